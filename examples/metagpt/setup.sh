#!/usr/bin/env bash
# Builds the virtual environment for MetaGPT 0.8.2 with Antiphon's client SDK:
#   examples/metagpt/setup.sh [VENV]      (default: .venv-metagpt at the repository root)
#
# MetaGPT lives apart from the server's environment: its pins (websockets<12, pydantic and
# numpy versions, old provider SDKs) clash with vLLM's. Its own requirements no longer install
# anywhere either: lancedb==0.4.0 is gone from PyPI and its grpcio pins contradict each other.
# So metagpt is installed without dependencies, beside requirements.txt: the packages its teams
# import, every one pinned as tested and installed as listed, without resolution (some of the
# pins metagpt's providers ask for contradict each other; websockets is newer than metagpt
# asks for, which the SDK needs and the teams do not use).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-metagpt}"
python="${PYTHON:-python3.11}"

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# gitignore-parser builds from source with pkg_resources, which setuptools 81 dropped.
"$venv/bin/python" -m pip install -q "setuptools<81" wheel
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -m pip install -q --no-deps metagpt==0.8.2
# Antiphon's client SDK (antiphon.agents needs only httpx and websockets, both above).
"$venv/bin/python" -m pip install -q --no-deps "$root"
# -P: not the repository's own antiphon/ folder, when run from its root.
"$venv/bin/python" -P -c "import antiphon.agents.metagpt_hooks, metagpt" 2>/dev/null || {
  echo "setup failed: metagpt or antiphon.agents does not import" >&2; exit 1; }
echo "MetaGPT environment ready: $venv"
