"""`splitspec serve` as a supervisor, with real processes: a worker killed mid-stream is restarted
while the gateway carries on (draft: target-only, same tokens; target: UNAVAILABLE, then served
again), and SIGTERM drains the gateway's streams before the workers stop."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.client import generate

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "splitspec"]
REQUEST = {"text": "def fib(n):", "ignore_eos": True}
OFF = gateway_pb2.Speculation(mode=gateway_pb2.Speculation.OFF)


class Served:
    """A ``splitspec serve`` process, its log, and its children found through /proc."""

    def __init__(self, root: Path, tiny_pair, *args: str) -> None:
        self.root = root
        self.address = f"unix:{root / 'gateway.sock'}"
        self.log_path = root / "serve.log"
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [*CLI, "serve", "--target-model", str(tiny_pair.target), "--draft-model", str(tiny_pair.draft),
                 "--listen", self.address, "--metrics-port", "0", *args],
                stdout=out, stderr=subprocess.STDOUT,
            )
        self.seen: set[int] = set()

    def log(self, since: int = 0) -> str:
        return self.log_path.read_text(errors="replace")[since:]

    def wait_log(self, pattern: str, since: int = 0, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log(since))
            if found:
                return found
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.log()}"
            time.sleep(0.2)
        raise TimeoutError(f"no {pattern!r} in serve's log after {timeout} s:\n{self.log(since)}")

    def children(self) -> dict[str, int]:
        """{target, draft, gateway: pid} of serve's live children (``python -m splitspec ROLE ...``)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and b"splitspec" in argv[:-1]:
                found[argv[argv.index(b"splitspec") + 1].decode()] = int(entry.name)
        self.seen.update(found.values())
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            for pid in self.seen:  # never leave a child behind, whatever failed
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@contextmanager
def _serve(tiny_pair, *args: str) -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="ss-serve-"))  # Unix socket paths must stay short
    served = Served(root, tiny_pair, *args)
    try:
        served.wait_log(r"splitspec serve: ready on ", timeout=90)
        assert set(served.children()) == {"target", "draft", "gateway"}
        yield served
    finally:
        served.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_pair) -> Iterator[Served]:
    with _serve(tiny_pair) as s:
        yield s


