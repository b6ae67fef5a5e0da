"""The host arena: fixed-size slots in one POSIX shared-memory segment, reachable by name.

The process that owns the host tier creates the arena; any other process (vLLM's worker)
attaches by name and reads or writes slots by number. Slot numbers travel in the connector's
metadata; which key lives in which slot is known only to the owner's `HostTier`.

    offset 0                  HEADER_BYTES
    [header: magic, version,  |slot 0       |slot 1       | ... |slot num_slots-1|
     slot_bytes, num_slots]   |<-slot_bytes->|

The header lets an attaching process check the geometry. Slots start page-aligned
(HEADER_BYTES is 4096); a slot is `slot_bytes` long, whatever the payload in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import struct
import sys
import threading
import time
from collections.abc import Collection
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from types import TracebackType
from typing import Any

from antiphon.tiering.tier import BytesLike, byte_view

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIQQ")  # magic, version, slot_bytes, num_slots
_MAGIC = b"AKVARENA"
_VERSION = 1
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
# Touched per madvise call, between checks for `close`: short, since the call holds the
# process's memory-map lock (32 MiB a call, on a normal-priority thread in vLLM's worker,
# stretched its steps to 0.4-1.4 s for 10 s).
PREFAULT_STEP_BYTES = 1 << 20


def _open_in_use(name: str) -> int:
    """A descriptor of segment `name` holding a shared lock on it for as long as it is open:
    every process that uses an arena, its owner and those attached, holds one, and the lock
    goes with the process however it ends. `reclaim_named_arena` tells a live arena from one
    a killed server left by it, across PID namespaces too (containers sharing /dev/shm)."""
    import _posixshmem  # the shm_open that SharedMemory itself uses

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_untracked(name: str) -> tuple[mmap.mmap, int]:
    """Map an existing segment without registering it with multiprocessing's resource tracker,
    with the descriptor holding its in-use lock (`_open_in_use`).

    Before Python 3.13 every `SharedMemory(name)` registers the segment, and a tracker that is
    not the creator's unlinks it when the attaching process exits (CPython issue 82300).
    """
    fd = _open_in_use(name)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size), fd
    except BaseException:
        os.close(fd)
        raise


class ArenaMemoryError(MemoryError):
    """The shared-memory file system cannot hold the arena; the message says how to fix it."""


def _reserve(name: str, size: int) -> None:
    """Allocate the segment's memory now, as vLLM allocates its KV pool at start: a segment
    larger than the room left in /dev/shm is accepted by `ftruncate`, then kills the process
    that writes past the room with SIGBUS, mid-step; here it fails at creation instead, with
    the sizes in the message. (The pages are not zeroed yet: tmpfs clears each at its first
    touch, which `HostArena.prefault_in_background` moves out of the steps.)"""
    import _posixshmem

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        try:
            free = os.statvfs("/dev/shm")
            room = f"; /dev/shm has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free"
        except OSError:
            room = ""
        raise ArenaMemoryError(
            f"cannot reserve {size / 2**20:.0f} MiB of shared memory for the host KV tier "
            f"({exc.strerror}){room}: lower the host tier's size (--host-tier-bytes) or give "
            f"/dev/shm more room (docker run --shm-size)") from exc
    finally:
        os.close(fd)


class HostArena:
    """Slots in shared memory. Create with `create`, attach with `attach`."""

    def __init__(self, name: str, buffer: memoryview, slot_bytes: int, num_slots: int, *,
                 in_use_fd: int, owner: SharedMemory | None = None,
                 mapping: mmap.mmap | None = None, tracked: bool = True) -> None:
        """Use `create` or `attach`; this wraps an already mapped segment."""
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._buf: memoryview | None = buffer
        self._owner = owner  # the creator's handle (None when attached)
        self._mapping = mapping  # the attacher's mapping (None when created)
        self._in_use_fd: int | None = in_use_fd  # holds the in-use lock (`_open_in_use`)
        self._tracked = tracked  # the owner's name is known to the resource tracker
        self._prefault: tuple[threading.Thread, threading.Event] | None = None

    @classmethod
    def create(cls, name: str, num_slots: int, slot_bytes: int, *,
               tracked: bool = True) -> HostArena:
        """Create segment `name` holding `num_slots` slots of `slot_bytes` bytes each.

        `tracked=False` keeps the name from multiprocessing's resource tracker, which unlinks
        the segments of a killed process some time after it died: for a name the operator
        chose (`--host-shm-name`), that unlink could come after a restart had reclaimed the
        name and created its own arena under it, and take the new arena's name away.

        Raises FileExistsError if a segment of that name exists (e.g. left by a killed process:
        remove it with `HostArena.unlink_stale(name)` or `reclaim_named_arena(name)`).
        """
        if slot_bytes < 1 or num_slots < 0:
            raise ValueError(f"need slot_bytes >= 1 and num_slots >= 0, got {slot_bytes}, "
                             f"{num_slots}")
        size = HEADER_BYTES + num_slots * slot_bytes
        try:
            shm = SharedMemory(name=name, create=True, size=size)
        except OverflowError:  # a size past off_t: Python leaves the empty segment behind
            HostArena.unlink_stale(name)
            raise ValueError(f"a host arena of {size} bytes is more than this system can "
                             "map") from None
        if not tracked:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        buf = shm.buf
        assert buf is not None
        try:
            in_use_fd = _open_in_use(name)
            try:
                # the header first: a start killed while reserving leaves a segment that
                # reads as an arena (`reclaim_named_arena`), not as another program's
                _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, slot_bytes, num_slots)
                _reserve(name, size)
            except BaseException:
                os.close(in_use_fd)
                raise
        except BaseException:
            shm.close()
            _unlink(shm, tracked)
            raise
        return cls(name, buf, slot_bytes, num_slots, in_use_fd=in_use_fd, owner=shm,
                   tracked=tracked)

    @classmethod
    def attach(cls, name: str) -> HostArena:
        """Map the existing segment `name` (created by another process) read-write."""
        mapping, in_use_fd = _map_untracked(name)
        buffer = memoryview(mapping)
        try:
            magic, version, slot_bytes, num_slots = _HEADER.unpack_from(buffer, 0)
            if magic != _MAGIC or version != _VERSION:
                raise ValueError(f"shared memory {name!r} is not a host arena (v{_VERSION})")
            if len(buffer) < HEADER_BYTES + num_slots * slot_bytes:
                raise ValueError(f"shared memory {name!r} is shorter than its header says")
        except BaseException:
            buffer.release()
            mapping.close()
            os.close(in_use_fd)
            raise
        return cls(name, buffer, slot_bytes, num_slots, in_use_fd=in_use_fd, mapping=mapping)

    @staticmethod
    def unlink_stale(name: str, shm_dir: Path = Path("/dev/shm")) -> bool:
        """Remove a segment left behind by a dead owner; False if there was none. By its
        name, without mapping it: a start that died creating it may have left it empty,
        which cannot be mapped."""
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            return False
        return True

    @property
    def is_owner(self) -> bool:
        return self._owner is not None

    @property
    def size_bytes(self) -> int:
        """Bytes of slot space (the header not counted)."""
        return self.num_slots * self.slot_bytes

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of the whole slot (`slot_bytes` long), no copy.

        Release it (or drop every reference) before `close`, which cannot unmap while views live.
        """
        start = self._offset(slot)
        return self._buffer[start:start + self.slot_bytes]

    def slots_view(self) -> memoryview:
        """A writable view of all slots back to back (`size_bytes` long), no copy: what the
        connector's worker maps as one `[num_slots, slot_bytes]` tensor."""
        return self._buffer[HEADER_BYTES:HEADER_BYTES + self.size_bytes]

    def write(self, slot: int, data: BytesLike, offset: int = 0) -> None:
        """Copy `data` into `slot` at byte `offset`; ValueError if it does not fit."""
        view = byte_view(data)
        if offset < 0 or offset + len(view) > self.slot_bytes:
            raise ValueError(f"{len(view)} bytes at offset {offset} overflow a "
                             f"{self.slot_bytes}-byte slot")
        start = self._offset(slot) + offset
        self._buffer[start:start + len(view)] = view

    def read(self, slot: int, num_bytes: int | None = None) -> bytes:
        """A copy of the first `num_bytes` (default: all) bytes of `slot`."""
        num_bytes = self.slot_bytes if num_bytes is None else num_bytes
        if not 0 <= num_bytes <= self.slot_bytes:
            raise ValueError(f"cannot read {num_bytes} bytes of a {self.slot_bytes}-byte slot")
        start = self._offset(slot)
        return bytes(self._buffer[start:start + num_bytes])

    def slot_array(self, slot: int, dtype: Any, shape: tuple[int, ...] | None = None) -> Any:
        """The slot as a numpy array of `dtype` (and `shape`), sharing memory: no copy.

        For the connector: `torch.from_numpy(arena.slot_array(s, np.uint8))` views a slot as a
        tensor. Drop the array before `close`.
        """
        import numpy as np

        array = np.frombuffer(self.slot_view(slot), dtype=dtype)
        return array if shape is None else array.reshape(shape)

    def prefault_in_background(self) -> None:
        """Touch every page of the arena now, on a background thread that runs only on
        idle cores, rather than in the steps that first write each slot. tmpfs zeroes a page
        at its first touch, and a VM may only back it with host memory then: on this
        project's 2-core VM, touching a new 2-GiB arena took 11 s (21 us a 4-KiB page), and
        in vLLM's worker the saves of a step, 720 to 2,160 pages, took 29-108 ms once they
        reached such pages, against 1-4 ms before in the same run. Touching maps the pages into this
        process too (the worker maps them again at its own first touch, about 2 us a page).
        No byte changes. Linux only (`MADV_POPULATE_WRITE`, 5.14 and later); elsewhere, or
        where the kernel refuses it, a page is touched at its first use. `close` stops it."""
        if self._prefault is not None or not sys.platform.startswith("linux"):
            return
        anchor = ctypes.c_char.from_buffer(self._buffer)
        address = ctypes.addressof(anchor)  # page-aligned: the mapping's start
        del anchor  # (an export held past `close` would keep the mapping)
        stop = threading.Event()
        thread = threading.Thread(target=_prefault, name=f"prefault-{self.name}", daemon=True,
                                  args=(self.name, address, len(self._buffer), stop))
        self._prefault = (thread, stop)
        thread.start()

    def check_integrity(self) -> None:
        """Assert the header still describes this arena."""
        header = _HEADER.unpack_from(self._buffer, 0)
        assert header == (_MAGIC, _VERSION, self.slot_bytes, self.num_slots), "arena header"
        assert len(self._buffer) >= HEADER_BYTES + self.size_bytes, "arena too short"

    def close(self) -> None:
        """Unmap (the owner also unlinks the name, so no new process can attach)."""
        if self._buf is None:
            return
        if self._prefault is not None:
            thread, stop = self._prefault
            stop.set()
            thread.join()  # (before the unmap: it would fault in pages of a reused range)
            self._prefault = None
        self._buf.release()
        self._buf = None
        try:
            if self._owner is not None:
                self._owner.close()
            elif self._mapping is not None:
                self._mapping.close()
        except BufferError:
            pass  # a caller still holds a slot view; the mapping goes when that view does
        if self._owner is not None:
            with contextlib.suppress(FileNotFoundError):
                _unlink(self._owner, self._tracked)
        if self._in_use_fd is not None:
            os.close(self._in_use_fd)
            self._in_use_fd = None

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def _buffer(self) -> memoryview:
        if self._buf is None:
            raise ValueError(f"host arena {self.name!r} is closed")
        return self._buf

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        return HEADER_BYTES + slot * self.slot_bytes


