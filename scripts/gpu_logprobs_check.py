"""Logprobs of the target on a GPU, graphed path included: through `splitspec serve` (built-in pair),
every mode's tokens and logprobs against target-only decoding and against the target run directly.

Usage (on a CUDA/ROCm machine): python3 scripts/gpu_logprobs_check.py [--device cuda:0] [--dtype float32]
Prints one line per mode and prompt, and PASS or FAIL.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile

import grpc
import torch

from splitspec.builtin import builtin_pair
from splitspec.cli.serve import wait_ready
from splitspec.models.devices import DTYPES
from splitspec.models.loader import load_target
from splitspec.text.tokenizer import Tokenizer
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc

Spec = gateway_pb2.Speculation
MODES = [("off", Spec(mode=Spec.OFF)), ("chain-16", Spec(mode=Spec.CHAIN, budget=16)), ("ddtree-22", Spec(mode=Spec.DDTREE, budget=22))]
PROMPTS = ["def fib(n):", "import os\n\n\ndef main(", "class Stack:\n    def __init__(self):"]
# Logprobs are exact up to the rounding of the logits they come from: a tree pass and a one-token
# pass round differently, so a bfloat16 logit of magnitude ~10-20 moves by some 0.05.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}


def run(address: str, prompt: str, spec) -> tuple[list[int], list]:
    with grpc.insecure_channel(address) as ch:
        request = gateway_pb2.GenerateRequest(
            text=prompt, max_tokens=64, ignore_eos=True, speculation=spec, logprobs=True, top_logprobs=5
        )
        tokens, logprobs = [], []
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=300):
            tokens.extend(r.token_ids)
            logprobs.extend(r.logprobs)
    return tokens, logprobs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    target, _ = builtin_pair()
    model, _ = load_target(target, args.device, DTYPES[args.dtype])
    tokenizer = Tokenizer.load(target)
    address = "127.0.0.1:50061"
    serve = subprocess.Popen([sys.executable, "-m", "splitspec", "serve", "--device", args.device, "--dtype", args.dtype,
                              "--listen", address, "--metrics-port", "0", "--http-listen", "", "--work-dir", tempfile.mkdtemp()])
    ok = True
    try:
        wait_ready(address, [serve], timeout=300)
        for prompt in PROMPTS:
            reference = None
            prompt_ids = tokenizer.encode(prompt)
            for name, spec in MODES:
                tokens, logprobs = run(address, prompt, spec)
                with torch.no_grad():  # the target run directly on prompt + output: row i predicts token i+1
                    ids = torch.tensor([prompt_ids + tokens], device=args.device)
                    logits = model.lm_head(model.forward_sequences(ids)[0]).double()
                    direct = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], -1)
                    expected = direct.gather(1, torch.tensor(tokens, device=args.device)[:, None])[:, 0].cpu()
                got = torch.tensor([lp.logprob for lp in logprobs], dtype=torch.float64)
                aligned = len(logprobs) == len(tokens) and all(lp.id == t for lp, t in zip(logprobs, tokens))
                error = (got - expected).abs().max().item() if aligned else float("inf")
                reference = reference or (tokens, got)
                same = tokens == reference[0]
                vs_off = (got - reference[1]).abs().max().item() if same else float("inf")
                passed = aligned and same and error < TOLERANCE[args.dtype] and vs_off < TOLERANCE[args.dtype] and all(len(lp.top) == 5 for lp in logprobs)
                ok &= passed
                print(f"{'PASS' if passed else 'FAIL'} {args.dtype} {name:10s} {prompt[:16]!r:20s} tokens identical={same} "
                      f"max |logprob - direct| {error:.2e}, vs off {vs_off:.2e}", flush=True)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