class Stream:
    """One Generate call read on a thread: its tokens as they arrive, then its final message or error."""

    def __init__(self, address: str, **fields) -> None:
        self.tokens: list[int] = []
        self.final = None
        self.error: grpc.RpcError | None = None
        self.finished_at = 0.0
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._call = gateway_pb2_grpc.GatewayStub(self._channel).Generate(gateway_pb2.GenerateRequest(**fields), timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.tokens.extend(response.token_ids)
                if response.HasField("final"):
                    self.final = response.final
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self._channel.close()

    def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            assert self.error is None and self.final is None, (self.error, len(self.tokens))
            assert time.monotonic() < deadline, f"only {len(self.tokens)} tokens after {timeout} s"
            time.sleep(0.01)

    def join(self, timeout: float = 60.0) -> Stream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self


def test_ready_line_names_every_endpoint_and_the_pair(served, tiny_pair):
    ready = served.wait_log(r"splitspec serve: ready on .*").group(0)
    assert f"ready on {served.address} (gateway gRPC, metrics off)" in ready
    assert "target worker on cpu (float32; --device auto), metrics off" in ready or "target worker on cuda:0" in ready
    assert "draft worker on " in ready and ready.count("metrics off") == 3
    assert f"target {tiny_pair.target}, draft {tiny_pair.draft}" in ready
    # The gateway waited for the loading target on its health service: the target logged no refused Info per probe.
    assert "still loading its model" not in served.log()
    pids = served.children()
    assert all(f"(pid {pids[role]})" in served.log() for role in pids)


def test_a_killed_draft_is_restarted_and_the_stream_continues_target_only(served):
    reference = generate(served.address, max_tokens=160, speculation=OFF, **REQUEST)
    draft = served.children()["draft"]
    stream = Stream(served.address, max_tokens=160, **REQUEST)
    stream.wait_tokens(8)
    mark = len(served.log())
    os.kill(draft, signal.SIGKILL)
    stream.join()
    # The expectation: the stream goes on target-only and gives the target's own tokens.
    assert stream.error is None, (stream.error.code(), stream.error.details())
    assert stream.final.finish_reason == gateway_pb2.LENGTH and stream.tokens == reference.tokens
    assert stream.final.usage.draft_fallbacks > 0  # the kill landed mid-stream
    # serve stayed up and started another draft, which the gateway takes back.
    served.wait_log(rf"the draft worker \(pid {draft}\) was killed by SIGKILL after \d+ s; restarting it in 1 s", mark)
    restarted = int(served.wait_log(r"restarted the draft worker \(pid (\d+)\)", mark).group(1))
    served.wait_log(rf"the draft worker \(pid {restarted}\) is serving again", mark)
    served.wait_log("draft worker is back; speculation resumes", mark, timeout=30)
    assert served.proc.poll() is None and served.children()["draft"] == restarted
    again = generate(served.address, max_tokens=32, **REQUEST)
    assert again.tokens == reference.tokens[:32] and again.final.usage.draft_fallbacks == 0  # speculating again


def test_a_killed_target_is_restarted_and_serves_again(served):
    reference = generate(served.address, max_tokens=24, speculation=OFF, **REQUEST)
    target, draft = served.children()["target"], served.children()["draft"]
    stream = Stream(served.address, max_tokens=400, **REQUEST)
    stream.wait_tokens(8)
    mark = len(served.log())
    os.kill(target, signal.SIGKILL)
    stream.join()
    assert stream.final is None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
    served.wait_log(rf"the target worker \(pid {target}\) was killed by SIGKILL", mark)
    restarted = int(served.wait_log(r"restarted the target worker \(pid (\d+)\)", mark).group(1))
    served.wait_log(rf"the target worker \(pid {restarted}\) is serving again", mark)
    deadline = time.monotonic() + 40
    while True:  # the gateway's health checks see the new target after its channel's reconnect back-off
        try:
            after = generate(served.address, max_tokens=24, speculation=OFF, **REQUEST)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
            time.sleep(0.5)
    assert after.tokens == reference.tokens
    assert served.proc.poll() is None and served.children()["draft"] == draft  # the draft was left alone


def test_sigterm_drains_streams_in_flight_then_stops_the_workers(tiny_pair):
    with _serve(tiny_pair) as served:
        pids = served.children()
        streams = [Stream(served.address, max_tokens=120, **REQUEST) for _ in range(3)]
        for s in streams:
            s.wait_tokens(4)
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join()
        assert served.proc.wait(timeout=60) == 0
        for s in streams:
            assert s.error is None, (s.error.code(), s.error.details())
            assert s.final.finish_reason == gateway_pb2.LENGTH and len(s.tokens) == 120
            assert s.finished_at > signalled
        assert streams[0].tokens == streams[1].tokens == streams[2].tokens
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
        log = served.log()
        # In order: the gateway drained (its grace is 30 s) before the workers were signalled (10 s):
        # the three requests ended in between.
        gateway_drain, worker_drain = log.index("draining for up to 30.0 s"), log.index("draining for up to 10.0 s")
        assert gateway_drain < worker_drain
        assert log[gateway_drain:worker_drain].count(" done: length") == 3
        assert "all processes stopped" in log


def test_a_killed_gateway_is_restarted(served):
    gateway = served.children()["gateway"]
    mark = len(served.log())
    os.kill(gateway, signal.SIGKILL)
    served.wait_log(rf"the gateway \(pid {gateway}\) was killed by SIGKILL", mark)
    restarted = int(served.wait_log(r"restarted the gateway \(pid (\d+)\)", mark).group(1))
    served.wait_log(rf"the gateway \(pid {restarted}\) is serving again", mark)
    out = generate(served.address, max_tokens=8, **REQUEST)
    assert len(out.tokens) == 8 and out.final.finish_reason == gateway_pb2.LENGTH


def test_serve_gives_up_after_max_restarts(tiny_pair):
    with _serve(tiny_pair, "--max-restarts", "0") as served:
        pids = served.children()
        os.kill(pids["draft"], signal.SIGKILL)
        assert served.proc.wait(timeout=60) == 1
        assert re.search(r"the draft worker \(pid \d+\) was killed by SIGKILL after 0 restarts within 60 s \(--max-restarts 0\); giving up", served.log())
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
