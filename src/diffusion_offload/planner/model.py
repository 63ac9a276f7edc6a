"""What the planner knows about a pipeline before loading it: components, bytes, blocks.

A model is a local diffusers pipeline folder, a hub id found in the local Hugging Face
cache (never downloaded: ``local_files_only``), or the hub id of a shipped weightless
config (``planner/configs/<org>/<name>``: ``model_index.json`` and each component's
``config.json``, no weights), in that order.

Sizes:

* With weight files, a component's persistent bytes come from its safetensors headers,
  read with safetensors' own reader (``safe_open``; the header only, validated against the
  file size), of the files diffusers loads for the chosen variant
  (``models.files.weight_files``: ``variant_compatible_siblings`` and sharded
  indexes). Floating tensors count at the load dtype, except those the library keeps in
  float32 (diffusers' ``_keep_in_fp32_modules`` for any load dtype; transformers'
  ``_keep_in_fp32_modules`` for float16 and ``_keep_in_fp32_modules_strict`` for float16
  and bfloat16), as ``from_pretrained(dtype=...)`` casts them.
* Non-persistent buffers (rotary tables, position ids), which are not in the files but are
  moved to the device with their module, come from the component built on the meta device.
* A shipped weightless config has no files: every byte comes from the meta-built component
  (its parameters and buffers, same dtype rule). Its parameter counts reproduce the
  published sizes (``tests/test_planner_configs.py``).
* Blocks (layer mode) are measured on the meta-built component: the bytes of each block's
  parameters and buffers at the load dtype, in execution order.

Tied weights are counted once, as they share one device storage.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.arena import device_bytes
from ..core.discovery import diffusers_role
from ..models.files import (
    ModelError,
    check_model_index,
    folder_or_hub_id,
    safetensors_tensors,
    weight_files,
)
from .quant import format_delta, format_from_quantization_config, parse_weights_dtype, weights_format_for

__all__ = ["ComponentSize", "PlanModel", "configs_root", "load_plan_model", "shipped_models"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

WEIGHTLESS_KEY = "_diffusion_offload_weightless"
"""Key of a shipped ``model_index.json`` that marks it weightless: ``{"dtype": ..., "source": ...}``."""


def configs_root() -> Path:
    """The folder of the shipped weightless configs (``<org>/<name>/model_index.json``)."""
    return Path(__file__).parent / "configs"


def shipped_models() -> list[str]:
    """Hub ids of the shipped weightless configs, sorted."""
    root = configs_root()
    return sorted(f"{p.parent.parent.name}/{p.parent.name}" for p in root.glob("*/*/model_index.json"))


@dataclass(frozen=True)
class ComponentSize:
    """One module component as the planner sees it.

    Attributes:
        name: the pipeline attribute (``"transformer"``).
        role: ``dit``, ``text_encoder``, ``encoder``, ``vae`` or ``resident``.
        class_name: the component's class.
        nbytes: device bytes at the load dtype: weights plus non-persistent buffers (bytes).
        params: parameter count (elements; tied parameters once).
        blocks: bytes of each streamed block, in execution order (empty: no blocks found).
        source: where ``nbytes`` comes from: ``"safetensors headers"`` or
            ``"config (weightless)"``.
        tied_extra: bytes of a Parameter held by several modules (tied embeddings), counted
            once per extra holder: what ``module.to(device)`` copies again on a
            PrivateUse1 device (the fake device, NPU), where PyTorch's ``_apply`` replaces
            each holder's Parameter instead of using ``set_data`` (bytes).
        weights_format: the format ``nbytes`` and ``blocks`` are sized in when it is not
            the load dtype (``planner.quant``: ``"fp8"``, ``"nf4"``...), else None.
    """

    name: str
    role: str
    class_name: str
    nbytes: int
    params: int
    blocks: tuple[int, ...] = ()
    source: str = "safetensors headers"
    tied_extra: int = 0
    weights_format: str | None = None


@dataclass
class PlanModel:
    """A pipeline resolved for planning.

    Attributes:
        model: the model as given (folder or hub id).
        path: the pipeline folder read.
        pipeline_class: ``_class_name`` of ``model_index.json``.
        weightless: True for a shipped weightless config.
        dtype: the load dtype of the floating weights.
        components: module components in ``model_index.json`` order.
        modules: the same components built on the meta device (for activation runs).
        index: the parsed ``model_index.json``.
        scheduler: the pipeline's scheduler, built from its config (None if it has none).
        files: the safetensors files of each component (empty for a weightless config).
        host_sizes: ``planner.host``'s per-component tensor sizes, once computed.
    """

    model: str
    path: Path
    pipeline_class: str
    weightless: bool
    dtype: torch.dtype
    components: dict[str, ComponentSize]
    modules: dict[str, nn.Module] = field(repr=False, default_factory=dict)
    index: dict[str, Any] = field(repr=False, default_factory=dict)
    scheduler: Any = field(repr=False, default=None)
    files: dict[str, list[Path]] = field(repr=False, default_factory=dict)
    host_sizes: dict[str, Any] = field(repr=False, default_factory=dict)

    def bytes_of(self, names: Iterator[str] | list[str] | set[str]) -> int:
        """Total device bytes of the named components."""
        return sum(self.components[n].nbytes for n in names)


def _locate(model: str | os.PathLike) -> tuple[Path, bool]:
    """The folder to read for ``model`` and whether it is a shipped weightless config.

    Raises:
        ModelError: not a folder, not in the local Hugging Face cache and not shipped.
    """
    found = folder_or_hub_id(model)
    if isinstance(found, Path):
        return found, False
    text = found
    try:
        from huggingface_hub import snapshot_download

        cached = Path(snapshot_download(text, local_files_only=True))
        if (cached / "model_index.json").is_file():
            return cached, False
    except Exception:  # not in the cache (huggingface_hub raises several types)
        pass
    shipped = configs_root() / text
    if (shipped / "model_index.json").is_file():
        return shipped, True
    raise ModelError(
        f"model {text!r} is not a local directory, is not in the local Hugging Face cache and "
        f"has no shipped weightless config (shipped: {shipped_models()}); download it first "
        f"(hf download {text}) or pass a pipeline folder. The planner never "
        "downloads weights"
    )


def _keep_fp32_rule(module: nn.Module, dtype: torch.dtype) -> tuple[str, ...] | None:
    """Module name patterns kept in float32 when loading at ``dtype``, and the matching
    style, as the owning library applies them; None when nothing is kept."""
    if dtype == torch.float32:
        return None
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        keep: set[str] = set()
        if dtype == torch.float16:
            keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        if dtype in (torch.float16, torch.bfloat16):
            keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        return tuple(sorted(keep)) or None
    keep_diffusers = getattr(type(module), "_keep_in_fp32_modules", None)
    return tuple(keep_diffusers) if keep_diffusers else None


def _kept_fp32(name: str, keep: tuple[str, ...] | None) -> bool:
    return bool(keep) and any(part in keep for part in name.split("."))


def _cast_meta(module: nn.Module, dtype: torch.dtype, keep: tuple[str, ...] | None) -> None:
    """Give the meta module the dtypes ``from_pretrained(dtype=...)`` gives the real one:
    floating parameters and persistent buffers at ``dtype`` except those kept in float32;
    non-persistent buffers as built."""
    persistent = set(module.state_dict(keep_vars=True))
    for full, param in list(module.named_parameters(remove_duplicate=True)):
        if param.is_floating_point():
            target = torch.float32 if _kept_fp32(full, keep) else dtype
            if param.dtype != target:
                param.data = param.data.to(target)
    for full, buf in list(module.named_buffers(remove_duplicate=True)):
        if buf.is_floating_point() and full in persistent:
            target = torch.float32 if _kept_fp32(full, keep) else dtype
            if buf.dtype != target:
                owner, _, leaf = full.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                sub._buffers[leaf] = buf.to(target)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build_meta(folder: Path, library: str, class_name: str, dtype: torch.dtype) -> nn.Module:
    """Build component ``class_name`` of ``library`` from ``folder/config.json`` on the meta
    device (no weights, no initialisation cost), cast as loading at ``dtype`` would.

    Raises:
        ModelError: the class is unknown or its config is unreadable.
    """
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise ModelError(f"component class {library}.{class_name} is not available") from None
    try:
        if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # diffusers ModelMixin
            config = cls.load_config(folder)
            with torch.device("meta"):
                module = cls.from_config(config)
        else:  # transformers PreTrainedModel: built in the load dtype, as from_pretrained does
            config = cls.config_class.from_pretrained(folder)
            with torch.device("meta"), _default_dtype(dtype if dtype.is_floating_point else torch.float32):
                module = cls(config)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(
            f"cannot build {class_name} from {str(folder / 'config.json')!r}: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        ) from None
    module.eval()
    _cast_meta(module, dtype, _keep_fp32_rule(module, dtype))
    return module


def _config_text(folder: Path) -> str | None:
    try:
        return (folder / "config.json").read_text()
    except OSError:
        return None


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _module_bytes(module: nn.Module, only_nonpersistent: bool = False) -> int:
    """Bytes of ``module``'s parameters and buffers (each storage-sharing tensor once)."""
    persistent = set(module.state_dict(keep_vars=True)) if only_nonpersistent else set()
    seen: set[int] = set()
    total = 0
    items: list[tuple[str, torch.Tensor]] = []
    if not only_nonpersistent:
        items += list(module.named_parameters(remove_duplicate=True))
    items += list(module.named_buffers(remove_duplicate=True))
    for name, t in items:
        if only_nonpersistent and name in persistent:
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += _tensor_bytes(t)
    return total


