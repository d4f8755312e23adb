"""native/tree_attention's tiling on the GPU: keys per block, programs per multiprocessor and
query rows per program, for the AR, verify b22 and draft shapes of a Qwen3-8B step, each timed
as 36 calls (a step's layers) in one CUDA graph.

Usage: python scripts/gpu_attention_tune.py   (GPU only; prints one line per shape and setting)
"""

from __future__ import annotations

import itertools

import torch

from native import tree_attention as ta

dev = torch.device("cuda")
h, hkv, d, span = 32, 8, 128, 1024
for label, t, end in (("AR", 1, 530), ("verify b22", 24, 553), ("draft", 16, 600)):
    q = torch.randn(h, t, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(hkv, 2048, d, device=dev, dtype=torch.bfloat16)[:, :span]  # a view into a cache
    v = torch.randn(hkv, 2048, d, device=dev, dtype=torch.bfloat16)[:, :span]
    mask = (torch.arange(span, device=dev) < end)[None, :].expand(t, span).contiguous()
    reference = ta.tree_attention(q, k, v, mask).float()
    results = []
    for block_s, waves in itertools.product((32, 64, 128), (1, 2, 4)):
        ta.BLOCK_S, ta.WAVES = block_s, waves
        try:
            out = ta.tree_attention(q, k, v, mask)
            assert (out.float() - reference).abs().max() < 2e-2
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(36):
                    ta.tree_attention(q, k, v, mask)
            g.replay()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                g.replay()
            stop.record()
            torch.cuda.synchronize()
            results.append((start.elapsed_time(stop) / 20 / 36 * 1e3, block_s, waves))
        except Exception as exc:  # a tile too large for shared memory, say
            print(f"{label}: BLOCK_S {block_s} WAVES {waves}: {type(exc).__name__}: {str(exc)[:80]}")
    ta.BLOCK_S, ta.WAVES = 64, 1
    for us, block_s, waves in sorted(results):
        print(f"{label}: {us:5.2f} us per call  BLOCK_S {block_s} WAVES {waves}" + ("  (current)" if (block_s, waves) == (64, 1) else ""))
