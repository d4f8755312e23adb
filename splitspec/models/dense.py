"""Dense decoder family (Llama, Qwen2, Qwen3): config, KV cache and a tree-capable forward.

The three architectures share one layer: pre-norm attention with GQA and rotate-half RoPE, then a
SwiGLU MLP. They differ only in flags of :class:`DenseConfig`: per-head q/k RMSNorm (Qwen3),
q/k/v biases (Qwen2), and RoPE frequency scaling (Llama 3.1's, or linear).

One forward serves prefill chunks, tree verification and single-token steps: the caller passes
the tokens, their absolute positions, the KV slot where their keys start, and a boolean
visibility mask over all key positions (causal for prefill, ancestor-only for a tree).

The target engine drives every family through the same *sequence state* interface:
``model.new_cache(capacity, device, dtype)`` makes a sequence's state, the forward fills it, and
``cache.commit(start, accepted)`` keeps the accepted rows of a verify block (here: KV compaction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from splitspec.models.layers import QKVProjection, RMSNorm, SwiGLU, embedding, rope_cos_sin
from splitspec.models.paged import KVBlockPool, PagedState, PassInputs
from splitspec.spec.acceptance import compact_rows


@dataclass(frozen=True)
class DenseConfig:
    """Geometry of a dense decoder. ``rope_freq_factors`` [head_dim / 2] divides the RoPE
    frequencies (see ``layers.rope_cos_sin``); None means unscaled."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_context: int = 40960
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    attention_bias: bool = False
    rope_freq_factors: tuple[float, ...] | None = None
    architecture: str = "qwen3"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected head_dim / 2 = {self.head_dim // 2}")


class KVCache:
    """Static KV storage for one sequence: ``k``, ``v`` [num_layers, H_kv, capacity, D].

    Slots are absolute positions. A verify pass writes its tree rows after the committed
    prefix; acceptance then compacts the accepted rows down (see ``spec.acceptance``).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # [num_layers, H_kv, capacity, D]; may be views of a shared pool

    @classmethod
    def allocate(cls, config: DenseConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def commit(self, start: int, accepted: Sequence[int]) -> None:
        """Keep the accepted rows (``[AL]``, root row 0 first) of the verify block at ``start``."""
        compact_rows(self.k, start, accepted)
        compact_rows(self.v, start, accepted)


class DenseDecoderLayer(nn.Module):
    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = QKVProjection(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, qk_norm=c.qk_norm, bias=c.attention_bias
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def finish(self, attended: torch.Tensor, h: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention output ``attended`` [T, hidden] (of the normed input, from
        the residual stream ``h``): residual, norm, MLP, residual, ``next_norm``; returns
        ``(next_norm(h'), h')``. Each residual add is fused with the norm that follows it."""
        x, h = self.post_attention_layernorm.forward_add(attended, h)
        return next_norm.forward_add(self.mlp(x), h)

    def forward_causal(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [B, T, hidden] of whole sequences from position 0, no cache (training)."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        k, v = attn.key_value(x, cos, sin)
        h = h + attn.attend(attn.query(x, cos, sin), k, v, None, causal=True)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseForCausalLM(nn.Module):
    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DenseDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_cache(self, capacity: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return KVCache.allocate(self.config, capacity, torch.device(device), dtype)

    def new_pool(self, num_blocks: int, block_size: int, max_sequences: int, device: torch.device, dtype: torch.dtype) -> PagedState:
        """The paged state of every sequence a target engine serves (``max_sequences`` is for
        recurrent families; attention needs blocks only)."""
        c = self.config
        return PagedState(KVBlockPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, device, dtype))

    @staticmethod
    def position_bytes(config: DenseConfig, dtype: torch.dtype) -> int:
        """KV bytes of one position over all layers."""
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize

    def fuse_projections(self) -> None:
        """Inference: q/k/v and gate/up each become one matmul (fewer, fuller kernels per step)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype, c.rope_freq_factors)

    def forward_sequences(
        self, tokens: torch.Tensor, taps: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole sequences ``tokens`` [B, T] from position 0, causal, no KV cache, differentiable.

        Returns the final normed hidden states [B, T, hidden] (apply ``lm_head`` for logits) and
        tap features [B, T, len(taps) * hidden] or None, tapped as in :meth:`forward`. Used to
        train a target from scratch and to run a frozen target online while training a draft.
        """
        h = self.embed_tokens(tokens)
        cos, sin = self._rope(torch.arange(tokens.shape[1], device=tokens.device), h.dtype)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer.forward_causal(h, cos, sin)
            if i in taps:
                tapped[i] = h
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return self.norm(h), features

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute
        cache: KVCache,
        start: int | torch.Tensor,  # KV slot of tokens[0], or the KV slots [T] of every row
        mask: torch.Tensor,  # [T, S] bool over KV slots 0 .. S (S = start + T for an int start), True = visible
        taps: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] rows to project to logits; None = all
        parents: torch.Tensor | None = None,  # [T] a tree's parent rows; attention needs only the mask
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns logits [R, vocab] (float32) and tap features [T, len(taps) * hidden] or None.

        ``parents`` is part of the common forward signature (recurrent families need it); for
        attention the ``mask`` already says which rows each row sees. Tap ``i`` is the output of
        decoder layer ``i`` (the residual stream after its MLP), the ``hidden_states[i + 1]`` of
        Hugging Face's numbering, concatenated in ``taps`` order.
        """
        def attend(i: int, attn: QKVProjection, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return attn.project_attend_cached(x, cos, sin, cache.k[i], cache.v[i], start, mask)

        return self._decode(tokens, positions, attend, taps, logit_rows)

    @torch.inference_mode()
    def forward_paged(
        self,
        inputs: PassInputs,  # the pass's rows over several sequences (splitspec.models.paged)
        state: PagedState,
        taps: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] ragged rows to project to logits; None = all
        chain: bool = False,  # a prompt chunk of one sequence (recurrent families advance on it)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` over the rows of several sequences at once, each row attending to its own
        sequence's paged keys: logits [R, vocab] (float32) and tap features [N, len(taps) * hidden]."""
        at = inputs.attention()

        def attend(i: int, attn: QKVProjection, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return attn.project_attend_paged(x, cos, sin, state.kv.k[i], state.kv.v[i], at)

        return self._decode(inputs.tokens, inputs.positions, attend, taps, logit_rows)

    def _decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend, taps: Sequence[int], logit_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over rows ``tokens`` [T] at ``positions`` [T], layer ``i``'s attention output
        being ``attend(i, self_attn, x, cos, sin)`` (which writes the rows' K/V wherever its cache
        keeps them): logits [R, vocab] (float32) and tap features [T, len(taps) * hidden]."""
        h = self.embed_tokens(tokens)
        cos, sin = self._rope(positions, h.dtype)
        x = self.layers[0].input_layernorm(h)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer.finish(attend(i, layer.self_attn, x, cos, sin), h, next_norm)
            if i in taps:
                tapped[i] = h
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        if logit_rows is not None:
            x = x[logit_rows]
        return self.lm_head(x).float(), features
