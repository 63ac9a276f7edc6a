"""Issue 21 items 1-3: ``serve`` against idle, slow and many clients, its address line, and
its shutdown, on real ``serve`` processes (``tests/serve_stub.py``: the real command with
a stub engine, so nothing is generated).

Two servers start once for the module, both under ``RLIMIT_NOFILE`` 256 (where 300 idle
sockets used to make ``/health`` fail), with short deadlines: ``patient`` with a 30 s
shutdown grace (its last test stops it with two SIGINTs) and ``brief`` with a 0.5 s grace.
"""

from __future__ import annotations

import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402

from diffusion_offload.server.connections import FD_RESERVE  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

STUB = Path(__file__).with_name("serve_stub.py")
NOFILE = 256
HEADERS_S = 2.0
BODY_S = 2.0
GRACE_S = 0.5
KEEP_ALIVE_S = 1.0
STUCK = {"prompt": "STUCK forever", "size": "16x16", "num_frames": 1, "num_inference_steps": 1}


@dataclass
class Proc:
    """A ``serve`` process, its address and the lines it printed so far."""

    proc: subprocess.Popen
    model: str
    url: str = ""
    port: int = 0
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def text(self) -> str:
        """Everything printed on stderr so far."""
        return "".join(self.err)

    def wait_err(self, pattern: str, timeout: float = 10) -> re.Match:
        """Wait until stderr has a line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text())
            if match:
                return match
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} on stderr: {self.text()}")


def _pump(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _start(model: Path, *flags: str) -> Proc:
    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, str(STUB), str(model), "--port", "0", "--device", "cpu", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=limit_files,
    )
    p = Proc(proc, str(model))
    threading.Thread(target=_pump, args=(proc.stdout, p.out), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, p.err), daemon=True).start()
    return p


def _ready(p: Proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not p.out:
        assert p.proc.poll() is None, f"serve exited with {p.proc.returncode}: {p.text()}"
        assert time.monotonic() < deadline, f"serve printed no address: {p.text()}"
        time.sleep(0.05)
    match = re.fullmatch(rf"serving {re.escape(p.model)} at (http://127\.0\.0\.1:(\d+))\n", p.out[0])
    assert match, p.out
    p.url, p.port = match.group(1), int(match.group(2))
    while httpx.get(f"{p.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """``patient`` (30 s grace) and ``brief`` (0.5 s grace), started together."""
    model = tiny_pipelines.save("wan2.1", tmp_path_factory.mktemp("models") / "wan")
    common = ("--timeout-headers", str(HEADERS_S), "--timeout-body", str(BODY_S),
              "--timeout-keep-alive", str(KEEP_ALIVE_S))
    procs = {"patient": _start(model, *common, "--shutdown-grace", "30"),
             "brief": _start(model, *common, "--shutdown-grace", str(GRACE_S))}
    try:
        for p in procs.values():
            _ready(p)
        yield procs
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
            p.proc.wait()


def _closed(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` (readable and at EOF, or reset)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        while True:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _timed_health(url: str) -> float:
    start = time.monotonic()
    r = httpx.get(f"{url}/health", timeout=5)
    elapsed = time.monotonic() - start
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    return elapsed


def test_plain_serve_prints_its_address_with_port_0(servers: dict[str, Proc]) -> None:
    for p in servers.values():
        assert p.port > 0
        assert p.out[0] == f"serving {p.model} at http://127.0.0.1:{p.port}\n"  # then access logs


def test_300_idle_connections_and_health_answers_within_1s(servers: dict[str, Proc]) -> None:
    p = servers["patient"]
    limit = NOFILE - FD_RESERVE  # the default --max-connections under ulimit -n 256
    opened = time.monotonic()
    idle = [_connect(p.port) for _ in range(300)]
    try:
        time.sleep(0.5)  # the server accepts them all
        assert _timed_health(p.url) < 1.0
        if time.monotonic() - opened < HEADERS_S - 0.5:  # none reached its head deadline yet
            # the oldest idle ones were closed to keep `limit` open, one more for /health
            closed = [i for i, s in enumerate(idle) if _closed(s)]
            assert closed == list(range(300 - limit + 1))
    finally:
        for s in idle:
            s.close()


def test_idle_header_drip_and_body_drip_clients_are_cut_off(servers: dict[str, Proc]) -> None:
    p = servers["patient"]
    fresh = _connect(p.port)  # sends nothing
    kept = _connect(p.port)  # one request, then idle (keep-alive)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    heads = [_connect(p.port) for _ in range(20)]
    bodies = [_connect(p.port) for _ in range(10)]
    for s in bodies:
        s.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n{")
    for s in heads:
        s.sendall(b"GET /health HTTP/1.1\r\n")
    start = time.monotonic()
    received: dict[socket.socket, bytes] = {s: b"" for s in (fresh, kept, *heads, *bodies)}
    closed_at: dict[socket.socket, float] = {}
    slowest_health = 0.0
    try:
        while len(closed_at) < len(received) and time.monotonic() - start < HEADERS_S + 2:
            for s in (*heads, *bodies):
                if s not in closed_at:
                    try:  # one byte every 0.1 s: each client is always "still sending"
                        s.sendall(b"X-Drip: 1\r\n"[:1] if s in heads else b" ")
                    except OSError:
                        pass
            for s in received:
                if s in closed_at:
                    continue
                readable, _, _ = select.select([s], [], [], 0)
                if readable:
                    try:
                        chunk = s.recv(65536)
                    except ConnectionError:
                        chunk = b""
                    received[s] += chunk
                    if not chunk:
                        closed_at[s] = time.monotonic() - start
            slowest_health = max(slowest_health, _timed_health(p.url))
            time.sleep(0.1)
        assert slowest_health < 1.0
        assert set(closed_at) == set(received), "a client was never cut off"
        assert closed_at[kept] < HEADERS_S  # the keep-alive timeout, before any head deadline
        assert received[kept].startswith(b"HTTP/1.1 200 OK")
        for s in (fresh, *heads):
            assert HEADERS_S - 0.5 < closed_at[s] < HEADERS_S + 1.5
            assert received[s].startswith(b"HTTP/1.1 408 Request Timeout"), received[s]
            assert b"the request headers did not arrive within 2 s (--timeout-headers)" in received[s]
        for s in bodies:
            assert BODY_S - 0.5 < closed_at[s] < BODY_S + 1.5
            assert received[s].startswith(b"HTTP/1.1 408 Request Timeout"), received[s]
            assert b"the request body did not arrive within 2 s (--timeout-body)" in received[s]
    finally:
        for s in received:
            s.close()


def test_shutdown_ends_within_the_grace_plus_2s(servers: dict[str, Proc]) -> None:
    p = servers["brief"]
    job = httpx.post(f"{p.url}/v1/videos", json=STUCK, timeout=5).json()
    while httpx.get(f"{p.url}/v1/videos/{job['id']}", timeout=5).json()["status"] != "in_progress":
        time.sleep(0.02)
    sent = time.monotonic()
    p.proc.send_signal(signal.SIGINT)
    p.proc.wait(timeout=10)
    elapsed = time.monotonic() - sent
    assert p.proc.returncode == 0, p.text()
    assert GRACE_S <= elapsed < GRACE_S + 2.0, f"exited {elapsed:.1f} s after SIGINT, grace {GRACE_S} s"
    assert (f"received SIGINT: job {job['id']} may finish for up to 0.5 s (--shutdown-grace), "
            "then it is marked failed and the server exits within 1.5 s; SIGINT again exits "
            "now") in p.text()
    assert f"job {job['id']} marked failed: still running after the 0.5 s shutdown grace" in p.text()


def test_a_second_sigint_exits_at_once_marking_the_job_failed(servers: dict[str, Proc]) -> None:
    p = servers["patient"]
    job = httpx.post(f"{p.url}/v1/videos", json=STUCK, timeout=5).json()
    while httpx.get(f"{p.url}/v1/videos/{job['id']}", timeout=5).json()["status"] != "in_progress":
        time.sleep(0.02)
    sent = time.monotonic()
    p.proc.send_signal(signal.SIGINT)
    p.wait_err(f"received SIGINT: job {job['id']} may finish for up to 30 s")
    p.proc.send_signal(signal.SIGINT)
    try:
        p.proc.wait(timeout=3.0)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve still running 3 s after the second SIGINT: {p.text()}") from None
    assert time.monotonic() - sent < 3.0
    assert p.proc.returncode == 130
    assert f"job {job['id']} marked failed: the server was stopped by a second SIGINT" in p.text()
