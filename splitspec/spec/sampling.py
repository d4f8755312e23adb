"""The target's decoding rule, a pure function of (logits, seed, absolute position).

Sampling uses the Gumbel-max trick with noise from a counter-based hash of
``(seed, position, token id)`` instead of a stateful generator. The token drawn at a position
therefore depends only on the logits there and on the request's seed, never on how many rows a
pass contained or which speculation mode ran. That is what makes a seeded speculative run produce
*the same tokens* as a seeded plain run, so losslessness under sampling is an exact test.

``argmax(logits / T + G)`` with ``G ~ Gumbel(0, 1)`` i.i.d. per token is an exact sample from
``softmax(logits / T)``; top-k / top-p filtering sets the excluded logits to -inf first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus filtering
    top_k: int = 0  # 0 = no top-k filtering
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # int64 products wrap, but the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [T, vocab], a pure function of (seed, positions [T], token id)."""
    device = positions.device
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _mix32(_mix32(positions.to(torch.int64) ^ seed_lo) ^ seed_hi)  # [T]
    token = torch.arange(vocab_size, device=device, dtype=torch.int64)
    bits = _mix32((_mix32(key[:, None] ^ token[None, :]) + 0x9E3779B9) & _MASK32)  # [T, vocab]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # open interval (0, 1)
    return -torch.log(-torch.log(uniform))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf. logits [T, vocab]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep a token if the mass before it is still below top_p (the first one always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw_tokens(logits: torch.Tensor, positions: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's token at every row: logits [T, vocab] float32, positions [T] (any device: only
    seeded sampling reads them) -> [T] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    return (scaled + gumbel_noise(params.seed, positions.to(logits.device), logits.shape[-1])).argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens, params: SamplingParams, top: int
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """The logprobs OpenAI's ``logprobs`` report: for each row of ``logits`` [R, vocab] and the token
    drawn there (``tokens`` [R]), ``(token, logprob, [(id, logprob)] * top)`` under the target's
    *sampling distribution* ``log_softmax(logits / temperature)`` (for temperature 0, greedy, of the
    raw logits), computed in float64. Top-k / top-p filtering is not applied: these are the
    temperature-scaled model's probabilities. The alternatives are the ``top`` most likely ids, most
    likely first."""
    scaled = logits.to(torch.float64)
    if not params.greedy:
        scaled = scaled / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    out = []
    if top > 0:
        values, indices = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
        values, indices = values.tolist(), indices.tolist()
    for r, token in enumerate(ids.tolist()):
        alternatives = list(zip(indices[r], values[r])) if top > 0 else []
        out.append((token, chosen[r], alternatives))
    return out
