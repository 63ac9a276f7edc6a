"""The command line's parser and the parsing shared by ``generate`` and ``serve``.

This module imports neither torch nor diffusers, so ``--help``, ``--version`` and a bad
flag or config answer at once. Both :mod:`diffusion_offload.cli` and
:mod:`diffusion_offload.server.app` import from here (never from each other).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from .units import human_bytes, parse_bytes

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "CliError",
    "build_parser",
    "check_lora_args",
    "check_serve_args",
    "parse_config_args",
    "read_config_arg",
    "version",
]

EXIT_USAGE = 2
EXIT_FAILURE = 1

DEFAULT_PROMPT = "a red fox running through fresh snow"

_TINY_KINDS = ("wan2.1", "wan2.2", "wan2.2-i2v", "flux", "sd3", "qwen-image")  # testing.tiny_pipelines.KINDS


class CliError(Exception):
    """A user error: printed as one line ``diffusion-offload: error: ...``, exit status 2
    (or ``status``)."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def version() -> str:
    """The installed package version (``diffusion_offload.__version__`` as a fallback)."""
    try:
        from importlib.metadata import version as _v

        return _v("diffusion_offload")
    except Exception:  # not installed (a source checkout on sys.path)
        from . import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as one line ``diffusion-offload: error: --flag: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (\S+?)(/\S+)?: ", r"\1: ", message)
        print(f"diffusion-offload: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _int(flag: str, minimum: int | None = None, maximum: int | None = None):
    """An argparse ``type`` for an int in ``[minimum, maximum]``, with an error naming it."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if minimum is not None and value < minimum:
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        if maximum is not None and value > maximum:
            bound = f"<= {maximum}" if minimum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def _float(minimum: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not value >= minimum or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def _bytes_type(text: str) -> int:
    """A size flag's value: a number with a unit (a bare number is refused: ``24`` is far
    more likely 24 GiB than 24 bytes)."""
    if re.fullmatch(r"\s*\d+(\.\d+)?\s*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit; give a unit, e.g. 24GiB (B, KiB, MiB, GiB, TiB, or kB, MB, "
            "GB, TB)"
        )
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_bytes_type.__name__ = "size"


def _budget_type(text: str) -> int | str:
    """``--device-memory-budget``, ``--host-memory-budget``: ``auto`` or a size."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _bytes_type(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or auto") from None


_budget_type.__name__ = "size or auto"


def _lora_type(text: str) -> tuple[str, float]:
    """``--lora PATH[:SCALE]``: a LoRA file, folder or hub id and its scale (default 1)."""
    path, sep, scale_text = text.rpartition(":")
    scale = 1.0
    if sep:
        try:
            scale = float(scale_text)
        except ValueError:  # a colon inside the path itself
            path = text
        else:
            if scale != scale or scale in (float("inf"), float("-inf")):
                raise argparse.ArgumentTypeError(f"the scale of {text!r} must be a finite number")
    else:
        path = text
    if not path.strip():
        raise argparse.ArgumentTypeError(f"must be PATH[:SCALE], e.g. style.safetensors:0.8, got {text!r}")
    looks_local = path.endswith(".safetensors") or path.startswith((".", "/", "~"))
    if looks_local and not Path(path).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{path!r} does not exist (give a LoRA file, folder or hub id)")
    return str(Path(path).expanduser()) if looks_local else path, scale


_lora_type.__name__ = "PATH[:SCALE]"


def check_lora_args(args: argparse.Namespace) -> None:
    """``--lora`` needs peft (diffusers' LoRA loading uses it).

    Raises:
        CliError: ``--lora`` given and peft not installed (names the ``lora`` extra).
    """
    if getattr(args, "lora", None):
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise CliError(f"--lora {args.lora[0][0]} needs peft, which is not installed; install "
                           "it with pip install 'diffusion_offload[lora]'")


