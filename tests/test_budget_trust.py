"""The memory budget (module mode with ``device_memory_budget``) you can trust (issue 17):
prefetches in flight ordered before whatever the caller does between requests, weights
replaced beside the copy stream (layerwise casting) race-free, no stale prefetch, budgets
below what must be resident refused (and growth after enable followed), ties between two
selected components placed and audited right.

Every test runs on the fake accelerator with its race detector, and checks that no race
was found, that ``audit() == []`` and that the outputs equal the all-resident run.
"""

from __future__ import annotations

import gc
import time
import warnings

import numpy as np
import pytest
import torch

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.core.hooks import get_handle
from diffusion_offload.core.policy import BudgetTooSmallError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.pytest_plugin import requires_fake

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}

pytestmark = requires_fake


@pytest.fixture(autouse=True)
def _clean(fake_device):
    yield
    fa.set_copy_bandwidth(None)
    fa.set_capacity(None)


def _run(pipe, kind: str = "wan2.2", **over) -> np.ndarray:
    kw = tiny_pipelines.default_call_kwargs(kind)
    kw.update(over)
    out = pipe(
        prompt="a cat on a mat",
        negative_prompt="blurry",
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(0),
        **kw,
    )
    frames = getattr(out, "frames", None)
    return np.asarray(out.images if frames is None else frames, dtype=np.float64)


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _sizes(kind: str, device) -> tuple[int, dict[str, int]]:
    """(bytes that always stay on the device, evictable bytes per selected component)."""
    probe = ModelLevelOffloadBackend(FULL, device)
    pipe = tiny_pipelines.build(kind)
    probe.enable(pipe)
    fixed = sum(c.nbytes for c in probe.components.values() if not c.selected)
    sizes = {n: c.evictable_bytes for n, c in probe.components.items() if c.selected}
    probe.disable()
    return fixed, sizes


def _races() -> int:
    return fa.stats()["races_detected"]


# ---------------------------------------------------------------- item 2: in flight after a request


def _until_prefetched(pipe, backend, names: set[str], ref: np.ndarray, kind: str = "wan2.2", at_most: int = 5) -> None:
    """Run requests until the decode left ``names`` loading on the copy stream."""
    for _ in range(at_most):
        assert np.abs(_run(pipe, kind) - ref).max() == 0.0
        assert backend.audit() == []
        if names <= set(backend.policy.prefetched):
            return
    raise AssertionError(f"{names} never prefetched at the end of a request")


def _q(pipe) -> torch.nn.Parameter:
    return pipe.text_encoder.encoder.block[0].layer[0].SelfAttention.q.weight


def test_reads_writes_and_replacements_between_requests_are_ordered_after_the_prefetch(fake_device):
    """The decode prefetches the next request's text encoder on the copy stream; when the
    request returns, the caller reads it, prints it, writes it in place and replaces a
    weight's ``.data``: none of it races the copy, the writes are kept."""
    ref_pipe = tiny_pipelines.build("wan2.2").to(fake_device)
    ref = _run(ref_pipe)
    fixed, sizes = _sizes("wan2.2", fake_device)
    pipe = tiny_pipelines.build("wan2.2")
    budget = fixed + sum(sizes.values()) - 4096  # not all three: the text encoder leaves
    # (not ``shared.weight``: the all-resident reference's ``.to(fakegpu)`` unties it)
    actions = [
        ("read", lambda p: float(_q(p).sum().item())),
        ("repr", lambda p: repr(p.text_encoder.encoder.final_layer_norm.weight)),
        ("in-place write", lambda p: _q(p).mul_(1.5)),
        ("replace .data", lambda p: setattr(
            p.text_encoder.encoder.final_layer_norm.weight, "data",
            p.text_encoder.encoder.final_layer_norm.weight.data * 0.5)),
    ]
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        for name, action in actions:
            _until_prefetched(pipe, backend, {"text_encoder"}, ref)
            assert backend.components["text_encoder"].pending is not None  # in flight
            with torch.no_grad():
                got = action(pipe)
                want = action(ref_pipe)
            if name == "read":
                assert got == want
            assert _races() == 0, name
            assert backend.audit() == [], name
            ref = _run(ref_pipe)
            assert np.abs(_run(pipe) - ref).max() == 0.0, name  # the write was kept
            assert backend.audit() == [], name
        assert backend.stats.prefetches >= len(actions)
    assert _races() == 0


