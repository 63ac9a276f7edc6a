"""Fault injection over layer mode and the memory budget (issue 17, "Must show").

The module-mode sweep is ``tests/test_faults.py``; this one covers
``LayerwiseOffloadBackend`` and ``ModelLevelOffloadBackend(..., device_memory_budget=...)``.

One run is (scenario, fault kind, k): the move primitive ``transfer._rebind`` is replaced
and raises the fault *before* (the move is not made) or *after* (the move is made) the k-th
move of the scenario's action, once, for every k from 1 to the number of moves the action
makes. Fault kinds: ``KeyboardInterrupt``, ``RuntimeError`` and a device OOM
(``torch.OutOfMemoryError``). The ``disable_hook_removal`` scenarios raise at the k-th hook
removal of ``disable()`` instead (``disable`` may make no move at all).

After the fault (caught by the test; a fault the library absorbs, such as an OOM it retries,
is fine) a run passes only if:

* no race was detected and no unexpected exception (one not caused by the fault) escaped;
* ``backend.audit() == []``;
* the device holds exactly the resting set, nothing else allocated since the pipeline was
  built: layer mode: trunks + unselected components + at most one streamed block (the
  carried prefetch), every block whole on one side; budget mode: every component whole
  on the side its ``resident`` flag says, and no two copies;
* every weight equals the expected value (the all-resident weights plus the writes the
  scenario made: no write lost, nothing rolled back twice);
* the next request equals the all-resident output exactly, and afterwards the same holds.

A scenario whose ``enable`` or ``disable`` raised is checked as rolled back (nothing
changed, nothing allocated, hooks gone / still working) and then retried.

Values are read after ``fa.synchronize()``: a read between requests that races a copy
still in flight (issue 17, item 2) is the property test's business
(``tests/test_offload_property.py``); here the question is whether every transition is
all-or-nothing. ``disable`` promises that the caller is ordered after every pending copy,
so after a completed ``disable`` nothing is synchronized: the test moves the pipeline to
the device, runs it, moves it back to the host and frees it, and the race detector must
stay silent.

Failures are collected over the whole sweep and reported grouped by message, naming the
scenario, the fault kind, before/after and every k that broke; each test prints its number
of runs. ``test_fault_sweep_full`` (marker ``full``, run by ``.ci/run``) runs every k of
every (scenario, kind, before/after); ``test_fault_sweep_sample`` (the README's test
command) every sixth k, shifted per (kind, before/after), so that every k of every scenario
is still hit by one fault.
"""

from __future__ import annotations

import contextlib
import gc
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core import transfer as transfer_mod
from diffusion_offload.core.discovery import SupportsComponentDiscovery
from diffusion_offload.core.hooks import get_hook, offload_component
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = requires_fake

LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}
SELECTED = ("text_encoder", "transformer", "transformer_2")
UNSELECTED = ("image_encoder", "vae")
DIM, VOCAB = 8, 16
STD = {"steps": 1, "cfg": False, "order": ("transformer", "transformer_2")}

# ----------------------------------------------------------------------------- the pipeline


