"""The gateway's adaptive tree budget: BudgetPolicy learning from observed steps, and the
speculation loop and the servicer using it (fake workers, no processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.gateway.budget import BudgetPolicy, parse_budget
from services.gateway.server import GatewayServicer, GatewayState
from services.gateway.speculation import TARGET_ONLY_RUN, DraftShape, Mode, SpeculationOptions, SpeculativeSequence
from services.gateway.workers import Prefilled, Proposed, Verified
from services.metrics import GatewayMetrics
from splitspec.errors import InvalidArgument
from splitspec.spec.budget import ADAPTIVE_BUDGETS, depth_mass
from splitspec.spec.budget_choice import HYSTERESIS
from splitspec.spec.tree import build_ddtree
from splitspec.transport.tensors import array_from_pb, array_to_pb
from splitspec.v1 import common_pb2, gateway_pb2, target_pb2

DEPTHS, K = 15, 8
TOP_IDS = np.arange(DEPTHS * K, dtype=np.int64).reshape(DEPTHS, K)
# A DFlash-like proposal: the top token has 0.75 of the mass at depth 1, decaying with depth. [L, K]
TOP_LOGPROBS = np.log(0.75 * 0.97 ** np.arange(DEPTHS)[:, None] * 0.25 ** np.arange(K)[None, :])
TREE = build_ddtree(TOP_IDS, TOP_LOGPROBS, budget=64)


def flat_then_linear(rows: float) -> float:
    """A large target's verify pass: 20 ms up to 128 rows (memory-bound), then 0.1 ms per row."""
    return 0.020 + 1e-4 * max(0.0, rows - 128)


def run_steps(
    policy: BudgetPolicy, sequences: int, steps: int, rng: np.random.Generator, true_q: np.ndarray | None = None, waits: int = 0,
    other_s: float = 0.003, prompt_s: float = 0.0,
) -> list[int]:
    """``steps`` steps of ``sequences`` sequences sharing each pass, every one choosing as the policy
    says: feed it what the gateway would see, the target priced by ``flat_then_linear`` and accepting
    each depth with probability ``true_q[d]`` given the depth before (default: as the draft predicts);
    each round also waits for ``waits`` passes of other sequences like its own, and spends
    ``other_s`` outside the target and ``prompt_s`` in it behind other sequences' prompts. Returns
    the budgets chosen."""
    chosen = []
    for _ in range(steps):
        budget = policy.choose(TREE)
        chosen.append(budget)
        tree = TREE.prefix(budget)
        rows = sequences * (budget + 1)
        forward = flat_then_linear(rows)
        for _ in range(sequences):
            policy.observe_pass(rows, sequences, forward)
            wait = waits * forward + prompt_s
            policy.observe_round(other_s + forward + wait, forward, wait, sequences, prompt_wait_s=prompt_s, pass_rows=rows)
            reach = depth_mass(tree.scores, tree.depths, DEPTHS) if true_q is None else np.cumprod(np.r_[1.0, true_q])
            accepted = int(np.sum(rng.random() < reach[1 : int(tree.depths.max(initial=0)) + 1]))
            policy.observe_acceptance(tree, accepted)
    return chosen


def near_best(policy: BudgetPolicy, budget: int) -> bool:
    """Whether ``budget``'s expected rate is within the hysteresis of the best one's."""
    candidates, rates = policy.rates()
    return rates[candidates == budget][0] * (1 + HYSTERESIS) >= rates.max()


def test_the_default_budget_until_passes_and_a_round_were_seen():
    policy = BudgetPolicy(22, 64, warmup_passes=4)
    assert policy.choose(TREE) == 22 and policy.choose(TREE.prefix(5)) == 5
    for _ in range(4):
        policy.observe_pass(23, 1, 0.02)
    assert policy.choose(TREE) == 22  # no round yet: t_other unknown
    policy.observe_pass(0, 0, 0.0)  # a target that reports nothing teaches nothing
    assert policy.passes == 4
    policy.observe_round(0.025, 0.02)
    assert policy.ready and policy.choose(TREE) == 64  # one cost point: flat, so the largest tree


def test_it_learns_the_cost_curve_from_the_passes_it_sees():
    policy = BudgetPolicy()
    rng = np.random.default_rng(0)
    for rows in rng.integers(1, 4096, 3000):
        policy.observe_pass(int(rows), 1, flat_then_linear(rows))
    probe = np.array([1, 20, 100, 128, 300, 1000, 4000])
    learned = policy.cost(probe)
    assert np.allclose(learned, [flat_then_linear(r) for r in probe], rtol=0.08)
    assert np.all(np.diff(policy.cost(np.arange(1, 5000))) >= 0)


def test_a_new_choice_is_logged_with_the_pass_costs_it_rests_on(caplog):
    """The log line of a choice names the learned pass time of each row bucket, so that a strange
    choice can be traced to the costs it was made from."""
    policy = BudgetPolicy(22, 64)
    with caplog.at_level("INFO", logger="services.gateway.budget"):
        run_steps(policy, 4, 40, np.random.default_rng(1))
    lines = [r.getMessage() for r in caplog.records if "adaptive budget" in r.getMessage()]
    assert lines, "no choice was logged"
    costs, level = lines[-1].split("pass ms by rows (")[1].split("), the rounds' passes at ")
    assert float(level.split("x")[0]) == pytest.approx(1.0, abs=0.05)  # this world's passes cost what the curve says
    points = [tuple(float(v) for v in point.split(": ")) for point in costs.split(", ")]  # (rows, ms)
    assert points and [r for r, _ in points] == sorted(r for r, _ in points)
    for rows, ms in points:
        assert ms == pytest.approx(1e3 * flat_then_linear(rows), rel=0.02), (rows, ms)


