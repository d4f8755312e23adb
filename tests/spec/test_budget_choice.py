"""The choice rule and the target's budget board (pure: no services)."""

from __future__ import annotations

import numpy as np
import pytest

from splitspec.spec.budget_choice import HYSTERESIS, BudgetBoard, BudgetVote, ChoiceRule

BUDGETS = np.array([0, 3, 7, 15])


def vote(voter: str, rates, sequences: float = 1.0, budgets=BUDGETS, guessed=None) -> BudgetVote:
    return BudgetVote(voter, np.asarray(budgets), np.asarray(rates, dtype=np.float64), sequences, None if guessed is None else np.asarray(guessed))


def ticks(board: BudgetBoard, passes: int) -> None:
    for _ in range(passes):
        board.tick(1)


def test_the_rule_moves_past_the_hysteresis_and_back_only_after_the_hold():
    rule = ChoiceRule(hold=5)
    assert rule.update(BUDGETS, np.array([1.0, 2.0, 3.0, 1.0]), now=0) == (True, False)
    assert rule.choice == 7
    slightly = np.array([1.0, 3.0 * (1 + HYSTERESIS) * 0.99, 3.0, 1.0])
    assert rule.update(BUDGETS, slightly, now=10) == (False, False) and rule.choice == 7  # within the hysteresis
    smaller = np.array([1.0, 5.0, 3.0, 1.0])
    assert rule.update(BUDGETS, smaller, now=10) == (True, False) and rule.choice == 3
    larger = np.array([1.0, 3.0, 5.0, 1.0])
    assert rule.update(BUDGETS, larger, now=12) == (False, True) and rule.choice == 3  # back the way it came: held
    assert rule.update(BUDGETS, np.array([5.0, 3.0, 1.0, 1.0]), now=12) == (True, False) and rule.choice == 0  # onward: at once
    assert rule.update(BUDGETS, larger, now=17) == (True, False) and rule.choice == 7  # the hold has passed


def test_a_budget_expected_faster_at_every_update_for_three_holds_replaces_the_choice_within_the_hysteresis():
    """Wander within the hysteresis keeps the choice; a budget that stays the best at every update
    for ``persist`` passes (3 holds by default) replaces it, however small its lead."""
    rule = ChoiceRule(hold=5)
    rule.update(BUDGETS, np.array([1.0, 2.0, 3.0, 1.0]), now=0)
    assert rule.choice == 7
    lead = np.array([1.0, 3.0 * 1.04, 3.0, 1.0])  # 3 ahead by 4%
    other = np.array([1.0, 3.0, 3.0 * 1.04, 1.0])  # 7 ahead by 4%
    for now in range(10, 42, 2):  # the lead wanders from 3 to 7 and back: nothing persists
        assert rule.update(BUDGETS, lead if now % 4 else other, now=now) == (False, False) and rule.choice == 7
    for now in range(42, 57):  # 3 ahead at every update from 42
        assert rule.update(BUDGETS, lead, now=now) == (False, False) and rule.choice == 7
    assert rule.update(BUDGETS, lead, now=57) == (True, False) and rule.choice == 3  # 15 passes on = 3 holds
    slow = ChoiceRule(hold=5, persist=100)
    slow.update(BUDGETS, np.array([1.0, 2.0, 3.0, 1.0]), now=0)
    assert not any(slow.update(BUDGETS, lead, now=now)[0] for now in range(10, 100))


def test_a_choice_made_on_a_guessed_cost_is_chosen_again_freely_once_measured():
    """A choice whose rate rested on a guessed cost is provisional: the first update whose rate for
    it is measured chooses the best, within the hysteresis and the hold; one made on measured
    costs keeps both."""
    rule = ChoiceRule(hold=50)
    guess_15 = np.array([False, False, False, True])
    assert rule.update(BUDGETS, np.array([1.0, 3.0, 3.1, 4.0]), now=0, guessed=guess_15) == (True, False)
    assert rule.choice == 15 and rule.provisional
    assert rule.update(BUDGETS, np.array([1.0, 3.0, 3.3, 3.0]), now=1, guessed=guess_15) == (False, True)  # still a guess: kept
    measured = np.zeros(4, dtype=bool)
    assert rule.update(BUDGETS, np.array([1.0, 3.0, 3.2, 3.0]), now=2, guessed=measured) == (True, False)
    assert rule.choice == 7 and not rule.provisional  # 1.07x: within the hysteresis, and back before the hold
    assert rule.update(BUDGETS, np.array([1.0, 3.0, 3.0, 3.6]), now=3, guessed=measured) == (False, True)  # an ordinary choice: held
    kept = ChoiceRule(hold=50)
    kept.update(BUDGETS, np.array([1.0, 3.0, 3.1, 4.0]), now=0, guessed=guess_15)
    assert kept.update(BUDGETS, np.array([1.0, 3.0, 3.0, 4.2]), now=1, guessed=measured) == (False, False)  # measured and still best
    assert kept.choice == 15 and not kept.provisional
    assert kept.update(BUDGETS, np.array([1.0, 3.0, 4.3, 4.0]), now=2, guessed=measured) == (False, True)  # then the rule as ever


