"""Quantized weights move like plain ones (issue 19): every format, in module mode, layer
mode and layer mode with a budget, on a small pipeline on the fake device.

Each cell checks: the output is bit-equal to the same quantized pipeline run on the CPU
(the toy's attention is plain ``matmul``/``softmax``, so the fake device runs the CPU's
own kernels); the host copies hold the quantized bytes (data plus scales, within 1 %);
no weight byte goes device->host; ``audit() == []``; no race; each weight keeps its
object, class and quantization state, and follows its inner tensors' device.

Formats: torchao int8 and float8 weight-only, optimum-quanto qint8, bitsandbytes nf4
(nested statistics) and int8 (CPU backend, built with ``Linear4bit`` / ``Linear8bitLt``
directly), GGUF Q8_0 (diffusers' ``GGUFLinear``) and fp8 storage with diffusers'
layerwise casting. A format whose library is missing is skipped with the reason.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend, SupportsComponentDiscovery
from diffusion_offload.core.quantized import UnsupportedTensorError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.testing.toy import SyntheticDiT

pytestmark = requires_fake

WIDTH = 64  # every Linear's numel is a multiple of 64 (bitsandbytes' 4-bit block size)


class QuantPipe(nn.Module, SupportsComponentDiscovery):
    """A text encoder (two Linears) then a four-block ``SyntheticDiT``: ``pipe(x)``."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text_encoder = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.transformer = SyntheticDiT(num_blocks=4, width=WIDTH, in_dim=WIDTH, heads=2, seed=1)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.transformer(self.text_encoder(x)).cpu()


def _linears(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def _swap(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    for parent, name, child in _linears(module):
        setattr(parent, name, make(child))


def _torchao(config_name: str) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        quantization = pytest.importorskip("torchao.quantization", reason="needs torchao (the `test` extra)")
        quantization.quantize_(module, getattr(quantization, config_name)())
    return apply


def _quanto(module: nn.Module) -> None:
    quanto = pytest.importorskip("optimum.quanto", reason="needs optimum-quanto (the `test` extra)")
    quanto.quantize(module, weights=quanto.qint8)
    quanto.freeze(module)


def _bnb_nf4(module: nn.Module) -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (the `test` extra)")

    def make(lin: nn.Linear) -> nn.Module:
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
        q.load_state_dict(lin.state_dict())
        return q.to("cpu")  # quantizes

    _swap(module, make)


def _bnb_int8(module: nn.Module) -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (the `test` extra)")

    def make(lin: nn.Linear) -> nn.Module:
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None, has_fp16_weights=False)
        q.load_state_dict(lin.state_dict())
        return q.to("cpu")  # quantizes

    _swap(module, make)


def _gguf(module: nn.Module) -> None:
    gguf = pytest.importorskip("gguf", reason="needs gguf (the `test` extra)")
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    q8 = gguf.GGMLQuantizationType.Q8_0

    def make(lin: nn.Linear) -> nn.Module:
        q = GGUFLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=torch.float32)
        data = gguf.quantize(lin.weight.detach().numpy(), q8)
        q.weight = GGUFParameter(torch.from_numpy(data), quant_type=q8)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        return q

    _swap(module, make)


