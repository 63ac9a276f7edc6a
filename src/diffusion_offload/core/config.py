"""``diffusion_offload_config``: parsing and validation (SPEC section 3).

The config is a mapping (or its JSON text on the command line)::

    {"mode": "module", "components": ["dit", "text_encoder"], "pin_memory": true}

``parse_diffusion_offload_config`` validates it completely before anything is loaded,
hooked or moved, and returns an immutable, hashable, picklable
``DiffusionOffloadConfig`` that round-trips through JSON.

Error rules: a wrong Python type raises ``TypeError``; a bad value or an unknown key
raises ``ValueError``. Every message names the field, the bad value and what is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMPONENTS",
    "MODES",
    "WEIGHT_TRANSFERS",
    "DiffusionOffloadConfig",
    "LayerOptions",
    "parse_diffusion_offload_config",
]

MODES: tuple[str, ...] = ("module", "layer")
COMPONENTS: tuple[str, ...] = ("dit", "text_encoder")
WEIGHT_TRANSFERS: tuple[str, ...] = ("rank-local", "allgather")
_TOP_KEYS: tuple[str, ...] = ("mode", "components", "layer_options", "pin_memory")
_LAYER_KEYS: tuple[str, ...] = ("weight_transfer", "resident_layers")


@dataclass(frozen=True)
class LayerOptions:
    """Layer-wise options of one component (``mode="layer"`` only).

    Attributes:
        weight_transfer: ``"rank-local"`` or ``"allgather"``, or None (backend default).
        resident_layers: number of layers kept on the device (``dit`` only), or None.
    """

    weight_transfer: str | None = None
    resident_layers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict, without unset keys."""
        out: dict[str, Any] = {}
        if self.weight_transfer is not None:
            out["weight_transfer"] = self.weight_transfer
        if self.resident_layers is not None:
            out["resident_layers"] = self.resident_layers
        return out


