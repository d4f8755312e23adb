"""Draft training: the training pass equals the inference pass, training learns, resume is exact,
and the written draft loads and serves losslessly through the real services."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_target, write_target_gguf
from splitspec.models.dflash import DFlashDraft
from splitspec.models.loader import check_draft_fits, load_dflash_draft, load_target, read_target_config
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab
from splitspec.train.draft import (
    DraftTrainConfig,
    block_hidden,
    cached_target_pass,
    draft_config_for,
    make_blocks,
    target_pass,
    train_draft,
)


def serve_pair(services, target, draft) -> str:
    """A float64 target, ``draft`` and a gateway over them, started; the gateway's address."""
    t = services.start("target", "target", "--model", str(target), "--dtype", "float64", "--threads", "1")
    d = services.start("draft", "draft", "--model", str(draft), "--target-model", str(target), "--threads", "1")
    return services.start("gateway", "gateway", "--target", t, "--draft", d)


def _config(target, data, out, **overrides) -> DraftTrainConfig:
    fields = dict(target=str(target), data=[str(data)], out=str(out), seq_len=64, anchors=16, batch_size=4, steps=6,
                  eval_every=100, eval_sequences=4, heldout_fraction=0.2, taps=(1, 2, 3), device="cpu", lr=3e-3)
    return DraftTrainConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def trained(looping, tmp_path_factory):
    target, data = looping
    out = tmp_path_factory.mktemp("trained")
    return target, train_draft(_config(target, data, out, steps=40, eval_every=10))


def test_training_blocks_equal_inference_blocks(tiny_pair):
    """Pins the mask: each block of the batched training pass equals the inference pass over the
    features strictly before its anchor (``context_kv`` + ``forward``)."""
    target, target_config = load_target(tiny_pair.target)
    tokenizer = Tokenizer.load(tiny_pair.target)
    config = draft_config_for(target_config, tokenizer, DraftTrainConfig(str(tiny_pair.target), ["-"], "-", taps=(1, 3), block_size=8))
    torch.manual_seed(0)
    draft = DFlashDraft(config)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 30), generator=g)
    anchors = torch.tensor([[1, 9, 17, 28], [3, 4, 20, 27]])  # blocks that overlap, and ones that run past the end
    features, _ = target_pass(target, tokens, config.target_layer_ids, greedy=False)
    blocks = make_blocks(tokens, anchors, 8, config.mask_token_id, 7.0)
    head = target.lm_head.weight
    with torch.no_grad():
        logits = F.linear(block_hidden(draft, target.embed_tokens, blocks, features), head)  # [N, Q, vocab]
    for n in range(2):
        for i, a in enumerate(anchors[n].tolist()):
            rows = slice(8 * i, 8 * (i + 1))
            context = draft.context_kv(features[n, :a], torch.arange(a))
            noise = target.embed_tokens(blocks.tokens[n, rows])
            with torch.no_grad():
                expected = F.linear(draft(noise, a + torch.arange(8), context), head)
            torch.testing.assert_close(logits[n, rows], expected, atol=1e-5, rtol=1e-5)


def test_blocks_inputs_labels_and_weights():
    tokens = torch.arange(100, 110)[None]  # [1, 10]
    blocks = make_blocks(tokens, torch.tensor([[2, 7]]), 4, 99, 7.0)
    assert blocks.tokens.tolist() == [[102, 99, 99, 99, 107, 99, 99, 99]]
    assert blocks.positions.tolist() == [[2, 3, 4, 5, 7, 8, 9, 10]]
    assert blocks.labels[0, :7].tolist() == [102, 103, 104, 105, 107, 108, 109]
    w = np.exp(-1 / 7)
    np.testing.assert_allclose(blocks.weights[0].numpy(), [0, 1, w, w * w, 0, 1, w, 0], rtol=1e-6)  # row 0 and past the end: 0
    mask = blocks.mask[0]  # [8, 10 + 8]
    assert mask[1, :10].tolist() == [True, True] + [False] * 8  # context strictly before anchor 2
    assert mask[5, :10].tolist() == [True] * 7 + [False] * 3
    assert mask[1, 10:].tolist() == [True] * 4 + [False] * 4 and mask[6, 10:].tolist() == [False] * 4 + [True] * 4


