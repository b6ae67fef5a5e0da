"""The papers' step-latency forms, each a map from a step's composition to seconds with its own
least-squares fit. Pure numpy: no torch.

    bros   BROS section 4: one linear model per phase, summed over the phases present
               t = a0p*Sp + a1p*Ap + bp*[Np > 0]  +  a0d*Sn + a1d*Ad + bd*[Nd > 0]
    bros_max  bros plus the longest decode context (Echo's max(L)) and one step intercept
               t = bros + g*max(L) + b
    bros_after  bros_max plus a decode step's cost right after a step with prefill tokens
               t = bros_max + a*[Nd > 0 and the previous step had prefill tokens]
    hygen  HyGen section 4.2: linear regression on (Sp, Sd, Sp^2, Sd^2, Np, Nd), with intercept
    echo   Echo section 5.2: prefill Tp = max(alpha*Ap + beta*Sp, c), decode
           Td = gamma*max(L) + delta*mean(L); a step with both: max(Tp, Td) + (1-lambda)*min(..)

Sp, Ap: the step's prefill tokens and their attention area (new times context tokens summed
over prefill requests; l^2 for a whole prompt of l tokens). Sn, Ad: the same for decode
requests. Sd, L: decode requests' context tokens, summed and per request. Np, Nd: prefill and
decode requests. Where a paper leaves a choice open:
- BROS writes the attention term as Ln*La, "the shape of the attention score matrix"; summed
  per request it is Ap and Ad (no score links requests of one batch).
- HyGen's "decode tokens" Sd are the decode requests' context tokens: their new tokens would
  be Nd again.
- Echo's eq. (8), lambda*max + (1-lambda)*min, lies between min and max, yet its text puts a
  mixed batch between the max and the sum; the form here is the mix the text describes.

Every fit minimises the squared relative error (weights 1/t), with non-negative coefficients,
so no term makes a step cheaper. MAPE measures the absolute relative error, whose best fit
follows the median step rather than the mean; `absolute_error_weights` turns a fit into one
round of iteratively reweighted least squares towards it (see the function). Given `start`
coefficients, terms the data never exercises keep their start value instead of falling to
zero (an online window of decode steps says nothing about prefill), as do terms too few steps
exercise (`refit_nnls`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from antiphon.engine_ext.stepshape import StepShape


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| subject to x >= 0 (Lawson and Hanson's active-set method), on
    columns scaled to unit norm for conditioning."""
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    a = a / scale
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.abs(b).max(initial=0.0)))
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        for _ in range(3 * n):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            blocking = passive & (z <= 0)
            step = x[blocking] / np.maximum(x[blocking] - z[blocking], 1e-300)
            x = x + float(step.min()) * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
    return np.maximum(x, 0.0) / scale


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error (0.05 = 5%) over steps with a positive latency."""
    keep = measured > 0
    if not keep.any():
        return float("nan")
    return float(np.mean(np.abs(predicted[keep] - measured[keep]) / measured[keep]))


def relative_weights(latencies: np.ndarray) -> np.ndarray:
    """Least-squares weights that fit relative, not absolute, error: 1 / measured latency."""
    return 1.0 / np.maximum(latencies, 1e-4)


# Relative errors below this count as this in `absolute_error_weights`: without a floor, a step
# the fit happens to predict exactly would take all the weight of the next round.
ABSOLUTE_ERROR_FLOOR = 0.01


def absolute_error_weights(latencies: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """Least-squares weights under which a fit, started from `predicted`, minimises the mean
    absolute relative error (MAPE) instead of the squared one: `relative_weights` over the
    square root of each step's relative error under `predicted` (floored at
    `ABSOLUTE_ERROR_FLOOR`). Repeated, this is iteratively reweighted least squares for the L1
    fit. Served steps on a 2-core CPU scatter with a right tail (p10-p90 of measured over
    predicted 0.92-1.13, median below mean), so a squared-error fit sits above most steps;
    replayed over traces of 2,100-2,200 steps the L1 fit's MAPE was 0.3-0.7 points lower."""
    latencies = np.asarray(latencies, dtype=np.float64)
    relative = np.abs(np.asarray(predicted, dtype=np.float64) - latencies) \
        / np.maximum(latencies, 1e-4)
    return relative_weights(latencies) / np.sqrt(np.maximum(relative, ABSOLUTE_ERROR_FLOOR))


