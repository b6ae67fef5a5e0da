"""Run the three-role agent workflow (architect, engineer, reviewer) against an Antiphon server.

    .venv/bin/python examples/agents/workflow.py --url http://127.0.0.1:8000 \
        --task "a command-line todo list"

Each role has its own session; when a role starts a model call, the roles that will run next
get an advisory, so the server brings their conversations' KV forward. Prints every message,
then each call's time to first token and the advisory lead times.
"""

from __future__ import annotations

import argparse
import asyncio

from antiphon.agents import AsyncAntiphon
from antiphon.agents.workflows import run_workflow


async def main(args: argparse.Namespace) -> None:
    async with AsyncAntiphon(args.url, args.api_key) as client:
        env = await run_workflow(client, args.task, hints=not args.no_hints,
                                 max_tokens=args.max_tokens)
        for m in env.history:
            print(f"--- {m.sent_from} ({m.cause_by})\n{m.content.strip()}\n")
        for c in env.calls:
            lead = "-" if c.advisory_lead_s is None else f"{c.advisory_lead_s:.2f} s"
            print(f"{c.role:>9} {c.action:<15} TTFT {c.ttft_s:6.3f} s  total {c.total_s:6.2f} s"
                  f"  prompt {c.prompt_tokens:5d} tokens  advisory lead {lead}")
        print(f"advisories sent: {env.hooks.num_advisories}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--task", default="a command-line todo list that saves to a JSON file")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-hints", action="store_true", help="send no advisories")
    asyncio.run(main(parser.parse_args()))
