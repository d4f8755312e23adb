"""Losslessness with DFlash2 drafts through the three real services: speculative output == target-only.

A DFlash2 draft's candidates are chained by its selector's walk (greedy, or sampled under
temperature) and grown into DDTrees over its pair-score lattice (``splitspec.spec.lattice``), or,
asked for, by each depth's log-probabilities alone. Verification is the target's, so every mode
must give the target's own tokens. Two drafts: a random DFlash2 draft of the tiny pair (sliding
window 32, so long prompts cross it; random, so it rarely hits) and the benchmark/test-only
OracleDrafter answering as a DFlash2 draft (``--selector``: pair scores favouring the recorded
path), which drives long acceptances and makes lattice trees differ from independent ones.
Targets in float64, dense Qwen3 and the Qwen3.5 hybrid.
"""

from __future__ import annotations

import json

import pytest

from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.v1 import gateway_pb2
from tests.client import generate, generate_all, live_sequences
from tests.test_lossless import lossless_cases

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
MODES = [
    ("chain-4", Spec(mode=Spec.CHAIN, budget=4)),
    ("chain-15", Spec(mode=Spec.CHAIN, budget=15)),
    ("ddtree-4", Spec(mode=Spec.DDTREE, budget=4, chain_seed=False)),
    ("ddtree-16", Spec(mode=Spec.DDTREE, budget=16, chain_seed=False)),
    ("ddtree-16-seeded", Spec(mode=Spec.DDTREE, budget=16, chain_seed=True)),
    ("ddtree-16-independent", Spec(mode=Spec.DDTREE, budget=16, chain_seed=False, scores=Spec.INDEPENDENT)),
    ("chain-15-independent", Spec(mode=Spec.CHAIN, budget=15, scores=Spec.INDEPENDENT)),
]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def system(request, module_services, tmp_path_factory):
    from splitspec.models.loader import read_target_config

    s, arch = module_services, request.param
    target_path, draft_path = make_tiny(tmp_path_factory.mktemp(f"dflash2-{arch}"), TinySpec(architecture=arch, seed=1, draft_arch="dflash2"))
    model = str(target_path)
    table = tmp_path_factory.mktemp(f"oracle2-{arch}") / "table.jsonl"
    target = s.start(f"d2-{arch}-target", "target", "--model", model, "--dtype", "float64", "--threads", "1")
    oracle = s.start(f"d2-{arch}-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--selector", "--target-model", model)
    dflash2 = s.start(f"d2-{arch}-dflash2", "draft", "--model", str(draft_path), "--target-model", model, "--threads", "1")
    gw_oracle = s.start(f"d2-{arch}-gw-oracle", "gateway", "--target", target, "--draft", oracle)
    gw_dflash2 = s.start(f"d2-{arch}-gw-dflash2", "gateway", "--target", target, "--draft", dflash2)
    cases = lossless_cases(read_target_config(model).vocab_size, prompts=4, seed=2027, longest=45)
    references = [generate(gw_oracle, speculation=Spec(mode=Spec.OFF), **case) for case in cases]
    with table.open("w") as f:
        for case, ref in zip(cases, references):
            assert ref.final.usage.mean_acceptance_length == 1.0 and len(ref.tokens) == 40
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref.tokens}) + "\n")
    yield {"target": target, "oracle": oracle, "dflash2": dflash2, "gw_oracle": gw_oracle, "gw_dflash2": gw_dflash2,
           "cases": cases, "references": references, "log": s.log(f"d2-{arch}-dflash2")}
    for name in ("gw-dflash2", "gw-oracle", "dflash2", "oracle", "target"):
        s.stop(f"d2-{arch}-{name}")


def _run(system, gateway: str, spec) -> list:
    usages = []
    outs = generate_all(system[gateway], system["cases"], 4, speculation=spec)  # lone and batched passes
    for case, ref, out in zip(system["cases"], system["references"], outs):
        assert out.tokens == ref.tokens, f"diverged at temperature {case['temperature']}"
        assert out.final.finish_reason == gateway_pb2.LENGTH and out.final.usage.draft_fallbacks == 0
        usages.append(out.final.usage)
    return usages


@pytest.mark.parametrize("name,spec", MODES, ids=[m[0] for m in MODES])
def test_oracle_selector_output_equals_target_only(system, name, spec):
    usages = _run(system, "gw_oracle", spec)
    assert pooled_acceptance_length(usages) > 1.5  # the drafts are accepted, or this would prove little


def test_the_lattice_finds_what_independent_scores_miss(system):
    """The oracle's selector knows each corrupted depth's true token when it is still a candidate: its
    walk and its lattice trees accept more than the top-1 chain and the independent trees."""
    al = {name: pooled_acceptance_length(_run(system, "gw_oracle", spec)) for name, spec in MODES if "15" in name or "ddtree-16" in name}
    assert al["chain-15"] > al["chain-15-independent"] + 0.5
    assert al["ddtree-16"] > al["ddtree-16-independent"]


@pytest.mark.parametrize("name,spec", [MODES[1], MODES[3], MODES[5]], ids=["chain-15", "ddtree-16", "ddtree-16-independent"])
def test_dflash2_draft_output_equals_target_only(system, name, spec):
    _run(system, "gw_dflash2", spec)


def test_no_state_left_behind(system):
    assert live_sequences(system["target"], system["oracle"]) == (0, 0)
    assert live_sequences(system["target"], system["dflash2"]) == (0, 0)
