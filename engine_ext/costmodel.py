"""Step latency prediction from batch composition (BROS form), fitted online.

    t(step) = a0 * Ln + a1 * sum_i(n_i * c_i) + a2 * N + b

Ln: new tokens in the step; n_i, c_i: new and context tokens of request i (the attention
score matrix area BROS calls Ln*La); N: requests in the step. The model starts from a prior
and refits by least squares on a window of observed steps, and reports its mean absolute
percentage error over recent predictions, so drift is visible.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Batch composition of one step."""

    num_new_tokens: int  # Ln
    attention_area: int  # sum over requests of new tokens times context tokens
    num_requests: int  # N

    @classmethod
    def of(cls, requests: Iterable[tuple[int, int]]) -> StepShape:
        """From (new tokens, context tokens) per request."""
        ln = area = n = 0
        for new, ctx in requests:
            ln += new
            area += new * ctx
            n += 1
        return cls(ln, area, n)

    def features(self) -> tuple[float, float, float, float]:
        return (float(self.num_new_tokens), float(self.attention_area),
                float(self.num_requests), 1.0)


# A conservative prior (seconds) for a small model on a CPU, replaced after the first refit.
_PRIOR = (2e-4, 1e-8, 1e-4, 0.02)


class CostModel:
    def __init__(self, window: int = 512, refit_every: int = 32,
                 coefficients: Sequence[float] = _PRIOR) -> None:
        self.coefficients = np.asarray(coefficients, dtype=np.float64)
        self._observations: collections.deque[tuple[tuple[float, ...], float]] = (
            collections.deque(maxlen=window))
        self._errors: collections.deque[float] = collections.deque(maxlen=window)
        self._refit_every = refit_every
        self._since_refit = 0
        self.num_refits = 0

    def predict_s(self, shape: StepShape) -> float:
        """Predicted step latency (seconds)."""
        return max(0.0, float(np.dot(self.coefficients, shape.features())))

    def observe(self, shape: StepShape, latency_s: float) -> None:
        """Record a measured step; refits every `refit_every` observations."""
        predicted = self.predict_s(shape)
        if latency_s > 0:
            self._errors.append(abs(predicted - latency_s) / latency_s)
        self._observations.append((shape.features(), latency_s))
        self._since_refit += 1
        if self._since_refit >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        """Least-squares fit on the window (relative error weighting, non-negative terms)."""
        self._since_refit = 0
        if len(self._observations) < 8:
            return
        x = np.array([f for f, _ in self._observations])
        y = np.array([t for _, t in self._observations])
        w = 1.0 / np.maximum(y, 1e-4)  # minimise relative, not absolute, error
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        self.coefficients = np.maximum(coef, 0.0)
        self.num_refits += 1

    @property
    def mape(self) -> float | None:
        """Mean absolute percentage error of recent predictions (0.05 = 5%)."""
        return float(np.mean(self._errors)) if self._errors else None
