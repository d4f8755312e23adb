"""Faults with real processes: a draft killed mid-stream, a target killed or losing a sequence,
client cancellation and deadlines, SIGTERM draining, idle expiry. Output never changes, and no
state is left on the workers afterwards."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import grpc
import pytest

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from tests.client import generate, worker_state

pytestmark = pytest.mark.slow
Spec = gateway_pb2.Speculation
PROMPT = gateway_pb2.TokenIds(ids=[11, 22, 33, 44, 55])
LONG = 800  # tokens: long enough to act while the stream is still running


def wait_until(condition, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def gateway_info(address: str) -> gateway_pb2.GatewayInfo:
    with grpc.insecure_channel(address) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).Info(common_pb2.InfoRequest(), timeout=5)


def start_system(services, tiny_pair, table, *gateway_args):
    target = services.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64", "--sequence-ttl", "60")
    draft = services.start("draft", "oracle-draft", "--table", str(table), "--corruption", "0.2", "--target-model", str(tiny_pair.target))
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft, "--health-interval", "0.2", *gateway_args)
    return target, draft, gateway


def record_reference(gateway: str, table, max_tokens: int = LONG) -> list[int]:
    ref = generate(gateway, tokens=PROMPT, max_tokens=max_tokens, ignore_eos=True, speculation=Spec(mode=Spec.OFF))
    table.write_text(json.dumps({"tokens": list(PROMPT.ids) + ref.tokens}) + "\n")
    return ref.tokens


def open_stream(channel, metadata=(), **fields):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    return stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120, metadata=metadata)


def collect(stream, tokens: list[int]) -> gateway_pb2.Final | None:
    final = None
    for r in stream:
        tokens.extend(r.token_ids)
        if r.HasField("final"):
            final = r.final
    return final


def test_draft_killed_mid_stream_then_back(services, tiny_pair, tmp_path):
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    reference = record_reference(gateway, table)
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        stream = open_stream(ch, tokens=PROMPT, max_tokens=LONG, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        services.stop("draft", signal.SIGKILL)
        final = collect(stream, tokens)
    assert tokens == reference
    assert final.usage.draft_fallbacks > 0
    assert not gateway_info(gateway).draft_available

    services.start("draft", "oracle-draft", "--table", str(table), "--corruption", "0.2", "--target-model", str(tiny_pair.target))
    wait_until(lambda: gateway_info(gateway).draft_available, what="draft back")
    again = generate(gateway, tokens=PROMPT, max_tokens=LONG, ignore_eos=True)
    assert again.tokens == reference
    assert again.final.usage.draft_fallbacks == 0 and again.final.usage.mean_acceptance_length > 2
    wait_until(lambda: worker_state(target, services.address("draft")).empty, what="state released")


def test_running_sequence_resumes_speculation_when_the_draft_returns(services, tiny_pair, tmp_path):
    """The draft restarts (losing every context) while a sequence runs: the sequence falls back,
    then starts a fresh draft context and speculates again, with unchanged output."""
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    reference = record_reference(gateway, table, max_tokens=2400)
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        stream = open_stream(ch, tokens=PROMPT, max_tokens=2400, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        services.stop("draft", signal.SIGKILL)
        services.start("draft", "oracle-draft", "--table", str(table), "--corruption", "0.2", "--target-model", str(tiny_pair.target))
        final = collect(stream, tokens)
    assert tokens == reference
    usage = final.usage
    assert usage.draft_fallbacks > 0
    # Steps after the restart speculate again, and accept: a fallback step commits one token, so the
    # others committed the rest. (How many steps fall back depends on how fast the draft restarts.)
    speculated = usage.steps - usage.draft_fallbacks
    assert speculated >= 10, usage
    assert (usage.completion_tokens - usage.draft_fallbacks) / speculated > 1.5, usage


def test_draft_deadline_miss_falls_back_then_speculation_resumes(services, tiny_pair, tmp_path):
    """Proposals of other sequences queued on the draft's engine thread (as on a draft shared by many
    sequences) make the sequence's Propose miss --draft-timeout: that step runs target-only and its
    stream is dropped. Once the queue is gone and the draft answers health checks again, the
    sequence speculates on a new stream, with unchanged output."""
    table = tmp_path / "table.jsonl"
    target = services.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64", "--threads", "1")
    draft = services.start(
        "draft", "oracle-draft", "--table", str(table), "--corruption", "0.2", "--delay", "0.02",
        "--target-model", str(tiny_pair.target),
    )
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft, "--health-interval", "0.2", "--draft-timeout", "0.25")
    reference = record_reference(gateway, table, max_tokens=400)
    missed = "draft failed (DEADLINE_EXCEEDED"
    stop = threading.Event()
    blockers: list[str] = []

    def keep_the_draft_busy(stub) -> None:
        """Keep 20 x 0.02 s of other work queued ahead of anything new, until a Propose missed its deadline."""
        in_flight = []
        while not stop.is_set() and missed not in services.log("gateway"):
            in_flight = [f for f in in_flight if not f.done()]
            while len(in_flight) < 20:
                blockers.append(f"blocker-{len(blockers)}")
                in_flight.append(stub.Propose.future(draft_pb2.ProposeRequest(sequence_id=blockers[-1], top_k=2), timeout=60))
            time.sleep(0.005)
        for f in in_flight:
            f.result()

    with grpc.insecure_channel(draft) as dch:
        stub = draft_pb2_grpc.DraftWorkerStub(dch)
        feeder = threading.Thread(target=keep_the_draft_busy, args=(stub,))
        feeder.start()
        try:
            wait_until(lambda: worker_state(target, draft).draft_sequences > 0, what="the draft busy")
            done = generate(gateway, tokens=PROMPT, max_tokens=400, ignore_eos=True)
        finally:
            stop.set()
            feeder.join()
        for b in blockers:
            stub.Release(common_pb2.ReleaseRequest(sequence_id=b), timeout=5)
    assert done.tokens == reference
    usage = done.final.usage
    assert usage.draft_fallbacks >= 1 and "fallbacks {'deadline_exceeded': " in services.log("gateway")
    speculated = usage.steps - usage.draft_fallbacks
    assert speculated >= 10 and (usage.completion_tokens - usage.draft_fallbacks) / speculated > 1.5, usage
    wait_until(lambda: worker_state(target, draft).empty, what="state released")


def test_target_killed_mid_stream_then_back(services, tiny_pair, tmp_path):
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    reference = record_reference(gateway, table)
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        stream = open_stream(ch, tokens=PROMPT, max_tokens=LONG, ignore_eos=True)
        next(stream)
        services.stop("target", signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            collect(stream, [])
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: not gateway_info(gateway).target_available, what="target marked down")
    with pytest.raises(grpc.RpcError) as refused:
        generate(gateway, tokens=PROMPT, max_tokens=4)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "unavailable" in refused.value.details()

    target = services.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64")
    wait_until(lambda: gateway_info(gateway).target_available, what="target back")
    assert generate(gateway, tokens=PROMPT, max_tokens=LONG, ignore_eos=True).tokens == reference
    wait_until(lambda: worker_state(target, draft).empty, what="state released")


@pytest.mark.parametrize("mode", ["ddtree", "off"])
def test_gateway_recovers_a_sequence_the_target_lost(services, tiny_pair, tmp_path, mode):
    """Speculating, and target-only (whose steps are pipelined: the step in flight behind the one
    that finds the sequence gone must not run after the re-prefill)."""
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    reference = record_reference(gateway, table)
    speculation = Spec(mode=Spec.OFF) if mode == "off" else None
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch, grpc.insecure_channel(target) as tch:
        stream = open_stream(
            ch, tokens=PROMPT, max_tokens=LONG, ignore_eos=True, speculation=speculation, metadata=(("x-request-id", "lost-1"),)
        )
        tokens = list(next(stream).token_ids)
        # The workers know the request by the gateway's own sequence id, which its log names.
        sequence_id = re.search(r"request lost-1: sequence (\w+)", services.log("gateway")).group(1)
        released = target_pb2_grpc.TargetWorkerStub(tch).Release(common_pb2.ReleaseRequest(sequence_id=sequence_id), timeout=5)
        final = collect(stream, tokens)
    assert released.released
    assert tokens == reference and final.finish_reason == gateway_pb2.LENGTH
    assert "re-prefilling" in services.log("gateway")
    wait_until(lambda: worker_state(target, draft).empty, what="state released")


def test_cancel_and_deadline_release_everything(services, tiny_pair, tmp_path):
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    record_reference(gateway, table)
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        stream = open_stream(ch, tokens=PROMPT, max_tokens=LONG, ignore_eos=True)
        next(stream)
        assert worker_state(target, draft).target_sequences == 1
        stream.cancel()
    wait_until(lambda: worker_state(target, draft).empty, what="released after cancel")
    with pytest.raises(grpc.RpcError) as late:
        generate(gateway, timeout=0.3, tokens=PROMPT, max_tokens=LONG, ignore_eos=True, speculation=Spec(mode=Spec.OFF))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: worker_state(target, draft).empty, what="released after deadline")


def test_sigterm_drains_in_flight_requests(services, tiny_pair, tmp_path):
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table, "--shutdown-grace", "60")
    reference = record_reference(gateway, table)
    with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as ch:
        stream = open_stream(ch, tokens=PROMPT, max_tokens=LONG, ignore_eos=True, speculation=Spec(mode=Spec.OFF))
        tokens = list(next(stream).token_ids)
        services.procs["gateway"].send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:
            generate(gateway, tokens=PROMPT, max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        final = collect(stream, tokens)
    assert tokens == reference and final.finish_reason == gateway_pb2.LENGTH
    assert services.procs["gateway"].wait(timeout=30) == 0


def test_workers_expire_idle_sequences(services, tiny_pair):
    target = services.start("target", "target", "--model", str(tiny_pair.target), "--sequence-ttl", "0.4")
    with grpc.insecure_channel(target) as ch:
        stub = target_pb2_grpc.TargetWorkerStub(ch)
        stub.Prefill(target_pb2.PrefillRequest(sequence_id="forgotten", tokens=[1, 2, 3]), timeout=10)
        assert worker_state(target).target_sequences == 1
        wait_until(lambda: worker_state(target).empty, timeout=5, what="expiry")
        with pytest.raises(grpc.RpcError) as gone:
            stub.Verify(target_pb2.VerifyRequest(sequence_id="forgotten"), timeout=5)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        # Release is idempotent.
        assert not stub.Release(common_pb2.ReleaseRequest(sequence_id="forgotten"), timeout=5).released
    assert "after 0 s idle" in services.log("target") or "idle" in services.log("target")


def test_malformed_draft_proposals_cost_only_speculation(services, tiny_pair, tmp_path):
    """A draft whose weights went bad (NaN in its fc projection) answers every Propose with NaN
    log-probs. The gateway treats the proposal as input: each step falls back to target-only
    ("malformed"), and the request completes with the target-only output."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken-draft"
    shutil.copytree(tiny_pair.draft, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["fc.weight"].fill_(float("nan"))
    save_file(weights, str(broken / "model.safetensors"))
    target = services.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64")
    draft = services.start("draft", "draft", "--model", str(broken), "--target-model", str(tiny_pair.target), "--dtype", "float64")
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft)
    expected = generate(gateway, tokens=PROMPT, max_tokens=40, ignore_eos=True, speculation=Spec(mode=Spec.OFF)).tokens
    done = generate(gateway, tokens=PROMPT, max_tokens=40, ignore_eos=True, speculation=Spec(mode=Spec.DDTREE, budget=8))
    assert done.tokens == expected
    usage = done.final.usage
    assert usage.draft_fallbacks >= usage.steps - 1 > 0, usage  # the last step drafts nothing
    assert "malformed draft proposal (top_logprobs contains NaN)" in services.log("gateway")
    wait_until(lambda: worker_state(target, draft).empty, what="state released")


def test_a_reused_request_id_speculates_from_its_first_step(services, tiny_pair, tmp_path):
    """Clients reuse x-request-id (retries): every request, from this gateway or a restarted one,
    runs on a sequence id of the gateway's own, so nothing the workers remember of an earlier
    request with that x-request-id holds it back."""
    table = tmp_path / "table.jsonl"
    target, draft, gateway = start_system(services, tiny_pair, table)
    reference = record_reference(gateway, table, max_tokens=64)
    for restart in (False, False, True):
        if restart:
            services.stop("gateway")
            gateway = services.start("gateway", "gateway", "--target", target, "--draft", draft)
        out = generate(gateway, tokens=PROMPT, max_tokens=64, ignore_eos=True, metadata=(("x-request-id", "again"),))
        assert out.tokens == reference
        assert out.final.usage.draft_fallbacks == 0 and out.final.usage.mean_acceptance_length > 1.0
