"""The Prometheus wiring in isolation: what one step, one request and one failure add to the registry."""

from __future__ import annotations

import asyncio
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.gateway.stats import SequenceStats, StepStats
from services.metrics import GatewayMetrics, WorkerMetrics, model_name, serve_metrics
from splitspec.errors import InvalidArgument, ResourceExhausted
from tests.tools import free_port, require


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    found = registry.get_sample_value(name, {"model": "m", **labels})
    return 0.0 if found is None else found


@pytest.fixture
def gateway() -> GatewayMetrics:
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.model = "m"
    return metrics


def test_a_step_counts_accepted_tokens_by_depth(gateway):
    gateway.observe_step("ddtree", StepStats(tree_nodes=22, draft_depth=9, accepted=3))
    gateway.observe_step("ddtree", StepStats(tree_nodes=22, draft_depth=7, accepted=1))
    r = gateway.registry
    assert value(r, "splitspec_spec_decode_steps_total", mode="ddtree") == 2
    assert value(r, "splitspec_spec_decode_accepted_tokens_total", mode="ddtree") == 4
    assert value(r, "splitspec_spec_decode_draft_tokens_total", mode="ddtree") == 16
    assert value(r, "splitspec_spec_decode_tree_nodes_total", mode="ddtree") == 44
    per_pos = [value(r, "splitspec_spec_decode_accepted_tokens_per_pos_total", mode="ddtree", position=str(d)) for d in (1, 2, 3, 4)]
    assert per_pos == [2, 1, 1, 0]
    assert value(r, "splitspec_spec_decode_acceptance_length_tokens_sum", mode="ddtree") == 4 + 2
    assert value(r, "splitspec_spec_decode_acceptance_length_tokens_bucket", mode="ddtree", le="2.0") == 1
    assert value(r, "splitspec_draft_fallbacks_total", reason="deadline_exceeded") == 0


def test_fallback_steps_are_counted_by_reason_and_in_the_sequence_stats(gateway):
    stats = SequenceStats()
    for step in (StepStats(4, 4, 2), StepStats(0, 0, 0, "deadline_exceeded"), StepStats(0, 0, 0, "deadline_exceeded")):
        stats.add(step)
        gateway.observe_step("chain", step)
    assert (stats.steps, stats.committed, stats.fallbacks, stats.tree_nodes) == (3, 5, 2, 4)
    # AL (splitspec.spec.acceptance_length): fallback steps count, with their one token each.
    assert stats.mean_acceptance_length == 5 / 3
    r = gateway.registry
    al_sum, al_count = (value(r, f"splitspec_spec_decode_acceptance_length_tokens_{s}", mode="chain") for s in ("sum", "count"))
    assert al_sum / al_count == stats.mean_acceptance_length
    assert value(gateway.registry, "splitspec_draft_fallbacks_total", reason="deadline_exceeded") == 2


def test_request_timing_one_itl_observation_per_token_after_the_first(gateway):
    with gateway.request() as timing:
        assert value(gateway.registry, "splitspec_num_requests_waiting") == 1
        timing.admitted(prompt_tokens=7)
        assert value(gateway.registry, "splitspec_num_requests_running") == 1
        for batch in (1, 0, 4, 3):
            timing.tokens(batch)
        timing.finished("length")
    r = gateway.registry
    assert value(r, "splitspec_num_requests_running") == value(r, "splitspec_num_requests_waiting") == 0
    assert value(r, "splitspec_generation_tokens_total") == 8
    assert value(r, "splitspec_prompt_tokens_total") == 7
    assert value(r, "splitspec_time_to_first_token_seconds_count") == 1
    assert value(r, "splitspec_inter_token_latency_seconds_count") == 7
    assert value(r, "splitspec_request_success_total", reason="length") == 1
    assert value(r, "splitspec_e2e_request_latency_seconds_count") == 1
    assert timing.first_token_s is not None and timing.first_token_s >= 0


@pytest.mark.parametrize(
    "error,reason,admitted",
    [(InvalidArgument("max_tokens"), "invalid_argument", False), (ResourceExhausted("KV"), "resource_exhausted", True),
     (asyncio.CancelledError(), "cancelled", True), (RuntimeError("bug"), "internal", True)],
)
def test_failures_are_counted_by_status_and_release_the_gauges(gateway, error, reason, admitted):
    with pytest.raises(type(error)):
        with gateway.request() as timing:
            if admitted:
                timing.admitted(prompt_tokens=3)
            raise error
    r = gateway.registry
    assert value(r, "splitspec_request_failure_total", reason=reason) == 1
    assert value(r, "splitspec_num_requests_running") == value(r, "splitspec_num_requests_waiting") == 0
    assert value(r, "splitspec_e2e_request_latency_seconds_count") == 0


