"""What `reuse_cpu_compiled_model` changes in a loaded compiled function, and what it leaves.
The real load, in an engine's second start: tests/engine/test_compile_cache.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch.compiler
from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

from antiphon.engine_ext.compile_cache import adapt_loaded_function, reuse_cpu_compiled_model


def inductor_forward(*args: Any) -> Any:
    return sum(args)


inductor_forward.serialize = lambda: b""  # type: ignore[attr-defined]


def loaded(compiled: Any) -> SimpleNamespace:
    """The shape of torch's AOTCompiledFunction where vLLM reads it."""
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))


def test_inductor_function_gets_finalize_loading_and_runs_outside_dynamo() -> None:
    compiled = BundledAOTAutogradSerializableCallable(inductor_forward)
    assert not hasattr(compiled, "finalize_loading")  # vLLM's load failed on this
    assert adapt_loaded_function(loaded(compiled))
    compiled.finalize_loading(None)
    assert compiled.compiled_fn._torchdynamo_disable
    assert compiled(1, 2, 3) == 6


def test_functions_vllm_can_finalize_are_left_as_loaded() -> None:
    class VllmFunction:
        def finalize_loading(self, vllm_config: Any) -> None:
            pass

    own = VllmFunction()
    assert not adapt_loaded_function(loaded(own))
    assert not adapt_loaded_function(SimpleNamespace())
    assert vars(own) == {}


def test_wrapper_adapts_what_torch_loads_and_is_installed_once() -> None:
    original = torch.compiler.load_compiled_function
    compiled = BundledAOTAutogradSerializableCallable(inductor_forward)

    def load(file: Any, **kwargs: Any) -> SimpleNamespace:
        return loaded(compiled)

    try:
        torch.compiler.load_compiled_function = load
        reuse_cpu_compiled_model()
        installed = torch.compiler.load_compiled_function
        reuse_cpu_compiled_model()
        assert torch.compiler.load_compiled_function is installed is not load
        assert installed(None, f_globals={})._artifacts.compiled_fn is compiled
        assert hasattr(compiled, "finalize_loading")
    finally:
        torch.compiler.load_compiled_function = original
