"""native/paged_attention's launch on the GPU: keys per loop step, query rows per program, warps,
pipeline stages and key splits, for the batched verify and decode passes of the Qwen3-8B shape
and the Qwen3.5-27B verify pass, each timed as one layer per call over a step's layers (36 or 16
pools, so L2 holds none of their keys) in one CUDA graph (``gpu_quant_libraries.timed``, best of
5), against the default plan.

Every setting's output is first compared with the default plan's (bf16: within 2e-2). Prints one
line per shape and setting, fastest first, and writes ``$OUT/gpu_paged_attention_tune.json``.

Usage: python scripts/gpu_paged_attention_tune.py [--shapes 8b-verify16,8b-decode32,27b-verify1] [--default-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quant_libraries import timed  # noqa: E402

from native import paged_attention as pa  # noqa: E402

BLOCK_SIZE = 16  # the target's KV block (TargetLimits.block_size)
# name: (sequences, rows a sequence, heads, K/V heads, head_dim, layers)
SHAPES = {
    "8b-verify16": (16, 24, 32, 8, 128, 36),
    "8b-verify16b12": (16, 13, 32, 8, 128, 36),  # budget-12 trees
    "8b-verify32": (32, 24, 32, 8, 128, 36),
    "8b-decode32": (32, 1, 32, 8, 128, 36),
    "27b-verify1": (1, 24, 24, 4, 256, 16),
}


def make(sequences: int, rows: int, heads: int, kv_heads: int, head_dim: int, layers: int, dev):
    """Random queries, ``layers`` pools and tables of sequences with 500-700 committed keys; each
    block's rows see the prefix and the rows before them."""
    g = torch.Generator(device="cpu").manual_seed(0)
    starts = torch.randint(500, 700, (sequences,), generator=g)
    span = -(-(int(starts.max()) + rows) // BLOCK_SIZE) * BLOCK_SIZE
    per_seq = span // BLOCK_SIZE
    blocks = torch.randperm(sequences * per_seq, generator=g) + 1  # block 0 is the pad block
    tables = blocks.view(sequences, per_seq)
    slots = (sequences * per_seq + 1) * BLOCK_SIZE
    pools = [(torch.randn(kv_heads, slots, head_dim, device=dev, dtype=torch.bfloat16),
              torch.randn(kv_heads, slots, head_dim, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
    cols = torch.arange(span)
    visible = (cols[None, None, :] < (starts[:, None, None] + torch.arange(rows)[None, :, None] + 1))  # [B, T, S]
    q = torch.randn(sequences, heads, rows, head_dim, device=dev, dtype=torch.bfloat16)
    return q, pools, tables.to(dev), starts.to(dev), visible.to(dev)


def settings(head_dim: int, rows: int):
    """Launch settings to try: (block_s, block_r, num_warps, num_stages, waves)."""
    wide = head_dim > 128
    block_s = (16, 32) if wide else (32, 64)
    block_r = (16,) if rows == 1 else ((16, 32, 64) if wide else (32, 64, 128))
    stages = (1, 2, 3) if wide else (2, 3, 4)
    for s, r, w, st in itertools.product(block_s, block_r, (4, 8), stages):
        if r * head_dim > 64 * 128 and w == 4:
            continue  # the accumulator alone would fill four warps' registers
        yield s, r, w, st, 0
    for waves in (2, 4):
        yield 0, 0, 4, 0, waves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8b-verify16,8b-decode32,27b-verify1")
    parser.add_argument("--default-only", action="store_true", help="time the default plan only (an A/B of the kernel's code)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    results = []
    for name in args.shapes.split(","):
        b, t, h, hkv, d, layers = SHAPES[name]
        q, pools, tables, starts, visible = make(b, t, h, hkv, d, layers, dev)
        span = visible.shape[-1]

        def run(launch, q=q, pools=pools, tables=tables, starts=starts, visible=visible):
            for k, v in pools:
                out = pa.paged_tree_attention(q, k, v, tables, starts, visible, BLOCK_SIZE, launch)
            return out

        default = pa.plan(b, h, hkv, t, d, span, dev)
        reference = run(default).float()
        base_us = timed(lambda: run(default), reps=1)  # noqa: B023 - timed now
        print(f"\n{name}: B={b} T={t} H={h} H_kv={hkv} D={d} keys ~{span}, {layers} layers; default {default}: {base_us:.1f} us", flush=True)
        rows = []
        for block_s, block_r, warps, stages, waves in [] if args.default_only else settings(d, t):
            launch = pa.plan(b, h, hkv, t, d, span, dev, block_s=block_s, block_r=block_r, waves=waves, num_warps=warps, num_stages=stages)
            try:
                err = float((run(launch).float() - reference).abs().max())
                us = timed(lambda: run(launch), reps=1)  # noqa: B023 - timed now
            except Exception as exc:  # noqa: BLE001 - a setting the GPU cannot run (shared memory) is skipped
                print(f"  {launch}: failed ({str(exc).splitlines()[0][:120]})", flush=True)
                continue
            ok = err < 2e-2
            rows.append(dict(shape=name, block_s=launch.block_s, block_r=launch.block_r, splits=launch.splits, warps=warps,
                             stages=launch.num_stages, us=us, vs_default=base_us / us, err=err, ok=ok))
        for r in sorted(rows, key=lambda r: r["us"]):
            print(f"  block_s {r['block_s']:3d} block_r {r['block_r']:3d} splits {r['splits']:2d} warps {r['warps']} stages {r['stages']}: "
                  f"{r['us']:8.1f} us  {r['vs_default']:.2f}x the default  err {r['err']:.1e}{'' if r['ok'] else '  WRONG'}", flush=True)
        results.append(dict(shape=name, default_us=base_us, rows=rows))
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_paged_attention_tune.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
