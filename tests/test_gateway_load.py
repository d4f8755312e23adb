"""The gateway under hostile load, through real processes: huge prompts must not stall other streams,
health checks or metrics, and one client flooding the gateway must not starve another.

Run as a script it prints the figures of the large-prompt probe (for before/after comparisons):

    python -m tests.test_gateway_load [--pair builtin|tiny] [--seconds 20] [--loaders 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.tools import free_port

HUGE_PROMPT_BYTES = 4_000_000  # just under the gateway's default --max-request-bytes (4 MiB)


@dataclass
class LoadFigures:
    stream_messages: int = 0
    streams: int = 0
    longest_gap_s: float = 0.0  # longest gap between two messages of one stream
    health_latencies_s: list[float] = field(default_factory=list)
    health_failures: int = 0  # Check calls that failed (deadline 1 s) or did not say SERVING
    metrics_latencies_s: list[float] = field(default_factory=list)
    metrics_failures: int = 0
    huge_codes: dict[str, int] = field(default_factory=dict)
    huge_latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> str:
        h = sorted(self.health_latencies_s) or [float("nan")]
        m = sorted(self.metrics_latencies_s) or [float("nan")]
        huge = sorted(self.huge_latencies_s) or [float("nan")]
        return (
            f"stream: {self.streams} streams, {self.stream_messages} messages, longest gap {self.longest_gap_s:.3f} s\n"
            f"health: {len(self.health_latencies_s) + self.health_failures} checks, {self.health_failures} failed (1 s deadline), "
            f"answered in median {h[len(h) // 2]:.4f} s, max {h[-1]:.4f} s\n"
            f"metrics: {len(self.metrics_latencies_s) + self.metrics_failures} scrapes, {self.metrics_failures} failed, "
            f"median {m[len(m) // 2]:.4f} s, max {m[-1]:.4f} s\n"
            f"huge prompts: {sum(self.huge_codes.values())} sent, statuses {self.huge_codes}, "
            f"each answered in median {huge[len(huge) // 2]:.3f} s, max {huge[-1]:.3f} s"
        )


def probe_large_prompts(
    address: str, *, prompt: str, max_tokens: int, seconds: float, loaders: int, huge_requests: int = 0, metrics_port: int = 0
) -> LoadFigures:
    """Streams ``prompt`` over and over on one channel while ``loaders`` other channels each send
    4 MB prompts back to back (``huge_requests`` each, or for ``seconds``), health is checked every
    0.2 s and /metrics scraped every 0.5 s."""
    figures = LoadFigures()
    stop = threading.Event()
    huge = gateway_pb2.GenerateRequest(text=("x = 1\n" * (HUGE_PROMPT_BYTES // 6 + 1))[:HUGE_PROMPT_BYTES], max_tokens=16)
    lock = threading.Lock()

    def stream() -> None:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            request = gateway_pb2.GenerateRequest(text=prompt, max_tokens=max_tokens, ignore_eos=True)
            while not stop.is_set():
                last = None
                for _ in stub.Generate(request, timeout=120):
                    now = time.perf_counter()
                    if last is not None:
                        figures.longest_gap_s = max(figures.longest_gap_s, now - last)
                    last = now
                    figures.stream_messages += 1
                figures.streams += 1

    def health() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    ok = False
                if ok:
                    figures.health_latencies_s.append(time.perf_counter() - t0)
                else:
                    figures.health_failures += 1
                stop.wait(0.2)

    def scrape() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1.0) as r:
                    r.read()
                figures.metrics_latencies_s.append(time.perf_counter() - t0)
            except OSError:
                figures.metrics_failures += 1
            stop.wait(0.5)

    def load(deadline: float) -> None:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            sent = 0
            while time.monotonic() < deadline and (not huge_requests or sent < huge_requests):
                t0 = time.perf_counter()
                try:
                    list(stub.Generate(huge, timeout=60))
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    figures.huge_latencies_s.append(time.perf_counter() - t0)
                    figures.huge_codes[code] = figures.huge_codes.get(code, 0) + 1
                sent += 1

    background = [threading.Thread(target=stream, daemon=True), threading.Thread(target=health, daemon=True)]
    if metrics_port:
        background.append(threading.Thread(target=scrape, daemon=True))
    for t in background:
        t.start()
    started = time.monotonic() + 60
    while figures.stream_messages < 3 and time.monotonic() < started:  # the stream runs before the load starts
        time.sleep(0.05)
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=load, args=(deadline,), daemon=True) for _ in range(loaders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not loaders:  # a baseline: the same stream, checks and scrapes without the load
        time.sleep(seconds)
    stop.set()
    for t in background:
        t.join(timeout=130)
    return figures


def _start_pair(services, target_path: str, draft_path: str, *gateway_args: str, cpu_threads: bool = False, address: str = "") -> str:
    threads = ("--threads", "1") if cpu_threads else ()
    target = services.start("target", "target", "--model", target_path, *threads)
    draft = services.start("draft", "draft", "--model", draft_path, "--target-model", target_path, *threads)
    return services.start("gateway", "gateway", "--target", target, "--draft", draft, *gateway_args, address=address)


@pytest.mark.slow
def test_huge_prompts_neither_stall_streams_nor_health(services, tiny_pair):
    metrics_port = free_port()
    address = _start_pair(services, str(tiny_pair.target), str(tiny_pair.draft), "--metrics-port", str(metrics_port))
    figures = probe_large_prompts(
        address, prompt="def fib(n):", max_tokens=400, seconds=60, loaders=2, huge_requests=4, metrics_port=metrics_port
    )
    print(figures.summary())
    assert figures.huge_codes == {"INVALID_ARGUMENT": 8}, figures.huge_codes
    assert max(figures.huge_latencies_s) < 1.0, figures.huge_latencies_s
    # Before the gateway bounded this work, each 4 MB prompt held its event loop for seconds (gaps
    # of 28-35 s). 1 s leaves room for a shared, loaded CPU (a stream's own gaps reach 0.5 s there).
    assert figures.stream_messages > 10 and figures.longest_gap_s < 1.0, figures.summary()
    assert figures.health_failures == 0 and max(figures.health_latencies_s) < 1.0, figures.summary()
    assert figures.metrics_failures == 0 and max(figures.metrics_latencies_s) < 1.0, figures.summary()


@pytest.mark.slow
def test_a_flooding_client_does_not_starve_another(services, tiny_pair):
    """One client (one channel: one peer address) sends ten long requests at once; it gets one slot,
    three queue, the rest are refused at once, and another client's request still starts at once."""
    address = _start_pair(
        services, str(tiny_pair.target), str(tiny_pair.draft), "--max-running", "2", "--max-running-per-client", "1",
        "--max-waiting-per-client", "3", "--max-queue-wait", "300", address=f"127.0.0.1:{free_port()}",
    )
    flood = gateway_pb2.GenerateRequest(text="def fib(n):", max_tokens=200, ignore_eos=True)
    outcomes: list[tuple[str, float, float]] = []  # status, seconds to the first message (or the error), seconds in all
    lock = threading.Lock()

    # Each channel its own connection (gRPC shares one between channels of the same target by default),
    # so the two clients have different peer addresses, as two client processes would.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as flooder, grpc.insecure_channel(address, options=options) as other:
        flood_stub, other_stub = gateway_pb2_grpc.GatewayStub(flooder), gateway_pb2_grpc.GatewayStub(other)
        list(flood_stub.Generate(gateway_pb2.GenerateRequest(text="a", max_tokens=1), timeout=60))  # connected

        def one(stub, request, out):
            t0 = time.perf_counter()
            first, code = None, "OK"
            try:
                for _ in stub.Generate(request, timeout=120):
                    first = first or time.perf_counter() - t0
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                out.append((code, first if first is not None else time.perf_counter() - t0, time.perf_counter() - t0))

        flooding = [threading.Thread(target=one, args=(flood_stub, flood, outcomes)) for _ in range(10)]
        for t in flooding:
            t.start()
        time.sleep(1.0)  # the flood is in: one running, three waiting, six refused
        mine: list[tuple[str, float, float]] = []
        one(other_stub, gateway_pb2.GenerateRequest(text="def add(a, b):", max_tokens=8, ignore_eos=True), mine)
        print(f"the other client's request: first message after {mine[0][1]:.3f} s, done after {mine[0][2]:.3f} s")
        for t in flooding:
            t.join()

    codes = sorted(code for code, _, _ in outcomes)
    print("flood:", sorted((code, round(first, 3), round(total, 3)) for code, first, total in outcomes))
    assert codes == ["OK"] * 4 + ["RESOURCE_EXHAUSTED"] * 6, codes
    refused = [first for code, first, _ in outcomes if code != "OK"]
    assert max(refused) < 1.0, refused  # refused at once
    served = sorted(total for code, _, total in outcomes if code == "OK")
    (code, first, total), = mine
    assert code == "OK"
    # The other client's request started at once, while the flood's requests ran one after another.
    assert first < 2.0 and first < served[0] / 2, (first, served)


