"""Every target architecture and format through the three real services: lossless, and chat.

llama: a Q8_0 GGUF (q/k rows permuted as llama.cpp stores them) with a GGUF DFlash draft.
qwen2: a Hugging Face directory (sharded safetensors, tied embeddings, q/k/v biases, tokenizer.json)
with a z-lab DFlash draft directory. (qwen3 GGUF is tests/test_lossless.py.) Each is checked with
its DFlash draft and with the oracle drafter, which makes long acceptances happen; the target runs
in float64 so that tree batching cannot flip a near-tie.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from splitspec.fixtures.gguf_writing import CHATML_TEMPLATE
from splitspec.fixtures.tiny import TinySpec, make_tiny, random_draft, write_draft_dir, write_draft_gguf
from splitspec.models.dflash import DFlashConfig
from splitspec.models.loader import read_target_config
from splitspec.spec.acceptance_length import pooled_acceptance_length
from splitspec.text.chat import ChatTemplate
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab, write_gguf_tokenizer
from splitspec.v1 import gateway_pb2
from tests.client import generate, generate_all, live_sequences
from tests.dense_fixtures import hf_model
from tests.tools import write_gguf

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
Spec = gateway_pb2.Speculation
MODES = [Spec(mode=Spec.DDTREE, budget=16, chain_seed=True), Spec(mode=Spec.CHAIN, budget=8)]


def _llama(out):
    target, draft_dir = make_tiny(out, TinySpec(architecture="llama", seed=2), weight_type="q8_0")
    config = DFlashConfig.from_dict(json.loads((draft_dir / "config.json").read_text()))
    write_draft_gguf(out / "draft.gguf", config, load_file(str(draft_dir / "model.safetensors")), "q8_0")
    return target, out / "draft.gguf"


def _qwen2(out):
    vocab = byte_level_vocab("def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 4, num_merges=40)
    write_gguf(out / "tok.gguf", lambda w: write_gguf_tokenizer(w, vocab, chat_template=CHATML_TEMPLATE))
    target = out / "qwen2"
    transformers.AutoTokenizer.from_pretrained(out, gguf_file="tok.gguf").save_pretrained(target)
    hf_model("qwen2", tie=True, layers=3, seed=3, vocab_size=len(vocab.tokens)).save_pretrained(target, max_shard_size="500KB")
    assert (target / "model.safetensors.index.json").exists()
    config = read_target_config(target)
    draft, tensors = random_draft(config, TinySpec(num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256),
                                  vocab.special_ids["<|mask|>"], np.random.default_rng(4))
    draft_dir = out / "draft"
    write_draft_dir(draft_dir, draft, tensors, config.num_layers)
    return target, draft_dir


def _cases(vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(7)
    cases = []
    for _ in range(3):
        prompt = rng.integers(0, vocab_size, int(rng.integers(2, 20))).tolist()
        for temperature in (0.0, 1.0):
            cases.append({"tokens": gateway_pb2.TokenIds(ids=prompt), "max_tokens": 24, "ignore_eos": True,
                          "temperature": temperature, "seed": int(rng.integers(2**63))})
    return cases


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def system(request, module_services, tmp_path_factory):
    s = module_services
    s.stop_all()  # one architecture's processes at a time
    out = tmp_path_factory.mktemp(request.param)
    target_path, draft_path = (_llama if request.param == "llama" else _qwen2)(out)
    name = request.param
    target = s.start(f"{name}-target", "target", "--model", str(target_path), "--dtype", "float64", "--threads", "1")
    dflash = s.start(f"{name}-dflash", "draft", "--model", str(draft_path), "--target-model", str(target_path), "--threads", "1")
    table = out / "table.jsonl"
    oracle = s.start(f"{name}-oracle", "oracle-draft", "--table", str(table), "--corruption", "0.3", "--target-model", str(target_path))
    gw_dflash = s.start(f"{name}-gw-dflash", "gateway", "--target", target, "--draft", dflash)
    gw_oracle = s.start(f"{name}-gw-oracle", "gateway", "--target", target, "--draft", oracle)
    cases = _cases(read_target_config(target_path).vocab_size)
    references = [generate(gw_dflash, speculation=Spec(mode=Spec.OFF), **case) for case in cases]
    table.write_text("".join(json.dumps({"tokens": list(c["tokens"].ids) + r.tokens}) + "\n" for c, r in zip(cases, references)))
    return {"name": name, "target_path": target_path, "target": target, "dflash": dflash, "oracle": oracle,
            "gw_dflash": gw_dflash, "gw_oracle": gw_oracle, "cases": cases, "references": references}


@pytest.mark.parametrize("spec", MODES, ids=["ddtree-16-seeded", "chain-8"])
@pytest.mark.parametrize("drafter", ["gw_dflash", "gw_oracle"])
def test_speculative_output_equals_target_only(system, spec, drafter):
    usages = []
    outs = generate_all(system[drafter], system["cases"], 4, speculation=spec)  # lone and batched passes
    for case, ref, out in zip(system["cases"], system["references"], outs):
        assert len(ref.tokens) == 24
        assert out.tokens == ref.tokens, f"{system['name']} {drafter} diverged at temperature {case['temperature']}"
        assert out.final.usage.draft_fallbacks == 0
        usages.append(out.final.usage)
    if drafter == "gw_oracle":  # the oracle's drafts must be accepted, or equality proves little
        assert pooled_acceptance_length(usages) > 1.5


def test_chat_messages_use_the_models_template(system):
    tokenizer = Tokenizer.load(system["target_path"])
    messages = [("system", "You are terse."), ("user", "def fib(n):")]
    rendered = ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens).render([{"role": r, "content": c} for r, c in messages])
    chat = gateway_pb2.Messages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages])
    via_chat = generate(system["gw_dflash"], messages=chat, max_tokens=12, ignore_eos=True)
    via_tokens = generate(system["gw_dflash"], tokens=gateway_pb2.TokenIds(ids=tokenizer.encode(rendered, add_special_tokens=False)),
                          max_tokens=12, ignore_eos=True)
    assert via_chat.tokens == via_tokens.tokens and via_chat.final.usage.prompt_tokens == via_tokens.final.usage.prompt_tokens
    assert rendered.endswith("<|im_start|>assistant\n")
    no_header = generate(system["gw_dflash"], messages=chat, add_generation_prompt=False, max_tokens=1, ignore_eos=True)
    assert no_header.final.usage.prompt_tokens < via_chat.final.usage.prompt_tokens
    cli = subprocess.run(
        [sys.executable, "-m", "splitspec", "generate", "def fib(n):", "--chat", "--system", "You are terse.",
         "--address", system["gw_dflash"], "--max-tokens", "12", "--ignore-eos"],
        capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.rstrip("\n") == via_chat.text.rstrip("\n")


def test_no_state_left_behind(system):
    assert live_sequences(system["target"], system["dflash"]) == (0, 0)
    assert live_sequences(system["target"], system["oracle"]) == (0, 0)
