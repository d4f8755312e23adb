"""Per-kernel device time of the target's graphed AR step and budget-B verify, grouped by kind.

Random weights of a real shape (benchmark only), one sequence with a ``--prompt``-token context,
the engine the target worker runs (fixed shapes, CUDA graphs). For each pass it prints the median
wall time of a step (pass, acceptance walk, commit, read-back), then the profile of ``--reps``
steps: kernels per step, their summed device time, the share of the wall time no kernel ran
(launch gaps and host work), the device time by kind (``KINDS``: the first pattern a kernel's name
contains decides), the most expensive kernels, and where the device sat idle: the idle time a step
between each pair of kernels (the one before, the one after; the step's end and the next step's
start too), the largest pairs first.

With ``--unfused`` the same weights are profiled again with every fused projection
(``layers.fuse_linears``) split back into its layers' own matmuls. With ``--host N`` each pass's
host work is timed by phase over N steps (the engine's prepare, launch, the wait for the device,
settle and finish) and profiled (cProfile, the functions of most own time), the wait left out.

Usage: python3 scripts/gpu_kernel_table.py [--shape random:qwen35-27b-q4km] [--budget 22] [--unfused] [--host 30]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import re
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from services.target.engine import TargetEngine, TargetLimits, VerifyStep
from splitspec.bench.components import copy_bandwidth, median_ms, random_tree, weight_bytes
from splitspec.bench.random_weights import random_target
from splitspec.spec.sampling import SamplingParams

KINDS = [  # (kind, pattern of the kernel's name), first match wins
    ("quantized matmul (gguf_mma)", r"gguf_mma|permute_x|q4k_kernel|q6k_kernel|prepare_x"),
    ("quantized matmul (Triton)", r"gguf|_q4_k|_q6_k|_q5_k|_q8_0|iq4"),
    ("bf16 matmul (cuBLAS)", r"gemm|gemv|cutlass|xmma|splitKreduce"),
    ("delta rule", r"delta"),
    ("conv", r"conv"),
    ("attention", r"attn|attention|flash"),
    ("norm", r"norm"),
    ("activation", r"silu|sigmoid|softplus|gelu"),
    ("sampling, top-k, walk", r"argmax|topk|top_k|sort|softmax|scan|accept"),
    ("copies, fills", r"copy|fill|Memcpy|Memset|index|gather|scatter|cat"),
    ("other elementwise", r"elementwise|vectorized|reduce"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def kernel_table(title: str, call, wall_ms: float, reps: int, top: int) -> None:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    kernels = []  # (start, end, name) in microseconds
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total
            count[e.name] += 1
            kernels.append((e.time_range.start, e.time_range.end, re.sub(r"^void |\(anonymous namespace\)::", "", e.name)))
    kernels_us = sum(total.values()) / reps
    print(f"== {title}: {wall_ms:.3f} ms a step; {sum(count.values()) / reps:.0f} kernels, {kernels_us / 1e3:.3f} ms of device time"
          f" ({1 - kernels_us / 1e3 / wall_ms:.0%} of the step without a kernel running)")
    by_kind, kind_count = collections.Counter(), collections.Counter()
    for name, us in total.items():
        by_kind[kind_of(name)] += us / reps
        kind_count[kind_of(name)] += count[name] / reps
    for kind, us in by_kind.most_common():
        print(f"  {kind:30s} {us / 1e3:7.3f} ms {kind_count[kind]:7.0f} kernels")
    for name, us in total.most_common(top):
        print(f"  {us / reps:9.1f} us {count[name] / reps:6.1f}x  {name[:110]}")
    gaps = idle_between(kernels)
    print(f"  idle {sum(gaps.values()) / reps / 1e3:.3f} ms a step between kernels (over {len(kernels)} kernels); the largest:")
    for (before, after), us in gaps.most_common(top):
        print(f"  {us / reps:9.1f} us  {before[:60]}  ->  {after[:60]}")


def idle_between(kernels: list[tuple[float, float, str]]) -> collections.Counter:
    """Idle microseconds between consecutive kernels (sorted by start; overlapping ones, as
    programmatic dependent launches overlap, leave no gap), summed by (kernel before, kernel after)."""
    gaps: collections.Counter = collections.Counter()
    kernels = sorted(kernels)
    end, last = None, ""
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps[(last, name)] += start - end
        if end is None or stop >= end:
            end, last = stop, name
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="random:qwen35-27b-q4km")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget", type=int, default=22)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--unfused", action="store_true", help="then again with every projection unfused (the same weights)")
    parser.add_argument("--host", type=int, default=0, help="time and profile the host work of N steps of each pass")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, config = random_target(args.shape, device, getattr(torch, args.dtype))
    bandwidth, nbytes = copy_bandwidth(device), weight_bytes(model)
    print(f"{args.shape}: {nbytes / 1e9:.2f} GB of weights, copy bandwidth {bandwidth / 1e12:.2f} TB/s, roofline {nbytes / bandwidth * 1e3:.2f} ms")
    profile_engine(model, config, args, "fused projections")
    if args.unfused:
        for module in model.modules():
            for name in ("_qkv", "_qk", "_gate_up", "_in_proj", "_in_proj_zba"):  # layers.fuse_linears' results: their layers stay views
                if getattr(module, name, None) is not None:
                    setattr(module, name, None)
        gc.collect()  # the first engine's graphs and pools
        torch.cuda.empty_cache()
        profile_engine(model, config, args, "unfused projections")


def profile_engine(model, config, args, label: str) -> None:
    device = torch.device("cuda")
    print(f"--- {label}")
    rng = np.random.default_rng(0)
    context = args.prompt + 64 * (args.reps + 60)
    engine = TargetEngine(model, TargetLimits(max_sequences=1, max_tree_nodes=args.budget, max_kv_tokens=context + 64), fixed_shapes=True, capture=True, hot_passes=1, hot_padding=0)
    engine.prefill("p", rng.integers(0, config.vocab_size, args.prompt).tolist(), SamplingParams(), reserve_tokens=context)
    tokens, parents = random_tree(rng, config.vocab_size, args.budget)
    ar = median_ms(lambda: engine.verify("p", [], []), 20, 3, device)
    kernel_table("AR step (graph)", lambda: engine.verify("p", [], []), ar, args.reps, args.top)
    tree = median_ms(lambda: engine.verify("p", tokens, parents), 20, 3, device)
    kernel_table(f"verify b{args.budget} (graph)", lambda: engine.verify("p", tokens, parents), tree, args.reps, args.top)
    print(f"verify b{args.budget} / AR = {tree / ar:.2f}")
    if args.host:
        host_phases(engine, "AR step", [], [], args.host, args.top)
        host_phases(engine, f"verify b{args.budget}", tokens, parents, args.host, args.top)


def host_phases(engine: TargetEngine, title: str, tokens: list[int], parents: list[int], steps: int, top: int) -> None:
    """Mean ms a step of each phase of the engine's pass (verify_batch's own sequence), then the
    host phases' cProfile."""
    step = [VerifyStep("p", tokens, parents)]
    phases = collections.Counter()
    profiler = cProfile.Profile()
    for _ in range(steps):
        marks = [time.perf_counter()]
        profiler.enable()
        verify = engine.prepare_pass(step)
        marks.append(time.perf_counter())
        engine.launch_pass(verify)
        profiler.disable()
        marks.append(time.perf_counter())
        engine.wait_pass(verify)
        marks.append(time.perf_counter())
        profiler.enable()
        engine.settle_pass(verify)
        marks.append(time.perf_counter())
        engine.finish_pass(verify)
        profiler.disable()
        marks.append(time.perf_counter())
        for name, t0, t1 in zip(("prepare", "launch", "wait", "settle", "finish"), marks, marks[1:]):
            phases[name] += (t1 - t0) * 1e3 / steps
    print(f"== host work of the {title}, {steps} steps: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()) + " ms a step")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
