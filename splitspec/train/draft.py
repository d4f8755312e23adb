"""Train a DFlash drafter (arXiv 2602.06036) for a frozen target, with the recipe SpecForge
implements (DFlash, arXiv 2602.06036), or a DFlash2 drafter (``arch="dflash2"``: the same loss
plus its candidate selector's, ``splitspec.train.selector``). ``train_draft(DraftTrainConfig(...))``
is the whole API.

Terms:

- *anchor*: a position ``a`` of a training sequence where a block starts. The block is
  ``[token[a], MASK × (B-1)]`` at positions ``a .. a+B-1``, embedded by the target's embedding;
  row ``k`` predicts ``token[a+k]`` (same-position prediction). Row 0 is given, not trained.
- *context*: the target's tap features (outputs of the tapped layers, concatenated) at positions
  strictly before the anchor, because at inference the anchor is the bonus token, which has no
  feature yet. Block rows also see their own block, in both directions, and nothing else.
- *loss*: cross-entropy of the block rows against the text, row ``k >= 1`` weighted
  ``w_k = exp(-(k-1)/gamma)`` (0 for rows past the sequence end): ``Σ w·CE / Σ w``.
- *acceptance estimate*: on held-out text, teacher-forced. For an anchor ``a``, draft row ``k``
  *matches* when its argmax equals the target's greedy token at position ``a+k`` (the argmax of
  the target's logits at ``a+k-1``, reading the held-out text). The estimate is the mean over
  anchors of ``1 +`` the number of leading matching rows: the tokens chain DFlash would commit per
  step, bonus included, were the committed text the held-out text. It lies in ``[1, B]``. A
  DFlash2 draft's chain is its selector's walk (``acceptance``); its top-1 chain's estimate is
  ``acceptance_top1``.

Each step, every sequence of the batch gets ``anchors`` blocks at distinct random positions, and
all of them go through the draft in one pass (``DFlashDraft.forward_blocks``): one masked
attention per layer over keys ``[context ; every block]``. The target runs once per batch, without
gradients; its embedding and LM head stay frozen and are not part of the written draft.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from splitspec.models.devices import resolve_device
from splitspec.models.dflash import DFlashConfig, DFlashDraft, default_target_layer_ids
from splitspec.models.dflash2 import DFlash2Config, DFlash2Draft, init_dflash2_extras
from splitspec.models.hub import resolve_model
from splitspec.models.loader import load_dflash_draft, load_target
from splitspec.text.tokenizer import Tokenizer
from splitspec.train.data import DEFAULT_GLOB, PackedCorpus, load_corpus
from splitspec.train.selector import selector_loss_sum, walked_tokens

logger = logging.getLogger(__name__)

MASK_TOKEN = "<|mask|>"
CHECKPOINT_FILE = "checkpoint.pt"
LOG_FILE = "train_log.json"
INIT_STD = 0.02  # std of the draft's initial linear weights (the Qwen3 initializer range)
LOGIT_ELEMENTS = 1 << 27  # the loss and argmax materialise at most this many logits at once
# Fields that steer a run but not what it computes: a resumed run may change them.
RUN_FIELDS = frozenset({"data", "glob", "out", "device", "eval_every", "eval_sequences", "checkpoint_every", "resume", "stop_at"})


@dataclass
class DraftTrainConfig:
    """What to train, on what, and how. Defaults follow the published recipe (DFlash, arXiv 2602.06036) except the
    size (``layers``, ``steps``), which the caller picks."""

    target: str  # target checkpoint: GGUF file, Hugging Face directory or hf:// reference
    data: Sequence[str]  # text files, directories (searched with ``glob``) and JSONL files
    out: str  # output directory: config.json, model.safetensors, train_log.json, checkpoint.pt
    glob: str = DEFAULT_GLOB  # comma-separated file name patterns for directories
    seq_len: int = 1024  # tokens per packed training sequence
    heldout_fraction: float = 0.05  # share of the text (by document) kept for evaluation
    arch: str = "dflash"  # dflash | dflash2
    layers: int = 2  # draft decoder layers
    taps: tuple[int, ...] | None = None  # target layers whose outputs feed the draft; None = DFlash's default spacing
    block_size: int = 16  # B: anchor + B-1 drafted tokens
    mask_token_id: int | None = None  # None = the tokenizer's "<|mask|>"
    anchors: int = 512  # blocks per sequence per step (capped by the positions available)
    labels: str = "text"  # "text": the next tokens of the text (recipe); "target": the target's greedy tokens on it
    gamma: float = 7.0  # loss decay over block rows
    lr: float = 6e-4  # peak learning rate (AdamW)
    warmup_fraction: float = 0.04  # linear warmup share of the steps, then cosine decay to 0
    grad_clip: float = 1.0  # max global gradient norm
    steps: int = 1000  # optimizer steps of the whole run
    batch_size: int = 4  # sequences per step
    device: str = "auto"  # auto (cuda if available), cpu or cuda:N
    seed: int = 0  # draft init, batch order and anchor positions
    eval_every: int = 100  # steps between held-out evaluations (and one at the end)
    eval_sequences: int = 16  # held-out sequences evaluated (the first ones)
    checkpoint_every: int = 500  # steps between writes of OUT/checkpoint.pt
    resume: bool = False  # continue from OUT/checkpoint.pt, exactly
    init: str | None = None  # a draft directory whose weights start the run instead of random ones (same config)
    stop_at: int | None = None  # end this run after this step (with a checkpoint), to resume later
    # DFlash2 only (the published drafts' values): its selector, convolutions and attention window.
    selector_top_k: int = 16
    selector_rank: int = 256
    selector_weight: float = 1.0  # of the selector loss, added to the draft's
    conv_group_size: int = 16
    sliding_window: int = 0  # 0: every context position (full attention)


@dataclass
class DraftTrainResult:
    out_dir: Path  # holds the draft (config.json + model.safetensors) and train_log.json
    losses: list[float]  # training loss of every step so far, step 1 first (resumed runs included)
    evals: list[dict[str, float]]  # {"step", "heldout_loss", "acceptance"[, "acceptance_top1"]} at every evaluation
    heldout_loss: float  # at the last step
    heldout_acceptance: float  # acceptance estimate (module docstring) at the last step
    wall_time_s: float  # this call, loading included
    steps_per_second: float  # optimizer steps of this call per second of its training loop
    step: int  # last step done; equals config.steps unless stop_at ended the run early


# ------------------------------------------------------------------------------------------ recipe


@dataclass(frozen=True)
class Blocks:
    """N sequences, A anchors each, B rows per block; Q = A·B rows per sequence."""

    tokens: torch.Tensor  # [N, Q] block inputs: the anchor token, then MASK
    positions: torch.Tensor  # [N, Q] absolute positions anchor + 0..B-1
    labels: torch.Tensor  # [N, Q] token at each row's position (clamped to the sequence end)
    weights: torch.Tensor  # [N, Q] float32 loss weights, 0 for row 0 and past the sequence end
    mask: torch.Tensor  # [N, Q, T + Q] bool, keys = [context ; all blocks]


def sample_anchors(generator: torch.Generator, batch: int, low: int, high: int, count: int) -> torch.Tensor:
    """[batch, count] sorted positions drawn uniformly without replacement from ``low..high``."""
    scores = torch.rand(batch, high - low + 1, generator=generator)
    return scores.argsort(dim=1)[:, :count].sort(dim=1).values + low


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int, window: int = 0) -> torch.Tensor:
    """anchors [N, A] -> [N, A·B, seq_len + A·B] bool: a block row sees context positions before
    its anchor (and, with a sliding ``window``, after its own position minus ``window``) and every
    row of its own block."""
    rows_anchor = anchors.repeat_interleave(block_size, dim=1)  # [N, Q]
    cols = torch.arange(seq_len, device=anchors.device)  # [T]
    context = cols < rows_anchor[..., None]  # [N, Q, T]
    if window:
        rows_position = rows_anchor + torch.arange(rows_anchor.shape[1], device=anchors.device) % block_size  # [N, Q]
        context &= cols > rows_position[..., None] - window
    block = torch.arange(rows_anchor.shape[1], device=anchors.device) // block_size  # [Q] block of each row
    own = (block[:, None] == block[None, :]).expand(anchors.shape[0], -1, -1)  # [N, Q, Q]
    return torch.cat([context, own], dim=-1)


def make_blocks(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int, gamma: float,
    label_tokens: torch.Tensor | None = None, window: int = 0,
) -> Blocks:
    """tokens [N, T], anchors [N, A] -> the blocks' inputs, targets and mask (``window``: a sliding
    window's, see :func:`block_attention_mask`). Row labels come from ``label_tokens`` [N, T]
    (default: ``tokens``) at the rows' positions."""
    n, t = tokens.shape
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchors[..., None] + offsets  # [N, A, B]
    inputs = torch.full_like(positions, mask_token_id)
    inputs[..., 0] = tokens.gather(1, anchors)
    labels = (tokens if label_tokens is None else label_tokens).gather(1, positions.clamp(max=t - 1).flatten(1))
    decay = torch.exp(-(offsets - 1).clamp(min=0) / gamma) * (offsets > 0)  # [B]: w_k, w_0 = 0
    weights = decay * (positions < t)
    return Blocks(inputs.flatten(1), positions.flatten(1), labels, weights.flatten(1).float(), block_attention_mask(anchors, t, block_size, window))


