"""Round-trip cost of a verify step on each gateway wire (unary call, per-sequence stream, step socket).

Usage (CPU: about a minute; GPU: a few minutes, most of it drawing the random weights):
    python3 scripts/wire_overhead.py                                   # random:tiny on the CPU
    python3 scripts/wire_overhead.py --device cuda:0                   # random:qwen3-8b on a GPU
    python3 scripts/wire_overhead.py --device cuda:0 --accept 6 --steps 200 --rounds 5
Writes $OUT/wire_overhead.json when OUT is set; the last line is PASS or FAIL.

It starts a real target worker (``splitspec target``, random weights of a real shape) on a Unix
socket and on loopback TCP, and drives it through the gateway's own ``TargetClient`` (with the
gateway's metrics interceptor) on each wire (the step socket on the Unix transport only). Each round runs one sequence per wire, in turns: a
prefill with tap features, then ``--steps`` verify steps, each a chain of ``--budget`` nodes whose
first ``--accept - 1`` tokens are the target's own greedy continuation (recorded first, step by
step), so every step commits ``--accept`` tokens and returns their tap features, as a speculating
sequence at that acceptance length would. The overhead of a step is its wall time at the client
minus the forward time the target reports: serialization, the transport, the worker's gRPC and
event loop, the hop to its engine thread and back.

PASS: every wire committed exactly the recorded continuation (the wire changes nothing but time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from services.gateway.workers import TargetClient
from services.metrics import GatewayMetrics
from splitspec.bench.random_weights import DRAFT_LAYERS, random_target_config
from splitspec.cli.serve import wait_ready
from splitspec.models.dflash import default_target_layer_ids
from splitspec.v1 import target_pb2

PROMPT_LEN = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="target device (cpu or cuda:N)")
    p.add_argument("--model", default="", help="target (default: random:tiny on a CPU, random:qwen3-8b on a GPU)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", type=int, default=100, help="verify steps per sequence")
    p.add_argument("--rounds", type=int, default=3, help="sequences per wire and transport, taking turns")
    p.add_argument("--budget", type=int, default=22, help="tree nodes per step")
    p.add_argument("--accept", type=int, default=1, help="tokens each step commits (1 = an AR step)")
    p.add_argument("--feature-dtype", default="bfloat16", help="wire dtype of the tap features ('' = the target's)")
    p.add_argument("--transports", default="unix,tcp", help="comma-separated: unix, tcp")
    return p.parse_args()


def chain(reference: list[int], position: int, budget: int, accept: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``budget`` chained nodes after the root at ``position``: the next ``accept - 1`` reference
    tokens, then tokens that differ from the reference (rejected)."""
    truth = reference[position + 1 : position + budget + 1]
    tokens = [t if i < accept - 1 else (t + 1) % vocab for i, t in enumerate(truth)]
    return np.array(tokens, dtype=np.int32), np.arange(len(tokens), dtype=np.int32)


async def run_sequence(client: TargetClient, sid: str, prompt: list[int], reference: list[int], args, taps, vocab: int):
    """Prefill then ``args.steps`` steps; returns (committed tokens, [(wall_ns, forward_ns)] per step)."""
    reserve = PROMPT_LEN + args.steps * args.accept + args.budget + 2
    request = target_pb2.PrefillRequest(
        sequence_id=sid, tokens=prompt, reserve_tokens=reserve, tap_layer_ids=taps, feature_dtype=args.feature_dtype
    )
    first = await client.prefill(request, timeout=600)
    committed, timings = [first.next_token], []
    for _ in range(args.steps):
        position = len(prompt) + len(committed) - 1  # of the root, the pending token
        tokens, parents = chain(reference, position, args.budget, args.accept, vocab) if reference else (np.zeros(0, np.int32),) * 2
        t0 = time.perf_counter_ns()
        v = await client.verify(sid, tokens, parents, True, timeout=600)
        timings.append((time.perf_counter_ns() - t0, v.forward_ns))
        committed += v.committed_tokens[1:] + [v.next_token]
    await client.release(sid)
    return committed, timings


