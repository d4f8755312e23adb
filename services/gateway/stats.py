"""What the gateway counts per verify step and per request: plain dataclasses that the speculation
loop fills and ``services.metrics`` turns into Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.spec.acceptance_length import acceptance_length


@dataclass(frozen=True)
class StepStats:
    """What one verify step did."""

    tree_nodes: int  # drafted nodes sent to verification (0 = target-only)
    draft_depth: int  # draft positions speculated: the depth of the deepest node
    accepted: int  # accepted nodes, i.e. the depth of the accepted path; the step commits accepted + 1
    fallback: str = ""  # why the step ran target-only although speculation was asked ("" = it did not)
    budget: int | None = None  # the node budget its tree was built under (None: no tree was drafted)

    @property
    def committed(self) -> int:
        """Tokens this step committed, bonus included: its acceptance length (AL, splitspec.spec.acceptance_length)."""
        return self.accepted + 1


@dataclass
class SequenceStats:
    """A request's verify steps (the prefill's token is no step's and is not counted)."""

    steps: int = 0  # verify passes
    committed: int = 0  # tokens committed by verifies (root + accepted nodes), every one of every step
    tree_nodes: int = 0  # drafted nodes sent to verification
    fallbacks: int = 0  # steps run target-only because the draft failed, was down or is missing
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    recoveries: int = 0  # re-prefills after the target lost the sequence

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.committed += step.committed
        self.tree_nodes += step.tree_nodes
        if step.fallback:
            self.fallbacks += 1
            self.fallback_reasons[step.fallback] = self.fallback_reasons.get(step.fallback, 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        """``usage.mean_acceptance_length``: AL as splitspec.spec.acceptance_length defines it (0.0 with no step)."""
        return acceptance_length(self.committed, self.steps)
