"""Decode-shaped attention on the GPU: the fused SDPA kernel (grouped query rows) vs plain matmul +
softmax, captured in a CUDA graph of 36 layers' worth of calls, as in an 8B verify step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

dev = torch.device("cuda")
hkv, group, d = 8, 4, 128
for rows in (1, 24):
    for span in (1024, 4096):
        q = torch.randn(1, hkv, group * rows, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, span, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.rand(group * rows, span, device=dev) > 0.1

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        def plain():
            s = torch.matmul(q, k.transpose(-1, -2)).float() * d**-0.5
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
            return torch.matmul(p, v)

        assert (sdpa() - plain()).abs().max() < 5e-2
        times = {}
        for name, fn in (("sdpa", sdpa), ("plain", plain)):
            for _ in range(3):
                fn()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(36):
                    fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) / 10
        print(f"rows {rows:3d} span {span}: 36 calls sdpa {times['sdpa']:.3f} ms, plain {times['plain']:.3f} ms")
