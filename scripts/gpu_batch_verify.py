"""GPU check and timing of batched verify (continuous batching) in the target engine, no services.

1. Correctness (float32, random qwen3-0.6b shape): the verify steps of several sequences run as one
   fixed-shape pass replayed as a CUDA graph give every sequence the tokens of running it alone
   eagerly, over steps that mix decode steps and trees.
   The same in stages (``TargetEngine.prepare_pass`` ... ``finish_pass``) as the target's batcher
   runs two cohorts, each pass prepared while the other's is on the device, against serial
   passes, for ``--check-shape`` and the hybrid ``tiny-qwen35-q4km`` (graphed, float32).
2. Timing (bfloat16, random weights of ``--shape``): for each batch size B, B sequences with
   ``--prompt`` prompt tokens each take decode steps (1 row each) and budget-``--budget`` trees
   together: ms per pass and aggregate decode tok/s (B / ms), then the pass time by total rows
   (the cost curve the gateway's adaptive budget learns).
3. Staged passes (``--staged B``): two cohorts of B sequences take turns with budget-``--budget``
   trees, their passes serial (``verify_batch``) or staged as the target's batcher runs them (the
   next cohort's pass prepared while one is on the device, launched before the last one's results
   are finished): ms per pass, alternating the two ways; with ``--row-buckets``, once per set of
   the fixed shapes' row buckets (an experiment: the committed set is ``graphs.ROW_BUCKETS``).
4. ``--gemm-rows``: cuBLAS's bf16 matmuls of the qwen3-8b layer by row count, which those buckets
   are chosen by (a pass pads its rows up to a bucket).

Usage: python scripts/gpu_batch_verify.py [--shape qwen3-8b] [--batches 1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from services.target import graphs
from services.target.engine import TargetEngine, TargetLimits, VerifyStep
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target
from splitspec.spec.sampling import SamplingParams

GREEDY = SamplingParams()
COMMITTED_BUCKETS = graphs.ROW_BUCKETS


def check(shape: str, device: str) -> bool:
    model, config = random_target(f"random:{shape}", device, torch.float32)
    eager = TargetEngine(model, TargetLimits(max_kv_tokens=16 * 1024))
    graphed = TargetEngine(model, TargetLimits(max_kv_tokens=16 * 1024), fixed_shapes=True, capture=device == "cuda", hot_passes=1, hot_padding=0)
    rng = np.random.default_rng(0)
    ids = [f"s{i}" for i in range(6)]
    for sid in ids:
        prompt = rng.integers(0, config.vocab_size, int(rng.integers(5, 300))).tolist()
        for e in (eager, graphed):
            e.prefill(sid, prompt, GREEDY, taps=(1, 2), reserve_tokens=1024)
    same, worst = True, 0.0
    for _ in range(30):
        members = [sid for sid in ids if rng.random() < 0.7] or ids[:1]
        steps = []
        for sid in members:
            budget = int(rng.choice([0, 5, 22]))
            tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
            steps.append(VerifyStep(sid, tokens, parents, True))
        alone = [eager.verify_batch([s])[0] for s in steps]
        together = graphed.verify_batch(steps)
        for a, b in zip(alone, together):
            same &= (a.committed_tokens, a.next_token) == (b.committed_tokens, b.next_token)
            worst = max(worst, (a.features.float() - b.features.float()).abs().max().item())
    ok = same and worst < 1e-2
    print(f"{'PASS' if ok else 'FAIL'} batched graphs vs alone eager, {shape} float32: tokens identical {same}, "
          f"max |feature diff| {worst:.2e}, graphs {graphed.runner.graphs}", flush=True)
    return ok


def run_staged(engine: TargetEngine, passes: list[list[VerifyStep]]) -> list[list]:
    """``passes`` (cohorts taking turns: no sequence in two passes in a row) in the target
    batcher's order: each prepared while the one before is on the device, launched once that one
    is settled, before its results are finished. Each pass's results."""
    out = []
    flying = engine.prepare_pass(passes[0])
    engine.launch_pass(flying)
    for i in range(1, len(passes) + 1):
        following = engine.prepare_pass(passes[i], frozenset(s.sequence_id for s in passes[i - 1])) if i < len(passes) else None
        engine.settle_pass(flying)
        if following is not None:
            engine.launch_pass(following, ahead=True)
        out.append(engine.finish_pass(flying))
        flying = following
    return out


