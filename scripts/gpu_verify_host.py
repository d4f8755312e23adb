"""Where a graphed verify step's host time goes, stage by stage (perf_counter, no profiler):
tree checks and masks, the static inputs' copies, the replay's launch, the wait for the target's
tokens, the walk and commit, the accepted rows' features.

Usage: python scripts/gpu_verify_host.py   (GPU only; medians over 50 steps per budget)
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from services.target.engine import TargetEngine
from services.target.graphs import StaticVerifier
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target
from splitspec.spec.acceptance import accept_path
from splitspec.spec.sampling import SamplingParams, draw_tokens
from splitspec.spec.tree import node_depths, tree_attention_mask, validate_tree

dev = torch.device("cuda")
model, config = random_target("random:qwen3-8b", dev, torch.bfloat16)
static = StaticVerifier(model, 1, 4096, capture=True)
engine = TargetEngine(model, static=static)
rng = np.random.default_rng(0)
engine.prefill("p", rng.integers(0, config.vocab_size, 512).tolist(), SamplingParams(), taps=(1, 9, 17, 25, 33), reserve_tokens=4096)
state = engine.sequences.get("p")

for budget in (0, 22):
    stages: dict[str, list[float]] = {}
    for i in range(60):
        tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
        if budget:
            tokens[0] = state.pending_token  # some steps accept a node or two: commit moves rows
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        tok, par = np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64)
        validate_tree(tok, par, config.vocab_size, 64)
        start = state.length
        row_tokens = [state.pending_token, *tok.tolist()]
        positions = start + np.concatenate([[0], node_depths(par)])
        mask = tree_attention_mask(par)
        t.append(time.perf_counter())
        p_rows = len(row_tokens)
        out = static.forward(state.cache, row_tokens, positions, start, mask, state.taps)  # copies + replay launch
        t.append(time.perf_counter())
        logits, features = out
        target = draw_tokens(logits, torch.from_numpy(positions).to(dev), state.sampling).cpu().numpy()
        t.append(time.perf_counter())
        accepted, next_token = accept_path(tok, par, target)
        state.cache.commit(start, accepted)
        state.length, state.pending_token = start + len(accepted), int(next_token)
        t.append(time.perf_counter())
        index = torch.tensor(accepted, device=dev, dtype=torch.int64)
        host = features.index_select(0, index).to(torch.bfloat16).cpu()
        t.append(time.perf_counter())
        if i >= 10:
            for name, a, b in zip(("checks + masks", "copies + launch", "wait for tokens", "walk + commit", "features to host"), t, t[1:]):
                stages.setdefault(name, []).append((b - a) * 1e6)
    print(f"budget {budget}: " + "; ".join(f"{k} {statistics.median(v):.0f} us" for k, v in stages.items()))

start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for budget in (0, 22):
    tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
    engine.verify("p", tokens, parents)
    key = next(k for k in static._passes if k[1] >= len(tokens) + 1 and not k[4])
    g = static._passes[key].graph
    ms = []
    for _ in range(30):
        start_ev.record()
        g.replay()
        end_ev.record()
        torch.cuda.synchronize()
        ms.append(start_ev.elapsed_time(end_ev))
    wall = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.verify("p", tokens, parents, return_features=True)
        wall.append(time.perf_counter() - t0)
    print(f"budget {budget}: graph replay {statistics.median(ms) * 1e3:.0f} us; engine.verify with features {statistics.median(wall) * 1e6:.0f} us")
