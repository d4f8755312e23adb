"""Where a step's time goes on the GPU: launch cost, graph replay vs engine call, draft pieces.

Usage: python scripts/gpu_profile.py [shape]   (writes profile tables to $OUT if set)
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from splitspec.bench.components import median_ms, random_tree
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.services.draft.engine import DraftEngine
from splitspec.services.target.engine import TargetEngine
from splitspec.services.target.graphs import StaticVerifier
from splitspec.spec.sampling import SamplingParams

shape = sys.argv[1] if len(sys.argv) > 1 else "random:qwen3-8b"
dev = torch.device("cuda")
out = os.environ.get("OUT", "/tmp")
x = torch.zeros(1, device=dev)
print(f"launch: {median_ms(lambda: [x.add_(1) for _ in range(1000)], 5, 2, dev):.3f} us per add_ (1000 launches)")

model, config = load_target(shape, dev, torch.bfloat16)
static = StaticVerifier(model, 1, 2048, capture=True)
engine = TargetEngine(model, static=static)
rng = np.random.default_rng(0)
engine.prefill("p", rng.integers(0, config.vocab_size, 512).tolist(), SamplingParams(), reserve_tokens=2048)
state = engine.sequences.get("p")
for budget in (0, 22, 64):
    tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
    t, p = np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64)
    engine.tree_forward(state, t, p)
    key = next(k for k in static._passes if k[1] >= len(tokens) + 1)
    graph = static._passes[key].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    fwd = median_ms(lambda: engine.tree_forward(state, t, p), 20, 3, dev)
    ver = median_ms(lambda: engine.verify("p", tokens, parents), 20, 3, dev)
    print(f"budget {budget}: graph replay {start.elapsed_time(end) / 20:.2f} ms; tree_forward {fwd:.2f} ms; verify {ver:.2f} ms; passes {list(static._passes)}")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        engine.verify("p", [], [])
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
print("== AR verify (graphs), by CPU time\n" + table)

eager = TargetEngine(model)
eager.prefill("e", rng.integers(0, config.vocab_size, 512).tolist(), SamplingParams(), reserve_tokens=2048)
print(f"eager AR {median_ms(lambda: eager.verify('e', [], []), 10, 3, dev):.2f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        eager.verify("e", [], [])
    torch.cuda.synchronize()
print("== AR verify (eager), by CUDA time\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
del eager, engine, static, model
torch.cuda.empty_cache()

draft, dconfig = load_dflash_draft(shape + "-dflash", dev, torch.bfloat16)
embed, head, _ = load_target_head(shape, dev, torch.bfloat16)
d = DraftEngine(draft, embed, head)
width = dconfig.num_taps * dconfig.hidden_size
d.propose("d", 0, 512, torch.randn(512, width, device=dev, dtype=torch.bfloat16), 8)
pos = [512]


def step():
    pos[0] += 1
    d.propose("d", 1, pos[0], torch.randn(1, width, device=dev, dtype=torch.bfloat16), 8).top_ids.cpu()


print(f"draft step {median_ms(step, 10, 3, dev):.2f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print("== draft step, by CUDA time\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
print("== draft step, by CPU time\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
