"""Where a decode step goes (splitspec.bench.step_split), read from the services' real metric classes."""

import pytest
from prometheus_client import generate_latest

from services.metrics import GatewayMetrics, WorkerMetrics
from splitspec.bench.step_split import StepSplit, means, totals


def _gateway_rounds(metrics: GatewayMetrics, rpc: str, seconds: list[float]) -> None:
    """Round trips of ``rpc`` in the series the gateway's RPC observer (``RpcObserver.observe``) writes."""
    for s in seconds:
        metrics.child(metrics.rpc_duration, rpc).observe(s)


def test_means_between_two_scrapes_of_the_real_metrics():
    gateway, target, draft = GatewayMetrics(), WorkerMetrics("target", "m"), WorkerMetrics("draft", "d")
    _gateway_rounds(gateway, "TargetWorker/Verify", [0.004])
    target.forward("verify", 3_000_000)
    target.batched("verify", [object()], [0.001])
    before = totals(generate_latest(gateway.registry).decode()) | totals(generate_latest(target.registry).decode())
    _gateway_rounds(gateway, "TargetWorker/Verify", [0.006, 0.008])
    _gateway_rounds(gateway, "DraftWorker/Propose", [0.002])
    for ns in (5_000_000, 6_000_000):
        target.forward("verify", ns)
    target.forward("prefill", 90_000_000)  # another phase: not a step's pass, but a share of each step's time
    target.batched("verify", [object(), object()], [0.0, 0.0005])
    draft.forward("propose", 1_500_000)
    draft.batched("propose", [object()], [0.0002])
    after = totals(generate_latest(gateway.registry).decode()) | totals(generate_latest(target.registry).decode())
    after |= totals(generate_latest(draft.registry).decode())
    split = means(before, after)
    assert split.verify_rpc_ms == pytest.approx(7.0) and split.propose_rpc_ms == pytest.approx(2.0)
    assert split.target_pass_ms == pytest.approx(5.5) and split.target_queue_ms == pytest.approx(0.25)
    assert split.draft_pass_ms == pytest.approx(1.5) and split.draft_queue_ms == pytest.approx(0.2)
    assert split.prompt_ms_per_step == pytest.approx(45.0)  # one 90 ms prompt over the two steps counted


def test_nothing_counted_is_none():
    assert means({}, {}) == StepSplit()
    assert means({"verify_rpc_ms": (1.0, 2.0)}, {"verify_rpc_ms": (1.0, 2.0)}).verify_rpc_ms is None
