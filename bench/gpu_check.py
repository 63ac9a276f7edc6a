"""GPU check: placement/equality tests on a real device, transfer bandwidth, layer mode.

1. Runs ``tests/test_backend.py``, ``tests/test_transfer_hooks.py`` and
   ``tests/test_split.py`` with the ``fake_device`` fixture switched to the real device
   (``DIFFUSION_OFFLOAD_TEST_DEVICE=cuda``). Tests that need the fake accelerator's exact
   byte counters are skipped there (they say so).
2. Builds a random ~4 GB bf16 DiT-like component (16 x Linear(8192, 16384)) plus a
   small text encoder, enables model-level offload, and times with CUDA synchronization:
   load from host copies pinned in place, load from pageable host copies, eviction of
   unmodified weights (no copy; fingerprints only), eviction with write-back of modified
   weights, a load+evict cycle with the write checks stubbed out (``check_stub``: their
   cost), and, as the
   naive baseline, ``module.to(device)`` / ``module.to("cpu")`` of the same component.
   It also reports pinned bytes against weight bytes, whether the host storages were
   pinned in place (same data pointers before and after ``enable()``) and how much the
   CUDA caching host allocator grew (0 expected: no ``pin_memory()`` copies).
3. Layer mode (``LayerwiseOffloadBackend``): a random DiT-shaped bf16 model, 40 blocks of
   width 5120 (attention: qkv + out projections and ``scaled_dot_product_attention``, 40
   heads; MLP 4x; pre-norm; ~629 MB per block, 23.4 GiB in all), one forward of batch 1 at
   4096 and at 16384 tokens, timed with synchronization (median of ``--repeats`` back to
   back forwards after one warm-up, as in a denoising loop): all resident; layer mode with
   prefetch; without prefetch (``prefetch=False``: every block copied when it runs); with
   prefetch and ``resident_layers`` 10 and 20; and with prefetch and ``check_writes=False``
   (the write checks' cost). Reports the
   overhead vs resident, streamed bytes per forward and the H2D rate they amount to
   (streamed bytes / forward time), the pinned H2D bandwidth of one block-sized copy for
   reference, peak device memory (``max_memory_allocated``), and whether the output equals
   the resident one.

Needs torch >= 2.11 with a GPU and pytest; not diffusers. Run from the repo root::

    PYTHONPATH=src python bench/gpu_check.py [--gib 4] [--repeats 3] [--skip-tests]
        [--skip-transfer] [--skip-layer] [--layer-blocks 40] [--layer-width 5120]
        [--tokens 4096 16384]

Prints Markdown tables; with ``$OUT`` set it also writes ``$OUT/gpu_check.md``.
Without a GPU, ``--tiny`` runs the layer-mode section end to end on the test fake
device (``diffusion_offload.testing.fake_accelerator``) with a tiny model: a check of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from diffusion_offload import (  # noqa: E402
    LayerwiseOffloadBackend,
    ModelLevelOffloadBackend,
    SupportsComponentDiscovery,
)
from diffusion_offload.core.hooks import get_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_stub import write_checks_off  # noqa: E402  (bench/check_stub.py)


class _Big(nn.Module):
    def __init__(self, layers: int, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows, bias=False, dtype=dtype) for _ in range(layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, layers: int, rows: int, cols: int) -> None:
        super().__init__()
        self.transformer = _Big(layers, rows, cols, torch.bfloat16)
        self.text_encoder = nn.Linear(64, 64, dtype=torch.bfloat16)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_tests() -> tuple[int, str]:
    env = dict(os.environ, DIFFUSION_OFFLOAD_TEST_DEVICE="cuda", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_backend.py", "tests/test_transfer_hooks.py", "tests/test_split.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return proc.returncode, tail


def _host_allocator_bytes() -> int:
    """Bytes the CUDA caching host allocator (``pin_memory()`` copies) holds, or -1."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        return -1
    return int(stats().get("allocated_bytes.current", stats().get("allocated_bytes", -1)))


