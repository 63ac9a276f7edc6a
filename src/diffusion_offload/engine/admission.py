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

__all__ = ["MARGIN", "Admission", "Shape"]

logger = logging.getLogger("diffusion_offload")

MARGIN = 1.10
"""The planner's tested error bound: measured peak <= predicted <= ``MARGIN`` x measured
(``tests/test_planner_tiny.py``, every candidate of every tiny family)."""

Shape = tuple[int, int, "int | None", int, "bool | None"]
"""``(height, width, num_frames or None, steps, cfg)`` of a request (pixels, frames, steps)."""


class Admission:
    """The admission check of one engine.

    Args:
        name: the model as errors name it (a served model's id, or the model path).
        capacity: the device's total memory (bytes).
        predict: ``shape -> predicted peak`` (bytes) for the engine's config; raises
            ``ValueError`` when the planner cannot plan it (admission then turns off).
        size_multiple: height and width must be multiples of this (pixels).
        frame_step: ``num_frames - 1`` must be a multiple of this (video), or None.

    Attributes:
        enabled: False once the planner could not plan this engine.
        predictions: predicted peaks made so far, by shape (a cache: one meta replay a
            shape).
    """

    def __init__(self, name: str, capacity: int, predict: Callable[[Shape], int],
                 size_multiple: int, frame_step: int | None) -> None:
        self.name = name
        self.capacity = capacity
        self._predict = predict
        self.size_multiple = max(int(size_multiple), 1)
        self.frame_step = frame_step
        self.enabled = True
        self.predictions: dict[Shape, int] = {}
        self._lock = threading.Lock()

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

    def check(self, shape: Shape) -> None:
        """Refuse ``shape`` when it cannot fit the device.

        Raises:
            FitError: the lower bound of its peak exceeds ``capacity``; the message names
                the model, the predicted peak, the device bytes and what fits.
        """
        if self.fits(shape):
            return
        peak = self.peak(shape)
        height, width, frames, steps, cfg = shape
        what = f"{height}x{width}" + (f", {frames} frames" if frames is not None else "")
        raise FitError(
            f"model {self.name!r} cannot run {what}: the planner predicts a device peak of "
            f"{peak} bytes (at least {int(peak / MARGIN)}), and the device has {self.capacity} "
            f"bytes; {self._what_fits(shape)}"
        )

    def _under(self, shape: Shape) -> bool:
        peak = self.peak(shape)
        return peak is not None and peak <= self.capacity

    def _what_fits(self, shape: Shape) -> str:
        """The largest size at the asked aspect (and frames) whose predicted peak fits, and
        for a video the most frames at the asked size."""
        height, width, frames, steps, cfg = shape
        m = self.size_multiple
        tall = height >= width

        def scaled(k: int) -> Shape:  # k multiples on the longer side, the aspect kept
            long, short = (height, width) if tall else (width, height)
            other = max(m, int(round(k * m * short / long / m)) * m)
            h, w = (k * m, other) if tall else (other, k * m)
            return (h, w, frames, steps, cfg)

        parts = []
        best = self._largest(lambda k: self._under(scaled(k)), max(height, width) // m)
        if best:
            h, w = scaled(best)[:2]
            parts.append(f"the largest size that fits is {h}x{w}"
                         + (f" at {frames} frames" if frames is not None else ""))
        if frames is not None and self.frame_step:
            step = self.frame_step
            most = self._largest(lambda k: self._under((height, width, 1 + (k - 1) * step, steps, cfg)),
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


def build_admission(name: str, capacity: int | None, model_path: str, config: Any,
                    device_memory_budget: Any, device_kind: str, dtype: Any, variant: str | None,
                    component_roles: Any, size_multiple: int, frame_step: int | None) -> Admission | None:
    """The :class:`Admission` of an engine, or None where there is nothing to check (no
    known device capacity, a device budget given as a fraction still unresolved)."""
    if not capacity or (device_memory_budget is not None and not isinstance(device_memory_budget, int)):
        return None
    state: dict[str, Any] = {}

    def predict(shape: Shape) -> int:
        from ..planner.model import load_plan_model
        from ..planner.plan import predict_peak
        from ..planner.stages import Request

        if "pm" not in state:
            state["pm"] = load_plan_model(model_path, variant=variant, dtype=dtype,
                                          component_roles=component_roles)
        height, width, frames, steps, cfg = shape
        return predict_peak(state["pm"], Request(height, width, frames, steps, cfg), config,
                            device_memory_budget, device_kind=device_kind)

    return Admission(name, capacity, predict, size_multiple, frame_step)
