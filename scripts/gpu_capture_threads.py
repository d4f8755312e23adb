"""Whether a CUDA graph capture survives another thread's CUDA calls (GPU check, issue #18).

The draft worker's servicer copies a prompt's feature rows into pinned memory on a thread of its
own (services/draft/server.py) while the engine thread may be capturing a block pass; the target's
watcher thread waits on events while its engine thread captures. In CUDA's "global" capture mode
a call such as cudaHostAlloc or cudaEventQuery on *any* thread during a capture invalidates it;
"thread_local" forbids them on the capturing thread only. This script captures a small pass many
times while a second thread keeps allocating pinned tensors (and copying from them), under each
mode, and counts the captures that failed and the pinned allocations that raised; then the same
through ``services.worker.cuda_graphs.capture``, the workers' own capture.

Usage: python3 scripts/gpu_capture_threads.py [--captures 50]
"""

from __future__ import annotations

import argparse
import threading

import torch

from services.worker.cuda_graphs import capture


def pinned_churn(stop: threading.Event, errors: list[str], count: list[int]) -> None:
    """Allocate pinned tensors of changing sizes and copy them to the device until ``stop``, as the
    draft's servicer does for each prompt (``services.draft.engine.pinned``)."""
    dev = torch.device("cuda:0")
    size = 1 << 16
    stream = torch.cuda.Stream(dev)
    while not stop.is_set():
        size = size * 3 % (1 << 24) + 4096  # new sizes, so the caching host allocator allocates
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                host.to(dev, non_blocking=True)
            count[0] += 1
        except RuntimeError as exc:
            errors.append(str(exc).splitlines()[0])


def run(mode: str | None, captures: int) -> tuple[int, int, int, str]:
    """(failed captures, pinned allocations, failed allocations, first error) with the churn thread
    running; ``mode`` None: through ``capture`` (the workers' path)."""
    dev = torch.device("cuda:0")
    # No random numbers: a capture that fails in "global" mode leaves torch's CUDA generator
    # expecting one ("Offset increment outside graph capture"), which the workers' passes never draw.
    x = torch.arange(1024 * 1024, device=dev, dtype=torch.float32).view(1024, 1024).remainder_(7).sub_(3)
    stop, errors, count = threading.Event(), [], [0]
    churn = threading.Thread(target=pinned_churn, args=(stop, errors, count), daemon=True)
    churn.start()
    failed, first = 0, ""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(dev)
    for _ in range(captures):
        compute = lambda: torch.relu(x @ x).sum(0)  # noqa: E731
        try:
            if mode is None:
                capture(compute, dev, pool)
            else:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    compute()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=mode):
                    compute()
                graph.replay()
        except RuntimeError as exc:
            failed += 1
            first = first or str(exc).splitlines()[0]
        torch.cuda.synchronize()
    stop.set()
    churn.join()
    return failed, count[0], len(errors), first or (errors[0] if errors else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--captures", type=int, default=50)
    args = p.parse_args()
    print("| capture mode | captures failed | pinned allocations beside them | of those failed | first error |")
    print("|---|---|---|---|---|")
    for mode in ("global", "thread_local", None):
        failed, allocs, alloc_failed, first = run(mode, args.captures)
        name = mode or "services.worker.cuda_graphs.capture"
        print(f"| {name} | {failed} / {args.captures} | {allocs} | {alloc_failed} | {first[:120]} |")


if __name__ == "__main__":
    main()
