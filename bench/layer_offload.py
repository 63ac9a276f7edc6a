"""Layer mode vs module mode vs diffusers' group offload, side by side on the fake device.

For tiny Wan2.2 and tiny Flux with ``num_layers`` blocks per DiT (default 8), every
variant gets its own freshly built (identical, deterministic) pipeline:

* all-resident: ``pipe.to(device)``
* module mode: ``ModelLevelOffloadBackend({"mode": "module", "components": ["dit",
  "text_encoder"]})``
* layer mode (prefetch on) and layer mode with ``resident_layers: 2``:
  ``LayerwiseOffloadBackend({"mode": "layer", ...})``
* diffusers group offload, ``block_level`` (1 block per group) and ``leaf_level``, each
  without and with ``use_stream=True``: ``enable_group_offload`` on every DiT (a
  ``ModelMixin``), ``diffusers.hooks.apply_group_offloading`` on every text encoder (a
  ``transformers`` model; for ``block_level`` with ``block_modules=["encoder"]`` so that
  the encoder's block list is grouped block by block: without it a text encoder, whose
  top level holds no ``ModuleList``, is a single group). The VAE is put on the device
  (it stays resident in our modes too).

The requests stop at the latents (``output_type="latent"``; ``--output np`` decodes): the
VAE is resident in every variant, and the tiny VAE's decode activations dwarf the tiny
weights, which would hide the differences in peak memory. All variants are set up and
warmed up first (one request; layer mode gets a second one: the first teaches it the
order of the components, and only the second teaches it what follows the last DiT
forward, the next request's text encoder; diffusers' stream mode traces the order of
its groups on the first request), then measured in interleaved rounds
(each round runs every variant once, in a rotated order), so that load from other
processes and the fake device's slower stream-modelling dispatch path (on for the whole
process once any side stream exists) hit every variant alike.

Columns, per measured request (bytes and counts are identical in every measured run,
the script checks it; wall time is the median):

* peak: device bytes at the request's high-water mark, this variant's resting weights
  included (other variants' pipelines, alive in the same process, are subtracted)
* H2D / D2H: bytes copied host->device / device->host (weights and activations)
* copies: tensor copies between host and device (fake ``transfers``)
* syncs: device-wide ``synchronize()`` calls; host stream syncs: ``Stream.synchronize``
  / ``Event.synchronize`` calls (host blocks on a stream; counted by this script)
* stream waits: ``wait_event`` / ``wait_stream`` (device-side ordering, no host block)
* time: median wall time / the all-resident median (same process, side by side)
* max|diff|: largest absolute difference of the latents from the all-resident latents

``--diagnose-write-check`` adds module and layer mode with our write detection (device
fingerprints of the weights at load/release, read back to the host) stubbed out: what it
costs in time on this device, where every device op is a Python call.

Usage (about 2 minutes on 2 shared CPU cores; 3 with ``--diagnose-write-check``)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/layer_offload.py [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_stub import write_checks_off  # noqa: E402  (bench/check_stub.py)

SELECT = ["dit", "text_encoder"]
DITS = ("transformer", "transformer_2")
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
PROMPT = {"prompt": "a cat on a mat", "negative_prompt": "blurry"}

# Host-blocking stream syncs, counted here: the fake device's ``synchronizes`` counts only
# the device-wide ``synchronize()``.
_HOST_SYNCS = [0]


def _count_host_syncs() -> None:
    for cls in (fa.Stream, fa.Event):
        real = cls.synchronize

        def counted(self, _real=real) -> None:
            _HOST_SYNCS[0] += 1
            _real(self)

        cls.synchronize = counted


@contextlib.contextmanager
def _write_check(on: bool):
    """``on=False``: our write detection stubbed out (``check_stub.write_checks_off``),
    as ``bench/residency_costs.py fingerprint`` does, to see what it costs on this device."""
    with write_checks_off(not on):
        yield


@dataclass
class Variant:
    """One way of running a pipeline, once set up: its pipeline and what keeps it alive."""

    name: str
    pipe: Any = None
    keep: Any = None  # the backend (our hooks hold it weakly)
    rest_bytes: int = 0  # device bytes this variant holds between requests
    note: str = ""
    error: str = ""
    runs: list[dict[str, Any]] = field(default_factory=list)
    out: np.ndarray | None = None
    engine: dict[str, int] = field(default_factory=dict)  # our backend's counters, last run
    write_check: bool = True  # False: our write detection stubbed out (diagnostic)


def _build(kind: str, layers: int) -> Any:
    pipe = tiny_pipelines.build(kind, seed=0, num_layers=layers)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _request(pipe: Any, kind: str, output: str) -> np.ndarray:
    kwargs = tiny_pipelines.default_call_kwargs(kind)
    out = pipe(
        **PROMPT, output_type=output, generator=torch.Generator("cpu").manual_seed(0), **kwargs
    )
    value = getattr(out, "images", None)
    value = out.frames if value is None else value
    if isinstance(value, torch.Tensor):
        return value.cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def _modules(pipe: Any, names: tuple[str, ...]) -> list[tuple[str, torch.nn.Module]]:
    return [
        (n, getattr(pipe, n)) for n in names if isinstance(getattr(pipe, n, None), torch.nn.Module)
    ]


def _group_offload(
    pipe: Any, device: torch.device, level: str, use_stream: bool, encoder_blocks: bool
) -> None:
    from diffusers.hooks import apply_group_offloading

    kw: dict[str, Any] = {
        "onload_device": device,
        "offload_device": "cpu",
        "offload_type": level,
        "use_stream": use_stream,
    }
    if level == "block_level":
        kw["num_blocks_per_group"] = 1
    for _, dit in _modules(pipe, DITS):
        dit.enable_group_offload(**kw)
    for _, enc in _modules(pipe, ENCODERS):
        extra = {"block_modules": ["encoder"]} if level == "block_level" and encoder_blocks else {}
        apply_group_offloading(enc, **kw, **extra)
    pipe.vae.to(device)


def _setups(
    kind: str, layers: int, device: torch.device, diagnose: bool = False
) -> dict[str, Callable[[], Variant]]:
    """Variant name -> a function that builds and sets up that variant's pipeline."""

    def resident() -> Variant:
        pipe = _build(kind, layers).to(device)
        return Variant("all-resident", pipe)

    def ours(
        name: str, cls: type, config: dict[str, Any], write_check: bool = True
    ) -> Callable[[], Variant]:
        def setup() -> Variant:
            pipe = _build(kind, layers)
            backend = cls(config, device)
            backend.enable(pipe)
            return Variant(name, pipe, backend, write_check=write_check)

        return setup

    def group(name: str, level: str, use_stream: bool) -> Callable[[], Variant]:
        def setup() -> Variant:
            pipe = _build(kind, layers)
            if level != "block_level" or not use_stream:
                _group_offload(pipe, device, level, use_stream, encoder_blocks=True)
                note = (
                    "text encoders: apply_group_offloading(block_modules=['encoder'])"
                    if level == "block_level"
                    else ""
                )
                return Variant(name, pipe, note=note)
            try:  # grouping the text encoders' blocks, as without streams
                _group_offload(pipe, device, level, use_stream, encoder_blocks=True)
                return Variant(name, pipe, note="text encoders: block_modules=['encoder']")
            except Exception as exc:  # noqa: BLE001 - reported, then the fallback runs
                failure = f"{type(exc).__name__}: {exc}".split("\n")[0]
            pipe = _build(kind, layers)  # the failed attempt left hooks behind: start over
            _group_offload(pipe, device, level, use_stream, encoder_blocks=False)
            return Variant(
                name,
                pipe,
                note=(
                    "apply_group_offloading(text_encoder, block_modules=['encoder'], "
                    f"use_stream=True) fails ({failure}); text encoders offloaded as one group "
                    "each instead"
                ),
            )

        return setup

    layer = {"mode": "layer", "components": SELECT}
    module = {"mode": "module", "components": SELECT}
    diagnostic = {
        "diffusion_offload module, write check stubbed (diagnostic)": ours(
            "diffusion_offload module, write check stubbed (diagnostic)",
            ModelLevelOffloadBackend,
            module,
            write_check=False,
        ),
        "diffusion_offload layer (prefetch), write check stubbed (diagnostic)": ours(
            "diffusion_offload layer (prefetch), write check stubbed (diagnostic)",
            LayerwiseOffloadBackend,
            layer,
            write_check=False,
        ),
    }
    return {
        "all-resident": resident,
        "diffusion_offload module [dit, text_encoder]": ours(
            "diffusion_offload module [dit, text_encoder]",
            ModelLevelOffloadBackend,
            module,
        ),
        "diffusion_offload layer (prefetch)": ours(
            "diffusion_offload layer (prefetch)", LayerwiseOffloadBackend, layer
        ),
        "diffusion_offload layer, resident_layers 2": ours(
            "diffusion_offload layer, resident_layers 2",
            LayerwiseOffloadBackend,
            {**layer, "layer_options": {"dit": {"resident_layers": 2}}},
        ),
        "diffusers group block_level (1 block)": group(
            "diffusers group block_level (1 block)", "block_level", False
        ),
        "diffusers group block_level (1 block), use_stream": group(
            "diffusers group block_level (1 block), use_stream", "block_level", True
        ),
        "diffusers group leaf_level": group("diffusers group leaf_level", "leaf_level", False),
        "diffusers group leaf_level, use_stream": group(
            "diffusers group leaf_level, use_stream", "leaf_level", True
        ),
        **(diagnostic if diagnose else {}),
    }


