"""Reuse of the model vLLM compiled on an earlier start, on CPU.

vLLM 0.32 compiles the model once per configuration and saves the result
(`VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`) so that later starts load it
instead of compiling again. On CPU it compiles with torch's own inductor backend rather than
its `VllmBackend`, and the saved function loads back as torch's
`BundledAOTAutogradSerializableCallable`, which lacks the `finalize_loading` that vLLM calls on
every loaded function: each load failed ("'function' object has no attribute
'finalize_loading'"), and every start compiled the model again (30-45 s on 2 cores, 2-3 minutes
on a cold cache).

`reuse_cpu_compiled_model` wraps `torch.compiler.load_compiled_function` so that such a
function gets the two things the freshly compiled one has: a `finalize_loading` with nothing
to do (its compiled code is loaded with it), and the call under `torch._dynamo.disable`. The
freshly compiled function runs under it (AOT autograd's runtime wrapper); without it, the
Python parts of vLLM's custom operators (its attention and KV-cache operators, the KV
connector's layer hooks) ran through Dynamo's frame hook, and each decode step was 10-20% slower
than with the model compiled in the process (docs/benchmarks.md, fortieth session).

Functions that already have a `finalize_loading` (vLLM's own backend, as on GPUs) are left as
they load.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_antiphon_reuses_cpu_compiled_model"


def reuse_cpu_compiled_model() -> None:
    """Install the wrapper (once per process; the worker calls it before the model compiles)."""
    import torch.compiler

    load = torch.compiler.load_compiled_function
    if getattr(load, _PATCHED, False):
        return

    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        adapt_loaded_function(loaded)
        return loaded

    setattr(load_compiled_function, _PATCHED, True)
    torch.compiler.load_compiled_function = load_compiled_function


def adapt_loaded_function(loaded: Any) -> bool:
    """Give a loaded function whose compiled part lacks `finalize_loading` a no-op one and a
    call under `torch._dynamo.disable`; True where it did."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    artifacts = getattr(loaded, "_artifacts", None)
    compiled = getattr(artifacts, "compiled_fn", None)
    if not isinstance(compiled, BundledAOTAutogradSerializableCallable) \
            or hasattr(compiled, "finalize_loading"):
        return False
    import torch._dynamo

    compiled.compiled_fn = torch._dynamo.disable(compiled.compiled_fn)
    compiled.finalize_loading = _nothing_to_finalize  # type: ignore[attr-defined]
    return True


def _nothing_to_finalize(vllm_config: Any) -> None:
    """The inductor function loads its compiled code with it."""