def _prefault(name: str, address: int, size: int, stop: threading.Event) -> None:
    """`madvise(MADV_POPULATE_WRITE)` over `size` bytes at `address`, a step at a time until
    done or `stop` is set: maps the pages writable without changing a byte. The thread runs
    under `SCHED_IDLE` (at nice 19 where that is refused): it takes cores nothing else
    wants, and never one from the forward pass's threads."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    started = time.monotonic()
    for offset in range(0, size, PREFAULT_STEP_BYTES):
        if stop.is_set():
            return
        if libc.madvise(address + offset, min(PREFAULT_STEP_BYTES, size - offset),
                        _MADV_POPULATE_WRITE) != 0:
            logger.info("host arena %s: pages are touched at their first use (madvise: %s)",
                        name, os.strerror(ctypes.get_errno()))
            return
    logger.info("host arena %s: %d MiB touched in %.1f s", name, size >> 20,
                time.monotonic() - started)


ARENA_PREFIX = "antiphon-kv-"


def default_arena_name() -> str:
    """A name unique to this process and start: `antiphon-kv-<pid>-<random>`. The random
    part keeps a restart that gets the same pid (a container, whose pids start alike, over a
    /dev/shm kept across restarts) clear of the arena a killed server left under it."""
    return f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def remove_orphaned_arenas(shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink default-named arenas (`antiphon-kv-<pid>[-<random>]`) whose process is gone: a server
    killed without closing its tiers leaves its arena in shared memory, which is RAM, until
    someone removes it. Returns the names removed. An arena named by `--host-shm-name`
    (`reclaim_named_arena` makes way for that one), whose pid is alive (in this pid
    namespace) and that is younger than `CREATING_S` (its creator may not have taken its
    in-use lock yet), or that a live process still uses, is left alone. An older one whose pid
    is alive is swept: a restarted container's engine gets its killed predecessor's pid, and
    that arena, a whole host tier of RAM, stayed behind at every such restart. One named
    with this process's own pid and not in use is swept however young: this process is not
    creating it, so its creator, which had the pid before, is dead."""
    removed = []
    for path in shm_dir.glob(f"{ARENA_PREFIX}*"):
        pid = _arena_pid(path.name)
        if pid is None or _is_in_use(path) or (
                pid != os.getpid() and _is_alive(pid) and _is_young(path)):
            continue
        try:
            if HostArena.unlink_stale(path.name, shm_dir):
                removed.append(path.name)
        except OSError as exc:  # another user's, say: theirs to remove, not a reason to fail
            logger.warning("host arena %s left by process %s could not be removed: %s",
                           path.name, pid, exc)
    return removed