def test_a_choice_kept_against_a_better_one_says_why_at_debug(caplog):
    """While a choice is held (or the better one is not better by the hysteresis), a debug line
    once a pass names the budget it keeps, the one the figures prefer, and the figures."""
    policy = BudgetPolicy(22, 64, hold_passes=40)
    rng = np.random.default_rng(1)
    assert run_steps(policy, 1, 40, rng)[-1] == 64
    small = run_steps(policy, 32, 12, rng)[-1]
    with caplog.at_level("DEBUG", logger="services.gateway.budget"):
        run_steps(policy, 1, 12, rng)  # the load gone: larger trees, a reversal, wait for the hold
    kept = [r for r in caplog.records if "keeps" in r.getMessage()]
    assert kept and all(r.levelname == "DEBUG" for r in kept)
    assert kept[0].getMessage().startswith(f"adaptive budget keeps {small}, not ") and "(held)" in kept[0].getMessage()
    assert "pass ms by rows (" in kept[0].getMessage()
    assert len(kept) <= 12  # a line a pass, not one a step
    caplog.clear()
    with caplog.at_level("DEBUG", logger="services.gateway.budget"):
        for _ in range(5):  # five sequences' steps in one pass, each tree fed to the draft's mass
            policy.choose(TREE)
    assert policy.choice == small and len([r for r in caplog.records if "keeps" in r.getMessage()]) == 1


def test_a_choice_on_guessed_costs_is_chosen_again_once_its_pass_is_measured():
    """One user, passes of up to 8 rows measured flat: larger passes are guessed as cheap, and the
    first choice is the largest tree. Its pass, measured at 0.1 ms a row more, makes a 24-node tree
    the best by less than the hysteresis (a choice made on measured costs would stay): it moves
    there at the next step."""

    def cost(rows: int) -> float:
        return 0.012 + 1e-4 * max(0, rows - 8)

    policy = BudgetPolicy(22, 64)
    for rows in (1, 4, 8) * 4:
        policy.observe_pass(rows, 1, cost(rows))
    policy.observe_round(0.0125, 0.012)
    chosen = []
    for _ in range(4):
        budget = policy.choose(TREE)
        chosen.append(budget)
        if len(chosen) == 1:
            candidates = policy.rates()[0]
            assert policy.rule.provisional and list(candidates[policy.guessed(candidates)]) == [15, 23, 31, 47, 63, 64]
        policy.observe_pass(budget + 1, 1, cost(budget + 1))
        policy.observe_round(0.001 + cost(budget + 1), cost(budget + 1))
        policy.observe_acceptance(TREE.prefix(budget), 3)
    candidates, rates = policy.rates()
    best = candidates[np.argmax(rates)]
    assert chosen == [64] + [best] * 3 and best < 64 and not policy.rule.provisional
    assert rates.max() < (1 + HYSTERESIS) * rates[candidates == 64][0]


def test_it_learns_the_per_depth_calibration():
    """The target accepts each depth with probability 0.6 where the draft says 0.75: observed over
    predicted acceptance at depth d tends to (0.6 / 0.75) ** d on a chain of top-1 tokens."""
    policy = BudgetPolicy(calibration_alpha=0.002)  # averages over ~1000 steps: 0/1 outcomes are noisy
    rng = np.random.default_rng(1)
    chain = build_ddtree(TOP_IDS[:, :1], np.log(np.full((DEPTHS, 1), 0.75)), budget=DEPTHS)
    for _ in range(6000):
        accepts = rng.random(DEPTHS) < 0.6  # the target's token matches the chain's at each depth
        policy.observe_acceptance(chain, DEPTHS if accepts.all() else int(np.argmin(accepts)))
    c = policy.calibration(4)
    assert c[0] == 1.0
    assert np.allclose(c[1:], (0.6 / 0.75) ** np.arange(1, 5), rtol=0.15), c
    assert policy.calibration(DEPTHS + 3)[-3:].tolist() == [1.0, 1.0, 1.0]  # depths never seen


def test_its_choice_follows_the_observed_load():
    """Alone, the pass costs the same at any budget: the largest tree. As 32 sequences share the
    passes, the policy sees the concurrency and the cost of wide passes and cuts the trees; when the
    load goes, the trees grow again."""
    policy = BudgetPolicy(22, 64)
    rng = np.random.default_rng(2)
    alone = run_steps(policy, 1, 40, rng)
    assert alone[:8] == [22] * 8 and alone[-1] == 64
    busy = run_steps(policy, 32, 40, rng)
    assert policy.concurrency == pytest.approx(32, rel=0.02)  # about the last 10 passes count
    assert busy[-1] <= 8 and near_best(policy, busy[-1]), busy
    again = run_steps(policy, 1, 40, rng)[-1]
    assert again >= 47 and near_best(policy, again)
    assert run_steps(policy, 8, 60, rng)[-1] in range(8, 24)


def test_a_round_that_waits_for_other_passes_prices_its_rows_as_that_many_passes():
    """Users out of step: the target alternates between two groups, so each round holds two passes
    (its own and the other group's wait); the rows cost twice per round, and the trees shrink."""
    alone, alternating = BudgetPolicy(22, 64), BudgetPolicy(22, 64)
    one = run_steps(alone, 32, 80, np.random.default_rng(8), other_s=0.1)[-1]
    two = run_steps(alternating, 32, 80, np.random.default_rng(8), waits=1, other_s=0.1)[-1]
    assert alone.passes_per_round == pytest.approx(1.0) and alternating.passes_per_round == pytest.approx(2.0)
    assert alone.t_other == pytest.approx(0.1) == alternating.t_other
    assert two < one, (two, one)


