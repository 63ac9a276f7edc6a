"""The platform layer: device normalisation, platform choice, per-backend calls."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from diffusion_offload.core import platform as platform_mod
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.core.platform import (
    CpuPlatform,
    CudaPlatform,
    FakePlatform,
    MemoryStats,
    MpsPlatform,
    NpuPlatform,
    Platform,
    XpuPlatform,
    normalize_device,
    platform_for,
    same_device,
)

ALLOWED_TYPES = ["'cpu'", "'cuda'", "'fakegpu'", "'mps'", "'npu'", "'xpu'"]


def _npu_device(index: int = 0) -> types.SimpleNamespace:
    """A stand-in for ``torch.device("npu", index)``.

    ``torch.device("npu")`` exists only once ``torch_npu`` has renamed PrivateUse1 (and
    in this process the fake accelerator owns PrivateUse1), so npu tests use this object.
    """
    return types.SimpleNamespace(type="npu", index=index)


@pytest.fixture
def npu_devices(monkeypatch):
    """Make ``platform_for("npu[:N]")`` resolvable without ``torch_npu``."""
    real = platform_mod.normalize_device

    def fake_normalize(device):
        if isinstance(device, str) and device.split(":")[0] == "npu":
            index = int(device.split(":")[1]) if ":" in device else 0
            return _npu_device(index)
        return real(device)

    monkeypatch.setattr(platform_mod, "normalize_device", fake_normalize)


# ----------------------------------------------------------------------------- normalize_device


def test_normalize_cpu():
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device("cpu").index is None
    assert normalize_device("cpu:0") == torch.device("cpu")
    assert normalize_device(torch.device("cpu")) == torch.device("cpu")


def test_normalize_int_is_cuda():
    assert normalize_device(0) == torch.device("cuda", 0)
    assert normalize_device(3) == torch.device("cuda", 3)
    assert normalize_device(3).index == 3


def test_normalize_keeps_explicit_index(monkeypatch):
    fake = mock.MagicMock()
    fake.current_device.return_value = 3
    monkeypatch.setattr(torch, "xpu", fake, raising=False)
    assert normalize_device("xpu:5") == torch.device("xpu", 5)
    assert normalize_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    fake.current_device.assert_not_called()


@pytest.mark.parametrize("spelling", ["xpu", torch.device("xpu")])
def test_normalize_reads_current_device(monkeypatch, spelling):
    xpu = types.SimpleNamespace(current_device=lambda: 3)
    monkeypatch.setattr(torch, "xpu", xpu, raising=False)
    dev = normalize_device(spelling)
    assert dev == torch.device("xpu", 3)
    assert dev.index == 3
    assert dev != torch.device("xpu")  # why normalisation exists


def test_normalize_cuda_reads_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert normalize_device("cuda") == torch.device("cuda", 2)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 2)


def test_normalize_mps_reads_current_device_when_present(monkeypatch):
    fake = mock.MagicMock()
    fake.current_device.return_value = 1
    monkeypatch.setattr(torch, "mps", fake, raising=False)
    assert normalize_device("mps") == torch.device("mps", 1)


def test_normalize_without_current_device_defaults_to_index_0(monkeypatch):
    monkeypatch.setattr(torch, "mps", types.SimpleNamespace(), raising=False)
    assert normalize_device("mps") == torch.device("mps", 0)


def test_normalize_uninitialised_backend_defaults_to_index_0(monkeypatch):
    def boom():
        raise RuntimeError("Torch not compiled with XPU enabled")

    monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(current_device=boom), raising=False)
    assert normalize_device("xpu") == torch.device("xpu", 0)


@pytest.mark.parametrize("bad", [[0], ["cuda"], None, 1.0, True, False, {"type": "cuda"}])
def test_normalize_bad_type(bad):
    with pytest.raises(TypeError, match="device must be a str, int or torch.device"):
        normalize_device(bad)
    with pytest.raises(TypeError):
        platform_for(bad)


def test_normalize_unknown_string_is_torchs_error():
    with pytest.raises(RuntimeError):
        normalize_device("gpu")


def test_same_device():
    assert same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not same_device(torch.device("cuda", 1), torch.device("cuda"))
    assert not same_device(torch.device("cuda", 0), torch.device("xpu", 0))
    assert same_device(torch.device("cpu"), torch.device("cpu"))


# ----------------------------------------------------------------------------- platform_for


@pytest.mark.parametrize(
    ("device", "cls", "expected"),
    [
        ("cuda", CudaPlatform, torch.device("cuda", 0)),
        ("cuda:1", CudaPlatform, torch.device("cuda", 1)),
        (2, CudaPlatform, torch.device("cuda", 2)),
        (torch.device("cuda", 3), CudaPlatform, torch.device("cuda", 3)),
        ("xpu:1", XpuPlatform, torch.device("xpu", 1)),
        (torch.device("xpu", 0), XpuPlatform, torch.device("xpu", 0)),
        ("mps", MpsPlatform, torch.device("mps", 0)),
        ("cpu", CpuPlatform, torch.device("cpu")),
        (torch.device("cpu"), CpuPlatform, torch.device("cpu")),
    ],
)
def test_platform_for_chooses_by_type(monkeypatch, device, cls, expected):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "mps", types.SimpleNamespace(), raising=False)
    p = platform_for(device, module=mock.MagicMock())
    assert type(p) is cls
    assert p.device == expected
    assert p.name == expected.type
    assert repr(p) == f"{cls.__name__}({expected})"


def test_platform_for_npu(npu_devices):
    p = platform_for("npu:1", module=mock.MagicMock())
    assert type(p) is NpuPlatform
    assert p.device.type == "npu" and p.device.index == 1
    assert p.name == "npu"
    assert platform_mod._PLATFORMS["npu"] is NpuPlatform


def test_platform_for_npu_defaults_to_torch_npu(npu_devices, monkeypatch):
    fake = mock.MagicMock()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    p = platform_for("npu")
    p.empty_cache()
    fake.empty_cache.assert_called_once_with()


@requires_fake
def test_platform_for_fakegpu(fake_device):
    for spelling in ("fakegpu", "fakegpu:0", fake_device, torch.device("fakegpu")):
        p = platform_for(spelling)
        assert type(p) is FakePlatform
        assert p.device == torch.device("fakegpu", 0)


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "vulkan", "hpu:0", "xla"])
def test_platform_for_unknown_type(device):
    with pytest.raises(ValueError) as info:
        platform_for(device)
    message = str(info.value)
    dev_type = torch.device(device).type
    assert f"'{dev_type}:0'" in message
    assert "not supported" in message
    for name in ALLOWED_TYPES:
        assert name in message


# ----------------------------------------------------------------------------- per-backend calls


def _module_mock() -> mock.MagicMock:
    m = mock.MagicMock()
    m.memory_allocated.return_value = 1000
    m.max_memory_allocated.return_value = 5000
    m.mem_get_info.return_value = (7000, 9000)
    m.current_allocated_memory.return_value = 1200
    m.driver_allocated_memory.return_value = 3000
    m.recommended_max_memory.return_value = 16000
    return m


FLAGS = {
    # type: (supports_pinning, blocking_d2h, is_noop)
    "cuda": (True, False, False),
    "xpu": (True, True, False),
    "npu": (True, False, False),
    "mps": (False, False, False),
    "cpu": (False, False, True),
    "fakegpu": (True, False, False),
}


def test_flag_table_covers_every_platform():
    assert set(FLAGS) == set(platform_mod._PLATFORMS)
    for name, cls in platform_mod._PLATFORMS.items():
        assert (cls.supports_pinning, cls.blocking_d2h, cls.is_noop) == FLAGS[name], name
        assert issubclass(cls, Platform)


@pytest.mark.parametrize("device", ["cuda:1", "xpu:2", "npu:3"])
def test_device_module_calls(npu_devices, device):
    m = _module_mock()
    p = platform_for(device, module=m)
    dev = p.device
    assert (p.supports_pinning, p.blocking_d2h, p.is_noop) == FLAGS[dev.type]

    p.synchronize()
    m.synchronize.assert_called_once_with(dev)

    p.empty_cache()
    m.empty_cache.assert_called_once_with()

    stats = p.memory_stats()
    assert stats == MemoryStats(
        allocated_bytes=1000, peak_bytes=5000, free_bytes=7000, total_bytes=9000
    )
    assert all(type(v) is int for v in (stats.allocated_bytes, stats.peak_bytes))
    m.memory_allocated.assert_called_once_with(dev)
    m.max_memory_allocated.assert_called_once_with(dev)
    m.mem_get_info.assert_called_once_with(dev)

    p.reset_peak_memory()
    m.reset_peak_memory_stats.assert_called_once_with(dev)


def test_device_module_without_mem_get_info():
    m = mock.MagicMock(spec=["synchronize", "memory_allocated", "max_memory_allocated"])
    m.memory_allocated.return_value = 10
    m.max_memory_allocated.return_value = 20
    p = platform_for("cuda:0", module=m)
    assert p.memory_stats() == MemoryStats(10, 20, None, None)


def test_default_module_is_the_torch_module(monkeypatch):
    fake = _module_mock()
    monkeypatch.setattr(torch, "xpu", fake, raising=False)
    p = platform_for("xpu:0")
    p.synchronize()
    fake.synchronize.assert_called_once_with(torch.device("xpu", 0))


def test_mps_calls():
    m = _module_mock()
    p = platform_for("mps:0", module=m)
    assert type(p) is MpsPlatform
    assert (p.supports_pinning, p.blocking_d2h, p.is_noop) == FLAGS["mps"]

    p.synchronize()
    m.synchronize.assert_called_once_with()  # torch.mps.synchronize takes no device

    p.empty_cache()
    m.empty_cache.assert_called_once_with()

    stats = p.memory_stats()
    assert stats == MemoryStats(
        allocated_bytes=1200, peak_bytes=1200, free_bytes=16000 - 3000, total_bytes=16000
    )
    m.current_allocated_memory.assert_called_once_with()
    m.recommended_max_memory.assert_called_once_with()
    m.driver_allocated_memory.assert_called_once_with()
    m.memory_allocated.assert_not_called()
    m.mem_get_info.assert_not_called()

    p.reset_peak_memory()
    m.reset_peak_memory_stats.assert_not_called()


def test_mps_free_bytes_never_negative():
    m = _module_mock()
    m.driver_allocated_memory.return_value = 20000
    assert platform_for("mps:0", module=m).memory_stats().free_bytes == 0


def test_mps_without_recommended_max_memory():
    m = mock.MagicMock(spec=["current_allocated_memory", "driver_allocated_memory"])
    m.current_allocated_memory.return_value = 64
    assert platform_for("mps:0", module=m).memory_stats() == MemoryStats(64, 64, None, None)


def test_cpu_is_noop():
    m = _module_mock()
    p = platform_for("cpu", module=m)
    assert type(p) is CpuPlatform
    assert (p.supports_pinning, p.blocking_d2h, p.is_noop) == FLAGS["cpu"]
    assert p.synchronize() is None
    assert p.empty_cache() is None
    assert p.reset_peak_memory() is None
    assert p.memory_stats() == MemoryStats(0, 0, None, None)
    assert m.mock_calls == []


def test_cpu_without_module():
    p = platform_for("cpu")
    p.synchronize()
    p.empty_cache()
    p.reset_peak_memory()
    assert p.memory_stats() == MemoryStats(0, 0, None, None)


# ----------------------------------------------------------------------------- fake accelerator


@pytest.fixture
def fake_platform(fake_device):
    from diffusion_offload.testing import fake_accelerator

    fake_accelerator.set_capacity(None)
    try:
        yield platform_for(fake_device), fake_accelerator
    finally:
        fake_accelerator.set_capacity(None)


@requires_fake
def test_fake_platform_flags(fake_platform):
    p, _ = fake_platform
    assert type(p) is FakePlatform
    assert (p.supports_pinning, p.blocking_d2h, p.is_noop) == FLAGS["fakegpu"]
    assert p.name == "fakegpu"


@requires_fake
def test_fake_platform_memory_stats(fake_platform):
    p, fa = fake_platform
    before = p.memory_stats().allocated_bytes
    assert before == fa.stats()["allocated_bytes"]
    t = torch.zeros(1000, device=p.device)  # 4000 bytes
    stats = p.memory_stats()
    assert stats.allocated_bytes == fa.stats()["allocated_bytes"] == before + 4000
    assert stats.peak_bytes == fa.stats()["peak_bytes"] >= stats.allocated_bytes
    assert stats.total_bytes is not None and stats.free_bytes is not None
    assert stats.free_bytes == stats.total_bytes - stats.allocated_bytes
    del t


@requires_fake
def test_fake_platform_capacity(fake_platform):
    p, fa = fake_platform
    t = torch.ones(256, device=p.device)
    allocated = fa.stats()["allocated_bytes"]
    assert allocated >= 1024
    capacity = allocated + 10_000
    fa.set_capacity(capacity)
    stats = p.memory_stats()
    assert stats.total_bytes == capacity
    assert stats.free_bytes == capacity - fa.stats()["allocated_bytes"] == 10_000
    assert stats.allocated_bytes == allocated
    fa.set_capacity(None)
    assert p.memory_stats().total_bytes != capacity
    del t


@requires_fake
def test_fake_platform_synchronize_counts_once(fake_platform):
    p, fa = fake_platform
    before = fa.stats()["synchronizes"]
    p.synchronize()
    assert fa.stats()["synchronizes"] == before + 1
    p.synchronize()
    assert fa.stats()["synchronizes"] == before + 2


@requires_fake
def test_fake_platform_reset_peak(fake_platform):
    p, fa = fake_platform
    keep = torch.ones(100, device=p.device)
    tmp = torch.ones(1000, device=p.device)
    del tmp
    stats = p.memory_stats()
    assert stats.peak_bytes >= stats.allocated_bytes + 4000
    p.reset_peak_memory()
    stats = p.memory_stats()
    assert stats.peak_bytes == stats.allocated_bytes == fa.stats()["peak_bytes"]
    p.empty_cache()  # accepted, nothing to release
    del keep