def _arena_overhead(module: nn.Module) -> int:
    """Device bytes beyond ``module``'s tensors that loading it from its arenas allocates
    (alignment padding, the write check's reference sums: ``core.arena.device_bytes``)."""
    seen: set[int] = set()
    sizes = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            sizes.append(_tensor_bytes(t))
    return device_bytes(sizes) - sum(sizes)


def _tied_extra(module: nn.Module) -> int:
    """Bytes of each Parameter times (its number of holding modules - 1)."""
    holders: dict[int, list[Any]] = {}
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                holders.setdefault(id(p), [p, 0])[1] += 1
    return sum(_tensor_bytes(p) * (n - 1) for p, n in holders.values())


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields each tied one once


def _header_bytes(files: list[Path], dtype: torch.dtype, keep: tuple[str, ...] | None) -> int:
    """Bytes at load dtype of every tensor in the safetensors headers of ``files``.

    Raises:
        ModelError: a truncated, corrupt or unreadable file (named).
    """
    total = 0
    for key, (stored, numel) in safetensors_tensors(files).items():
        if stored in _SAFETENSORS_FLOATS:
            target = torch.float32 if _kept_fp32(key, keep) else dtype
            total += numel * torch.tensor([], dtype=target).element_size()
        else:
            total += numel * _SAFETENSORS_BYTES.get(stored, 1)
    return total