@pytest.fixture(scope="module")
def text_encoder_lora() -> dict[str, torch.Tensor]:
    pytest.importorskip("peft", reason="LoRA loading needs peft (the `test` extra installs it)")
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    te = tiny_pipelines.build("flux").text_encoder
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    te = inject_adapter_in_model(config, te)
    return {f"text_encoder.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(te).items()}


def test_lora_load_and_fuse_between_requests_with_the_text_encoders_in_flight(fake_device, text_encoder_lora):
    """Flux: the decode prefetches both text encoders; ``load_lora_weights`` and
    ``fuse_lora`` into the text encoder between requests read and replace the weights
    being copied: ordered after the copy, the fused weights are kept."""
    kind = "flux"
    ref_pipe = tiny_pipelines.build(kind).to(fake_device)
    ref = _run(ref_pipe, kind)
    fixed, sizes = _sizes(kind, fake_device)
    encoders = sizes["text_encoder"] + sizes["text_encoder_2"]
    budget = fixed + max(encoders, sizes["transformer"])  # one group at a time
    pipe = tiny_pipelines.build(kind)
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        _until_prefetched(pipe, backend, {"text_encoder", "text_encoder_2"}, ref, kind)
        for p in (ref_pipe, pipe):
            p.load_lora_weights({k: v.clone() for k, v in text_encoder_lora.items()}, adapter_name="a")
            p.fuse_lora(components=["text_encoder"], lora_scale=1.0)
        assert _races() == 0
        want = _run(ref_pipe, kind)
        assert np.abs(want - ref).max() > 1e-6  # the LoRA changes the output
        for _ in range(2):
            assert np.abs(_run(pipe, kind) - want).max() <= 1e-6
            assert backend.audit() == []
    assert _races() == 0


@pytest.mark.slow  # wall-clock overlap (sleeps): CI's slow run
def test_the_decode_still_overlaps_the_text_encoder_prefetch(fake_device):
    """Ordering the caller after the prefetch waits at the end of the decode, not before
    it: the copy is still in flight when the decode's compute starts, and a 0.6 s copy
    behind a 0.8 s decode adds (almost) nothing to it, measured against the same decode
    with an instant copy."""
    fixed, sizes = _sizes("wan2.2", fake_device)
    pipe = tiny_pipelines.build("wan2.2")
    budget = fixed + sum(sizes.values()) - 4096
    copy_seconds = 0.6
    decode_seconds = 0.8
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        ref = _run(tiny_pipelines.build("wan2.2").to(fake_device))
        te_bytes = backend.components["text_encoder"].evictable_bytes
        offload_decode = pipe.vae.decode  # the offload entry point
        bandwidth: list[float | None] = [None]
        timings: list[tuple[float, bool]] = []

        def timed_decode(*args, **kwargs):
            fa.set_copy_bandwidth(bandwidth[0])
            start = time.perf_counter()
            try:
                return offload_decode(*args, **kwargs)
            finally:
                timings.append((time.perf_counter() - start, backend.components["text_encoder"].pending is not None))
                fa.set_copy_bandwidth(None)

        def prefetching_decode() -> float:
            for _ in range(3):  # until a decode prefetches the text encoder
                timings.clear()
                assert np.abs(_run(pipe) - ref).max() == 0.0
                if timings[-1][1]:
                    return timings[-1][0]
            raise AssertionError("no decode prefetched the text encoder")

        te = backend.components["text_encoder"]
        in_flight: list[bool] = []

        def decode_compute(module, args):
            # the virtual copy is not complete yet (query() is False: nothing is marked done)
            in_flight.append(te.pending is not None and not te.pending.event.query())
            time.sleep(decode_seconds)

        sleeper = pipe.vae.post_quant_conv.register_forward_pre_hook(decode_compute)
        pipe.vae.decode = timed_decode
        try:
            instant = prefetching_decode()
            bandwidth[0] = te_bytes / copy_seconds
            in_flight.clear()
            slow = prefetching_decode()
            assert in_flight[-1]  # the copy overlaps the decode
        finally:
            del pipe.vae.decode
            sleeper.remove()
        print(f"decode with the text encoder prefetch: {slow:.3f} s with a {copy_seconds} s copy, "
              f"{instant:.3f} s with an instant one")
        assert slow - instant < 0.5 * copy_seconds
        assert backend.audit() == []
    assert _races() == 0


# ---------------------------------------------------------------- item 3: layerwise casting


def _fp8_wan22():
    pipe = tiny_pipelines.build("wan2.2")
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).enable_layerwise_casting(
            storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32
        )
    return pipe


