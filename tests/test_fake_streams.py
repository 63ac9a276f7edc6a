"""Streams, events, the race detector and the copy-bandwidth model of the fake accelerator."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.fake_accelerator import host_races, races

D = 32  # block weights are D x D float32: 4096 bytes


def _side(s: fa.Stream) -> str:
    return f"stream {s.stream_id} (side)"


@pytest.fixture
def streams(fake_device):
    """A fresh copy stream, the default stream, and a clean slate of counters."""
    fa.set_copy_bandwidth(None)
    fa.synchronize()  # nothing pending from earlier tests
    fa.reset_stats()
    yield torch.fakegpu.Stream(device=fake_device), torch.fakegpu.current_stream()
    fa.set_copy_bandwidth(None)
    fa.synchronize()
    fa.reset_stats()


def test_api_matches_torch_cuda_shapes(fake_device):
    mod = torch.fakegpu
    for name in ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream"):
        assert getattr(mod, name) is not None
    default = mod.current_stream(device=fake_device)
    assert default.stream_id == 0 and default == mod.default_stream() == fa.current_stream()
    s = mod.Stream(device=fake_device)
    t = fa.Stream(device="fakegpu:0", priority=-1)
    assert isinstance(s, torch.Stream) and s.device == fake_device
    assert s.stream_id > 0 and t.stream_id == s.stream_id + 1 and s != t
    # == and hash by id, also against a plain torch.Stream naming the same stream
    same = torch.Stream(stream_id=s.stream_id, device_type=s.device_type, device_index=0)
    assert s == same and hash(s) == hash(same) and len({s, same, t}) == 2
    with mod.stream(s):
        assert mod.current_stream() == s
        with mod.stream(None):  # None: no change, as torch.cuda.stream(None)
            assert mod.current_stream() == s
        with t:
            assert mod.current_stream() == t
        assert mod.current_stream() == s
    assert mod.current_stream() == default
    with pytest.raises(ValueError, match="not a fakegpu device"):
        mod.Stream(device="cpu")
    with pytest.raises(ValueError, match="not a fakegpu device"):
        mod.current_stream(device="fakegpu:1")
    e = mod.Event(enable_timing=True, blocking=False, interprocess=False)
    assert e.query()  # never recorded: complete, as CUDA
    assert s.record_event(e) is e and e.query() and s.query()
    with pytest.raises(TypeError, match="expected a fakegpu Event"):
        s.wait_event(object())  # type: ignore[arg-type]


def test_record_stream_works_on_fake_tensors(streams, fake_device):
    copy, default = streams
    x = torch.ones(4, device=fake_device)
    x.record_stream(copy)
    x.record_stream(default)
    plain = torch.Stream(stream_id=copy.stream_id, device_type=copy.device_type, device_index=0)
    x.record_stream(plain)
    foreign = torch.Stream(stream_id=1, device_type=1, device_index=0)  # a cuda stream
    with pytest.raises(ValueError, match="not a fakegpu stream"):
        x.record_stream(foreign)
    assert fa.stats()["races_detected"] == 0


def _prefetch_loop(blocks, x, copy, release: str):
    """The layer-offload pattern: copy block i+1 on ``copy`` while block i computes."""
    default = fa.current_stream()
    with fa.stream(copy):
        nxt = blocks[0].to(x.device, non_blocking=True)
        ev = copy.record_event()
    for i in range(len(blocks)):
        default.wait_event(ev)
        w = nxt
        if i + 1 < len(blocks):
            with fa.stream(copy):
                nxt = blocks[i + 1].to(x.device, non_blocking=True)
                ev = copy.record_event()
        x = torch.tanh(x @ w)
        if release == "record_stream":
            w.record_stream(default)
        else:  # the copy stream waits for compute before the block is dropped
            done = fa.Event()
            done.record()
            copy.wait_event(done)
        del w
    return x


@pytest.mark.parametrize("release", ["record_stream", "event"])
def test_correct_prefetch_loop_has_no_races_and_exact_counters(streams, fake_device, release):
    copy, _ = streams
    blocks = [torch.randn(D, D) / D**0.5 for _ in range(6)]
    x_host = torch.randn(3, D)
    ref = x_host
    for w in blocks:
        ref = torch.tanh(ref @ w)
    base = fa.stats()["allocated_bytes"]
    x = x_host.to(fake_device)
    out = _prefetch_loop(blocks, x, copy, release).cpu()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    s = fa.stats()
    block_bytes = D * D * 4
    assert s["races_detected"] == 0
    assert s["h2d_bytes"] == 6 * block_bytes + 3 * D * 4
    assert s["d2h_bytes"] == 3 * D * 4
    assert s["transfers"] == 6 + 2
    assert s["events"] == 6 + (6 if release == "event" else 0)
    assert s["stream_waits"] == 6 + (6 if release == "event" else 0)
    assert s["synchronizes"] == 0  # compute waited on events, never the whole device
    # peak: two blocks (current, prefetched) and four 3 x D activations (the caller's
    # input, the previous block's output, matmul out, tanh out), nothing else
    assert s["peak_bytes"] - base == 2 * block_bytes + 4 * 3 * D * 4
    del x


def test_missing_wait_event_raises_naming_shape_and_streams(streams, fake_device):
    copy, _ = streams
    x = torch.randn(3, D, device=fake_device)
    with fa.stream(copy):
        w = torch.randn(D, 2 * D).to(fake_device, non_blocking=True)
        copy.record_event()
    with pytest.raises(fa.RaceError) as info:
        x @ w  # no wait_event: the copy may still be in flight
    msg = str(info.value)
    assert f"shape ({D}, {2 * D})" in msg and "dtype torch.float32" in msg
    assert f"{_side(copy)} host-to-device copy" in msg and "still pending" in msg
    assert "read by aten.mm.default on stream 0 (default)" in msg
    assert "without an event wait" in msg
    assert fa.stats()["races_detected"] == 1
    assert isinstance(info.value, RuntimeError)
    # a write over the pending copy is a race as well
    with pytest.raises(fa.RaceError, match=r"written by aten\.fill_\.Scalar on stream 0"):
        w.fill_(0.0)
    assert fa.stats()["races_detected"] == 2


@pytest.mark.parametrize("read", ["cpu", "item", "tolist", "to_cpu_non_blocking", "copy_to_host"])
def test_host_read_of_pending_tensor_races(streams, fake_device, read):
    copy, _ = streams
    with fa.stream(copy):
        w = torch.arange(4.0).to(fake_device, non_blocking=True)
    do = {
        "cpu": lambda: w.cpu(),
        "item": lambda: w[1].item(),
        "tolist": lambda: w.tolist(),
        "to_cpu_non_blocking": lambda: w.to("cpu", non_blocking=True),
        "copy_to_host": lambda: torch.empty(4).copy_(w),
    }[read]
    pattern = (
        r"shape \((4,)?\), dtype torch.float32( \(a view of one allocated with shape \(4,\)\))?: "
        rf"{re.escape(_side(copy))} host-to-device copy "
        r".* pending, read by (device-to-host copy \(host read\)|host read \(\.item\(\)\)) "
        r"on stream 0 \(default\)"
    )
    with pytest.raises(fa.RaceError, match=pattern):
        do()
    assert fa.stats()["races_detected"] == 1
    with fa.stream(copy):  # on the stream that wrote it, the read is ordered: fine
        assert w.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert fa.stats()["races_detected"] == 1


def test_freeing_block_used_by_compute_without_ordering_is_caught(streams, fake_device):
    copy, default = streams
    x = torch.randn(3, D, device=fake_device)
    with fa.stream(copy):
        w = torch.randn(D, D).to(fake_device, non_blocking=True)  # allocated on the copy stream
        ev = copy.record_event()
    default.wait_event(ev)
    y = x @ w  # compute uses the block on the default stream
    del w  # no record_stream, and the copy stream never waited on compute
    assert fa.stats()["races_detected"] == 1  # found at the free ...
    with pytest.raises(fa.RaceError) as info:
        y + 1  # ... raised by the next fakegpu op
    msg = str(info.value)
    assert f"shape ({D}, {D}), dtype torch.float32, allocated on {_side(copy)} was freed" in msg
    assert "aten.mm.default on stream 0 (default)" in msg and "record_stream" in msg
    y + 1  # raised once only
    assert fa.stats()["races_detected"] == 1


@pytest.mark.parametrize("ordering", ["record_stream", "wait_stream", "event", "synchronize"])
def test_freeing_block_after_proper_ordering_is_fine(streams, fake_device, ordering):
    copy, default = streams
    x = torch.randn(3, D, device=fake_device)
    with fa.stream(copy):
        w = torch.randn(D, D).to(fake_device, non_blocking=True)
    default.wait_stream(copy)
    y = x @ w
    if ordering == "record_stream":
        w.record_stream(default)
    elif ordering == "wait_stream":
        copy.wait_stream(default)
    elif ordering == "event":
        default.record_event().wait(copy)
    else:
        fa.synchronize()
    del w
    y + 1
    assert fa.stats()["races_detected"] == 0


def test_reusing_a_buffer_still_read_by_compute_is_a_race(streams, fake_device):
    copy, default = streams
    with fa.stream(copy):
        buf = torch.randn(D, D).to(fake_device, non_blocking=True)
    default.wait_stream(copy)
    y = torch.ones(2, D, device=fake_device) @ buf  # compute reads buf
    with fa.stream(copy):
        pattern = (
            r"stream 0 \(default\) aten\.mm\.default .* may still be using it, "
            r"written by host-to-device copy"
        )
        with pytest.raises(fa.RaceError, match=pattern):
            buf.copy_(torch.zeros(D, D), non_blocking=True)
        copy.wait_stream(default)  # the right way: wait for compute first
        buf.copy_(torch.zeros(D, D), non_blocking=True)
    assert fa.stats()["races_detected"] == 1
    del y


def test_synchronize_and_host_waits_clear_pending(streams, fake_device):
    copy, default = streams
    before = fa.stats()["synchronizes"]
    for complete in ("device", "stream", "event", "query", "blocking_copy"):
        with fa.stream(copy):
            w = torch.full((5,), 2.0).to(fake_device, non_blocking=True)
            ev = copy.record_event()
            if complete == "blocking_copy":  # the host waits for the stream up to here
                torch.zeros(1).to(fake_device)
        {
            "device": fa.synchronize,
            "stream": copy.synchronize,
            "event": ev.synchronize,
            "query": lambda: ev.query() or pytest.fail("no bandwidth set: complete at once"),
            "blocking_copy": lambda: None,
        }[complete]()
        assert w.sum().item() == 10.0
        del w
    assert fa.stats()["races_detected"] == 0
    assert fa.stats()["synchronizes"] == before + 1


def test_waits_are_transitive(streams, fake_device):
    copy, default = streams
    other = fa.Stream()
    with fa.stream(copy):
        w = torch.ones(3).to(fake_device, non_blocking=True)
        e1 = copy.record_event()
    other.wait_event(e1)
    with fa.stream(other):
        e2 = other.record_event()
    default.wait_event(e2)  # default -> other -> copy
    assert w.sum().item() == 3.0
    with fa.stream(copy):
        v = torch.ones(3).to(fake_device, non_blocking=True)
    with fa.stream(other):  # waited on e1 only: v was copied after e1
        pattern = (
            f"{re.escape(_side(copy))} host-to-device copy .* "
            f"read by aten.mul.Tensor on {re.escape(_side(other))}"
        )
        with pytest.raises(fa.RaceError, match=pattern):
            v * 2
    assert fa.stats()["races_detected"] == 1


def test_side_stream_compute_is_pending_too(streams, fake_device):
    copy, default = streams
    a = torch.ones(4, device=fake_device)
    with fa.stream(copy):
        b = a * 3  # allocated and written on the side stream
    with pytest.raises(fa.RaceError, match=r"aten\.mul\.Tensor \(seq \d+\) is still pending"):
        b + 1
    default.wait_stream(copy)
    assert (b + 1).tolist() == [4.0] * 4


def test_default_only_storages_stay_untracked(streams, fake_device):
    x = torch.randn(8, device=fake_device)
    y = (x * 2).sum()
    assert fa.storage_key(x) not in races._tracked and fa.storage_key(y) not in races._tracked
    copy, _ = streams
    with fa.stream(copy):
        z = torch.ones(2, device=fake_device)
    assert fa.storage_key(z) in races._tracked


def test_no_stream_bookkeeping_until_a_side_stream_exists():
    code = (
        "import torch\n"
        "from diffusion_offload.testing import fake_accelerator as fa\n"
        "from diffusion_offload.testing.fake_accelerator import races\n"
        "from diffusion_offload.testing.fake_accelerator.state import state\n"
        "dev = fa.install()\n"
        "x = torch.randn(4, 4).to(dev, non_blocking=True)\n"
        "(x @ x).sum().item(); x.record_stream(torch.fakegpu.current_stream())\n"
        "assert not state.model_on and not races._tracked, 'model path used'\n"
        "assert fa.current_stream()._clock == {0: 0}\n"
        "fa.Stream()\n"
        "assert state.model_on\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_stats_counters_and_reset(streams, fake_device):
    copy, default = streams
    e = fa.Event()
    e.record(copy)  # 1 event
    copy.record_event()  # 2
    default.wait_event(e)  # 1 wait
    e.wait()  # 2 (current stream)
    copy.wait_stream(default)  # 3
    with fa.stream(copy):
        w = torch.ones(2).to(fake_device, non_blocking=True)
    with pytest.raises(fa.RaceError):
        w + 1
    s = fa.stats()
    assert (s["events"], s["stream_waits"], s["races_detected"]) == (2, 3, 1)
    fa.reset_stats()
    s = fa.stats()
    assert s["events"] == s["stream_waits"] == s["races_detected"] == 0
    with pytest.raises(fa.RaceError):  # reset_stats keeps the ordering facts: still pending
        w + 1


def test_set_copy_bandwidth_validates(fake_device):
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            fa.set_copy_bandwidth(bad)
    for bad in ("1e9", True):
        with pytest.raises(TypeError):
            fa.set_copy_bandwidth(bad)  # type: ignore[arg-type]
    fa.set_copy_bandwidth(None)


def test_bandwidth_times_copies_and_events(streams, fake_device):
    copy, default = streams
    nbytes = 1 << 20
    fa.set_copy_bandwidth(nbytes / 0.05)  # 50 ms per MiB
    host = torch.zeros(nbytes // 4)
    start = time.perf_counter()
    with fa.stream(copy):
        begin = copy.record_event(fa.Event(enable_timing=True))
        w = host.to(fake_device, non_blocking=True)
        end = copy.record_event(fa.Event(enable_timing=True))
    issued = time.perf_counter() - start
    assert issued < 0.04  # non_blocking on a side stream: the host did not wait
    assert not end.query()
    default.wait_event(end)  # the host sleeps until the copy completes
    waited = time.perf_counter() - start
    assert waited >= 0.05
    # 50 ms of copy, after the host issued it (the real memcpy runs first)
    assert 50.0 <= begin.elapsed_time(end) <= 50.0 + issued * 1000 + 1.0
    start = time.perf_counter()
    host.to(fake_device)  # blocking copy on the default stream: the host sleeps
    assert time.perf_counter() - start >= 0.05
    del w


class _Blocks:
    """16 ``nn.Linear(256, 256)`` blocks kept on the host, run block by block on the device
    in the two loops a layer-wise offload backend chooses between. Each loop returns
    (wall seconds, seconds spent in block compute)."""

    def __init__(self, device: torch.device, kernel_s: float) -> None:
        self.device = device
        self.kernel_s = kernel_s  # a fixed host sleep per block standing in for GPU time
        self.blocks = [torch.nn.Linear(256, 256) for _ in range(16)]
        self.nbytes = sum(p.numel() * 4 for p in self.blocks[0].parameters())
        self.x0 = torch.randn(64, 256, device=device)
        self.reps = 1

    def compute(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = torch.nn.functional.linear(x, weight, bias).tanh()
        if self.kernel_s:
            time.sleep(self.kernel_s)
        return x

    def calibrate(self, min_s: float) -> None:
        """Real compute repetitions so a block's compute takes >= ``min_s``."""
        w, b = (p.detach().to(self.device) for p in self.blocks[0].parameters())
        while self.reps < 4096:
            t = time.perf_counter()
            self.compute(self.x0, w, b)
            if time.perf_counter() - t >= min_s:
                return
            self.reps *= 2

    def mean_compute(self) -> float:
        """One block's compute as the mean over a pass with the weights resident: what
        the loops will see on this (shared) machine now, not the luckiest block."""
        resident = [[p.detach().to(self.device) for p in b.parameters()] for b in self.blocks]
        t = time.perf_counter()
        x = self.x0
        for w, b in resident:
            x = self.compute(x, w, b)
        return (time.perf_counter() - t) / len(self.blocks)

    def serial(self) -> tuple[float, float]:
        """Copy block i (blocking), then compute it."""
        start = time.perf_counter()
        busy = 0.0
        x = self.x0
        for block in self.blocks:
            w, b = (p.detach().to(self.device) for p in block.parameters())
            t = time.perf_counter()
            x = self.compute(x, w, b)
            busy += time.perf_counter() - t
            del w, b
        fa.synchronize()
        return time.perf_counter() - start, busy

    def prefetched(self, copy: fa.Stream) -> tuple[float, float]:
        """Copy block i+1 on the copy stream while block i computes."""
        default = fa.current_stream()
        n = len(self.blocks)

        def issue(i: int):
            with fa.stream(copy):
                params = [
                    p.detach().to(self.device, non_blocking=True)
                    for p in self.blocks[i].parameters()
                ]
                return params, copy.record_event()

        start = time.perf_counter()
        busy = 0.0
        x = self.x0
        nxt, ev = issue(0)
        for i in range(n):
            default.wait_event(ev)
            (w, b) = nxt
            if i + 1 < n:
                nxt, ev = issue(i + 1)
            t = time.perf_counter()
            x = self.compute(x, w, b)
            busy += time.perf_counter() - t
            w.record_stream(default)
            b.record_stream(default)
            del w, b
        fa.synchronize()
        return time.perf_counter() - start, busy


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    fa.set_copy_bandwidth(None)


