"""``token_logprobs``: the target's sampling distribution (log_softmax of logits / temperature)."""

from __future__ import annotations

import torch

from splitspec.spec.sampling import SamplingParams, token_logprobs


def test_token_logprobs_of_the_sampling_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).float()
    tokens = [4, 7, 49]
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=3)):
        scale = params.temperature if params.temperature > 0 else 1.0
        ref = torch.log_softmax(logits.double() / scale, dim=-1)
        out = token_logprobs(logits, tokens, params, 4)
        for r, (token, value, top) in enumerate(out):
            assert token == tokens[r] and abs(value - ref[r, token].item()) < 1e-12
            values, ids = torch.topk(ref[r], 4)
            assert [i for i, _ in top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(top, values.tolist())) < 1e-12
    assert all(top == [] for _, _, top in token_logprobs(logits, tokens, SamplingParams(), 0))
