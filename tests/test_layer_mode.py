"""Layer mode (``LayerwiseOffloadBackend``) on the fake accelerator: exact outputs, bytes,
peaks, prefetch ordering (race detector), fallbacks, ``resident_layers``, overlap.

Every run here also checks the fake device's race detector: 0 races.
"""

from __future__ import annotations

import gc
import time
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core.discovery import SupportsComponentDiscovery
from diffusion_offload.core.hooks import get_hook
from diffusion_offload.core.caches import clear_method_caches
from diffusion_offload.core.streamer import BlockStreamer
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.toy import SyntheticPipeline

LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
BLOCKS = 8


@pytest.fixture(autouse=True)
def _no_races(fake_device):
    """Every test: the detector counts no race unless the test expects one."""
    fa.reset_stats()
    yield
    fa.set_copy_bandwidth(None)


def _races() -> int:
    return fa.stats()["races_detected"]


def _images(out) -> np.ndarray:
    value = getattr(out, "images", None)
    if value is None:
        value = out.frames
    return np.asarray(value, dtype=np.float64)


def _run(pipe, kind: str, steps: int | None = None, latent: bool = False, guidance: bool = True) -> np.ndarray:
    kwargs = dict(tiny_pipelines.default_call_kwargs(kind))
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if not guidance:
        kwargs["guidance_scale"] = 1.0
    out = pipe(
        prompt="a cat on a mat",
        negative_prompt="blurry",
        output_type="latent" if latent else "np",
        generator=torch.Generator("cpu").manual_seed(0),
        **kwargs,
    )
    if latent:
        value = getattr(out, "images", None)
        value = out.frames if value is None else value
        return value.cpu().double().numpy()
    return _images(out)


def _unique_bytes(components) -> int:
    slots = {id(s): s for c in components for s in c.slots}
    return sum(s.nbytes for s in slots.values())


def _bound_parts(backend: LayerwiseOffloadBackend) -> tuple[int, int]:
    """(non-block bytes of every component, bytes of the two largest streamed blocks)."""
    comps = list(backend.components.values())
    nonblock = _unique_bytes([c for c in comps if c.role != "block"])
    # a block's device footprint: its arena (its 16-byte alignment padding included)
    blocks = sorted((c.transfer_bytes for c in comps if c.role == "block"), reverse=True)
    return nonblock, sum(blocks[:2])


@pytest.fixture(scope="module")
def resident_results(fake_device_module):
    """All-resident output, D2H bytes and activation peak of each tiny pipeline."""
    dev = fake_device_module
    out = {}
    for kind in tiny_pipelines.KINDS:
        pipe = tiny_pipelines.build(kind, num_layers=BLOCKS).to(dev)
        fa.reset_stats()
        weights = fa.stats()["allocated_bytes"]
        images = _run(pipe, kind)
        s = fa.stats()
        fa.reset_peak()
        _run(pipe, kind, latent=True)
        latent_peak = fa.stats()["peak_bytes"]
        out[kind] = {
            "images": images,
            "d2h": s["d2h_bytes"],
            "activations": s["peak_bytes"] - weights,
            "activations_without_decode": latent_peak - weights,
        }
        clear_method_caches(pipe)  # Qwen-Image memoizes RoPE tables on the device
        del pipe
        gc.collect()
    return out


@pytest.fixture(scope="module")
def fake_device_module():
    return fa.install()


