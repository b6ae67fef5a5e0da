"""The scheduler's remembered device prefix-cache hit of waiting requests: with vLLM's pages
cached and evicted as runs from the start of a prompt (how its LRU free queue evicts a
request's pages: the tail first), the remembered hit equals a full lookup at every step, and
a full lookup runs only when the hit's ends changed or the memo is old."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from antiphon.engine_ext.scheduler import DEVICE_HIT_REFRESH_STEPS, AntiphonScheduler

PAGE = 16


class Pool:
    def __init__(self) -> None:
        self.cached: set[bytes] = set()
        self.lookups = 0

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[int] | None:
        return [0] if block_hash in self.cached else None

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int
                               ) -> tuple[tuple[()], int, int]:
        self.lookups += 1
        pages = 0
        for block_hash in hashes[:max_tokens // PAGE]:
            if block_hash not in self.cached:
                break
            pages += 1
        return (), pages * PAGE, 0


def scheduler(pool: Pool) -> SimpleNamespace:
    manager = SimpleNamespace(block_pool=pool, coordinator=pool)
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True),
                           kv_cache_manager=manager, stats=SimpleNamespace(num_steps=0),
                           block_size=PAGE, _device_hits={}, _can_probe_hits=True)


@settings(max_examples=80, deadline=None)
@given(num_pages=st.integers(1, 12), seed=st.integers(0, 10**6),
       steps=st.lists(st.sampled_from(["same", "grow", "shrink", "clear", "longer"]),
                      min_size=1, max_size=80))
def test_the_remembered_hit_equals_a_full_lookup(num_pages: int, seed: int,
                                                 steps: list[str]) -> None:
    rng = random.Random(seed)
    pool = Pool()
    hashes = [rng.randbytes(8) for _ in range(num_pages)]
    request = SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=num_pages * PAGE)
    sched = scheduler(pool)
    cached_run = 0  # pages cached from the prompt's start
    for action in steps:
        if action == "grow":
            cached_run = min(len(hashes), cached_run + rng.randint(1, 3))
        elif action == "shrink":
            cached_run = max(0, cached_run - rng.randint(1, 3))
        elif action == "clear":
            cached_run = 0
        elif action == "longer":  # the request grew (preempted after more output)
            hashes.append(rng.randbytes(8))
            request.num_tokens += PAGE
        pool.cached = set(hashes[:cached_run])
        lookups = pool.lookups
        got = AntiphonScheduler._device_cached_tokens(sched, request)  # type: ignore[arg-type]
        full_lookups = pool.lookups - lookups
        pool.lookups = lookups
        assert got == pool.find_longest_cache_hit(hashes, request.num_tokens - 1)[1]
        pool.lookups = lookups + full_lookups
        sched.stats.num_steps += 1


def test_an_unchanged_hit_is_not_looked_up_again_until_the_memo_is_old() -> None:
    pool = Pool()
    hashes = [bytes([i]) * 8 for i in range(64)]
    pool.cached = set(hashes[:40])
    request = SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=64 * PAGE)
    sched = scheduler(pool)
    for _ in range(DEVICE_HIT_REFRESH_STEPS):
        assert AntiphonScheduler._device_cached_tokens(sched, request) == 40 * PAGE  # type: ignore[arg-type]
        sched.stats.num_steps += 1
    assert pool.lookups == 1
    AntiphonScheduler._device_cached_tokens(sched, request)  # type: ignore[arg-type]
    assert pool.lookups == 2  # refreshed in full


def test_a_request_that_reads_no_cached_kv_is_viewed_as_computing_its_whole_prompt() -> None:
    """vLLM reads neither the device's prefix cache nor the KV tiers for a request asking for
    its prompt's logprobs; the view counted the hit as computed, and the policy left the
    request's prefill unbounded: a 911-token chunk in one 7 s step past a 0.05 s guard."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from antiphon.engine_ext.config import SchedulerSettings
    from antiphon.engine_ext.schedstats import SchedulerStats

    pool = Pool()
    hashes = [bytes([i]) * 8 for i in range(62)]
    pool.cached.update(hashes)
    sched = scheduler(pool)
    sched.stats = SchedulerStats()
    sched.settings = SchedulerSettings(policy="bros")
    sched._stored_prefix_tokens = lambda request: 62 * PAGE  # the tiers hold it all too
    sched._first_token_s, sched._checkpoint_cost = {}, None
    sched._device_cached_tokens = lambda r: AntiphonScheduler._device_cached_tokens(sched, r)
    sched._held_prefix_pages = lambda r, num_pages: 0  # no request runs
    for prompt_logprobs, computed in ((None, 62 * PAGE), (1, 0)):
        params = SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs)
        request = Request("r", list(range(1000)), params, None)
        request.block_hashes = hashes
        view = AntiphonScheduler._view(sched, request, is_running=False)  # type: ignore[arg-type]
        assert view.num_computed_tokens == computed
        # Nor may a policy credit it a prefix running requests hold (`ResidentPrefixes`):
        # hygen and echo seated it on the pages it would share, and vLLM, needing all its
        # pages, refused it and every waiting request behind it (found by a review).
        assert bool(view.prefix_page_hashes) is (prompt_logprobs is None)
