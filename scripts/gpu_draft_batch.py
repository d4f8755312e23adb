"""The draft's block pass of S sequences as CUDA graphs: checked against the eager pass, then timed.

8B-shaped random draft (``random:qwen3-8b-dflash``, bf16) with the target's embedding and LM head
(``random:qwen3-8b``), host feature rows as from the wire. Three parts:

1. check: S sequences step together through ``propose_batch`` in one engine (one graph per
   step) and one by one through ``propose`` in an eager engine (no graphs); per step the largest
   log-prob difference, top-1 differences and whole-row id differences (as
   scripts/gpu_draft_graph_check.py reports them), in float32 and bfloat16;
2. timing: contexts of ~900 positions, 4 new rows per sequence per step: median ms of one
   ``propose_batch`` of S sequences (host staging, replay, copies back) on the batched graph
   (and its kernels' ms a pass, under the profiler: ``graph_paged_kernels``),
   with the paged attention kernel and with the torch gather (``SPLITSPEC_NATIVE_OFF``), on the
   eager batched pass;
3. a table: ms per pass against S x the pass of one sequence.

Usage: python scripts/gpu_draft_batch.py [--sizes 1,2,4,8,16,32] [--iters 20] [--json OUT.json]
On a CPU (``--device cpu --shape tiny``) the fixed shapes run eagerly: a quick check of the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch

from services.draft.engine import DraftEngine, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.bench.random_weights import random_draft, random_target_head


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Script:
    """S sequences: host features, a prompt each, then ``rows`` new rows a step."""

    def __init__(self, config, count: int, prompt: int, seed: int, dtype: torch.dtype, prefix: str) -> None:
        g = torch.Generator().manual_seed(seed)
        self.width = config.num_taps * config.hidden_size
        self.ids = [f"{prefix}{i}" for i in range(count)]
        self.ends = {sid: prompt - 8 * i % 40 for i, sid in enumerate(self.ids)}  # contexts differ a little
        self.vocab = config.vocab_size - 1
        self.g, self.dtype = g, dtype

    def _features(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.width, generator=self.g).to(self.dtype)

    def prompts(self, top_k: int) -> list[ProposeStep]:
        return [ProposeStep(sid, 7, end, self._features(end), top_k) for sid, end in self.ends.items()]

    def step(self, rows: int | list[int], top_k: int) -> list[ProposeStep]:
        steps = []
        for i, sid in enumerate(self.ids):
            m = rows[i] if isinstance(rows, list) else rows
            self.ends[sid] += m
            anchor = int(torch.randint(0, self.vocab, (1,), generator=self.g))
            steps.append(ProposeStep(sid, anchor, self.ends[sid], self._features(m), top_k))
        return steps


def check(device: torch.device, shape: str, dtype: torch.dtype, count: int, steps: int, context: int, capture: bool) -> dict:
    """Batched graphed against graphed alone, over ``steps`` steps of ``count`` sequences."""
    model, config = random_draft(f"random:{shape}-dflash", device, dtype)
    embed, head, _ = random_target_head(f"random:{shape}", device, dtype)
    batched = DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, context, count, capture))
    alone = DraftEngine(model, embed, head)
    script = Script(config, count, 300, 1, dtype, "c")
    g = torch.Generator().manual_seed(2)
    worst, top1, rows_differ, total = 0.0, 0, 0, 0
    for n in range(steps + 1):
        if n == 0:
            work = script.prompts(8)
        else:  # 1..B new rows each: appends inside the pass; every 5th step one larger than a block
            rows = torch.randint(1, config.block_size + 1, (count,), generator=g).tolist()
            if n % 5 == 0:
                rows[0] = config.block_size + 3
            work = script.step(rows, 8)
        results = batched.propose_batch(work)
        for step, result in zip(work, results):
            assert not isinstance(result, BaseException), result
            ref = alone.propose(step.sequence_id, step.anchor_token, step.anchor_position, step.features, step.top_k)
            worst = max(worst, (result.top_logprobs - ref.top_logprobs).abs().max().item())
            top1 += int((result.top_ids[:, 0] != ref.top_ids[:, 0]).sum())
            rows_differ += int((result.top_ids != ref.top_ids).any(-1).sum())
            total += result.top_ids.shape[0]
            assert result.pass_sequences == count
    shapes = sorted(batched.graphs.batch_shapes)
    out = {
        "dtype": str(dtype).removeprefix("torch."), "sequences": count, "steps": steps + 1, "rows": total,
        "max_logprob_diff": worst, "top1_differences": top1, "rows_with_any_id_difference": rows_differ,
        "batched_shapes": [list(map(str, s)) for s in shapes], "capture_failed": bool(batched.graphs.uncaptured),
    }
    print(json.dumps(out), flush=True)
    del batched, alone, model, embed, head
    return out


def time_passes(engine: DraftEngine, script: Script, iters: int, warmup: int, device: torch.device, top_k: int) -> float:
    """Median ms of one propose_batch of every sequence of ``script`` (4 new rows each)."""
    times = []
    for n in range(warmup + iters):
        work = script.step(4, top_k)
        sync(device)
        t0 = time.perf_counter()
        results = engine.propose_batch(work)
        sync(device)
        if n >= warmup:
            times.append(time.perf_counter() - t0)
        assert not any(isinstance(r, BaseException) for r in results), results
    return 1e3 * statistics.median(times)


def kernel_ms(engine: DraftEngine, script: Script, iters: int, top_k: int) -> float:
    """The kernels' ms in one propose_batch (under the profiler): the rest of its wall time is
    host work with the device idle, which a staged pass could overlap."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            engine.propose_batch(script.step(4, top_k))
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / iters