def test_layerwise_casting_beside_the_stage_prefetch_is_race_free(fake_device):
    """fp8 storage, float32 compute: the cast reads a weight the copy stream allocated and
    drops it. Budget = VAE + both DiTs: request 2 prefetches a DiT."""
    ref_pipe = _fp8_wan22().to(fake_device)
    want = _run(ref_pipe)
    dtypes = {n: t.dtype for n, t in ref_pipe.transformer.named_parameters()}
    del ref_pipe
    gc.collect()
    pipe = _fp8_wan22()
    budget = _nbytes(pipe.vae) + _nbytes(pipe.transformer) + _nbytes(pipe.transformer_2) + 4096
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        for _ in range(3):
            assert np.abs(_run(pipe) - want).max() == 0.0
            assert _races() == 0
            assert backend.audit() == []
        assert backend.stats.prefetches >= 2
        assert backend.stats.d2h_bytes == 0  # the stored fp8 bytes never change
        assert {n: t.dtype for n, t in pipe.transformer.named_parameters()} == dtypes
    assert _races() == 0


# ---------------------------------------------------------------- item 4: stale prefetch


def _reads_own_parameter_first(module: torch.nn.Module, weight: torch.Tensor | None = None) -> None:
    """Give ``module`` a forward wrapper that reads one of its Parameters (``weight``, by
    default ``patch_embedding.weight``) with its first input before any child runs, as a
    root that scales its input by its own Parameter does."""
    inner = module.forward
    weight = module.patch_embedding.weight if weight is None else weight

    def forward(*args, **kwargs):
        first = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        probe = weight.reshape(-1)[:1] * first.reshape(-1)[:1]  # device mismatch if on the host
        assert probe.device == first.device
        return inner(*args, **kwargs)

    module.forward = forward


def _wan22_request(pipe, stages: tuple[str, ...]) -> np.ndarray:
    """A Wan2.2 request whose DiT stages are ``stages``: ("T1",), ("T1", "T2") or ()."""
    hook = None
    if stages == ():  # the text encoder runs, then no denoising step, then the decode
        hook = pipe.text_encoder.register_forward_hook(lambda m, a, o: setattr(pipe, "_interrupt", True))
    pipe.register_to_config(boundary_ratio=0.0 if stages == ("T1",) else 0.875)
    try:
        return _run(pipe)
    finally:
        pipe.register_to_config(boundary_ratio=0.875)
        if hook is not None:
            hook.remove()


def test_a_prefetch_evicted_by_a_change_of_stage_order_is_loaded_at_its_stage(fake_device):
    """DiT sequences (T1), (T1), (T1, T2), (), (T1, T2): ``transformer_2``'s prefetch is
    evicted before its stage; the stage loads it (its root reads a Parameter first)."""
    sequences = [("T1",), ("T1",), ("T1", "T2"), (), ("T1", "T2")]
    ref_pipe = tiny_pipelines.build("wan2.2").to(fake_device)
    refs = [_wan22_request(ref_pipe, s) for s in sequences]
    fixed, sizes = _sizes("wan2.2", fake_device)
    pipe = tiny_pipelines.build("wan2.2")
    for name in ("transformer", "transformer_2"):
        _reads_own_parameter_first(getattr(pipe, name))
    evicted_in_flight = []
    budget = fixed + max(sizes.values())  # one component at a time
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        t2 = backend.components["transformer_2"]
        real_evict = t2.evict

        def evict():
            if t2.pending is not None:
                evicted_in_flight.append(True)
            return real_evict()

        t2.evict = evict
        for stages, ref in zip(sequences, refs):
            assert np.abs(_wan22_request(pipe, stages) - ref).max() == 0.0, stages
            assert backend.audit() == [], stages
            assert set(backend.policy.prefetched) == {
                n for n, c in backend.components.items() if c.pending is not None
            }
        assert evicted_in_flight  # the situation happened
    assert _races() == 0


