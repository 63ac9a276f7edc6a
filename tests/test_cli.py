"""``diffusion-offload generate`` / ``make-tiny`` through the real CLI in subprocesses
(issue 4 "Must show", CLI part).

Every bad input must exit with status 2, print exactly one line on stderr,
``diffusion-offload: error: ...``, naming the problem, and write nothing: each case runs
in its own empty working folder with ``--output``, ``--report`` and ``--trace`` pointing
into it (or defaulting to it), and the folder must still be empty afterwards.

Each CLI start costs seconds of imports, so all the processes of this module are started
up front, a few at a time (one per CPU), and the tests check their results.
"""

from __future__ import annotations

import json
import os
import shutil
import dataclasses
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from diffusion_offload.core.config import parse_diffusion_offload_config
from diffusion_offload.core.stats import TransferStats
from diffusion_offload.models.fit import footprint
from diffusion_offload.models.files import inspect_model
from diffusion_offload.testing import tiny_pipelines

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}
FULL_JSON = json.dumps(FULL)
PREFIX = "diffusion-offload: error: "
TIMEOUT = 600


@dataclass
class Case:
    """One CLI run: ``argv`` after the program name, with ``{out}`` (the run's own empty
    folder, also its working folder) and ``{root}`` (shared inputs) filled in."""

    argv: list[str]
    expect: list[str] = field(default_factory=list)  # substrings of the error line
    env: dict[str, str] = field(default_factory=dict)
    entry_point: bool = False  # run the ``diffusion-offload`` console script


def _can_create_in(folder: Path) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _read_only_folder(root: Path, cleanups: list) -> Path | None:
    """A folder where no file can be created, also for root (for whom mode bits do not count)."""
    folder = root / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    cleanups.append(lambda: folder.chmod(0o755))
    if not _can_create_in(folder):
        return folder
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        cleanups.insert(0, lambda: subprocess.run(["chattr", "-i", str(folder)], capture_output=True))
        if not _can_create_in(folder):
            return folder
    for candidate in (Path("/sys"), Path("/proc")):
        if candidate.is_dir() and not _can_create_in(candidate):
            return candidate
    return None


