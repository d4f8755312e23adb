"""The draft's graphed block pass against its eager pass with the built-in pair's real features.

Greedy target steps feed both draft engines the same feature rows; prints the first step where
their top-8 proposals differ, with the context size, or PASS. Usage: python scripts/gpu_draft_graph_check.py
"""

from __future__ import annotations

import torch

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.target.engine import TargetEngine
from splitspec.builtin import builtin_pair
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.spec.sampling import SamplingParams
from splitspec.text.tokenizer import Tokenizer

target_path, draft_path = map(str, builtin_pair())
dev = torch.device("cuda")
for dtype in (torch.float32, torch.bfloat16):
    target, tconfig = load_target(target_path, dev, dtype)
    draft, config = load_dflash_draft(draft_path, dev, dtype, num_target_layers=tconfig.num_layers)
    embed, head, _ = load_target_head(target_path, dev, dtype)
    engine = TargetEngine(target)
    drafts = [DraftEngine(draft, embed, head), DraftEngine(draft, embed, head, graphs=BlockGraphs(draft, embed, head, 4096, 8, capture=True))]
    for seq, repeat in (("a", 10), ("b", 6), ("c", 10)):  # several sequences; context crosses span 256
        prompt = Tokenizer.load(target_path).encode("import os\n\n\ndef read_config(path):\n    \"\"\"Read the file.\"\"\"\n" * repeat)
        pre = engine.prefill(seq, prompt, SamplingParams(), taps=config.target_layer_ids, reserve_tokens=512)
        anchor, feats, pos, worst, top1 = pre.next_token, pre.features, len(prompt), 0.0, 0
        for step in range(200):
            props = [d.propose(seq, anchor, pos, feats, 8) for d in drafts]
            worst = max(worst, (props[0].top_logprobs - props[1].top_logprobs).abs().max().item())
            top1 += int((props[0].top_ids[:, 0] != props[1].top_ids[:, 0]).sum())
            out = engine.verify(seq, [], [], return_features=True)
            anchor, feats, pos = out.next_token, out.features, pos + 1
        for d in drafts:
            d.sequences.pop(seq)
        engine.sequences.pop(seq)
        print(f"{dtype} seq {seq}: prompt {len(prompt)} -> {pos}: max logprob diff {worst:.3g}, top-1 differences {top1} of {200 * 15}")
