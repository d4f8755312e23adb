"""Check the GGUF-block matmul kernels (native.gguf_matmul) on a GPU and sweep their tilings.

Usage (on a CUDA machine): python3 scripts/gpu_gguf_matmul.py [--dtype bfloat16] [--reps 25] [--quick] [--types Q5_K,IQ4_XS]
For Qwen3-8B's linear shapes, each weight type (``--types``, default every kernel type: Q8_0, Q4_K,
Q5_K, Q6_K, IQ4_XS) and M in {1, 4, 16, 23, 33, 65}, every candidate
tiling of CANDIDATES (the GEMV kernel for small M, ``tl.dot`` tiles for larger M; ``default_tiling``
always among them) is checked against the torch reference (dequantize, then F.linear in x's dtype)
and timed: the median of ``--reps`` calls (CUDA events), each after a 256 MiB write that evicts the
weights from L2, as a decode step finds them. Printed per shape and M: the default's time, the
fastest candidate, the GB/s of quantized bytes, the percent of the device's copy bandwidth (read +
write of a 1 GiB tensor) and the speed-up over F.linear on the dequantized bf16 weight. Then, per
weight type and M, the candidate with the least time over one Qwen3-8B decode step (36 layers of
q/k/v/o/gate/up/down plus the LM head), which is what ``default_tiling`` should pick; a PASS/FAIL
line (every candidate within tolerance, the default's split-K bit-identical on a rerun); the rows
as JSON in $OUT/gguf_matmul.json when OUT is set. About 1 minute per type on an H100/H200, most
of it compiling the ~20 kernel variants of each; ``--quick`` times M = 1 and 16 only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from torch.nn import functional as F

from native.gguf_dequant import dequantize
from native.gguf_matmul import KERNEL_TYPES, Tiling, default_tiling, gguf_matmul, gguf_matmul_reference, row_bytes

sys.path.insert(0, str(Path(__file__).parents[1]))  # the checkout: tests.kquants
from tests.kquants import quantize_k  # noqa: E402  (the test-only K-quant writer)

# Qwen3-8B: label -> (K, N, times per decode step: 36 layers, one LM head).
SHAPES = {
    "q/o": (4096, 4096, 72), "k/v": (4096, 1024, 72), "gate/up": (4096, 12288, 72), "down": (12288, 4096, 36),
    "lm_head": (4096, 151936, 1),
}
MS = (1, 4, 16, 23, 33, 65)
GEMV = [Tiling(8, 512, 4, gemv=True), Tiling(4, 512, 4, gemv=True), Tiling(16, 512, 4, gemv=True),
        Tiling(8, 1024, 4, gemv=True), Tiling(16, 1024, 8, gemv=True), Tiling(4, 1024, 2, gemv=True), Tiling(32, 256, 4, gemv=True)]
DOT = [Tiling(64, 128, 4), Tiling(32, 128, 4), Tiling(64, 64, 4), Tiling(32, 64, 8)]


def candidates(m: int, qtype: Q) -> list[Tiling]:
    """The tilings timed for m rows: GEMV ones for one row, tl.dot ones above (and one GEMV up
    to 4 rows, to see where the tl.dot tiles take over); the default first."""
    pool = GEMV if m == 1 else DOT + (GEMV[:1] if m <= 4 else [])
    default = default_tiling(m, qtype)
    return [default] + [t for t in pool if t != default]


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # relative to the largest output


def random_blocks(qtype: Q, n: int, k: int, device: torch.device) -> torch.Tensor:
    """Valid packed rows [n, row_bytes]: 64 quantized random rows, tiled and shuffled (quantizing
    a 150k-row matrix on the CPU would take minutes). Q8_0 by gguf's quantizer, the others by the
    test-only one (tests.kquants)."""
    values = np.random.default_rng(int(qtype)).standard_normal((64, k)).astype(np.float32) * 0.05
    tile = quantize(values, qtype) if qtype == Q.Q8_0 else quantize_k(values, qtype)
    raw = torch.from_numpy(tile).to(device).repeat((n + 63) // 64, 1)[:n].contiguous()
    assert raw.shape == (n, row_bytes(qtype, k))
    return raw[torch.randperm(n, device=device)].contiguous()


class Timer:
    """Median device time of a call with a cold L2: each timed call follows a write of 256 MiB."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.reps = reps

    def __call__(self, fn) -> float:
        fn()  # compile / warm up
        events = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3  # us


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = Timer(device, 10)(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return ((ours.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="M = 1 and 16 only")
    p.add_argument("--types", default=",".join(t.name for t in sorted(KERNEL_TYPES, key=int)),
                   help="comma-separated weight types to check and time (default: every kernel type)")
    args = p.parse_args()
    qtypes = [Q[name] for name in args.types.split(",")]
    if not set(qtypes) <= KERNEL_TYPES:
        p.error(f"--types: kernels exist for {', '.join(t.name for t in sorted(KERNEL_TYPES, key=int))} only")
    started = time.time()
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    ms = (1, 16) if args.quick else MS
    timer = Timer(device, args.reps)
    roofline = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}; x {args.dtype}; copy bandwidth {roofline:.0f} GB/s (the roofline below)")
    print(f"{'type':5s} {'shape':8s} {'K':>6s} {'N':>7s} {'M':>3s} {'default us':>10s} {'best us':>8s} {'GB/s':>6s} {'%roof':>5s} "
          f"{'bf16 us':>8s} {'x bf16':>6s} {'x bf16 (best)':>13s}  best tiling")
    rows, ok, failures = [], True, []
    for qtype in qtypes:
        for label, (k, n, _) in SHAPES.items():
            raw = random_blocks(qtype, n, k, device)
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype)
                expected = gguf_matmul_reference(x, raw, qtype, n)
                timed = []
                for tiling in candidates(m, qtype):
                    error = relative_error(gguf_matmul(x, raw, qtype, n, tiling), expected)
                    if not error < TOLERANCE[dtype]:
                        ok = False
                        failures.append(f"{qtype.name} {label} M={m} {tiling}: error {error:.2e}")
                    timed.append({"tiling": tiling.__dict__, "us": timer(lambda: gguf_matmul(x, raw, qtype, n, tiling)), "rel_error": error})
                first, again = gguf_matmul(x, raw, qtype, n), gguf_matmul(x, raw, qtype, n)
                if not torch.equal(first, again):
                    ok = False
                    failures.append(f"{qtype.name} {label} M={m}: the default gave different bits on a rerun")
                xb = x.to(torch.bfloat16)
                dense_us = timer(lambda: F.linear(xb, w16))
                best = min(timed, key=lambda c: c["us"])
                default_us = timed[0]["us"]
                gbs = raw.numel() / best["us"] / 1e3
                row = {"type": qtype.name, "shape": label, "K": k, "N": n, "M": m, "dtype": args.dtype,
                       "quantized_bytes": raw.numel(), "default_tiling": default_tiling(m, qtype).__dict__, "default_us": default_us,
                       "best_tiling": best["tiling"], "best_us": best["us"], "best_GBps": gbs, "percent_of_copy_bw": 100 * gbs / roofline,
                       "bf16_linear_us": dense_us, "bf16_linear_GBps": w16.numel() * 2 / dense_us / 1e3, "candidates": timed}
                rows.append(row)
                print(f"{qtype.name:5s} {label:8s} {k:6d} {n:7d} {m:3d} {default_us:10.1f} {best['us']:8.1f} {gbs:6.0f} "
                      f"{row['percent_of_copy_bw']:5.1f} {dense_us:8.1f} {dense_us / default_us:5.2f}x {dense_us / best['us']:12.2f}x  "
                      f"{Tiling(**best['tiling'])}", flush=True)
            raw = w16 = None  # free this shape's tensors before the next one's
            torch.cuda.empty_cache()
    print("\nPer weight type and M: time of one Qwen3-8B decode step's linears (36 layers + LM head), "
          "default vs the best single candidate, and bf16 F.linear")
    summary = []
    for qtype in qtypes:
        for m in ms:
            mine = [r for r in rows if r["type"] == qtype.name and r["M"] == m]
            weight = {r["shape"]: SHAPES[r["shape"]][2] for r in mine}
            totals: dict[str, float] = {}
            for r in mine:
                for c in r["candidates"]:
                    key = repr(Tiling(**c["tiling"]))
                    totals[key] = totals.get(key, 0.0) + weight[r["shape"]] * c["us"]
            best_key = min(totals, key=totals.get)
            default_key = repr(default_tiling(m, qtype))
            dense = sum(weight[r["shape"]] * r["bf16_linear_us"] for r in mine)
            summary.append({"type": qtype.name, "M": m, "default": default_key, "default_step_us": totals[default_key],
                            "best": best_key, "best_step_us": totals[best_key], "bf16_step_us": dense})
            print(f"{qtype.name:5s} M={m:3d}  default {totals[default_key] / 1e3:7.2f} ms  best {totals[best_key] / 1e3:7.2f} ms "
                  f"({best_key})  bf16 {dense / 1e3:7.2f} ms  -> {dense / totals[best_key]:.2f}x")
    for failure in failures:
        print("  failed:", failure)
    print(("PASS" if ok else "FAIL") + f": every candidate within {TOLERANCE[dtype]:g} of the reference and the default "
          f"deterministic ({len(rows)} shapes x M; {time.time() - started:.0f} s)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gguf_matmul.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "copy_GBps": roofline, "dtype": args.dtype,
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