def test_a_draft_that_overpromises_gets_smaller_trees():
    rng = np.random.default_rng(3)
    trusting, doubting = BudgetPolicy(22, 64), BudgetPolicy(22, 64, calibration_alpha=0.05)
    # 16 sequences: the flat cost ends at 8 rows a sequence, so the trusted tree is the 7-node budget
    # and a doubted one a smaller one of ADAPTIVE_BUDGETS.
    trusted = run_steps(trusting, 16, 150, rng)[-1]
    doubted = run_steps(doubting, 16, 150, rng, true_q=np.full(DEPTHS, 0.3))[-1]
    assert doubted < trusted, (doubted, trusted)


def test_every_sequence_gets_the_gateways_one_budget_until_the_figures_move_it():
    """The choice comes from the running figures, not from the tree at hand: a confident and a
    doubtful tree, asked for in turn, get the same budget (the target's pass joins trees of one
    size); it moves when the figures do, and only by more than the hysteresis."""
    policy = BudgetPolicy(22, 64)
    run_steps(policy, 16, 60, np.random.default_rng(6))
    doubtful = build_ddtree(TOP_IDS, TOP_LOGPROBS - 1.5 * np.arange(K)[None, :] - 0.3, budget=64)
    first = policy.choose(TREE)
    assert first in ADAPTIVE_BUDGETS and first == policy.choice
    assert [policy.choose(t) for t in (doubtful, TREE, doubtful)] == [first] * 3
    assert policy.choose(TREE.prefix(2)) == min(first, 2)  # a tree smaller than the choice is itself
    run_steps(policy, 1, 40, np.random.default_rng(7))  # alone: the passes cost the same at any size
    assert policy.choose(TREE) > first
    # A current choice within the hysteresis of the best stays; one further below gives way, but
    # only once hold_passes passes have shown what the current one costs.
    candidates, rates = policy.rates()
    best = rates.max()
    near = [int(b) for b, r in zip(candidates, rates) if best > r > best / (1 + HYSTERESIS)]
    far = [int(b) for b, r in zip(candidates, rates) if r < best / (1 + HYSTERESIS)]
    assert near and far, (candidates, rates)
    policy.rule.hold, policy.rule.persist = 0, float("inf")  # the hysteresis alone (a lead kept for 3 holds wins too)
    policy.rule.choice = near[0]
    assert policy.choose(TREE) == near[0]
    policy.rule.choice = far[0]
    chosen = policy.choose(TREE)
    candidates, rates = policy.rates()  # as choose saw them (it took TREE into its figures first)
    assert chosen == int(candidates[np.argmax(rates)]) != far[0]


def test_a_choice_follows_a_ramp_at_once_and_turns_back_only_after_the_hold():
    """As load arrives the figures move over several passes: the choice follows them down step by
    step, a change onward needing no wait. Once the load goes, the first change back to larger
    trees waits until ``hold_passes`` passes (each counted once, whatever its sequences) since the
    last change have shown what the current choice costs."""
    policy = BudgetPolicy(22, 64, hold_passes=5)
    run_steps(policy, 1, 40, np.random.default_rng(9))
    alone = policy.choice
    chosen = []
    for sequences, rows, seconds in [(32, 32 * (alone + 1), 0.5)] * 12 + [(1, alone + 1, 0.02)] * 12:  # each: one pass
        chosen.append(policy.choose(TREE))
        for _ in range(sequences):  # 32 sequences whose passes call for far smaller trees, then one alone
            policy.observe_pass(rows, sequences, seconds)
            policy.observe_round(seconds + 0.001, seconds, 0.0, sequences)
    loaded, after = chosen[:12], chosen[12:]
    changes = [i for i in range(1, len(chosen)) if chosen[i] != chosen[i - 1]]
    down = [i for i in changes if i < 12]
    assert loaded[0] == alone and loaded == sorted(loaded, reverse=True) and loaded[-1] < alone, loaded
    assert len(down) >= 2 and min(b - a for a, b in zip(down, down[1:])) < 5, loaded  # onward: no hold
    up = [i for i in changes if chosen[i] > chosen[i - 1]]
    assert up and up[0] - down[-1] >= 5, chosen  # the way back: held
    assert after[-1] > loaded[-1]


def test_the_largest_tree_is_built_once_a_pass_and_the_choice_otherwise():
    """Past its warm-up the policy asks for a tree of ``max_budget`` nodes (whose scores feed the
    draft's mass) at the first step of each pass only; the other steps build the tree of the
    choice, which teaches the mass nothing and is cut to itself."""
    policy = BudgetPolicy(22, 64, warmup_passes=2)
    assert policy.tree_budget() == 64  # not ready: every tree is the largest
    run_steps(policy, 4, 30, np.random.default_rng(3))
    choice = policy.choice
    assert 0 < choice < 64
    for _ in range(3):  # passes of 4 sequences, each sequence reporting the pass
        sizes = []
        for _ in range(4):
            size = policy.tree_budget()
            sizes.append(size)
            feeds = policy._mass_feeds
            full = size == 64
            assert policy.choose(TREE if full else TREE.prefix(size), full=full) == choice
            assert policy._mass_feeds == feeds + full  # only the largest tree fed the mass
        assert sizes == [64, choice, choice, choice]
        for _ in range(4):
            policy.observe_pass(4 * (choice + 1), 4, flat_then_linear(4 * (choice + 1)))
            policy.observe_round(0.003 + flat_then_linear(4 * (choice + 1)), flat_then_linear(4 * (choice + 1)), 0.0, 4)
    # The choice's rates are computed once a pass (and when the mass moves), not at every step.
    first = policy._rates_now()
    assert policy._rates_now() is first
    policy.observe_pass(4 * (choice + 1), 1, flat_then_linear(4 * (choice + 1)))  # a whole pass more
    assert policy._rates_now() is not first


