"""One small platform interface for every accelerator offload runs on.

A ``Platform`` knows its device, how to synchronize it, how to empty its cache, its
memory statistics (bytes), whether host memory can be pinned for it, and whether
device->host copies must be blocking. ``platform_for(device)`` picks the implementation:

=========  =====================  ==============  ==============
type       torch module           pinned memory   blocking D2H
=========  =====================  ==============  ==============
cuda       ``torch.cuda``         yes             no  (ROCm builds report "cuda" too)
xpu        ``torch.xpu``          yes             yes (its allocator cannot evict storage
                                                        while an async copy is pending)
npu        ``torch.npu``          yes             no  (needs ``torch_npu``)
mps        ``torch.mps``          no (unified)    no
fakegpu    ``torch.fakegpu``      yes (simulated) no  (``diffusion_offload.testing``)
cpu        none                   no              no  (offload is a no-op)
=========  =====================  ==============  ==============

The cuda path runs on real GPUs in ``bench/gpu_check.py``; the xpu, npu and mps paths are
exercised in the unit tests against a mocked torch module only (no such hardware here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MemoryStats", "Platform", "normalize_device", "platform_for", "same_device"]


@dataclass(frozen=True)
class MemoryStats:
    """Device memory statistics in bytes; ``None`` where the platform cannot tell."""

    allocated_bytes: int
    peak_bytes: int
    free_bytes: int | None
    total_bytes: int | None


def normalize_device(device: str | torch.device | int) -> torch.device:
    """Return ``device`` as a ``torch.device`` with an explicit index (``cuda`` -> ``cuda:0``).

    ``torch.device("cuda") != torch.device("cuda", 0)``, so every comparison in this
    package goes through this function. ``cpu`` keeps no index. An int means ``cuda:N``.

    Raises:
        TypeError: ``device`` is not a str, int or torch.device.
        RuntimeError: the string is not a device torch knows.
    """
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"device must be a str, int or torch.device, got {device!r}")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        module = getattr(torch, device.type, None)
        index = 0
        if module is not None and hasattr(module, "current_device"):
            try:
                index = int(module.current_device())
            except Exception:  # an uninitialised backend: index 0 is the default
                index = 0
        device = torch.device(device.type, index)
    return device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality with a missing index read as 0 (``cuda`` == ``cuda:0``)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class Platform:
    """Device-specific operations used by the offload engine.

    Attributes:
        device: the normalized device (``cuda:0``, ``fakegpu:0``, ``cpu``...).
        supports_pinning: host copies may be pinned for faster, asynchronous H2D.
        blocking_d2h: device->host copies must be synchronous (XPU).
        is_noop: offload does nothing on this platform (CPU: host and device are one).
        locks_host_memory: pinning page-locks real host memory (the process's
            ``RLIMIT_MEMLOCK`` may matter); False for the simulated fake device.
        has_streams: the device module has ``Stream``/``Event``/``stream()`` with
            ``torch.cuda``'s semantics (CUDA, XPU, NPU, the fake device); layer mode then
            copies on a side stream. Elsewhere copies are synchronous.
    """

    supports_pinning: bool = False
    has_streams: bool = False
    locks_host_memory: bool = True
    blocking_d2h: bool = False
    is_noop: bool = False

    def __init__(self, device: torch.device, module: Any = None) -> None:
        self.device = device
        self._module = module if module is not None else getattr(torch, device.type, None)

    @property
    def name(self) -> str:
        """The device type, e.g. ``"cuda"``."""
        return self.device.type

    def synchronize(self) -> None:
        """Wait until all queued work on the device has finished."""
        self._module.synchronize(self.device)

    def empty_cache(self) -> None:
        """Release cached, unused device memory back to the driver."""
        self._module.empty_cache()

    def memory_stats(self) -> MemoryStats:
        """Allocated, peak, free and total device bytes."""
        mod = self._module
        free = total = None
        if hasattr(mod, "mem_get_info"):
            free, total = (int(x) for x in mod.mem_get_info(self.device))
        return MemoryStats(
            int(mod.memory_allocated(self.device)),
            int(mod.max_memory_allocated(self.device)),
            free,
            total,
        )

    def reset_peak_memory(self) -> None:
        """Make the peak equal to the currently allocated bytes."""
        self._module.reset_peak_memory_stats(self.device)

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """Pin ``nbytes`` of existing host memory at address ``ptr`` in place.

        Returns False where the platform cannot (the default): callers then copy into
        pinned memory per tensor, or stay pageable.
        """
        return False

    def host_unregister(self, ptr: int) -> None:
        """Undo ``host_register(ptr, ...)``."""
        return None

    # -- streams (``has_streams`` platforms; None / no-ops elsewhere) ------------------

    def storage_key(self, t: torch.Tensor) -> int:
        """The identity of the device allocation ``t`` views (its ``StorageImpl``'s
        address): equal for all views of one allocation while it lives. Host-side only."""
        return t.untyped_storage()._cdata

    def new_stream(self) -> Any:
        """A new side stream on the device (``torch.cuda.Stream(device)``), or None."""
        if not self.has_streams:
            return None
        return self._module.Stream(device=self.device)

    def current_stream(self) -> Any:
        """The stream device work is queued on now (``torch.cuda.current_stream``), or None."""
        if not self.has_streams:
            return None
        return self._module.current_stream(self.device)

    def new_event(self) -> Any:
        """A new event (``torch.cuda.Event()``), or None."""
        if not self.has_streams:
            return None
        return self._module.Event()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Queue device work of the ``with`` body on ``stream`` (None: the current one)."""
        if stream is None or not self.has_streams:
            yield
            return
        with self._module.stream(stream):
            yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class CudaPlatform(Platform):
    """NVIDIA CUDA and AMD ROCm (HIP builds expose the ``cuda`` device type)."""

    supports_pinning = True
    has_streams = True

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """``cudaHostRegister(ptr, nbytes, cudaHostRegisterDefault)``; False on any error."""
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
        except Exception:  # no runtime bindings in this build
            return False
        if int(err) != 0:
            if hasattr(cudart, "cudaGetLastError"):
                cudart.cudaGetLastError()  # clear it, so no later launch check reports it
            return False
        return True

    def host_unregister(self, ptr: int) -> None:
        """``cudaHostUnregister(ptr)``."""
        torch.cuda.cudart().cudaHostUnregister(ptr)