@pytest.mark.parametrize("kind", tiny_pipelines.KINDS)
def test_layer_mode_equals_all_resident_within_the_bound(kind, resident_results, fake_device):
    ref = resident_results[kind]
    gc.collect()
    base = fa.stats()["allocated_bytes"]
    pipe = tiny_pipelines.build(kind, num_layers=BLOCKS)
    backend = LayerwiseOffloadBackend(LAYER, fake_device)
    backend.enable(pipe)
    dits = [n for n, seq in backend.blocks.items() if n.startswith("transformer")]
    assert dits and all(len(backend.blocks[n]) == (2 if kind == "flux" else 1) * BLOCKS for n in dits)
    nonblock, two = _bound_parts(backend)
    bound = nonblock + two + ref["activations"]
    fa.reset_stats()
    assert fa.stats()["allocated_bytes"] - base == nonblock  # at rest: no streamed block
    images = _run(pipe, kind)
    s = fa.stats()
    assert np.abs(images - ref["images"]).max() == 0.0
    # no weight bytes come back: only the pipeline's own output and the write checks
    # (one byte per block release, compared on the device)
    assert backend.stats.d2h_bytes == 0
    assert s["d2h_bytes"] == ref["d2h"] + backend.stats.check_d2h_bytes
    assert s["peak_bytes"] - base <= bound, (s["peak_bytes"] - base, bound)
    assert backend.streamer.max_on_device <= 2
    assert backend.audit() == []
    assert backend.stats.fallback_loads == 0
    assert _races() == 0
    backend.disable()
    # trusting the weights (check_writes=False): D2H is exactly the all-resident floor
    trusted = tiny_pipelines.build(kind, num_layers=BLOCKS)
    with LayerwiseOffloadBackend(LAYER, fake_device, check_writes=False) as b2:
        b2.enable(trusted)
        fa.reset_stats()
        assert np.abs(_run(trusted, kind) - ref["images"]).max() == 0.0
        assert fa.stats()["d2h_bytes"] == ref["d2h"]
        assert b2.stats.check_d2h_bytes == 0 and b2.audit() == []
    assert _races() == 0  # the release ordering does not lean on the write check's read-back
    clear_method_caches(trusted)
    del trusted, b2

    clear_method_caches(pipe)
    del pipe, backend
    gc.collect()
    assert fa.stats()["allocated_bytes"] == base


# wan2.2-i2v VAE-encodes its image before denoising: those activations set the bound, and
# module mode fits under it as well, so "only layer mode runs" is not its property
@pytest.mark.parametrize("kind", [k for k in tiny_pipelines.KINDS if k != "wan2.2-i2v"])
def test_at_the_bound_only_layer_mode_runs(kind, resident_results, fake_device):
    """Capacity = the bound (non-block bytes + two largest blocks + activations): layer
    mode runs, all-resident and module mode run out of memory. The runs stop at the
    latents: the tiny VAE's decode activations dwarf the tiny weights and would hide the
    difference (module mode evicts everything before decoding)."""
    gc.collect()
    base = fa.stats()["allocated_bytes"]
    pipe = tiny_pipelines.build(kind, num_layers=BLOCKS)
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        nonblock, two = _bound_parts(backend)
        bound = nonblock + two + resident_results[kind]["activations_without_decode"]
        fa.set_capacity(base + bound)
        try:
            _run(pipe, kind, latent=True)
        finally:
            fa.set_capacity(None)
    fa.set_capacity(base + bound)
    try:
        clear_method_caches(pipe)
        del pipe, backend
        gc.collect()
        with pytest.raises(torch.OutOfMemoryError):
            _run(tiny_pipelines.build(kind, num_layers=BLOCKS).to(fake_device), kind, latent=True)
        gc.collect()
        pipe = tiny_pipelines.build(kind, num_layers=BLOCKS)
        with pytest.raises(torch.OutOfMemoryError):
            with ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, fake_device) as b3:
                b3.enable(pipe)
                _run(pipe, kind, latent=True)
    finally:
        fa.set_capacity(None)
    assert _races() == 0


def _dit_block_bytes(backend: LayerwiseOffloadBackend, name: str = "transformer") -> list[int]:
    return [backend.components[f"{name}.{b}"].evictable_bytes for b in backend.blocks.get(name, [])]


def _dit_forwards(pipe, kind: str, steps: int, **kwargs) -> int:
    calls = [0]
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    try:
        _run(pipe, kind, steps, latent=True, **kwargs)
    finally:
        handle.remove()
    return calls[0]