def run_fixed(policy: BudgetPolicy, budget: int, sequences: int, steps: int, rng: np.random.Generator, other_s: float = 0.003) -> float:
    """``steps`` steps of ``sequences`` sequences whose requests fixed ``budget``, fed to the policy
    as the gateway feeds it (the world of :func:`run_steps`, the draft's predictions true); returns
    the committed tok/s a sequence got."""
    tree = TREE.prefix(budget)
    rows = sequences * (budget + 1)
    forward = flat_then_linear(rows)
    reach = depth_mass(tree.scores, tree.depths, DEPTHS)
    committed = 0
    for _ in range(steps):
        for _ in range(sequences):
            policy.observe_pass(rows, sequences, forward)
            policy.observe_round(other_s + forward, forward, 0.0, sequences, pass_rows=rows)
            accepted = int(np.sum(rng.random() < reach[1 : int(tree.depths.max()) + 1]))
            policy.observe_acceptance(tree, accepted)
            policy.observe_fixed_tree(tree, budget)
            committed += accepted + 1
    return committed / sequences / (steps * (other_s + forward))


def test_the_forecast_of_a_fixed_budget_is_the_adaptive_models_rate_and_near_what_it_ran_at():
    """Requests that fix their budget teach the policy a forecast of their rate: the rate the
    adaptive choice would give that budget (the same model, the mass from their own trees), and,
    where the model's terms are true to the world (here: the draft's predictions, the pass costs),
    near the rate the steps ran at. At 16 sequences a 63-node tree's passes cost several times a
    7-node tree's, and the forecasts follow."""
    rng = np.random.default_rng(5)
    for sequences in (1, 16):
        policy = BudgetPolicy(22, 64, warmup_passes=3)
        assert policy.forecast == {}
        measured = {budget: run_fixed(policy, budget, sequences, 200, rng) for budget in (7, 63)}
        assert set(policy.forecast) == {0, 7, 63}
        policy.observe_pass(sequences * 64, 1, flat_then_linear(sequences * 64))  # a whole pass more: the forecast is due
        policy.observe_fixed_tree(TREE.prefix(7), 7)
        policy.choose(TREE)  # the adaptive model's mass, from a largest tree whose prefixes are the fixed trees
        candidates, rates = policy.rates()  # on the same figures
        for budget, rate in measured.items():
            assert policy.forecast[budget] == pytest.approx(rates[candidates == budget][0], rel=1e-6)
            assert policy.forecast[budget] == pytest.approx(rate, rel=0.1), (sequences, budget)
        # 0 before target-only rounds were seen: the drafting rounds' figures without the draft, as rates() guesses it.
        assert policy.forecast[0] == pytest.approx(rates[candidates == 0][0], rel=1e-6)
        assert (policy.forecast[63] > policy.forecast[7]) == (sequences == 1)


def test_a_rounds_own_passes_set_the_level_of_the_cost_curve():
    """The cost curve prices a budget's pass by its rows, its level by the rounds' own passes.
    Passes of every sequence at once (the draft idle) ran at 10 ms with 64 rows; the rounds of a
    fixed budget of 7 then ran passes of 24 rows at 15 ms (beside the draft's work). The curve,
    lowered to the cheapest pass of more rows, reads 10 ms at 24 rows; the forecast prices the
    rounds' passes at the 15 ms they took, and a 15-node tree's 48 rows at 1.5x the curve too
    (BENCHMARKS.md [X5]: on the 2-core CPU the curve alone over-priced drafting 1.2-1.3x)."""
    policy = BudgetPolicy(22, 64, warmup_passes=1)
    for _ in range(30):
        policy.observe_pass(64, 8, 0.010)
    tree = TREE.prefix(7)
    for _ in range(60):
        policy.observe_pass(24, 3, 0.015)
        policy.observe_round(0.005 + 0.015, 0.015, 0.0, 3, pass_rows=24)
        policy.observe_acceptance(tree, 2)
        policy.observe_fixed_tree(tree, 7)
    assert policy.cost(np.array([24.0, 48.0])) == pytest.approx([0.010, 0.010])
    al = 1.0 + depth_mass(tree.scores, tree.depths, 7) @ policy.calibration(7)
    assert policy.t_other == pytest.approx(0.005) and policy.passes_per_round == pytest.approx(1.0)
    assert policy.forecast[7] == pytest.approx(al / (0.005 + 0.015), rel=1e-2)  # (computed at its last pass, the calibration since moved a little)
    policy.choose(TREE)
    candidates, rates = policy.rates()
    al_15 = 1.0 + policy._mass[15] @ policy.calibration(64)
    assert rates[candidates == 15][0] == pytest.approx(al_15 / (0.005 + 0.015), rel=1e-3)  # 48 rows: the curve's 10 ms x 1.5


def test_the_forecast_follows_the_last_ten_fixed_budgets():
    policy = BudgetPolicy(22, 64, warmup_passes=1)
    for budget in range(1, 13):
        run_fixed(policy, budget, 2, 2, np.random.default_rng(budget))
    assert set(policy.forecast) == {0, *range(3, 13)}  # a metric label each: bounded
    run_fixed(policy, 3, 2, 2, np.random.default_rng(0))  # fed again: now the last, not the first to go
    run_fixed(policy, 13, 2, 2, np.random.default_rng(0))
    assert set(policy.forecast) == {0, 3, *range(5, 14)}


def test_budget_0_is_chosen_once_the_drafts_acceptance_is_calibrated():
    """Where the draft's proposal costs more than its trees save, 0 wins once the draft's
    acceptance is calibrated, priced without the draft (its steps do not ask it); a step that
    drafts while 0 is chosen (one exploring) gets the best tree of the other budgets."""
    policy = BudgetPolicy(22, 64, warmup_passes=1)
    for _ in range(20):
        policy.observe_pass(1, 1, 0.010)
        policy.observe_round(0.300, 0.010, 0.0, 1, draft_s=0.280)  # t_other 290 ms, of which the draft 280
    assert policy.t_other == pytest.approx(0.290) and policy.t_draft == pytest.approx(0.280)
    assert policy.choose(TREE) > 0 and 0 not in policy.rates()[0]  # 0 waits for a calibrated acceptance
    for _ in range(int(1 / policy.calibration_alpha)):
        policy.observe_acceptance(TREE, 3)
    policy.rule.choice = None  # as if unchosen: no hold
    explored = policy.choose(TREE)
    assert policy.choice == 0 and explored > 0  # the step that drafted explores
    candidates, rates = policy.rates()
    assert explored == candidates[candidates > 0][np.argmax(rates[candidates > 0])]
    # No target-only round seen yet: one token per (t_other - t_draft + t(1)).
    assert rates[candidates == 0][0] == pytest.approx(1 / (0.010 + 0.010))


