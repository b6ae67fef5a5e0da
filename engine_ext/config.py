"""Configuration of the engine: which model, how much KV memory, how vLLM is started."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from antiphon.configfields import MAX_INT_OPTION, check_int_fields, doc

GiB = 1 << 30

COST_MODEL_MODES = ("auto", "stored", "online")
DEFAULT_CPU_RESERVED_CORES = 0
# libgomp's spin before an idle OpenMP thread sleeps (GOMP_SPINCOUNT); see EngineConfig.
DEFAULT_CPU_OMP_SPIN_COUNT = 10_000

SCHEDULER_CLS = "antiphon.engine_ext.scheduler.AntiphonScheduler"
ASYNC_SCHEDULER_CLS = "antiphon.engine_ext.scheduler.AntiphonAsyncScheduler"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = doc(
        "Hugging Face model folder to serve; unset serves the default model "
        "(prepared by `antiphon model prepare`)", default=None)
    served_model_name: str | None = doc(
        "Model id reported by /v1/models and accepted in requests; unset uses the folder name",
        default=None)
    max_model_len: int = doc("Longest prompt plus output, in tokens", default=8192)
    kv_cache_gib: float = doc("Memory for vLLM's KV cache pool, in GiB", default=2.0)
    num_kv_pages: int | None = doc(
        "Number of KV pages (vLLM's num_gpu_blocks_override), instead of as many as "
        "--kv-cache-gib holds: the pool takes this many whatever memory they need; unset: "
        "from --kv-cache-gib", default=None)
    max_num_seqs: int = doc("Most sequences in one engine step", default=64)
    max_num_batched_tokens: int = doc(
        "Token budget of one engine step; raised to --max-model-len where it is lower (a "
        "step can hold a whole prompt; the co-scheduling policies size steps within it)",
        default=2048)
    dtype: str = doc(
        "Model weight, activation and KV dtype: bfloat16, float16, float32, or auto (bfloat16 "
        "on GPUs and on CPUs with bfloat16 instructions, float32 on other CPUs)",
        default="auto")
    enforce_eager: bool = doc(
        "Skip graph compilation (start-up about 30 s instead of 70 s on 2 cores; slower steps)",
        default=False)
    enable_prefix_caching: bool = doc("vLLM prefix caching of KV pages", default=True)
    seed: int = doc("Random seed of the engine, within [0, 2**32)", default=0)
    scheduler_cls: str | None = doc(
        "Scheduler class (qualified name) vLLM runs; unset: AntiphonScheduler where vLLM "
        "schedules synchronously (CPU), AntiphonAsyncScheduler where it overlaps (GPU)",
        default=None)
    policy: str = doc(
        "Scheduling policy: bros, hygen, echo or larry; fcfs or priority (vLLM's own "
        "policies); or bros_no_block_preemption (BROS's baseline in bench blocks)",
        default="bros")
    rt_ttft_slo_s: float = doc("Default TTFT target of RT requests, in seconds", default=1.0)
    rt_tpot_slo_s: float = doc("Default TPOT target of RT requests, in seconds", default=0.1)
    slo_headroom: float = doc(
        "Share of each RT target the scheduler keeps in reserve for mispredicted steps: it "
        "plans to meet TTFT and TPOT times (1 - this)", default=0.1)
    be_step_limit_s: float = doc(
        "Arrival guard: longest engine step BE work may make, in seconds (predicted by the "
        "cost model); a turn arriving during a step waits about this long at most before it "
        "is scheduled; BE prefills are chunked to fit. 'inf' (the default) turns it off: on a "
        "2-core CPU, 0.25 s cost 5x the BE throughput and lowered RT TTFT attainment (each "
        "step has a fixed cost, so small chunks waste it; docs/benchmarks.md)",
        default=math.inf)
    biblocks: bool = doc(
        "Bidirectional shared KV blocks: RT pages from the low end of each shared block, BE "
        "pages from the high end, and a preempted request's KV checkpointed to the host tier "
        "instead of recomputed (needs KV tiering for the checkpoints)", default=True)
    shared_block_pages: int = doc(
        "KV pages in one bidirectional shared block", default=4)
    step_trace: str | None = doc(
        "Diagnostics: append one JSON line per engine step (its requests by class and phase, "
        "queues, free pages, preemptions, predicted and measured latency) to this file",
        default=None)
    cpu_reserved_cores: int = doc(
        "CPU only: cores kept free of the model's threads for vLLM's engine process "
        "(VLLM_CPU_NUM_OF_RESERVED_CPU). 0: the model's threads use every core. vLLM's own "
        "default keeps one core per worker, and one more with a KV connector; with fewer "
        "cores than that it uses them all, so on a 2-core host the model got one core "
        "without KV tiering and two with it, and every benchmark that compared the two "
        "compared different hardware (docs/benchmarks.md)", default=DEFAULT_CPU_RESERVED_CORES)
    cpu_omp_spin_count: int = doc(
        "CPU only: how long the model's idle OpenMP threads spin before they sleep "
        "(libgomp's GOMP_SPINCOUNT, in iterations); -1 keeps libgomp's default (300,000). "
        "With the default, the threads spin on every core after each step while vLLM's "
        "engine process and the API server wait for the 4 ms scheduler tick: on 2 cores, "
        "decode steps of one shape took 15, 19.7 or 23.5 ms. At 10,000 they took the "
        "fastest of these, within 3% of each other (docs/benchmarks.md)",
        default=DEFAULT_CPU_OMP_SPIN_COUNT)
    cost_model: str = doc(
        "Where the step cost model starts: 'stored' (the fit `antiphon profile` stored for "
        "this model and machine, else a prior), 'auto' (as stored, but profile the engine at "
        "start, under 2 minutes on 2 cores, once, when no fit is stored), 'online' (the "
        "prior); it refits online in every mode", default="stored")

    def __post_init__(self) -> None:
        check_int_fields(self)
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be at least 16, got {self.max_model_len}")
        # (NaN fails too; a size that rounds to 0 bytes meant "unset" to vLLM on a GPU)
        # (1e300 passed as finite, and its bytes overflowed int() at start)
        if not 0 < self.kv_cache_gib * GiB <= MAX_INT_OPTION or self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_gib must be positive, at most 2**62 bytes, got "
                             f"{self.kv_cache_gib}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be at least 1, got {self.num_kv_pages}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.dtype not in ("bfloat16", "float16", "float32", "auto"):
            raise ValueError(f"dtype must be bfloat16, float16, float32 or auto, got {self.dtype}")

        if not (0 < self.rt_ttft_slo_s < math.inf and 0 < self.rt_tpot_slo_s < math.inf):
            raise ValueError("rt_ttft_slo_s and rt_tpot_slo_s must be positive and finite")
        if not 0 <= self.slo_headroom < 1:
            raise ValueError(f"slo_headroom must be within [0, 1), got {self.slo_headroom}")
        if self.step_trace is not None and not os.path.isdir(
                os.path.dirname(os.path.abspath(self.step_trace))):
            raise ValueError(f"step_trace: no folder for {self.step_trace!r}")
        if self.step_trace is not None and os.path.isdir(self.step_trace):
            raise ValueError(f"step_trace: {self.step_trace!r} is a folder; name a file in it")
        if not 0 <= self.seed < 2**32:  # numpy's range: vLLM's workers seed it
            raise ValueError(f"seed must be within [0, 2**32), got {self.seed}")
        if not self.be_step_limit_s > 0:  # also refuses NaN
            raise ValueError(f"be_step_limit_s must be positive, got {self.be_step_limit_s}")
        if self.shared_block_pages < 1:
            raise ValueError(f"shared_block_pages must be at least 1, got "
                             f"{self.shared_block_pages}")
        if self.cpu_reserved_cores < 0:
            raise ValueError(f"cpu_reserved_cores must be >= 0, got {self.cpu_reserved_cores}")
        if self.cpu_omp_spin_count < -1:
            raise ValueError(f"cpu_omp_spin_count must be >= 0, or -1 for libgomp's default, "
                             f"got {self.cpu_omp_spin_count}")
        if self.cost_model not in COST_MODEL_MODES:
            raise ValueError(f"cost_model must be one of {', '.join(COST_MODEL_MODES)}, "
                             f"got {self.cost_model!r}")
        from antiphon.engine_ext.policies import policy_class

        policy_class(self.policy)  # fails with the list of valid names

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * GiB)

    @property
    def scheduler_settings(self) -> SchedulerSettings:
        return SchedulerSettings(self.policy, self.rt_ttft_slo_s, self.rt_tpot_slo_s,
                                 self.biblocks, self.shared_block_pages, self.be_step_limit_s,
                                 self.step_trace, self.slo_headroom)


# vLLM's `worker_extension_cls` for Antiphon's engines; the stock vLLM baselines of the
# benchmarks get it too, for the reuse of the compiled model it brings on CPU (compile_cache.py:
# a model compiled in the process decodes 3-10% slower than a loaded one, docs/benchmarks.md)
WORKER_EXTENSION_CLS = "antiphon.engine_ext.worker_ext.AntiphonWorkerExtension"

CPU_RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
OMP_SPIN_COUNT_ENV = "GOMP_SPINCOUNT"


def cpu_threading_env(reserved_cores: int = DEFAULT_CPU_RESERVED_CORES,
                      omp_spin_count: int = DEFAULT_CPU_OMP_SPIN_COUNT) -> dict[str, str]:
    """The environment that gives engines (ours and stock vLLM alike) `reserved_cores` CPU
    cores free of the model's threads and OpenMP threads that spin `omp_spin_count`
    iterations before they sleep (-1: libgomp's default, the variable unset)."""
    env = {CPU_RESERVED_CORES_ENV: str(reserved_cores)}
    if omp_spin_count >= 0:
        env[OMP_SPIN_COUNT_ENV] = str(omp_spin_count)
    return env


def set_cpu_threading(reserved_cores: int = DEFAULT_CPU_RESERVED_CORES,
                      omp_spin_count: int = DEFAULT_CPU_OMP_SPIN_COUNT) -> None:
    """`cpu_threading_env` for engines started from now on in this process and its children
    (vLLM reads the variables when it starts its worker; libgomp when the worker loads it)."""
    if omp_spin_count < 0:
        os.environ.pop(OMP_SPIN_COUNT_ENV, None)
    os.environ.update(cpu_threading_env(reserved_cores, omp_spin_count))


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """What the scheduler needs in the EngineCore process, carried in vLLM's
    `additional_config` under the key `antiphon_scheduler`."""

    policy: str = "fcfs"
    rt_ttft_slo_s: float = 1.0
    rt_tpot_slo_s: float = 0.1
    biblocks: bool = False
    shared_block_pages: int = 4
    be_step_limit_s: float = math.inf
    step_trace: str | None = None  # file the scheduler appends a JSON line to per step
    slo_headroom: float = 0.0  # share of each RT target kept in reserve

    KEY = "antiphon_scheduler"

    def to_additional_config(self) -> dict[str, Any]:
        return {self.KEY: dataclasses.asdict(self)}

    @classmethod
    def from_additional_config(cls, additional: Any) -> SchedulerSettings:
        values = additional.get(cls.KEY, {}) if isinstance(additional, dict) else {}
        return cls(**values)