def test_prefetch_halves_wall_time_when_copy_equals_compute(streams, fake_device, one_thread):
    """16 Linear blocks; one block's copy takes as long as its compute. Prefetching block
    i+1 on the copy stream while block i computes takes <= 0.6x the wall time of
    copy-then-compute (ideal 17/32). A block's compute is a real Linear plus a fixed 16 ms
    host sleep standing in for the kernel's GPU time, so the ratio holds on a loaded,
    shared CPU (the next test shows the overlap with pure CPU compute)."""
    copy, _ = streams
    blocks = _Blocks(fake_device, kernel_s=0.016)
    ratios = []
    deadline = time.perf_counter() + 6.0
    while not ratios or (min(ratios) > 0.6 and time.perf_counter() < deadline):
        copy_s = blocks.mean_compute()
        fa.set_copy_bandwidth(blocks.nbytes / copy_s)
        fa.reset_stats()
        slow, _ = blocks.serial()
        assert slow >= 16 * (copy_s + blocks.kernel_s)  # the copies' and kernels' sleeps
        fast, _ = blocks.prefetched(copy)
        s = fa.stats()
        assert (s["events"], s["stream_waits"], s["races_detected"]) == (16, 16, 0)
        assert s["h2d_bytes"] == 2 * 16 * blocks.nbytes and s["synchronizes"] == 2
        ratios.append(fast / slow)
    assert min(ratios) <= 0.6, ratios


