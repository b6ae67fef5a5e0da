"""A MetaGPT team (metagpt 0.8.2) against a local Antiphon server, with call-graph advisories
from `antiphon.agents.metagpt_hooks`.

    examples/metagpt/setup.sh                      # once: builds .venv-metagpt
    .venv-metagpt/bin/python examples/metagpt/run.py --team coders --url http://127.0.0.1:8000

`--team software` is MetaGPT's software company (product manager, architect, project manager,
engineer), run as `metagpt "IDEA"` runs it; `--team coders` is the coder, tester and reviewer of
MetaGPT's multi-agent tutorial (`coding_team.py`). Either talks to Antiphon through the
OpenAI-compatible API. Each role gets an Antiphon session; when a role's model call starts, the
roles watching its action get an advisory. At the end it prints every model call (role, action,
first-token time, advisory lead time) and the server's advisory counters. `--no-hints` runs the
same team without advisories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from antiphon.agents import AsyncAntiphon, CallGraphHooks
from antiphon.agents.metagpt_hooks import MetaGPTAdvisor


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the Antiphon server")
    p.add_argument("--api-key", default=os.environ.get("ANTIPHON_API_KEY"))
    p.add_argument("--team", choices=("coders", "software"), default="coders")
    p.add_argument("--idea", default=None, help="the requirement (a default per team)")
    p.add_argument("--n-round", type=int, default=5, help="MetaGPT's rounds (its default: 5)")
    p.add_argument("--max-tokens", type=int, default=512, help="reply budget of each call")
    p.add_argument("--workdir", type=Path, default=None,
                   help="MetaGPT's project root (config and workspace); a new temporary one "
                        "by default")
    p.add_argument("--no-hints", action="store_true", help="send no advisories")
    return p.parse_args()


def configure_metagpt(workdir: Path, url: str, api_key: str | None, model: str,
                      max_tokens: int) -> None:
    """MetaGPT reads its configuration when first imported: write it first."""
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    llm = {"api_type": "openai", "base_url": f"{url}/v1", "api_key": api_key or "unused",
           "model": model, "max_token": max_tokens, "temperature": 0.0, "stream": True,
           "calc_usage": False}  # usage by tiktoken would need its vocabularies downloaded
    # JSON is YAML; MetaGPT's repair of open models' malformed output is on.
    (workdir / "config" / "config2.yaml").write_text(json.dumps(
        {"llm": llm, "repair_llm_output": True,
         "workspace": {"path": str(workdir / "workspace")}}))
    os.environ["METAGPT_PROJECT_ROOT"] = str(workdir)


async def run(args: argparse.Namespace) -> int:
    async with AsyncAntiphon(args.url, args.api_key) as client:
        model = (await client.models())[0]
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="metagpt-antiphon-"))
        configure_metagpt(workdir, args.url, args.api_key, model, args.max_tokens)
        from metagpt.team import Team

        team = Team()
        team.hire(hire(args.team))
        advisor = MetaGPTAdvisor(client, CallGraphHooks(client, send_advisories=not args.no_hints))
        graph = await advisor.attach(team.env)
        print(f"model {model}; roles and sessions: "
              + ", ".join(f"{r.name} {r.session_id}" for r in graph.roles), flush=True)
        team.invest(10.0)
        team.run_project(args.idea or IDEAS[args.team])
        started = time.perf_counter()
        error = None
        try:
            await run_team(team, args.n_round)
        except Exception as exc:  # report what ran before the team gave up
            error = exc
        await advisor.drain()
        elapsed = time.perf_counter() - started
    report(advisor, elapsed, workdir, metrics(args.url, args.api_key))
    if error is not None:
        print(f"the team stopped with an error: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 1
    return 0


async def run_team(team: Any, n_round: int) -> None:
    """`Team.run` (MetaGPT 0.8.2's), less its `serialize_decorator`: that logs an exception
    and returns None, and a team that failed was reported as done, exit status 0."""
    while n_round > 0 and not team.env.is_idle:
        n_round -= 1
        team._check_balance()  # (NoMoneyException past the investment)
        await team.env.run()
    team.env.archive(True)


IDEAS = {"coders": "write a function that calculates the product of a list",
         "software": "Write a command-line todo list app in Python."}


def hire(team: str) -> list[Any]:
    if team == "software":
        from metagpt.roles import Architect, Engineer, ProductManager, ProjectManager
        return [ProductManager(), Architect(), ProjectManager(),
                Engineer(n_borg=5, use_code_review=True)]
    sys.path.insert(0, str(Path(__file__).parent))
    import coding_team
    return coding_team.roles()


def metrics(url: str, api_key: str | None) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(("antiphon_kv_advisories_", 'antiphon_advisories_total{source="rest"}')):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def report(advisor: MetaGPTAdvisor, elapsed: float, workdir: Path,
           server: dict[str, float]) -> None:
    print(f"\n{'role':<16} {'action':<22} {'ttft_s':>7} {'total_s':>8} {'lead_s':>7}")
    for c in advisor.calls:
        lead = "-" if c.advisory_lead_s is None else f"{c.advisory_lead_s:.2f}"
        print(f"{c.role:<16} {c.action.rsplit('.', 1)[-1]:<22} {c.client_ttft_s:>7.3f} "
              f"{c.total_s:>8.2f} {lead:>7}")
    ttfts = [c.client_ttft_s for c in advisor.calls]
    print(f"\n{len(advisor.calls)} model calls in {elapsed:.1f} s; call TTFT p50 "
          f"{statistics.median(ttfts) if ttfts else float('nan'):.3f} s; advisories sent "
          f"{advisor.hooks.num_advisories} (failed {advisor.hooks.num_advisory_errors})")
    for name, value in server.items():
        print(f"  {name} {value:g}")
    print(f"MetaGPT's workspace: {workdir / 'workspace'}")


if __name__ == "__main__":
    sys.exit(asyncio.run(run(parse_args())))
