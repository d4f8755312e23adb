"""Per-kernel device time of the graphed AR step, verify b22 and draft step, plus the draft's
LM-head / top-K variants and its matmuls against the copy bandwidth.

Usage: python scripts/gpu_kernel_table.py [shape]   (GPU only; prints tables)
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from splitspec.bench.components import copy_bandwidth, median_ms, random_tree
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.services.draft.engine import DraftEngine
from splitspec.services.draft.graphs import BlockGraphs
from splitspec.services.target.engine import TargetEngine
from splitspec.services.target.graphs import StaticVerifier
from splitspec.spec.sampling import SamplingParams

shape = sys.argv[1] if len(sys.argv) > 1 else "random:qwen3-8b"
dev = torch.device("cuda")
bandwidth = copy_bandwidth(dev)
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")


def kernel_table(title: str, call, reps: int = 10) -> None:
    """Device time per call of every kernel name, summed over ``reps`` calls."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            total[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[name] += 1
    whole = sum(total.values()) / reps
    print(f"== {title}: {whole:.0f} us of kernels per call, {sum(count.values()) / reps:.0f} kernels")
    for name, us in total.most_common(25):
        print(f"{us / reps:8.1f} us {count[name] / reps:6.1f}x  {name}")
    timeline(title, call)


def timeline(title: str, call) -> None:
    """One call's span from its first host op to its last kernel: busy kernels, idle gaps and
    the host ops (runtime calls included) that were running during the largest gaps."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation") and "dur" in e]
    t0 = min(e["ts"] for e in host + kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    print(f"-- {title} timeline: {end - t0:.0f} us from first host op to last kernel; first kernel at +{kernels[0]['ts'] - t0:.0f}; kernels busy {busy:.0f} us")
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 0:
            gaps.append((gap, a, b))
    small = sum(g for g, _, _ in gaps if g < 5)
    print(f"   gaps: {len(gaps)} totalling {sum(g for g, _, _ in gaps):.0f} us ({small:.0f} us in gaps < 5 us)")
    for gap, a, b in sorted(gaps, key=lambda g: -g[0])[:6]:
        lo, hi = a["ts"] + a["dur"], b["ts"]
        during = sorted({e["name"][:40] for e in host if e["ts"] < hi and e["ts"] + e["dur"] > lo and e["dur"] < 5 * gap + 50})[:8]
        print(f"   {gap:7.0f} us after {a['name'][:40]!r} before {b['name'][:40]!r}; host: {during}")
    top = collections.Counter()
    for e in host:
        if e.get("cat") == "cpu_op" or e.get("cat") == "cuda_runtime":
            top[e["name"][:50]] += e["dur"]
    print("   host ops (inclusive us): " + ", ".join(f"{n} {us:.0f}" for n, us in top.most_common(12)))


model, config = load_target(shape, dev, torch.bfloat16)
static = StaticVerifier(model, 1, 2048, capture=True)
engine = TargetEngine(model, static=static)
rng = np.random.default_rng(0)
engine.prefill("p", rng.integers(0, config.vocab_size, 512).tolist(), SamplingParams(), reserve_tokens=2048)
tokens, parents = random_tree(rng, config.vocab_size, 22)
print(f"AR {median_ms(lambda: engine.verify('p', [], []), 30, 5, dev):.3f} ms; verify b22 {median_ms(lambda: engine.verify('p', tokens, parents), 30, 5, dev):.3f} ms")
kernel_table("AR step (graph)", lambda: engine.verify("p", [], []))
kernel_table("verify b22 (graph)", lambda: engine.verify("p", tokens, parents))
lm = model.lm_head.weight
del engine, static, model
torch.cuda.empty_cache()

draft, dconfig = load_dflash_draft(shape + "-dflash", dev, torch.bfloat16)
embed, head, _ = load_target_head(shape, dev, torch.bfloat16)
d = DraftEngine(draft, embed, head, graphs=BlockGraphs(draft, embed, head, 2048, 1, capture=True))
width = dconfig.num_taps * dconfig.hidden_size
feats = torch.randn(7, width, device=dev, dtype=torch.bfloat16)
seq = [0, 512]


def draft_step():
    seq[1] += 7
    if seq[0] == 0 or seq[1] > 1000:  # a fresh sequence; stay inside the slot and one span
        d.sequences.pop(f"d{seq[0]}")
        seq[0], seq[1] = seq[0] + 1, 519
        d.propose(f"d{seq[0]}", 0, 512, torch.randn(512, width, device=dev, dtype=torch.bfloat16), 8)
    d.propose(f"d{seq[0]}", 1, seq[1], feats, 8).top_ids.cpu()


print(f"draft step (7 rows appended) {median_ms(draft_step, 30, 5, dev):.3f} ms")
kernel_table("draft step, 7 rows appended (graph)", draft_step)

from splitspec.native import top_k  # noqa: E402

logits = torch.randn(15, dconfig.hidden_size, device=dev, dtype=torch.bfloat16) @ head.T
for k in (8, 64):
    ids, lp = top_k.top_k_log_softmax(logits, k)
    ref_ids, ref_lp = top_k.top_k_log_softmax_reference(logits, k)
    print(f"top_k kernel k={k}: max |logprob - reference| {(lp - ref_lp).abs().max().item():.2e}, ids equal {(ids == ref_ids).float().mean().item():.0%};"
          f" kernel {median_ms(lambda: top_k.top_k_log_softmax(logits, k), 50, 5, dev) * 1e3:.0f} us, reference {median_ms(lambda: top_k.top_k_log_softmax_reference(logits, k), 50, 5, dev) * 1e3:.0f} us (eager, launch included)")
layer = draft.layers[0]
for name, w in [("qkv", layer.self_attn._qkv[0]), ("o", layer.self_attn.o_proj.weight), ("gate_up", layer.mlp._gate_up[0]),
                ("down", layer.mlp.down_proj.weight), ("fc", draft.fc.weight)]:
    x = torch.randn(16, w.shape[1], device=dev, dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.nn.functional.linear(x, w), 50, 5, dev)
    print(f"draft {name} {tuple(w.shape)}: {ms * 1e3:.0f} us, {w.numel() * 2 / bandwidth * 1e6 / (ms * 1e3):.0%} of copy bandwidth")
