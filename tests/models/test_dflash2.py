"""DFlash2 against an independent implementation of its equations (docs/dflash2.md), written here
row by row in float64 from the checkpoint's tensors by their published names, and a checkpoint in
the published format (``config.json`` + ``model.safetensors``) loaded by the draft loader."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from splitspec.models.dflash2 import DFlash2Config, DFlash2Draft
from splitspec.models.loader import load_dflash_draft, read_draft_config

H, HEADS, KV_HEADS, D, FFN, VOCAB, B = 32, 4, 2, 8, 48, 97, 8


def config(**over) -> DFlash2Config:
    base = dict(
        hidden_size=H, intermediate_size=FFN, num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
        block_size=B, mask_token_id=96, target_layer_ids=(0, 2), rope_theta=10_000.0, vocab_size=VOCAB,
        conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5,
    )
    return DFlash2Config(**{**base, **over})


def random_state(c: DFlash2Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a DFlash2 checkpoint by its published name, random (float64)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    s = {"fc.weight": r(H, len(c.target_layer_ids) * H), "hidden_norm.weight": 1 + r(H, scale=0.1), "norm.weight": 1 + r(H, scale=0.1)}
    groups = H // c.conv_group_size
    for i in range(c.num_layers):
        p = f"layers.{i}."
        s |= {
            p + "input_layernorm.weight": 1 + r(H, scale=0.1), p + "post_attention_layernorm.weight": 1 + r(H, scale=0.1),
            p + "self_attn.q_proj.weight": r(HEADS * D, H), p + "self_attn.k_proj.weight": r(KV_HEADS * D, H),
            p + "self_attn.v_proj.weight": r(KV_HEADS * D, H), p + "self_attn.o_proj.weight": r(H, HEADS * D),
            p + "self_attn.q_norm.weight": 1 + r(D, scale=0.1), p + "self_attn.k_norm.weight": 1 + r(D, scale=0.1),
            p + "mlp.gate_proj.weight": r(FFN, H), p + "mlp.up_proj.weight": r(FFN, H), p + "mlp.down_proj.weight": r(H, FFN),
        }
        for conv in ("attention_conv", "mlp_conv"):
            s[f"{p}{conv}.base_kernel"] = r(2, c.conv_kernel_size, H, scale=0.5)
            s[f"{p}{conv}.kernel_projection.weight"] = r(2 * c.conv_kernel_size * groups, H, scale=0.3 / H ** 0.5)
    s["candidate_selector.hidden_projection.weight"] = r(c.selector_rank, H)
    s["candidate_selector.predecessor_codebook"] = r(VOCAB, c.selector_rank, scale=0.5)
    s["candidate_selector.successor_codebook"] = r(VOCAB, c.selector_rank, scale=0.5)
    return s


# ------------------------------------------------------------------ the equations, row by row

def rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean() + eps) * w


def rope(x, pos, theta):  # x [D] of one head at position pos, rotate-half
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = pos * theta ** (-2 * i / x.shape[0])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def conv(rows, coeff, base, side, group):
    """rows [B][H] of one block; coeff [B][2 * taps * groups] flat as (side, tap, group)."""
    taps, groups = base.shape[1], rows[0].shape[0] // group
    out = []
    for t in range(len(rows)):
        acc = torch.zeros_like(rows[t])
        for j in range(taps):
            if t - j < 0:
                continue
            for ch in range(rows[t].shape[0]):
                k = base[side, j, ch] + coeff[t][side * taps * groups + j * groups + ch // group]
                acc[ch] += k * rows[t - j][ch]
        out.append(acc)
    return out


def reference_block(s, c, features, anchor_embedding, mask_embedding, anchor_pos):
    """Final-normed hidden rows [B][H] of one block over context ``features`` [n][taps * H] at
    positions anchor_pos - n .. anchor_pos - 1 (the anchor's own row has no feature)."""
    B, HEADS, KV_HEADS, D = c.block_size, c.num_heads, c.num_kv_heads, c.head_dim
    n = len(features)
    ctx = [rms(s["fc.weight"] @ f, s["hidden_norm.weight"]) for f in features]
    ctx_pos = [anchor_pos - n + j for j in range(n)]
    xs = [anchor_embedding] + [mask_embedding] * (B - 1)
    pos = [anchor_pos + t for t in range(B)]
    group, rep = c.conv_group_size, HEADS // KV_HEADS

    def visible(t, p):
        return not c.sliding_window or pos[t] - p < c.sliding_window

    for i in range(c.num_layers):
        p = f"layers.{i}."
        u = [rms(x, s[p + "input_layernorm.weight"]) for x in xs]
        co = [s[p + "attention_conv.kernel_projection.weight"] @ v for v in u]
        ut = conv(u, co, s[p + "attention_conv.base_kernel"], 0, group)

        def heads(w, v, count):
            return (w @ v).view(count, D)

        def kv(v, p_abs):
            k = heads(s[p + "self_attn.k_proj.weight"], v, KV_HEADS)
            k = torch.stack([rope(rms(k[h], s[p + "self_attn.k_norm.weight"]), p_abs, c.rope_theta) for h in range(KV_HEADS)])
            return k, heads(s[p + "self_attn.v_proj.weight"], v, KV_HEADS)

        keys = [kv(v, q) for v, q in zip(ctx, ctx_pos)] + [kv(v, q) for v, q in zip(ut, pos)]
        key_pos = ctx_pos + pos
        att = []
        for t in range(B):
            q = heads(s[p + "self_attn.q_proj.weight"], ut[t], HEADS)
            outs = []
            for h in range(HEADS):
                qh = rope(rms(q[h], s[p + "self_attn.q_norm.weight"]), pos[t], c.rope_theta)
                idx = [j for j in range(len(keys)) if j >= n or visible(t, key_pos[j])]
                logits = torch.stack([qh @ keys[j][0][h // rep] / math.sqrt(D) for j in idx])
                w = torch.softmax(logits, 0)
                outs.append(sum(w[m] * keys[j][1][h // rep] for m, j in enumerate(idx)))
            att.append(s[p + "self_attn.o_proj.weight"] @ torch.cat(outs))
        att = conv(att, co, s[p + "attention_conv.base_kernel"], 1, group)
        xs = [x + a for x, a in zip(xs, att)]
        v = [rms(x, s[p + "post_attention_layernorm.weight"]) for x in xs]
        cm = [s[p + "mlp_conv.kernel_projection.weight"] @ r for r in v]
        vt = conv(v, cm, s[p + "mlp_conv.base_kernel"], 0, group)
        m = [s[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(s[p + "mlp.gate_proj.weight"] @ r) * (s[p + "mlp.up_proj.weight"] @ r)) for r in vt]
        m = conv(m, cm, s[p + "mlp_conv.base_kernel"], 1, group)
        xs = [x + d for x, d in zip(xs, m)]
    return [rms(x, s["norm.weight"]) for x in xs]


def reference_pair_scores(s, hidden, unary, candidates, anchor):
    """S[t][a][b] by the definition, one pair at a time."""
    A, Bc, W = s["candidate_selector.predecessor_codebook"], s["candidate_selector.successor_codebook"], s["candidate_selector.hidden_projection.weight"]
    L, K = candidates.shape
    out = torch.zeros(L, K, K, dtype=torch.float64)
    for t in range(L):
        gate = W @ hidden[t]
        for a in range(K):
            prev = anchor if t == 0 else int(candidates[t - 1, a])
            for b in range(K):
                out[t, a, b] = unary[t, b] + sum(A[prev, r] * gate[r] * Bc[int(candidates[t, b]), r] for r in range(gate.shape[0]))
    return out


def model_of(c, s) -> DFlash2Draft:
    model = DFlash2Draft(c).double()
    model.load_state_dict(s, strict=True)
    return model.eval()


@pytest.mark.parametrize("window", [0, 12])
@pytest.mark.parametrize("fused", [False, True])
def test_block_pass_matches_the_equations(window, fused):
    c = config(sliding_window=window)
    s = random_state(c)
    model = model_of(c, s)
    if fused:
        model.fuse_projections()
    g = torch.Generator().manual_seed(1)
    n, anchor_pos = 9, 30
    features = torch.randn(n, len(c.target_layer_ids) * H, generator=g, dtype=torch.float64)
    embed = torch.randn(VOCAB, H, generator=g, dtype=torch.float64)
    anchor = 17
    context = model.context_kv(features, torch.arange(anchor_pos - n, anchor_pos))
    noise = embed[torch.tensor([anchor] + [c.mask_token_id] * (B - 1))]
    got = model(noise, torch.arange(anchor_pos, anchor_pos + B), context)
    want = torch.stack(reference_block(s, c, list(features), embed[anchor], embed[c.mask_token_id], anchor_pos))
    # The model's RoPE angles are float32 (``rope_cos_sin``), the only part not in float64 here.
    assert torch.allclose(got, want, atol=5e-6, rtol=0), (got - want).abs().max()
    if window:  # the window hides context from the later rows: without it they differ
        assert not torch.allclose(model_of(config(), s)(noise, torch.arange(anchor_pos, anchor_pos + B), context), want, atol=1e-6)


def test_batched_block_pass_matches_one_at_a_time():
    c = config(sliding_window=12)
    model = model_of(c, random_state(c))
    g = torch.Generator().manual_seed(2)
    lengths, anchors = [3, 9, 14], [40, 20, 60]
    contexts, singles = [], []
    embed = torch.randn(VOCAB, H, generator=g, dtype=torch.float64)
    noise = embed[torch.tensor([[5] + [c.mask_token_id] * (B - 1)] * 3)]
    for n, a in zip(lengths, anchors):
        f = torch.randn(n, 2 * H, generator=g, dtype=torch.float64)
        ctx = model.context_kv(f, torch.arange(a - n, a))
        contexts.append(ctx)
        singles.append(model(noise[0], torch.arange(a, a + B), ctx))
    positions = torch.tensor(anchors)[:, None] + torch.arange(B)
    batched = model.forward_batch(noise, positions, contexts)
    assert torch.allclose(batched, torch.stack(singles), atol=1e-12)


def test_pair_scores_match_the_definition():
    c = config()
    s = random_state(c)
    model = model_of(c, s)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B - 1, H, generator=g, dtype=torch.float64)
    candidates = torch.stack([torch.randperm(VOCAB, generator=g)[: c.selector_top_k] for _ in range(B - 1)])
    unary = torch.randn(B - 1, c.selector_top_k, generator=g, dtype=torch.float64).sort(descending=True).values
    got = model.candidate_selector.pair_scores(hidden, unary, candidates, torch.tensor(11))
    want = reference_pair_scores(s, hidden, unary, candidates, 11)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-5)
    assert torch.equal(got[0, 0], got[0, -1])  # depth 1 has one predecessor: the anchor


def test_draft_logits_scale_and_cap():
    model = DFlash2Draft(config(output_multiplier=0.5, final_logit_softcapping=3.0))
    z = torch.tensor([[-20.0, 0.0, 2.0, 40.0]])
    assert torch.allclose(model.draft_logits(z), 3.0 * torch.tanh(0.5 * z / 3.0))
    assert DFlash2Draft(config()).draft_logits(z) is z


def published_checkpoint(tmp_path, c: DFlash2Config, state: dict[str, torch.Tensor]):
    raw = c.to_dict(num_target_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    return raw


def test_a_checkpoint_in_the_published_format_loads_and_matches(tmp_path):
    c = config(sliding_window=16)
    state = random_state(c)
    raw = published_checkpoint(tmp_path, c, state)
    # The published layout: DFlash2 keys under dflash_config, codebooks without ".weight".
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dflash_config"]["selector_top_k"] == 5
    assert raw["layer_types"] == ["sliding_attention"] * 2 and raw["sliding_window"] == 16
    assert read_draft_config(tmp_path) == c
    model, loaded = load_dflash_draft(tmp_path, dtype=torch.float64)
    assert isinstance(model, DFlash2Draft) and loaded == c
    rounded = {k: v.to(torch.bfloat16).double() for k, v in state.items()}
    g = torch.Generator().manual_seed(4)
    features = torch.randn(5, 2 * H, generator=g, dtype=torch.float64)
    embed = torch.randn(VOCAB, H, generator=g, dtype=torch.float64)
    noise = embed[torch.tensor([3] + [c.mask_token_id] * (B - 1))]
    got = model(noise, torch.arange(20, 20 + B), model.context_kv(features, torch.arange(15, 20)))
    want = torch.stack(reference_block(rounded, c, list(features), embed[3], embed[c.mask_token_id], 20))
    assert torch.allclose(got, want, atol=5e-6, rtol=0)


def test_published_config_keys_are_checked(tmp_path):
    c = config()
    raw = c.to_dict(num_target_layers=4)
    for key, value, message in [
        ("conv_group_size", 7, "does not divide hidden_size"),
        ("selector_top_k", 0, "selector_top_k must be at least 1"),
        ("selector_top_k", 1000, "exceeds vocab_size"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["dflash_config"][key] = value
        with pytest.raises(ValueError, match=message):
            DFlash2Config.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    del bad["dflash_config"]["selector_rank"]
    with pytest.raises(ValueError, match="missing key 'selector_rank'"):
        DFlash2Config.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    bad["layer_types"] = ["sliding_attention", "full_attention"]
    bad["sliding_window"] = 64
    with pytest.raises(ValueError, match="mix sliding and full attention"):
        DFlash2Config.from_dict(bad)


def test_identity_convolutions_and_a_neutral_selector_make_it_dflash():
    """The published conversion's starting point (``init_dflash2_extras``, with the successor
    codebook at zero): the block pass is the DFlash draft's with the same backbone, and every pair
    score is the depth's unary term."""
    from splitspec.models.dflash import DFlashDraft
    from splitspec.models.dflash2 import init_dflash2_extras

    c = config()
    s = random_state(c)
    d2 = model_of(c, s)
    init_dflash2_extras(d2)
    d1 = DFlashDraft(c).double()
    d1.load_state_dict({k: v for k, v in s.items() if "conv" not in k and "selector" not in k}, strict=True)
    g = torch.Generator().manual_seed(5)
    features = torch.randn(6, 2 * H, generator=g, dtype=torch.float64)
    noise = torch.randn(B, H, generator=g, dtype=torch.float64)
    positions = torch.arange(6, 6 + B)
    h1 = d1(noise, positions, d1.context_kv(features, torch.arange(6)))
    h2 = d2(noise, positions, d2.context_kv(features, torch.arange(6)))
    assert torch.equal(h1, h2)
    unary = torch.randn(B - 1, 5, generator=g, dtype=torch.float64)
    with torch.inference_mode():  # h2 came from an inference-mode pass
        pairs = d2.candidate_selector.pair_scores(h2[1:], unary, torch.randint(0, VOCAB, (B - 1, 5), generator=g), torch.tensor(3))
    assert torch.equal(pairs, unary.float()[:, None, :].expand(-1, 5, -1))
