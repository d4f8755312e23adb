"""Check and time the Triton tree kernels (native.tree_delta_rule) against the torch path.

Usage (on a CUDA machine with triton installed; about a minute):
    python3 scripts/gpu_tree_delta.py [--device cuda:0] [--hbm-tbps 4.8]
Writes $OUT/tree_delta.json when OUT is set; the last line is PASS or FAIL.

1. One Gated DeltaNet layer at the Qwen3.5-27B geometry (spec 4.1: 48 value heads, 128 x 128
   state, 10240 conv channels, conv width 4) over best-first random trees of budget 16, 22, 32 and
   64 (rows = budget + 1) and a 16-row chain, state stored in float32 and bfloat16: max error of
   the kernels against delta_rule.gated_delta_tree / conv_silu_reference, and time per layer call
   (CUDA events around each call, median of 30 after 5 warmups) for both paths.
2. Memory traffic of the delta kernel: every row's state written, the state before the block and
   every reloaded parent state read, divided by its time, against the HBM bandwidth (taken from
   the device name, or --hbm-tbps).
3. Dv tile sweep (BLOCK_V 16/32/64, 4/8 warps) of the delta kernel on the budget-22 tree.
4. A tiny random Qwen3.5 target: prefill, verify a tree, commit, decode one token, on the GPU (the
   model dispatches to the kernels) and on the CPU (torch): max logits and committed-state errors.
5. With a second GPU: the kernel on cuda:1 while cuda:0 is the current device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np
import torch

from native.tree_delta_rule import tree_conv_silu, tree_gated_delta
from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models.delta_rule import ancestor_table, chain_parents, conv_silu_reference, gated_delta_tree, l2_normalize
from splitspec.models.loader import load_target
from splitspec.spec.tree import build_ddtree, node_depths, tree_attention_mask

HEADS, DK, DV, CHANNELS, WIDTH = 48, 128, 128, 10240, 4  # Qwen3.5-27B DeltaNet layer
BUDGETS = (16, 22, 32, 64)
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}  # SXM parts


def tree_parents(budget: int, rng: np.random.Generator, device) -> torch.Tensor:
    """``[budget + 1]`` row parents of a best-first DDTree over random sorted log-probs (root first)."""
    depth, k = 16, 8
    top_ids = np.stack([rng.choice(1000, k, replace=False) for _ in range(depth)])
    logprobs = np.sort(np.log(rng.dirichlet(np.full(k, 0.3), size=depth) + 1e-9), axis=1)[:, ::-1]
    tree = build_ddtree(top_ids, logprobs, budget)
    return torch.tensor([-1, *tree.parents.tolist()], device=device)


def timed(fn, reps: int = 30, warmup: int = 5) -> float:
    """Median milliseconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def state_bytes_moved(parents: torch.Tensor, itemsize: int) -> int:
    """State bytes the delta kernel reads and writes: the state before the block, every row's state
    written, and a parent's state read back for every row that does not continue the previous one."""
    p = parents.tolist()
    reloads = sum(1 for t in range(1, len(p)) if p[t] != t - 1)
    return (1 + len(p) + reloads) * HEADS * DK * DV * itemsize


def layer_inputs(rows: int, store: torch.dtype, gen: torch.Generator, device):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q = l2_normalize(randn(rows, HEADS, DK)) * DK**-0.5
    k = l2_normalize(randn(rows, HEADS, DK))
    v = randn(rows, HEADS, DV)
    g = -2 * torch.rand(rows, HEADS, generator=gen, device=device)
    beta = torch.rand(rows, HEADS, generator=gen, device=device)
    state = (0.1 * randn(HEADS, DK, DV)).to(store)
    return q, k, v, g, beta, state


