"""A CPU stand-in for ``services.worker.cuda_graphs.capture`` (CI has no GPU), for the workers' handling
of a capture that fails: the graphs' containment is all the workers' own code, the capture itself
is CUDA's.

:class:`CaptureOnCpu` runs ``compute`` as ``capture`` does (once before capturing, once as the
replay after it) and returns a "graph" whose ``replay`` runs it again and writes the results into
the first outputs, as a CUDA graph's replay rewrites the outputs it captured; the calls numbered in
``fail`` raise as a capture does that another thread's CUDA call invalidated (after the run that
precedes a real capture: what that run wrote stays written).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

INVALIDATED = "CUDA error: operation not permitted when stream is capturing"


class CaptureOnCpu:
    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.calls = 0
        self.fail = set(fail)

    def __call__(self, compute, device, pool=None, before_replay=None):
        self.calls += 1
        outputs = compute()
        if self.calls in self.fail:
            raise RuntimeError(INVALIDATED)
        graph = _Replay(compute, outputs)
        if before_replay is not None:
            before_replay()
        graph.replay()  # as capture() replays once after capturing
        return graph, outputs


class _Replay:
    def __init__(self, compute, outputs) -> None:
        self.compute, self.outputs = compute, outputs

    @torch.inference_mode()  # the outputs are inference tensors (the workers' passes run in inference mode)
    def replay(self) -> None:
        for old, new in zip(tree_leaves(self.outputs), tree_leaves(self.compute()), strict=True):
            old.copy_(new)
