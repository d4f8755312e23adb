"""The draft engine on every visible GPU: eager vs graphed proposals, native kernels on and off.

A draft worker on cuda:1 once returned unsorted (NaN) log-probs; this isolates where: for each
device, each of (kernels, torch) x (eager, graphs) proposes over the same features, and every
result is compared with the eager torch pass on cuda:0. Prints PASS/FAIL per case.
Also proposes for two sequences in turn and checks the first proposal survives the second.
Usage: python scripts/gpu_second_device_check.py
"""

from __future__ import annotations

import os
import sys

import torch

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from splitspec.bench.random_weights import random_draft, random_target_head
from splitspec.models.devices import resolve_device

SHAPE = "random:qwen3-0.6b"
ok = True
reference = None
for index in range(torch.cuda.device_count()):
    dev = resolve_device(f"cuda:{index}")
    model, config = random_draft(SHAPE + "-dflash", dev, torch.float32)
    embed, head, _ = random_target_head(SHAPE, dev, torch.float32)
    width = config.num_taps * config.hidden_size
    feats = torch.randn(400, width, generator=torch.Generator().manual_seed(0))  # host features, as the server decodes them
    for native in ("1", "0"):
        os.environ["SPLITSPEC_NATIVE"] = native
        for graphed in (False, True):
            graphs = BlockGraphs(model, embed, head, 1024, 2, capture=True) if graphed else None
            engine = DraftEngine(model, embed, head, graphs=graphs)
            end, outs = 0, []
            for step, rows in enumerate([300] + [1 + s % 5 for s in range(20)]):
                p = engine.propose("s", step % 50, end + rows, feats[end : end + rows], 8)
                end += rows
                outs.append((p.top_ids.cpu(), p.top_logprobs.cpu()))
            # Two sequences in turn (two slots): a proposal must not change when the other replays.
            first = engine.propose("a", 5, 300, feats[:300], 8)
            kept = first.top_logprobs.clone()
            engine.propose("b", 6, 300, feats[100:400], 8)
            stable = torch.equal(first.top_logprobs, kept)
            nan = any(not torch.isfinite(lp).all() for _, lp in outs) or not stable
            if reference is None:
                reference = outs
            worst = max((a[1] - b[1]).abs().max().item() for a, b in zip(outs, reference))
            same = all(torch.equal(a[0], b[0]) for a, b in zip(outs, reference))
            passed = not nan and same and worst < 1e-3
            ok &= passed
            failed = graphs is not None and graphs.failed
            print(f"{'PASS' if passed else 'FAIL'} {dev} kernels={native} graphs={graphed}{' (capture failed)' if failed else ''}: "
                  f"NaN or overwritten {nan}, ids equal to cuda:0 eager torch {same}, max |logprob diff| {worst:.2e}", flush=True)
    os.environ.pop("SPLITSPEC_NATIVE")
    del model, embed, head
sys.exit(0 if ok else 1)
