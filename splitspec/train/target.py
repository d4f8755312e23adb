"""Train a small Qwen3 target from scratch on a packed corpus and write it as a GGUF.

The model is :class:`splitspec.models.dense.DenseForCausalLM` itself, trained through its
batched, cache-free ``forward_sequences``, so the weights that serve are exactly the ones trained.
Embeddings are tied to the LM head.

Training: random windows of ``seq_len + 1`` tokens from the training stream (each step draws
``batch_size`` start offsets from a generator seeded by ``seed``), next-token cross-entropy,
AdamW (no decay on norms) with linear warmup and cosine decay to ``min_lr_ratio * lr``, bfloat16
autocast on CUDA. The *held-out loss* is the mean cross-entropy over non-overlapping windows of
the held-out stream; it is measured every ``eval_every`` steps and the weights with the lowest
one are the ones written, which guards against overfitting a corpus of a few million tokens.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
from tqdm import tqdm

from splitspec.fixtures.tiny import gguf_weights, write_target_gguf
from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.train.bpe import EOT, PRE, gguf_vocab
from splitspec.train.corpus import load_packed

logger = logging.getLogger(__name__)

GGUF_NAME = "splitspec-builtin-stdlib"


@dataclass(frozen=True)
class TargetTrainConfig:
    """``data``: packed corpus (``corpus.save_packed``); ``tokenizer``: its ``tokenizer.json``;
    ``out``: the GGUF to write. ``max_steps`` > 0 overrides ``epochs`` (passes over the
    training tokens). The defaults are the shipped model's geometry (~12.5M parameters)."""

    data: Path
    tokenizer: Path
    out: Path
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rope_theta: float = 10_000.0
    seq_len: int = 512
    batch_size: int = 32
    epochs: float = 6.0
    max_steps: int = 0
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_tokens: int = 1 << 20  # held-out tokens scored per evaluation, at most
    init_std: float = 0.02
    seed: int = 0
    device: str = "auto"  # auto = cuda if available, else cpu
    compile: bool = False
    progress: bool = True


@dataclass
class TargetTrainResult:
    """What the run did, for the log and the model card. Losses are nats per token."""

    out: str
    device: str
    parameters: int
    steps: int
    tokens: int
    train_tokens_available: int
    heldout_tokens_scored: int
    wall_s: float
    tokens_per_s: float
    heldout_loss_initial: float
    heldout_loss_final: float
    heldout_loss_best: float
    best_step: int
    history: list[dict] = field(default_factory=list)  # {step, lr, train_loss, heldout_loss?}
    model: DenseForCausalLM | None = field(default=None, repr=False)  # the weights written, float32

    def to_dict(self) -> dict:
        """Everything but the model, JSON-ready."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}


def dense_config(config: TargetTrainConfig, vocab_size: int) -> DenseConfig:
    """The Qwen3 geometry of the target; its context length is the training ``seq_len``."""
    return DenseConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, rope_theta=config.rope_theta, max_context=config.seq_len,
        tie_word_embeddings=True, qk_norm=True, architecture="qwen3",
    )


def new_model(dense: DenseConfig, init_std: float, seed: int) -> DenseForCausalLM:
    """A freshly initialised model with tied embeddings: matrices N(0, init_std), residual output
    projections scaled down by sqrt(2 * layers) so the residual stream starts at unit scale; norms 1."""
    torch.manual_seed(seed)
    model = DenseForCausalLM(dense)
    model.lm_head.weight = model.embed_tokens.weight
    residual_std = init_std / math.sqrt(2 * dense.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else init_std)
    return model


def lr_factor(step: int, config: TargetTrainConfig, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 to ``min_lr_ratio``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def sequence_loss(model: DenseForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``windows`` [B, T + 1]."""
    hidden, _ = model.forward_sequences(windows[:, :-1])  # [B, T, hidden]
    logits = model.lm_head(hidden)  # [B, T, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model: DenseForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean loss over ``windows`` [N, T + 1], batch by batch."""
    model.eval()
    total = 0.0
    with _autocast(windows.device):
        for i in range(0, len(windows), batch_size):
            chunk = windows[i : i + batch_size]
            total += sequence_loss(model, chunk).item() * len(chunk)
    model.train()
    return total / len(windows)