def _fp8(module: nn.Module) -> None:
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(module, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


FORMATS: dict[str, Callable[[nn.Module], None]] = {
    "torchao-int8": _torchao("Int8WeightOnlyConfig"),
    "torchao-float8": _torchao("Float8WeightOnlyConfig"),
    "quanto-qint8": _quanto,
    "bnb-nf4": _bnb_nf4,
    "bnb-int8": _bnb_int8,
    "gguf-q8_0": _gguf,
    "fp8-layerwise-casting": _fp8,
}


def quantized(fmt: str) -> QuantPipe:
    """The pipeline with both components quantized in format ``fmt``."""
    pipe = QuantPipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            FORMATS[fmt](pipe.transformer)
            FORMATS[fmt](pipe.text_encoder)
        finally:
            logging.disable(logging.NOTSET)
    return pipe


def _x(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(3)).to(device)


# -- references and measurements ------------------------------------------------------------


def _by_hand(pipe: QuantPipe, device: torch.device) -> QuantPipe:
    """Every tensor of ``pipe`` put on ``device`` with ``t.data = t.data.to(device)``, the
    bitsandbytes state tensors included (``Module.to`` cannot move bitsandbytes' Parameter
    subclasses onto the fake device)."""
    with torch.no_grad():
        for t in _leaves(pipe):
            t.data = t.data.to(device)
    return pipe


_REFERENCE: dict[str, torch.Tensor] = {}


def reference(fmt: str, device: torch.device) -> torch.Tensor:
    """The output of the same quantized pipeline run without offload: on the CPU, except
    bitsandbytes int8, whose CPU backend dequantizes to float32 on the host while its
    device path runs int8 matmuls (a different computation): all-resident on the device."""
    if fmt not in _REFERENCE:
        pipe = quantized(fmt)
        if fmt == "bnb-int8":
            pipe(_x())  # Linear8bitLt moves CB / SCB into its state on its first forward
            _REFERENCE[fmt] = _by_hand(pipe, device)(_x(device))
        else:
            _REFERENCE[fmt] = pipe(_x())
    return _REFERENCE[fmt]


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes, found independently of the mover."""
    if hasattr(type(t), "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [leaf for n in names for leaf in _inner(getattr(t, n))]
    out = [t]
    state = getattr(t, "quant_state", None)
    while state is not None:  # bitsandbytes 4-bit: absmax, code, offset; nested: state2
        out += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        state = getattr(state, "state2", None)
    out += [getattr(t, k) for k in ("CB", "SCB") if isinstance(getattr(t, k, None), torch.Tensor)]
    return out


def _leaves(module: nn.Module) -> list[torch.Tensor]:
    out = [leaf for t in [*module.parameters(), *module.buffers()] for leaf in _inner(t)]
    for m in module.modules():  # bitsandbytes Linear8bitLt keeps CB / SCB in its state after a forward
        state = getattr(m, "state", None)
        if state is not None and type(m).__name__ == "Linear8bitLt":
            out += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    seen: dict[int, torch.Tensor] = {}
    for t in out:
        seen.setdefault(id(t), t)
    return list(seen.values())


def stored_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the distinct storages holding the modules' weights (quantized data, scales,
    codes): what one host copy of them must hold."""
    spans: dict[int, int] = {}
    for m in modules:
        for t in _leaves(m):
            s = t.untyped_storage()
            spans[s.data_ptr()] = s.nbytes()
    return sum(spans.values())


def _follows(module: nn.Module) -> list[str]:
    """Weights whose device disagrees with the tensors that hold their bytes."""
    return [f"{n}: {t.device} vs {[str(leaf.device) for leaf in _inner(t)]}"
            for n, t in module.named_parameters() if any(leaf.device != t.device for leaf in _inner(t))]


MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}
LAYER = {"mode": "layer", "components": ["dit"]}


def _backend(mode: str, fmt: str, device: torch.device) -> ModelLevelOffloadBackend | LayerwiseOffloadBackend:
    """Module mode, layer mode, or layer mode with a budget that keeps one block resident
    (room for the running block, the prefetch and one more, with half a block to spare
    for the arenas' alignment padding)."""
    if mode == "module":
        return ModelLevelOffloadBackend(MODULE, device)
    if mode == "layer":
        return LayerwiseOffloadBackend(LAYER, device)
    pipe = quantized(fmt)
    block = stored_bytes([pipe.transformer.blocks[0]])
    fixed = stored_bytes([pipe.text_encoder, pipe.transformer]) - 4 * block  # the trunk and the encoder
    return LayerwiseOffloadBackend(LAYER, device, device_memory_budget=fixed + int(3.5 * block))


def _host_side(mode: str, pipe: QuantPipe) -> list[nn.Module]:
    """The modules whose weights get host copies in ``mode``."""
    if mode == "module":
        return [pipe.text_encoder, pipe.transformer]
    return list(pipe.transformer.blocks)


# -- the matrix -----------------------------------------------------------------------------