class XpuPlatform(Platform):
    """Intel XPU. Device->host copies are blocking (mocked in tests; no XPU here)."""

    supports_pinning = True
    has_streams = True
    blocking_d2h = True


class NpuPlatform(Platform):
    """Ascend NPU through ``torch_npu`` (mocked in tests; no NPU here)."""

    supports_pinning = True
    has_streams = True


class MpsPlatform(Platform):
    """Apple MPS: unified memory, so no pinning (mocked in tests; no Mac here)."""

    def synchronize(self) -> None:
        self._module.synchronize()

    def memory_stats(self) -> MemoryStats:
        mod = self._module
        allocated = int(mod.current_allocated_memory())
        total = int(mod.recommended_max_memory()) if hasattr(mod, "recommended_max_memory") else None
        free = None if total is None else max(total - int(mod.driver_allocated_memory()), 0)
        return MemoryStats(allocated, allocated, free, total)

    def reset_peak_memory(self) -> None:
        return None


class FakePlatform(Platform):
    """The test accelerator of ``diffusion_offload.testing.fake_accelerator`` (``torch.fakegpu``)."""

    supports_pinning = True
    locks_host_memory = False

    @property
    def has_streams(self) -> bool:  # type: ignore[override]
        """The fake device models streams and events (and catches races between them)."""
        return hasattr(self._module, "Stream")

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """Simulated in-place pinning: the storage at ``ptr`` reports ``is_pinned()``."""
        return bool(self._module.host_register(ptr, nbytes))

    def host_unregister(self, ptr: int) -> None:
        """Undo the simulated registration."""
        self._module.host_unregister(ptr)

    def storage_key(self, t: torch.Tensor) -> int:
        """The allocation a ``fakegpu`` tensor views (its wrapper's own storage is not it)."""
        return int(self._module.storage_key(t))


class CpuPlatform(Platform):
    """Host only: nothing to offload to, every operation is a no-op."""

    is_noop = True

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(0, 0, None, None)

    def reset_peak_memory(self) -> None:
        return None


_PLATFORMS: dict[str, type[Platform]] = {
    "cuda": CudaPlatform,
    "xpu": XpuPlatform,
    "npu": NpuPlatform,
    "mps": MpsPlatform,
    "fakegpu": FakePlatform,
    "cpu": CpuPlatform,
}


def platform_for(device: str | torch.device | int, module: Any = None) -> Platform:
    """Return the ``Platform`` for ``device``.

    Args:
        device: a device string, index or ``torch.device``.
        module: the torch device module to call (``torch.cuda``...); tests pass a mock.

    Raises:
        ValueError: the device type is not one of cuda, xpu, npu, mps, fakegpu, cpu.
    """
    dev = normalize_device(device)
    cls = _PLATFORMS.get(dev.type)
    if cls is None:
        raise ValueError(
            f"device={str(dev)!r} is not supported; allowed device types: {sorted(_PLATFORMS)}"
        )
    return cls(dev, module)
