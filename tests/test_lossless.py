"""Losslessness through the three real services: speculative output == target-only output.

The target runs in float64 so that batching a tree differently from a single token cannot flip a
near-tie. Two drafts are used: the real DFlash draft of the tiny pair (random, so it rarely hits)
and the benchmark/test-only ReplayDrafter, which proposes the recorded target-only output
corrupted at 30% per depth. The replay drives long acceptances, rejections and branch
acceptances through every mode, so equality is tested where it is hard, not only where it is easy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from client import generate, live_sequences
from splitspec.v1 import gateway_pb2

pytestmark = pytest.mark.slow

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


def _cases(vocab: int) -> list[dict]:
    rng = np.random.default_rng(2026)
    cases = []
    for i in range(10):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        for temperature in (0.0, 1.0):
            sampling = {"temperature": temperature, "seed": int(rng.integers(2**63))}
            if i == 9 and temperature:
                sampling.update(top_p=0.9, top_k=20)
            cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 40, "ignore_eos": True, **sampling})
    return cases


@pytest.fixture(scope="module")
def system(module_services, tiny_pair, tmp_path_factory):
    s = module_services
    table = tmp_path_factory.mktemp("replay") / "table.jsonl"
    target = s.start("target", "target", "--model", str(tiny_pair.target), "--dtype", "float64")
    replay = s.start("replay", "draft", "--replay", str(table), "--replay-corruption", "0.3", "--target-model", str(tiny_pair.target))
    dflash = s.start("dflash", "draft", "--model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target))
    gw_replay = s.start("gw-replay", "gateway", "--target", target, "--draft", replay)
    gw_dflash = s.start("gw-dflash", "gateway", "--target", target, "--draft", dflash)
    from splitspec.models.loader import read_target_config

    cases = _cases(read_target_config(tiny_pair.target).vocab_size)
    references = [generate(gw_replay, speculation=Spec(mode=Spec.OFF), **case) for case in cases]
    with table.open("w") as f:
        for case, ref in zip(cases, references):
            assert ref.final.usage.mean_acceptance_length == 1.0 and len(ref.tokens) == 40
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref.tokens}) + "\n")
    return {"target": target, "replay": replay, "dflash": dflash, "gw_replay": gw_replay, "gw_dflash": gw_dflash,
            "cases": cases, "references": references}


@pytest.mark.parametrize("name,spec", MODES, ids=[m[0] for m in MODES])
def test_replay_draft_output_equals_target_only(system, name, spec):
    committed = steps = 0
    for case, ref in zip(system["cases"], system["references"]):
        out = generate(system["gw_replay"], speculation=spec, **case)
        assert out.tokens == ref.tokens, f"{name} diverged for temperature {case['temperature']}"
        assert out.text == ref.text
        assert out.final.finish_reason == gateway_pb2.LENGTH
        committed += out.final.usage.mean_acceptance_length * out.final.usage.steps
        steps += out.final.usage.steps
    # The replayed drafts must actually be accepted, or this test would prove nothing.
    assert committed / steps > (1.5 if spec.budget > 1 else 1.3)


@pytest.mark.parametrize("name,spec", [MODES[1], MODES[6]], ids=["chain-16", "ddtree-16-seeded"])
def test_dflash_draft_output_equals_target_only(system, name, spec):
    for case, ref in zip(system["cases"], system["references"]):
        out = generate(system["gw_dflash"], speculation=spec, **case)
        assert out.tokens == ref.tokens
        assert out.final.usage.draft_fallbacks == 0


def test_no_state_left_behind(system):
    assert live_sequences(system["target"], system["replay"]) == (0, 0)
    assert live_sequences(system["target"], system["dflash"]) == (0, 0)
