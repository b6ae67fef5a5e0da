"""Benchmark prompts are sized in the model's tokens, not in words."""

from __future__ import annotations

from typing import Any

import pytest

from antiphon.bench.workload import fit_tokens
from tests.conftest import default_model_or_skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_or_skip())


@pytest.mark.parametrize("text", ["数据中心的调度" * 80, "x = compute(a, b)\n" * 50,
                                  "Hello there.", ""])
def test_prompts_have_the_token_count_asked_for(tokenizer: Any, text: str) -> None:
    for n in (16, 100, 300):
        prompt = fit_tokens(text, n, "Tell me more about it.", tokenizer)
        assert abs(len(tokenizer.encode(prompt, add_special_tokens=False)) - n) <= 2
