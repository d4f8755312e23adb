"""What new sequences' prompts cost the draft's batched pass: a pass of S running sequences (a few
new rows each, appended inside the graph) with k new sequences whose first step brings a prompt's
feature rows (appended eagerly first, ``DraftEngine._context_kv``), timed by where the prompts'
rows are: on the host in pageable memory (as from the wire), on the host pinned, on the device.

Benchmark-only: an 8B-shaped random draft (``random:qwen3-8b-dflash``, bf16) with the target's
embedding and LM head (``random:qwen3-8b``), random features. ``--hog`` runs the same passes
while another process keeps the GPU busy with bf16 matmuls, as a target worker sharing the GPU
does (its kernels and the draft's then take turns on the device).

Prints one JSON line per (rows' place, k, hog): the median wall ms of the whole ``propose_batch``
and of its eager appends, over ``--iters`` passes.

``--profile N`` then prints the device time of N passes with no prompt by kernel kind.

Usage: python scripts/gpu_draft_prompts.py [--sequences 16] [--prompt 512] [--rows 7] [--iters 20] [--hog] [--profile 10]
On a CPU (``--device cpu --shape tiny``) the fixed shapes run eagerly: a quick check of the script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import time

import torch

from services.draft.engine import DraftEngine, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.bench.random_weights import random_draft, random_target_head

PLACES = ("pageable", "pinned", "device")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hog(device: str, stop) -> None:
    """Keep ``device`` busy with bf16 matmuls until ``stop`` is set (another process)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)


class Passes:
    """S running sequences stepping together, and new sequences joining with their prompts."""

    def __init__(self, engine: DraftEngine, width: int, count: int, context: int, seed: int) -> None:
        self.engine, self.width = engine, width
        self.g = torch.Generator().manual_seed(seed)
        self.ends = {f"run{i}": context - 8 * i for i in range(count)}
        self.new = itertools.count()
        results = engine.propose_batch([ProposeStep(sid, 7, end, self.features(end, "pageable"), 8) for sid, end in self.ends.items()])
        assert not any(isinstance(r, BaseException) for r in results), results

    def features(self, rows: int, place: str) -> torch.Tensor:
        f = torch.randn(rows, self.width, generator=self.g).to(torch.bfloat16 if self.engine.device.type == "cuda" else torch.float32)
        if place == "pinned" and self.engine.device.type == "cuda":
            return f.pin_memory()
        return f.to(self.engine.device) if place == "device" else f

    def step(self, rows: int, prompts: int, prompt: int, place: str) -> tuple[list[ProposeStep], list[str]]:
        steps = []
        for sid in self.ends:
            self.ends[sid] += rows
            steps.append(ProposeStep(sid, 7, self.ends[sid], self.features(rows, "pageable"), 8))
        joined = [f"new{next(self.new)}" for _ in range(prompts)]
        steps += [ProposeStep(sid, 7, prompt, self.features(prompt, place), 8) for sid in joined]
        return steps, joined


def measure(engine: DraftEngine, passes: Passes, args, place: str, prompts: int) -> dict:
    appends: list[float] = []
    context_kv = engine._context_kv

    def timed(admitted):
        t0 = time.perf_counter()
        try:
            return context_kv(admitted)
        finally:
            appends.append(time.perf_counter() - t0)

    engine._context_kv = timed
    walls = []
    try:
        for n in range(args.warmup + args.iters):
            steps, joined = passes.step(args.rows, prompts, args.prompt, place)
            appends.clear()
            sync(engine.device)
            t0 = time.perf_counter()
            results = engine.propose_batch(steps)
            sync(engine.device)
            wall = time.perf_counter() - t0
            assert not any(isinstance(r, BaseException) for r in results), results
            for sid in joined:  # the slots go back for the next pass's new sequences
                engine.sequences.pop(sid)
            if n >= args.warmup:
                walls.append((wall, sum(appends)))
    finally:
        engine._context_kv = context_kv
    return {
        "pass_ms": round(1e3 * statistics.median(w for w, _ in walls), 3),
        "appends_ms": round(1e3 * statistics.median(a for _, a in walls), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen3-8b", help="random shape: qwen3-8b (8B-shaped draft) or tiny (CPU check)")
    p.add_argument("--sequences", type=int, default=16, help="running sequences a pass")
    p.add_argument("--context", type=int, default=600, help="their context positions at the start")
    p.add_argument("--rows", type=int, default=7, help="new rows a running sequence brings a step (AL 6: about 7)")
    p.add_argument("--prompt", type=int, default=512, help="a new sequence's prompt rows")
    p.add_argument("--prompts", default="0,1,2", help="new sequences a pass, comma-separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--places", default=",".join(PLACES), help=f"where the prompts' rows are, comma-separated: {', '.join(PLACES)}")
    p.add_argument("--hog", action="store_true", help="also with another process keeping the GPU busy")
    p.add_argument("--profile", type=int, default=0, help="then the kernels of this many passes with no prompt, by kind (GPU)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, config = random_draft(f"random:{args.shape}-dflash", device, dtype)
    embed, head, _ = random_target_head(f"random:{args.shape}", device, dtype)
    counts = [int(k) for k in args.prompts.split(",")]
    passes_run = (args.warmup + args.iters) * (2 + len(PLACES) * len(counts) * 2) + args.profile + 3
    capacity = args.context + passes_run * args.rows + 64  # every pass's rows
    slots = args.sequences + max(counts)
    graphs = BlockGraphs(model, embed, head, max(capacity, args.prompt + 64), slots, capture=device.type == "cuda")
    engine = DraftEngine(model, embed, head, graphs=graphs)
    passes = Passes(engine, config.num_taps * config.hidden_size, args.sequences, args.context, 1)
    for hogged in (False, True) if args.hog and device.type == "cuda" else (False,):
        stop = proc = None
        if hogged:
            ctx = multiprocessing.get_context("spawn")
            stop = ctx.Event()
            proc = ctx.Process(target=hog, args=(args.device, stop), daemon=True)
            proc.start()
            time.sleep(5.0)  # its CUDA context up and its matmuls running
        try:
            for place in args.places.split(",") if device.type == "cuda" else ("pageable",):
                for k in counts:
                    row = {"sequences": args.sequences, "rows": args.rows, "prompts": k, "prompt": args.prompt, "place": place, "hog": hogged}
                    row |= measure(engine, passes, args, place, k)
                    print(json.dumps(row), flush=True)
        finally:
            if proc is not None:
                stop.set()
                proc.join(30)
    if args.profile and device.type == "cuda":
        from gpu_kernel_table import kernel_table  # scripts/: this script's folder

        def one_pass():
            steps, _ = passes.step(args.rows, 0, args.prompt, "pageable")
            engine.propose_batch(steps)

        wall = measure(engine, passes, args, "pageable", 0)["pass_ms"]
        kernel_table(f"{args.sequences} sequences, {args.rows} new rows each", one_pass, wall, args.profile, 25)
    print(json.dumps({"graph_capture_failed": bool(graphs.uncaptured), "batch_shapes": [list(map(str, s)) for s in sorted(graphs.batch_shapes)]}))


if __name__ == "__main__":
    main()
