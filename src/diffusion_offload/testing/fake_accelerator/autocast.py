"""``torch.autocast("fakegpu")``: CUDA's autocast op policy on the fake device.

``install()`` registers, for the ``AutocastPrivateUse1`` dispatch key, a fallthrough for
every op (as CUDA has) and a kernel for the ops CUDA's autocast casts:

- ``LOWER_PRECISION`` (matmuls, convolutions, linear, attention): floating ``fakegpu``
  arguments other than float64 are cast to the autocast dtype (``torch.get_autocast_dtype
  ("fakegpu")``, float16 or bfloat16) before the op runs;
- ``FP32`` (softmax, norms, exp/log, pow, reductions that overflow): they are cast to float32.

So a model under autocast computes in the dtypes it would on CUDA (PyTorch 2.13's lists in
``aten/src/ATen/autocast_mode.cpp``, the ops diffusers and transformers models call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from .state import DEVICE_TYPE

__all__ = ["FP32", "LOWER_PRECISION", "register"]

#: ops (``name`` or ``name.overload``) that run in the autocast dtype
LOWER_PRECISION: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "_convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
)

#: ops that run in float32
FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "group_norm", "norm.Scalar", "norm.ScalarOpt_dim", "cosine_similarity",
    "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits",
    "softmax.int", "log_softmax.int", "cumprod", "cumsum", "dist", "cdist", "renorm", "logsumexp",
    "prod", "sum", "linalg_vector_norm", "rms_norm",
)

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _op(spec: str) -> Any:
    name, _, overload = spec.partition(".")
    packet = getattr(torch.ops.aten, name)
    return getattr(packet, overload or "default")


def _kernel(op: Any, to_autocast_dtype: bool) -> Any:
    def cast(x: Any, dtype: torch.dtype) -> Any:
        if (
            isinstance(x, torch.Tensor)
            and x.device.type == DEVICE_TYPE
            and x.is_floating_point()
            and x.dtype != torch.float64
        ):
            return x.to(dtype)
        return x

    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype(DEVICE_TYPE) if to_autocast_dtype else torch.float32
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            args, kwargs = pytree.tree_map(lambda x: cast(x, dtype), (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def register(libs: list[torch.library.Library]) -> None:
    """Register the autocast fallthrough and kernels; appends the libraries to ``libs`` (to
    keep the registrations alive)."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    kernels = torch.library.Library("aten", "IMPL", "AutocastPrivateUse1")
    for specs, lower in ((LOWER_PRECISION, True), (FP32, False)):
        for spec in specs:
            kernels.impl(spec, _kernel(_op(spec), lower))
    libs.extend([fallthrough, kernels])