def measure(gib: float, repeats: int, memory: list[str]) -> list[tuple[str, float, float]]:
    """Transfer timings (name, seconds, GB/s); lines about host memory go to ``memory``."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows, cols = 16384, 8192
    layers = max(1, round(gib * (1 << 30) / (rows * cols * 2)))
    results: list[tuple[str, float, float]] = []
    for pin in (True, False):
        pipe = _Pipe(layers, rows, cols)
        nbytes = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        backend = ModelLevelOffloadBackend(
            {"mode": "module", "components": ["dit", "text_encoder"], "pin_memory": pin}, device
        )
        ptrs = [p.data_ptr() for p in pipe.transformer.parameters()]
        host_before = _host_allocator_bytes()
        start = time.perf_counter()
        backend.enable(pipe)
        enable_s = time.perf_counter() - start
        if pin:
            in_place = ptrs == [p.data_ptr() for p in pipe.transformer.parameters()]
            memory.append(
                f"pinning in place: weights {nbytes} B, stats.pinned_bytes "
                f"{backend.stats.pinned_bytes} B, pageable {backend.stats.pageable_host_bytes} B, "
                f"every weight is_pinned(): {all(p.is_pinned() for p in pipe.transformer.parameters())}, "
                f"same host storages as before enable: {in_place}, CUDA caching host allocator "
                f"grew by {_host_allocator_bytes() - host_before} B, enable() took {enable_s:.3f} s"
            )
        dit, enc = get_hook(pipe.transformer), get_hook(pipe.text_encoder)
        loads, evicts = [], []
        for _ in range(repeats):
            loads.append(_timed(dit.activate))
            evicts.append(_timed(enc.activate))
        kind = "pinned in place" if pin else "pageable"
        load = statistics.median(loads)
        results.append((f"load DiT from {kind} host copies (H2D)", load, nbytes / load / 1e9))
        evict = statistics.median(evicts)
        results.append((f"evict unmodified DiT ({kind}; no D2H copy)", evict, float("nan")))
        if pin:
            dit.activate()
            with torch.no_grad():
                for p in pipe.transformer.parameters():
                    p.mul_(1)  # bump _version: forces write-back
            wb = _timed(enc.activate)
            results.append(("evict modified DiT (D2H write-back to pinned)", wb, nbytes / wb / 1e9))
            with write_checks_off():
                bare = [_timed(dit.activate) + _timed(enc.activate) for _ in range(repeats)]
            cycle = statistics.median(loads) + statistics.median(evicts)
            results.append(("load+evict cycle without fingerprints (stubbed)", statistics.median(bare), float("nan")))
            memory.append(
                f"fingerprint cost: load+evict cycle {cycle:.4f} s with fingerprints, "
                f"{statistics.median(bare):.4f} s without ({cycle / statistics.median(bare):.2f} x)"
            )
        backend.disable()
        del pipe, backend, dit, enc
        torch.cuda.empty_cache()
    naive = _Big(layers, rows, cols, torch.bfloat16)
    to_dev = _timed(lambda: naive.to(device))
    to_host = _timed(lambda: naive.to("cpu"))
    results.append(("baseline module.to(device) from pageable", to_dev, nbytes / to_dev / 1e9))
    results.append(("baseline module.to('cpu') (D2H copy)", to_host, nbytes / to_host / 1e9))
    return results


# ----------------------------------------------------------------------------- layer mode


class _LayerBlock(nn.Module):
    """Pre-norm DiT block: ``x + out(sdpa(qkv(LN(x))))``, then ``x + fc2(gelu(fc1(LN(x))))``."""

    def __init__(
        self, width: int, heads: int, mlp_ratio: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, **kw)
        self.qkv = nn.Linear(width, 3 * width, **kw)
        self.out = nn.Linear(width, width, **kw)
        self.norm2 = nn.LayerNorm(width, **kw)
        self.fc1 = nn.Linear(width, mlp_ratio * width, **kw)
        self.fc2 = nn.Linear(mlp_ratio * width, width, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, s, 3, self.heads, w // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class _LayerDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(
        self,
        blocks: int,
        width: int,
        heads: int,
        in_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.proj_in = nn.Linear(in_dim, width, **kw)
        self.blocks = nn.ModuleList(
            _LayerBlock(width, heads, 4, dtype, device) for _ in range(blocks)
        )
        self.norm_out = nn.LayerNorm(width, **kw)
        self.head = nn.Linear(width, in_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm_out(h))


class _LayerPipe(nn.Module, SupportsComponentDiscovery):
    """A pipeline of one DiT (like ``tests/test_layer_mode.py::OneDiT``)."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        self.transformer = _LayerDiT(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