def _autoscale_type(text: str) -> tuple[int, int]:
    """``MIN:MAX`` generator replicas, ``1 <= MIN <= MAX``."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    low, high = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if match is None or not 1 <= low <= high:
        raise argparse.ArgumentTypeError(
            f"must be MIN:MAX generator replicas with 1 <= MIN <= MAX, e.g. 1:4, got {text!r}"
        )
    return low, high


_autoscale_type.__name__ = "MIN:MAX"


def check_serve_args(args: argparse.Namespace) -> None:
    """Checks of ``serve``'s Ray flags that argparse cannot express.

    Raises:
        CliError: ``--replicas``/``--autoscale``/``--ray-address``/``--ingress-replicas``
            without ``--ray``; a connection flag (``--max-connections``, ``--timeout-*``)
            with ``--ray``; ``--replicas`` with ``--autoscale``; ``--device cuda:N``
            with ``--ray`` (each replica gets its own GPU as ``cuda``).
    """
    ray_flags = [
        (flag, value)
        for flag, value in (
            ("--replicas", getattr(args, "replicas", None)),
            ("--autoscale", getattr(args, "autoscale", None)),
            ("--ray-address", getattr(args, "ray_address", None)),
            ("--ingress-replicas", getattr(args, "ingress_replicas", None)),
        )
        if value is not None
    ]
    if getattr(args, "ray", False) and (getattr(args, "extra_models", None) or getattr(args, "models_file", None)):
        raise CliError("--ray serves one model (MODEL); several models (--model, --models) run in "
                       "plain serve for now; drop --ray or give one MODEL")
    if getattr(args, "ray", False) and getattr(args, "model", None) is None:
        raise CliError("serve --ray needs MODEL (a pipeline directory or hub id)")
    if getattr(args, "ray", False):
        for flag in ("--max-connections", "--timeout-keep-alive", "--timeout-headers", "--timeout-body"):
            value = getattr(args, flag[2:].replace("-", "_"), None)
            if value is not None:
                raise CliError(
                    f"{flag} {value:g} applies to plain serve only: under --ray, Ray Serve's "
                    "HTTP proxy holds the connections; drop the flag or --ray"
                )
    if not getattr(args, "ray", False):
        if ray_flags:
            flag, value = ray_flags[0]
            shown = ":".join(map(str, value)) if isinstance(value, tuple) else value
            raise CliError(
                f"{flag} {shown} needs --ray (plain serve runs one pipeline in one process); "
                f"add --ray to run replicas on Ray Serve"
            )
        return
    if args.replicas is not None and args.autoscale is not None:
        raise CliError(
            f"--replicas {args.replicas} and --autoscale {args.autoscale[0]}:{args.autoscale[1]} "
            "are mutually exclusive: give a fixed count (--replicas N) or a range "
            "(--autoscale MIN:MAX), not both"
        )
    device = (args.device or "").strip().lower()
    if re.fullmatch(r"cuda:\d+", device):
        raise CliError(
            f"--device {args.device} with --ray: Ray gives each generator replica its own GPU, "
            "seen as cuda; use --device cuda (or omit --device)"
        )


def read_config_arg(text: str | None) -> Any:
    """The JSON object of ``--diffusion-offload-config`` (inline JSON or ``@FILE``), or None.

    Raises:
        CliError: unreadable file, invalid JSON, a repeated key, or not a JSON object.
    """
    if text is None:
        return None
    from .core.config import reject_duplicate_keys

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
    """The validated config from ``--diffusion-offload-config`` / ``--enable-cpu-offload``.

    Returns:
        A ``DiffusionOffloadConfig``, None (no offload), or the string ``"auto"`` (the
        planner picks the config when the engine is built).

    Raises:
        CliError: the config is not valid (the message names the flag and the field), or
            ``--device-memory-budget`` or ``--host-memory-budget`` is given without an
            offload config.
    """
    from .core.config import parse_diffusion_offload_config

    if args.diffusion_offload_config == "auto":
        if args.enable_cpu_offload:
            raise CliError("--diffusion-offload-config auto cannot be combined with "
                           "--enable-cpu-offload; give one of them")
        return "auto"
    raw = read_config_arg(args.diffusion_offload_config)
    try:
        config = parse_diffusion_offload_config(raw, enable_cpu_offload=args.enable_cpu_offload)
    except (TypeError, ValueError) as exc:
        raise CliError(f"--diffusion-offload-config: {exc}") from None
    budget = getattr(args, "device_memory_budget", None)
    if budget is not None:
        shown = budget if budget == "auto" else human_bytes(budget).replace(" ", "")
        if config is None:
            raise CliError(
                f"--device-memory-budget {shown} needs an offload config (without "
                "one everything stays on the device); add --diffusion-offload-config "
                "'{\"mode\":\"module\",\"components\":[\"dit\",\"text_encoder\"]}' (or auto), or drop it"
            )
    host = getattr(args, "host_memory_budget", None)
    if host is not None and config is None:
        shown = host if host == "auto" else human_bytes(host).replace(" ", "")
        raise CliError(
            f"--host-memory-budget {shown} needs an offload config (without one no host "
            "copies are made); add --diffusion-offload-config (or auto), or drop it"
        )
    return config


# ---------------------------------------------------------------------- the parser

SERVER_FIELDS = """\
request fields (an omitted or null field takes the server's default; limits apply to
the resolved value; a field that is neither below nor a pipeline knob answers 400):

