"""The ``torch.fakegpu`` backend module and ``install()``, which registers the device
with PyTorch (PrivateUse1 renamed ``fakegpu``), its kernels, the ``.data`` property,
the host-side checks of ``Tensor.__repr__``/``tolist`` and the ``torch.accelerator``
answers of ``accelerator.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import accelerator, autocast
from .counters import (
    _counters,
    memory_stats_nested,
    reset_accumulated_memory_stats,
    reset_peak,
    stats,
)
from .data import _data_get, _data_set
from .device import storage_key
from .host_races import _ensure_host_mode, _host_repr, _host_tolist, _unpin, pinned_host_bytes
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
    _sdpa_autograd,
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
    def get_rng_state(device: Any = None) -> torch.Tensor:
        """The device's RNG state: the host generator's (``torch.get_rng_state()``).

        Random ops on ``fakegpu`` tensors run on their host payloads and draw from the
        host's default generator: the fake device has no generator of its own, so
        ``torch.random.fork_rng`` (which saves and restores every device's state) works."""
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        """Restore a state from ``get_rng_state`` (into the host generator)."""
        torch.set_rng_state(new_state)

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
        """Bytes of live device storages (``stats()["allocated_bytes"]``)."""
        return stats()["allocated_bytes"]

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        """Peak of ``memory_allocated()`` since the last reset (``stats()["peak_bytes"]``)."""
        return stats()["peak_bytes"]

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        """Bytes held by the allocator: ``memory_allocated()`` (the fake caches nothing)."""
        return stats()["allocated_bytes"]

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        """Peak of ``memory_reserved()``: ``max_memory_allocated()``."""
        return stats()["peak_bytes"]

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``-style flat statistics (``"allocated_bytes.all.current"``
        ...), sorted by key; ``counters.memory_stats_nested`` documents them."""
        flat: list[tuple[str, Any]] = []

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                flat.append((prefix, value))

        walk("", memory_stats_nested())
        return dict(sorted(flat))

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """``(free, total)`` device bytes (``accelerator.memory_info``)."""
        return accelerator.memory_info()

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        reset_peak()

    @staticmethod
    def reset_max_memory_allocated(device: Any = None) -> None:
        reset_peak()

    @staticmethod
    def reset_accumulated_memory_stats(device: Any = None) -> None:
        reset_accumulated_memory_stats()

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def host_register(ptr: int, nbytes: int) -> bool:
        """Simulated ``cudaHostRegister``: the storage at ``ptr`` now reports ``is_pinned()``."""
        with _lock:
            if ptr in _counters.pinned:
                return False  # CUDA: cudaErrorHostMemoryAlreadyRegistered
            _counters.pinned[ptr] = nbytes
        return True

    @staticmethod
    def pinned_host_bytes() -> int:
        """Pinned host bytes alive now, as CUDA would hold them (``host_races.pinned_host_bytes``)."""
        return pinned_host_bytes()

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
        autograd_lib = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
        autograd_lib.impl("scaled_dot_product_attention", _sdpa_autograd)
        _libs.append(autograd_lib)
        autocast.register(_libs)
        cpu_lib = torch.library.Library("aten", "IMPL", "CPU")
        cpu_lib.impl("_pin_memory", _pin_memory)
        cpu_lib.impl("is_pinned", _is_pinned)
        _libs.extend([dev_lib, cpu_lib])
        torch.Tensor.data = property(_data_get, _data_set)  # type: ignore[assignment]
        torch.Tensor.__repr__ = _host_repr  # type: ignore[method-assign]
        torch.Tensor.tolist = _host_tolist  # type: ignore[method-assign]
        accelerator.patch()
        state.installed = True
        _ensure_host_mode()  # at the bottom of this thread's mode stack, for good
        return state.device


def is_installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return state.installed
