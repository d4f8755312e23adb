"""The user's path: `splitspec serve` and `splitspec generate` as real processes, plus start-up checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from client import generate
from tools import free_port
from splitspec.tiny import TinySpec, make_tiny
from splitspec.v1 import gateway_pb2

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "splitspec"]


def _wait_for(pattern: str, path, proc, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text()
        time.sleep(0.2)
    raise TimeoutError(path.read_text())


def test_serve_and_generate_from_the_command_line(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen([*CLI, "serve", "--listen", address, "--work-dir", str(tmp_path)], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("ready on", log, serve)
        done = subprocess.run(
            [*CLI, "generate", "def fib(n):", "--address", address, "--max-tokens", "64", "--ignore-eos"],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "64 generated tokens" in done.stderr and "mean acceptance length" in done.stderr
        assert done.stdout.strip()
        # The same request through the API: target-only decoding gives the same text.
        off = generate(address, text="def fib(n):", max_tokens=64, ignore_eos=True, speculation=gateway_pb2.Speculation(mode=gateway_pb2.Speculation.OFF))
        assert done.stdout.rstrip("\n") == off.text.rstrip("\n")
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    assert "gateway serving" in log.read_text()


def test_gateway_refuses_a_draft_built_for_another_target(services, tiny_pair, tmp_path):
    other_target, _ = make_tiny(tmp_path / "other", TinySpec(hidden_size=32, head_dim=8, seed=5))
    target = services.start("target", "target", "--model", str(tiny_pair.target))
    draft = services.start("draft", "draft", "--model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target))
    services.start("gateway-ok", "gateway", "--target", target, "--draft", draft)
    other = services.start("other", "target", "--model", str(other_target))
    services.start("gateway-bad", "gateway", "--target", other, "--draft", draft, wait=False)
    assert services.procs["gateway-bad"].wait(timeout=60) == 2
    line = services.log("gateway-bad").strip().splitlines()[-1]
    assert "does not fit target" in line and "hidden_size 64 vs 32" in line
    assert "Traceback" not in services.log("gateway-bad")


def test_bad_model_file_is_one_clear_line(services, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(64))
    services.start("target", "target", "--model", str(broken), wait=False)
    assert services.procs["target"].wait(timeout=60) == 2
    out = services.log("target")
    assert "Traceback" not in out and str(broken) in out