# Steps of a refit's window that must exercise a term before the refit moves it (not in the
# papers): refitted on the couple of steps that exercised it (one short prefill among hundreds
# of decodes), a term fitted them alone, and the sparsest such fit put a 2,048-token prompt at
# 1.5 to 2.7 times its time, or 30% under it. (Pulling each term towards its start instead
# wore off over the window's repeated refits, and made HyGen's squared term worse.) Replayed
# over eleven served step traces from a stale stored fit, 4 left the error as it was; 8 and 16
# held back the first minute's refits (0.5-3 points more over a run).
MIN_STEPS_TO_REFIT = 4


# A term whose column (weighted, scaled to unit norm) the columns of the terms refitted before
# it explain to within this residual norm keeps its start value in a refit (not in the papers).
# Where every step of the window prefilled (a document job's), the fixed costs of a step, of
# its prefill and of its decode were one column: the fit put all three on the first and zeroed
# the others, and a decode-only step was then planned at 2-40% of its time.
MIN_SEPARABLE_RESIDUAL = 1e-3


def refit_nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray,
               start: Sequence[float] | None) -> np.ndarray:
    """Non-negative coefficients for `x @ c ~ y`, each row weighted by `w`. With `start`,
    terms fewer than `MIN_STEPS_TO_REFIT` rows exercise keep their start value (an online
    window of decode steps says nothing about prefill, a couple of short prefills little),
    and so do terms the window cannot tell from those before them (`MIN_SEPARABLE_RESIDUAL`)."""
    if start is None:
        return nnls(x * w[:, None], y * w)
    coef = np.array(start, dtype=np.float64)
    used = _separable(x * w[:, None], np.count_nonzero(x, axis=0) >= MIN_STEPS_TO_REFIT)
    if used.any():
        b = (y - x[:, ~used] @ coef[~used]) * w
        coef[used] = nnls(x[:, used] * w[:, None], b)
    return coef