@pytest.mark.parametrize("kind", ["wan2.1"])
def test_resident_layers_cut_h2d_by_exactly_k_blocks_per_dit_forward(kind, fake_device):
    per_k = {}
    forwards = {}
    block_bytes = None
    for k in (0, 1, BLOCKS):
        config = {**LAYER, "layer_options": {"dit": {"resident_layers": k}}}
        pipe = tiny_pipelines.build(kind, num_layers=BLOCKS)
        with LayerwiseOffloadBackend(config, fake_device) as backend:
            backend.enable(pipe)
            assert len(backend.blocks.get("transformer", [])) == BLOCKS - k
            if k == 0:
                block_bytes = _dit_block_bytes(backend)
            _run(pipe, kind, 1, latent=True)  # learn the order; the next request starts
            _run(pipe, kind, 1, latent=True)  # from its prediction
            start = backend.stats.snapshot()
            forwards[k] = _dit_forwards(pipe, kind, 1)
            spent = backend.stats.since(start)
            per_k[k] = spent.h2d_bytes
            assert spent.fallback_loads == 0 and spent.d2h_bytes == 0
            # every streamed block loads exactly once per forward of its component
            te = sum(backend.components[f"text_encoder.{b}"].evictable_bytes for b in backend.blocks["text_encoder"])
            dit = sum(_dit_block_bytes(backend))
            assert per_k[k] == 2 * te + 2 * dit  # prompt + negative prompt; 1 step x guidance
            assert backend.audit() == []
    assert forwards[0] == forwards[1] == forwards[BLOCKS] == 2  # classifier-free guidance: 2 per step
    assert block_bytes is not None and len(set(block_bytes)) == 1  # equal blocks
    for k in (1, BLOCKS):
        # the DiT's first k blocks no longer stream, on each of its 2 forwards (the order
        # learned on the first request predicts every prefetch: nothing else moves)
        assert per_k[0] - per_k[k] == 2 * sum(block_bytes[:k]), (k, per_k)
    assert _races() == 0


def test_two_vs_eight_steps_grow_h2d_by_the_streamed_blocks_per_forward(fake_device):
    """Without guidance (one DiT forward per step), stopping at the latents."""
    kind = "wan2.1"
    pipe = tiny_pipelines.build(kind, num_layers=BLOCKS)
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        streamed = sum(_dit_block_bytes(backend))
        h2d = {}
        fwd = {}
        for steps in (2, 8):
            # learn this request's order: from the 2nd request on every prefetch is right
            _run(pipe, kind, steps, latent=True, guidance=False)
            _run(pipe, kind, steps, latent=True, guidance=False)
            start = backend.stats.snapshot()
            fwd[steps] = _dit_forwards(pipe, kind, steps, guidance=False)
            h2d[steps] = backend.stats.since(start).h2d_bytes
        assert fwd[8] - fwd[2] == 6
        assert h2d[8] - h2d[2] == 6 * streamed
        assert backend.stats.fallback_loads == 0
    assert _races() == 0


# ----------------------------------------------------------------------------- synthetic DiT


OneDiT = SyntheticPipeline  # a pipeline of one synthetic DiT (``transformer``)


def _synthetic_reference(fake_device, x: torch.Tensor, **kwargs) -> torch.Tensor:
    ref = OneDiT(**kwargs).to(fake_device)
    with torch.no_grad():
        return ref(x.to(fake_device)).cpu()


