"""``diffusion_offload_config`` parsing and validation (SPEC section 3)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diffusion_offload import (
    DiffusionOffloadConfig,
    ModelLevelOffloadBackend,
    parse_diffusion_offload_config,
)
from diffusion_offload.core.config import LayerOptions

MODE_NAMES = ["'module'", "'layer'"]
COMPONENT_NAMES = ["'dit'", "'text_encoder'"]
TOP_KEYS = ["'mode'", "'components'", "'layer_options'", "'pin_memory'"]
LAYER_KEYS = ["'weight_transfer'", "'resident_layers'"]
TRANSFERS = ["'rank-local'", "'allgather'"]
BOOLS = ["True", "False"]


def _cfg(**overrides):
    """A valid module-mode config with ``overrides`` applied (``...`` deletes a key)."""
    base = {"mode": "module", "components": ["dit"]}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not ...}


def _layer(layer_options, components=("dit", "text_encoder")):
    return {"mode": "layer", "components": list(components), "layer_options": layer_options}


# (value, kwargs for parse_diffusion_offload_config, exception type, substrings of the message)
BAD_CONFIGS = [
    # ---- the value itself
    pytest.param([], {}, TypeError, ["diffusion_offload_config", "[]", "list", *TOP_KEYS],
                 id="value-list"),
    pytest.param([("mode", "module")], {}, TypeError,
                 ["diffusion_offload_config", "[('mode', 'module')]", *TOP_KEYS],
                 id="value-list-of-pairs"),
    pytest.param(5, {}, TypeError, ["diffusion_offload_config", "5", "int", *TOP_KEYS],
                 id="value-int"),
    pytest.param(True, {}, TypeError, ["diffusion_offload_config", "True", *TOP_KEYS],
                 id="value-bool"),
    pytest.param(b'{"mode": "module"}', {}, TypeError,
                 ["diffusion_offload_config", "b'{\"mode\": \"module\"}'", *TOP_KEYS],
                 id="value-bytes"),
    # ---- JSON text
    pytest.param("{not json", {}, ValueError,
                 ["diffusion_offload_config", "invalid JSON", "'{not json'", *TOP_KEYS],
                 id="json-invalid"),
    pytest.param("", {}, ValueError, ["diffusion_offload_config", "invalid JSON", "''", *TOP_KEYS],
                 id="json-empty"),
    pytest.param("{'mode': 'module'}", {}, ValueError,
                 ["invalid JSON", "\"{'mode': 'module'}\"", *TOP_KEYS], id="json-single-quotes"),
    pytest.param('{"mode": "module", "components": ["dit"],}', {}, ValueError,
                 ["invalid JSON", "'mode'", "'components'"], id="json-trailing-comma"),
    pytest.param("null", {}, ValueError, ["diffusion_offload_config", "null", *TOP_KEYS],
                 id="json-null"),
    pytest.param("[1, 2]", {}, TypeError, ["diffusion_offload_config", "[1, 2]", *TOP_KEYS],
                 id="json-array"),
    pytest.param("7", {}, TypeError, ["diffusion_offload_config", "7", *TOP_KEYS],
                 id="json-number"),
    pytest.param(json.dumps(json.dumps(_cfg())), {}, TypeError,
                 ["diffusion_offload_config", "JSON string", *TOP_KEYS], id="json-double-encoded"),
    pytest.param('{"mode": "module", "components": "dit"}', {}, TypeError,
                 ["components", "'dit'", *COMPONENT_NAMES], id="json-components-str"),
    pytest.param('{"mode": "modules", "components": ["dit"]}', {}, ValueError,
                 ["mode", "'modules'", *MODE_NAMES], id="json-mode-unknown"),
    pytest.param('{"mode": "module", "components": ["dit"], "pin_memory": "true"}', {}, TypeError,
                 ["pin_memory", "'true'", *BOOLS], id="json-pin-memory-str"),
    # ---- top-level keys
    pytest.param(_cfg(**{"pin-memory": True}), {}, ValueError,
                 ["diffusion_offload_config", "unknown key", "'pin-memory'", *TOP_KEYS],
                 id="key-unknown-dash"),
    pytest.param(_cfg(Mode="module"), {}, ValueError, ["unknown key", "'Mode'", *TOP_KEYS],
                 id="key-unknown-case"),
    pytest.param(_cfg(enable_cpu_offload=True), {}, ValueError,
                 ["unknown key", "'enable_cpu_offload'", *TOP_KEYS], id="key-enable-cpu-offload"),
    pytest.param(_cfg(device="cuda"), {}, ValueError, ["unknown key", "'device'", *TOP_KEYS],
                 id="key-unknown-device"),
    pytest.param({**_cfg(), 1: "x"}, {}, TypeError,
                 ["diffusion_offload_config", "keys", "1", "int", *TOP_KEYS], id="key-int"),
    pytest.param({None: "module", **_cfg()}, {}, TypeError,
                 ["diffusion_offload_config", "None", *TOP_KEYS], id="key-none"),
    pytest.param({("mode",): "module", **_cfg()}, {}, TypeError,
                 ["diffusion_offload_config", "('mode',)", "tuple", *TOP_KEYS], id="key-tuple"),
    # ---- mode
    pytest.param(_cfg(mode=...), {}, ValueError, ["missing", "'mode'", *MODE_NAMES],
                 id="mode-missing"),
    pytest.param(_cfg(mode=None), {}, TypeError, ["mode", "None", *MODE_NAMES], id="mode-none"),
    pytest.param(_cfg(mode=1), {}, TypeError, ["mode", "1", "int", *MODE_NAMES], id="mode-int"),
    pytest.param(_cfg(mode=True), {}, TypeError, ["mode", "True", "bool", *MODE_NAMES],
                 id="mode-bool"),
    pytest.param(_cfg(mode=["module"]), {}, TypeError, ["mode", "['module']", *MODE_NAMES],
                 id="mode-list"),
    pytest.param(_cfg(mode="Module"), {}, ValueError, ["mode", "'Module'", *MODE_NAMES],
                 id="mode-wrong-case"),
    pytest.param(_cfg(mode="modules"), {}, ValueError, ["mode", "'modules'", *MODE_NAMES],
                 id="mode-plural"),
    pytest.param(_cfg(mode="LAYER"), {}, ValueError, ["mode", "'LAYER'", *MODE_NAMES],
                 id="mode-upper"),
    pytest.param(_cfg(mode=" module"), {}, ValueError, ["mode", "' module'", *MODE_NAMES],
                 id="mode-whitespace"),
    pytest.param(_cfg(mode=""), {}, ValueError, ["mode", "''", *MODE_NAMES], id="mode-empty"),
    pytest.param(_cfg(mode="sequential"), {}, ValueError, ["mode", "'sequential'", *MODE_NAMES],
                 id="mode-sequential"),
    # ---- components
    pytest.param(_cfg(components=...), {}, ValueError,
                 ["missing", "'components'", *COMPONENT_NAMES], id="components-missing"),
    pytest.param(_cfg(components="dit"), {}, TypeError,
                 ["components", "'dit'", "str", *COMPONENT_NAMES], id="components-str"),
    pytest.param(_cfg(components=b"dit"), {}, TypeError,
                 ["components", "b'dit'", *COMPONENT_NAMES], id="components-bytes"),
    pytest.param(_cfg(components={"dit": True}), {}, TypeError,
                 ["components", "{'dit': True}", "dict", *COMPONENT_NAMES], id="components-dict"),
    pytest.param(_cfg(components={"dit"}), {}, TypeError,
                 ["components", "{'dit'}", "set", *COMPONENT_NAMES], id="components-set"),
    pytest.param(_cfg(components=None), {}, TypeError,
                 ["components", "None", *COMPONENT_NAMES], id="components-none"),
    pytest.param(_cfg(components=2), {}, TypeError, ["components", "2", *COMPONENT_NAMES],
                 id="components-int"),
    pytest.param(_cfg(components=[]), {}, ValueError,
                 ["components", "[]", "non-empty", *COMPONENT_NAMES], id="components-empty"),
    pytest.param(_cfg(components=["DiT"]), {}, ValueError,
                 ["components", "'DiT'", "case-sensitive", *COMPONENT_NAMES],
                 id="components-wrong-case"),
    pytest.param(_cfg(components=["Text_Encoder"]), {}, ValueError,
                 ["components", "'Text_Encoder'", *COMPONENT_NAMES], id="components-wrong-case-te"),
    pytest.param(_cfg(components=["vae"]), {}, ValueError,
                 ["components", "'vae'", *COMPONENT_NAMES], id="components-unknown-vae"),
    pytest.param(_cfg(components=["dit", "image_encoder"]), {}, ValueError,
                 ["components", "'image_encoder'", *COMPONENT_NAMES], id="components-unknown-2nd"),
    pytest.param(_cfg(components=["dit", "dit"]), {}, ValueError,
                 ["components", "'dit'", "repeated", *COMPONENT_NAMES], id="components-duplicate"),
    pytest.param(_cfg(components=["text_encoder", "dit", "text_encoder"]), {}, ValueError,
                 ["components", "'text_encoder'", "repeated", *COMPONENT_NAMES],
                 id="components-duplicate-later"),
    pytest.param(_cfg(components=["dit", 1]), {}, TypeError,
                 ["components", "1", "int", *COMPONENT_NAMES], id="components-entry-int"),
    pytest.param(_cfg(components=[None]), {}, TypeError,
                 ["components", "None", *COMPONENT_NAMES], id="components-entry-none"),
    pytest.param(_cfg(components=[["dit"]]), {}, TypeError,
                 ["components", "['dit']", "list", *COMPONENT_NAMES], id="components-entry-list"),
    # ---- layer_options in module mode
    pytest.param(_cfg(layer_options={"dit": {"weight_transfer": "rank-local"}}), {}, ValueError,
                 ["layer_options", "{'dit': {'weight_transfer': 'rank-local'}}", "mode='module'",
                  "mode='layer'"], id="layer-options-in-module-mode"),
    pytest.param(_cfg(layer_options={"dit": {}}), {}, ValueError,
                 ["layer_options", "{'dit': {}}", "mode='module'", "mode='layer'"],
                 id="layer-options-in-module-mode-empty-inner"),
    pytest.param(_cfg(layer_options={"dit": {"resident_layers": 2}}), {}, ValueError,
                 ["layer_options", "'resident_layers': 2", "mode='module'"],
                 id="layer-options-in-module-mode-resident"),
    # ---- layer_options: shape
    pytest.param(_layer(["dit"]), {}, TypeError, ["layer_options", "['dit']", "list", "mapping"],
                 id="layer-options-list"),
    pytest.param(_layer("dit"), {}, TypeError, ["layer_options", "'dit'", "mapping"],
                 id="layer-options-str"),
    pytest.param(_layer(None), {}, TypeError, ["layer_options", "None", "mapping"],
                 id="layer-options-none"),
    pytest.param(_cfg(layer_options=[]), {}, TypeError, ["layer_options", "[]", "mapping"],
                 id="layer-options-list-module-mode"),
    pytest.param(_layer({"text_encoder": {}}, components=["dit"]), {}, ValueError,
                 ["layer_options", "'text_encoder'", "not a selected component", "['dit']"],
                 id="layer-options-key-not-selected"),
    pytest.param(_layer({"vae": {}}), {}, ValueError,
                 ["layer_options", "'vae'", *COMPONENT_NAMES], id="layer-options-key-unknown"),
    pytest.param(_layer({"DiT": {}}), {}, ValueError,
                 ["layer_options", "'DiT'", *COMPONENT_NAMES], id="layer-options-key-case"),
    pytest.param(_layer({1: {}}), {}, TypeError,
                 ["layer_options", "1", "int", *COMPONENT_NAMES], id="layer-options-key-int"),
    pytest.param(_layer({"dit": "rank-local"}), {}, TypeError,
                 ["layer_options['dit']", "'rank-local'", "mapping", *LAYER_KEYS],
                 id="layer-options-inner-str"),
    pytest.param(_layer({"dit": ["allgather"]}), {}, TypeError,
                 ["layer_options['dit']", "['allgather']", *LAYER_KEYS],
                 id="layer-options-inner-list"),
    pytest.param(_layer({"dit": {"weight_transfers": "allgather"}}), {}, ValueError,
                 ["layer_options['dit']", "unknown key", "'weight_transfers'", *LAYER_KEYS],
                 id="layer-options-inner-unknown"),
    pytest.param(_layer({"text_encoder": {"offload": True}}), {}, ValueError,
                 ["layer_options['text_encoder']", "'offload'", *LAYER_KEYS],
                 id="layer-options-inner-unknown-te"),
    pytest.param(_layer({"dit": {1: "x"}}), {}, TypeError,
                 ["layer_options['dit']", "1", "int", *LAYER_KEYS],
                 id="layer-options-inner-key-int"),
    # ---- weight_transfer
    pytest.param(_layer({"dit": {"weight_transfer": "all-gather"}}), {}, ValueError,
                 ["layer_options['dit'].weight_transfer", "'all-gather'", *TRANSFERS],
                 id="weight-transfer-unknown"),
    pytest.param(_layer({"text_encoder": {"weight_transfer": "Rank-Local"}}), {}, ValueError,
                 ["layer_options['text_encoder'].weight_transfer", "'Rank-Local'", *TRANSFERS],
                 id="weight-transfer-case"),
    pytest.param(_layer({"dit": {"weight_transfer": 1}}), {}, TypeError,
                 ["weight_transfer", "1", "int", *TRANSFERS], id="weight-transfer-int"),
    pytest.param(_layer({"dit": {"weight_transfer": None}}), {}, TypeError,
                 ["weight_transfer", "None", *TRANSFERS], id="weight-transfer-none"),
    pytest.param(_layer({"dit": {"weight_transfer": ["rank-local"]}}), {}, TypeError,
                 ["weight_transfer", "['rank-local']", *TRANSFERS], id="weight-transfer-list"),
    # ---- resident_layers
    pytest.param(_layer({"dit": {"resident_layers": -1}}), {}, ValueError,
                 ["layer_options['dit'].resident_layers", "-1", "int >= 0"],
                 id="resident-layers-negative"),
    pytest.param(_layer({"dit": {"resident_layers": True}}), {}, TypeError,
                 ["resident_layers", "True", "bool", "int >= 0"], id="resident-layers-bool"),
    pytest.param(_layer({"dit": {"resident_layers": 1.0}}), {}, TypeError,
                 ["resident_layers", "1.0", "float", "int >= 0"], id="resident-layers-float"),
    pytest.param(_layer({"dit": {"resident_layers": "2"}}), {}, TypeError,
                 ["resident_layers", "'2'", "int >= 0"], id="resident-layers-str"),
    pytest.param(_layer({"dit": {"resident_layers": None}}), {}, TypeError,
                 ["resident_layers", "None", "int >= 0"], id="resident-layers-none"),
    pytest.param(_layer({"text_encoder": {"resident_layers": 1}}), {}, ValueError,
                 ["layer_options['text_encoder'].resident_layers", "1", "'dit' only"],
                 id="resident-layers-on-text-encoder"),
    pytest.param(_layer({"text_encoder": {"resident_layers": 0}}, components=["text_encoder"]), {},
                 ValueError, ["layer_options['text_encoder'].resident_layers", "0", "'dit' only"],
                 id="resident-layers-zero-on-text-encoder"),
    # ---- pin_memory
    pytest.param(_cfg(pin_memory="yes"), {}, TypeError, ["pin_memory", "'yes'", "str", *BOOLS],
                 id="pin-memory-yes"),
    pytest.param(_cfg(pin_memory=1), {}, TypeError, ["pin_memory", "1", "int", *BOOLS],
                 id="pin-memory-one"),
    pytest.param(_cfg(pin_memory=0), {}, TypeError, ["pin_memory", "0", "int", *BOOLS],
                 id="pin-memory-zero"),
    pytest.param(_cfg(pin_memory=None), {}, TypeError, ["pin_memory", "None", *BOOLS],
                 id="pin-memory-none"),
    pytest.param(_cfg(pin_memory="True"), {}, TypeError, ["pin_memory", "'True'", *BOOLS],
                 id="pin-memory-str-true"),
    # ---- enable_cpu_offload
    pytest.param(_layer({}), {"enable_cpu_offload": True}, ValueError,
                 ["enable_cpu_offload", "mode='layer'", "mode='module'"],
                 id="legacy-with-layer-mode"),
    pytest.param({"mode": "layer", "components": ["dit"]}, {"enable_cpu_offload": True},
                 ValueError, ["enable_cpu_offload", "'layer'", "mode='module'"],
                 id="legacy-with-layer-mode-no-options"),
    pytest.param('{"mode": "layer", "components": ["dit"]}', {"enable_cpu_offload": True},
                 ValueError, ["enable_cpu_offload", "'layer'", "mode='module'"],
                 id="legacy-with-layer-mode-json"),
    pytest.param(_cfg(), {"enable_cpu_offload": "yes"}, TypeError,
                 ["enable_cpu_offload", "'yes'", *BOOLS], id="legacy-str"),
    pytest.param(_cfg(), {"enable_cpu_offload": 1}, TypeError,
                 ["enable_cpu_offload", "1", "int", *BOOLS], id="legacy-int"),
    pytest.param(None, {"enable_cpu_offload": None}, TypeError,
                 ["enable_cpu_offload", "None", *BOOLS], id="legacy-none"),
    pytest.param(None, {"enable_cpu_offload": "true"}, TypeError,
                 ["enable_cpu_offload", "'true'", *BOOLS], id="legacy-str-value-none"),
]


def test_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 45


@pytest.mark.parametrize(("value", "kwargs", "exc_type", "substrings"), BAD_CONFIGS)
def test_malformed_config_is_rejected(value, kwargs, exc_type, substrings):
    with pytest.raises(exc_type) as info:
        parse_diffusion_offload_config(value, **kwargs)
    assert type(info.value) is exc_type  # exact type, not a subclass
    message = str(info.value)
    missing = [s for s in substrings if s not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_already_parsed_layer_config_with_legacy_flag_is_rejected():
    parsed = parse_diffusion_offload_config({"mode": "layer", "components": ["dit"]})
    with pytest.raises(ValueError, match="enable_cpu_offload"):
        parse_diffusion_offload_config(parsed, enable_cpu_offload=True)


def test_from_json_rejects_bad_input():
    with pytest.raises(ValueError, match="invalid JSON"):
        DiffusionOffloadConfig.from_json("{")
    with pytest.raises(TypeError, match="JSON string"):
        DiffusionOffloadConfig.from_json(json.dumps(json.dumps(_cfg())))
    with pytest.raises(TypeError, match="enable_cpu_offload"):
        DiffusionOffloadConfig.from_json(json.dumps({**_cfg(), "enable_cpu_offload": "yes"}))
    with pytest.raises(ValueError, match="mode='layer'"):
        DiffusionOffloadConfig.from_json(
            json.dumps({"mode": "layer", "components": ["dit"], "enable_cpu_offload": True})
        )


# ----------------------------------------------------------------------------- valid configs


def test_defaults():
    c = parse_diffusion_offload_config({"mode": "module", "components": ["dit", "text_encoder"]})
    assert c == DiffusionOffloadConfig("module", ("dit", "text_encoder"), (), True, True)
    assert c.pin_memory is True
    assert c.explicit is True
    assert c.layer_options == ()
    assert c.selects("dit") and c.selects("text_encoder")


def test_component_order_is_kept_and_pin_memory_false():
    c = parse_diffusion_offload_config(
        {"mode": "module", "components": ["text_encoder"], "pin_memory": False}
    )
    assert c.components == ("text_encoder",)
    assert c.pin_memory is False
    assert c.selects("text_encoder") and not c.selects("dit")
    c2 = parse_diffusion_offload_config({"mode": "module", "components": ["text_encoder", "dit"]})
    assert c2.components == ("text_encoder", "dit")


def test_module_mode_accepts_empty_layer_options_and_tuple_components():
    c = parse_diffusion_offload_config(
        {"mode": "module", "components": ("dit",), "layer_options": {}}
    )
    assert c.components == ("dit",)
    assert c.layer_options == ()


def test_layer_mode_with_options_parses():
    c = parse_diffusion_offload_config(
        {
            "mode": "layer",
            "components": ["text_encoder", "dit"],
            "layer_options": {
                "text_encoder": {"weight_transfer": "allgather"},
                "dit": {"weight_transfer": "rank-local", "resident_layers": 0},
            },
            "pin_memory": False,
        }
    )
    assert c.mode == "layer"
    assert c.components == ("text_encoder", "dit")
    assert c.layer_options == (
        ("dit", LayerOptions("rank-local", 0)),
        ("text_encoder", LayerOptions("allgather", None)),
    )
    assert c.pin_memory is False
    assert c.explicit is True


def test_layer_mode_without_options_parses():
    c = parse_diffusion_offload_config({"mode": "layer", "components": ["dit"]})
    assert c.mode == "layer" and c.layer_options == ()


def test_legacy_enable_cpu_offload():
    c = parse_diffusion_offload_config(None, enable_cpu_offload=True)
    assert c is not None
    assert c.mode == "module"
    assert c.components == ("dit", "text_encoder")
    assert c.pin_memory is True
    assert c.explicit is False
    assert c.layer_options == ()


def test_legacy_with_module_mode_keeps_the_explicit_selection():
    c = parse_diffusion_offload_config(
        {"mode": "module", "components": ["text_encoder"], "pin_memory": False},
        enable_cpu_offload=True,
    )
    assert c == DiffusionOffloadConfig("module", ("text_encoder",), (), False, True)
    assert c.explicit is True


def test_none_without_legacy_is_none():
    assert parse_diffusion_offload_config(None) is None
    assert parse_diffusion_offload_config(None, enable_cpu_offload=False) is None


def test_json_string_input():
    text = '{"mode": "module", "components": ["dit"], "pin_memory": false}'
    c = parse_diffusion_offload_config(text)
    assert c == DiffusionOffloadConfig("module", ("dit",), (), False, True)
    assert parse_diffusion_offload_config(text, enable_cpu_offload=True) == c


def test_parsed_config_passes_through():
    c = parse_diffusion_offload_config({"mode": "module", "components": ["dit"]})
    assert parse_diffusion_offload_config(c) is c
    assert parse_diffusion_offload_config(c, enable_cpu_offload=True) is c


def test_input_mapping_is_not_kept_or_mutated():
    raw = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1}}}
    snapshot = json.loads(json.dumps(raw))
    c = parse_diffusion_offload_config(raw)
    assert raw == snapshot
    raw["components"].append("text_encoder")
    raw["layer_options"]["dit"]["resident_layers"] = 5
    assert c.components == ("dit",)
    assert c.layer_options == (("dit", LayerOptions(None, 1)),)


VALID = [
    {"mode": "module", "components": ["dit"]},
    {"mode": "module", "components": ["text_encoder", "dit"], "pin_memory": False},
    {"mode": "layer", "components": ["dit"]},
    {
        "mode": "layer",
        "components": ["dit", "text_encoder"],
        "layer_options": {
            "dit": {"resident_layers": 3, "weight_transfer": "allgather"},
            "text_encoder": {},
        },
    },
    None,  # legacy enable_cpu_offload=True
]


def _parse_valid(raw):
    if raw is None:
        return parse_diffusion_offload_config(None, enable_cpu_offload=True)
    return parse_diffusion_offload_config(raw)


@pytest.mark.parametrize("raw", VALID, ids=lambda r: "legacy" if r is None else json.dumps(r))
def test_immutable_hashable_picklable_json_round_trip(raw):
    c = _parse_valid(raw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = "layer"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.pin_memory = not c.pin_memory
    for _, opts in c.layer_options:
        with pytest.raises(dataclasses.FrozenInstanceError):
            opts.resident_layers = 7
    again = _parse_valid(json.loads(json.dumps(raw)))
    assert again == c and again is not c
    assert hash(again) == hash(c)
    assert len({c, again}) == 1
    restored = pickle.loads(pickle.dumps(c))
    assert restored == c and hash(restored) == hash(c)
    assert DiffusionOffloadConfig.from_json(c.to_json()) == c
    assert json.loads(c.to_json()) == c.to_dict()
    if c.explicit:
        assert parse_diffusion_offload_config(c.to_dict()) == c
        assert parse_diffusion_offload_config(c.to_json()) == c


def test_legacy_round_trip_keeps_explicit_false():
    c = parse_diffusion_offload_config(None, enable_cpu_offload=True)
    back = DiffusionOffloadConfig.from_json(c.to_json())
    assert back == c
    assert back.explicit is False
    explicit = parse_diffusion_offload_config(
        {"mode": "module", "components": ["dit", "text_encoder"]}
    )
    assert explicit != c  # same selection, different meaning (discover image encoders too)


_SELECTIONS = [
    list(p)
    for r in (1, 2)
    for combo in itertools.combinations(("dit", "text_encoder"), r)
    for p in itertools.permutations(combo)
]


@given(
    components=st.sampled_from(_SELECTIONS),
    pin_memory=st.booleans(),
    mode=st.sampled_from(["module", "layer"]),
    as_json=st.booleans(),
)
def test_round_trip_property(components, pin_memory, mode, as_json):
    raw = {"mode": mode, "components": components, "pin_memory": pin_memory}
    c = parse_diffusion_offload_config(json.dumps(raw) if as_json else raw)
    assert c.components == tuple(components)
    assert c.pin_memory is pin_memory
    assert c.mode == mode
    back = DiffusionOffloadConfig.from_json(c.to_json())
    assert back == c
    assert back.components == tuple(components)
    assert hash(back) == hash(c)
    assert pickle.loads(pickle.dumps(c)) == c


# ----------------------------------------------------------------------------- backend


def test_each_backend_refuses_the_other_mode_naming_the_right_one():
    from diffusion_offload import LayerwiseOffloadBackend

    with pytest.raises(ValueError, match="LayerwiseOffloadBackend"):
        ModelLevelOffloadBackend({"mode": "layer", "components": ["dit"]}, "cpu")
    with pytest.raises(ValueError, match="ModelLevelOffloadBackend"):
        LayerwiseOffloadBackend({"mode": "module", "components": ["dit"]}, "cpu")


def test_layer_backend_refuses_allgather_naming_distributed_layer_offload():
    from diffusion_offload import LayerwiseOffloadBackend

    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    with pytest.raises(NotImplementedError, match="distributed layer offload"):
        LayerwiseOffloadBackend(config, "cpu")
    ok = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "rank-local"}}}
    assert LayerwiseOffloadBackend(ok, "cpu").config.mode == "layer"


def test_backend_validates_config_first():
    with pytest.raises(ValueError, match="'Module'"):
        ModelLevelOffloadBackend({"mode": "Module", "components": ["dit"]}, "cpu")
    with pytest.raises(TypeError, match="components"):
        ModelLevelOffloadBackend({"mode": "module", "components": "dit"}, "cpu")
