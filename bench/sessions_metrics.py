"""Per-turn context accounting and per-sweep-point metrics of `antiphon bench sessions`.

A follow-up turn's prior context is the KV its previous turn computed; what the server did not
find cached of it was recomputed:

    previous turn  [ prompt ............... | reply ..... x ]    x: sampled, never fed back
    follow-up      [ prior context ................... ][ new message ..... y ]
                   [ cached (any tier) ... | recomputed ]    y: always computed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from antiphon.bench.sessions_clients import TurnResult
from antiphon.quantiles import percentile

COUNTERS = ("prompt_tokens", "tokens_from_device", "tokens_from_host", "tokens_from_ssd",
            "computed_prompt_tokens", "advisories_received", "advisories_used",
            "advisories_expired", "advisories_late", "advisories_reclaimed", "turns_held",
            "turns_fetched_in_step", "ssd_fetches_cut", "fetch_retries", "saves_refused",
            "rt_preemptions", "rt_recomputed_tokens")
POINT_METRICS = ("recomputed_context_frac", "preemption_recomputed_frac", "followup_ttft_p50_s",
                 "followup_ttft_p99_s", "fresh_ttft_p50_s", "followup_over_fresh_p50",
                 "tpot_p50_s", "host_hit_frac", "ssd_hit_frac", "missed_advisories",
                 "missed_over_advised_p50", "send_lag_max_s", "send_lag_p99_s")


def prior_context_tokens(prev_prompt: int, prev_completion: int, prompt: int) -> int:
    """Tokens of a follow-up prompt whose KV its previous turn computed: that turn's prompt and
    reply but the reply's last token (sampled, never fed back), and never the new prompt's last
    token (always computed, to sample from)."""
    return max(0, min(prev_prompt + prev_completion - 1, prompt - 1))


def recomputed_context_tokens(prior_context: int, cached: int) -> int:
    return max(0, prior_context - cached)


def turn_records(users: int, user: int, results: Sequence[TurnResult],
                 advised: Sequence[bool] | None = None) -> list[dict[str, Any]]:
    """One JSON record per turn of one simulated user, with its context accounting and
    whether a typing advisory preceded it (`advised`, per turn; none did when omitted)."""
    records = []
    for turn, r in enumerate(results):
        prev = results[turn - 1] if turn else None
        prior = prior_context_tokens(prev.prompt_tokens, prev.completion_tokens,
                                     r.prompt_tokens) if prev else 0
        records.append({"users": users, "user": user, "turn": turn, "ttft_s": r.ttft_s,
                        "tpot_s": r.tpot_s, "prompt_tokens": r.prompt_tokens,
                        "completion_tokens": r.completion_tokens,
                        "cached_tokens": r.cached_tokens, "prior_context_tokens": prior,
                        "recomputed_context_tokens": recomputed_context_tokens(
                            prior, r.cached_tokens), "fresh_ttft_s": None,
                        "host_tokens": r.tier_tokens[0] if r.tier_tokens else None,
                        "ssd_tokens": r.tier_tokens[1] if r.tier_tokens else None,
                        "advised": bool(advised[turn]) if advised else False,
                        "send_lag_s": r.send_lag_s})
    return records


def counter_deltas(before: dict[str, Any] | None,
                   after: dict[str, Any] | None) -> dict[str, int] | None:
    """Tiering counters over a window; None when the server reports none."""
    if not before or not after:
        return None
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in COUNTERS}


def summarise_point(records: Sequence[dict[str, Any]], tiering: dict[str, int] | None,
                    is_stock: bool = False) -> dict[str, float | None]:
    """One sweep point's metrics. Tier hit fractions are of the follow-ups' prior context, so
    that device, host, SSD and recomputed shares add up to about one. Fresh TTFTs are of the
    follow-ups the prober sent again alone (`fresh_ttft_s`), under the same load."""
    followups = [r for r in records if r["turn"] > 0]
    prior = sum(r["prior_context_tokens"] for r in followups)
    probed = [r for r in followups if r["fresh_ttft_s"]]

    def share(tokens: int | None) -> float | None:
        return tokens / prior if tokens is not None and prior else None

    def tier_share(tier: str) -> float | None:
        """The share of the follow-ups' prior context the `tier` loaded: each follow-up's
        own (its first admission, as its output reports it) where the server says; else the
        server's counter over the window, which also counts first turns and reloads after a
        preemption (an upper bound)."""
        own = [r[f"{tier}_tokens"] for r in followups if r.get(f"{tier}_tokens") is not None]
        if own:
            return share(sum(own))
        return share(tiering[f"tokens_from_{tier}"] if tiering else None)

    # Follow-ups that went without the advisory their system sends (advisory_miss10), against
    # those that had it, in the same run: what a missed advisory costs, free of the few
    # percent one engine start differs from the next. Each turn counts as its TTFT over its
    # message's fresh TTFT, so that a long new message does not pass for a missed advisory.
    advised = [r["ttft_s"] / r["fresh_ttft_s"] for r in probed if r.get("advised")]
    missed = [r["ttft_s"] / r["fresh_ttft_s"] for r in probed if not r.get("advised")]
    advised_p50, missed_p50 = percentile(advised, 0.5), percentile(missed, 0.5)
    any_advised = any(r.get("advised") for r in followups)

    # A turn's cached tokens are counted when it is first admitted: what turns recomputed
    # after a preemption took their pages is the scheduler's count, apart (Antiphon's servers
    # report it, stock vLLM does not; it also holds decode positions and first turns, so
    # over the follow-ups' prior context it can only overstate).
    preempted = tiering.get("rt_recomputed_tokens") if tiering and not is_stock else None
    return {
        "recomputed_context_frac": share(sum(r["recomputed_context_tokens"] for r in followups)),
        "preemption_recomputed_frac": share(preempted),
        "followup_ttft_p50_s": percentile([r["ttft_s"] for r in followups], 0.5),
        "followup_ttft_p99_s": percentile([r["ttft_s"] for r in followups], 0.99),
        "fresh_ttft_p50_s": percentile([r["fresh_ttft_s"] for r in probed], 0.5),
        "followup_over_fresh_p50": percentile([r["ttft_s"] / r["fresh_ttft_s"] for r in probed],
                                              0.5),
        # (of the replies with a gap between text frames to time: `TurnResult.tpot_s`)
        "tpot_p50_s": percentile([r["tpot_s"] for r in records if r["tpot_s"] is not None],
                                 0.5),
        "host_hit_frac": tier_share("host"),
        "ssd_hit_frac": tier_share("ssd"),
        "missed_advisories": sum(not r.get("advised") for r in followups)
        if any_advised else None,
        "missed_over_advised_p50": missed_p50 / advised_p50
        if missed_p50 is not None and advised_p50 else None,
        # How late turns went against their think times: near 0 where the users kept to
        # the reading and typing rates, and the point's load is the one the model says.
        "send_lag_max_s": max((r["send_lag_s"] for r in records if "send_lag_s" in r),
                              default=None),
        "send_lag_p99_s": percentile([r["send_lag_s"] for r in records if "send_lag_s" in r],
                                     0.99),
    }


def merge_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's repeated sweeps (`--repeats`) as one: each point metric the median over
    the runs that report it, every turn (tagged with its run), the runs themselves kept."""
    if len(runs) == 1:
        return dict(runs[0])
    merged: dict[str, Any] = {"users": runs[0]["users"]}
    for k in POINT_METRICS:
        merged[k] = [percentile([r[k][i] for r in runs if r[k][i] is not None], 0.5)
                     for i in range(len(merged["users"]))]
    merged["turns"] = [{**t, "run": n} for n, r in enumerate(runs) for t in r["turns"]]
    merged["runs"] = [{k: v for k, v in r.items() if k != "turns"} for r in runs]
    return merged