def _counters() -> dict[str, int]:
    s = fa.stats()
    return {**s, "host_syncs": _HOST_SYNCS[0]}


def _measure_once(v: Variant, kind: str, output: str) -> None:
    gc.collect()
    fa.reset_stats()
    _HOST_SYNCS[0] = 0
    start = fa.stats()["allocated_bytes"]
    engine = v.keep.stats.snapshot() if v.keep is not None else None
    with _write_check(v.write_check):
        t0 = time.perf_counter()
        out = _request(v.pipe, kind, output)
        seconds = time.perf_counter() - t0
    s = _counters()
    if engine is not None:
        spent = v.keep.stats.since(engine)
        v.engine = {
            "weight_h2d_bytes": spent.h2d_bytes,
            "weight_d2h_bytes": spent.d2h_bytes,
            "check_d2h_bytes": spent.check_d2h_bytes,
            "prefetches": spent.prefetches,
            "fallback_loads": spent.fallback_loads,
        }
        if isinstance(v.keep, LayerwiseOffloadBackend):
            v.engine["max_streamed_blocks_on_device"] = v.keep.streamer.max_on_device
    gc.collect()  # garbage of this request: what stays allocated after it is a leak
    v.runs.append(
        {
            "peak_bytes": s["peak_bytes"] - start + v.rest_bytes,
            "h2d_bytes": s["h2d_bytes"],
            "d2h_bytes": s["d2h_bytes"],
            "copies": s["transfers"],
            "synchronizes": s["synchronizes"],
            "stream_waits": s["stream_waits"],
            "host_syncs": s["host_syncs"],
            "races": s["races_detected"],
            "leaked_bytes": fa.stats()["allocated_bytes"] - start,
            "seconds": seconds,
        }
    )
    v.out = out


