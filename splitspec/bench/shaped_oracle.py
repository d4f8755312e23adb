"""ShapedOracleDrafter — FOR BENCHMARKS ONLY, never for serving users.

The honest round of a real drafter at a real acceptance length, measured in one row: a DFlash
draft of random weights and the real shape runs every pass it would run (its batched block pass,
the target's tap features appended to its contexts), and the OracleDrafter's proposals
(``oracle_drafter.py``, recorded continuations corrupted at a chosen rate) are what it answers.
So the round holds the draft's real pass, the tap features of every committed row on the wire (a
random draft commits about one token a step, moving a sixth of the rows an AL-6 drafter moves),
and the target's commit of AL tokens a step, where ``splitspec bench`` otherwise composes the
honest figure from two rows (the oracle's AL, the random draft's round).

The oracle's own work (about 0.1 ms of Python a step on the 2-core CPU: 1.6 ms for a pass of 16)
is no real draft's, so it runs on a thread of its own while the draft's graphed pass is on the
GPU (started once the pass is launched, so that it does not hold the GIL from the launch); an
eager pass (a CPU) answers it after the pass.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from services.draft.engine import DraftEngine, Proposal, ProposeStep
from splitspec.bench.oracle_drafter import OracleDrafter


class ShapedOracleDrafter:
    """``DraftEngine``'s interface (its attributes are the wrapped engine's: the taps the target
    sends, the live contexts a release frees); ``propose_batch`` runs the engine's pass and answers
    each step the engine accepted with the oracle's proposal, timed as the engine's pass."""

    def __init__(self, engine: DraftEngine, oracle: OracleDrafter) -> None:
        self.engine, self.oracle = engine, oracle
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oracle")
        self._steps: list[ProposeStep] = []
        self._answers: Future | None = None  # the oracle's answers to _steps, once the pass is launched
        graphs = getattr(engine, "graphs", None)
        if graphs is not None:  # the graphed passes: the oracle starts when one returns, launched
            graphs.run_batch = self._launched(graphs.run_batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _launched(self, launch):
        def run(*args, **kwargs):
            out = launch(*args, **kwargs)
            if self._answers is None and self._steps:
                self._answers = self._helper.submit(self.oracle.propose_batch, self._steps)
            return out

        return run

    def propose_batch(self, steps: list[ProposeStep]) -> list[Proposal | BaseException]:
        self._steps, self._answers = steps, None
        try:
            ran = self.engine.propose_batch(steps)
            answers = self._answers.result() if self._answers is not None else self.oracle.propose_batch(steps)
        finally:
            self._steps, self._answers = [], None
        out: list[Proposal | BaseException] = []
        for engine_result, oracle_result in zip(ran, answers):
            if isinstance(engine_result, Proposal) and isinstance(oracle_result, Proposal):
                oracle_result.forward_ns, oracle_result.pass_sequences = engine_result.forward_ns, engine_result.pass_sequences
            out.append(engine_result if isinstance(engine_result, BaseException) else oracle_result)
        self._forget_released()
        return out

    propose = OracleDrafter.propose  # one step through propose_batch (not the engine's own, which __getattr__ would give)

    def _forget_released(self) -> None:
        """The oracle's histories of sequences the engine no longer holds (released, expired,
        refused): the worker releases only the engine's contexts."""
        for sequence_id, _ in self.oracle.sequences.items():
            if sequence_id not in self.engine.sequences:
                self.oracle.sequences.pop(sequence_id)