def check_layer(name: str, parents: torch.Tensor, store: torch.dtype, gen, device, hbm: float | None) -> dict:
    rows = parents.shape[0]
    q, k, v, g, beta, state = layer_inputs(rows, store, gen, device)
    out, states = tree_gated_delta(q, k, v, g, beta, state, parents, store)
    ref_out, ref_states = gated_delta_tree(q, k, v, g, beta, state, parents, store)
    history = torch.randn(WIDTH - 1, CHANNELS, generator=gen, device=device).bfloat16()
    inputs = torch.randn(rows, CHANNELS, generator=gen, device=device).bfloat16()
    weight = (0.3 * torch.randn(CHANNELS, WIDTH, generator=gen, device=device)).bfloat16()
    ancestors = ancestor_table(parents, WIDTH)
    conv = tree_conv_silu(history, inputs, ancestors, weight)
    ref_conv = conv_silu_reference(history, inputs, ancestors, weight)
    result = {
        "tree": name, "rows": rows, "depth": int(max(node_depths(parents[1:].cpu().numpy()), default=0)) if rows > 1 else 0,
        "state_dtype": str(store).removeprefix("torch."),
        "out_err": (out - ref_out).abs().max().item(),
        "state_err": (states.float() - ref_states.float()).abs().max().item(),
        "state_bits_equal": (states == ref_states).float().mean().item(),
        "conv_err": (conv.float() - ref_conv.float()).abs().max().item(),
        "delta_ms": timed(lambda: tree_gated_delta(q, k, v, g, beta, state, parents, store)),
        "delta_torch_ms": timed(lambda: gated_delta_tree(q, k, v, g, beta, state, parents, store), reps=10),
        "conv_ms": timed(lambda: tree_conv_silu(history, inputs, ancestors, weight)),
        "conv_torch_ms": timed(lambda: conv_silu_reference(history, inputs, ancestors, weight), reps=10),
    }
    moved = state_bytes_moved(parents.cpu(), store.itemsize)
    result["state_mb"] = moved / 1e6
    result["delta_tbps"] = moved / (result["delta_ms"] * 1e-3) / 1e12
    result["hbm_fraction"] = result["delta_tbps"] / hbm if hbm else None
    bf16 = store == torch.bfloat16
    result["ok"] = (
        result["out_err"] < (2e-3 if bf16 else 1e-4)
        and result["state_err"] < (5e-2 if bf16 else 1e-4)
        and (not bf16 or result["state_bits_equal"] > 0.99)
        and result["conv_err"] < 5e-2
    )
    return result


def sweep_tiles(parents: torch.Tensor, gen, device) -> list[dict]:
    q, k, v, g, beta, state = layer_inputs(parents.shape[0], torch.float32, gen, device)
    out = []
    for block_v in (16, 32, 64):
        for warps in (4, 8):
            ms = timed(lambda: tree_gated_delta(q, k, v, g, beta, state, parents, torch.float32, block_v=block_v, num_warps=warps))
            out.append({"block_v": block_v, "num_warps": warps, "delta_ms": ms})
    return out


def check_tiny_model(device) -> dict:
    """Prefill, tree verify, commit and one decode step of a tiny qwen35 target on ``device``
    (kernels) and on the CPU (torch): max differences of the logits and the committed state."""
    target, _ = make_tiny(tempfile.mkdtemp(), TinySpec(architecture="qwen35", seed=1))
    node_parents = np.array([0, 0, 1, 1, 3, 2, 6, 4, 8, 0])  # parent row of node i + 1
    accepted = [0, 1, 4, 8, 9]
    results = []
    for dev in (device, torch.device("cpu")):
        model, config = load_target(target, dev, torch.float32)
        gen = np.random.default_rng(3)
        prompt = torch.tensor(gen.integers(0, config.vocab_size, 9), device=dev)
        nodes = torch.tensor(gen.integers(0, config.vocab_size, len(node_parents)), device=dev)
        n, rows = len(prompt), len(nodes) + 1
        cache = model.new_cache(n + rows + 1, dev, torch.float32)
        prefill, _ = model(prompt, torch.arange(n, device=dev), cache, 0, torch.ones(n, n, dtype=torch.bool, device=dev).tril())
        row_parents = torch.tensor([-1, *node_parents.tolist()], device=dev)
        positions = n + torch.tensor([0, *node_depths(node_parents).tolist()], device=dev)
        tree_mask = torch.from_numpy(tree_attention_mask(node_parents)).to(dev)
        mask = torch.cat([torch.ones(rows, n, dtype=torch.bool, device=dev), tree_mask], dim=1)
        verify, _ = model(torch.cat([prompt[-1:], nodes]), positions, cache, n, mask, parents=row_parents)
        cache.commit(n, accepted)
        length = n + len(accepted)
        step, _ = model(nodes[:1], torch.tensor([length], device=dev), cache, length, torch.ones(1, length + 1, dtype=torch.bool, device=dev))
        results.append([x.cpu() for x in (prefill, verify, step, cache.conv, cache.recurrent)])
    errs = [(a - b).abs().max().item() for a, b in zip(*results)]
    return {"logits_err": max(errs[:3]), "state_err": max(errs[3:]), "ok": max(errs) < 1e-3}


