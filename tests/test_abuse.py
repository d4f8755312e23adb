"""A hostile or careless client against real processes (target, draft, gateway): cancels and
deadlines at any point of a request leave nothing on the workers, requests sharing an x-request-id
never touch each other's sequences, a target whose steps are slow answers its health checks at
once and is never taken for down, and the step socket refuses an unauthenticated client before it
buffers anything large."""

from __future__ import annotations

import json
import random
import re
import select
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.transport.stepwire import HEADER, HELLO, MAX_FRAME_BYTES, REQUEST
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.client import generate, worker_state

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
WIRES = ("socket", "stream", "unary")
MODES = {"off": Spec(mode=Spec.OFF), "chain": Spec(mode=Spec.CHAIN, budget=8), "ddtree": Spec(mode=Spec.DDTREE, budget=16)}
PROMPT = gateway_pb2.TokenIds(ids=[11, 22, 33, 44, 55])
MAX_TOKENS = 60
RELEASE_WAIT_S = 2.0  # releases are asynchronous; the workers must be empty this soon after the last request


def wait_empty(target: str, draft: str, timeout: float = RELEASE_WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        state = worker_state(target, draft)
        if state.empty or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture(scope="module")
def system(module_services, tiny_pair, tmp_path_factory):
    """One target and one (oracle) draft, and a gateway per wire in front of them."""
    s = module_services
    model = str(tiny_pair.target)
    table = tmp_path_factory.mktemp("abuse") / "table.jsonl"
    target = s.start("ab-target", "target", "--model", model, "--threads", "1")
    gateway = s.start("ab-gw-ref", "gateway", "--target", target, "--draft", "", "--wire", "unary")
    reference = generate(gateway, tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True).tokens
    s.stop("ab-gw-ref")
    table.write_text(json.dumps({"tokens": list(PROMPT.ids) + reference}) + "\n")
    draft = s.start("ab-draft", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", model)
    gateways = {
        wire: s.start(f"ab-gw-{wire}", "gateway", "--target", target, "--draft", draft, "--wire", wire, "--health-interval", "0.5")
        for wire in WIRES
    }
    for wire, address in gateways.items():
        assert generate(address, tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True).tokens == reference, wire
    return {"target": target, "draft": draft, "gateways": gateways, "reference": reference, "services": s}


def abandon(channel, rng: random.Random, mode: str) -> tuple[str, list[int]]:
    """One request given up at a random point: a deadline or a cancel after a random time (from
    before the prefill reaches the target to past the last token), or a cancel right after a
    random number of answers. Returns how it ended and the tokens it got."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, speculation=MODES[mode])
    how = rng.choice(["deadline", "cancel-after-time", "cancel-after-answers"])
    after_s = rng.choice([rng.uniform(0.001, 0.02), rng.uniform(0.02, 0.3), rng.uniform(0.3, 1.5)])
    tokens: list[int] = []
    call = stub.Generate(request, timeout=after_s if how == "deadline" else 30)
    if how == "cancel-after-time":
        threading.Timer(after_s, call.cancel).start()
    answers = rng.randint(1, 40)
    try:
        for response in call:
            tokens.extend(response.token_ids)
            answers -= 1
            if how == "cancel-after-answers" and answers == 0:
                call.cancel()
        return "completed", tokens
    except grpc.RpcError as exc:
        return exc.code().name, tokens


def test_cancels_and_deadlines_anywhere_leave_nothing_on_the_workers(system):
    """48 requests, on every wire and in every mode, three at a time, each given up at a random
    point; whatever they got is the start of the right output, and afterwards neither worker holds
    a sequence, a KV reservation or a draft context."""
    reference, ended = system["reference"], {}

    def client(wire: str, seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(system["gateways"][wire], options=CHANNEL_OPTIONS) as channel:
            for i in range(16):
                mode = list(MODES)[i % 3]
                outcome, tokens = abandon(channel, rng, mode)
                assert tokens == reference[: len(tokens)], (wire, mode, outcome)
                assert outcome in ("completed", "CANCELLED", "DEADLINE_EXCEEDED"), (wire, mode, outcome)
                ended[outcome] = ended.get(outcome, 0) + 1

    clients = [threading.Thread(target=client, args=(wire, seed)) for seed, wire in enumerate(WIRES)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    print(f"48 requests given up at random points ended: {ended}")
    assert sum(ended.values()) == 48 and ended.get("CANCELLED") and ended.get("DEADLINE_EXCEEDED"), ended
    state = wait_empty(system["target"], system["draft"])
    assert state.empty, f"left on the workers after {ended}: {state}"
    # Nothing was lost on the way either: the system still serves, and the draft still speculates.
    for wire, gateway in system["gateways"].items():
        done = generate(gateway, tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, speculation=MODES["ddtree"])
        assert done.tokens == reference and done.final.usage.draft_fallbacks == 0, wire
    assert wait_empty(system["target"], system["draft"]).empty


@pytest.mark.parametrize("wire", WIRES)
def test_requests_sharing_an_x_request_id_do_not_touch_each_other(system, wire):
    """The x-request-id names a request in logs only: two at once with the same one each get the
    output they would alone, each on a sequence of the gateway's own."""
    gateway, reference = system["gateways"][wire], system["reference"]
    rid = f"dup-{wire}"
    outputs: dict[str, tuple[list[int], gateway_pb2.Final]] = {}
    overlap = threading.Event()

    def run(name: str, speculation) -> None:
        tokens, final = [], None
        with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
            request = gateway_pb2.GenerateRequest(tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, speculation=speculation)
            for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=60, metadata=(("x-request-id", rid),)):
                tokens.extend(r.token_ids)
                if name == "A" and len(tokens) == 1:
                    overlap.wait(10)  # B is under way while A still runs
                if name == "B":
                    overlap.set()
                if r.HasField("final"):
                    final = r.final
        outputs[name] = (tokens, final)

    a = threading.Thread(target=run, args=("A", MODES["off"]))
    b = threading.Thread(target=run, args=("B", MODES["ddtree"]))
    a.start()
    time.sleep(0.05)
    b.start()
    a.join()
    b.join()
    assert overlap.is_set()
    for name in "AB":
        tokens, final = outputs[name]
        assert tokens == reference and final.finish_reason == gateway_pb2.LENGTH, name
    log = system["services"].log(f"ab-gw-{wire}")
    sequences = re.findall(rf"request {rid}: sequence ([0-9a-f]{{32}})", log)
    assert len(sequences) == 2 and sequences[0] != sequences[1] and rid not in sequences
    assert wait_empty(system["target"], system["draft"]).empty


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("kind", [HELLO, REQUEST])
def test_an_unauthenticated_client_cannot_make_the_step_socket_buffer_a_large_frame(module_services, tiny_pair, kind):
    """A first frame announcing (nearly) the largest frame there is, a hello or a request, is refused
    on its header: the worker answers UNAUTHENTICATED at once and hangs up after at most a little of
    the payload, which it never holds."""
    s = module_services
    name = f"ab-locked-{kind}"
    address = s.start(name, "target", "--model", str(tiny_pair.target), "--threads", "1", "--auth-token", "s3cret")
    pid = s.procs[name].pid
    before = rss_mib(pid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address.removeprefix("unix:") + ".steps")
    sock.settimeout(10)
    t0 = time.monotonic()
    sock.sendall(HEADER.pack(MAX_FRAME_BYTES, kind))
    chunk, sent, peak, answered_s = b"\0" * (1 << 20), 0, before, None
    try:
        while sent < 256 << 20:  # half of what the header announced, 1 MiB at a time
            if answered_s is None and select.select([sock], [], [], 0)[0]:
                answered_s = time.monotonic() - t0
            sock.sendall(chunk)
            sent += len(chunk)
            peak = max(peak, rss_mib(pid))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker hung up
    if answered_s is None:
        select.select([sock], [], [], 10)
        answered_s = time.monotonic() - t0
    answer = b""
    try:
        while chunk := sock.recv(1 << 16):
            answer += chunk
    except ConnectionResetError:
        pass
    sock.close()
    peak = max(peak, rss_mib(pid))
    size, answer_kind = HEADER.unpack(answer[: HEADER.size])
    assert answer[HEADER.size : HEADER.size + size] == b"UNAUTHENTICATED\nmissing or wrong bearer token in the step socket's hello"
    assert answered_s < 1.0 and sent <= 8 << 20, (answered_s, sent)  # refused before the payload, then hung up
    assert peak - before < 32, (before, peak)
    s.stop(name)


def test_a_target_with_slow_steps_answers_health_checks_and_stays_up(module_services, tmp_path_factory):
    """A target whose every step takes a fifth to two fifths of a second on these CPUs (a model far larger
    than the tiny one, in float64 on one thread: as a 1.5B model on a CPU) decodes for the gateway
    while a probe checks its health every 0.2 s: every check is answered at once (within 0.3 s),
    and the gateway, checking every 0.2 s too, never takes it for down."""
    from splitspec.fixtures.tiny import TinySpec, make_tiny

    s = module_services
    spec = TinySpec(hidden_size=1024, intermediate_size=4096, num_heads=16, num_kv_heads=4, head_dim=64, target_layers=44, seed=3)
    target_model, _ = make_tiny(tmp_path_factory.mktemp("slow"), spec, weight_type="f16")
    # 5 GiB of float64 weights: 36 s to load here, more than 60 s on CI's busier machine.
    target = s.start("ab-slow", "target", "--model", str(target_model), "--dtype", "float64", "--threads", "1", timeout=240)
    gateway = s.start("ab-slow-gw", "gateway", "--target", target, "--draft", "", "--health-interval", "0.2")
    checks: list[tuple[float, int]] = []
    gateway_down: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(target) as tch, grpc.insecure_channel(gateway) as gch:
            health, info = health_pb2_grpc.HealthStub(tch), gateway_pb2_grpc.GatewayStub(gch)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                except grpc.RpcError as exc:
                    status = exc.code().name
                checks.append((time.perf_counter() - t0, status))
                if not info.Info(common_pb2.InfoRequest(), timeout=5).target_available:
                    gateway_down.append(time.strftime("%T"))
                time.sleep(0.2)

    arrivals: list[tuple[float, int]] = []  # (when, tokens) of each answer
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        request = gateway_pb2.GenerateRequest(tokens=PROMPT, max_tokens=16, ignore_eos=True, speculation=MODES["off"])
        responses = gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120)
        prober = threading.Thread(target=probe)
        try:
            for r in responses:
                if r.token_ids:
                    arrivals.append((time.monotonic(), len(r.token_ids)))
                    if len(arrivals) == 1:
                        prober.start()  # from the first decode step on
            after = generate(gateway, tokens=PROMPT, max_tokens=2, ignore_eos=True, timeout=60)  # served right after, too
        finally:
            stop.set()
            if prober.is_alive():
                prober.join()
    step_s = (arrivals[-1][0] - arrivals[0][0]) / sum(n for _, n in arrivals[1:])  # one token a step
    # A check must be able to land inside a step: steps of most of the probe's 0.2 s at least (CI's
    # machine ran this model's steps at 0.19 s with 36 layers where this one ran them at 0.33 s).
    assert step_s >= 0.15, f"steps of {step_s:.3f} s are not slow enough for this test"
    assert len(after.tokens) == 2
    serving = health_pb2.HealthCheckResponse.SERVING
    assert len(checks) >= 10 and all(status == serving for _, status in checks), checks
    # Within 0.3 s, all of them: a loop held by steps makes many late (before the fix: 9 of 15
    # over 0.3 s, 7 past the 1 s timeout). One slower answer is tolerated when the CPU is shared
    # (these tests run on 2 busy cores: the worker may wait its turn for a moment), never past 1 s.
    took = sorted(t for t, _ in checks)
    assert took[-2] < 0.3 and took[-1] < 1.0, f"slowest health checks {took[-5:]}, median {took[len(took) // 2]:.3f} s; steps {step_s:.3f} s"
    assert not gateway_down and "DOWN" not in s.log("ab-slow-gw")
    s.stop("ab-slow-gw")
    s.stop("ab-slow")
