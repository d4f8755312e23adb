"""Check the Qwen3.5 tree verify on a device and time the plain-PyTorch reference at 27B widths.

Usage (on a CUDA/ROCm machine, see scripts/device_setup.sh):
    python3 scripts/gpu_check_qwen35.py --device cuda:0 [--no-wide]
1. A tiny random qwen35 target in float64 and float32: every tree row's logits against decoding its
   path token by token, and the committed state against the sequential one (max abs differences).
2. One Gated DeltaNet layer's tree recurrence at 27B widths (48 value heads, 128 x 128 state) over a
   budget-22 chain-seeded tree (23 rows, depth 15), state stored in float32 and bfloat16.
3. (unless --no-wide) A 4-layer model at 27B widths (3 DeltaNet + 1 attention, random bf16 weights,
   1024-token context): time per verify step at budgets 0 and 22, and peak memory.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from services.target.engine import TargetEngine
from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models.delta_rule import gated_delta_tree, l2_normalize
from splitspec.models.devices import resolve_device
from splitspec.models.loader import load_target
from splitspec.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()
WIDE = Qwen35Config(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=4, num_heads=24, num_kv_heads=4, head_dim=256,
    rotary_dim=64, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
)


def random_tree(vocab: int, budget: int, rng: np.random.Generator):
    top_ids = np.stack([rng.choice(vocab, 8, replace=False) for _ in range(15)])
    return build_ddtree(top_ids, -np.sort(rng.random((15, 8)) * 3, axis=1), budget, chain_seed=True)


def path_rows(tree, row: int) -> list[int]:
    rows = []
    while row:
        rows.append(row)
        row = int(tree.parents[row - 1])
    return rows[::-1]


def decode_sequentially(model, prompt: list[int], path: list[int], device, dtype):
    n = len(prompt)
    cache = model.new_cache(n + len(path) + 1, device, dtype)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    logits, _ = model(torch.tensor(prompt, device=device), torch.arange(n, device=device), cache, 0, causal)
    for i, token in enumerate(path):
        visible = torch.ones(1, n + i + 1, dtype=torch.bool, device=device)
        logits, _ = model(torch.tensor([token], device=device), torch.tensor([n + i], device=device), cache, n + i, visible)
    return logits[-1], cache


def check_tiny(device) -> None:
    target, _ = make_tiny(tempfile.mkdtemp(), TinySpec(architecture="qwen35", seed=1))
    for dtype in (torch.float64, torch.float32):
        model, config = load_target(target, device, dtype)
        engine, rng = TargetEngine(model), np.random.default_rng(0)
        prompt = rng.integers(0, config.vocab_size, 9).tolist()
        engine.prefill("s", prompt, GREEDY, reserve_tokens=64)
        state = engine.sequences.get("s")
        tree = random_tree(config.vocab_size, 22, rng)
        logits, _, _ = engine.tree_forward(state, tree.tokens.astype(np.int64), tree.parents.astype(np.int64))
        def tokens(rows: list[int]) -> list[int]:
            return [state.pending_token] + [int(tree.tokens[r - 1]) for r in rows]

        worst = max(
            (logits[row] - decode_sequentially(model, prompt, tokens(path_rows(tree, row)), device, dtype)[0]).abs().max().item()
            for row in range(tree.num_nodes + 1)
        )
        accepted = path_rows(tree, tree.num_nodes)
        state.cache.commit(len(prompt), [0, *accepted])
        _, reference = decode_sequentially(model, prompt, tokens(accepted), device, dtype)
        state_err = max((state.cache.recurrent - reference.recurrent).abs().max().item(), (state.cache.conv - reference.conv).abs().max().item())
        print(f"tiny qwen35 {device} {dtype}: max |tree - sequential| logits {worst:.2e}, committed state {state_err:.2e}", flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_wide_layer(device) -> None:
    rng = np.random.default_rng(1)
    tree = random_tree(1000, 22, rng)
    parents = torch.tensor([-1, *tree.parents.tolist()], device=device)
    t, h, d = tree.num_nodes + 1, WIDE.linear_num_value_heads, WIDE.linear_key_head_dim
    for store in (torch.float32, torch.bfloat16):
        q = l2_normalize(torch.randn(t, h, d, device=device)) / d**0.5
        k, v = l2_normalize(torch.randn(t, h, d, device=device)), torch.randn(t, h, d, device=device)
        g, beta = -torch.rand(t, h, device=device), torch.rand(t, h, device=device)
        state = torch.randn(h, d, d, device=device).to(store)
        for i in range(23):
            if i == 3:
                sync(device)
                t0 = time.perf_counter()
            gated_delta_tree(q, k, v, g, beta, state, parents, store)
        sync(device)
        ms = (time.perf_counter() - t0) / 20 * 1000
        print(f"gated_delta_tree, 27B layer, {t} rows depth {int(tree.depths.max())}, {store} state: {ms:.2f} ms per layer, x48 layers {48 * ms:.0f} ms", flush=True)


def time_wide_model(device) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen35ForCausalLM(WIDE).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ssm_a"):
                p.uniform_(-8.0, -0.5)
            elif name.endswith("dt_bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.3 if name.endswith("conv_weight") else 0.02)
    engine, rng = TargetEngine(model), np.random.default_rng(0)
    engine.prefill("s", rng.integers(0, WIDE.vocab_size, 1024).tolist(), GREEDY, reserve_tokens=1500)
    for budget in (0, 22):
        tree = random_tree(WIDE.vocab_size, budget, rng)
        for i in range(25):
            if i == 5:
                sync(device)
                t0 = time.perf_counter()
            engine.verify("s", tree.tokens.tolist(), tree.parents.tolist())
        sync(device)
        print(f"4-layer 27B-width model, bf16, budget {budget}: {(time.perf_counter() - t0) / 20 * 1000:.1f} ms per verify step", flush=True)
    if device.type == "cuda":
        print(f"peak device memory {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--no-wide", action="store_true", help="skip the 4-layer 27B-width model (5 GB of weights)")
    args = p.parse_args()
    device = resolve_device(args.device)
    check_tiny(device)
    time_wide_layer(device)
    if not args.no_wide:
        time_wide_model(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
