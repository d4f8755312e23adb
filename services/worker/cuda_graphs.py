"""CUDA graph capture shared by the target's verify and the draft's block pass.

A captured pass replays fixed kernels on fixed addresses, so each caller keeps its inputs in
static buffers, writes them before a replay and reads the outputs the capture returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")
MIN_SPAN = 256
WARM_SPANS = (256, 512, 1024)  # key spans the workers' warm-ups capture: prompts up to ~1K tokens, and their answers


def attention_span(end: int) -> int:
    """Key slots a pass reads when its keys end at slot ``end``: a power of two ≥ ``MIN_SPAN``,
    so that one graph serves every length up to it."""
    return max(MIN_SPAN, 1 << (end - 1).bit_length())


_STREAMS: dict[int, torch.cuda.Stream] = {}


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside the block, anything that makes the host wait for a CUDA stream (``.item()``, a copy
    to the host, ``nonzero``) raises, by torch's sync debug mode: a check that a pass's host side
    (filling its inputs, a replay) never stalls on the device. Waiting on an event is allowed."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def capture(
    compute: Callable[[], T], device: torch.device, pool=None, before_replay: Callable[[], object] | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``compute`` (reading only static buffers) and replay it once.

    The warm-up run on a side stream, which capture requires, already computes this call's
    result; the replay after capture writes it into the outputs that later replays reuse. So
    ``compute`` runs twice: a pass that moves state on in place (a hybrid's prompt chunk) puts it
    back in ``before_replay``, called (on the current stream) between the capture and the replay.
    """
    # Capture records on the current device: make it the tensors' one (a worker on cuda:1, say),
    # and capture on a stream of that device. torch's default capture stream is made once per
    # process on whatever device is current then; graphs sharing a pool want one stream anyway.
    with torch.cuda.device(device):
        index = torch.cuda.current_device()
        side = _STREAMS.get(index)
        if side is None:
            side = _STREAMS[index] = torch.cuda.Stream(index)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compute()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": only this thread's unsafe calls break the capture. In CUDA's default
        # "global" mode any thread's do: the draft's servicer pinning a prompt's rows
        # (cudaHostAlloc, cudaEventQuery in torch's host allocator) while the engine thread
        # captured a pass made that capture fail, and the draft served eagerly from then on
        # (scripts/gpu_capture_threads.py, BENCHMARKS.md [S20]).
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            outputs = compute()
        if before_replay is not None:
            before_replay()
        graph.replay()
    return graph, outputs


@dataclass
class StagedInputs:
    """A pass's static input bytes on the device, written on the host: the host bytes (pinned)
    go over in one asynchronous copy a step, and are written again only once that copy is done.
    On a CPU the host bytes are the device bytes and nothing is copied."""

    on_device: torch.Tensor  # [nbytes] uint8, read by the pass
    on_host: torch.Tensor  # [nbytes] uint8, pinned (``on_device`` itself on a CPU)
    copied: torch.cuda.Event | None  # the last copy out of ``on_host`` (None on a CPU)

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device) -> StagedInputs:
        on_device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if device.type != "cuda":
            return cls(on_device, on_device, None)
        return cls(on_device, torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())

    def writable(self) -> np.ndarray:
        """The host bytes, once the last copy out of them is done."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.on_host.numpy()

    def upload(self, nbytes: int | None = None) -> None:
        """Copy the first ``nbytes`` (all by default) to the device, asynchronously."""
        if self.copied is None:
            return
        self.on_device[:nbytes].copy_(self.on_host[:nbytes], non_blocking=True)
        # The inputs' own stream: the engine thread's current device may be another GPU.
        self.copied.record(torch.cuda.current_stream(self.on_device.device))
