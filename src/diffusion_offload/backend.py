"""``ModelLevelOffloadBackend``: model-level (sequential) offload of a pipeline.

Only the executing component group sits on the device: DiTs and text encoders take
turns, VAEs stay resident, host copies are pinned (SPEC section 4). ``enable`` is
transactional: it validates everything first, and if any move or hook install fails it
removes the hooks it installed and puts every tensor back where it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .config import DiffusionOffloadConfig, parse_diffusion_offload_config
from .discovery import Component, discover_components
from .hooks import HookHandle, SequentialOffloadHook, attach_hook
from .platform import Platform, platform_for
from .split import SupportsModelCpuOffload
from .transfer import ComponentWeights, Mover, TensorSlot, TransferStats, collect_tensors

__all__ = ["ModelLevelOffloadBackend"]

logger = logging.getLogger(__name__)

_ENCODER_ROLES = ("text_encoder", "encoder")
_STAGE_ROLES = ("dit", "text_encoder", "encoder", "vae")


class ModelLevelOffloadBackend:
    """Model-level offload: one hook per execution-stage module, mutual exclusion of groups.

    Args:
        config: a ``DiffusionOffloadConfig`` or a mapping/JSON accepted by
            ``parse_diffusion_offload_config`` (``mode`` must be ``"module"``).
        device: the accelerator (``"cuda"``, ``"cuda:1"``, ``"fakegpu"``...). On ``cpu``
            offload is a documented no-op: ``enable`` installs nothing.
        component_roles: role overrides for discovery (name -> role).
        use_hsdp: passed to split models (``SupportsModelCpuOffload``).

    Raises:
        TypeError, ValueError: an invalid config (see ``parse_diffusion_offload_config``)
            or device.
        NotImplementedError: ``mode="layer"`` (not implemented yet).
    """

    def __init__(
        self,
        config: DiffusionOffloadConfig | Mapping[str, Any] | str,
        device: str | torch.device | int,
        *,
        component_roles: Mapping[str, str] | None = None,
        use_hsdp: bool = False,
    ) -> None:
        parsed = parse_diffusion_offload_config(config)
        if parsed is None:
            raise ValueError("config must not be None; pass a diffusion_offload_config")
        if parsed.mode != "module":
            raise NotImplementedError(
                f"mode={parsed.mode!r} has no backend yet; ModelLevelOffloadBackend "
                "implements mode='module'"
            )
        self.config = parsed
        self.platform: Platform = platform_for(device)
        self.device = self.platform.device
        self.component_roles = dict(component_roles) if component_roles else None
        self.use_hsdp = use_hsdp
        self.mover = Mover(self.platform, parsed.pin_memory)
        self.components: dict[str, ComponentWeights] = {}
        self.modules: dict[str, torch.nn.Module] = {}
        self._handles: list[HookHandle] = []
        self._delegate: SupportsModelCpuOffload | None = None
        self._enabled = False

    # ------------------------------------------------------------------ public API

    @property
    def stats(self) -> TransferStats:
        """The engine's counters of weight moves (bytes, loads, evictions, seconds)."""
        return self.mover.stats

    def is_enabled(self) -> bool:
        """Whether ``enable`` has completed and ``disable`` has not."""
        return self._enabled

    def enable(self, pipeline: Any) -> None:
        """Install model-level offload on ``pipeline`` (idempotent).

        Afterwards the selected DiTs are on the host and everything else on the device;
        each DiT, encoder and VAE module carries one ``SequentialOffloadHook``.

        Raises:
            ValueError: the selection cannot be honoured (no DiT, no encoder stage, or
                ``text_encoder`` selected but none found); nothing was changed.
            TypeError: the pipeline's components cannot be discovered.
            torch.OutOfMemoryError: the device cannot hold what must be resident; every
                hook and tensor was rolled back.
        """
        if self._enabled:
            return
        if isinstance(pipeline, SupportsModelCpuOffload):
            self._enable_delegated(pipeline)
            return
        components = discover_components(pipeline, self.component_roles)
        self._check_selection(components)
        if self.platform.is_noop:
            logger.info("device is cpu: model-level offload is a no-op (nothing to offload to)")
            self._enabled = True
            return
        weights = self._build(components)
        undo: list[tuple[TensorSlot, torch.Tensor]] = []
        handles: list[HookHandle] = []
        try:
            self._establish(weights, undo)
            for comp in components:
                if comp.role not in _STAGE_ROLES:
                    continue
                hook = SequentialOffloadHook(
                    weights[comp.name],
                    self._exclusion(comp, weights),
                    self._companions(comp, weights),
                )
                handles.append(attach_hook(comp.module, hook))
        except BaseException:
            for handle in reversed(handles):
                handle.remove()
            with torch.inference_mode(False), torch.no_grad():
                for slot, old in reversed(undo):
                    torch.utils.swap_tensors(slot.tensor, old)
            raise
        self.components = weights
        self.modules = {c.name: c.module for c in components}
        self._handles = handles
        self._enabled = True

    def disable(self) -> None:
        """Remove every hook this backend installed; tensors stay where they are.

        Raises:
            Exception: whatever a hook removal raised; the backend then stays enabled
                and calling ``disable`` again removes the remaining hooks.
        """
        if not self._enabled:
            return
        if self._delegate is not None:
            self._delegate.disable_omni_model_cpu_offload()
            self._delegate = None
        while self._handles:
            self._handles[-1].remove()
            self._handles.pop()
        self.components = {}
        self.modules = {}
        self._enabled = False

    # ------------------------------------------------------------------ internals

    def _enable_delegated(self, pipeline: SupportsModelCpuOffload) -> None:
        kwargs: dict[str, Any] = {
            "device": self.device,
            "pin_memory": self.config.pin_memory,
            "use_hsdp": self.use_hsdp,
        }
        if self.config.explicit:
            kwargs["offload_components"] = self.config.components
        try:
            pipeline.enable_omni_model_cpu_offload(**kwargs)
        except BaseException:
            pipeline.disable_omni_model_cpu_offload()
            raise
        self._delegate = pipeline
        self._enabled = True

    def _check_selection(self, components: list[Component]) -> None:
        roles = [c.role for c in components]
        names = {c.name: c.role for c in components}
        if self.config.selects("dit") and "dit" not in roles:
            raise ValueError(
                f"components includes 'dit' but the pipeline has no DiT; discovered: {names}"
            )
        if self.config.selects("text_encoder") and "text_encoder" not in roles:
            raise ValueError(
                "components includes 'text_encoder' but the pipeline has no text encoder; "
                f"discovered: {names}"
            )
        if self.config.explicit and not any(r in _ENCODER_ROLES for r in roles):
            raise ValueError(
                "model-level offload needs an encoder stage for mutual exclusion with the "
                f"DiTs, but the pipeline declares none; discovered: {names}"
            )

    def _build(self, components: list[Component]) -> dict[str, ComponentWeights]:
        selected = {c.name: self.config.offloads_role(c.role) for c in components}
        owners: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        per_comp: dict[str, list[torch.Tensor]] = {}
        for comp in components:
            per_comp[comp.name] = collect_tensors(comp.module)
            for t in per_comp[comp.name]:
                owners.setdefault(id(t), []).append(comp.name)
                tensors[id(t)] = t
        slots = {
            key: TensorSlot(t, evictable=all(selected[n] for n in owners[key]))
            for key, t in tensors.items()
        }
        return {
            comp.name: ComponentWeights(
                comp.name,
                comp.role,
                selected[comp.name],
                [slots[id(t)] for t in per_comp[comp.name]],
                self.mover,
            )
            for comp in components
        }

    def _establish(
        self, weights: dict[str, ComponentWeights], undo: list[tuple[TensorSlot, torch.Tensor]]
    ) -> None:
        """Selected DiTs on the host, everything else on the device (evict before load)."""
        mover = self.mover
        unique = {id(s): s for w in weights.values() for s in w.slots}
        for slot in unique.values():
            if slot.evictable:
                mover.adopt(slot, undo)
        for w in weights.values():
            if w.selected and w.role == "dit":
                for slot in w.slots:
                    mover.evict(slot, undo)
                w.resident = False
        for slot in unique.values():
            if not slot.evictable:
                mover.place(slot, undo)
        for w in weights.values():
            if w.selected and w.role != "dit":
                for slot in w.slots:
                    mover.load(slot, undo)
                w.resident = True
        self.platform.synchronize()

    def _exclusion(
        self, comp: Component, weights: dict[str, ComponentWeights]
    ) -> list[ComponentWeights]:
        selected = [w for w in weights.values() if w.selected]
        if comp.role == "dit":
            return [w for w in selected if w.name != comp.name]
        if comp.role in _ENCODER_ROLES:
            return [w for w in selected if w.role == "dit"]
        return []

    def _companions(
        self, comp: Component, weights: dict[str, ComponentWeights]
    ) -> list[ComponentWeights]:
        """A selected encoder loads the whole selected encoder group (they run back to back)."""
        if comp.role in _ENCODER_ROLES and weights[comp.name].selected:
            return [w for w in weights.values() if w.selected and w.role in _ENCODER_ROLES]
        return []

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"ModelLevelOffloadBackend({self.config.to_json()}, {self.device}, {state})"
