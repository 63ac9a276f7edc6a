"""The models ``serve`` is given: ``MODEL``, ``--model [ID=]PATH`` (repeatable) and
``--models FILE`` (TOML or JSON), read into ``engine.pool.ModelSpec``s.

A ``--models`` file is a list of entries, ``[[models]]`` tables in TOML or a JSON list (or
``{"models": [...]}``), each with:

- ``id`` (required): the id requests name it by;
- ``path`` (required): the pipeline folder or hub id;
- ``config``: its offload config (an object as ``--diffusion-offload-config`` takes; default
  the command line's, else module mode with the DiTs and text encoders);
- ``variant``, ``dtype``: as the flags of the same names (default: the command line's);
- ``loras``: a list of ``[path, scale]`` pairs (default: the command line's ``--lora``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine.pool import ModelSpec, repeated_ids

__all__ = ["ENTRY_KEYS", "model_specs", "read_models_file"]

ENTRY_KEYS = ("id", "path", "config", "variant", "dtype", "loras")
"""The keys a ``--models`` entry may have."""


def read_models_file(path: str, defaults: dict[str, Any]) -> list[ModelSpec]:
    """The ``ModelSpec``s of a ``--models`` file (``.toml``, else JSON), each entry's
    missing keys taken from ``defaults`` (``config``, ``variant``, ``dtype``, ``loras``).

    Raises:
        ValueError: the file cannot be read or parsed, is not a list of entries, or an
            entry has an unknown key, lacks ``id`` or ``path``, or has a value of the wrong
            type (the message names the file, the entry and the key).
    """
    where = f"--models {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        data: Any = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"{where}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a non-empty list of models ([[models]] tables in TOML, "
                         "a JSON list or {\"models\": [...]})")
    return [_entry(e, i, where, defaults) for i, e in enumerate(entries)]


def _entry(entry: Any, index: int, where: str, defaults: dict[str, Any]) -> ModelSpec:
    name = f"{where}: entry {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"{name} must be a table/object with {list(ENTRY_KEYS)}, got {entry!r}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r}; allowed: {', '.join(ENTRY_KEYS)}")
    for key in ("id", "path"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{name}: {key!r} is required, a non-empty string (got {entry.get(key)!r})")
    name = f"{where}: model {entry['id']!r}"
    for key in ("variant", "dtype"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise ValueError(f"{name}: {key!r} must be a string, got {entry[key]!r}")
    config = entry.get("config", defaults.get("config"))
    if config is not None:
        from ..core.config import parse_diffusion_offload_config

        try:
            config = parse_diffusion_offload_config(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: config: {exc}") from None
    loras = entry.get("loras", defaults.get("loras", ()))
    if not isinstance(loras, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in loras
    ):
        raise ValueError(f"{name}: 'loras' must be a list of [path, scale] pairs, got {loras!r}")
    try:
        return ModelSpec(entry["id"], entry["path"], config, entry.get("variant", defaults.get("variant")),
                         tuple((str(p), float(s)) for p, s in loras), entry.get("dtype", defaults.get("dtype")))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def model_specs(positional: str | None, flags: Sequence[str], models_file: str | None,
                defaults: dict[str, Any]) -> list[ModelSpec]:
    """Every model ``serve`` is asked for, in order: ``MODEL`` (its id is the path as
    given), each ``--model [ID=]PATH`` (no ``ID=``: the path is the id), then the entries
    of ``--models FILE``; the command line's ``defaults`` fill what an entry leaves out.

    Raises:
        ValueError: no model at all, a repeated id, an empty ``--model`` value or a bad
            file (named).
    """
    specs: list[ModelSpec] = []
    if positional is not None:
        specs.append(_flag_spec(positional, positional, defaults))
    for value in flags:
        model_id, sep, path = value.partition("=")
        if not sep:
            model_id = path = value
        if not model_id or not path:
            raise ValueError(f"--model {value!r}: give PATH or ID=PATH, both non-empty")
        specs.append(_flag_spec(model_id, path, defaults))
    if models_file is not None:
        specs.extend(read_models_file(models_file, defaults))
    if not specs:
        raise ValueError("serve needs a model: MODEL, --model [ID=]PATH (repeatable) or --models FILE")
    repeated = repeated_ids(specs)
    if repeated:
        raise ValueError(f"model ids must be unique; repeated: {', '.join(repeated)} (name them with --model ID=PATH)")
    return specs


def _flag_spec(model_id: str, path: str, defaults: dict[str, Any]) -> ModelSpec:
    return ModelSpec(model_id, path, defaults.get("config"), defaults.get("variant"),
                     tuple(defaults.get("loras", ())), defaults.get("dtype"))
