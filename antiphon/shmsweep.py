"""Shared-memory segments a killed engine left behind, removed on the next start.

vLLM's engine creates POSIX shared-memory segments (`/dev/shm/psm_<hex>`: the message queues
between the API process and the engine core, sparse files of up to 240 MiB each) and named
semaphores (`/dev/shm/sem.mp-<name>`), and unlinks them when it shuts down. A server killed
with SIGKILL never does, and nothing else will: they stay until the machine reboots, each
holding whatever pages were written to it.

A server records the segments its own processes (itself, its engine core and workers: the
processes under it) map or hold open while its engine starts, in `<data-dir>/engine-shm.json`,
and deletes the record when it shuts down cleanly. A server that finds a record at start (its
predecessor on this data folder was killed) unlinks the recorded segments that no live process
still maps. Only recorded names are touched: a segment another program created in the
meantime is left alone (it was recorded too, and swept, when whatever appeared in /dev/shm
while the engine started counted), and one a live process still maps (an engine core that
outlived its server) stays recorded, for the start after.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from antiphon.private import open_private

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Python's default names for multiprocessing.shared_memory segments and semaphores, which
# vLLM's engine uses.
PREFIXES = ("psm_", "sem.mp-")
RECORD_NAME = "engine-shm.json"


class EngineSegments:
    """The record of one server's engine segments in `data_dir`."""

    def __init__(self, data_dir: Path, shm_dir: Path = SHM_DIR) -> None:
        self.record = Path(data_dir) / RECORD_NAME
        self.shm_dir = shm_dir
        self._still_mapped: set[str] = set()  # recorded by a predecessor, in use at `sweep`
        self._recorded: list[str] | None = None  # what `remember` wrote last
        self._ours: set[str] = set()  # new segments this server's processes were seen to map

    def names(self) -> set[str]:
        """The segment names present now."""
        try:
            return {p.name for p in self.shm_dir.iterdir() if p.name.startswith(PREFIXES)}
        except OSError:  # no /dev/shm: nothing to track
            return set()

    def sweep(self) -> list[str]:
        """Unlink the segments a killed predecessor recorded that no live process maps.
        Returns the names unlinked; those still mapped are kept for the next `remember`."""
        try:
            recorded = json.loads(self.record.read_text())["segments"]
            if not isinstance(recorded, list):  # (a record that parses, but not as ours:
                # iterated, it failed every start until removed by hand)
                raise TypeError(f"segments is a {type(recorded).__name__}, not a list")
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring %s (%s)", self.record, exc)
            self.record.unlink(missing_ok=True)
            return []
        mapped = _mapped_segment_names(self.shm_dir)
        removed = []
        for name in recorded:
            if not (isinstance(name, str) and name.startswith(PREFIXES) and "/" not in name):
                continue
            if name in mapped:
                self._still_mapped.add(name)
                continue
            try:
                (self.shm_dir / name).unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("cannot remove %s (%s)", self.shm_dir / name, exc)
                continue
            removed.append(name)
        self.record.unlink(missing_ok=True)
        if removed:
            logger.warning("removed %d shared-memory segments left by a killed engine: %s",
                           len(removed), ", ".join(sorted(removed)))
        return removed

    def remember(self, before: set[str]) -> None:
        """Record the segments that appeared since `before` (taken before the engine
        started) that this process or one under it maps or holds open, written atomically.
        A record that cannot be written (a full disk) is logged, not raised: the server
        serves without it (a kill then leaves the segments for the operator to remove)."""
        present = self.names()
        if present - before - self._ours:
            try:
                self._ours |= (present - before) & _mapped_segment_names(
                    self.shm_dir, _process_tree(os.getpid()))
            except OSError as exc:  # (a /proc this process may not list: nothing new known)
                logger.warning("cannot tell which shared-memory segments the engine maps "
                               "(%s): a kill of this server would leave them", exc)
        new = sorted((self._ours | self._still_mapped) & present)
        if new == self._recorded:
            return  # (written already: while the engine starts, this runs every second)
        tmp = self.record.with_suffix(".tmp")
        try:
            tmp.unlink(missing_ok=True)
            with os.fdopen(open_private(tmp), "w") as f:
                f.write(json.dumps({"pid": os.getpid(), "segments": new}))
            os.replace(tmp, self.record)
            self._recorded = new
        except OSError as exc:
            logger.warning("could not record the engine's shared memory in %s (%s): a kill "
                           "of this server would leave %s in %s", self.record, exc,
                           ", ".join(new) or "none", self.shm_dir)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def forget(self) -> None:
        """A clean shutdown: the engine unlinked its own segments."""
        self.record.unlink(missing_ok=True)
        self._recorded = None


def _process_tree(root: int) -> list[int]:
    """`root` and every live process under it (children, theirs, and so on)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:  # the parent is the 2nd field after the name, which may hold spaces and ')'
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(proc.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue.extend(children.get(pid, ()))
    return tree


def _mapped_segment_names(shm_dir: Path, pids: Iterable[int] | None = None) -> set[str]:
    """Names of segments under `shm_dir` that a live process (of `pids`, where given) maps or
    holds open."""
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    procs = (Path("/proc") / str(pid) for pid in pids) if pids is not None else (
        proc for proc in Path("/proc").iterdir() if proc.name.isdigit())
    for proc in procs:
        try:
            with open(proc / "maps", encoding="utf-8", errors="replace") as maps:
                # a line ends with the mapped file's path, the only field with a '/'
                paths = [line[line.find("/"):].rstrip("\n") for line in maps if "/" in line]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        with contextlib.suppress(OSError):
            paths += [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        names.update(path[len(prefix):].removesuffix(" (deleted)") for path in paths
                     if path.startswith(prefix))
    return names
