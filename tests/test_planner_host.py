"""The planner's host-memory columns (issue 20): pinned, pageable and disk bytes and disk
bytes read per request per candidate, by the backends' own tier rule, equal to what the
backend holds and reads for the same budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_offload.core import tiers
from diffusion_offload.planner.host import component_sizes
from diffusion_offload.planner.model import load_plan_model
from diffusion_offload.planner.plan import HostInputs, fastest_fitting, plan_model, resolve_request

from test_host_budget import _call, _save_big_wan

GiB = 1 << 30


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> tuple[Path, int]:
    """A tiny Wan2.1 with a 4-block DiT of about 1.6 MB, saved as safetensors."""
    directory = tmp_path_factory.mktemp("plan-host-wan")
    return directory, _save_big_wan(directory, num_layers=4, ffn_dim=2048)


def _rows(directory: Path, budget: int | None, bandwidth: float = 3e9, cfg: bool | None = False):
    pm = load_plan_model(directory)
    # the request ``_call`` runs: 32x32 (the tiny pipeline's call kwargs), 1 step, no CFG
    request = resolve_request(pm, 32, 32, 5, 1, cfg=cfg)
    rows = plan_model(pm, request, 8 * GiB, device_kind="fakegpu", host=HostInputs(budget, bandwidth))
    return pm, {r.name: r for r in rows}


def test_without_a_budget_every_host_copy_is_pinned(wan_dir):
    directory, dit_bytes = wan_dir
    pm, rows = _rows(directory, None)
    dit = [n for n, c in pm.components.items() if c.role == "dit"][0]
    host = sum(n for _, n, _ in component_sizes(pm, dit))
    assert host == dit_bytes + sum(n for _, n, backed in component_sizes(pm, dit) if not backed)
    row = rows["module dit"]
    assert (row.pinned_bytes, row.pageable_bytes, row.disk_bytes, row.staging_bytes) == (host, 0, 0, 0)
    assert row.disk_read_bytes_per_request == 0 and row.host_fits
    resident = rows["all resident"]
    assert (resident.pinned_bytes, resident.disk_bytes) == (0, 0)
    # every DiT weight is stored in the file at its load dtype: file-backed
    assert all(backed for key, _, backed in component_sizes(pm, dit)
               if key in pm.modules[dit].state_dict())


def test_module_mode_columns_are_the_tier_rule_on_the_models_tensors(wan_dir):
    """Exact bytes: the columns are ``split_tiers`` on the DiT's tensor sizes in order, a
    request loads the DiT once (the VAE evicts it), reading its disk bytes once, and the
    disk reads add their seconds at the disk bandwidth."""
    directory, dit_bytes = wan_dir
    budget = dit_bytes // 3
    pm, rows = _rows(directory, budget, bandwidth=1e9)
    dit = [n for n, c in pm.components.items() if c.role == "dit"][0]
    sizes = [(n, b) for _, n, b in component_sizes(pm, dit)]
    plan = tiers.split_tiers(sizes, budget, 0, tiers.check_bytes([[n for n, _ in sizes]]))
    row = rows["module dit"]
    assert plan.disk_bytes > dit_bytes // 2
    assert row.disk_bytes == plan.disk_bytes
    # a ring buffer: the largest tensor, at most a quarter of the budget
    assert row.staging_bytes == plan.staging_bytes == 2 * min(max(n for n, _ in sizes), budget // 4)
    assert row.pinned_bytes == plan.ram_bytes and row.pageable_bytes == 0
    assert row.pinned_bytes + row.staging_bytes <= budget
    assert row.disk_read_bytes_per_request == plan.disk_bytes
    assert row.transfer_seconds == pytest.approx(
        row.h2d_bytes_per_request / 25e9 + plan.disk_bytes / 1e9)


@pytest.mark.parametrize("name", ["module dit", "module dit+text_encoder", "layer dit+text_encoder k=0"])
def test_the_planned_split_is_what_the_backend_holds_and_reads(name, wan_dir, fake_device):
    """Same budget: the planner's pinned, disk and staging bytes equal the backend's
    ``stats`` after ``Omni`` loads the model, and its disk bytes per request equal what a
    request reads."""
    from diffusion_offload.engine.omni import Omni

    directory, dit_bytes = wan_dir
    budget = dit_bytes // 3
    _, rows = _rows(directory, budget)
    row = rows[name]
    engine = Omni(str(directory), row.config["diffusion_offload_config"], device="fakegpu",
                  host_memory_budget=budget, progress=False)
    try:
        s = engine.backend.stats
        assert s.disk_backed_bytes > 0
        copies = s.pinned_bytes  # the planner's column: host copies
        assert (copies, s.pageable_host_bytes, s.disk_backed_bytes, s.staging_bytes) == (
            row.pinned_bytes, row.pageable_bytes, row.disk_bytes, row.staging_bytes)
        _call(engine.pipeline)  # the reader learns the order
        snap = s.snapshot()
        _call(engine.pipeline)
        assert s.since(snap).disk_read_bytes == row.disk_read_bytes_per_request
    finally:
        engine.close()


def test_a_candidate_whose_ram_only_copies_exceed_the_budget_does_not_fit(wan_dir):
    """A budget below the DiT's non-file-backed bytes plus the smallest staging ring: no
    offload candidate of the DiT fits the host; ``auto`` then picks all resident (no host
    copies), and a budget of the weights changes nothing from no budget."""
    directory, dit_bytes = wan_dir
    _, rows = _rows(directory, 0)
    assert not rows["module dit"].host_fits and not rows["module dit"].fits
    assert not rows["layer dit+text_encoder k=0"].host_fits
    assert fastest_fitting(list(rows.values())).name == "all resident"
    _, plain = _rows(directory, None)
    _, roomy = _rows(directory, 1 << 40)
    assert list(plain.values()) == list(roomy.values())


def test_plan_cli_takes_host_memory_and_disk_bandwidth(wan_dir, capsys):
    """``--host-memory`` plans under the budget ``"auto"`` would take from that much room
    (minus its reserve); ``--json`` rows carry the host columns, the table shows them."""
    import json

    from diffusion_offload.cli import main

    directory, dit_bytes = wan_dir
    host = dit_bytes // 2
    args = ["plan", str(directory), "--device-kind", "fakegpu", "--device-memory", "8GiB",
            "--height", "32", "--width", "32", "--num-frames", "5", "--steps", "1",
            "--host-memory", f"{host}B", "--disk-bandwidth", "1GB/s"]
    assert main([*args, "--json"]) == 0
    out = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    _, want = _rows(directory, host - tiers.reserve_bytes(host), bandwidth=1e9, cfg=None)
    for name, row in want.items():
        got = out[name]
        assert (got["pinned_bytes"], got["pageable_bytes"], got["disk_bytes"], got["staging_bytes"],
                got["disk_read_bytes_per_request"], got["host_fits"]) == (
            row.pinned_bytes, row.pageable_bytes, row.disk_bytes, row.staging_bytes,
            row.disk_read_bytes_per_request, row.host_fits)
    assert out["module dit"]["disk_bytes"] > 0
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "pinned  pageable" in table and "disk/request" in table


def test_auto_respects_the_host_budget(wan_dir):
    """With the device too small for all resident, ``auto`` picks an offload candidate;
    under a host budget it picks one planned with the disk tier; with a host budget
    nothing's RAM-only copies fit, nothing fits (a one-line ``FitError``)."""
    import torch

    from diffusion_offload.models.fit import FitError
    from diffusion_offload.planner.auto import auto_config

    directory, dit_bytes = wan_dir
    _, rows = _rows(directory, None, cfg=None)
    free = rows["all resident"].peak_bytes - 1
    kwargs = {"device_kind": "fakegpu", "free_bytes": free, "dtype": torch.float32,
              "shape": {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1},
              "modes": ("module", "layer")}
    assert auto_config(directory, **kwargs).row.name != "all resident"
    picked = auto_config(directory, host_memory_budget=dit_bytes // 3, **kwargs).row
    assert picked.host_fits and picked.disk_bytes > 0
    assert picked.pinned_bytes + picked.staging_bytes <= dit_bytes // 3
    with pytest.raises(FitError, match="no candidate fits") as info:
        auto_config(directory, host_memory_budget=0, **kwargs)
    assert "the host-memory budget cannot hold the RAM-only host copies of ['module" in str(info.value)
