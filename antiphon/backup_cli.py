"""`antiphon backup DEST`: a consistent copy of a data folder's sessions and batch jobs, taken
while the server runs.

Each database is copied with SQLite's online backup (a snapshot as of one moment, whatever the
server writes meanwhile), then the batch files that snapshot names. The KV tiers are not copied:
they are a cache of what the sessions hold, rebuilt by use. To restore, stop the server and
start it with `--data-dir DEST`. (Copying DEST's databases over a data folder's is not a
restore: SQLite would replay the `-wal` file a killed server left beside the old database onto
the copy.)

A backup that fails (a full disk: status 2) leaves nothing behind: every copy is written
under a temporary name (`.part`) and takes its own name only once all are done. A backup
killed midway cannot clean up: its folder keeps the `BACKUP-UNFINISHED` file it wrote first
(and removes last), and `serve` refuses a folder that holds it (some databases may be
missing, and a server would make them anew, empty). A batch file deleted after the snapshot
sends the backup back for a newer snapshot of the batch database, which holds what the deletion
changed (the server marks a file deleted in its database before it removes it: a batch failed
for its input gone, a batch's items dropped with its last results); after `SNAPSHOT_TRIES`
snapshots, a file still missing is marked deleted in the copy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from antiphon import env
from antiphon.datalock import (
    UNFINISHED_BACKUP,
    DataDirInUseError,
    UnfinishedBackupError,
    check_not_unfinished_backup,
    holder,
    lock_data_dir,
)
from antiphon.private import private_dir, private_file
from antiphon.server.file_store import FileStore, fsync_dir
from antiphon.sessions.config import SessionConfig
from antiphon.sqlite import DatabaseDamaged

DATABASES = ("sessions.sqlite3", "batches.sqlite3")
# Snapshots of the batch database a backup takes at most while files it names are deleted
# under it (each snapshot's files not copied yet are copied; a copied file never changes).
SNAPSHOT_TRIES = 5


def backup(data_dir: Path, dest: Path) -> dict[str, Any]:
    """Copy `data_dir`'s databases and batch files into `dest` (new or empty); what was
    copied. Raises FileExistsError (`dest` holds files), FileNotFoundError (no database in
    `data_dir`), DatabaseDamaged (a copy fails SQLite's integrity check)."""
    check_not_unfinished_backup(data_dir)  # (its copy would look whole)
    if dest.exists() and _holds_files(dest):
        raise FileExistsError(f"{dest} is not empty")
    found = [name for name in DATABASES if (data_dir / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{data_dir} holds no Antiphon database")
    made = not dest.exists()
    private_dir(dest)
    # Held to the end: a server started on `dest` meanwhile would write databases the
    # backup's then replace under it (it refuses a held lock, as this does).
    try:
        lock = lock_data_dir(dest)
    except BaseException as exc:
        if made:
            with contextlib.suppress(OSError):
                dest.rmdir()
        if isinstance(exc, DataDirInUseError):
            raise DataDirInUseError(f"{dest} is in use by another antiphon process (pid "
                                    f"{holder(dest / '.lock')}): back up into another "
                                    "folder") from None
        raise
    try:
        return _backup_into(data_dir, dest, found, made)
    finally:
        os.close(lock)


def _backup_into(data_dir: Path, dest: Path, found: list[str], made: bool) -> dict[str, Any]:
    """`backup`, `dest`'s lock held."""
    if _holds_files(dest):  # (a server came and went)
        raise FileExistsError(f"{dest} is not empty")
    unfinished = dest / UNFINISHED_BACKUP
    # What the backup writes, under its temporary name and its own, in the order they take
    # their names: the batch files, then the databases, the sessions one last.
    names = [*(["files"] if "batches.sqlite3" in found else []), *reversed(found)]
    parts = {name: dest / f"{name}.part" for name in names}
    try:
        with open(private_file(unfinished), "wb") as marker:
            os.fsync(marker.fileno())
        fsync_dir(dest)
        summary: dict[str, Any] = {}
        for name in found:
            if name == "batches.sqlite3":
                summary[name], summary["files"] = _copy_batches(data_dir, parts[name],
                                                                parts["files"])
            else:
                summary[name] = _copy_database(data_dir / name, parts[name])
        for name in names:
            os.replace(parts[name], dest / name)
        fsync_dir(dest)  # the names, on disk before the folder says it is whole
        unfinished.unlink()
        fsync_dir(dest)
    except BaseException:
        for name in names:
            for path in (parts[name], dest / name,
                         *(dest / f"{name}.part{end}" for end in ("-journal", "-wal", "-shm"))):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        unfinished.unlink(missing_ok=True)  # last: until it goes, no server starts here
        (dest / ".lock").unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                dest.rmdir()
        raise
    return summary


def _holds_files(folder: Path) -> bool:
    """Whether `folder` holds anything but a data folder's lock (a failed backup's, say)."""
    return any(path.name != ".lock" for path in folder.iterdir())


def _copy_database(source: Path, target: Path) -> dict[str, int]:
    src = sqlite3.connect(source)
    dst = sqlite3.connect(private_file(target))
    try:
        src.backup(dst)  # one snapshot; the server's writes go on beside it (WAL)
        (status,) = dst.execute("PRAGMA integrity_check").fetchone()
        if status != "ok":
            raise DatabaseDamaged(f"the copy of {source} is damaged ({status})")
        tables = [r[0] for r in dst.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {t: dst.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
    finally:
        dst.close()
        src.close()


def _copy_batches(data_dir: Path, database: Path,
                  target: Path) -> tuple[dict[str, int], dict[str, Any]]:
    """The batch database into `database` and the files it names into `target`: snapshots
    until one names no file deleted since (`SNAPSHOT_TRIES` at most). What was copied."""
    private_dir(target)
    copied: dict[str, Path] = {}  # file id -> its copy
    for _ in range(SNAPSHOT_TRIES):
        counts = _copy_database(data_dir / "batches.sqlite3", database)
        sizes, missing = _copy_files(database, data_dir / "files", target, copied)
        if not missing:
            break
    else:  # deleted faster than snapshots are taken: as the server's DELETE /v1/files
        db = sqlite3.connect(database, isolation_level=None)  # marks them, bar what follows
        try:
            db.executemany("UPDATE files SET deleted_at = ? WHERE file_id = ?",
                           [(time.time(), file_id) for file_id in missing])
        finally:
            db.close()
    for file_id in copied.keys() - sizes.keys():  # deleted before the last snapshot
        copied.pop(file_id).unlink()
    fsync_dir(target)  # the copies' names, renamed into it (and the ones removed)
    num_bytes = sum(sizes[file_id] for file_id in copied)
    return counts, {"copied": len(copied), "bytes": num_bytes, "missing": missing}


def _copy_files(database: Path, source: Path, target: Path,
                copied: dict[str, Path]) -> tuple[dict[str, int], list[str]]:
    """The batch files `database` names (not deleted) and not in `copied`, from `source` into
    `target`, each durable and of the size the database gives it, added to `copied`; the
    sizes of the files named, and those gone from `source` (deleted after the snapshot).
    Raises OSError where a copy fails (none is left)."""
    db = sqlite3.connect(database, isolation_level=None)
    try:
        rows = db.execute("SELECT file_id, num_bytes FROM files WHERE deleted_at IS NULL")
        sizes = dict(rows.fetchall())
    finally:
        db.close()
    files = FileStore(source)
    missing = []
    for file_id, size in sizes.items():
        if file_id in copied:
            continue
        path = files.path(file_id)
        if _copy_file(path, target / path.name, size):
            copied[file_id] = target / path.name
        else:
            missing.append(file_id)
    return sizes, missing


def _copy_file(source: Path, target: Path, size: int) -> bool:
    """Copy `source` to `target` through a temporary name, synced; False where `source` is
    gone (deleted after the snapshot). Raises OSError, leaving nothing, where the copy
    fails or does not come out `size` bytes long."""
    part = target.with_name(target.name + ".part")
    try:
        with open(source, "rb") as src, open(private_file(part), "wb") as dst:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
            if dst.tell() != size:
                raise OSError(f"{source} is {dst.tell()} bytes, its record says {size}")
    except FileNotFoundError as exc:
        part.unlink(missing_ok=True)
        if exc.filename == str(source):
            return False
        raise
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, target)
    return True


def _backup(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir or env.data_dir() or SessionConfig().data_dir).expanduser()
    try:
        summary = backup(data_dir, Path(args.dest))
    except (OSError, DatabaseDamaged, sqlite3.Error, UnfinishedBackupError,
            DataDirInUseError) as exc:
        print(f"antiphon backup: {exc}", file=sys.stderr)
        return 2
    for name, counts in summary.items():
        if name == "files":
            print(f"files: {counts['copied']} ({counts['bytes']} bytes)"
                  + (f"; {len(counts['missing'])} deleted meanwhile" if counts["missing"] else ""))
        else:
            print(f"{name}: " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    print(f"backed up {data_dir} into {args.dest} (the KV tiers are a cache and are not copied)")
    return 0


def add_backup_parser(commands: Any) -> None:
    p = commands.add_parser("backup", help="copy the sessions and batch jobs of a data folder, "
                            "while the server runs")
    p.add_argument("dest", help="folder to create (or an empty one)")
    p.add_argument("--data-dir", default=None,
                   help="the server's data folder (default: ANTIPHON_DATA_DIR, or "
                   "~/.local/share/antiphon)")
    p.set_defaults(func=_backup)
