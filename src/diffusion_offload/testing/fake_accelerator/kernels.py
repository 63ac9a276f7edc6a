"""The kernels ``install()`` registers with ``torch.library``: the ``fakegpu`` factory,
copy and scalar-read kernels that run below Python dispatch, and the CPU kernels of pinning
(``aten::_pin_memory``, ``aten::is_pinned``).
"""

from __future__ import annotations

import torch

from .counters import _count_copy, _count_op, _counters
from .device import (
    FakeDeviceTensor,
    _aten,
    _copy_accesses,
    _dispatch,
    _dispatch_transfer_plain,
    _is_host_tensor,
    _nbytes,
    _unwrap,
)
from .host_races import _after_transfer, _host_begin, _host_note, _host_pending, _mark_pinned
from .races import _begin_op, _note_kernel_write, _raise_deferred
from .state import _current, _lock, state


@torch.compiler.disable
def _empty_memory_format(
    size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    inner = torch.empty(
        size,
        dtype=dtype,
        layout=layout or torch.strided,
        memory_format=memory_format or torch.contiguous_format,
    )
    return FakeDeviceTensor(inner)


@torch.compiler.disable
def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    inner = torch.empty_strided(size, stride, dtype=dtype, layout=layout or torch.strided)
    return FakeDeviceTensor(inner)


@torch.compiler.disable
def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::_copy_from`` for copies that reach the backend below Python dispatch
    (``torch.tensor(data, device="fakegpu")`` copies this way): one device op, and a host
    wait when it copies to the host."""
    out = _copy_from_uncounted(self, dst, non_blocking)
    _count_op(_is_host_tensor(dst) and not _is_host_tensor(self))
    return out


def _copy_from_uncounted(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """``_copy_from`` without counting it (``_count_op``)."""
    host_side = _is_host_tensor(self) != _is_host_tensor(dst)
    if state.model_on:
        if state.deferred:
            _raise_deferred()
        T = _current()
        accesses, transfer, op = _copy_accesses(dst, self)
        host = (self if transfer == "h2d" else dst) if host_side else None
        pinned, non_blocking = _host_begin(T, host, transfer == "d2h", non_blocking, op)
        seq = _begin_op(T, accesses, op)
        _copy_from_plain(self, dst)
        if pinned and non_blocking:
            _host_note(T, seq, host, transfer == "d2h", op)
        if transfer is not None:
            _after_transfer(T, _nbytes(dst), non_blocking)
        return dst
    if host_side and (non_blocking or _host_pending):
        _dispatch_transfer_plain(_aten.copy_.default, (dst, self, non_blocking), {})
        return dst
    return _copy_from_plain(self, dst)


def _copy_from_plain(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if isinstance(dst, FakeDeviceTensor) and _is_host_tensor(self):
        _count_copy("h2d", _nbytes(dst))
    elif _is_host_tensor(dst) and isinstance(self, FakeDeviceTensor):
        _count_copy("d2h", _nbytes(dst))
    _unwrap(dst).copy_(_unwrap(self))
    return dst


@torch.compiler.disable
def _arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::arange.start_step`` (and ``.start``): PyTorch's composite fills an empty
    tensor through ``arange.out``, whose resize a wrapper tensor cannot show (its sizes
    are fixed at creation); build the result whole."""
    out = FakeDeviceTensor(torch.arange(start, end, step, dtype=dtype))
    _note_kernel_write(out, "aten.arange")
    _count_op(False)
    return out


@torch.compiler.disable
def _arange_end(end, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::arange``: see ``_arange``."""
    out = FakeDeviceTensor(torch.arange(end, dtype=dtype))
    _note_kernel_write(out, "aten.arange")
    _count_op(False)
    return out


@torch.compiler.disable
def _linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::linspace``, built whole for the same reason as ``_arange``."""
    out = FakeDeviceTensor(torch.linspace(start, end, steps, dtype=dtype))
    _note_kernel_write(out, "aten.linspace")
    _count_op(False)
    return out


@torch.compiler.disable
def _local_scalar_dense(self: torch.Tensor) -> bool | int | float | complex:
    """``aten::_local_scalar_dense`` below Python dispatch: ``torch.tensor([t[i]])`` with a
    device scalar reads it back this way, as CUDA does. One device->host read of the
    element, counted like ``.item()`` (a D2H copy, a device op and a host wait)."""
    return _dispatch(_aten._local_scalar_dense.default, (self,), {})


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    out = torch.empty_like(self, memory_format=torch.preserve_format)
    out.copy_(self)
    _mark_pinned(out)
    return out


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    if self.device.type != "cpu":
        return False
    with _lock:
        return self.untyped_storage().data_ptr() in _counters.pinned


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_autograd(*args, **kwargs):
    """``aten::scaled_dot_product_attention`` at ``AutogradPrivateUse1``.

    The op is ``CompositeImplicitAutograd``: PyTorch decomposes it before the backend
    sees it, by ``_fused_sdp_choice_stub``, a C++ registry a Python backend cannot fill.
    On ``fakegpu`` that choice is always the math decomposition (scaled ``bmm``, softmax,
    ``bmm``), outside inference mode only: under ``inference_mode`` the whole op reaches
    the fake, which runs the host's fused kernel. The two give different bits, and
    neither matched the host run everywhere. CUDA runs one fused kernel whatever the
    grad mode. So when no gradient is needed (grad mode off, or no argument requires
    grad), the op goes below autograd whole: one device op that computes exactly what
    the same call on CPU computes. When one is needed, PyTorch's decomposition runs as
    before, with its backward.
    """
    if torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())
    ):
        return _SDPA.decompose(*args, **kwargs)
    with torch._C._AutoDispatchBelowAutograd():
        return _SDPA(*args, **kwargs)
