"""GPU check and timing of the hybrid (Qwen3.5) target on the fast path: fixed-shape verify and
decode passes replayed as CUDA graphs, and the commit by recomputation (issue #17).

For each random-weight shape of ``--shapes`` (default: ``tiny-qwen35`` in float32, ``qwen35-27b``
in bfloat16 with float32 states; ``qwen35-27b-q4km`` is the 24 GB target's Q4_K_M layout):

1. Commit cost, before the model loads (synthetic tensors of the shape's DeltaNet geometry). The
   question: keep every tree row's recurrent state until acceptance and copy the deepest accepted
   row's (the old design), or keep every row's delta-rule inputs and recompute the accepted path
   (``Qwen35Slots.commit``, ``delta_rule.path_gated_delta``)? Printed per budget-22 tree: the bytes
   each keeps (at 27B: 23 rows x 48 layers x 48 x 128 x 128 x 4 B = 3.47 GB of states against
   45.6 MB of inputs); the tree kernel per layer storing every row (what keeping states needs)
   against storing only the rows a later row reloads (all recomputation needs); and the commit
   itself for 1, 4 and 16 sequences: a copy of each deepest row's state (every layer) against
   ``path_gated_delta`` over paths of 1, 4, 8 and 16 rows. Decision rule: recomputation stays if
   (tree kernel, all rows - kept rows) x layers + copy >= recompute for the typical path (AL 4-8),
   i.e. at equal or better speed it keeps ~76x fewer bytes; otherwise the table says by how much
   it loses, against a budget-22 graphed verify's time from part 3.
2. Correctness, for 1, 4 and 16 sequences (``--sequences``): a decode step and a budget-22 tree
   pass, each twice (the capture, then a later replay), on three engines sharing the weights:
   exact shapes eager, fixed shapes eager, fixed shapes captured (its prompts' prefills replaying
   prompt-chunk graphs captured at warm-up). The captured pass's logits must
   match the fixed-eager ones (the same kernels at the same shapes) and the exact ones within the
   dtype's tolerance, with the same argmax at every row; after committing the same random path of
   every tree in all three, the recurrent and conv states likewise. Every replayed pass (filled,
   uploaded, replayed) runs under ``torch.cuda.set_sync_debug_mode("error")``
   (``services.worker.cuda_graphs.no_host_sync``), and so does every fixed-eager pass: neither
   makes the host wait on the device. (A capture would have failed on any sync inside the pass.)
3. Timing: one AR step (a decode pass of 1 sequence) and a budget-22 verify at each batch, exact
   eager against graphed: the pass alone (runner.run + synchronize) and the whole step
   (``verify_batch``: pass, walk, commit), median ms.

Prints one table per part and ends with PASS or FAIL. About 3 minutes on an H100 (the 27B shape
draws 54 GB of random bfloat16 weights; it needs an 80 GB card).

Usage: python scripts/gpu_hybrid_graphs.py [--shapes tiny-qwen35:float32,qwen35-27b:bfloat16] [--sequences 1,4,16]
A dry run of the script's logic on a CPU (no capture, no sync check, wall-clock times):
TRITON_INTERPRET=1 SPLITSPEC_NATIVE_CPU=1 python scripts/gpu_hybrid_graphs.py --device cpu --shapes tiny-qwen35:float32 --sequences 1,2 --iters 1
"""

from __future__ import annotations

import argparse
import gc
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from native.tree_delta_rule import path_gated_delta, tree_gated_delta
from services.target.engine import TargetEngine, TargetLimits, VerifyStep, _work
from services.worker.cuda_graphs import no_host_sync
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target, random_target_config
from splitspec.models.delta_rule import batch_parents, l2_normalize, reloaded_rows
from splitspec.models.paged import pass_layout
from splitspec.models.qwen35 import tree_node_bytes, tree_row_bytes
from splitspec.spec.sampling import SamplingParams

