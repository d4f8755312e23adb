"""Training a tiny target from scratch: the held-out loss falls, the GGUF it writes loads with the
same logits and tokenizer, and the target serves with a draft, losslessly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from splitspec.fixtures.tiny import TinySpec, random_draft, write_draft_dir
from splitspec.models.loader import load_target
from splitspec.text.tokenizer import Tokenizer
from splitspec.train import bpe
from splitspec.train.corpus import load_packed
from splitspec.train.target import TargetTrainConfig, train_target

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, seq_len=64,
            batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10, eval_tokens=2048, progress=False)


@pytest.fixture(scope="module")
def trained(small_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("target") / "target.gguf"
    config = TargetTrainConfig(data=small_build.packed, tokenizer=small_build.tokenizer, out=out, max_steps=30, **TINY)
    return config, train_target(config)


def test_training_lowers_the_held_out_loss(trained):
    config, result = trained
    assert result.steps == 30 and result.tokens == 30 * 8 * 64
    assert result.heldout_loss_initial == pytest.approx(np.log(512), abs=0.3)  # a fresh model is near uniform
    assert result.heldout_loss_best < result.heldout_loss_initial - 0.5
    assert result.best_step > 0 and result.heldout_loss_best == min(h["heldout_loss"] for h in result.history if "heldout_loss" in h)
    assert [h["step"] for h in result.history if "heldout_loss" in h] == [0, 10, 20, 30]
    assert result.parameters == sum(p.numel() for p in result.model.parameters())
    assert "model" not in result.to_dict()


def test_same_seed_same_run(small_build, tmp_path):
    runs = [
        train_target(TargetTrainConfig(data=small_build.packed, tokenizer=small_build.tokenizer, out=tmp_path / f"{i}.gguf", max_steps=4, seed=seed, **TINY))
        for i, seed in enumerate((5, 5, 6))
    ]
    losses = [[h.get("train_loss") for h in r.history] for r in runs]
    assert losses[0] == losses[1] != losses[2]
    assert (tmp_path / "0.gguf").read_bytes() == (tmp_path / "1.gguf").read_bytes()


def test_the_gguf_loads_with_the_same_logits_and_tokenizer(trained, small_build):
    config, result = trained
    loaded, dense = load_target(config.out)
    assert (dense.vocab_size, dense.hidden_size, dense.num_layers, dense.max_context) == (512, 64, 2, 64)
    assert dense.tie_word_embeddings and dense.qk_norm and dense.architecture == "qwen3" and dense.rope_theta == 10_000
    _, heldout, _ = load_packed(small_build.packed)
    tokens = torch.from_numpy(heldout[:2 * 64].astype(np.int64)).view(2, 64)
    # The same weights rounded to F16 as the file stores matrices (norms stay F32).
    rounded = copy.deepcopy(result.model)
    rounded.load_state_dict({k: v.half().float() if v.ndim == 2 else v for k, v in result.model.state_dict().items()})
    with torch.no_grad():
        expected = rounded.lm_head(rounded.forward_sequences(tokens)[0])
        got = loaded.lm_head(loaded.forward_sequences(tokens)[0])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    tok = Tokenizer.from_gguf(config.out)
    backend = small_build.backend()
    text = small_build.heldout_texts()[0]
    assert tok.encode(text) == backend.encode(text).ids
    assert tok.eos_token_ids == (backend.token_to_id(bpe.EOT),) and tok.bos_token_id == backend.token_to_id(bpe.EOT)
    assert tok.chat_template is None


@pytest.mark.slow
def test_the_trained_target_serves_with_a_draft(trained, services):
    """``splitspec target`` loads the trained GGUF; with a random DFlash draft using its ``<|mask|>``
    token, every speculation mode gives the target-only tokens."""
    from splitspec.v1 import gateway_pb2
    from tests.client import generate

    config, result = trained
    mask = Tokenizer.from_gguf(config.out).token_to_id(bpe.MASK)
    spec = TinySpec(draft_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
    draft, tensors = random_draft(result.model.config, spec, mask, np.random.default_rng(0))
    draft_dir = config.out.parent / "draft"
    write_draft_dir(draft_dir, draft, tensors, result.model.config.num_layers)
    target = services.start("target", "target", "--model", str(config.out))
    drafter = services.start("draft", "draft", "--model", str(draft_dir), "--target-model", str(config.out))
    gateway = services.start("gateway", "gateway", "--target", target, "--draft", drafter)
    Spec = gateway_pb2.Speculation
    request = {"text": "def parse_args(", "max_tokens": 24, "ignore_eos": True}
    off = generate(gateway, speculation=Spec(mode=Spec.OFF), **request)
    assert len(off.tokens) == 24
    for mode in (Spec.CHAIN, Spec.DDTREE):
        out = generate(gateway, speculation=Spec(mode=mode, budget=8), **request)
        assert out.tokens == off.tokens and out.final.usage.draft_fallbacks == 0
