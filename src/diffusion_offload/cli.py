"""The ``diffusion-offload`` command line: ``generate``, ``serve``, ``plan`` and ``make-tiny``.

Every bad input (missing directory, unknown hub id offline, not a diffusers pipeline,
unsupported pipeline class, a truncated or corrupt weight file, invalid JSON or config,
an existing output without ``--overwrite``, an output inside the model folder, a size
the model does not take, a config that does not fit) prints one line
``diffusion-offload: error: ...`` naming the flag as typed, and exits with status 2,
writing nothing. ``--help``, ``--version`` and flag or config errors answer before
torch is imported. Outputs are written to a temporary file in the same folder, then
renamed, so a failure leaves nothing behind.

Testing aid (undocumented in ``--help``): with ``--device fakegpu``, the environment
variable ``DIFFUSION_OFFLOAD_FAKE_CAPACITY=BYTES`` limits the fake accelerator's memory
to ``BYTES`` (``fake_accelerator.set_capacity``) before the fit check, so a config that
does not fit can be shown without a real GPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .cli_args import (
    DEFAULT_PROMPT,
    EXIT_FAILURE,
    EXIT_USAGE,
    CliError,
    build_parser,
    check_lora_args,
    parse_config_args,
    quiet_libraries,
    version,
)
from .units import human_bytes

__all__ = ["CliError", "default_model_dir", "main"]

FAKE_CAPACITY_ENV = "DIFFUSION_OFFLOAD_FAKE_CAPACITY"
REPORT_FORMAT = 2

# report "request" key -> (argparse dest, flag)
_REQUEST_ARGS = {
    "model": ("model", "--model"),
    "variant": ("variant", "--variant"),
    "prompt": ("prompt", "--prompt"),
    "negative_prompt": ("negative_prompt", "--negative-prompt"),
    "height": ("height", "--height"),
    "width": ("width", "--width"),
    "num_frames": ("num_frames", "--num-frames"),
    "num_inference_steps": ("steps", "--steps"),
    "seed": ("seed", "--seed"),
    "fps": ("fps", "--fps"),
    "params": ("param", "--param"),
    "image": ("image", "--image"),
    "mask": ("mask", "--mask"),
    "device": ("device", "--device"),
    "dtype": ("dtype", "--dtype"),
    "max_pinned_bytes": ("max_pinned_memory", "--max-pinned-memory"),
    "device_memory_budget": ("device_memory_budget", "--device-memory-budget"),
    "host_memory_budget": ("host_memory_budget", "--host-memory-budget"),
    "guidance_scale": ("guidance_scale", "--guidance-scale"),
    "loras": ("lora", "--lora"),
}


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


# ---------------------------------------------------------------------- files


def _check_new_file(path: str | None, flag: str, overwrite: bool, suffixes: tuple[str, ...]) -> Path | None:
    """Checks of a file the command will write, before anything loads."""
    if path is None:
        return None
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        raise CliError(f"{flag} {path!r} must end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise CliError(f"{flag} {path!r} is a folder; give a file name")
    if out.exists() and not overwrite:
        raise CliError(f"{flag} {path!r} already exists; pass --overwrite to replace it")
    from .engine.media import check_writable_folder

    try:
        check_writable_folder(out, flag)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if out.exists() and not os.access(out, os.W_OK):
        raise CliError(f"{flag} {path!r} is not writable")
    return out


def _check_outside_model(named: list[tuple[str, Path]], model_dir: Path) -> None:
    root = model_dir.resolve()
    for flag, path in named:
        resolved = path.resolve()
        if resolved == root or root in resolved.parents:
            raise CliError(
                f"{flag} {str(path)!r} is inside the model folder {str(model_dir)!r}; "
                "write outputs elsewhere (model files are never replaced)"
            )


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


# ---------------------------------------------------------------------- report


def _apply_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """Fill the flags not given on the command line from ``--from-report``'s request."""
    if args.from_report is None:
        return None
    file = Path(args.from_report)
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
        request = report["request"]
        if not isinstance(request, dict):
            raise TypeError
    except FileNotFoundError:
        raise CliError(f"--from-report: file {args.from_report!r} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CliError(
            f"--from-report {args.from_report!r} is not a diffusion-offload report with a "
            "'request' (write one with generate --report)"
        ) from None
    for key, (dest, _flag) in _REQUEST_ARGS.items():
        if getattr(args, dest, None) is None and request.get(key) is not None:
            setattr(args, dest, request[key])
    if args.diffusion_offload_config is None and not args.enable_cpu_offload:
        config = request.get("diffusion_offload_config")
        if config is not None:
            args.diffusion_offload_config = json.dumps(config)
    if args.output is None and request.get("output"):
        args.output = request["output"]
    return report