def test_blocks_take_labels_from_label_tokens():
    tokens = torch.arange(100, 110)[None]
    blocks = make_blocks(tokens, torch.tensor([[2]]), 4, 99, 7.0, label_tokens=tokens + 1000)
    assert blocks.tokens.tolist() == [[102, 99, 99, 99]]  # inputs still come from the text
    assert blocks.labels.tolist() == [[1102, 1103, 1104, 1105]]


def test_self_distillation_learns_the_targets_own_tokens(looping, tmp_path):
    """--labels target: rows learn the target's greedy tokens, which the acceptance estimate counts."""
    target, data = looping
    result = train_draft(_config(target, data, tmp_path / "distilled", steps=40, eval_every=10, labels="target"))
    assert np.mean(result.losses[-10:]) < np.mean(result.losses[:10]) - 1.0
    assert result.heldout_acceptance > result.evals[0]["acceptance"]
    with pytest.raises(ValueError, match="--labels 'teacher'"):
        train_draft(_config(target, data, tmp_path / "bad", labels="teacher"))


def test_cached_fallback_equals_batched_target_pass(tiny_pair):
    """The per-sequence path that hybrid targets train through gives what the batched one gives."""
    target, _ = load_target(tiny_pair.target)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    features, greedy = target_pass(target, tokens, (1, 3), greedy=True)
    cached_features, cached_greedy = cached_target_pass(target, tokens, (1, 3), greedy=True)
    torch.testing.assert_close(cached_features, features, atol=1e-5, rtol=1e-5)
    assert torch.equal(cached_greedy, greedy)
    assert cached_target_pass(target, tokens, (1, 3), greedy=False)[1] is None


def test_training_lowers_loss_and_raises_acceptance(trained):
    _, result = trained
    losses = result.losses
    assert len(losses) == 40 and [e["step"] for e in result.evals] == [10, 20, 30, 40]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0
    assert result.evals[-1]["heldout_loss"] < result.evals[0]["heldout_loss"]
    assert result.heldout_acceptance > result.evals[0]["acceptance"] + 0.05
    assert 1.0 <= result.evals[0]["acceptance"] <= result.heldout_acceptance <= 16
    log = json.loads((result.out_dir / "train_log.json").read_text())
    assert log["losses"] == losses and log["heldout_acceptance"] == result.heldout_acceptance and log["finished"]
    assert log["config"]["taps"] == [1, 2, 3] and log["data"]["heldout_documents"] >= 1


def test_resume_continues_exactly(looping, tmp_path):
    target, data = looping
    straight = train_draft(_config(target, data, tmp_path / "straight"))
    first = train_draft(_config(target, data, tmp_path / "split", stop_at=3, checkpoint_every=100))
    assert first.step == 3 and (tmp_path / "split" / "checkpoint.pt").is_file()
    assert not json.loads((tmp_path / "split" / "train_log.json").read_text())["finished"]
    second = train_draft(_config(target, data, tmp_path / "split", resume=True))
    assert second.step == 6 and second.losses == straight.losses
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"--resume: .*checkpoint.pt was written with other settings: lr 0.003 -> 0.001"):
        train_draft(_config(target, data, tmp_path / "split", resume=True, lr=1e-3))
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint at"):
        train_draft(_config(target, data, tmp_path / "straight", resume=True))