def block_hidden(draft: DFlashDraft, embed: nn.Embedding, blocks: Blocks, features: torch.Tensor) -> torch.Tensor:
    """The draft's normed output rows [N, Q, hidden] for ``blocks``, given tap features [N, T, taps·hidden]."""
    noise = embed(blocks.tokens).float()  # the residual stream stays float32 under autocast
    return draft.forward_blocks(noise, blocks.positions, features, blocks.mask)


def _chunk_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(F.linear(hidden, head).float(), labels, reduction="none") * weights).sum()


def weighted_ce_sum(
    hidden: torch.Tensor,  # [R, hidden]
    head: torch.Tensor,  # [vocab, hidden] the target's LM head
    labels: torch.Tensor,  # [R]
    weights: torch.Tensor,  # [R]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·CE, Σ w) over the rows of positive weight. Large vocabularies go in chunks whose
    logits are recomputed in the backward pass instead of kept (at most LOGIT_ELEMENTS at once)."""
    keep = weights > 0
    hidden, labels, weights = hidden[keep], labels[keep], weights[keep]
    rows = max(1, LOGIT_ELEMENTS // head.shape[0])
    if len(labels) <= rows:
        return _chunk_loss(hidden, head, labels, weights), weights.sum()
    parts = [
        checkpoint(_chunk_loss, hidden[s : s + rows], head, labels[s : s + rows], weights[s : s + rows], use_reentrant=False)
        for s in range(0, len(labels), rows)
    ]
    return torch.stack(parts).sum(), weights.sum()


def greedy_tokens(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """argmax of ``hidden`` [..., hidden] @ ``head``ᵀ -> [...], in chunks of at most LOGIT_ELEMENTS logits."""
    flat = hidden.flatten(0, -2)
    rows = max(1, LOGIT_ELEMENTS // head.shape[0])
    out = torch.cat([F.linear(flat[s : s + rows], head).argmax(-1) for s in range(0, len(flat), rows)])
    return out.view(hidden.shape[:-1])


@torch.no_grad()
def target_pass(target: nn.Module, tokens: torch.Tensor, taps: Sequence[int], greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [N, T] -> tap features [N, T, taps·hidden] and, if ``greedy``, the target's argmax
    after every position [N, T]. Dense targets run batched without a cache
    (``forward_sequences``); others run sequence by sequence (:func:`cached_target_pass`)."""
    if not hasattr(target, "forward_sequences"):
        return cached_target_pass(target, tokens, taps, greedy)
    hidden, features = target.forward_sequences(tokens, taps)
    return features, greedy_tokens(hidden, target.lm_head.weight) if greedy else None


@torch.no_grad()
def cached_target_pass(target: nn.Module, tokens: torch.Tensor, taps: Sequence[int], greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`target_pass` through the serving forward, one causal prefill per sequence: slower, any family."""
    t = tokens.shape[1]
    positions = torch.arange(t, device=tokens.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
    dtype = target.embed_tokens.weight.dtype
    features, nexts = [], []
    for row in tokens:
        cache = target.new_cache(t, tokens.device, dtype)
        logits, tapped = target(row, positions, cache, 0, causal, taps, logit_rows=None if greedy else positions[-1:])
        features.append(tapped.clone())  # a normal tensor (not an inference one), so autograd may save it
        nexts.append(logits.argmax(-1))
    return torch.stack(features), torch.stack(nexts) if greedy else None


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the peak rate before optimizer step ``step`` (0-based): linear warmup, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


# --------------------------------------------------------------------------------------------- run


class Batches:
    """Training sequence indices: every sequence once per epoch, in a fresh random order."""

    def __init__(self, count: int, batch_size: int, generator: torch.Generator) -> None:
        self.count, self.batch_size, self.generator = count, batch_size, generator
        self.order = torch.randperm(count, generator=generator)
        self.cursor = 0

    def next(self) -> torch.Tensor:
        taken = []
        need = self.batch_size
        while need:
            if self.cursor == self.count:
                self.order, self.cursor = torch.randperm(self.count, generator=self.generator), 0
            part = self.order[self.cursor : self.cursor + need]
            taken.append(part)
            self.cursor += len(part)
            need -= len(part)
        return torch.cat(taken)

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order, "cursor": self.cursor, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.cursor = state["order"], state["cursor"]
        self.generator.set_state(state["generator"])


@dataclass
class _Run:
    """Everything fixed for the length of a run."""

    config: DraftTrainConfig
    device: torch.device
    target: nn.Module
    num_target_layers: int
    draft_config: DFlashConfig
    corpus: PackedCorpus
    eval_anchors: torch.Tensor  # [M, A_eval] fixed anchors of the evaluated held-out sequences
    fingerprint: str  # of the packed data, to refuse resuming on other data

    @property
    def head(self) -> torch.Tensor:
        return self.target.lm_head.weight

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")


def check_config(c: DraftTrainConfig) -> None:
    """Refuse values that cannot train, naming the flag."""
    positive = {"steps": c.steps, "batch_size": c.batch_size, "anchors": c.anchors, "layers": c.layers,
                "eval_every": c.eval_every, "eval_sequences": c.eval_sequences, "checkpoint_every": c.checkpoint_every}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if c.block_size < 2:
        raise ValueError(f"--block-size {c.block_size}: must be at least 2")
    if c.seq_len < c.block_size + 1:
        raise ValueError(f"--seq-len {c.seq_len} is too short for a block of {c.block_size}: needs at least {c.block_size + 1}")
    for name, value in (("gamma", c.gamma), ("lr", c.lr)):
        if not value > 0:
            raise ValueError(f"--{name} {value}: must be positive")
    if not 0 <= c.warmup_fraction < 1:
        raise ValueError(f"--warmup-fraction {c.warmup_fraction}: must be in [0, 1)")
    if c.stop_at is not None and not 1 <= c.stop_at <= c.steps:
        raise ValueError(f"--stop-at {c.stop_at}: must be between 1 and --steps {c.steps}")
    if not c.data:
        raise ValueError("no training data given")
    if c.labels not in ("text", "target"):
        raise ValueError(f"--labels {c.labels!r}: choose text or target")
    if c.arch not in ("dflash", "dflash2"):
        raise ValueError(f"--arch {c.arch!r}: choose dflash or dflash2")
    if c.arch == "dflash2" and not c.selector_weight >= 0:
        raise ValueError(f"--selector-weight {c.selector_weight}: must be at least 0")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(name)


def draft_config_for(target_config: Any, tokenizer: Tokenizer, c: DraftTrainConfig) -> DFlashConfig:
    """A draft with the target's hidden size, attention geometry and RoPE base."""
    num_layers = target_config.num_layers
    taps = tuple(c.taps) if c.taps else tuple(default_target_layer_ids(num_layers, c.layers))
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise ValueError(f"--taps {list(taps)}: layers {bad} do not exist (the target has layers 0..{num_layers - 1})")
    mask = c.mask_token_id
    if mask is None:
        mask = tokenizer.token_to_id(MASK_TOKEN)
        if mask is None:
            raise ValueError(f"{c.target}: the tokenizer has no {MASK_TOKEN} token; pass --mask-token-id (an unused id below {target_config.vocab_size})")
    if not 0 <= mask < target_config.vocab_size:
        raise ValueError(f"--mask-token-id {mask}: outside the target vocabulary of {target_config.vocab_size}")
    t = target_config
    config = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=c.layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, block_size=c.block_size, mask_token_id=mask,
        target_layer_ids=taps, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, vocab_size=t.vocab_size,
    )
    if c.arch == "dflash2":
        config = DFlash2Config(
            **vars(config), conv_group_size=c.conv_group_size, selector_rank=c.selector_rank,
            selector_top_k=c.selector_top_k, sliding_window=c.sliding_window,
        )
        config.check("train-draft")  # names the field; the flags carry the same names
    return config


def _prepare(c: DraftTrainConfig) -> _Run:
    check_config(c)
    device = _device(c.device)
    path = resolve_model(c.target)
    tokenizer = Tokenizer.load(path)
    corpus = load_corpus(c.data, tokenizer, c.seq_len, c.heldout_fraction, c.glob)
    target, target_config = load_target(path, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    target.requires_grad_(False)
    draft_config = draft_config_for(target_config, tokenizer, c)
    evaluated = min(c.eval_sequences, len(corpus.heldout))
    eval_anchors = sample_anchors(
        torch.Generator().manual_seed(c.seed + 1), evaluated, 1, c.seq_len - c.block_size, min(c.anchors, c.seq_len - c.block_size)
    )
    digest = hashlib.sha256(corpus.train.tobytes() + corpus.heldout.tobytes()).hexdigest()[:16]
    return _Run(c, device, target, target_config.num_layers, draft_config, corpus, eval_anchors, digest)


def _new_draft(config: DFlashConfig, seed: int, device: torch.device) -> DFlashDraft:
    torch.manual_seed(seed)
    dflash2 = isinstance(config, DFlash2Config)
    draft = DFlash2Draft(config) if dflash2 else DFlashDraft(config)
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=INIT_STD)
    if dflash2:  # identity convolutions and a neutral selector, as a converted DFlash draft starts
        init_dflash2_extras(draft)
    return draft.to(device)


def _load_init(draft: DFlashDraft, config: DFlashConfig, num_target_layers: int, folder: str) -> None:
    """Start ``draft`` from a written draft's weights (``load_dflash_draft``: a directory or its GGUF
    conversion), for fine-tuning or a second schedule after a finished run. That draft must be the
    one this run builds."""
    try:
        loaded, then = load_dflash_draft(folder, num_target_layers=num_target_layers)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--init {folder}: not a readable draft directory (config.json + model.safetensors) or GGUF conversion of one: {exc}") from exc
    changed = [f"{f.name} {getattr(then, f.name, None)!r} -> {getattr(config, f.name)!r}"
               for f in dataclasses.fields(config) if getattr(then, f.name, None) != getattr(config, f.name)]
    if type(then) is not type(config) or changed:
        raise ValueError(f"--init {folder}: that draft differs from the one these settings build: "
                         + "; ".join(changed or [f"{type(then).__name__} -> {type(config).__name__}"]))
    draft.load_state_dict(loaded.state_dict())


def _train_step(run: _Run, draft: DFlashDraft, optimizer, scheduler, batches: Batches) -> float:
    c = run.config
    tokens = torch.from_numpy(run.corpus.train[batches.next().numpy()]).to(run.device)
    distill = c.labels == "target"
    features, target_next = target_pass(run.target, tokens, run.draft_config.target_layer_ids, greedy=distill)
    anchors = sample_anchors(batches.generator, len(tokens), 1, c.seq_len - 2, min(c.anchors, c.seq_len - 2)).to(run.device)
    # Self-distillation: the label at position p is the target's argmax after p - 1 (teacher-forced).
    label_tokens = torch.cat([tokens[:, :1], target_next[:, :-1]], dim=1) if distill else tokens
    blocks = make_blocks(tokens, anchors, c.block_size, run.draft_config.mask_token_id, c.gamma, label_tokens, _window(run))
    with run.autocast():
        hidden = block_hidden(draft, run.target.embed_tokens, blocks, features)
        total, weight = weighted_ce_sum(hidden.flatten(0, 1), run.head, blocks.labels.flatten(), blocks.weights.flatten())
        loss = total / weight
        if isinstance(draft, DFlash2Draft):
            selector_total, selector_weight = selector_loss_sum(draft, hidden, run.head, blocks.labels, blocks.weights, blocks.tokens)
            loss = loss + c.selector_weight * selector_total / selector_weight
    loss.backward()
    nn.utils.clip_grad_norm_(draft.parameters(), c.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _window(run: _Run) -> int:
    return getattr(run.draft_config, "sliding_window", 0)


@torch.no_grad()
def evaluate(run: _Run, draft: DFlashDraft) -> dict[str, float]:
    """The held-out loss and acceptance estimate (and a DFlash2 draft's ``acceptance_top1``) over
    the first ``eval_sequences`` held-out sequences."""
    c, b = run.config, run.config.block_size
    total = weight = 0.0
    accepted, accepted_top1, anchors_seen = 0, 0, 0
    for s in range(0, len(run.eval_anchors), c.batch_size):
        anchors = run.eval_anchors[s : s + c.batch_size].to(run.device)
        tokens = torch.from_numpy(run.corpus.heldout[s : s + len(anchors)]).to(run.device)
        features, target_next = target_pass(run.target, tokens, run.draft_config.target_layer_ids, greedy=True)
        blocks = make_blocks(tokens, anchors, b, run.draft_config.mask_token_id, c.gamma, window=_window(run))
        with run.autocast():
            hidden = block_hidden(draft, run.target.embed_tokens, blocks, features)
            t, w = weighted_ce_sum(hidden.flatten(0, 1), run.head, blocks.labels.flatten(), blocks.weights.flatten())
            top1 = greedy_tokens(hidden, run.head).unflatten(1, (-1, b))  # [N, A, B]
            drafted = top1
            if isinstance(draft, DFlash2Draft):
                drafted = walked_tokens(draft, hidden.unflatten(1, (-1, b)), run.head, blocks.tokens[:, ::b])
        total, weight = total + t.item(), weight + w.item()
        # The target's token at position p is its argmax after p - 1; eval blocks end inside the sequence.
        expected = target_next.gather(1, blocks.positions - 1).unflatten(1, (-1, b))  # [N, A, B]
        leading = (drafted[..., 1:] == expected[..., 1:]).long().cumprod(-1).sum(-1)  # [N, A]
        accepted += int((1 + leading).sum())
        accepted_top1 += int((1 + (top1[..., 1:] == expected[..., 1:]).long().cumprod(-1).sum(-1)).sum())
        anchors_seen += leading.numel()
    out = {"heldout_loss": total / weight, "acceptance": accepted / anchors_seen}
    if isinstance(draft, DFlash2Draft):
        out["acceptance_top1"] = accepted_top1 / anchors_seen
    return out


def write_draft(out: Path, draft: DFlashDraft, config: DFlashConfig, num_target_layers: int) -> None:
    """The z-lab DFlash directory: ``config.json`` + ``model.safetensors`` (bfloat16, as the
    published drafts: half the bytes of float32, and drafting tolerates the rounding)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).cpu().contiguous() for name, p in draft.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_dict(num_target_layers), indent=2) + "\n")


def _recipe(c: DraftTrainConfig) -> dict[str, Any]:
    """The config as JSON-ready values, run-steering fields included."""
    return json.loads(json.dumps(dataclasses.asdict(c), default=str))  # tuples -> lists, paths -> str


def _save_checkpoint(run: _Run, path: Path, draft, optimizer, scheduler, batches: Batches, step: int, losses, evals) -> None:
    state = {
        "step": step, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "batches": batches.state_dict(), "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None,
        "losses": list(losses), "evals": list(evals), "config": _recipe(run.config), "data": run.fingerprint,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def _load_checkpoint(run: _Run, path: Path, draft, optimizer, scheduler, batches: Batches) -> tuple[int, list, list]:
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    then, now = state["config"], _recipe(run.config)
    changed = [f"{k} {then.get(k)!r} -> {now[k]!r}" for k in now if k not in RUN_FIELDS and then.get(k) != now[k]]
    if changed:
        raise ValueError(f"--resume: {path} was written with other settings: {'; '.join(changed)}")
    if state["data"] != run.fingerprint:
        raise ValueError(f"--resume: the training text differs from the text {path} was trained on")
    draft.load_state_dict(state["draft"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["batches"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], state["losses"], state["evals"]


def train_draft(config: DraftTrainConfig) -> DraftTrainResult:
    """Train (or, with ``resume``, continue) a draft; write it and ``train_log.json`` to ``config.out``."""
    started = time.perf_counter()
    run = _prepare(config)
    c, out = config, Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = _new_draft(run.draft_config, c.seed, run.device)
    if c.init:  # a resumed run's checkpoint holds these weights' descendants; loading them first is harmless
        _load_init(draft, run.draft_config, run.num_target_layers, c.init)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=c.lr)
    warmup = round(c.warmup_fraction * c.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, c.steps, warmup))
    batches = Batches(len(run.corpus.train), c.batch_size, torch.Generator().manual_seed(c.seed))
    step, losses, evals = 0, [], []
    if c.resume:
        step, losses, evals = _load_checkpoint(run, out / CHECKPOINT_FILE, draft, optimizer, scheduler, batches)
    stop = c.stop_at or c.steps
    logger.info(
        "training a %d-layer draft on %d sequences of %d tokens (%d held out), taps %s, steps %d..%d on %s",
        run.draft_config.num_layers, len(run.corpus.train), c.seq_len, len(run.corpus.heldout),
        list(run.draft_config.target_layer_ids), step + 1, stop, run.device,
    )
    bar = tqdm(total=stop, initial=step, desc="train-draft", unit="step", disable=None)
    loop_started, first = time.perf_counter(), step
    while step < stop:
        losses.append(_train_step(run, draft, optimizer, scheduler, batches))
        step += 1
        if step % c.eval_every == 0 or step == stop:
            evals.append({"step": step, **evaluate(run, draft)})
            logger.info("step %d: loss %.4f, held-out loss %.4f, acceptance estimate %.3f", step, losses[-1], evals[-1]["heldout_loss"], evals[-1]["acceptance"])
        if step % c.checkpoint_every == 0 or (step == stop and stop < c.steps):
            _save_checkpoint(run, out / CHECKPOINT_FILE, draft, optimizer, scheduler, batches, step, losses, evals)
        postfix = {"loss": f"{losses[-1]:.3f}", "lr": f"{scheduler.get_last_lr()[0]:.2e}"}
        if evals:
            postfix["acc"] = f"{evals[-1]['acceptance']:.2f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update()
    bar.close()
    loop_time = time.perf_counter() - loop_started
    if not evals or evals[-1]["step"] != step:  # resumed at the stop step: evaluate what was loaded
        evals.append({"step": step, **evaluate(run, draft)})
    write_draft(out, draft, run.draft_config, run.num_target_layers)
    result = DraftTrainResult(
        out_dir=out, losses=losses, evals=evals, heldout_loss=evals[-1]["heldout_loss"],
        heldout_acceptance=evals[-1]["acceptance"], wall_time_s=time.perf_counter() - started,
        steps_per_second=(step - first) / loop_time if step > first else 0.0, step=step,
    )
    log = {
        "config": _recipe(c), "draft_config": run.draft_config.to_dict(run.num_target_layers), "step": step,
        "finished": step == c.steps, "data": {
            "train_sequences": len(run.corpus.train), "heldout_sequences": len(run.corpus.heldout),
            "train_documents": run.corpus.train_documents, "heldout_documents": run.corpus.heldout_documents,
            "train_tokens": int(run.corpus.train.size), "fingerprint": run.fingerprint,
        },
        "losses": losses, "evals": evals, "heldout_loss": result.heldout_loss, "heldout_acceptance": result.heldout_acceptance,
        "wall_time_s": result.wall_time_s, "steps_per_second": result.steps_per_second, "device": str(run.device),
    }
    (out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return result
