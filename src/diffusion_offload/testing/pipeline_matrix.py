"""The compatibility matrix: tiny random pipelines of diffusers families under every
offload mode, on the fake device (issue 25).

``FAMILIES`` lists each family (its label, the pipeline class, how to build and call the
tiny pipeline); ``MODES`` the offload modes; ``check(family, mode, device)`` runs one cell
against the family's all-resident reference (``reference``) and returns a ``Cell``.
``tests/test_pipeline_matrix.py`` asserts every cell, and ``tests/pipeline_matrix_table.py``
prints the README's "Supported pipelines" table from the same lists.

A cell passes when, for one request, the output equals the all-resident output
(``max_abs_diff == 0.0``), ``audit() == []`` before and after it, no weight byte was copied
device->host during it (``stats.d2h_bytes``), and every selected component moved: it was on the
host at rest (after ``enable()`` or after the request) and on the device whenever it ran. A
mode that ``enable()`` refuses is a ``Cell`` with ``refused`` set to the error message.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..core.caches import clear_method_caches
from . import tiny_families, tiny_pipelines

__all__ = ["FAMILIES", "MODES", "NEVER_CALLED", "Cell", "Family", "check", "reference", "weight_bytes"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of the matrix: ``label`` (README), ``pipeline`` (diffusers class name),
    ``build() -> pipe`` (on the host) and ``run(pipe) -> np.ndarray`` (float64)."""

    label: str
    pipeline: str
    build: Callable[[], Any]
    run: Callable[[Any], np.ndarray]


def _kind(kind: str) -> tuple[Callable[[], Any], Callable[[Any], np.ndarray]]:
    def run(pipe: Any) -> np.ndarray:
        out = pipe(prompt="a cat", negative_prompt="blurry", output_type="np",
                   generator=torch.Generator("cpu").manual_seed(0), **tiny_pipelines.default_call_kwargs(kind))
        return np.asarray(out[0], dtype=np.float64)

    return (lambda: tiny_pipelines.build(kind)), run


def _family(name: str) -> tuple[Callable[[], Any], Callable[[Any], np.ndarray]]:
    return (lambda: tiny_families.build(name)), (lambda pipe: tiny_families.run(name, pipe).numpy())