class MiniBlock(nn.Module):
    """A streamed block: a Linear and a non-persistent buffer (3 tensors: few moves)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.full((dim,), 0.01), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) + self.shift


class MiniDiT(nn.Module):
    """A trunk (``proj``, no bias) around ``blocks``."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, dim: int, depth: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.blocks = nn.ModuleList(MiniBlock(dim) for _ in range(depth))

    def forward(self, latents: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.proj(latents) + cond
        for block in self.blocks:
            h = block(h)
        return h


class MiniTextEncoder(nn.Module):
    """Token ids (B, T) -> (B, D): an embedding (the trunk) and ``layers``."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["layers"]

    def __init__(self, vocab: int, dim: int, depth: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MiniBlock(dim) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).mean(dim=1)
        for layer in self.layers:
            h = layer(h)
        return h


class MiniImageEncoder(nn.Module):
    """An unselectable encoder (role ``encoder``): stays resident."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.proj(image)


class MiniVAE(nn.Module):
    """Called through ``decode`` (under ``offload_component``), as diffusers does."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.post = nn.Linear(dim, dim, bias=False)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.post(latents))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode(latents)


class MiniPipeline(nn.Module, SupportsComponentDiscovery):
    """Text encoder (1 streamed block), image encoder, two DiTs (2 and 1 streamed
    blocks), VAE: the smallest pipeline with every situation of the scenarios.

    ``__call__`` runs like a diffusers pipeline: the text encoder (twice with CFG: prompt
    and negative prompt) unless ``embeds`` are given, the image encoder, ``steps`` steps
    of the DiTs in ``order`` (batch 2 with CFG), then ``vae.decode``.
    """

    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder", "image_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.text_encoder = MiniTextEncoder(VOCAB, DIM)
            self.image_encoder = MiniImageEncoder(DIM)
            self.transformer = MiniDiT(DIM)
            self.transformer_2 = MiniDiT(DIM, depth=1)
            self.vae = MiniVAE(DIM)
        self.eval()

    def __call__(  # type: ignore[override]
        self,
        device: torch.device,
        steps: int = 1,
        cfg: bool = False,
        order: tuple[str, ...] = ("transformer", "transformer_2"),
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        ids = torch.tensor([[1, 5, 7]])
        with torch.no_grad():
            if embeds is None:
                cond = self.text_encoder(ids.to(device))
                neg = self.text_encoder(torch.zeros_like(ids).to(device)) if cfg else None
            else:
                cond, neg = embeds[0].to(device), embeds[1].to(device)
            img = self.image_encoder(torch.ones(1, DIM, device=device))
            latents = torch.zeros(1, DIM, device=device)
            for _ in range(steps):
                for name in order:
                    dit = getattr(self, name)
                    if cfg:
                        both = dit(torch.cat([latents, latents]), torch.cat([cond + img, neg + img]))
                        eps = both[:1] * 1.5 - both[1:] * 0.5
                    else:
                        eps = dit(latents, cond + img)
                    latents = latents + 0.25 * eps
            if get_hook(self.vae) is not None:
                with offload_component(self.vae):
                    out = self.vae.decode(latents)
            else:
                out = self.vae.decode(latents)
            return out.cpu()


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _base_values() -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in _tensors(MiniPipeline())}


_BASE = _base_values()
_REF_CACHE: dict[Any, torch.Tensor] = {}


def _key(kwargs: dict) -> Any:
    return tuple(sorted((k, v if k != "embeds" else "embeds") for k, v in kwargs.items()))


def _apply_writes(values: dict[str, torch.Tensor], writes: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in values.items()}
    for name, op in writes:
        _write_op(out[name], op)
    return out


def _write_op(t: torch.Tensor, op: str) -> None:
    with torch.no_grad():
        if op == "data.add_":
            t.data.add_(1.0)  # a .data in-place write: _version does not see it
        elif op == "data=":
            t.data = t.data + 1.0  # a .data reassignment: a new storage, new bytes
        else:
            t.add_(0.5)  # an in-place write under no_grad


def _reference(device: torch.device, kwargs: dict, writes: list[tuple[str, str]]) -> torch.Tensor:
    """The all-resident output of ``kwargs`` with the weights after ``writes``."""
    key = (_key(kwargs), tuple(writes))
    if key not in _REF_CACHE:
        pipe = MiniPipeline()
        values = _apply_writes(_BASE, writes)
        with torch.no_grad():
            for n, t in _tensors(pipe):
                t.copy_(values[n])
        pipe.to(device)
        _REF_CACHE[key] = pipe(device, **kwargs)
    return _REF_CACHE[key]


def _embeds() -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed prompt embeddings (host tensors), as a pipeline accepts them."""
    enc = MiniPipeline().text_encoder
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 7]])
        return enc(ids), enc(torch.zeros_like(ids))


# ----------------------------------------------------------------------------- faults

