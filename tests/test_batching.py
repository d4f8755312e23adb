"""Many users at once, through the three real services: every sequence's output under continuous
batching equals its single-stream, target-only output.

The target runs in float32 (the CPU default). At concurrency 8 and 32 the workers batch the steps
of the sequences that are ready into one forward pass; the target's ``/metrics`` must show passes
of several sequences, or this test would prove nothing. Both target families run, every mode,
greedy and seeded sampling, with the real DFlash draft of the tiny pair and the benchmark/test-only
OracleDrafter (the recorded target-only output corrupted at 30% per depth), which drives long
acceptances and rejections. The target computes each pass on a thread of its own
(``--cpu-pass-thread on``), so that, as on a GPU, it prepares one cohort's pass while another's
runs (``services.worker.batching``); the real draft's test checks that it did.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from splitspec.v1 import gateway_pb2
from tests.client import generate, worker_state
from tests.tools import free_port

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
MODES = [
    ("off", Spec(mode=Spec.OFF)),
    ("chain-8", Spec(mode=Spec.CHAIN, budget=8)),
    ("ddtree-12", Spec(mode=Spec.DDTREE, budget=12, chain_seed=False)),
]
NEW_TOKENS = 24


def _cases(vocab: int, count: int) -> list[dict]:
    rng = np.random.default_rng(18)
    cases = []
    for i in range(count):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": int(rng.integers(2**63))}
        cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": NEW_TOKENS, "ignore_eos": True, **sampling})
    return cases


def passes_by_size(metrics_url: str) -> dict[float, float]:
    """Cumulative counts of the target's verify passes by sequences per pass (the histogram's buckets)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    pattern = r'splitspec_worker_pass_sequences_bucket\{le="([^"]+)",model="[^"]*",phase="verify"\} (\S+)'
    found = {float(le): float(count) for le, count in re.findall(pattern, text)}
    if not found:  # label order is the client library's: accept either
        pattern = r'splitspec_worker_pass_sequences_bucket\{[^}]*le="([^"]+)"[^}]*phase="verify"[^}]*\} (\S+)'
        found = {float(le): float(count) for le, count in re.findall(pattern, text)}
    return found


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def system(request, module_services, tiny_pair, tiny_qwen35_pair, tmp_path_factory):
    from splitspec.models.loader import read_target_config

    s, arch = module_services, request.param
    pair = tiny_qwen35_pair if arch == "qwen35" else tiny_pair
    model = str(pair.target)
    table = tmp_path_factory.mktemp(f"batching-{arch}") / "table.jsonl"
    port = free_port()
    target = s.start(
        f"b-{arch}-target", "target", "--model", model, "--dtype", "float32", "--threads", "1", "--metrics-port", str(port),
        "--cpu-pass-thread", "on",  # passes compute on their own thread, the next prepared meanwhile, as on a GPU
    )
    oracle = s.start(f"b-{arch}-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", model)
    draft_port = free_port()
    # Four context slots for up to eight sequences at once (the fast path's fixed shapes, run eagerly on a
    # CPU): the others run the eager pass until a slot frees, then are seated in it.
    dflash = s.start(
        f"b-{arch}-dflash", "draft", "--model", str(pair.draft), "--target-model", model, "--threads", "1",
        "--graph-sequences", "4", "--graph-context", "256", "--metrics-port", str(draft_port),
    )
    gw_oracle = s.start(f"b-{arch}-gw-oracle", "gateway", "--target", target, "--draft", oracle, "--metrics-port", "0")
    gw_dflash = s.start(f"b-{arch}-gw-dflash", "gateway", "--target", target, "--draft", dflash, "--metrics-port", "0")
    gw_auto = s.start(f"b-{arch}-gw-auto", "gateway", "--target", target, "--draft", dflash, "--metrics-port", "0", "--budget", "auto")
    gw_auto2 = s.start(f"b-{arch}-gw-auto2", "gateway", "--target", target, "--draft", dflash, "--metrics-port", "0", "--budget", "auto")
    cases = _cases(read_target_config(model).vocab_size, 32)
    # Single-stream, target-only: one request at a time.
    references = [generate(gw_oracle, speculation=Spec(mode=Spec.OFF), **case).tokens for case in cases]
    with table.open("w") as f:
        for case, ref in zip(cases, references):
            assert len(ref) == NEW_TOKENS
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref}) + "\n")
    yield {"target": target, "oracle": oracle, "dflash": dflash, "gw_oracle": gw_oracle, "gw_dflash": gw_dflash, "gw_auto": gw_auto,
           "gw_auto2": gw_auto2, "cases": cases, "references": references, "metrics": f"http://127.0.0.1:{port}/metrics",
           "draft_metrics": f"http://127.0.0.1:{draft_port}/metrics"}
    for name in ("gw-auto2", "gw-auto", "gw-dflash", "gw-oracle", "dflash", "oracle", "target"):
        s.stop(f"b-{arch}-{name}")


