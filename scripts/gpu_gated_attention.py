"""Qwen3.5-27B's gated attention layer, fused ``qkv_rope`` path against the torch path, on CUDA.

Geometry of the 27B (hidden 5120, 24 heads, 4 KV heads, head_dim 256, rotary_dim 64), random bf16
weights, a paged pool. For 1 and 23 rows: max abs/rel differences of q, the pool writes and the
layer output (each path also against a float32 evaluation of the same bf16 inputs; the layer's
output of the kernels, the attention gate applied in the paged kernel's store, also against the
layer with no kernel, the gate applied by torch), then the median
of 200 timed calls (torch.cuda.Event) of the norm/RoPE/write part and of the whole layer, eager and
replayed as a CUDA graph. Run from the repo root: PYTHONPATH=. python3 scripts/gpu_gated_attention.py
"""

import os
import statistics

import numpy as np
import torch

from native import qkv_rope
from splitspec.models.layers import rope_cos_sin
from splitspec.models.paged import KVBlockPool, PassInputs, pass_layout
from splitspec.models.qwen35 import GatedAttention, Qwen35Config

DEV, DT = torch.device("cuda"), torch.bfloat16
H, HKV, D, R, HIDDEN, EPS = 24, 4, 256, 64, 5120, 1e-6
BLOCK, START, CALLS = 16, 1500, 200

config = Qwen35Config(
    vocab_size=1024, hidden_size=HIDDEN, intermediate_size=17408, num_layers=4, num_heads=H, num_kv_heads=HKV, head_dim=D,
    rotary_dim=R, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
)
torch.manual_seed(0)
attn = GatedAttention(config).to(DEV, DT).requires_grad_(False)
for p in attn.parameters():
    if p.dim() == 1:  # norm weights near 1 (plain RMSNorm weights, as loaded)
        p.copy_(1 + 0.3 * torch.randn_like(p))
    else:
        p.normal_(0.0, p.shape[1] ** -0.5)


