"""Admission before OOM (issue 35 item 4): refuse a request whose device peak cannot fit.

Before a request runs (``Omni.check_request``, which ``serve`` calls before it queues a
job, and ``Omni.generate``), the planner predicts its device peak, weights plus
activations, for the engine's own config and device budget at the request's height, width,
frames and steps (``planner.plan.predict_peak``: a replay on the meta device, nothing
read). ``n`` outputs run one after another, so ``n`` does not change the peak.

The rule never refuses a request that would have run: the planner's predictions are held
within ``[measured, MARGIN x measured]`` on the fake device (``tests/test_planner_tiny.py``),
so a request is refused only when ``predicted / MARGIN``, a lower bound of its real peak,
exceeds the device's total memory. A request between the two bounds is admitted (it may
still run out of memory; the engine's error then names the stage). The refusal is a
``FitError`` naming the model, the predicted peak, the device bytes and the largest size
(for a video: and the most frames at the asked size) whose predicted peak fits.

Where the planner has no rule for the model or config (no activation model for the
pipeline, the legacy switch, a quantized or sharded load), admission stays off for that
engine and says so once in the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..models.fit import FitError
from ..models.rules import ModelRules

__all__ = ["MARGIN", "Admission", "AdmissionError", "Shape", "admission_for"]

logger = logging.getLogger("diffusion_offload")

MARGIN = 1.10
"""The planner's tested error bound: measured peak <= predicted <= ``MARGIN`` x measured
(``tests/test_planner_tiny.py``, every candidate of every tiny family)."""

Shape = tuple[int, int, "int | None", int, "bool | None", "int | None"]
"""``(height, width, num_frames or None, steps, cfg, max_sequence_length or None)`` of a
request (pixels, frames, steps, text tokens), as ``planner.stages.Request`` takes them."""


class AdmissionError(FitError):
    """A request refused before it ran: its predicted device peak cannot fit the device.

    Under ``serve`` the answer is a 400 with ``error.code`` = :attr:`error_code` and
    ``error.param`` = :attr:`field` (``"size"``), so a client tells it from other refusals.

    Attributes:
        field: the request field to change (``"size"``; for a video, or fewer frames).
        error_code: ``"admission_refused"``.
        peak: the predicted device peak (bytes).
        capacity: the device's total memory (bytes).
    """

    field = "size"
    error_code = "admission_refused"

    def __init__(self, message: str, peak: int, capacity: int) -> None:
        super().__init__(message)
        self.peak = peak
        self.capacity = capacity

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across Ray with its numbers
        return type(self), (str(self), self.peak, self.capacity)


class Admission:
    """The admission check of one engine.

    Args:
        name: the model as errors name it (a served model's id, or the model path).
        capacity: returns the device's total memory now (bytes; read at each check).
        predict: ``shape -> predicted peak`` (bytes) for the engine's config; raises
            ``ValueError`` when the planner cannot plan it (admission then turns off).
        rules: the model's size rules and defaults (``models.rules.model_rules``).
        takes_sequence_length: the pipeline's ``__call__`` takes ``max_sequence_length``.

    Attributes:
        enabled: False once the planner could not plan this engine.
        predictions: predicted peaks made so far, by shape (a cache: one meta replay a
            shape).
    """

    def __init__(self, name: str, capacity: Callable[[], int] | int, predict: Callable[[Shape], int],
                 rules: ModelRules, takes_sequence_length: bool = False) -> None:
        self.name = name
        self._capacity = capacity if callable(capacity) else (lambda: capacity)
        self._predict = predict
        self.rules = rules
        self.size_multiple = max(int(rules.size_multiple), 1)
        self.frame_step = rules.frame_step if rules.is_video else None
        self._takes_length = takes_sequence_length
        self.enabled = True
        self.predictions: dict[Shape, int] = {}
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """The device's total memory now (bytes)."""
        return int(self._capacity())

    def peak(self, shape: Shape) -> int | None:
        """The predicted device peak of ``shape`` (bytes), or None when admission is off."""
        with self._lock:
            if not self.enabled:
                return None
            if shape not in self.predictions:
                try:
                    self.predictions[shape] = int(self._predict(shape))
                except (ValueError, NotImplementedError, KeyError, TypeError) as exc:
                    self.enabled = False
                    logger.info("admission check off for %s: the planner cannot plan it (%s)",
                                self.name, exc)
                    return None
            return self.predictions[shape]

    def fits(self, shape: Shape) -> bool:
        """Whether ``shape`` may run: its peak's lower bound (``predicted / MARGIN``) is
        within the device (True when admission is off)."""
        peak = self.peak(shape)
        return peak is None or peak <= MARGIN * self.capacity

    def shape_of(self, kwargs: dict[str, Any], negative: bool) -> Shape | None:
        """The :data:`Shape` of one pipeline call's ``kwargs`` (omitted sizes take the
        model's defaults); ``cfg`` is the engine's rule with a negative prompt, and off
        without one (a lower bound: guidance may still run). None when a size is unknown."""
        values = self.rules.resolve({k: kwargs.get(k) for k in
                                     ("height", "width", "num_frames", "num_inference_steps")})
        height, width, steps = values.get("height"), values.get("width"), values.get("num_inference_steps")
        frames = values.get("num_frames") if self.rules.is_video else None
        if height is None or width is None or steps is None or (self.rules.is_video and frames is None):
            return None
        length = kwargs.get("max_sequence_length") if self._takes_length else None
        return (int(height), int(width), None if frames is None else int(frames), int(steps),
                None if negative else False, None if length is None else int(length))

    def check_call(self, kwargs: dict[str, Any], negative: bool) -> None:
        """``check`` the shape of one pipeline call (``shape_of``); nothing when unknown.

        Raises:
            AdmissionError: as ``check``.
        """
        shape = self.shape_of(kwargs, negative)
        if shape is not None:
            self.check(shape)

    def check(self, shape: Shape) -> None:
        """Refuse ``shape`` when it cannot fit the device.

        Raises:
            AdmissionError: the lower bound of its peak exceeds ``capacity``; the message
                names the model, the predicted peak, the device bytes and what fits.
        """
        peak, capacity = self.peak(shape), self.capacity  # one reading: the decision is the message's
        if peak is None or peak <= MARGIN * capacity:  # ``fits``
            return
        height, width, frames = shape[:3]
        what = f"{height}x{width}" + (f", {frames} frames" if frames is not None else "")
        raise AdmissionError(
            f"model {self.name!r} cannot run {what}: the planner predicts a device peak of "
            f"{peak} bytes (at least {int(peak / MARGIN)}), and the device has {capacity} "
            f"bytes; {self._what_fits(shape)}", peak, capacity)

    def _under(self, shape: Shape) -> bool:
        peak = self.peak(shape)
        return peak is not None and peak <= self.capacity

    def _what_fits(self, shape: Shape) -> str:
        """The largest size at the asked aspect (and frames) whose predicted peak fits, and
        for a video the most frames at the asked size."""
        height, width, frames = shape[:3]
        m = self.size_multiple
        tall = height >= width

        def scaled(k: int) -> Shape:  # k multiples on the longer side, the aspect kept
            long, short = (height, width) if tall else (width, height)
            other = max(m, int(round(k * m * short / long / m)) * m)
            h, w = (k * m, other) if tall else (other, k * m)
            return (h, w, *shape[2:])

        parts = []
        best = self._largest(lambda k: self._under(scaled(k)), max(height, width) // m)
        if best:
            h, w = scaled(best)[:2]
            parts.append(f"the largest size that fits is {h}x{w}"
                         + (f" at {frames} frames" if frames is not None else ""))
        if frames is not None and self.frame_step:
            step = self.frame_step
            most = self._largest(lambda k: self._under((height, width, 1 + (k - 1) * step, *shape[3:])),
                                 (frames - 1) // step + 1)
            if most:
                parts.append(f"at {height}x{width} at most {1 + (most - 1) * step} frames fit")
        if not parts:
            return "not even the smallest size fits: choose a config that keeps less on the device"
        return "; ".join(parts)

    @staticmethod
    def _largest(ok: Callable[[int], bool], upper: int) -> int:
        """The largest ``k`` in ``[1, upper)`` with ``ok(k)`` (a binary search: the peak
        grows with the size), 0 when none."""
        lo, hi = 0, max(upper, 1)  # ok(lo) holds (or lo == 0); hi is the refused one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo


def admission_for(engine: Any, call_params: set[str]) -> "Admission | None":
    """The :class:`Admission` of ``engine`` (an ``Omni``), or None where there is nothing to
    check: offload a no-op (device ``cpu``), no known device capacity, or a device budget
    still given as text. The planner's model is loaded at the first check (safetensors
    headers and meta modules, no weight read)."""
    from ..models.rules import model_rules

    budget = engine.device_memory_budget
    if engine.platform.is_noop or (budget is not None and not isinstance(budget, int)):
        return None
    if not engine.platform.memory_stats().total_bytes:
        return None
    rules = model_rules(engine.info)
    state: dict[str, Any] = {}

    def predict(shape: Shape) -> int:
        from ..planner.model import load_plan_model
        from ..planner.plan import predict_peak
        from ..planner.stages import Request

        if "pm" not in state:
            state["pm"] = load_plan_model(engine.info.path, variant=engine.variant, dtype=engine.dtype,
                                          component_roles=engine.component_roles)
        return predict_peak(state["pm"], Request(*shape), engine.config, budget,
                            device_kind=engine.device.type)

    def capacity() -> int:
        return engine.platform.memory_stats().total_bytes or 0

    return Admission(engine.name, capacity, predict, rules, "max_sequence_length" in call_params)