def check_other_device(parents: torch.Tensor) -> dict | None:
    """With two GPUs: the kernel on cuda:1 while cuda:0 is current (Triton launches on the current
    device unless told otherwise) against the torch path there."""
    if torch.cuda.device_count() < 2:
        return None
    device = torch.device("cuda:1")
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, g, beta, state = layer_inputs(parents.shape[0], torch.float32, gen, device)
    parents = parents.to(device)
    out, states = tree_gated_delta(q, k, v, g, beta, state, parents, torch.float32)
    ref_out, ref_states = gated_delta_tree(q, k, v, g, beta, state, parents, torch.float32)
    err = max((out - ref_out).abs().max().item(), (states - ref_states).abs().max().item())
    return {"err": err, "ok": err < 1e-4}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth in TB/s (default: from the device name)")
    args = p.parse_args()
    device = torch.device(args.device)
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device visible")
        return 1
    name = torch.cuda.get_device_name(device)
    hbm = args.hbm_tbps or next((bw for key, bw in HBM_TBPS.items() if key in name), None)
    print(f"device {name}, HBM {hbm or '?'} TB/s, triton {__import__('triton').__version__}, torch {torch.__version__}", flush=True)
    rng, gen = np.random.default_rng(0), torch.Generator(device=device).manual_seed(0)
    trees = {f"budget {b}": tree_parents(b, rng, device) for b in BUDGETS}
    trees["chain 16"] = chain_parents(16, device)
    layers = [check_layer(tree, parents, store, gen, device, hbm) for tree, parents in trees.items() for store in (torch.float32, torch.bfloat16)]
    header = f"{'tree':<10}{'rows':>5}{'depth':>6} {'state':<9}{'out err':>9}{'state err':>10}{'bits=':>7}{'conv err':>9}" \
             f"{'delta ms':>9}{'torch ms':>9}{'x':>6}{'conv ms':>8}{'torch ms':>9}{'TB/s':>6}{'%HBM':>6}"
    print(header)
    for r in layers:
        hbm_pct = f"{100 * r['hbm_fraction']:.0f}" if r["hbm_fraction"] else "?"
        print(f"{r['tree']:<10}{r['rows']:>5}{r['depth']:>6} {r['state_dtype']:<9}{r['out_err']:>9.1e}{r['state_err']:>10.1e}"
              f"{r['state_bits_equal']:>7.3f}{r['conv_err']:>9.1e}{r['delta_ms']:>9.3f}{r['delta_torch_ms']:>9.3f}"
              f"{r['delta_torch_ms'] / r['delta_ms']:>6.0f}{r['conv_ms']:>8.3f}{r['conv_torch_ms']:>9.3f}{r['delta_tbps']:>6.2f}{hbm_pct:>6}")
    sweep = sweep_tiles(trees["budget 22"], gen, device)
    print("delta kernel tiles, budget 22, float32 state: " + ", ".join(f"BV {s['block_v']} w{s['num_warps']} {s['delta_ms']:.3f} ms" for s in sweep))
    tiny = check_tiny_model(device)
    print(f"tiny qwen35, {device} kernels vs cpu torch: logits {tiny['logits_err']:.1e}, committed state {tiny['state_err']:.1e}")
    other = check_other_device(trees["budget 22"])
    if other:
        print(f"cuda:1 while cuda:0 is current: max error {other['err']:.1e}")
    ok = all(r["ok"] for r in layers) and tiny["ok"] and (other is None or other["ok"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tree_delta.json"), "w") as f:
            json.dump({"device": name, "hbm_tbps": hbm, "layers": layers, "tile_sweep": sweep, "tiny_model": tiny, "other_device": other, "pass": ok}, f, indent=1)
    print("PASS" if ok else "FAIL: " + ", ".join(f"{r['tree']} {r['state_dtype']}" for r in layers if not r["ok"]) + ("" if tiny["ok"] else " tiny model") + ("" if other is None or other["ok"] else " cuda:1"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
