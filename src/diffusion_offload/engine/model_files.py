"""Locating a diffusers-format pipeline and reading its component sizes without loading it.

A model is a local directory or a Hugging Face hub id (resolved through the local cache
when ``HF_HUB_OFFLINE=1``). Component sizes come from the safetensors headers (8-byte
little-endian header length, then a JSON header with each tensor's dtype and shape), so
the fit check runs before a single weight is read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import diffusers

__all__ = ["ModelError", "ModelInfo", "inspect_model", "resolve_model"]

# bytes per element of the safetensors dtype names
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class ModelError(ValueError):
    """The model cannot be found or is not a usable diffusers pipeline."""


@dataclass(frozen=True)
class ModelInfo:
    """What ``model_index.json`` and the safetensors headers say about a pipeline.

    Attributes:
        path: the pipeline directory.
        pipeline_class: ``_class_name`` of ``model_index.json``.
        components: module component name -> (library, class name).
        numels: component -> {safetensors dtype name -> element count}.
        is_video: the pipeline's ``__call__`` takes ``num_frames``.
    """

    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]
    numels: dict[str, dict[str, int]]
    is_video: bool

    def component_bytes(self, name: str, dtype_bytes: int | None = None) -> int:
        """Bytes of component ``name``; floating tensors counted at ``dtype_bytes`` if given."""
        total = 0
        for dtype, numel in self.numels.get(name, {}).items():
            size = dtype_bytes if (dtype_bytes and dtype in _FLOAT_DTYPES) else _DTYPE_BYTES[dtype]
            total += numel * size
        return total

    def checkpoint_dtype(self) -> str | None:
        """The dominant floating safetensors dtype of the DiTs (else of all weights)."""
        counts: dict[str, int] = {}
        names = [n for n in self.numels if n.startswith(("transformer", "unet"))] or list(self.numels)
        for n in names:
            for dtype, numel in self.numels[n].items():
                if dtype in _FLOAT_DTYPES:
                    counts[dtype] = counts.get(dtype, 0) + numel
        return max(counts, key=counts.get) if counts else None


def resolve_model(model: str | os.PathLike) -> Path:
    """Return the pipeline directory for a local path or a hub id.

    Raises:
        ModelError: not a directory and not resolvable as a hub id (offline and not in
            the local cache, or unknown).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise ModelError(f"model {text!r} is a file, not a diffusers pipeline directory")
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelError(
            f"model {text!r} is not an existing directory nor a hub id of the form 'org/name'"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    try:
        return Path(snapshot_download(text, local_files_only=bool(HF_HUB_OFFLINE)))
    except Exception as exc:  # huggingface_hub raises several error types
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE=1)" if HF_HUB_OFFLINE else "on the hub"
        raise ModelError(
            f"model {text!r} is not a local directory and was not found {where}: "
            f"{type(exc).__name__}"
        ) from None


def _safetensors_numels(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            out[entry["dtype"]] = out.get(entry["dtype"], 0) + numel
    return out


def inspect_model(path: Path) -> ModelInfo:
    """Read ``model_index.json`` and the safetensors headers under ``path``.

    Raises:
        ModelError: no or invalid ``model_index.json``, a pipeline class diffusers does
            not have, or one that is not text-to-image/video (needs an input image).
    """
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelError(f"{str(path)!r} is not a diffusers pipeline: no model_index.json")
    try:
        spec = json.loads(index.read_text())
        class_name = spec["_class_name"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelError(f"{str(index)!r} is not a valid model_index.json ({exc})") from None
    cls = getattr(diffusers, str(class_name), None)
    if cls is None or not hasattr(cls, "__call__") or not isinstance(cls, type):
        raise ModelError(f"pipeline class {class_name!r} is not a diffusers pipeline")
    import inspect

    params = inspect.signature(cls.__call__).parameters
    required = [n for n in ("image", "video", "control_image") if n in params
                and params[n].default is inspect.Parameter.empty]
    if "prompt" not in params or required or "image" in params:
        raise ModelError(
            f"pipeline class {class_name!r} is not supported: diffusion_offload runs "
            "text-to-image and text-to-video pipelines (prompt in, image or video out)"
        )
    components: dict[str, tuple[str, str]] = {}
    numels: dict[str, dict[str, int]] = {}
    for name, value in spec.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        if value[0] is None:
            continue
        components[name] = (str(value[0]), str(value[1]))
        folder = path / name
        if folder.is_dir():
            counts = _safetensors_numels(folder)
            if counts:
                numels[name] = counts
    return ModelInfo(path, class_name, components, numels, "num_frames" in params)
