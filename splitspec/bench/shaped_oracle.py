"""ShapedOracleDrafter — FOR BENCHMARKS ONLY, never for serving users.

The honest round of a real drafter at a real acceptance length, measured in one row: a DFlash
draft of random weights and the real shape runs every pass it would run (its batched block pass,
the target's tap features appended to its contexts), and the OracleDrafter's proposals
(``oracle_drafter.py``, recorded continuations corrupted at a chosen rate) are what it answers.
So the round holds the draft's real pass, the tap features of every committed row on the wire (a
random draft commits about one token a step, moving a sixth of the rows an AL-6 drafter moves),
and the target's commit of AL tokens a step, where ``splitspec bench`` otherwise composes the
honest figure from two rows (the oracle's AL, the random draft's round).
"""

from __future__ import annotations

from typing import Any

from services.draft.engine import DraftEngine, Proposal, ProposeStep
from splitspec.bench.oracle_drafter import OracleDrafter


class ShapedOracleDrafter:
    """``DraftEngine``'s interface (its attributes are the wrapped engine's: the taps the target
    sends, the live contexts a release frees); ``propose_batch`` runs the engine's pass, then answers
    each step the engine accepted with the oracle's proposal, timed as the engine's pass."""

    def __init__(self, engine: DraftEngine, oracle: OracleDrafter) -> None:
        self.engine, self.oracle = engine, oracle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def propose_batch(self, steps: list[ProposeStep]) -> list[Proposal | BaseException]:
        ran = self.engine.propose_batch(steps)
        answers = self.oracle.propose_batch(steps)
        out: list[Proposal | BaseException] = []
        for engine_result, oracle_result in zip(ran, answers):
            if isinstance(engine_result, Proposal) and isinstance(oracle_result, Proposal):
                oracle_result.forward_ns, oracle_result.pass_sequences = engine_result.forward_ns, engine_result.pass_sequences
            out.append(engine_result if isinstance(engine_result, BaseException) else oracle_result)
        self._forget_released()
        return out

    def propose(
        self, sequence_id: str, anchor_token: int, anchor_position: int, features, top_k: int, window: int = 0, tokens=(),
        context: int = 0, depths: int = 0,
    ) -> Proposal:
        step = ProposeStep(sequence_id, anchor_token, anchor_position, features, top_k, window, list(tokens), context, depths)
        result = self.propose_batch([step])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _forget_released(self) -> None:
        """The oracle's histories of sequences the engine no longer holds (released, expired,
        refused): the worker releases only the engine's contexts."""
        for sequence_id, _ in self.oracle.sequences.items():
            if sequence_id not in self.engine.sequences:
                self.oracle.sequences.pop(sequence_id)
