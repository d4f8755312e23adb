"""The graphed target on every visible GPU, driven from a worker thread as the service drives it:
prefill (graphed chunks) and verify steps must give the same tokens and features as cuda:0.

Usage: python scripts/gpu_target_second_device_check.py   (prints PASS/FAIL per device)
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from services.target.engine import TargetEngine
from services.target.graphs import StaticVerifier
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target
from splitspec.models.devices import resolve_device
from splitspec.spec.sampling import SamplingParams


def run(index: int) -> list:
    dev = resolve_device(f"cuda:{index}")  # on the main thread, as the worker's start-up does
    model, config = random_target("random:qwen3-0.6b", dev, torch.float32)
    engine = TargetEngine(model, static=StaticVerifier(model, 1, 1024, capture=True))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, 300).tolist()

    def steps() -> list:  # on another thread, whose current device is not set
        out = [engine.prefill("s", prompt, SamplingParams(), taps=(1, 5), reserve_tokens=1024)]
        out[0] = (out[0].next_token, out[0].features.cpu())
        for budget in (0, 22, 0, 22, 8):
            tokens, parents = random_tree(rng, config.vocab_size, budget) if budget else ([], [])
            r = engine.verify("s", tokens, parents, return_features=True)
            out.append((r.committed_tokens, r.next_token, r.features))
        return out

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(steps).result()


reference = run(0)
ok = True
for index in range(1, torch.cuda.device_count()):
    got = run(index)
    same = all(
        a[:-1] == b[:-1] and torch.allclose(a[-1], b[-1], atol=1e-4) for a, b in zip(reference, got, strict=True)
    )
    print(f"cuda:{index}: {'PASS' if same else 'FAIL'}")
    ok &= same
sys.exit(0 if ok else 1)