def heldout_windows(heldout: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] (consecutive windows share one boundary token, so
    each held-out token is a target once), covering at most ``max_tokens`` targets."""
    count = min(len(heldout) - 1, max_tokens) // seq_len
    if count == 0:
        raise ValueError(f"held-out split has {len(heldout)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    starts = np.arange(count) * seq_len
    return torch.from_numpy(heldout[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))


def train_target(config: TargetTrainConfig) -> TargetTrainResult:
    """Train the target of ``config`` and write ``config.out`` (F16 GGUF, tokenizer embedded)."""
    device = _device(config.device)
    backend = tokenizers.Tokenizer.from_file(str(config.tokenizer))
    train, heldout, _ = load_packed(Path(config.data))
    dense = dense_config(config, backend.get_vocab_size(with_added_tokens=True))
    top = int(max(train.max(), heldout.max()))
    if top >= dense.vocab_size:
        raise ValueError(f"{config.data}: token id {top} is outside the vocabulary of {config.tokenizer} ({dense.vocab_size} tokens)")
    if len(train) <= config.seq_len + 1:
        raise ValueError(f"{config.data}: training split has {len(train)} tokens, fewer than seq_len + 2 = {config.seq_len + 2}")

    model = new_model(dense, config.init_std, config.seed).to(device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    tokens_per_step = config.batch_size * config.seq_len
    total_steps = config.max_steps or max(1, math.ceil(config.epochs * len(train) / tokens_per_step))
    stream = torch.from_numpy(train.astype(np.int64)).to(device)
    offsets = torch.arange(config.seq_len + 1, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    evaluation = heldout_windows(heldout, config.seq_len, config.eval_tokens).to(device)
    loss_fn = torch.compile(sequence_loss) if config.compile else sequence_loss

    initial = best = heldout_loss(model, evaluation, config.batch_size)
    best_step, best_state = 0, copy.deepcopy(model.state_dict())
    history: list[dict] = [{"step": 0, "heldout_loss": initial}]
    logger.info("training %d steps of %d tokens (%.1f passes over %d tokens); held-out loss %.4f",
                total_steps, tokens_per_step, total_steps * tokens_per_step / len(train), len(train), initial)
    train_seconds, last = 0.0, initial
    bar = tqdm(range(total_steps), desc="target", unit="step", disable=not config.progress)
    for step in bar:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = config.lr * lr_factor(step, config, total_steps)
        starts = torch.randint(0, len(train) - config.seq_len - 1, (config.batch_size,), generator=generator).to(device)
        with _autocast(device):
            loss = loss_fn(model, stream[starts[:, None] + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        train_loss = loss.item()  # also waits for the step, so the timing is honest
        train_seconds += time.perf_counter() - t0
        record = {"step": step + 1, "lr": optimizer.param_groups[0]["lr"], "train_loss": train_loss}
        if (step + 1) % config.eval_every == 0 or step + 1 == total_steps:
            last = record["heldout_loss"] = heldout_loss(model, evaluation, config.batch_size)
            if last < best:
                best, best_step, best_state = last, step + 1, copy.deepcopy(model.state_dict())
            logger.info("step %d: train loss %.4f, held-out loss %.4f", step + 1, train_loss, last)
        history.append(record)
        bar.set_postfix(loss=f"{train_loss:.3f}", heldout=f"{last:.3f}", tok_s=f"{(step + 1) * tokens_per_step / train_seconds:,.0f}")
    bar.close()

    model.load_state_dict(best_state)
    write_target(model, dense, backend, Path(config.out))
    tokens = total_steps * tokens_per_step
    return TargetTrainResult(
        out=str(config.out), device=str(device), parameters=sum(p.numel() for p in model.parameters()),
        steps=total_steps, tokens=tokens, train_tokens_available=len(train), heldout_tokens_scored=evaluation.shape[0] * config.seq_len,
        wall_s=train_seconds, tokens_per_s=tokens / train_seconds, heldout_loss_initial=initial,
        heldout_loss_final=last, heldout_loss_best=best, best_step=best_step, history=history, model=model.float().cpu().eval(),
    )


def write_target(model: DenseForCausalLM, dense: DenseConfig, backend: tokenizers.Tokenizer, path: Path) -> None:
    """``model`` as a ``qwen3`` GGUF: F16 matrices, F32 norms, no ``output.weight`` (tied), and
    ``backend`` as its "gpt2" tokenizer with ``<|endoftext|>`` as BOS and EOS (no chat template)."""
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_target_gguf(
        path, dense, gguf_weights(dense, state), gguf_vocab(backend), "f16",
        tokenizer_pre=PRE, eos=EOT, chat_template=None, name=GGUF_NAME,
    )
