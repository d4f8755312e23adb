"""DFlash2 draft training: the training pass equals the inference pass under a sliding window, the
selector loss is its definition, and a trained DFlash2 draft learns, loads and serves losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from splitspec.models.dflash2 import DFlash2Draft, init_dflash2_extras
from splitspec.models.loader import check_draft_fits, load_dflash_draft, load_target, read_target_config
from splitspec.text.tokenizer import Tokenizer
from splitspec.train.draft import DraftTrainConfig, block_hidden, draft_config_for, make_blocks, target_pass, train_draft
from splitspec.train.selector import selector_loss_sum, walked_tokens
from tests.train.test_draft import _config, serve_pair

DFLASH2 = dict(arch="dflash2", selector_top_k=8, selector_rank=16, conv_group_size=8)


def _draft(tiny_pair, window: int = 0, block: int = 8, strength: float = 0.1):
    target, target_config = load_target(tiny_pair.target)
    tokenizer = Tokenizer.load(tiny_pair.target)
    settings = DraftTrainConfig(str(tiny_pair.target), ["-"], "-", taps=(1, 3), block_size=block, sliding_window=window, **DFLASH2)
    config = draft_config_for(target_config, tokenizer, settings)
    torch.manual_seed(0)
    draft = DFlash2Draft(config)
    init_dflash2_extras(draft)
    with torch.no_grad():  # away from the identity start, so the convolutions and the selector count
        for name, p in draft.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn_like(p) * strength)
    return target, config, draft


def test_training_blocks_equal_inference_blocks_under_the_window(tiny_pair):
    target, config, draft = _draft(tiny_pair, window=12)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 40), generator=g)
    anchors = torch.tensor([[1, 9, 20, 37], [3, 4, 25, 33]])  # early anchors, overlapping blocks, ones past the window
    features, _ = target_pass(target, tokens, config.target_layer_ids, greedy=False)
    blocks = make_blocks(tokens, anchors, 8, config.mask_token_id, 7.0, window=12)
    with torch.no_grad():
        hidden = block_hidden(draft, target.embed_tokens, blocks, features)  # [N, Q, H]
    for n in range(2):
        for i, a in enumerate(anchors[n].tolist()):
            rows = slice(8 * i, 8 * (i + 1))
            first = max(0, a - 11)  # the inference engine keeps window - 1 rows; the mask hides more per row
            context = draft.context_kv(features[n, first:a], torch.arange(first, a))
            expected = draft(target.embed_tokens(blocks.tokens[n, rows]), a + torch.arange(8), context)
            torch.testing.assert_close(hidden[n, rows], expected, atol=1e-5, rtol=1e-5)


def test_the_selector_loss_is_its_definition(tiny_pair):
    target, config, draft = _draft(tiny_pair, strength=1.0)  # pair terms as large as the logits
    head = target.lm_head.weight
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 16, config.hidden_size, generator=g)
    labels = torch.randint(0, 256, (2, 16), generator=g)
    inputs = torch.randint(0, 256, (2, 16), generator=g)
    weights = torch.rand(2, 16, generator=g) * (torch.arange(16) % 8 != 0)
    weights[1, 12:] = 0  # past a sequence's end
    total, weight = selector_loss_sum(draft, hidden, head, labels, weights, inputs)
    s = draft.candidate_selector
    with torch.no_grad():
        want_total = _reference_selector_loss(s, hidden, head, labels, weights, inputs)
    assert abs(total.item() - want_total) < 1e-5 * max(1.0, want_total) and abs(weight.item() - weights.sum().item()) < 1e-6
    total.backward()  # the loss reaches the selector's parameters
    assert s.successor_codebook.grad.abs().sum() > 0 and s.hidden_projection.weight.grad.abs().sum() > 0


def _reference_selector_loss(s, hidden, head, labels, weights, inputs) -> float:
    """Σ w·CE by the definition, one row at a time."""
    want_total = 0.0
    for n in range(2):
        for q in range(16):
            if weights[n, q] == 0:
                continue
            h = hidden[n, q]
            logits = head @ h
            cands = logits.topk(8).indices.tolist()
            gold = int(labels[n, q])
            if gold not in cands:
                cands[-1] = gold
            before = int(inputs[n, q - 1]) if q % 8 == 1 else int(labels[n, q - 1])
            gate = s.hidden_projection.weight @ h
            scores = torch.stack([logits[b] + (s.predecessor_codebook[before] * gate * s.successor_codebook[b]).sum() for b in cands])
            want_total += float(weights[n, q]) * float(F.cross_entropy(scores[None], torch.tensor([cands.index(gold)])))
    return want_total


def test_the_walk_follows_the_pair_scores(tiny_pair):
    target, config, draft = _draft(tiny_pair)
    head = target.lm_head.weight
    hidden = torch.randn(1, 2, 8, config.hidden_size, generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[5, 9]])
    drafted = walked_tokens(draft, hidden, head, anchors)
    for a in range(2):
        h = hidden[0, a]
        cands = (h[1:] @ head.T).topk(8).indices  # [L, K]
        unary = (h[1:] @ head.T).gather(1, cands)
        with torch.inference_mode():
            pairs = draft.candidate_selector.pair_scores(h[1:], unary, cands, anchors[0, a])
        index, want = 0, []
        for t in range(7):
            index = int(pairs[t, index].argmax())
            want.append(int(cands[t, index]))
        assert drafted[0, a, 1:].tolist() == want


def test_a_dflash2_draft_trains_loads_and_serves(looping, tmp_path, services):
    from splitspec.spec.acceptance_length import pooled_acceptance_length
    from splitspec.v1 import gateway_pb2
    from tests.client import generate

    target, data = looping
    result = train_draft(_config(target, data, tmp_path / "d2", steps=40, eval_every=10, sliding_window=48, **DFLASH2))
    assert np.mean(result.losses[-10:]) < np.mean(result.losses[:10]) - 1.0
    assert result.heldout_acceptance > result.evals[0]["acceptance"] + 0.05
    assert all("acceptance_top1" in e for e in result.evals)
    draft, config = load_dflash_draft(result.out_dir)
    assert isinstance(draft, DFlash2Draft) and config.selector_top_k == 8 and config.sliding_window == 48
    check_draft_fits(config, read_target_config(target), str(result.out_dir), str(target))
    gw = serve_pair(services, target, result.out_dir)
    spec = gateway_pb2.Speculation
    usages = []
    for prompt in ("G4G4G", "+++"):
        request = dict(text=prompt, max_tokens=40, ignore_eos=True)
        reference = generate(gw, speculation=spec(mode=spec.OFF), **request)
        for mode in (spec(mode=spec.CHAIN, budget=7), spec(mode=spec.DDTREE, budget=16)):
            out = generate(gw, speculation=mode, **request)
            assert out.tokens == reference.tokens and out.final.usage.draft_fallbacks == 0
            usages.append(out.final.usage)
    assert pooled_acceptance_length(usages) > 1.1


@pytest.mark.parametrize("overrides,message", [
    (dict(conv_group_size=7), "conv_group_size 7 does not divide hidden_size 64"),
    (dict(sliding_window=4), "sliding_window 4 is shorter than the block"),
    (dict(arch="eagle"), "--arch 'eagle': choose dflash or dflash2"),
])
def test_bad_dflash2_settings_are_named(looping, tmp_path, overrides, message):
    target, data = looping
    with pytest.raises(ValueError, match=message):
        train_draft(_config(target, data, tmp_path, **{**DFLASH2, **overrides}))


def test_gradients_reach_every_parameter_with_the_kernels_on(tiny_pair, monkeypatch):
    """The kernels have no backward: where training records a call the reference runs, so the
    gradients with kernels on (as on a GPU; here Triton's interpreter) are the references'."""
    target, config, draft = _draft(tiny_pair, window=12)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (1, 24), generator=g)
    features, _ = target_pass(target, tokens, config.target_layer_ids, greedy=False)
    blocks = make_blocks(tokens, torch.tensor([[2, 13]]), 8, config.mask_token_id, 7.0, window=12)
    grads = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        draft.zero_grad(set_to_none=True)
        hidden = block_hidden(draft, target.embed_tokens, blocks, features)
        total, weight = selector_loss_sum(draft, hidden, target.lm_head.weight, blocks.labels, blocks.weights, blocks.tokens)
        (total / weight + hidden.square().mean()).backward()
        grads.append({name: p.grad for name, p in draft.named_parameters()})
    kernels, reference = grads
    assert all(g is not None and g.abs().sum() > 0 for g in kernels.values()), [n for n, g in kernels.items() if g is None]
    for name in kernels:
        torch.testing.assert_close(kernels[name], reference[name], atol=1e-6, rtol=1e-5)
