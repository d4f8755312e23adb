"""Q4_K's and Q6_K's tensor-core matmuls (interleaved blocks, the serving layout) by split count: how many
programs share each 64-feature tile's K range (``native.gguf_mma.a_operand_splits`` chooses one per
shape, the same for every row count, so that a verify pass's rows sum as a decode step's do).

Random blocks of the 27B and 8B layer shapes (benchmark-only), 1 and 23 rows, µs a call
(``triton.testing.do_bench``, three copies of the weights taken in turn). With ``--once`` each
shape's default call runs three times untimed, for a profiler:
``ncu --clock-control none -k regex:q4k_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight
--section WarpStateStats --section Occupancy --section LaunchStats python3 scripts/gpu_mma_splits.py --once --shapes 27b.gate_up``.

Usage: python3 scripts/gpu_mma_splits.py [--types Q4_K,Q6_K] [--shapes 27b.gate_up,27b.down,8b.gate_up,27b.qkv]
       [--splits 1,2,3,4,5] [--once]   (GPU only; the ncu filter of a Q6_K call: regex:q6k_kernel)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from gguf import GGMLQuantizationType as Q
from gpu_quant_libraries import random_blocks  # this folder is on the path of a script run from it

from native import gguf_mma, sm_count
from native.gguf_matmul import interleave

SHAPES = {"27b.gate_up": (2 * 17408, 5120), "27b.down": (5120, 17408), "8b.gate_up": (2 * 12288, 4096), "27b.qkv": (10240, 5120)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K", help="Q4_K, Q6_K or both (a Q4_K_M file's 27B down and q/k/v are Q6_K in half its layers)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--splits", default="1,2,3,4,5")
    parser.add_argument("--once", action="store_true", help="run each shape's default call three times, untimed (for ncu)")
    args = parser.parse_args()
    for qtype, name in itertools.product([Q[t] for t in args.types.split(",")], args.shapes.split(",")):
        n, k = SHAPES[name]
        weights = [interleave(random_blocks(qtype, n, k, "cuda"), qtype) for _ in range(3)]
        default = gguf_mma.a_operand_splits(-(-n // gguf_mma.A_OPERAND_FEATURES), k // 256, sm_count(weights[0].device))
        for m in (1, 23):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if args.once:
                for w in weights:
                    gguf_mma.matmul(x, w, qtype, n, interleaved=True)
                continue
            row = []
            for splits in map(int, args.splits.split(",")):
                turn = itertools.cycle(weights)
                us = 1e3 * triton.testing.do_bench(
                    lambda: gguf_mma.matmul(x, next(turn), qtype, n, splits=splits, interleaved=True), warmup=50, rep=300)
                row.append(f"s{splits} {us:6.1f}")
            print(f"{qtype.name} {name:12s} M={m:2d} (default {default} splits): " + "  ".join(row), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
