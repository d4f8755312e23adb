"""Tree verification against sequential decoding, KV compaction, and the engine's admission rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from splitspec.models.loader import load_target
from splitspec.models.dense import KVCache
from splitspec.services.target.engine import TargetEngine, TargetLimits
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(tiny_pair):
    model, _ = load_target(tiny_pair.target, dtype=torch.float64)  # float64: comparisons are exact to ~1e-12
    return model


def random_tree(rng: np.random.Generator, vocab: int, budget: int):
    depth, k = 6, 3
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(depth)])
    logprobs = -np.sort(rng.random((depth, k)) * 3, axis=1)
    return build_ddtree(ids, logprobs, budget)


def test_every_tree_row_equals_sequential_decoding_of_its_path(model):
    engine = TargetEngine(model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, 7).tolist()
    engine.prefill("tree", prompt, GREEDY, reserve_tokens=64)
    state = engine.sequences["tree"]
    tree = random_tree(rng, vocab, budget=12)
    logits, _, positions = engine.tree_forward(state, tree.tokens.astype(np.int64), tree.parents.astype(np.int64))
    for row in range(tree.num_nodes + 1):
        path, node = [], row
        while node:
            path.append(int(tree.tokens[node - 1]))
            node = int(tree.parents[node - 1])
        path = [state.pending_token, *reversed(path)]
        n = len(prompt) + len(path)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        full, _ = model(torch.tensor(prompt + path), torch.arange(n), KVCache(model.config, n, "cpu", torch.float64), 0, causal)
        assert positions[row].item() == n - 1
        assert torch.allclose(logits[row], full[-1], atol=1e-9)


def test_verify_commits_target_tokens_and_compacts_kv(model):
    """The accepted path's K/V equal those of prefilling the committed tokens sequentially."""
    vocab = model.config.vocab_size
    engine = TargetEngine(model)
    prompt = [5, 9, 33, 120, 7]
    # The target's own greedy continuation, one token at a time.
    engine.prefill("ar", prompt, GREEDY, reserve_tokens=64)
    greedy = [engine.sequences["ar"].pending_token]
    for _ in range(6):
        greedy.append(engine.verify("ar", [], []).next_token)
    # A tree whose second branch follows the continuation for 3 nodes, beside wrong siblings.
    wrong = [(t + 1) % vocab for t in greedy]
    tokens = [wrong[1], greedy[1], greedy[2], wrong[3], greedy[3], wrong[4]]
    parents = [0, 0, 2, 3, 3, 5]
    engine.prefill("tree", prompt, GREEDY, taps=(1, 2), reserve_tokens=64)
    result = engine.verify("tree", tokens, parents, return_features=True)
    assert result.accepted_nodes == [2, 3, 5]
    assert result.committed_tokens == greedy[:4]
    assert result.next_token == greedy[4]
    assert result.features.shape == (4, 2 * model.config.hidden_size)

    engine.prefill("seq", prompt + greedy[:4], GREEDY, taps=(1, 2), reserve_tokens=64)
    tree_state, seq_state = engine.sequences["tree"], engine.sequences["seq"]
    n = len(prompt) + 4
    assert tree_state.length == seq_state.length == n
    assert tree_state.pending_token == seq_state.pending_token
    assert torch.allclose(tree_state.cache.k[:, :, :n], seq_state.cache.k[:, :, :n], atol=1e-10)
    assert torch.allclose(tree_state.cache.v[:, :, :n], seq_state.cache.v[:, :, :n], atol=1e-10)
    # Decoding continues identically from the compacted cache.
    assert [engine.verify("tree", [], []).next_token for _ in range(2)] == greedy[5:7]


def test_chunked_prefill_equals_one_pass(model):
    one = TargetEngine(model, TargetLimits(prefill_chunk=512))
    chunked = TargetEngine(model, TargetLimits(prefill_chunk=3))
    prompt = list(range(10, 21))
    a = one.prefill("a", prompt, GREEDY, taps=(0, 3), reserve_tokens=32, feature_rows=4)
    b = chunked.prefill("a", prompt, GREEDY, taps=(0, 3), reserve_tokens=32, feature_rows=4)
    assert a.next_token == b.next_token
    assert a.features.shape == (4, 2 * model.config.hidden_size)
    assert torch.allclose(a.features, b.features, atol=1e-10)
    assert torch.allclose(one.sequences["a"].cache.k[:, :, :11], chunked.sequences["a"].cache.k[:, :, :11], atol=1e-10)


def test_errors_name_the_field(model):
    engine = TargetEngine(model, TargetLimits(max_sequences=1, max_tree_nodes=4))
    with pytest.raises(InvalidArgument, match="tokens: id 99999"):
        engine.prefill("x", [1, 99999], GREEDY)
    with pytest.raises(InvalidArgument, match="tap_layer_ids"):
        engine.prefill("x", [1, 2], GREEDY, taps=(9,))
    with pytest.raises(InvalidArgument, match="reserve_tokens"):
        engine.prefill("x", [1, 2], GREEDY, reserve_tokens=10**7)
    engine.prefill("x", [1, 2], GREEDY, reserve_tokens=4)
    with pytest.raises(ResourceExhausted):
        engine.prefill("y", [1, 2], GREEDY)
    with pytest.raises(FailedPrecondition, match="already live"):
        engine.prefill("x", [1, 2], GREEDY)
    with pytest.raises(NotFound):
        engine.verify("nope", [], [])
    with pytest.raises(InvalidArgument, match="parents"):
        engine.verify("x", [1, 2], [0, 2])
    with pytest.raises(InvalidArgument):
        engine.verify("x", [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])  # more nodes than max_tree_nodes
    with pytest.raises(FailedPrecondition, match="reserved 4"):
        engine.verify("x", [1, 2], [0, 1])
    assert engine.release("x") and not engine.release("x")
