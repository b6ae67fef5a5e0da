"""Seeded requests whose prompt is computed in chunks on the CPU backend (engine_ext.seeded_cpu):
the sample thrown away with each chunk leaves the request's generator as it was."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from antiphon.engine_ext.seeded_cpu import patch_runner_class


class Runner:
    """vLLM's model runner reduced to what the patch touches: `_sample` draws from each
    request's generator, `_bookkeeping_sync` rewinds those of discarded samples as vLLM 0.32
    does (by offset, which a CPU generator lacks)."""

    def __init__(self, generators: dict[int, torch.Generator], discard: list[bool]) -> None:
        self.input_batch = SimpleNamespace(generators=generators, num_reqs=len(discard))
        self.discard_request_mask = SimpleNamespace(np=np.array(discard))

    def _sample(self, logits: Any, spec_decode_metadata: Any) -> dict[int, float]:
        return {i: float(torch.rand(1, generator=g)) for i, g in
                self.input_batch.generators.items()}

    def _bookkeeping_sync(self, *args: Any) -> str:
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "kept"


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def test_vllms_rewind_fails_on_a_cpu_generator() -> None:
    runner = Runner({0: seeded(1)}, [True])
    runner._sample(None, None)
    with pytest.raises(RuntimeError, match="offset"):
        runner._bookkeeping_sync()


def test_a_discarded_sample_leaves_the_generator_as_it_was() -> None:
    class Patched(Runner):
        pass

    patch_runner_class(Patched)
    patch_runner_class(Patched)  # a second call does nothing
    # request 0's prompt is cut in two chunks, request 1 (same seed) computes it in one; request
    # 2 is decoding without a seed
    chunked = Patched({0: seeded(7), 1: seeded(7)}, [True, False, False])
    first = chunked._sample(None, None)
    assert chunked._bookkeeping_sync() == "kept"
    assert sorted(chunked.input_batch.generators) == [0, 1]  # back after the bookkeeping
    chunked.discard_request_mask.np[0] = False  # its last chunk
    second = chunked._sample(None, None)
    chunked._bookkeeping_sync()
    assert second[0] == first[0] == first[1]  # as if the thrown-away sample was never drawn
    assert second[1] != first[1]  # request 1's sample was kept: its generator went on


def test_a_seed_of_minus_one_reaches_vllm_as_a_seed() -> None:
    """vLLM reads seed -1 as none: a request (or a choice whose seed + offset wrapped onto
    -1) with it got a reply that did not repeat."""
    from vllm import SamplingParams

    from antiphon.engine_ext.vllm_engine import vllm_seed

    seed = vllm_seed(-1)
    assert SamplingParams(seed=seed).seed == seed
    drawn = [torch.rand(4, generator=torch.Generator().manual_seed(s)) for s in (-1, seed)]
    assert torch.equal(*drawn)  # the generator torch makes of -1
    assert vllm_seed(7) == 7 and vllm_seed(None) is None