@dataclass(frozen=True)
class DiffusionOffloadConfig:
    """A validated offload config. Build it with ``parse_diffusion_offload_config``.

    Attributes:
        mode: ``"module"`` (model-level offload) or ``"layer"`` (layer-wise; parsed, not
            yet implemented by a backend).
        components: selected component kinds, a tuple of distinct names from
            ``("dit", "text_encoder")`` in the order given.
        layer_options: ``(component, LayerOptions)`` pairs, sorted by component; empty
            in module mode.
        pin_memory: keep host copies in pinned (page-locked) memory when the platform
            supports it.
        explicit: True for a selection given as a config; False when the config stands
            for the legacy ``enable_cpu_offload=True`` (offload every discovered DiT and
            every discovered encoder, image encoders included).
    """

    mode: str
    components: tuple[str, ...]
    layer_options: tuple[tuple[str, LayerOptions], ...] = ()
    pin_memory: bool = True
    explicit: bool = True

    def __post_init__(self) -> None:
        """Validate the fields of a config built by hand (the same rules as parsing).

        Raises:
            TypeError: a field of the wrong type.
            ValueError: a field with a bad value (see ``parse_diffusion_offload_config``).
        """
        if not isinstance(self.mode, str):
            raise TypeError(
                f"mode must be a str from {list(MODES)}, got {self.mode!r} ({_type_name(self.mode)})"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not allowed; allowed values: {list(MODES)}")
        if _parse_components(self.components) != self.components:
            raise TypeError(
                f"components must be a tuple of str from {list(COMPONENTS)}, got "
                f"{self.components!r} ({_type_name(self.components)})"
            )
        if not isinstance(self.layer_options, tuple) or not all(
            isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[1], LayerOptions)
            for kv in self.layer_options
        ):
            raise TypeError(
                "layer_options must be a tuple of (component, LayerOptions) pairs, got "
                f"{self.layer_options!r}"
            )
        _parse_layer_options(
            {k: v.to_dict() for k, v in self.layer_options}, self.mode, self.components
        )
        for name in ("pin_memory", "explicit"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"{name} must be a bool (True or False), got {value!r} ({_type_name(value)})"
                )

    def selects(self, component: str) -> bool:
        """Whether ``component`` (``"dit"`` or ``"text_encoder"``) is selected."""
        return component in self.components

    def offloads_role(self, role: str) -> bool:
        """Whether a component of ``role`` may move to the host under this config.

        ``dit`` and ``text_encoder`` follow the selection, ``adapter`` (ControlNets...)
        follows ``dit``; other encoders (``encoder``: image encoders, MLLMs) only under the
        legacy ``enable_cpu_offload``; ``vae`` and ``resident`` never.
        """
        if role == "adapter":
            return self.selects("dit")
        if role in COMPONENTS:
            return self.selects(role)
        return role == "encoder" and not self.explicit

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that ``from_json(json.dumps(...))`` maps back to an equal config.

        For an explicit config ``parse_diffusion_offload_config`` accepts it too; the legacy
        config (``explicit=False``) is ``{"enable_cpu_offload": true}``, which only
        ``from_json`` understands.
        """
        if not self.explicit:
            return {"enable_cpu_offload": True}
        out: dict[str, Any] = {
            "mode": self.mode,
            "components": list(self.components),
            "pin_memory": self.pin_memory,
        }
        if self.layer_options:
            out["layer_options"] = {k: v.to_dict() for k, v in self.layer_options}
        return out

    def to_json(self) -> str:
        """The config as JSON text (see ``to_dict``)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DiffusionOffloadConfig":
        """Parse JSON text written by ``to_json`` (or by a user).

        A document holding ``"enable_cpu_offload": b`` equals
        ``parse_diffusion_offload_config(<the rest>, enable_cpu_offload=b)`` (an empty
        rest stands for None): with an explicit module config the selection wins.

        Raises:
            ValueError: invalid JSON or an invalid config.
            TypeError: a field of the wrong type.
        """
        value = _loads(text)
        if value is None:
            raise ValueError(
                "diffusion_offload_config JSON must be an object with keys "
                f"{list(_TOP_KEYS)}, got null"
            )
        legacy = False
        if isinstance(value, dict) and "enable_cpu_offload" in value:
            value = dict(value)
            legacy = value.pop("enable_cpu_offload")
            if not isinstance(legacy, bool):
                raise TypeError(
                    f"enable_cpu_offload must be a bool (true or false), got {legacy!r}"
                )
            if not value:  # the legacy switch alone: offload every DiT and encoder
                value = None
        config = parse_diffusion_offload_config(value, enable_cpu_offload=legacy)
        if config is None:
            raise ValueError(
                '{"enable_cpu_offload": false} alone selects no offload; give "mode" and '
                '"components", or set enable_cpu_offload to true'
            )
        return config


def _type_name(value: Any) -> str:
    return type(value).__name__


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice is an error, not silently last-wins.

    Raises:
        ValueError: a duplicate key (named in the message).
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"diffusion_offload_config JSON repeats key {key!r}; give each key once")
        out[key] = value
    return out


def _loads(text: str) -> Any:
    """Decode config JSON; a JSON string literal is refused, never decoded a second time."""
    try:
        value = json.loads(text, object_pairs_hook=reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"diffusion_offload_config: invalid JSON ({exc}) in {text!r}; expected a JSON "
            f"object with keys {list(_TOP_KEYS)}"
        ) from None
    if isinstance(value, str):
        raise TypeError(
            f"diffusion_offload_config JSON must be an object with keys {list(_TOP_KEYS)}, "
            f"got the JSON string {text!r}"
        )
    return value