FAMILIES: dict[str, Family] = {
    "wan2.1": Family("Wan2.1", "WanPipeline", *_kind("wan2.1")),
    "wan2.2": Family("Wan2.2 T2V", "WanPipeline", *_kind("wan2.2")),
    "wan2.2-i2v": Family("Wan2.2 I2V", "WanImageToVideoPipeline", *_kind("wan2.2-i2v")),
    "flux": Family("FLUX.1", "FluxPipeline", *_kind("flux")),
    "sd3": Family("SD3 / SD3.5", "StableDiffusion3Pipeline", *_kind("sd3")),
    "qwen-image": Family("Qwen-Image", "QwenImagePipeline", *_kind("qwen-image")),
    "pixart-sigma": Family("PixArt-Sigma", "PixArtSigmaPipeline", *_family("pixart-sigma")),
    "chroma": Family("Chroma", "ChromaPipeline", *_family("chroma")),
    "sd-controlnet": Family("SD 1.x + ControlNet", "StableDiffusionControlNetPipeline", *_family("sd-controlnet")),
    "kandinsky2.2": Family("Kandinsky 2.2 decoder", "KandinskyV22Pipeline", *_family("kandinsky2.2")),
    "dit": Family("DiT (class-conditional)", "DiTPipeline", *_family("dit")),
    "flux-controlnet": Family("FLUX.1 + ControlNet", "FluxControlNetPipeline", *_family("flux-controlnet")),
    "sdxl-controlnet": Family("SDXL + ControlNet", "StableDiffusionXLControlNetPipeline", *_family("sdxl-controlnet")),
    "z-image": Family("Z-Image", "ZImagePipeline", *_family("z-image")),
    "sana": Family("Sana", "SanaPipeline", *_family("sana")),
    "lumina2": Family("Lumina2", "Lumina2Pipeline", *_family("lumina2")),
    "hidream": Family("HiDream", "HiDreamImagePipeline", *_family("hidream")),
    "flux2": Family("FLUX.2", "Flux2Pipeline", *_family("flux2")),
    "flux2-klein": Family("FLUX.2 [klein]", "Flux2KleinPipeline", *_family("flux2-klein")),
    "stable-cascade": Family("Stable Cascade (prior + decoder)", "StableCascadeCombinedPipeline",
                             *_family("stable-cascade")),
    # combined pipelines: a prior pipeline and a decoder pipeline nested in them share their components
    "kandinsky2.1-combined": Family("Kandinsky 2.1 (prior + decoder)", "KandinskyCombinedPipeline",
                                    *_family("kandinsky2.1-combined")),
    "kandinsky2.1-img2img-combined": Family("Kandinsky 2.1 img2img (prior + decoder)", "KandinskyImg2ImgCombinedPipeline",
                                            *_family("kandinsky2.1-img2img-combined")),
    "kandinsky2.1-inpaint-combined": Family("Kandinsky 2.1 inpaint (prior + decoder)", "KandinskyInpaintCombinedPipeline",
                                            *_family("kandinsky2.1-inpaint-combined")),
    "kandinsky2.2-combined": Family("Kandinsky 2.2 (prior + decoder)", "KandinskyV22CombinedPipeline",
                                    *_family("kandinsky2.2-combined")),
    "kandinsky2.2-img2img-combined": Family("Kandinsky 2.2 img2img (prior + decoder)",
                                            "KandinskyV22Img2ImgCombinedPipeline",
                                            *_family("kandinsky2.2-img2img-combined")),
    "kandinsky2.2-inpaint-combined": Family("Kandinsky 2.2 inpaint (prior + decoder)",
                                            "KandinskyV22InpaintCombinedPipeline",
                                            *_family("kandinsky2.2-inpaint-combined")),
    "qwen-image-edit": Family("Qwen-Image-Edit", "QwenImageEditPipeline", *_family("qwen-image-edit")),
    "hunyuan-video": Family("HunyuanVideo", "HunyuanVideoPipeline", *_family("hunyuan-video")),
    "hunyuan-video-1.5": Family("HunyuanVideo 1.5", "HunyuanVideo15Pipeline", *_family("hunyuan-video-1.5")),
    "ltx-video": Family("LTX-Video", "LTXPipeline", *_family("ltx-video")),
    "ltx2": Family("LTX-2", "LTX2Pipeline", *_family("ltx2")),
    "cogvideox": Family("CogVideoX", "CogVideoXPipeline", *_family("cogvideox")),
    "mochi": Family("Mochi", "MochiPipeline", *_family("mochi")),
    "skyreels-v2": Family("SkyReels-V2", "SkyReelsV2Pipeline", *_family("skyreels-v2")),
    "animatediff": Family("AnimateDiff", "AnimateDiffPipeline", *_family("animatediff")),
    "kandinsky5": Family("Kandinsky 5 (T2V)", "Kandinsky5T2VPipeline", *_family("kandinsky5")),
}
"""Family key -> ``Family``, in the README's order."""

NEVER_CALLED: dict[str, set[str]] = {
    # AnimateDiffPipeline copies the motion adapter's weights into its UNetMotionModel when
    # it is built and never calls motion_adapter itself; its role (adapter) still loads it
    # with the DiT group, which the README notes
    "animatediff": {"motion_adapter"},
}
"""Family key -> selected components the pipeline never calls: they only rest on the host."""

MODES: dict[str, str] = {
    "module": "module mode, components=['dit']",
    "legacy": "the legacy switch (enable_cpu_offload=True)",
    "layer": "layer mode, components=['dit']",
    "budget": "the legacy switch (every DiT and encoder) with device_memory_budget = half the weight bytes",
}
"""Mode key -> what it runs."""


