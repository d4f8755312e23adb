"""Per-kernel device time of the graphed AR step, verify b22 and draft step, plus the draft's
LM-head / top-K variants and its matmuls against the copy bandwidth.

Usage: python scripts/gpu_kernel_table.py [shape]   (GPU only; prints tables)
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.target.engine import TargetEngine
from services.target.graphs import StaticVerifier
from splitspec.bench.components import copy_bandwidth, median_ms, random_tree
from splitspec.bench.random_weights import random_draft, random_target, random_target_head
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


model, config = random_target(shape, dev, torch.bfloat16)
static = StaticVerifier(model, 1, 2048, capture=True)
engine = TargetEngine(model, static=static)
rng = np.random.default_rng(0)
engine.prefill("p", rng.integers(0, config.vocab_size, 512).tolist(), SamplingParams(), reserve_tokens=2048)
tokens, parents = random_tree(rng, config.vocab_size, 22)
print(f"AR {median_ms(lambda: engine.verify('p', [], []), 30, 5, dev):.3f} ms; verify b22 {median_ms(lambda: engine.verify('p', tokens, parents), 30, 5, dev):.3f} ms")
kernel_table("AR step (graph)", lambda: engine.verify("p", [], []))
kernel_table("verify b22 (graph)", lambda: engine.verify("p", tokens, parents))
prompt = rng.integers(0, config.vocab_size, 512).tolist()


def prefill():
    engine.prefill("q", prompt, SamplingParams(), reserve_tokens=1024)
    engine.sequences.pop("q")


print(f"prefill 512, eager (no free slot) {median_ms(prefill, 5, 2, dev):.2f} ms")
kernel_table("prefill 512 (eager)", prefill, reps=3)
graphed = TargetEngine(model, static=StaticVerifier(model, 1, 2048, capture=True))
eager = TargetEngine(model)
taps = (1, 9, 17, 25, 33)
a = graphed.prefill("g", prompt, SamplingParams(), taps=taps, reserve_tokens=1024)
b = eager.prefill("e", prompt, SamplingParams(), taps=taps, reserve_tokens=1024)
print(f"graphed prefill vs eager: next token {a.next_token} vs {b.next_token}, features max |diff| {(a.features - b.features).abs().max().item():.3g}"
      f" (max |feature| {b.features.abs().max().item():.3g})")
graphed.sequences.pop("g")


def graphed_prefill():
    graphed.prefill("g", prompt, SamplingParams(), taps=taps, reserve_tokens=1024)
    graphed.sequences.pop("g")


print(f"prefill 512 with taps, graphed chunks {median_ms(graphed_prefill, 5, 2, dev):.2f} ms")
kernel_table("prefill 512 with taps (graphed chunks)", graphed_prefill, reps=3)
graphed = eager = None  # freed before the draft loads
engine = static = model = None
torch.cuda.empty_cache()

draft, dconfig = random_draft(shape + "-dflash", dev, torch.bfloat16)
embed, head, _ = random_target_head(shape, dev, torch.bfloat16)
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

from native import top_k  # noqa: E402

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
