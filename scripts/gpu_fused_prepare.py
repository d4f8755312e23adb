"""x's producer (RMSNorm, the residual add and RMSNorm, SwiGLU's activation) run inside the Q4_K/Q6_K
matmul's x preparation (``native.gguf_mma.produce``), checked on a GPU against the launches apart.

1. Each producer, Q4_K and Q6_K (interleaved, the serving layout), 1-32 rows: the matmul of the
   produced x against the matmul of the producer's own output, both against a float64 reference
   (the producer and the dequantized weights in float64): the produced error may not exceed the
   apart one's by more than a third (its x keeps 11 bits where the apart norm rounds to bf16's
   8). Bit for bit: the residual sum; a row's result alone and among 23 rows; two runs; the
   other block type's arrays (``Prepared.arrays_for``) against a producer run for that type;
   ``Prepared.plain()`` against the producer's own output.
2. A 4-layer model of the 27B Q4_K_M geometry (random weights, benchmark-only), linked against
   ``SPLITSPEC_NATIVE_OFF=gguf_prepare``: a 64-row prompt (apart: more than 32 rows), a 23-row
   block and one-row steps; the logits' largest difference relative to the largest logit, and
   the greedy tokens.

Prints PASS or FAIL per check and exits 1 on any FAIL. Usage: python3 scripts/gpu_fused_prepare.py
[--skip-model]   (GPU only)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from gguf import GGMLQuantizationType as Q
from gpu_quant_libraries import random_blocks  # this folder is on the path of a script run from it

from native import gguf_mma
from native.gguf_dequant import dequantize
from native.gguf_matmul import interleave
from splitspec.bench import random_weights
from splitspec.models.layers import RMSNorm, SwiGLU

EPS = 1e-6
failures: list[str] = []
passed = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    global passed
    if ok:
        passed += 1
    else:
        failures.append(name)
    if not ok or detail:  # each bit-for-bit check's PASS only counted
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def producer(kind: int, a: torch.Tensor, b: torch.Tensor | None, norm: RMSNorm) -> gguf_mma.Producer:
    if kind == gguf_mma.SILU_MUL:
        return gguf_mma.Producer(kind, a, lambda: (SwiGLU.activation(a), None))
    if kind == gguf_mma.NORM:
        return gguf_mma.Producer(kind, a, lambda: (norm.plain(a), None), weight=norm.weight, eps=EPS)
    return gguf_mma.Producer(kind, a, lambda: norm.plain_add(a, b), b, norm.weight, EPS)


def reference(kind: int, a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The producer's output in float64 (the residual sum rounded to bf16 first, as every path does)."""
    if kind == gguf_mma.SILU_MUL:
        gate, up = a.double().chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    x = (a + b).double() if kind == gguf_mma.ADD_NORM else a.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, n: int) -> torch.Tensor:
    prepared = gguf_mma.prepared_for(x)
    arrays = prepared.arrays_for(qtype) if prepared is not None else None
    return gguf_mma.matmul(x, raw, qtype, n, interleaved=True, prepared=arrays)


