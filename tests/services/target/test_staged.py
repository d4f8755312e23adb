"""A verify pass in stages (``TargetEngine.prepare_pass`` ... ``finish_pass``), as the target's
batcher runs them: one cohort's pass prepared while the other's is on the device, settled, the
prepared one launched, and only then the settled one finished. Every sequence's output must equal
what serial ``verify_batch`` passes give it, for the dense and the hybrid target, greedy and
seeded sampling, exact and fixed shapes; a pass prepared ahead takes no block that would need a
preemption, and a sequence released while its pass is on the device leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.target.engine import TargetEngine, TargetLimits, VerifyStep
from splitspec.bench.components import random_tree
from splitspec.errors import NotFound
from splitspec.models.loader import load_target
from splitspec.spec.sampling import SamplingParams

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def cohort_steps(rng, vocab: int, cohort: list[str], rounds: int) -> list[list[VerifyStep]]:
    """``rounds`` passes of ``cohort``: trees of budgets 0 (a decode step), 3 and 12."""
    passes = []
    for _ in range(rounds):
        trees = [random_tree(rng, vocab, int(rng.choice([0, 3, 12]))) for _ in cohort]
        passes.append([VerifyStep(sid, tokens, parents, return_features=True) for sid, (tokens, parents) in zip(cohort, trees)])
    return passes


def outputs(results) -> list:
    return [(r.committed_tokens, r.next_token, r.committed_length, r.features) for r in results]


@pytest.mark.parametrize("fixed_shapes,thread", [(False, False), (False, True), (True, False)], ids=["exact", "exact-thread", "fixed"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_pass_prepared_while_the_other_cohorts_is_on_the_device_gives_the_serial_output(model, sampling, fixed_shapes, thread):
    """``thread``: each pass computes on the engine's CPU pass thread while the next is prepared."""
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    prompts = {f"s{i}": rng.integers(0, vocab, n).tolist() for i, n in enumerate((5, 13, 30, 7, 19))}
    a, b = ["s0", "s1", "s2"], ["s3", "s4"]
    passes = [p for pair in zip(cohort_steps(rng, vocab, a, 4), cohort_steps(rng, vocab, b, 4)) for p in pair]  # A, B, A, ...

    def engine(cpu_pass_thread: bool = False) -> TargetEngine:
        e = TargetEngine(model, TargetLimits(max_kv_tokens=2048), fixed_shapes=fixed_shapes, cpu_pass_thread=cpu_pass_thread)
        for sid, prompt in prompts.items():
            e.prefill(sid, prompt, sampling, taps=(0, 2), reserve_tokens=160)
        return e

    serial = engine()
    expected = [outputs(serial.verify_batch(steps)) for steps in passes]

    staged, got, overlapped = engine(thread), [], 0
    flying = staged.prepare_pass(passes[0])
    staged.launch_pass(flying)
    for i, steps in enumerate(passes[1:] + [None], start=1):
        busy = frozenset(s.sequence_id for s in passes[i - 1])
        overlapped += staged.pass_running(flying)
        following = staged.prepare_pass(steps, busy) if steps is not None else None
        staged.settle_pass(flying)
        if following is not None:
            staged.launch_pass(following, ahead=True)
        got.append(outputs(staged.finish_pass(flying)))
        flying = following
    for want, have in zip(expected, got, strict=True):
        for w, h in zip(want, have, strict=True):
            assert w[:3] == h[:3]
            assert torch.allclose(w[3], h[3], atol=1e-10)
    assert (overlapped > 0) == thread  # with the thread, passes were prepared while one computed


def test_a_pass_prepared_ahead_takes_no_block_that_would_need_a_preemption(tiny_pair):
    """Ahead of a pass on the device, a preemption could hit a sequence of that pass: a pass whose
    blocks are not free is not prepared then (None, nothing taken) and is prepared after the settle,
    where it may preempt as any pass does. Its steps must not name a sequence of the busy pass."""
    model, _ = load_target(tiny_pair.target, dtype=torch.float32)
    engine = TargetEngine(model, TargetLimits(max_kv_tokens=48, block_size=4))
    for sid in ("a", "b"):
        engine.prefill(sid, [1, 2, 3], GREEDY, reserve_tokens=40)
    flying = engine.prepare_pass([VerifyStep("a", list(range(3, 12)), list(range(9)))])  # a grows
    engine.launch_pass(flying)
    free = engine.kv.free_blocks
    big = [VerifyStep("b", list(range(3, 3 + 30)), list(range(30)))]  # more blocks than are free
    assert engine.prepare_pass(big, busy=frozenset({"a"})) is None
    assert engine.kv.free_blocks == free and len(engine.sequences.get("b").holding.blocks) == 1
    with pytest.raises(RuntimeError, match="on the device"):
        engine.prepare_pass([VerifyStep("a", [], [])], busy=frozenset({"a"}))
    engine.settle_pass(flying)
    assert engine.finish_pass(flying)[0].committed_length > 3
    later = engine.prepare_pass(big)  # now it may preempt: a, the older, keeps its blocks; b is the newest
    engine.launch_pass(later)
    engine.settle_pass(later)
    (result,) = engine.finish_pass(later)
    assert isinstance(result, NotFound) and "a" in engine.sequences  # b, the newest, gave way


def test_a_sequence_released_while_its_pass_is_on_the_device_leaves_nothing_behind(tiny_pair):
    """Between its stages the engine is idle, so a release gives the blocks back at once: the pass
    still settles and answers its other sequences as before, and every block is free once all go."""
    model, _ = load_target(tiny_pair.target, dtype=torch.float32)
    rng = np.random.default_rng(2)
    engine = TargetEngine(model, TargetLimits(max_kv_tokens=512, block_size=4))
    twin = TargetEngine(model, TargetLimits(max_kv_tokens=512, block_size=4))
    for e in (engine, twin):
        for sid in ("a", "b"):
            e.prefill(sid, [5, 6, 7, 8], GREEDY, reserve_tokens=64)
    tokens, parents = random_tree(rng, model.config.vocab_size, 12)
    steps = [VerifyStep(sid, tokens, parents) for sid in ("a", "b")]
    flying = engine.prepare_pass(steps)
    engine.launch_pass(flying)
    assert engine.sequences.pop("a")
    assert engine.sequences.get("a") is None
    engine.settle_pass(flying)
    results = engine.finish_pass(flying)
    assert results[1].committed_tokens == twin.verify_batch(steps)[1].committed_tokens
    assert engine.sequences.pop("b")
    assert engine.kv.free_blocks == engine.kv.usable_blocks