def run_concurrently(gateway: str, cases: list[dict], concurrency: int, spec) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return [c.tokens for c in pool.map(lambda case: generate(gateway, speculation=spec, **case), cases)]


@pytest.mark.parametrize("concurrency", [8, 32])
@pytest.mark.parametrize("name,spec", MODES, ids=[m[0] for m in MODES])
def test_outputs_under_batching_equal_single_stream(system, name, spec, concurrency):
    before = passes_by_size(system["metrics"])
    outputs = run_concurrently(system["gw_oracle"], system["cases"], concurrency, spec)
    for i, (out, ref) in enumerate(zip(outputs, system["references"], strict=True)):
        assert out == ref, f"{name} at concurrency {concurrency}: case {i} diverged"
    after = passes_by_size(system["metrics"])
    batched = (after[float("inf")] - after[1.0]) - (before.get(float("inf"), 0) - before.get(1.0, 0))
    assert batched > 0, "no verify pass held more than one sequence: nothing was batched"


def prepared_ahead(metrics_url: str) -> float:
    """The target's verify passes prepared while the pass before was on the device (``--cpu-pass-thread``)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = re.search(r'^splitspec_worker_passes_prepared_ahead_total\{[^}]*phase="verify"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def gauge(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("name,spec", MODES[1:], ids=[m[0] for m in MODES[1:]])
def test_real_draft_outputs_under_batching_equal_single_stream(system, name, spec):
    """Speculating sequences form cohorts that take turns at the draft and the target: the target
    prepares one cohort's pass while the other's computes (staged passes), and must still give
    every sequence the target's own output. The draft has four context slots for the eight: the
    others run its eager pass until a slot frees and they are seated in it, their context copied."""
    before = prepared_ahead(system["metrics"])
    outputs = run_concurrently(system["gw_dflash"], system["cases"], 8, spec)
    assert outputs == system["references"]
    assert prepared_ahead(system["metrics"]) > before, "no verify pass was prepared ahead: the staged path did not run"
    # Eight at once over four draft slots: every slot came back (a request's release precedes its answer).
    assert gauge(system["draft_metrics"], "splitspec_worker_graph_slots_capacity") == 4
    assert gauge(system["draft_metrics"], "splitspec_worker_graph_slots_used") == 0
    assert gauge(system["draft_metrics"], "splitspec_worker_live_sequences") == 0


def budget_votes(metrics_url: str) -> float:
    """The adaptive gateways whose budget votes the target counts now."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return float(re.search(r"^splitspec_worker_budget_votes\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_adaptive_budget_outputs_under_batching_equal_single_stream(system):
    """``--budget auto`` with the real draft on two gateways at once, which vote to the target and
    follow the budget it agrees over both: whatever budgets they pick (0 among them: steps that
    skip the draft and send it the missed features later), the target's output."""
    cases, half = system["cases"], len(system["cases"]) // 2
    votes, done = [], threading.Event()

    def watch():
        while not done.wait(0.1):
            votes.append(budget_votes(system["metrics"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(run_concurrently, system["gw_auto"], cases[:half], 8, Spec(mode=Spec.DDTREE))
            second = pool.submit(run_concurrently, system["gw_auto2"], cases[half:], 8, Spec(mode=Spec.DDTREE))
            outputs = first.result() + second.result()
    finally:
        done.set()
        watcher.join()
    assert outputs == system["references"]
    assert max(votes) == 2, votes  # both gateways' votes counted together


def test_no_state_left_behind(system):
    for draft in ("oracle", "dflash"):
        state = worker_state(system["target"], system[draft])
        assert state.empty, state
