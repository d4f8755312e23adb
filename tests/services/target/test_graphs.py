"""The fixed-shape fast path (pooled KV slots, padded rows, bucketed spans) against the eager pass.

On the CPU the fixed shapes run without graph capture, so these tests pin everything the CUDA
graphs replay: padding, masks, slot writes, span buckets, slot reuse.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from services.target.engine import TargetEngine
from services.target.graphs import ROW_BUCKETS, PooledKVCache, StaticVerifier, prefill_bucket, row_bucket
from services.worker.cuda_graphs import attention_span
from splitspec.models.loader import load_target
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(tiny_pair):
    model, _ = load_target(tiny_pair.target, dtype=torch.float64)
    return model


def engines(model, slots: int = 2, context: int = 600):
    return TargetEngine(model), TargetEngine(model, static=StaticVerifier(model, slots, context, capture=False))


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 23, 24, 25, 257)] == [1, 2, 4, 24, 24, 32, 264]
    assert row_bucket(ROW_BUCKETS[-1] + 1) is None
    assert [attention_span(e) for e in (1, 256, 257, 600)] == [256, 256, 512, 1024]
    assert [prefill_bucket(n) for n in (1, 64, 65, 300, 512, 513)] == [64, 64, 128, 512, 512, None]


@pytest.mark.parametrize("prompt_len", [5, 250])  # the second crosses from span 256 to 512
def test_tree_rows_equal_the_eager_pass(model, prompt_len):
    eager, static = engines(model)
    rng = np.random.default_rng(prompt_len)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    for engine in (eager, static):
        engine.prefill("s", prompt, GREEDY, taps=(0, 2), reserve_tokens=300)
    assert isinstance(static.sequences.get("s").cache, PooledKVCache)
    for budget in (0, 3, 22, 40):
        ids = np.stack([rng.choice(vocab, 3, replace=False) for _ in range(8)])
        tree = build_ddtree(ids, -np.sort(rng.random((8, 3)) * 3, axis=1), budget)
        tokens, parents = tree.tokens.astype(np.int64), tree.parents.astype(np.int64)
        out_e = eager.tree_forward(eager.sequences.get("s"), tokens, parents)
        out_s = static.tree_forward(static.sequences.get("s"), tokens, parents)
        for a, b in zip(out_e, out_s, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b.double(), atol=1e-9), f"budget {budget}"


@pytest.mark.parametrize(("prompt_len", "feature_rows"), [(7, 0), (600 - 40, 300)])  # one chunk (padded), two
def test_a_pooled_prompt_runs_in_chunked_passes_equal_to_the_eager_prefill(model, prompt_len, feature_rows, monkeypatch):
    eager, static = engines(model)
    passes = []  # a spy: the real method runs
    prefill = static.static.prefill
    monkeypatch.setattr(static.static, "prefill", lambda cache, tokens, *a: passes.append(len(tokens)) or prefill(cache, tokens, *a))
    prompt = np.random.default_rng(prompt_len).integers(0, model.config.vocab_size, prompt_len).tolist()
    results = [e.prefill("s", prompt, GREEDY, taps=(0, 2), reserve_tokens=600, feature_rows=feature_rows) for e in (eager, static)]
    assert passes == ([prompt_len] if prompt_len < 512 else [512, prompt_len - 512])
    assert results[0].next_token == results[1].next_token
    assert results[0].features.shape == results[1].features.shape == (feature_rows or prompt_len, 2 * model.config.hidden_size)
    assert torch.allclose(results[0].features, results[1].features, atol=1e-9)
    caches = [e.sequences.get("s").cache for e in (eager, static)]
    assert torch.allclose(caches[0].k[:, :, :prompt_len], caches[1].k[:, :, :prompt_len], atol=1e-9)
    # Decoding goes on alike from either prefill.
    assert eager.verify("s", [], []).next_token == static.verify("s", [], []).next_token


def test_a_new_verify_shape_makes_the_smaller_ones_first_without_touching_the_sequence(model):
    eager, static = engines(model)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, model.config.vocab_size, 40).tolist()
    for engine in (eager, static):
        engine.prefill("s", prompt, GREEDY, taps=(1,), reserve_tokens=300)
    ids = np.stack([rng.choice(model.config.vocab_size, 3, replace=False) for _ in range(8)])
    tree = build_ddtree(ids, -np.sort(rng.random((8, 3)) * 3, axis=1), 22)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    results = [e.verify("s", tokens, parents, return_features=True) for e in (eager, static)]
    # The 23-row tree's pass came with those of every smaller bucket, made before it ran.
    made = sorted(rows for (slot, rows, span, taps, last_only) in static.static._passes if not last_only)
    assert made == [1, 2, 4, 8, 16, 24]
    assert results[0].committed_tokens == results[1].committed_tokens and results[0].next_token == results[1].next_token
    assert torch.allclose(results[0].features, results[1].features, atol=1e-9)
    for _ in range(3):  # smaller steps find their passes made, and decode on alike
        e, s = (engine.verify("s", [], []) for engine in (eager, static))
        assert (e.committed_tokens, e.next_token) == (s.committed_tokens, s.next_token)
    assert sorted(rows for (slot, rows, span, taps, last_only) in static.static._passes if not last_only) == made


def test_generation_is_identical_and_slots_come_back(model):
    eager, static = engines(model, slots=1)
    prompt = [5, 9, 33, 120, 7]
    rng = np.random.default_rng(0)
    for sid in ("a", "b"):  # "b" finds no free slot and runs eagerly
        for engine in (eager, static):
            engine.prefill(sid, prompt, GREEDY, taps=(1,), reserve_tokens=64)
    assert isinstance(static.sequences.get("a").cache, PooledKVCache)
    assert not isinstance(static.sequences.get("b").cache, PooledKVCache)
    for _ in range(12):
        for sid in ("a", "b"):
            pending = eager.sequences.get(sid).pending_token
            tokens = rng.integers(0, model.config.vocab_size, 3).tolist()
            tokens[0] = pending  # some trees get accepted nodes
            parents = [0, 1, 1]
            e = eager.verify(sid, tokens, parents, return_features=True)
            s = static.verify(sid, tokens, parents, return_features=True)
            assert (e.committed_tokens, e.next_token, e.committed_length) == (s.committed_tokens, s.next_token, s.committed_length)
            assert torch.allclose(e.features, s.features, atol=1e-9)
    assert static.static.free_slots == 0
    static.sequences.pop("a")
    gc.collect()
    assert static.static.free_slots == 1
    static.prefill("c", prompt, GREEDY, reserve_tokens=700)  # longer than a slot: eager
    assert not isinstance(static.sequences.get("c").cache, PooledKVCache)
    assert static.static.free_slots == 1