def test_prefetch_hides_copies_behind_real_cpu_compute(streams, fake_device, one_thread):
    """The same loops with pure CPU compute (no sleeps), a block's copy taking half its
    compute. The wall time minus the time spent computing is the copy time the host was
    exposed to: all 16 copies serially; prefetched, the first copy plus the waits for
    copies that outlast a block's compute. Exposures, not walls, are compared, and the
    copy is half a block's compute, so a shared machine's load changing the compute time
    between calibration and the runs does not decide the result."""
    copy, _ = streams
    blocks = _Blocks(fake_device, kernel_s=0.0)
    blocks.calibrate(0.020)
    results = []
    deadline = time.perf_counter() + 5.0
    while not results or (results[-1][0] > 0.5 * results[-1][1] and time.perf_counter() < deadline):
        copy_s = 0.5 * blocks.mean_compute()
        fa.set_copy_bandwidth(blocks.nbytes / copy_s)
        fa.reset_stats()
        slow, slow_busy = blocks.serial()
        fast, fast_busy = blocks.prefetched(copy)
        exposed_serial, exposed_prefetch = slow - slow_busy, fast - fast_busy
        assert exposed_serial >= 16 * copy_s  # the copies' sleeps
        assert fa.stats()["races_detected"] == 0
        results.append((exposed_prefetch, exposed_serial, copy_s))
    assert results[-1][0] <= 0.5 * results[-1][1], results


