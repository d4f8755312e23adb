"""Tree verification against sequential decoding, state commit, and the engine's admission rules.

Every test runs on the dense Qwen3 target and on the Qwen3.5 hybrid (Gated DeltaNet + gated
attention), the latter with recurrent states stored in float64 and in bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.target.engine import TargetEngine, TargetLimits
from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from splitspec.models.loader import load_target
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=["qwen3", "qwen35", "qwen35-bf16-state"])
def model(request, tiny_pair, tiny_qwen35_pair):
    path = tiny_pair.target if request.param == "qwen3" else tiny_qwen35_pair.target
    state_dtype = torch.bfloat16 if request.param.endswith("bf16-state") else None
    model, _ = load_target(path, dtype=torch.float64, state_dtype=state_dtype)  # float64: comparisons are exact to ~1e-12
    return model


def decode_sequentially(model, prompt: list[int], path: list[int]):
    """Prefill ``prompt``, then decode ``path`` one token at a time: (logits of the last token, cache)."""
    n = len(prompt)
    cache = model.new_cache(n + len(path) + 1, "cpu", torch.float64)
    logits, _ = model(torch.tensor(prompt), torch.arange(n), cache, 0, torch.tril(torch.ones(n, n, dtype=torch.bool)))
    for i, token in enumerate(path):
        logits, _ = model(torch.tensor([token]), torch.tensor([n + i]), cache, n + i, torch.ones(1, n + i + 1, dtype=torch.bool))
    return logits[-1], cache


def assert_same_state(a, b, length: int) -> None:
    """K/V of the first ``length`` positions, and the conv and recurrent state of hybrid models."""
    assert torch.allclose(a.k[:, :, :length], b.k[:, :, :length], atol=1e-10)
    assert torch.allclose(a.v[:, :, :length], b.v[:, :, :length], atol=1e-10)
    for name in ("conv", "recurrent"):
        if hasattr(a, name):
            assert getattr(a, name).dtype == getattr(b, name).dtype
            assert torch.allclose(getattr(a, name).double(), getattr(b, name).double(), atol=1e-10), name


def path_tokens(tree, row: int) -> list[int]:
    path = []
    while row:
        path.append(int(tree.tokens[row - 1]))
        row = int(tree.parents[row - 1])
    return path[::-1]


def random_tree(rng: np.random.Generator, vocab: int, budget: int):
    depth, k = 6, 3
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(depth)])
    logprobs = -np.sort(rng.random((depth, k)) * 3, axis=1)
    return build_ddtree(ids, logprobs, budget)


@pytest.mark.parametrize("seed", range(3))
def test_every_tree_row_equals_sequential_decoding_of_its_path(model, seed):
    engine = TargetEngine(model)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, 7).tolist()
    engine.prefill("tree", prompt, GREEDY, reserve_tokens=64)
    state = engine.sequences.get("tree")
    tree = random_tree(rng, vocab, budget=12)
    logits, _, positions = engine.tree_forward(state, tree.tokens.astype(np.int64), tree.parents.astype(np.int64))
    for row in range(tree.num_nodes + 1):
        path = [state.pending_token, *path_tokens(tree, row)]
        expected, _ = decode_sequentially(model, prompt, path)
        assert positions[row].item() == len(prompt) + len(path) - 1
        assert torch.allclose(logits[row], expected, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_commit_of_any_accepted_path_equals_sequential_decoding(model, seed):
    """Whatever path the walk accepts, the committed state is that of decoding it token by token."""
    engine = TargetEngine(model)
    rng = np.random.default_rng(10 + seed)
    prompt = rng.integers(0, model.config.vocab_size, 5).tolist()
    engine.prefill("tree", prompt, GREEDY, reserve_tokens=64)
    state = engine.sequences.get("tree")
    tree = random_tree(rng, model.config.vocab_size, budget=14)
    engine.tree_forward(state, tree.tokens.astype(np.int64), tree.parents.astype(np.int64))
    deepest = int(rng.integers(1, tree.num_nodes + 1))
    accepted, row = [], deepest
    while row:
        accepted.append(row)
        row = int(tree.parents[row - 1])
    engine.commit(state, [0, *reversed(accepted)])
    _, expected = decode_sequentially(model, prompt, [state.pending_token, *path_tokens(tree, deepest)])
    assert_same_state(engine.sequence_cache(state), expected, len(prompt) + len(accepted) + 1)


def test_verify_commits_target_tokens_and_compacts_kv(model):
    """The accepted path's K/V equal those of prefilling the committed tokens sequentially."""
    vocab = model.config.vocab_size
    engine = TargetEngine(model)
    prompt = [5, 9, 33, 120, 7]
    # The target's own greedy continuation, one token at a time.
    engine.prefill("ar", prompt, GREEDY, reserve_tokens=64)
    greedy = [engine.sequences.get("ar").pending_token]
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

    tree_state = engine.sequences.get("tree")
    n = len(prompt) + 4
    assert tree_state.length == n and tree_state.pending_token == greedy[4]
    _, sequential = decode_sequentially(model, prompt, greedy[:4])
    assert_same_state(engine.sequence_cache(tree_state), sequential, n)
    # Decoding continues identically from the compacted cache.
    assert [engine.verify("tree", [], []).next_token for _ in range(2)] == greedy[5:7]


def test_chunked_prefill_equals_one_pass(model):
    if getattr(model, "state_dtype", None) == torch.bfloat16:
        pytest.skip("not applicable: a bfloat16 state is rounded at every chunk boundary, so chunkings differ by design")
    one = TargetEngine(model, TargetLimits(prefill_chunk=512))
    chunked = TargetEngine(model, TargetLimits(prefill_chunk=3))
    prompt = list(range(10, 21))
    a = one.prefill("a", prompt, GREEDY, taps=(0, 3), reserve_tokens=32, feature_rows=4)
    b = chunked.prefill("a", prompt, GREEDY, taps=(0, 3), reserve_tokens=32, feature_rows=4)
    assert a.next_token == b.next_token
    assert a.features.shape == (4, 2 * model.config.hidden_size)
    assert torch.allclose(a.features, b.features, atol=1e-10)
    assert_same_state(one.sequence_cache(one.sequences.get("a")), chunked.sequence_cache(chunked.sequences.get("a")), 11)


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
    assert engine.sequences.pop("x") and not engine.sequences.pop("x")