def test_the_board_chooses_again_once_every_voter_with_a_stake_measured_its_choice():
    board = BudgetBoard(hold=50)
    guess_15 = [False, False, False, True]
    board.vote(vote("a", [1, 3, 3.1, 4], guessed=guess_15))
    board.vote(vote("idle", [1, 3, 3, 3], sequences=0, guessed=[True] * 4))  # runs no sequence: no stake in the guess
    assert board.agreed == 15 and board.rule.provisional
    board.vote(vote("b", [1, 3, 3.2, 3], guessed=guess_15))
    assert board.agreed == 15  # b guessed it too
    board.vote(vote("b", [1, 3, 3.2, 3]))  # measured by b; a's latest vote still guessed it
    assert board.agreed == 15
    board.vote(vote("a", [1, 3, 3.2, 3]))
    assert board.agreed == 7 and not board.rule.provisional  # within the hysteresis, before the hold


def test_the_board_agrees_the_budget_of_most_tokens_over_all_voters_sequences():
    """Each gateway alone would choose its own best (3 and 15); the board chooses the budget of the
    most committed tokens per second over both gateways' sequences, weighed by how many each runs."""
    many, few = vote("many", [10, 31, 28, 20], sequences=6), vote("few", [10, 20, 26, 40], sequences=2)
    board = BudgetBoard()
    assert board.agreed is None  # no vote: every gateway chooses alone
    board.vote(few)
    assert board.agreed == 15
    ticks(board, 20)  # past the hold of the first choice
    board.vote(many)
    totals = 6 * many.rates + 2 * few.rates  # 3: 226, 7: 220, 15: 200
    assert board.agreed == BUDGETS[np.argmax(totals)] == 3
    fresh = BudgetBoard()
    fresh.vote(vote("many", [10, 31, 28, 20], sequences=1))
    ticks(fresh, 20)
    fresh.vote(vote("few", [10, 20, 26, 40], sequences=9))
    assert fresh.agreed == 15  # the same views, the other way round in sequences


def test_a_kept_agreed_budget_says_why_at_debug_once_a_pass(caplog):
    """Within the hysteresis the board keeps its choice; a debug line once a pass of its clock
    names the budget it keeps, the one the votes prefer and their totals."""
    board = BudgetBoard()
    board.vote(vote("a", [1, 2, 3, 1]))
    assert board.agreed == 7
    ticks(board, 20)  # past the hold
    with caplog.at_level("DEBUG", logger="splitspec.spec.budget_choice"):
        for _ in range(3):  # three steps of one pass
            board.vote(vote("a", [1, 3.2, 3, 1]))
        board.tick(1)
        board.vote(vote("a", [1, 3.2, 3, 1]))
    kept = [r for r in caplog.records if "keeps" in r.getMessage()]
    assert [r.levelname for r in kept] == ["DEBUG", "DEBUG"] and board.agreed == 7
    assert kept[0].getMessage() == "agreed budget keeps 7, not 3, over 1 gateways' votes: 0: 1, 3: 3, 7: 3, 15: 1 tok/s expected of all their sequences"


def test_the_board_chooses_among_the_budgets_every_voter_offers():
    board = BudgetBoard()
    board.vote(vote("calibrated", [50, 10, 9, 8]))  # 0 best by far
    assert board.agreed == 0
    board.vote(vote("young", [10, 9, 8], budgets=[3, 7, 15]))  # not calibrated yet: no 0 among its budgets
    assert board.agreed == 3
    ticks(board, 20)
    board.vote(vote("young", [30, 1, 1], budgets=[15, 3, 7]))  # any order of budgets
    assert board.agreed == 15


def test_votes_expire_and_then_the_board_agrees_nothing():
    board = BudgetBoard(ttl=10)
    board.vote(vote("a", [1, 2, 3, 4]))
    ticks(board, 6)
    board.vote(vote("b", [1, 2, 3, 4]))
    ticks(board, 5)  # a's vote is 11 passes old, b's 5
    assert board.figures() == (15, 1)  # b's alone
    board.tick(4)  # a pass of 4 sequences is one pass, whichever of them reports it
    for _ in range(3):
        board.tick(4)
    ticks(board, 5)  # b's vote is 11 passes old
    assert board.figures() == (None, 0)
    board.vote(vote("c", [4, 3, 2, 1]))
    assert list(board.votes) == ["c"]  # the expired are forgotten


@pytest.mark.parametrize(
    "bad,message",
    [
        (vote("", [1, 2, 3, 4]), "needs its voter"),
        (vote("x", [1, 2, 3]), "one finite rate per budget"),
        (vote("x", [1, 2, float("nan"), 4]), "one finite rate per budget"),
        (vote("x", [1], budgets=[]), "one finite rate per budget"),
        (vote("x", [1, 2, 3, 4], budgets=[-1, 3, 7, 15]), "must be >= 0"),
        (vote("x", [1, 2, 3, 4], sequences=-2), "must be >= 0"),
        (vote("x", [1, 2, 3, 4], guessed=[True, False]), "guessed marks are one per budget"),
    ],
)
def test_a_malformed_vote_is_refused_and_changes_nothing(bad, message):
    board = BudgetBoard()
    board.vote(vote("good", [1, 2, 3, 4]))
    with pytest.raises(ValueError, match=message):
        board.vote(bad)
    assert list(board.votes) == ["good"] and board.agreed == 15