GREEDY = SamplingParams()
PROMPT = 64
BUDGET = 22
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}  # max |logit or state diff| / max |value|, exact vs graphed
MB = 1e6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn, device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median device ms of ``fn()`` (CUDA events around each call; wall time on a CPU)."""
    if device.type != "cuda":
        return wall_ms(fn, device, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def wall_ms(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall ms of ``fn()`` with the device drained before and after (host work included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


# -- 1. commit cost ---------------------------------------------------------------------------------


def commit_costs(shape: str, dtype: torch.dtype, sequences: list[int], dev: torch.device, iters: int) -> list[str]:
    c = random_target_config(f"random:{shape}")
    state_dtype = torch.promote_types(dtype, torch.float32)
    gen = torch.Generator(device=dev).manual_seed(0)
    layers, hv, hk, dk, dv = c.num_linear_layers, c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    rng = np.random.default_rng(0)
    tokens, parents = random_tree(rng, 1000, BUDGET)
    rows = len(tokens) + 1
    stored = rows * tree_node_bytes(c, dtype, state_dtype).recurrent
    kept = rows * tree_row_bytes(c, dtype)
    lines = [
        f"{shape}: a budget-{BUDGET} tree ({rows} rows) keeps {stored / MB:.1f} MB of {str(state_dtype)[6:]} states "
        f"or {kept / MB:.2f} MB of delta-rule inputs ({stored / kept:.0f}x); the tree kernel's per-layer scratch, "
        f"freed after each layer: {rows * hv * dk * dv * state_dtype.itemsize / MB:.1f} MB"
    ]
    # The tree kernel per layer: every row stored, or only the reloaded ones.
    for n in sequences:
        blocks = [torch.tensor([-1, *parents]) for _ in range(n)]
        row_parents, offsets = batch_parents(blocks)
        row_parents, offsets = row_parents.to(dev), offsets.to(dev)
        t = len(row_parents)
        q = l2_normalize(torch.randn(t, hv, dk, device=dev, generator=gen)) * dk**-0.5
        k = l2_normalize(torch.randn(t, hv, dk, device=dev, generator=gen))
        v = torch.randn(t, hv, dv, device=dev, generator=gen).to(dtype)
        g, beta = -torch.rand(t, hv, device=dev, generator=gen), torch.rand(t, hv, device=dev, generator=gen)
        table = torch.zeros(n + 1, hv, dk, dv, device=dev, dtype=state_dtype)
        index = torch.arange(1, n + 1, device=dev)
        keep = reloaded_rows(row_parents)
        every = device_ms(lambda: tree_gated_delta(q, k, v, g, beta, table, row_parents, state_dtype, offsets, state_index=index), dev, iters)
        reloaded = device_ms(
            lambda: tree_gated_delta(q, k, v, g, beta, table, row_parents, state_dtype, offsets, state_index=index, keep=keep), dev, iters
        )
        lines.append(
            f"  {n:2d} seq: tree kernel per layer, every row stored {every * 1e3:7.1f} us, the {int(keep.sum()) // n} reloaded rows "
            f"of each tree {reloaded * 1e3:7.1f} us; x {layers} layers: {every * layers:.2f} against {reloaded * layers:.2f} ms"
        )
    # The commit: a copy of each sequence's deepest row's state, or the path recomputed.
    for n in sequences:
        slots = torch.zeros(layers, n + 1, hv, dk, dv, device=dev, dtype=state_dtype)
        index = torch.arange(1, n + 1, device=dev)
        deepest = torch.randn(layers, n, hv, dk, dv, device=dev, generator=gen).to(state_dtype)  # the kept rows' states
        copy = device_ms(lambda: slots.index_copy_(1, index, deepest), dev, iters)
        keys = l2_normalize(torch.randn(layers, rows * n, hk, dk, device=dev, generator=gen))
        values = torch.randn(layers, rows * n, hv, dv, device=dev, generator=gen).to(dtype)
        decays, betas = -torch.rand(layers, rows * n, hv, device=dev, generator=gen), torch.rand(layers, rows * n, hv, device=dev, generator=gen)
        recompute = []
        for length in (1, 4, 8, 16):
            paths = torch.arange(length, device=dev).repeat(n, 1) + rows * torch.arange(n, device=dev)[:, None]
            lengths = torch.full((n,), length, device=dev)
            recompute.append(device_ms(lambda: path_gated_delta(slots, index, paths, lengths, keys, values, decays, betas), dev, iters))
        lines.append(
            f"  {n:2d} seq: commit by copy {copy:.3f} ms (keeping {n * stored / 1e9:.2f} GB); by recomputation over paths of "
            f"1/4/8/16 rows {' / '.join(f'{ms:.3f}' for ms in recompute)} ms (keeping {n * kept / MB:.1f} MB)"
        )
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return lines


# -- 2. correctness and 3. timing ----------------------------------------------------------------------


def layout_of(engine: TargetEngine, steps: list[VerifyStep]):
    """The pass layout a verify of ``steps`` runs (blocks grown as the engine grows them)."""
    items = [_work(i, engine.sequences.get(s.sequence_id), s) for i, s in enumerate(steps)]
    for item in items:
        engine._grow(item.state, item.state.length + len(item.row_tokens))
    return pass_layout(
        engine.kv, [w.row_tokens for w in items], [w.rows for w in items], [w.state.length for w in items],
        [w.state.holding.blocks for w in items], [w.tree for w in items], [w.state.holding.slot for w in items],
    )


@contextmanager
def checked_runs(engine: TargetEngine, syncs: list[str]):
    """Inside the block, a pass of ``engine``'s runner whose host side waits on the device is
    recorded in ``syncs`` (torch's message) and run again unchecked, so that the script goes on."""
    if engine.device.type != "cuda":  # a CPU has no device to wait on
        yield
        return
    run = engine.runner.run

    def checked(layout, taps, prompt_chunk=False):
        try:
            with no_host_sync():
                return run(layout, taps, prompt_chunk)
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            syncs.append(str(exc).splitlines()[0])
            return run(layout, taps, prompt_chunk)

    engine.runner.run = checked
    try:
        yield
    finally:
        engine.runner.run = run


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def check_and_time(shape: str, dtype: torch.dtype, sequences: list[int], iters: int, device: torch.device) -> tuple[bool, list[str], list[str]]:
    model, config = random_target(f"random:{shape}", device, dtype)
    vocab, top = config.vocab_size, max(sequences)
    limits = TargetLimits(max_sequences=top, max_kv_tokens=top * 1024)
    exact = TargetEngine(model, limits)
    fixed = TargetEngine(model, limits, fixed_shapes=True)  # fixed shapes, eager
    graphed = TargetEngine(model, limits, fixed_shapes=True, capture=device.type == "cuda", hot_passes=1)
    engines = (exact, fixed, graphed)
    # The prompts replay prompt-chunk graphs captured at warm-up, on the pad sequence (whose state
    # slot warm-up puts back): the checks below start from the state those prefills left.
    graphed.runner.warm_up(1, blocks=(1,), spans=(256,), prompt_chunk=graphed.prompt_chunk)
    graphed.runner.capture_rows = graphed.runner.max_rows  # warm-up lowered it to its one row: the trees below are captured at first use
    warmed = graphed.runner.graphs
    rng = np.random.default_rng(1)
    ids = [f"s{i}" for i in range(top)]
    for sid in ids:
        prompt = rng.integers(0, vocab, PROMPT).tolist()
        for e in engines:
            e.prefill(sid, prompt, GREEDY, reserve_tokens=1024)
    ok, checks = True, [f"{shape}: {warmed} passes captured at warm-up; prompts captured while serving: {graphed.runner.graphs - warmed}"]
    syncs: list[str] = []  # host syncs found in fixed-shape passes
    tol = TOLERANCE[dtype]
    for n in sequences:
        for kind in ("decode", f"b{BUDGET}"):
            for attempt in ("capture", "replay"):
                steps = [VerifyStep(sid, *(random_tree(rng, vocab, BUDGET) if kind != "decode" else ([], []))) for sid in ids[:n]]
                outs = []
                for e in engines:
                    layout = layout_of(e, steps)
                    # The fixed-shape passes may not wait on the device: eager ones always, captured
                    # ones once captured (a capture compiles and replays, outside the check).
                    check = e is fixed or (e is graphed and attempt == "replay")
                    with checked_runs(e, syncs) if check else nullcontext():
                        logits, _ = e.runner.run(layout, ())
                    outs.append(logits.float().clone())
                # The same random path of every tree, committed in all three.
                commits = []
                for s, step in enumerate(steps):
                    node = int(rng.integers(0, len(step.tokens) + 1))
                    path = [node]
                    while path[-1]:
                        path.append(step.parents[path[-1] - 1])
                    commits.append((step.sequence_id, path[::-1], int(layout.offsets[s])))
                for e in engines:
                    e._commit([(e.sequences.get(sid), path, first) for sid, path, first in commits])
                states = [torch.stack([e.state.slots.read(e.sequences.get(sid).holding.slot)["recurrent"] for sid in ids[:n]]) for e in engines]
                vs_fixed, vs_exact = relative(outs[2], outs[1]), relative(outs[2], outs[0])
                same_argmax = bool((outs[2].argmax(-1) == outs[0].argmax(-1)).all() and (outs[2].argmax(-1) == outs[1].argmax(-1)).all())
                state_fixed, state_exact = relative(states[2], states[1]), relative(states[2], states[0])
                good = same_argmax and max(vs_fixed, vs_exact, state_fixed, state_exact) <= tol and not syncs
                ok &= good
                checks.append(
                    f"{shape:16s} {n:3d} {kind:7s} {attempt:8s} {vs_fixed:9.1e} {vs_exact:9.1e} {str(same_argmax):7s} "
                    f"{state_fixed:9.1e} {state_exact:9.1e}  {'ok' if good else 'FAIL'}"
                )
        print(checks[-1], flush=True)
    if device.type == "cuda":
        checks.append(
            f"{shape}: host syncs in fixed-shape passes: " + ("; ".join(dict.fromkeys(syncs)) if syncs else "none (every replay and fixed-eager pass checked)")
        )
    del fixed
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    timings = []
    for n in sequences:
        for kind in ("AR step", f"verify b{BUDGET}"):
            steps = [VerifyStep(sid, *(random_tree(rng, vocab, BUDGET) if kind != "AR step" else ([], []))) for sid in ids[:n]]
            row = [f"{shape:16s} {n:3d} {kind:10s}"]
            passes, whole = [], []
            for e in (exact, graphed):
                layout = layout_of(e, steps)
                passes.append(wall_ms(lambda e=e, layout=layout: e.runner.run(layout, ()), device, iters))
                whole.append(wall_ms(lambda e=e: e.verify_batch(steps), device, iters))
            row.append(f"{passes[0]:9.2f} {passes[1]:9.2f} {passes[0] / passes[1]:6.1f}x {whole[0]:9.2f} {whole[1]:9.2f} {whole[0] / whole[1]:6.1f}x")
            timings.append(" ".join(row))
            print(timings[-1], flush=True)
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else "n/a on a CPU"
    timings.append(f"{shape}: {graphed.runner.graphs} graphs; peak memory {peak}")
    return ok, checks, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny-qwen35:float32,qwen35-27b:bfloat16", help="random shapes, each NAME:DTYPE")
    parser.add_argument("--sequences", default="1,4,16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu for a dry run of the logic")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu for a dry run)")
    sequences = [int(s) for s in args.sequences.split(",")]
    ok, commit_lines, checks, timings = True, [], [], []
    for spec in args.shapes.split(","):
        shape, dtype_name = spec.split(":") if ":" in spec else (spec, "bfloat16")
        dtype = getattr(torch, dtype_name)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        commit_lines += commit_costs(shape, dtype, sequences, device, max(args.iters, 3))
        good, c, t = check_and_time(shape, dtype, sequences, args.iters, device)
        ok &= good
        checks += c
        timings += t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n== device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU (dry run)'} ==")
    print("\n-- 1. commit: keep every row's state and copy, or keep the rows' inputs and recompute --")
    print("\n".join(commit_lines))
    print("\n-- 2. graphed pass vs fixed-shape eager and exact-shape eager (max |diff| / max |value|) --")
    print(f"{'shape':16s} {'seq':>3s} {'pass':7s} {'run':8s} {'vs fixed':>9s} {'vs exact':>9s} {'argmax':7s} {'state/fx':>9s} {'state/ex':>9s}")
    print("\n".join(checks))
    print("\n-- 3. ms: the pass alone (exact eager, graphed, speed-up) and the whole verify step (same) --")
    print(f"{'shape':16s} {'seq':>3s} {'step':10s} {'eager':>9s} {'graphed':>9s} {'':>7s} {'eager':>9s} {'graphed':>9s}")
    print("\n".join(timings))
    print("\nPASS" if ok else "\nFAIL")


if __name__ == "__main__":
    main()
