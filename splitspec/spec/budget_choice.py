"""One budget for every sequence of a target, chosen from expected rates that wander (numpy only).

Terms (see :mod:`splitspec.spec.budget` for the rates)
-----
rates
    ``[m]`` committed tokens per second expected of a sequence at each of ``[m]`` candidate budgets.
choice
    The budget every adaptive step gets now. A :class:`ChoiceRule` moves it only when another budget
    is expected ``hysteresis`` faster, or has been expected faster at every update for ``persist``
    passes, and back the way it came only ``hold`` passes after the last change: expected rates
    wander by several percent from pass to pass, and every change mixes tree sizes in the target's
    passes for a while.
vote
    A gateway's rates and how many sequences it runs at them (:class:`BudgetVote`), sent to the
    target with its steps (``VerifyRequest.budget_vote``).
board
    The target's :class:`BudgetBoard`: one choice over every gateway's latest vote, the budget that
    maximizes the committed tokens per second of all their sequences together, sent back with every
    step (``VerifyResponse.agreed_budget``). Each gateway choosing alone from its own view split
    the passes: on an H200 (27B, 2 gateways, 32 users) one gateway kept 15 nodes and the other 3,
    each within its hysteresis of what its figures preferred, and the passes' mixed trees ran at
    0.82 of a fixed budget of 3 (BENCHMARKS.md [I1]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

__all__ = ["HYSTERESIS", "BudgetBoard", "BudgetVote", "ChoiceRule"]

logger = logging.getLogger(__name__)

HYSTERESIS = 0.10  # how much faster a budget must be expected to replace the current choice


@dataclass
class ChoiceRule:
    """The current choice and when and which way it last moved, in a clock of passes.

    A change onward, the way the last one went, needs no hold: as load arrives the figures move
    over many passes, and a hold kept the choice made at the first of them behind the load.

    A choice whose rate rested on a guessed cost (a pass of more or fewer rows than any measured:
    :func:`splitspec.spec.budget.verify_cost` guesses optimistically there, so that such a pass
    gets tried) is *provisional*: once its rate rests on measured costs, the rule chooses again
    with neither hysteresis nor hold. On an H200 (27B, one user) a gateway chose 23 nodes from
    costs of passes of up to 8 rows; 24 rows then ran at 18.5 ms, not the 14.3 guessed, and the
    hysteresis kept 23 against the 7 that ran faster (BENCHMARKS.md [I1]).

    A lead within the hysteresis that lasts wins too: a budget expected faster at every update
    for ``persist`` passes replaces the choice. The hysteresis is there for wander, which moves
    the lead from one budget to another; a lead that stays is the load's. On an H100 (27B, 8
    users) two runs kept 7 nodes where a fixed 3 ran 5-8% faster ([X7], [A11])."""

    hold: float  # passes after a change before the choice may move back the other way
    hysteresis: float = HYSTERESIS
    persist: float | None = None  # passes one budget must stay the best to replace the choice within the hysteresis; None: 3 holds
    choice: int | None = None
    chosen_at: float = 0.0  # the clock at the last change
    direction: int = 0  # the sign of the last change: +1 to larger trees, -1 to smaller, 0 none yet
    provisional: bool = False  # the choice was made on a guessed cost, not yet measured
    challenger: int | None = None  # the budget expected faster than the choice at every update since challenged_at
    challenged_at: float = 0.0

    def update(self, candidates: np.ndarray, rates: np.ndarray, now: float, guessed: np.ndarray | None = None) -> tuple[bool, bool]:
        """Move the choice to the best of ``candidates`` (``[m]`` int, with their ``rates``, ``[m]``)
        where the rule lets it; ``guessed`` (``[m]`` bool, default none) marks the rates that rest
        on a guessed cost. Returns ``(changed, held)``: whether it moved, and whether the hold kept
        it from moving back."""
        guessed = np.zeros(len(candidates), dtype=bool) if guessed is None else np.asarray(guessed, dtype=bool)  # [m]
        best = int(np.argmax(rates))
        current = np.flatnonzero(candidates == self.choice)
        if len(current) and self.provisional and not guessed[current[0]]:  # measured now: choose again, freely
            self.provisional = False
            self.adopt(int(candidates[best]), now, bool(guessed[best]))
            return best != current[0], False
        onward = self.choice is not None and np.sign(candidates[best] - self.choice) == self.direction != 0
        held = now - self.chosen_at < self.hold and not onward
        if self.challenger != candidates[best] or candidates[best] == self.choice:
            self.challenger, self.challenged_at = int(candidates[best]), now
        persistent = now - self.challenged_at >= (3 * self.hold if self.persist is None else self.persist)
        if len(current) and (held or (rates[best] <= (1 + self.hysteresis) * rates[current[0]] and not persistent)):
            return False, held
        self.adopt(int(candidates[best]), now, bool(guessed[best]))
        return True, False

    def adopt(self, budget: int, now: float, guessed: bool = False) -> None:
        """Make ``budget`` the choice (a change from the current one counts as one), provisional
        where its rate rests on a guessed cost."""
        if budget == self.choice:
            return
        if self.choice is not None:
            self.direction = int(np.sign(budget - self.choice))
        self.choice, self.chosen_at, self.provisional = budget, now, guessed


@dataclass
class BudgetVote:
    """A gateway's view: the tokens per second it expects of one of its ``sequences`` at each budget."""

    voter: str  # the gateway (an id it draws at start)
    budgets: np.ndarray  # [m] int
    rates: np.ndarray  # [m] float, committed tokens per second of one sequence
    sequences: float  # the gateway's adaptive sequences now
    guessed: np.ndarray | None = None  # [m] bool: the rates that rest on a guessed cost (ChoiceRule); None: none
    at: float = 0.0  # the board's clock when it came


