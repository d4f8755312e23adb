"""How the workers' batchers group many speculating users, with the model and the GPU replaced by
timers (issue #18; a scheduling study, no torch): passes per round and the round's length.

The real ``StepBatcher`` of each worker (the target's staged, the draft's not) runs over a
stand-in engine whose passes take the given times on one simulated device shared by both workers
as one GPU is: time-sliced (``--device shared``, the default: a pass of each process at once, each
at half speed, as two CUDA contexts take turns on one GPU; BENCHMARKS.md [R7] saw the draft's
passes run inside the target's) or one pass after another (``fifo``). Both keep the total work. Each
user loops: Propose (the draft's batcher), its gateway's work, Verify (the target's), its gateway's
work again; a gateway handles its users' steps one at a time (on a thread of its own), as one
process's event loop does. Host work is slept, not spent, and every time runs ``--scale`` times
slower than given (reported unscaled): on the 2-core CPU, at real speed, the thread hand-offs of
the 40-odd threads and coroutines took as long as the gateways' work and split the users into
cohorts of 1-10 that no GPU run showed (BENCHMARKS.md [M1]).

Pass times, ms: target ``--target-ms + --target-row-ms * rows`` (rows: ``--budget + 1`` a user;
BENCHMARKS.md [B10]: 9.58 ms at 32 rows, 14.33 at 272 on an H100), draft ``--draft-ms +
--draft-user-ms * users`` ([D6]: 2.92 at 12, 3.69 at 16, 5.44 at 32). The ideal round of two
cohorts is two passes of each kind back to back; the report gives it beside the measured one.

Usage: python scripts/batching_sim.py [--users 32] [--gateways 2] [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from services.worker.batching import StepBatcher
from services.worker.hosting import EngineHost, SequenceTable


class Device:
    """One GPU: jobs run one after another, each for its time."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_s = 0.0
        self.log: list[tuple[float, float, float, str]] = []  # (queued, start, end, label) of each job
        threading.Thread(target=self._run, daemon=True, name="device").start()

    def submit(self, seconds: float, label: str = "") -> threading.Event:
        done = threading.Event()
        self.jobs.put((seconds, done, label, time.perf_counter()))
        return done

    def _run(self) -> None:
        while True:
            seconds, done, label, queued = self.jobs.get()
            start = time.perf_counter()
            end = start + seconds
            self.log.append((queued, start, end, label))
            while (left := end - time.perf_counter()) > 0:
                time.sleep(min(left, 0.0005))
            self.busy_s += seconds
            done.set()


class SharedDevice(Device):
    """One GPU time-sliced between processes, as two CUDA contexts share one without MPS: each
    process's jobs run in order (its stream), and the jobs at the head of two processes' queues
    share the device equally, each at half speed (slices finer than a pass), so the total work is
    kept. A job's label's first letter names its process."""

    def __init__(self) -> None:
        self.queues: dict[str, list[list]] = {}  # process -> its jobs [left, done, label, queued, start]
        self.wake = threading.Condition()
        self.busy_s = 0.0
        self.log: list[tuple[float, float, float, str]] = []
        threading.Thread(target=self._run, daemon=True, name="device").start()

    def submit(self, seconds: float, label: str = "") -> threading.Event:
        done = threading.Event()
        with self.wake:
            jobs = self.queues.setdefault(label[:1], [])
            jobs.append([seconds, done, label, time.perf_counter(), time.perf_counter() if not jobs else None])
            self.wake.notify()
        return done

    def _run(self) -> None:
        last = time.perf_counter()
        while True:
            with self.wake:
                while not any(self.queues.values()):
                    self.wake.wait()
                    last = time.perf_counter()  # idle time does no work
                now = time.perf_counter()
                heads = [jobs[0] for jobs in self.queues.values() if jobs]
                self.busy_s += now - last
                for job in heads:
                    job[0] -= (now - last) / len(heads)
                last = now
                for jobs in self.queues.values():
                    if jobs and jobs[0][0] <= 0:
                        _, done, label, queued, start = jobs.pop(0)
                        self.log.append((queued, start, now, label))
                        done.set()
                        if jobs:
                            jobs[0][4] = now
                busy = [jobs[0][0] for jobs in self.queues.values() if jobs]  # work left of each head job
                soonest = min(busy, default=0.0) * len(busy)  # until the first of them ends, at 1 / len(busy) speed
            time.sleep(min(max(soonest, 0.0), 0.0005))


class StandIn:
    """An engine of ``users`` live sequences ("u0", ...) whose passes go to ``device``."""

    def __init__(self, device: Device, users: int, args) -> None:
        self.device, self.args = device, args
        self.sequences = SequenceTable()
        for u in range(users):
            self.sequences.add(f"u{u}", object())
        self.passes: list[int] = []  # users a pass

    def _run(self, kind: str, items: list, seconds: float) -> threading.Event:
        self.passes.append(len(items))
        return self.device.submit(seconds, f"{kind} " + ",".join(sorted(i[1:] for i in items)))


class TargetStandIn(StandIn):
    """A staged engine (``StagedEngine``) whose pass is host work, then device time by its rows."""

    def prepare_pass(self, items: list, busy: frozenset[str]):
        time.sleep(self.args.target_prepare_ms / 1e3)
        rows = sum(self.args.budget + 1 for _ in items)
        return SimpleNamespace(items=items, seconds=(self.args.target_ms + self.args.target_row_ms * rows) / 1e3, done=None)

    def launch_pass(self, p, ahead: bool = False) -> None:
        p.done = self._run("T", p.items, p.seconds)

    def pass_running(self, p) -> bool:
        return not p.done.is_set()

    def wait_pass(self, p) -> None:
        p.done.wait()

    def settle_pass(self, p) -> None:
        p.done.wait()

    def finish_pass(self, p) -> list:
        time.sleep(self.args.target_finish_ms / 1e3)
        return [None] * len(p.items)


