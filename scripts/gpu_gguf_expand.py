"""GPU check and timing of ``native.gguf_expand`` (W expanded a tile at a time, multiplied on cuBLAS)
against the in-register kernels it replaces for many rows, to set ``gguf_expand.MIN_ROWS``.

1. Check, per type (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS): bf16 expansion of rows [first, end) of a
   (4100, 5120) weight equals ``gguf_dequant.dequantize(...).to(bfloat16)`` bit for bit;
   ``gguf_matmul`` of 65 and 300 rows (the expanded path, whole weight and three tiles) against
   F.linear on that bf16 W (what a dequantized bf16 model computes): bitwise equal for the whole
   weight (the same cuBLAS call); for tiles (cuBLAS may pick another kernel for a tile's N), its
   error against float32 x @ W^T at most F.linear's own plus 2^-8 of each row's largest (one more
   bf16 rounding); bitwise equal on a rerun.
2. Timing (a CUDA graph of 20 calls, best of 5), per type, layer shape and M: ``expand`` (this
   path), ``kernel`` (what ``gguf_matmul`` runs without it: ``gguf_mma`` for Q4_K/Q6_K up to 64
   rows, else the Triton kernels' default tiling), ``bf16`` (F.linear on a bf16 copy: a
   dequantized model's matmul) and ``expand_only`` (the expansion of the whole weight, no product).
   Then, per type, the fewest rows from which ``expand`` is faster than ``kernel`` over the sum of
   the shapes at every larger M timed: the ``MIN_ROWS`` it suggests.

Weights are random GGUF blocks (benchmark only). Prints PASS/FAIL; writes ``$OUT/gpu_gguf_expand.json``.
Usage: python scripts/gpu_gguf_expand.py [--types Q4_K,...] [--shapes 27b.gate_up,...] [--rows 2,8,...]
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

from gpu_quant_libraries import SHAPES, copy_bandwidth, random_blocks, timed  # noqa: E402

from native import gguf_expand, gguf_mma  # noqa: E402
from native.gguf_blocks import levels  # noqa: E402
from native.gguf_dequant import dequantize  # noqa: E402
from native.gguf_matmul import KERNEL_TYPES, default_tiling, gguf_matmul  # noqa: E402

TYPES = "Q4_K,Q6_K,Q5_K,Q8_0,IQ4_XS"


def error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of a row relative to that row's largest magnitude."""
    return ((y.float() - exact).abs().amax(1) / exact.abs().amax(1).clamp(min=1e-30)).max().item()


def check(device: torch.device, types: list[Q]) -> list[str]:
    """Each check's line printed; the failed ones returned."""
    failed = []
    n, k = 4100, 5120
    for qtype in types:
        raw = random_blocks(qtype, n, k, device)
        w = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
        table = levels(device)
        for first, end in ((0, n), (7, 3001)):
            out = torch.empty(end - first, k, dtype=torch.bfloat16, device=device)
            same = torch.equal(gguf_expand.expand(raw, qtype, table, first, end, out), w[first:end])
            line = f"check {qtype.name} expand rows [{first}, {end}): {'bit-identical' if same else 'FAIL'}"
            print(line, flush=True)
            failed += [] if same else [line]
        saved = gguf_expand.TILE_BYTES
        for tile in (None, 1400):
            gguf_expand.TILE_BYTES = tile * k * 2 if tile else saved
            for m in (65, 300):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                ref, exact = F.linear(x, w), x.float() @ w.float().T
                y, again = gguf_matmul(x, raw, qtype, n), gguf_matmul(x, raw, qtype, n)
                err, ref_err = error(y, exact), error(ref, exact)
                line = (f"check {qtype.name} matmul M={m} tile={tile or 'whole'}: err {err:.1e} (F.linear's {ref_err:.1e}), "
                        f"equal to F.linear {torch.equal(y, ref)}, repeats its bits {torch.equal(y, again)}")
                good = (torch.equal(y, ref) if tile is None else err <= ref_err + 2**-8) and torch.equal(y, again)
                print(line + ("" if good else " FAIL"), flush=True)
                failed += [] if good else [line]
        gguf_expand.TILE_BYTES = saved
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--shapes", default="8b.qkv,8b.gate_up,8b.down,27b.attn_qkv,27b.gate_up,27b.down")
    ap.add_argument("--rows", default="2,8,23,64,65,128,256,512")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    types = [Q[t] for t in args.types.split(",")]
    assert set(types) <= KERNEL_TYPES
    failed = [] if args.skip_check else check(device, types)
    if args.check_only:
        print("\n".join(failed + ["FAIL" if failed else "PASS"]))
        return
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results, suggested = [], {}
    for qtype in types:
        totals: dict[int, dict[str, float]] = {}
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            raw = random_blocks(qtype, n, k, device)
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            table = levels(device)
            tile = torch.empty(gguf_expand.tile_rows(n, k, 2), k, dtype=torch.bfloat16, device=device)
            expand_only = timed(lambda: [gguf_expand.expand(raw, qtype, table, f, min(f + len(tile), n), tile) for f in range(0, n, len(tile))])
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                if gguf_mma.usable(x, raw, qtype):
                    kernel = lambda: gguf_mma.matmul(x, raw, qtype, n)  # noqa: E731
                else:
                    kernel = lambda: gguf_matmul(x, raw, qtype, n, tiling=default_tiling(m, qtype))  # noqa: E731
                row = {"type": qtype.name, "shape": name, "N": n, "K": k, "M": m, "bytes": raw.numel(), "expand_only": expand_only,
                       "expand": timed(lambda: gguf_expand.matmul(x, raw, qtype, n, table)), "kernel": timed(kernel),
                       "bf16": timed(lambda: F.linear(x, w16))}
                results.append(row)
                for var in ("expand", "kernel"):
                    totals.setdefault(m, {}).setdefault(var, 0.0)
                    totals[m][var] += row[var]
                tflops = 2 * m * n * k / row["expand"] / 1e6
                print(f"{qtype.name:6s} {name:13s} M={m:3d}  expand {row['expand']:8.1f} us ({tflops:5.0f} TFLOP/s)  kernel {row['kernel']:8.1f}  "
                      f"bf16 {row['bf16']:8.1f}  expand_only {expand_only:7.1f} ({(raw.numel() + 2 * n * k) / expand_only / 1e6:4.2f} TB/s)  "
                      f"kernel/expand {row['kernel'] / row['expand']:5.2f}", flush=True)
            raw = w16 = tile = None
            torch.cuda.empty_cache()
        faster = [m for m in rows if all(totals[r]["expand"] < totals[r]["kernel"] for r in rows if r >= m)]
        suggested[qtype.name] = min(faster) if faster else None
        print(f"{qtype.name}: expand faster over the shapes from M = {suggested[qtype.name]} on (of {rows})", flush=True)
    dest = Path(os.environ.get("OUT", "out"))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "gpu_gguf_expand.json").write_text(json.dumps({"copy_bw": bw, "rows": results, "suggested_min_rows": suggested}, indent=1))
    print("\n".join(failed + ["FAIL" if failed else "PASS"]))


if __name__ == "__main__":
    main()
