"""Step latency prediction from batch composition, fitted online.

The model predicts with one of the papers' forms (`costforms`: bros, hygen, echo), starting
from a profiled fit (`antiphon profile`, which `serve` loads) or else from the BROS form's
prior. It refits by least squares on a window of observed steps, starting from the current
coefficients and weighing each step towards the fit of least absolute error, and reports the
mean absolute percentage error of its recent predictions, so drift is visible.

To the form it adds the KV connector's page copies, which no paper's form has: a fixed cost
for a step that copies pages and a cost per page-layer copied, learned online from the
residuals of the form (a profiled fit holds the form's terms only). Served on a 2-core CPU,
decode steps with copies ran 13-14% slower than the form predicted and steps without 4-5%
faster (docs/benchmarks.md). The copies are known once vLLM has scheduled a step, after the policy
planned it, so planning adds the copy cost of an average recent step instead.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence

import numpy as np

from antiphon.engine_ext.costforms import CostForm, absolute_error_weights, cost_form, nnls
from antiphon.engine_ext.stepshape import StepShape
from antiphon.quantiles import percentile_of_sorted

__all__ = ["CostModel", "StepShape"]


class CostModel:
    # Planning margin: the `CALIBRATION_QUANTILE` of measured / predicted latency over the
    # last `CALIBRATION_WINDOW` steps (at least 1, at most `MAX_CALIBRATION`).
    CALIBRATION_QUANTILE = 0.8
    CALIBRATION_WINDOW = 64
    MAX_CALIBRATION = 2.0
    # Rounds of reweighted least squares per refit. One round a refit also approaches the
    # fit of least absolute error, but slowly: an L1 fit discounts the steps it predicts
    # worst, so when the host slowed down, the new steps were discounted and the model lagged
    # (replayed over a 2,100-step trace with a 30 s slowdown, MAPE 6.7% after one round
    # against 5.7% after three, 6.3% with squared error). A round takes about 2 ms a window.
    REFIT_ROUNDS = 3

    def __init__(self, form: CostForm | str = "bros",
                 coefficients: Sequence[float] | dict[str, float] | None = None,
                 window: int = 512, refit_every: int = 32) -> None:
        """`coefficients` in the form's `terms` order, or by term name; unset: its prior."""
        self.form = cost_form(form) if isinstance(form, str) else form
        self.coefficients = (self.form.prior if coefficients is None
                             else self.form.coefficients_of(coefficients))
        self._observations: collections.deque[tuple[StepShape, float]] = (
            collections.deque(maxlen=window))
        self._errors: collections.deque[float] = collections.deque(maxlen=window)
        self._error_sum = 0.0
        # measured / predicted of the last CALIBRATION_WINDOW steps, in arrival order and
        # sorted: the engine observes every step, and numpy's quantile over the window took
        # more of the engine process than the policy's whole plan (py-spy, 16 streams)
        self._ratios: collections.deque[float] = collections.deque()
        self._sorted_ratios: list[float] = []
        self.calibration = 1.0
        self._refit_every = refit_every
        self._since_refit = 0
        self.num_refits = 0
        # (per step that copies pages, per page-layer copied), seconds; see the module doc
        self.copy_coefficients: tuple[float, float] = (0.0, 0.0)
        self.mean_copy_s = 0.0  # the copy cost of the window's average step

    def use(self, form: CostForm | str, coefficients: Sequence[float]) -> None:
        """Predict with `form` and `coefficients` (a profiled fit) from now on; observed steps
        stay for later refits, the error history and the calibration start again (measured
        against the coefficients replaced, the calibration planned an exact fit with their
        margin, up to twice its steps)."""
        self.form = cost_form(form) if isinstance(form, str) else form
        self.coefficients = self.form.coefficients_of(coefficients)
        self._errors.clear()
        self._error_sum = 0.0
        self._since_refit = 0
        self._ratios.clear()
        self._sorted_ratios.clear()
        self.calibration = 1.0

    def predict_s(self, shape: StepShape) -> float:
        """Predicted step latency (seconds), its page copies included."""
        return self.form.predict_s(self.coefficients, shape) + self.copy_s(shape)

    def copy_s(self, shape: StepShape) -> float:
        """The part of the predicted latency that is the step's page copies (seconds)."""
        if not shape.page_copies:
            return 0.0
        per_step, per_page = self.copy_coefficients
        return per_step + per_page * shape.page_copies

    def planning_s(self, shape: StepShape) -> float:
        """The step latency a policy plans with (seconds): the prediction, with the copies
        of an average recent step when `shape` names none (a plan's never does), times the
        calibration, so that a step planned to fit a deadline fits it in most measured steps
        (4 in 5), not just on average. On a 2-core host the model underpredicted steps
        mixing many decodes with a prefill chunk by 20-30%, and steps planned to the limit
        ran past their TPOT."""
        return self._unscaled_planning_s(shape) * self.calibration

    def _unscaled_planning_s(self, shape: StepShape) -> float:
        copies = self.copy_s(shape) if shape.page_copies else self.mean_copy_s
        return self.form.predict_s(self.coefficients, shape) + copies

    def observe(self, shape: StepShape, latency_s: float) -> float | None:
        """Record a measured step (seconds); refits every `refit_every` observations.
        Returns the prediction's relative error on it (None for a step of no time)."""
        form_s = self.form.predict_s(self.coefficients, shape)
        predicted = form_s + self.copy_s(shape)
        error = None
        if latency_s > 0:
            if len(self._errors) == self._errors.maxlen:
                self._error_sum -= self._errors[0]
            error = abs(predicted - latency_s) / latency_s
            self._errors.append(error)
            self._error_sum += error
            # calibrated against what a policy planned with: copies unknown, their mean
            planned = form_s + self.mean_copy_s
            if planned > 0:
                self._add_ratio(latency_s / planned)
                self._calibrate()
        self._observations.append((shape, latency_s))
        self._since_refit += 1
        if self._since_refit >= self._refit_every:
            self.refit()
        return error

    def _add_ratio(self, ratio: float) -> None:
        if len(self._ratios) == self.CALIBRATION_WINDOW:
            oldest = self._ratios.popleft()
            del self._sorted_ratios[bisect.bisect_left(self._sorted_ratios, oldest)]
        self._ratios.append(ratio)
        bisect.insort(self._sorted_ratios, ratio)

    def _calibrate(self) -> None:
        ratios = self._sorted_ratios
        if len(ratios) < self.CALIBRATION_WINDOW // 4:
            return
        ratio = percentile_of_sorted(ratios, self.CALIBRATION_QUANTILE)  # numpy's default
        self.calibration = min(self.MAX_CALIBRATION, max(1.0, ratio))

    def refit(self) -> None:
        """Fit the form to the window less its copy costs, starting from the current
        coefficients (terms the window does not exercise keep theirs), then the copy terms
        to what the form leaves of the steps that copied pages: `REFIT_ROUNDS` rounds of
        alternating, reweighted least squares per refit."""
        self._since_refit = 0
        if len(self._observations) < 8:
            return
        shapes = [s for s, _ in self._observations]
        latencies = np.array([t for _, t in self._observations])
        copies = np.array([s.page_copies for s in shapes], dtype=np.float64)
        copy_x = np.column_stack([copies > 0, copies]).astype(np.float64)
        copied = copies > 0
        copy_part = copy_x @ np.asarray(self.copy_coefficients)
        form_part = self.form.predict_all(self.coefficients, shapes)
        for _ in range(self.REFIT_ROUNDS):
            # Both fits weigh a step by its measured latency (relative error), not by the
            # part left to fit: a copy part as long as the step left a target near zero,
            # whose weight drowned every other step; served, the form fell to zero
            # (docs/benchmarks.md). And by its error under the current coefficients, towards
            # the fit of least MAPE, the error the model reports.
            w = absolute_error_weights(latencies, form_part + copy_part)
            self.coefficients = self.form.fit(shapes, latencies - copy_part,
                                              start=self.coefficients, weights=w)
            form_part = self.form.predict_all(self.coefficients, shapes)
            if copied.any():
                residual = latencies[copied] - form_part[copied]
                per_step, per_page = nnls(copy_x[copied] * w[copied, None],
                                          residual * w[copied])
                self.copy_coefficients = (float(per_step), float(per_page))
                copy_part = copy_x @ np.asarray(self.copy_coefficients)
        self.mean_copy_s = float(copy_part.mean())
        self.num_refits += 1

    @property
    def mape(self) -> float | None:
        """Mean absolute percentage error of recent predictions (0.05 = 5%)."""
        return self._error_sum / len(self._errors) if self._errors else None