@pytest.mark.parametrize(
    ("kwargs", "fallbacks_first_forward"),
    [({"skip": (3,)}, 1), ({"repeat": (2,)}, 1), ({}, 0), ({"order": (0, 1, 5, 6, 7)}, 1)],
)
def test_skipped_or_repeated_blocks_fall_back_once_then_follow_what_runs(kwargs, fallbacks_first_forward, fake_device):
    """The first forward follows the container's order (one synchronous fallback where
    the model departs from it); from then on the schedule is the observed one: no
    fallback, and each forward copies exactly the blocks that run, once each."""
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    ref = _synthetic_reference(fake_device, x, num_blocks=8, **kwargs)
    pipe = OneDiT(num_blocks=8, **kwargs)
    ran = sorted(set(pipe.transformer.block_order))
    ran_bytes = sum(
        t.numel() * t.element_size()
        for i in ran
        for t in list(pipe.transformer.blocks[i].parameters()) + list(pipe.transformer.blocks[i].buffers())
    )
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        # what streams: each block's arena, its 16-byte alignment padding included
        seq = backend.streamer.sequences["transformer"]
        padding = sum(seq[i].nbytes for i in ran) - ran_bytes
        assert 0 <= padding <= 0.01 * ran_bytes
        ran_bytes += padding
        with torch.no_grad():
            spent = []
            for _ in range(4):
                before = backend.stats.snapshot()
                out = pipe(x.to(fake_device)).cpu()
                spent.append(backend.stats.since(before))
                assert torch.equal(out, ref)
        assert backend.stats.fallback_loads == fallbacks_first_forward
        assert [s.h2d_bytes for s in spent[1:]] == [ran_bytes] * 3
        assert backend.streamer.max_on_device <= 2
        assert backend.audit() == []
    assert _races() == 0


@pytest.mark.parametrize("keep", [4, 5])
def test_resident_layers_beyond_the_block_count_is_refused_before_anything_moves(keep, fake_device):
    """``resident_layers`` up to the block count is accepted (all of them: nothing
    streams); one more is a ValueError giving the count, with no hook left and every
    weight where it was."""
    pipe = OneDiT(num_blocks=4)
    before = {n: (t.device, t.data_ptr()) for n, t in pipe.state_dict(keep_vars=True).items()}
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": keep}}}
    backend = LayerwiseOffloadBackend(config, fake_device)
    if keep == 4:
        backend.enable(pipe)
        assert backend.streamer.sequences.get("transformer", []) == []
        backend.disable()
        return
    with pytest.raises(ValueError, match=r"resident_layers=5 is larger than 'transformer'\'s 4 blocks; allowed: 0\.\.4"):
        backend.enable(pipe)
    assert {n: (t.device, t.data_ptr()) for n, t in pipe.state_dict(keep_vars=True).items()} == before
    assert get_hook(pipe.transformer) is None


# the broken wait races twice: in the forward (the error this test expects) and in the
# release's write check that the block's always-called post-hook then runs, which torch
# reports as a warning ("raised an exception that was silenced")
@pytest.mark.filterwarnings("ignore:module forward hook with:UserWarning")
def test_a_mover_that_skips_the_event_wait_is_caught(fake_device, monkeypatch):
    pipe = OneDiT(num_blocks=4)
    monkeypatch.setattr(BlockStreamer, "_wait", lambda self, block: None)
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        with pytest.raises(fa.RaceError, match=r"shape \(.*stream 0 \(default\).*without an event wait"):
            with torch.no_grad():
                pipe(torch.zeros(1, 4, 8, device=fake_device))
    assert _races() >= 1


def test_a_mover_that_frees_a_prefetched_block_unrecorded_is_caught(fake_device, monkeypatch):
    """A prefetched block's memory belongs to the copy stream; without ``record_stream``
    on the compute stream that read it, its release is a use-after-free (the write
    check's read-back would wait for the compute, so this runs with
    ``check_writes=False``)."""
    pipe = OneDiT(num_blocks=4)
    monkeypatch.setattr(BlockStreamer, "_record", lambda self, block, stream: None)
    with pytest.raises(fa.RaceError):
        with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device, check_writes=False) as backend:
            backend.enable(pipe)
            with torch.no_grad():
                pipe(torch.zeros(1, 4, 8, device=fake_device))
    assert _races() >= 1


