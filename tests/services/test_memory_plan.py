"""Memory plans (services/worker/memory_plan.py): each part equals what the workers allocate, a
cap that cannot hold the plan is refused at start-up with the flags to lower, and the plan of the
issue-#17 configuration (Qwen3.5-27B Q4_K_M + its DFlash draft, budget-22 trees, 16K context)."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from services.draft.engine import ContextCache
from services.draft.main import draft_engine
from services.target.engine import TargetEngine, TargetLimits, VerifyStep
from services.target.graphs import PassRunner
from services.worker import memory_plan as mp
from splitspec.cli.serve import memory_caps
from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.spec.sampling import SamplingParams

GiB = mp.GiB


def file_values(path) -> int:
    """Values of every tensor of a GGUF file: a float32 load holds 4 bytes of each."""
    return sum(int(t.n_elements) for t in GGUFReader(path).tensors)


def chain(nodes: int, vocab: int, rng) -> tuple[list[int], list[int]]:
    """Tokens and parents of a tree of ``nodes`` nodes in one chain (node i's parent is node i - 1;
    0 is the root)."""
    return rng.integers(0, vocab, nodes).tolist(), list(range(nodes))


# -- the parts against what is allocated --------------------------------------------------------


def test_dense_plan_is_what_the_engine_allocates(tiny_pair):
    model, config = load_target(tiny_pair.target)
    limits = TargetLimits(max_sequences=4, max_kv_tokens=300, max_tree_nodes=22)
    plan = mp.target_plan(model, config, torch.float32, limits)
    engine = TargetEngine(model, limits)
    assert plan.weights == 4 * file_values(tiny_pair.target)  # the fused q/k/v and gate/up views count once
    assert plan.kv_cache == engine.kv.k.nbytes + engine.kv.v.nbytes
    assert plan.state_slots == plan.tree_buffers == plan.context_slots == 0
    assert plan.total == plan.weights + plan.kv_cache + plan.workspace


def test_kept_gguf_blocks_count_as_blocks(tmp_path):
    """``--keep-quantized``: the weights are the blocks as the file holds them, not a dequantized copy."""
    path, _ = make_tiny(tmp_path, TinySpec(hidden_size=256, num_heads=4, head_dim=64, intermediate_size=512), weight_type="q8_0")
    dequantized, config = load_target(path)
    kept, _ = load_target(path, keep_quantized=True)
    limits = TargetLimits(max_sequences=2, max_kv_tokens=64, max_tree_nodes=4)
    blocks = [m for m in kept.modules() if hasattr(m, "raw")]
    assert blocks, "nothing was kept in blocks"
    values = sum(m.out_features * m.in_features if hasattr(m, "out_features") else m.num_embeddings * m.embedding_dim for m in blocks)
    raw = sum(m.raw.nbytes for m in blocks)
    assert raw < 4 * values / 3  # Q8_0: 34 bytes a block of 32 values
    full = mp.target_plan(dequantized, config, torch.float32, limits).weights
    assert mp.target_plan(kept, config, torch.float32, limits).weights == full - 4 * values + raw


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["float32-states", "bfloat16-states"])
def test_hybrid_plan_is_what_the_pools_and_a_largest_verify_pass_hold(tiny_qwen35_pair, state_dtype):
    model, config = load_target(tiny_qwen35_pair.target, state_dtype=state_dtype)
    limits = TargetLimits(max_sequences=3, max_kv_tokens=256, max_tree_nodes=6)
    plan = mp.target_plan(model, config, torch.float32, limits)
    engine = TargetEngine(model, limits)
    slots = engine.state.slots
    assert plan.weights == 4 * file_values(tiny_qwen35_pair.target)
    assert plan.kv_cache == engine.kv.k.nbytes + engine.kv.v.nbytes
    assert plan.state_slots == slots.conv.nbytes + slots.recurrent.nbytes
    # The largest pass: every sequence at once, each with a tree of --max-tree-nodes nodes.
    rng = np.random.default_rng(0)
    vocab = config.vocab_size
    for s in range(limits.max_sequences):
        engine.prefill(f"s{s}", rng.integers(0, vocab, 5).tolist(), SamplingParams(), reserve_tokens=64)
    steps = [VerifyStep(f"s{s}", *chain(limits.max_tree_nodes, vocab, rng)) for s in range(limits.max_sequences)]
    results = engine.verify_batch(steps)
    assert not [r for r in results if isinstance(r, BaseException)]
    pending = slots.pending
    assert pending is not None  # still held after the pass: the next pass's candidates join it
    held = sum(t.nbytes for t in (pending.conv_inputs, pending.keys, pending.values, pending.decays, pending.betas))
    assert plan.tree_buffers == 2 * held


def test_graph_outputs_are_the_rows_of_the_largest_warm_up_pass(tiny_pair):
    """Captured graphs write their logits and features into buffers of the runner, as many rows as
    the largest pass warm_up makes (on a CPU the fixed shapes run eagerly, at the same shapes): the
    plan's rows; of features, as many as the largest prompt chunk's where that is larger."""
    model, config = load_target(tiny_pair.target)
    engine = TargetEngine(model, TargetLimits(max_sequences=8, max_kv_tokens=64), fixed_shapes=True)
    engine.runner.warm_up(8, prompt_chunk=engine.prompt_chunk)
    largest = max(p.inputs.shape[0] for key, p in engine.runner._passes.items() if not key[-1])
    assert largest == engine.runner.capture_rows == mp.graph_output_rows(8) == 8 * 64
    prompt = max(p.inputs.shape[0] for key, p in engine.runner._passes.items() if key[-1])  # a prompt chunk's features
    assert prompt == mp.prompt_graph_rows(engine.limits.prefill_chunk) == 512
    assert isinstance(engine.runner, PassRunner) and engine.runner.graphs == 0  # nothing captured on a CPU


def test_draft_plan_is_what_the_draft_holds(tiny_pair):
    target_config = load_target(tiny_pair.target)[1]
    model, config = load_dflash_draft(tiny_pair.draft, num_target_layers=target_config.num_layers)
    embed, head, _ = load_target_head(tiny_pair.target)
    args = argparse.Namespace(graph_sequences=3, graph_context=128, no_cuda_graphs=True, max_sequences=8)
    engine = draft_engine(args, model, embed, head, torch.device("cpu"))
    plan = mp.draft_plan(model, embed, head, slots=3, context=128, max_sequences=8)
    assert engine.graphs.seat(ContextCache(config.num_layers), 0)  # the first sequence seated allocates the pool
    assert plan.context_slots == sum(k.nbytes + v.nbytes for k, v in engine.graphs.pool)
    draft_values = sum(p.numel() for p in model.parameters())  # fused q/k/v and gate/up: views of one tensor each
    assert plan.weights == 4 * draft_values + embed.nbytes + head.nbytes
    assert plan.kv_cache == plan.state_slots == plan.tree_buffers == 0


# -- budget, refusal and the auto KV size ---------------------------------------------------------


def test_the_budget_keeps_a_24th_of_the_cap_at_most_a_gib():
    assert mp.MemoryPlan("target", cap=24 * GiB).budget == 23 * GiB
    assert mp.MemoryPlan("target", cap=48 * GiB).budget == 47 * GiB
    assert mp.MemoryPlan("target", cap=12 * GiB).budget == 11.5 * GiB
    assert mp.MemoryPlan("target").budget is None and mp.MemoryPlan("target", weights=1 << 50).fits


def test_a_refusal_names_the_large_parts_and_their_flags():
    plan = mp.MemoryPlan("target", weights=10 * GiB, kv_cache=8 * GiB, tree_buffers=6 * GiB, workspace=GiB // 100, cap=24 * GiB)
    with pytest.raises(mp.MemoryPlanError) as info:
        plan.check()
    message = str(info.value)
    assert "24.01 GiB" in message and "23.00 GiB budget" in message
    # Largest first, each with what lowers it; a part too small to matter is left out.
    assert message.index("weights") < message.index("KV cache") < message.index("tree buffers")
    for flag in ("--keep-quantized", "--max-kv-tokens", "--max-tree-nodes", "--state-dtype bfloat16", "raise --memory-cap-gb"):
        assert flag in message
    assert "workspace" not in message
    mp.MemoryPlan("draft", weights=GiB, context_slots=GiB, cap=3 * GiB).check()  # fits: no error


def test_auto_kv_size_is_the_most_that_fits_the_cap(tiny_qwen35_pair):
    model, config = load_target(tiny_qwen35_pair.target)
    limits = TargetLimits(max_sequences=4, max_tree_nodes=22)

    def plan_at(positions: int, cap: int = 8 << 20) -> mp.MemoryPlan:
        return mp.target_plan(model, config, torch.float32, TargetLimits(**{**limits.__dict__, "max_kv_tokens": positions}), cap=cap)

    tokens = mp.most_kv_tokens(plan_at, 1 << 20, limits.block_size)
    assert tokens % limits.block_size == 0 and 0 < tokens < 1 << 20
    assert plan_at(tokens).fits and not plan_at(tokens + limits.block_size).fits
    assert mp.most_kv_tokens(lambda n: plan_at(n, cap=1 << 40), 4096, 16) == 4096  # the cap leaves room for all
    assert mp.most_kv_tokens(lambda n: plan_at(n, cap=1 << 10), 4096, 16) == 16  # nothing fits: one block, refused later


def test_serve_splits_a_cap_only_between_workers_sharing_a_device():
    assert memory_caps(0, 0, True) == ([], [])
    assert memory_caps(24, 0, False) == (["--memory-cap-gb", "24"], ["--memory-cap-gb", "24"])
    assert memory_caps(24, 0, True) == (["--memory-cap-gb", "16"], ["--memory-cap-gb", "8"])
    assert memory_caps(24, 6.5, True) == (["--memory-cap-gb", "17.5"], ["--memory-cap-gb", "6.5"])
    with pytest.raises(ValueError, match="--draft-memory-gb 30"):
        memory_caps(24, 30, True)


def test_the_cap_flags_read_their_environment_variables(monkeypatch):
    from splitspec.cli.main import build_parser

    monkeypatch.setenv("SPLITSPEC_TARGET_MEMORY_CAP_GB", "22")
    monkeypatch.setenv("SPLITSPEC_SERVE_MEMORY_CAP_GB", "24")
    parser = build_parser()
    assert parser.parse_args(["target", "--model", "m.gguf"]).memory_cap_gb == 22.0
    assert parser.parse_args(["target", "--model", "m.gguf", "--memory-cap-gb", "20"]).memory_cap_gb == 20.0
    assert parser.parse_args(["serve"]).memory_cap_gb == 24.0
    assert parser.parse_args(["draft", "--model", "d", "--target-model", "t"]).memory_cap_gb == 0.0


# -- the real `splitspec target` process ----------------------------------------------------------


@pytest.mark.slow
def test_target_refuses_a_cap_it_cannot_fit(services, tiny_qwen35_pair, monkeypatch):
    """Through the environment variable, as a deployment sets it: 64 sequences of 257-row trees need
    hundreds of MiB of tree buffers; the cap is 10 MiB."""
    monkeypatch.setenv("SPLITSPEC_TARGET_MEMORY_CAP_GB", "0.01")
    services.start(
        "target", "target", "--model", str(tiny_qwen35_pair.target), "--max-sequences", "64", "--max-tree-nodes", "256",
        "--max-kv-tokens", "1024", wait=False,
    )
    assert services.procs["target"].wait(timeout=60) == 2
    log = services.log("target")
    assert "Traceback" not in log and "target memory plan:" in log
    last = log.strip().splitlines()[-1]
    assert "over the" in last and "--memory-cap-gb 0.01" in last
    assert "tree buffers" in last and "--max-tree-nodes" in last
    assert "paged KV cache" not in log  # refused before the pools


@pytest.mark.slow
def test_target_under_a_cap_it_fits_logs_its_plan_and_serves(services, tiny_qwen35_pair):
    services.start(
        "target", "target", "--model", str(tiny_qwen35_pair.target), "--memory-cap-gb", "0.004",
        "--max-sequences", "4", "--max-tree-nodes", "22",
    )
    log = services.log("target")
    block = log[log.index("target memory plan:"):]
    for part in ("weights", "KV cache", "state slots", "tree buffers", "workspace", "total"):
        assert re.search(rf"\n  {part} +\d+\.\d\d MiB", block), part
    assert re.search(r"cap 4\.10 MiB \(--memory-cap-gb 0\.004\), budget [\d.]+ MiB after [\d.]+ MiB of headroom: fits", block), block
    # The auto KV size took what the cap left, far below the CPU's 1 GiB default (4 x 4096 positions here).
    positions = int(re.search(r"paged KV cache: (\d+) positions", log).group(1))
    assert 16 <= positions < 4 * 4096


# -- the issue-#17 configuration -------------------------------------------------------------------


def test_the_27b_q4km_pair_at_16k_context_and_budget_22():
    """Qwen3.5-27B Q4_K_M as the benchmark's ``random:qwen35-27b-q4km`` shape holds it (linears in
    GGUF blocks, the embedding in Q4_K, the head in Q6_K, as a keep-quantized load holds a real
    file), on the meta device: nothing is allocated. One sequence of 16,384 positions, trees of 22
    nodes, bf16 compute; the draft of the published 27B shape (5 layers, hidden 5120) with one
    context slot of 16,384 positions, borrowing the target's embedding and head in their blocks.
    The parts are checked against arithmetic on the geometry; whether the pair fits 23 GiB is
    printed (``pytest -s``), not asserted: it is the finding, not a property of the code."""
    from gguf import GGMLQuantizationType as Q

    from native.gguf_matmul import QuantLinear
    from splitspec.bench.random_weights import QWEN35_27B, random_draft_config
    from splitspec.models.dflash import DFlashDraft
    from splitspec.models.quantized import QuantEmbedding, q4_k_m_types, swap_quant_linears
    from splitspec.models.qwen35 import Qwen35ForCausalLM

    c, bf16 = QWEN35_27B, torch.bfloat16
    assert (c.num_layers, c.num_full_layers, c.hidden_size, c.vocab_size) == (64, 16, 5120, 248320)
    with torch.device("meta"):
        target = Qwen35ForCausalLM(c)
    swap_quant_linears(target, q4_k_m_types(target))
    target.embed_tokens = QuantEmbedding(Q.Q4_K, c.vocab_size, c.hidden_size, bf16, device="meta")
    target = target.to(bf16)
    limits = TargetLimits(max_sequences=1, max_kv_tokens=16384, max_tree_nodes=22)
    draft_config = random_draft_config("random:qwen35-27b-dflash")
    with torch.device("meta"):
        draft = DFlashDraft(draft_config).to(bf16)
    embed = QuantEmbedding(Q.Q4_K, c.vocab_size, c.hidden_size, bf16, device="meta")
    head = QuantLinear(Q.Q6_K, c.hidden_size, c.vocab_size, device="meta")
    plans = {}
    for name, state_dtype in (("float32", None), ("bfloat16", bf16)):
        target.state_dtype = state_dtype
        plans[name] = mp.target_plan(target, c, bf16, limits, cap=24 * GiB)
    plans["draft"] = mp.draft_plan(draft, embed, head, slots=1, context=16384, max_sequences=1, cap=24 * GiB)

    # Weights: llama.cpp's Q4_K_M file is 15.4 GiB (DESIGN.md); the recipe of models.quantized may
    # differ from llama.cpp's in a few tensors (within 3% of the file).
    q4_k_embed, q6_k_head = c.vocab_size * c.hidden_size // 256 * 144, c.vocab_size * c.hidden_size // 256 * 210
    assert abs(plans["float32"].weights - 15.4 * GiB) < 0.03 * 15.4 * GiB
    # KV: 16 attention layers x K and V x 4 heads x 256 x bf16 = 64 KiB a position, 1025 blocks of 16.
    assert plans["float32"].kv_cache == 1025 * 16 * 16 * 2 * 4 * 256 * 2
    # A tree row: per DeltaNet layer a 10240-channel conv input and the delta rule's inputs (a float32
    # key of 16 x 128, a bf16 value of 48 x 128, float32 decay and strength per value head), whatever
    # the states' dtype: the commit recomputes the state. A slot: a [48, 128, 128] state and 3 conv inputs.
    state, conv = 48 * 128 * 128, 2 * 16 * 128 + 48 * 128
    for name, itemsize in (("float32", 4), ("bfloat16", 2)):
        assert plans[name].tree_buffers == 2 * 23 * 48 * (conv * 2 + 16 * 128 * 4 + 48 * 128 * 2 + 2 * 48 * 4)
        assert plans[name].state_slots == 2 * 48 * (state * itemsize + 3 * conv * 2)
    d = draft_config
    layer = (d.hidden_size * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim * d.hidden_size
             + 3 * d.hidden_size * d.intermediate_size + 2 * d.hidden_size + 2 * d.head_dim)
    draft_values = d.num_layers * layer + 5 * d.hidden_size * d.hidden_size + 2 * d.hidden_size
    assert plans["draft"].weights == 2 * draft_values + q4_k_embed + q6_k_head
    assert plans["draft"].context_slots == 5 * 2 * 8 * (16384 + 16) * 128 * 2
    # A prompt chunk's attention over the whole context: gathered K and V (4 heads x 256), its mask
    # and the bf16 additive mask built from it.
    target.state_dtype = None
    longer = mp.target_plan(target, c, bf16, TargetLimits(max_sequences=1, max_kv_tokens=32768, max_tree_nodes=22), cap=24 * GiB)
    assert longer.workspace - plans["float32"].workspace == 16384 * (2 * 4 * 256 * 2 + 512 * (1 + 2))

    print("\n-- issue #17: Qwen3.5-27B Q4_K_M + 27B DFlash draft, 16K context, budget 22 --")
    for name, plan in plans.items():
        print(f"[{name if name == 'draft' else f'target, {name} states'}]\n{plan.describe()}")
    for states in ("float32", "bfloat16"):
        pair = plans[states].total + plans["draft"].total
        parts = {f"target {k}": v for k, v in plans[states].parts.items()} | {f"draft {k}": v for k, v in plans["draft"].parts.items()}
        largest = max(parts, key=parts.get)
        print(
            f"pair with {states} states: {pair / GiB:.2f} GiB against 23 GiB: "
            f"{'fits' if pair <= 23 * GiB else f'does not fit, over by {(pair - 23 * GiB) / GiB:.2f} GiB'}; "
            f"largest part: {largest} {parts[largest] / GiB:.2f} GiB"
        )


def test_the_expanded_tile_is_the_largest_kept_weight_fused_or_not_up_to_the_tile_limit():
    """Many-row matmuls expand a kept weight a tile at a time (``native.gguf_expand``): the plan
    counts the largest tile, fused projections included (their rows outnumber either layer's)."""
    from gguf import GGMLQuantizationType as Q
    from torch import nn

    from native.gguf_expand import TILE_BYTES
    from native.gguf_matmul import QuantLinear
    from splitspec.models.layers import fuse_linears

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up = QuantLinear(Q.Q4_K, 512, 96, device="meta"), QuantLinear(Q.Q4_K, 512, 64, device="meta")
            self.out = QuantLinear(Q.Q6_K, 256, 256, device="meta")

    block = Block()
    assert mp.expand_tile_bytes(block, 2) == 256 * 256 * 2  # apart: the Q6_K weight is the largest
    block.fused = fuse_linears(block.gate, block.up)
    assert block.fused is not None
    assert mp.expand_tile_bytes(block, 2) == 160 * 512 * 2
    assert mp.expand_tile_bytes(nn.Linear(512, 64), 2) == 0  # nothing kept: no tile
    big = QuantLinear(Q.Q6_K, 5120, 248_320, device="meta")  # a 27B LM head: 2.5 GB as bf16
    assert TILE_BYTES - 16 * 5120 * 2 < mp.expand_tile_bytes(big, 2) <= TILE_BYTES
