"""Layer mode keeps every write to a streamed block's weights (issue 38, item 1).

A write made while a streamed block is on the device (in a forward pre-hook registered
after ``enable()``, in its ``forward``, in a post-hook) or while it waits on the host
between calls, by each write path (``.data`` in-place ops, in-place ops, ``.data =``,
index assignment, ``nn.init``), in plain layer mode, under a device budget (kept blocks)
and with ``resident_layers``, is kept: after three requests the weights equal those of the
same pipeline run all-resident with the same hooks, and so do the outputs of every request.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.toy import SyntheticPipeline

REQUESTS = 3


def _write(w: torch.Tensor, path: str, count: int) -> None:
    """One write of ``path`` to ``w`` (a Parameter), changing it on every call."""
    if path == "data.add_":
        w.data.add_(1.0)  # the alias has its own version counter: invisible on the host
    elif path == "in_place":
        with torch.no_grad():
            w.add_(1.0)
    elif path == "data=":
        w.data = w.data + 1.0
    elif path == "index":
        w.data[0] = w.data[0] + 1.0  # index assignment through .data: no version bump either
    elif path == "nn.init":
        nn.init.constant_(w, 0.25 * count)
    else:
        raise AssertionError(path)


PATHS = ("data.add_", "in_place", "data=", "index", "nn.init")
WHERE = ("pre_hook", "forward", "post_hook", "between")
SETUPS = ("layer", "budget", "resident_layers")


def _install(pipe: SyntheticPipeline, where: str, path: str) -> Callable[[], None]:
    """Install the writer on ``transformer.blocks[1]``; returns what runs between requests
    (the ``between`` writer, else nothing)."""
    block = pipe.transformer.blocks[1]
    count = [0]

    def write() -> None:
        count[0] += 1
        _write(block.fc1.bias, path, count[0])
        _write(block.norm1.weight, path, count[0])

    if where == "pre_hook":
        block.register_forward_pre_hook(lambda m, a: write())
    elif where == "post_hook":
        block.register_forward_hook(lambda m, a, o: write())
    elif where == "forward":
        inner = block.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            write()
            return inner(x)

        block.forward = forward  # an instance attribute: the block's own forward writes
    else:
        return write
    return lambda: None


def _backend(setup: str, device: torch.device, pipe: SyntheticPipeline) -> LayerwiseOffloadBackend:
    config = {"mode": "layer", "components": ["dit"]}
    if setup == "resident_layers":
        config["layer_options"] = {"dit": {"resident_layers": 1}}
    if setup != "budget":
        return LayerwiseOffloadBackend(config, device)
    with LayerwiseOffloadBackend(config, device) as probe:
        probe.enable(pipe)
        block = probe.streamer.sequences["transformer"][0].nbytes
        budget = probe.fixed_bytes + 3 * block  # the double buffer + one kept block
    return LayerwiseOffloadBackend(config, device, device_memory_budget=budget)


def _requests(pipe: SyntheticPipeline, between: Callable[[], None], device: torch.device) -> list[torch.Tensor]:
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    outs = []
    for _ in range(REQUESTS):
        with torch.no_grad():
            outs.append(pipe(x.to(device)).cpu())
        fa.synchronize()  # a host write between requests must not race the copy (item 2's business)
        between()
    return outs


def _weights(pipe: SyntheticPipeline) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in [*pipe.named_parameters(), *pipe.named_buffers()]}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("path", PATHS)
def test_every_write_to_a_streamed_block_is_kept(fake_device, path, where, setup):
    fa.reset_stats()
    ref = SyntheticPipeline(num_blocks=4)
    between = _install(ref, where, path)
    ref.to(fake_device)
    expected = _requests(ref, between, fake_device)
    expected_weights = _weights(ref)
    del ref

    pipe = SyntheticPipeline(num_blocks=4)
    with _backend(setup, fake_device, pipe) as backend:
        backend.enable(pipe)
        between = _install(pipe, where, path)
        outs = _requests(pipe, between, fake_device)
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        now = _weights(pipe)
        assert now.keys() == expected_weights.keys()
        lost = [n for n in now if not torch.equal(now[n], expected_weights[n])]
        assert lost == []
        assert backend.audit() == []
        backend.disable()
    after = _weights(pipe)
    assert [n for n in after if not torch.equal(after[n], expected_weights[n])] == []
    assert fa.stats()["races_detected"] == 0


def test_a_release_costs_one_device_check_and_writes_back_only_what_changed(fake_device):
    """Every release is compared on the device (one comparison, one host wait); an
    unwritten block is never written back, a ``.data`` in-place write in a pre-hook is
    (the bytes of exactly the written tensor)."""
    pipe = SyntheticPipeline(num_blocks=3)
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    block = pipe.transformer.blocks[1]
    with LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(x.to(fake_device))  # learns the order
            pipe(x.to(fake_device))
        start = backend.stats.snapshot()
        with torch.no_grad():
            pipe(x.to(fake_device))
        clean = backend.stats.since(start)
        assert clean.d2h_bytes == 0
        # block 0 carried in (compared on the device as the call starts), then each of
        # the 3 releases compared on the device
        assert clean.device_checks == 1 + 3
        def bump(module: nn.Module, args: tuple) -> None:
            module.fc1.bias.data.add_(1.0)

        handle = block.register_forward_pre_hook(bump)
        before = block.fc1.bias.detach().clone()
        start = backend.stats.snapshot()
        with torch.no_grad():
            pipe(x.to(fake_device))
        handle.remove()
        written = backend.stats.since(start)
        assert written.d2h_bytes == block.fc1.bias.numel() * 4
        assert torch.equal(block.fc1.bias.detach(), before + 1.0)
        assert backend.audit() == []
