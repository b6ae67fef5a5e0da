"""What vLLM runs a model with where the deployment does not say: its dtype on this machine,
and the sampling parameters the model's folder sets."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                    "repetition_penalty": float}


def resolve_dtype(dtype: str) -> str:
    """The dtype vLLM runs: `dtype`, with 'auto' resolved to bfloat16 on accelerators and on
    CPUs that compute it natively (`cpu_computes_bf16`), float32 on other CPUs, where vLLM's
    bfloat16 matmuls are emulated (prefill about 5 times slower than float32 on an AVX2-only
    CPU: docs/benchmarks.md)."""
    if dtype != "auto":
        return dtype
    from vllm.platforms import current_platform

    resolved = "bfloat16" if not current_platform.is_cpu() or cpu_computes_bf16() else "float32"
    logger.info("dtype auto: %s", resolved)
    return resolved


def cpu_computes_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True if the CPU has bfloat16 matrix instructions (x86 AVX-512 BF16 or AMX, Arm BF16)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def model_sampling_defaults(model_dir: Path) -> Mapping[str, float]:
    """The sampling parameters `model_dir`'s generation_config.json sets (those vLLM takes from
    it), as `GenerationParams` fields; none when it has no such file."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text())
    except FileNotFoundError:
        return MappingProxyType({})
    return MappingProxyType({name: kind(config[name]) for name, kind in _SAMPLING_FIELDS.items()
                             if isinstance(config.get(name), (int, float))})