def _separable(a: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """The `candidates` columns of `a` that the candidates before them, so kept, do not
    explain to within `MIN_SEPARABLE_RESIDUAL` (each column scaled to unit norm)."""
    kept = np.zeros_like(candidates)
    norms = np.linalg.norm(a, axis=0)
    for j in np.flatnonzero(candidates):
        column = a[:, j] / norms[j]
        if kept.any():
            basis = a[:, kept] / norms[kept]
            column = column - basis @ np.linalg.lstsq(basis, column, rcond=None)[0]
        kept[j] = np.linalg.norm(column) >= MIN_SEPARABLE_RESIDUAL
    return kept


def _fit_weights(latencies: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """A fit's weights: those given, else `relative_weights` of the latencies it fits."""
    if weights is None:
        return relative_weights(np.asarray(latencies, dtype=np.float64))
    return np.asarray(weights, dtype=np.float64)


class CostForm(abc.ABC):
    name: str
    # The form this one adds terms to, if any: it must predict clearly better to be chosen.
    extends: str | None = None
    terms: tuple[str, ...]  # coefficient names, in order
    prior: tuple[float, ...]  # a conservative start (seconds) for a small model on a CPU
    # terms bounded above, besides all being >= 0
    upper_bounds: ClassVar[Mapping[str, float]] = MappingProxyType({})

    @abc.abstractmethod
    def predict_s(self, coefficients: Sequence[float], shape: StepShape) -> float:
        """Predicted latency of a step of `shape` (seconds)."""

    @abc.abstractmethod
    def fit(self, shapes: Sequence[StepShape], latencies: np.ndarray,
            start: Sequence[float] | None = None,
            weights: np.ndarray | None = None) -> tuple[float, ...]:
        """Coefficients fitted to step `latencies` (seconds); pure. `weights` per step
        (default: `relative_weights` of `latencies`) must come from the measured latencies
        when `latencies` is a part of them: a target near or below zero would otherwise
        weigh thousands of times more than the other steps."""

    def predict_all(self, coefficients: Sequence[float],
                    shapes: Sequence[StepShape]) -> np.ndarray:
        return np.array([self.predict_s(coefficients, s) for s in shapes])

    def coefficients_of(self, values: Sequence[float] | dict[str, float]) -> tuple[float, ...]:
        """Coefficients from a sequence in `terms` order or a {term: value} mapping (terms left
        out are 0); raises ValueError naming the terms when they do not match, or a value that
        is not a finite number >= 0 (a NaN predicted every step to take 0 s, for good: no refit
        recovers a term the steps do not exercise)."""
        if isinstance(values, dict):
            unknown = set(values) - set(self.terms)
            if unknown:
                raise ValueError(f"{self.name} has no terms {sorted(unknown)}; its terms: "
                                 f"{', '.join(self.terms)}")
            coefficients = tuple(float(values.get(t, 0.0)) for t in self.terms)
        elif len(values) != len(self.terms):
            raise ValueError(f"{self.name} takes {len(self.terms)} coefficients "
                             f"({', '.join(self.terms)}), got {len(values)}")
        else:
            coefficients = tuple(float(v) for v in values)
        bad = [t for t, c in zip(self.terms, coefficients, strict=True)
               if not 0.0 <= c < math.inf]
        if bad:
            raise ValueError(f"{self.name}: coefficients of {', '.join(bad)} are not finite "
                             "numbers >= 0")
        over = [f"{t} ({c} > {self.upper_bounds[t]})"
                for t, c in zip(self.terms, coefficients, strict=True)
                if c > self.upper_bounds.get(t, math.inf)]
        if over:
            raise ValueError(f"{self.name}: coefficients out of range: {', '.join(over)}")
        return coefficients


class LinearForm(CostForm):
    """t = coefficients . features(shape)"""

    @abc.abstractmethod
    def features(self, shape: StepShape) -> tuple[float, ...]: ...

    def predict_s(self, coefficients: Sequence[float], shape: StepShape) -> float:
        # Plain Python: policies call this many times a step, on a handful of terms.
        return max(0.0, sum(c * f for c, f in zip(coefficients, self.features(shape),
                                                   strict=True)))

    def fit(self, shapes: Sequence[StepShape], latencies: np.ndarray,
            start: Sequence[float] | None = None,
            weights: np.ndarray | None = None) -> tuple[float, ...]:
        x = np.array([self.features(s) for s in shapes], dtype=np.float64)
        y = np.asarray(latencies, dtype=np.float64)
        coef = refit_nnls(x, y, _fit_weights(latencies, weights), start)
        return tuple(float(c) for c in coef)


class BrosForm(LinearForm):
    name = "bros"
    terms: tuple[str, ...] = ("prefill_token_s", "prefill_attention_s", "prefill_step_s",
                              "decode_token_s", "decode_attention_s", "decode_step_s")
    prior: tuple[float, ...] = (2e-4, 1e-8, 0.02, 3e-4, 1e-8, 0.02)

    def features(self, shape: StepShape) -> tuple[float, ...]:
        has_prefill = 1.0 if shape.num_prefill_requests else 0.0
        has_decode = 1.0 if shape.num_decode_requests else 0.0
        return (shape.num_prefill_tokens, shape.prefill_attention_area, has_prefill,
                shape.num_decode_tokens, shape.decode_attention_area, has_decode)


class BrosMaxForm(BrosForm):
    """BROS's form with two terms measured on a 2-core CPU (not in the paper). A decode
    step's attention time follows its longest context more than the sum: one request at 1,025
    tokens took 19-21 ms against 13 ms at 65, 32 requests at 1,025 took 47 ms against 33 ms, so
    the cost per context token fell 15-fold with the batch (decode attention runs in parallel
    over requests). And a step mixing prefill and decode costs less than the two phases' fixed
    costs summed. Mean held-out error over ten splits of two profiles: 10.0% and 8.6%, against
    bros's 14.0% and 11.7%."""

    name = "bros_max"
    extends = "bros"
    terms = (*BrosForm.terms, "decode_max_context_s", "step_s")
    prior = (*BrosForm.prior, 0.0, 0.0)

    def features(self, shape: StepShape) -> tuple[float, ...]:
        return (*super().features(shape), float(shape.max_decode_context), 1.0)


class BrosAfterForm(BrosMaxForm):
    """bros_max plus a fixed cost on a decode step that follows a step with prefill tokens (not
    in the paper). Measured on a 2-core CPU: over the 686 steps of a full profile, bros_max's
    errors on the first decode step after a prefill averaged +15% (the steps ran slower than
    predicted) and on the decode steps after those -7 to -9%. The term was worth 3 to 5 ms;
    held-out error over ten splits fell from 9.6% to 7.5% (full profile) and from 9.0% to
    6.5% (quick)."""

    name = "bros_after"
    extends = "bros_max"
    terms = (*BrosMaxForm.terms, "decode_after_prefill_s")
    prior = (*BrosMaxForm.prior, 0.0)

    def features(self, shape: StepShape) -> tuple[float, ...]:
        after = 1.0 if shape.after_prefill and shape.num_decode_requests else 0.0
        return (*super().features(shape), after)


class HygenForm(LinearForm):
    name = "hygen"
    terms = ("prefill_token_s", "decode_context_s", "prefill_token_sq_s",
             "decode_context_sq_s", "prefill_request_s", "decode_request_s", "intercept_s")
    prior = (2e-4, 1e-8, 1e-9, 0.0, 1e-4, 3e-4, 0.02)

    def features(self, shape: StepShape) -> tuple[float, ...]:
        sp, sd = float(shape.num_prefill_tokens), float(shape.decode_context_tokens)
        return (sp, sd, sp * sp, sd * sd, shape.num_prefill_requests,
                shape.num_decode_requests, 1.0)


class EchoForm(CostForm):
    name = "echo"
    terms = ("alpha", "beta", "c", "gamma", "delta", "lambda")
    prior = (1e-8, 2e-4, 0.02, 1e-5, 1e-5, 0.0)
    # Above 1 a mixed step would take less than its longer phase, down to below zero.
    upper_bounds = MappingProxyType({"lambda": 1.0})
    _KAPPAS = np.linspace(0.0, 1.0, 11)  # 1 - lambda, searched on a grid

    @staticmethod
    def _phases(coefficients: Sequence[float], shape: StepShape) -> tuple[float, float]:
        alpha, beta, c, gamma, delta, _ = coefficients
        tp = td = 0.0
        if shape.num_prefill_requests:
            tp = max(alpha * shape.prefill_attention_area + beta * shape.num_prefill_tokens, c)
        if shape.num_decode_requests:
            mean = shape.decode_context_tokens / shape.num_decode_requests
            td = gamma * shape.max_decode_context + delta * mean
        return tp, td

    def predict_s(self, coefficients: Sequence[float], shape: StepShape) -> float:
        tp, td = self._phases(coefficients, shape)
        if tp and td:
            return max(tp, td) + (1.0 - coefficients[5]) * min(tp, td)
        return tp + td

    def fit(self, shapes: Sequence[StepShape], latencies: np.ndarray,
            start: Sequence[float] | None = None,
            weights: np.ndarray | None = None) -> tuple[float, ...]:
        """Alternates between the piecewise choices (which steps' prefill sits at the floor c,
        which phase is the longer) and a linear fit under them, for each lambda on a grid
        (near the start's lambda when given); keeps the iterate of lowest relative error."""
        y = np.asarray(latencies, dtype=np.float64)
        w = _fit_weights(y, weights)
        if start is None:
            kappas = self._KAPPAS
            prefill_only = [t for s, t in zip(shapes, y, strict=True)
                            if s.num_prefill_requests and not s.num_decode_requests]
            # First without a floor (nothing sits at c = 0), then with the floor at the
            # fastest prefills' latency, so the c term gets steps to fit.
            floor = float(np.percentile(prefill_only, 10)) if prefill_only else 0.0
            initial: tuple[float, ...] = (0.0,) * 6
        else:
            kappa = 1.0 - start[5]
            kappas = np.clip(np.array([kappa - 0.1, kappa, kappa + 0.1]), 0.0, 1.0)
            if sum(1 for s in shapes if s.num_prefill_requests and s.num_decode_requests) \
                    < MIN_STEPS_TO_REFIT:  # lambda mixes the phases: too few mixed steps
                kappas = np.array([kappa])  # say nothing of it (it drifted to 1 on ties)
            floor, initial = 0.0, tuple(start)
        best: tuple[float, tuple[float, ...]] = (np.inf, initial)
        for kappa in np.unique(kappas):
            coef = (*initial[:5], 1.0 - float(kappa))
            for i in range(8):
                x = np.array([self._row(coef, s) for s in shapes])
                kept = None if start is None else initial[:5]
                refitted = (*(float(v) for v in refit_nnls(x, y, w, kept)), coef[5])
                error = float(np.sum(((self.predict_all(refitted, shapes) - y) * w) ** 2))
                if error < best[0]:
                    best = (error, refitted)
                if i == 0 and floor > 0:
                    refitted = (*refitted[:2], floor, *refitted[3:])
                elif np.allclose(refitted, coef, rtol=1e-6, atol=0.0):
                    break
                coef = refitted
        return best[1]

    def _row(self, coefficients: Sequence[float], shape: StepShape) -> list[float]:
        """The step's time as a linear row over (alpha, beta, c, gamma, delta), under the
        piecewise choices `coefficients` make."""
        tp, td = self._phases(coefficients, shape)
        prefill = [0.0] * 5
        if shape.num_prefill_requests:
            if tp <= coefficients[2] and coefficients[2] > 0:  # at the floor c
                prefill[2] = 1.0
            else:
                prefill[0] = float(shape.prefill_attention_area)
                prefill[1] = float(shape.num_prefill_tokens)
        decode = [0.0] * 5
        if shape.num_decode_requests:
            decode[3] = float(shape.max_decode_context)
            decode[4] = shape.decode_context_tokens / shape.num_decode_requests
        kappa = 1.0 - coefficients[5]
        if shape.num_prefill_requests and shape.num_decode_requests:
            longer, shorter = (prefill, decode) if tp >= td else (decode, prefill)
            return [a + kappa * b for a, b in zip(longer, shorter, strict=True)]
        return [a + b for a, b in zip(prefill, decode, strict=True)]


FORMS: dict[str, CostForm] = {f.name: f for f in (BrosForm(), BrosMaxForm(), BrosAfterForm(),
                                                  HygenForm(), EchoForm())}


def extended_forms(form: CostForm) -> list[str]:
    """The registered forms `form` adds terms to, nearest first (bros_after: bros_max, bros);
    the chain stops at a name that is not registered."""
    chain: list[str] = []
    parent = form.extends
    while parent in FORMS and parent not in chain:
        chain.append(parent)
        parent = FORMS[parent].extends
    return chain


def cost_form(name: str) -> CostForm:
    """The form called `name`; raises ValueError listing the valid names."""
    try:
        return FORMS[name]
    except KeyError:
        raise ValueError(f"unknown cost-model form {name!r}; valid forms: "
                         f"{', '.join(sorted(FORMS))}") from None
