"""Split-model delegation (SPEC section 5).

Some models hold mutually exclusive parts inside one module (a "reasoner" run once per
request and a "generator" run every denoising step, inside one transformer). Generic
hooks cannot see the parts, so such a pipeline implements ``SupportsModelCpuOffload``
and the backend delegates to it.

Contract for implementers:

* only the executing part is device resident;
* enable and disable are idempotent;
* transfers use the supplied device and pinning (and HSDP) settings;
* an explicit selection (``offload_components``) is honoured or rejected before any
  partial setup;
* disable removes every model-local hook or context.

``PartSwitcher`` is the reusable helper: one context manager per named part, built on
the same ``Mover`` as the generic backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..platform import platform_for
from ..residency import ComponentWeights, WeightTable, named_tensors
from ..stats import TransferStats
from ..transfer import Mover, Transaction

__all__ = ["PartSwitcher", "SupportsModelCpuOffload"]


@runtime_checkable
class SupportsModelCpuOffload(Protocol):
    """A pipeline (or model) that manages model-level offload of its own parts."""

    def enable_omni_model_cpu_offload(
        self,
        *,
        device: torch.device,
        pin_memory: bool,
        use_hsdp: bool,
        offload_components: tuple[str, ...] | None = None,
    ) -> None:
        """Set up the parts' offload; idempotent. Reject an unsupported selection first."""

    def disable_omni_model_cpu_offload(self) -> None:
        """Remove every model-local hook or context; idempotent."""


class PartSwitcher:
    """Exclusive residency of named parts of one model.

    ``with switcher.part("reasoner"):`` evicts every other part, loads ``reasoner`` and
    synchronizes; re-entering the part that is already active moves nothing. Tensors
    shared between parts are never evicted.

    Args:
        parts: name -> module (e.g. ``{"reasoner": model.reasoner, ...}``).
        device: the accelerator.
        pin_memory: pin host copies when the platform supports it.
        use_hsdp: accepted for the protocol; shards are moved rank-locally either way.

    Raises:
        ValueError: ``parts`` is empty or a module is given twice.
    """

    def __init__(
        self,
        parts: Mapping[str, nn.Module],
        device: torch.device | str,
        pin_memory: bool = True,
        use_hsdp: bool = False,
    ) -> None:
        if not parts:
            raise ValueError("parts must name at least one module, got an empty mapping")
        if len({id(m) for m in parts.values()}) != len(parts):
            raise ValueError(f"parts {list(parts)} must be distinct modules")
        self.mover = Mover(platform_for(device), pin_memory)
        self.use_hsdp = use_hsdp
        table = WeightTable(self.mover, shared_evictable=False)
        for name, module in parts.items():
            table.add(name, "part", True, module)
        txn = Transaction()
        try:
            table.adopt({name: named_tensors(m, component=name) for name, m in parts.items()}, txn)
            for weights in table.components.values():
                weights.resident = True
                weights.evict()
                txn.on_rollback(weights.load)
        except BaseException:
            txn.rollback()
            raise
        txn.commit()
        self.parts: dict[str, ComponentWeights] = table.components
        self.active: str | None = None

    @property
    def stats(self) -> TransferStats:
        """The switcher's transfer counters."""
        return self.mover.stats

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Make part ``name`` the only resident part for the body of the ``with``.

        Raises:
            KeyError: ``name`` is not a part.
        """
        if name not in self.parts:
            raise KeyError(f"unknown part {name!r}; parts: {list(self.parts)}")
        if self.active != name or not self.parts[name].ready:
            self.active = None  # a failed switch leaves no stale active part
            for other, weights in self.parts.items():
                if other != name:
                    weights.evict()
            self.parts[name].load()
            self.active = name
        yield

    def evict_all(self) -> None:
        """Move every part to the host (e.g. before another component runs)."""
        for weights in self.parts.values():
            weights.evict()
        self.active = None
