"""Benchmark prompts are sized in the model's tokens, not in words."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from antiphon.bench.workload import (
    LEVAL_FILES,
    azure_arrivals,
    document_chunks,
    fit_tokens,
    workload_summary,
)
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


def test_a_trace_window_runs_at_the_rate_and_lengths_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scaled by the whole trace's rate and means, a window of a trace whose rate and lengths
    vary ran at 2.3 to 4.3 turns a second for a rate of 3, and was cut short."""
    rng = random.Random(3)
    start, rows = datetime(2023, 11, 16, 18, 0), []
    at = 0.0
    for i in range(3000):
        at += rng.expovariate(8.0 if (i // 500) % 2 else 1.0)  # busy and quiet stretches
        busy = (i // 700) % 2
        rows.append(f"{(start + timedelta(seconds=at)).isoformat(sep=' ')},"
                    f"{rng.randint(50, 400) * (1 + 3 * busy)},{rng.randint(5, 60)}")
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    monkeypatch.setenv("ANTIPHON_BENCH_DATA", str(tmp_path))
    for seed in range(6):
        arrivals = azure_arrivals(40.0, 3.0, 300, 48, seed=seed)
        summary = workload_summary(arrivals, 40.0)
        assert summary["rt_turns"] == 120 and summary["rt_rate_per_s"] == 3.0
        assert arrivals[0].at_s == 0.0 and arrivals[-1].at_s == pytest.approx(119 / 3)
        assert summary["rt_mean_prompt_tokens"] == pytest.approx(300, rel=0.02)
        assert summary["rt_mean_output_tokens"] == pytest.approx(48, rel=0.05)


def test_document_chunks_are_512_to_1024_tokens(tokenizer: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized by words, BE chunks ran from 300 to 2,900 tokens (those past the benchmark's
    2,048-token context failed), and each document's short tail was a chunk too."""
    texts = ["The committee reviewed the budget. " * 600, "def f(x):\n    return x * 2\n" * 500,
             "短い文章です。" * 900, "Too short to chunk."]
    for name, text in zip(LEVAL_FILES, texts, strict=True):
        (tmp_path / name).write_text(json.dumps({"instructions": ["Summarise."],
                                                 "input": text}) + "\n")
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text("")  # marks the data folder
    monkeypatch.setenv("ANTIPHON_BENCH_DATA", str(tmp_path))
    chunks = document_chunks(512, 1024, tokenizer, seed=0)
    sizes = [len(tokenizer.encode(text, add_special_tokens=False)) for _, text in chunks]
    assert len(sizes) >= 6 and all(500 <= n <= 1040 for n in sizes), sizes
