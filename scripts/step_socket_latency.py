"""What one step costs on the step socket, beyond the worker's own time, and what busy polling
(``splitspec.transport.busypoll``) changes.

A worker process serves VerifyRequest -> VerifyResponse on a real ``StepSocketServer``; its
step holds the loop's thread for ``hold`` µs (as an inline step waits for the GPU) and answers
with ``reply`` bytes of features. The client sends a step, reads the answer, then sleeps
``gap`` µs on its loop (as the gateway waits for the other worker) before the next. Overhead =
round trip - hold, median over ``--steps`` steps. ``gap`` > 0 lets the worker fall asleep
between steps; ``hold`` > 0 lets the client fall asleep while it waits.

Usage: python scripts/step_socket_latency.py [--spins 0,20000] [--steps 300]   (CPU only)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from splitspec.transport import busypoll
from splitspec.transport.stepwire import StepSocket, StepSocketServer
from splitspec.v1 import common_pb2, target_pb2

CASES = [(0, 0), (6000, 0), (0, 2000), (6000, 2000)]  # (hold, gap) µs
REPLIES = [0, 7 * 5 * 4096 * 2]  # a decode step; a budget-22 step accepting 7 rows of 5 bf16 taps


async def serve(path: str, hold_us: int, reply: int) -> None:
    response = target_pb2.VerifyResponse(
        committed_tokens=[1], next_token=2, committed_length=3,
        features=common_pb2.Tensor(dtype="bfloat16", shape=[reply // 2], data=bytes(reply)) if reply else None,
    )

    async def step(request, context):
        end = time.perf_counter() + hold_us / 1e6
        while time.perf_counter() < end:
            pass
        return response

    server = StepSocketServer(path, "probe", "Verify", target_pb2.VerifyRequest, step)
    await server.start()
    await asyncio.Event().wait()


def worker(path: str, hold_us: int, reply: int, spin_us: int) -> None:
    busypoll.run(serve(path, hold_us, reply), spin_us)


async def client(path: str, gap_us: int, steps: int) -> list[float]:
    sock = StepSocket(path, target_pb2.VerifyResponse)
    request = target_pb2.VerifyRequest(sequence_id="s", tokens=list(range(22)), parents=list(range(-1, 21)), return_features=True)
    while True:  # the worker is up once a step answers
        try:
            await sock.step(request, 1.0)
            break
        except Exception:  # noqa: BLE001 - not listening yet
            await asyncio.sleep(0.05)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        await sock.step(request, 5.0)
        times.append(time.perf_counter() - t0)
        if gap_us:
            await asyncio.sleep(gap_us / 1e6)
    sock.close()
    return times[10:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spins", default="0,20000", help="busy-poll µs to compare (both processes), comma-separated")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"cpus {os.cpu_count()}; overhead = round trip - hold, median µs (p90)")
    print("spin_us reply_bytes " + " ".join(f"hold{h}/gap{g}" for h, g in CASES))
    for spin in (int(s) for s in args.spins.split(",")):
        for reply in REPLIES:
            row = []
            for hold, gap in CASES:
                path = os.path.join(tempfile.mkdtemp(), "probe.steps")
                proc = ctx.Process(target=worker, args=(path, hold, reply, spin), daemon=True)
                proc.start()
                try:
                    times = busypoll.run(client(path, gap, args.steps), spin)
                finally:
                    proc.kill()
                    proc.join()
                over = sorted((t * 1e6 - hold) for t in times)
                row.append(f"{statistics.median(over):.0f} ({over[int(0.9 * len(over))]:.0f})")
            print(f"{spin} {reply} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
