"""``weights_from=MODEL_DIR``: file-back the host weights of a pipeline built elsewhere
(issue 20).

A pipeline loaded by ``Omni`` keeps its weights as private memory maps of their
safetensors files, so a host-memory budget can leave them on disk (``tiers``). A pipeline
built another way holds them in anonymous memory: RAM-only. Given the pipeline folder its
weights came from, ``back_with_files`` replaces each such host tensor by the same tensor
read from ``MODEL_DIR/<component>/*.safetensors`` (safetensors' own reader: a private,
copy-on-write map of the file), after checking that the name, shape, dtype and bytes are
equal; the anonymous copy is then freed. The tensor object stays the same (``.data`` is
rebound), so modules, ties and user references are untouched.

Tensors not in the files (non-persistent buffers), tensors sharing a storage with others
(their aliasing would be lost) and tensors that are file-backed already are left as they
are. A tensor in the files with another shape, dtype or bytes is an error naming it: the
pipeline was not built from that folder (or was changed since).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .tiers import FileMaps, file_backed

__all__ = ["WeightsMismatchError", "back_with_files"]


class WeightsMismatchError(ValueError):
    """A weight differs from the tensor of the same name in ``weights_from``'s files."""


def _files(folder: Path, component: str) -> list[Path]:
    return sorted((folder / component).glob("*.safetensors"))


def back_with_files(
    folder: str | os.PathLike[str],
    named: dict[str, list[tuple[str, torch.Tensor]]],
    selected: dict[str, bool],
    maps: FileMaps,
) -> int:
    """File-back the selected host tensors from ``folder``'s safetensors files.

    Args:
        folder: the pipeline folder (``model_index.json`` and one subfolder per
            component, as ``save_pretrained`` writes it).
        named: per component key, its ``(name, tensor)`` pairs (``named_tensors``); a
            key ``"transformer"`` or, for a streamed block, ``"transformer.blocks.0"``
            (tensor names relative to the block).
        selected: which keys get host copies.
        maps: the process's file maps (which tensors are file-backed already).

    Returns:
        The bytes now file-backed that were not.

    Raises:
        FileNotFoundError: ``folder`` is not a directory (named).
        WeightsMismatchError: a tensor's shape, dtype or bytes differ from the file's
            tensor of the same name (component, tensor and the difference named); no
            tensor was changed.
    """
    from safetensors import safe_open

    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"weights_from={str(folder)!r} is not a directory")
    todo: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles: dict[str, dict[str, Path]] = {}
    for key, tensors in named.items():
        if not selected.get(key):
            continue
        component, _, prefix = key.partition(".")
        if component not in handles:
            index: dict[str, Path] = {}
            for f in _files(root, component):
                with safe_open(str(f), framework="pt") as h:
                    index.update({k: f for k in h.keys()})
            handles[component] = index
        index = handles[component]
        for tname, t in tensors:
            full = f"{prefix}.{tname}" if prefix else tname
            nbytes = t.numel() * t.element_size()
            if (full not in index or t.device.type != "cpu" or file_backed(t, maps)
                    or t.untyped_storage().nbytes() != nbytes or not t.is_contiguous()):
                continue
            with safe_open(str(index[full]), framework="pt") as h:
                mapped = h.get_tensor(full)
            where = f"weights_from={str(folder)!r}: {component} tensor {full!r}"
            if tuple(mapped.shape) != tuple(t.shape):
                raise WeightsMismatchError(
                    f"{where} has shape {tuple(t.shape)}, the file's {tuple(mapped.shape)}")
            if mapped.dtype != t.dtype:
                raise WeightsMismatchError(f"{where} is {t.dtype}, the file's {mapped.dtype}")
            with torch.no_grad():
                same = torch.equal(t.detach().reshape(-1).view(torch.uint8),
                                   mapped.reshape(-1).view(torch.uint8))
            if not same:
                raise WeightsMismatchError(
                    f"{where} differs from the file's bytes (the pipeline was not built from "
                    "this folder, or its weights changed)")
            todo.append((t, mapped))
    with torch.no_grad():
        for t, mapped in todo:
            t.data = mapped
    return sum(t.numel() * t.element_size() for t, _ in todo)
