"""The fake device answers the calls CUDA answers (issue 38, item 9).

- The race check at a free credits a stream given to ``record_stream`` that is ordered
  after the use, as CUDA's caching allocator does (it defers reuse of the block until an
  event recorded on each such stream at the free completes).
- ``torch.accelerator``'s memory, stream and synchronize functions answer from the fake
  device's own counters and streams.
- diffusers' model CPU offload, sequential offload and group offload (with and without
  streams) run on it and equal the all-resident run.
- Qwen2.5-VL's vision tower (Qwen-Image-Edit's image path) runs on it and equals the CPU
  run bit for bit; ``scaled_dot_product_attention`` computes on it what it computes on the
  CPU, in every grad mode.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

MIB = 1 << 20


@pytest.fixture
def streams(fake_device) -> Iterator[torch.device]:
    """The fake device with nothing pending and clean counters, before and after."""
    fa.set_copy_bandwidth(None)
    fa.synchronize()
    fa.reset_stats()
    yield fake_device
    fa.synchronize()
    fa.reset_stats()


def _free(name: str, scope: dict[str, Any]) -> None:
    del scope[name]
    gc.collect()


# ----------------------------------------------------------------- the free check


def _free_after_record(
    dev: torch.device, alloc: torch.Stream, compute: torch.Stream, side: torch.Stream, wait: str
) -> None:
    """Allocate on ``alloc``, use on ``compute``, record on ``side``, free; ``wait``: when
    ``side`` waits on ``compute`` ("after" the use, "before" it, or "never")."""
    with torch.fakegpu.stream(alloc):
        held = {"x": torch.ones(256, device=dev)}
    if wait == "before":
        side.wait_stream(compute)
    with torch.fakegpu.stream(compute):
        y = held["x"] * 2.0
    if wait == "after":
        side.wait_stream(compute)
    held["x"].record_stream(side)
    _free("x", held)
    assert y.shape == (256,)


@pytest.mark.parametrize(
    "pattern",
    [
        "alloc and use on the compute stream",
        "alloc on the default stream, use on a compute side stream",
        "alloc on a load stream, use on the default stream",
    ],
)
def test_a_free_credits_a_recorded_stream_ordered_after_the_use(streams, pattern) -> None:
    dev = streams
    default, compute, side, load = (
        torch.fakegpu.default_stream(),
        torch.fakegpu.Stream(),
        torch.fakegpu.Stream(),
        torch.fakegpu.Stream(),
    )
    alloc, use = {
        "alloc and use on the compute stream": (compute, compute),
        "alloc on the default stream, use on a compute side stream": (default, compute),
        "alloc on a load stream, use on the default stream": (load, default),
    }[pattern]
    if alloc is load:  # the use is ordered after the load, as an offload hook does it
        with torch.fakegpu.stream(load):
            held = {"x": torch.ones(256).pin_memory().to(dev, non_blocking=True)}
        default.wait_stream(load)
        y = held["x"] * 2.0
        side.wait_stream(default)
        held["x"].record_stream(side)
        _free("x", held)
    else:
        _free_after_record(dev, alloc, use, side, wait="after")
    torch.ones(1, device=dev).add_(1.0)  # a race found at the free raises here
    assert fa.stats()["races_detected"] == 0


@pytest.mark.parametrize("wait", ["never", "before"])
def test_a_free_still_races_when_the_recorded_stream_is_not_ordered_after_the_use(
    streams, wait
) -> None:
    dev = streams
    compute, side = torch.fakegpu.Stream(), torch.fakegpu.Stream()
    _free_after_record(dev, torch.fakegpu.default_stream(), compute, side, wait=wait)
    with pytest.raises(fa.RaceError, match=r"freed while aten\.mul\.Tensor on stream \d+ \(side\)"):
        torch.ones(1, device=dev)
    assert fa.stats()["races_detected"] == 1


# ------------------------------------------------------------ torch.accelerator


def test_torch_accelerator_memory_functions_answer_from_the_fake_counters(fake_device) -> None:
    acc = torch.accelerator
    assert acc.current_accelerator() == torch.device("fakegpu")
    gc.collect()
    fa.reset_stats()  # accumulated statistics zeroed, peaks := current
    base = fa.stats()["allocated_bytes"]
    start = acc.memory_stats()
    base_count = start["allocation.all.current"]
    assert acc.memory_stats()["allocation.all.allocated"] == 0
    small = torch.empty(1000, device=fake_device)  # 4,000 B: small pool (<= 1 MiB)
    large = torch.empty(MIB // 2 + 1, device=fake_device)  # 2 MiB + 4 B: large pool
    scratch = torch.empty(MIB // 4, device=fake_device)  # exactly 1 MiB: small pool
    del scratch
    gc.collect()
    s = fa.stats()
    assert s["allocated_bytes"] == base + 4_000 + 2 * MIB + 4
    assert s["peak_bytes"] == base + 4_000 + 3 * MIB + 4
    assert acc.memory_allocated() == acc.memory_allocated(fake_device) == s["allocated_bytes"]
    assert acc.max_memory_allocated() == acc.max_memory_allocated(0) == s["peak_bytes"]
    assert acc.memory_reserved() == s["allocated_bytes"]  # no caching: nothing reserved beyond
    assert acc.max_memory_reserved() == s["peak_bytes"]
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.current"] == s["allocated_bytes"]
    assert stats["allocated_bytes.all.allocated"] == 4_000 + 3 * MIB + 4
    assert stats["allocated_bytes.all.freed"] == MIB
    assert stats["allocated_bytes.large_pool.allocated"] == 2 * MIB + 4
    assert stats["allocated_bytes.large_pool.freed"] == 0
    assert stats["allocated_bytes.small_pool.allocated"] == 4_000 + MIB
    assert stats["allocated_bytes.small_pool.freed"] == MIB
    assert stats["allocation.all.current"] == base_count + 2
    assert stats["allocation.all.allocated"] == stats["num_device_alloc"] == 3
    assert stats["allocation.all.freed"] == stats["num_device_free"] == 1
    assert stats["allocation.small_pool.current"] == start["allocation.small_pool.current"] + 1
    assert stats["allocation.large_pool.current"] == start["allocation.large_pool.current"] + 1
    assert stats["allocated_bytes.large_pool.current"] == start["allocated_bytes.large_pool.current"] + 2 * MIB + 4
    assert stats["requested_bytes.all.current"] == stats["active_bytes.all.current"] == s["allocated_bytes"]
    assert stats["inactive_split_bytes.all.current"] == stats["num_ooms"] == 0
    assert list(stats) == sorted(stats)  # flattened and sorted, as for CUDA
    assert dict(torch.fakegpu.memory_stats()) == dict(stats)

    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated() == base + 4_000 + 2 * MIB + 4
    assert acc.memory_stats()["allocated_bytes.small_pool.peak"] == acc.memory_stats()[
        "allocated_bytes.small_pool.current"
    ]
    acc.reset_accumulated_memory_stats()
    after = acc.memory_stats()
    assert after["allocated_bytes.all.allocated"] == after["allocated_bytes.all.freed"] == 0
    assert after["allocated_bytes.all.current"] == base + 4_000 + 2 * MIB + 4
    acc.empty_cache()  # no caching allocator: nothing to release, nothing changes
    assert acc.memory_allocated() == base + 4_000 + 2 * MIB + 4

    fa.set_capacity(s["allocated_bytes"] + 10_000)
    assert acc.get_memory_info() == (10_000, s["allocated_bytes"] + 10_000)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(3_000, device=fake_device)  # 12,000 B > 10,000 B free
    assert acc.memory_stats()["num_ooms"] == 1
    fa.set_capacity(None)
    with pytest.raises(ValueError, match="not a fakegpu device"):
        acc.memory_allocated(1)
    del small, large


def test_torch_accelerator_defers_to_pytorch_for_another_accelerator(fake_device, monkeypatch) -> None:
    from diffusion_offload.testing.fake_accelerator import accelerator

    monkeypatch.setattr(accelerator, "_ours", lambda: False)
    # PyTorch's own binding: a Python backend has no DeviceAllocator
    with pytest.raises(RuntimeError, match="is not a DeviceAllocator"):
        torch.accelerator.memory_allocated()
    monkeypatch.undo()
    assert torch.accelerator.memory_allocated() == fa.stats()["allocated_bytes"]


def test_empty_host_cache_after_device_use_does_not_crash() -> None:
    script = (
        "import torch\n"
        "from diffusion_offload.testing import fake_accelerator as fa\n"
        "dev = fa.install()\n"
        "x = torch.ones(4).pin_memory().to(dev)\n"
        "torch.accelerator.empty_host_cache()\n"
        "print('survived', x.sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "survived 4.0"


def test_torch_accelerator_streams_and_synchronize_are_the_fake_ones(streams) -> None:
    acc = torch.accelerator
    side = torch.fakegpu.Stream()
    assert acc.current_stream() is torch.fakegpu.default_stream()
    acc.set_stream(side)
    try:
        assert acc.current_stream() is side is fa.current_stream()
    finally:
        acc.set_stream(torch.fakegpu.default_stream())
    assert fa.current_stream() is torch.fakegpu.default_stream()
    before = fa.stats()["synchronizes"]
    acc.synchronize()
    acc.synchronize(streams)
    assert fa.stats()["synchronizes"] == before + 2


# ---------------------------------------------------------------- small fixes


def test_to_meta_moves_no_data_and_type_param_rebuilds_a_parameter(fake_device) -> None:
    weight = torch.nn.Linear(4, 4).to(fake_device).weight
    assert isinstance(weight, torch.nn.Parameter) and type(weight) is fa.FakeDeviceTensor
    fa.reset_stats()
    meta = weight.to("meta")
    assert meta.device.type == "meta" and meta.shape == (4, 4)
    s = fa.stats()
    assert (s["device_ops"], s["transfers"], s["d2h_bytes"], s["host_waits"]) == (0, 0, 0, 0)
    # accelerate's set_module_tensor_to_device: type(param)(data, requires_grad=...)
    rebuilt = type(weight)(meta, requires_grad=False)
    assert type(rebuilt) is torch.nn.Parameter and rebuilt.device.type == "meta"
    assert not rebuilt.requires_grad
    on_device = type(weight)(weight.detach(), requires_grad=True)
    assert isinstance(on_device, torch.nn.Parameter) and on_device.device == fake_device


def test_module_to_device_under_inference_mode(fake_device) -> None:
    host = torch.ones(3)
    dev = host.to(fake_device)
    assert torch._has_compatible_shallow_copy_type(dev, host) is False
    assert torch._has_compatible_shallow_copy_type(dev, dev) is True
    with torch.inference_mode():
        lin = torch.nn.Linear(3, 2).to(fake_device)
        assert lin.weight.device == fake_device and isinstance(lin.weight, torch.nn.Parameter)


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad enabled, no grad needed"])
def test_sdpa_computes_what_the_cpu_computes_as_one_device_op(fake_device, mode) -> None:
    q, k, v = _qkv()
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with ctx():
        qd, kd, vd = (t.to(fake_device) for t in (q, k, v))
        fa.reset_stats()
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=0.3)
        assert fa.stats()["device_ops"] == 1  # one fused kernel, as on CUDA
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        assert torch.equal(out.cpu(), ref)


def test_sdpa_with_grad_decomposes_and_backpropagates(fake_device) -> None:
    q, k, v = _qkv(1)
    qd = q.to(fake_device).requires_grad_()
    out = F.scaled_dot_product_attention(qd, k.to(fake_device), v.to(fake_device))
    out.sum().backward()
    # PyTorch's math decomposition, run on the CPU, gives the same bits
    qc = q.clone().requires_grad_()
    ref = torch.ops.aten._scaled_dot_product_attention_math(qc, k, v)[0]
    ref.sum().backward()
    assert torch.equal(out.detach().cpu(), ref.detach())
    assert torch.equal(qd.grad.cpu(), qc.grad)


# ------------------------------------------------------------- Qwen2.5-VL vision


def _tiny_qwen2_5_vl() -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 0,
        },
        # window attention in block 0, full attention in block 1, as Qwen-Image's encoder
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
            "window_size": 56,
        },
        image_token_id=60,
        video_token_id=61,
        vision_start_token_id=62,
        vision_end_token_id=63,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def _image_inputs() -> dict[str, torch.Tensor]:
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])  # two images: 96 and 16 patches
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    tokens = [2, 62] + [60] * 24 + [63, 3, 62] + [60] * 4 + [63, 4]
    ids = torch.tensor([tokens, [0, 0] + tokens[:-2]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == 60).long(),
        "pixel_values": torch.cat([pixels, pixels]),
        "image_grid_thw": torch.cat([grid, grid]),
    }


def test_qwen2_5_vl_vision_tower_equals_the_cpu_run(fake_device) -> None:
    pytest.importorskip("transformers")
    model = _tiny_qwen2_5_vl()
    inputs = _image_inputs()
    pixels, grid = inputs["pixel_values"][:112], inputs["image_grid_thw"][:2]
    with torch.no_grad():
        ref_vision = model.model.visual(pixels, grid_thw=grid).pooler_output
        ref = model(**inputs, output_hidden_states=True).hidden_states[-1]
        model.to(fake_device)
        on_device = {k: v.to(fake_device) for k, v in inputs.items()}
        vision = model.model.visual(
            pixels.to(fake_device), grid_thw=grid.to(fake_device)
        ).pooler_output
        out = model(**on_device, output_hidden_states=True).hidden_states[-1]
    assert vision.device == fake_device and vision.shape == (28, 32)
    assert torch.equal(vision.cpu(), ref_vision)
    assert torch.equal(out.cpu(), ref)


# ----------------------------------------------------------- diffusers offloads

KIND = "wan2.1"


def _run(pipe: Any) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="a cat on a mat",
        negative_prompt="blurry",
        output_type="latent",
        generator=torch.Generator("cpu").manual_seed(0),
        **tiny_pipelines.default_call_kwargs(KIND),
    )
    return out.frames.cpu()


@pytest.fixture(scope="module")
def resident_latents() -> torch.Tensor:
    dev = fa.install()
    return _run(tiny_pipelines.build(KIND).to(dev))


def _model_offload(pipe: Any, dev: torch.device) -> None:
    pipe.enable_model_cpu_offload(device=dev)


def _sequential_offload(pipe: Any, dev: torch.device) -> None:
    pipe.enable_sequential_cpu_offload(device=dev)


def _group(level: str, use_stream: bool, record_stream: bool = False) -> Callable[[Any, torch.device], None]:
    def setup(pipe: Any, dev: torch.device) -> None:
        pipe.enable_group_offload(
            onload_device=dev,
            offload_type=level,
            num_blocks_per_group=1 if level == "block_level" else None,
            use_stream=use_stream,
            record_stream=record_stream,
        )

    return setup


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(_model_offload, id="enable_model_cpu_offload"),
        pytest.param(_sequential_offload, id="enable_sequential_cpu_offload"),
        pytest.param(_group("block_level", False), id="group block_level"),
        pytest.param(_group("block_level", True), id="group block_level use_stream"),
        pytest.param(_group("leaf_level", True, True), id="group leaf_level use_stream record_stream"),
    ],
)
def test_diffusers_offloads_equal_the_resident_run(streams, resident_latents, setup) -> None:
    pytest.importorskip("accelerate")
    pipe = tiny_pipelines.build(KIND)
    setup(pipe, streams)
    first = _run(pipe)
    second = _run(pipe)
    assert torch.equal(first, resident_latents)
    assert torch.equal(second, resident_latents)
    assert fa.stats()["races_detected"] == 0
