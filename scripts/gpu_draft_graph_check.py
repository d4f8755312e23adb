"""The draft's graphed block pass against its eager pass with the built-in pair's real features.

Greedy target steps feed both draft engines the same feature rows; prints the first step where
their top-8 proposals differ, with the context size, or PASS. Usage: python scripts/gpu_draft_graph_check.py
"""

from __future__ import annotations

import torch

from splitspec.builtin import builtin_pair
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.services.draft.engine import DraftEngine
from splitspec.services.draft.graphs import BlockGraphs
from splitspec.services.target.engine import TargetEngine
from splitspec.spec.sampling import SamplingParams
from splitspec.tokenizer import Tokenizer

target_path, draft_path = map(str, builtin_pair())
dev = torch.device("cuda")
for dtype in (torch.float32, torch.bfloat16):
    target, tconfig = load_target(target_path, dev, dtype)
    draft, config = load_dflash_draft(draft_path, dev, dtype, num_target_layers=tconfig.num_layers)
    embed, head, _ = load_target_head(target_path, dev, dtype)
    engine = TargetEngine(target)
    prompt = Tokenizer.load(target_path).encode("import os\n\n\ndef read_config(path):\n    \"\"\"Read the file.\"\"\"\n" * 6)
    pre = engine.prefill("s", prompt, SamplingParams(), taps=config.target_layer_ids, reserve_tokens=512)
    drafts = [DraftEngine(draft, embed, head), DraftEngine(draft, embed, head, graphs=BlockGraphs(draft, embed, head, 4096, 1, capture=True))]
    anchor, feats, pos, bad = pre.next_token, pre.features, len(prompt), None
    for step in range(150):
        props = [d.propose("s", anchor, pos, feats, 8) for d in drafts]
        same = torch.equal(props[0].top_ids, props[1].top_ids)
        if not same and bad is None:
            diff = (props[0].top_logprobs - props[1].top_logprobs).abs().max().item()
            bad = f"step {step}: context {pos} rows, logprob diff {diff:.3g}, eager {props[0].top_ids[:3, 0].tolist()} graph {props[1].top_ids[:3, 0].tolist()}"
        out = engine.verify("s", [], [], return_features=True)
        anchor, feats, pos = out.next_token, out.features, pos + 1
    print(f"{dtype}: prompt {len(prompt)}, " + ("PASS: identical proposals for 150 steps" if bad is None else f"FAIL first at {bad}"))
