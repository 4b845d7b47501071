"""The CUDA runtime this process already runs, called by address: page-locking and raw copies.

torch has no call for two things the direct device path needs: page-locking a range of memory it
did not allocate (the store's arena, mapped from shared memory) without taking the GIL for the
seconds that takes, and a strided copy (``cudaMemcpy2DAsync``: one DMA moves "layer n of every
chunk", rows at equal distances in the arena, into one contiguous device buffer). Both are plain C
calls of the CUDA runtime, made here through :mod:`ctypes` (which releases the GIL around them).

The library is the runtime torch loaded, found among this process's mappings
(``/proc/self/maps``), so its streams are torch's streams (``torch.cuda.Stream.cuda_stream``) and
its device context is torch's. Nothing is loaded where CUDA is absent: :func:`cuda_runtime` then
raises :class:`CudaRuntimeUnavailable` with the reason, and callers keep their other path.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from pathlib import Path

__all__ = [
    "DEVICE_TO_HOST",
    "HOST_TO_DEVICE",
    "PORTABLE",
    "READ_ONLY",
    "CudaRuntime",
    "CudaRuntimeError",
    "CudaRuntimeUnavailable",
    "cuda_runtime",
    "loaded_runtime_path",
]

logger = logging.getLogger(__name__)

#: ``cudaMemcpyKind`` values.
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
#: ``cudaHostRegisterPortable``: page-locked for every CUDA context, not only the current one's.
PORTABLE = 1
#: ``cudaHostRegisterReadOnly`` (CUDA 11.1): the device only reads the range, which may then be a
#: read-only mapping (the store's sealed arena, as engines map it).
READ_ONLY = 8

_RUNTIME_NAME = re.compile(r"\s(/\S*/libcudart\.so[.\d]*)$")


class CudaRuntimeUnavailable(RuntimeError):
    """No CUDA runtime is loaded in this process (no CUDA build of torch, or none initialized)."""


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call returned an error; ``code`` is its ``cudaError_t``."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed with CUDA error {code} ({name})")
        self.code = code


def loaded_runtime_path(maps: str) -> str | None:
    """The path of the CUDA runtime library among ``/proc/self/maps`` lines, if one is mapped."""
    for line in maps.splitlines():
        found = _RUNTIME_NAME.search(line)
        if found:
            return found.group(1)
    return None


class CudaRuntime:
    """Typed entry points of one loaded CUDA runtime library (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        size, pointer, stream = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p
        self._register = library.cudaHostRegister
        self._register.argtypes = [pointer, size, ctypes.c_uint]
        self._unregister = library.cudaHostUnregister
        self._unregister.argtypes = [pointer]
        self._copy = library.cudaMemcpyAsync
        self._copy.argtypes = [pointer, pointer, size, ctypes.c_int, stream]
        self._copy_2d = library.cudaMemcpy2DAsync
        self._copy_2d.argtypes = [pointer, size, pointer, size, size, size, ctypes.c_int, stream]
        self._last_error = library.cudaGetLastError
        self._error_name = library.cudaGetErrorString
        self._error_name.restype = ctypes.c_char_p
        for function in (self._register, self._unregister, self._copy, self._copy_2d):
            function.restype = ctypes.c_int
        self._last_error.restype = ctypes.c_int

    def describe(self, code: int) -> str:
        """The runtime's words for error ``code``."""
        name = self._error_name(code)
        return name.decode() if name else f"error {code}"

    def _failed(self, call: str, code: int) -> CudaRuntimeError:
        # A failed call also sets the thread's sticky "last error", which torch's next kernel
        # launch on this thread would report as its own failure: clear it here.
        self._last_error()
        return CudaRuntimeError(call, code, self.describe(code))

    def host_register(self, address: int, nbytes: int, flags: int = PORTABLE) -> int:
        """Page-lock ``[address, address + nbytes)`` for DMA; the CUDA error code (0: done).

        Takes about 0.2-0.7 s per GiB (the kernel pins every page); ctypes releases the GIL.
        """
        code = int(self._register(address, nbytes, flags))
        if code:
            self._last_error()
        return code

    def host_unregister(self, address: int) -> int:
        """Undo :meth:`host_register` of the range that starts at ``address``; the error code."""
        code = int(self._unregister(address))
        if code:
            self._last_error()
        return code

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` on ``stream`` (a raw ``cudaStream_t``).

        Raises:
            CudaRuntimeError: the runtime refused the copy.
        """
        code = int(self._copy(dst, src, nbytes, kind, stream))
        if code:
            raise self._failed("cudaMemcpyAsync", code)

    def copy_2d_async(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        height: int,
        kind: int,
        stream: int,
    ) -> None:
        """Queue ``height`` rows of ``width`` bytes, ``src_pitch`` apart at the source and
        ``dst_pitch`` apart at the destination, as ONE copy on ``stream``.

        Raises:
            CudaRuntimeError: the runtime refused the copy (a pitch over the device's limit).
        """
        code = int(self._copy_2d(dst, dst_pitch, src, src_pitch, width, height, kind, stream))
        if code:
            raise self._failed("cudaMemcpy2DAsync", code)


_lock = threading.Lock()
_loaded: CudaRuntime | None = None


def _wheel_runtimes() -> list[str]:
    """CUDA runtime libraries shipped by NVIDIA's wheels (``nvidia/*/lib``), newest first."""
    try:
        import nvidia  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return []
    found: list[str] = []
    for root in getattr(nvidia, "__path__", []):
        found += sorted(map(str, Path(root).glob("*/lib/libcudart.so.*")), reverse=True)
    return found


def cuda_runtime() -> CudaRuntime:
    """The CUDA runtime torch has loaded (initializing torch's CUDA first), cached.

    Raises:
        CudaRuntimeUnavailable: no CUDA device, no CUDA build of torch, or its runtime library
            cannot be found or lacks an entry point; the message says which.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            import torch
        except ImportError as exc:
            raise CudaRuntimeUnavailable(f"torch does not import: {exc}") from exc
        if not torch.cuda.is_available():
            raise CudaRuntimeUnavailable("torch sees no CUDA device")
        torch.cuda.init()  # type: ignore[no-untyped-call]  # maps the runtime library
        try:
            path = loaded_runtime_path(Path("/proc/self/maps").read_text())
        except OSError as exc:
            raise CudaRuntimeUnavailable(f"cannot read /proc/self/maps: {exc}") from exc
        failures = []
        # The mapped file itself (the same library torch uses); else the process's global
        # symbols, where torch's wheels preload the runtime with RTLD_GLOBAL; else the runtime
        # of the NVIDIA wheels beside torch (streams and contexts are the driver's: shared).
        for candidate in [path, None, *_wheel_runtimes()] if path else [None, *_wheel_runtimes()]:
            try:
                _loaded = CudaRuntime(ctypes.CDLL(candidate), candidate or "(process symbols)")
                break
            except (OSError, AttributeError) as exc:
                failures.append(f"{candidate or 'process symbols'}: {exc}")
        else:
            raise CudaRuntimeUnavailable(
                "no usable CUDA runtime library in this process (" + "; ".join(failures) + ")"
            )
        logger.debug("CUDA runtime for direct copies: %s", _loaded.path)
        return _loaded
