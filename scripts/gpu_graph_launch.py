"""How long a CUDA graph launch holds the host and the GPU, by graph size and split (trivial
kernels; the real steps' replays are timed by gpu_verify_host.py).

Usage: python scripts/gpu_graph_launch.py   (GPU only; prints a table)
"""

from __future__ import annotations

import statistics
import time

import torch


def graphs_of(x: torch.Tensor, total: int, parts: int) -> list[torch.cuda.CUDAGraph]:
    out = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(parts):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(total // parts):
                    x.mul_(1.0001)
            out.append(g)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return out


def timed(replay, reps: int = 50) -> tuple[float, float]:
    """Median µs the call holds the host, and of the call and the device's work after it (the
    device idle before each)."""
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return statistics.median(host) * 1e6, statistics.median(wall) * 1e6


def main() -> None:
    x = torch.zeros(1 << 16, device="cuda")
    for total in (160, 470):
        for parts in (1, 2, 4, 8):
            gs = graphs_of(x, total, parts)
            host, wall = timed(lambda: [g.replay() for g in gs])
            print(f"{total} kernels in {parts} graphs: launch holds the host {host:.0f} us; launch + run {wall:.0f} us")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(total):
            x.mul_(1.0001)
        end.record()
        torch.cuda.synchronize()
        print(f"{total} kernels eager: GPU {start.elapsed_time(end) * 1e3:.0f} us")


if __name__ == "__main__":
    main()