@pytest.mark.slow  # wall-clock overlap (sleeps): CI's slow run
@pytest.mark.slow
def test_prefetch_overlaps_copies_with_compute(fake_device):
    """16 equal blocks; each block's compute stands for 100 ms of device time (a sleep, as
    a GPU kernel would take, so the measurement does not depend on this machine's load)
    and copies are slowed so one block's copy also takes 100 ms: prefetch hides the
    copies (ideal ratio 0.5; serial: 16 x (copy + compute)). The fake device's own host
    work per block (hooks, the release's write check) cannot overlap. The check reads its
    sums back in a D2H copy that the slowed bandwidth prices too (a few bytes per block):
    at width 64 this read is about 3 % of a block's bytes (at width 4, 40 %). A timing
    test: marked slow (CI runs it alone, not beside other tests), the fastest of 3 runs."""
    step = 0.1
    kwargs = {"num_blocks": 16, "width": 64, "heads": 2}
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0)).to(fake_device)
    walls = {}
    for prefetch in (True, False):
        pipe = OneDiT(**kwargs)
        block_bytes = sum(t.numel() * t.element_size() for t in pipe.transformer.blocks[0].state_dict().values())
        with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device, prefetch=prefetch) as backend:
            backend.enable(pipe)
            with torch.no_grad():
                pipe(x)  # warm up, learn the order
                for block in pipe.transformer.blocks:
                    block.register_forward_hook(lambda m, a, o: time.sleep(step))
                fa.set_copy_bandwidth(block_bytes / step)
                runs = []
                for _ in range(3 if prefetch else 1):  # the fastest of 3: noise only adds time
                    start = time.perf_counter()
                    pipe(x)
                    runs.append(time.perf_counter() - start)
                walls[prefetch] = min(runs)
                fa.set_copy_bandwidth(None)
            assert backend.stats.fallback_loads == 0
    ratio = walls[True] / walls[False]
    print("wall with prefetch / without:", walls, round(ratio, 3))
    assert walls[False] >= 16 * 2 * step
    assert ratio <= 0.6, walls
    assert _races() == 0


def test_compiled_blocks_do_not_recompile(fake_device):
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    ref = _synthetic_reference(fake_device, x, num_blocks=4)
    pipe = OneDiT(num_blocks=4)
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        for block in pipe.transformer.blocks:
            block.compile(backend="eager")
        # dynamo's own patch (monkeypatch's undo would delete the config entry)
        with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
            for _ in range(3):
                assert torch.equal(pipe(x.to(fake_device)).cpu(), ref)
        assert backend.audit() == []
    torch._dynamo.reset()
    assert _races() == 0


# ----------------------------------------------------------------------------- lifecycle


def test_enable_rejects_a_component_without_blocks_and_a_block_claimed_twice(fake_device):
    class NoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Pipe(nn.Module, SupportsComponentDiscovery):
        _dit_modules: ClassVar[list[str]] = ["transformer"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []
        _resident_modules: ClassVar[list[str]] = []

        def __init__(self) -> None:
            super().__init__()
            self.transformer = NoBlocks()

    pipe = Pipe()
    with pytest.raises(ValueError, match="_layerwise_offload_blocks_attrs"):
        LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device).enable(pipe)
    assert pipe.transformer.proj.weight.device.type == "cpu"
    twice = OneDiT(num_blocks=3)
    backend = LayerwiseOffloadBackend(
        {"mode": "layer", "components": ["dit"]}, fake_device, layer_blocks={"transformer": ["blocks", "blocks"]}
    )
    with pytest.raises(ValueError, match="streamed once"):
        backend.enable(twice)
    assert all(p.device.type == "cpu" for p in twice.parameters())
    assert not backend.is_enabled()
    with pytest.raises(ValueError, match="not components"):
        LayerwiseOffloadBackend(
            {"mode": "layer", "components": ["dit"]}, fake_device, layer_blocks={"unet": ["blocks"]}
        ).enable(OneDiT(num_blocks=2))


def test_layer_blocks_override_and_trunk_placement(fake_device):
    gc.collect()
    base = fa.stats()["allocated_bytes"]
    pipe = OneDiT(num_blocks=4)
    with LayerwiseOffloadBackend(
        {"mode": "layer", "components": ["dit"]}, fake_device, layer_blocks={"transformer": ["blocks"]}
    ) as backend:
        backend.enable(pipe)
        dit = pipe.transformer
        assert backend.blocks == {"transformer": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]}
        for module in (dit.proj_in, dit.norm_out, dit.head):
            assert all(p.device == fake_device for p in module.parameters())
        for block in dit.blocks:
            assert all(t.device.type == "cpu" for t in [*block.parameters(), *block.buffers()])
            assert all(p.is_pinned() for p in block.parameters())
        assert fa.stats()["allocated_bytes"] - base == sum(
            p.numel() * p.element_size() for m in (dit.proj_in, dit.norm_out, dit.head) for p in m.parameters()
        )
        backend.disable()
        backend.disable()  # idempotent
        assert not backend.is_enabled()


