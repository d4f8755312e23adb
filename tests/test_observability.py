"""Observability end to end: the three services scraped by a real Prometheus server.

The test counts what it got back (tokens, steps and accepted tokens from every response's usage)
and checks through Prometheus' HTTP API that the services' counters equal those counts and that
the histograms observed every request, token and worker call. The draft is the oracle drafter
(benchmark/test only): it proposes the target's own recorded output corrupted at 30% per depth,
so steps accept several tokens and every speculation counter moves. A second gateway, whose draft
deadline its (deliberately slow) oracle drafter cannot meet, exercises the fallback path. The Grafana dashboard's queries then run
against the same server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitspec.spec.acceptance_length import committed_tokens
from splitspec.v1 import gateway_pb2
from tests.client import Completion, generate
from tests.tools import free_port, require

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
DASHBOARD = Path(__file__).parents[1] / "deploy" / "grafana" / "dashboards" / "splitspec.json"
MAX_KV_TOKENS = 50_000
SPEC_MODES = {"ddtree": Spec(mode=Spec.DDTREE, budget=8), "chain": Spec(mode=Spec.CHAIN, budget=4)}


class Prometheus:
    """A real Prometheus server scraping ``targets`` (job -> host:port) every second."""

    def __init__(self, root: Path, targets: dict[str, str]) -> None:
        binary = require("prometheus", "prometheus")
        jobs = [{"job_name": job, "static_configs": [{"targets": [address]}]} for job, address in targets.items()]
        config = root / "prometheus.yml"  # JSON is YAML
        config.write_text(json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = root / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()}")

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.load(urllib.request.urlopen(url, timeout=10))
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}: {exc.read().decode()}") from exc
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_until(self, expr: str, done, timeout: float = 30.0) -> list[dict]:
        """Poll until ``done(result)``: later scrapes bring final values, and a scrape that timed out on
        a loaded machine leaves a target's series stale (absent) until the next one succeeds."""
        deadline = time.monotonic() + timeout
        while not done(result := self.query(expr)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return result

    def _single(self, expr: str, result: list[dict]) -> float | None:
        assert len(result) <= 1, f"{expr} has {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def value(self, expr: str) -> float:
        """The expression's single value, once it has one."""
        got = self._single(expr, self.query_until(expr, bool))
        assert got is not None, f"no data for {expr}"
        return got

    def wait_for(self, expr: str, expected: float | None) -> float | None:
        """The expression's value once it equals ``expected``, or the last value (None: no series) after a timeout."""
        return self._single(expr, self.query_until(expr, lambda result: self._single(expr, result) == expected))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class System:
    prometheus: Prometheus
    metrics_ports: dict[str, int]  # Prometheus job -> /metrics port
    completions: dict[str, list[tuple[str, Completion]]]  # gateway job -> (mode, completion)
    gateway_log: Path


def _wait_healthy(address: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Poll with the `splitspec health` subcommand, as container health checks do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"service at {address} exited with {proc.returncode}:\n{log.read_text(errors='replace')}"
        done = subprocess.run([sys.executable, "-m", "splitspec", "health", address, "--timeout", "2"], capture_output=True, text=True)
        if done.returncode == 0:
            assert "SERVING" in done.stdout
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout} s")


def _committed(c: Completion) -> int:
    """Tokens committed by the verify steps (root + accepted), from the usage the gateway returned."""
    return committed_tokens(c.final.usage)


@pytest.fixture(scope="module")
def system(module_services, tiny_pair, tmp_path_factory):
    s = module_services
    root = tmp_path_factory.mktemp("observability")
    ports = {job: free_port() for job in ("gateway", "fallback", "target", "draft")}
    # The target binds every interface, as in a container; its /metrics follows --listen's host.
    # (The later --listen overrides the Unix socket the fixture passes first.)
    target_port = free_port()
    s.start(
        "target", "target", "--model", str(tiny_pair.target), "--listen", f"0.0.0.0:{target_port}",
        "--metrics-port", str(ports["target"]), "--max-kv-tokens", str(MAX_KV_TOKENS), "--threads", "1", wait=False,
    )
    target = f"127.0.0.1:{target_port}"
    _wait_healthy(target, s.procs["target"], s.root / "target.log")
    table = root / "oracle.jsonl"
    draft = s.start(
        "draft", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", str(tiny_pair.target),
        "--metrics-port", str(ports["draft"]),
    )
    # --budget auto: a request that names no budget gets the adaptive budget's (its metrics need one).
    gateway = s.start(
        "gateway", "gateway", "--target", target, "--draft", draft, "--metrics-port", str(ports["gateway"]), "--log-json", "--budget", "auto"
    )
    # A drafter slower than the fallback gateway's draft deadline: every proposal misses it.
    slow_draft = s.start(
        "slow-draft", "oracle-draft", "--table", str(table), "--delay", "0.5", "--target-model", str(tiny_pair.target),
    )
    fallback = s.start(
        "fallback", "gateway", "--target", target, "--draft", slow_draft, "--draft-timeout", "0.05",
        "--metrics-port", str(ports["fallback"]),
    )
    prometheus = Prometheus(root, {job: f"127.0.0.1:{port}" for job, port in ports.items()})
    try:
        rng = np.random.default_rng(6)
        cases = [
            {"tokens": gateway_pb2.TokenIds(ids=rng.integers(0, 256, int(n)).tolist()), "max_tokens": 24, "ignore_eos": True}
            for n in rng.integers(3, 20, 3)
        ]
        done: dict[str, list[tuple[str, Completion]]] = {"gateway": [], "fallback": []}
        with table.open("w") as f:
            for case in cases:  # target-only references, which the oracle drafter then proposes
                ref = generate(gateway, speculation=Spec(mode=Spec.OFF), **case)
                done["gateway"].append(("off", ref))
                f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref.tokens}) + "\n")
        for case in cases:
            for mode, spec in SPEC_MODES.items():
                done["gateway"].append((mode, generate(gateway, speculation=spec, **case)))
        with pytest.raises(grpc.RpcError) as failed:
            generate(gateway, text="x", max_tokens=0)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for case in cases[:2]:
            done["fallback"].append(("ddtree", generate(fallback, **case)))
        # Adaptive, last: the target counts its gateway's budget vote until 40 passes of others' steps have passed.
        done["gateway"].append(("ddtree", generate(gateway, speculation=Spec(mode=Spec.DDTREE), **cases[0])))
        yield System(prometheus, ports, done, s.root / "gateway.log")
    finally:
        prometheus.stop()