def _arena_pid(name: str) -> int | None:
    """The pid in a default arena name (`default_arena_name`), None in another name."""
    pid = name.removeprefix(ARENA_PREFIX).split("-")[0]
    return int(pid) if name.startswith(ARENA_PREFIX) and pid.isdigit() else None


def remove_arenas_of(pids: Collection[int], shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the default-named arenas of processes `pids` (this server's engine processes,
    just stopped: vLLM kills its engine process before that closes its tiers), and take them
    off multiprocessing's resource tracker, which this process's children share: it would
    unlink them itself at this process's exit, warning of "leaked shared_memory objects".
    Returns the names removed."""
    tracker_here = getattr(resource_tracker._resource_tracker, "_fd", None) is not None
    removed = []
    for path in shm_dir.glob(f"{ARENA_PREFIX}*"):
        if _arena_pid(path.name) not in pids or not HostArena.unlink_stale(path.name, shm_dir):
            continue
        removed.append(path.name)
        if tracker_here:  # (else the tracker that knows the name is another's)
            resource_tracker.unregister("/" + path.name, "shared_memory")
    return removed


class ArenaInUse(RuntimeError):
    """The arena is in use by a live process: two servers cannot share one arena."""


def reclaim_named_arena(name: str, shm_dir: Path = Path("/dev/shm")) -> bool:
    """Make way for an arena named by `--host-shm-name`, which `remove_orphaned_arenas` cannot
    tell by its name: a host arena of that name that no live process uses (no process holds
    its in-use lock, `_open_in_use`) was left by a killed server, and is unlinked (True); no
    segment of that name gives False. Raises ArenaInUse where a live process uses it (another
    server, or an engine or worker that outlived its own), and FileExistsError where the
    segment is not a host arena (another program's, left alone)."""
    path = shm_dir / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError as exc:
        raise FileExistsError(f"shared memory {name!r} exists and belongs to another user: "
                              f"name another arena with --host-shm-name") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArenaInUse(f"host arena {name!r} is in use by a running process (another "
                             f"server, or the engine of one that was killed): stop it, or "
                             f"name another arena with --host-shm-name") from None
        header = os.pread(fd, _HEADER.size, 0)
        if len(header) < _HEADER.size or _HEADER.unpack(header)[0] != _MAGIC:
            raise FileExistsError(f"shared memory {name!r} exists and is not a host arena: "
                                  f"name another one with --host-shm-name")
        try:
            replaced = os.stat(path).st_ino != os.fstat(fd).st_ino
        except FileNotFoundError:
            return False  # another start reclaimed it meanwhile
        if replaced:  # another start reclaimed it and created its own under the name
            raise ArenaInUse(f"host arena {name!r} was just created by another process: "
                             f"two servers are starting with this --host-shm-name")
        path.unlink()  # still holding the lock: no other start unlinks a newer arena
        return True
    finally:
        os.close(fd)


def _unlink(shm: SharedMemory, tracked: bool) -> None:
    if tracked:
        shm.unlink()
    else:  # SharedMemory.unlink would tell a tracker that never heard of the name
        import _posixshmem

        _posixshmem.shm_unlink(shm._name)  # type: ignore[attr-defined]


def _is_in_use(path: Path) -> bool:
    """Whether a live process holds segment `path`'s in-use lock (`_open_in_use`): a worker
    that outlived its server, or a process in another PID namespace."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


CREATING_S = 60.0  # how long a segment's creator may take to lock it, with room to spare


def _is_young(path: Path) -> bool:
    """Whether segment `path` was made (or last written) within `CREATING_S`."""
    try:
        return time.time() - path.stat().st_mtime < CREATING_S
    except FileNotFoundError:
        return False


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