# layer mode without a budget streams the same blocks as with one (which keeps one
# resident): the full sweep runs it, the default run keeps to the other two
@pytest.mark.parametrize("mode", ["module", pytest.param("layer", marks=pytest.mark.full), "budget"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_weights_move_like_plain_ones(fmt, mode, fake_device):
    want = reference(fmt, fake_device)
    pipe = quantized(fmt)
    weights = {n: (p, type(p)) for n, p in pipe.named_parameters()}
    quantized_bytes = stored_bytes(_host_side(mode, pipe))
    plain_bytes = stored_bytes(_host_side(mode, QuantPipe()))
    backend = _backend(mode, fmt, fake_device)
    with backend:
        backend.enable(pipe)
        s = backend.stats
        host = s.pinned_bytes + s.pageable_host_bytes  # the host copies
        outs = [pipe(_x(fake_device)) for _ in range(2)]
        if mode == "budget":
            assert len(backend.streamer.kept) == 1  # one block stays, three stream
        assert backend.audit() == []
        assert backend.stats.d2h_bytes == 0
        assert _follows(pipe) == []
    for out in outs:
        assert torch.equal(out, want), f"max diff {(out - want).abs().max().item()}"
    assert abs(host - quantized_bytes) <= 0.01 * quantized_bytes, (host, quantized_bytes)
    assert quantized_bytes < 0.5 * plain_bytes  # really the quantized bytes
    assert fa.stats()["races_detected"] == 0
    for n, p in pipe.named_parameters():  # same objects, still of their classes
        assert weights[n][0] is p and isinstance(p, weights[n][1]), n


# -- host copies, writes, refusals ----------------------------------------------------------


def test_inner_tensors_get_pinned_arena_host_copies_and_writes_are_found(fake_device):
    """torchao int8: the inner tensors' host copies live in the component's pinned arenas;
    evicting them copies nothing back; an in-place write to an inner tensor while it is
    resident is found by the write check, written back (its bytes only) and loaded again."""
    pipe = quantized("torchao-int8")
    weight = pipe.transformer.blocks[0].fc1.weight
    with ModelLevelOffloadBackend(MODULE, fake_device) as backend:
        backend.enable(pipe)
        assert backend.stats.pageable_host_bytes == 0 and backend.stats.pinned_bytes > 0
        assert weight.device.type == "cpu" and weight.qdata.is_pinned() and weight.scale.is_pinned()
        slot = backend._table.slot_of(weight.qdata)
        assert slot.arena is not None and slot.arena is backend._table.slot_of(weight.scale).arena
        pipe(_x(fake_device))
        assert weight.device == fake_device and weight.qdata.device == fake_device
        with torch.no_grad():
            weight.qdata[0, 0] += 1  # a write to the quantized data itself
        written = weight.qdata[:1].clone().cpu()
        pipe.text_encoder(_x(fake_device))  # evicts the DiT
        assert weight.device.type == "cpu" and backend.stats.d2h_bytes == weight.qdata.numel()
        assert torch.equal(weight.qdata[:1], written) and weight.qdata.is_pinned()
        pipe(_x(fake_device))
        assert torch.equal(weight.qdata[:1].cpu(), written)
        assert backend.audit() == []
    assert fa.stats()["races_detected"] == 0


def test_a_quantized_pipeline_placed_on_the_device_first_gets_one_host_copy(fake_device):
    """torchao int8 weights moved to the device by ``Module.to`` before ``enable``: each
    inner tensor gets its host copy through one device->host copy, then moves as usual."""
    want = reference("torchao-int8", fake_device)
    on_host = quantized("torchao-int8")
    expected = stored_bytes([on_host.text_encoder, on_host.transformer])
    pipe = quantized("torchao-int8").to(fake_device)
    with ModelLevelOffloadBackend(MODULE, fake_device) as backend:
        backend.enable(pipe)
        adopted = backend.stats.d2h_bytes
        outs = [pipe(_x(fake_device)) for _ in range(2)]
        assert backend.audit() == [] and _follows(pipe) == []
        assert backend.stats.d2h_bytes == adopted  # no write-back after the host copies
    assert adopted == expected
    assert all(torch.equal(out, want) for out in outs)
    assert fa.stats()["races_detected"] == 0


class ScaledWeight(nn.Parameter):
    """A Parameter subclass that keeps its scale in a tensor attribute (a format the mover
    does not know: the scale would stay behind)."""

    def __new__(cls, data: torch.Tensor, scale: torch.Tensor) -> "ScaledWeight":
        self = torch.Tensor._make_subclass(cls, data, False)
        self.scale = scale
        return self


class Opaque(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__``: its bytes cannot be found."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "Opaque":
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.inner if isinstance(a, Opaque) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _placement(pipe: nn.Module) -> list[tuple[str, int]]:
    """Device and storage of every tensor holding the pipeline's bytes."""
    return [(t.device.type, t.untyped_storage().data_ptr()) for t in _leaves(pipe) if type(t) is not Opaque]


@pytest.mark.parametrize("mode", ["module", "layer"])
@pytest.mark.parametrize("weight", ["ScaledWeight", "Opaque"])
def test_an_unsupported_subclass_is_refused_before_anything_moves(weight, mode, fake_device):
    pipe = quantized("torchao-int8")
    fc1 = pipe.transformer.blocks[2].fc1
    w = fc1.weight.dequantize().detach()
    if weight == "ScaledWeight":
        fc1.weight = ScaledWeight(w, torch.ones(w.shape[0]))
    else:
        fc1.register_buffer("lut", Opaque(torch.ones(4)))
    before, allocated = _placement(pipe), fa.stats()["allocated_bytes"]
    backend = ModelLevelOffloadBackend(MODULE, fake_device) if mode == "module" else LayerwiseOffloadBackend(LAYER, fake_device)
    with pytest.raises(UnsupportedTensorError) as info:
        backend.enable(pipe)
    msg = str(info.value)
    assert ("fc1.weight" if weight == "ScaledWeight" else "fc1.lut") in msg and weight in msg and "Supported formats" in msg and "torchao" in msg
    assert "component 'transformer" in msg
    assert not backend.is_enabled() and _placement(pipe) == before
    assert fa.stats()["allocated_bytes"] == allocated and fa.stats()["h2d_bytes"] == 0
    assert backend.stats.pinned_bytes == 0 and backend.stats.pageable_host_bytes == 0
    assert not pipe.transformer.blocks[0].fc1.weight.qdata.is_pinned()


# -- LoRA on a 4-bit DiT --------------------------------------------------------------------


def _lora_sequence(pipe: QuantPipe, device: torch.device | str, evict: Callable[[], None]) -> list[torch.Tensor]:
    """Outputs before a LoRA, with it, fused, unfused, and after it is deleted (peft on
    bitsandbytes nf4: fusing dequantizes, adds the delta and quantizes a new Params4bit).
    ``evict`` runs before fusing and unfusing (the weights are then on the host)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    outs = [pipe(_x(device))]
    pipe.transformer.is_loaded_in_4bit = True  # peft then wraps Linear4bit in its bnb LoRA layer
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["fc1", "qkv"], init_lora_weights=False)
    inject_adapter_in_model(config, pipe.transformer)
    layers = [m for m in pipe.transformer.modules() if isinstance(m, BaseTunerLayer)]
    outs.append(pipe(_x(device)))
    for step in ("merge", "unmerge"):
        evict()
        for m in layers:
            getattr(m, step)()
        outs.append(pipe(_x(device)))
    for m in layers:
        m.delete_adapter("default")
    outs.append(pipe(_x(device)))
    return outs


@pytest.mark.slow  # bitsandbytes' CPU 4-bit kernels: about 10 s in all
def test_a_lora_fused_and_unloaded_on_a_4bit_dit_equals_all_resident(fake_device):
    pytest.importorskip("peft", reason="LoRA needs peft (the `test` extra)")
    want = _lora_sequence(quantized("bnb-nf4"), "cpu", lambda: None)
    assert not torch.equal(want[0], want[1])  # the LoRA changes the output
    pipe = quantized("bnb-nf4")
    with ModelLevelOffloadBackend(MODULE, fake_device) as backend:
        backend.enable(pipe)
        got = _lora_sequence(pipe, fake_device, lambda: pipe.text_encoder(_x(fake_device)))
        assert backend.audit() == [] and _follows(pipe) == []
        # peft puts a new LoRA layer on its base weight's device (the DiT was resident):
        # its host copy is the one device->host copy, no weight is ever written back
        # (four blocks; r=4 on qkv 64->192: 4*64 + 192*4 and fc1 64->128: 4*64 + 128*4, float32)
        lora_bytes = 4 * (4 * 64 + 192 * 4 + 4 * 64 + 128 * 4) * 4
        assert backend.stats.d2h_bytes == lora_bytes
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max().item()}"
    assert fa.stats()["races_detected"] == 0