def test_counters_equal_what_the_clients_counted(system):
    p = system.prometheus
    accepted_somewhere = 0
    for job, runs in system.completions.items():
        sel = f'job="{job}"'
        generated, prompt = sum(len(c.tokens) for _, c in runs), sum(c.final.usage.prompt_tokens for _, c in runs)
        assert generated == sum(c.final.usage.completion_tokens for _, c in runs)
        assert p.wait_for(f"splitspec_generation_tokens_total{{{sel}}}", generated) == generated
        assert p.wait_for(f"splitspec_prompt_tokens_total{{{sel}}}", prompt) == prompt
        assert p.wait_for(f'splitspec_request_success_total{{{sel}, reason="length"}}', len(runs)) == len(runs)
        for mode in sorted({m for m, _ in runs}):
            mine = [c for m, c in runs if m == mode]
            steps = sum(c.final.usage.steps for c in mine)
            accepted = sum(_committed(c) for c in mine) - steps
            if mode == "off":  # AL counts verify steps only: target-only is exactly 1, the prefill's token aside
                assert all(c.final.usage.mean_acceptance_length == 1.0 for c in mine) and accepted == 0
                assert all(c.final.usage.steps == len(c.tokens) - 1 for c in mine)
            assert p.wait_for(f'splitspec_spec_decode_steps_total{{{sel}, mode="{mode}"}}', steps) == steps
            assert p.wait_for(f'splitspec_spec_decode_accepted_tokens_total{{{sel}, mode="{mode}"}}', accepted) == accepted
            by_depth = f'sum(splitspec_spec_decode_accepted_tokens_per_pos_total{{{sel}, mode="{mode}"}})'
            expected = accepted or None  # no series before a first acceptance
            assert p.wait_for(by_depth, expected) == expected
            assert p.wait_for(f'splitspec_spec_decode_acceptance_length_tokens_sum{{{sel}, mode="{mode}"}}', accepted + steps) == accepted + steps
            if mode != "off" and job == "gateway":
                accepted_somewhere += accepted
                drafted = p.value(f'splitspec_spec_decode_draft_tokens_total{{{sel}, mode="{mode}"}}')
                assert accepted <= drafted <= steps * 15  # each step speculates at most block - 1 positions
    assert accepted_somewhere > 0, "the oracle's drafts were never accepted: the counters were tested on zeros"


def test_histograms_observed_every_request_token_and_worker_call(system):
    p = system.prometheus
    all_steps = all_requests = 0
    for job, runs in system.completions.items():
        sel = f'job="{job}"'
        requests, steps = len(runs), sum(c.final.usage.steps for _, c in runs)
        all_steps, all_requests = all_steps + steps, all_requests + requests
        assert p.wait_for(f"splitspec_time_to_first_token_seconds_count{{{sel}}}", requests) == requests
        assert p.wait_for(f"splitspec_e2e_request_latency_seconds_count{{{sel}}}", requests) == requests
        assert p.wait_for(f"splitspec_request_queue_time_seconds_count{{{sel}}}", requests) == requests
        tokens_after_first = sum(len(c.tokens) - 1 for _, c in runs)
        assert p.wait_for(f"splitspec_inter_token_latency_seconds_count{{{sel}}}", tokens_after_first) == tokens_after_first
        assert p.wait_for(f'splitspec_rpc_duration_seconds_count{{{sel}, rpc="TargetWorker/Verify"}}', steps) == steps
        assert p.wait_for(f'splitspec_rpc_duration_seconds_count{{{sel}, rpc="TargetWorker/Prefill"}}', requests) == requests
        assert p.value(f'splitspec_rpc_request_bytes_count{{{sel}, rpc="TargetWorker/Verify"}}') == steps
        assert p.value(f'splitspec_rpc_response_bytes_sum{{{sel}, rpc="TargetWorker/Verify"}}') > 0
        ttft = p.value(f"histogram_quantile(0.5, splitspec_time_to_first_token_seconds_bucket{{{sel}}})")
        assert 0 < ttft < 10
    target = 'job="target", phase='
    assert p.wait_for(f'splitspec_worker_forward_duration_seconds_count{{{target}"verify"}}', all_steps) == all_steps
    assert p.wait_for(f'splitspec_worker_forward_duration_seconds_count{{{target}"prefill"}}', all_requests) == all_requests
    proposes = p.value('splitspec_rpc_duration_seconds_count{job="gateway", rpc="DraftWorker/Propose"}')
    assert p.value('splitspec_worker_forward_duration_seconds_count{job="draft", phase="propose"}') >= proposes > 0