def make_pass(rows: int):
    """One sequence of ``rows`` rows (a decode row, or a verify tree) at START, over scattered blocks."""
    pool = KVBlockPool(1, HKV, D, 2 + (START + rows) // BLOCK + 8, BLOCK, DEV, DT)
    pool.k[:, :, BLOCK:].normal_()
    pool.v[:, :, BLOCK:].normal_()
    rng = np.random.default_rng(rows)
    table = rng.permutation(np.arange(1, pool.num_blocks))[: -(-(START + rows) // BLOCK)]
    parents = np.array([-1] + [int(rng.integers(0, j)) for j in range(1, rows)])
    tree = np.eye(rows, dtype=bool)
    for j in range(1, rows):
        tree[j] |= tree[parents[j]]
    layout = pass_layout(pool, [[0] * rows], [parents], [START], [table], [tree])
    inputs = PassInputs.exact(layout, BLOCK, DEV)
    cos, sin = rope_cos_sin(inputs.positions, R, config.rope_theta, DT)
    return pool, inputs.attention(), cos, sin


def fp32_heads(x, w, cos, sin):
    """The definition in float32 from the bf16 inputs: x [T, heads, D] -> [heads, T, D]."""
    x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * w.float()
    c, s = cos.float()[:, None], sin.float()[:, None]
    a, b = x[..., : R // 2], x[..., R // 2 : R]
    rot = torch.cat([a * c[..., : R // 2] - b * s[..., : R // 2], b * c[..., R // 2 :] + a * s[..., R // 2 :]], -1)
    return torch.cat([rot, x[..., R:]], -1).transpose(0, 1)


def diff(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs()
    rel = err.max().item() / want.float().abs().max().item()
    print(f"  {name:<28} max abs {err.max().item():.3e}  max rel (to max |ref|) {rel:.3e}  mean abs {err.mean().item():.3e}")


def median_ms(fn) -> float:
    times = []
    for _ in range(CALLS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured as a CUDA graph (after warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def use_fused(on: bool, attention: bool = True) -> None:
    """The fused q/k/v kernel on or off; ``attention`` False turns the paged attention kernel (and
    with it the gate applied in its store) off as well. The switch is read at call time."""
    off = ([] if on else ["qkv_rope"]) + ([] if attention else ["paged_attention"])
    os.environ["SPLITSPEC_NATIVE_OFF"] = ",".join(off)


with torch.no_grad():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for rows in (1, 23):
        pool, at, cos, sin = make_pass(rows)
        x = torch.randn(rows, HIDDEN, device=DEV, dtype=DT)
        packed, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        slots = at.write_slots
        print(f"rows {rows}:")
        # The norm/RoPE/write part: the kernel against the torch ops it replaces.
        k_pools, v_pools = pool.k[0].clone(), pool.v[0].clone()
        q_fused = qkv_rope.gated_qkv_rope(packed, k, v, cos, sin, *attn._norm_args(), k_pools, v_pools, slots)
        q_torch, _ = attn._heads_q_gate(packed, cos, sin)
        k_torch, v_torch = attn._heads_kv(k, v, cos, sin)
        q_ref = fp32_heads(packed.view(rows, H, 2 * D)[..., :D], attn.q_norm.weight, cos, sin)
        k_ref = fp32_heads(k.view(rows, HKV, D), attn.k_norm.weight, cos, sin)
        diff("q fused vs torch", q_fused, q_torch)
        diff("q fused vs fp32", q_fused, q_ref)
        diff("q torch vs fp32", q_torch, q_ref)
        diff("k pool fused vs torch", k_pools[:, slots], k_torch)
        diff("k pool fused vs fp32", k_pools[:, slots], k_ref)
        diff("k torch vs fp32", k_torch, k_ref)
        diff("v pool fused vs torch", v_pools[:, slots], v_torch)
        # The whole layer through its public method, the switch on and off (same pool contents).
        outs = []
        for on in (True, False):
            use_fused(on)
            pool_k, pool_v = pool.k[0].clone(), pool.v[0].clone()
            outs.append((attn.project_attend_paged(x, cos, sin, pool_k, pool_v, at), pool_k, pool_v))
        diff("layer out fused vs torch", outs[0][0], outs[1][0])
        # Against the layer with no kernel at all: the gate applied by torch after torch attention.
        use_fused(False, attention=False)
        plain = attn.project_attend_paged(x, cos, sin, pool.k[0].clone(), pool.v[0].clone(), at)
        use_fused(True)
        diff("layer out kernels vs no kernel", outs[0][0], plain)
        diff("k pool (layer) fused vs torch", outs[0][1], outs[1][1])
        diff("v pool (layer) fused vs torch", outs[0][2], outs[1][2])
        # Timings.
        kp, vp = pool.k[0].clone(), pool.v[0].clone()

        def part_fused():
            qkv_rope.gated_qkv_rope(packed, k, v, cos, sin, *attn._norm_args(), kp, vp, slots)

        def part_torch():
            attn._heads_q_gate(packed, cos, sin)
            kt, vt = attn._heads_kv(k, v, cos, sin)
            kp.index_copy_(1, slots, kt)
            vp.index_copy_(1, slots, vt)

        def layer():
            attn.project_attend_paged(x, cos, sin, kp, vp, at)

        for name, fused_fn, torch_fn in (("norm+rope+writes", part_fused, part_torch), ("whole layer", layer, layer)):
            for mode in ("eager", "graph"):
                times = []
                for on, fn in ((True, fused_fn), (False, torch_fn)):
                    use_fused(on)
                    run = fn if mode == "eager" else graphed(fn)
                    run()
                    times.append(median_ms(run))
                print(f"  {name:<17} {mode:<5} fused {1e3 * times[0]:8.1f} us   torch {1e3 * times[1]:8.1f} us   saved {1e3 * (times[1] - times[0]):8.1f} us")
    use_fused(True)
