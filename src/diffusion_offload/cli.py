"""The ``diffusion-offload`` command line: ``generate``, ``serve`` and ``make-tiny``.

Every bad input (missing directory, unknown hub id offline, not a diffusers pipeline,
unsupported pipeline class, invalid JSON or config, unwritable or wrongly named output,
a config that does not fit) prints one line ``diffusion-offload: error: ...`` to stderr
and exits with status 2, writing nothing. Library warnings (transformers, diffusers) are
silenced while the input is validated, so that line is all a bad input prints.

Testing aid (undocumented in ``--help``): with ``--device fakegpu``, the environment
variable ``DIFFUSION_OFFLOAD_FAKE_CAPACITY=BYTES`` limits the fake accelerator's memory
to ``BYTES`` (``fake_accelerator.set_capacity``) before the fit check, so a config that
does not fit can be shown without a real GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["default_model_dir", "main"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
FAKE_CAPACITY_ENV = "DIFFUSION_OFFLOAD_FAKE_CAPACITY"


class CliError(Exception):
    """A user error: printed as one line, exit status 2 (or ``status``)."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        print(f"diffusion-offload: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def default_model_dir() -> Path:
    """Where the embedded tiny Wan2.2 model lives: ``$DIFFUSION_OFFLOAD_CACHE`` or
    ``$XDG_CACHE_HOME/diffusion_offload`` (default ``~/.cache/diffusion_offload``), ``/tiny-wan2.2``."""
    root = os.environ.get("DIFFUSION_OFFLOAD_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "diffusion_offload")
    return Path(root) / "tiny-wan2.2"


def _ensure_default_model() -> Path:
    from .testing import tiny_pipelines

    path = default_model_dir()
    if (path / "model_index.json").is_file() and tiny_pipelines.kind_of(path) is None:
        # built by an earlier version, before folders carried the tiny-pipeline marker
        (path / tiny_pipelines.MARKER).write_text(json.dumps({"kind": "wan2.2", "seed": 0}))
    if not (path / "model_index.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building the embedded tiny Wan2.2 model in {path} ...", file=sys.stderr)
        tiny_pipelines.save("wan2.2", path)
    return path


def _read_config_arg(text: str | None) -> Any:
    if text is None:
        return None
    from .config import reject_duplicate_keys

    if text.startswith("@"):
        file = Path(text[1:])
        if file.is_dir():
            raise CliError(f"--diffusion-offload-config: {str(file)!r} is a folder, not a JSON file")
        if not file.is_file():
            raise CliError(f"--diffusion-offload-config: file {str(file)!r} does not exist")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--diffusion-offload-config: cannot read {str(file)!r} as UTF-8 text ({exc})") from None
    try:
        value = json.loads(text, object_pairs_hook=reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise CliError(f"--diffusion-offload-config is not valid JSON: {exc}") from None
    except ValueError as exc:  # a repeated key
        raise CliError(f"--diffusion-offload-config: {exc}") from None
    if not isinstance(value, dict):
        raise CliError(
            f"--diffusion-offload-config must be a JSON object like "
            f'{{"mode": "module", "components": ["dit", "text_encoder"]}}, got {value!r}'
        )
    return value


def parse_config_args(args: argparse.Namespace):
    """The validated config from ``--diffusion-offload-config`` / ``--enable-cpu-offload``."""
    from .config import parse_diffusion_offload_config

    raw = _read_config_arg(args.diffusion_offload_config)
    try:
        return parse_diffusion_offload_config(raw, enable_cpu_offload=args.enable_cpu_offload)
    except (TypeError, ValueError) as exc:
        raise CliError(f"--diffusion-offload-config: {exc}") from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diffusion-offload-config", metavar="JSON_OR_@FILE",
                   help='offload config, e.g. \'{"mode":"module","components":["dit","text_encoder"]}\'')
    p.add_argument("--enable-cpu-offload", action="store_true",
                   help="legacy: model-level offload of every DiT and encoder")
    p.add_argument("--device", help="cuda[:N], xpu, npu, mps, fakegpu (the test accelerator) or cpu; default: auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffusion-offload", description="Model-level offload for diffusion pipelines.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate an image or a video")
    gen.add_argument("--model", help="pipeline directory or hub id (default: the embedded tiny Wan2.2)")
    gen.add_argument("--prompt", default="a red fox running through fresh snow")
    gen.add_argument("--negative-prompt")
    gen.add_argument("--output", help="output file: .png for images, .mp4 or .gif for videos")
    _add_engine_args(gen)
    for name in ("--steps", "--seed", "--height", "--width", "--num-frames", "--fps"):
        gen.add_argument(name, type=int)
    gen.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    gen.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (open in Perfetto)")

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-style HTTP API")
    srv.add_argument("model", help="pipeline directory or hub id")
    srv.add_argument("--omni", action="store_true", help="accepted for vLLM-Omni command-line compatibility")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    _add_engine_args(srv)
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (not on /health, /metrics)")
    srv.add_argument("--max-queue", type=int, default=32, help="waiting jobs before 429 (default 32)")
    srv.add_argument("--max-pixels", type=int, default=1024 * 1024,
                     help="largest width*height a request may ask for (default 1048576)")
    srv.add_argument("--max-frames", type=int, default=129, help="largest num_frames of a video job (default 129)")
    srv.add_argument("--max-steps", type=int, default=100, help="largest num_inference_steps (default 100)")
    srv.add_argument("--max-body-bytes", type=int, default=1048576, help="largest request body, else 413")
    srv.add_argument("--shutdown-grace", type=float, default=30.0,
                     help="seconds the running job may finish after SIGINT/SIGTERM (default 30)")

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight pipeline in diffusers format")
    tiny.add_argument("kind", help="wan2.1, wan2.2, flux, sd3, qwen-image")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def _check_writable(path: str | None, flag: str) -> Path | None:
    from .engine.media import check_writable_folder

    if path is None:
        return None
    out = Path(path)
    if out.suffix.lower() != ".json":
        raise CliError(f"{flag} {path!r} must end in .json")
    try:
        check_writable_folder(out, flag)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if out.is_dir():
        raise CliError(f"{flag} {path!r} is a folder")
    return out


@contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Silence transformers and diffusers warnings (e.g. about optional backends that
    importing a pipeline class logs) while the input is validated; restored afterwards."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    saved = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(saved[0])
        diffusers_logging.set_verbosity(saved[1])


def _hide_loading_bars() -> None:
    """No per-file "Loading weights" bars from diffusers/transformers: the CLI shows one
    progress bar, over the denoising steps (the pipeline's own)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _apply_fake_capacity(device: str | None) -> None:
    """``DIFFUSION_OFFLOAD_FAKE_CAPACITY`` (testing aid): cap the fake accelerator's memory."""
    value = os.environ.get(FAKE_CAPACITY_ENV)
    if value is None or device is None or not str(device).startswith("fakegpu"):
        return
    try:
        nbytes = int(value)
        if nbytes < 0:
            raise ValueError
    except ValueError:
        raise CliError(f"{FAKE_CAPACITY_ENV}={value!r} is not a number of bytes (an int >= 0)") from None
    from .testing import fake_accelerator

    fake_accelerator.install()
    fake_accelerator.set_capacity(nbytes)


def _summary(output: Any, report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="diffusion-offload", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for stage, seconds in output.timings.items():
        table.add_row(f"time {stage}", f"{seconds:.3f} s")
    table.add_row("peak device memory", f"{output.peak_device_memory_bytes:,} B")
    stats = output.offload_stats
    table.add_row("host->device weights", f"{int(stats.get('h2d_bytes', 0)):,} B")
    table.add_row("device->host weights", f"{int(stats.get('d2h_bytes', 0)):,} B")
    table.add_row("loads / evictions", f"{int(stats.get('loads', 0))} / {int(stats.get('evictions', 0))}")
    table.add_row("output", str(report["output"]))
    Console(stderr=True).print(table)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import FitError, ModelError, Omni, SamplingParams
    from .engine.media import check_output_path, encode_png, encode_video, write_atomic
    from .engine.model_files import inspect_model, resolve_model

    config = parse_config_args(args)
    _hide_loading_bars()
    report_path = _check_writable(args.report, "--report")
    trace_path = _check_writable(args.trace, "--trace")
    named = [(flag, Path(p).resolve()) for flag, p in
             (("--output", args.output), ("--report", args.report), ("--trace", args.trace)) if p]
    for i, (flag, path) in enumerate(named):
        for other, other_path in named[i + 1:]:
            if path == other_path:
                raise CliError(f"{flag} and {other} name the same file {str(path)!r}; give each its own")
    if args.output is not None:  # what does not depend on the model, before loading its code
        try:
            check_output_path(args.output, None)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    embedded = args.model is None
    with _quiet_libraries():
        try:
            model_dir = _ensure_default_model() if embedded else resolve_model(args.model)
            info = inspect_model(model_dir)
        except ModelError as exc:
            raise CliError(str(exc)) from None
    output = args.output or ("output.mp4" if info.is_video else "output.png")
    try:
        out_path = check_output_path(output, info.is_video)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _apply_fake_capacity(args.device)
    values = {
        "height": args.height, "width": args.width, "num_frames": args.num_frames,
        "num_inference_steps": args.steps, "seed": args.seed, "fps": args.fps,
    }
    from .testing.tiny_pipelines import default_call_kwargs, kind_of

    tiny_kind = kind_of(model_dir)
    if tiny_kind is not None:  # a tiny model (embedded or make-tiny): its fast defaults
        for key, value in default_call_kwargs(tiny_kind).items():
            if key in values and values[key] is None:
                values[key] = value
    if not info.is_video and args.num_frames is not None:
        raise CliError(f"--num-frames: {info.pipeline_class} makes images, not videos")
    try:
        params = SamplingParams(**values)
        engine = Omni(
            str(model_dir), config, device=args.device, dtype=args.dtype, trace=trace_path is not None
        )
    except (FitError, ModelError, NotImplementedError) as exc:
        raise CliError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    with engine:
        prompt = {"prompt": args.prompt, "negative_prompt": args.negative_prompt} if args.negative_prompt else args.prompt
        try:
            result = engine.generate(prompt, params)[0]
        except ValueError as exc:  # the pipeline's own input checks (size multiples, ...)
            raise CliError(" ".join(str(exc).split())) from None
        except torch.OutOfMemoryError as exc:
            message = " ".join(str(exc).split())
            raise CliError(
                f"{message} (try a config that offloads more components, or a smaller size)",
                EXIT_FAILURE,
            ) from None
        except Exception as exc:  # the model itself failed: one line, status 1
            message = " ".join(str(exc).split())
            raise CliError(f"generation failed: {type(exc).__name__}: {message}", EXIT_FAILURE) from None
        fps = params.fps or 16
        if info.is_video:
            data = encode_video(result.frames[0], fps, out_path.suffix.lower())
        else:
            data = encode_png(result.images[0])
        write_atomic(out_path, data)
        report = {
            "model": args.model or str(model_dir),
            "pipeline_class": info.pipeline_class,
            "device": str(engine.device),
            "config": config.to_dict() if config is not None else None,
            "timings": result.timings,
            "peak_device_memory_bytes": result.peak_device_memory_bytes,
            "offload_stats": result.offload_stats,
            "output": str(out_path),
        }
        if report_path is not None:
            write_atomic(report_path, json.dumps(report, indent=2).encode())
        if trace_path is not None:
            write_atomic(trace_path, json.dumps(engine.trace_dict()).encode())
    _summary(result, report)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from .testing import tiny_pipelines

    if args.kind not in tiny_pipelines.KINDS:
        raise CliError(f"kind {args.kind!r} is not allowed; allowed: {list(tiny_pipelines.KINDS)}")
    try:
        path = tiny_pipelines.save(args.kind, args.dir, seed=args.seed)
    except OSError as exc:
        raise CliError(f"make-tiny: cannot write {args.dir!r}: {exc.strerror or exc}") from None
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server.app import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``diffusion-offload``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "make-tiny":
            return _make_tiny(args)
        return _serve(args)
    except CliError as exc:
        print(f"diffusion-offload: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("diffusion-offload: interrupted (no output written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