def kernels() -> None:
    names = {gguf_mma.SILU_MUL: "silu_mul", gguf_mma.NORM: "norm", gguf_mma.ADD_NORM: "add_norm"}
    gen = torch.Generator("cuda").manual_seed(0)
    # 12288: a norm row of more super-blocks than its block has warps (each warp takes several).
    shapes = ((gguf_mma.NORM, (2048, 5120)), (gguf_mma.ADD_NORM, (2048, 4096)), (gguf_mma.NORM, (512, 12288)), (gguf_mma.SILU_MUL, (1024, 17408)))
    for kind, (n, k) in shapes:
        width = 2 * k if kind == gguf_mma.SILU_MUL else k
        norm = RMSNorm(k, EPS).to("cuda", torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.randn(k, device="cuda", generator=gen))
        a_all = (3 * torch.randn(32, width, device="cuda", generator=gen)).bfloat16()
        b_all = (3 * torch.randn(32, width, device="cuda", generator=gen)).bfloat16()
        for qtype in (Q.Q4_K, Q.Q6_K):
            blocks = random_blocks(qtype, n, k, "cuda")
            raw, weight64 = interleave(blocks, qtype), dequantize(blocks, qtype, (n, k)).double()
            worst = []
            for m in (1, 2, 7, 8, 9, 16, 17, 23, 24, 25, 32):
                a, b = a_all[:m], b_all[:m] if kind == gguf_mma.ADD_NORM else None
                p = producer(kind, a, b, norm)
                x, total = gguf_mma.produce(p, qtype)
                fused = matmul(x, raw, qtype, n)
                plain_x, plain_total = p.plain()
                apart = matmul(plain_x, raw, qtype, n)
                exact = reference(kind, a, b, norm.weight) @ weight64.T
                scale = exact.abs().max().item()
                err_fused, err_apart = [(y.double() - exact).abs().max().item() / scale for y in (fused, apart)]
                worst.append((err_fused, err_apart))
                tag = f"{names[kind]} K={k} {qtype.name} M={m}"
                if total is not None:
                    check(f"{tag}: residual sum bit for bit", torch.equal(total, plain_total))
                check(f"{tag}: Prepared.plain() is the producer's output", torch.equal(gguf_mma.prepared_for(x).plain(), plain_x))
                again, _ = gguf_mma.produce(producer(kind, a, b, norm), qtype)
                check(f"{tag}: two runs bit for bit", torch.equal(matmul(again, raw, qtype, n), fused))
                if m == 23:
                    alone, _ = gguf_mma.produce(producer(kind, a[:1], None if b is None else b[:1], norm), qtype)
                    check(f"{tag}: row 0 alone = row 0 of 23", torch.equal(matmul(alone, raw, qtype, n)[0], fused[0]))
                    other = Q.Q6_K if qtype == Q.Q4_K else Q.Q4_K
                    raw_other = interleave(random_blocks(other, n, k, "cuda"), other)
                    direct, _ = gguf_mma.produce(producer(kind, a, b, norm), other)
                    check(f"{tag}: arrays_for({other.name}) = a producer run for {other.name}",
                          torch.equal(matmul(x, raw_other, other, n), matmul(direct, raw_other, other, n)))
            bad = [(f, s) for f, s in worst if f > s * 4 / 3 + 1e-6]
            check(f"{names[kind]} K={k} {qtype.name}: error against float64 no worse than apart's by a third",
                  not bad, "; ".join(f"{f:.2e} vs {s:.2e}" for f, s in worst))


def logits(model, ids: torch.Tensor, prompt: int, block: int) -> torch.Tensor:
    cache = model.new_cache(len(ids), "cuda", torch.bfloat16)
    rows, t = [], 0
    for width in (prompt, block, *[1] * (len(ids) - prompt - block)):
        positions = torch.arange(t, t + width, device="cuda")
        mask = torch.arange(t + width, device="cuda")[None, :] <= positions[:, None]
        rows.append(model(ids[t : t + width], positions, cache, t, mask)[0].float())
        t += width
    return torch.cat(rows)


def model_check() -> None:
    random_weights.SHAPES["check-27b-q4km"] = dataclasses.replace(
        random_weights.SHAPES["qwen35-27b-q4km"], config=dataclasses.replace(random_weights.QWEN35_27B, num_layers=4))
    model, config = random_weights.random_target("random:check-27b-q4km", "cuda", torch.bfloat16)
    linked = sum(m.consumer is not None for m in model.modules() if isinstance(m, RMSNorm)) + sum(
        m.produced is not None for m in model.modules() if isinstance(m, SwiGLU))
    ids = torch.randint(0, config.vocab_size, (96,), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.inference_mode():
        ours = logits(model, ids, 64, 23)
        os.environ["SPLITSPEC_NATIVE_OFF"] = "gguf_prepare"
        apart = logits(model, ids, 64, 23)
        os.environ["SPLITSPEC_NATIVE_OFF"] = ""
    diff = ((ours - apart).abs().max() / apart.abs().max()).item()
    same = (ours.argmax(-1) == apart.argmax(-1)).float().mean().item()
    check(f"4-layer 27B model ({linked} producers linked): prompt rows apart equal", torch.equal(ours[:64], apart[:64]))
    check("4-layer 27B model: linked logits against apart", diff < 0.02 and same >= 0.9,
          f"largest difference {diff:.2e} of the largest logit; greedy tokens equal in {same:.0%} of {len(ids)} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    os.environ["SPLITSPEC_NATIVE_ON"] = "gguf_prepare"  # off by default (native.gguf_mma.prepares_on)
    torch.manual_seed(0)
    with torch.inference_mode():
        kernels()
    if not args.skip_model:
        model_check()
    print(f"{passed} checks passed; " + (f"FAIL: {', '.join(failures)}" if failures else "PASS: every check"), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
