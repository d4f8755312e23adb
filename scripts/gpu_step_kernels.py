"""The kernels of one target AR step in launch order, and the torch operations behind them.

Random weights of a real shape (benchmark only), one sequence after a 512-token prompt, the
target engine at fixed shapes *eagerly* (no CUDA graph, so the profiler sees the torch operations
that launch each kernel; a graphed step replays the same kernels). Prints the step's kernel count,
kernels ``START`` to ``END`` in launch order with their device microseconds (the prologue that
builds a pass's metadata comes first, then the layers), and the torch operations by count. Used
to find the small launches worth fusing (BENCHMARKS.md).

Usage: python3 scripts/gpu_step_kernels.py [SHAPE] [START] [END]   (default random:qwen35-27b-q4km 0 160)
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.target.engine import TargetEngine, TargetLimits  # noqa: E402
from splitspec.bench.random_weights import random_target  # noqa: E402
from splitspec.spec.sampling import SamplingParams  # noqa: E402


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "random:qwen35-27b-q4km"
    start, end = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0, 160)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, config = random_target(shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    engine = TargetEngine(model, TargetLimits(max_sequences=1, max_tree_nodes=22, max_kv_tokens=2048), fixed_shapes=True, capture=False)
    engine.prefill("p", np.random.default_rng(0).integers(0, config.vocab_size, 512).tolist(), SamplingParams(), reserve_tokens=1500)
    for _ in range(3):
        engine.verify("p", [], [])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.verify("p", [], [])
        if dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    print(f"{shape}: {len(kernels)} kernels in one AR step; {config.num_layers} layers")
    for i, e in enumerate(kernels[start:end], start):
        print(f"  {i:5d} {e.device_time_total:7.1f} us  {e.name[:120]}")
    ops = collections.Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"))
    print("torch operations by count (one step):")
    for name, n in ops.most_common(45):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main()
