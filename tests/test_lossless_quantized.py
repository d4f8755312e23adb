"""Losslessness with ``--keep-quantized`` through the three real services, on the hybrid target.

The target is the tiny Qwen3.5 of ``tests.quantized_fixtures`` (Q4_K, Q5_K, Q6_K, Q8_0 blocks,
tiled value heads), served with its kernel-typed linears and its embedding kept in blocks; the
drafts are the oracle (the recorded target-only output corrupted at 30% per depth, so that long
acceptances, rejections and branches happen) and the fixture's DFlash draft as a Q8_0 GGUF, kept
quantized with the target's embedding and LM head. Speculative output must equal target-only
output in every mode, greedy and seeded; target-only output of the kept-quantized target must
equal that of the same file dequantized. The targets run in float64, as in ``tests/test_lossless.py``,
so that batching a tree differently from a single token cannot flip a near-tie. Last, ``splitspec
serve --keep-quantized`` passes the flag to both workers.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from splitspec.models.loader import load_dflash_draft, load_target, load_target_head, read_target_config
from splitspec.models.quantized import head_summary, kept_summary
from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.v1 import gateway_pb2
from tests.client import generate, generate_all, live_sequences
from tests.quantized_fixtures import make_pair

pytestmark = pytest.mark.slow

Spec = gateway_pb2.Speculation
MODES = [
    ("chain-4", Spec(mode=Spec.CHAIN, budget=4)),
    ("chain-16", Spec(mode=Spec.CHAIN, budget=16)),
    ("ddtree-1", Spec(mode=Spec.DDTREE, budget=1, chain_seed=False)),
    ("ddtree-4", Spec(mode=Spec.DDTREE, budget=4, chain_seed=False)),
    ("ddtree-16-seeded", Spec(mode=Spec.DDTREE, budget=16, chain_seed=True)),
    ("ddtree-64", Spec(mode=Spec.DDTREE, budget=64, chain_seed=False)),
]


def kept_lines(pair) -> tuple[str, str]:
    """The lines the target and draft workers log of what they keep in blocks, as the loaders
    keep it here (which types have kernels is ``native.gguf_matmul.KERNEL_TYPES``'s to say)."""
    target, _, draft_gguf = pair
    model, _ = load_target(target, keep_quantized=True)
    draft, _ = load_dflash_draft(draft_gguf, keep_quantized=True)
    embed, head, _ = load_target_head(target, keep_quantized=True)
    target_line, draft_line = kept_summary(model), f"{kept_summary(draft)}; the target's {head_summary(embed, head)}"
    assert "embedding in blocks (Q4_K)" in target_line and "1 dequantized" in target_line  # the Q5_0 up_proj
    assert draft_line.endswith("0 dequantized; the target's embedding in blocks (Q4_K), LM head in blocks (Q6_K)")
    return f"keep-quantized target: {target_line}", f"keep-quantized draft: {draft_line}"


def _cases(vocab: int) -> list[dict]:
    rng = np.random.default_rng(17)
    cases = []
    for _ in range(4):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        for temperature in (0.0, 1.0):
            sampling = {"temperature": temperature, "seed": int(rng.integers(2**63))}
            cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 32, "ignore_eos": True, **sampling})
    return cases


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("quantized-pair"))


@pytest.fixture(scope="module")
def system(module_services, pair):
    s = module_services
    model, _, draft_gguf = (str(p) for p in pair)
    table = pair[0].parent / "table.jsonl"
    one_thread = ["--threads", "1"]  # two workers spinning all cores of a small CI machine stall each other
    target = s.start("q-target", "target", "--model", model, "--dtype", "float64", "--keep-quantized", *one_thread)
    plain = s.start("plain-target", "target", "--model", model, "--dtype", "float64", *one_thread)
    oracle = s.start("q-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", model)
    dflash = s.start("q-dflash", "draft", "--model", draft_gguf, "--target-model", model, "--keep-quantized", *one_thread)
    gw_oracle = s.start("q-gw-oracle", "gateway", "--target", target, "--draft", oracle)
    gw_dflash = s.start("q-gw-dflash", "gateway", "--target", target, "--draft", dflash)
    gw_plain = s.start("plain-gw", "gateway", "--target", plain, "--draft", "")
    # The norms and activations inside the matmuls' x preparation, by its CPU reference path
    # (native.gguf_mma.produce): the placeholders it returns are NaN, so any reader that is no
    # quantized matmul would show in the output.
    linked = s.start("linked-target", "target", "--model", model, "--dtype", "float64", "--keep-quantized", *one_thread,
                     env={"SPLITSPEC_NATIVE_ON": "gguf_prepare"})
    gw_linked = s.start("linked-gw", "gateway", "--target", linked, "--draft", oracle)
    target_kept, draft_kept = kept_lines(pair)
    assert target_kept in s.log("q-target") and "keep-quantized target:" not in s.log("plain-target")
    assert draft_kept in s.log("q-dflash")
    assert "run inside their quantized matmuls' x preparation" in s.log("linked-target")
    assert "x preparation" not in s.log("q-target")

    cases = _cases(read_target_config(model).vocab_size)
    references = [generate(gw_oracle, speculation=Spec(mode=Spec.OFF), **case) for case in cases]
    with table.open("w") as f:
        for case, ref in zip(cases, references):
            assert ref.final.usage.mean_acceptance_length == 1.0 and len(ref.tokens) == 32
            f.write(json.dumps({"tokens": list(case["tokens"].ids) + ref.tokens}) + "\n")
    yield {"target": target, "oracle": oracle, "dflash": dflash, "gw_oracle": gw_oracle, "gw_dflash": gw_dflash,
           "gw_plain": gw_plain, "linked": linked, "gw_linked": gw_linked, "cases": cases, "references": references}
    for name in ("linked-gw", "linked-target", "plain-gw", "q-gw-dflash", "q-gw-oracle", "q-dflash", "q-oracle", "plain-target", "q-target"):
        s.stop(name)


