"""The chunked tree delta rule (``native.tree_chunk_delta``) against the row walk
(``native.tree_delta_rule.tree_gated_delta`` storing only the reloaded rows, as a tree pass
served it before), at the Qwen3.5-27B DeltaNet geometry (48 value heads over 16 key heads, 128 x
128 float32 states read from a slot table), on random inputs (benchmark-only).

Usage (a CUDA machine; each variant compiles for about 10 s a row bucket, 32 and 64):
    python3 scripts/gpu_tree_chunk.py   (VARIANTS=tf32x3/128/8 BLOCKS="1 x b22,32 x b22" for fewer)
Prints, per block (one sequence's best-first tree of budget 22 or 63, and 8 or 32 sequences of a
budget-22 tree each), the walk's time and each chunked variant's (``tl.dot`` precision of its
float32 products, Dv tile, warps), and each one's largest output error against the float64 walk
in torch, over the largest output. Times are a call's share of a CUDA graph of 20 calls (median
of 10 replays), as a captured pass runs them: timed call by call, the wrappers' launches made
the walk look 5x slower than in the 27B step (BENCHMARKS.md [T11]). Writes
``$OUT/tree_chunk.json``; the last line is PASS (every variant within 1e-5 of the largest output)
or FAIL.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_tree_delta import tree_parents  # noqa: E402

from native.tree_chunk_delta import tree_chunk_delta  # noqa: E402
from native.tree_delta_rule import tree_gated_delta  # noqa: E402
from splitspec.models.delta_rule import batch_parents, gated_delta_tree, l2_normalize, reloaded_rows  # noqa: E402

HEADS, KEY_HEADS, DK, DV, SLOTS = 48, 16, 128, 128, 40
VARIANTS = [("tf32x3", bv, w) for bv in (64, 128) for w in (4, 8)] + [("ieee", 64, 8)]
if os.environ.get("VARIANTS"):  # e.g. tf32x3/128/8,tf32x3/64/4 (each variant compiles for ~10 s)
    VARIANTS = [(p, int(bv), int(w)) for p, bv, w in (x.split("/") for x in os.environ["VARIANTS"].split(","))]


def graphed_ms(fn, calls: int = 20, reps: int = 10) -> float:
    """Median ms a call of ``fn`` takes replayed from a CUDA graph of ``calls`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def block(budgets: list[int], rng, device):
    """Parents and offsets of one tree per budget, concatenated; the most rows of one."""
    trees = [tree_parents(b, rng, torch.device("cpu")) for b in budgets]
    parents, offsets = batch_parents(trees)
    return parents.to(device), offsets.to(device), max(len(t) for t in trees)


def main() -> int:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(0)
    table = 0.1 * torch.randn(SLOTS, HEADS, DK, DV, generator=gen, device=device)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    blocks = {f"1 x b{b}": [b] for b in (22, 63)} | {"8 x b22": [22] * 8, "32 x b22": [22] * 32}
    if os.environ.get("BLOCKS"):  # e.g. "1 x b22,32 x b22"
        blocks = {name: blocks[name] for name in os.environ["BLOCKS"].split(",")}
    results, ok = [], True
    for name, budgets in blocks.items():
        parents, offsets, max_rows = block(budgets, rng, device)
        n, seqs = parents.shape[0], len(budgets)
        # As a bf16 pass has them (qwen35.DeltaInputs): q and k float32 (normalised in float32), v bf16.
        # (Until [T12] q and k were bf16 here, whose q.k products the kernel takes as tf32, and the
        # kernel ran 12x faster here than in the 27B pass.)
        q = l2_normalize(torch.randn(n, KEY_HEADS, DK, generator=gen, device=device)) * DK**-0.5
        k = l2_normalize(torch.randn(n, KEY_HEADS, DK, generator=gen, device=device))
        v = torch.randn(n, HEADS, DV, generator=gen, device=device).bfloat16()
        g = -2 * torch.rand(n, HEADS, generator=gen, device=device)
        beta = torch.rand(n, HEADS, generator=gen, device=device)
        slots = torch.randperm(SLOTS, device=device)[:seqs]
        keep = reloaded_rows(parents).to(torch.int8)
        exact, _ = gated_delta_tree(*(x.double() for x in (q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g, beta)),
                                    table.double(), parents, torch.float64, slots)
        scale = exact.abs().max().item()

        def walk():
            return tree_gated_delta(q, k, v, g, beta, table, parents, torch.float32, offsets, state_index=slots, keep=keep)[0]

        row = {"block": name, "rows": n, "max_rows": max_rows, "walk_err": (walk().double() - exact).abs().max().item() / scale,
               "walk_ms": graphed_ms(walk)}
        line = f"{name:<9} rows {n:4d}: walk {row['walk_ms']:.3f} ms (err {row['walk_err']:.1e})"
        for precision, block_v, warps in VARIANTS:
            def chunked():
                return tree_chunk_delta(q, k, v, g, beta, table, parents, max_rows, offsets, state_index=slots,
                                        block_v=block_v, num_warps=warps, precision=precision)  # noqa: B023 - called now
            try:
                err = (chunked().double() - exact).abs().max().item() / scale
                ms = graphed_ms(chunked)
            except Exception as exc:  # noqa: BLE001 - one variant's failure (registers, shared memory) must not end the run
                print(f"  {precision} BV {block_v} w{warps}: FAILED {str(exc)[-300:]}", flush=True)
                continue
            row[f"{precision}/{block_v}/{warps}"] = {"ms": ms, "err": err}
            ok &= err < 1e-5
            line += f"\n  {precision:<7}BV {block_v:3d} w{warps}: {ms:.3f} ms ({row['walk_ms'] / ms:5.2f}x) err {err:.1e}"
        print(line, flush=True)
        results.append(row)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "tree_chunk.json").write_text(json.dumps(results, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
