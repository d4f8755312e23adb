"""GPU check and timing of the fused layer kernels (native/rms_norm, silu_mul, tree_attention).

1. Each kernel against its plain-torch reference on the GPU (bf16 and float32).
2. AR and verify steps (CUDA graphs) and the draft step with all kernels, then with each of the
   three switched off (SPLITSPEC_NATIVE_OFF), on random weights of ``--shape``.
3. A kernel table (CUDA time) of the graphed AR step with all kernels.

Usage: python scripts/gpu_fused_kernels.py [--shape random:qwen3-8b]   (JSON to $OUT if set)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.target.engine import TargetEngine, TargetLimits
from services.target.graphs import StaticVerifier
from splitspec.bench.components import copy_bandwidth, median_ms, random_tree, weight_bytes
from splitspec.bench.random_weights import random_draft, random_target, random_target_head
from splitspec.models.layers import QKVProjection, RMSNorm, SwiGLU
from splitspec.spec.sampling import SamplingParams

KERNELS = ("rms_norm", "silu_mul", "tree_attention")
p = argparse.ArgumentParser()
p.add_argument("--shape", default="random:qwen3-8b")
p.add_argument("--iters", type=int, default=30)
p.add_argument("--quick", action="store_true", help="all kernels only (no switched-off variants)")
args = p.parse_args()
dev = torch.device("cuda")
out_dir = os.environ.get("OUT")
result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(dev)}


def both(fn):
    """fn() with all kernels, and with SPLITSPEC_NATIVE=0 (plain torch on the same GPU)."""
    os.environ.pop("SPLITSPEC_NATIVE", None)
    a = fn()
    os.environ["SPLITSPEC_NATIVE"] = "0"
    b = fn()
    os.environ.pop("SPLITSPEC_NATIVE")
    return a, b


ok = True
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 6e-2)):
    norm = RMSNorm(4096, 1e-6).to(dev, dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    x, r = torch.randn(2, 24, 4096, device=dev, dtype=dtype)
    mlp = SwiGLU(4096, 12288).to(dev, dtype)
    mlp.fuse()
    attn = QKVProjection(4096, 32, 8, 128, 1e-6).to(dev, dtype)
    attn.o_proj = torch.nn.Identity()
    checks = {
        "rms_norm": lambda: norm(x),
        "add_rms_norm": lambda: torch.cat(norm.forward_add(x, r), -1),
        "silu_mul (SwiGLU)": lambda: mlp(x),
    }
    for t, span in ((1, 1024), (24, 1024), (65, 4096), (24, 300)):
        q = torch.randn(32, t, 128, device=dev, dtype=dtype)
        k, v = torch.randn(2, 8, 4096, 128, device=dev, dtype=dtype)
        mask = torch.rand(t, span, device=dev) > 0.3
        mask[torch.arange(t), span - t + torch.arange(t, device=dev)] = True
        checks[f"tree_attention T={t} span={span}"] = lambda q=q, k=k, v=v, mask=mask, span=span: attn.attend(q, k[:, :span], v[:, :span], mask)
    for name, fn in checks.items():
        a, b = both(fn)
        err = (a.float() - b.float()).abs().max().item()
        passed = err < tol * max(1.0, b.float().abs().max().item())
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {name} {str(dtype)[6:]}: max diff {err:.2e}", flush=True)
        result.setdefault("checks", []).append({"name": name, "dtype": str(dtype), "max_diff": err, "pass": passed})

model, config = random_target(args.shape, dev, torch.bfloat16)
wb, bw = weight_bytes(model), copy_bandwidth(dev)
roof = 1e3 * wb / bw
print(f"weights {wb / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s, roofline {roof:.2f} ms", flush=True)
result.update(weight_bytes=wb, copy_bandwidth=bw, roofline_ms=roof, steps={})
rng = np.random.default_rng(0)
prompt = rng.integers(0, config.vocab_size, 512).tolist()
trees = {b: random_tree(rng, config.vocab_size, b) for b in (16, 22, 32, 64)}
variants = {"all": "", **{f"no {k}": k for k in KERNELS}, "none of the three": ",".join(KERNELS)}
if args.quick:
    variants = {"all": ""}
for label, off in variants.items():
    os.environ["SPLITSPEC_NATIVE_OFF"] = off
    static = StaticVerifier(model, 1, 2048, capture=True)
    engine = TargetEngine(model, TargetLimits(max_tree_nodes=64), static)
    engine.prefill("s", prompt, SamplingParams(), reserve_tokens=2048)
    row = {"ar": median_ms(lambda: engine.verify("s", [], []), args.iters, 3, dev)}
    for b, (tokens, parents) in trees.items():
        row[f"b{b}"] = median_ms(lambda: engine.verify("s", tokens, parents), args.iters, 3, dev)
    result["steps"][label] = row
    print(f"{label:>20}: AR {row['ar']:.2f} ms ({100 * roof / row['ar']:.0f}% of roofline); verify " + " / ".join(f"{row[f'b{b}']:.2f}" for b in trees), flush=True)
    if label == "all":
        # Where the AR step's time goes: GPU work (back-to-back replays), one replay waited for,
        # the engine's forward (inputs copied in), and the whole verify (sampling, acceptance).
        graph = next(p.graph for k, p in static._passes.items() if k[1] == 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        state, none = engine.sequences.get("s"), np.zeros(0, dtype=np.int64)
        row["replay_back_to_back"] = start.elapsed_time(end) / 20
        row["replay_and_wait"] = median_ms(graph.replay, args.iters, 3, dev)
        row["tree_forward"] = median_ms(lambda: engine.tree_forward(state, none, none), args.iters, 3, dev)
        print("AR step parts: " + ", ".join(f"{k} {row[k]:.2f} ms" for k in ("replay_back_to_back", "replay_and_wait", "tree_forward", "ar")), flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.verify("s", [], [])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        print("== graphed AR step (5 steps), by CUDA time\n" + table, flush=True)
        result["ar_profile"] = table
    engine.sequences.pop("s")
    engine = static = None  # freed before the next variant (not del: the timed lambdas name them)
    torch.cuda.empty_cache()
del model
torch.cuda.empty_cache()

draft, dconfig = random_draft(args.shape + "-dflash", dev, torch.bfloat16)
embed, head, _ = random_target_head(args.shape, dev, torch.bfloat16)
width = dconfig.num_taps * dconfig.hidden_size
for label, off in (("all", ""), ("none of the three", ",".join(KERNELS))):
    os.environ["SPLITSPEC_NATIVE_OFF"] = off
    blocks = BlockGraphs(draft, embed, head, 512 + args.iters + 64, 1, capture=True)
    d = DraftEngine(draft, embed, head, graphs=blocks)
    d.propose("d", 0, 512, torch.randn(512, width, device=dev, dtype=torch.bfloat16), 8)
    pos = [512]

    def step():
        pos[0] += 1
        d.propose("d", 1, pos[0], torch.randn(1, width, device=dev, dtype=torch.bfloat16), 8).top_ids.cpu()

    ms = median_ms(step, args.iters, 3, dev)
    result.setdefault("draft_ms", {})[label] = None if blocks.uncaptured else ms
    if label == "all":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        print("== graphed draft step (5 steps), by CUDA time\n" + table, flush=True)
        result["draft_profile"] = table
    print(f"draft step ({label}): {ms:.2f} ms{' (capture FAILED: eager)' if blocks.uncaptured else ''}", flush=True)
    d.sequences.pop("d")
    d = blocks = None  # (not del: the timed step names d)
print("PASS all kernel checks" if ok else "FAIL some kernel check")
if out_dir:
    with open(os.path.join(out_dir, "fused_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