def check_staged(shape: str, device: str) -> bool:
    """Staged passes of two cohorts against serial ones, one graphed engine each (float32)."""
    model, config = random_target(f"random:{shape}", device, torch.float32)
    rng = np.random.default_rng(4)
    cohorts = [[f"s{i}" for i in range(4)], [f"s{i}" for i in range(4, 7)]]
    prompts = {sid: rng.integers(0, config.vocab_size, int(rng.integers(5, 300))).tolist() for c in cohorts for sid in c}
    passes = []
    for r in range(12):
        steps = []
        for sid in cohorts[r % 2]:
            budget = int(rng.choice([0, 5, 12]))
            tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
            steps.append(VerifyStep(sid, tokens, parents, True))
        passes.append(steps)
    engines = []
    for _ in range(2):
        e = TargetEngine(model, TargetLimits(max_kv_tokens=8 * 1024), fixed_shapes=True, capture=device == "cuda", hot_passes=1, hot_padding=0)
        for sid, prompt in prompts.items():
            e.prefill(sid, prompt, GREEDY, taps=(1, 2), reserve_tokens=1024)
        engines.append(e)
    serial = [engines[0].verify_batch(steps) for steps in passes]
    staged = run_staged(engines[1], passes)
    same, worst = True, 0.0
    for want, got in zip(serial, staged):
        for a, b in zip(want, got):
            same &= (a.committed_tokens, a.next_token, a.committed_length) == (b.committed_tokens, b.next_token, b.committed_length)
            worst = max(worst, (a.features.float() - b.features.float()).abs().max().item())
    ok = same and worst < 1e-2
    print(f"{'PASS' if ok else 'FAIL'} staged passes of two cohorts vs serial, {shape} float32 graphed: tokens identical {same}, "
          f"max |feature diff| {worst:.2e}", flush=True)
    return ok


