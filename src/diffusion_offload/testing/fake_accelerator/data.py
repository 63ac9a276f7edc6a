"""``t.data = new`` across host and ``fakegpu`` tensors, as on CUDA (``install()`` puts
``_data_get``/``_data_set`` on ``torch.Tensor`` as the ``data`` property).
"""

from __future__ import annotations

import torch

from .device import FakeDeviceTensor

_TENSOR_DATA = torch._C.TensorBase.data  # the C++ getset descriptor


def _data_get(self: torch.Tensor) -> torch.Tensor:
    return _TENSOR_DATA.__get__(self)


def _data_set(self: torch.Tensor, new: torch.Tensor) -> None:
    """``t.data = new`` as CUDA behaves, also across host and ``fakegpu`` tensors.

    PyTorch refuses ``set_data`` between CPU and PrivateUse1 tensors ("incompatible
    tensor type": its shallow-copy compatibility list leaves PrivateUse1 out), while
    CPU<->CUDA works. Across that boundary, ``t`` is pointed at an alias of ``new``'s
    storage with ``torch.utils.swap_tensors`` (identity and Parameter-ness kept).
    Between two fake tensors the payload is rebound too (``set_data`` alone copies only
    the wrapper's metadata).
    """
    fake_self, fake_new = isinstance(self, FakeDeviceTensor), isinstance(new, FakeDeviceTensor)
    if fake_self != fake_new:
        _rebind_across(self, new)
        return
    _TENSOR_DATA.__set__(self, new)
    if fake_self:
        self._inner = new._inner


_HOST_CLASS = "_fakegpu_host_class"
_device_classes: dict[type, type] = {}


def _device_class(host_class: type) -> type:
    """The class a tensor of ``host_class`` has on the fake device.

    Plain tensors and Parameters become ``FakeDeviceTensor``. A subclass (diffusers'
    ``GGUFParameter``, a quantized Parameter) keeps being an instance of it, as with
    ``.data =`` on CUDA: the device class derives from both ``FakeDeviceTensor`` (for
    the device's dispatch) and ``host_class`` (its methods, ``__torch_function__`` and
    attributes). When the subclass re-wraps an op's result as ``cls(result, **kw)``, the
    result gets the attributes ``host_class``'s constructor computes for those arguments.
    """
    if host_class in (torch.Tensor, torch.nn.Parameter) or issubclass(host_class, FakeDeviceTensor):
        return FakeDeviceTensor
    cls = _device_classes.get(host_class)
    if cls is None:

        def __new__(cls, data=None, *args, **kwargs):  # noqa: N807
            inner = data._inner if isinstance(data, FakeDeviceTensor) else data
            out = FakeDeviceTensor.__new__(cls, inner)
            with torch.inference_mode(False), torch.no_grad():
                model = host_class(inner.detach(), *args, **kwargs)
            out.__dict__.update({k: v for k, v in model.__dict__.items() if k != "_inner"})
            out.__dict__[_HOST_CLASS] = host_class
            return out

        cls = type(
            f"FakeDevice{host_class.__name__}",
            (FakeDeviceTensor, host_class),
            {"__new__": __new__, "__module__": __name__},
        )
        _device_classes[host_class] = cls
    return cls


def _rebind_across(self: torch.Tensor, new: torch.Tensor) -> None:
    """``self.data = new`` across host and ``fakegpu``, as ``set_data`` does on CUDA.

    The object ``self`` keeps its identity, its attributes, Parameter-ness and
    ``requires_grad``, and it works whoever else references ``self`` (a live autograd
    graph, weakrefs from compiled code): the payload is exchanged at the ``TensorImpl``
    level (``torch._C._swap_tensor_impl``), which, unlike ``torch.utils.swap_tensors``,
    does not refuse shared tensors. References taken earlier (an autograd graph's saved
    tensors) keep the old payload, as ``set_data`` leaves them the old storage on CUDA.
    ``self`` gets a version counter of its own, not ``new``'s: ``set_data`` keeps the
    target's counter, so two Parameters rebound to views of one buffer do not bump each
    other's ``_version``.
    """
    requires_grad = self.requires_grad
    is_param = isinstance(self, torch.nn.Parameter)
    attrs = {k: v for k, v in self.__dict__.items() if k not in ("_inner", _HOST_CLASS)}
    if isinstance(self, FakeDeviceTensor):  # born on the device: its host class by kind
        host_class = self.__dict__.get(
            _HOST_CLASS, torch.nn.Parameter if is_param else torch.Tensor
        )
    else:
        host_class = type(self)
    with torch.inference_mode(False), torch.no_grad():
        alias = _fresh_alias(new)
    torch._C._swap_tensor_impl(self, alias)
    if isinstance(new, FakeDeviceTensor):
        self.__class__ = _device_class(host_class)
        attrs["_inner"] = alias.__dict__["_inner"]
        attrs[_HOST_CLASS] = host_class
        attrs["_is_param"] = is_param
    else:
        self.__class__ = host_class
        attrs.pop("_is_param", None)
    self.__dict__.clear()
    self.__dict__.update(attrs)
    if self.requires_grad != requires_grad:
        self.requires_grad_(requires_grad)


def _fresh_alias(new: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``new``'s memory with a version counter of its own: ``.data``
    (``detach`` would share ``new``'s counter, and with it the counter of every view of
    ``new``'s base)."""
    return _data_get(new)
