"""Host memory for host copies: pin storages in place, check what the host can hold.

Pinning in place registers an existing host storage with the device driver (CUDA:
``cudaHostRegister`` through ``torch.cuda.cudart()``) instead of allocating a pinned copy:
no second copy of the weights ever exists, and CUDA's caching host allocator does not
round each block up to a power of two (``Tensor.pin_memory()`` does). A registration
lives as long as the storage: it is undone (``cudaHostUnregister``) when the storage is
freed, so weights stay pinned after ``disable()`` and nothing stays registered after the
memory is gone.

No single registration is larger than ``PIN_CHUNK`` (1 GiB): a larger storage is
registered in pieces cut at multiples of ``PIN_CHUNK`` (page-aligned addresses, so no two
pieces share a page). Pinning one buffer of 12 GiB or more fails on some drivers
(vllm-omni #2748).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .platform import Platform

__all__ = [
    "PIN_CHUNK",
    "available_host_bytes",
    "caching_host_bytes",
    "charge_while_alive",
    "host_buffer",
    "PAGE_CACHE",
    "check_page_cache",
    "locked_memory_limit",
    "page_out",
    "pin_in_place",
    "pin_pieces",
    "unpin_in_place",
]

PIN_CHUNK = 1 << 30
"""The largest single pin (``host_register`` or ``pin_memory``), in bytes (1 GiB): a
multiple of the page size. Tests lower it."""

# re-entrant: creating a finalizer may run the garbage collector, whose finalizers
# (another storage's ``_unregister``) take this lock on the same thread
_lock = threading.RLock()
# (device type, storage data pointer) -> (the storage, weakly; its finalizer; its id)
# (the finalizer unregisters every piece)
_registered: dict[tuple[str, int], tuple[weakref.ref, weakref.finalize, int]] = {}


def pin_pieces(ptr: int, nbytes: int) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the pieces ``[ptr, ptr + nbytes)`` is registered in: cut at
    every multiple of ``PIN_CHUNK``, so each is at most ``PIN_CHUNK`` bytes."""
    chunk = PIN_CHUNK
    pieces = []
    start, end = ptr, ptr + nbytes
    while start < end:
        cut = min((start // chunk + 1) * chunk, end)
        pieces.append((start, cut - start))
        start = cut
    return pieces


def pin_in_place(platform: Platform, storage: torch.UntypedStorage) -> bool:
    """Register ``storage`` (host memory) as pinned for ``platform``'s device, in place,
    in pieces of at most ``PIN_CHUNK`` bytes (``pin_pieces``).

    Returns True when the storage is pinned (now or already), False when the platform
    cannot register it (no in-place pinning, a read-only memory map, the driver refused
    a piece: the pieces registered are undone): the caller keeps it pageable. A
    registration left by a dead storage at the same address (its finalizer not yet run)
    is undone first.
    """
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if ptr == 0 or nbytes == 0:
        return False
    key = (platform.device.type, ptr)
    with _lock:
        entry = _registered.get(key)
        if entry is not None:
            if entry[0]() is storage:
                return True
            entry[1]()  # stale: the memory was freed and reused
        pieces = pin_pieces(ptr, nbytes)
        done: list[int] = []
        for start, n in pieces:
            if not platform.host_register(start, n):
                for p in done:
                    platform.host_unregister(p)
                return False
            done.append(start)
        fin = weakref.finalize(storage, _unregister, platform, key, id(storage), tuple(done))
        _registered[key] = (weakref.ref(storage), fin, id(storage))
    return True


def unpin_in_place(platform: Platform, storage: torch.UntypedStorage) -> None:
    """Undo ``pin_in_place`` for ``storage`` now (a rolled-back ``enable``)."""
    key = (platform.device.type, storage.data_ptr())
    with _lock:
        entry = _registered.get(key)
    if entry is not None and entry[0]() is storage:
        entry[1]()


def _unregister(platform: Platform, key: tuple[str, int], owner: int, pieces: tuple[int, ...]) -> None:
    with _lock:
        entry = _registered.get(key)
        if entry is None or entry[2] != owner:  # undone already, or a newer storage's
            return
        del _registered[key]
    for start in pieces:
        platform.host_unregister(start)


def caching_host_bytes(nbytes: int) -> int:
    """The pinned bytes ``Tensor.pin_memory()`` (and a non-blocking copy to a fresh host
    tensor) takes for ``nbytes``: PyTorch's caching host allocator rounds every block up to
    the next power of two (``aten/src/ATen/core/CachingHostAllocator.h``, ``allocate``:
    ``c10::llvm::PowerOf2Ceil(size)``; SGLang measured 1.67x growth from it,
    sgl-project/sglang #39021), and keeps a freed block cached for the next allocation of
    its size class. An in-place registration (``pin_in_place``) does not go through that
    allocator: it pins exactly the storage's bytes."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def host_buffer(
    numel: int,
    dtype: torch.dtype,
    platform: Platform,
    pin: bool,
    charge: Callable[[int], None],
) -> torch.Tensor:
    """A fresh host tensor ``(numel,)`` of ``dtype`` for our own use (a staging buffer,
    the write check's sums and weights), pinned when ``pin``, every pinned byte charged.

    Pinning is in place where the platform registers host memory (``pin_in_place``: the
    charge is the buffer's bytes, no rounding), else by ``pin_memory()`` (the charge is
    ``caching_host_bytes``: the caching allocator's power of two), else the buffer stays
    pageable (no charge). ``charge(nbytes)`` is called with the pinned bytes now and with
    their negation when the storage is freed (``weakref.finalize``), so a gauge fed by it
    counts exactly the pinned buffers alive.
    """
    buf = torch.empty(numel, dtype=dtype)
    if not pin or numel == 0 or not platform.supports_pinning:
        return buf
    nbytes = numel * buf.element_size()
    if pin_in_place(platform, buf.untyped_storage()):
        charged = nbytes
    else:
        try:
            buf = buf.pin_memory()
        except RuntimeError:  # no pinning here: pageable, the copies are then synchronous
            return buf
        charged = caching_host_bytes(nbytes)
    charge_while_alive(buf, charged, charge)
    return buf


def charge_while_alive(t: torch.Tensor, nbytes: int, charge: Callable[[int], None]) -> None:
    """``charge(nbytes)`` now and ``charge(-nbytes)`` once host tensor ``t``'s storage is
    freed (``weakref.finalize``); nothing for 0 bytes."""
    if nbytes:
        charge(nbytes)
        weakref.finalize(t.untyped_storage(), charge, -nbytes)


def available_host_bytes() -> int | None:
    """Host memory available to new allocations, in bytes (``psutil``: MemAvailable on Linux)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return None
    return int(psutil.virtual_memory().available)


def locked_memory_limit() -> int | None:
    """The process's ``RLIMIT_MEMLOCK`` soft limit in bytes, or None when unlimited."""
    try:
        import resource
    except ImportError:  # not a Unix host
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


_MADV_PAGEOUT = 21  # Linux 5.4+ (include/uapi/asm-generic/mman-common.h)
_PAGE = 4096


def page_out(t: torch.Tensor) -> bool:
    """Ask the kernel to reclaim the pages of host tensor ``t``'s bytes from this process
    (``madvise(MADV_PAGEOUT)`` on the whole pages inside its span): clean file-backed pages
    are dropped from the process (they no longer count in its RssFile, and the page cache
    may then drop them), dirty or anonymous pages are written to swap, never lost (unlike
    ``MADV_DONTNEED``, which would discard a private page a caller wrote into). Source:
    madvise(2). Returns False where the call is not available or refused (older kernels:
    EINVAL); nothing changes then."""
    start = t.data_ptr()
    nbytes = t.numel() * t.element_size()
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + nbytes) // _PAGE * _PAGE
    if t.device.type != "cpu" or hi <= lo:
        return False
    libc = _libc()
    if libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_PAGEOUT) == 0


@functools.cache
def _libc() -> Any:
    """The C library (``madvise``), loaded once; None where there is none to load."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise  # noqa: B018 - raises AttributeError where it is missing
    except (OSError, AttributeError):
        return None
    return libc


PAGE_CACHE = ("auto", "drop", "keep")
"""The ``page_cache`` settings of a host budget's disk-backed loads: ``"drop"`` the file
pages a load read (``POSIX_FADV_DONTNEED`` after its copy: a cgroup's memory limit counts
page cache, so they must not pile up there), ``"keep"`` them (the next request reads them
from RAM), ``"auto"``: drop under a cgroup memory limit, else keep."""


def check_page_cache(value: object) -> str:
    """Validate a ``page_cache`` setting (``PAGE_CACHE``).

    Raises:
        ValueError: naming the field, the value and what is allowed.
    """
    if not isinstance(value, str) or value not in PAGE_CACHE:
        raise ValueError(f"page_cache must be one of {', '.join(map(repr, PAGE_CACHE))}, got {value!r}")
    return value