def _parse_components(value: Any) -> tuple[str, ...]:
    allowed = f"a non-empty list of distinct names from {list(COMPONENTS)}"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"components must be {allowed}, got {value!r} ({_type_name(value)})"
        )
    if len(value) == 0:
        raise ValueError(f"components must be {allowed}, got an empty list []")
    seen: list[str] = []
    for item in value:
        if not isinstance(item, str):
            raise TypeError(
                f"components entries must be strings from {list(COMPONENTS)}, "
                f"got {item!r} ({_type_name(item)})"
            )
        if item not in COMPONENTS:
            raise ValueError(
                f"components entry {item!r} is not allowed; allowed values: "
                f"{list(COMPONENTS)} (exact, case-sensitive)"
            )
        if item in seen:
            raise ValueError(
                f"components entry {item!r} is repeated; list each name from "
                f"{list(COMPONENTS)} once"
            )
        seen.append(item)
    return tuple(seen)


def _parse_layer_options(
    value: Any, mode: str, components: tuple[str, ...]
) -> tuple[tuple[str, LayerOptions], ...]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"layer_options must be a mapping of component -> options, got {value!r} "
            f"({_type_name(value)})"
        )
    if mode == "module" and len(value) > 0:
        raise ValueError(
            f"layer_options={dict(value)!r} is not allowed with mode='module': module mode "
            "moves whole components and rejects layer_options (weight_transfer, "
            "resident_layers); use mode='layer' or remove layer_options"
        )
    out: list[tuple[str, LayerOptions]] = []
    for comp, opts in value.items():
        if not isinstance(comp, str):
            raise TypeError(
                f"layer_options keys must be component names (str) from {list(components)}, "
                f"got {comp!r} ({_type_name(comp)})"
            )
        if comp not in components:
            raise ValueError(
                f"layer_options key {comp!r} is not a selected component; allowed: "
                f"{list(components)} (the selected components)"
            )
        if not isinstance(opts, Mapping):
            raise TypeError(
                f"layer_options[{comp!r}] must be a mapping with keys {list(_LAYER_KEYS)}, "
                f"got {opts!r} ({_type_name(opts)})"
            )
        weight_transfer = None
        resident_layers = None
        for key, val in opts.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"layer_options[{comp!r}] keys must be str from {list(_LAYER_KEYS)}, "
                    f"got {key!r} ({_type_name(key)})"
                )
            if key == "weight_transfer":
                if not isinstance(val, str):
                    raise TypeError(
                        f"layer_options[{comp!r}].weight_transfer must be a str from "
                        f"{list(WEIGHT_TRANSFERS)}, got {val!r} ({_type_name(val)})"
                    )
                if val not in WEIGHT_TRANSFERS:
                    raise ValueError(
                        f"layer_options[{comp!r}].weight_transfer={val!r} is not allowed; "
                        f"allowed values: {list(WEIGHT_TRANSFERS)}"
                    )
                weight_transfer = val
            elif key == "resident_layers":
                if comp != "dit":
                    raise ValueError(
                        f"layer_options[{comp!r}].resident_layers={val!r} is not allowed: "
                        "resident_layers applies to 'dit' only"
                    )
                if isinstance(val, bool) or not isinstance(val, int):
                    raise TypeError(
                        f"layer_options['dit'].resident_layers must be an int >= 0, got "
                        f"{val!r} ({_type_name(val)})"
                    )
                if val < 0:
                    raise ValueError(
                        f"layer_options['dit'].resident_layers must be an int >= 0, got {val}"
                    )
                resident_layers = val
            else:
                raise ValueError(
                    f"layer_options[{comp!r}] has unknown key {key!r}; allowed keys: "
                    f"{list(_LAYER_KEYS)}"
                )
        out.append((comp, LayerOptions(weight_transfer, resident_layers)))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def parse_diffusion_offload_config(
    value: Mapping[str, Any] | DiffusionOffloadConfig | str | None,
    *,
    enable_cpu_offload: bool = False,
) -> DiffusionOffloadConfig | None:
    """Validate ``value`` and return a ``DiffusionOffloadConfig`` (or None: no offload).

    Args:
        value: a mapping with keys ``mode`` (required), ``components`` (required),
            ``layer_options``, ``pin_memory``; its JSON text; an already parsed
            config (returned as is, after the ``enable_cpu_offload`` check); or None.
        enable_cpu_offload: the legacy switch. With ``value=None`` it stands for
            model-level offload of every discovered DiT and encoder (``explicit=False``).
            With ``mode="module"`` it is accepted and the explicit selection wins. With
            ``mode="layer"`` it is a ValueError.

    Returns:
        The parsed config, or None when ``value`` is None and ``enable_cpu_offload`` is
        False.

    Raises:
        TypeError: ``value`` or a field has the wrong Python type (a non-string key,
            ``components`` given as a str or mapping, a non-bool ``pin_memory``, ...).
        ValueError: a bad value, a missing required key, an unknown key, invalid JSON,
            ``layer_options`` in module mode, ``enable_cpu_offload`` with layer mode, or
            ``"auto"`` (resolved by ``Omni``, ``generate`` and ``serve``, not here).
    """
    if not isinstance(enable_cpu_offload, bool):
        raise TypeError(
            f"enable_cpu_offload must be a bool (True or False), got {enable_cpu_offload!r} "
            f"({_type_name(enable_cpu_offload)})"
        )
    if value is None:
        if not enable_cpu_offload:
            return None
        return DiffusionOffloadConfig("module", COMPONENTS, (), True, explicit=False)
    if isinstance(value, str):
        if value.strip() == "auto":
            raise ValueError(
                "diffusion_offload_config='auto' is not a config: the planner resolves it for a "
                "model and a device. Use Omni(model, diffusion_offload_config='auto'), "
                "'diffusion-offload generate|serve --diffusion-offload-config auto', or "
                "diffusion_offload.plan_offload(model, device_memory=...) and pass a row's config"
            )
        value = _loads(value)
        if value is None:
            raise ValueError(
                "diffusion_offload_config JSON must be an object with keys "
                f"{list(_TOP_KEYS)}, got null"
            )
        return parse_diffusion_offload_config(value, enable_cpu_offload=enable_cpu_offload)
    if isinstance(value, DiffusionOffloadConfig):
        if enable_cpu_offload and value.mode == "layer":
            raise ValueError(_LEGACY_LAYER_MESSAGE)
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"diffusion_offload_config must be a mapping (or JSON object) with keys "
            f"{list(_TOP_KEYS)}, got {value!r} ({_type_name(value)})"
        )
    for key in value:
        if not isinstance(key, str):
            raise TypeError(
                f"diffusion_offload_config keys must be str from {list(_TOP_KEYS)}, got "
                f"{key!r} ({_type_name(key)})"
            )
        if key not in _TOP_KEYS:
            raise ValueError(
                f"diffusion_offload_config has unknown key {key!r}; allowed keys: "
                f"{list(_TOP_KEYS)}"
            )
    if "mode" not in value:
        raise ValueError(
            f"diffusion_offload_config is missing required key 'mode'; allowed values: "
            f"{list(MODES)}"
        )
    mode = value["mode"]
    if not isinstance(mode, str):
        raise TypeError(
            f"mode must be a str from {list(MODES)}, got {mode!r} ({_type_name(mode)})"
        )
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed; allowed values: {list(MODES)}")
    if enable_cpu_offload and mode == "layer":
        raise ValueError(_LEGACY_LAYER_MESSAGE)
    if "components" not in value:
        raise ValueError(
            "diffusion_offload_config is missing required key 'components'; allowed: a "
            f"non-empty list of names from {list(COMPONENTS)}"
        )
    components = _parse_components(value["components"])
    layer_options = _parse_layer_options(value.get("layer_options", {}), mode, components)
    pin_memory = value.get("pin_memory", True)
    if not isinstance(pin_memory, bool):
        raise TypeError(
            f"pin_memory must be a bool (True or False), got {pin_memory!r} "
            f"({_type_name(pin_memory)})"
        )
    return DiffusionOffloadConfig(mode, components, layer_options, pin_memory, explicit=True)


_LEGACY_LAYER_MESSAGE = (
    "enable_cpu_offload=True cannot be combined with mode='layer': enable_cpu_offload "
    "means model-level offload; allowed: mode='module', or drop enable_cpu_offload"
)