# ----------------------------------------------------------------------------- host side
#
# The host is its own participant: it knows a stream's work complete only after a
# synchronize, an event/stream synchronize, a query() that returned True, or a blocking
# copy on a stream ordered after that work. Non-blocking copies between the device and
# pinned (or registered) host memory stay pending for the host until then.

_HOST_PENDING_D2H = (
    r"pinned host tensor of shape .*: stream \d+ \((side|default)\) device-to-host copy "
    r"\(seq \d+\) into it is still pending, (read|written) by .* on the host: the host had "
    r"not waited for it"
)
_HOST_PENDING_H2D = (
    r"pinned host tensor of shape .*: stream \d+ \((side|default)\) host-to-device copy "
    r"\(seq \d+\) may still be reading it, written by .* on the host: the host had not "
    r"waited for it"
)


@pytest.fixture
def pinned_host(streams):
    """``make(how, values)``: a 4-element float32 host tensor in pinned memory, by
    ``pin_memory()`` or registered in place (``torch.fakegpu.host_register``, undone at
    teardown)."""
    registered = []

    def make(how: str, values=(0.0, 0.0, 0.0, 0.0)) -> torch.Tensor:
        t = torch.tensor(values)
        if how == "pin_memory":
            t = t.pin_memory()
        else:
            storage = t.untyped_storage()
            assert torch.fakegpu.host_register(storage.data_ptr(), storage.nbytes())
            registered.append((t, storage.data_ptr()))
        assert t.is_pinned()
        return t

    yield make
    fa.synchronize()
    for _, ptr in registered:
        torch.fakegpu.host_unregister(ptr)


