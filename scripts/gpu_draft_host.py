"""Where a graphed Propose's host time goes, stage by stage (perf_counter, no profiler), for the
Qwen3-8B-shaped 5-layer draft: the request's parse and feature decode, the static inputs'
copies, the replay's launch, the wait and the proposal's copy to the host, the response's encode.

Usage: python scripts/gpu_draft_host.py   (GPU only; medians over 50 steps per appended row count)
"""

from __future__ import annotations

import statistics
import time

import torch

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.worker.cuda_graphs import attention_span
from splitspec.bench.random_weights import random_draft, random_target_head
from splitspec.transport.tensors import tensor_from_pb, tensor_to_pb
from splitspec.v1 import draft_pb2

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
model, config = random_draft("random:qwen3-8b-dflash", dev, torch.bfloat16)
embed, head, _ = random_target_head("random:qwen3-8b", dev, torch.bfloat16)
width = config.num_taps * config.hidden_size
blocks = BlockGraphs(model, embed, head, 4096, 1, capture=True)
engine = DraftEngine(model, embed, head, graphs=blocks)
engine.propose("s", 0, 512, torch.randn(512, width, device=dev, dtype=torch.bfloat16), 8)
position = 512

for rows in (1, 7):
    stages: dict[str, list[float]] = {}
    wall: list[float] = []
    for i in range(60):
        feats = torch.randn(rows, width, dtype=torch.bfloat16)
        wire = draft_pb2.ProposeRequest(
            sequence_id="s", anchor_token=1, anchor_position=position + rows, features=tensor_to_pb(feats), top_k=8
        ).SerializeToString()
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        request = draft_pb2.ProposeRequest.FromString(wire)
        features = tensor_from_pb(request.features)
        t.append(time.perf_counter())
        cache = engine.sequences.get("s").cache
        end = cache.size + rows
        p = blocks._passes.get((cache.slot, min(attention_span(end + config.block_size), blocks.context), 8, True))
        if p is None:  # this span's appending pass is not captured yet: let the engine do it
            engine.propose("s", 1, position + rows, features, 8)
            position += rows
            continue
        head = (1, position + rows, 0, end, cache.size, position)
        if i % 2:  # the copies as they were before the staging buffer, timed in the same state
            p.head.copy_(torch.tensor(head, dtype=torch.int64))
            p.features[:rows].copy_(features)
        else:
            p.write(head, features)
        t.append(time.perf_counter())
        p.graph.replay()
        t.append(time.perf_counter())
        ids, logprobs = (x.to("cpu", non_blocking=True) for x in (p.top_ids, p.top_logprobs))
        torch.cuda.current_stream().synchronize()
        t.append(time.perf_counter())
        draft_pb2.ProposeResponse(top_ids=tensor_to_pb(ids), top_logprobs=tensor_to_pb(logprobs)).SerializeToString()
        t.append(time.perf_counter())
        cache.size += rows
        engine.sequences.get("s").ctx_end = position = position + rows
        # the same step through the engine, as the servicer calls it
        feats2 = tensor_from_pb(request.features)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.propose("s", 1, position + rows, feats2, 8)
        wall.append(time.perf_counter() - t0)
        position += rows
        if i >= 10:
            names = ("parse + decode", "inputs' copy", "replay launch", "wait + to host", "encode")
            for name, a, b in zip(names, t, t[1:]):
                stages.setdefault(name if i % 2 == 0 or name != names[1] else "two blocking copies (before)", []).append((b - a) * 1e6)
    print(f"{rows} rows: " + "; ".join(f"{k} {statistics.median(v):.0f} us" for k, v in stages.items())
          + f"; engine.propose {statistics.median(wall[10:]) * 1e6:.0f} us")

start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for key, p in blocks._passes.items():
    ms = []
    for _ in range(30):
        start_ev.record()
        p.graph.replay()
        end_ev.record()
        torch.cuda.synchronize()
        ms.append(start_ev.elapsed_time(end_ev))
    print(f"pass {key}: graph replay {statistics.median(ms) * 1e3:.0f} us")
