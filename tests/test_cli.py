"""The user's path: `splitspec serve` and `splitspec generate` as real processes, plus start-up checks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.v1 import gateway_pb2
from tests.client import generate
from tests.tools import free_port

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


@contextmanager
def _serve(tmp_path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``splitspec serve`` on a free port until the block ends; yields the gateway address."""
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [*CLI, "serve", "--listen", address, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        _wait_for("ready on", log, serve)
        yield address
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    assert "gateway serving" in log.read_text()


def test_serve_and_generate_from_the_command_line(tmp_path):
    with _serve(tmp_path, "--work-dir", str(tmp_path)) as address:
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


def test_make_tiny_qwen35_and_serve_it(tmp_path):
    """A tiny Qwen3.5 hybrid GGUF from ``make-tiny --architecture qwen35``, served with its draft: every
    speculation mode gives the target-only output, greedy and sampled, also with the recurrent
    states stored in bfloat16 (the target worker's ``--state-dtype``, set through its env var)."""
    made = subprocess.run([*CLI, "make-tiny", str(tmp_path / "q35"), "--architecture", "qwen35"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    target, draft = tmp_path / "q35" / "target.gguf", tmp_path / "q35" / "draft"
    Spec = gateway_pb2.Speculation
    env = {"SPLITSPEC_TARGET_STATE_DTYPE": "bfloat16"}
    with _serve(tmp_path, "--target-model", str(target), "--draft-model", str(draft), env=env) as address:
        for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
            request = {"text": "def fib(n):", "max_tokens": 48, "ignore_eos": True, **sampling}
            off = generate(address, speculation=Spec(mode=Spec.OFF), **request)
            assert len(off.tokens) == 48
            for spec in (Spec(mode=Spec.CHAIN, budget=15), Spec(mode=Spec.DDTREE, budget=22, chain_seed=True), Spec(mode=Spec.DDTREE, budget=8)):
                out = generate(address, speculation=spec, **request)
                assert out.tokens == off.tokens and out.text == off.text
                assert out.final.usage.draft_fallbacks == 0
    log = (tmp_path / "serve.log").read_text()
    assert "hybrid target: 3 DeltaNet + 1 attention layers" in log
    assert re.search(r"state slots .* slots x [\d.]+ KiB \(bfloat16 states\)", log)  # the env var reached the target


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


def test_a_worker_that_fails_to_start_never_takes_the_gateway_down(services, tiny_pair, tmp_path):
    """The target is replaced by one whose file is corrupt: it exits with one line, the gateway
    stays up (answering UNAVAILABLE meanwhile) and serves again once a good target is back."""
    import grpc

    target = services.start("target", "target", "--model", str(tiny_pair.target))
    draft = services.start("draft", "draft", "--model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target))
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft)
    request = {"text": "hello", "max_tokens": 8, "ignore_eos": True}
    before = generate(gateway, **request)
    services.stop("target")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_pair.target.read_bytes()[:5000])
    services.start("target", "target", "--model", str(truncated), wait=False)
    assert services.procs["target"].wait(timeout=60) == 2
    lines = services.log("target").strip().splitlines()
    assert "Traceback" not in services.log("target")
    assert str(truncated) in lines[-1] and "truncated or corrupt" in lines[-1]
    with pytest.raises(grpc.RpcError) as info:
        generate(gateway, **request)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert services.procs["gateway"].poll() is None
    services.procs.pop("target")
    services.start("target", "target", "--model", str(tiny_pair.target))
    deadline = time.monotonic() + 60
    while True:  # the gateway's channel reconnects after its backoff
        try:
            after = generate(gateway, **request)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
            time.sleep(0.5)
    assert after.tokens == before.tokens


@pytest.mark.parametrize("case", ["unsupported-quant", "corrupt-safetensors", "unknown-architecture"])
def test_bad_files_end_the_worker_with_one_line(services, tmp_path, case):
    from gguf import GGMLQuantizationType as Q

    from splitspec.fixtures.gguf_writing import encoder

    if case == "unsupported-quant":
        f32 = encoder("f32")

        def encode(name, array):  # one tensor in IQ2_XXS, which the loader does not take
            if name == "blk.0.ffn_up.weight":
                return np.zeros((array.shape[0], array.shape[1] // 256 * 66), np.uint8), Q.IQ2_XXS
            return f32(name, array)

        model, _ = make_tiny(tmp_path, TinySpec(hidden_size=256, num_heads=4, head_dim=64, target_layers=2), weight_type=encode)
        expected = ["'blk.0.ffn_up.weight'", "unsupported type IQ2_XXS"]
    elif case == "corrupt-safetensors":
        model = tmp_path / "dir"
        model.mkdir()
        (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
        (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
        expected = [str(model / "model.safetensors"), "not a readable safetensors file"]
    else:
        model, _ = make_tiny(tmp_path, TinySpec())
        model.write_bytes(model.read_bytes().replace(b"qwen3", b"gpt_x"))
        expected = ["unsupported architecture 'gpt_x'"]
    services.start("target", "target", "--model", str(model), wait=False)
    assert services.procs["target"].wait(timeout=60) == 2
    log = services.log("target")
    assert "Traceback" not in log
    last = log.strip().splitlines()[-1]
    assert all(e in last for e in expected), last


def test_workers_load_hub_references_offline_from_the_cache(services, tiny_pair, tmp_path, monkeypatch):
    """`--model hf://OWNER/REPO/FILE` and `hf://OWNER/REPO` (a directory) from an HF_HOME cache, offline."""
    import shutil

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    for repo, put in [("tiny-target", lambda d: shutil.copy(tiny_pair.target, d / "model.gguf")),
                      ("tiny-draft", lambda d: shutil.copytree(tiny_pair.draft, d, dirs_exist_ok=True))]:
        root = tmp_path / "hub" / f"models--splitspec-test--{repo}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)
        snapshot = root / "snapshots" / commit
        snapshot.mkdir(parents=True)
        put(snapshot)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target_ref = "hf://splitspec-test/tiny-target/model.gguf"
    target = services.start("target", "target", "--model", target_ref)
    draft = services.start("draft", "draft", "--model", "hf://splitspec-test/tiny-draft", "--target-model", target_ref)
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft)
    out = generate(gateway, text="hello", max_tokens=8, ignore_eos=True)
    assert len(out.tokens) == 8 and out.final.usage.draft_fallbacks == 0
    services.start("absent", "target", "--model", "hf://splitspec-test/tiny-target/absent.gguf", wait=False)
    assert services.procs["absent"].wait(timeout=60) == 2
    last = services.log("absent").strip().splitlines()[-1]
    assert "hf://splitspec-test/tiny-target/absent.gguf" in last and "HF_HUB_OFFLINE" in last


def test_device_auto_is_the_first_gpu_or_the_cpu():
    import torch

    from splitspec.models.devices import resolve_device

    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(resolve_device("auto")) == expected  # on the CPU-only test machine: cpu
    with pytest.raises(ValueError, match="use auto, cpu or cuda:N"):
        resolve_device("gpu0")


def test_device_cuda_without_index_is_the_current_gpu(monkeypatch):
    """``--device cuda`` names the current GPU with its index: torch.cuda.set_device refuses an
    index-less device (torch 2.11 on an H100 raised ValueError at the target's start). The CPU-only
    test machine has no CUDA runtime, so its four calls stand in for a machine with two GPUs."""
    import torch

    from splitspec.models.devices import resolve_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 1), torch.device("cuda", 0)]
    with pytest.raises(ValueError, match="only 2 GPU"):
        resolve_device("cuda:2")


def _free_port_run(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that are free right now."""
    import socket

    for _ in range(50):
        first = free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def _read_lines_with_times(proc: subprocess.Popen):
    """A thread collecting each stderr line of ``proc`` with the monotonic time it arrived, and
    the time the process ended, into the list it returns along with the thread."""
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
        proc.wait()
        lines.append((time.monotonic(), ""))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines


def test_serve_ready_line_names_every_endpoint_and_the_device(tmp_path, tiny_pair):
    """`serve` with its default --device auto: the ready line gives the gateway's address, the
    three /metrics URLs (which answer, naming the device) and the pair; serve's own process never
    loads torch. A `generate --wait` started before serve says once that it waits, then succeeds."""
    import urllib.request

    address = f"unix:{tmp_path / 'gw.sock'}"
    waiting = subprocess.Popen(
        [*CLI, "generate", "hello", "--address", address, "--max-tokens", "4", "--ignore-eos", "--wait", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    port = _free_port_run(3)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [*CLI, "serve", "--listen", address, "--target-model", str(tiny_pair.target), "--draft-model", str(tiny_pair.draft),
             "--metrics-port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        _wait_for("ready on", log, serve)
        ready = next(line for line in log.read_text().splitlines() if "ready on" in line)
        device = "cuda:0 (bfloat16" if "cuda" in ready else "cpu (float32"
        assert f"ready on {address} (gateway gRPC, metrics http://127.0.0.1:{port}/metrics)" in ready, ready
        assert f"target worker on {device}; --device auto), metrics http://127.0.0.1:{port + 1}/metrics" in ready, ready
        assert f"draft worker on {device}; --device auto), metrics http://127.0.0.1:{port + 2}/metrics" in ready, ready
        assert f"serving target and draft as given: target {tiny_pair.target}, draft {tiny_pair.draft}" in ready
        for i, service in enumerate(["gateway", "target", "draft"]):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port + i}/metrics", timeout=10).read().decode()
            assert f'service="{service}"' in text
            if service != "gateway":
                assert f'device="{device.split()[0]}"' in text
        maps = open(f"/proc/{serve.pid}/maps").read()
        assert "libtorch" not in maps and "torch/_C" not in maps
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert err.count("waiting for the gateway at") == 1 and "4 generated tokens" in err
    finally:
        waiting.kill()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


def test_generate_without_a_gateway_says_so_and_gives_up(tmp_path):
    """No gateway at a real (unused) Unix socket address: generate says at once where it waits and
    how to start a gateway, then gives up after the connect timeout (default 10 s, or
    --connect-timeout), or with --wait after the request's --timeout, with one line and exit 1."""
    address = f"unix:{tmp_path / 'nobody.sock'}"
    cases = {"default": ([], 10.0), "flag": (["--connect-timeout", "2"], 2.0), "wait": (["--wait", "--timeout", "4"], 4.0)}
    procs = {
        name: (time.monotonic(), subprocess.Popen([*CLI, "generate", "hi", "--address", address, *flags], stderr=subprocess.PIPE, text=True))
        for name, (flags, _) in cases.items()
    }
    readers = {name: _read_lines_with_times(proc) for name, (_, proc) in procs.items()}
    for name, (started, proc) in procs.items():
        thread, lines = readers[name]
        thread.join(timeout=60)
        (ended, _), lines, limit = lines[-1], lines[:-1], cases[name][1]
        assert proc.returncode == 1
        assert len(lines) == 2, lines
        (said_at, said), (_, gave_up) = lines
        assert said == f"splitspec generate: waiting for the gateway at {address} (up to {limit:.0f} s; start one with `splitspec serve`)"
        assert gave_up.startswith(f"splitspec generate: no gateway answered at {address} within {limit:.0f} s: start one with `splitspec serve`")
        assert ("raise --timeout" in gave_up) == (name == "wait")
        # The waiting line came at once (not after the wait), and the wait lasted the timeout.
        assert limit - 0.5 <= ended - said_at <= limit + 3.0, (name, ended - said_at)
        assert ended - started <= limit + 15.0  # Python start-up on a loaded 2-core machine included


def test_gateway_waiting_for_a_worker_logs_once_then_every_10_s(services):
    """The gateway's start-up wait for a worker that is not there: one line, then one line per 10 s
    with the time waited and why, then (--worker-wait) one error line and exit 2."""
    services.start("gateway", "gateway", "--target", services.address("absent-target"), "--draft", "", "--worker-wait", "12", wait=False)
    assert services.procs["gateway"].wait(timeout=60) == 2
    log = services.log("gateway")
    assert log.count("waiting for the target worker") == 2  # "waiting ..." and "still waiting ..."
    assert log.count("still waiting for the target worker after 10 s (not reachable: UNAVAILABLE)") == 1
    assert "target worker: not reachable: UNAVAILABLE after 12 s (--worker-wait)" in log.strip().splitlines()[-1]
    assert "Traceback" not in log


def test_draft_taps_the_target_cannot_read_are_a_warning_and_bad_layers_an_error(services, tiny_pair, tmp_path):
    """``--draft-taps``: a draft path the target cannot read (a deployment without its draft) leaves
    the warmed passes without features and serves; a layer the target lacks is a clear error."""
    services.start("target", "target", "--model", str(tiny_pair.target), "--draft-taps", str(tmp_path / "missing"))
    assert "--draft-taps" in services.log("target") and "record no features" in services.log("target")
    services.start("bad", "target", "--model", str(tiny_pair.target), "--draft-taps", "1,99", wait=False)
    assert services.procs["bad"].wait(timeout=60) != 0
    out = services.log("bad")
    assert "layers [99] are outside the target's" in out and "Traceback" not in out
