"""What one step costs on the step socket, beyond the worker's own time, and what busy polling
(``splitspec.transport.busypoll``) changes.

A worker process serves VerifyRequest -> VerifyResponse on a real ``StepSocketServer``; its
step holds the loop's thread for ``hold`` µs (as an inline step waits for the GPU) and answers
with ``reply`` bytes of features, built each step as the target builds them: encoded into the
message (``tensor_to_pb``, the gRPC answer) or spliced in by reference (``TensorSpliced``, the step
socket's since 7debc2d; ``--answers``). The client sends a step, reads the answer, then sleeps
``gap`` µs on its loop (as the gateway waits for the other worker) before the next. Overhead =
round trip - hold, median over ``--steps`` steps. ``gap`` > 0 lets the worker fall asleep
between steps; ``hold`` > 0 lets the client fall asleep while it waits.

Usage: python scripts/step_socket_latency.py [--spins 0,20000] [--steps 300] [--answers encoded,spliced]   (CPU only)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from splitspec.transport import busypoll
from splitspec.transport.stepwire import StepSocket, StepSocketServer
from splitspec.transport.tensors import TensorSpliced, tensor_to_pb
from splitspec.v1 import target_pb2

CASES = [(0, 0), (6000, 0), (0, 2000), (6000, 2000)]  # (hold, gap) µs
ROW = 5 * 4096 * 2  # one row of the 8B shape's 5 bf16 taps
REPLIES = [0, ROW, 7 * ROW]  # a decode step; a step accepting 1 row and 7 rows


async def serve(path: str, hold_us: int, reply: int, answer: str) -> None:
    import torch

    features = torch.zeros(reply // ROW, ROW // 2, dtype=torch.bfloat16) if reply else None

    async def step(request, context):
        end = time.perf_counter() + hold_us / 1e6
        while time.perf_counter() < end:
            pass
        response = target_pb2.VerifyResponse(committed_tokens=[1], next_token=2, committed_length=3)
        if features is None:
            return response
        if answer == "spliced":
            return TensorSpliced(response, "features", features)
        response.features.CopyFrom(tensor_to_pb(features))
        return response

    server = StepSocketServer(path, "probe", "Verify", target_pb2.VerifyRequest, step)
    await server.start()
    await asyncio.Event().wait()


def worker(path: str, hold_us: int, reply: int, spin_us: int, answer: str) -> None:
    busypoll.run(spinning(serve(path, hold_us, reply, answer), spin_us))


async def spinning(main, spin_us: int):
    """``main`` on a loop that busy-polls ``spin_us`` µs (0: off), as a service's ``--busy-poll``."""
    busypoll.configure(str(spin_us) if spin_us else "off", True, "probe")
    return await main


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
    p.add_argument("--answers", default="encoded,spliced", help="how the features go into the answer, comma-separated: encoded, spliced")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"cpus {os.cpu_count()}; overhead = round trip - hold, median µs (p90)")
    print("spin_us answer reply_bytes " + " ".join(f"hold{h}/gap{g}" for h, g in CASES))
    for spin, answer, reply in itertools.product((int(s) for s in args.spins.split(",")), args.answers.split(","), REPLIES):
        if reply or answer == "encoded":  # no features: the same answer either way
            row = []
            for hold, gap in CASES:
                path = os.path.join(tempfile.mkdtemp(), "probe.steps")
                proc = ctx.Process(target=worker, args=(path, hold, reply, spin, answer), daemon=True)
                proc.start()
                try:
                    times = busypoll.run(spinning(client(path, gap, args.steps), spin))
                finally:
                    proc.kill()
                    proc.join()
                over = sorted((t * 1e6 - hold) for t in times)
                row.append(f"{statistics.median(over):.0f} ({over[int(0.9 * len(over))]:.0f})")
            print(f"{spin} {answer} {reply} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
