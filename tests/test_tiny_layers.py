"""Many-block test models for layer mode: ``tiny_pipelines.build(..., num_layers=N)``,
``diffusion-offload make-tiny --num-layers N`` and ``testing.toy.SyntheticDiT``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_offload.cli_args import build_parser
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.toy import SyntheticBlock, SyntheticDiT, ToyDiT

KINDS = tiny_pipelines.KINDS

# the depths every kind had before num_layers existed (and still has with None)
DEFAULT_DEPTHS = {
    "wan2.1": {"transformer.blocks": 2},
    "wan2.2": {"transformer.blocks": 2, "transformer_2.blocks": 2},
    "wan2.2-i2v": {"transformer.blocks": 2, "transformer_2.blocks": 2},
    "flux": {"transformer.transformer_blocks": 1, "transformer.single_transformer_blocks": 2},
    "sd3": {"transformer.transformer_blocks": 2},
    "qwen-image": {"transformer.transformer_blocks": 2},
}


def _depths(pipe, kind: str, encoders: bool = False) -> dict[str, int]:
    return {p: len(m) for p, m in tiny_pipelines.block_containers(pipe, kind, encoders).items()}


def _dit_names(pipe) -> list[str]:
    return [n for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _run(pipe, kind: str) -> np.ndarray:
    kwargs = tiny_pipelines.default_call_kwargs(kind)
    negative = {} if kind == "flux" else {"negative_prompt": "blurry"}
    with torch.no_grad():
        out = pipe(
            prompt="a photo of a cat",
            output_type="np",
            generator=torch.Generator().manual_seed(0),
            **negative,
            **kwargs,
        )
    return np.asarray(out.frames if kind.startswith("wan") else out.images)


# ----------------------------------------------------------------- tiny pipelines


@pytest.fixture(scope="module")
def deep() -> dict[str, object]:
    """Every kind built once with num_layers=8."""
    return {kind: tiny_pipelines.build(kind, 0, num_layers=8) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_num_layers_gives_every_dit_n_blocks(kind, deep):
    pipe = deep[kind]
    depths = _depths(pipe, kind)
    assert set(depths) == set(DEFAULT_DEPTHS[kind])
    assert set(depths.values()) == {8}
    for name in _dit_names(pipe):  # the config says so too, so save/load keeps the depth
        config = getattr(pipe, name).config
        assert config.num_layers == 8
        if kind == "flux":
            assert config.num_single_layers == 8
    # the block paths are the only ModuleLists of blocks in the DiTs, and text encoders keep 2
    for path, n in _depths(pipe, kind, encoders=True).items():
        assert n == (8 if path in depths else 2), path


@pytest.mark.parametrize("kind", KINDS)
def test_deep_pipeline_runs_two_steps(kind, deep):
    pipe = deep[kind]
    calls: dict[str, int] = {}
    handles = []
    for path, blocks in tiny_pipelines.block_containers(pipe, kind).items():
        for i, block in enumerate(blocks):
            key = f"{path}.{i}"
            handles.append(
                block.register_forward_hook(lambda *_a, key=key: calls.__setitem__(key, calls.get(key, 0) + 1))
            )
    try:
        out = _run(pipe, kind)
    finally:
        for h in handles:
            h.remove()
    assert np.isfinite(out).all()
    assert out.shape == ((1, 5, 32, 32, 3) if kind.startswith("wan") else (1, 32, 32, 3))
    # every block of every DiT ran (Wan2.2: each expert runs one of the two steps)
    expected = {f"{p}.{i}" for p in DEFAULT_DEPTHS[kind] for i in range(8)}
    assert set(calls) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_default_is_unchanged(kind):
    """None builds what build(kind, seed) built before the option existed."""
    default = tiny_pipelines.build(kind, 0)
    explicit = tiny_pipelines.build(kind, 0, num_layers=None)
    assert _depths(default, kind) == DEFAULT_DEPTHS[kind]
    modules = {n: c for n, c in default.components.items() if isinstance(c, torch.nn.Module)}
    assert modules
    for name, module in modules.items():
        assert _same_state(module, getattr(explicit, name)), name


def test_num_layers_weights_are_deterministic():
    a = tiny_pipelines.build("wan2.2", 0, num_layers=3)
    b = tiny_pipelines.build("wan2.2", 0, num_layers=3)
    c = tiny_pipelines.build("wan2.2", 1, num_layers=3)
    assert _same_state(a.transformer, b.transformer)
    assert _same_state(a.transformer_2, b.transformer_2)
    assert not _same_state(a.transformer, c.transformer)
    assert not _same_state(a.transformer, a.transformer_2)  # the experts differ


def test_num_layers_one():
    pipe = tiny_pipelines.build("flux", 0, num_layers=1)
    assert set(_depths(pipe, "flux").values()) == {1}


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-3, ValueError),
        (2.0, TypeError),
        ("8", TypeError),
        (True, TypeError),
        ([8], TypeError),
    ],
)
def test_bad_num_layers_rejected(value, error, tmp_path):
    for call in (
        lambda: tiny_pipelines.build("wan2.1", 0, num_layers=value),
        lambda: tiny_pipelines.save("wan2.1", tmp_path / "out", num_layers=value),
    ):
        with pytest.raises(error) as info:
            call()
        message = str(info.value)
        assert "num_layers" in message
        assert repr(value) in message
        assert "integer >= 1" in message
    assert not (tmp_path / "out").exists()  # nothing written


def test_numpy_integer_accepted():
    assert tiny_pipelines.check_num_layers(np.int64(4)) == 4
    assert type(tiny_pipelines.check_num_layers(np.int64(4))) is int
    assert tiny_pipelines.check_num_layers(None) is None


def test_save_records_num_layers(tmp_path):
    from diffusers import DiffusionPipeline

    deep = tiny_pipelines.save("sd3", tmp_path / "deep", seed=5, num_layers=3)
    plain = tiny_pipelines.save("wan2.1", tmp_path / "plain")
    assert tiny_pipelines.read_marker(deep) == {"kind": "sd3", "seed": 5, "num_layers": 3}
    assert tiny_pipelines.read_marker(plain) == {"kind": "wan2.1", "seed": 0, "num_layers": None}
    assert tiny_pipelines.kind_of(deep) == "sd3"
    loaded = DiffusionPipeline.from_pretrained(deep)
    assert _depths(loaded, "sd3") == {"transformer.transformer_blocks": 3}
    assert _same_state(loaded.transformer, tiny_pipelines.build("sd3", 5, num_layers=3).transformer)
    # a marker written before num_layers existed
    (plain / tiny_pipelines.MARKER).write_text(json.dumps({"kind": "wan2.1", "seed": 0}))
    assert tiny_pipelines.read_marker(plain) == {"kind": "wan2.1", "seed": 0, "num_layers": None}
    (plain / tiny_pipelines.MARKER).write_text(json.dumps({"kind": "nope"}))
    assert tiny_pipelines.read_marker(plain) is None
    assert tiny_pipelines.kind_of(plain) is None


# ----------------------------------------------------------------- make-tiny --num-layers


def test_make_tiny_parser_num_layers():
    parser = build_parser()
    assert parser.parse_args(["make-tiny", "flux", "d"]).num_layers is None
    assert parser.parse_args(["make-tiny", "flux", "d", "--num-layers", "8"]).num_layers == 8


@pytest.mark.parametrize("bad", ["0", "-1", "2.5", "eight", "1001"])
def test_make_tiny_parser_rejects_bad_num_layers(bad, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["make-tiny", "flux", "d", "--num-layers", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--num-layers" in err and repr(bad) in err


def test_make_tiny_num_layers_writes_deep_folder(tmp_path, monkeypatch, capsys):
    """``diffusion-offload make-tiny flux DIR --num-layers 8``, run in-process through
    ``cli.main`` (test_cli.py covers the real subprocess and its quietness; here the
    process-wide logging/warning settings it makes are stubbed out)."""
    from diffusers import DiffusionPipeline

    from diffusion_offload import cli

    monkeypatch.setattr(cli, "quiet_libraries", lambda *a, **k: None)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda *a, **k: None)
    target = tmp_path / "flux8"
    assert cli.main(["make-tiny", "flux", str(target), "--num-layers", "8"]) == 0
    assert Path(capsys.readouterr().out.strip()) == target
    assert tiny_pipelines.read_marker(target) == {"kind": "flux", "seed": 0, "num_layers": 8}
    config = json.loads((target / "transformer" / "config.json").read_text())
    assert (config["num_layers"], config["num_single_layers"]) == (8, 8)
    loaded = DiffusionPipeline.from_pretrained(target)
    assert set(_depths(loaded, "flux").values()) == {8}
    assert _same_state(loaded.transformer, tiny_pipelines.build("flux", 0, num_layers=8).transformer)
    # --overwrite replaces it with the default depths, and the marker says so
    assert cli.main(["make-tiny", "flux", str(target), "--overwrite"]) == 0
    assert tiny_pipelines.read_marker(target) == {"kind": "flux", "seed": 0, "num_layers": None}
    config = json.loads((target / "transformer" / "config.json").read_text())
    assert (config["num_layers"], config["num_single_layers"]) == (1, 2)


# ----------------------------------------------------------------- synthetic DiT


def _record(model: SyntheticDiT) -> tuple[list[int], list]:
    order: list[int] = []
    handles = [
        block.register_forward_hook(lambda *_a, i=i: order.append(i)) for i, block in enumerate(model.blocks)
    ]
    return order, handles


def test_synthetic_dit_layout_and_shapes():
    model = SyntheticDiT(num_blocks=16, width=32, in_dim=8, seed=0)
    assert SyntheticDiT._layerwise_offload_blocks_attrs == ["blocks"]
    assert ToyDiT._layerwise_offload_blocks_attrs == ["blocks"]
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 16
    assert all(isinstance(b, SyntheticBlock) for b in model.blocks)
    assert not model.training
    block = model.blocks[0]
    assert "residual_scale" in block.state_dict() and "attn_temperature" not in block.state_dict()
    assert {n for n, _ in block.named_buffers()} == {"residual_scale", "attn_temperature"}
    x = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model(x)
    assert y.shape == (3, 10, 8) and y.dtype == torch.float32 and torch.isfinite(y).all()
    # attention mixes the sequence: changing one token changes the others' outputs
    x2 = x.clone()
    x2[:, 0] += 1.0
    with torch.no_grad():
        y2 = model(x2)
    assert not torch.allclose(y[:, 1:], y2[:, 1:])
    with pytest.raises(ValueError, match=r"\[batch, seq, 8\]"):
        model(torch.randn(3, 10, 7))


def test_synthetic_dit_dtype():
    model = SyntheticDiT(num_blocks=2, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}
    with torch.no_grad():
        y = model(torch.randn(1, 4, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_synthetic_dit_determinism():
    state = torch.random.get_rng_state()
    a, b, c = SyntheticDiT(num_blocks=4, seed=7), SyntheticDiT(num_blocks=4, seed=7), SyntheticDiT(num_blocks=4, seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    assert _same_state(a, b) and not _same_state(a, c)
    assert not torch.equal(a.blocks[0].qkv.weight, a.blocks[1].qkv.weight)  # blocks differ
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    # skip/repeat/order change what runs, not the weights
    assert _same_state(a, SyntheticDiT(num_blocks=4, seed=7, skip=(1,), repeat=(2,)))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, list(range(16))),
        ({"skip": (3,)}, [0, 1, 2] + list(range(4, 16))),
        ({"repeat": (2,)}, [0, 1, 2, 2] + list(range(3, 16))),
        ({"skip": (0, 15), "repeat": (5,)}, [1, 2, 3, 4, 5, 5] + list(range(6, 15))),
        ({"order": (15, 3, 3, 0)}, [15, 3, 3, 0]),
    ],
)
def test_synthetic_dit_executed_sequence(kwargs, expected):
    model = SyntheticDiT(num_blocks=16, seed=0, **kwargs)
    assert list(model.block_order) == expected
    order, handles = _record(model)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x)
    for h in handles:
        h.remove()
    assert order == expected
    if kwargs:  # a different block sequence gives a different output
        with torch.no_grad():
            assert not torch.allclose(y, SyntheticDiT(num_blocks=16, seed=0)(x))


def test_synthetic_dit_block_order_is_settable():
    model = SyntheticDiT(num_blocks=4)
    model.block_order = [3, 2, 1, 0]
    order, handles = _record(model)
    with torch.no_grad():
        model(torch.randn(1, 3, 8))
    assert order == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="empty"):
        model.block_order = []
    with pytest.raises(ValueError, match="block_order"):
        model.block_order = [4]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_blocks": 0}, ValueError, "num_blocks"),
        ({"num_blocks": 2.0}, TypeError, "num_blocks"),
        ({"width": 30, "heads": 4}, ValueError, "multiple of heads"),
        ({"skip": (16,)}, ValueError, "skip: block index 16 out of range; allowed 0 to 15"),
        ({"repeat": (-1,)}, ValueError, "repeat"),
        ({"skip": "3"}, TypeError, "skip"),
        ({"skip": (2,), "repeat": (2,)}, ValueError, "both in skip and in repeat"),
        ({"order": (1,), "skip": (2,)}, ValueError, "order"),
        ({"order": ()}, ValueError, "empty"),
        ({"dtype": torch.int64}, TypeError, "dtype"),
    ],
)
def test_synthetic_dit_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyntheticDiT(**{"num_blocks": 16, **kwargs})