def test_fallbacks_and_failures_are_counted_by_reason(system):
    p = system.prometheus
    fallbacks = sum(c.final.usage.draft_fallbacks for _, c in system.completions["fallback"])
    assert fallbacks > 0
    # A missed deadline marks the draft down, so later steps of the same requests fall back as draft_down.
    assert p.wait_for('sum(splitspec_draft_fallbacks_total{job="fallback"})', fallbacks) == fallbacks
    assert p.value('splitspec_draft_fallbacks_total{job="fallback", reason="deadline_exceeded"}') >= 1
    assert p.value('splitspec_rpc_failures_total{job="fallback", rpc="DraftWorker/Propose", reason="deadline_exceeded"}') >= 1
    assert p.query('splitspec_draft_fallbacks_total{job="gateway"}') == []
    assert p.wait_for('splitspec_request_failure_total{job="gateway", reason="invalid_argument"}', 1) == 1
    assert p.value('splitspec_num_requests_running{job="gateway"} + splitspec_num_requests_waiting{job="gateway"}') == 0


def test_workers_report_capacity_placement_and_released_state(system):
    p = system.prometheus
    assert p.value('splitspec_worker_kv_cache_capacity_tokens{job="target"}') == MAX_KV_TOKENS
    assert p.wait_for('splitspec_worker_kv_cache_reserved_tokens{job="target"}', 0) == 0
    assert p.wait_for('sum(splitspec_worker_live_sequences{job=~"target|draft"})', 0) == 0
    assert p.value('splitspec_worker_max_sequences{job="target"}') == 64
    assert p.value('splitspec_worker_model_load_seconds{job="target"}') > 0
    info = {r["metric"]["job"]: r["metric"] for r in p.query_until("splitspec_build_info", lambda result: len(result) == 4)}
    assert set(info) == {"gateway", "fallback", "target", "draft"}
    assert {m["model"] for m in info.values()} == {"target"}  # the tiny pair's target.gguf, on every service
    assert info["target"]["service"] == "target" and info["target"]["backend"] == "cpu" and info["target"]["dtype"] == "float32"


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_every_metrics_endpoint_passes_promtool(system):
    promtool = require("promtool", "prometheus")
    for job, port in system.metrics_ports.items():
        done = subprocess.run([promtool, "check", "metrics"], input=_scrape(port), capture_output=True, text=True)
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), f"{job}: {done.stdout}{done.stderr}"


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def test_dashboard_queries_use_only_exported_metrics_and_return_data(system):
    exported = {
        sample.name
        for port in system.metrics_ports.values()
        for family in text_string_to_metric_families(_scrape(port))
        for sample in family.samples
    }
    queries = _dashboard_queries()
    assert len(queries) > 30
    for query in queries:
        names = set(re.findall(r"\bsplitspec_\w+", query))
        assert names and names <= exported, f"{query} uses {sorted(names - exported)}, not exported"
    grafana_variables = {"$__rate_interval": "5m", "$__range": "1h", "$model": ".*"}
    for query in queries:
        if query.startswith("label_values("):
            continue
        promql = query
        for variable, replacement in grafana_variables.items():
            promql = promql.replace(variable, replacement)
        assert not re.search(r"\$[a-zA-Z_]", promql), f"unknown Grafana variable in {query}"
        # rate() needs two scrapes of a series since it appeared: query_until waits for the later ones.
        assert system.prometheus.query_until(promql, bool), f"no data for {query}"


def test_request_log_is_one_json_object_per_line_with_the_usage(system):
    lines = [json.loads(line) for line in system.gateway_log.read_text().splitlines() if line.strip()]
    summaries = [line["request"] for line in lines if "request" in line]
    runs = [c for _, c in system.completions["gateway"]]
    assert len(summaries) == len(runs)
    logged = Counter((s["completion_tokens"], s["steps"], s["finish_reason"]) for s in summaries)
    assert logged == Counter((c.final.usage.completion_tokens, c.final.usage.steps, "length") for c in runs)
    assert all(0 < s["ttft_s"] <= s["duration_s"] and len(s["request_id"]) == 32 for s in summaries)