def staged_bench(shape: str, size: int, prompt: int, budget: int, iters: int, device: str, rounds: int = 4) -> None:
    """Two cohorts of ``size`` sequences taking turns: ms per pass serial and staged, alternating."""
    model, config = random_target(f"random:{shape}", device, torch.bfloat16 if device == "cuda" else torch.float32)
    engine = TargetEngine(
        model, TargetLimits(max_sequences=2 * size, max_kv_tokens=2 * size * (prompt + 4096)), fixed_shapes=True, capture=device == "cuda",
        hot_passes=1, hot_padding=0,
    )
    rng = np.random.default_rng(2)
    taps = tuple(range(1, config.num_layers, max(1, config.num_layers // 5)))[:5]
    cohorts = [[f"c{c}-{i}" for i in range(size)] for c in range(2)]
    for sid in cohorts[0] + cohorts[1]:
        engine.prefill(sid, rng.integers(0, config.vocab_size, prompt).tolist(), GREEDY, taps=taps, reserve_tokens=prompt + 4096)

    def passes(n: int) -> list[list[VerifyStep]]:
        return [[VerifyStep(sid, *random_tree(rng, config.vocab_size, budget), True) for sid in cohorts[i % 2]] for i in range(n)]

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ways = {"serial": lambda ps: [engine.verify_batch(steps) for steps in ps], "staged": lambda ps: run_staged(engine, ps)}
    for way in ways.values():  # warm: both cohorts' shapes captured
        way(passes(4))
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            ps = passes(iters)
            sync()
            t0 = time.perf_counter()
            way(ps)
            sync()
            times[name].append(1e3 * (time.perf_counter() - t0) / iters)
    print(f"two cohorts of {size} sequences taking turns, budget-{budget} trees ({size * (budget + 1)} rows a pass), {shape}, "
          f"ms a pass over {iters} passes, {rounds} rounds alternating:", flush=True)
    for name, ms in times.items():
        print(f"  {name}: " + ", ".join(f"{t:.2f}" for t in ms) + f" (median {np.median(ms):.2f})", flush=True)
    print(f"  staged / serial: {np.median(times['staged']) / np.median(times['serial']):.3f}; graphs captured {engine.runner.graphs}", flush=True)
    if device == "cuda":  # where a staged pass's time goes: the device's busy share of the wall time
        from torch.profiler import ProfilerActivity, profile

        ps = passes(iters)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            ways["staged"](ps)
            sync()
            wall = time.perf_counter() - t0
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        print(f"  staged under the profiler: {1e3 * wall / iters:.2f} ms a pass, kernels {1e3 * busy / iters:.2f} ms "
              f"({busy / wall:.0%} of the wall time; kernels may overlap)", flush=True)


# The qwen3-8b layer's matmuls as the dense family fuses them, (out, in) features: q/k/v, o, gate/up, down.
LAYER_MATMULS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def gemm_rows(rows: list[int], layers: int = 36, iters: int = 30) -> None:
    """cuBLAS's bf16 matmuls of the qwen3-8b layer at each row count (random weights, each larger
    than L2): µs a call and the layers' sum, to set the fixed shapes' row buckets by."""
    weights = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16) for name, shape in LAYER_MATMULS_8B.items()}
    print("| rows | " + " | ".join(f"{n} µs" for n in weights) + f" | {layers} layers, ms | ms / row |", flush=True)
    print("|---" * (len(weights) + 3) + "|", flush=True)
    for m in rows:
        cells = []
        for w in weights.values():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for a, b in events:
                a.record()
                torch.nn.functional.linear(x, w)
                b.record()
            torch.cuda.synchronize()
            cells.append(1e3 * float(np.median([a.elapsed_time(b) for a, b in events])))
        total = layers * sum(cells) / 1e3
        print(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {total:.2f} | {total / m:.4f} |", flush=True)


def timed(engine: TargetEngine, steps: list[VerifyStep], iters: int) -> float:
    """Median ms of one verify_batch of ``steps`` (each sequence's KV grows as it goes)."""
    for _ in range(3):
        engine.verify_batch(steps)
    times = []
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        engine.verify_batch(steps)
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


def profile_passes(engine: TargetEngine, steps: list[VerifyStep], label: str) -> None:
    """Where a pass's time goes: host time of verify_batch's parts, and the top device kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.verify_batch(steps)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    print(f"profile of 5 passes, {len(steps)} sequences, {label}:", flush=True)
    key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), flush=True)


def bench(shape: str, batches: list[int], prompt: int, budget: int, iters: int, device: str, profile: int = 0) -> None:
    model, config = random_target(f"random:{shape}", device, torch.bfloat16 if device == "cuda" else torch.float32)
    top = max(batches)
    engine = TargetEngine(
        model, TargetLimits(max_sequences=top, max_kv_tokens=top * (prompt + 2048)), fixed_shapes=True, capture=device == "cuda", hot_passes=1, hot_padding=0
    )
    rng = np.random.default_rng(1)
    print(f"{shape} {next(model.parameters()).dtype}, prompts of {prompt}, random weights (benchmark-only), paged KV, CUDA graphs", flush=True)
    print("| sequences | decode ms/pass | decode aggregate tok/s | x B=1 | tree b%d ms/pass | tree / decode |" % budget)
    print("|---|---|---|---|---|---|")
    base = None
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        for sid in ids:
            engine.prefill(sid, rng.integers(0, config.vocab_size, prompt).tolist(), GREEDY, taps=tuple(range(1, config.num_layers, max(1, config.num_layers // 5)))[:5], reserve_tokens=prompt + 2048)
        decode = timed(engine, [VerifyStep(sid, [], [], True) for sid in ids], iters)
        trees = []
        for sid in ids:
            tokens, parents = random_tree(rng, config.vocab_size, budget)
            trees.append(VerifyStep(sid, tokens, parents, True))
        tree = timed(engine, trees, iters)
        rate = 1e3 * b / decode
        base = base or rate
        print(f"| {b} | {decode:.2f} | {rate:.0f} | {rate / base:.2f} | {tree:.2f} | {tree / decode:.2f} |", flush=True)
        if b == profile:
            profile_passes(engine, [VerifyStep(sid, [], [], True) for sid in ids], "decode")
            profile_passes(engine, trees, f"tree b{budget}")
        if b == top:
            curve = []
            for nodes in (1, 4, 8, 16, 22, 32):
                steps = []
                for sid in ids:
                    tokens, parents = random_tree(rng, config.vocab_size, nodes)
                    steps.append(VerifyStep(sid, tokens, parents, True))
                curve.append((b * (nodes + 1), timed(engine, steps, max(5, iters // 2))))
            print("pass ms by total rows at B=%d: " % b + ", ".join(f"{r} rows {ms:.2f}" for r, ms in curve), flush=True)
        for sid in ids:
            engine.sequences.pop(sid)
    print(f"graphs captured: {engine.runner.graphs}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--check-shape", default="qwen3-0.6b")
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--profile", type=int, default=0, help="profile the passes of this batch size")
    p.add_argument("--staged", type=int, default=0, help="time two cohorts of this many sequences, serial and staged passes")
    p.add_argument("--skip-batches", action="store_true", help="only the checks and --staged")
    p.add_argument("--gemm-rows", default="", help="time the 8B layer's cuBLAS matmuls at these row counts first")
    p.add_argument(
        "--row-buckets", default="",
        help="experiment: --staged once per '/'-separated list of the fixed shapes' row buckets ('default': the committed ones)",
    )
    args = p.parse_args()
    if args.gemm_rows:
        gemm_rows([int(m) for m in args.gemm_rows.split(",")])
    ok = args.skip_check or all([check(args.check_shape, args.device), check_staged(args.check_shape, args.device), check_staged("tiny-qwen35-q4km", args.device)])
    if not args.skip_batches:
        bench(args.shape, [int(b) for b in args.batches.split(",")], args.prompt, args.budget, args.iters, args.device, args.profile)
    for variant in (args.row_buckets or "default").split("/") if args.staged else ():
        if variant != "default":
            graphs.ROW_BUCKETS = tuple(int(r) for r in variant.split(","))
        print(f"row buckets {graphs.ROW_BUCKETS}", flush=True)
        staged_bench(args.shape, args.staged, args.prompt, args.budget, args.iters, args.device)
        graphs.ROW_BUCKETS = COMMITTED_BUCKETS
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
