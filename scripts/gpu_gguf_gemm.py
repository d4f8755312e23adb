"""GPU check and timing of ``native.gguf_gemm`` (Q4_K/Q6_K tiles expanded in shared memory) against
what ``gguf_matmul`` runs without it, to set the rows it takes.

1. Check, per type, on odd shapes, row counts, block rows and splits: the result's error against
   float32 x @ W^T, W the dequantized weight rounded to bf16, at most F.linear's own on that bf16 W
   plus 2^-8 of each row's largest (the expanded path's criterion, ``gpu_gguf_expand.py``), and
   bitwise equal on a rerun; x given as an unaligned view as well.
2. Timing (a CUDA graph of 20 calls, best of 5), per type, layer shape and M: ``gemm`` (default
   block rows and splits, and each block-row size), ``before`` (``gguf_matmul`` without it:
   ``gguf_mma`` up to 64 rows, expanded tiles on cuBLAS above), ``bf16`` (F.linear on a bf16 copy)
   and ``one_row`` (``gguf_mma`` at one row, the decode step's call). Then, per type, the row
   counts where ``gemm`` is faster than ``before`` over the sum of the shapes.

Weights are random GGUF blocks (benchmark only). Prints PASS/FAIL; writes ``$OUT/gpu_gguf_gemm.json``.
Usage: python scripts/gpu_gguf_gemm.py [--types Q4_K,Q6_K] [--shapes 27b.gate_up,...] [--rows 23,64,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quant_libraries import SHAPES, random_blocks, timed  # noqa: E402

from native import gguf_gemm, gguf_mma  # noqa: E402
from native.gguf_dequant import dequantize  # noqa: E402
from native.gguf_matmul import gguf_matmul  # noqa: E402

CHECK_SHAPES = ((4100, 5120), (72, 256), (33, 2560), (1000, 17408))  # (N, K)


def error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of a row relative to that row's largest magnitude."""
    return ((y.float() - exact).abs().amax(1) / exact.abs().amax(1).clamp(min=1e-30)).max().item()


def check(device: torch.device, types: list[Q]) -> list[str]:
    failed = []
    for qtype in types:
        for n, k in CHECK_SHAPES:
            raw = random_blocks(qtype, n, k, device)
            w = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            for m in (17, 33, 64, 100, 300):
                big = torch.randn(m, k + 8, device=device, dtype=torch.bfloat16)
                for x in (big[:, :k].contiguous(), big[:, 8:], big[:, 1:k + 1]):  # aligned; 16 bytes in, stride k + 8; unaligned (copied)
                    ref, exact = F.linear(x, w), x.float() @ w.float().T
                    ref_err = error(ref, exact)
                    for bm in (32, 64):
                        for splits in (1, 3):
                            y = gguf_gemm.matmul(x, raw, qtype, n, bm, splits)
                            again = gguf_gemm.matmul(x, raw, qtype, n, bm, splits)
                            err = error(y, exact)
                            good = err <= ref_err + 2**-8 and torch.equal(y, again)
                            if not good or (m == 100 and bm == 64 and splits == 3):
                                line = (f"check {qtype.name} N={n} K={k} M={m} bm={bm} splits={splits} view={x.data_ptr() != big.data_ptr()}: "
                                        f"err {err:.1e} (F.linear's {ref_err:.1e}), repeats {torch.equal(y, again)}")
                                print(line + ("" if good else " FAIL"), flush=True)
                                failed += [] if good else [line]
            y = gguf_matmul(torch.randn(90, k, device=device, dtype=torch.bfloat16), raw, qtype, n)  # the default route runs
            assert y.shape == (90, n)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="8b.qkv,8b.gate_up,8b.down,27b.attn_qkv,27b.gate_up,27b.down")
    ap.add_argument("--rows", default="17,23,32,33,48,64,96,128,160,256,512")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    types = [Q[t] for t in args.types.split(",")]
    failed = [] if args.skip_check else check(device, types)
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results, faster = [], {}
    for qtype in types:
        totals: dict[int, dict[str, float]] = {}
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            raw = random_blocks(qtype, n, k, device)
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            x1 = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            one_row = timed(lambda: gguf_mma.matmul(x1, raw, qtype, n))
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                row = {"type": qtype.name, "shape": name, "N": n, "K": k, "M": m, "one_row": one_row,
                       "gemm": timed(lambda: gguf_gemm.matmul(x, raw, qtype, n)),
                       "gemm32": timed(lambda: gguf_gemm.matmul(x, raw, qtype, n, 32)),
                       "gemm64": timed(lambda: gguf_gemm.matmul(x, raw, qtype, n, 64)),
                       "before": timed(lambda: gguf_matmul(x, raw, qtype, n)),
                       "bf16": timed(lambda: F.linear(x, w16))}
                results.append(row)
                for var in ("gemm", "before"):
                    totals.setdefault(m, {}).setdefault(var, 0.0)
                    totals[m][var] += row[var]
                print(f"{qtype.name:5s} {name:13s} M={m:3d}  gemm {row['gemm']:7.1f} us ({2 * m * n * k / row['gemm'] / 1e6:4.0f} TFLOP/s, "
                      f"{raw.numel() / row['gemm'] / 1e6:4.2f} TB/s)  bm32 {row['gemm32']:7.1f}  bm64 {row['gemm64']:7.1f}  "
                      f"before {row['before']:7.1f}  bf16 {row['bf16']:7.1f}  before/gemm {row['before'] / row['gemm']:5.2f}  "
                      f"gemm/one_row {row['gemm'] / one_row:5.2f} (one row {one_row:.1f})", flush=True)
            raw = w16 = None
            torch.cuda.empty_cache()
        faster[qtype.name] = [m for m in rows if totals[m]["gemm"] < totals[m]["before"]]
        print(f"{qtype.name}: gemm faster over the shapes at M = {faster[qtype.name]} (of {rows})", flush=True)
    dest = Path(os.environ.get("OUT", "out"))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "gpu_gguf_gemm.json").write_text(json.dumps({"rows": results, "faster": faster}, indent=1))
    print("\n".join(failed + ["FAIL" if failed else "PASS"]))


if __name__ == "__main__":
    main()
