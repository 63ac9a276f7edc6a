"""Host memory for host copies: pin storages in place, check what the host can hold.

Pinning in place registers an existing host storage with the device driver (CUDA:
``cudaHostRegister`` through ``torch.cuda.cudart()``) instead of allocating a pinned copy:
no second copy of the weights ever exists, and CUDA's caching host allocator does not
round each block up to a power of two (``Tensor.pin_memory()`` does). A registration
lives as long as the storage: it is undone (``cudaHostUnregister``) when the storage is
freed, so weights stay pinned after ``disable()`` and nothing stays registered after the
memory is gone.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .platform import Platform

__all__ = ["available_host_bytes", "locked_memory_limit", "pin_in_place", "unpin_in_place"]

# re-entrant: creating a finalizer may run the garbage collector, whose finalizers
# (another storage's ``_unregister``) take this lock on the same thread
_lock = threading.RLock()
# (device type, storage data pointer) -> (the storage, weakly; its finalizer; its id)
_registered: dict[tuple[str, int], tuple[weakref.ref, weakref.finalize, int]] = {}


def pin_in_place(platform: Platform, storage: torch.UntypedStorage) -> bool:
    """Register ``storage`` (host memory) as pinned for ``platform``'s device, in place.

    Returns True when the storage is pinned (now or already), False when the platform
    cannot register it (no in-place pinning, a read-only memory map, the driver refused):
    the caller keeps it pageable. A registration left by a dead storage at the same
    address (its finalizer not yet run) is undone first.
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
        if not platform.host_register(ptr, nbytes):
            return False
        fin = weakref.finalize(storage, _unregister, platform, key, id(storage))
        _registered[key] = (weakref.ref(storage), fin, id(storage))
    return True


def unpin_in_place(platform: Platform, storage: torch.UntypedStorage) -> None:
    """Undo ``pin_in_place`` for ``storage`` now (a rolled-back ``enable``)."""
    key = (platform.device.type, storage.data_ptr())
    with _lock:
        entry = _registered.get(key)
    if entry is not None and entry[0]() is storage:
        entry[1]()


def _unregister(platform: Platform, key: tuple[str, int], owner: int) -> None:
    with _lock:
        entry = _registered.get(key)
        if entry is None or entry[2] != owner:  # undone already, or a newer storage's
            return
        del _registered[key]
    platform.host_unregister(key[1])


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
