"""Seeded sampling under chunked prefill on the CPU backend (a vLLM 0.32 bug, worked around).

vLLM samples a token for every request in a step, also for one whose prompt is only partly
computed, and throws that token away; for a seeded request it then winds the request's random
generator back (`gen.set_offset(gen.get_offset() - 4)`), so the seeded sequence does not
depend on how the prompt was cut. A CPU `torch.Generator` has no offset: the call raised, and
the worker, the engine and the server died with it, for one request with `seed` whose prompt
the scheduler cut into chunks (a policy's step budget, or a preempted request recomputing).

Here, before sampling, the model runner keeps the state of each CPU generator whose sample
will be thrown away, and after it puts that state back and keeps the generator out of vLLM's
rewind: the same outcome as vLLM's rewind on a GPU (whose generators are left alone).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_PATCHED = "_antiphon_seeded_cpu"


def rewind_discarded_cpu_generators() -> None:
    """Patch vLLM's model runner class (in a worker process; once)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch_runner_class(GPUModelRunner)


def patch_runner_class(runner_cls: Any) -> None:
    """Wrap `runner_cls._sample` and `_bookkeeping_sync` (vLLM's `GPUModelRunner`, which the
    CPU runner extends) as the module docstring says; a second call does nothing."""
    if getattr(runner_cls, _PATCHED, False):
        return
    sample, bookkeeping = runner_cls._sample, runner_cls._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._antiphon_rewind = discarded_cpu_generators(self)
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewind: dict[int, tuple[torch.Generator, torch.Tensor]] = getattr(
            self, "_antiphon_rewind", {})
        self._antiphon_rewind = {}
        generators = self.input_batch.generators
        for index, (generator, state) in rewind.items():
            generator.set_state(state)
            del generators[index]  # out of vLLM's rewind, which needs an offset
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update({index: generator for index, (generator, _) in rewind.items()})

    runner_cls._sample = _sample
    runner_cls._bookkeeping_sync = _bookkeeping_sync
    setattr(runner_cls, _PATCHED, True)


def discarded_cpu_generators(runner: Any) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """{batch index: (generator, its state now)} of the CPU generators of the requests whose
    sample this step throws away (a prompt not yet computed to its end)."""
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discarded = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return {int(index): (generator, generator.get_state()) for index in discarded
            if (generator := generators.get(int(index))) is not None
            and generator.device.type == "cpu"}
