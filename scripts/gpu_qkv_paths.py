"""The dense attention's q/k/v paths on a GPU: the ``qkv_rope`` kernel fed by one fused matmul, by
q and k fused with v apart (a Q4_K_M file's layers whose v is Q6_K), or by three matmuls, each
against the plain-torch path (``SPLITSPEC_NATIVE_OFF=qkv_rope``) of the same model.

Random weights of the Qwen3-8B attention geometry (benchmark-only), two layers, bf16, a 23-row
block after 100 cached positions: the max abs difference of the logits and of the K/V cache each
path writes, and the kernel's launches (one a layer where it runs).

Usage: python3 scripts/gpu_qkv_paths.py   (GPU only)
"""

from __future__ import annotations

import os

import torch

from native import qkv_rope
from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.models.layers import fuse_linears


def run(model: DenseForCausalLM, native: bool):
    os.environ["SPLITSPEC_NATIVE_OFF"] = "" if native else "qkv_rope"
    tokens, start = torch.randint(0, model.config.vocab_size, (23,), device="cuda", generator=torch.Generator("cuda").manual_seed(1)), 100
    cache = model.new_cache(256, "cuda", torch.bfloat16)
    slots = torch.arange(start, start + 23, device="cuda")
    mask = torch.ones(23, start + 23, dtype=torch.bool, device="cuda").tril(start)
    logits, _ = model(tokens, slots, cache, slots, mask)
    return logits.float(), cache.k.float(), cache.v.float()


def main() -> None:
    config = DenseConfig(vocab_size=4096, hidden_size=4096, intermediate_size=12288, num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128)
    launches = []
    launch = qkv_rope._launch
    qkv_rope._launch = lambda *a: launches.append(1) or launch(*a)
    for mode in ("qkv", "qk", "none"):
        torch.manual_seed(0)
        model = DenseForCausalLM(config).to("cuda", torch.bfloat16).requires_grad_(False)
        if mode == "qkv":
            model.fuse_projections()
        elif mode == "qk":
            for layer in model.layers:
                layer.self_attn._qk = fuse_linears(layer.self_attn.q_proj, layer.self_attn.k_proj)
        launches.clear()
        ours = run(model, True)
        count = len(launches)
        theirs = run(model, False)
        diffs = ", ".join(f"{name} {(a - b).abs().max().item():.3g}" for name, a, b in zip(("logits", "k", "v"), ours, theirs))
        print(f"{mode:4s}: kernel launches {count}; max abs difference against the torch path: {diffs}", flush=True)


if __name__ == "__main__":
    main()
