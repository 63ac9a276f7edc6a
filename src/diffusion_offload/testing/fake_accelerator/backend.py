"""The ``torch.fakegpu`` backend module and ``install()``, which registers the device
with PyTorch (PrivateUse1 renamed ``fakegpu``), its kernels, the ``.data`` property and
the host-side checks of ``Tensor.__repr__``/``tolist``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import autocast
from .counters import _counters, reset_peak, stats
from .data import _data_get, _data_set
from .device import storage_key
from .host_races import _ensure_host_mode, _host_repr, _host_tolist, _unpin
from .kernels import (
    _arange,
    _arange_end,
    _copy_from,
    _empty_memory_format,
    _local_scalar_dense,
    _empty_strided,
    _is_pinned,
    _linspace,
    _pin_memory,
)
from .races import RaceError
from .state import DEVICE_TYPE, _lock, state
from .streams import (
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_stream,
    stream,
    synchronize,
)

# What ``torch.fakegpu.mem_get_info`` reports as total memory when no capacity is set.
_UNLIMITED_TOTAL = 1 << 50
_libs: list[torch.library.Library] = []  # keep registrations alive


class _BackendModule:
    """The ``torch.fakegpu`` module: what PyTorch expects of a device backend module."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """The dtypes ``torch.autocast("fakegpu", dtype=...)`` accepts (CUDA's)."""
        return [torch.float16, torch.bfloat16]

    Stream = Stream
    Event = Event
    StreamContext = StreamContext
    RaceError = RaceError

    @staticmethod
    def synchronize(device: Any = None) -> None:
        synchronize()

    @staticmethod
    def current_stream(device: Any = None) -> Stream:
        return current_stream(device)

    @staticmethod
    def default_stream(device: Any = None) -> Stream:
        return default_stream(device)

    @staticmethod
    def stream(s: Stream | None) -> StreamContext:
        return stream(s)

    @staticmethod
    def set_stream(s: Stream) -> None:
        set_stream(s)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return stats()["allocated_bytes"]

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return stats()["peak_bytes"]

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        s = stats()
        total = s["capacity"] if s["capacity"] >= 0 else _UNLIMITED_TOTAL
        return max(total - s["allocated_bytes"], 0), total

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        reset_peak()

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def host_register(ptr: int, nbytes: int) -> bool:
        """Simulated ``cudaHostRegister``: the storage at ``ptr`` now reports ``is_pinned()``."""
        with _lock:
            if ptr in _counters.pinned:
                return False  # CUDA: cudaErrorHostMemoryAlreadyRegistered
            _counters.pinned.add(ptr)
        return True

    @staticmethod
    def host_unregister(ptr: int) -> None:
        """Simulated ``cudaHostUnregister``."""
        _unpin(ptr)

    @staticmethod
    def storage_key(t: torch.Tensor) -> int:
        """The identity of the allocation a ``fakegpu`` tensor views (``storage_key``)."""
        return storage_key(t)


def install() -> torch.device:
    """Register the ``fakegpu`` device (idempotent) and return ``torch.device("fakegpu:0")``.

    Raises:
        RuntimeError: PrivateUse1 is already registered under another name in this
            process (PyTorch allows one rename per process).
    """
    with _lock:
        if state.installed:
            return state.device
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(
                f"PrivateUse1 is already registered as {current!r}; the fake accelerator "
                f"needs it as {DEVICE_TYPE!r} and PyTorch allows one name per process"
            )
        from torch.utils.backend_registration import (
            _setup_privateuseone_for_python_backend,
        )

        if current != DEVICE_TYPE:
            _setup_privateuseone_for_python_backend(
                DEVICE_TYPE, backend_module=_BackendModule()
            )
        state.device = torch.device(DEVICE_TYPE, 0)
        if state.default_stream is None:
            state.default_stream = Stream._make(0)
        dev_lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
        dev_lib.impl("empty.memory_format", _empty_memory_format)
        dev_lib.impl("empty_strided", _empty_strided)
        dev_lib.impl("_copy_from", _copy_from)
        dev_lib.impl("arange", _arange_end)
        dev_lib.impl("arange.start", _arange)
        dev_lib.impl("arange.start_step", _arange)
        dev_lib.impl("linspace", _linspace)
        dev_lib.impl("_local_scalar_dense", _local_scalar_dense)
        autocast.register(_libs)
        cpu_lib = torch.library.Library("aten", "IMPL", "CPU")
        cpu_lib.impl("_pin_memory", _pin_memory)
        cpu_lib.impl("is_pinned", _is_pinned)
        _libs.extend([dev_lib, cpu_lib])
        torch.Tensor.data = property(_data_get, _data_set)  # type: ignore[assignment]
        torch.Tensor.__repr__ = _host_repr  # type: ignore[method-assign]
        torch.Tensor.tolist = _host_tolist  # type: ignore[method-assign]
        state.installed = True
        _ensure_host_mode()  # at the bottom of this thread's mode stack, for good
        return state.device


def is_installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return state.installed