def test_worker_gauges_are_read_at_scrape_time():
    live = []
    metrics = WorkerMetrics("target", "m", CollectorRegistry())
    metrics.watch(live_sequences=lambda: len(live), kv_cache_capacity_tokens=lambda: 1024)
    metrics.forward("verify", 2_500_000)
    live.extend("ab")
    r = metrics.registry
    assert value(r, "splitspec_worker_live_sequences") == 2
    assert value(r, "splitspec_worker_kv_cache_capacity_tokens") == 1024
    assert value(r, "splitspec_worker_forward_duration_seconds_sum", phase="verify") == pytest.approx(0.0025)
    with pytest.raises(KeyError):
        metrics.watch(no_such_gauge=lambda: 1)


def test_the_adaptive_budgets_figures_are_read_at_scrape_time(gateway):
    """Nothing before the policy has seen a round; then the choice, the rates it was made from and
    the drafting rounds' figures (the level of their passes among them); the target-only rounds'
    once 0's steps ran. Each equals the
    policy's own, and the exposition passes promtool's lint."""
    import numpy as np

    from services.gateway.budget import BudgetPolicy
    from tests.services.gateway.test_budget_policy import run_fixed, run_steps

    policy = BudgetPolicy(22, 64)
    gateway.watch_budget(policy.figures)
    r = gateway.registry
    assert r.get_sample_value("splitspec_adaptive_budget_nodes", {"model": "m"}) is None
    run_steps(policy, 8, 30, np.random.default_rng(0))
    assert value(r, "splitspec_adaptive_budget_nodes") == policy.choice > 0
    candidates, rates, _ = policy._rates_now()
    assert [value(r, "splitspec_adaptive_budget_expected_tokens_per_second", budget=str(b)) for b in candidates] == list(rates)
    assert value(r, "splitspec_adaptive_budget_round_other_seconds", kind="drafting") == policy.t_other > 0
    assert value(r, "splitspec_adaptive_budget_round_passes", kind="drafting") == policy.passes_per_round
    assert value(r, "splitspec_adaptive_budget_pass_sequences", kind="drafting") == policy.concurrency == 8
    assert value(r, "splitspec_adaptive_budget_draft_seconds") == policy.t_draft
    assert value(r, "splitspec_adaptive_budget_pass_level", kind="drafting") == policy._level() != 1.0
    assert r.get_sample_value("splitspec_adaptive_budget_round_other_seconds", {"model": "m", "kind": "target_only"}) is None
    assert r.get_sample_value("splitspec_adaptive_budget_forecast_tokens_per_second", {"model": "m", "budget": "12"}) is None
    run_fixed(policy, 12, 8, 3, np.random.default_rng(1))
    assert value(r, "splitspec_adaptive_budget_forecast_tokens_per_second", budget="12") == policy.forecast[12] > 0
    policy.observe_pass(8, 8, 0.01)
    policy.observe_round(0.017, 0.015, 0.0, 8, target_only=True, pass_rows=8)  # its pass 1.5x the curve at 8 rows
    assert value(r, "splitspec_adaptive_budget_round_other_seconds", kind="target_only") == pytest.approx(0.002)
    assert value(r, "splitspec_adaptive_budget_pass_sequences", kind="target_only") == 8
    policy.rates()
    assert value(r, "splitspec_adaptive_budget_pass_level", kind="target_only") == policy._level(target_only=True) != 1.0
    promtool = require("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=generate_latest(r).decode(), capture_output=True, text=True)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_metrics_are_served_on_the_listen_host_and_a_busy_port_is_one_clear_error():
    metrics = WorkerMetrics("draft", "m", CollectorRegistry())
    metrics.describe(device="cpu")
    port = free_port()
    serve_metrics(metrics.registry, port, "unix:/tmp/some.sock")  # a Unix socket service: loopback
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'splitspec_build_info{device="cpu",model="m",service="draft",version=' in body
    with pytest.raises(OSError, match=rf"--metrics-port {port}: cannot listen on 127.0.0.1:{port}"):
        serve_metrics(CollectorRegistry(), port, f"127.0.0.1:{free_port()}")


def test_model_label_is_the_file_or_folder_name():
    assert model_name("/models/Qwen3-8B-Q4_K_M.gguf") == "Qwen3-8B-Q4_K_M"
    assert model_name("/models/Qwen3-8B/") == "Qwen3-8B"