def cpu_pass(rows: float) -> float:
    """The built-in target's pass on the 2-core CPU: 15 ms at one row, 26 at 8, 57 at 48 (the
    gateway's logs of BENCHMARKS.md [N2])."""
    return 0.0135 + 0.0016 * min(rows, 8) + 0.00075 * max(0.0, rows - 8)


def run_cpu_load(policy: BudgetPolicy, passes: int, rng: np.random.Generator, users: int = 8) -> list[int | None]:
    """``passes`` passes of ``users`` sequences on the 2-core CPU: a drafting step waits 54-70 ms
    outside the target (the draft's proposal most of it) and the sequences split into two groups
    of about four a pass, each round waiting 1.3-1.5 passes; a target-only step spends 2 ms
    outside the target and all meet in one pass. Returns the choice after each pass."""
    choices = []
    for _ in range(passes):
        if policy.choice == 0:
            explorers = sum((len(choices) + i) % (TARGET_ONLY_RUN + 1) == 0 for i in range(users))  # each after its run
            trees = [TREE.prefix(policy.choose(TREE)) for _ in range(explorers)]
            groups = [(users, users - explorers + sum(t.num_nodes + 1 for t in trees), trees, 1.0)]
        else:
            first = int(rng.integers(3, 6))
            groups = []
            for n in (first, users - first):
                tree = TREE.prefix(policy.choose(TREE))
                groups.append((n, n * (tree.num_nodes + 1), [tree] * n, rng.uniform(1.3, 1.5)))
        for n, rows, trees, q in groups:
            forward = cpu_pass(rows)
            for i in range(n):
                policy.observe_pass(rows, n, forward)
                if i >= len(trees):
                    policy.observe_round(0.002 + forward, forward, 0.0, n, target_only=True, pass_rows=rows)
                    continue
                draft = rng.uniform(0.046, 0.062)
                policy.observe_round(draft + 0.008 + q * forward, forward, (q - 1) * forward, n, draft_s=draft, pass_rows=rows)
                reach = depth_mass(trees[i].scores, trees[i].depths, DEPTHS)
                policy.observe_acceptance(trees[i], int(np.sum(rng.random() < reach[1 : int(trees[i].depths.max()) + 1])))
        choices.append(policy.choice)
    return choices


def test_budget_0_is_tried_on_its_guess_and_kept_where_its_own_rounds_show_the_draft_never_pays():
    """The 2-core CPU at 8 users (``run_cpu_load``): a target-only round takes 28 ms, a drafting
    one 100 ms or more for at most 3 tokens. Before any target-only round, 0 is priced by the
    drafting rounds' ``t_other`` without the draft and their ``n q`` sequences in one pass (priced
    as they met, ``n`` and ``q`` theirs, it was expected at 0.8 of its rounds' rate, within the
    hysteresis of 7, and the figures' noise moved the choice between them). Once the draft's
    acceptance is calibrated it is chosen on that guess, provisionally, and kept when its own
    rounds price it at what they take, far ahead of every drafting budget."""
    policy = BudgetPolicy(22, 64)
    rng = np.random.default_rng(11)
    choices = run_cpu_load(policy, 1, rng)
    while choices[-1] != 0 and len(choices) < 100:
        choices += run_cpu_load(policy, 1, rng)
    assert choices[-1] == 0 and policy.rule.provisional and policy.verified_trees >= 1 / policy.calibration_alpha
    assert set(choices[8:-1]) == {7}
    kept = run_cpu_load(policy, 400, rng)
    assert kept == [0] * 400 and not policy.rule.provisional
    candidates, rates = policy.rates()
    assert rates[candidates == 0][0] == pytest.approx(1 / (0.002 + cpu_pass(8)))  # one token a target-only round
    assert rates[candidates == 0][0] > 1.2 * rates[candidates > 0].max()  # by twice the hysteresis


def test_adaptive_budgets_fill_the_targets_row_buckets():
    """Each adaptive budget's tree (b + 1 rows) is a row bucket of the target's fixed-shape passes,
    so adaptive steps make no CUDA graph shapes of their own; and the policy picks only those."""
    from services.target.graphs import ROW_BUCKETS  # the target's (torch); the gateway has a copy

    assert {b + 1 for b in ADAPTIVE_BUDGETS} <= set(ROW_BUCKETS)
    policy = BudgetPolicy(22, 64)
    chosen = run_steps(policy, 1, 40, np.random.default_rng(4)) + run_steps(policy, 6, 40, np.random.default_rng(5))
    assert set(chosen[8:]) <= set(ADAPTIVE_BUDGETS) | {64}, sorted(set(chosen))


def test_the_budget_flag():
    assert parse_budget("auto") == "auto" and parse_budget("AUTO") == "auto" and parse_budget("16") == 16
    for bad in ("0", "-3", "many"):
        with pytest.raises(Exception, match="auto"):
            parse_budget(bad)


# The speculation loop and the servicer ------------------------------------------------------

PROMPT = [1, 2, 3]
MAX_NEW_TOKENS = 24
# The target accepts nothing, so step i (1-based) follows i generated tokens and may draft this deep:
# the tokens still wanted after its bonus. The last step drafts nothing.
STEP_DEPTHS = [min(DEPTHS, MAX_NEW_TOKENS - i - 1) for i in range(1, MAX_NEW_TOKENS)]