def _write_index(folder: Path, spec: object) -> Path:
    folder.mkdir()
    (folder / "model_index.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
    return folder


def _bad_cases(root: Path, read_only: Path | None, need_full: int) -> dict[str, Case]:
    flux = ["--model", "{root}/flux"]
    out_png = ["--output", "{out}/out.png", "--report", "{out}/report.json", "--trace", "{out}/trace.json"]
    cases = {
        "missing_directory": Case(
            ["--model", "{root}/no-such-model-dir", *out_png], ["'{root}/no-such-model-dir'", "not an existing directory"]
        ),
        "unknown_hub_id_offline": Case(
            ["--model", "nobody-org/no-such-model", *out_png],
            ["'nobody-org/no-such-model'", "not found in the local Hugging Face cache", "HF_HUB_OFFLINE=1"],
        ),
        "not_a_diffusers_pipeline": Case(
            ["--model", "{root}/not-a-pipeline", *out_png], ["not a diffusers pipeline", "no model_index.json"]
        ),
        "unsupported_class_without_prompt": Case(
            ["--model", "{root}/svd", *out_png], ["'StableVideoDiffusionPipeline' is not supported"]
        ),
        "invalid_json_config": Case(
            [*flux, "--diffusion-offload-config", '{"mode": "module",', *out_png],
            ["--diffusion-offload-config is not valid JSON"],
        ),
        "invalid_config": Case(
            [*flux, "--diffusion-offload-config", '{"mode": "module", "components": ["vae"]}', *out_png],
            ["--diffusion-offload-config", "'vae'"],
        ),
        "output_folder_missing": Case(
            [*flux, "--output", "{out}/missing/out.png", "--report", "{out}/report.json"],
            ["--output", "'{out}/missing/out.png'", "does not exist"],
        ),
        "unknown_output_extension": Case(
            [*flux, "--output", "{out}/out.jpg", "--report", "{out}/report.json"],
            ["--output", "out.jpg' must end in .png or .mp4 or .gif"]
        ),
        "video_extension_for_image_model": Case(
            [*flux, "--output", "{out}/out.mp4", "--report", "{out}/report.json"], ["produces an image", ".png"]
        ),
        "image_extension_for_video_model": Case(  # the embedded default (Wan2.2) makes videos
            ["--output", "{out}/out.png", "--report", "{out}/report.json"], ["produces a video", ".mp4"]
        ),
        # no offload needs more than is free; the full config fits at rest, but the planner
        # predicts its peak (activations included) does not: the advice is the planner's
        "config_does_not_fit": Case(
            [*flux, "--device", "fakegpu", *out_png],
            ["model does not fit", "config no offload needs", f"only {need_full} bytes are free",
             "the planner predicts that no candidate fits", "the smallest need is"],
            env={"DIFFUSION_OFFLOAD_FAKE_CAPACITY": str(need_full)},
        ),
        "bad_dtype": Case([*flux, "--dtype", "float64", *out_png], ["--dtype", "'float64'"]),
        "num_frames_for_image_model": Case(
            [*flux, "--num-frames", "5", *out_png], ["--num-frames", "FluxPipeline makes images"]
        ),
        "config_json_string": Case(
            [*flux, "--diffusion-offload-config", '"module"', *out_png], ["must be a JSON object", "'module'"]
        ),
        "config_duplicate_key": Case(
            [*flux, "--diffusion-offload-config",
             '{"mode": "module", "mode": "layer", "components": ["dit"]}', *out_png],
            ["repeats key 'mode'"],
        ),
        "config_file_is_a_folder": Case(
            [*flux, "--diffusion-offload-config", "@{root}", *out_png], ["is a folder"]
        ),
        "report_and_trace_same_file": Case(
            [*flux, "--output", "{out}/out.png", "--report", "{out}/x.json", "--trace", "{out}/x.json"],
            ["--report and --trace name the same file"],
        ),
        "seed_too_large": Case(
            [*flux, "--seed", str(2**64), *out_png],
            [f"--seed: must be an integer from 0 to {2**63 - 1}, got '{2**64}'"],
        ),
        "device_not_available": Case([*flux, "--device", "cuda", *out_png], ["'cuda' is not available"]),
        "height_not_a_multiple": Case(  # checked from the model's config files, before it loads
            ["--device", "cpu", "--height", "33", "--output", "{out}/out.mp4"],
            ["--height 33 is not allowed by WanPipeline: it must be a multiple of 16", "e.g. 32 or 48"],
        ),
        "width_not_a_multiple_flux": Case(  # tiny Flux: VAE scale 2 x packed 2x2 patches = 4
            [*flux, "--width", "30", *out_png], ["--width 30 is not allowed by FluxPipeline", "multiple of 4"],
        ),
        "steps_negative": Case([*flux, "--steps", "-3", *out_png], ["--steps: must be an integer >= 1, got '-3'"]),
        "fps_zero": Case(["--fps", "0", "--output", "{out}/out.mp4"], ["--fps: must be an integer from 1 to 240"]),
        "output_exists": Case(
            [*flux, "--output", "{root}/existing.png"], ["--output", "existing.png' already exists", "--overwrite"]
        ),
        "report_inside_model_folder": Case(
            [*flux, "--output", "{out}/o.png", "--report", "{root}/flux/transformer/config.json", "--overwrite"],
            ["--report", "is inside the model folder"],
        ),
        "output_inside_model_folder": Case(
            [*flux, "--output", "{root}/flux/new.png"], ["--output", "is inside the model folder"]
        ),
        "truncated_length_prefix": Case(
            ["--model", "{root}/cut-prefix", "--device", "fakegpu", *out_png],
            ["weight file '{root}/cut-prefix/transformer/diffusion_pytorch_model.safetensors' cannot be read: "
             "truncated or corrupt"],
        ),
        "truncated_header": Case(
            ["--model", "{root}/cut-header", "--device", "fakegpu", *out_png],
            ["weight file '{root}/cut-header/transformer/", "truncated or corrupt"],
        ),
        "truncated_data": Case(
            ["--model", "{root}/cut-data", "--device", "fakegpu", *out_png],
            ["weight file '{root}/cut-data/transformer/", "truncated or corrupt"],
        ),
        "variant_missing": Case(
            [*flux, "--variant", "bf16", *out_png], ["variant 'bf16': no weight files of this variant"]
        ),
        "max_pinned_memory_bad_unit": Case(
            [*flux, "--max-pinned-memory", "12XB", *out_png], ["--max-pinned-memory: '12XB' is not a size"]
        ),
        "from_report_missing": Case(
            ["--from-report", "{out}/nothing.json", *out_png], ["--from-report", "does not exist"]
        ),
        "from_report_not_a_report": Case(
            ["--from-report", "{root}/full.json", *out_png], ["--from-report", "is not a diffusion-offload report"]
        ),
        "num_frames_not_allowed": Case(
            ["--device", "cpu", "--num-frames", "2", "--output", "{out}/out.mp4"],
            ["num_frames - 1 must be a multiple of 4"],
        ),
    }
    if read_only is not None:
        cases["output_folder_read_only"] = Case(
            [*flux, "--output", f"{read_only}/out.png"], [f"'{read_only}/out.png' is not writable"]
        )
    return cases


def _good_cases() -> dict[str, Case]:
    return {
        "mp4_embedded_default": Case(  # fresh cache: the default model is built on first use
            [
                "--device", "fakegpu", "--diffusion-offload-config", FULL_JSON,
                "--num-frames", "5", "--height", "32", "--width", "48", "--fps", "8", "--seed", "1",
                "--output", "{out}/video.mp4", "--report", "{out}/report.json", "--trace", "{out}/trace.json",
            ],
            env={"DIFFUSION_OFFLOAD_CACHE": "{out}/cache"},
        ),
        "gif_embedded_default_cpu": Case(
            ["--device", "cpu", "--num-frames", "5", "--fps", "8", "--output", "{out}/anim.gif"]
        ),
        "png_flux": Case(
            [
                "--model", "{root}/flux", "--device", "fakegpu", "--diffusion-offload-config", "@{root}/full.json",
                "--height", "32", "--width", "48", "--steps", "2", "--negative-prompt", "blurry",
                "--output", "{out}/image.png", "--report", "{out}/report.json",
            ]
        ),
    }


def _run(name: str, case: Case, root: Path, out_root: Path, base_env: dict[str, str], command: str) -> dict:
    out = out_root / name
    out.mkdir()

    def fill(text: str) -> str:
        return text.replace("{out}", str(out)).replace("{root}", str(root))

    env = dict(base_env)
    env.update({k: fill(v) for k, v in case.env.items()})
    if case.entry_point and shutil.which("diffusion-offload"):
        program = [shutil.which("diffusion-offload")]
    else:
        program = [sys.executable, "-m", "diffusion_offload.cli"]
    argv = [command, *(fill(a) for a in case.argv)] if command else [fill(a) for a in case.argv]
    start = time.perf_counter()
    proc = subprocess.run(
        program + argv, cwd=out, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    return {
        "out": out, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
        "expect": [fill(e) for e in case.expect], "seconds": time.perf_counter() - start,
    }


class _Results:
    """name -> the finished run's result (waits for it), plus fixed extra values."""

    def __init__(self, futures: dict, extra: dict) -> None:
        self.futures = futures
        self.extra = extra

    def __getitem__(self, name: str):
        if name in self.extra:
            return self.extra[name]
        return self.futures[name].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every CLI run of this module (a few in parallel); name -> result."""
    root = tmp_path_factory.mktemp("cli-inputs")
    out_root = tmp_path_factory.mktemp("cli-runs")
    cleanups: list = []
    tiny_pipelines.save("flux", root / "flux")
    tiny_pipelines.save("wan2.2", root / "cache" / "tiny-wan2.2")  # the embedded default, prebuilt
    (root / "not-a-pipeline").mkdir()
    (root / "not-a-pipeline" / "config.json").write_text("{}")
    _write_index(root / "svd", {"_class_name": "StableVideoDiffusionPipeline", "_diffusers_version": "0.42.0"})
    (root / "full.json").write_text(FULL_JSON)
    data = (root / "flux" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little")
    for name, cut in (("cut-prefix", 4), ("cut-header", 8 + header // 2),
                      ("cut-data", 8 + header + (len(data) - 8 - header) // 2)):
        shutil.copytree(root / "flux", root / name)
        (root / name / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(data[:cut])
    need_full = footprint(inspect_model(root / "flux"), parse_diffusion_offload_config(FULL), 4, True).device_bytes
    read_only = _read_only_folder(root, cleanups)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFUSION_OFFLOAD_", "HF_"))}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "HF_HUB_CACHE": str(root / "hf-home" / "hub"),
        "DIFFUSION_OFFLOAD_CACHE": str(root / "cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    jobs = {f"bad/{n}": ("generate", c) for n, c in _bad_cases(root, read_only, need_full).items()}
    jobs.update({f"good/{n}": ("generate", c) for n, c in _good_cases().items()})
    jobs["oom/flux"] = ("generate", Case(  # the weights fit, the activations do not: refused first
        ["--model", "{root}/flux", "--device", "fakegpu", "--diffusion-offload-config", FULL_JSON,
         "--output", "{out}/out.png", "--report", "{out}/report.json", "--trace", "{out}/trace.json"],
        ["cannot run 32x32: the planner predicts a device peak of", "not even the smallest size fits"],
        env={"DIFFUSION_OFFLOAD_FAKE_CAPACITY": str(need_full + 1024)},
    ))
    jobs["make_tiny/sd3"] = ("make-tiny", Case(["sd3", "{out}/tiny-sd3"], entry_point=True))
    jobs["make_tiny/flux"] = ("make-tiny", Case(["flux", "{out}/tiny-flux"]))
    jobs["make_tiny/bad_kind"] = ("make-tiny", Case(["sdxl", "{out}/tiny-sdxl"], ["invalid choice: 'sdxl'"]))
    precious = root / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    jobs["make_tiny/refuses_foreign_folder"] = ("make-tiny", Case(["flux", str(precious)], ["is not empty", "--overwrite"]))
    jobs["make_tiny/refuses_foreign_folder_with_overwrite"] = (
        "make-tiny", Case(["flux", str(precious), "--overwrite"], ["refusing to replace", "not written by make-tiny"])
    )
    jobs["make_tiny/refuses_own_folder_without_overwrite"] = (
        "make-tiny", Case(["flux", "{root}/flux"], ["is not empty", "--overwrite"])
    )
    shutil.copytree(root / "flux", root / "flux-again")
    jobs["make_tiny/replaces_own_folder_with_overwrite"] = (
        "make-tiny", Case(["sd3", "{root}/flux-again", "--overwrite"])
    )
    (root / "existing.png").write_bytes(b"precious photo")
    (root / "photo.png").write_bytes(b"precious photo")
    jobs["good/overwrite"] = ("generate", Case([
        "--model", "{root}/flux", "--device", "cpu", "--output", "{root}/photo.png", "--overwrite"]))
    variant = shutil.copytree(root / "flux", root / "flux-variant")
    for comp, stem in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                       ("text_encoder", "model"), ("text_encoder_2", "model")):
        shutil.copy(variant / comp / f"{stem}.safetensors", variant / comp / f"{stem}.fp16.safetensors")
    jobs["good/variant"] = ("generate", Case(
        ["--model", "{root}/flux-variant", "--variant", "fp16", "--device", "fakegpu",
         "--diffusion-offload-config", FULL_JSON, "--output", "{out}/v.png", "--report", "{out}/report.json"],
    ))
    # Started in the order the tests read them, a few at a time, while the tests run: each
    # test waits only for its own runs (no single setup holds the whole batch).
    first = [f"bad/{n}" for n in BAD]
    order = [n for n in first if n in jobs] + [n for n in jobs if n not in first]
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    try:
        futures = {
            n: pool.submit(_run, n.replace("/", "-"), jobs[n][1], root, out_root, env, jobs[n][0])
            for n in order
        }
        yield _Results(futures, {"read_only_available": read_only is not None, "inputs": root})
    finally:
        pool.shutdown(wait=True, cancel_futures=False)
        for cleanup in cleanups:
            cleanup()


BAD = [
    "missing_directory", "unknown_hub_id_offline", "not_a_diffusers_pipeline",
    "unsupported_class_without_prompt", "invalid_json_config",
    "invalid_config", "output_folder_missing", "output_folder_read_only", "unknown_output_extension",
    "video_extension_for_image_model", "image_extension_for_video_model", "config_does_not_fit",
    "bad_dtype", "num_frames_for_image_model", "config_json_string", "config_duplicate_key",
    "config_file_is_a_folder", "report_and_trace_same_file", "seed_too_large", "device_not_available",
    "height_not_a_multiple", "num_frames_not_allowed", "width_not_a_multiple_flux", "steps_negative",
    "fps_zero", "output_exists", "report_inside_model_folder", "output_inside_model_folder",
    "truncated_length_prefix", "truncated_header", "truncated_data", "variant_missing",
    "max_pinned_memory_bad_unit", "from_report_missing", "from_report_not_a_report",
]


def _check_one_error_line(result: dict) -> str:
    detail = f"stdout={result['stdout']!r}\nstderr={result['stderr']!r}"
    assert result["returncode"] == 2, detail
    lines = result["stderr"].splitlines()
    assert len(lines) == 1, detail
    assert lines[0].startswith(PREFIX), detail
    for text in result["expect"]:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    assert result["stdout"] == "", detail
    return lines[0]


@pytest.mark.parametrize("name", BAD)
def test_bad_input(runs, name):
    if name == "output_folder_read_only" and not runs["read_only_available"]:
        pytest.skip(
            "this machine has no folder the test user cannot write to (root ignores mode bits, "
            "chattr +i is refused and /sys, /proc accept new files), so the case cannot be set up"
        )
    result = runs[f"bad/{name}"]
    _check_one_error_line(result)
    assert sorted(p.name for p in result["out"].iterdir()) == [], "a bad input wrote files"


def test_out_of_memory_during_the_request(runs):
    """A request whose activations cannot fit: refused before it runs by admission (issue 35
    item 4), one error line naming the predicted peak, status 2, no files."""
    result = runs["oom/flux"]
    assert result["returncode"] == 2, result["stderr"]  # refused input, as the fit check
    assert "Traceback" not in result["stderr"]
    last = result["stderr"].splitlines()[-1]
    assert last.startswith(PREFIX)
    for text in result["expect"]:
        assert text in last
    errors = [line for line in result["stderr"].splitlines() if line.startswith(PREFIX)]
    assert errors == [last]
    assert sorted(p.name for p in result["out"].iterdir()) == []


def test_mp4_report_and_trace(runs):
    import imageio.v2 as imageio

    result = runs["good/mp4_embedded_default"]
    assert result["returncode"] == 0, result["stderr"]
    out = result["out"]
    assert (out / "cache" / "tiny-wan2.2" / "model_index.json").is_file()  # built on first use
    assert "building the embedded tiny Wan2.2 model" in result["stderr"]
    assert not list((out / "cache").glob(".*")), "the atomic build left temporary folders"
    assert sorted(p.name for p in out.iterdir()) == ["cache", "report.json", "trace.json", "video.mp4"]

    video = np.stack(imageio.mimread(out / "video.mp4"))  # imageio-ffmpeg decodes it
    assert video.shape == (5, 32, 48, 3)
    assert video.dtype == np.uint8 and video.std() > 0

    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {
        "model", "pipeline_class", "device", "config", "timings", "peak_device_memory_bytes", "offload_stats",
    }
    assert report["pipeline_class"] == "WanPipeline"
    assert report["model"] == str(out / "cache" / "tiny-wan2.2")
    assert report["device"] == "fakegpu:0"
    assert parse_diffusion_offload_config(report["config"]) == parse_diffusion_offload_config(FULL)
    assert set(report["timings"]) == {"load", "text_encoding", "denoising", "decoding", "total"}
    assert all(v >= 0 for v in report["timings"].values())
    assert report["peak_device_memory_bytes"] > 0
    # the sampled host peak: a Python process with torch loaded holds far more than 10 MiB
    assert set(report["peak_host_memory"]) == {"rss_anon_bytes", "rss_file_bytes"}
    assert all(v > 10 << 20 for v in report["peak_host_memory"].values())
    stats = report["offload_stats"]
    assert set(stats) == {f.name for f in dataclasses.fields(TransferStats)} | {"pinned_total_bytes"}
    assert {"h2d_bytes", "d2h_bytes", "loads", "evictions", "pinned_bytes", "disk_read_bytes"} <= set(stats)
    assert stats["loads"] == 2 and stats["h2d_bytes"] > 0  # transformer, then transformer_2

    trace = json.loads((out / "trace.json").read_text())
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["ph"] in ("X", "M") for e in trace["traceEvents"])
    loads = [e for e in spans if e["name"] == "load"]
    assert len(loads) == stats["loads"]
    assert len([e for e in spans if e["name"] == "evict"]) == stats["evictions"]
    assert {e["cat"] for e in loads} == {"transformer", "transformer_2"}
    assert [e["name"] for e in spans if e["tid"] == 0] == ["text_encoding", "denoising", "decoding"]
    assert len({e["tid"] for e in spans if e["tid"] != 0}) == len({e["cat"] for e in spans if e["tid"] != 0})


def test_gif(runs):
    from PIL import Image

    result = runs["good/gif_embedded_default_cpu"]
    assert result["returncode"] == 0, result["stderr"]
    out = result["out"]
    assert sorted(p.name for p in out.iterdir()) == ["anim.gif"]
    with Image.open(out / "anim.gif") as gif:
        assert gif.format == "GIF" and gif.size == (32, 32)
        assert gif.n_frames == 5


def test_png_of_requested_size(runs):
    from PIL import Image

    result = runs["good/png_flux"]
    assert result["returncode"] == 0, result["stderr"]
    out = result["out"]
    assert sorted(p.name for p in out.iterdir()) == ["image.png", "report.json"]
    with Image.open(out / "image.png") as image:
        assert image.format == "PNG" and image.size == (48, 32)
    report = json.loads((out / "report.json").read_text())
    assert report["pipeline_class"] == "FluxPipeline" and report["device"] == "fakegpu:0"
    assert report["offload_stats"]["loads"] >= 1


def test_make_tiny(runs):
    result = runs["make_tiny/sd3"]
    assert result["returncode"] == 0, result["stderr"]
    assert result["stderr"] == ""  # no library warnings, no weight-writing bars
    target = result["out"] / "tiny-sd3"
    assert result["stdout"].strip() == str(target)
    info = inspect_model(target)
    assert info.pipeline_class == "StableDiffusion3Pipeline"
    assert {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"} <= set(info.numels)


def test_make_tiny_refuses_a_foreign_folder(runs):
    _check_one_error_line(runs["make_tiny/refuses_foreign_folder"])
    precious = Path(runs["make_tiny/refuses_foreign_folder"]["out"]).parent
    notes = list(Path(precious.parent).glob("cli-inputs*/precious/notes.txt"))
    assert notes and notes[0].read_text() == "keep me"


def test_make_tiny_bad_kind(runs):
    result = runs["make_tiny/bad_kind"]
    line = _check_one_error_line(result)
    assert "kind: invalid choice: 'sdxl'" in line
    for kind in tiny_pipelines.KINDS:
        assert repr(kind) in line
    assert sorted(p.name for p in result["out"].iterdir()) == []


def test_make_tiny_is_quiet(runs):
    """Building Flux (CLIP image processor, weight-writing bars) prints only the folder."""
    result = runs["make_tiny/flux"]
    assert result["returncode"] == 0, result["stderr"]
    assert result["stderr"] == ""
    assert result["stdout"].strip() == str(result["out"] / "tiny-flux")


def test_make_tiny_non_empty_folders(runs):
    """Any non-empty folder needs --overwrite; even then only a folder make-tiny wrote."""
    _check_one_error_line(runs["make_tiny/refuses_foreign_folder"])
    _check_one_error_line(runs["make_tiny/refuses_foreign_folder_with_overwrite"])
    _check_one_error_line(runs["make_tiny/refuses_own_folder_without_overwrite"])
    result = runs["make_tiny/replaces_own_folder_with_overwrite"]
    assert result["returncode"] == 0, result["stderr"]
    target = Path(result["stdout"].strip())
    assert inspect_model(target).pipeline_class == "StableDiffusion3Pipeline"
    assert tiny_pipelines.kind_of(target) == "sd3"


def test_overwrite_replaces_the_output(runs):
    result = runs["good/overwrite"]
    assert result["returncode"] == 0, result["stderr"]
    inputs = runs["inputs"]
    assert (inputs / "photo.png").read_bytes().startswith(b"\x89PNG")
    assert list(inputs.glob(".photo.png*")) == []  # the temporary file was renamed into place
    assert (inputs / "existing.png").read_bytes() == b"precious photo"  # refused without --overwrite


def test_variant_fit_and_generation(runs):
    """*.fp16.safetensors next to the plain files: the fit check counts one set (plain or
    variant, as diffusers loads them), and --variant fp16 loads the variant's files."""
    from diffusion_offload.models.files import weight_files

    inputs = runs["inputs"]
    plain, both = inspect_model(inputs / "flux"), inspect_model(inputs / "flux-variant")
    assert both.numels == plain.numels
    assert inspect_model(inputs / "flux-variant", "fp16").numels == plain.numels
    files = weight_files(inputs / "flux-variant", "fp16")
    assert [p.name for p in files["transformer"]] == ["diffusion_pytorch_model.fp16.safetensors"]
    assert [p.name for p in weight_files(inputs / "flux-variant")["transformer"]] == [
        "diffusion_pytorch_model.safetensors"]
    result = runs["good/variant"]
    assert result["returncode"] == 0, result["stderr"]
    report = json.loads((result["out"] / "report.json").read_text())
    assert report["request"]["variant"] == "fp16"


def test_table_uses_human_units_and_counts_load(runs):
    result = runs["good/png_flux"]
    err = result["stderr"]
    assert "time load" in err and "time total (load included)" in err
    peak = err.split("peak device memory")[1].split("\n")[0].strip(" │")
    h2d = err.split("host->device weights")[1].split("\n")[0].strip(" │")
    assert peak.endswith(("KiB", "MiB", "GiB")) and "," not in peak, peak
    assert h2d.endswith(("KiB", "MiB", "GiB")) and "," not in h2d, h2d
    report = json.loads((result["out"] / "report.json").read_text())
    timings = report["timings"]
    parts = sum(v for k, v in timings.items() if k != "total")
    assert timings["total"] == pytest.approx(parts)
    assert timings["total"] >= timings["load"] > 0


def test_generate_is_quiet(runs):
    """No library warnings or loading bars, whatever the command (the denoising bar stays)."""
    for name in ("good/png_flux", "good/variant", "good/mp4_embedded_default"):
        err = runs[name]["stderr"]
        for noise in ("Loading pipeline components", "Loading weights", "torchvision", "Warning", "warn("):
            assert noise not in err, f"{name}: {noise!r} in {err!r}"


def test_report_records_the_full_request(runs):
    report = json.loads((runs["good/png_flux"]["out"] / "report.json").read_text())
    request = report["request"]
    assert request["prompt"] == "a red fox running through fresh snow"
    assert request["negative_prompt"] == "blurry"
    assert (request["height"], request["width"], request["num_inference_steps"], request["seed"]) == (32, 48, 2, 0)
    assert request["device"] == "fakegpu:0" and request["dtype"] == "float32"
    assert parse_diffusion_offload_config(request["diffusion_offload_config"]) == parse_diffusion_offload_config(FULL)
    assert Path(request["model"]).is_absolute()
    assert set(report["versions"]) == {"diffusion_offload", "torch", "diffusers"}


def test_from_report_reproduces_the_video(runs, tmp_path):
    """generate --from-report report.json gives the same frames as the recorded run."""
    import imageio.v2 as imageio

    first = runs["good/mp4_embedded_default"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSION_OFFLOAD_")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    again = tmp_path / "again.mp4"
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_offload", "generate", "--from-report",
         str(first["out"] / "report.json"), "--output", str(again)],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    original = np.stack(imageio.mimread(first["out"] / "video.mp4"))
    repeated = np.stack(imageio.mimread(again))
    assert original.shape == repeated.shape == (5, 32, 48, 3)
    assert np.array_equal(original, repeated)
    assert (first["out"] / "video.mp4").read_bytes() == again.read_bytes()