def test_init_starts_from_a_written_draft(trained, looping, tmp_path):
    """``init`` loads a finished run's weights (a second schedule, or fine-tuning): with a vanishing
    learning rate the run writes them back unchanged and evaluates as the finished run did."""
    target, data = looping
    _, done = trained
    again = train_draft(_config(target, data, tmp_path / "again", steps=2, eval_every=1, lr=1e-12, init=str(done.out_dir)))
    a, b = load_file(done.out_dir / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = train_draft(_config(target, data, tmp_path / "fresh", steps=1, eval_every=1, lr=1e-12))
    assert abs(again.evals[0]["heldout_loss"] - done.heldout_loss) < 0.05 < fresh.evals[0]["heldout_loss"] - done.heldout_loss
    with pytest.raises(ValueError, match=r"--init .*: that draft differs from the one these settings build: block_size 16 -> 8"):
        train_draft(_config(target, data, tmp_path / "other", block_size=8, init=str(done.out_dir)))
    with pytest.raises(ValueError, match=r"--init .*nowhere: not a readable draft directory"):
        train_draft(_config(target, data, tmp_path / "other", init=str(tmp_path / "nowhere")))


def test_trains_a_hybrid_target(tiny_qwen35_pair, looping, tmp_path):
    _, data = looping
    result = train_draft(_config(tiny_qwen35_pair.target, data, tmp_path, steps=2, taps=None, eval_sequences=1))
    draft, config = load_dflash_draft(result.out_dir)
    check_draft_fits(config, read_target_config(tiny_qwen35_pair.target), str(result.out_dir), str(tiny_qwen35_pair.target))
    assert config.target_layer_ids == (1, 1)  # DFlash's default taps for 4 target layers and 2 draft layers


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(seq_len=16), "--seq-len 16 is too short for a block of 16: needs at least 17"),
        (dict(taps=(1, 9)), r"--taps \[1, 9\]: layers \[9\] do not exist \(the target has layers 0..3\)"),
        (dict(mask_token_id=5000), "--mask-token-id 5000: outside the target vocabulary of 260"),
        (dict(stop_at=9), "--stop-at 9: must be between 1 and --steps 6"),
        (dict(anchors=0), "--anchors 0: must be at least 1"),
    ],
)
def test_bad_settings_name_the_flag(looping, tmp_path, overrides, message):
    target, data = looping
    with pytest.raises(ValueError, match=message):
        train_draft(_config(target, data, tmp_path, **overrides))


def test_a_tokenizer_without_mask_token_asks_for_the_flag(looping, tmp_path):
    vocab = byte_level_vocab(special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    config, state = random_target(TinySpec(), len(vocab.tokens), np.random.default_rng(0))
    write_target_gguf(tmp_path / "nomask.gguf", config, gguf_weights(config, state), vocab)
    with pytest.raises(ValueError, match=r"nomask.gguf: the tokenizer has no <\|mask\|> token; pass --mask-token-id"):
        train_draft(_config(tmp_path / "nomask.gguf", looping[1], tmp_path / "out"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitspec", "train-draft", *args], capture_output=True, text=True, timeout=120)


def test_cli_trains_and_writes_a_loadable_draft(tiny_pair, looping, tmp_path):
    out = tmp_path / "draft"
    proc = _cli(str(tiny_pair.target), str(looping[1]), "--out", str(out), "--device", "cpu", "--steps", "3",
                "--seq-len", "32", "--anchors", "8", "--eval-every", "2", "--eval-sequences", "2", "--layers", "1", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} after step 3: held-out loss" in proc.stdout
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["losses"]) == 3 and [e["step"] for e in log["evals"]] == [2, 3]
    draft, config = load_dflash_draft(out)
    assert config.num_layers == 1 and config.target_layer_ids == (2,) and config.block_size == 16


def test_cli_bad_input_is_one_clear_line(tiny_pair, tmp_path):
    proc = _cli(str(tiny_pair.target), str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out"), "--device", "cpu", "--threads", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(f"splitspec train-draft: {tmp_path / 'missing.txt'}: no such file or directory")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_trained_draft_serves_losslessly(trained, services):
    from splitspec.spec.acceptance_length import pooled_acceptance_length
    from splitspec.v1 import gateway_pb2
    from tests.client import generate

    target, result = trained
    draft, config = load_dflash_draft(result.out_dir)
    check_draft_fits(config, read_target_config(target), str(result.out_dir), str(target))
    gw = serve_pair(services, target, result.out_dir)
    spec = gateway_pb2.Speculation
    usages = []
    for prompt in ("G4G4G", "p\\P8", "+++", "hello"):
        request = dict(text=prompt, max_tokens=48, ignore_eos=True)
        reference = generate(gw, speculation=spec(mode=spec.OFF), **request)
        for mode in (spec(mode=spec.CHAIN, budget=15), spec(mode=spec.DDTREE, budget=16, chain_seed=True)):
            out = generate(gw, speculation=mode, **request)
            assert out.tokens == reference.tokens and out.final.usage.draft_fallbacks == 0
            usages.append(out.final.usage)
    assert pooled_acceptance_length(usages) > 1.1  # the trained draft is right some of the time (1.31 when written)