def _issue_d2h(how: str, copy: fa.Stream, src: torch.Tensor, make) -> tuple[torch.Tensor, fa.Event]:
    """A non-blocking device->host copy of ``src`` into pinned memory; returns the host
    tensor and an event recorded after it on the stream it ran on."""
    stream = fa.current_stream() if how.endswith("default") else copy
    with fa.stream(stream):
        if how.startswith("to_cpu"):
            host = src.to("cpu", non_blocking=True)
            assert host.is_pinned()  # as on CUDA: a non-blocking D2H result is pinned
        else:
            host = make("registered" if how.startswith("registered") else "pin_memory")
            host.copy_(src, non_blocking=True)
        return host, stream.record_event()


_D2H_ISSUES = ["copy_side", "copy_default", "to_cpu_side", "to_cpu_default", "registered_side"]
_HOST_READS = {
    "op": lambda p: p + 1,
    "view_op": lambda p: p[1:].mean(),
    "equal": lambda p: torch.equal(p, torch.arange(4.0)),
    "clone": lambda p: p.clone(),
    "item": lambda p: p[2].item(),
    "float": lambda p: float(p[2]),
    "tolist": lambda p: p.tolist(),
    "repr": lambda p: repr(p),
    "format": lambda p: f"{p}",
    "host_copy_from": lambda p: torch.empty(4).copy_(p),
    "to_dtype": lambda p: p.to(torch.float64),
}


@pytest.mark.parametrize("read", sorted(_HOST_READS))
@pytest.mark.parametrize("issue", _D2H_ISSUES)
def test_host_read_during_pending_d2h_into_pinned_memory_races(
    streams, fake_device, pinned_host, issue, read
):
    """Reading pinned host memory that a non-blocking D2H copy is still writing races,
    whatever the torch op (printing and tolist() included), on the default stream too."""
    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h(issue, copy, src, pinned_host)
    with pytest.raises(fa.RaceError, match=_HOST_PENDING_D2H):
        _HOST_READS[read](host)
    assert fa.stats()["races_detected"] == 1
    ev.synchronize()  # the right way: the host waits for the copy
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    _HOST_READS[read](host)
    assert fa.stats()["races_detected"] == 1