POST /v1/images/generations (application/json):
  prompt               text, required, 1-32000 characters (the tokenizer truncates)
  model                must be the served model's id (optional)
  n                    images, 1-10 (default 1)
  size                 "WIDTHxHEIGHT" or "auto" (default: the model's; 32x32 for a
                       make-tiny model); width*height <= --max-pixels, each side a
                       multiple of the model's size multiple (VAE scale x patch size)
  width, height        instead of size (a size that disagrees is a 400)
  response_format      "b64_json" (default); "url": a link to GET
                       /v1/images/{id}/{i}.{format} here (same key), kept --job-ttl s;
                       "file": the image bytes themselves (n = 1)
  output_format        png (default), jpeg or webp
  output_compression   0-100: the JPEG/WebP quality (default 100; PNG ignores it)
  background           auto or opaque ("transparent" is a 400: opaque images only)
  negative_prompt      text (default none); on FLUX it needs true_cfg_scale > 1,
                       which defaults to 4.0 when a negative prompt is given
  num_inference_steps  1 to --max-steps (default: the model's; 2 for a make-tiny model)
  guidance_scale       0-1000 (default: the pipeline's)
  flow_shift           0-1000, the scheduler's shift for this request
  boundary_ratio       0-1, Wan2.2's expert switch for this request
  seed                 0 to 2**62 (default: random); image i uses seed + i
  extra_params         an object of further pipeline knobs
  quality, style, moderation, safety_identifier, user, partial_images (0)
                       accepted and ignored; stream true is a 400
  pipeline knobs       every other argument of the pipeline's __call__ that JSON can
                       carry (true_cfg_scale, max_sequence_length, sigmas...): numbers
                       0-1000 (ints 0-4096, fractions 0-1), strings up to 32000
                       characters, lists up to --max-steps + 1 items; what the server
                       sets (output_type, generator, callbacks, num_images_per_prompt:
                       use n, latents, prompt_embeds...) is a 400 naming it

POST /v1/videos (application/json, multipart/form-data or x-www-form-urlencoded):
  prompt, model, size, width, height, negative_prompt, num_inference_steps,
  guidance_scale, flow_shift, boundary_ratio, seed, extra_params, knobs  as above
  seconds              OpenAI's duration: converted to frames at fps and rounded to
                       a frame count the model accepts (Wan: 4k+1); echoed as given
  num_frames           1 to --max-frames (default: the model's; 5 for a make-tiny
                       model); give seconds or num_frames, not both
  fps                  1-240 (default 16)
  guidance_scale_2     0-1000, the low-noise expert's guidance (Wan2.2; default the
                       pipeline's)
"""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diffusion-offload-config", metavar="JSON_OR_@FILE",
                   help='offload config as JSON or @FILE, e.g. '
                        '\'{"mode":"module","components":["dit","text_encoder"]}\', or auto: '
                        "the fastest candidate of 'diffusion-offload plan' that fits the device "
                        "(default: none, everything on the device)")
    p.add_argument("--enable-cpu-offload", action="store_true",
                   help="legacy switch: model-level offload of every DiT and encoder (default: off)")
    p.add_argument("--device",
                   help="cuda[:N], xpu, npu, mps, fakegpu (the CPU-backed test accelerator) or cpu "
                        "(default: the first accelerator found, else cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight dtype (default: auto, the checkpoint's own)")
    p.add_argument("--variant", metavar="NAME",
                   help="weight file variant to load, e.g. fp16 for *.fp16.safetensors, as "
                        "diffusers' variant= (default: none, the plain weight files)")
    p.add_argument("--max-pinned-memory", metavar="SIZE", type=_bytes_type,
                   help="cap on pinned host memory for host copies; the rest stays pageable "
                        "(with a unit: e.g. 40GiB, 512MiB, 1000000B; default: no cap)")
    p.add_argument("--device-memory-budget", metavar="SIZE|auto", type=_budget_type,
                   help="keep weights resident while they fit in SIZE bytes of device memory "
                        "(e.g. 70GiB), or auto: free memory minus a reserve of max(10%%, 1 GiB) "
                        "for activations; module mode keeps whole components (the next stage "
                        "is prefetched when it fits), layer mode keeps streamed blocks beyond "
                        "the trunks (default: module mode's strict rule, only the running "
                        "group on the device; layer mode's trunks and two blocks)")
    p.add_argument("--host-memory-budget", metavar="SIZE|auto", type=_budget_type,
                   help="host memory the offload's host copies may take (pinned, then "
                        "pageable, and the staging ring), e.g. 24GiB, or auto: min(MemAvailable, "
                        "cgroup limit - usage) minus a reserve of min(10%%, 2 GiB); weights that do "
                        "not fit stay on disk, memory-mapped from their safetensors files and read "
                        "at every load (default: no budget, every host copy in RAM)")
    p.add_argument("--page-cache", choices=("auto", "drop", "keep"), default=None,
                   help="with --host-memory-budget: drop the file pages a disk-backed load "
                        "read once it copied them (a container's memory limit counts page "
                        "cache), or keep them; auto (the default) drops under a cgroup memory "
                        "limit")
    p.add_argument("--lora", metavar="PATH[:SCALE]", type=_lora_type, action="append",
                   help="a LoRA (.safetensors file, folder or hub id) loaded with diffusers' "
                        "load_lora_weights after offload is enabled, at SCALE (default 1); "
                        "repeat for several, all active together (needs peft: pip install "
                        "'diffusion_offload[lora]'; default: none)")


_DEVICE_KINDS = ("cuda", "xpu", "npu", "mps", "fakegpu", "cpu")  # planner.memory.DEVICE_KINDS


def _bandwidth_type(text: str) -> float:
    """``--h2d-bandwidth``: a size per second (``55GB/s``, ``25e9``, ``12GiB/s``) in bytes/s."""
    value = str(text).strip()
    if value.lower().endswith("/s"):
        value = value[:-2]
    try:
        number = float(value)
    except ValueError:
        try:
            number = float(parse_bytes(value))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a bandwidth; use bytes per second with a unit, e.g. 55GB/s, "
                "25GiB/s or 25e9"
            ) from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a bandwidth > 0 bytes/s, got {text!r}")
    return number


_bandwidth_type.__name__ = "bandwidth"


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="predict memory and transfer cost of each offload config, loading no weight",
        description="Predict, for each offload candidate (all resident, module mode, module mode "
                    "with a memory budget, layer mode), the resting and peak device memory and the "
                    "host-to-device "
                    "bytes and seconds per request, from the safetensors headers and one request "
                    "replayed on the meta device. No weight is read or downloaded. The fastest "
                    "candidate that fits is marked: it is what --diffusion-offload-config auto "
                    "picks.",
    )
    plan.add_argument("model", help="pipeline directory, hub id in the local Hugging Face cache, or "
                                    "the hub id of a shipped weightless config (required)")
    plan.add_argument("--device-memory", metavar="SIZE", type=_bytes_type,
                      help="memory the device may allocate, with a unit: e.g. 24GiB, 80GB (default: the "
                           "total memory of this machine's --device-kind device)")
    plan.add_argument("--device-kind", choices=_DEVICE_KINDS, default="cuda",
                      help="picks the attention memory model: cuda/xpu/npu/cpu fused kernels "
                           "(no score matrix), fakegpu/mps the math kernel (default: cuda)")
    plan.add_argument("--height", type=_int("--height", 1), metavar="PIXELS",
                      help="output height (default: the model's)")
    plan.add_argument("--width", type=_int("--width", 1), metavar="PIXELS",
                      help="output width (default: the model's)")
    plan.add_argument("--num-frames", type=_int("--num-frames", 1), metavar="N",
                      help="frames of a video (default: the model's)")
    plan.add_argument("--steps", type=_int("--steps", 1), metavar="N",
                      help="denoising steps (default: the model's)")
    plan.add_argument("--h2d-bandwidth", type=_bandwidth_type, metavar="RATE", default=25e9,
                      help="host-to-device bandwidth, e.g. 55GB/s (default: 25GB/s, pinned "
                           "copies over PCIe 4.0 x16)")
    plan.add_argument("--host-memory", metavar="SIZE", type=_bytes_type,
                      help="host memory the process has, with a unit, e.g. 32GiB: plans the "
                           "host copies under the budget 'auto' would take from it (minus a "
                           "tenth, at most 2 GiB), in pinned, pageable and disk tiers "
                           "(default: no host budget, every host copy pinned)")
    plan.add_argument("--disk-bandwidth", type=_bandwidth_type, metavar="RATE", default=3e9,
                      help="disk read bandwidth for disk-backed weights, e.g. 7GB/s "
                           "(default: 3GB/s, an NVMe SSD)")
    plan.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                      help="weight dtype (default: auto, the checkpoint's own)")
    plan.add_argument("--variant", metavar="NAME",
                      help="weight file variant, as for generate (default: the plain files)")
    plan.add_argument("--weights-dtype", metavar="FORMAT|KEY=FORMAT,...",
                      help="size the weights as quantized or cast at load: one format for every "
                           "DiT and text encoder (fp8, int8, nf4, int4, bf16, fp16, fp32), or per "
                           "role or component, e.g. dit=fp8,text_encoder=bf16 (default: as stored; "
                           "a component's quantization_config is honoured)")
    plan.add_argument("--json", action="store_true",
                      help="print the rows as JSON instead of a table (default: table)")


def build_parser() -> argparse.ArgumentParser:
    """The ``diffusion-offload`` parser: ``generate``, ``serve``, ``plan``, ``make-tiny``."""
    parser = _Parser(
        prog="diffusion-offload",
        description="Run diffusion pipelines larger than one accelerator by model-level offload.",
    )
    parser.add_argument("--version", action="version", version=f"diffusion-offload {version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    gen = sub.add_parser(
        "generate", help="generate an image or a video",
        description="Generate one image or video and print a summary table.",
    )
    gen.add_argument("--model", help="pipeline directory or hub id "
                                      "(default: the embedded tiny Wan2.2, built on first use)")
    gen.add_argument("--prompt", help=f"the text prompt (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--negative-prompt", help="what to avoid (default: none)")
    gen.add_argument("--image", metavar="PATH",
                     help="an image to edit (PNG, JPEG or WebP): image-to-image with the "
                          "model's variant, or the model itself for edit and image-to-video "
                          "models; --param strength=0.8 sets how much changes (default: none, "
                          "text to image or video)")
    gen.add_argument("--mask", metavar="PATH",
                     help="with --image: inpaint where the mask is white (default: none, "
                          "the whole image is edited)")
    gen.add_argument("--output", metavar="FILE",
                     help=".png for image models, .mp4 or .gif for video models "
                          "(default: output.mp4 or output.png)")
    gen.add_argument("--overwrite", action="store_true",
                     help="replace existing --output/--report/--trace files (default: refuse)")
    _add_engine_args(gen)
    gen.add_argument("--steps", type=_int("--steps", 1), metavar="N",
                     help="denoising steps (default: the model's; 2 for a make-tiny model)")
    gen.add_argument("--seed", type=_int("--seed", 0, 2**63 - 1), metavar="N",
                     help="seed of the CPU generator (default: 0)")
    gen.add_argument("--height", type=_int("--height", 1), metavar="PIXELS",
                     help="output height (default: the model's; 32 for a make-tiny model)")
    gen.add_argument("--width", type=_int("--width", 1), metavar="PIXELS",
                     help="output width (default: the model's; 32 for a make-tiny model)")
    gen.add_argument("--num-frames", type=_int("--num-frames", 1), metavar="N",
                     help="frames of a video (default: the model's; 5 for a make-tiny model)")
    gen.add_argument("--guidance-scale", type=_float(0.0), metavar="SCALE",
                     help="classifier-free guidance scale (default: the pipeline's)")
    gen.add_argument("--param", action="append", metavar="NAME=VALUE", default=None,
                     help="a pipeline knob by name, repeatable: any JSON-valued argument of "
                          "the pipeline's __call__ (true_cfg_scale=4, max_sequence_length=256, "
                          "sigmas=[1.0,0.5]), or flow_shift / boundary_ratio / guidance_scale_2; "
                          "checked as serve checks request fields (default: none, the "
                          "pipeline's own defaults)")
    gen.add_argument("--fps", type=_int("--fps", 1, 240), metavar="N",
                     help="frames per second of the written video (default: 16)")
    gen.add_argument("--report", metavar="FILE.json",
                     help="write a JSON report: the full request, timings, memory, transfers "
                          "(default: none)")
    gen.add_argument("--trace", metavar="FILE.json",
                     help="write a Chrome trace, opens in Perfetto (default: none)")
    gen.add_argument("--from-report", metavar="FILE.json",
                     help="repeat the request recorded in a --report file; flags given here "
                          "override it (default: none)")

    srv = sub.add_parser(
        "serve", help="serve the model over an OpenAI-style HTTP API",
        description="Serve one model, or several sharing one device (--model repeated, or "
                    "--models FILE): OpenAI-style images API, async video jobs, /metrics.",
        epilog=SERVER_FIELDS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    srv.add_argument("model", nargs="?", help="pipeline directory or hub id of the one model served "
                                              "(required unless --model or --models is given)")
    srv.add_argument("--model", dest="extra_models", action="append", default=[], metavar="[ID=]PATH",
                     help="a model to serve (repeatable): requests name it by ID (default: PATH as "
                          "given); several models share the device, one awake at a time "
                          "(default: none)")
    srv.add_argument("--idle-release", type=_float(0.001), metavar="SECONDS",
                     help="after this long without a job, evict every model to the host (no "
                          "device-to-host copy of an unmodified weight); the next request wakes it "
                          "(default: never)")
    srv.add_argument("--max-reorder", type=_int("--max-reorder", 0), metavar="K",
                     help="with several models, a waiting job of the model that ran last may run "
                          "before older ones (a swap saved), passing each over at most K times; 0: "
                          "first in, first out (default: 4)")
    srv.add_argument("--models", dest="models_file", metavar="FILE",
                     help="models to serve, a TOML ([[models]] tables) or JSON list of entries with "
                          "id, path and optionally config, variant, dtype, loras (default: none)")
    srv.add_argument("--omni", action="store_true",
                     help="accepted for vLLM-Omni command-line compatibility (default: off)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    srv.add_argument("--port", type=_int("--port", 0, 65535), default=8000,
                     help="port to bind, 0 picks a free one (default: 8000)")
    _add_engine_args(srv)
    srv.add_argument("--api-key",
                     help="require 'Authorization: Bearer KEY' on /v1/* (printable ASCII; "
                          "default: no key)")
    srv.add_argument("--allowed-origins", metavar="ORIGIN[,ORIGIN...]", default="",
                     help="browser origins (scheme://host[:port]) allowed to call the API besides "
                          "the server's own, comma-separated (default: none)")
    srv.add_argument("--allowed-hosts", metavar="HOST[,HOST...]", default="",
                     help="Host header names accepted besides the bound address and localhost "
                          "when bound to loopback, comma-separated (default: none)")
    srv.add_argument("--max-queue", type=_int("--max-queue", 1), default=32,
                     help="waiting jobs before 429 (default: 32)")
    srv.add_argument("--max-pixels", type=_int("--max-pixels", 1), default=2_097_152,
                     help="largest width*height a request may resolve to (default: 2097152, "
                          "2 MP: OpenAI's 1792x1024 fits, 2048x2048 does not)")
    srv.add_argument("--max-frames", type=_int("--max-frames", 1), default=None,
                     help="largest num_frames of a video job (default: 12 s at 16 fps in "
                          "frames the model accepts, 193 for Wan)")
    srv.add_argument("--max-steps", type=_int("--max-steps", 1), default=100,
                     help="largest num_inference_steps (default: 100)")
    srv.add_argument("--max-body-bytes", type=_int("--max-body-bytes", 1), default=1048576,
                     help="largest request body in bytes, else 413 (default: 1048576)")
    srv.add_argument("--shutdown-grace", type=_float(0.0), default=30.0,
                     help="seconds the running job may finish after SIGINT/SIGTERM; then it is "
                          "marked failed and serve exits within a second; a second signal "
                          "exits at once (default: 30)")
    conn = srv.add_argument_group(
        "connections", "Slow and idle clients are cut off; open connections are bounded.")
    conn.add_argument("--max-connections", type=_int("--max-connections", 1), metavar="N",
                      help="most open client connections; beyond it the connection waiting "
                           "longest for a request is closed, or, when all have a request in "
                           "flight, the new one gets 503 (default: 1000, or ulimit -n minus 64 "
                           "when that is less)")
    conn.add_argument("--timeout-keep-alive", type=_float(0.001), metavar="SECONDS",
                      help="close a connection idle this long between requests (default: 5)")
    conn.add_argument("--timeout-headers", type=_float(0.001), metavar="SECONDS",
                      help="the request line and headers must arrive within this from the "
                           "connection opening or the previous response, else 408 and close "
                           "(default: 10)")
    conn.add_argument("--timeout-body", type=_float(0.001), metavar="SECONDS",
                      help="the request body must arrive within this after its headers, else "
                           "408 and close (default: 30)")
    srv.add_argument("--job-ttl", type=_float(0.0), default=3600.0,
                     help="seconds a finished video job is kept before it expires (default: 3600)")
    srv.add_argument("--max-stored-jobs", type=_int("--max-stored-jobs", 1), default=100,
                     help="most video jobs kept; the oldest finished ones are dropped first "
                          "(default: 100)")
    ray_group = srv.add_argument_group(
        "Ray Serve (pip install 'diffusion_offload[ray]')",
        "Scale out: one generator replica per accelerator, shared job state, the same API.",
    )
    ray_group.add_argument("--ray", action="store_true",
                           help="serve on Ray Serve instead of one process (default: off)")
    ray_group.add_argument("--replicas", type=_int("--replicas", 1), metavar="N",
                           help="generator replicas, one per accelerator (needs --ray; default: "
                                "one per GPU in the cluster, else 1)")
    ray_group.add_argument("--autoscale", type=_autoscale_type, metavar="MIN:MAX",
                           help="scale generator replicas from MIN to MAX with the queue length "
                                "(needs --ray; not with --replicas; default: fixed --replicas)")
    ray_group.add_argument("--ray-address", metavar="ADDRESS",
                           help="an existing Ray cluster, e.g. ray://head:10001 or auto (needs "
                                "--ray; default: start a local cluster on this machine)")
    ray_group.add_argument("--ingress-replicas", type=_int("--ingress-replicas", 1), metavar="N",
                           help="HTTP ingress replicas; any of them serves any job (needs --ray; "
                                "default: 1)")

    _add_plan_parser(sub)

    tiny = sub.add_parser(
        "make-tiny", help="write a tiny random-weight pipeline in diffusers format",
        description="Write a tiny random-weight pipeline (seconds to build, for trying things out).",
    )
    tiny.add_argument("kind", choices=_TINY_KINDS, help=f"one of {', '.join(_TINY_KINDS)} (required)")
    tiny.add_argument("dir", help="a new or empty folder (required)")
    tiny.add_argument("--seed", type=_int("--seed", 0, 2**63 - 1), default=0,
                      help="weights are a pure function of kind, seed and --num-layers (default: 0)")
    tiny.add_argument("--num-layers", type=_int("--num-layers", 1, 1000), default=None, metavar="N",
                      help="give every DiT N blocks, 1 to 1000 (Flux: N double and N single), for "
                           "trying layer-wise offload; text encoders keep theirs (default: "
                           "the tiny models' own depths, 1 to 2 blocks)")
    tiny.add_argument("--overwrite", action="store_true",
                      help="replace the folder if make-tiny wrote it earlier; never another "
                           "folder (default: refuse any non-empty folder)")
    return parser


def quiet_libraries(heavy: bool = True) -> None:
    """Silence library chatter that does not concern the user, the same way in every command:
    transformers/diffusers/huggingface_hub warnings below error level, their loading and
    saving progress bars, and Python warnings raised inside those libraries and torch.
    The quantization backends diffusers imports when they are installed log at import
    (torchao: its CUDA-only extensions it could not load, "no triton"; bitsandbytes: its
    optional ``kernels`` package, which bitsandbytes 0.50 asks for a CPU kernel at import on
    AVX512-BF16 hosts, and ``kernels`` >= 0.19 itself: "Skipping publisher trust check ..."
    offline; torch's pytree: torchao's enums registered with it):
    their loggers are set to error level too, without importing them.

    Environment variables are set first (``setdefault``, so a user's own choice wins) so
    that libraries imported later start quiet; with ``heavy`` (the command is about to
    load a model anyway) diffusers' and transformers' own switches are set too, which
    imports them. The pipeline's denoising progress bar is not a loading bar and stays.
    """
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for module in ("diffusers", "transformers", "torch", "huggingface_hub", "accelerate", "torchvision"):
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    for name in ("diffusers", "transformers", "huggingface_hub", "accelerate", "torchao",
                 "bitsandbytes", "kernels", "optimum.quanto", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if heavy:
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