@dataclasses.dataclass
class Cell:
    """The outcome of one family under one mode.

    Attributes:
        refused: ``enable()``'s error message when it refused the mode, else None.
        max_abs_diff: max |output - all-resident output| (0.0: bit-equal).
        audit: ``audit()`` breaches after ``enable()`` and after the request.
        weight_d2h_bytes: weight bytes copied device->host during the request
            (``backend.stats.d2h_bytes``; ``enable()`` makes the host copies of weights the
            pipeline placed on the device, which is not counted).
        not_moved: selected components that did not both rest on the host and run on the
            device; one in ``NEVER_CALLED`` must rest on the host and never be called.
        selected: the selected components.
    """

    refused: str | None = None
    max_abs_diff: float = float("nan")
    audit: list[str] = dataclasses.field(default_factory=list)
    weight_d2h_bytes: int = 0
    not_moved: list[str] = dataclasses.field(default_factory=list)
    selected: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Ran, bit-equal, nothing in ``audit``, no weight D2H, every selected component moved."""
        return (self.refused is None and self.max_abs_diff == 0.0 and not self.audit
                and self.weight_d2h_bytes == 0 and not self.not_moved and bool(self.selected))


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def reference(family: str, device: torch.device) -> np.ndarray:
    """The family's all-resident output on ``device`` (float64)."""
    fam = FAMILIES[family]
    pipe = fam.build().to(device)
    try:
        return _quiet(lambda: fam.run(pipe))
    finally:
        clear_method_caches(pipe)  # QwenEmbedRope memoizes device tensors per (self, device)


def weight_bytes(pipe: Any) -> int:
    """Bytes of every parameter and buffer of the pipeline's ``nn.Module`` components, each
    tensor counted once (shared ones too)."""
    seen: dict[int, int] = {}
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _backend(mode: str, pipe: Any, device: torch.device) -> Any:
    from ..core.backends.layer import LayerwiseOffloadBackend
    from ..core.backends.module import ModelLevelOffloadBackend
    from ..core.config import parse_diffusion_offload_config

    if mode == "module":
        return ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, device)
    if mode == "legacy":
        return ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), device)
    if mode == "layer":
        return LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, device)
    if mode == "budget":
        return ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), device,
                                        device_memory_budget=weight_bytes(pipe) // 2)
    raise ValueError(f"mode={mode!r} is not a matrix mode; allowed: {sorted(MODES)}")


def _on_host(module: torch.nn.Module) -> bool:
    return any(t.device.type == "cpu" for t in [*module.parameters(), *module.buffers()])


def check(family: str, mode: str, device: torch.device, ref: np.ndarray) -> Cell:
    """Run ``family`` under ``mode`` on ``device`` (the fake accelerator) for one request
    and compare with ``ref`` (``reference(family, device)``).

    Raises:
        ValueError: an unknown family or mode (named, with the allowed ones).
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not in the matrix; allowed: {sorted(FAMILIES)}")
    fam = FAMILIES[family]
    pipe = fam.build().to(device)
    backend = _backend(mode, pipe, device)
    try:
        _quiet(lambda: backend.enable(pipe))
    except (ValueError, TypeError) as exc:
        return Cell(refused=str(exc))
    cell = Cell()
    try:
        # layer mode manages each streamed block as its own entry ("transformer.blocks.0")
        cell.selected = sorted({n.split(".")[0] for n, c in backend.components.items() if c.selected})
        modules = {n: pipe.components[n] for n in cell.selected}
        rested = {n for n, m in modules.items() if _on_host(m)}
        ran: set[str] = set()  # called with its weights on the device
        called: set[str] = set()  # called at all
        handles = []
        for name, module in modules.items():
            for sub in module.modules():
                if next(sub.parameters(recurse=False), None) is not None:
                    handles.append(sub.register_forward_pre_hook(
                        lambda m, a, name=name: (
                            ran if next(m.parameters(recurse=False)).device.type == device.type else called
                        ).add(name)
                    ))
        cell.audit += backend.audit()
        d2h = backend.stats.d2h_bytes  # enable() copied the weights placed on the device to the host
        out = _quiet(lambda: fam.run(pipe))
        for h in handles:
            h.remove()
        rested |= {n for n, m in modules.items() if _on_host(m)}
        cell.audit += backend.audit()
        cell.max_abs_diff = float(np.abs(out - ref).max())
        cell.weight_d2h_bytes = backend.stats.d2h_bytes - d2h
        called |= ran
        idle = NEVER_CALLED.get(family, set())
        cell.not_moved = sorted(n for n in cell.selected if n not in rested
                                or (n in idle and n in called) or (n not in idle and n not in ran))
    finally:
        backend.disable()
        clear_method_caches(pipe)
    return cell
