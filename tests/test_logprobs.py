"""Logprobs through the three real services: every committed token's logprob (and top alternatives)
is the log-softmax of the target's own logits at that position, whatever the speculation mode.

The target runs in float64; the reference runs the same checkpoint directly on the whole sequence
in one pass. An oracle draft (the recorded target-only output, 30% corrupted per depth) makes the
speculative runs accept long paths, reject and take branches, so the bonus and accepted-node rows
of a tree pass are all exercised.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
TOP = 5
MODES = {"off": Spec(mode=Spec.OFF), "chain": Spec(mode=Spec.CHAIN, budget=8), "ddtree": Spec(mode=Spec.DDTREE, budget=8)}


def generate_with_logprobs(address: str, **fields):
    """(token ids, logprobs, final) of one Generate, checking each message's logprobs align with its ids."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tokens, logprobs, final = [], [], None
        for r in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120):
            assert [lp.id for lp in r.logprobs] == (list(r.token_ids) if fields.get("logprobs") else [])
            tokens.extend(r.token_ids)
            logprobs.extend(r.logprobs)
            if r.HasField("final"):
                final = r.final
    return tokens, logprobs, final


@pytest.fixture(scope="module", params=["eager", "fast-path"])
def system(request, module_services, tiny_pair, tmp_path_factory):
    from splitspec.models.loader import load_target, read_target_config

    s, model = module_services, str(tiny_pair.target)
    table = tmp_path_factory.mktemp("logprobs-oracle") / "table.jsonl"
    # The fast path's fixed shapes (pooled KV slot, padded rows; graphs on a GPU) read the same logits.
    fast = ["--fixed-shapes", "on"] if request.param == "fast-path" else []
    target = s.start("lp-target", "target", "--model", model, "--dtype", "float64", "--threads", "1", *fast)
    oracle = s.start("lp-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", model)
    gateway = s.start("lp-gateway", "gateway", "--target", target, "--draft", oracle)
    vocab = read_target_config(model).vocab_size
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(4):
        prompt = rng.integers(0, vocab, int(rng.integers(2, 30))).tolist()
        cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 32, "ignore_eos": True, "temperature": 0.0,
                      "logprobs": True, "top_logprobs": TOP})
    references = [generate_with_logprobs(gateway, speculation=MODES["off"], **case) for case in cases]
    with table.open("w") as f:
        for case, (tokens, _, _) in zip(cases, references):
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + tokens}) + "\n")
    target_model, _ = load_target(model, dtype=torch.float64)
    yield {"gateway": gateway, "cases": cases, "references": references, "model": target_model}
    for name in ("lp-gateway", "lp-oracle", "lp-target"):
        s.stop(name)


def direct_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every generated token's position [len(generated), vocab],
    from one pass over prompt + generated[:-1] (greedy: temperature 0, the raw logits)."""
    ids = prompt + generated[:-1]
    n = len(ids)
    cache = model.new_cache(n, "cpu", torch.float64)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    with torch.no_grad():
        logits, _ = model(torch.tensor(ids), torch.arange(n), cache, 0, mask)
    return torch.log_softmax(logits[len(prompt) - 1 :].to(torch.float64), dim=-1)


@pytest.mark.parametrize("mode", list(MODES))
def test_logprobs_are_the_targets_distribution(system, mode):
    accepted = []
    for case, (ref_tokens, ref_logprobs, _) in zip(system["cases"], system["references"]):
        tokens, logprobs, final = generate_with_logprobs(system["gateway"], speculation=MODES[mode], **case)
        assert tokens == ref_tokens and len(tokens) == 32
        accepted.append(final.usage.mean_acceptance_length)
        direct = direct_logprobs(system["model"], list(case["tokens"].ids), tokens)
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            assert lp.id == token
            assert lp.logprob == pytest.approx(direct[i, token].item(), abs=1e-9), (mode, i)
            assert direct[i].argmax().item() == token  # greedy
            assert len(lp.top) == TOP
            assert [t.id for t in lp.top][0] == token
            for t in lp.top:
                assert t.logprob == pytest.approx(direct[i, t.id].item(), abs=1e-9)
            top_ref = torch.topk(direct[i], TOP).values.tolist()
            assert [t.logprob for t in lp.top] == pytest.approx(top_ref, abs=1e-9)
        # Speculative and target-only runs report the same logprobs.
        assert [(lp.id, [t.id for t in lp.top]) for lp in logprobs] == [(lp.id, [t.id for t in lp.top]) for lp in ref_logprobs]
        assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in ref_logprobs], abs=1e-9)
    if mode != "off":
        assert np.mean(accepted) > 1.3  # the oracle's drafts were accepted: tree rows were exercised


def test_logprobs_follow_held_back_tokens(system):
    """A stop string holds text (and its tokens) back; the logprobs sent stay aligned with the ids sent."""
    case, (ref_tokens, ref_logprobs, _) = system["cases"][0], system["references"][0]
    from tests.client import generate

    text = generate(system["gateway"], **{k: v for k, v in case.items() if k not in ("logprobs", "top_logprobs")}).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop:
        pytest.skip("no text to stop on")
    tokens, logprobs, final = generate_with_logprobs(system["gateway"], speculation=MODES["ddtree"], stop=[stop], **case)
    assert final.finish_reason == gateway_pb2.STOP
    assert tokens == ref_tokens[: len(tokens)]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in ref_logprobs[: len(tokens)]], abs=1e-9)


def test_logprobs_off_by_default_and_bounded(system):
    case = {k: v for k, v in system["cases"][0].items() if k not in ("logprobs", "top_logprobs")}
    tokens, logprobs, _ = generate_with_logprobs(system["gateway"], speculation=MODES["ddtree"], **case)
    assert tokens and not logprobs
    with pytest.raises(grpc.RpcError) as info:
        generate_with_logprobs(system["gateway"], logprobs=True, top_logprobs=21, **case)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in info.value.details()