_HOST_WAITS = {
    "event_synchronize": lambda copy, ev, src: ev.synchronize(),
    "stream_synchronize": lambda copy, ev, src: copy.synchronize(),
    "device_synchronize": lambda copy, ev, src: fa.synchronize(),
    "event_query": lambda copy, ev, src: ev.query() or pytest.fail("no bandwidth: complete"),
    "stream_query": lambda copy, ev, src: copy.query() or pytest.fail("no bandwidth: complete"),
    # a blocking read on a stream that is itself ordered after the copy
    "cpu_after_wait_event": lambda copy, ev, src: (fa.current_stream().wait_event(ev), src.cpu()),
    "item_after_wait_event": lambda copy, ev, src: (
        fa.current_stream().wait_event(ev),
        src[0].item(),
    ),
    "tolist_after_wait_stream": lambda copy, ev, src: (
        fa.current_stream().wait_stream(copy),
        src.tolist(),
    ),
    "blocking_copy_on_same_stream": lambda copy, ev, src: _on(copy, lambda: src.cpu()),
    "repr_on_same_stream": lambda copy, ev, src: _on(copy, lambda: repr(src)),
}


def _on(stream: fa.Stream, fn):
    with fa.stream(stream):
        return fn()


@pytest.mark.parametrize("wait", sorted(_HOST_WAITS))
def test_host_read_after_the_host_waited_for_the_d2h_is_fine(
    streams, fake_device, pinned_host, wait
):
    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    _HOST_WAITS[wait](copy, ev, src)
    for read in _HOST_READS.values():
        read(host)
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert fa.stats()["races_detected"] == 0
    assert not host_races._host_pending  # nothing left to track


def test_host_knowledge_is_transitive_through_stream_waits(streams, fake_device, pinned_host):
    """A blocking read on ``other`` tells the host what ``other`` waited on: copy -> other."""
    copy, _ = streams
    other = fa.Stream()
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    other.wait_event(ev)
    with fa.stream(other):
        torch.ones(1, device=fake_device).item()  # blocking on other, ordered after the copy
    assert (host + 1).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert fa.stats()["races_detected"] == 0


def test_a_stream_wait_or_an_unordered_blocking_read_does_not_tell_the_host(
    streams, fake_device, pinned_host
):
    """``wait_event`` orders a stream, not the host; a blocking read on a stream that is not
    ordered after the copy says nothing of it either."""
    copy, default = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    torch.ones(2, device=fake_device).cpu()  # blocking on the default stream: unordered
    with pytest.raises(fa.RaceError, match=_HOST_PENDING_D2H):
        host.sum()
    default.wait_event(ev)  # the default stream is ordered now, the host still is not
    with pytest.raises(fa.RaceError, match=_HOST_PENDING_D2H):
        host.sum()
    src.cpu()  # a blocking read on the (now ordered) default stream: the host knows
    assert host.sum().item() == 6.0
    assert fa.stats()["races_detected"] == 2


_H2D_ISSUES = ["to_side", "copy_side", "to_default", "registered_side"]
_HOST_WRITES = {
    "add_": lambda p: p.add_(1),
    "zero_": lambda p: p.zero_(),
    "fill_view": lambda p: p[1:3].fill_(7.0),
    "copy_into": lambda p: p.copy_(torch.ones(4)),
    "setitem": lambda p: p.__setitem__(0, 5.0),
    "data_iadd": lambda p: p.data.__iadd__(1),
    "out": lambda p: torch.add(torch.ones(4), 1, out=p),
    "d2h_copy_into_on_default": lambda p: p.copy_(torch.ones(4, device="fakegpu")),
}


def _issue_h2d(how: str, copy: fa.Stream, make) -> tuple[torch.Tensor, torch.Tensor, fa.Event]:
    """A non-blocking host->device copy from pinned memory; (source, device copy, event)."""
    stream = fa.current_stream() if how.endswith("default") else copy
    src = make("registered" if how.startswith("registered") else "pin_memory", (1.0, 2.0, 3.0, 4.0))
    with fa.stream(stream):
        if how.startswith("copy"):
            dev = torch.empty(4, device="fakegpu")
            dev.copy_(src, non_blocking=True)
        else:
            dev = src.to("fakegpu", non_blocking=True)
        return src, dev, stream.record_event()


@pytest.mark.parametrize("write", sorted(_HOST_WRITES))
@pytest.mark.parametrize("issue", _H2D_ISSUES)
def test_host_write_into_pinned_source_of_pending_h2d_races(
    streams, fake_device, pinned_host, issue, write
):
    """Writing the pinned source of a pending non-blocking H2D copy races (the copy may
    not have read it yet), by a host op or by a copy on a stream not ordered after it."""
    copy, default = streams
    src, dev, ev = _issue_h2d(issue, copy, pinned_host)
    stream_write = write == "d2h_copy_into_on_default"
    if stream_write and issue.endswith("default"):  # on the pending copy's own stream: ordered
        _HOST_WRITES[write](src)
        assert src.tolist() == [1.0] * 4 and fa.stats()["races_detected"] == 0
        return
    pattern = (
        r"host-to-device copy \(seq \d+\) may still be reading it, written by "
        r"device-to-host copy \(host read\) on stream 0 \(default\): no event wait"
        if stream_write
        else _HOST_PENDING_H2D
    )
    with pytest.raises(fa.RaceError, match=pattern):
        _HOST_WRITES[write](src)
    assert src.tolist() == [1.0, 2.0, 3.0, 4.0]  # the racing write did not run
    assert fa.stats()["races_detected"] == 1
    default.wait_event(ev)
    assert dev.tolist() == [1.0, 2.0, 3.0, 4.0]  # blocking on a stream ordered after it
    _HOST_WRITES[write](src)
    assert fa.stats()["races_detected"] == 1


