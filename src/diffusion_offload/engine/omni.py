"""``Omni``: the offline engine. Load a diffusers pipeline to the host, enable offload, generate."""

from __future__ import annotations

import gc
import inspect
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.backends.base import OffloadBackendBase
from ..core.backends.layer import LayerwiseOffloadBackend
from ..core.backends.module import ModelLevelOffloadBackend
from ..core.config import DiffusionOffloadConfig, parse_diffusion_offload_config
from ..core.discovery import ROLES
from ..core.platform import Platform, normalize_device, platform_for
from ..core.stats import TransferStats
from ..core.tiers import auto_host_budget, check_budget
from ..core.hostmem import check_page_cache
from .admission import admission_for
from .hostrss import PeakHostMemory
from ..models.fit import Footprint, check_fit
from ..core.caches import clear_method_caches
from ..models.files import ModelInfo, inspect_model, resolve_model
from .knobs import KnobError, knob_table
from .params import GenerationOutput, SamplingParams
from .requests import (
    PromptItem, call_kwargs, check_request, image_input, normalize_prompts, request_overrides,
    variant_for,
)
from .trace import TraceRecorder

__all__ = ["LIBRARY_LOGGERS", "Omni", "build_omni", "check_peft", "detach_library_tracebacks",
           "parse_dtype", "pick_device"]

logger = logging.getLogger("diffusion_offload")

AUTO_PREFIX = "diffusion_offload_config='auto': "  # how the planner's FitError starts

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_STAGES = ("text_encoding", "denoising", "decoding")


LIBRARY_LOGGERS = (
    "accelerate", "bitsandbytes", "diffusers", "huggingface_hub", "kernels", "optimum", "peft",
    "safetensors", "torch", "torchao", "transformers",
)
"""The libraries whose log records ``detach_library_tracebacks`` keeps frame-free (by
logger name: the name or a child of it)."""


class _Detached:
    """An exception argument of a log record, as text: formats as the exception did
    (``%s`` and ``%r``), without its traceback."""

    __slots__ = ("_str", "_repr")

    def __init__(self, exc: BaseException) -> None:
        self._str, self._repr = str(exc), repr(exc)

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        return self._repr


def _detach(record: logging.LogRecord) -> logging.LogRecord:
    """Drop what keeps frames alive from a library's ``record``: exception arguments become
    their text (``_Detached``), ``exc_info`` its formatted ``exc_text``."""
    args = record.args
    if isinstance(args, tuple) and any(isinstance(a, BaseException) for a in args):
        record.args = tuple(_Detached(a) if isinstance(a, BaseException) else a for a in args)
    elif isinstance(args, Mapping) and any(isinstance(a, BaseException) for a in args.values()):
        record.args = {k: _Detached(a) if isinstance(a, BaseException) else a for k, a in args.items()}
    if record.exc_info and record.exc_info[2] is not None:
        if not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
    return record


_detach_lock = threading.Lock()


def detach_library_tracebacks() -> None:
    """Make the log records of ``LIBRARY_LOGGERS`` keep no frames, in this process, from now
    on (idempotent; wraps ``logging``'s record factory, whichever it is).

    bitsandbytes logs, at its import, a warning whose argument is the exception its
    optional kernel download raised (offline); its traceback keeps every frame above the
    import, those loading a pipeline included. A handler that keeps records (pytest's log
    capture, ``logging.handlers.MemoryHandler``, a shipper that formats later) then keeps
    a closed engine's weights and their device memory. Such records keep their text: an
    exception argument formats as it did (``%s``, ``%r``), an ``exc_info`` traceback is
    formatted once into ``exc_text``, which ``logging.Formatter`` prints the same way.
    Records of other loggers (the application's, this package's) are left as they are.
    """
    with _detach_lock:
        previous = logging.getLogRecordFactory()
        if getattr(previous, "_diffusion_offload_detach", False):
            return

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            name = record.name
            if any(name == lib or name.startswith(lib + ".") for lib in LIBRARY_LOGGERS):
                _detach(record)
            return record

        factory._diffusion_offload_detach = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(factory)