def test_kept_blocks_decode_as_the_dequantized_file(system):
    """Target-only output of the kept-quantized target is the dequantized target's, token for token."""
    outs = generate_all(system["gw_plain"], system["cases"], 4, speculation=Spec(mode=Spec.OFF))
    for ref, out in zip(system["references"], outs):
        assert out.tokens == ref.tokens


@pytest.mark.parametrize("name,spec", MODES, ids=[m[0] for m in MODES])
def test_oracle_draft_output_equals_target_only(system, name, spec):
    usages = []
    outs = generate_all(system["gw_oracle"], system["cases"], 4, speculation=spec)
    for case, ref, out in zip(system["cases"], system["references"], outs):
        assert out.tokens == ref.tokens, f"{name} diverged for temperature {case['temperature']}"
        usages.append(out.final.usage)
    # The oracle's drafts must actually be accepted, or this test would prove nothing.
    assert pooled_acceptance_length(usages) > (1.5 if spec.budget > 1 else 1.3)


@pytest.mark.parametrize("name,spec", [MODES[1], MODES[4]], ids=["chain-16", "ddtree-16-seeded"])
def test_quantized_dflash_draft_output_equals_target_only(system, name, spec):
    outs = generate_all(system["gw_dflash"], system["cases"], 4, speculation=spec)
    for ref, out in zip(system["references"], outs):
        assert out.tokens == ref.tokens
        assert out.final.usage.draft_fallbacks == 0


@pytest.mark.parametrize("name,spec", [("off", Spec(mode=Spec.OFF)), MODES[1], MODES[4]], ids=["off", "chain-16", "ddtree-16-seeded"])
def test_linked_producers_output_equals_target_only(system, name, spec):
    """A target whose norms and SwiGLU activations run inside the matmuls' x preparation (its CPU
    reference path) serves the same tokens: no reader of their placeholders is anything but a
    quantized matmul, in prefill, decode and tree verify."""
    outs = generate_all(system["gw_linked"], system["cases"], 4, speculation=spec)
    for ref, out in zip(system["references"], outs):
        assert out.tokens == ref.tokens, name


def test_no_state_left_behind(system):
    assert live_sequences(system["target"], system["oracle"]) == (0, 0)
    assert live_sequences(system["target"], system["dflash"]) == (0, 0)
    assert live_sequences(system["linked"], system["oracle"]) == (0, 0)


def test_serve_passes_keep_quantized_to_both_workers(services, pair):
    target, _, draft_gguf = pair
    gateway = services.start(
        "serve", "serve", "--target-model", str(target), "--draft-model", str(draft_gguf), "--keep-quantized", "--dtype", "float64",
    )
    deadline = time.monotonic() + 60
    while "splitspec serve: ready" not in services.log("serve"):
        assert time.monotonic() < deadline, services.log("serve")
        time.sleep(0.2)
    log = services.log("serve")  # the workers log into serve's output
    assert all(line in log for line in kept_lines(pair))
    case = _cases(read_target_config(target).vocab_size)[1]  # seeded sampling
    off = generate(gateway, speculation=Spec(mode=Spec.OFF), **case)
    on = generate(gateway, speculation=Spec(mode=Spec.DDTREE, budget=16, chain_seed=True), **case)
    assert on.tokens == off.tokens and len(off.tokens) == 32