def bench_kind(
    kind: str, layers: int, runs: int, output: str, device: torch.device, diagnose: bool = False
) -> list[Variant]:
    variants: list[Variant] = []
    for name, setup in _setups(kind, layers, device, diagnose).items():
        gc.collect()
        before = fa.stats()["allocated_bytes"]
        t0 = time.perf_counter()
        try:
            v = setup()
            with _write_check(v.write_check):
                _request(v.pipe, kind, output)  # warm-up: cold start, order learning
                if isinstance(v.keep, LayerwiseOffloadBackend):
                    # layer mode learns what follows the last DiT forward (the next
                    # request's text encoder) only when that runs: from the third request
                    # on, every prefetch is predicted (the tests measure the same way)
                    _request(v.pipe, kind, output)
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result
            v = Variant(name, error=f"{type(exc).__name__}: {exc}".split("\n")[0])
            gc.collect()
        gc.collect()
        v.rest_bytes = fa.stats()["allocated_bytes"] - before
        gc.freeze()  # this pipeline's objects: later collections skip them (unfrozen below)
        print(
            f"  [{kind}] set up + warm-up {name}: {time.perf_counter() - t0:.1f} s"
            + (f" FAILED {v.error}" if v.error else ""),
            file=sys.stderr,
            flush=True,
        )
        variants.append(v)
    live = [v for v in variants if not v.error]
    for r in range(runs):
        order = live[r % len(live) :] + live[: r % len(live)]
        for v in order:
            try:
                _measure_once(v, kind, output)
            except Exception as exc:  # noqa: BLE001
                v.error = f"{type(exc).__name__}: {exc}".split("\n")[0]
                live = [x for x in live if x is not v]
    gc.unfreeze()
    for v in variants:  # the engine's own counters of the last measured request
        if v.engine and isinstance(v.keep, LayerwiseOffloadBackend):
            e = v.engine
            v.note = (
                f"engine, last request: weight H2D {e['weight_h2d_bytes']:,} B, weight D2H "
                f"{e['weight_d2h_bytes']} B, write-check read-backs {e['check_d2h_bytes']} B, "
                f"prefetches {e['prefetches']}, fallback loads {e['fallback_loads']}; at most "
                f"{e['max_streamed_blocks_on_device']} streamed blocks on the device"
            )
        elif v.engine:
            e = v.engine
            v.note = (
                f"engine, last request: weight H2D {e['weight_h2d_bytes']:,} B, weight D2H "
                f"{e['weight_d2h_bytes']} B, write-check read-backs {e['check_d2h_bytes']} B"
            )
    return variants