def _stored_quantized(files: list[Path]) -> bool:
    """Whether the safetensors headers of ``files`` hold quantized weights (8-bit floats,
    or 8-bit integers: bitsandbytes' and torchao's serialised formats)."""
    return bool(files) and any(
        stored in ("F8_E4M3", "F8_E5M2", "I8", "U8") for stored, _ in safetensors_tensors(files).values()
    )


def _checkpoint_dtype(files: dict[str, list[Path]]) -> torch.dtype | None:
    """The dominant floating dtype of the DiTs' files (else of all files), as
    ``Omni(dtype="auto")`` picks it."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    names = [n for n in files if n.startswith(("transformer", "unet"))] or list(files)
    for name in names:
        for file in files[name]:
            try:
                with safe_open(str(file), framework="numpy") as fh:
                    for key in fh.keys():
                        piece = fh.get_slice(key)
                        stored = str(piece.get_dtype())
                        if stored in _SAFETENSORS_FLOATS:
                            numel = 1
                            for dim in piece.get_shape():
                                numel *= int(dim)
                            counts[stored] = counts.get(stored, 0) + numel
            except Exception as exc:  # safetensors raises its own SafetensorError, OSError...
                raise ModelError(
                    f"weight file {str(file)!r} cannot be read: truncated or corrupt "
                    f"({' '.join(str(exc).split())[:200]})"
                ) from None
    if not counts:
        return None
    return _SAFETENSORS_FLOATS[max(counts, key=counts.get)]


def discover_block_modules(module: nn.Module, override: Any = None) -> list[nn.Module]:
    """The blocks of ``module`` in execution order (layer mode's discovery), [] if none."""
    try:
        from ..core.blocks import discover_blocks
    except ImportError:  # pragma: no cover - layer mode not installed
        discover_blocks = _fallback_blocks
    try:
        return [block for _, block in discover_blocks(module, override)]
    except (ValueError, TypeError):
        return []


def _blocks(module: nn.Module, override: Any = None) -> tuple[int, ...]:
    """Bytes of each block of ``module`` (layer mode), in execution order; () if none."""
    return tuple(
        _module_bytes(block) + _arena_overhead(block) for block in discover_block_modules(module, override)
    )


_FALLBACK_CONTAINERS = (
    "blocks", "transformer_blocks", "single_transformer_blocks", "encoder.block",
    "text_model.encoder.layers", "model.language_model.layers",
)


def _fallback_blocks(module: nn.Module, override: Any = None) -> list[tuple[str, nn.Module]]:
    """Block containers of the models layer mode knows (used until ``blocks`` exists)."""
    out: list[tuple[str, nn.Module]] = []
    for path in _FALLBACK_CONTAINERS:
        try:
            container = module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            out += [(f"{path}.{i}", child) for i, child in enumerate(container)]
    if not out:
        raise ValueError(f"no blocks found in {type(module).__name__}")
    return out


def resolve_dtype(dtype: str | torch.dtype | None, files: dict[str, list[Path]] | None,
                  index: Mapping[str, Any]) -> torch.dtype:
    """The load dtype: an explicit one, else the checkpoint's (``"auto"``/None), else the
    dtype recorded in a weightless config, else float32.

    Raises:
        ValueError: a dtype name not in float32/float16/bfloat16/auto.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not allowed; allowed: ['auto', {', '.join(map(repr, _DTYPES))}]")
        return _DTYPES[dtype]
    if files:
        found = _checkpoint_dtype(files)
        if found is not None:
            return found
    recorded = (index.get(WEIGHTLESS_KEY) or {}).get("dtype")
    return _DTYPES.get(recorded, torch.float32)


def load_plan_model(
    model: str | os.PathLike,
    *,
    variant: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    component_roles: Mapping[str, str] | None = None,
    layer_blocks: Mapping[str, Any] | None = None,
    weights_dtype: str | Mapping[str, str] | None = None,
) -> PlanModel:
    """Resolve ``model`` and size its components without reading a weight.

    Args:
        model: a pipeline folder, a cached hub id, or a shipped config's hub id.
        variant: weight file variant, as ``Omni(variant=...)``.
        dtype: ``"auto"`` (the checkpoint's; a weightless config's recorded dtype),
            ``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype.
        component_roles: role overrides, as ``Omni(component_roles=...)``.
        layer_blocks: block container paths per component, as ``Omni(layer_blocks=...)``.
        weights_dtype: formats the weights will be quantized or cast to at load
            (``planner.quant.parse_weights_dtype``: ``"fp8"`` for every DiT and text
            encoder, or ``"dit=fp8,text_encoder=bf16"``, keys roles or component names).
            Without one, a component whose ``config.json`` has a ``quantization_config``
            is sized in that format, unless its weight files are stored quantized already
            (their headers then give the size).

    Raises:
        ModelError: the model cannot be found, has no usable ``model_index.json``, or a
            weight file is truncated or corrupt.
        ValueError: a bad dtype, component role or weights format.
    """
    path, weightless = _locate(model)
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelError(f"{str(path)!r} is not a diffusers pipeline: no model_index.json")
    try:
        index = json.loads(index_file.read_text())
        pipeline_class = str(index["_class_name"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{str(index_file)!r} is not a valid model_index.json ({exc})") from None
    if not isinstance(index, dict):
        raise ModelError(f"{str(index_file)!r} is not a valid model_index.json (not a JSON object)")
    check_model_index(index, index_file)
    files = {} if weightless else weight_files(path, variant)
    load_dtype = resolve_dtype(dtype, files, index)
    formats = parse_weights_dtype(weights_dtype)
    roles = dict(component_roles or {})
    components: dict[str, ComponentSize] = {}
    modules: dict[str, nn.Module] = {}
    built: dict[tuple[str, str, str | None], nn.Module] = {}
    scheduler = None
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue
        library, class_name = value
        try:
            cls = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError):
            raise ModelError(
                f"{str(index_file)!r}: component {name!r} is {library}.{class_name}, which is "
                f"not available here (unknown class, or {library} not installed)"
            ) from None
        if name == "scheduler" or class_name.endswith("Scheduler"):
            try:
                scheduler = cls.from_config(cls.load_config(path / name))
            except (OSError, ValueError):
                scheduler = None
            continue
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue  # tokenizers, processors
        config_text = _config_text(path / name)
        built_key = (library, class_name, config_text)
        module = built.get(built_key) if config_text is not None else None
        if module is None:  # identical components (Wan2.2's two experts) are built once
            module = _build_meta(path / name, library, class_name, load_dtype)
            built[built_key] = module
        modules[name] = module
        role = roles.get(name) or diffusers_role(name) or "resident"
        keep = _keep_fp32_rule(module, load_dtype)
        if name in files:
            nbytes = _header_bytes(files[name], load_dtype, keep) + _module_bytes(module, only_nonpersistent=True)
            source = "safetensors headers"
        else:
            nbytes = _module_bytes(module)
            source = "config (weightless)" if weightless else "config (no weight files)"
        nbytes += _arena_overhead(module)  # as an offloaded component's arenas allocate it
        override = (layer_blocks or {}).get(name)
        # only DiTs and text encoders stream in layer mode (a VAE's containers are not
        # blocks, and discovering them would log a line per plan)
        streams = role in ("dit", "text_encoder") or name in (layer_blocks or {})
        blocks = _blocks(module, override) if streams else ()
        fmt = weights_format_for(formats, name, role)
        if fmt is None and not _stored_quantized(files.get(name, [])):
            fmt = format_from_quantization_config(config_text)
        if fmt is not None:
            nbytes += format_delta(module, fmt, load_dtype)
            blocks = tuple(
                b + format_delta(m, fmt, load_dtype)
                for b, m in zip(blocks, discover_block_modules(module, override))
            )
        components[name] = ComponentSize(
            name=name, role=role, class_name=class_name, nbytes=nbytes,
            params=_param_count(module), blocks=blocks, source=source,
            tied_extra=_tied_extra(module), weights_format=fmt.name if fmt is not None else None,
        )
    if not any(c.role == "dit" for c in components.values()):
        raise ModelError(
            f"{str(index_file)!r} ({pipeline_class}) has no DiT or UNet component to plan for; "
            f"its module components: {sorted(components) or 'none'}"
        )
    unknown = sorted(set(formats) - set(components) - {"dit", "text_encoder"})
    if unknown:
        raise ValueError(
            f"--weights-dtype names {unknown}, which are neither roles ('dit', 'text_encoder') "
            f"nor module components of {pipeline_class}; components: {sorted(components)}"
        )
    for name in roles:
        if name not in components:
            raise ValueError(
                f"component_roles names {name!r}, which is not a module component of "
                f"{pipeline_class}; components: {sorted(components)}"
            )
    return PlanModel(str(model), path, pipeline_class, weightless, load_dtype, components,
                     modules, index, scheduler, dict(files))
