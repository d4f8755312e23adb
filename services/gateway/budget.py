"""The gateway's adaptive tree budget (``--budget auto``): one :class:`BudgetPolicy` per gateway,
shared by all its sequences, learns from their steps and chooses each DDTree step's budget.

It keeps running figures of what :mod:`splitspec.spec.budget` needs (see its terms), each an
exponential moving average (EMA), so they follow the load as it changes:

- the verify cost curve ``t(rows)``: per row bucket, the mean rows and seconds of the target's
  passes, fed by every ``VerifyResponse`` (``pass_rows``, ``forward_ns``); it gives the shape of
  a pass's cost by its rows, and the rounds' own passes its level (:meth:`BudgetPolicy.rates`);
- ``t_other``: a speculating step's time minus its verify pass and its wait for that pass, and of
  it ``t_draft``, the draft's proposal as the gateway waits for it;
- the passes a round holds ``q``: its pass and its wait in the target behind other passes over
  its pass (a wait behind other sequences' prompts counts nowhere: :meth:`BudgetPolicy.observe_round`).
  Sequences out of step make the target alternate between groups of them, so a round waits for the other
  groups' passes, whose rows grow with the budget as its own do: a round costs
  ``t_other + q * t(rows)`` (at 8 users on an H200, ``q`` near 2: priced as one pass, the policy
  chose trees of 48-64 nodes where 16-23 were faster);
- the concurrency ``n``: sequences per pass (``pass_sequences``). The target counts every sequence
  of the pass, so other gateways' sequences are in it too;
- ``t_other``, ``q`` and ``n`` apart for the rounds of target-only steps (budget 0), which meet
  in the target as drafting rounds do not (:meth:`BudgetPolicy.round_figures`);
- the calibration ``c(d)``: per depth, the observed and the predicted acceptance;
- the draft's mass by budget and depth (``prefix_depth_mass``) of the largest tree, built once a
  pass (:meth:`BudgetPolicy.tree_budget`; the pass's other steps build only the chosen size).

**One budget for all.** The choice is made from these running figures, not from the tree at hand,
so every sequence of the gateway gets the same budget until the figures move it: the target's
passes then join trees of one size, shapes its CUDA graphs were warmed up for
(``services.target.graphs.WARM_BLOCKS``). Trees chosen one by one from their own scores made
passes of mixed sizes, each mix a new shape; on an H200 (8B, 32 users) those passes ran eagerly
or stalled for captures, and the adaptive rounds took 85 ms against a fixed budget's 55-84 ms. A
new choice replaces the current one only when its rate is ``HYSTERESIS`` higher, or when it was
the best at every choice for three holds (a lead under the hysteresis: on an H100, 27B, 8 users,
two runs kept 7 nodes where a fixed 3 ran 5-8% faster, BENCHMARKS.md [X7], [A11]), and one that
reverses the last change (larger trees after smaller, or smaller after larger) not before
``hold_passes`` passes since that change have shown what the current one costs: at 8 users on an
H200, with 3% and no hold, the choice moved between 7 and 64 nodes several times a second as
``t_other`` and ``q`` wandered, its passes mixed tree sizes, and the rounds took 44 ms against a
fixed budget's 30. A change onward, the way the last one went, needs no wait: as load arrives the
figures move over ``1 / alpha`` passes, and the hold kept the choice made at the first of them
(one pass into a load of 32 sequences, the concurrency reads 4) for ten passes behind the load
(``test_a_choice_follows_a_ramp_at_once_and_turns_back_only_after_the_hold``;
:class:`splitspec.spec.budget_choice.ChoiceRule`).

**One budget for all gateways.** Each pass the policy's rates go to the target with a step as a
vote (:meth:`BudgetPolicy.take_vote`, ``VerifyRequest.budget_vote``), and every answer carries the
budget the target's board chose over the live votes of every gateway
(:class:`splitspec.spec.budget_choice.BudgetBoard`), which the policy then follows; its own rule
decides only while the target agrees none (a target that keeps no board, or no vote live).

**Budget 0 skips the draft.** While the choice is 0 the gateway's sequences take target-only
steps, in pipelined runs that do not ask the draft (``services.gateway.speculation.TARGET_ONLY_RUN``);
their rounds price 0 once seen, and before that the drafting rounds' figures without ``t_draft``,
their sequences all in one pass, do (a guess, so a choice of 0 made on it is provisional:
:class:`splitspec.spec.budget_choice.ChoiceRule`). After each run a sequence drafts one step,
with the best tree of the other budgets (:meth:`BudgetPolicy.choose`), so that acceptance, the
draft's mass and ``t_draft`` stay observed and the choice can leave 0; the tap features of the run go to the draft with that proposal. On
the 2-core CPU with the built-in pair, 8 clients got 0.77 of AR's tok/s when budget 0 still paid
the draft.

**A forecast of fixed budgets.** Requests that fix their budget feed the same figures, and the
draft's mass of their own trees prices a forecast of their rate (:meth:`BudgetPolicy.observe_fixed_tree`):
held against the rate a fixed budget is measured at, it shows how far the model is off at a load,
with no adaptive choice moving what it observes.

Its methods never await, so on the gateway's one event loop each runs whole between steps of
other sequences; no lock is needed.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from splitspec.spec.budget import ADAPTIVE_BUDGETS, budget_rates, depth_mass, prefix_depth_mass, row_bucket, verify_cost
from splitspec.spec.budget_choice import BudgetVote, ChoiceRule
from splitspec.spec.tree import DraftTree

logger = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_BUDGET = 22  # before the policy has cost data, and the chain length of chain mode under auto
DEFAULT_MAX_BUDGET = 64
FORECAST_BUDGETS = 10  # fixed budgets the forecast follows, the last fed (a metric label each)


def parse_budget(text: str) -> str | int:
    """The ``--budget`` flag (argparse type): ``auto`` or a fixed number of nodes (>= 1)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        budget = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number") from None
    if budget < 1:
        raise argparse.ArgumentTypeError(f"{budget} must be >= 1 (or auto)")
    return budget


