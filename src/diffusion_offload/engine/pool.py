"""Several models on one device: ``ModelPool``, ``Omni`` engines that take turns.

Each model is an ``Omni`` built ``sleepable`` (every tensor keeps a host copy, the VAEs and
unselected components too), so handing the device from one model to another moves no
unmodified weight device-to-host: the model that ran last is put to sleep
(``Omni.sleep``: evicted, zero D2H weight bytes), then the requested one runs, its resting
components loaded back (``Omni.wake``) and its offloaded ones loaded as they run, by the
offload rules of its own config. One request runs at a time, whatever the model.

The host budget is shared: each model gets a part of ``host_memory_budget`` proportional
to its stored weight bytes (``ModelInfo.component_bytes``), so the host copies of all
models together stay within it; what does not fit a model's part stays file-backed on
disk (``core.tiers``). A model's ``device_memory_budget`` (its own config's) applies while
it runs. One model is awake at a time: the others hold no weight bytes on the device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models.files import inspect_model, resolve_model

__all__ = ["DEFAULT_CONFIG", "ModelPool", "ModelSpec", "PoolModel", "UnknownModelError"]

DEFAULT_CONFIG: dict[str, Any] = {"mode": "module", "components": ["dit", "text_encoder"]}
"""The offload config of a pool model that gives none: module mode, DiTs and text encoders."""


class UnknownModelError(KeyError):
    """A model id the pool does not serve (the message names the served ids)."""

    def __init__(self, model: str, served: Sequence[str]) -> None:
        super().__init__(model)
        self.model = model
        self.served = tuple(served)

    def __str__(self) -> str:
        return f"the model {self.model!r} is not served here; served ids: {', '.join(self.served)}"


@dataclass(frozen=True)
class ModelSpec:
    """One model of a pool.

    Attributes:
        id: the id requests name it by (``model``); unique in the pool.
        path: the diffusers pipeline folder (or an id ``resolve_model`` finds).
        config: its offload config (``DEFAULT_CONFIG`` when None).
        variant: the weight file variant (``"fp16"``...), as ``Omni``'s.
        loras: ``(path, scale)`` pairs loaded at start, as ``Omni``'s.
        dtype: the dtype to load in (``Omni``'s ``dtype``; None: the stored one).
    """

    id: str
    path: str
    config: Any = None
    variant: str | None = None
    loras: tuple[tuple[str, float], ...] = ()
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or self.id != self.id.strip():
            raise ValueError(f"model id must be a non-empty string without outer spaces, got {self.id!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model {self.id!r}: path must be a non-empty string, got {self.path!r}")


@dataclass
class ModelCounts:
    """What one model of a pool has done: requests run, swaps in and their seconds."""

    requests: int = 0
    swaps: int = 0
    swap_seconds: float = 0.0
    last_used: float = field(default=0.0)


class ModelPool:
    """Several models behind one device and one host budget, one request at a time.

    Args:
        specs: the models (``ModelSpec``), ids unique.
        host_memory_budget: bytes for the host copies of all models together, ``"auto"``
            (``core.tiers.auto_host_budget``, measured before any model loads) or None (no
            budget); each model gets a part proportional to its stored weight bytes.
        build: ``build(spec, host_memory_budget) -> Omni``-like engine (tests inject one);
            default: ``Omni(spec.path, spec.config or DEFAULT_CONFIG, sleepable=True, ...)``
            with ``omni_kwargs`` (``device``, ``progress``, ``max_pinned_bytes``,
            ``device_memory_budget``, ``page_cache``...).
        omni_kwargs: passed to every ``Omni``.

    Attributes:
        engines: id -> its engine, in the order given.
        counts: id -> its ``ModelCounts``.
        active: the id of the model awake on the device, or None.
        listeners: ``listener(model_id, seconds)`` called after each swap (metrics).

    Raises:
        ValueError: no model, a repeated id, or an invalid spec (named).
        Whatever ``Omni`` raises for a model (its id is in the message); the engines
            built before it are closed.
    """

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        host_memory_budget: int | str | None = None,
        build: Callable[[ModelSpec, int | None], Any] | None = None,
        **omni_kwargs: Any,
    ) -> None:
        if not specs:
            raise ValueError("a model pool needs at least one model")
        dup = repeated_ids(specs)
        if dup:
            raise ValueError(f"model ids must be unique; repeated: {dup}")
        self._lock = threading.RLock()
        self.engines: dict[str, Any] = {}
        self.counts: dict[str, ModelCounts] = {s.id: ModelCounts() for s in specs}
        self.active: str | None = None
        self.listeners: list[Callable[[str, float], None]] = []
        if host_memory_budget == "auto":
            from ..core.tiers import auto_host_budget

            host_memory_budget = auto_host_budget()
        self.host_memory_budget = host_memory_budget
        parts = self._budget_parts(specs, host_memory_budget)
        make = build or (lambda spec, budget: _build_omni(spec, budget, omni_kwargs))
        try:
            for spec in specs:
                try:
                    engine = make(spec, parts[spec.id])
                except Exception as exc:
                    if _retypable(exc):
                        raise type(exc)(f"model {spec.id!r}: {exc}") from exc
                    raise
                self.engines[spec.id] = engine
                _sleep(engine)  # each model starts on the host: the device is the first request's
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _budget_parts(specs: Sequence[ModelSpec], budget: int | None) -> dict[str, int | None]:
        """Each model's part of ``budget``, proportional to its stored weight bytes (the
        last one takes the rounding), or None for every model without a budget."""
        if budget is None:
            return {s.id: None for s in specs}
        sizes = {}
        for s in specs:
            info = inspect_model(resolve_model(s.path), s.variant)
            sizes[s.id] = sum(info.component_bytes(name) for name in info.numels)
        total = sum(sizes.values()) or 1
        parts = {i: budget * n // total for i, n in sizes.items()}
        last = specs[-1].id
        parts[last] += budget - sum(parts.values())
        return parts

    def engine(self, model: str) -> Any:
        """The engine serving ``model``.

        Raises:
            UnknownModelError: not one of the pool's ids (they are named).
        """
        engine = self.engines.get(model)
        if engine is None:
            raise UnknownModelError(model, list(self.engines))
        return engine

    def generate(self, model: str, prompts: Any, sampling_params: Any = None) -> list[Any]:
        """``Omni.generate`` on ``model``, once the device is handed to it (``activate``).

        Raises:
            UnknownModelError: ``model`` is not served; whatever ``Omni.generate`` raises.
        """
        with self._lock:
            engine = self.activate(model)
            self.counts[model].requests += 1
            return engine.generate(prompts, sampling_params)

    def activate(self, model: str) -> Any:
        """Hand the device to ``model``: the awake model sleeps (zero D2H weight bytes for
        unmodified weights), then ``model`` wakes. Counted as a swap when the device
        changes hands (or the model was released); returns its engine."""
        with self._lock:
            engine = self.engine(model)
            counts = self.counts[model]
            counts.last_used = time.monotonic()
            if self.active == model and not getattr(engine, "asleep", False):
                return engine
            start = time.perf_counter()
            if self.active is not None and self.active != model:
                _sleep(self.engines[self.active])
            self.active = None
            engine.wake()
            self.active = model
            seconds = time.perf_counter() - start
            counts.swaps += 1
            counts.swap_seconds += seconds
            for listener in self.listeners:
                listener(model, seconds)
            return engine

    def release(self, model: str | None = None) -> int:
        """Put ``model`` (None: every model) to sleep: it holds no weight on the device until
        its next request. Returns the weight bytes that left the device.

        Raises:
            UnknownModelError: ``model`` is not served.
        """
        with self._lock:
            names = list(self.engines) if model is None else [model]
            freed = 0
            for name in names:
                freed += _sleep(self.engine(name))
                if self.active == name:
                    self.active = None
            return freed

    def describe(self) -> list[dict[str, Any]]:
        """One entry per model: ``id``, ``kind`` (``"image"`` or ``"video"``), its weight
        bytes on the device, in host RAM (pinned, pageable, written) and left on disk now,
        and its ``requests``, ``swaps`` and ``swap_seconds``."""
        out = []
        for name, engine in self.engines.items():
            backend = getattr(engine, "backend", None)
            s = engine.stats
            out.append({
                "id": name,
                "kind": "video" if engine.is_video else "image",
                "device_bytes": 0 if backend is None else backend.device_weight_bytes(),
                "host_bytes": s.pinned_bytes + s.pageable_host_bytes + s.cow_bytes,
                "pinned_bytes": s.pinned_bytes,
                "pageable_bytes": s.pageable_host_bytes,
                "disk_bytes": s.disk_backed_bytes,
                "requests": self.counts[name].requests,
                "swaps": self.counts[name].swaps,
                "swap_seconds": self.counts[name].swap_seconds,
                "awake": name == self.active,
            })
        return out

    def views(self) -> dict[str, "PoolModel"]:
        """id -> an engine-like view of that model whose ``generate`` goes through the pool
        (``PoolModel``), in the order given: what a server routes requests to."""
        return {name: PoolModel(self, name) for name in self.engines}

    def close(self) -> None:
        """Close every engine (idempotent)."""
        with self._lock:
            for engine in self.engines.values():
                engine.close()
            self.active = None

    def __enter__(self) -> "ModelPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PoolModel:
    """One model of a ``ModelPool`` seen as an engine: ``generate`` hands the device to it
    first (``ModelPool.generate``); every other attribute (``is_video``, ``knobs``,
    ``check_request``, ``pipeline``, ``stats``...) is its ``Omni``'s.

    Args:
        pool: the pool.
        model: the model's id in it.
    """

    def __init__(self, pool: ModelPool, model: str) -> None:
        self.pool = pool
        self.model_id = model

    def generate(self, prompts: Any, sampling_params: Any = None) -> list[Any]:
        """``ModelPool.generate(self.model_id, ...)``."""
        return self.pool.generate(self.model_id, prompts, sampling_params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool.engines[self.model_id], name)


def _build_omni(spec: ModelSpec, budget: int | None, kwargs: Mapping[str, Any]) -> Any:
    from .omni import Omni

    options = dict(kwargs)
    if budget is not None:
        options["host_memory_budget"] = budget
    return Omni(spec.path, spec.config if spec.config is not None else DEFAULT_CONFIG,
                variant=spec.variant, loras=spec.loras, dtype=spec.dtype, sleepable=True,
                name=spec.id, **options)


def repeated_ids(specs: Sequence[ModelSpec]) -> list[str]:
    """The ids given to more than one of ``specs``, sorted (``[]``: all unique)."""
    ids = [s.id for s in specs]
    return sorted({i for i in ids if ids.count(i) > 1})


def _sleep(engine: Any) -> int:
    """``engine.sleep()`` when it offloads and is awake (an engine without an offload
    backend, e.g. on the CPU, has nothing to move); the bytes freed."""
    if getattr(engine, "backend", None) is None or engine.asleep:
        return 0
    return engine.sleep()


def _retypable(exc: Exception) -> bool:
    """Whether ``type(exc)(message)`` rebuilds ``exc`` with a new message (plain errors)."""
    return type(exc) in (ValueError, TypeError, RuntimeError, OSError, NotImplementedError)
