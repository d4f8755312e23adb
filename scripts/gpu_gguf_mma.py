"""GPU check and timing of ``native.gguf_mma`` (Q4_K, Q6_K and IQ4_XS on tensor cores) against the
Triton ``gguf_matmul`` kernels and cuBLAS on a bf16 copy.

1. Correctness, per type: odd shapes (N not a multiple of the program's features, K of 1-68
   super-blocks), M = 1, 2, 5, 16, 17, 23, 33, 64, splits 1, 3 and the default, x of four kinds
   (normal, times 3e5, times 1e-7, and spread over 1e-4..1e4 along K). Each result is compared
   with x @ W^T in float32 for W as its kernel holds it (``kernel_weights``): dequantized (Q4_K,
   exact), d times sc (q - 32) rounded to fp16 (Q6_K), dequantized and rounded to bf16 (IQ4_XS);
   the kernels' other roundings are the bf16 output and the order of float32 sums (and x as
   scaled fp16 for Q4_K and Q6_K): the bound is 2^-8 of the row's largest magnitude. Every run
   twice, bitwise equal; row 0 of every M bitwise equal to M = 1's; Q4_K's and Q6_K's first
   multiple of 16 rows interleaved (``gguf_matmul.interleave``, as the models hold them on a GPU)
   bitwise equal to the file's layout.
2. Timing (a CUDA graph of 20 calls, best of 5, the calls reading copies of the weight in turn so
   that L2 holds none of it): per 8B/27B layer shape and M, microseconds and bandwidth on the
   packed bytes for ``n_tiles`` 1 and 2 (default splits; ``--min-blocks`` adds builds whose IQ4_XS
   kernel is register-capped; the Q4_K and Q6_K kernels have one shape, so their two columns time
   the same kernel), the Q4_K and Q6_K kernels on interleaved blocks (``mma_il``), the Triton kernels
   (``default_tiling``) and cuBLAS bf16; "x1" is the time over the same variant's M = 1 time.

Weights are random GGUF blocks (benchmark only). Prints PASS/FAIL and writes ``$OUT/gpu_gguf_mma.json``.
Usage: python scripts/gpu_gguf_mma.py [--shapes 27b.gate_up,...] [--rows 1,2,4,8,16,23,32,64]
"""

from __future__ import annotations

import argparse
import itertools
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

from native import gguf_mma  # noqa: E402
from native.gguf_dequant import dequantize  # noqa: E402
from native.gguf_matmul import default_tiling, gguf_matmul, interleavable, interleave  # noqa: E402

CHECK_SHAPES = ((1000, 512), (72, 256), (4100, 17408), (33, 2560))  # (N, K)
CHECK_ROWS = (1, 2, 5, 16, 17, 23, 33, 64)


def x_kinds(k: int, device) -> dict[str, torch.Tensor]:
    """Rows of x as models make them and at the ends of bf16's range (Q4_K and Q6_K take x as fp16
    scaled per 256 values: these check that scaling)."""
    base = torch.randn(max(CHECK_ROWS), k, device=device)
    kinds = {"randn": base, "large": base * 3e5, "small": base * 1e-7,
             "mixed": base * torch.logspace(-4, 4, k, device=device)}
    kinds["randn"][3] = 0  # a row of zeros
    return {name: v.to(torch.bfloat16) for name, v in kinds.items()}


