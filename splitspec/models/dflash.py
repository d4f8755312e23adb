"""DFlash block drafter (arXiv 2602.06036): config and model.

The draft writes a whole block in one non-causal pass over ``[anchor, MASK × (B-1)]``. It is
conditioned on *tap features*: the concatenated outputs of a few target layers for every
committed position, projected once by ``fc`` + ``hidden_norm`` and injected as extra keys and
values in every draft layer (no ``input_layernorm`` on them; ``k_norm`` and RoPE do apply).
Row k of the block predicts the token at ``anchor_position + k``; row 0 is discarded. The
draft borrows the target's embedding and LM head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from native import paged_attention, qkv_rope, use_triton
from splitspec.models.layers import TREE_ATTENTION_ROWS, QKVProjection, RMSNorm, SwiGLU, rope_cos_sin


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's tap choice: evenly spaced between layer 1 and ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class ConfigKeys:
    """A draft ``config.json``'s keys: each read from ``dflash_config`` first, then the top level
    (published drafts put their DFlash keys in one or the other); a missing one is named."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source, self.dflash = raw, source, raw.get("dflash_config") or {}

    def need(self, key: str, top_level: bool = False) -> Any:
        for where in ((self.raw,) if top_level else (self.dflash, self.raw)):
            if where.get(key) is not None:
                return where[key]
        raise ValueError(f"{self.source}: missing key {key!r}")

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.need(key)
        except ValueError:
            return default


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> DFlashConfig:
        """Parse a z-lab DFlash ``config.json`` (a Qwen3 config plus DFlash fields)."""
        keys = ConfigKeys(raw, source)
        keys.need("dflash_config", top_level=True)
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{source}: layer_types {layer_types} include sliding-window layers, not supported yet")
        config = cls(**cls.shared_fields(keys))
        if config.block_size < 2:
            raise ValueError(f"{source}: block_size must be at least 2, got {config.block_size}")
        return config

    @staticmethod
    def shared_fields(keys: ConfigKeys) -> dict[str, Any]:
        """The fields every draft config has (DFlash's), read from ``keys``."""
        num_layers = int(keys.need("num_hidden_layers"))
        heads = int(keys.need("num_attention_heads"))
        taps = keys.get("target_layer_ids")
        if taps is None:
            taps = default_target_layer_ids(int(keys.need("num_target_layers")), num_layers)
        rope = keys.get("rope_parameters") or {}
        return dict(
            hidden_size=int(keys.need("hidden_size")),
            intermediate_size=int(keys.need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(keys.get("num_key_value_heads", heads)),
            head_dim=int(keys.get("head_dim") or int(keys.need("hidden_size")) // heads),
            block_size=int(keys.need("block_size")),
            mask_token_id=int(keys.need("mask_token_id")),
            target_layer_ids=tuple(int(t) for t in taps),
            rms_norm_eps=float(keys.get("rms_norm_eps", 1e-6)),
            rope_theta=float(keys.get("rope_theta", rope.get("rope_theta", 1_000_000.0))),
            vocab_size=keys.get("vocab_size"),
        )

    def to_dict(self, num_target_layers: int) -> dict[str, Any]:
        """The ``config.json`` that z-lab's DFlash code and ``from_dict`` read."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_layers,
            "block_size": self.block_size,
            "num_target_layers": num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        }

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = QKVProjection(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,  # [(N,) Q, hidden] block rows
        cos: torch.Tensor,  # [Q, D] at the block positions, or [N, 1, Q, D]
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [(N,) H_kv, S, D] projected context keys of this layer
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None = None,  # [(N,) Q, S + Q] bool, True = visible; None = all visible
    ) -> torch.Tensor:
        attn = self.self_attn
        x = self.input_layernorm(h)
        q, k, v = attn.query_key_value(x, cos, sin)
        keys, values = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
        # Non-causal: every block row sees the (visible) context and the whole block.
        h = h + attn.attend(q, keys, values, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(
        self,
        x: torch.Tensor,  # [B, hidden] this layer's normed input
        h: torch.Tensor,  # [B, hidden] the block rows it was normed from
        cos: torch.Tensor,  # [B, D]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [H_kv, capacity, D]: the context's keys, then room for the block's
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B] where the block's own keys and values go
        mask: torch.Tensor,  # [B, S] bool over cache slots: the visible context and the block
        next_norm: RMSNorm,  # the next layer's input norm, or the final norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the block's keys written next to the context in its cache instead
        of concatenated to it: fixed shapes and addresses (CUDA graphs), one attention kernel.
        Returns ``(next_norm(h'), h')``: each residual add is fused with the norm after it."""
        x, h = self.post_attention_layernorm.forward_add(self.self_attn.project_attend_cached(x, cos, sin, k_cache, v_cache, slots, mask), h)
        return next_norm.forward_add(self.mlp(x), h)

    def forward_pooled(
        self,
        x: torch.Tensor,  # [S * B, hidden] this layer's normed input: S blocks of B rows
        h: torch.Tensor,  # [S * B, hidden] the block rows it was normed from
        cos: torch.Tensor,  # [S * B, D]
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [H_kv, pool slots, D] every pooled context's keys of this layer
        v_pool: torch.Tensor,
        at: PooledAttention,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_cached` of S blocks, each over its own context in the pool."""
        attn = self.self_attn
        q = project_write(attn, x, cos, sin, k_pool, v_pool, at.write_slots)  # [H, S * B, D]
        x, h = self.post_attention_layernorm.forward_add(attend_pooled(attn, q, k_pool, v_pool, at), h)
        return next_norm.forward_add(self.mlp(x), h)


class DFlashDraft(nn.Module):
    layer_class = DFlashLayer  # a subclass's own layers (DFlash2's)

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def sliding_window(self) -> int:
        """A block row at position p sees the context positions > p - window (0: all of them;
        ``DFlash2Config.sliding_window``)."""
        return getattr(self.config, "sliding_window", 0)

    def fuse_projections(self) -> None:
        """Inference: q/k/v and gate/up each become one matmul (see ``layers.fuse_linears``)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.hidden_norm(self.fc(features))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, c.dtype)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def append_cached(
        self,
        features: torch.Tensor,  # [R, taps * hidden]
        positions: torch.Tensor,  # [R] absolute
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [H_kv, capacity, D]
        slots: torch.Tensor,  # [R] cache slots of the rows
    ) -> None:
        """:meth:`context_kv` written straight into the cache slots (fixed shapes: CUDA graphs)."""
        c = self.hidden_norm(self.fc(features))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, c.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            layer.self_attn.write_key_value(c, cos, sin, k_cache, v_cache, slots)

    @torch.inference_mode()
    def forward_cached(
        self,
        noise: torch.Tensor,  # [B, hidden]
        positions: torch.Tensor,  # [B] absolute
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [H_kv, capacity, D]
        slots: torch.Tensor,  # [B] free cache slots for the block's own keys and values
        mask: torch.Tensor,  # [B, S] bool over cache slots 0 .. S: visible context and the block's slots
    ) -> torch.Tensor:
        """:meth:`forward` over a preallocated cache (see ``DFlashLayer.forward_cached``)."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, noise.dtype)
        h = noise
        x = self.layers[0].input_layernorm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, (k, v), next_norm in zip(self.layers, caches, norms, strict=True):
            x, h = layer.forward_cached(x, h, cos, sin, k, v, slots, mask, next_norm)
        return x

    @torch.inference_mode()
    def forward_pooled(
        self,
        noise: torch.Tensor,  # [S * B, hidden]: S blocks of B rows
        positions: torch.Tensor,  # [S * B] absolute
        pools: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [H_kv, pool slots, D]
        at: PooledAttention,
    ) -> torch.Tensor:
        """:meth:`forward_cached` of S sequences' blocks in one pass, each sequence's context a
        region of a shared pool (``PooledAttention``): fixed shapes and addresses for any choice of
        regions, so one CUDA graph serves every batch of S. Returns [S * B, hidden]."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, noise.dtype)
        h = noise
        x = self.layers[0].input_layernorm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, (k, v), next_norm in zip(self.layers, pools, norms, strict=True):
            x, h = layer.forward_pooled(x, h, cos, sin, k, v, at, next_norm)
        return x

    def _blocks(
        self,
        noise: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: Sequence[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = noise
        for layer, (k, v) in zip(self.layers, context, strict=True):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    @torch.inference_mode()
    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Tap features [m, taps * hidden] at ``positions`` [m] -> per layer (k, v), each [H_kv, m, D]."""
        return self._context_kv(features, positions)

    @torch.inference_mode()
    def forward(
        self,
        noise: torch.Tensor,  # [B, hidden]: target embeddings of [anchor, MASK × (B-1)]
        positions: torch.Tensor,  # [B] absolute positions anchor_position + 0..B-1
        context: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [H_kv, S, D], all visible
    ) -> torch.Tensor:
        """Returns the normalised block hidden states [B, hidden]; apply the target LM head to rows 1..B-1.
        Under a sliding window (DFlash2 drafts) row t sees the context rows of its own window."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, noise.dtype)
        n, b, w = context[0][0].shape[-2], noise.shape[0], self.sliding_window
        mask = None
        if w and n + b > w:
            rows, cols = torch.arange(b, device=noise.device)[:, None], torch.arange(n + b, device=noise.device)
            mask = (cols >= n) | (cols > n + rows - w)  # [B, n + B]: column j < n is position anchor - n + j
        return self._blocks(noise, cos, sin, context, mask)

    @torch.inference_mode()
    def forward_batch(
        self,
        noise: torch.Tensor,  # [S, B, hidden]: target embeddings of each sequence's [anchor, MASK × (B-1)]
        positions: torch.Tensor,  # [S, B] absolute positions anchor_position + 0..B-1 of each sequence
        contexts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],  # per sequence, per layer (k, v) [H_kv, n_s, D]
    ) -> torch.Tensor:
        """:meth:`forward` of S sequences' blocks in one pass (continuous batching of Propose steps).
        Returns the normalised block hidden states [S, B, hidden].

        Terms: S sequences; B the block size; ``n_s`` the length of sequence s's visible context
        (all of its cached positions, or its window), which differs between sequences; L the
        longest ``n_s``. Every layer's context keys and values are stacked into [S, H_kv, L, D],
        sequence s's in columns ``0 .. n_s - 1`` and zeros after them, and the block's own keys
        follow at columns ``L .. L + B - 1``. The mask [S, B, L + B] shows every row of block s
        columns ``< n_s`` and the block's: exactly the keys :meth:`forward` shows it, so each
        sequence's rows equal :meth:`forward` over its own context, up to rounding (the matmuls
        run at other shapes).
        """
        c = self.config
        s, b = positions.shape
        context, lengths = pad_contexts(contexts)  # per layer (k, v) [S, H_kv, L, D]; [S] n_s
        width = context[0][0].shape[2]  # L
        cols = torch.arange(width + b, device=noise.device)  # [L + B]
        visible = (cols < lengths[:, None]) | (cols >= width)  # [S, L + B]: own context, own block
        mask = visible[:, None, :].expand(s, b, width + b)  # [S, B, L + B]: non-causal, every row sees the same keys
        if self.sliding_window:  # ... but the context rows of its own window (every context ends at its anchor)
            rows = torch.arange(b, device=noise.device)[None, :, None]  # [1, B, 1]
            mask = mask & ((cols >= width) | (cols > lengths[:, None, None] + rows - self.sliding_window))
        cos, sin = rope_cos_sin(positions.flatten(), c.head_dim, c.rope_theta, noise.dtype)
        cos, sin = (t.unflatten(0, positions.shape).unsqueeze(1) for t in (cos, sin))  # [S, 1, B, D]: shared by heads
        return self._blocks(noise, cos, sin, context, mask)

    def forward_blocks(
        self,
        noise: torch.Tensor,  # [N, Q, hidden]: target embeddings of several blocks per sequence, concatenated
        positions: torch.Tensor,  # [N, Q] absolute position of every block row
        features: torch.Tensor,  # [N, S, taps * hidden] tap features of whole sequences, positions 0..S-1
        mask: torch.Tensor,  # [N, Q, S + Q] bool over keys [context ; all blocks], True = visible
    ) -> torch.Tensor:
        """Training form of :meth:`forward` (differentiable, batched): many blocks of N sequences in
        one pass, kept apart by ``mask``. Returns the normalised block hidden states [N, Q, hidden].

        With a mask that shows block rows the context positions before their anchor and their own
        block, each block's rows equal :meth:`forward` over :meth:`context_kv` of that context.
        """
        c = self.config
        ctx_positions = torch.arange(features.shape[1], device=features.device)
        cos, sin = rope_cos_sin(positions.flatten(), c.head_dim, c.rope_theta, noise.dtype)
        cos, sin = (t.unflatten(0, positions.shape).unsqueeze(1) for t in (cos, sin))  # [N, 1, Q, D]: shared by heads
        return self._blocks(noise, cos, sin, self._context_kv(features, ctx_positions), mask)


@dataclass
class PooledAttention:
    """Where S blocks of B rows read and write in a pool of contexts: per layer one K and one V
    tensor [H_kv, pool slots, D], sequence s's context in the ``region`` slots starting at
    ``regions[s] * region`` (its key column c is pool slot ``regions[s] * region + c``).

    ``ends[s]``: the block's own first column (its keys go to columns ``ends[s] ..
    ends[s] + B``; ``write_slots`` are those pool slots); ``visible`` [S, B, span] bool over
    columns ``0 .. span``; ``firsts[s]``: the first context column every block row sees (a draft
    window's start; 0 without one), which ``visible`` must agree with. Columns a sequence does not see may hold anything finite. A region
    may be shorter than ``span`` only if its sequence's columns past ``ends[s] + B`` are beyond
    the pool's last slot (a pad sequence's scratch region): those are clamped to it."""

    regions: torch.Tensor  # [S] int64
    ends: torch.Tensor  # [S] int64
    write_slots: torch.Tensor  # [S * B] int64
    visible: torch.Tensor  # [S, B, span] bool
    region: int  # slots per region
    firsts: torch.Tensor | None = None  # [S] int64 (None: 0)
    _gather: torch.Tensor | None = field(default=None, repr=False)

    def gather_rows(self, pool: torch.Tensor) -> torch.Tensor:
        """[S, H_kv, span] rows of ``pool.view(-1, D)`` holding each sequence's key columns (the
        same for every layer: computed once a pass)."""
        if self._gather is None:
            heads, slots = pool.shape[0], pool.shape[1]
            cols = torch.arange(self.visible.shape[-1], device=pool.device)
            per_sequence = (self.regions[:, None] * self.region + cols).clamp_(max=slots - 1)  # [S, span]
            head_rows = torch.arange(heads, device=pool.device) * slots  # [H_kv]
            self._gather = head_rows[None, :, None] + per_sequence[:, None, :]
        return self._gather


def project_write(
    attn: QKVProjection, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Queries [H, T, D] of the rows ``x`` [T, hidden], their keys and values written to the pool
    ``slots`` [T]: the projection half of ``QKVProjection.project_attend_cached`` (one
    ``qkv_rope`` launch where the kernels run)."""
    if attn._native_rope(x):
        return qkv_rope.qkv_rope(*attn._projections(x), cos, sin, *attn._norm_args(), k_pool, v_pool, slots)
    q, k, v = attn.query_key_value(x, cos, sin)
    k_pool.index_copy_(1, slots, k)
    v_pool.index_copy_(1, slots, v)
    return q


def attend_pooled(attn: QKVProjection, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, at: PooledAttention) -> torch.Tensor:
    """Attention of S blocks ``q`` [H, S * B, D], each over its own region of the pool, then
    ``o_proj`` -> [S * B, hidden]. The native paged kernel reads the keys in place (a region is
    one page of ``region`` slots: block table ``[regions[s]]``, prefix ``firsts[s] .. ends[s]``,
    the columns before it by ``visible``), and only up to each sequence's own ``ends[s] + B``; the torch path gathers ``[S, H_kv, span, D]`` first
    (``QKVProjection.attend_paged``'s plain path)."""
    heads, rows, d = q.shape
    s, b, span = at.visible.shape
    blocks = q.unflatten(1, (s, b)).transpose(0, 1)  # [S, H, B, D]
    if heads * b <= TREE_ATTENTION_ROWS and use_triton(q, "paged_attention") and paged_attention.supported(blocks, k_pool, v_pool, at.visible):
        out = paged_attention.paged_tree_attention(
            blocks, k_pool, v_pool, at.regions[:, None], at.ends, at.visible, at.region, prefix_from=at.firsts,
        )
    else:
        gather = at.gather_rows(k_pool).flatten()
        k = k_pool.view(-1, d).index_select(0, gather).view(s, -1, span, d)  # [S, H_kv, span, D]
        v = v_pool.view(-1, d).index_select(0, gather).view(s, -1, span, d)
        out = attn.attention(blocks, k, v, at.visible)  # [S, B, H * D]
    return attn.o_proj(out.flatten(0, 1))


def pad_contexts(
    contexts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],  # per sequence, per layer (k, v) [H_kv, n_s, D]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer (k, v) [S, H_kv, L, D] with sequence s in columns ``0 .. n_s - 1`` and zeros after
    (a masked key's probability is 0, and 0 * NaN would be NaN), and the lengths ``n_s`` [S]."""
    lengths = [layers[0][0].shape[1] for layers in contexts]
    first = contexts[0][0][0]  # [H_kv, n_0, D]
    shape = (len(contexts), first.shape[0], max(lengths), first.shape[2])
    padded = []
    for i in range(len(contexts[0])):
        k, v = first.new_zeros(shape), first.new_zeros(shape)
        for s, layers in enumerate(contexts):
            k[s, :, : lengths[s]], v[s, :, : lengths[s]] = layers[i]
        padded.append((k, v))
    return padded, torch.tensor(lengths, device=first.device)
