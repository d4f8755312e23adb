"""Check `train_draft` on a GPU: the bf16 training pass matches the inference pass, the masked block
attention never falls back to SDPA's math kernel, and how fast and how big a run of real shape is.

Usage (on a CUDA/ROCm machine): python3 scripts/gpu_check_train_draft.py [--shape 0.6b|1.7b]
    [--seq-len 2048] [--anchors 512] [--batch-size 4] [--layers 2] [--steps 30] [--device cuda:0]
It writes a random target of a Qwen3 shape (GGUF, bf16, Qwen3 vocabulary size, byte-level
tokenizer) and synthetic text to a temp dir, then trains. Prints PASS/FAIL lines, steps/s and peak
memory; with $OUT set, also writes $OUT/train_draft_gpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_target, write_target_gguf
from splitspec.models.dflash import DFlashDraft
from splitspec.models.loader import load_target
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab
from splitspec.train.draft import DraftTrainConfig, block_hidden, draft_config_for, make_blocks, target_pass, train_draft

SHAPES = {  # Qwen3 geometry: hidden, layers, heads, kv heads, head_dim, intermediate ("tiny" smoke-tests the script on a CPU)
    "tiny": TinySpec(),
    "0.6b": TinySpec(hidden_size=1024, target_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072, weight_scale=0.02),
    "1.7b": TinySpec(hidden_size=2048, target_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=6144, weight_scale=0.02),
}
QWEN3_VOCAB = 151936
WORDS = "def class return import for while if else self print range len list dict value key index".split()


def fused_attention_only(device: torch.device, backends: list[SDPBackend]):
    """SDPA limited to ``backends`` on a GPU (the CPU has only flash and math: no limit there)."""
    return sdpa_kernel(backends) if device.type == "cuda" else contextlib.nullcontext()


def write_inputs(root: Path, spec: TinySpec, documents: int, chars: int) -> Path:
    vocab = byte_level_vocab()
    config, state = random_target(spec, QWEN3_VOCAB, np.random.default_rng(0))
    target = root / "target.gguf"
    write_target_gguf(target, config, gguf_weights(config, state), vocab, "bf16")
    rng = np.random.default_rng(1)
    (root / "data").mkdir()
    for i in range(documents):
        words = rng.choice(WORDS, chars // 6)
        (root / "data" / f"{i}.txt").write_text(" ".join(words))
    return target


def check_blocks(target_path: Path, device: torch.device) -> float:
    """Max |training logits - inference logits| for a 2-layer draft over 4 anchors, bf16 target, float32 draft."""
    target, target_config = load_target(target_path, device, torch.bfloat16)
    tokenizer = Tokenizer.load(target_path)
    config = draft_config_for(target_config, tokenizer, DraftTrainConfig(str(target_path), ["-"], "-"))
    torch.manual_seed(0)
    draft = DFlashDraft(config).to(device)
    tokens = torch.randint(0, 256, (1, 256), device=device)
    anchors = torch.tensor([[1, 60, 128, 250]], device=device)
    features, _ = target_pass(target, tokens, config.target_layer_ids, greedy=False)
    features = features.float()
    blocks = make_blocks(tokens, anchors, config.block_size, config.mask_token_id, 7.0)
    head = target.lm_head.weight.float()
    worst = 0.0
    with torch.no_grad(), fused_attention_only(device, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        logits = F.linear(block_hidden(draft, target.embed_tokens, blocks, features), head)[0]
    for i, a in enumerate(anchors[0].tolist()):
        rows = slice(config.block_size * i, config.block_size * (i + 1))
        context = draft.context_kv(features[0, :a], torch.arange(a, device=device))
        noise = target.embed_tokens(blocks.tokens[0, rows]).float()
        with torch.no_grad():
            expected = F.linear(draft(noise, a + torch.arange(config.block_size, device=device), context), head)
        worst = max(worst, (logits[rows] - expected).abs().max().item())
    return worst


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    device = torch.device(args.device)
    root = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    target = write_inputs(root, SHAPES[args.shape], documents=64, chars=args.seq_len * args.batch_size * args.steps // 48 + 4096)
    print(f"wrote target and text in {time.perf_counter() - t0:.1f} s")
    results: dict = {"shape": args.shape, "seq_len": args.seq_len, "anchors": args.anchors, "batch_size": args.batch_size,
                     "layers": args.layers, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    ok = True

    worst = check_blocks(target, device)
    passed = worst < 1e-2
    ok &= passed
    results["block_logits_max_abs_diff"] = worst
    print(f"{'PASS' if passed else 'FAIL'} training blocks == inference blocks on {device} (max |diff| {worst:.2e}, float32 draft, fused SDPA kernels only on GPU)")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    config = DraftTrainConfig(
        target=str(target), data=[str(root / "data")], out=str(root / "out"), seq_len=args.seq_len, anchors=args.anchors,
        batch_size=args.batch_size, layers=args.layers, steps=args.steps, eval_every=args.steps, eval_sequences=4,
        checkpoint_every=args.steps, device=args.device,
    )
    try:
        # Without the math kernel, a masked attention it would need raises instead of eating memory.
        with fused_attention_only(device, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            result = train_draft(config)
    except RuntimeError as exc:
        print(f"FAIL training without SDPA's math kernel: {str(exc).splitlines()[0]}")
        ok = False
    else:
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        finite = all(np.isfinite(result.losses))
        ok &= finite
        results.update(steps_per_second=result.steps_per_second, peak_gib=peak, wall_time_s=result.wall_time_s,
                       first_loss=result.losses[0], last_loss=result.losses[-1], heldout_acceptance=result.heldout_acceptance)
        print(f"{'PASS' if finite else 'FAIL'} {args.steps} steps ({args.shape} target, seq {args.seq_len}, {args.anchors} anchors, "
              f"batch {args.batch_size}, {args.layers}-layer draft): {result.steps_per_second:.2f} steps/s "
              f"({result.steps_per_second * args.batch_size * args.seq_len:.0f} tokens/s), peak {peak:.1f} GiB, "
              f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    results["ok"] = ok
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_draft_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