FAULTS: dict[str, Callable[[str], BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "RuntimeError": RuntimeError,
    "OOM": torch.OutOfMemoryError,
}


class MoveFault:
    """The move primitive, raising ``kind`` before or after the k-th move (once).

    ``k=None`` only counts the moves."""

    def __init__(self, kind: str | None, when: str, k: int | None) -> None:
        self.kind, self.when, self.k = kind, when, k
        self.moves = 0
        self.fired = False
        self.exc: BaseException | None = None
        self.real = transfer_mod._rebind

    def _raise(self) -> None:
        self.fired = True
        assert self.kind is not None
        self.exc = FAULTS[self.kind](f"injected {self.kind} {self.when} move {self.k}")
        raise self.exc

    def __call__(self, obj: torch.Tensor, payload: torch.Tensor) -> None:
        if self.fired:
            return self.real(obj, payload)
        self.moves += 1
        if self.k is not None and self.moves == self.k:
            if self.when == "after":
                self.real(obj, payload)
            self._raise()
        return self.real(obj, payload)

    @contextlib.contextmanager
    def installed(self, ctx: "Ctx") -> Iterator[None]:
        transfer_mod._rebind = self
        try:
            yield
        finally:
            transfer_mod._rebind = self.real


class RemovalFault(MoveFault):
    """Raise at the k-th hook removal of ``disable()`` (before it, or after it)."""

    @contextlib.contextmanager
    def installed(self, ctx: "Ctx") -> Iterator[None]:
        patched = []
        for handle in list(getattr(ctx.backend, "_handles", [])):
            real = handle.remove

            def remove(real=real) -> None:
                if self.fired:
                    return real()
                self.moves += 1
                if self.k is not None and self.moves == self.k:
                    if self.when == "after":
                        real()
                    self._raise()
                return real()

            handle.remove = remove  # instance attribute: shadows the method
            patched.append(handle)
        try:
            yield
        finally:
            for handle in patched:
                handle.__dict__.pop("remove", None)


def _caused_by(exc: BaseException, cause: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if exc is cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Free what the frames of a caught exception hold (activations, device copies), so
    the device-bytes check sees only what the library keeps."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _where(exc: BaseException) -> str:
    """The innermost frame of the library proper (not ``testing/``, whose fake device
    raises races) and the innermost frame of the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    lib = [
        f for f in frames
        if "diffusion_offload" in f.filename and "/tests/" not in f.filename and "/testing/" not in f.filename
    ]
    parts = []
    if lib:
        f = lib[-1]
        parts.append(f"{f.filename.split('src/')[-1]}:{f.lineno} in {f.name}")
    if frames and (not lib or frames[-1] is not lib[-1]):
        f = frames[-1]
        parts.append(f"{f.filename.split('src/')[-1].split('/')[-1]}:{f.lineno} in {f.name}")
    return " ... ".join(parts)


def _describe(exc: BaseException) -> str:
    first = (str(exc).splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first} [at {_where(exc)}]"


# ----------------------------------------------------------------------------- scenarios


@dataclass
class Ctx:
    device: torch.device
    mode: str
    base: set[int] = field(default_factory=set)
    pipe: MiniPipeline | None = None
    backend: Any = None
    budget: int | None = None
    writes: list[tuple[str, str]] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    blocks: dict[str, nn.Module] = field(default_factory=dict)
    before: dict[str, Any] = field(default_factory=dict)
    action_kwargs: dict | None = None
    phase: str = "enabled"  # what the action is: "enable", "disable", or a call

    def new_backend(self) -> Any:
        if self.mode == "layer":
            return LayerwiseOffloadBackend(LAYER, self.device)
        return ModelLevelOffloadBackend(MODULE, self.device, device_memory_budget=self.budget)

    def enable(self) -> None:
        self.backend.enable(self.pipe)
        self.note_blocks()

    def note_blocks(self) -> None:
        if self.mode == "layer" and self.backend.is_enabled():
            self.blocks = {
                f"{comp}.{name}": self.pipe.get_submodule(f"{comp}.{name}")
                for comp, names in self.backend.blocks.items()
                for name in names
            }

    def request(self, **kwargs: Any) -> torch.Tensor:
        return self.pipe(self.device, **(kwargs or STD))


def _budget_for_two_of_three(device: torch.device) -> int:
    """Room for the unselected components and the two largest selected ones: every
    request evicts and prefetches (the DiT after the text encoder, the text encoder
    during the decode)."""
    pipe = MiniPipeline()
    probe = ModelLevelOffloadBackend(MODULE, device)
    probe.enable(pipe)
    comps = probe.components
    sel = sorted((comps[n].evictable_bytes for n in SELECTED), reverse=True)
    fixed = sum(comps[n].nbytes for n in comps if n not in SELECTED)
    probe.disable()
    del pipe, probe
    gc.collect()
    return fixed + sel[0] + sel[1]


def _writer(ctx: Ctx, block: str, weight_op: str = "data.add_") -> Callable[..., None]:
    """A forward pre-hook that writes the block's weights while it is on the device: the
    weight by ``weight_op`` (``"data="`` a reassignment; ``"data.add_"`` a ``.data``
    in-place write, which changes neither the version counter nor the storage: only the
    release's device check sees it, issue 38 item 1), the bias by an in-place op."""

    def hook(module: nn.Module, args: tuple) -> None:
        _write_op(module.fc.weight, weight_op)
        _write_op(module.fc.bias, "add_")
        ctx.writes += [(f"{block}.fc.weight", weight_op), (f"{block}.fc.bias", "add_")]

    return hook


def _prepare(ctx: Ctx, scenario: str) -> None:
    ctx.pipe = MiniPipeline()
    if scenario == "enable_from_device":
        ctx.pipe.to(ctx.device)
    ctx.backend = ctx.new_backend()
    if scenario.startswith("enable"):
        ctx.phase = "enable"
        ctx.before = {
            "placement": {n: t.device for n, t in _tensors(ctx.pipe)},
            "live": set(fa.live_storages()),
            "allocated": fa.stats()["allocated_bytes"],
        }
        return
    ctx.enable()
    if scenario in ("budget_decode_prefetch", "budget_disable", "budget_disable_hook_removal"):
        # as learned after a decode ran out of memory beside the DiTs: the VAE evicts
        # them and the next request's text encoder is prefetched during the decode
        assert hasattr(ctx.backend.policy, "decode_needs_room")
        ctx.backend.policy.decode_needs_room = True
    # the first request learns the order: from the second on, prefetches are carried
    # over (layer mode) and stages prefetched (budget); the carried cases take two
    warm = {"first_forward": 0, "budget_first_forward": 0}.get(scenario, 1)
    if scenario in ("carried_write", "disable", "disable_hook_removal", "budget_decode_prefetch",
                    "budget_disable", "budget_disable_hook_removal"):
        warm = 2
    for _ in range(warm):
        ctx.request()
    if scenario in ("writeback_release", "writeback_release_data"):
        block = ctx.pipe.transformer.blocks[1]  # registered after the offload pre-hook: runs on the device
        op = "data=" if scenario == "writeback_release" else "data.add_"
        ctx.hooks.append(block.register_forward_pre_hook(_writer(ctx, "transformer.blocks.1", op)))
    elif scenario == "carried_write":
        fa.synchronize()  # the write itself must not race the copy (item 2 is tested elsewhere)
        on_dev = [n for n, m in ctx.blocks.items() if all(t.device == ctx.device for _, t in _tensors(m))]
        name = on_dev[0] if on_dev else "text_encoder.layers.0"
        _writer(ctx, name)(ctx.pipe.get_submodule(name), ())
        ctx.before["carried"] = name
    if scenario in ("disable", "disable_hook_removal", "budget_disable", "budget_disable_hook_removal"):
        ctx.phase = "disable"


def _action(ctx: Ctx, scenario: str) -> Any:
    if ctx.phase == "enable":
        return ctx.enable()
    if ctx.phase == "disable":
        return ctx.backend.disable()
    if scenario == "prefetch":
        # the text encoder runs on its carried prefetch and the next prefetched block,
        # then prefetches the DiT's first block
        with torch.no_grad():
            ctx.pipe.text_encoder(torch.tensor([[1, 5, 7]]).to(ctx.device))  # output dropped
        return None
    if scenario == "prefetch_drop":
        ctx.action_kwargs = {"steps": 1, "cfg": False, "order": ("transformer_2", "transformer")}
    elif scenario == "carried_write":
        ctx.action_kwargs = {**STD, "embeds": _embeds()}  # the text encoder does not run
    else:
        ctx.action_kwargs = dict(STD)
    return ctx.request(**ctx.action_kwargs)


LAYER_SCENARIOS = (
    "enable_from_host",  # trunks and unselected components move to the device
    "enable_from_device",  # the streamed blocks move to the host
    "first_forward",  # the first request: every block loads, order learned
    "later_forward",  # the third identical request: carried prefetch, prefetches, releases
    "prefetch",  # a text-encoder call on prefetched blocks, ending with the DiT's prefetch
    "prefetch_drop",  # the DiT order reversed: two wrong prefetches dropped
    "writeback_release",  # a block written while on the device: written back at release
    "writeback_release_data",  # the same by a .data in-place write in its pre-hook
    "carried_write",  # the carried prefetch written between requests, then dropped
    "disable",  # disable() with a carried prefetch (its moves, if it makes any)
    "disable_hook_removal",  # disable() failing at the k-th hook removal
)
BUDGET_SCENARIOS = (
    "budget_first_forward",  # the first request under a budget for two of three components
    "budget_prefetch",  # a later request: next stage prefetched on the copy stream
    "budget_decode_prefetch",  # the VAE evicts the DiTs; the text encoder prefetched during the decode
    "budget_disable",  # disable() with a stage prefetch in flight
    "budget_disable_hook_removal",  # the same, failing at the k-th hook removal
)
SCENARIOS = LAYER_SCENARIOS + BUDGET_SCENARIOS


# ----------------------------------------------------------------------------- checks


def _check_rest(ctx: Ctx) -> list[str]:
    """The device holds exactly the resting set."""
    out: list[str] = []
    pipe, dev = ctx.pipe, ctx.device
    assert pipe is not None
    if ctx.mode == "layer":
        in_block = {id(t) for m in ctx.blocks.values() for _, t in _tensors(m)}
        carried = []
        for name, m in ctx.blocks.items():
            sides = {t.device == dev for _, t in _tensors(m)}
            if len(sides) > 1:
                out.append(f"block {name} is split between the host and the device")
            elif True in sides:
                carried.append(name)
        if len(carried) > 1:
            out.append(f"{len(carried)} streamed blocks on the device at rest (at most one carried prefetch): {carried}")
        for n, t in _tensors(pipe):
            if id(t) not in in_block and t.device != dev:
                out.append(f"{n} (trunk or unselected component) is on {t.device}, not on the device")
    else:
        comps = ctx.backend.components if ctx.backend is not None and ctx.backend.is_enabled() else {}
        for cname in SELECTED + UNSELECTED:
            sides = {t.device == dev for _, t in _tensors(pipe.get_submodule(cname))}
            if len(sides) > 1:
                out.append(f"component {cname} is split between the host and the device")
            elif cname in UNSELECTED and sides != {True}:
                out.append(f"unselected component {cname} is not on the device")
            elif cname in comps and sides and (True in sides) != bool(comps[cname].resident):
                out.append(
                    f"component {cname}: on the {'device' if True in sides else 'host'} but "
                    f"resident={comps[cname].resident}"
                )
    live = fa.live_storages()
    mine = {fa.storage_key(t) for _, t in _tensors(pipe) if t.device == dev}
    mine |= _pending_bookkeeping(ctx)
    orphans = {k: v for k, v in live.items() if k not in ctx.base and k not in mine}
    if orphans:
        out.append(
            f"{len(orphans)} device storage(s), {sum(orphans.values())} bytes, alive that no "
            "tensor of the pipeline uses (stranded or leaked)"
        )
    return out


def _pending_bookkeeping(ctx: Ctx) -> set[int]:
    """Device storages a budget prefetch in flight holds besides the weights (the loaded
    tensors' fingerprints, read back when its stage runs): part of the resting set."""
    keys: set[int] = set()
    backend = ctx.backend
    if ctx.mode != "budget" or backend is None or not backend.is_enabled():
        return keys
    for comp in backend.components.values():
        pending = getattr(comp, "pending", None)
        if pending is None:
            continue
        names = list(getattr(pending, "__dict__", {})) + list(getattr(type(pending), "__slots__", ()))
        for value in (getattr(pending, n, None) for n in names):
            if isinstance(value, torch.Tensor) and value.device == ctx.device:
                keys.add(fa.storage_key(value))
    return keys


def _check_values(ctx: Ctx) -> list[str]:
    expected = _apply_writes(_BASE, ctx.writes)
    bad = []
    for n, t in _tensors(ctx.pipe):
        if not torch.equal(t.detach().cpu(), expected[n]):
            bad.append(n)
    if bad:
        return [f"weights differ from the expected values (a write lost or undone): {bad}"]
    return []


def _guarded(out: list[str], what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except AssertionError as exc:
        out.append(f"{what}: {exc}")
        _drop_tracebacks(exc)
    except BaseException as exc:  # noqa: BLE001 - a check's own error is a failure
        out.append(f"{what}: {_describe(exc)}")
        _drop_tracebacks(exc)
    return None


def _races(out: list[str], when: str) -> None:
    n = fa.stats()["races_detected"]
    if n:
        out.append(f"{n} race(s) detected {when}")


def _check_enabled(ctx: Ctx, out: list[str], when: str) -> None:
    """audit, the resting set, the values, the next request, and the same again."""
    audit = _guarded(out, f"audit() {when}", ctx.backend.audit)
    if audit:
        out.append(f"audit() {when}: {audit}")
    out.extend(f"{m} ({when})" for m in _guarded(out, "resting set", lambda: _check_rest(ctx)) or [])
    _guarded(out, "synchronize", fa.synchronize)
    out.extend(f"{m} ({when})" for m in _guarded(out, "values", lambda: _check_values(ctx)) or [])
    ref = _reference(ctx.device, STD, ctx.writes)
    got = _guarded(out, f"next request {when}", ctx.request)
    if got is not None and not torch.equal(got, ref):
        out.append(f"next request {when} differs from the all-resident output (max |diff| {(got - ref).abs().max().item():.3g})")
    _races(out, f"by the next request {when}")
    audit = _guarded(out, "audit() after the next request", ctx.backend.audit)
    if audit:
        out.append(f"audit() after the next request {when}: {audit}")
    out.extend(f"{m} (after the next request {when})" for m in _guarded(out, "resting set", lambda: _check_rest(ctx)) or [])


def _check_no_hooks(ctx: Ctx, out: list[str]) -> None:
    for name, m in ctx.pipe.named_modules():
        left = [a for a in ("forward", "_apply", "decode", "encode") if a in m.__dict__]
        if left or m._forward_pre_hooks or m._forward_hooks:
            out.append(f"module {name or '<root>'} still has offload hooks ({left}, "
                       f"{len(m._forward_pre_hooks)} pre-hooks, {len(m._forward_hooks)} hooks)")
            return


def _check_disabled(ctx: Ctx, out: list[str]) -> None:
    """After a completed disable: no hook left; the caller is ordered after every pending
    copy: use, move and free the weights, with no race."""
    _check_no_hooks(ctx, out)
    out.extend(_guarded(out, "values after disable", lambda: _check_values(ctx)) or [])
    _races(out, "after disable")

    def use_and_free() -> None:
        pipe, dev = ctx.pipe, ctx.device
        pipe.to(dev)
        got = pipe(dev, **STD)
        ref = _reference(dev, STD, ctx.writes)
        assert torch.equal(got, ref), "the disabled pipeline, moved to the device, differs from all-resident"
        # other code uses the weights on the device and frees them with no synchronize
        # in between (a caching allocator reuses that memory at once)
        with torch.no_grad():
            cond = pipe.text_encoder(torch.tensor([[1, 5, 7]], device=dev))
            latents = pipe.transformer_2(pipe.transformer(torch.zeros(1, DIM, device=dev), cond), cond)
        for _, t in _tensors(pipe):
            t.data = torch.zeros_like(t)
        del cond, latents
        gc.collect()
        fa.synchronize()  # raises a race found at a free

    _guarded(out, "use, move and free after disable", use_and_free)
    _races(out, "when the disabled pipeline's device copies were freed")


def _check_enable_rolled_back(ctx: Ctx, out: list[str]) -> None:
    if ctx.backend.is_enabled():
        out.append("enable() raised but the backend is enabled")
        return
    now = {n: t.device for n, t in _tensors(ctx.pipe)}
    moved = [n for n, d in now.items() if d != ctx.before["placement"][n]]
    if moved:
        out.append(f"a failed enable() left tensors moved: {moved}")
    out.extend(_guarded(out, "values after a failed enable", lambda: _check_values(ctx)) or [])
    # a tensor put back on the device may get a new storage: count what nobody uses
    mine = {fa.storage_key(t) for _, t in _tensors(ctx.pipe) if t.device == ctx.device}
    extra = {k: v for k, v in fa.live_storages().items() if k not in ctx.before["live"] and k not in mine}
    if extra:
        out.append(
            f"a failed enable() left {len(extra)} device storage(s), {sum(extra.values())} bytes, "
            "allocated that no tensor uses"
        )
    if fa.stats()["allocated_bytes"] > ctx.before["allocated"]:
        out.append(
            f"a failed enable() left {fa.stats()['allocated_bytes'] - ctx.before['allocated']} "
            "more device bytes allocated than before it"
        )
    _check_no_hooks(ctx, out)


def _check(ctx: Ctx, raised: BaseException | None) -> list[str]:
    out: list[str] = []
    _races(out, "during the action")
    for h in ctx.hooks:
        h.remove()
    ctx.hooks.clear()
    if ctx.phase == "enable":
        if raised is not None:
            _check_enable_rolled_back(ctx, out)
            if _guarded(out, "retried enable()", ctx.enable) is None and not ctx.backend.is_enabled():
                return out
        else:
            ctx.note_blocks()
        _check_enabled(ctx, out, "after enable")
    elif ctx.phase == "disable":
        if ctx.backend.is_enabled():
            if raised is None:
                out.append("disable() returned but the backend is still enabled")
            _check_enabled(ctx, out, "after a failed disable")
            _guarded(out, "retried disable()", ctx.backend.disable)
            if ctx.backend.is_enabled():
                out.append("a retried disable() left the backend enabled")
                return out
        _check_disabled(ctx, out)
    else:
        if raised is None and ctx.action_kwargs is not None:
            # the fault was absorbed (an OOM retried): the request itself must be exact
            pass
        _check_enabled(ctx, out, "after the fault")
    return out


# ----------------------------------------------------------------------------- the sweep


def _run(device: torch.device, scenario: str, kind: str | None, when: str, k: int | None) -> tuple[int, list[str]]:
    """One run; returns (moves the action made, failures)."""
    gc.collect()
    fa.synchronize()
    fa.reset_stats()
    ctx = Ctx(device, "budget" if scenario.startswith("budget") else "layer")
    if ctx.mode == "budget":
        ctx.budget = _budget(device)
    gc.collect()
    ctx.base = set(fa.live_storages())
    _prepare(ctx, scenario)
    fault = (RemovalFault if scenario.endswith("disable_hook_removal") else MoveFault)(kind, when, k)
    raised: BaseException | None = None
    result = None
    with fault.installed(ctx):
        try:
            result = _action(ctx, scenario)
        except BaseException as exc:  # noqa: BLE001 - the fault, or what it caused
            raised = exc
    out: list[str] = []
    if raised is not None and not _caused_by(raised, fault.exc):
        out.append(f"unexpected exception from the action: {_describe(raised)}")
    if k is not None and not fault.fired:
        out.append(f"the fault did not fire: the action made {fault.moves} moves this time")
    _drop_tracebacks(raised)
    _drop_tracebacks(fault.exc)  # absorbed by the library (an OOM retried): still ours
    if raised is None and ctx.action_kwargs is not None and isinstance(result, torch.Tensor):
        ref = _reference(device, ctx.action_kwargs, ctx.writes)
        if not torch.equal(result, ref):
            out.append("the faulted request completed (fault absorbed) but differs from all-resident")
    result = None
    out.extend(_check(ctx, raised))
    if ctx.backend is not None:
        with contextlib.suppress(BaseException):
            ctx.backend.disable()
    ctx.pipe = ctx.backend = None
    gc.collect()
    with contextlib.suppress(BaseException):
        fa.synchronize()
    return fault.moves, out


_BUDGET: dict[str, int] = {}
_MOVES: dict[str, int] = {}
RUNS: dict[tuple[str, str, str], int] = {}


def _budget(device: torch.device) -> int:
    if "b" not in _BUDGET:
        _BUDGET["b"] = _budget_for_two_of_three(device)
    return _BUDGET["b"]


def _moves(device: torch.device, scenario: str) -> int:
    """The number of moves (hook removals) the scenario's action makes without a fault."""
    if scenario not in _MOVES:
        _MOVES[scenario] = _run(device, scenario, None, "after", None)[0]
    return _MOVES[scenario]


def _ranges(ks: list[int]) -> str:
    ks = sorted(ks)
    parts, start = [], None
    for i, k in enumerate(ks):
        if start is None:
            start = k
        if i + 1 == len(ks) or ks[i + 1] != k + 1:
            parts.append(str(start) if start == k else f"{start}-{k}")
            start = None
    return ",".join(parts)


@pytest.fixture(autouse=True)
def _frozen_gc(fake_device):
    """Every run collects its garbage (hooks form cycles); freezing what exists before
    the test makes each collection scan only the run's own objects (fast)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    fa.set_capacity(None)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_without_fault(fake_device, scenario):
    """Each scenario passes the checks with no fault (so a sweep failure is the fault's),
    and makes moves to inject at (``disable``: hook removals)."""
    moves, failures = _run(fake_device, scenario, None, "after", None)
    _MOVES.setdefault(scenario, moves)
    print(f"{scenario}: {moves} moves, no fault")
    assert not failures, f"{scenario} without a fault:\n  " + "\n  ".join(failures)
    if not scenario.endswith("disable"):  # disable may move nothing: its removals are swept
        assert moves >= 3, f"{scenario}: the action made only {moves} moves"


COMBOS = [(kind, when) for kind in FAULTS for when in ("before", "after")]


def _sweep(device: torch.device, scenario: str, kind: str, when: str, ks: list[int]) -> None:
    """Run (scenario, kind, when, k) for every k in ``ks``; fail naming every k that broke."""
    n = _moves(device, scenario)
    groups: dict[str, tuple[str, list[int]]] = {}
    for k in ks:
        _, failures = _run(device, scenario, kind, when, k)
        for msg in dict.fromkeys(failures):
            key = re.sub(r"(stream|seq) \d+", r"\1 N", msg)  # the same failure at another k
            groups.setdefault(key, (msg, []))[1].append(k)
    failed = sorted({k for _, ks_ in groups.values() for k in ks_})
    RUNS[(scenario, kind, when)] = len(ks)
    print(f"fault runs ({scenario}, {kind}, {when}): {len(ks)} of k=1..{n}; failing k: {_ranges(failed) or 'none'}")
    if groups:
        unit = "hook removal" if scenario.endswith("hook_removal") else "move"
        lines = [f"({scenario}, {kind} {when} {unit}, k={_ranges(ks_)} of {n}): {msg}" for msg, ks_ in groups.values()]
        pytest.fail(f"{len(failed)} of {len(ks)} runs failed:\n  " + "\n  ".join(lines), pytrace=False)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_sweep_sample(fake_device, scenario, kind, when):
    """The README's test command: every sixth k, shifted per (kind, before/after), so each
    k of each scenario is hit by one of the six combinations (the ``full`` run: by all)."""
    n = _moves(fake_device, scenario)
    offset = COMBOS.index((kind, when))
    _sweep(fake_device, scenario, kind, when, list(range(1 + offset, n + 1, len(COMBOS))))


@pytest.mark.full
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_sweep_full(fake_device, scenario, kind, when):
    """Every k from 1 to the number of moves (hook removals) of the scenario's action."""
    n = _moves(fake_device, scenario)
    _sweep(fake_device, scenario, kind, when, list(range(1, n + 1)))
