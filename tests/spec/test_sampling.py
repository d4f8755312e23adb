"""The counter-based decoding rule: exact distribution, and independence from how rows are batched."""

from __future__ import annotations

import torch

from splitspec.spec.sampling import SamplingParams, draw_tokens, filter_logits, gumbel_noise


def test_greedy_is_argmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draw_tokens(logits, torch.arange(5), SamplingParams()), logits.argmax(-1))


def test_a_token_depends_only_on_seed_position_and_logits():
    params = SamplingParams(temperature=0.8, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    batch = draw_tokens(logits.repeat(64, 1), torch.arange(100, 164), params)
    single = torch.cat([draw_tokens(logits, torch.tensor([p]), params) for p in range(100, 164)])
    assert torch.equal(batch, single)  # same draws whether positions come in one pass or one by one
    assert len(set(batch.tolist())) > 5  # and different positions draw different tokens
    other_seed = draw_tokens(logits.repeat(64, 1), torch.arange(100, 164), SamplingParams(temperature=0.8, seed=1235))
    assert not torch.equal(batch, other_seed)


def test_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    n = 40_000
    draws = draw_tokens(logits.repeat(n, 1), torch.arange(n), SamplingParams(temperature=1.0, seed=7))
    freq = torch.bincount(draws, minlength=5).double() / n
    expected = torch.softmax(logits[0].double(), -1)
    # 5 standard errors of a binomial proportion at n = 40k is below 0.012.
    assert (freq - expected).abs().max().item() < 0.012


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    n = 4000
    top_k = draw_tokens(logits.repeat(n, 1), torch.arange(n), SamplingParams(temperature=2.0, top_k=2, seed=3))
    assert set(top_k.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # [0.64, 0.23, 0.09, ...]: top_p 0.8 keeps the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    top_p = draw_tokens(logits.repeat(n, 1), torch.arange(n), SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    assert set(top_p.tolist()) == {0, 1}
    kept = filter_logits(logits, top_k=0, top_p=0.01)
    assert torch.isfinite(kept).sum().item() == 1  # the most likely token always stays


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(99, torch.arange(200), 500).double()
    assert abs(g.mean().item() - 0.5772) < 0.02  # Euler-Mascheroni constant
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.05
