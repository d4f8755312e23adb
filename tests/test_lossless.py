"""Losslessness through the three real services: speculative output == target-only output.

Both target families run, each also on the fast path's fixed shapes (padded passes, CUDA graphs on
a GPU): dense Qwen3 and the Qwen3.5 hybrid, whose Gated DeltaNet state follows each tree row's
parent chain and is committed along the accepted path. The target runs in
float64 so that batching a tree differently from a single token cannot flip a near-tie. A test's
cases run four at a time (``CONCURRENCY``), so the target's passes hold one sequence or several,
as they come: the lone and the batched paths both, every output against its single-stream
reference. Two drafts are used: the real DFlash draft of the tiny pair (random, so it rarely hits)
and the benchmark/test-only OracleDrafter, which proposes the recorded target-only output
corrupted at 30% per depth. The oracle drives long acceptances, rejections and branch
acceptances through every mode, so equality is tested where it is hard, not only where it is easy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.v1 import gateway_pb2
from tests.client import generate_all, live_sequences

pytestmark = pytest.mark.slow
CONCURRENCY = 4

Spec = gateway_pb2.Speculation
MODES = [
    ("chain-4", Spec(mode=Spec.CHAIN, budget=4)),
    ("chain-16", Spec(mode=Spec.CHAIN, budget=16)),
    ("ddtree-1", Spec(mode=Spec.DDTREE, budget=1, chain_seed=False)),
    ("ddtree-4", Spec(mode=Spec.DDTREE, budget=4, chain_seed=False)),
    ("ddtree-4-seeded", Spec(mode=Spec.DDTREE, budget=4, chain_seed=True)),
    ("ddtree-16", Spec(mode=Spec.DDTREE, budget=16, chain_seed=False)),
    ("ddtree-16-seeded", Spec(mode=Spec.DDTREE, budget=16, chain_seed=True)),
    ("ddtree-64", Spec(mode=Spec.DDTREE, budget=64, chain_seed=False)),
    ("ddtree-64-seeded", Spec(mode=Spec.DDTREE, budget=64, chain_seed=True)),
]


def lossless_cases(vocab: int, prompts: int = 10, seed: int = 2026, longest: int = 40) -> list[dict]:
    """Each prompt (random tokens, 1 to ``longest - 1``) greedy and seeded at temperature 1 (the
    last also with top-p 0.9 and top-k 20), 40 new tokens each."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(prompts):
        prompt = rng.integers(0, vocab, int(rng.integers(1, longest))).tolist()
        for temperature in (0.0, 1.0):
            sampling = {"temperature": temperature, "seed": int(rng.integers(2**63))}
            if i == prompts - 1 and temperature:
                sampling.update(top_p=0.9, top_k=20)
            cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 40, "ignore_eos": True, **sampling})
    return cases


@pytest.fixture(scope="module", params=["qwen3", "qwen3-fast-path", "qwen35", "qwen35-fast-path"])
def system(request, module_services, tiny_pair, tiny_qwen35_pair, tmp_path_factory):
    from splitspec.models.loader import read_target_config

    s, arch = module_services, request.param
    pair = tiny_qwen35_pair if arch.startswith("qwen35") else tiny_pair
    model = str(pair.target)
    table = tmp_path_factory.mktemp(f"oracle-{arch}") / "table.jsonl"
    # The fixed-shape passes (padded rows and sequences, bucketed spans; graphs on a GPU).
    fast = ["--fixed-shapes", "on"] if arch.endswith("fast-path") else []
    # One torch thread per worker: two workers spinning all cores of a small CI machine stall each other.
    target = s.start(f"{arch}-target", "target", "--model", model, "--dtype", "float64", "--threads", "1", *fast)
    oracle = s.start(f"{arch}-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", model)
    dflash = s.start(f"{arch}-dflash", "draft", "--model", str(pair.draft), "--target-model", model, "--threads", "1")
    gw_oracle = s.start(f"{arch}-gw-oracle", "gateway", "--target", target, "--draft", oracle)
    gw_dflash = s.start(f"{arch}-gw-dflash", "gateway", "--target", target, "--draft", dflash)
    # The gateways above carry steps on the workers' step sockets (--wire auto, workers on Unix sockets);
    # these two on per-sequence gRPC streams and on one gRPC call per step.
    gw_stream = s.start(f"{arch}-gw-stream", "gateway", "--target", target, "--draft", oracle, "--wire", "stream")
    gw_unary = s.start(f"{arch}-gw-unary", "gateway", "--target", target, "--draft", oracle, "--wire", "unary")
    for name, wire in (("gw-oracle", "socket"), ("gw-dflash", "socket"), ("gw-stream", "stream"), ("gw-unary", "unary")):
        assert f"on the {wire} wire, draft" in s.log(f"{arch}-{name}")

    cases = lossless_cases(read_target_config(model).vocab_size)
    # One at a time: each reference is its case's single-stream output.
    references = generate_all(gw_oracle, cases, 1, speculation=Spec(mode=Spec.OFF))
    with table.open("w") as f:
        for case, ref in zip(cases, references):
            assert ref.final.usage.mean_acceptance_length == 1.0 and len(ref.tokens) == 40
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref.tokens}) + "\n")
    yield {"arch": arch, "target": target, "oracle": oracle, "dflash": dflash, "gw_oracle": gw_oracle, "gw_dflash": gw_dflash,
           "gw_stream": gw_stream, "gw_unary": gw_unary,
           "cases": cases, "references": references}
    for name in ("gw-unary", "gw-stream", "gw-dflash", "gw-oracle", "dflash", "oracle", "target"):
        s.stop(f"{arch}-{name}")


@pytest.mark.parametrize("name,spec", MODES, ids=[m[0] for m in MODES])
def test_oracle_draft_output_equals_target_only(system, name, spec):
    usages = []
    outs = generate_all(system["gw_oracle"], system["cases"], CONCURRENCY, speculation=spec)
    for case, ref, out in zip(system["cases"], system["references"], outs):
        assert out.tokens == ref.tokens, f"{name} diverged for temperature {case['temperature']}"
        assert out.text == ref.text
        assert out.final.finish_reason == gateway_pb2.LENGTH
        usages.append(out.final.usage)
    # The oracle's drafts must actually be accepted, or this test would prove nothing.
    assert pooled_acceptance_length(usages) > (1.5 if spec.budget > 1 else 1.3)


@pytest.mark.parametrize("name,spec", [MODES[1], MODES[6]], ids=["chain-16", "ddtree-16-seeded"])
def test_dflash_draft_output_equals_target_only(system, name, spec):
    outs = generate_all(system["gw_dflash"], system["cases"], CONCURRENCY, speculation=spec)
    for ref, out in zip(system["references"], outs):
        assert out.tokens == ref.tokens
        assert out.final.usage.draft_fallbacks == 0


@pytest.mark.parametrize("wire", ["stream", "unary"])
@pytest.mark.parametrize("name,spec", [MODES[1], MODES[6]], ids=["chain-16", "ddtree-16-seeded"])
def test_grpc_wires_output_equals_target_only(system, name, spec, wire):
    outs = generate_all(system[f"gw_{wire}"], system["cases"], CONCURRENCY, speculation=spec)
    for ref, out in zip(system["references"], outs):
        assert out.tokens == ref.tokens
        assert out.final.usage.mean_acceptance_length > 1.0 and out.final.usage.draft_fallbacks == 0


def test_no_state_left_behind(system):
    assert live_sequences(system["target"], system["oracle"]) == (0, 0)
    assert live_sequences(system["target"], system["dflash"]) == (0, 0)