class FakeTarget:
    """A target that accepts no draft node and reports a batched pass of 32 sequences."""

    def __init__(self) -> None:
        self.trees: list[tuple[list[int], list[int]]] = []
        self.runs: list[tuple[int, bool]] = []  # each pipelined run of target-only steps: its steps, its late_last

    async def prefill(self, request, timeout=None) -> Prefilled:
        return Prefilled(next_token=500, features=None)

    async def verify(self, sequence_id, tokens, parents, return_features, timeout=None, vote=None) -> Verified:
        self.trees.append((np.asarray(tokens).tolist(), np.asarray(parents).tolist()))
        rows = 32 * (len(tokens) + 1)
        return Verified([500], 500, 0, None, int(flat_then_linear(rows) * 1e9), pass_rows=rows, pass_sequences=32)

    async def decode(self, sequence_id, steps, timeout, return_features=False, late_last=False, vote=None):
        """Target-only steps, as ``TargetClient.decode`` answers them."""
        self.runs.append((steps, late_last))
        for _ in range(steps):
            yield await self.verify(sequence_id, np.zeros(0, np.int64), np.zeros(0, np.int64), return_features)

    async def release(self, sequence_id) -> None:
        pass


class FakeDraft:
    """Answers the depths asked for (``ProposeRequest.depths``), as the draft worker does, and records them."""

    def __init__(self) -> None:
        self.depths: list[int] = []

    async def propose(self, sequence_id, anchor, start, history, features, top_k, window, timeout=None, context=0, depths=0):
        self.depths.append(depths)
        cut = depths or DEPTHS
        return Proposed(TOP_IDS[:cut], TOP_LOGPROBS[:cut])

    async def release(self, sequence_id, context=0) -> None:
        pass


def run_sequence(options: SpeculationOptions, policy: BudgetPolicy, max_new_tokens: int = MAX_NEW_TOKENS, target=None, draft=None):
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.model = "m"
    target = target or FakeTarget()
    seq = SpeculativeSequence(
        "s", target, draft or FakeDraft(), DraftShape(block_size=DEPTHS + 1, taps=()), options, PROMPT, common_pb2.Sampling(),
        max_new_tokens=max_new_tokens, max_context=4096, on_step=metrics.step_observer(options.mode.value),
        budget_policy=policy,
    )

    async def drain():
        async for _ in seq.run():
            pass

    asyncio.run(drain())
    budgets = metrics.registry.get_sample_value("splitspec_spec_decode_budget_nodes_sum", {"model": "m", "mode": options.mode.value})
    return target.trees, budgets


def recording(policy: BudgetPolicy) -> list[int]:
    """Record every budget ``policy.choose`` returns."""
    chosen, choose = [], policy.choose

    def record(tree, full=True):
        chosen.append(choose(tree, full))
        return chosen[-1]

    policy.choose = record
    return chosen


def test_an_adaptive_sequence_cuts_the_largest_tree_to_the_choice_and_feeds_the_policy():
    # No hold: one sequence's reports of 32-sequence passes count 1/32 of a pass each.
    policy = BudgetPolicy(22, 64, warmup_passes=3, hold_passes=0)
    chosen = recording(policy)
    options = SpeculationOptions(budget=64, adaptive=True)
    draft = FakeDraft()
    trees, budgets = run_sequence(options, policy, draft=draft)
    assert len(trees) == policy.passes == len(STEP_DEPTHS) and trees[-1] == ([], [])
    assert len(chosen) == len(STEP_DEPTHS) - 1  # every step that drafted
    assert policy.concurrency == 32 and policy.t_other >= 0
    # The default until 3 passes were seen, then the largest tree (one cost point: a flat curve), whose
    # wide pass (32 x 65 rows) shows the cost growing: the trees shrink.
    assert chosen[:4] == [22, 22, 22, 64] and max(chosen[4:]) < 22, chosen
    for (tokens, parents), budget, depth in zip(trees, chosen, STEP_DEPTHS):
        want = build_ddtree(TOP_IDS, TOP_LOGPROBS, budget, chain_seed=options.chain_seed, max_depth=depth)
        assert (tokens, parents) == (want.tokens.tolist(), want.parents.tolist())
    assert budgets == sum(chosen)
    # Every depth the tree could reach was asked for (the trees above are those of every depth), and
    # once the choice fell below the block, the steps that built only its tree asked for fewer.
    assert all(min(budget, depth) <= asked <= depth for budget, depth, asked in zip(chosen, STEP_DEPTHS, draft.depths))
    assert any(asked < depth for depth, asked in zip(STEP_DEPTHS, draft.depths))


class FeatureTarget(FakeTarget):
    """Accepts nothing, in passes of one sequence, and returns a tap feature row per committed
    position whose value is the position: a draft can check it got every row once, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0  # positions committed

    async def prefill(self, request, timeout=None) -> Prefilled:
        self.length = len(request.tokens)
        return Prefilled(next_token=500, features=array_to_pb(np.arange(self.length, dtype=np.float32)[:, None]))

    async def verify(self, sequence_id, tokens, parents, return_features, timeout=None, vote=None) -> Verified:
        self.trees.append((np.asarray(tokens).tolist(), np.asarray(parents).tolist()))
        features = array_to_pb(np.array([[self.length]], dtype=np.float32)) if return_features else None
        self.length += 1
        return Verified([500], 500, 0, features, int(flat_then_linear(len(tokens) + 1) * 1e9), pass_rows=len(tokens) + 1, pass_sequences=1)


class CheckingDraft(FakeDraft):
    """Checks, as the draft worker does, that a context's feature rows join up to each anchor."""

    def __init__(self) -> None:
        self.proposals: list[tuple[int, list[float]]] = []  # (anchor position, rows' positions)
        self.ends: dict[int, int] = {}  # context -> first position without features

    async def propose(self, sequence_id, anchor, start, history, features, top_k, window, timeout=None, context=0, depths=0):
        rows = array_from_pb(features)[:, 0].tolist()
        assert rows == list(range(self.ends.get(context, start - len(rows)), start)), (start, rows)
        self.ends[context] = start
        self.proposals.append((start, rows))
        return Proposed(TOP_IDS, TOP_LOGPROBS)


