"""Locating a diffusers-format pipeline and reading its component sizes without loading it.

A model is a local directory or a Hugging Face hub id (resolved through the local cache
when ``HF_HUB_OFFLINE=1``). Component sizes come from the safetensors headers, read with
safetensors' own ``safe_open`` (which also rejects truncated and corrupt files), of the
files diffusers will load for the chosen variant, so the fit check runs before a single
weight is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers

__all__ = [
    "ModelError", "ModelInfo", "check_model_index", "folder_or_hub_id", "hub_error", "inspect_model",
    "resolve_model",
    "safetensors_numels", "safetensors_tensors", "weight_files",
]

# libraries whose components with a config.json load weights, and their weight file stems
_WEIGHTED = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}

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
        variant: the weight variant the sizes were read for (None: the plain files).
    """

    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]
    numels: dict[str, dict[str, int]]
    is_video: bool
    variant: str | None = None

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


def folder_or_hub_id(model: str | os.PathLike) -> Path | str:
    """``model`` as an existing folder (a ``Path``) or a well-formed hub id (``"org/name"``).

    Raises:
        ModelError: ``model`` is a file, or neither a folder nor of the form ``org/name``.
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
    return text


def resolve_model(model: str | os.PathLike) -> Path:
    """Return the pipeline directory for a local path or a hub id.

    Raises:
        ModelError: not a directory and not resolvable as a hub id (offline and not in
            the local cache, or unknown).
    """
    found = folder_or_hub_id(model)
    if isinstance(found, Path):
        return found
    text = found
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    try:
        return Path(snapshot_download(text, local_files_only=bool(HF_HUB_OFFLINE)))
    except Exception as exc:  # huggingface_hub raises several error types
        raise ModelError(hub_error(text, exc, bool(HF_HUB_OFFLINE))) from None


def hub_error(model: str, exc: BaseException, offline: bool) -> str:
    """Why hub id ``model`` could not be had, in one line with what to do: offline (not in
    the local cache), gated, unknown on the hub, or not cached and the hub unreachable."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    start = f"model {model!r} is not a local directory"
    if offline:
        return (f"{start} and was not found in the local Hugging Face cache (HF_HUB_OFFLINE=1 "
                f"keeps the hub out); download it first with `hf download {model}`, or pass a "
                "pipeline folder")
    if isinstance(exc, GatedRepoError):
        return (f"{start}, and it is gated on the hub: accept its terms on huggingface.co and log "
                "in with `hf auth login`")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"{start} and was not found on the hub (a typo, or a private repo: log in with "
                "`hf auth login`)")
    reason = " ".join(str(exc).split()).split(" An error happened")[0][:120]
    return (f"{start}, is not in the local Hugging Face cache, and the hub could not be reached "
            f"({type(exc).__name__}{': ' + reason if reason else ''}); connect to the network, or "
            f"download it first with `hf download {model}`")


def weight_files(path: Path, variant: str | None = None) -> dict[str, list[Path]]:
    """The safetensors files diffusers will load, per component folder of pipeline ``path``.

    Files are chosen with diffusers' own rule (``variant_compatible_siblings``): for
    ``variant=None`` only plain names (``diffusion_pytorch_model.safetensors``,
    ``model-00001-of-00002.safetensors``), never ``*.fp16.safetensors``; for a variant, the
    variant's files where a component has them, else its plain ones. A sharded checkpoint
    (``*.safetensors.index[.VARIANT].json``) counts the shards its ``weight_map`` names.

    Raises:
        ModelError: no component has files of ``variant``, or an index file is unreadable
            or names a shard that is missing (the message names the file).
    """
    from diffusers.pipelines.pipeline_loading_utils import variant_compatible_siblings

    names = [
        f"{sub.name}/{file.name}"
        for sub in sorted(path.iterdir()) if sub.is_dir() and not sub.name.startswith(".")
        for file in sorted(sub.iterdir()) if file.is_file()
    ]
    try:
        usable, _ = variant_compatible_siblings(names, variant=variant)
    except ValueError:
        found = sorted({n.split(".")[-2] for n in names if n.count(".") >= 2 and n.endswith(".safetensors")})
        raise ModelError(
            f"variant {variant!r}: no weight files of this variant in {str(path)!r} "
            f"(files named like diffusion_pytorch_model.{variant}.safetensors); "
            f"variants found: {found or 'none'}"
        ) from None
    out: dict[str, list[Path]] = {}
    for name in sorted(usable):
        component, file = name.split("/", 1)
        if ".safetensors" not in file:
            continue
        out.setdefault(component, []).append(path / component / file)
    for component, files in out.items():
        indexes = [f for f in files if f.name.endswith(".json")]
        if not indexes:
            continue
        shards: list[Path] = []
        for index in indexes:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shard_names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ModelError(
                    f"weight index {str(index)!r} is unreadable or corrupt ({type(exc).__name__}); "
                    "download the model again"
                ) from None
            for shard in shard_names:
                file = index.parent / str(shard)
                if not file.is_file():
                    raise ModelError(
                        f"weight index {str(index)!r} names shard {str(shard)!r}, which is "
                        "missing; download the model again"
                    )
                shards.append(file)
        out[component] = sorted(set(shards))
    return out


