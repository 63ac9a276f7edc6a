"""Request parameters and results of the ``Omni`` engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from PIL import Image

__all__ = ["GenerationOutput", "SamplingParams"]

_SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes 64-bit seeds; seed + i must fit


@dataclass
class SamplingParams:
    """Sampling settings of one ``Omni.generate`` call; ``None`` takes the pipeline's default.

    Attributes:
        height, width: output size in pixels.
        num_frames: frames per video (video pipelines only).
        fps: frames per second when a video is written to a file (default 16).
        num_inference_steps: denoising steps.
        guidance_scale: classifier-free guidance scale.
        guidance_scale_2: guidance of the low-noise expert (Wan2.2 two-expert pipelines).
        seed: seed of the CPU generator; output ``i`` of a prompt uses ``seed + i``
            (default 0, so the same request gives the same output).
        num_outputs_per_prompt: images or videos per prompt (default 1).
        flow_shift: the scheduler's shift for this request (``flow_shift`` of UniPC and
            DPM, ``shift`` of FlowMatchEuler); the model's own afterwards.
        boundary_ratio: Wan2.2's switch between its two experts, for this request.
        extra: further ``__call__`` arguments by name (``true_cfg_scale``,
            ``max_sequence_length``, ``sigmas``...), checked against the pipeline's
            signature (``engine.knobs``).
    """

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    seed: int | None = None
    num_outputs_per_prompt: int | None = None
    flow_shift: float | None = None
    boundary_ratio: float | None = None
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "extra":
                if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                    raise TypeError(f"SamplingParams.extra must be a dict of argument names, got {value!r}")
                continue
            if f.name == "boundary_ratio" and not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"SamplingParams.boundary_ratio must be from 0 to 1, got {value!r}")
            if f.name in ("guidance_scale", "guidance_scale_2", "flow_shift", "boundary_ratio"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"SamplingParams.{f.name} must be a number, got {value!r}")
                if value < 0:
                    raise ValueError(f"SamplingParams.{f.name} must be >= 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SamplingParams.{f.name} must be an int, got {value!r}")
            minimum = 0 if f.name == "seed" else 1
            if value < minimum:
                raise ValueError(f"SamplingParams.{f.name} must be >= {minimum}, got {value!r}")
            if f.name == "seed" and value >= _SEED_LIMIT:
                raise ValueError(f"SamplingParams.seed must be < 2**63, got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        """The set fields as a dict."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class GenerationOutput:
    """The result for one prompt.

    Attributes:
        prompt: the prompt text.
        images: PIL images (image pipelines), else None.
        frames: videos, each a list of PIL frames (video pipelines), else None.
        timings: seconds: ``text_encoding``, ``denoising``, ``decoding``, and ``total``
            (this request's wall time: the stages and what lies between them, the load
            excluded); ``load`` (the engine's load time, also ``Omni.load_seconds``) only
            in the first request's outputs.
        peak_device_memory_bytes: peak device bytes during this request (reset per request).
        peak_host_memory: sampled peak resident host memory during this request, bytes:
            ``rss_anon_bytes`` and ``rss_file_bytes`` (``engine.hostrss``; ``{}`` off Linux).
        offload_stats: this request's ``TransferStats`` (``core.stats``): weight moves
            (``h2d_bytes``, ``d2h_bytes``, ``loads``, ``evictions``, ``transfer_seconds``...),
            the host tiers' gauges (``pinned_bytes``, ``disk_backed_bytes``...) and disk
            reads (``disk_read_bytes``, ``disk_read_seconds``, ``staging_copies``...).
        negative_prompt: the negative prompt, if any.
    """

    prompt: str
    images: list[Image.Image] | None = None
    frames: list[list[Image.Image]] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    peak_device_memory_bytes: int = 0
    peak_host_memory: dict[str, int] = field(default_factory=dict)
    offload_stats: dict[str, float] = field(default_factory=dict)
    negative_prompt: str | None = None