@pytest.mark.parametrize(
    "wait",
    ["event_synchronize", "stream_synchronize", "device_synchronize", "cpu_after_wait_event"],
)
def test_host_write_after_the_host_waited_for_the_h2d_is_fine(
    streams, fake_device, pinned_host, wait
):
    copy, _ = streams
    src, dev, ev = _issue_h2d("to_side", copy, pinned_host)
    _HOST_WAITS[wait](copy, ev, dev)
    for write in _HOST_WRITES.values():
        write(src)
    assert fa.stats()["races_detected"] == 0


def test_reading_the_source_of_a_pending_h2d_is_no_race(streams, fake_device, pinned_host):
    copy, default = streams
    src, dev, ev = _issue_h2d("to_side", copy, pinned_host)
    for read in _HOST_READS.values():
        read(src)
    other = src.to(fake_device, non_blocking=True)  # a second reader on another stream
    assert other.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert fa.stats()["races_detected"] == 0
    with pytest.raises(fa.RaceError, match=_HOST_PENDING_H2D):  # still pending for writes
        src.add_(1)
    del dev, ev


def test_host_write_during_pending_d2h_races(streams, fake_device, pinned_host):
    """A host write into memory that a pending D2H copy writes: the copy would overwrite it."""
    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    with pytest.raises(fa.RaceError, match=r"into it is still pending, written by aten\.fill_"):
        host.fill_(9.0)
    ev.synchronize()
    host.fill_(9.0)
    assert host.tolist() == [9.0] * 4 and fa.stats()["races_detected"] == 1


def test_copies_on_a_pinned_buffer_are_ordered_by_streams_not_by_the_host(
    streams, fake_device, pinned_host
):
    """Between copies, stream order is what counts: a copy on a stream ordered after a
    pending copy of the same pinned buffer is fine although the host has not waited."""
    copy, default = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    with pytest.raises(fa.RaceError, match=r"read by host-to-device copy on stream 0 \(default\)"):
        host.to(fake_device, non_blocking=True)  # the default stream did not wait
    with fa.stream(copy):  # the same stream: ordered
        back = host.to(fake_device, non_blocking=True)
    default.wait_event(ev)
    again = host.to(fake_device)  # ordered after the copy; blocking: the host knows now
    host.sum()
    assert again.tolist() == [0.0, 1.0, 2.0, 3.0] and fa.stats()["races_detected"] == 1
    default.wait_stream(copy)
    assert back.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("show", ["repr", "str", "format", "print"])
def test_printing_a_device_tensor_with_a_pending_copy_races(streams, fake_device, show, capsys):
    copy, default = streams
    with fa.stream(copy):
        w = torch.arange(4.0).to(fake_device, non_blocking=True)
        ev = copy.record_event()
    do = {"repr": repr, "str": str, "format": lambda t: f"{t}", "print": print}[show]
    pattern = (
        rf"shape \(4,\), dtype torch.float32: {re.escape(_side(copy))} host-to-device copy "
        r"\(seq \d+\) is still pending, read by repr\(\) \(host read\) on stream 0 \(default\)"
    )
    with pytest.raises(fa.RaceError, match=pattern):
        do(w)
    assert fa.stats()["races_detected"] == 1
    with fa.stream(copy):  # on the copy's own stream: ordered
        assert "0., 1., 2., 3." in repr(w)
    default.wait_event(ev)
    do(w)
    assert fa.stats()["races_detected"] == 1


@pytest.mark.parametrize("order", ["wait_event", "synchronize", "same_stream"])
def test_printing_a_device_tensor_after_ordering_is_fine(streams, fake_device, order):
    copy, default = streams
    with fa.stream(copy):
        w = torch.arange(4.0).to(fake_device, non_blocking=True)
        ev = copy.record_event()
    if order == "wait_event":
        default.wait_event(ev)
    elif order == "synchronize":
        fa.synchronize()
    with fa.stream(copy if order == "same_stream" else default):
        assert "0., 1., 2., 3." in repr(w) and "fakegpu" in str(w)
    assert fa.stats()["races_detected"] == 0


def test_pageable_memory_is_never_pending(streams, fake_device):
    """Copies to or from pageable host memory are synchronous for the host memory, as on
    CUDA (staged H2D, synchronous D2H), so the host may touch it right away."""
    copy, _ = streams
    src = torch.ones(4)
    assert not src.is_pinned()
    with fa.stream(copy):
        dev = src.to(fake_device, non_blocking=True)
        out = torch.zeros(4)
        out.copy_(dev, non_blocking=True)  # the device side waits on the copy stream itself
    src.add_(1)
    assert out.tolist() == [1.0] * 4
    assert not host_races._host_pending and fa.stats()["races_detected"] == 0


