"""``diffusion-offload serve --ray`` end to end, as a user runs it (issue 21 item 11): a real
local Ray cluster in a subprocess, one tiny FLUX generator on the fake accelerator.

It prints no INFO line per request or per Serve event, the same ``auto`` pick line as plain
``serve``, no "graceful_shutdown failed" line at a clean exit, and SIGINT stops it (the
signal handler once deadlocked on its own ``threading.Event``). Marked ``ray``: CI runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from diffusion_offload.server.app import bind_socket
from diffusion_offload.testing import tiny_pipelines

pytestmark = pytest.mark.ray


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def test_serve_ray_is_quiet_prints_the_auto_pick_and_stops_on_sigint(tmp_path):
    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install -e '.[ray]')")
    model = tiny_pipelines.save("flux", tmp_path / "flux")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "diffusion_offload", "serve", str(model), "--ray", "--device", "fakegpu",
           "--port", str(port), "--diffusion-offload-config", "auto"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"serve --ray exited early:\n{''.join(lines)}"
            lines.append(line)
            if line.startswith("diffusion-offload: serving"):
                break
        body = json.dumps({"prompt": "a cat", "size": "64x64"}).encode()
        for _ in range(2):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/images/generations", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200 and json.loads(resp.read())["data"][0]["b64_json"]
        time.sleep(1.0)  # let any per-request log line reach the driver
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert elapsed < 30 + 2, f"exited {elapsed:.1f} s after SIGINT"
    picks = [ln for ln in out.splitlines() if ln.startswith("diffusion_offload_config=auto picked ")]
    assert len(picks) == 1, out
    assert f"diffusion-offload: serving {model} at http://127.0.0.1:{port} on Ray Serve" in out
    assert "diffusion-offload: stopping (running jobs get up to 30 s; Ctrl-C again to stop now)" in out
    assert " INFO " not in out and "INFO " not in out, out  # no Serve or access log line
    assert "/v1/images/generations" not in out and "graceful_shutdown" not in out, out
    assert "Failed to load" not in out, out  # the quantization backends' import noise
