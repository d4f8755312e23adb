"""Check and time the GGUF-block matmul kernels (splitspec.native.gguf_matmul) on a GPU.

Usage (on a CUDA machine): python3 scripts/gpu_gguf_matmul.py [--dtype bfloat16] [--iters 50] [--sweep]
For Qwen3-8B's linear shapes, each weight type and M in {1, 16, 23, 33, 65}: the kernel's largest
error relative to the torch reference (dequantize, then F.linear in x's dtype), its median time
per call (CUDA events), the GB/s of quantized bytes that time implies, and the same time for
F.linear on the dequantized bf16 weight. The device's copy bandwidth (read + write of a 1 GiB
tensor) is the roofline the percentages refer to. Prints a table and one PASS/FAIL line; writes
the rows as JSON to $OUT/gguf_matmul.json when OUT is set. Takes well under two minutes.
``--sweep`` also times a few other tilings for M = 1 and 16 (about a minute more) and reports
the fastest per shape, to tune ``default_tiling``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from torch.nn import functional as F

from splitspec.models.dequant import dequantize
from splitspec.native.gguf_matmul import KERNEL_TYPES, Tiling, default_tiling, gguf_matmul, gguf_matmul_reference, row_bytes

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from kquants import quantize_k  # noqa: E402  (the test-only K-quant writer)

SHAPES = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096), "lm_head": (4096, 151936)}  # K, N
MS = (1, 16, 23, 33, 65)
SWEEP = {
    1: [Tiling(16, 256, 4), Tiling(32, 256, 4), Tiling(64, 256, 8), Tiling(32, 128, 4), Tiling(64, 128, 4), Tiling(16, 256, 2)],
    16: [Tiling(32, 128, 4), Tiling(64, 128, 4), Tiling(64, 256, 8), Tiling(128, 64, 8), Tiling(32, 256, 4)],
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # relative to the largest output


def random_blocks(qtype: Q, n: int, k: int, device: torch.device) -> torch.Tensor:
    """Valid packed rows [n, row_bytes]: 64 quantized random rows, tiled and shuffled (quantizing
    a 150k-row matrix on the CPU would take minutes)."""
    values = np.random.default_rng(int(qtype)).standard_normal((64, k)).astype(np.float32) * 0.05
    tile = quantize(values, qtype) if qtype == Q.Q8_0 else quantize_k(values, qtype)
    raw = torch.from_numpy(tile).to(device).repeat((n + 63) // 64, 1)[:n].contiguous()
    assert raw.shape == (n, row_bytes(qtype, k))
    return raw[torch.randperm(n, device=device)].contiguous()


def median_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / ms / 1e6


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time the tilings of SWEEP for M = 1 and 16")
    args = p.parse_args()
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    roofline = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}; x {args.dtype}; copy bandwidth {roofline:.0f} GB/s (the roofline below)")
    print(f"{'type':5s} {'shape':8s} {'K':>6s} {'N':>7s} {'M':>3s} {'rel.err':>8s} {'kernel us':>9s} {'GB/s':>6s} {'%roof':>5s} {'bf16 us':>8s} {'speed-up':>8s}")
    rows, ok = [], True
    for qtype in sorted(KERNEL_TYPES, key=int):
        for label, (k, n) in SHAPES.items():
            raw = random_blocks(qtype, n, k, device)
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            for m in MS:
                x = torch.randn(m, k, device=device, dtype=dtype)
                ours = gguf_matmul(x, raw, qtype, n)
                expected = gguf_matmul_reference(x, raw, qtype, n)
                error = ((ours.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                ok &= error < TOLERANCE[dtype]
                kernel_ms = median_ms(lambda: gguf_matmul(x, raw, qtype, n), args.iters)
                xb = x.to(torch.bfloat16)
                dense_ms = median_ms(lambda: F.linear(xb, w16), args.iters)
                gbs = raw.numel() / kernel_ms / 1e6
                row = {"type": qtype.name, "shape": label, "K": k, "N": n, "M": m, "dtype": args.dtype, "rel_error": error,
                       "kernel_us": 1e3 * kernel_ms, "kernel_GBps": gbs, "percent_of_copy_bw": 100 * gbs / roofline,
                       "bf16_linear_us": 1e3 * dense_ms, "bf16_linear_GBps": w16.numel() * 2 / dense_ms / 1e6,
                       "quantized_bytes": raw.numel(), "tiling": default_tiling(m).__dict__}
                if args.sweep and m in SWEEP:
                    # Each candidate must be correct too before its time counts.
                    timed = []
                    for t in SWEEP[m]:
                        candidate = gguf_matmul(x, raw, qtype, n, t)
                        ok &= ((candidate.float() - expected.float()).abs().max() / expected.float().abs().max()).item() < TOLERANCE[dtype]
                        timed.append((median_ms(lambda: gguf_matmul(x, raw, qtype, n, t), args.iters), t))
                    best_ms, best = min(timed, key=lambda pair: pair[0])
                    row["sweep"] = [{"tiling": t.__dict__, "us": 1e3 * ms} for ms, t in timed]
                    row["best_tiling"], row["best_us"] = best.__dict__, 1e3 * best_ms
                rows.append(row)
                print(f"{qtype.name:5s} {label:8s} {k:6d} {n:7d} {m:3d} {error:8.1e} {row['kernel_us']:9.1f} {gbs:6.0f} "
                      f"{row['percent_of_copy_bw']:5.1f} {row['bf16_linear_us']:8.1f} {dense_ms / kernel_ms:7.2f}x"
                      + (f"  best {row['best_us']:.1f} us with {row['best_tiling']}" if "best_us" in row else ""), flush=True)
            del raw, w16
            torch.cuda.empty_cache()
    print(("PASS" if ok else "FAIL") + f": every error below {TOLERANCE[dtype]:g} ({len(rows)} shapes)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gguf_matmul.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "copy_GBps": roofline, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