def test_target_only_steps_of_budget_0_run_pipelined_without_the_draft_and_keep_its_features():
    """While the adaptive budget is 0, steps skip the draft, in pipelined runs of
    ``TARGET_ONLY_RUN`` (as mode off's steps, so that every sequence of the gateway joins each
    pass), each run followed by one step that drafts; the features of the steps the draft missed
    reach it, joined, with that proposal, every row once and in order."""
    policy = BudgetPolicy(22, 64, warmup_passes=1, hold_passes=float("inf"))
    policy.rule.choice = 0  # held: a draft whose proposals cost more than they save
    policy.verified_trees = int(1 / policy.calibration_alpha)  # as after that many steps: 0 may be chosen
    target, draft = FeatureTarget(), CheckingDraft()
    seq = SpeculativeSequence(
        "s", target, draft, DraftShape(block_size=DEPTHS + 1, taps=(1,)), SpeculationOptions(budget=64, adaptive=True), PROMPT,
        common_pb2.Sampling(), max_new_tokens=60, max_context=4096, budget_policy=policy,
    )

    async def drain():
        return [tokens async for tokens in seq.run()]

    out = sum(asyncio.run(drain()), [])
    assert out == [500] * 60  # the target's tokens, whoever drafted
    run = TARGET_ONLY_RUN
    # The prefill's token, then a run, a drafted step (which accepts nothing), a run, and so on.
    # Each run's last step tells the target that the sequence's next step (at the draft) comes late.
    assert target.runs == [(run, True), (run, True), (60 - 1 - 2 * (run + 1), True)], target.runs
    first, second = len(PROMPT) + run, len(PROMPT) + 2 * run + 1
    assert [(start, len(rows)) for start, rows in draft.proposals] == [(first, len(PROMPT) + run), (second, 1 + run)]  # the drafted step's row too
    assert sum(len(tokens) > 0 for tokens, _ in target.trees) == 2 == policy._drafting.other.count  # drafting rounds
    assert policy._target_only.other.count == len(target.trees) - 2  # the others target-only rounds


def test_a_fixed_budget_wins_over_the_policy_and_still_teaches_it():
    policy = BudgetPolicy(22, 64, warmup_passes=3)
    chosen = recording(policy)
    draft = FakeDraft()
    trees, budgets = run_sequence(SpeculationOptions(budget=12), policy, draft=draft)
    assert chosen == [] and policy.passes == len(STEP_DEPTHS) and policy.concurrency == 32
    assert draft.depths == [min(12, depth) for depth in STEP_DEPTHS[:-1]]  # a 12-node tree reaches depth 12 at most
    # 12 nodes a step, but at depth 1 (one token left before the bonus) the draft's 8 candidates.
    assert [len(tokens) for tokens, _ in trees] == [12] * (len(STEP_DEPTHS) - 2) + [8, 0]
    assert budgets == 12 * (len(STEP_DEPTHS) - 1)
    assert set(policy.forecast) == {0, 12}  # its trees price a forecast of budget 12 (BudgetPolicy.observe_fixed_tree)
    run_sequence(SpeculationOptions(mode=Mode.CHAIN, budget=5), policy)
    run_sequence(SpeculationOptions(adaptive=True), policy)
    assert set(policy.forecast) == {0, 12}  # chains and adaptive trees price none
    with pytest.raises(ValueError):
        run_sequence(SpeculationOptions(mode=Mode.CHAIN, adaptive=True), policy)


def servicer(defaults: SpeculationOptions, policy: BudgetPolicy, max_tree_nodes: int = 256) -> GatewayServicer:
    state = GatewayState(target_pb2.TargetInfo(max_tree_nodes=max_tree_nodes), None, tokenizer=None)
    return GatewayServicer(None, None, state, defaults, None, None, None, policy)


def test_a_requests_own_budget_wins_over_the_adaptive_default():
    Spec = gateway_pb2.Speculation
    gateway = servicer(SpeculationOptions(budget=22, adaptive=True), BudgetPolicy(22, 64))
    auto = gateway._options(Spec())
    assert (auto.mode, auto.adaptive, auto.budget) == (Mode.DDTREE, True, 64)  # built at the most, cut per step
    own = gateway._options(Spec(budget=5))
    assert (own.adaptive, own.budget, own.top_k) == (False, 5, 5)
    chain = gateway._options(Spec(mode=Spec.CHAIN))
    assert (chain.adaptive, chain.budget) == (False, 22)
    with pytest.raises(InvalidArgument, match="speculation.budget"):
        gateway._options(Spec(budget=300))
    assert servicer(SpeculationOptions(budget=22, adaptive=True), BudgetPolicy(22, 64), max_tree_nodes=40)._options(Spec()).budget == 40
    fixed = servicer(SpeculationOptions(budget=16), BudgetPolicy(22, 64))._options(Spec())
    assert (fixed.adaptive, fixed.budget) == (False, 16)
    # A default above what the target verifies is cut to it, for every mode (the bench's AR rows
    # against a target of --max-tree-nodes 16 were refused); a request's own budget is not.
    small = servicer(SpeculationOptions(budget=22), BudgetPolicy(22, 64), max_tree_nodes=16)
    assert small._options(Spec(mode=Spec.OFF)).budget == 16 and small._options(Spec()).budget == 16
    with pytest.raises(InvalidArgument, match="speculation.budget: 17 is outside"):
        small._options(Spec(budget=17))