@pytest.mark.parametrize("write", ["in_place", "data_reassigned"])
def test_a_block_written_while_resident_is_written_back(fake_device, write):
    """Inside its forward a streamed block's writes are seen at its release, which is
    compared on the device: the arena's sums (an in-place op), or the member's
    fingerprint once its ``.data`` was reassigned (it left the arena)."""
    pipe = OneDiT(num_blocks=3)
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    block = pipe.transformer.blocks[1]

    def bump(module, args):
        w = module.fc1.weight
        if write == "in_place":
            with torch.no_grad():
                w.add_(1.0)
        else:
            w.data = w.data + 1.0

    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        before = block.fc1.weight.detach().clone()
        with torch.no_grad():
            pipe(x.to(fake_device))  # the first call learns the order
        checks = backend.stats.snapshot()
        handle = block.register_forward_pre_hook(bump)
        with torch.no_grad():
            pipe(x.to(fake_device))
        handle.remove()
        done = backend.stats.since(checks)
        assert block.fc1.weight.device.type == "cpu"
        assert torch.equal(block.fc1.weight.detach(), before + 1.0)
        assert done.d2h_bytes == block.fc1.weight.numel() * 4
        # block 0, the carried prefetch, is compared on the device when the call starts,
        # then counts as loaded in this call; each of the 3 releases is compared on the
        # device
        assert done.device_checks == 1 + 3
        assert backend.audit() == []
    assert _races() == 0


def test_a_data_in_place_write_to_the_carried_prefetch_between_calls_is_written_back(fake_device):
    """The carried prefetch sits on the device between calls, where the caller's code
    runs (peft's merge writes ``p.data`` in place): its release is decided by the device
    fingerprints."""
    pipe = OneDiT(num_blocks=3)
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(x.to(fake_device))
            pipe(x.to(fake_device))
        carried = [b for b in backend.streamer.on_device()]
        assert [b.name for b in carried] == ["blocks.0"]
        block = pipe.transformer.blocks[0]
        before = block.fc1.weight.detach().cpu().clone()
        block.fc1.weight.data.add_(1.0)
        checks = backend.stats.snapshot()
        with torch.no_grad():
            pipe(x.to(fake_device))  # releases block 0 (written back), then carries it again
        assert backend.stats.since(checks).d2h_bytes == block.fc1.weight.numel() * 4
        # carried again, reloaded from the written-back host copy
        assert [b.name for b in backend.streamer.on_device()] == ["blocks.0"]
        assert torch.equal(block.fc1.weight.detach().cpu(), before + 1.0)
        assert backend.audit() == []
    assert _races() == 0