class DraftStandIn(StandIn):
    """The draft's engine: one pass at a time, host work around its device time."""

    def propose_batch(self, items: list) -> list:
        time.sleep(self.args.draft_host_ms / 2e3)
        self._run("D", items, (self.args.draft_ms + self.args.draft_user_ms * len(items)) / 1e3).wait()
        time.sleep(self.args.draft_host_ms / 2e3)
        return [None] * len(items)


async def simulate(args) -> dict:
    device = SharedDevice() if args.device == "shared" else Device()
    target_host, draft_host = EngineHost("target"), EngineHost("draft")
    target, draft = TargetStandIn(device, args.users, args), DraftStandIn(device, args.users, args)
    target_host.attach(target, None)
    draft_host.attach(draft, None)
    gather = args.max_gather_ms / 1e3
    verifier = StepBatcher(target_host, lambda e, items: None, key=lambda item: item, staged=True, max_gather_s=gather)
    proposer = StepBatcher(draft_host, lambda e, items: e.propose_batch(items), key=lambda item: item, max_gather_s=gather)
    # A gateway is a process of its own: its work runs on a thread of its own, one step at a time.
    gateways = [ThreadPoolExecutor(max_workers=1) for _ in range(args.gateways)]
    rounds: list[float] = []
    hop = args.hop_ms / 1e3

    async def gateway_work(g: int) -> None:
        await asyncio.get_running_loop().run_in_executor(gateways[g], time.sleep, args.gateway_ms / 1e3)

    async def user(u: int) -> None:
        sid, g = f"u{u}", u % args.gateways
        await asyncio.sleep(u * 0.0002)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            await asyncio.sleep(hop)
            await proposer.submit(sid)
            await asyncio.sleep(hop)
            await gateway_work(g)
            await asyncio.sleep(hop)
            await verifier.submit(sid)
            await asyncio.sleep(hop)
            await gateway_work(g)
            if r >= args.warm_up:
                rounds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(args.users)))
    wall = time.perf_counter() - t0
    for pool in [target_host.executor, draft_host.executor, *gateways]:
        pool.shutdown()
    if args.trace:
        base = min(start for _, start, _, _ in device.log)
        last_end = None  # of every job started before (time-sliced jobs overlap)
        for queued, start, end, label in sorted(device.log[-args.trace:], key=lambda job: job[1]):
            idle = "" if last_end is None else f"idle {1e3 * max(0.0, start - last_end) / args.scale:5.2f}"
            last_end = end if last_end is None else max(last_end, end)
            print(f"{1e3 * (start - base) / args.scale:9.2f} {1e3 * (end - start) / args.scale:6.2f} queued {1e3 * (start - queued) / args.scale:5.2f} {idle:10} {label}")
    return {
        "round_ms": 1e3 * statistics.median(rounds), "target_passes": target.passes, "draft_passes": draft.passes,
        "device_busy": device.busy_s / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warm-up", type=int, default=5)
    p.add_argument("--budget", type=int, default=12)
    p.add_argument("--target-ms", type=float, default=9.0)
    p.add_argument("--target-row-ms", type=float, default=0.0185)
    p.add_argument("--target-prepare-ms", type=float, default=1.5)
    p.add_argument("--target-finish-ms", type=float, default=0.8)
    p.add_argument("--draft-ms", type=float, default=2.0)
    p.add_argument("--draft-user-ms", type=float, default=0.1)
    p.add_argument("--draft-host-ms", type=float, default=1.0)
    p.add_argument("--gateway-ms", type=float, default=0.3, help="a gateway's work a user step (tree build, requests)")
    p.add_argument("--hop-ms", type=float, default=0.1, help="one message between processes")
    p.add_argument("--device", choices=("shared", "fifo"), default="shared",
                   help="the GPU time-sliced between the two workers' processes (shared), or their passes one after another (fifo)")
    p.add_argument("--trace", type=int, default=0, help="print the device's last this many jobs (by start: start, ms, queued, idle before)")
    p.add_argument("--max-gather-ms", type=float, default=4.0, help="the batchers' max_gather_s, ms")
    p.add_argument("--scale", type=float, default=4.0, help="every time above times this (slower than real, so that thread hand-offs matter less); reported unscaled")
    args = p.parse_args()
    half = args.users / 2
    ideal = 2 * (args.target_ms + args.target_row_ms * half * (args.budget + 1)) + 2 * (args.draft_ms + args.draft_user_ms * half)
    for name in ("target_ms", "target_row_ms", "target_prepare_ms", "target_finish_ms", "draft_ms", "draft_user_ms", "draft_host_ms", "gateway_ms", "hop_ms", "max_gather_ms"):
        setattr(args, name, getattr(args, name) * args.scale)
    out = asyncio.run(simulate(args))
    out["round_ms"] /= args.scale
    for kind in ("target", "draft"):
        sizes = out[f"{kind}_passes"]
        print(f"{kind} passes: {len(sizes)}, users a pass mean {statistics.mean(sizes):.1f}; "
              f"sizes most seen {Counter(sizes).most_common(6)}")
    per_round = len(out["target_passes"]) / args.rounds
    print(f"round {out['round_ms']:.2f} ms (median), two cohorts back to back {ideal:.2f} ms; target passes a round {per_round:.2f}; "
          f"device busy {out['device_busy']:.0%}")


if __name__ == "__main__":
    main()
