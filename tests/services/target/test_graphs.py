"""The fixed-shape passes (padded rows, sequences and key spans over the paged KV cache) against the
exact-shape eager pass.

On the CPU the fixed shapes run without graph capture, so these tests pin everything the CUDA
graphs replay: padding, masks, block-table reads and writes, span buckets, shape reuse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.target import graphs
from services.target.engine import TargetEngine, TargetLimits, VerifyStep
from services.target.graphs import PREFILL_BUCKETS, ROW_BUCKETS, WARM_BLOCKS, WARM_SPANS, bucket, warm_up_passes, warm_up_start
from services.worker.cuda_graphs import attention_span
from splitspec.models.loader import load_target
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree
from tests.services.graph_capture import CaptureOnCpu

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def model(request, tiny_pair, tiny_qwen35_pair):
    path = tiny_pair.target if request.param == "qwen3" else tiny_qwen35_pair.target
    model, _ = load_target(path, dtype=torch.float64)
    return model


def engines(model, limits: TargetLimits | None = None) -> tuple[TargetEngine, TargetEngine]:
    return TargetEngine(model, limits), TargetEngine(model, limits, fixed_shapes=True)


def random_tree(rng, vocab: int, budget: int):
    ids = np.stack([rng.choice(vocab, 3, replace=False) for _ in range(8)])
    return build_ddtree(ids, -np.sort(rng.random((8, 3)) * 3, axis=1), budget)


def test_buckets():
    assert [bucket(n, ROW_BUCKETS) for n in (1, 2, 3, 23, 24, 25, 257)] == [1, 2, 4, 24, 24, 32, 264]
    assert bucket(ROW_BUCKETS[-1] + 1, ROW_BUCKETS) is None
    assert [attention_span(e) for e in (1, 256, 257, 600)] == [256, 256, 512, 1024]
    assert [bucket(n, PREFILL_BUCKETS) for n in (1, 64, 65, 300, 512, 513)] == [64, 64, 128, 512, 512, None]


@pytest.mark.parametrize("prompt_len", [5, 250])  # the second crosses from span 256 to 512
def test_tree_rows_equal_the_eager_pass(model, prompt_len):
    eager, fixed = engines(model)
    rng = np.random.default_rng(prompt_len)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    for engine in (eager, fixed):
        engine.prefill("s", prompt, GREEDY, taps=(0, 2), reserve_tokens=300)
    for budget in (0, 3, 22, 40):
        tree = random_tree(rng, vocab, budget)
        tokens, parents = tree.tokens.astype(np.int64), tree.parents.astype(np.int64)
        out_e = eager.tree_forward(eager.sequences.get("s"), tokens, parents)
        out_s = fixed.tree_forward(fixed.sequences.get("s"), tokens, parents)
        for a, b in zip(out_e, out_s, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b.double(), atol=1e-9), f"budget {budget}"


@pytest.mark.parametrize(("prompt_len", "feature_rows"), [(7, 0), (600 - 40, 300)])  # one chunk (padded), two
def test_a_prompt_runs_in_chunked_fixed_passes_equal_to_the_eager_prefill(model, prompt_len, feature_rows):
    eager, fixed = engines(model)
    prompt = np.random.default_rng(prompt_len).integers(0, model.config.vocab_size, prompt_len).tolist()
    results = [e.prefill("s", prompt, GREEDY, taps=(0, 2), reserve_tokens=600, feature_rows=feature_rows) for e in (eager, fixed)]
    chunks = sorted(key[0] for key in fixed.runner._passes if key[-1])  # prompt-chunk passes by padded rows
    # The hybrid's too: its padding rows neither decay nor write the chunk's recurrent state.
    assert chunks == ([64] if prompt_len < 64 else [64, 512])
    assert results[0].next_token == results[1].next_token
    assert results[0].features.shape == results[1].features.shape == (feature_rows or prompt_len, 2 * model.config.hidden_size)
    assert torch.allclose(results[0].features, results[1].features, atol=1e-9)
    caches = [e.sequence_cache(e.sequences.get("s")) for e in (eager, fixed)]
    assert torch.allclose(caches[0].k[:, :, :prompt_len], caches[1].k[:, :, :prompt_len], atol=1e-9)
    for name in ("conv", "recurrent"):  # the hybrid's state slots
        if hasattr(caches[0], name):
            assert torch.allclose(getattr(caches[0], name), getattr(caches[1], name), atol=1e-9), name
    # Decoding goes on alike from either prefill.
    assert eager.verify("s", [], []).next_token == fixed.verify("s", [], []).next_token


def test_batches_of_every_mix_generate_alike_and_reuse_their_shapes(model):
    """Sequences of different lengths, with trees of different sizes and decode steps, in batches
    that change from step to step: the fixed-shape passes (padded rows and sequences) give every
    sequence what the exact eager passes give."""
    eager, fixed = engines(model)
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    ids = [f"s{i}" for i in range(5)]
    for sid, length in zip(ids, (3, 17, 40, 90, 9)):
        prompt = rng.integers(0, vocab, length).tolist()
        for engine in (eager, fixed):
            engine.prefill(sid, prompt, GREEDY, taps=(1,), reserve_tokens=400)
    for step in range(8):
        members = [sid for sid in ids if rng.random() < 0.7] or ids[:1]
        steps = []
        for sid in members:
            tree = random_tree(rng, vocab, int(rng.choice([0, 1, 5, 22])))
            steps.append(VerifyStep(sid, tree.tokens.tolist(), tree.parents.tolist(), True))
        for e, s in zip(eager.verify_batch(steps), fixed.verify_batch(steps), strict=True):
            assert (e.committed_tokens, e.next_token, e.committed_length) == (s.committed_tokens, s.next_token, s.committed_length)
            assert torch.allclose(e.features, s.features, atol=1e-9)
            assert e.pass_sequences == s.pass_sequences == len(steps)
    shapes = len(fixed.runner._passes)
    fixed.verify_batch([VerifyStep("s0", [], [], True)])  # a shape seen before: no new pass
    assert len(fixed.runner._passes) <= shapes + 1


def test_blocks_come_back_when_a_sequence_ends(model):
    _, fixed = engines(model, TargetLimits(max_kv_tokens=64, block_size=16))
    free = fixed.kv.free_blocks
    fixed.prefill("a", list(range(1, 20)), GREEDY, reserve_tokens=60)  # 20 positions: 2 blocks
    assert fixed.kv.free_blocks == free - 2
    fixed.verify("a", list(range(5, 19)), list(range(14)))  # 19 + 15 rows: a third block
    assert fixed.kv.free_blocks == free - 3
    assert fixed.sequences.pop("a")
    assert fixed.kv.free_blocks == free


def test_warm_up_covers_every_batch_of_one_block_size_largest_pass_first():
    """warm_up's passes: one for each shape (rows and sequences padded to their buckets) of a batch
    of 1 to 32 sequences whose blocks are all one adaptive budget's, at each span, the largest first
    (it sizes the graphs' output buffers); passes over the row limit are left out."""
    passes = warm_up_passes(32, 256)
    assert {rows for _, rows, _ in passes} == set(WARM_BLOCKS) and {span for span, _, _ in passes} == set(WARM_SPANS)
    assert all(bucket(n * rows, ROW_BUCKETS) <= 256 and warm_up_start(span, rows) >= 1 for span, rows, n in passes)

    def shape(rows, n):
        return bucket(n * rows, ROW_BUCKETS), 1 << (n - 1).bit_length()

    for span in WARM_SPANS:
        for rows in WARM_BLOCKS:
            made = [shape(rows, n) for s, r, n in passes if (s, r) == (span, rows)]
            wanted = {shape(rows, n) for n in range(1, 33) if shape(rows, n)[0] <= 256}
            assert sorted(made) == sorted(wanted), (span, rows)  # each shape once
    sizes = [n * rows for _, rows, n in passes]
    assert sizes == sorted(sizes, reverse=True)
    assert {n for _, rows, n in warm_up_passes(6, 2048) if rows == 1} == {1, 2, 3, 5}  # batches of 1, 2, 3-4, 5-6


def test_warm_up_makes_the_batch_shapes_and_touches_no_sequence(model):
    eager, fixed = engines(model)
    prompt = list(range(3, 40))
    for engine in (eager, fixed):
        engine.prefill("s", prompt, GREEDY, taps=(1,), reserve_tokens=300)
    held = fixed.sequence_cache(fixed.sequences.get("s"))
    made = fixed.runner.warm_up(4, blocks=(1, 24), spans=(256,))
    # Batches of 1, 2 and 4 sequences, of one row (decode) and of 24 rows (a budget-22 tree).
    assert made == 6 and {(key[1], key[2]) for key in fixed.runner._passes if not key[-1]} >= {(b, t) for b in (1, 2, 4) for t in (1, 24)}
    after = fixed.sequence_cache(fixed.sequences.get("s"))
    assert torch.equal(held.k, after.k) and torch.equal(held.v, after.v)  # only the pad block was written
    for name in ("conv", "recurrent"):  # the hybrid's tree passes only read the state slots
        if hasattr(held, name):
            assert torch.equal(getattr(held, name), getattr(after, name)), name
    for _ in range(3):
        e, f = eager.verify("s", [], [], True), fixed.verify("s", [], [], True)
        assert (e.committed_tokens, e.next_token) == (f.committed_tokens, f.next_token)
        assert torch.allclose(e.features, f.features, atol=1e-9)


def test_a_stand_in_covers_the_shape_with_the_fewest_rows():
    """``stand_in``: same kind, no fewer rows, sequences, block rows or keys, the same taps (any taps
    for a pass that wants none); the fewest rows, then keys."""
    taps = (1, 3)
    captured = [(24, 1, 24, 1024, taps, False), (8, 1, 8, 512, taps, False), (8, 1, 8, 1024, taps, False),
                (32, 2, 16, 512, (), False), (64, 1, 64, 512, taps, True)]
    assert graphs.stand_in((2, 1, 2, 512, taps, False), captured) == (8, 1, 8, 512, taps, False)
    assert graphs.stand_in((8, 1, 8, 1024, (), False), captured) == (8, 1, 8, 1024, taps, False)  # features dropped
    assert graphs.stand_in((16, 1, 16, 512, taps, False), captured) == (24, 1, 24, 1024, taps, False)
    assert graphs.stand_in((16, 2, 8, 512, (), False), captured) == (32, 2, 16, 512, (), False)
    assert graphs.stand_in((16, 2, 8, 512, taps, False), captured) is None  # no tapped pass of two sequences
    assert graphs.stand_in((8, 1, 8, 2048, taps, False), captured) is None  # more keys than any
    assert graphs.stand_in((2, 1, 2, 512, (1,), False), captured) is None  # other taps
    assert graphs.stand_in((64, 1, 64, 256, taps, True), captured) == (64, 1, 64, 512, taps, True)  # prompt chunks only
    assert graphs.stand_in((4, 1, 4, 256, taps, False), []) is None


def test_passes_run_in_their_stand_ins_give_what_the_exact_passes_give(model, monkeypatch):
    """A step whose shape has no graph yet runs in a larger warmed pass (more rows, sequences or
    keys) or, wanting no features, in a tapped pass of its shape, and commits what the eager engine
    does. On the CPU no pass is captured; here every warmed pass counts as captured, so the stand-in
    runs eagerly at its shape, as its graph would replay it."""
    eager, fixed = engines(model)
    taps = (0, 2)
    fixed.runner.warm_up(2, blocks=(8, 24), spans=(256, 512), taps=taps)
    warmed = list(fixed.runner._passes)
    monkeypatch.setattr(fixed.runner, "_captured", lambda: warmed)
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    for sid, length in (("a", 30), ("b", 7)):
        prompt = rng.integers(0, vocab, length).tolist()
        for engine in (eager, fixed):
            engine.prefill(sid, prompt, GREEDY, taps=taps if sid == "a" else (), reserve_tokens=300)
    for budget in (3, 0, 5, 22, 1):
        steps = [VerifyStep(sid, *(t.tolist() for t in (tree.tokens, tree.parents)), sid == "a")
                 for sid in ("a", "b") for tree in [random_tree(rng, vocab, budget)]]
        for e, f in zip(eager.verify_batch(steps), fixed.verify_batch(steps), strict=True):
            assert (e.committed_tokens, e.next_token, e.committed_length) == (f.committed_tokens, f.next_token, f.committed_length)
            assert (e.features is None) == (f.features is None)
            if e.features is not None:
                assert torch.allclose(e.features, f.features, atol=1e-9)
    e, f = eager.verify("b", [3], [0]), fixed.verify("b", [3], [0])  # no features: a tapped pass, its features dropped
    assert (e.committed_tokens, e.next_token, e.features, f.features) == (f.committed_tokens, f.next_token, None, None)
    # Budgets 0, 1 and 3 ran in the pass of two 8-row blocks, b's step in that of one; 5 and 22
    # (tapped: one sequence wants features) in their own warmed passes.
    assert fixed.runner.stand_in_passes == 4
    assert fixed.runner.unmeasured == 4  # all four larger: their times are the stand-ins', not their steps' shapes'


def test_a_stand_in_serves_until_its_padding_adds_up_to_a_capture(model, monkeypatch):
    """A shape with a larger captured pass runs in it, not at its third pass captured, until the
    passes' padding adds up to ``hot_padding`` passes (what a capture costs): a shape that comes and
    goes costs no capture. Here a 4-row tree in the warmed 8-row pass is half padding, so with
    ``hot_padding`` 2 the first four passes stand in and the fifth runs at its own shape (on a GPU,
    captured). Every warmed pass counts as captured, as in the test above."""
    assert graphs.padding((48, 8, 8, 1024), (64, 8, 8, 1024)) == 0.25
    assert graphs.padding((16, 2, 8, 512), (32, 2, 16, 512)) == 0.5  # block rows padded most
    assert graphs.padding((8, 1, 8, 512), (8, 1, 8, 1024)) == 0.5  # keys too
    _, fixed = engines(model)
    runner = fixed.runner
    assert (runner.hot_passes, runner.hot_padding) == (graphs.HOT_PASSES, graphs.HOT_PADDING)
    runner.warm_up(1, blocks=(8,), spans=(256,))
    warmed = list(runner._passes)
    monkeypatch.setattr(runner, "_captured", lambda: warmed)
    runner.hot_padding = 2.0
    rng = np.random.default_rng(12)
    vocab = model.config.vocab_size
    fixed.prefill("a", rng.integers(0, vocab, 20).tolist(), GREEDY, reserve_tokens=300)
    stood_in = []
    for _ in range(6):
        tree = random_tree(rng, vocab, 3)
        fixed.verify_batch([VerifyStep("a", tree.tokens.tolist(), tree.parents.tolist(), False)])
        stood_in.append(runner.stand_in_passes)
    assert stood_in == [1, 2, 3, 4, 4, 4]
    assert runner._passes[(4, 1, 4, 256, (), False)].padding == 2.0


def test_an_eager_pass_until_its_shape_is_captured_reports_no_time(model):
    """A shape met while serving runs eagerly until its hot pass captures it: those runs take many
    times a replay (launches, compiles), so their passes report no time (forward_ns 0), as a capture
    does, and the adaptive budget's cost curve never learns them. A shape too large to capture
    always runs eagerly: that is its cost, reported. (On the CPU capture is off; switched on here,
    these passes stop before their hot pass, so nothing is captured.)"""
    _, fixed = engines(model)
    runner = fixed.runner
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    fixed.prefill("a", rng.integers(0, vocab, 20).tolist(), GREEDY, reserve_tokens=300)

    def pass_time(budget: int) -> int:
        tree = random_tree(rng, vocab, budget)
        return fixed.verify_batch([VerifyStep("a", tree.tokens.tolist(), tree.parents.tolist(), False)])[0].forward_ns

    assert pass_time(3) > 0  # capture off: every pass is the measure of its shape
    runner.capture = True
    assert runner.hot_passes == 3
    assert [pass_time(5) for _ in range(2)] == [0, 0]  # a new shape, captured at its third pass
    runner.capture_rows = 4  # shapes above 4 rows are never captured: their eager time is their cost
    assert pass_time(5) > 0
    assert runner.graphs == 0 and runner.unmeasured == 2


def test_a_failed_capture_runs_its_shape_eagerly_and_the_others_keep_their_graphs(model, monkeypatch, caplog):
    """The first capture (the prompt chunk's) fails as one that another thread's CUDA call
    invalidated: the pass runs eagerly (the hybrid's state put back first: the run before the
    capture moved it on) and so does every later pass of its shape, never captured again, while
    the decode and tree shapes are captured and replayed; every sequence commits what the eager
    engine commits."""
    stub = CaptureOnCpu(fail=(1,))
    monkeypatch.setattr(graphs, "capture", stub)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eager, fixed = TargetEngine(model), TargetEngine(model, fixed_shapes=True, capture=True, hot_passes=1, hot_padding=0)
    rng = np.random.default_rng(9)
    vocab = model.config.vocab_size
    for sid in ("a", "b"):  # two prompts of one chunk shape
        prompt = rng.integers(0, vocab, 20).tolist()
        e, f = (engine.prefill(sid, prompt, GREEDY, taps=(1,), reserve_tokens=200) for engine in (eager, fixed))
        assert e.next_token == f.next_token and torch.allclose(e.features, f.features, atol=1e-9)
    for budget in (0, 5, 0, 5, 22):
        steps = [VerifyStep(sid, *(t.tolist() for t in (tree.tokens, tree.parents)), True)
                 for sid in ("a", "b") for tree in [random_tree(rng, vocab, budget)]]
        for e, f in zip(eager.verify_batch(steps), fixed.verify_batch(steps), strict=True):
            assert (e.committed_tokens, e.next_token) == (f.committed_tokens, f.next_token)
            assert torch.allclose(e.features, f.features, atol=1e-9)
    runner = fixed.runner
    failed = [key for key, p in runner._passes.items() if p.never_captured]
    captured = [key for key, p in runner._passes.items() if p.graph is not None]
    assert len(failed) == 1 and failed[0][-1] and runner.capture_failures == 1  # the prompt chunk's shape
    assert len(captured) >= 2 and stub.calls == 1 + len(captured)  # each other shape captured once, then replayed
    assert "that shape runs eagerly (1 shapes so far)" in caplog.text


def test_a_prompt_chunk_captured_while_serving_moves_the_state_on_once(model, monkeypatch):
    """A capture runs its pass twice (before capturing, and the replay after): a hybrid's prompt
    chunk, which moves its sequence's conv and recurrent state on in place, gets the state put back
    between, so the sequence's prefill (captured at its first chunk here) leaves the state, the
    features and the next token the eager engine's do; the second sequence's replays the graph."""
    stub = CaptureOnCpu()
    monkeypatch.setattr(graphs, "capture", stub)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eager, fixed = TargetEngine(model), TargetEngine(model, fixed_shapes=True, capture=True, hot_passes=1, hot_padding=0)
    rng = np.random.default_rng(4)
    for sid in ("a", "b"):
        prompt = rng.integers(0, model.config.vocab_size, 30).tolist()
        e, f = (engine.prefill(sid, prompt, GREEDY, taps=(1,), reserve_tokens=100) for engine in (eager, fixed))
        assert e.next_token == f.next_token and torch.allclose(e.features, f.features, atol=1e-9)
        caches = [engine.sequence_cache(engine.sequences.get(sid)) for engine in (eager, fixed)]
        for name in ("conv", "recurrent"):  # the hybrid's state slots
            if hasattr(caches[0], name):
                assert torch.allclose(getattr(caches[0], name), getattr(caches[1], name), atol=1e-9), name
    assert stub.calls == 1 and [key for key, p in fixed.runner._passes.items() if p.graph is not None and key[-1]]


@pytest.mark.parametrize("chunk", [512, 300, 64])
def test_warm_up_prompt_chunks_are_the_shapes_prompts_up_to_the_largest_span_make(chunk):
    """``warm_up_prompt_chunks``: the shapes (rows padded to their bucket, keys to their span) of the
    chunks that prompts of 1 to 1,024 tokens are cut into, every one of them and no other, each
    once, the largest first."""
    made = graphs.warm_up_prompt_chunks(chunk, WARM_SPANS)

    def shape(start, rows):
        return bucket(rows, PREFILL_BUCKETS), attention_span(start + bucket(rows, PREFILL_BUCKETS))

    met = {shape(begin, min(n, begin + chunk) - begin) for n in range(1, max(WARM_SPANS) + 1) for begin in range(0, n, chunk)}
    assert sorted(shape(start, rows) for start, rows in made) == sorted(met)
    assert [rows for _, rows in made] == sorted((rows for _, rows in made), reverse=True)


def test_warm_up_captures_the_prompt_chunks_and_leaves_the_pad_state_as_it_was(model, monkeypatch):
    """With ``prompt_chunk`` warm-up captures the prompt chunks too (on the pad sequence: a hybrid's
    pad state slot is put back afterwards), so prompts up to the largest span are served by
    replays alone, with the next token, features and state the eager engine gives."""
    stub = CaptureOnCpu()
    monkeypatch.setattr(graphs, "capture", stub)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eager, fixed = TargetEngine(model), TargetEngine(model, fixed_shapes=True, capture=True)
    slots = fixed.state.slots
    pad = None if slots is None else {name: t.clone() for name, t in slots.read(0).items()}
    made = fixed.runner.warm_up(1, blocks=(1,), spans=(256, 512, 1024), taps=(1,), prompt_chunk=fixed.prompt_chunk)
    prompts = [key for key, p in fixed.runner._passes.items() if key[-1] and p.graph is not None]
    assert len(prompts) == len(graphs.warm_up_prompt_chunks(fixed.prompt_chunk)) == 8 and made == stub.calls
    if pad is not None:
        assert all(torch.equal(pad[name], t) for name, t in slots.read(0).items())
    rng = np.random.default_rng(5)
    for sid, n in (("a", 40), ("b", 700), ("c", 1000)):  # chunks of 64; 512 + 256 rows; 512 + 512
        prompt = rng.integers(0, model.config.vocab_size, n).tolist()
        e, f = (engine.prefill(sid, prompt, GREEDY, taps=(1,), reserve_tokens=n + 40) for engine in (eager, fixed))
        assert e.next_token == f.next_token and torch.allclose(e.features, f.features, atol=1e-9)
        caches = [engine.sequence_cache(engine.sequences.get(sid)) for engine in (eager, fixed)]
        for name in ("conv", "recurrent"):
            if hasattr(caches[0], name):
                assert torch.allclose(getattr(caches[0], name), getattr(caches[1], name), atol=1e-9), name
    assert stub.calls == made  # nothing captured while serving