def parse_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    """``None``/``"auto"`` -> ``"auto"``; ``"float32"``/``"float16"``/``"bfloat16"`` or a torch dtype.

    Raises:
        ValueError: any other value (the message lists the allowed ones).
    """
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not allowed; allowed values: ['auto', {', '.join(map(repr, _DTYPES))}]")


def pick_device(device: str | torch.device | None) -> torch.device:
    """The device to run on.

    ``None`` picks the first available of cuda, xpu, npu, mps, then the fake accelerator
    if installed, else ``cpu`` (logged; ``Omni`` says once that an offload config is a
    no-op there). ``"fakegpu"`` installs the fake accelerator.

    Raises:
        ValueError: an unknown device string.
    """
    if device is not None:
        if str(device).startswith("fakegpu"):
            from ..testing import fake_accelerator

            fake_accelerator.install()
        try:
            dev = normalize_device(device)
        except RuntimeError:
            raise ValueError(
                f"device={str(device)!r} is not a device torch knows; allowed: cuda[:N], xpu, "
                "npu, mps, fakegpu, cpu"
            ) from None
        platform_for(dev)  # raises ValueError for unsupported types
        if dev.type == "fakegpu" and dev.index != 0:
            raise ValueError(f"device={str(device)!r}: the fake accelerator has one device, fakegpu:0")
        module = getattr(torch, dev.type, None)
        if dev.type in ("cuda", "xpu", "npu") and not (module is not None and module.is_available()):
            raise ValueError(f"device={str(device)!r} is not available on this machine (this torch build "
                             f"has no {dev.type} device); allowed here: cpu, fakegpu")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"device={str(device)!r} is not available on this machine")
        return dev
    for kind in ("cuda", "xpu", "npu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return normalize_device(kind)
    if torch.backends.mps.is_available():
        return torch.device("mps", 0)
    from ..testing import fake_accelerator

    if fake_accelerator.is_installed():
        return normalize_device("fakegpu")
    logger.info("no accelerator found: running on the CPU")  # Omni says when offload is a no-op
    return torch.device("cpu")


class _StageTimer:
    """Stage boundaries from torch forward hooks on the encoders and DiTs.

    ``text_encoding`` runs from the request start to the first DiT forward, ``denoising``
    from there to the end of the last DiT forward, ``decoding`` from there to the end.
    """

    def __init__(self, modules: Mapping[str, tuple[torch.nn.Module, str]]) -> None:
        self.handles = []
        for module, role in modules.values():
            if role == "dit":
                self.handles.append(module.register_forward_pre_hook(self._dit_start))
                self.handles.append(module.register_forward_hook(self._dit_end, always_call=True))
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.first_dit: float | None = None
        self.last_dit: float | None = None

    def _dit_start(self, module: torch.nn.Module, args: Any) -> None:
        if self.first_dit is None:
            self.first_dit = time.perf_counter()

    def _dit_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.last_dit = time.perf_counter()

    @property
    def stage(self) -> str:
        if self.first_dit is None:
            return "text_encoding"
        return "denoising" if self.last_dit is None or self.last_dit < self.first_dit else "decoding"

    def spans(self, end: float) -> dict[str, tuple[float, float]]:
        first = self.first_dit if self.first_dit is not None else end
        last = self.last_dit if self.last_dit is not None else first
        return {
            "text_encoding": (self.start, first),
            "denoising": (first, last),
            "decoding": (last, end),
        }

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class Omni:
    """The offline engine.

    Args:
        model: a diffusers-format pipeline directory or a hub id (``org/name``; from the
            local cache when ``HF_HUB_OFFLINE=1``).
        diffusion_offload_config: the offload config (mapping, JSON text or parsed), None
            for no offload (everything on the device), or ``"auto"``: the planner's fastest
            candidate that fits the device's free memory at ``plan_shape``
            (``diffusion_offload.planner.auto``); the pick is logged in one line, kept
            in ``plan_message``, and its row in ``plan_choice`` (a ``PlanRow``).
        enable_cpu_offload: the legacy switch (model-level offload of every DiT and encoder).
        device: the accelerator; None picks one (see ``pick_device``).
        dtype: ``"auto"`` (the checkpoint's), ``"float32"``, ``"float16"``, ``"bfloat16"``.
        component_roles: role overrides (component name -> role).
        trace: record a residency/stage trace (``trace_dict()``, ``write_trace()``).
        progress: show the pipeline's progress bar over denoising steps.
        max_pinned_bytes: pin at most this many bytes of host copies (the rest stay
            pageable); None: no cap. See ``ModelLevelOffloadBackend``.
        variant: the weight file variant to load (``"fp16"`` loads
            ``*.fp16.safetensors``), as diffusers' ``from_pretrained(variant=...)``;
            the fit check counts the same files.
        layer_blocks: layer mode: block container paths per component name, overriding
            the built-in table (``{"transformer": ["blocks"]}``). See
            ``LayerwiseOffloadBackend``.
        plan_shape: the request to plan for (with ``"auto"``, and for the fit check's
            advice when a config does not fit), keys ``height``, ``width`` (pixels),
            ``num_frames``, ``num_inference_steps``; a missing key takes the model's default.
        device_memory_budget: bytes of weights that may stay resident, ``"auto"``, or
            None (module mode: the strict rule; layer mode: trunks and two blocks). See
            ``diffusion_offload.core.policy`` and ``LayerwiseOffloadBackend``.
            ``omni.device_memory_budget`` is the budget run (with ``"auto"``: its pick).
        loras: ``(path or hub id, scale)`` pairs, loaded after offload is enabled with
            diffusers' ``load_lora_weights`` (adapters ``lora_0``, ``lora_1``, ...) and
            activated together with ``set_adapters`` at their scales; needs peft.
        host_memory_budget: bytes of host memory the host copies may take, ``"auto"`` or
            None (no budget). ``"auto"`` is measured before the weights are read
            (``core.tiers.auto_host_budget``); ``omni.host_memory_budget`` is the budget
            run, in bytes. The pipeline is loaded with diffusers' ``from_pretrained``,
            whose safetensors weights stay file-backed (private memory maps) when loaded in
            their stored dtype, so weights past the budget stay on disk. See
            ``ModelLevelOffloadBackend``.
        page_cache: ``"auto"``, ``"drop"`` or ``"keep"``: the file pages a disk-backed
            load read (``core.hostmem.PAGE_CACHE``; the backends' ``page_cache``).
        sleepable: keep a host copy of what rests on the device too, so ``sleep`` can
            empty the device with no device-to-host weight copy (``engine.pool.ModelPool``
            shares one device between several engines this way); needs an offload config.
        admission: refuse a request whose predicted device peak cannot fit the device
            before it runs (``engine.admission``: an ``AdmissionError``, a ``FitError``,
            naming what fits).
        name: the model as refusals name it (``serve``: the served id); None: ``model``.

    ``generate`` is thread-safe: whole calls are serialized, so each returns the result
    and the ``offload_stats`` of its request run alone.

    Validation order: config, dtype, device, model files, fit check; only then are
    weights read (to the host) and offload enabled.

    Raises:
        TypeError, ValueError: invalid config, dtype, device or component_roles.
        ModelError: the model cannot be found or is not a supported diffusers pipeline.
        FitError: the device cannot hold the config's resting footprint; with ``"auto"``:
            no candidate's predicted peak fits (the message names the smallest need).
        NotImplementedError: ``layer_options`` asks for ``weight_transfer="allgather"``.
        ImportError: ``loras`` without peft installed (names the ``lora`` extra).
        ValueError: a LoRA that cannot be loaded (names it) or a pipeline without LoRA support.
    """

    def __init__(
        self,
        model: str | Path,
        diffusion_offload_config: DiffusionOffloadConfig | Mapping[str, Any] | str | None = None,
        enable_cpu_offload: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        component_roles: Mapping[str, str] | None = None,
        *,
        trace: bool = False,
        progress: bool = True,
        max_pinned_bytes: int | None = None,
        variant: str | None = None,
        layer_blocks: Mapping[str, Sequence[str]] | None = None,
        plan_shape: Mapping[str, int | None] | None = None,
        device_memory_budget: int | str | None = None,
        loras: Sequence[tuple[str, float]] = (),
        host_memory_budget: int | str | None = None,
        page_cache: str = "auto",
        sleepable: bool = False,
        admission: bool = True,
        name: str | None = None,
    ) -> None:
        start = time.perf_counter()
        detach_library_tracebacks()  # before any library is imported or loads weights
        self._lock = threading.RLock()
        auto = isinstance(diffusion_offload_config, str) and diffusion_offload_config == "auto"
        if auto and enable_cpu_offload:
            raise ValueError("diffusion_offload_config='auto' cannot be combined with "
                             "enable_cpu_offload=True; give one of them")
        self.config = None if auto else parse_diffusion_offload_config(
            diffusion_offload_config, enable_cpu_offload=enable_cpu_offload
        )
        dtype_choice = parse_dtype(dtype)
        self.device = pick_device(device)
        self.platform: Platform = platform_for(self.device)
        self.model = str(model)
        self.name = self.model if name is None else str(name)
        self.variant = variant
        self.info: ModelInfo = inspect_model(resolve_model(model), variant)
        self.component_roles = self._check_roles(component_roles)
        self.dtype = self._resolve_dtype(dtype_choice)
        self.plan_choice = None
        self.plan_message: str | None = None  # auto's pick, the line it logs
        host_memory_budget = check_budget(host_memory_budget)
        check_page_cache(page_cache)
        if auto:
            if host_memory_budget == "auto" and not self.platform.is_noop:
                host_memory_budget = auto_host_budget()  # before the weights are read
            self.config, picked_budget = self._auto_config(
                plan_shape, layer_blocks, budget=device_memory_budget is None,
                host_budget=host_memory_budget if isinstance(host_memory_budget, int) else None)
            if picked_budget is not None:
                device_memory_budget = picked_budget
        self.device_memory_budget = device_memory_budget  # as run: auto's pick included
        self.footprint: Footprint | None = None
        if not self.platform.is_noop:
            free = self.platform.memory_stats().free_bytes
            self.footprint = check_fit(
                self.info, self.config, torch.tensor([], dtype=self.dtype).element_size(), free,
                self.platform.supports_pinning, self.component_roles, layer_blocks,
                advise=lambda: self._planned_advice(free, plan_shape, layer_blocks),
            )
        elif self.config is not None:
            logger.info("device is cpu: the offload config is accepted but offload is a no-op")

        from diffusers import DiffusionPipeline

        if host_memory_budget == "auto" and self.config is not None and not self.platform.is_noop:
            host_memory_budget = auto_host_budget()  # before the weights are read
        self.host_memory_budget = host_memory_budget
        self.pipeline = DiffusionPipeline.from_pretrained(
            self.info.path, dtype=self.dtype, variant=variant
        )
        self.pipeline.set_progress_bar_config(disable=not progress)
        self.backend: OffloadBackendBase | None = None
        if self.config is not None and not self.platform.is_noop:
            layer = self.config.mode == "layer"
            cls = LayerwiseOffloadBackend if layer else ModelLevelOffloadBackend
            self.backend = cls(
                self.config, self.device, **({"layer_blocks": layer_blocks} if layer else {}),
                component_roles=self.component_roles, max_pinned_bytes=max_pinned_bytes,
                device_memory_budget=device_memory_budget, host_memory_budget=host_memory_budget,
                page_cache=page_cache, sleepable=sleepable,
            )
            self.backend.enable(self.pipeline)
        elif not self.platform.is_noop:
            self.pipeline.to(self.device)
        self._load_loras(loras)  # while offloaded: picked up at the next activation
        from ..core.discovery import discover_components

        self._timer = _StageTimer({c.name: (c.module, c.role)  # no local keeps the modules
                                   for c in discover_components(self.pipeline, self.component_roles)})
        self.tracer: TraceRecorder | None = None
        if trace:
            self.tracer = TraceRecorder()
            if self.backend is not None:
                for weights in self.backend.components.values():
                    if weights.selected and weights.role != "block":  # blocks: the streamer's events
                        self.tracer.watch(weights, weights.resident)
                layer = isinstance(self.backend, LayerwiseOffloadBackend)
                streamer = self.backend.streamer if layer else None
                if streamer is not None:  # layer mode: block spans on the component lanes
                    streamer.listeners.append(self.tracer.on_block)
        self._call_params = set(inspect.signature(self.pipeline.__call__).parameters)
        self.knobs, self.refused_args = knob_table(self.pipeline.__call__)
        self._own_config = dict(self.pipeline.config)  # check_request's view: never an override
        self._variants: dict[str, tuple[Any, dict[str, Any], dict[str, str]]] = {}
        self._variant_lock = threading.Lock()
        self.admission = admission_for(self, self._call_params) if admission else None
        self.load_seconds = time.perf_counter() - start
        self._load_reported = False

    # ------------------------------------------------------------------ helpers

    def _load_loras(self, loras: Sequence[tuple[str, float]]) -> None:
        """Load each ``(path, scale)`` with diffusers' ``load_lora_weights`` (adapters
        ``lora_0``, ``lora_1``, ...) and activate them all with their scales."""
        if not loras:
            return
        cls = type(self.pipeline).__name__
        if not hasattr(self.pipeline, "load_lora_weights"):
            raise ValueError(f"lora: {cls} takes no LoRA weights (it has no load_lora_weights)")
        check_peft()
        names = []
        for i, (path, _scale) in enumerate(loras):
            name = f"lora_{i}"
            try:
                self.pipeline.load_lora_weights(path, adapter_name=name)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                message = " ".join(str(exc).split())
                raise ValueError(f"lora {path!r} cannot be loaded into {cls}: {message}") from None
            names.append(name)
        self.pipeline.set_adapters(names, adapter_weights=[float(scale) for _, scale in loras])

    def _auto_config(self, shape: Mapping[str, int | None] | None,
                     layer_blocks: Mapping[str, Sequence[str]] | None,
                     budget: bool, host_budget: int | None = None
                     ) -> tuple[DiffusionOffloadConfig | None, int | None]:
        """Resolve ``diffusion_offload_config="auto"`` with the planner (logged in one line):
        the config and the ``device_memory_budget`` to run (None: none picked); a candidate
        whose RAM-only host copies exceed ``host_budget`` (bytes) is not picked."""
        if self.platform.is_noop:
            logger.info("diffusion_offload_config=auto on the cpu: no offload (a no-op there)")
            return None, None
        from ..planner.auto import auto_config

        choice = auto_config(
            self.info.path, device_kind=self.device.type,
            free_bytes=self.platform.memory_stats().free_bytes, dtype=self.dtype,
            variant=self.variant, component_roles=self.component_roles, shape=shape,
            modes=("module", "layer"), layer_blocks=layer_blocks,
            budget=budget, host_memory_budget=host_budget,
        )
        self.plan_choice = choice.row
        self.plan_message = choice.message
        logger.info(choice.message)
        return choice.config, choice.budget

    def _planned_advice(self, free: int, shape: Mapping[str, int | None] | None,
                        layer_blocks: Mapping[str, Sequence[str]] | None) -> str | None:
        """The fit check's suggestion from the planner's predicted peaks (what ``auto``
        would run at ``shape``, or that nothing fits); None when the planner cannot plan
        this model (the resting-footprint suggestion is used then)."""
        from ..models.fit import FitError
        from ..planner.auto import auto_config

        try:
            choice = auto_config(
                self.info.path, device_kind=self.device.type, free_bytes=free, dtype=self.dtype,
                variant=self.variant, component_roles=self.component_roles, shape=shape,
                modes=("module", "layer"), layer_blocks=layer_blocks,
            )
        except FitError as exc:
            return f"the planner predicts that {str(exc).removeprefix(AUTO_PREFIX)}"
        except Exception:  # noqa: BLE001 - advice only: fall back to the resting footprints
            if logger.isEnabledFor(logging.DEBUG):  # as text: a kept record keeps no frames
                import traceback

                logger.debug("the planner could not advise on the fit:\n%s", traceback.format_exc())
            return None
        flags = f"--diffusion-offload-config '{choice.config.to_json()}'" if choice.config else "no offload"
        if choice.budget is not None:
            flags += f" --device-memory-budget {choice.budget}B"
        return (f"try {flags} (the planner's pick '{choice.row.name}': predicted peak "
                f"{choice.row.peak_bytes} bytes)")

    def _check_roles(self, roles: Mapping[str, str] | None) -> dict[str, str] | None:
        if roles is None:
            return None
        if not isinstance(roles, Mapping):
            raise TypeError(f"component_roles must be a mapping name -> role, got {roles!r}")
        for name, role in roles.items():
            if name not in self.info.components:
                raise ValueError(
                    f"component_roles names {name!r}, which is not a component of "
                    f"{self.info.pipeline_class}; components: {sorted(self.info.components)}"
                )
            if role not in ROLES:
                raise ValueError(f"component_roles[{name!r}]={role!r} is not allowed; allowed roles: {list(ROLES)}")
        return dict(roles)

    def _resolve_dtype(self, choice: str | torch.dtype) -> torch.dtype:
        if isinstance(choice, torch.dtype):
            return choice
        stored = self.info.checkpoint_dtype()
        return _SAFETENSORS_DTYPES.get(stored or "F32", torch.float32)

    @property
    def is_video(self) -> bool:
        """True for text-to-video pipelines (outputs carry ``frames``)."""
        return self.info.is_video

    @property
    def pipeline_class(self) -> str:
        """The served pipeline's diffusers class name (``model_index.json``'s)."""
        return self.info.pipeline_class

    @property
    def image_input(self) -> str | None:
        """How the served pipeline takes a prompt's ``image`` itself: ``"required"``
        (image-to-video), ``"optional"`` (an edit model) or None (edits run through its
        image-to-image variant). Raises RuntimeError once the engine is closed."""
        if self.pipeline is None:
            raise RuntimeError("this Omni engine is closed; build a new one to generate")
        return image_input(self.pipeline)

    @property
    def stats(self) -> TransferStats:
        """The engine's cumulative weight-move counters (zeros without offload)."""
        return self.backend.stats if self.backend is not None else TransferStats()

    def _pipeline_for(self, item: PromptItem) -> tuple[Any, dict[str, Any], dict[str, str]]:
        """``(pipeline, knobs, refused)`` that runs ``item``: the served pipeline, or with
        an image its image-to-image (with a mask, inpainting) variant, built once by
        diffusers' ``from_pipe`` so that it shares every weight and the offload hooks."""
        kind = variant_for(self.pipeline, item)
        if kind is None:
            return self.pipeline, self.knobs, self.refused_args
        with self._variant_lock:  # built at most once, also from check_request's thread
            return self._variant(kind)

    def _variant(self, kind: str) -> tuple[Any, dict[str, Any], dict[str, str]]:
        if kind not in self._variants:
            from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

            auto = AutoPipelineForInpainting if kind == "inpaint" else AutoPipelineForImage2Image
            what = "inpainting" if kind == "inpaint" else "image-to-image"
            try:
                variant = auto.from_pipe(self.pipeline)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{self.info.pipeline_class} has no {what} variant in diffusers, "
                                 f"so it cannot edit images ({exc})") from None
            base = self.pipeline
            variant.set_progress_bar_config(**getattr(base, "_progress_bar_config", {}))
            variant.progress_bar = lambda iterable=None, total=None: base.progress_bar(
                iterable=iterable, total=total)  # the served pipeline's bar: progress reports
            knobs, refused = knob_table(variant.__call__)
            self._variants[kind] = (variant, knobs, refused)
        return self._variants[kind]

    def knobs_for(self, mask: bool) -> tuple[dict[str, Any], dict[str, str]]:
        """``(knobs, refused)`` (``engine.knobs.knob_table``) of the pipeline that edits an
        image (``mask``: inpaints it); builds its variant once if it needs one.

        Raises:
            ValueError: the served pipeline has no such variant.
            RuntimeError: the engine was closed.
        """
        from PIL import Image

        if self.pipeline is None:
            raise RuntimeError("this Omni engine is closed; build a new one to generate")
        probe = Image.new("RGB", (1, 1))
        item = PromptItem("", images=(probe,), mask=probe if mask else None)
        _, knobs, refused = self._pipeline_for(item)  # not under the lock: a running job
        return knobs, refused

    def _prepare(self, prompts: Any, params: SamplingParams) -> list[tuple[PromptItem, Any, dict]]:
        items = normalize_prompts(prompts)
        out = []
        for item in items:
            if item.negative is not None and "negative_prompt" not in self._call_params:
                raise ValueError(f"{self.info.pipeline_class} takes no negative_prompt")
            pipe, knobs, refused = self._pipeline_for(item)
            if item.images is None and image_input(pipe) == "required":
                raise KnobError("image", f"{self.info.pipeline_class} makes its output from an "
                                         "input image: give 'image' (a PIL image) in the prompt "
                                         "mapping (generate --image PATH)")
            kwargs = call_kwargs(pipe, knobs, refused, params, item.negative is not None)
            if self.admission is not None and pipe is self.pipeline and item.images is None:
                self.admission.check_call(kwargs, item.negative is not None)
            frames = kwargs.get("num_frames")
            factor = getattr(self.pipeline, "vae_scale_factor_temporal", None)
            if frames is not None and isinstance(factor, int) and factor > 1 and (frames - 1) % factor:
                raise ValueError(
                    f"SamplingParams.num_frames={frames} is not allowed by {self.info.pipeline_class}: "
                    f"num_frames - 1 must be a multiple of {factor} (e.g. {frames - (frames - 1) % factor})"
                )
            out.append((item, pipe, kwargs))
        return out

    def check_request(self, prompts: Any, sampling_params: SamplingParams | None = None) -> None:
        """Check a request as ``generate`` would, and with the pipeline's own
        ``check_inputs``, without running it (``serve`` calls this as a request arrives).

        Thread-safe without the engine's lock: the pipeline is seen with its own config,
        never a running request's ``boundary_ratio``.

        Raises:
            TypeError, ValueError: what ``generate`` would raise before running, or what
                the pipeline's ``check_inputs`` raises (its message kept).
            RuntimeError: the engine was closed.
        """
        if self.pipeline is None:
            raise RuntimeError("this Omni engine is closed; build a new one to generate")
        params = sampling_params or SamplingParams()
        for item, pipe, kwargs in self._prepare(prompts, params):
            own = self._own_config if pipe is self.pipeline else dict(pipe.config)
            check_request(pipe, own, item, kwargs, params)

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts: str | Mapping[str, str] | Sequence[str | Mapping[str, str]],
        sampling_params: SamplingParams | None = None,
    ) -> list[GenerationOutput]:
        """Generate one output per prompt.

        Args:
            prompts: a prompt string, a dict with ``prompt`` and optionally
                ``negative_prompt``, ``image`` (a PIL image or a list of them: an edit,
                run by the pipeline itself when its ``__call__`` takes ``image``, else by
                its image-to-image variant) and ``mask`` (a PIL image: the inpainting
                variant), or a list of them.
            sampling_params: ``SamplingParams``; None fields take the pipeline's defaults;
                its ``flow_shift``/``boundary_ratio`` hold for this call only (the model's own
                are restored after it, also when it raises). A negative prompt on a
                pipeline that uses it only with ``true_cfg_scale > 1`` (FLUX) gets
                ``true_cfg_scale`` 4.0 when unset (``engine.knobs.DEFAULT_TRUE_CFG_SCALE``).

        Returns:
            One ``GenerationOutput`` per prompt, in order.

        Raises:
            TypeError, ValueError: malformed prompts or unsupported parameters; a
                ``KnobError`` (a ``ValueError``, ``field="image"``) for a prompt without
                ``image`` on a pipeline that needs one (image-to-video).
            RuntimeError: the engine was closed.
            torch.OutOfMemoryError: the device ran out of memory; the message names
                the stage and the component being loaded.
        """
        with self._lock:  # one request at a time: no thread evicts a component mid-forward
            if self.pipeline is None:
                raise RuntimeError("this Omni engine is closed; build a new one to generate")
            self.wake()
            params = sampling_params or SamplingParams()
            outputs = []
            for item, pipe, kwargs in self._prepare(prompts, params):
                with request_overrides(pipe, params):
                    outputs.append(self._run(pipe, item, params, kwargs))
            return outputs

    def _run(
        self, pipe: Any, item: PromptItem, params: SamplingParams, kwargs: dict[str, Any]
    ) -> GenerationOutput:
        prompt, negative = item.prompt, item.negative
        n = params.num_outputs_per_prompt or 1
        seed = params.seed or 0
        self.platform.reset_peak_memory()
        before = self.stats.snapshot()
        images: list = []
        videos: list = []
        timings = {stage: 0.0 for stage in _STAGES}
        request_start = time.perf_counter()
        with PeakHostMemory() as host:
            for i in range(n):
                call = dict(kwargs)
                if negative is not None:
                    call["negative_prompt"] = negative
                call.update(item.images_kwargs())
                generator = torch.Generator("cpu").manual_seed(seed + i)
                self._timer.reset()
                try:
                    result = pipe(prompt=prompt, generator=generator, output_type="pil", **call)
                except torch.OutOfMemoryError as exc:
                    raise torch.OutOfMemoryError(
                        f"device out of memory during stage {self._timer.stage!r}: {exc}"
                    ) from exc
                end = time.perf_counter()
                for stage, (s, e) in self._timer.spans(end).items():
                    timings[stage] += e - s
                    if self.tracer is not None:
                        self.tracer.span(stage, "stages", s, e, prompt=prompt, output=i)
                if self.is_video:
                    videos.append(list(result.frames[0]))
                else:
                    images.append(result.images[0])
        total = time.perf_counter() - request_start
        timings["total"] = total
        if not self._load_reported:  # the load belongs to the first request only
            self._load_reported = True
            timings = {"load": self.load_seconds, **timings}
        peak = self.platform.memory_stats().peak_bytes
        return GenerationOutput(
            prompt=prompt,
            images=None if self.is_video else images,
            frames=videos if self.is_video else None,
            timings=timings,
            peak_device_memory_bytes=peak,
            peak_host_memory=dict(host.peak),
            offload_stats=self.stats.since(before).as_dict(),
            negative_prompt=negative,
        )

    def trace_dict(self) -> dict[str, Any]:
        """The Chrome trace of everything recorded so far.

        Raises:
            RuntimeError: the engine was built with ``trace=False``.
        """
        if self.tracer is None:
            raise RuntimeError("tracing is off: build Omni(..., trace=True)")
        return self.tracer.to_dict()

    @property
    def asleep(self) -> bool:
        """Whether ``sleep`` emptied the device and no request has run since."""
        return self.backend is not None and self.backend.asleep

    def sleep(self) -> int:
        """Move every weight of the pipeline to the host (``backend.sleep``: no device-to-host
        copy of an unmodified weight) and empty the device cache; the next ``generate`` wakes
        it. Returns the weight bytes that left the device.

        Raises:
            RuntimeError: the engine was not built ``sleepable=True`` with an offload config.
        """
        with self._lock:
            if self.backend is None or not self.backend.mover.keep_host:
                raise RuntimeError("sleep() needs Omni(..., sleepable=True) with an offload config")
            freed = self.backend.sleep()
            self.platform.empty_cache()
            return freed

    def wake(self) -> int:
        """Undo ``sleep`` (``generate`` calls it): returns the H2D bytes, 0 when awake."""
        with self._lock:
            return 0 if self.backend is None else self.backend.wake()

    def close(self) -> None:
        """Disable offload, drop the pipeline and empty the device cache (idempotent)."""
        with self._lock:
            if getattr(self, "pipeline", None) is None:
                return
            if self.backend is not None:
                self.backend.disable()
            self._timer.remove()
            clear_method_caches(self.pipeline)
            self.pipeline = None
            gc.collect()
            self.platform.empty_cache()

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_peft() -> None:
    """Raise ``ImportError`` naming the ``lora`` extra when peft (which diffusers' LoRA
    loading needs) is not installed."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ImportError("loading a LoRA needs peft, which is not installed; install it with "
                          "pip install 'diffusion_offload[lora]'")


def build_omni(model: str | Path, config: Any, *, variant: str | None = None,
               max_pinned_bytes: int | None = None, **kwargs: Any) -> Any:
    """``Omni(model, config, variant=..., max_pinned_bytes=..., **kwargs)``: the engine of
    ``generate`` and ``serve``, built in one place.

    Raises:
        Whatever ``Omni`` raises.
    """
    return Omni(str(model), config, variant=variant, max_pinned_bytes=max_pinned_bytes, **kwargs)