def main() -> None:
    p = argparse.ArgumentParser(description="Large-prompt load probe against real gateway + worker processes")
    p.add_argument("--pair", choices=["builtin", "tiny"], default="builtin")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the loaders send 4 MB prompts")
    p.add_argument("--loaders", type=int, default=2, help="clients sending 4 MB prompts back to back, in parallel")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per stream (default: most of the context)")
    args = p.parse_args()
    from tests.conftest import _running_services

    with tempfile.TemporaryDirectory() as work, _running_services() as services:
        if args.pair == "builtin":
            from splitspec.builtin import builtin_pair

            target, draft = map(str, builtin_pair())
            max_tokens = args.max_tokens or 400
        else:
            from splitspec.fixtures.tiny import TinySpec, make_tiny

            target, draft = map(str, make_tiny(Path(work), TinySpec(seed=1)))
            max_tokens = args.max_tokens or 1000
        metrics_port = free_port()
        address = _start_pair(services, target, draft, "--metrics-port", str(metrics_port), cpu_threads=True)
        figures = probe_large_prompts(
            address, prompt="def parse_args(argv):\n", max_tokens=max_tokens, seconds=args.seconds, loaders=args.loaders,
            metrics_port=metrics_port,
        )
        print(f"pair {args.pair}, {args.loaders} loaders for {args.seconds:.0f} s")
        print(figures.summary())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    main()