def safetensors_tensors(files: list[Path]) -> dict[str, tuple[str, int]]:
    """Every tensor in ``files``: key -> (safetensors dtype name, element count), read with
    safetensors' own reader (``safe_open``: the header only, validated against the file
    size). No weight is read.

    Raises:
        ModelError: a file is truncated, corrupt or unreadable (the message names it).
    """
    from safetensors import safe_open

    out: dict[str, tuple[str, int]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as fh:
                for key in fh.keys():
                    piece = fh.get_slice(key)
                    numel = 1
                    for dim in piece.get_shape():
                        numel *= int(dim)
                    out[key] = (str(piece.get_dtype()), numel)
        except OSError as exc:
            raise ModelError(
                f"weight file {str(file)!r} cannot be read: {exc.strerror or exc}"
            ) from None
        except Exception as exc:  # SafetensorError: a bad header or a size mismatch
            detail = " ".join(str(exc).split()).removeprefix("Error while deserializing header: ")
            reason = f"truncated or corrupt ({detail or type(exc).__name__})"
            raise ModelError(
                f"weight file {str(file)!r} cannot be read: {reason}; download the model again"
            ) from None
    return out


def safetensors_numels(files: list[Path]) -> dict[str, int]:
    """Element counts per safetensors dtype name over ``files`` (``safetensors_tensors``).

    Raises:
        ModelError: a file is truncated, corrupt or unreadable (the message names it).
    """
    out: dict[str, int] = {}
    for dtype, numel in safetensors_tensors(files).values():
        out[dtype] = out.get(dtype, 0) + numel
    return out


def check_model_index(index: Mapping[str, Any], index_file: Path) -> None:
    """Every component entry of ``model_index.json``: a plain folder name (nothing is read
    outside the model folder) and ``[library, class]`` as two strings (or two nulls: an
    absent optional component).

    Raises:
        ModelError: naming the file, the entry and what is allowed.
    """
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list):
            continue
        if (not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name
                or Path(name).is_absolute()):
            raise ModelError(
                f"{str(index_file)!r}: component {name!r} is not a folder name of the model "
                "(no '/', '\\' or '..'); nothing outside the model folder is read"
            )
        if len(value) != 2 or not (all(isinstance(v, str) for v in value) or value == [None, None]):
            raise ModelError(
                f"{str(index_file)!r}: component {name!r} must be [library, class] as two "
                f"strings, e.g. [\"diffusers\", \"AutoencoderKLWan\"], got {json.dumps(value)}"
            )


def inspect_model(path: Path, variant: str | None = None) -> ModelInfo:
    """Read ``model_index.json`` and the safetensors headers under ``path``.

    Only the files diffusers loads for ``variant`` are counted (see :func:`weight_files`).

    Raises:
        ModelError: no or invalid ``model_index.json``, a pipeline class diffusers does
            not have, one without a ``prompt`` or that needs a ``video`` or a
            ``control_image`` (an ``image`` is fine: edits, image-to-video), no
            files of ``variant``, a model component without its weight file (named), or a
            truncated, corrupt or unreadable weight file.
    """
    path = Path(path)
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelError(f"{str(path)!r} is not a diffusers pipeline: no model_index.json")
    try:
        spec = json.loads(index.read_text())
        class_name = spec["_class_name"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelError(f"{str(index)!r} is not a valid model_index.json ({exc})") from None
    check_model_index(spec, index)
    cls = getattr(diffusers, str(class_name), None)
    if cls is None or not hasattr(cls, "__call__") or not isinstance(cls, type):
        raise ModelError(f"pipeline class {class_name!r} is not a diffusers pipeline")
    import inspect

    params = inspect.signature(cls.__call__).parameters
    required = [n for n in ("video", "control_image") if n in params
                and params[n].default is inspect.Parameter.empty]
    if "prompt" not in params or required:
        raise ModelError(
            f"pipeline class {class_name!r} is not supported: diffusion_offload runs "
            "pipelines that take a prompt and at most an input image (text-to-image, "
            "text-to-video, image edits, image-to-video)"
        )
    components: dict[str, tuple[str, str]] = {}
    numels: dict[str, dict[str, int]] = {}
    for name, value in spec.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        if value[0] is None:
            continue
        components[name] = (str(value[0]), str(value[1]))
    files = weight_files(path, variant)
    for name, (library, _cls) in components.items():
        folder = path / name
        if name not in files and (folder / "config.json").is_file() and library in _WEIGHTED:
            if any(f.suffix in (".bin", ".pt", ".pth", ".ckpt") for f in folder.iterdir()):
                continue  # pickled weights: diffusers reads them, their sizes are unknown here
            stem = _WEIGHTED[library] + (f".{variant}" if variant else "")
            raise ModelError(
                f"component {name!r} has no weight file: {str(folder / (stem + '.safetensors'))!r} "
                f"(or the shards of {stem}.safetensors.index.json) is missing; download the "
                "model again"
            )
    for name in components:
        counts = safetensors_numels(files.get(name, []))
        if counts:
            numels[name] = counts
    return ModelInfo(path, class_name, components, numels, "num_frames" in params, variant)