def _dev_module(device: torch.device):
    """``torch.cuda`` (or ``torch.fakegpu`` for ``--tiny``): synchronize, peak memory."""
    return getattr(torch, device.type)


def _timed_on(device: torch.device, fn) -> float:
    mod = _dev_module(device)
    mod.synchronize()
    start = time.perf_counter()
    fn()
    mod.synchronize()
    return time.perf_counter() - start


def _pinned_h2d_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """GB/s of one ``nbytes`` copy from pinned host memory to the device (median)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = [
        _timed_on(device, lambda: dst.copy_(host, non_blocking=True)) for _ in range(repeats + 1)
    ]
    return nbytes / statistics.median(times[1:]) / 1e9


def measure_layer(
    device: torch.device,
    blocks: int,
    width: int,
    heads: int,
    tokens: list[int],
    repeats: int,
    notes: list[str],
    dtype: torch.dtype = torch.bfloat16,
    in_dim: int = 64,
) -> list[dict]:
    """Layer mode vs all resident on one DiT-shaped model; one row per (variant, tokens)."""
    mod = _dev_module(device)
    torch.manual_seed(0)
    # initialised on the device (fast); moved to the host after the all-resident runs
    pipe = _LayerPipe(blocks, width, heads, in_dim, dtype, device).eval()
    block_bytes = sum(p.numel() * p.element_size() for p in pipe.transformer.blocks[0].parameters())
    total = sum(p.numel() * p.element_size() for p in pipe.parameters())
    gen = torch.Generator(device="cpu").manual_seed(1)
    inputs = {t: torch.randn(1, t, in_dim, generator=gen).to(device, dtype) for t in tokens}
    rows: list[dict] = []
    ref: dict[int, torch.Tensor] = {}
    base_s: dict[int, float] = {}

    def run(name: str, t: int, backend, streamed_blocks: int = 0) -> None:
        x = inputs[t]
        with torch.no_grad():
            out = pipe(x)  # warm-up (layer mode: learns the block order)
            mod.synchronize()
            mod.reset_peak_memory_stats()
            before = backend.stats.snapshot() if backend is not None else None
            times = []
            for _ in range(repeats):
                times.append(_timed_on(device, lambda: pipe(x)))
            out = pipe(x)  # one more forward, untimed: its output is compared
            mod.synchronize()
        peak = mod.max_memory_allocated()
        seconds = statistics.median(times)
        row = {
            "variant": name,
            "tokens": t,
            "seconds": seconds,
            "peak_bytes": peak,
            "finite": bool(torch.isfinite(out).all()),
        }
        if backend is None:
            ref[t], base_s[t] = out, seconds
            row.update(overhead=0.0, streamed=0, gbps=float("nan"), equal=True, max_abs_diff=0.0)
        else:
            spent = backend.stats.since(before)
            streamed = spent.h2d_bytes / (repeats + 1)  # per forward, steady state
            row.update(
                overhead=seconds / base_s[t] - 1.0,
                streamed=streamed,
                gbps=streamed / seconds / 1e9,
                equal=bool(torch.equal(out, ref[t])),
                max_abs_diff=float((out.float() - ref[t].float()).abs().max()),
                fallbacks=spent.fallback_loads,
                prefetches=spent.prefetches,
                weight_d2h=spent.d2h_bytes,
                expected_streamed=streamed_blocks * block_bytes,
            )
        rows.append(row)

    for t in tokens:
        run("all resident", t, None)
    start = time.perf_counter()
    # host copies as from_pretrained leaves them: pageable; enable() pins them in place
    pipe.to("cpu")
    mod.empty_cache()
    notes.append(
        f"layer model: {blocks} blocks x {block_bytes:,} B ({width} wide, {heads} heads, "
        f"MLP 4x, {dtype}), {total:,} B = {total / 2**30:.2f} GiB in all; moved to the host in "
        f"{time.perf_counter() - start:.1f} s"
    )
    ref_gbps = _pinned_h2d_gbps(device, block_bytes, repeats)
    notes.append(
        f"reference: one block-sized copy ({block_bytes:,} B) from pinned host memory: "
        f"{ref_gbps:.2f} GB/s, so streaming all {blocks} blocks takes at least "
        f"{blocks * block_bytes / ref_gbps / 1e9:.3f} s per forward"
    )
    variants = [
        ("layer, prefetch", True, 0),
        ("layer, no prefetch", False, 0),
        (f"layer, prefetch, resident_layers {blocks // 4}", True, blocks // 4),
        (f"layer, prefetch, resident_layers {blocks // 2}", True, blocks // 2),
        # the write checks off (``check_writes=False``: a weight written on the device is
        # then lost at its release), to see what they cost
        ("layer, prefetch, check_writes=False", True, 0),
    ]
    for name, prefetch, resident in variants:
        config: dict = {"mode": "layer", "components": ["dit"]}
        if resident:
            config["layer_options"] = {"dit": {"resident_layers": resident}}
        backend = LayerwiseOffloadBackend(
            config, device, prefetch=prefetch, check_writes="check_writes" not in name
        )
        start = time.perf_counter()
        backend.enable(pipe)
        enable_s = time.perf_counter() - start
        notes.append(
            f"{name}: enable() {enable_s:.2f} s, "
            f"{len(backend.blocks['transformer'])} streamed blocks, host copies pinned "
            f"{backend.stats.pinned_bytes:,} B, pageable "
            f"{backend.stats.pageable_host_bytes:,} B"
        )
        try:
            for t in tokens:
                run(name, t, backend, blocks - resident)
            if backend.audit():
                notes.append(f"{name}: audit: {backend.audit()[:3]}")
            notes.append(
                f"{name}: at most {backend.streamer.max_on_device} streamed blocks on the device"
            )
        finally:
            backend.disable()
        mod.empty_cache()
    return rows


def layer_table(rows: list[dict], unit: str = "G") -> list[str]:
    """Markdown rows; sizes in GB / GiB (``unit="G"``) or KB / KiB (``"K"``, for ``--tiny``)."""
    dec, binary = (1e9, 2**30) if unit == "G" else (1e3, 2**10)
    lines = [
        (
            f"| layer mode | tokens | forward s (median) | overhead vs resident | streamed "
            f"{unit}B / forward | H2D GB/s (streamed / forward time) | peak device {unit}iB | "
            "output vs resident |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        gbps = "-" if math.isnan(r["gbps"]) else f"{r['gbps']:.{1 if unit == 'G' else 4}f}"
        streamed = "-" if not r["streamed"] else f"{r['streamed'] / dec:.2f}"
        same = (
            "reference"
            if r["variant"] == "all resident"
            else ("bitwise equal" if r["equal"] else f"max abs diff {r['max_abs_diff']:.2e}")
        )
        if not r["finite"]:
            same += " (non-finite values!)"
        if r.get("fallbacks"):
            same += f"; {r['fallbacks']} fallback loads"
        if r.get("streamed") and r["streamed"] != r["expected_streamed"]:
            same += f"; streamed {r['streamed']:.0f} B/forward, expected {r['expected_streamed']} B"
        lines.append(
            f"| {r['variant']} | {r['tokens']} | {r['seconds']:.4f} | "
            f"{100 * r['overhead']:+.1f}% | {streamed} | {gbps} | "
            f"{r['peak_bytes'] / binary:.2f} | {same} |"
        )
    return lines


def main_tiny(repeats: int) -> int:
    """The layer-mode section on the fake device with a tiny model (no GPU needed)."""
    from diffusion_offload.testing import fake_accelerator as fa

    device = fa.install()
    torch.set_num_threads(1)  # the fake device computes on the CPU: tiny ops, no thread contention
    notes: list[str] = []
    rows = measure_layer(
        device,
        blocks=8,
        width=64,
        heads=4,
        tokens=[16, 32],
        repeats=repeats,
        notes=notes,
        in_dim=16,
    )
    if any(r.get("streamed") and r["streamed"] != r["expected_streamed"] for r in rows):
        notes.append(
            "streamed bytes per forward differ from the streamed blocks' bytes (see the table)"
        )
    s = fa.stats()
    lines = [
        "layer-mode section on the fake device (--tiny: checks the script; times mean nothing)",
        "",
    ]
    lines += layer_table(rows, unit="K") + [""] + [f"* {n}" for n in notes]
    lines.append(
        f"* fake device: races detected {s['races_detected']}, stream waits {s['stream_waits']}, "
        f"synchronizes {s['synchronizes']}"
    )
    print("\n".join(lines))
    ok = s["races_detected"] == 0 and all(
        r["equal"]
        and r["finite"]
        and (not r["streamed"] or r["streamed"] == r["expected_streamed"])
        for r in rows
    )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description="GPU placement tests, transfer bandwidth, layer-mode streaming")
    parser.add_argument("--gib", type=float, default=4.0, help="size of the random bf16 DiT in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument(
        "--skip-transfer", action="store_true", help="skip the module-mode transfer timings"
    )
    parser.add_argument("--skip-layer", action="store_true", help="skip the layer-mode section")
    parser.add_argument("--layer-blocks", type=int, default=40)
    parser.add_argument("--layer-width", type=int, default=5120)
    parser.add_argument("--layer-heads", type=int, default=40)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384],
                        help="sequence lengths of the layer-mode forwards (batch 1)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="no GPU needed: run the layer-mode section on the fake device, tiny model",
    )
    args = parser.parse_args()
    if args.tiny:
        return main_tiny(args.repeats)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run on a GPU machine)")
        return 1
    lines = [f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
             f"CUDA {torch.version.cuda}", ""]
    printed = [0]

    def flush() -> None:
        """Print the new lines; rewrite ``$OUT/gpu_check.md`` (a later crash or timeout
        keeps what was measured before it)."""
        print("\n".join(lines[printed[0]:]), flush=True)
        printed[0] = len(lines)
        out = os.environ.get("OUT")
        if out:
            Path(out, "gpu_check.md").write_text("\n".join(lines) + "\n")

    status = 0
    if not args.skip_tests:
        status, tail = run_tests()
        lines += ["placement/equality tests on cuda:", "```", tail, "```", ""]
        flush()
    if not args.skip_transfer:
        lines += ["| operation | seconds (median) | GB/s |", "|---|---:|---:|"]
        memory: list[str] = []
        for name, seconds, gbps in measure(args.gib, args.repeats, memory):
            rate = "-" if gbps != gbps else f"{gbps:.1f}"
            lines.append(f"| {name} | {seconds:.4f} | {rate} |")
        lines += [""] + [f"* {m}" for m in memory] + [""]
        flush()
    if not args.skip_layer:
        device = torch.device("cuda", torch.cuda.current_device())
        notes: list[str] = []
        try:
            rows = measure_layer(device, args.layer_blocks, args.layer_width, args.layer_heads,
                                 args.tokens, args.repeats, notes)
        except Exception as exc:  # noqa: BLE001 - reported with what was measured before
            lines += [f"layer-mode section failed: {type(exc).__name__}: {exc}"]
            lines += [f"* {n}" for n in notes]
            flush()
            return status or 1
        lines += layer_table(rows) + [""] + [f"* {n}" for n in notes]
        if not all(r["equal"] and r["finite"] for r in rows):
            status = status or 1
        flush()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