def test_interrupt_during_block_moves_leaves_every_tensor_in_place(fake_device, monkeypatch):
    """Ctrl-C after the k-th tensor move of layer mode's enable, or of a forward (block
    loads and releases): every tensor is where the invariant says, nothing allocated is
    left behind, and the next forward equals the reference."""
    from diffusion_offload.core import transfer as transfer_mod

    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(2))
    ref = _synthetic_reference(fake_device, x, num_blocks=3)
    real = transfer_mod._rebind

    def inject_after(k):
        count = [0]

        def rebind(obj, payload):
            real(obj, payload)
            count[0] += 1
            if count[0] == k:
                raise KeyboardInterrupt(f"injected after move {k}")

        monkeypatch.setattr(transfer_mod, "_rebind", rebind)
        return count

    # the number of moves of an enable that starts with the model on the device
    probe = OneDiT(num_blocks=3).to(fake_device)
    count = inject_after(10**9)
    LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device).enable(probe)
    monkeypatch.setattr(transfer_mod, "_rebind", real)
    enable_moves = count[0]
    assert enable_moves >= 10
    del probe
    for phase, ks in (("enable", range(1, enable_moves + 1, 5)), ("forward", (1, 7, 31))):
        for k in ks:
            gc.collect()
            pipe = OneDiT(num_blocks=3)
            if phase == "enable":
                pipe.to(fake_device)
            gc.collect()
            base = fa.stats()["allocated_bytes"]
            backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device)
            if phase == "forward":
                backend.enable(pipe)
            count = inject_after(k)
            try:
                if phase == "enable":
                    backend.enable(pipe)
                with torch.no_grad():
                    pipe(x.to(fake_device))
            except KeyboardInterrupt:
                pass
            monkeypatch.setattr(transfer_mod, "_rebind", real)
            assert count[0] >= k  # the interrupt fired
            fa.synchronize()
            if phase == "enable":
                assert not backend.is_enabled()
                # rolled back: every tensor on the device again, nothing else allocated
                assert all(t.device == fake_device for t in pipe.state_dict().values())
                assert fa.stats()["allocated_bytes"] == base
                backend.enable(pipe)
            assert backend.audit() == [], (phase, k, count[0])
            with torch.no_grad():
                assert torch.equal(pipe(x.to(fake_device)).cpu(), ref), (phase, k)
            assert backend.audit() == []
            backend.disable()
            del pipe, backend
    assert _races() == 0


@pytest.mark.parametrize("where", ["before ours", "after ours"])
def test_a_foreign_pre_hook_that_raises_leaves_no_race_and_every_weight_on_the_host(where, fake_device):
    """A user's forward pre-hook on a streamed block raises, registered before the
    backend's hooks (ours never run for that call, but our always-called post-hook does)
    or after them (the block is resident and the next one's copy is in flight): the error
    reaches the caller, no device op reads a copy still in flight (the fake device's race
    detector), every weight is back on the host, and the next forward equals the
    all-resident one."""
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(2))
    ref = _synthetic_reference(fake_device, x, num_blocks=6)
    pipe = OneDiT(num_blocks=6)
    armed = {"on": False}

    def hostile(mod, args):
        if armed["on"]:
            raise ValueError("user hook")

    races = _races()
    target = pipe.transformer.blocks[2]
    handle = target.register_forward_pre_hook(hostile) if where == "before ours" else None
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        if handle is None:
            handle = target.register_forward_pre_hook(hostile)
        with torch.no_grad():
            assert torch.equal(pipe(x.to(fake_device)).cpu(), ref)  # learns the order
            armed["on"] = True
            with pytest.raises(ValueError, match="user hook"):
                pipe(x.to(fake_device))
            armed["on"] = False
            assert [b.name for b in backend.streamer.on_device()] == [
                b.name for b in backend.streamer.on_device() if b is backend.streamer.prefetched
            ]  # at most the carried prefetch stays on the device
            assert torch.equal(pipe(x.to(fake_device)).cpu(), ref)
        assert backend.audit() == []
        assert _races() == races
    handle.remove()


def test_releasing_a_block_whose_copy_is_in_flight_orders_the_check_after_it(fake_device):
    """``BlockStreamer._release`` of a block loaded on the copy stream and never handed to
    the compute stream: the write check reads its device bytes only after the copy (an
    event wait, no race), and the block is back on the host, unchanged."""
    pipe = OneDiT(num_blocks=3)
    want = {k: v.clone() for k, v in pipe.transformer.blocks[1].state_dict().items()}
    races = _races()
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        streamer = backend.streamer
        block = streamer.sequences["transformer"][1]
        fa.set_copy_bandwidth(1e6)  # the copy stays in flight while the host goes on
        try:
            streamer._load(block, streamer.copy_stream)
            assert block.event is not None
            streamer._release(block)
        finally:
            fa.set_copy_bandwidth(None)
        assert not block.on_device and block.event is None
        assert _races() == races
        got = pipe.transformer.blocks[1].state_dict()
        assert all(torch.equal(got[k], v) and got[k].device.type == "cpu" for k, v in want.items())
