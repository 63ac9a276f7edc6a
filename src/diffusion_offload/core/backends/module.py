"""``ModelLevelOffloadBackend``: model-level (sequential) offload of a pipeline.

Only the executing component group sits on the device: DiTs and text encoders take
turns, VAEs stay resident, host copies are pinned (SPEC section 4). With a
``device_memory_budget`` the residency policy (``core/policy.py``) keeps what fits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config import DiffusionOffloadConfig
from ..discovery import Component, DIT_GROUP_ROLES, ENCODER_ROLES, STAGE_ROLES
from ..hooks import SequentialOffloadHook, attach_hook
from ..policy import BudgetTooSmallError, MemoryPolicy, resolve_budget, smallest_budget
from ..residency import ComponentWeights, WeightTable, named_tensors
from .base import OffloadBackendBase
from .split import SupportsModelCpuOffload

__all__ = ["ModelLevelOffloadBackend"]

logger = logging.getLogger(__name__)


class ModelLevelOffloadBackend(OffloadBackendBase):
    """Model-level offload: one hook per execution-stage module, mutual exclusion of groups.

    Args: see ``OffloadBackendBase`` (``config``'s ``mode`` must be ``"module"``), and
        device_memory_budget: bytes of component weights that may stay resident, ``"auto"``
            (free device memory at enable minus max(10 % of the device, 1 GiB) for
            activations; unlimited on the fake device without a capacity), or None (the
            default): the strict rule. See ``diffusion_offload.core.policy``.

    Raises:
        TypeError, ValueError: an invalid config (``mode="layer"``: use
            ``LayerwiseOffloadBackend``), device or ``max_pinned_bytes``.
    """

    MODE = "module"

    def __init__(
        self,
        config: DiffusionOffloadConfig | Mapping[str, Any] | str,
        device: str | torch.device | int,
        *,
        component_roles: Mapping[str, str] | None = None,
        use_hsdp: bool = False,
        max_pinned_bytes: int | None = None,
        device_memory_budget: int | str | None = None,
        host_memory_budget: int | str | None = None,
        weights_from: str | os.PathLike[str] | None = None,
        page_cache: str = "auto",
        sleepable: bool = False,
    ) -> None:
        super().__init__(
            config,
            device,
            component_roles=component_roles,
            use_hsdp=use_hsdp,
            max_pinned_bytes=max_pinned_bytes,
            host_memory_budget=host_memory_budget,
            weights_from=weights_from,
            page_cache=page_cache,
            sleepable=sleepable,
        )
        if device_memory_budget is not None:
            # validate now (the bytes of "auto" are measured at enable)
            if device_memory_budget != "auto":
                resolve_budget(device_memory_budget, self.platform)
            elif not isinstance(device_memory_budget, str):
                raise TypeError(f"device_memory_budget must be bytes, 'auto' or None, got {device_memory_budget!r}")
        self.device_memory_budget = device_memory_budget
        self.policy: MemoryPolicy | None = None
        self._encoders_rest_on_device = True

    def audit(self) -> list[str]:
        """Every breach of the residency invariant; ``[]`` when all holds.

        Checked: each tensor of a selected component is on the side its ``resident``
        flag says (device when resident, host when evicted) and each tensor of an
        unselected component, or shared with one, is on the device; a tensor that sits
        in a component's modules but is not managed is reported, unless a pending
        structural change explains it and it holds no device memory of an evicted
        component; and no two groups (a selected DiT, the selected encoders) are
        resident at once. O(tensors); meant for tests and debugging.
        """
        with self.lock:
            if not self._enabled or self._table is None:
                return []
            out = self._placement_breaches()
            groups: dict[str, list[str]] = {}
            if self.policy is not None and not self.policy.strict:
                budget = self.policy.budget
                resident = self.policy.resident_bytes()
                if budget is not None and resident > budget and not any(
                    c.pending is not None for c in self.components.values()
                ):
                    out.append(f"{resident} bytes of weights resident, over the budget of {budget}")
                return out
            adapters = []
            for comp in self.components.values():
                if comp.selected and comp.resident and comp.role == "adapter":
                    adapters.append(comp.name)
                elif comp.selected and comp.resident and comp.role != "vae":
                    key = "encoders" if comp.role in ENCODER_ROLES else comp.name
                    groups.setdefault(key, []).append(comp.name)
            if adapters:  # adapters join the resident DiT's group
                dits = [k for k in groups if k != "encoders"]
                groups.setdefault(dits[0] if dits else "adapters", []).extend(adapters)
            if len(groups) > 1:
                out.append(f"more than one group is resident: {sorted(groups.values())}")
            return out

    def _enable(self, components: list[Component]) -> None:
        selected = {c.name: self.config.offloads_role(c.role) for c in components}
        named = {c.name: named_tensors(c.module, component=c.name) for c in components}
        table = WeightTable(self.mover)
        for comp in components:
            table.add(comp.name, comp.role, selected[comp.name], comp.module)
        budget = self._check_budget(table, named, selected, components)

        def install(weights: dict[str, ComponentWeights], handles: list[Any]) -> None:
            policy = MemoryPolicy(None, self.platform, weights)
            if budget is not None:
                policy.set_budget(budget)
                policy.copy_stream = self.platform.new_stream()
                fixed = policy.fixed_bytes()
                if fixed > budget:  # the adopted slots disagree with the plan
                    raise BudgetTooSmallError(self.device_memory_budget, budget, fixed, fixed, 0, ())
            for comp in components:
                hook = None
                if comp.role in STAGE_ROLES:
                    hook = SequentialOffloadHook(
                        weights[comp.name],
                        self._exclusion(comp, weights),
                        self._companions(comp, weights),
                        self.lock,
                        policy,
                    )
                handles.append(
                    attach_hook(comp.module, hook, comp.name, child_hooks=selected[comp.name])
                )
            self.policy = policy

        self._transact_enable(table, named, selected, install)

    def _check_budget(
        self,
        table: WeightTable,
        named: dict[str, list[tuple[str, torch.Tensor]]],
        selected: dict[str, bool],
        components: list[Component],
    ) -> int | None:
        """Resolve ``device_memory_budget`` to bytes and refuse one below the smallest
        workable budget, before anything is adopted, pinned or moved; decide whether the
        selected encoders rest on the device (``_encoders_rest_on_device``: only when they
        fit within the budget beside the bytes that always stay).

        Returns the budget in bytes, or None (the strict rule).

        Raises:
            BudgetTooSmallError (a ValueError): the budget (``"auto"`` resolved) is below
                the bytes that always stay on the device (unselected components, tensors
                shared with them); the message names both numbers.
            ValueError: a meta tensor or a tensor on a foreign device (named).
        """
        self._encoders_rest_on_device = True
        if self.device_memory_budget is None:
            return None
        table.check_tensors(named)
        plan = table.plan(named, selected)
        on_device = self._bytes_on_device(named)
        # "auto" counts the managed weights on the device now as available (they are
        # what the budget is for), as it does after placement
        budget = resolve_budget(self.device_memory_budget, self.platform, on_device)
        assert budget is not None
        encoders = [c.name for c in components if selected[c.name] and c.role in ENCODER_ROLES]
        resting, fixed, _, _ = smallest_budget(plan, [encoders])
        if fixed > budget:
            raise BudgetTooSmallError(self.device_memory_budget, budget, fixed, fixed, 0, ())
        self._encoders_rest_on_device = resting <= budget
        return budget

    def _at_rest_on_host(self, weights: ComponentWeights) -> bool:
        """Module mode: the selected DiT group (DiTs, adapters) rests on the host; the
        selected encoders rest on the device until the first DiT runs, unless a budget
        has no room for them there."""
        if weights.selected and weights.role in ENCODER_ROLES:
            return not self._encoders_rest_on_device
        return weights.selected and weights.role in DIT_GROUP_ROLES

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
        """An explicit selection needs what it names and a stage that evicts the DiTs
        (an encoder or a VAE); the legacy switch offloads whatever exists."""
        if not self.config.explicit:
            return
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
        if not any(r in ENCODER_ROLES or r == "vae" for r in roles):
            raise ValueError(
                "model-level offload needs an encoder or a VAE stage for mutual exclusion "
                f"with the DiTs, but the pipeline declares none; discovered: {names}"
            )

    def _exclusion(
        self, comp: Component, weights: dict[str, ComponentWeights]
    ) -> list[ComponentWeights]:
        selected = [w for w in weights.values() if w.selected]
        if comp.role == "dit":  # the encoders and the other DiTs; adapters stay with it
            return [w for w in selected if w.name != comp.name and w.role != "adapter"]
        if comp.role == "adapter":
            return [w for w in selected if w.role in ENCODER_ROLES]
        if comp.role in ENCODER_ROLES or comp.role == "vae":
            # a VAE decodes without the DiTs: evicting an unmodified DiT costs no copy,
            # and the next request's text encoder evicts it anyway
            return [w for w in selected if w.role in DIT_GROUP_ROLES]
        return []

    def _companions(
        self, comp: Component, weights: dict[str, ComponentWeights]
    ) -> list[ComponentWeights]:
        """A selected encoder loads the whole selected encoder group (they run back to
        back); a selected DiT loads the selected adapters, and an adapter its DiT when the
        pipeline has one selected DiT (they run in the same denoising steps)."""
        if not weights[comp.name].selected:
            return []
        selected = [w for w in weights.values() if w.selected]
        if comp.role in ENCODER_ROLES:
            return [w for w in selected if w.role in ENCODER_ROLES]
        if comp.role == "dit":
            return [w for w in selected if w.role == "adapter"]
        if comp.role == "adapter":
            dits = [w for w in selected if w.role == "dit"]
            return dits if len(dits) == 1 else []
        return []

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"ModelLevelOffloadBackend({self.config.to_json()}, {self.device}, {state})"
