"""Time one target verify step (engine only, no gRPC) at several tree budgets.

Usage: python3 scripts/bench_verify.py [--model target.gguf | --arch qwen3|qwen35] [--device cpu]
       [--dtype float32] [--state-dtype float32] [--budgets 0,8,22,64] [--context 512] [--threads 1]
Without --model a tiny random target of --arch is written to a temp dir. Trees come from DDTree over
random top-8 draft log-probs (chain seed on), so they have the depth and width of real steps; the
walk accepts only the root (random tokens), so every step re-verifies from the same length.
Prints the median over --steps steps after --warmup, and for hybrid targets the state bytes per node.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from services.target.engine import TargetEngine
from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models.devices import DTYPES, resolve_device, resolve_dtype
from splitspec.models.loader import load_target
from splitspec.models.qwen35 import Qwen35Config, tree_node_bytes
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="")
    p.add_argument("--arch", default="qwen35", choices=["qwen3", "qwen35"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--state-dtype", default="", choices=["", "float32", "bfloat16", "float16"])
    p.add_argument("--budgets", default="0,8,22,64")
    p.add_argument("--context", type=int, default=512, help="prompt length before the timed steps")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = args.model or make_tiny(tempfile.mkdtemp(), TinySpec(architecture=args.arch))[0]
    model, config = load_target(path, device, dtype, DTYPES[args.state_dtype] if args.state_dtype else None)
    if isinstance(config, Qwen35Config):
        node = tree_node_bytes(config, dtype, model.recurrent_dtype(dtype))
        print(f"state bytes per tree node: {node.total} (recurrent {node.recurrent}, conv {node.conv}, kv {node.kv})")
    rng = np.random.default_rng(0)
    engine = TargetEngine(model)
    budgets = [int(b) for b in args.budgets.split(",")]
    reserve = args.context + len(budgets) * (args.warmup + args.steps) + max(budgets) + 1  # each step commits its root
    engine.prefill("bench", rng.integers(0, config.vocab_size, args.context).tolist(), SamplingParams(), reserve_tokens=reserve)
    for budget in budgets:
        top_ids = np.stack([rng.choice(config.vocab_size, 8, replace=False) for _ in range(15)])
        tree = build_ddtree(top_ids, -np.sort(rng.random((15, 8)) * 3, axis=1), budget, chain_seed=True)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        times = []
        for i in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            engine.verify("bench", tokens, parents)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        depth = int(tree.depths.max()) if tree.num_nodes else 0
        print(f"{config.architecture} {str(dtype)[6:]} budget {budget:3d} (depth {depth:2d}): {1000 * np.median(times):7.2f} ms / verify step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
