"""Processes of a test's server, from /proc."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()


def is_gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody reaped (a container's init may not)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] == "Z"


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (vLLM's engine core and worker below a server)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (fields := _stat_fields(int(proc.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if not is_gone(p)]
