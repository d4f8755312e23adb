"""Run the tiny pair through `splitspec serve` on a GPU and check every mode against target-only output.

Usage (on a CUDA/ROCm machine): python3 scripts/gpu_smoke.py --device cuda:0 [--dtype float32]
Prints one line per mode: identical to target-only or not, AL, and the gateway's time per step.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

from splitspec.cli.serve import wait_ready
from splitspec.v1 import gateway_pb2
from tests.client import generate

Spec = gateway_pb2.Speculation
MODES = [("off", Spec(mode=Spec.OFF)), ("chain-16", Spec(mode=Spec.CHAIN, budget=16)),
         ("ddtree-22", Spec(mode=Spec.DDTREE, budget=22)), ("ddtree-64", Spec(mode=Spec.DDTREE, budget=64))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--draft-device", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    work = tempfile.mkdtemp()
    address = "127.0.0.1:50051"
    serve = subprocess.Popen([sys.executable, "-m", "splitspec", "serve", "--device", args.device, "--draft-device",
                              args.draft_device, "--dtype", args.dtype, "--work-dir", work, "--listen", address])
    ok = True
    try:
        wait_ready(address, [serve], timeout=300)
        for label, sampling in [("greedy", {}), ("T=1 seed 7", {"temperature": 1.0, "seed": 7})]:
            reference = None
            for name, spec in MODES:
                generate(address, text="def fib(n):", max_tokens=8, ignore_eos=True, speculation=spec, timeout=300)  # warm-up
                t0 = time.perf_counter()
                out = generate(address, text="def fib(n):", max_tokens=args.max_tokens, ignore_eos=True, speculation=spec, timeout=300, **sampling)
                elapsed = time.perf_counter() - t0
                reference = reference or out.tokens
                same = out.tokens == reference
                ok &= same
                u = out.final.usage
                print(f"{args.device} {args.dtype} {label:11s} {name:10s} identical={same} AL={u.mean_acceptance_length:.2f} "
                      f"steps={u.steps} {1000 * elapsed / u.steps:.2f} ms/step {u.completion_tokens / elapsed:.1f} tok/s", flush=True)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
