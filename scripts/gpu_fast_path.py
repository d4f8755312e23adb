"""GPU check of the target fast path: CUDA-graph verify vs the eager pass on random weights.

float32, so graph replay and eager must agree to rounding; then a greedy generation through the
engine must be token-identical. Prints PASS/FAIL lines. Usage: python scripts/gpu_fast_path.py
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from services.target.engine import TargetEngine
from services.target.graphs import StaticVerifier
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target
from splitspec.spec.sampling import SamplingParams

ok = True
for shape in ("random:tiny", "random:qwen3-0.6b"):
    model, config = random_target(shape, "cuda", torch.float32)
    eager = TargetEngine(model)
    graphs = TargetEngine(model, static=StaticVerifier(model, 2, 2048, capture=True))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, 300).tolist()
    for e in (eager, graphs):
        e.prefill("s", prompt, SamplingParams(), taps=(1, 2), reserve_tokens=2048)
    worst, same = 0.0, True
    for step in range(40):
        budget = [0, 22, 5, 64][step % 4]
        tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
        le, fe, _ = eager.tree_forward(eager.sequences.get("s"), np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))
        lg, fg, _ = graphs.tree_forward(graphs.sequences.get("s"), np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))
        worst = max(worst, (le - lg).abs().max().item(), (fe - fg).abs().max().item())
        a, b = eager.verify("s", tokens, parents), graphs.verify("s", tokens, parents)
        same &= (a.committed_tokens, a.next_token) == (b.committed_tokens, b.next_token)
    passed = same and worst < 1e-3
    ok &= passed
    print(f"{'PASS' if passed else 'FAIL'} {shape}: max |logit/feature diff| {worst:.2e}, tokens identical {same}, graphs {graphs.static.graphs}")
    del model, eager, graphs
    torch.cuda.empty_cache()
# The native kernels (qkv_rope on every dense step) against the plain-torch path on the same GPU.
import os  # noqa: E402

for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
    model, config = random_target("random:qwen3-0.6b", "cuda", dtype)
    with torch.no_grad():  # full-size attention outputs, so that q's path shows in the logits too
        for layer in model.layers:
            layer.self_attn.o_proj.weight.normal_(0.0, 0.02)
    ids = torch.randint(0, config.vocab_size, (40,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    runs = []
    for native in ("1", "0"):
        os.environ["SPLITSPEC_NATIVE"] = native
        cache = model.new_cache(64, "cuda", dtype)
        mask = torch.ones(40, 40, dtype=torch.bool, device="cuda").tril()
        logits, feats = model(ids, torch.arange(40, device="cuda"), cache, 0, mask, taps=(3, 9))
        runs.append((logits.float(), feats.float(), cache.k.float()))
    os.environ.pop("SPLITSPEC_NATIVE")
    # Relative to each output's scale: bf16 rounding differs between fused and unfused kernels.
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs))
    agree = (runs[0][0].argmax(-1) == runs[1][0].argmax(-1)).float().mean().item()
    passed = worst < tolerance and agree > 0.9
    ok &= passed
    print(f"{'PASS' if passed else 'FAIL'} native kernels vs torch, qwen3-0.6b {dtype}: max diff {worst:.2e} of the output scale, argmax agreement {agree:.2f}")
    del model
    torch.cuda.empty_cache()

# The draft's graphed block pass against its eager pass, float32.
from services.draft.engine import DraftEngine  # noqa: E402
from services.draft.graphs import BlockGraphs  # noqa: E402
from splitspec.bench.random_weights import random_draft, random_target_head  # noqa: E402

for shape in ("random:tiny", "random:qwen3-0.6b"):
    model, config = random_draft(shape + "-dflash", "cuda", torch.float32)
    embed, head, _ = random_target_head(shape, "cuda", torch.float32)
    width = config.num_taps * config.hidden_size
    engines = [DraftEngine(model, embed, head), DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, 1024, 1, capture=True))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    feats = torch.randn(700, width, device="cuda", generator=gen)
    worst, same, end = 0.0, True, 0
    for step, (rows, window) in enumerate([(300, 0)] + [(1 + s % 5, 64 if s % 3 == 0 else 0) for s in range(40)]):
        props = [e.propose("d", step % 100, end + rows, feats[end : end + rows], 8, window) for e in engines]
        end += rows
        same &= torch.equal(props[0].top_ids, props[1].top_ids)
        worst = max(worst, (props[0].top_logprobs - props[1].top_logprobs).abs().max().item())
    passed = same and worst < 1e-3
    ok &= passed
    print(f"{'PASS' if passed else 'FAIL'} draft {shape}: max |logprob diff| {worst:.2e}, ids identical {same}")
sys.exit(0 if ok else 1)
