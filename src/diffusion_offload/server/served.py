"""The models a server serves, and which one a request names.

A server holds one engine (``Omni``) or several behind one device (``engine.pool``'s
``ModelPool``: its ``views``). Each is a ``ServedModel``: its id (the ``model`` of
requests and of ``/v1/models``), its engine, and the limits and defaults the routes check
its requests against (its own pipeline's knobs, size multiple, frame step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine_adapter import call_params, frame_step
from .errors import APIError
from .schemas import Limits

__all__ = ["ServedModel", "describe", "engine_views", "model_limits", "route"]


@dataclass
class ServedModel:
    """One served model.

    Attributes:
        id: its id (``model`` in requests).
        engine: its engine (``generate``, ``is_video``...; a ``PoolModel`` in a pool).
        limits: what its requests are checked against (``schemas.Limits``).
        rules: its ``models.rules.ModelRules`` (None for test doubles).
    """

    id: str
    engine: Any
    limits: Limits
    rules: Any


def engine_views(engine: Any, model_id: str) -> dict[str, Any]:
    """id -> engine of what ``engine`` serves: a pool's ``views()``, else ``{model_id: engine}``."""
    views = getattr(engine, "views", None)
    return dict(views()) if callable(views) else {model_id: engine}


def model_limits(engine: Any, settings: Any, max_frames_default: Any) -> tuple[Limits, Any]:
    """``(limits, rules)`` of ``engine``'s model under the server ``settings``: the size
    multiple, frame step, largest side and frames of its rules (``models.rules``), its
    call's parameters and knob table. ``max_frames_default(settings, step)`` gives the
    frames limit when ``--max-frames`` is not set."""
    info = getattr(engine, "info", None)
    rules = None
    if info is not None and hasattr(info, "pipeline_class"):
        from ..models.rules import model_rules

        rules = model_rules(info)
    step = rules.frame_step if rules is not None else frame_step(engine)
    knobs = getattr(engine, "knobs", None)
    limits = Limits(
        settings.max_pixels,
        max_frames_default(settings, step),
        settings.max_steps,
        settings.size_multiple or (rules.size_multiple if rules is not None else 16),
        step,
        call_params(engine),
        rules.max_side if rules is not None else None,
        rules.max_frames if rules is not None else None,
        rules.limit_source if rules is not None else "",
        knobs if isinstance(knobs, dict) else None,
        dict(getattr(engine, "refused_args", None) or {}),
    )
    return limits, rules


def route(models: dict[str, ServedModel], model: str | None, check: bool = True) -> ServedModel:
    """The served model a request's ``model`` field names.

    With one model, ``model`` is optional; a different id is a 400 when ``check`` (a
    request's; a queued job is routed unchecked). With several, it is required and must be
    one of theirs.

    Raises:
        APIError: 400 ``model_not_found`` (one model, another id), 400
            ``missing_required_parameter`` (several, none named), 404 ``model_not_found``
            (several, an unknown id); each names the served ids.
    """
    if len(models) == 1:
        only = next(iter(models.values()))
        if check and model is not None and model != only.id:
            raise APIError(400, f"Invalid value for 'model': this server serves {only.id!r}, not {model!r}.",
                           param="model", code="model_not_found")
        return only
    served = ", ".join(repr(m) for m in models)
    if model is None:
        raise APIError(400, f"Missing required parameter: 'model': this server serves several models "
                            f"({served}); name one.", param="model", code="missing_required_parameter")
    found = models.get(model)
    if found is None:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {served}.",
                       param="model", code="model_not_found")
    return found


def describe(engine: Any, model_id: str, runs: int) -> list[dict[str, Any]]:
    """Per served model, where its weights are now and what it did: a pool's
    ``describe()``; for one engine its ``device_bytes``, ``host_bytes`` (pinned, pageable,
    written), ``pinned_bytes``, ``pageable_bytes``, ``disk_bytes``, the jobs it ran
    (``runs``: ``requests``) and ``swaps`` 0. ``[]`` before the load, or for an engine
    that keeps no stats (a remote one)."""
    pooled = getattr(engine, "describe", None)
    if callable(pooled):
        return pooled()
    stats = getattr(engine, "stats", None)
    if stats is None:
        return []
    backend = getattr(engine, "backend", None)
    return [{
        "id": model_id,
        "device_bytes": 0 if backend is None else backend.device_weight_bytes(),
        "host_bytes": stats.pinned_bytes + stats.pageable_host_bytes + stats.cow_bytes,
        "pinned_bytes": stats.pinned_bytes,
        "pageable_bytes": stats.pageable_host_bytes,
        "disk_bytes": stats.disk_backed_bytes,
        "requests": runs,
        "swaps": 0,
    }]