class _Ema:
    """An exponential moving average; its first observation is its start value."""

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.count = alpha, 0.0, 0

    def add(self, x: float, weight: float = 1.0) -> None:
        """Observe ``x``; ``weight`` scales ``alpha`` (a report that is one of several of one event)."""
        self.value = x if self.count == 0 else self.value + min(1.0, self.alpha * weight) * (x - self.value)
        self.count += 1


@dataclass(frozen=True)
class BudgetFigures:
    """What a gateway's adaptive budget rests on now (:meth:`BudgetPolicy.figures`), for its metrics."""

    choice: int | None  # the budget adaptive steps get (0: target-only runs; None: not chosen yet)
    draft_s: float  # t_draft, seconds
    rounds: dict[str, tuple[float, float, float]]  # kind of round seen (drafting, target_only) -> (t_other s, q, n)
    expected: dict[int, float]  # candidate budget -> committed tok/s expected of a sequence (empty before a choice)
    forecast: dict[int, float]  # fixed budget requests ran -> committed tok/s the same model expects of a sequence there
    levels: dict[str, float]  # kind of round -> the level its passes were priced at, when rates were last priced (BudgetPolicy._level)


class _Rounds:
    """Running figures of one kind of step's rounds (drafting, or target-only): ``t_other``, the
    passes a round holds ``q``, and its own pass's rows and seconds."""

    def __init__(self, alpha: float) -> None:
        self.other, self.passes = _Ema(alpha), _Ema(alpha)
        self.rows, self.forward = _Ema(alpha), _Ema(alpha)
        self.seen = 0.0  # passes' worth of rounds observed (each report weighs 1 / its pass's sequences)

    def observe(self, other_s: float, passes: float | None, weight: float, rows: int = 0, forward_s: float = 0.0) -> None:
        self.other.add(other_s, weight)
        if passes is not None:
            self.passes.add(passes, weight)
        if rows > 0 and forward_s > 0:
            self.rows.add(rows, weight)
            self.forward.add(forward_s, weight)
        self.seen += weight