def timing(device: torch.device, shape: str, sizes: list[int], iters: int, prompt: int, context: int, capture: bool) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, config = random_draft(f"random:{shape}-dflash", device, dtype)
    embed, head, _ = random_target_head(f"random:{shape}", device, dtype)
    rows = []
    single = None
    for s in sizes:
        row = {"S": s}
        # Per S: the graph (paged attention kernel; torch gather, S > 1) and the eager batched pass (S > 1).
        labels = ("graph_paged",) if s == 1 else ("graph_paged", "graph_gather", "eager")
        for label in labels:
            try:
                graphs = None
                if label != "eager":  # slots for these S sequences alone: every one of them gets one
                    graphs = BlockGraphs(model, embed, head, context, s, capture)
                if label == "graph_gather":
                    os.environ["SPLITSPEC_NATIVE_OFF"] = "paged_attention"  # read at capture: the graphs keep it
                engine = DraftEngine(model, embed, head, graphs=graphs)
                script = Script(config, s, prompt, 3, dtype, f"{label}{s}-")
                engine.propose_batch(script.prompts(8))
                assert graphs is None or all(engine.sequences.get(sid).cache.slot is not None for sid in script.ids)
                ms = time_passes(engine, script, iters, 3, device, 8)
                if label == "graph_paged" and device.type == "cuda":
                    row[label + "_kernels"] = round(kernel_ms(engine, script, iters, 8), 3)
                row[label] = None if graphs is not None and graphs.uncaptured else round(ms, 3)
                if graphs is not None and s > 1:
                    row[label + "_shapes"] = [str(k) for k in sorted(graphs.batch_shapes)]
            except Exception:
                traceback.print_exc()
                row[label] = None
            finally:
                os.environ.pop("SPLITSPEC_NATIVE_OFF", None)
                engine = graphs = None
                gc.collect()
        if s == 1:
            single = row["graph_paged"]
        if single:
            row["S_x_single"] = round(s * single, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen3-8b", help="random shape: qwen3-8b (8B-shaped draft) or tiny (CPU check)")
    p.add_argument("--sizes", default="1,2,4,8,16,32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--prompt", type=int, default=900, help="context positions before timing (4 more per step)")
    p.add_argument("--context", type=int, default=2048, help="positions per slot (--graph-context)")
    p.add_argument("--check-sequences", type=int, default=6)
    p.add_argument("--check-steps", type=int, default=12)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    device = torch.device(args.device)
    capture = device.type == "cuda"
    if capture:
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    report: dict = {"device": torch.cuda.get_device_name(device) if capture else "cpu", "checks": [], "timing": []}

    def checked(dtype: torch.dtype) -> None:
        if args.skip_check:
            return
        try:
            report["checks"].append(check(device, args.shape, dtype, args.check_sequences, args.check_steps, args.context, capture))
        except Exception:
            traceback.print_exc()
        gc.collect()
        if capture:
            torch.cuda.empty_cache()

    checked(torch.bfloat16)  # the serving dtype first, float32 (exactness) last
    sizes = [int(x) for x in args.sizes.split(",")]
    report["timing"] = timing(device, args.shape, sizes, args.iters, args.prompt, args.context, capture)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    gc.collect()
    if capture:
        torch.cuda.empty_cache()
    checked(torch.float32)
    print(f"\n{report['device']}: ms per propose_batch (contexts ~{args.prompt}, 4 new rows per sequence per step, top-8)")
    first = report["timing"][0]
    print(f"one sequence: {first.get('graph_paged')} ms (kernels {first.get('graph_paged_kernels')})")
    print(f"{'S':>3} {'batched graph (paged)':>22} {'batched graph (gather)':>23} {'eager batched':>14} {'S x one sequence':>19}")
    for row in report["timing"]:
        cells = [row.get("graph_paged"), row.get("graph_gather"), row.get("eager"), row.get("S_x_single")]
        print(f"{row['S']:>3} " + " ".join(f"{'-' if c is None else c:>{w}}" for c, w in zip(cells, (22, 23, 14, 19))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
