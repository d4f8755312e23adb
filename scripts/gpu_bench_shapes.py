"""GPU check and component timings of the quantized and hybrid benchmark shapes.

Usage: python scripts/gpu_bench_shapes.py [--device cuda:0] [--shapes qwen3-8b-q4km,qwen35-27b-q4km,qwen35-27b]

1. Kernels in the random quantized models: the tiny ``-q4km`` shapes (dense and hybrid) in bfloat16
   give the same logits with the Triton kernels (``gguf_matmul`` in every QuantLinear,
   ``tree_delta_rule``) as with the torch references (``SPLITSPEC_NATIVE=0``), to bf16 tolerance.
2. ``splitspec bench --parts components`` for each shape, one process each (so each starts with
   an empty device), writing ``$OUT/components-SHAPE.json`` (or ./ without $OUT).

Prints PASS/FAIL per check and shape, the Markdown tables, and a JSON summary line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

TOLERANCE = 3e-2  # of the largest logit: bf16 weights, float32 accumulation in a different order


def kernel_check(shape: str, device: str) -> float:
    from splitspec.bench.random_weights import random_target

    model, _ = random_target(f"random:{shape}", device, torch.bfloat16)
    tokens = torch.tensor([3, 77, 150, 9, 400, 12], device=device)
    mask = torch.ones(6, 6, dtype=torch.bool, device=device).tril()
    logits = {}
    for native in ("1", "0"):
        os.environ["SPLITSPEC_NATIVE"] = native
        cache = model.new_cache(16, device, torch.bfloat16)
        logits[native] = model(tokens, torch.arange(6, device=device), cache, 0, mask)[0].float()
    os.environ.pop("SPLITSPEC_NATIVE")
    ours, expected = logits["1"], logits["0"]
    if not torch.isfinite(ours).all():
        return float("inf")
    return ((ours - expected).abs().max() / expected.abs().max()).item()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", default="qwen3-8b-q4km,qwen35-27b-q4km,qwen35-27b")
    p.add_argument("--iters", default="30", help="timed calls per component figure (bench --iters)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"kernels": {}, "components": {}}
    ok = True
    for shape in ("tiny-q4km", "tiny-qwen35-q4km"):
        error = kernel_check(shape, args.device)
        passed = error < TOLERANCE
        ok &= passed
        summary["kernels"][shape] = error
        print(f"{'PASS' if passed else 'FAIL'} kernels vs references, random:{shape} bf16: max error {error:.2e} of the largest logit", flush=True)
    for shape in args.shapes.split(","):
        path = out / f"components-{shape}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "splitspec", "bench", "--shape", shape, "--parts", "components", "--device", args.device,
             "--iters", args.iters, "--json", str(path)],
            capture_output=True, text=True,
        )
        passed = proc.returncode == 0
        ok &= passed
        print(proc.stdout if passed else proc.stderr[-3000:], flush=True)
        print(f"{'PASS' if passed else 'FAIL'} bench components random:{shape}", flush=True)
        if passed:
            comp = json.loads(path.read_text())["components"]
            summary["components"][shape] = {k: comp[k] for k in ("weight_bytes", "peak_bytes", "roofline_ms", "ar_ms", "verify_ms", "draft_ms")}
    print(json.dumps(summary))
    (out / "gpu_bench_shapes.json").write_text(json.dumps(summary, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