def _summary(output: Any, report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="diffusion-offload", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for stage, seconds in report["timings"].items():
        label = "time total (load included)" if stage == "total" else f"time {stage}"
        table.add_row(label, f"{seconds:.3f} s")
    table.add_row("peak device memory", human_bytes(output.peak_device_memory_bytes))
    stats = output.offload_stats
    table.add_row("host->device weights", human_bytes(int(stats.get("h2d_bytes", 0))))
    table.add_row("device->host weights", human_bytes(int(stats.get("d2h_bytes", 0))))
    table.add_row("loads / evictions", f"{int(stats.get('loads', 0))} / {int(stats.get('evictions', 0))}")
    table.add_row(
        "host copies pinned / pageable / disk",
        " / ".join(human_bytes(int(stats.get(k, 0)))
                   for k in ("pinned_bytes", "pageable_host_bytes", "disk_backed_bytes")),
    )
    table.add_row("disk reads", human_bytes(int(stats.get("disk_read_bytes", 0))))
    table.add_row("output", str(report["output"]))
    Console(stderr=True).print(table)


# ---------------------------------------------------------------------- generate


_PARAM_FIELDS = ("flow_shift", "boundary_ratio", "guidance_scale_2")
"""``--param`` names that are ``SamplingParams`` fields rather than ``__call__`` arguments."""


def _edit_class(pipeline_class: str, edit: str | None) -> Any:
    """The diffusers class that runs the request: the model's, or with ``--image`` (and
    ``--mask``) its image-to-image (inpainting) variant, as ``Omni`` picks it."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    params = inspect.signature(cls.__call__).parameters
    if edit is None or ("image" in params and (edit == "image" or "mask_image" in params)):
        return cls
    from diffusers.pipelines import auto_pipeline

    mapping = (auto_pipeline.AUTO_INPAINT_PIPELINES_MAPPING if edit == "mask"
               else auto_pipeline.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING)
    try:
        return auto_pipeline._get_task_class(mapping, pipeline_class)
    except ValueError:
        what = "inpainting" if edit == "mask" else "image-to-image"
        raise CliError(f"--{edit}: {pipeline_class} has no {what} variant in diffusers, so it "
                       "cannot edit images") from None


def _param_args(items: list[str], pipeline_class: str, steps: int | None,
                edit: str | None = None) -> dict[str, Any]:
    """``--param NAME=VALUE`` pairs as ``SamplingParams`` fields (``extra`` for the
    ``__call__`` knobs), each checked by ``engine.knobs`` before any weight is read,
    against the pipeline that runs the request (``edit``: ``"image"`` or ``"mask"``).

    Raises:
        CliError: not ``NAME=VALUE``, a name given twice, one the pipeline does not take
            (the message lists those it does), one the engine sets, or a bad value.
    """
    if not items:
        return {}
    from .engine.knobs import Knob, KnobError, check_knob, knob_table, refusal

    cls = _edit_class(pipeline_class, edit)
    pipeline_class = cls.__name__
    knobs, refused = knob_table(cls.__call__)
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CliError(f"--param {item!r}: write NAME=VALUE, e.g. --param true_cfg_scale=4")
        if name in fields or name in extra:
            raise CliError(f"--param {name}: given twice")
        try:
            if name in _PARAM_FIELDS:
                fields[name] = check_knob(Knob(name, "float"), text, field=name, text=True)
                continue
            if name in refused:
                raise refusal(name, refused[name])
            if name not in knobs or name in ("negative_prompt", "height", "width", "num_frames",
                                             "num_inference_steps", "guidance_scale"):
                own = {"negative_prompt": "--negative-prompt", "height": "--height",
                       "width": "--width", "num_frames": "--num-frames",
                       "num_inference_steps": "--steps", "guidance_scale": "--guidance-scale"}
                if name in own:
                    raise KnobError(name, f"give {name} as {own[name]}")
                taken = sorted(set(knobs) - set(own)) + list(_PARAM_FIELDS)
                raise KnobError(name, f"{pipeline_class} takes no {name!r}; it takes: "
                                      f"{', '.join(taken)}")
            extra[name] = check_knob(knobs[name], text, field=name, text=True,
                                     max_items=(steps or 1000) + 1)
        except KnobError as exc:
            raise CliError(f"--param {name}: {exc}") from None
    return {**fields, **({"extra": extra} if extra else {})}


def _image_args(image: str | None, mask: str | None) -> dict[str, Any]:
    """``--image``/``--mask`` as the ``image``/``mask`` of ``Omni.generate``'s prompt,
    read before any weight is (EXIF orientation applied; the mask in grey levels).

    Raises:
        CliError: a mask without an image, or a file that is not a PNG, JPEG or WebP.
    """
    if mask is not None and image is None:
        raise CliError("--mask needs --image (the image to inpaint)")
    from PIL import Image, ImageOps, UnidentifiedImageError

    out: dict[str, Any] = {}
    for flag, key, path, mode in (("--image", "image", image, "RGB"), ("--mask", "mask", mask, "L")):
        if path is None:
            continue
        try:
            with Image.open(path, formats=["PNG", "JPEG", "WEBP"]) as opened:
                out[key] = ImageOps.exif_transpose(opened).convert(mode)
        except FileNotFoundError:
            raise CliError(f"{flag} {path!r}: no such file") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise CliError(f"{flag} {path!r}: not a PNG, JPEG or WebP image ({exc})") from None
    return out


def _generate(args: argparse.Namespace) -> int:
    _apply_report(args)
    config = parse_config_args(args)
    check_lora_args(args)
    overwrite = args.overwrite
    out_given = _check_new_file(args.output, "--output", overwrite, (".png", ".mp4", ".gif"))
    report_path = _check_new_file(args.report, "--report", overwrite, (".json",))
    trace_path = _check_new_file(args.trace, "--trace", overwrite, (".json",))
    named = [(flag, p) for flag, p in (("--output", out_given), ("--report", report_path),
                                       ("--trace", trace_path)) if p is not None]
    for i, (flag, path) in enumerate(named):
        for other, other_path in named[i + 1:]:
            if path.resolve() == other_path.resolve():
                raise CliError(f"{flag} and {other} name the same file {str(path)!r}; give each its own")

    quiet_libraries()
    import torch

    from .engine import FitError, ModelError
    from .engine.media import check_output_path, encode_png, encode_video, write_atomic
    from .models.files import inspect_model, resolve_model
    from .engine.omni import parse_dtype, pick_device
    from .engine.params import SamplingParams
    from .models.rules import DEFAULT_FPS, model_rules
    from .engine.omni import build_omni

    embedded = args.model is None
    try:
        parse_dtype(args.dtype)
        model_dir = _ensure_default_model() if embedded else resolve_model(args.model)
        info = inspect_model(model_dir, args.variant)
    except ModelError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:
        raise CliError(f"--dtype: {exc}") from None
    output = args.output or ("output.mp4" if info.is_video else "output.png")
    try:
        out_path = check_output_path(output, info.is_video)
    except ValueError as exc:
        raise CliError(f"--output: {exc}") from None
    if out_given is None:
        out_path = _check_new_file(output, "--output", overwrite, (".png", ".mp4", ".gif"))
    named.append(("--output", out_path))
    _check_outside_model(named, model_dir)

    rules = model_rules(info)
    names = {"height": "--height", "width": "--width", "num_frames": "--num-frames"}
    try:
        rules.check({"height": args.height, "width": args.width, "num_frames": args.num_frames}, names)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    values = rules.resolve({
        "height": args.height, "width": args.width, "num_frames": args.num_frames,
        "num_inference_steps": args.steps,
    })
    seed = 0 if args.seed is None else args.seed
    fps = (args.fps or DEFAULT_FPS) if info.is_video else None
    prompt_text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    images = _image_args(args.image, args.mask)
    knobs = _param_args(args.param or [], info.pipeline_class, values.get("num_inference_steps"),
                        edit="mask" if args.mask else ("image" if args.image else None))
    try:
        device = pick_device(args.device)  # picked once: its log line is said once
        params = SamplingParams(seed=seed, fps=fps, guidance_scale=args.guidance_scale, **values,
                                **knobs)
    except (TypeError, ValueError) as exc:
        raise CliError(f"--device: {exc}" if "device" in str(exc) else str(exc)) from None
    _apply_fake_capacity(args.device)
    try:
        extra: dict[str, Any] = {"plan_shape": values}  # auto's and the fit advice's request
        if args.device_memory_budget is not None:
            extra["device_memory_budget"] = args.device_memory_budget
        if getattr(args, "host_memory_budget", None) is not None:
            extra["host_memory_budget"] = args.host_memory_budget
        if getattr(args, "page_cache", None) is not None:
            extra["page_cache"] = args.page_cache
        engine = build_omni(
            model_dir, config, variant=args.variant, max_pinned_bytes=args.max_pinned_memory,
            device=device, dtype=args.dtype, trace=trace_path is not None,
            loras=[tuple(lora) for lora in args.lora or ()], **extra,
        )
        config = engine.config  # "auto" resolved: the report records what ran
    except (FitError, ModelError, NotImplementedError, ImportError) as exc:
        raise CliError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # diffusers could not read a file the checks did not cover
        raise CliError(f"the model files in {str(model_dir)!r} cannot be loaded: "
                       f"{' '.join(str(exc).split())}") from None
    with engine:
        prompt: Any = prompt_text
        if args.negative_prompt is not None:
            prompt = {"prompt": prompt_text, "negative_prompt": args.negative_prompt}
        if images:
            prompt = {**(prompt if isinstance(prompt, dict) else {"prompt": prompt}), **images}
        try:
            result = engine.generate(prompt, params)[0]
        except ValueError as exc:  # the pipeline's own input checks
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
        if info.is_video:
            data = encode_video(result.frames[0], fps or DEFAULT_FPS, out_path.suffix.lower())
        else:
            data = encode_png(result.images[0])
        timings = dict(result.timings)
        timings["total"] = sum(v for k, v in timings.items() if k != "total")
        import diffusers

        report = {
            "format": REPORT_FORMAT,
            "request": {
                # a local folder as an absolute path, so the report works from anywhere
                "model": str(model_dir.resolve()) if embedded or Path(args.model).is_dir() else args.model,
                "variant": args.variant,
                "prompt": prompt_text,
                "negative_prompt": args.negative_prompt,
                **values,
                "seed": seed,
                "fps": fps,
                "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."),
                "diffusion_offload_config": config.to_dict() if config is not None else None,
                "max_pinned_bytes": args.max_pinned_memory,
                # auto's pick included, so --from-report replays what ran
                "device_memory_budget": getattr(engine, "device_memory_budget", None),
                # "auto" as measured, so --from-report replays what ran
                "host_memory_budget": getattr(engine, "host_memory_budget", None),
                "guidance_scale": args.guidance_scale,
                "params": list(args.param) if args.param else None,
                "image": str(Path(args.image).resolve()) if args.image else None,
                "mask": str(Path(args.mask).resolve()) if args.mask else None,
                "loras": [list(lora) for lora in args.lora or ()] or None,
                "output": str(out_path),
            },
            "model": args.model or str(model_dir),
            "model_path": str(model_dir.resolve()),
            "pipeline_class": info.pipeline_class,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "config": config.to_dict() if config is not None else None,
            "timings": timings,
            "peak_device_memory_bytes": result.peak_device_memory_bytes,
            "peak_host_memory": result.peak_host_memory,
            "offload_stats": result.offload_stats,
            "output": str(out_path),
            "versions": {
                "diffusion_offload": version(),
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
            },
        }
        trace = json.dumps(engine.trace_dict()).encode() if trace_path is not None else None
        write_atomic(out_path, data)
        if report_path is not None:
            write_atomic(report_path, json.dumps(report, indent=2).encode())
        if trace_path is not None:
            write_atomic(trace_path, trace)
    _summary(result, report)
    return 0


# ---------------------------------------------------------------------- make-tiny


def _make_tiny(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    if target.exists() and not target.is_dir():
        raise CliError(f"make-tiny: {args.dir!r} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()):
        if not args.overwrite:
            raise CliError(
                f"make-tiny: folder {args.dir!r} is not empty; choose a new or empty folder, or "
                "pass --overwrite to replace a folder that make-tiny wrote"
            )
        from .testing import tiny_pipelines

        if tiny_pipelines.kind_of(target) is None:
            raise CliError(
                f"make-tiny: refusing to replace {args.dir!r}: it was not written by make-tiny "
                f"(no {tiny_pipelines.MARKER}), even with --overwrite"
            )
    quiet_libraries()
    from .testing import tiny_pipelines

    try:
        path = tiny_pipelines.save(args.kind, args.dir, seed=args.seed, num_layers=args.num_layers)
    except FileExistsError as exc:
        raise CliError(f"make-tiny: {exc}") from None
    except OSError as exc:
        raise CliError(f"make-tiny: cannot write {args.dir!r}: {exc.strerror or exc}") from None
    print(path)
    return 0


# ---------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    """``diffusion-offload plan``: the planner's table (or ``--json``) on stdout."""
    quiet_libraries()
    from .engine import ModelError
    from .planner.model import load_plan_model
    from .core.tiers import reserve_bytes
    from .planner.plan import HostInputs, describe_plan, format_plan, plan_model, resolve_request, rows_json

    names = {"height": "--height", "width": "--width", "num_frames": "--num-frames"}
    try:
        pm = load_plan_model(args.model, variant=args.variant, dtype=args.dtype or "auto",
                             weights_dtype=args.weights_dtype)
        request = resolve_request(pm, args.height, args.width, args.num_frames, args.steps,
                                  names=names)
        device_memory = args.device_memory
        if device_memory is None and args.device_kind == "cpu":
            raise CliError("--device-kind cpu needs --device-memory (a CPU has no device memory "
                           "of its own to read), e.g. --device-memory 64GiB")
        if device_memory is None:
            from .planner.plan import default_device_memory

            device_memory = default_device_memory(args.device_kind)
        host_memory = args.host_memory
        host_budget = None if host_memory is None else host_memory - reserve_bytes(host_memory)
        rows = plan_model(pm, request, device_memory, device_kind=args.device_kind,
                          h2d_bandwidth=args.h2d_bandwidth,
                          host=HostInputs(host_budget, args.disk_bandwidth))
    except ModelError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:
        message = str(exc).replace("device_memory is required", "--device-memory is required")
        raise CliError(message) from None
    if args.json:
        print(rows_json(pm, request, rows, device_memory, args.device_kind, args.h2d_bandwidth))
    else:
        print(describe_plan(pm, request, device_memory, args.device_kind, args.h2d_bandwidth))
        if host_budget is not None:
            print(f"host: {human_bytes(host_memory)}, budget {human_bytes(host_budget)} "
                  f"({host_budget} bytes); disk {args.disk_bandwidth / 1e9:g} GB/s\n")
        print(format_plan(rows))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .cli_args import check_serve_args

    check_serve_args(args)
    if args.ray:
        try:
            from .server.ray_serve import serve_ray
        except ImportError as exc:
            raise CliError(
                f"--ray needs Ray Serve, which is not installed ({exc}); install it with "
                "pip install 'diffusion_offload[ray]'"
            ) from None
        return serve_ray(args)
    from .server.app import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``diffusion-offload``; returns the exit status (0 ok, 1 the model
    failed while running, 2 a bad input, 130 interrupted)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad flag (already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "make-tiny":
            return _make_tiny(args)
        if args.command == "plan":
            return _plan(args)
        return _serve(args)
    except CliError as exc:
        print(f"diffusion-offload: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("diffusion-offload: interrupted (no output written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