def test_a_prefetch_evicted_by_the_oom_retry_is_loaded_at_its_stage(fake_device):
    """The decode prefetches the next request's text encoder, then runs out of memory; the
    retry evicts every selected component, the prefetch included; the next request's
    text-encoder stage loads it again (its root reads a Parameter first)."""
    ref = _run(tiny_pipelines.build("wan2.2").to(fake_device))
    fixed, sizes = _sizes("wan2.2", fake_device)
    pipe = tiny_pipelines.build("wan2.2")
    _reads_own_parameter_first(pipe.text_encoder, pipe.text_encoder.shared.weight)
    budget = fixed + sum(sizes.values()) - 4096  # not all three: the text encoder leaves
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        te = backend.components["text_encoder"]
        fired: list[bool] = []

        def oom_once(module, args):
            if not fired and te.pending is not None:
                fired.append(True)
                raise torch.OutOfMemoryError("injected: out of memory in the decode")

        handle = pipe.vae.post_quant_conv.register_forward_pre_hook(oom_once)
        for _ in range(4):
            assert np.abs(_run(pipe) - ref).max() == 0.0
            assert backend.audit() == []
            if fired:
                break
        handle.remove()
        assert fired, "the text encoder was never in flight during a decode"
        assert backend.policy.retries == 1 and not te.resident and te.pending is None
        assert backend.policy.prefetched == {}
        for _ in range(2):
            assert np.abs(_run(pipe) - ref).max() == 0.0
            assert backend.audit() == []
    assert _races() == 0


# ---------------------------------------------------------------- item 7: budget below the resident set


def _all_on_host(pipe) -> bool:
    return all(
        t.device.type == "cpu"
        for m in pipe.components.values() if isinstance(m, torch.nn.Module)
        for t in list(m.parameters()) + list(m.buffers())
    )


def _no_hooks(pipe) -> bool:
    return all(
        get_handle(sub) is None
        for m in pipe.components.values() if isinstance(m, torch.nn.Module)
        for sub in m.modules()
    )


def test_a_budget_below_the_smallest_workable_is_refused_before_anything_moves(fake_device):
    """The smallest workable budget is the bytes that always stay on the device (issue 25
    item 7: a stage bigger than the rest runs, and is evicted when done)."""
    fixed, _ = _sizes("wan2.2", fake_device)
    smallest = fixed
    pipe = tiny_pipelines.build("wan2.2")
    before = fa.stats()
    backend = ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=smallest - 1)
    with pytest.raises(BudgetTooSmallError) as err:
        backend.enable(pipe)
    message = str(err.value)
    assert f"smallest workable budget of {smallest} bytes" in message
    assert f"{smallest - 1} bytes" in message and "None for the strict rule" in message
    assert isinstance(err.value, ValueError)
    assert (err.value.smallest, err.value.fixed, err.value.group) == (smallest, fixed, 0)
    assert not backend.is_enabled() and _no_hooks(pipe) and _all_on_host(pipe)
    after = fa.stats()
    assert (after["h2d_bytes"], after["allocated_bytes"]) == (before["h2d_bytes"], before["allocated_bytes"])

    # the smallest workable budget itself runs, inside the budget, equal to all-resident
    ref = _run(tiny_pipelines.build("wan2.2").to(fake_device))
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=smallest) as backend:
        backend.enable(pipe)
        for _ in range(3):
            assert np.abs(_run(pipe) - ref).max() == 0.0
            assert backend.audit() == []
            assert backend.policy.resident_bytes() <= smallest
    assert _races() == 0


def test_auto_resolving_to_zero_on_a_small_device_is_refused(fake_device):
    pipe = tiny_pipelines.build("wan2.2")
    fa.set_capacity(1 << 30)  # "auto" keeps at least 1 GiB for activations: nothing is left
    backend = ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget="auto")
    with pytest.raises(BudgetTooSmallError, match=r"device_memory_budget='auto' \(resolved to 0 bytes\) is below the smallest workable budget of \d+ bytes"):
        backend.enable(pipe)
    assert not backend.is_enabled() and _no_hooks(pipe) and _all_on_host(pipe)


@pytest.fixture(scope="module")
def transformer_lora() -> dict[str, torch.Tensor]:
    pytest.importorskip("peft", reason="LoRA loading needs peft (the `test` extra installs it)")
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = tiny_pipelines.build("wan2.2").transformer
    t.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    return {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(t).items()}


