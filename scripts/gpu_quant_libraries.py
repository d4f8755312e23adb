"""Quantized matmul on a GPU: our kernels against cuBLAS bf16 and the libraries that could do it.

(The int8-activation ``mmvq`` kernel this script first timed was removed after this comparison;
it is in commit 3cdb1ba. BENCHMARKS.md holds the numbers.)

For each layer shape of Qwen3-8B and Qwen3.5-27B and each row count M, the time of one
``x [M, K] @ W^T`` (inside a CUDA graph of 20 calls, so launches cost what they cost in the model)
and the bandwidth it reaches on the weight's packed bytes, for:

- ``bf16``: ``F.linear`` on a bfloat16 copy (cuBLAS): what dequantizing at load gives;
- ``gguf_matmul``: the float-expanding Triton kernels of ``native.gguf_matmul``;
- ``int4pack``: PyTorch's own int4 weight-only kernel (``torch._weight_int4pack_mm``, tinygemm),
  Q4_K converted to its group-32 bfloat16 scale and zero (not exact: bf16 scales);
- ``gemlite``: the gemlite package's A16W4 Triton kernels, group 32, fp16 scales and zeros.

Run from the repository root: ``python scripts/gpu_quant_libraries.py``; gemlite from ``.whl/bench`` if present.
Weights are random GGUF blocks (benchmark only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from native.gguf_dequant import dequantize  # noqa: E402
from native.gguf_matmul import gguf_matmul, gguf_matmul_reference  # noqa: E402

SHAPES = {  # name: (N, K)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
    "8b.lm_head": (151936, 4096),
    "27b.attn_qkv": (10240, 5120), "27b.gate_up": (34816, 5120), "27b.down": (5120, 17408), "27b.lm_head": (248320, 5120),
}
ROWS = (1, 2, 4, 8, 16, 23, 32)


SCALE_BYTES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,), Q.IQ4_XS: (0,)}  # a block's f16 fields


def random_blocks(qtype: Q, n: int, k: int, device) -> torch.Tensor:
    """Random GGUF blocks with small finite f16 scales (benchmark weights) of any kernel type."""
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n, k // values, nbytes), dtype=torch.uint8, device=device)
    scale = torch.full((n, k // values), 2e-3, dtype=torch.float16, device=device).view(torch.uint8).view(n, k // values, 2)
    for offset in SCALE_BYTES[qtype]:
        raw[..., offset : offset + 2] = scale
    return raw.view(n, -1)


def timed(fn, reps: int = 20, graphs: bool = True) -> float:
    """Microseconds per call, replaying a CUDA graph of ``reps`` calls (eager if capture fails)."""
    fn()
    torch.cuda.synchronize()
    if graphs:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
            g.replay()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t0) / reps)
            return best * 1e6
        except Exception as exc:  # noqa: BLE001
            print(f"  (graph capture failed: {type(exc).__name__}: {exc}; eager)", file=sys.stderr)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def copy_bandwidth(device) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a), reps=10)
    return 2 * a.numel() / (us * 1e-6)


def int4pack(raw: torch.Tensor, n: int, k: int):
    """Q4_K -> torch's int4pack (group 32): w = (q - 8) * scale + zero with scale = d sc, zero = 8 d sc - dmin m."""
    blocks = raw.view(n, k // 256, 144)
    one = torch.zeros_like(blocks)
    one[..., :2] = blocks[..., :2]  # d only, dmin 0, q = 1 everywhere: dequantizes to d * sc
    one[..., 4:16] = blocks[..., 4:16]
    one[..., 16:] = 0x11
    scale = dequantize(one.view(n, -1), Q.Q4_K, (n, k)).view(n, k // 32, 32)[..., 0]  # [N, K/32]
    mins = blocks.clone()
    mins[..., :2] = 0
    mins[..., 16:] = 0
    neg_min = dequantize(mins.view(n, -1), Q.Q4_K, (n, k)).view(n, k // 32, 32)[..., 0]  # -dmin m
    q = blocks[..., 16:].view(n, k // 256, 4, 32)
    values = torch.stack([q & 15, q >> 4], dim=3).reshape(n, k)  # [N, K] 0..15
    packed = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
    w = torch._convert_weight_to_int4pack(packed.contiguous(), 8)
    zeros = 8 * scale + neg_min
    sz = torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    return lambda x: torch._weight_int4pack_mm(x, w, 32, sz)


def gemlite_linear(raw: torch.Tensor, n: int, k: int):
    from gemlite.core import DType, GemLiteLinearTriton

    blocks = raw.view(n, k // 256, 144)
    w = dequantize(raw, Q.Q4_K, (n, k)).view(n, k // 32, 32)
    q = blocks[..., 16:].view(n, k // 256, 4, 32)
    values = torch.stack([q & 15, q >> 4], dim=3).reshape(n, k // 32, 32).float()
    # w = (q - zero) * scale: scale from two distinct q of a group, zero from one
    lo, hi = values.argmin(-1, keepdim=True), values.argmax(-1, keepdim=True)
    span = (values.gather(-1, hi) - values.gather(-1, lo)).clamp(min=1)
    scale = (w.gather(-1, hi) - w.gather(-1, lo)) / span
    zero = values.gather(-1, lo) - w.gather(-1, lo) / scale.where(scale != 0, torch.ones_like(scale))
    layer = GemLiteLinearTriton(W_nbits=4, group_size=32, in_features=k, out_features=n, input_dtype=DType.BF16, output_dtype=DType.BF16)
    layer.pack(values.view(n, k).to(torch.uint8), scale.view(n, -1).half(), zero.view(n, -1).half(), None)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bw / 1e12:.2f} TB/s")
    shapes = [s for s in SHAPES if not args.shapes or s in args.shapes.split(",")]
    rows = tuple(int(r) for r in args.rows.split(","))
    results = []
    for qtype in [Q[t] for t in args.types.split(",")]:
        for name in shapes:
            n, k = SHAPES[name]
            raw = random_blocks(qtype, n, k, device)
            nbytes = raw.numel()
            w16 = dequantize(raw, qtype, (n, k)).to(torch.bfloat16)
            packers = {}
            if qtype == Q.Q4_K:
                for lib, make in (("int4pack", int4pack), ("gemlite", gemlite_linear)):
                    try:
                        packers[lib] = make(raw, n, k)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{lib} unavailable for {name}: {type(exc).__name__}: {str(exc)[:200]}")
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                row = {"type": qtype.name, "shape": name, "N": n, "K": k, "M": m, "bytes": nbytes}
                ref = gguf_matmul_reference(x.float(), raw, qtype, n)
                yg = gguf_matmul(x, raw, qtype, n).float()
                row["gguf_matmul_err_ref"] = ((yg - ref).abs().max() / ref.abs().max()).item()
                row["bf16_us"] = timed(lambda: F.linear(x, w16))
                row["gguf_matmul_us"] = timed(lambda: gguf_matmul(x, raw, qtype, n))
                for lib, fn in packers.items():
                    try:
                        yl = fn(x).float()
                        row[f"{lib}_err_ref"] = ((yl - ref).abs().max() / ref.abs().max()).item()
                        row[f"{lib}_us"] = timed(lambda: fn(x))
                    except Exception as exc:  # noqa: BLE001
                        print(f"{lib} M={m} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                results.append(row)
                libs = "  ".join(f"{lib} {row.get(lib + '_us', float('nan')):7.1f}" for lib in packers)
                print(
                    f"{qtype.name} {name:13s} M={m:2d}  bf16 {row['bf16_us']:7.1f}  gguf_matmul {row['gguf_matmul_us']:7.1f}  "
                    f"{libs}  err vs reference: gguf_matmul {row['gguf_matmul_err_ref']:.1e}",
                    flush=True,
                )
            w16 = raw = packers = None  # free before the next shape
            torch.cuda.empty_cache()
    out = Path(sys.argv[0]).resolve().parent.parent / "out"
    import os

    dest = Path(os.environ.get("OUT", out))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "gpu_quant_libraries.json").write_text(json.dumps({"copy_bw": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
