"""`antiphon bench blocks`: bidirectional blocks against recompute preemption, under memory
pressure.

The workload of `bench mixed` (RT chat turns from the Azure trace over a saturating BE batch
job), served with the `bros` policy on a KV pool too small for all running requests, twice in
one run: `biblocks` (pages placed in bidirectional shared blocks, preempted BE work lazily
checkpointed to the host tier and restored) and `recompute` (stock vLLM memory: a preempted
request frees its pages and recomputes what the prefix cache no longer holds; no KV tiers).
"""

from __future__ import annotations

import argparse
from typing import Any

from antiphon.bench.args import names_in
from antiphon.bench.mixed import add_workload_arguments, run_systems

SYSTEMS = {
    "biblocks": ["--policy", "bros", "--biblocks", "--kv-tiering"],
    "recompute": ["--policy", "bros", "--no-biblocks", "--no-kv-tiering"],
}
# Not run by default: recompute preemption with KV tiering on, which separates what the tiers'
# write-through costs from what bidirectional blocks change.
EXTRA_SYSTEMS = {"recompute_tiered": ["--policy", "bros", "--no-biblocks", "--kv-tiering"]}
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
    add_workload_arguments(p, kv_pages=24)
    p.set_defaults(bench_func=main)