def kernel_weights(raw: torch.Tensor, qtype: Q, n: int, k: int) -> torch.Tensor:
    """W [n, k] float32 as the type's kernel multiplies it (see the module docstring)."""
    w = dequantize(raw, qtype, (n, k)).float()
    if qtype == Q.Q6_K:  # d * sc (q - 32): the integer product (exact in float32) rounded to fp16
        d = raw.view(n, k // 256, 210)[..., 208:].contiguous().view(torch.float16).float()  # [n, k / 256, 1]
        d = d.expand(n, k // 256, 256).reshape(n, k)
        products = torch.where(d != 0, w / d, 0.0)
        return products.half().float() * d
    return w if qtype == Q.Q4_K else w.to(torch.bfloat16).float()


def check(device: torch.device) -> bool:
    ok = True
    for qtype in gguf_mma.MMA_TYPES:
        for n, k in CHECK_SHAPES:
            raw = random_blocks(qtype, n, k, device)
            if qtype == Q.Q4_K:  # d and dmin of each block drawn (random_blocks gives all one value)
                d = (torch.rand(n, k // 256, 2, device=device) * 4e-3 + 1e-4).half()
                raw.view(n, k // 256, -1)[..., :4] = d.view(torch.uint8).view(n, k // 256, 4)
            w = kernel_weights(raw, qtype, n, k)
            for kind, x_all in x_kinds(k, device).items():
                worst = 0.0
                for splits in (1, 3, 0):
                    first_row = None
                    for m in CHECK_ROWS:
                        x = x_all[:m]
                        ref = x.float() @ w.T
                        y = gguf_mma.matmul(x, raw, qtype, n, splits=splits)
                        again = gguf_mma.matmul(x, raw, qtype, n, splits=splits)
                        err = ((y.float() - ref).abs().amax(1) / ref.abs().amax(1).clamp(min=1e-30)).max().item()
                        same = torch.equal(y, again)
                        first_row = y[0].clone() if m == 1 else first_row
                        row_free = torch.equal(y[0], first_row)
                        n16 = n - n % 16  # interleaved (gguf_matmul.interleave): the same bits as the file's layout
                        if n16 and interleavable(raw[:n16], qtype):
                            file_layout = gguf_mma.matmul(x, raw[:n16], qtype, n16, splits=splits)
                            interleaved = gguf_mma.matmul(x, interleave(raw[:n16], qtype), qtype, n16, splits=splits, interleaved=True)
                            same &= torch.equal(interleaved, file_layout)
                        good = err <= 2**-8 and same and row_free
                        ok &= good
                        worst = max(worst, err)
                        if not good:
                            print(f"check {qtype.name} N={n} K={k} x={kind} M={m} splits={splits or 'default'}: err {err:.1e} "
                                  f"deterministic (and interleaved equal) {same} row-independent {row_free} FAIL", flush=True)
                print(f"check {qtype.name} N={n} K={k} x={kind}: largest error {worst:.1e} of a row's largest "
                      f"(M {CHECK_ROWS}, splits 1, 3, default)", flush=True)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b.qkv,8b.gate_up,8b.down,27b.attn_qkv,27b.gate_up,27b.down,27b.lm_head")
    ap.add_argument("--rows", default="1,2,4,8,16,23,32,64")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--min-blocks", type=lambda t: [int(v) for v in t.split(",") if v], default=[],
                    help="also time builds whose IQ4_XS kernel must fit this many blocks a multiprocessor (e.g. 3,4)")
    ap.add_argument("--json", default="gpu_gguf_mma.json", help="file name under $OUT")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    ok = True if args.skip_check else check(device)
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for qtype in [Q[t] for t in args.types.split(",")]:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            raw = random_blocks(qtype, n, k, device)
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            # Copies the timed calls take in turn, 400 MB at least, so that L2 (50 MB) holds none
            # of the weights a call reads, as in a model's step.
            copies = [raw] + [raw.clone() for _ in range(max(3, -(-400_000_000 // raw.numel())) - 1)]
            turn = itertools.cycle(copies)
            interleaved = itertools.cycle([interleave(c, qtype) for c in copies] if interleavable(raw, qtype) else [])
            one = {}
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                variants = {f"mma{t}": (lambda t=t: gguf_mma.matmul(x, next(turn), qtype, n, n_tiles=t)) for t in (1, 2)}
                for mb in args.min_blocks:
                    variants[f"mma_mb{mb}"] = lambda mb=mb: gguf_mma.matmul(x, next(turn), qtype, n, min_blocks=mb)
                if interleavable(raw, qtype):
                    variants["mma_il"] = lambda: gguf_mma.matmul(x, next(interleaved), qtype, n, interleaved=True)
                variants["triton"] = lambda: gguf_matmul(x, next(turn), qtype, n, tiling=default_tiling(m, qtype))
                variants["bf16"] = lambda: F.linear(x, w16)
                row = {"type": qtype.name, "shape": name, "N": n, "K": k, "M": m, "bytes": raw.numel()}
                for var, fn in variants.items():
                    row[var] = timed(fn)
                    one.setdefault(var, row[var])
                results.append(row)
                text = "  ".join(
                    f"{var} {row[var]:6.1f} ({(raw.numel() if var != 'bf16' else 2 * n * k) / row[var] / 1e6:4.2f} TB/s, x1 {row[var] / one[var]:4.2f})"
                    for var in variants)
                print(f"{qtype.name} {name:13s} M={m:2d}  {text}", flush=True)
            raw = w16 = copies = turn = None
            torch.cuda.empty_cache()
    dest = Path(os.environ.get("OUT", "out"))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / args.json).write_text(json.dumps({"copy_bw": bw, "rows": results}, indent=1))
    print("PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