async def measure(address: str, transport: str, args, taps, vocab: int) -> tuple[dict, bool]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, PROMPT_LEN).tolist()
    recorder = TargetClient(address, wire="unary")
    # The greedy continuation, one token per step: what every chain draws its accepted tokens from.
    ar = argparse.Namespace(**{**vars(args), "steps": args.steps * args.accept + args.budget, "accept": 1})
    continuation, _ = await run_sequence(recorder, f"{transport}-record", prompt, [], ar, taps, vocab)
    reference = prompt + continuation
    wires = ("unary", "stream", "socket") if transport == "unix" else ("unary", "stream")
    clients = {wire: TargetClient(address, observer=GatewayMetrics().interceptor(), wire=wire) for wire in wires}
    if "socket" in clients:
        await clients["socket"].offer_step_socket((await recorder.info(timeout=10)).step_socket)
    timings = {wire: [] for wire in wires}
    exact = True
    for r in range(args.rounds):
        for wire, client in clients.items():
            committed, steps = await run_sequence(client, f"{transport}-{wire}-{r}", prompt, reference, args, taps, vocab)
            exact &= committed == reference[PROMPT_LEN : PROMPT_LEN + len(committed)]
            timings[wire] += steps
    for client in [recorder, *clients.values()]:
        await client.close()
    rows = {}
    for wire, steps in timings.items():
        wall = [w / 1e6 for w, _ in steps]
        forward = [f / 1e6 for _, f in steps]
        overhead = sorted(w - f for w, f in zip(wall, forward))
        rows[wire] = {
            "steps": len(steps), "wall_ms": statistics.median(wall), "forward_ms": statistics.median(forward),
            "overhead_ms": statistics.median(overhead), "overhead_mean_ms": statistics.fmean(overhead),
            "overhead_p90_ms": overhead[int(0.9 * (len(overhead) - 1))],
        }
    return rows, exact


def start_target(args, address: str, log: Path) -> subprocess.Popen:
    service = ["splitspec.bench.workers", "random-target"] if args.model.startswith("random:") else ["splitspec", "target"]
    cmd = [sys.executable, "-m", *service, "--model", args.model, "--device", args.device, "--dtype", args.dtype,
           "--listen", address, "--metrics-port", "0", *(["--threads", "1"] if args.device == "cpu" else [])]  # the client needs a core too
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_ready(address, [proc], 900)
    return proc


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def main() -> int:
    args = parse_args()
    args.model = args.model or ("random:tiny" if args.device == "cpu" else "random:qwen3-8b")
    config = random_target_config(args.model) if args.model.startswith("random:") else None
    if config is None:
        from splitspec.models.loader import read_target_config

        config = read_target_config(args.model)
    taps = default_target_layer_ids(config.num_layers, DRAFT_LAYERS)
    work = Path(tempfile.mkdtemp(prefix="wire-"))
    results, exact = {}, True
    for transport in args.transports.split(","):
        address = f"unix:{work / 'target.sock'}" if transport == "unix" else free_tcp_address()
        proc = start_target(args, address, work / f"target-{transport}.log")
        try:
            results[transport], ok = asyncio.run(measure(address, transport, args, taps, config.vocab_size))
            exact &= ok
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    print(f"\nverify steps of {args.model} on {args.device}: budget {args.budget}, {args.accept} token(s) committed per step, "
          f"taps {taps} in {args.feature_dtype or 'the compute dtype'}; medians over {args.rounds} x {args.steps} steps per wire\n")
    print("| transport | wire | wall ms/step | forward ms/step | overhead ms/step (median / mean / p90) | overhead vs unary |")
    print("|---|---|---|---|---|---|")
    for transport, rows in results.items():
        for wire in rows:
            r, base = rows[wire], rows["unary"]["overhead_ms"]
            versus = "" if wire == "unary" else f"{r['overhead_ms'] - base:+.3f} ms ({100 * (r['overhead_ms'] / base - 1):+.0f}%)"
            print(f"| {transport} | {wire} | {r['wall_ms']:.3f} | {r['forward_ms']:.3f} | {r['overhead_ms']:.3f} / "
                  f"{r['overhead_mean_ms']:.3f} / {r['overhead_p90_ms']:.3f} | {versus} |")
    report = {"args": vars(args), "taps": taps, "results": results, "exact": exact}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "wire_overhead.json").write_text(json.dumps(report, indent=1))
    print("PASS: every wire committed the target's own continuation" if exact else "FAIL: a wire committed other tokens")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
