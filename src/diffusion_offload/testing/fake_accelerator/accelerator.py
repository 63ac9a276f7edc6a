"""``torch.accelerator``'s memory, stream and synchronize calls, answered for ``fakegpu``.

PyTorch routes ``torch.accelerator.memory_stats()``, ``memory_allocated()``,
``max_memory_allocated()``, ``memory_reserved()``, ``max_memory_reserved()``,
``reset_peak_memory_stats()``, ``reset_accumulated_memory_stats()``, ``empty_cache()``,
``empty_host_cache()`` and ``get_memory_info()`` through ``torch._C._accelerator_*`` bindings to the C++
``c10::DeviceAllocator`` registered for the device type. Only a C++ extension can register
one (``c10::SetAllocator`` with a ``DeviceAllocator`` subclass); a backend registered from
Python (``_setup_privateuseone_for_python_backend``) has none, and every one of those calls
fails with ``INTERNAL ASSERT FAILED ... Allocator for fakegpu is not a DeviceAllocator``
(``empty_host_cache()``, once a ``fakegpu`` tensor exists, crashes the process).
Likewise ``torch.accelerator.synchronize()``, ``current_stream()`` and ``set_stream()`` go
to the Python backend's C++ device guard, whose streams are hard-wired to one default
stream: ``synchronize()`` raises, and ``current_stream()`` never sees a side stream.

``patch()`` (called by ``install()``) replaces those ``torch._C._accelerator_*`` entry
points, the layer every ``torch.accelerator`` function reads at call time (so a function
imported before ``install()`` is covered too), with wrappers that answer from the fake
device (``counters``, ``streams``) when the current accelerator is ``fakegpu`` and call
PyTorch's own binding otherwise. Nothing else of PyTorch is changed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .counters import (
    memory_stats_nested,
    reset_accumulated_memory_stats,
    reset_peak,
    stats,
)
from .state import DEVICE_TYPE
from .streams import _as_stream, _check_device, current_stream, set_stream, synchronize

#: what ``get_memory_info`` reports as total memory when no capacity is set (bytes)
UNLIMITED_TOTAL = 1 << 50

_originals: dict[str, Callable[..., Any]] = {}


def _ours() -> bool:
    """Whether ``torch.accelerator`` currently serves the fake device."""
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == DEVICE_TYPE


def _device(index: Any) -> None:
    """Check a device index given to ``torch._C._accelerator_*`` (the fake has index 0).

    Raises:
        ValueError: ``index`` names another device.
    """
    if isinstance(index, int) and index == -1:
        return  # "the current device"
    _check_device(index)


def memory_info() -> tuple[int, int]:
    """``(free, total)`` device bytes: ``total`` is the capacity (``set_capacity``), or
    ``UNLIMITED_TOTAL`` when none is set; ``free`` is ``total - allocated_bytes``, at
    least 0."""
    s = stats()
    total = s["capacity"] if s["capacity"] >= 0 else UNLIMITED_TOTAL
    return max(total - s["allocated_bytes"], 0), total


def _is_allocator_initialized() -> bool:
    return True


def _empty_cache() -> None:
    return None  # no caching allocator: freed memory is returned at once


def _empty_host_cache() -> None:
    # pinned host memory is ordinary host memory marked pinned (host_races): nothing is
    # cached. PyTorch's own binding dereferences the Python backend's missing host
    # allocator and crashes the process once fakegpu has been used.
    return None


def _get_device_stats(index: int) -> dict[str, Any]:
    _device(index)
    return memory_stats_nested()


def _reset_accumulated(index: int) -> None:
    _device(index)
    reset_accumulated_memory_stats()


def _reset_peak(index: int) -> None:
    _device(index)
    reset_peak()


def _get_memory_info(index: int) -> tuple[int, int]:
    _device(index)
    return memory_info()


def _synchronize_device(index: int) -> None:
    _device(index)
    synchronize()


def _get_stream(index: int) -> torch.Stream:
    _device(index)
    return current_stream()


def _set_stream(s: torch.Stream) -> None:
    set_stream(_as_stream(s))


# binding name -> the fake's answer (same arguments as the binding)
_ANSWERS: dict[str, Callable[..., Any]] = {
    "_accelerator_isAllocatorInitialized": _is_allocator_initialized,
    "_accelerator_emptyCache": _empty_cache,
    "_accelerator_emptyHostCache": _empty_host_cache,
    "_accelerator_getDeviceStats": _get_device_stats,
    "_accelerator_resetAccumulatedStats": _reset_accumulated,
    "_accelerator_resetPeakStats": _reset_peak,
    "_accelerator_getMemoryInfo": _get_memory_info,
    "_accelerator_synchronizeDevice": _synchronize_device,
    "_accelerator_getStream": _get_stream,
}


def _routed(name: str, answer: Callable[..., Any]) -> Callable[..., Any]:
    original = _originals[name]

    def call(*args: Any) -> Any:
        return answer(*args) if _ours() else original(*args)

    call.__name__ = name
    call.__doc__ = (
        f"``torch._C.{name}``, answered by the fake device when the current accelerator "
        f"is {DEVICE_TYPE!r} (``fake_accelerator.accelerator``), else PyTorch's own."
    )
    return call


def _set_stream_routed(s: torch.Stream) -> None:
    """``torch._C._accelerator_setStream``: a ``fakegpu`` stream becomes the fake device's
    current stream; any other stream goes to PyTorch's own binding."""
    if isinstance(s, torch.Stream) and s.device_type == int(torch._C._autograd.DeviceType.PrivateUse1):
        _set_stream(s)
        return
    _originals["_accelerator_setStream"](s)


def patch() -> None:
    """Route ``torch.accelerator``'s memory, stream and synchronize calls to the fake
    device while it is the current accelerator (idempotent; ``install()`` calls it).

    A binding missing from this PyTorch build is left alone (its ``torch.accelerator``
    function does not exist there either).
    """
    if _originals:
        return
    for name, answer in _ANSWERS.items():
        original = getattr(torch._C, name, None)
        if original is None:
            continue
        _originals[name] = original
        setattr(torch._C, name, _routed(name, answer))
    original = getattr(torch._C, "_accelerator_setStream", None)
    if original is not None:
        _originals["_accelerator_setStream"] = original
        torch._C._accelerator_setStream = _set_stream_routed
