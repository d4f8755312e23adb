"""Load: 32 concurrent streams and several hundred requests of mixed modes and budgets through
the real services. Every output equals its single-stream output; afterwards the workers hold
no sequences, no KV reservations and no draft context."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.v1 import gateway_pb2
from tests.client import generate, worker_state

pytestmark = pytest.mark.slow
Spec = gateway_pb2.Speculation
CONCURRENCY, ROUNDS = 32, 10


def _requests() -> list[dict]:
    rng = np.random.default_rng(7)
    specs = [Spec(mode=Spec.OFF), Spec(mode=Spec.CHAIN, budget=8), Spec(mode=Spec.DDTREE, budget=4),
             Spec(mode=Spec.DDTREE, budget=22), Spec(mode=Spec.DDTREE, budget=64, chain_seed=False)]
    out = []
    for i in range(20):
        prompt = gateway_pb2.TokenIds(ids=rng.integers(0, 260, int(rng.integers(1, 30))).tolist())
        sampling = {"temperature": 1.0, "seed": i} if i % 2 else {}
        out.append(dict(tokens=prompt, max_tokens=int(rng.integers(4, 24)), ignore_eos=True, speculation=specs[i % len(specs)], **sampling))
    return out


def test_concurrent_streams_match_single_stream_outputs(module_services, tiny_pair, tmp_path_factory):
    s = module_services
    table = tmp_path_factory.mktemp("load") / "table.jsonl"
    target = s.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64")
    oracle = s.start("oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", str(tiny_pair.target))
    gateway = s.start("gateway", "gateway", "--target", target, "--draft", oracle, "--max-running", "64")
    requests = _requests()
    singles = [generate(gateway, **r).tokens for r in requests]
    with table.open("w") as f:
        for r, tokens in zip(requests, singles):
            f.write(json.dumps({"tokens": list(r["tokens"].ids) + tokens}) + "\n")
    singles = [generate(gateway, **r).tokens for r in requests]  # now with the oracle speculating

    jobs = [(i % len(requests)) for i in range(CONCURRENCY * ROUNDS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: (i, generate(gateway, timeout=300, **requests[i])), jobs))
    assert len(results) == CONCURRENCY * ROUNDS
    for i, out in results:
        assert out.tokens == singles[i], f"request {i} changed under load"
    speculated = [out.final.usage for i, out in results if requests[i]["speculation"].mode != Spec.OFF]
    assert pooled_acceptance_length(speculated) > 1.5
    state = worker_state(target, oracle)
    assert state.empty, state
