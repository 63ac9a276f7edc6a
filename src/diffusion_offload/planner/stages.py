"""One request of a pipeline, replayed on the meta device to measure its activation memory.

Each supported pipeline family has a program that mirrors what its diffusers ``__call__``
(0.42) keeps on the device, in the same order: the token ids moved to the device, each
text encoder's forward (the real module, built on the meta device, at
``max_sequence_length``), the prompt embeddings the pipeline keeps and post-processes,
the latents, the denoiser's forward at the latent shape (twice per step with
classifier-free guidance, or once at batch 2 for SD3), the guidance arithmetic, the
scheduler's real ``step`` (the pipeline's own scheduler, whose state, e.g. UniPC's
previous model outputs, is part of the measurement), the latent de-normalisation, the
VAE's ``decode`` of the full video and the image processor's de-normalisation (what
``postprocess`` does on the device before moving the result to the host).

Everything runs under :class:`~.memory.LiveBytes`, which counts live bytes exactly as a
device allocator; weights are not counted here (they are added per candidate from the
safetensors headers). The program reports **segments**: for every stretch of the request
during which one component is the one running (from the moment its offload hook fires
to the next component's hook), the peak of live activation bytes in it. A candidate's
peak is then ``max(resident weights during the segment + segment peak)``.

Repetition is replayed, not re-run, with the same bytes (checked byte for byte against full
runs on every shipped config): the denoiser's later calls (other guidance branch, later
steps; the guidance arithmetic and the scheduler's ``step`` still run every step), a
component's repeated blocks (same class, parameter shapes and argument metadata:
:class:`_BlockReplay`), the causal video decoder's per-frame calls once its cache is in
steady state, and single ops with the same argument metadata (:class:`~.memory.LiveBytes`).
A replay allocates the bytes the first call needed above what it left allocated, frees
them, then allocates outputs of the recorded sizes, strides and dtypes. A Wan2.2-A14B
request at 720p, 81 frames, 40 steps replays in about 0.5 s of CPU.

Data-dependent questions on the meta device (``mask.all()``) are answered so that the
model builds its explicit attention mask (padding present), the larger choice.

Supported: ``WanPipeline``, ``FluxPipeline``, ``StableDiffusion3Pipeline``,
``QwenImagePipeline``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .memory import LiveBytes, attention_model
from .model import PlanModel

__all__ = ["FAMILIES", "Request", "StageReport", "measure_request"]

_META = torch.device("meta")


@dataclass(frozen=True)
class Request:
    """The request shape a plan is for.

    Attributes:
        height, width: output size (pixels).
        num_frames: frames of a video (None for image pipelines).
        steps: denoising steps.
        cfg: classifier-free guidance on (two denoiser passes per step, or batch 2);
            None: what the engine runs for a request with a negative prompt: on for every
            family (FLUX.1-dev, guidance-distilled, runs true CFG because the engine gives a
            negative prompt ``true_cfg_scale`` 4.0, ``engine.knobs.DEFAULT_TRUE_CFG_SCALE``).
        max_sequence_length: text tokens of the T5/UMT5 encoders (None: the pipeline's
            default: Wan 512, FLUX 512, SD3 256, Qwen-Image 512 for the denoiser; Qwen-Image's
            encoder reads up to 1024 + 34 template tokens).
    """

    height: int
    width: int
    num_frames: int | None
    steps: int
    cfg: bool | None = None
    max_sequence_length: int | None = None


@dataclass
class StageReport:
    """What one replayed request measured.

    Attributes:
        segments: ``(component, peak activation bytes)`` in execution order; the peak
            includes every tensor the pipeline keeps alive then (bytes).
        calls: forward calls per component in a full request (for layer-mode transfers).
        leftover: bytes a request leaves allocated for the next one (scheduler state,
            model caches); already included in every segment's peak, as the steady state
            of back-to-back requests (an upper bound for segments after the scheduler
            resets).
    """

    segments: list[tuple[str, int]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    leftover: int = 0

    @property
    def used(self) -> list[str]:
        """Components that run in a request, in first-use order."""
        out: list[str] = []
        for name, _ in self.segments:
            if name not in out:
                out.append(name)
        return out


class _Run:
    """Segment bookkeeping around a :class:`LiveBytes` tracker."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker
        self.report = StageReport()
        self._current: list[Any] | None = None
        # component -> (transient bytes of a call, output shape, output dtype)
        self._replay: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def use(self, component: str) -> None:
        """The hook of ``component`` fires: a new segment starts (or the current goes on)."""
        self._close()
        self.report.calls[component] = self.report.calls.get(component, 0) + 1
        if self._current is not None and self._current[0] == component:
            self.tracker.reset_peak()
            return
        self.tracker.reset_peak()
        self._current = [component, self.tracker.now]
        self.report.segments.append(tuple(self._current))  # type: ignore[arg-type]

    def _close(self) -> None:
        if self._current is None:
            return
        self._current[1] = max(self._current[1], self.tracker.peak)
        self.report.segments[-1] = (self._current[0], self._current[1])

    def finish(self) -> StageReport:
        self._close()
        return self.report

    def forward(self, component: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Call ``module`` in component ``component``'s segment and return its first output.

        The first call runs the module; later calls (same shapes: the other guidance
        branch, later steps) replay it: a transient allocation of the bytes the first call
        needed above what it left allocated, freed, then the output. Bytes the first call
        left behind (caches such as Qwen-Image's rotary tables) are not allocated again.
        """
        self.use(component)
        replay = self._replay.get(component)
        if replay is not None:
            transient, shape, dtype = replay
            torch.empty(transient, dtype=torch.uint8, device=_META)  # the transient peak, freed at once
            out = torch.empty(shape, dtype=dtype, device=_META)
        else:
            self.tracker.reset_peak()
            result = module(*args, **kwargs)
            out = result[0] if isinstance(result, (tuple, list)) else result
            del result
            transient = self.tracker.peak - self.tracker.now + _nbytes(out)
            self._replay[component] = (max(transient, 0), tuple(out.shape), out.dtype)
        self._current[1] = max(self._current[1], self.tracker.peak)  # type: ignore[index]
        self.report.segments[-1] = (self._current[0], self._current[1])  # type: ignore[index]
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dev(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A device tensor the pipeline makes (counted by the tracker)."""
    return torch.empty(shape, dtype=dtype, device=_META)


_DTYPES: "weakref.WeakKeyDictionary[nn.Module, torch.dtype]" = weakref.WeakKeyDictionary()


def _dtype_of(module: nn.Module) -> torch.dtype:
    """The module's dtype as the pipeline reads it (``module.dtype``: diffusers and
    transformers skip modules kept in float32); cached per module (it walks every
    parameter)."""
    cached = _DTYPES.get(module)
    if cached is not None:
        return cached
    dtype = getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype):
        _DTYPES[module] = dtype
        return dtype
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _vae_scale(vae: nn.Module) -> int:
    cfg = vae.config
    if getattr(cfg, "scale_factor_spatial", None):
        return int(cfg.scale_factor_spatial)
    if getattr(cfg, "temperal_downsample", None) is not None:
        return 2 ** len(cfg.temperal_downsample)
    return 2 ** (len(cfg.block_out_channels) - 1)


def _timesteps(pm: PlanModel, steps: int, mu: float | None = None,
               sigmas: Any = None) -> list[torch.Tensor]:
    """The scheduler's timesteps on the host, as the pipeline sets them."""
    sched = pm.scheduler
    kwargs: dict[str, Any] = {}
    if sigmas is not None:
        kwargs["sigmas"] = sigmas
    if mu is not None:
        kwargs["mu"] = mu
    if kwargs:
        sched.set_timesteps(device="cpu", **kwargs)
    else:
        sched.set_timesteps(steps, device="cpu")
    sched.set_begin_index(0)
    return list(sched.timesteps)


def _postprocess(image: torch.Tensor) -> torch.Tensor:
    """``VaeImageProcessor.postprocess``'s device work for ``output_type="pil"``: per-image
    ``denormalize`` then ``stack`` (the result then moves to the host)."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor().postprocess(image, output_type="pt")


def _guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    return uncond + scale * (cond - uncond)


# ---------------------------------------------------------------------- Wan


def _wan(pm: PlanModel, req: Request, run: _Run) -> None:
    m = pm.modules
    te = m["text_encoder"]
    dits = [n for n in ("transformer", "transformer_2") if n in m]
    dit_dtype = _dtype_of(m[dits[0]])
    length = req.max_sequence_length or 512
    cfg = True if req.cfg is None else req.cfg
    embeds = []
    for _ in range(2 if cfg else 1):
        run.use("text_encoder")
        ids, mask = _dev((1, length), torch.int64), _dev((1, length), torch.int64)
        out = te(ids, mask).last_hidden_state
        del ids, mask
        out = out.to(dtype=_dtype_of(te))
        views = [u[:1] for u in out]  # a one-token prompt: the largest padding
        del out
        stacked = torch.stack([torch.cat([u, u.new_zeros(length - u.size(0), u.size(1))]) for u in views])
        del views
        embeds.append(stacked.repeat(1, 1, 1).view(1, length, -1))
        del stacked
    embeds = [e.to(dit_dtype) for e in embeds]
    transformer = m[dits[0]]
    vae = m["vae"]
    scale = _vae_scale(vae)
    frames = req.num_frames or 1
    temporal = getattr(vae.config, "scale_factor_temporal", None) or 4
    latent_shape = (1, transformer.config.in_channels, (frames - 1) // temporal + 1,
                    req.height // scale, req.width // scale)
    timesteps = _timesteps(pm, req.steps)
    t_dev = _dev((len(timesteps),), pm.scheduler.timesteps.dtype)
    latents = _dev(latent_shape, torch.float32)
    ones = torch.ones(latents.shape, dtype=torch.float32, device=_META)  # WanPipeline's ``mask``
    ratio = pm.index.get("boundary_ratio")
    boundary = ratio * pm.scheduler.config.num_train_timesteps if ratio is not None else None
    # WanPipeline's loop locals (latent_model_input, timestep, noise_pred, noise_uncond)
    # stay alive until reassigned, and through the decode
    noise = uncond = None
    for i, t in enumerate(timesteps):
        name = dits[0] if boundary is None or t >= boundary or len(dits) == 1 else dits[1]
        model_input = latents.to(_dtype_of(m[name]))
        timestep = t_dev[i].expand(latents.shape[0])
        noise = run.forward(name, m[name], hidden_states=model_input,
                            timestep=timestep, encoder_hidden_states=embeds[0], return_dict=False)
        if cfg:
            uncond = run.forward(name, m[name], hidden_states=model_input, timestep=timestep,
                                 encoder_hidden_states=embeds[1], return_dict=False)
            noise = _guided(noise, uncond, 4.0)
        latents = pm.scheduler.step(noise, t, latents, return_dict=False)[0]
    latents = latents.to(dtype=_dtype_of(vae))
    z = vae.config.z_dim
    mean, std = _dev((1, z, 1, 1, 1), latents.dtype), _dev((1, z, 1, 1, 1), latents.dtype)
    latents = latents / std + mean
    run.use("vae")
    video = vae.decode(latents, return_dict=False)[0]
    outs = [_postprocess(video[b].permute(1, 0, 2, 3)) for b in range(video.shape[0])]
    del outs, video, latents, ones, noise, uncond, model_input, timestep


# ---------------------------------------------------------------------- FLUX


def _flux(pm: PlanModel, req: Request, run: _Run) -> None:
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift

    m = pm.modules
    clip, t5, dit, vae = m["text_encoder"], m["text_encoder_2"], m["transformer"], m["vae"]
    length = req.max_sequence_length or 512
    cfg = True if req.cfg is None else req.cfg  # a negative prompt gets true_cfg_scale 4.0
    prompts = []
    for _ in range(2 if cfg else 1):
        run.use("text_encoder")
        ids = _dev((1, 77), torch.int64)
        out = clip(ids, output_hidden_states=False)
        del ids
        pooled = out.pooler_output
        del out
        pooled = pooled.to(dtype=_dtype_of(clip)).repeat(1, 1).view(1, -1)
        run.use("text_encoder_2")
        ids = _dev((1, length), torch.int64)
        embeds = t5(ids, output_hidden_states=False)[0]
        del ids
        embeds = embeds.to(dtype=_dtype_of(t5)).repeat(1, 1, 1).view(1, length, -1)
        text_ids = _dev((length, 3), embeds.dtype)
        prompts.append((embeds, pooled, text_ids))
    dtype = prompts[0][0].dtype
    scale = _vae_scale(vae)
    h, w = 2 * (req.height // (scale * 2)), 2 * (req.width // (scale * 2))
    channels = dit.config.in_channels // 4
    latents = FluxPipeline._pack_latents(_dev((1, channels, h, w), dtype), 1, channels, h, w)
    image_ids = _dev(((h // 2) * (w // 2), 3), dtype)
    cfg_sched = pm.scheduler.config
    mu = calculate_shift(latents.shape[1], cfg_sched.get("base_image_seq_len", 256),
                         cfg_sched.get("max_image_seq_len", 4096), cfg_sched.get("base_shift", 0.5),
                         cfg_sched.get("max_shift", 1.15))
    import numpy as np

    sigmas = np.linspace(1.0, 1 / req.steps, req.steps)
    if cfg_sched.get("use_flow_sigmas", False):
        sigmas = None
    timesteps = _timesteps(pm, req.steps, mu=mu, sigmas=sigmas)
    t_dev = _dev((len(timesteps),), torch.float32)
    guidance = (torch.full([1], 3.5, dtype=torch.float32, device=_META).expand(1)
                if dit.config.guidance_embeds else None)

    def denoise(prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        embeds, pooled, text_ids = prompt
        return run.forward("transformer", dit, hidden_states=latents, timestep=timestep / 1000,
                           guidance=guidance, pooled_projections=pooled,
                           encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids,
                           return_dict=False)

    # FluxPipeline's loop locals (timestep, noise_pred, neg_noise_pred) stay alive until
    # reassigned, and through the decode
    noise = uncond = None
    for i, t in enumerate(timesteps):
        timestep = t_dev[i].expand(latents.shape[0]).to(latents.dtype)
        noise = denoise(prompts[0])
        if cfg:
            uncond = denoise(prompts[1])
            noise = _guided(noise, uncond, 4.0)
        latents = pm.scheduler.step(noise, t, latents, return_dict=False)[0]
    latents = FluxPipeline._unpack_latents(latents, req.height, req.width, scale)
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    run.use("vae")
    image = vae.decode(latents, return_dict=False)[0]
    image = _postprocess(image)
    del image, latents, noise, uncond, timestep


# ---------------------------------------------------------------------- SD3


def _sd3(pm: PlanModel, req: Request, run: _Run) -> None:
    m = pm.modules
    dit, vae = m["transformer"], m["vae"]
    length = req.max_sequence_length or 256
    cfg = True if req.cfg is None else req.cfg
    encoded = []
    held = []  # encode_prompt's locals: the prompt's stay alive while the negative is encoded
    for _ in range(2 if cfg else 1):
        clips = []
        for name in ("text_encoder", "text_encoder_2"):
            enc = m[name]
            run.use(name)
            ids = _dev((1, 77), torch.int64)
            out = enc(ids, output_hidden_states=True)
            del ids
            pooled = out[0]
            embeds = out.hidden_states[-2]
            del out
            embeds = embeds.to(dtype=_dtype_of(m["text_encoder"])).repeat(1, 1, 1).view(1, 77, -1)
            pooled = pooled.repeat(1, 1).view(1, -1)
            clips.append((embeds, pooled))
        clip_embeds = torch.cat([clips[0][0], clips[1][0]], dim=-1)
        if "text_encoder_3" in m:
            t5 = m["text_encoder_3"]
            run.use("text_encoder_3")
            ids = _dev((1, length), torch.int64)
            t5_embeds = t5(ids)[0]
            del ids
            t5_embeds = t5_embeds.to(dtype=_dtype_of(t5)).repeat(1, 1, 1).view(1, length, -1)
        else:
            t5_embeds = torch.zeros((1, length, dit.config.joint_attention_dim),
                                    dtype=_dtype_of(m["text_encoder"]), device=_META)
        clip_embeds = torch.nn.functional.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
        pooled = torch.cat([clips[0][1], clips[1][1]], dim=-1)
        held.append((clips, clip_embeds, t5_embeds))
        del clips, clip_embeds, t5_embeds
        encoded.append((embeds, pooled))
    del held  # encode_prompt returns
    if cfg:
        embeds = torch.cat([encoded[1][0], encoded[0][0]], dim=0)
        pooled = torch.cat([encoded[1][1], encoded[0][1]], dim=0)
    else:
        embeds, pooled = encoded[0]
    scale = _vae_scale(vae)
    latents = _dev((1, dit.config.in_channels, req.height // scale, req.width // scale), embeds.dtype)
    timesteps = _timesteps(pm, req.steps)
    t_dev = _dev((len(timesteps),), pm.scheduler.timesteps.dtype)
    # StableDiffusion3Pipeline's loop locals (latent_model_input, timestep, noise_pred and
    # its chunks noise_pred_uncond/noise_pred_text, views of the batch-2 output) stay alive
    # until reassigned, and through the decode
    noise = uncond = cond = None
    for i, t in enumerate(timesteps):
        model_input = torch.cat([latents] * 2) if cfg else latents
        timestep = t_dev[i].expand(model_input.shape[0])
        noise = run.forward("transformer", dit, hidden_states=model_input, timestep=timestep,
                            encoder_hidden_states=embeds, pooled_projections=pooled,
                            return_dict=False)
        if cfg:
            uncond, cond = noise.chunk(2)
            noise = _guided(cond, uncond, 7.0)
        latents = pm.scheduler.step(noise, t, latents, return_dict=False)[0]
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    run.use("vae")
    image = vae.decode(latents, return_dict=False)[0]
    image = _postprocess(image)
    del image, latents, noise, uncond, cond, model_input, timestep


# ---------------------------------------------------------------------- Qwen-Image


def _qwen_image(pm: PlanModel, req: Request, run: _Run) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline, calculate_shift

    m = pm.modules
    te, dit, vae = m["text_encoder"], m["transformer"], m["vae"]
    drop, cap = 34, 1024  # QwenImagePipeline: prompt template prefix, tokenizer_max_length
    length = req.max_sequence_length or 512
    tokens = cap + drop  # the encoder reads the whole (truncated) templated prompt
    cfg = True if req.cfg is None else req.cfg
    prompts = []
    for _ in range(2 if cfg else 1):
        run.use("text_encoder")
        ids, mask = _dev((1, tokens), torch.int64), _dev((1, tokens), torch.int64)
        position_ids = None
        out = te(input_ids=ids, attention_mask=mask, output_hidden_states=True, position_ids=position_ids)
        hidden = out.hidden_states[-1]
        bool_mask = mask.bool()
        lengths = bool_mask.sum(dim=1)
        selected = _dev((tokens, hidden.shape[-1]), hidden.dtype)  # hidden[bool_mask]
        split = [e[drop:] for e in torch.split(selected, [tokens], dim=0)]
        masks = [torch.ones(e.size(0), dtype=torch.long, device=_META) for e in split]
        width = max(e.size(0) for e in split)
        embeds = torch.stack([torch.cat([u, u.new_zeros(width - u.size(0), u.size(1))]) for u in split])
        attn = torch.stack([torch.cat([u, u.new_zeros(width - u.size(0))]) for u in masks])
        del out, hidden, bool_mask, lengths, selected, split, masks, ids, mask
        embeds = embeds.to(dtype=_dtype_of(te))
        embeds = embeds[:, :length]
        embeds = embeds.repeat(1, 1, 1).view(1, embeds.shape[1], -1)
        attn = attn[:, :length].repeat(1, 1).view(1, -1)
        del attn  # all ones: the pipeline passes no mask
        prompts.append(embeds)
    scale = _vae_scale(vae)
    h, w = 2 * (req.height // (scale * 2)), 2 * (req.width // (scale * 2))
    channels = dit.config.in_channels // 4
    latents = QwenImagePipeline._pack_latents(_dev((1, 1, channels, h, w), prompts[0].dtype), 1, channels, h, w)
    img_shapes = [[(1, req.height // scale // 2, req.width // scale // 2)]]
    cfg_sched = pm.scheduler.config
    mu = calculate_shift(latents.shape[1], cfg_sched.get("base_image_seq_len", 256),
                         cfg_sched.get("max_image_seq_len", 4096), cfg_sched.get("base_shift", 0.5),
                         cfg_sched.get("max_shift", 1.15))
    import numpy as np

    timesteps = _timesteps(pm, req.steps, mu=mu, sigmas=np.linspace(1.0, 1 / req.steps, req.steps))
    t_dev = _dev((len(timesteps),), torch.float32)

    def denoise(embeds: torch.Tensor) -> torch.Tensor:
        return run.forward("transformer", dit, hidden_states=latents, timestep=timestep / 1000,
                           guidance=None, encoder_hidden_states_mask=None,
                           encoder_hidden_states=embeds, img_shapes=img_shapes, return_dict=False)

    # QwenImagePipeline's loop locals (timestep, noise_pred, neg_noise_pred, comb_pred,
    # cond_norm, noise_norm) stay alive until reassigned, and through the decode
    noise = uncond = comb = cond_norm = noise_norm = None
    for i, t in enumerate(timesteps):
        timestep = t_dev[i].expand(latents.shape[0]).to(latents.dtype)
        noise = denoise(prompts[0])
        if cfg:
            uncond = denoise(prompts[1])
            comb = _guided(noise, uncond, 4.0)
            cond_norm = torch.norm(noise, dim=-1, keepdim=True)
            noise_norm = torch.norm(comb, dim=-1, keepdim=True)
            noise = comb * (cond_norm / noise_norm)
        latents = pm.scheduler.step(noise, t, latents, return_dict=False)[0]
    latents = QwenImagePipeline._unpack_latents(latents, req.height, req.width, scale)
    latents = latents.to(_dtype_of(vae))
    z = vae.config.z_dim
    mean, std = _dev((1, z, 1, 1, 1), latents.dtype), _dev((1, z, 1, 1, 1), latents.dtype)
    latents = latents / std + mean
    run.use("vae")
    image = vae.decode(latents, return_dict=False)[0][:, :, 0]
    image = _postprocess(image)
    del image, latents, noise, uncond, comb, cond_norm, noise_norm, timestep


FAMILIES: dict[str, Callable[[PlanModel, Request, _Run], None]] = {
    "WanPipeline": _wan,
    "FluxPipeline": _flux,
    "StableDiffusion3Pipeline": _sd3,
    "QwenImagePipeline": _qwen_image,
}
"""Pipeline class -> its replay program."""


class _BlockReplay:
    """Replay repeated blocks: the blocks of a component have the same structure and see
    the same shapes, so the first call of each (class, parameter shapes, argument
    metadata) runs and later calls allocate what it allocated: a transient of the bytes
    it needed above what it left, then outputs with the same sizes, strides and dtypes.
    A block whose output views an input runs every time."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker
        self.memo: dict[tuple, Any] = {}
        self.structure: dict[int, tuple] = {}
        self.patched: list[nn.Module] = []

    def install(self, pm: PlanModel) -> None:
        from .model import discover_block_modules

        seen: set[int] = set()
        for name, module in pm.modules.items():
            if name in pm.components and not pm.components[name].blocks:
                continue  # not streamed in layer mode (a VAE): no blocks to memoize
            for block in discover_block_modules(module):
                if id(block) in seen:
                    continue
                seen.add(id(block))
                original = block.forward
                block.forward = self._wrap(block, original)  # type: ignore[method-assign]
                self.patched.append(block)

        for module in pm.modules.values():
            decoder = getattr(module, "decoder", None)
            if isinstance(decoder, nn.Module) and id(decoder) not in seen and "feat_cache" in (
                    inspect.signature(decoder.forward).parameters):
                seen.add(id(decoder))
                decoder.forward = self._wrap_cached(decoder, decoder.forward)  # type: ignore[method-assign]
                self.patched.append(decoder)

    def remove(self) -> None:
        for block in self.patched:
            del block.forward
        self.patched = []

    def _wrap_cached(self, decoder: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        """A causal video decoder called once per latent frame (Wan, Qwen-Image VAEs):
        ``decoder(x, feat_cache=list, feat_idx=[0], first_chunk=bool)`` replaces the list's
        entries with new cache tensors. Calls with the same input and cache metadata
        are replayed: the transient, then new cache entries and the output."""
        from .memory import _NO_KEY, _memo_item

        def forward(x: torch.Tensor, feat_cache: Any = None, feat_idx: Any = None,
                    **kwargs: Any) -> Any:
            if feat_idx is None:
                feat_idx = [0]
            if feat_cache is None:
                return original(x, feat_cache=feat_cache, feat_idx=feat_idx, **kwargs)
            # the input is a one-frame view of the latents at a different offset each call:
            # its offset does not change what the call allocates
            where = (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else _NO_KEY
            item = _memo_item((tuple(feat_cache), feat_idx[0], sorted(kwargs.items())))
            item = _NO_KEY if where is _NO_KEY or item is _NO_KEY else (where, item)
            key = None if item is _NO_KEY else ("decoder", id(decoder), item)
            layout = self.memo.get(key) if key is not None else None
            if layout is not None:
                transient, out_structure, cache_structures, idx_after = layout
                torch.empty(transient, dtype=torch.uint8, device=_META)  # the transient peak, freed at once
                for i, structure in enumerate(cache_structures):
                    if structure is not None:
                        feat_cache[i] = _rebuild(structure)
                feat_idx[0] = idx_after
                return _rebuild(out_structure)
            tracker = self.tracker
            outer_peak = tracker.peak
            start = tracker.now
            tracker.reset_peak()
            # weak references: holding the old entries would keep them allocated
            before = [weakref.ref(e) if isinstance(e, torch.Tensor) else (lambda e=e: e)
                      for e in feat_cache]
            out = original(x, feat_cache=feat_cache, feat_idx=feat_idx, **kwargs)
            structure = _structure(out)
            olds = [ref() for ref in before] + [None] * (len(feat_cache) - len(before))
            caches = [None if new is old else
                      ("const", new) if isinstance(new, (str, int, float)) else _structure(new)
                      for new, old in zip(feat_cache, olds)]
            changed = [c for new, old, c in zip(feat_cache, olds, caches) if new is not old]
            if key is not None and structure is not None and all(
                    c is not None and c[0] in ("tensor", "none", "const") for c in changed):
                self.memo[key] = (max(tracker.peak - start, 0), structure, caches, feat_idx[0])
            tracker.peak = max(outer_peak, tracker.peak)
            return out

        return forward

    def _key(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        from .memory import _NO_KEY, _memo_item

        shape = self.structure.get(id(block))
        if shape is None:
            shape = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
            self.structure[id(block)] = shape
        item = _memo_item((tuple(args), tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))))
        return None if item is _NO_KEY else (type(block), shape, item)

    def _wrap(self, block: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            key = self._key(block, args, kwargs)
            layout = self.memo.get(key) if key is not None else None
            if layout is not None:
                transient, outputs = layout
                torch.empty(transient, dtype=torch.uint8, device=_META)  # the transient peak, freed at once
                return _rebuild(outputs)
            tracker = self.tracker
            outer_peak = tracker.peak
            tracker.reset_peak()
            out = original(*args, **kwargs)
            leaves = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage()._cdata for t in _leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            structure = _structure(out)
            if key is not None and structure is not None and not any(
                    t.untyped_storage()._cdata in inputs for t in leaves):
                kept = sum(t.untyped_storage().nbytes() for t in
                           {t.untyped_storage()._cdata: t for t in leaves}.values())
                self.memo[key] = (max(tracker.peak - tracker.now + kept, 0), structure)
            tracker.peak = max(outer_peak, tracker.peak)
            return out

        return forward


def _leaves(value: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(value)


def _structure(out: Any) -> Any:
    """Sizes, strides and dtypes of a block's output (a tensor, None, or a tuple/list of
    them), or None when it holds anything else."""
    if out is None:
        return ("none",)
    if isinstance(out, torch.Tensor):
        if not out.is_meta or out.layout != torch.strided:
            return None
        return ("tensor", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)):
        items = [_structure(o) for o in out]
        if any(i is None for i in items):
            return None
        return ("tuple" if isinstance(out, tuple) else "list", tuple(items))
    return None


def _rebuild(structure: Any) -> Any:
    kind = structure[0]
    if kind == "none":
        return None
    if kind == "const":
        return structure[1]
    if kind == "tensor":
        return torch.empty_strided(structure[1], structure[2], dtype=structure[3], device=_META)
    items = [_rebuild(s) for s in structure[1]]
    return tuple(items) if kind == "tuple" else items


def _clear_caches(pm: PlanModel) -> None:
    """Clear the method caches of the meta modules' classes (Qwen-Image's rotary tables)."""
    from types import SimpleNamespace

    from ..core.caches import clear_method_caches

    clear_method_caches(SimpleNamespace(components=dict(pm.modules)))


def measure_request(pm: PlanModel, req: Request, device_kind: str) -> StageReport:
    """Replay one request of ``pm`` at ``req``'s shapes on the meta device under the memory
    model of ``device_kind`` and return its segments.

    Raises:
        ValueError: the pipeline class has no replay program, or ``device_kind`` is unknown.
    """
    program = FAMILIES.get(pm.pipeline_class)
    if program is None:
        raise ValueError(
            f"the planner has no activation model for {pm.pipeline_class}; supported pipelines: "
            f"{sorted(FAMILIES)}"
        )
    attention = attention_model(device_kind)
    _clear_caches(pm)  # a cache filled by an earlier plan of these modules would hide allocations
    tracker = LiveBytes()
    run = _Run(tracker)
    import gc

    blocks = _BlockReplay(tracker)
    blocks.install(pm)
    try:
        with torch.no_grad(), attention(), tracker:  # as diffusers' __call__ (composite ops decompose)
            program(pm, req, run)
            gc.collect()
    finally:
        blocks.remove()
    report = run.finish()
    # what a request leaves on the device (the scheduler's last model outputs and sample,
    # its timesteps, models' caches, tensor attributes a forward moved there) is still
    # there while the next request runs
    report.leftover = tracker.now + sum(_attribute_tensor_bytes(pm.modules[name]) for name in report.used)
    report.segments = [(name, peak + report.leftover) for name, peak in report.segments]
    return report


def _attribute_tensor_bytes(module: Any) -> int:
    """Bytes of the tensors ``module``'s submodules hold as plain attributes (neither
    parameters nor buffers, so offload does not move them).

    Assumed to reach the device at the first forward and to stay there from then on,
    whatever the component's residency: the one such case in the supported families is
    diffusers' ``QwenEmbedRope`` (``pos_freqs``/``neg_freqs``, two complex64 rotary
    tables), whose ``_get_device_freqs`` method cache keeps their device copies. The
    tables were made before the replay and the cache copies nothing on the meta device,
    so :class:`LiveBytes` does not see them. 0 for what is not an ``nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        return 0
    total = 0
    for sub in module.modules():
        own = {id(t) for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None}
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and id(value) not in own:
                total += value.numel() * value.element_size()
    return total