def _host_mode_on() -> bool:
    n = torch._C._len_torch_dispatch_stack()
    return any(
        isinstance(torch._C._get_dispatch_stack_at(i), host_races._HostAccessMode) for i in range(n)
    )


def test_host_checks_cost_nothing_without_pending_copies(streams, fake_device, pinned_host):
    """Only pinned storages with a pending copy are tracked: other host tensors are
    untouched by the check, and what completed is forgotten at the host's next wait."""
    copy, _ = streams
    assert _host_mode_on() and not host_races._host_pending  # install() pushed it, for good
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    assert len(host_races._host_pending) == 1
    other = torch.ones(4)
    other.add_(1)  # untracked: no race, no entry
    assert (other * 2).tolist() == [4.0] * 4 and len(host_races._host_pending) == 1
    ev.synchronize()
    assert _host_mode_on() and not host_races._host_pending
    host.sum()
    # a freed pinned buffer with a pending copy is forgotten with it
    host2, _ = _issue_d2h("copy_side", copy, src, pinned_host)
    assert len(host_races._host_pending) == 1
    del host2
    assert not host_races._host_pending
    fa.synchronize()  # src was read on the copy stream: order that before src is freed


def test_a_mode_pushed_inside_inference_mode_survives_its_exit(streams, fake_device, pinned_host):
    """A copy issued inside ``torch.inference_mode`` (as the offload engine's moves are),
    then a synchronize there: factory calls afterwards still work (a pop of the mode
    inside that context used to leave torch's Python dispatch key on over an empty
    mode stack: "Hit Python dispatch key but no arguments had PyInterpreter")."""
    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    with torch.inference_mode(False), torch.no_grad():
        host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
        fa.synchronize()
    assert torch.empty(3).shape == (3,) and torch.arange(3).tolist() == [0, 1, 2]
    assert torch.arange(3, device=fake_device).cpu().tolist() == [0, 1, 2]
    assert host.sum().item() == 6.0


def test_host_mode_sits_below_a_users_dispatch_mode(streams, fake_device, pinned_host):
    """The host-op check sits beneath a user's TorchDispatchMode, so that mode's
    ``__exit__`` still pops itself; host ops under it are checked too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    depth = torch._C._len_torch_dispatch_stack()
    with Passthrough() as user:
        host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
        n = torch._C._len_torch_dispatch_stack()
        assert torch._C._get_dispatch_stack_at(n - 1) is user and _host_mode_on()
        with pytest.raises(fa.RaceError, match=_HOST_PENDING_D2H):
            host.sum()
    assert torch._C._len_torch_dispatch_stack() == depth and _host_mode_on()
    ev.synchronize()
    assert host.sum().item() == 6.0


def test_access_outside_torch_is_not_detected(streams, fake_device, pinned_host):
    """Documented blind spot: ``.numpy()`` (and what shares its memory), ``data_ptr()``
    and raw buffers bypass the dispatcher, so no race is seen there."""
    copy, _ = streams
    src = torch.arange(4.0).to(fake_device)
    host, ev = _issue_d2h("copy_side", copy, src, pinned_host)
    assert host.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]  # a race on a GPU, unseen here
    assert fa.stats()["races_detected"] == 0
    ev.synchronize()


def test_host_races_on_the_plain_path_without_side_streams():
    """Without any side stream (no stream model at all), a non-blocking copy with pinned
    memory on the default stream is still pending for the host, as on CUDA."""
    code = (
        "import torch\n"
        "from diffusion_offload.testing import fake_accelerator as fa\n"
        "from diffusion_offload.testing.fake_accelerator import host_races, races\n"
        "from diffusion_offload.testing.fake_accelerator.state import state\n"
        "dev = fa.install()\n"
        "d = torch.arange(4.0).to(dev)\n"
        "p = torch.zeros(4).pin_memory()\n"
        "p.copy_(d, non_blocking=True)\n"
        "try:\n"
        "    p.sum()\n"
        "except fa.RaceError as e:\n"
        "    assert 'stream 0 (default) device-to-host copy' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no race')\n"
        "d.sum().item()  # blocking on the default stream: the host knows the copy\n"
        "assert p.tolist() == [0.0, 1.0, 2.0, 3.0]\n"
        "y = d.to('cpu', non_blocking=True)\n"
        "assert y.is_pinned()\n"
        "try:\n"
        "    repr(y)\n"
        "except fa.RaceError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('no race')\n"
        "torch.fakegpu.synchronize()\n"
        "assert repr(y) and not host_races._host_pending\n"
        "q = torch.ones(4).pin_memory()\n"
        "w = q.to(dev, non_blocking=True)\n"
        "q.sum()  # read-read: fine\n"
        "try:\n"
        "    q.mul_(2)\n"
        "except fa.RaceError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('no race')\n"
        "w.cpu()\n"
        "q.mul_(2)\n"
        "assert not state.model_on and not races._tracked, 'model path used'\n"
        "assert fa.stats()['races_detected'] == 3\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