def test_a_group_grown_by_a_lora_runs_over_the_budget_then_leaves(fake_device, transformer_lora):
    """At the budget of what always stays plus the largest group, a LoRA grows
    ``transformer`` past it: the grown stage runs and is evicted when done (issue 25 item
    7), the budget in force stays the one given, no warning, ``audit() == []``; after
    ``unload_lora_weights`` it runs within the budget again."""
    fixed, sizes = _sizes("wan2.2", fake_device)
    smallest = fixed + max(sizes.values())
    ref_pipe = tiny_pipelines.build("wan2.2").to(fake_device)
    pipe = tiny_pipelines.build("wan2.2")
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=smallest) as backend:
        backend.enable(pipe)
        assert np.abs(_run(pipe) - _run(ref_pipe)).max() == 0.0
        for p in (ref_pipe, pipe):
            p.load_lora_weights({k: v.clone() for k, v in transformer_lora.items()}, adapter_name="a")
        want = _run(ref_pipe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                np.testing.assert_allclose(_run(pipe), want, atol=1e-6)
                assert backend.audit() == []
        grown = fixed + backend.components["transformer"].evictable_bytes
        assert grown > smallest and backend.policy.budget == smallest
        assert backend.policy.resident_bytes() <= smallest
        raised = [w for w in caught if issubclass(w.category, RuntimeWarning) and "device_memory_budget" in str(w.message)]
        assert raised == []
        for p in (ref_pipe, pipe):
            p.unload_lora_weights()
        assert np.abs(_run(pipe) - _run(ref_pipe)).max() <= 1e-6
        assert backend.audit() == []
        assert backend.policy.budget == smallest
        assert backend.policy.resident_bytes() <= smallest
    assert _races() == 0


# ---------------------------------------------------------------- item 8: ties between selected components


def _tied_wan22():
    pipe = tiny_pipelines.build("wan2.2")
    pipe.transformer_2.patch_embedding.weight = pipe.transformer.patch_embedding.weight
    return pipe


@pytest.mark.parametrize("budgeted", [False, True], ids=["strict", "budget"])
def test_a_weight_tied_between_two_dits_follows_whichever_is_resident(fake_device, budgeted):
    ref = _run(_tied_wan22().to(fake_device))
    pipe = _tied_wan22()
    kw = {}
    if budgeted:  # both DiTs fit, not the text encoder beside them
        kw["device_memory_budget"] = _nbytes(pipe.vae) + _nbytes(pipe.transformer) + _nbytes(pipe.transformer_2) + 4096
    with ModelLevelOffloadBackend(FULL, fake_device, **kw) as backend:
        backend.enable(pipe)
        audits: list[list[str]] = []
        for name in ("transformer", "transformer_2"):
            getattr(pipe, name).blocks[0].register_forward_pre_hook(lambda m, a: audits.append(backend.audit()))
        for _ in range(3):
            assert np.abs(_run(pipe) - ref).max() == 0.0
            assert backend.audit() == []
        assert audits and all(a == [] for a in audits), [a for a in audits if a][:1]
        tied = pipe.transformer.patch_embedding.weight
        assert pipe.transformer_2.patch_embedding.weight is tied  # still tied
        resident = [n for n in ("transformer", "transformer_2") if backend.components[n].resident]
        assert (tied.device == fake_device) == bool(resident)
    assert _races() == 0


class _Branch(torch.nn.Module):
    """A LoRA-like branch around a Linear, its tensors created on the host."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.base = base
        self.down = torch.nn.Linear(base.in_features, 2, bias=False)
        self.up = torch.nn.Linear(2, base.out_features, bias=False)
        with torch.no_grad():
            self.down.weight.copy_(torch.randn(self.down.weight.shape, generator=g))
            self.up.weight.copy_(torch.randn(self.up.weight.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _first_linear(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for name, sub in module.named_modules():
        for child_name, child in sub.named_children():
            if isinstance(child, torch.nn.Linear):
                return sub, child_name
    raise AssertionError("no Linear")


def test_a_branch_added_to_a_resident_encoder_is_loaded_at_its_stage(fake_device):
    """Ample budget: the text encoder is resident since enable; a LoRA-like branch
    (host tensors) added to it is loaded when the encoder's stage runs (its structural
    change is adopted before the policy makes room, and the adopted tensors still load)."""
    from diffusion_offload.testing.toy import ToyPipeline

    g = torch.Generator().manual_seed(3)
    ids, image = torch.randint(0, 32, (2, 5), generator=g), torch.randn(2, 16, generator=g)
    ref, pipe = ToyPipeline().to(fake_device), ToyPipeline()
    with ModelLevelOffloadBackend(FULL, fake_device, device_memory_budget=1 << 40) as backend:
        backend.enable(pipe)
        for p in (ref, pipe):
            parent, name = _first_linear(p.encoders["text"])
            setattr(parent, name, _Branch(getattr(parent, name)))
        ref.to(fake_device)
        assert torch.equal(pipe(ids, image, device=fake_device), ref(ids, image, device=fake_device))
        assert backend.audit() == []
    assert fa.stats()["races_detected"] == 0