_COLS = (
    "peak_bytes",
    "h2d_bytes",
    "d2h_bytes",
    "copies",
    "synchronizes",
    "stream_waits",
    "host_syncs",
)


def summarize(kind: str, variants: list[Variant]) -> dict[str, Any]:
    base = next(v for v in variants if v.name == "all-resident")
    base_s = statistics.median(r["seconds"] for r in base.runs)
    rows = []
    for v in variants:
        row: dict[str, Any] = {
            "variant": v.name,
            "note": v.note,
            "error": v.error,
            "engine": v.engine,
        }
        if v.runs and not v.error:
            last = v.runs[-1]
            row.update({c: last[c] for c in _COLS})
            row["counts_stable"] = all(all(r[c] == last[c] for c in _COLS) for r in v.runs)
            row["races"] = max(r["races"] for r in v.runs)
            row["leaked_bytes"] = max(r["leaked_bytes"] for r in v.runs)
            row["seconds_median"] = statistics.median(r["seconds"] for r in v.runs)
            row["seconds"] = [r["seconds"] for r in v.runs]
            row["time_ratio"] = row["seconds_median"] / base_s
            row["max_abs_diff"] = float(np.abs(v.out - base.out).max())
        rows.append(row)
    return {"kind": kind, "rows": rows}


def markdown(result: dict[str, Any], layers: int, runs: int, output: str) -> str:
    kind = result["kind"]
    lines = [
        (
            f"tiny {kind}, num_layers={layers}, 2 steps, output_type={output!r}; "
            f"per request, median of {runs} runs after warm-up"
        ),
        "",
        (
            "| variant | peak bytes | H2D bytes | D2H bytes | copies | syncs | stream waits | "
            "host stream syncs | time / all-resident | max abs diff |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in result["rows"]:
        if row["error"] or "time_ratio" not in row:
            lines.append(f"| {row['variant']} | failed: {row['error']} |||||||||")
            continue
        lines.append(
            f"| {row['variant']} | {row['peak_bytes']:,} | {row['h2d_bytes']:,} | "
            f"{row['d2h_bytes']:,} | {row['copies']:,} | {row['synchronizes']:,} | "
            f"{row['stream_waits']:,} | "
            f"{row['host_syncs']:,} | {row['time_ratio']:.2f} | {row['max_abs_diff']:.1e} |"
        )
        extra = []
        if not row["counts_stable"]:
            extra.append("byte/copy counts differed between measured runs (last run shown)")
        if row["races"]:
            extra.append(f"{row['races']} races detected")
        if row["leaked_bytes"]:
            extra.append(f"{row['leaked_bytes']} device bytes more after the request than before")
        if row["note"]:
            extra.append(row["note"])
        if extra:
            notes.append(f"* {row['variant']}: " + "; ".join(extra))
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kinds", nargs="+", default=["wan2.2", "flux"], choices=tiny_pipelines.KINDS
    )
    parser.add_argument("--layers", type=int, default=8, help="blocks per DiT (num_layers)")
    parser.add_argument("--runs", type=int, default=3, help="measured requests per variant")
    parser.add_argument(
        "--output",
        choices=["latent", "np"],
        default="latent",
        help="stop at the latents (default) or decode with the resident VAE",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steadier ratios on a shared machine)",
    )
    parser.add_argument(
        "--diagnose-write-check",
        action="store_true",
        help="add module and layer mode with our write detection stubbed out (its cost here)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the results as JSON ('-': stdout)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = fa.install()
    _count_host_syncs()
    start = time.perf_counter()
    results = []
    for kind in args.kinds:
        variants = bench_kind(
            kind, args.layers, args.runs, args.output, device, args.diagnose_write_check
        )
        results.append(summarize(kind, variants))
        del variants
        gc.collect()
    blocks = [markdown(r, args.layers, args.runs, args.output) for r in results]
    print("\n\n".join(blocks))
    print(
        f"\n(total {time.perf_counter() - start:.0f} s; torch {torch.__version__}, "
        f"{args.threads} thread(s))"
    )
    if args.json:
        import diffusers

        payload = {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "layers": args.layers,
            "runs": args.runs,
            "output": args.output,
            "results": results,
        }
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