class BudgetPolicy:
    """Chooses each adaptive step's budget from what the gateway's steps observed.

    Args:
        default_budget: the budget chosen before ``warmup_passes`` passes and a speculating step were seen.
        max_budget: the largest budget chosen (the adaptive trees are built at this size).
        warmup_passes: verify passes to observe before choosing.
        alpha: EMA weight of a new pass's observation of cost, ``t_other`` and concurrency: about the
            last ``1 / alpha`` passes count.
        calibration_alpha: EMA weight of one step's acceptance. A step's acceptance at a depth is 0
            or 1, so this averages over more steps.
        hold_passes: passes after a change of the choice before it may change back the other way
            (default ``1 / alpha``: the passes the figures average over).
    """

    def __init__(
        self,
        default_budget: int = DEFAULT_BUDGET,
        max_budget: int = DEFAULT_MAX_BUDGET,
        *,
        warmup_passes: int = 8,
        alpha: float = 0.1,
        calibration_alpha: float = 0.01,
        hold_passes: float | None = None,
    ) -> None:
        if not 0 <= default_budget <= max_budget:
            raise ValueError(f"default budget {default_budget} is outside [0, max budget {max_budget}]")
        if warmup_passes < 1:
            raise ValueError(f"warmup_passes must be >= 1 (the cost curve needs a point), got {warmup_passes}")
        self.default_budget, self.max_budget, self.warmup_passes = default_budget, max_budget, warmup_passes
        self.alpha, self.calibration_alpha = alpha, calibration_alpha
        self.passes = 0
        self._buckets: dict[int, tuple[_Ema, _Ema]] = {}  # row bucket -> (EMA of rows, EMA of seconds)
        self._drafting = _Rounds(alpha)  # t_other (seconds), q and n of the steps that drafted
        self._target_only = _Rounds(alpha)  # the same of the steps that did not (the choice was 0)
        self._target_only_sequences = _Ema(alpha)  # n of the target-only rounds' passes (drafting ones: the concurrency)
        self._draft = _Ema(alpha)  # t_draft, seconds
        self._concurrency = _Ema(alpha)  # sequences per pass
        self._observed: list[_Ema] = []  # [depth] EMA of the steps' acceptance at that depth (index 0 unused)
        self._predicted: list[_Ema] = []  # [depth] EMA of the draft's probability mass at that depth
        self._mass: np.ndarray | None = None  # [max_budget + 1, max_budget + 1] EMA of prefix_depth_mass
        self.verified_trees = 0  # steps whose acceptance the calibration has seen
        # The choice (None: not ready) in a clock of _pass_weight, moved by this gateway's figures
        # while the target agrees no budget over every gateway's votes.
        self.rule = ChoiceRule(1.0 / alpha if hold_passes is None else hold_passes)
        self.voter = uuid.uuid4().hex[:12]  # this gateway, to the target's BudgetBoard
        self.sequences = 0  # adaptive sequences running now (Speculation.run counts them)
        self.agreed: int | None = None  # the target's agreed budget that the choice follows (:meth:`agree`)
        self._voted: tuple[int, int] | None = None  # the _cached key of the last vote taken
        self._pass_weight = 0.0  # passes observed, each counted once (its reports weigh 1 / its sequences)
        self._mass_fed = -1  # int(_pass_weight) when a largest tree last fed the draft's mass
        self._mass_feeds = 0  # trees that fed it
        self._cached: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None  # (key, _rates_now())
        self.levels: dict[str, float] = {}  # kind of round -> its passes' level when rates were last priced (_round_cost)
        self._logged = -1  # int(_pass_weight) of the last "keeps" line
        self._fixed_mass: dict[int, _Ema] = {}  # fixed budget -> EMA of its trees' depth mass [budget + 1]
        self.forecast: dict[int, float] = {}  # fixed budget -> the model's tok/s of a sequence (observe_fixed_tree)
        self._forecast_at = -1  # int(_pass_weight) when forecast was computed

    def observe_pass(self, rows: int, pass_sequences: int, forward_s: float) -> None:
        """A verify pass of ``rows`` rows over ``pass_sequences`` sequences took ``forward_s`` seconds.

        Every sequence of a pass reports it, so a pass of ``n`` counts ``n`` times: its concurrency is
        then the one a sequence meets. Each report weighs ``1 / pass_sequences``, so that a pass
        counts once and the figures average over about ``1 / alpha`` passes at any load, not over a
        fraction of one pass (on an H200 at 32 users, weighing each report fully, the concurrency
        read 5 to 26 within seconds). Where other gateways' sequences share the passes, this
        gateway sees its share of each, so its figures span that many more passes."""
        if rows < 1 or pass_sequences < 1 or forward_s <= 0:
            return  # a target that does not time or count its passes teaches nothing
        weight = 1.0 / pass_sequences
        bucket = self._buckets.setdefault(row_bucket(rows), (_Ema(self.alpha), _Ema(self.alpha)))
        bucket[0].add(rows, weight)
        bucket[1].add(forward_s, weight)
        self._concurrency.add(pass_sequences, weight)
        self.passes += 1
        self._pass_weight += weight

    def observe_round(
        self, seconds: float, verify_forward_s: float, verify_queue_s: float = 0.0, pass_sequences: int = 1, draft_s: float = 0.0,
        prompt_wait_s: float = 0.0, target_only: bool = False, pass_rows: int = 0,
    ) -> None:
        """A speculating step took ``seconds`` from its proposal to its verify response, of which its
        verify pass of ``pass_sequences`` sequences took ``verify_forward_s``, its wait in the
        target for that pass ``verify_queue_s`` (of it ``prompt_wait_s`` behind other sequences'
        prompts) and its proposal ``draft_s``. The wait behind other passes counts in ``q``; the
        rest of the round beside the pass and its wait is ``t_other``. The wait behind prompts
        counts in neither: the target spends the same seconds on the prompts whatever the budget,
        so they take a share of the time off every budget alike. Counted per round, in ``t_other``,
        they argued for larger trees, which commit more per round and so seem to share the wait
        out: on an H200 (27B, each wave of requests starting with its prompts) ``t_other`` read
        24-62 ms at 8 users and 128 ms at 32 with a 3-9 ms draft, and the policy chose 15- and
        23-node trees and got 0.80 of a fixed budget of 3 at 8 users (BENCHMARKS.md [O1]).
        Counted as passes they made ``q`` read 16-24 at 16-32 users ([J7]). Weighed as a pass's
        report (:meth:`observe_pass`).

        ``pass_rows``: the rows of its pass, whose seconds then set the cost curve's level (:meth:`rates`).

        ``target_only``: the step did not ask the draft (the choice was 0; ``draft_s`` is unused).
        Its figures price budget 0 apart (:meth:`round_figures`): without the draft between their
        steps, a gateway's sequences meet in the target at once, in fewer passes of more sequences.
        On the 2-core CPU with the built-in pair at 8 users, drafting rounds met 3-7 sequences a
        pass; priced with their figures, 0 was expected at 0.8-1.2 of what mode off's steps ran
        at in the same bench, and the choice moved between 0 and 3 or 7 every few seconds
        (BENCHMARKS.md [N2], [N3], [N5])."""
        weight = 1.0 / max(1, pass_sequences)
        behind_passes = verify_queue_s - min(max(prompt_wait_s, 0.0), verify_queue_s)
        rounds = self._target_only if target_only else self._drafting
        passes = (verify_forward_s + behind_passes) / verify_forward_s if verify_forward_s > 0 else None
        rounds.observe(max(0.0, seconds - verify_forward_s - verify_queue_s), passes, weight, pass_rows, verify_forward_s)
        if target_only:
            self._target_only_sequences.add(max(1, pass_sequences), weight)
        else:
            self._draft.add(min(draft_s, rounds.other.value), weight)

    def observe_acceptance(self, tree: DraftTree, accepted_depth: int) -> None:
        """A step verified ``tree`` (with its scores) and accepted ``accepted_depth`` nodes: update the
        calibration of every depth the tree reached (a depth it did not reach is no evidence)."""
        if tree.num_nodes == 0 or tree.scores is None:
            return
        self.verified_trees += 1
        max_depth = int(tree.depths.max())
        predicted = depth_mass(tree.scores, tree.depths, max_depth)  # [max_depth + 1]
        while len(self._observed) <= max_depth:
            self._observed.append(_Ema(self.calibration_alpha))
            self._predicted.append(_Ema(self.calibration_alpha))
        for depth in range(1, max_depth + 1):
            observed, mass = self._observed[depth], self._predicted[depth]
            if mass.count == 0:
                # Both start at the first prediction, as if it had come true (c = 1), so that the first
                # few steps, each accepting 0 or 1, cannot swing the ratio to 0 or to many times 1.
                observed.add(predicted[depth])
                mass.add(predicted[depth])
            observed.add(float(accepted_depth >= depth))
            mass.add(predicted[depth])

    def observe_fixed_tree(self, tree: DraftTree, budget: int) -> None:
        """A step of a request that fixed its ``budget`` verified ``tree`` (with its scores): the
        draft's mass of the tree joins that budget's figure, and once a pass :attr:`forecast` gives
        the rate :meth:`rates`' model expects of a sequence at each fixed budget seen, and at 0
        (target-only steps: mode off's rate), from the round figures and costs of now. Beside the
        rate a fixed budget, or mode off, is measured at, the forecast says how far the model the
        adaptive budget chooses by is off at that load, with no adaptive choice moving what it
        observes (``scripts/adaptive_budget.py`` prints both)."""
        if tree.num_nodes == 0 or tree.scores is None:
            return
        mass = depth_mass(tree.scores, tree.depths, budget)  # [budget + 1]; a tree has at most budget nodes
        figure = self._fixed_mass.pop(budget, None) or _Ema(self.alpha)
        figure.add(mass, 1.0 / self.concurrency)
        self._fixed_mass[budget] = figure  # last in the order: the budgets fed longest ago go first
        while len(self._fixed_mass) > FORECAST_BUDGETS:
            del self._fixed_mass[next(iter(self._fixed_mass))]
        if not self.ready or int(self._pass_weight) == self._forecast_at:
            return
        self._forecast_at = int(self._pass_weight)
        budgets = np.array([0, *sorted(self._fixed_mass)])  # [m]; 0: target-only steps, as rates() prices them
        expected_al = np.zeros(budgets[-1] + 1)  # [max + 1], set at the budgets seen
        expected_al[budgets] = [1.0] + [1.0 + self._fixed_mass[b].value @ self.calibration(b) for b in budgets[1:]]
        other, q, n = self._round_terms(budgets)  # [m] each
        rates = budget_rates(expected_al, self._round_cost(budgets, q), other, n, budgets)  # [m]
        self.forecast = {int(b): float(r) for b, r in zip(budgets, rates)}  # one assignment: a metrics scrape may read it

    @property
    def concurrency(self) -> float:
        """Sequences per verify pass (1.0 before any pass was observed)."""
        return self._concurrency.value if self._concurrency.count else 1.0

    @property
    def t_other(self) -> float:
        """A drafting round's ``t_other``, seconds."""
        return self._drafting.other.value

    @property
    def t_draft(self) -> float:
        return self._draft.value

    @property
    def passes_per_round(self) -> float:
        """A drafting round's ``q`` (1.0 before one was observed)."""
        return self._drafting.passes.value if self._drafting.passes.count else 1.0

    def round_figures(self, target_only: bool = False) -> tuple[float, float, float]:
        """``(t_other, q, n)`` of a drafting round, or of a target-only one, as :meth:`rates` prices
        them. ``n`` is :attr:`concurrency`, the sequences of the passes now. Target-only, before
        such a round was seen: the drafting round's ``t_other`` without the draft, and the ``n q``
        sequences of a drafting round's passes in one pass (target-only steps are pipelined, so
        they all meet in each pass; priced as drafting rounds met, with their ``n`` and ``q``, 0
        was expected at 25 tok/s a sequence on an H200 at 32 users of the 27B, BENCHMARKS.md
        [I1], where mode off's steps ran at 38 while all users decoded, [Y1]); after, its own,
        ``n`` at least :attr:`concurrency` (its own from before a load came would price 0 at a
        lighter load than its steps would meet)."""
        n = self.concurrency
        if not target_only:
            return self.t_other, self.passes_per_round, n
        own = self._target_only
        if not own.other.count:
            return max(0.0, self.t_other - self.t_draft), 1.0, n * self.passes_per_round
        return own.other.value, own.passes.value if own.passes.count else 1.0, max(self._target_only_sequences.value, n)

    def figures(self) -> BudgetFigures:
        """The figures the last choice was made from: the rates computed at the last pass
        (:meth:`_rates_now`), and the fixed budgets' :attr:`forecast`, not recomputed here (a
        metrics scrape reads them from another thread)."""
        kinds = {"drafting": self._drafting, "target_only": self._target_only}
        rounds = {kind: self.round_figures(kind == "target_only") for kind, seen in kinds.items() if seen.other.count}
        cached = self._cached
        expected = {int(b): float(r) for b, r in zip(*cached[1][:2])} if cached is not None else {}
        return BudgetFigures(self.choice, self.t_draft, rounds, expected, self.forecast, self.levels)

    def calibration(self, max_depth: int) -> np.ndarray:
        """``c(d)`` for ``d = 0 .. max_depth``: ``[max_depth + 1]`` float64, 1.0 where unobserved."""
        c = np.ones(max_depth + 1)
        for depth in range(1, min(max_depth + 1, len(self._observed))):
            mass = self._predicted[depth].value
            if self._predicted[depth].count and mass > 0:
                c[depth] = self._observed[depth].value / mass
        return c

    def cost(self, rows: np.ndarray) -> np.ndarray:
        """``t(rows)`` as learned so far (:func:`splitspec.spec.budget.verify_cost`); needs one pass."""
        points = [(r.value, s.value) for r, s in self._buckets.values()]
        known_rows, known_seconds = np.array(points).T  # [k] each
        return verify_cost(rows, known_rows, known_seconds)

    @property
    def ready(self) -> bool:
        """Whether the policy has seen enough to choose: ``warmup_passes`` passes and one speculating step."""
        return self.passes >= self.warmup_passes and self._drafting.other.count > 0

    def rates(self) -> tuple[np.ndarray, np.ndarray]:
        """The budgets the policy chooses among (``[m]``: ``ADAPTIVE_BUDGETS`` below ``max_budget``,
        and ``max_budget``; 0 once ``1 / calibration_alpha`` verified trees have calibrated the
        draft's acceptance) and the committed tokens per second it expects of a sequence at each
        (``[m]``); 0 priced by target-only rounds (:meth:`round_figures`); needs :attr:`ready` and
        a tree seen by :meth:`choose`.

        A round's pass costs ``t(rows)`` scaled by the level of its kind's rounds: the seconds their
        own passes took over what the curve gives their rows. The curve alone is off where the
        rounds run: its row buckets learn slowly (a load's passes of 1 to n sequences spread over
        several), keep the points of loads before, and are lowered to the cheapest pass of more
        rows (a pass of every sequence at once, while the draft idles, runs faster than the passes
        beside its work). On the 2-core CPU at 8 clients drafting budgets were expected 1.2-1.3x
        faster than they ran, 1.0-1.2x with the level (BENCHMARKS.md [X3], [X5]); on an H100 with
        the 27B at 32 users the level read 0.79-0.93 ([X7])."""
        # 0 stops the drafting that teaches the calibration: it waits for ~1 / calibration_alpha steps of
        # it. (The built-in pair's draft under-reports its acceptance; trusted at once, it chose 0.)
        known = self.verified_trees >= 1.0 / self.calibration_alpha
        candidates = np.array([b for b in ADAPTIVE_BUDGETS if 0 < b < self.max_budget or (b == 0 and known)] + [self.max_budget])  # [m]
        expected_al = 1.0 + self._mass @ self.calibration(self.max_budget)  # [max_budget + 1]
        other, q, n = self._round_terms(candidates)
        return candidates, budget_rates(expected_al, self._round_cost(candidates, q), other, n, candidates)

    def _round_cost(self, candidates: np.ndarray, q: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """The passes of a round of each of ``candidates`` (``[m]``), ``q`` of them: ``rows`` (``[m]``)
        -> ``q t(rows)`` at the level of the candidate's kind of round (:meth:`_level`)."""
        self.levels = {"drafting": self._level(), "target_only": self._level(target_only=True)}
        level = np.where(candidates == 0, self.levels["target_only"], self.levels["drafting"])  # [m]
        return lambda rows: q * level * self.cost(rows)

    def _level(self, target_only: bool = False) -> float:
        """The seconds a kind of round's own passes took over what the cost curve gives their rows
        (1.0 before such a round was seen): the curve's shape prices a budget's passes, the
        rounds' own passes its level (:meth:`rates`)."""
        own = self._target_only if target_only else self._drafting
        if not own.rows.count:
            return 1.0
        return own.forward.value / float(self.cost(np.array([own.rows.value]))[0])

    def _round_terms(self, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(t_other, q, n)`` of each of ``candidates`` (``[m]`` each): 0's target-only rounds, the
        others' drafting ones (:meth:`round_figures`)."""
        drafting, target_only = self.round_figures(), self.round_figures(target_only=True)
        return tuple(np.where(candidates == 0, a, b) for a, b in zip(target_only, drafting))

    def guessed(self, candidates: np.ndarray) -> np.ndarray:
        """``[m]`` bool: whether the rate of each of ``candidates`` (``[m]``, as :meth:`rates` gives
        them) rests on a guess: its pass's rows in a row bucket beyond the measured ones
        (:func:`splitspec.spec.budget.verify_cost` extrapolates there), or, for 0, target-only
        rounds not yet seen for ``1 / alpha`` passes (:meth:`round_figures`); needs one pass."""
        n = self._round_terms(candidates)[2]  # [m]
        buckets = np.array([row_bucket(int(round(rows))) for rows in n * (candidates + 1)])  # [m]
        unseen_rounds = self._target_only.seen < 1.0 / self.alpha  # 0 priced by the drafting rounds' figures, or its own still settling
        return (buckets < min(self._buckets)) | (buckets > max(self._buckets)) | ((candidates == 0) & unseen_rounds)

    def tree_budget(self) -> int:
        """How many nodes this adaptive step's tree should be built with: ``max_budget`` while the
        policy is not ready and once a pass after that (that tree feeds the draft's mass by budget,
        :meth:`choose`), else the budget :meth:`choose` will cut it to. A best-first tree's first
        ``b`` nodes do not depend on how many more it grows, so the other steps build only what
        they verify: on the 2-core CPU a 22-node tree took 57 µs, a 64-node one 123 µs
        (BENCHMARKS.md, [P8])."""
        if not self.ready or self._mass is None or int(self._pass_weight) != self._mass_fed:
            return self.max_budget
        if self.choice is None or self.choice == 0:  # not chosen yet, or an exploring step of budget 0
            return _best_drafting(*self._rates_now()[:2])
        return self.choice

    def _rates_now(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`rates` and their :meth:`guessed` marks (``[m]`` each), computed once a pass (each
        counted once, as in :meth:`observe_pass`) and again when the draft's mass moves; in between
        the steps of a pass share them."""
        key = (int(self._pass_weight), self._mass_feeds)
        if self._cached is None or self._cached[0] != key:
            candidates, rates = self.rates()
            self._cached = (key, (candidates, rates, self.guessed(candidates)))
        return self._cached[1]

    def choose(self, tree: DraftTree, full: bool = True) -> int:
        """The budget for a step whose draft gave ``tree``, a DDTree of the largest budget (with its
        scores), or, where not ``full``, of the budget :meth:`tree_budget` gave: the gateway's
        current choice among ``ADAPTIVE_BUDGETS`` below ``max_budget`` and ``max_budget`` itself,
        or the tree's size when that is smaller; cut the tree to it with ``tree.prefix``. A full
        tree's scores join the running figures the choice is made from. While the choice is 0 only
        exploring steps draft (one after each run of target-only steps), and they get the best
        other budget."""
        most = min(tree.num_nodes, self.max_budget)
        if full and tree.num_nodes and tree.scores is not None:
            mass = prefix_depth_mass(tree.scores, tree.depths, self.max_budget)
            self._mass = mass if self._mass is None else self._mass + self.alpha * (mass - self._mass)
            self._mass_fed, self._mass_feeds = int(self._pass_weight), self._mass_feeds + 1
        if not self.ready or self._mass is None:
            return min(self.default_budget, most)
        candidates, rates, guessed = self._rates_now()
        changed, held = False, False
        if self.agreed is None:  # else the target's agreed choice, followed as it came (:meth:`agree`)
            before = self.choice
            changed, held = self.rule.update(candidates, rates, self._pass_weight, guessed)
            if changed:
                self._log_choice("adaptive budget %s -> %d", before, self.choice, candidates, rates, logging.INFO)
        best = int(candidates[np.argmax(rates)])
        if not changed and best != self.choice and self._logged != int(self._pass_weight):  # once a pass
            self._logged = int(self._pass_weight)
            if self.agreed is None:
                what = "adaptive budget keeps %s, not %d" + (" (held)" if held else "")
            else:  # what this gateway's own figures prefer
                what = "adaptive budget follows the agreed %s, not %d"
            self._log_choice(what, self.choice, best, candidates, rates, logging.DEBUG)
        if self.choice == 0:  # a step that drafts while 0 is chosen explores: the best of the others
            return min(_best_drafting(candidates, rates), most)
        return min(self.choice, most)

    @property
    def choice(self) -> int | None:
        """The budget every adaptive step gets now (None: not ready)."""
        return self.rule.choice

    def agree(self, budget: int | None) -> None:
        """The target's agreed budget over every gateway's votes, as a step's answer said (None: it
        agreed none). Followed from the next step on, its tree built at that size, where it is among
        this gateway's budgets; otherwise (a gateway of another ``--max-budget`` voted it, or this
        one is not ready) the gateway's own rule decides."""
        self.agreed = None
        if budget is None or not self.ready or self._mass is None:
            return
        candidates, rates, _ = self._rates_now()
        if budget not in candidates:
            return
        before, self.agreed = self.choice, budget
        self.rule.adopt(budget, self._pass_weight)
        if self.choice != before:
            self._log_choice("adaptive budget %s -> %d (agreed by the target)", before, budget, candidates, rates, logging.INFO)

    def take_vote(self) -> BudgetVote | None:
        """This gateway's rates and sequences for the target's budget board, once each time the rates
        are computed anew (once a pass); None before the policy is ready and between."""
        if self._cached is None or self._cached[0] == self._voted or not self.ready:
            return None
        self._voted = self._cached[0]
        candidates, rates, guessed = self._cached[1]
        return BudgetVote(self.voter, candidates, rates, float(self.sequences), guessed)

    def _log_choice(self, what: str, first: int | None, second: int, candidates: np.ndarray, rates: np.ndarray, level: int) -> None:
        """Log ``what`` (formatted with ``first`` and ``second``, a candidate) with the figures the
        choice rests on, the pass costs learned among them: a choice is only as good as they are."""
        if not logger.isEnabledFor(level):  # a debug line once a pass: its figures are not worth building unread
            return
        other, q, n = self.round_figures()
        other_0, q_0, n_0 = self.round_figures(target_only=True)
        seen = "" if self._target_only.other.count else " (none seen yet: the drafting rounds' without the draft, in one pass)"
        logger.log(
            level,
            what + ": %.1f tok/s expected of a sequence (%s); drafting rounds: %.1f sequences a pass, %.2f passes, "
            "t_other %.1f ms (draft %.1f); target-only rounds%s: %.1f sequences, %.2f passes, t_other %.1f ms; pass ms by rows (%s), "
            "the rounds' passes at %.2fx that (target-only %.2fx)",
            first, second, rates[candidates == second][0], ", ".join(f"{b}: {r:.1f}" for b, r in zip(candidates, rates)),
            n, q, 1e3 * other, 1e3 * self.t_draft, seen, n_0, q_0, 1e3 * other_0,
            ", ".join(f"{r.value:.0f}: {1e3 * s.value:.1f}" for r, s in sorted(self._buckets.values(), key=lambda point: point[0].value)),
            self._level(), self._level(target_only=True),
        )


def _best_drafting(candidates: np.ndarray, rates: np.ndarray) -> int:
    """The best of ``candidates`` (``[m]``, with their ``rates``) that asks the draft: above 0."""
    drafting = candidates > 0  # [m]
    return int(candidates[drafting][np.argmax(rates[drafting])])
