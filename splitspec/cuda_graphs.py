"""CUDA graph capture shared by the target's verify and the draft's block pass.

A captured pass replays fixed kernels on fixed addresses, so each caller keeps its inputs in
static buffers, writes them before a replay and reads the outputs the capture returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
MIN_SPAN = 256


def attention_span(end: int) -> int:
    """Key slots a pass reads when its keys end at slot ``end``: a power of two ≥ ``MIN_SPAN``,
    so that one graph serves every length up to it."""
    return max(MIN_SPAN, 1 << (end - 1).bit_length())


_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture(compute: Callable[[], T], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``compute`` (reading only static buffers) and replay it once.

    The warm-up run on a side stream, which capture requires, already computes this call's
    result; the replay after capture writes it into the outputs that later replays reuse.
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
        with torch.cuda.graph(graph, pool=pool, stream=side):
            outputs = compute()
        graph.replay()
    return graph, outputs
