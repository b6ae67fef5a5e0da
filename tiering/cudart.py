"""The few CUDA runtime calls the batched KV mover makes directly, through the runtime library
PyTorch itself loaded (found in the process's memory map; nothing else is loaded).

Why not PyTorch's own calls: a host-to-device copy of a slice through `Tensor.copy_` costs
about 15 us of host time (the slice's tensor, the dispatch), and a step that loads a long
context makes a thousand of them per layer set, on the thread that must also launch the forward
pass; `cudaMemcpyAsync` on raw pointers costs a few. And a failed `cudaHostRegister` leaves its
error as the runtime's last error, which PyTorch's next kernel launch check raises as its own:
`last_error` clears it.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

log = logging.getLogger(__name__)

HOST_TO_DEVICE = 1  # cudaMemcpyKind
DEVICE_TO_HOST = 2
HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class CudaRuntime:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.restype = ctypes.c_int

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        err = self._memcpy(dst, src, nbytes, kind, stream)
        if err:
            self._last_error()
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed: CUDA error {err}")

    def host_register(self, ptr: int, nbytes: int) -> int:
        """Page-lock `nbytes` at `ptr`; returns the CUDA error (0: done), with the runtime's
        last error cleared."""
        err = int(self._register(ptr, nbytes, 0))
        if err:
            self._last_error()
        return err

    def host_unregister(self, ptr: int) -> int:
        err = int(self._unregister(ptr))
        if err:
            self._last_error()
        return err


@cache
def runtime() -> CudaRuntime | None:
    """The CUDA runtime PyTorch loaded in this process, or None where none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return CudaRuntime(ctypes.CDLL(path))
        except (OSError, AttributeError) as exc:
            log.warning("CUDA runtime %s not usable: %s", path, exc)
    return None
