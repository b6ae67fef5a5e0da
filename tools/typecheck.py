"""Type-check the code base as the installed `antiphon` package.

The repository maps folders into the `antiphon` namespace (`server/` is `antiphon.server`), which
mypy cannot follow from the source tree: imports across components would silently become `Any`.
This builds a tree of symlinks shaped like the installed package and runs mypy on it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("server", "sessions", "tiering", "engine_ext", "agents", "bench", "web_ui")


def main() -> int:
    tree = Path(tempfile.mkdtemp(prefix="antiphon-mypy-"))
    try:
        package = tree / "antiphon"
        package.mkdir()
        for f in (ROOT / "antiphon").glob("*.py"):
            (package / f.name).symlink_to(f)
        for name in COMPONENTS:
            (package / name).symlink_to(ROOT / name)
        os.chdir(tree)  # so `-p antiphon` finds the tree, not the source folder
        out, err, status = api.run([
            "--config-file", str(ROOT / "pyproject.toml"), "--explicit-package-bases",
            "--no-incremental", "-p", "antiphon", *sys.argv[1:]])
        print(out.replace(str(tree) + "/", ""), end="")
        print(err, end="", file=sys.stderr)
        return status
    finally:
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