class CapturingTarget(FakeTarget):
    """Its first two passes capture a CUDA graph each: they report no time (forward_ns 0)."""

    async def verify(self, sequence_id, tokens, parents, return_features, timeout=None, vote=None) -> Verified:
        verified = await super().verify(sequence_id, tokens, parents, return_features, timeout)
        if len(self.trees) <= 2:
            verified.forward_ns = 0
        return verified


def test_a_pass_that_captured_a_graph_teaches_the_policy_nothing_of_costs():
    policy = BudgetPolicy(22, 64, warmup_passes=3)
    trees, _ = run_sequence(SpeculationOptions(budget=64, adaptive=True), policy, target=CapturingTarget())
    assert policy.passes == len(trees) - 2  # the two capturing passes: no cost point, no round
    assert policy._drafting.other.count == len(trees) - 3  # every other drafted step's round (the last step drafts nothing)
    assert policy._observed and policy._observed[1].count > 0  # acceptance is learned from every step


def test_a_wait_behind_prompts_is_neither_t_other_nor_passes():
    """A round of 60 ms: a 20 ms pass, 30 ms of waiting of which 20 ms behind another sequence's
    prompt, and 10 ms elsewhere. The 10 ms behind other passes count in q (they grow with the
    trees); the prompt's 20 ms count nowhere (no budget changes them)."""
    policy = BudgetPolicy(22, 64, warmup_passes=1)
    for _ in range(5):
        policy.observe_round(0.060, 0.020, 0.030, 1, prompt_wait_s=0.020)
    assert policy.passes_per_round == pytest.approx(1.5) and policy.t_other == pytest.approx(0.010)
    blind = BudgetPolicy(22, 64, warmup_passes=1)
    blind.observe_round(0.060, 0.020, 0.030, 1)  # a target that does not report the prompts' share
    assert blind.passes_per_round == pytest.approx(2.5) and blind.t_other == pytest.approx(0.010)
    odd = BudgetPolicy(22, 64, warmup_passes=1)
    odd.observe_round(0.060, 0.020, 0.030, 1, prompt_wait_s=0.050)  # more than the wait: capped at it
    assert odd.passes_per_round == pytest.approx(1.0) and odd.t_other == pytest.approx(0.010)


def test_prompts_that_hold_every_round_up_change_no_choice():
    """8 sequences a pass, every round also waiting 80 ms behind other sequences' prompts (a wave
    of requests starting): the target spends those seconds whatever the budget, so the policy
    chooses as it does without them, where a constant 80 ms a round would argue for larger trees."""
    quiet = run_steps(BudgetPolicy(22, 64), 8, 60, np.random.default_rng(5))
    busy = run_steps(BudgetPolicy(22, 64), 8, 60, np.random.default_rng(5), prompt_s=0.080)
    assert busy == quiet
    priced = run_steps(BudgetPolicy(22, 64), 8, 60, np.random.default_rng(5), other_s=0.083)
    assert priced[-1] > quiet[-1], (priced[-1], quiet[-1])


class VotingTarget(FakeTarget):
    """Records the budget votes the steps bring and answers each with ``agreed`` as the target's agreed budget."""

    def __init__(self, agreed: int | None) -> None:
        super().__init__()
        self.agreed, self.votes = agreed, []

    async def verify(self, sequence_id, tokens, parents, return_features, timeout=None, vote=None) -> Verified:
        if vote is not None:
            self.votes.append(vote)
        verified = await super().verify(sequence_id, tokens, parents, return_features)
        verified.agreed_budget = self.agreed
        return verified


def test_an_adaptive_sequence_votes_once_a_pass_and_follows_the_targets_agreed_budget(caplog):
    """The gateway's rates go to the target with its steps, once each time they are computed anew,
    weighed by the gateway's adaptive sequences; the budget the target agrees over every gateway's
    votes is the one its steps take (a debug line once a pass says what its own figures prefer),
    and without one the gateway's own rule goes on from it."""
    policy = BudgetPolicy(22, 64, warmup_passes=3, hold_passes=0)
    chosen = recording(policy)
    target = VotingTarget(agreed=None)
    run_sequence(SpeculationOptions(budget=64, adaptive=True), policy, target=target)
    own = chosen[-1]
    assert target.votes and own == policy.choice > 0, chosen  # the figures chose alone, and voted
    assert all(v.voter == policy.voter and v.sequences == 1 for v in target.votes)  # this sequence, while it ran
    assert policy.sequences == 0  # and not after
    assert len({id(v.rates) for v in target.votes}) == len(target.votes)  # no vote twice
    candidates, rates = policy.rates()
    np.testing.assert_array_equal(target.votes[-1].budgets, candidates)
    agreed = next(b for b in (7, 15, 1) if b != own)
    target, before = VotingTarget(agreed=agreed), len(chosen)
    with caplog.at_level("DEBUG", logger="services.gateway.budget"):
        run_sequence(SpeculationOptions(budget=64, adaptive=True), policy, target=target)
    follows = [r.getMessage() for r in caplog.records if "follows" in r.getMessage()]  # what its own figures prefer, once a pass
    assert follows and follows[0].startswith(f"adaptive budget follows the agreed {agreed}, not ") and "pass ms by rows (" in follows[0]
    second = chosen[before:]
    assert second[0] == own and set(second[1:]) == {agreed} and policy.choice == agreed, second  # from the first answer on
    assert all(len(tokens) == agreed for tokens, _ in target.trees[1:-1])  # each tree built at that size (the last: no node)
    policy.agree(99)  # not among its budgets (a gateway of a larger --max-budget voted): its own rule
    assert policy.agreed is None
    policy.rule.hold = float("inf")
    assert policy.choose(TREE) == agreed  # held: it goes on from the agreed choice
