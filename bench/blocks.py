"""`antiphon bench blocks`: bidirectional blocks against recompute preemption, under memory
pressure.

The workload of `bench mixed` (RT chat turns from the Azure trace over a saturating BE batch
job), served with the `bros` policy on a KV pool too small for all running requests, twice in
one run: `biblocks` (pages placed in bidirectional shared blocks, preempted BE work lazily
checkpointed to the host tier and restored) and `recompute` (stock vLLM memory: a preempted
request frees its pages and recomputes what the prefix cache no longer holds; no KV tiers),
and `no_block_preemption`, BROS's own ablation (section 7.4.1, "No Bi-cache"): without
bidirectional blocks an RT turn takes no pages from BE work either, and a running request that
cannot get a page is itself preempted and recomputed. In `recompute` an RT turn short of pages
still preempts BE requests (issue 3's rule), so it isolates what the checkpoints save; the
ablation is the baseline the paper's 1.23 and 1.63 times RT attainment were measured against.
`biblocks` runs the host tier alone: its checkpoints need nothing more, and on a CPU host the
SSD tier's write-through takes cycles from the model (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from antiphon.bench.args import names_in
from antiphon.bench.mixed import add_workload_arguments, run_systems

SYSTEMS = {
    "biblocks": ["--policy", "bros", "--biblocks", "--kv-tiering", "--ssd-tier-bytes", "0"],
    "recompute": ["--policy", "bros", "--no-biblocks", "--no-kv-tiering"],
    "no_block_preemption": ["--policy", "bros_no_block_preemption", "--no-biblocks",
                            "--no-kv-tiering"],
}
# Not run by default: recompute preemption with the tiers of `biblocks`, which separates what
# the write-through costs from what bidirectional blocks change; and `biblocks_ssd`, with the
# SSD tier on too, as `antiphon serve` runs by default.
EXTRA_SYSTEMS = {
    "recompute_tiered": ["--policy", "bros", "--no-biblocks", "--kv-tiering",
                         "--ssd-tier-bytes", "0"],
    "biblocks_ssd": ["--policy", "bros", "--biblocks", "--kv-tiering"],
}
ALL_SYSTEMS = {**SYSTEMS, **EXTRA_SYSTEMS}


def main(args: argparse.Namespace) -> int:
    systems = {name: [*ALL_SYSTEMS[name], "--shared-block-pages", str(args.shared_block_pages)]
               for name in args.systems.split(",")}
    return run_systems(args, "blocks", systems, baseline="recompute")


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("blocks", help="bidirectional KV blocks against recompute preemption")
    p.add_argument("--out", default="bench-blocks.json")
    p.add_argument("--systems", default=",".join(SYSTEMS), type=names_in(ALL_SYSTEMS),
                   help="comma-separated, of " + ", ".join(ALL_SYSTEMS))
    p.add_argument("--shared-block-pages", type=int, default=4)
    add_workload_arguments(p, kv_pages=24, rt_rate=1.0)
    p.set_defaults(bench_func=main)