@dataclass
class BudgetBoard:
    """The target's one adaptive budget over the votes of every gateway that sends them.

    The clock counts passes, each once (:meth:`tick` weighs a step's report by ``1 / sequences``
    of its pass). A vote lasts ``ttl`` passes: a gateway that stopped voting (its adaptive requests
    ended, or it went away) no longer counts, and once none counts the board agrees nothing and
    each gateway chooses alone."""

    hold: float = 10.0  # ChoiceRule.hold, passes; a gateway's BudgetPolicy holds as long by default
    ttl: float = 40.0
    passes: float = 0.0
    votes: dict[str, BudgetVote] = field(default_factory=dict)
    rule: ChoiceRule = field(init=False)
    _logged: int = field(init=False, default=-1)  # int(passes) of the last "keeps" line

    def __post_init__(self) -> None:
        self.rule = ChoiceRule(self.hold)

    def tick(self, pass_sequences: int) -> None:
        """A step of a pass of ``pass_sequences`` sequences was answered."""
        self.passes += 1.0 / max(1, pass_sequences)

    def vote(self, vote: BudgetVote) -> None:
        """Take ``vote`` (replacing its voter's last one) and choose again over the live votes."""
        if not vote.voter:
            raise ValueError("a budget vote needs its voter")
        if len(vote.budgets) == 0 or len(vote.budgets) != len(vote.rates) or not np.all(np.isfinite(vote.rates)):
            raise ValueError(f"a budget vote needs one finite rate per budget, got {len(vote.rates)} rates for {len(vote.budgets)} budgets")
        if np.min(vote.budgets) < 0 or not np.isfinite(vote.sequences) or vote.sequences < 0:
            raise ValueError(f"budgets and sequences must be >= 0, got budgets {list(vote.budgets)} and {vote.sequences} sequences")
        guessed = np.zeros(len(vote.budgets), dtype=bool) if vote.guessed is None else np.asarray(vote.guessed, dtype=bool)  # [m]
        if len(guessed) != len(vote.budgets):
            raise ValueError(f"a budget vote's guessed marks are one per budget, got {len(guessed)} for {len(vote.budgets)} budgets")
        order = np.argsort(vote.budgets)  # [m]
        vote.budgets, vote.rates, vote.guessed = np.asarray(vote.budgets)[order], np.asarray(vote.rates, dtype=np.float64)[order], guessed[order]
        vote.at = self.passes
        self.votes[vote.voter] = vote
        live = self._live()
        self.votes = {v.voter: v for v in live}  # a gateway gone (restarted: a new voter) is forgotten
        candidates = live[0].budgets
        for v in live[1:]:
            candidates = np.intersect1d(candidates, v.budgets)
        if not len(candidates):
            return  # gateways of disjoint budgets (their --max-budget) share no choice
        weights = np.array([v.sequences for v in live])  # [voters]; a gateway that runs none now has no stake
        if weights.sum() <= 0:
            weights = np.ones(len(live))
        total = np.zeros(len(candidates))  # [m] committed tokens per second of all the voters' sequences
        guessed = np.zeros(len(candidates), dtype=bool)  # [m] a rate a voter with a stake guessed
        for w, v in zip(weights, live):
            at = np.searchsorted(v.budgets, candidates)  # [m]
            total += w * v.rates[at]
            guessed |= (w > 0) & v.guessed[at]
        before = self.rule.choice
        changed, held = self.rule.update(candidates, total, self.passes, guessed)
        best = int(candidates[np.argmax(total)])
        if changed:
            logger.info("agreed budget %s -> %d over %d gateways' votes: %s tok/s expected of all their sequences",
                        before, self.rule.choice, len(live), _listed(candidates, total))
        elif best != self.rule.choice and self._logged != int(self.passes) and logger.isEnabledFor(logging.DEBUG):  # once a pass
            self._logged = int(self.passes)
            logger.debug(
                "agreed budget keeps %s, not %d%s, over %d gateways' votes: %s tok/s expected of all their sequences",
                self.rule.choice, best, " (held)" if held else "", len(live), _listed(candidates, total),
            )

    @property
    def agreed(self) -> int | None:
        """The budget every voter's adaptive steps should take, or None while no vote is live."""
        return self.figures()[0]

    def figures(self) -> tuple[int | None, int]:
        """``(agreed, live votes)``, read without changing the board (a metrics scrape reads them
        from another thread)."""
        live = len(self._live())
        return (self.rule.choice if live else None), live

    def _live(self) -> list[BudgetVote]:
        """The votes of the last ``ttl`` passes."""
        return [v for v in list(self.votes.values()) if self.passes - v.at <= self.ttl]


def _listed(budgets: np.ndarray, rates: np.ndarray) -> str:
    """``budget: rate`` pairs for a log line (built only when the line is written: votes come once a step)."""
    return ", ".join(f"{b}: {r:.0f}" for b, r in zip(budgets, rates))
