"""Check and time Gated DeltaNet prefill by flash-linear-attention's chunked kernel against our torch
chunked form and the sequential reference (issue #17: Qwen3.5-27B Q4_K_M prefill at 512 tokens).

On the GPU machine (no network), from the repository root, with .whl/fla carried along (it is
git-ignored, so name it in the run's carry list). The image already has torch, triton and einops;
fla-core is the package of fla's ops (flash_linear_attention-*.whl, its layers and models, is not
needed), einops is carried in case an image lacks it:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla/fla_core-0.6.0-py3-none-any.whl .whl/fla/einops-0.8.2-py3-none-any.whl
    PYTHONPATH=/tmp/site python3 scripts/gpu_delta_prefill.py [--device cuda:0] [--lengths 512 2048] [--reps 20]

About a minute (fla autotunes each kernel once per dtype on its first call). Writes
$OUT/delta_prefill.json when OUT is set; the last line is PASS or FAIL.

One Gated DeltaNet layer at the Qwen3.5-27B geometry (splitspec.bench.random_weights.QWEN35_27B:
48 value heads over 16 key heads, Dk = Dv = 128; 48 of its 64 layers are Gated DeltaNet) with a
nonzero state before the prefill, T = 512 and 2048 rows, inputs in float32 (what the model passes:
it computes the delta rule in float32) and in bfloat16:

1. Errors against the sequential recurrence in float64 (delta_rule.gated_delta_tree over a chain,
   fed the same rounded inputs): max abs error of the outputs and of the final state, and each
   relative to the reference's max abs value; also fla against our torch chunked form.
2. Time per layer call (CUDA events around each call, median of --reps after warm-up) of:
   ``torch``: native.chunked_delta_rule.chunk_prefill on the torch path (delta_rule.gated_delta_chunked);
   ``fla``: chunk_prefill on the fla path, layout conversions included (q/k at 48 heads, as the model
   passes them); ``fla-gva``: fla's kernel called directly with q/k at their 16 key heads (what passing
   the heads unrepeated would save). Then what 48 layers cost at each length, and the tokens per
   second that alone would allow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: native/, splitspec/

from native.chunked_delta_rule import ENV, chunk_prefill, fla_kernel  # noqa: E402
from splitspec.models.delta_rule import chain_parents, gated_delta_chunked, gated_delta_tree, l2_normalize  # noqa: E402

VALUE_HEADS, KEY_HEADS, DK, DV = 48, 16, 128, 128  # Qwen3.5-27B's Gated DeltaNet layer
GDN_LAYERS = 48  # of 64: every fourth layer is full attention
TARGET_TOK_S, TARGET_T = 5000, 512  # issue #17's goal for the whole model's prefill
# Pass marks: max abs error relative to the reference's max abs value. fla's products run on
# tensor cores (tf32 for float32 inputs), bfloat16 inputs round q, k, v and its per-chunk states.
TOLERANCE = {("torch", torch.float32): 1e-4, ("fla", torch.float32): 1e-2, ("torch", torch.bfloat16): 1e-4, ("fla", torch.bfloat16): 5e-2}
REFERENCE_SEGMENT = 256  # rows per gated_delta_tree call: it keeps every row's float64 state


def layer_inputs(rows: int, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """float32 inputs of one layer's prefill as GatedDeltaNet.forward makes them: q and k L2-normalised
    per key head (q scaled by Dk ** -0.5), then repeated to the value heads; g = -A softplus(a + dt_bias)
    with A in [1, 16] and dt_bias for a step of 1e-3 .. 1e-1 (Mamba's initialisation); beta a sigmoid.
    ``q16``/``k16`` are the key heads before the repeat."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, generator=gen, device=device)

    group = VALUE_HEADS // KEY_HEADS
    q16 = l2_normalize(randn(rows, KEY_HEADS, DK)) * DK**-0.5
    k16 = l2_normalize(randn(rows, KEY_HEADS, DK))
    dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1), VALUE_HEADS))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    g = -uniform(1.0, 16.0, VALUE_HEADS) * F.softplus(randn(rows, VALUE_HEADS) + dt_bias)
    return {
        "q": q16.repeat_interleave(group, 1), "k": k16.repeat_interleave(group, 1), "q16": q16, "k16": k16,
        "v": randn(rows, VALUE_HEADS, DV), "g": g, "beta": torch.sigmoid(randn(rows, VALUE_HEADS)),
        "state": 0.5 * randn(VALUE_HEADS, DK, DV),
    }


def in_dtype(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """q, k, v and beta in ``dtype`` (as a bfloat16 model would hand them over); g and the state stay float32."""
    return {name: x.to(dtype) if name in ("q", "k", "q16", "k16", "v", "beta") else x for name, x in inputs.items()}


def sequential_reference(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-token recurrence in float64 over the chain, in segments (each continues from the
    previous one's last state): outputs [T, H, Dv] and the final state [H, Dk, Dv]."""
    q, k, v, g, beta = (x[name].double() for name in ("q", "k", "v", "g", "beta"))
    state, outs = x["state"].double(), []
    for begin in range(0, v.shape[0], REFERENCE_SEGMENT):
        sl = slice(begin, begin + REFERENCE_SEGMENT)
        out, states = gated_delta_tree(q[sl], k[sl], v[sl], g[sl], beta[sl], state, chain_parents(v[sl].shape[0], v.device), torch.float64)
        outs.append(out)
        state = states[-1].clone()
        del states
    return torch.cat(outs), state


def with_backend(name: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_prefill with SPLITSPEC_DELTA_PREFILL=name."""
    os.environ[ENV] = name
    return chunk_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], fallback=gated_delta_chunked)


def fla_gva(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's kernel on the 16 key heads (value head h reads key head h // 3, repeat_interleave's order)."""
    kernel = fla_kernel()[0]
    dtype = x["v"].dtype
    out, final = kernel(
        x["q16"][None], x["k16"][None], x["v"][None], x["g"][None], x["beta"].to(dtype)[None],
        scale=1.0, initial_state=x["state"][None], output_final_state=True,
    )
    return out[0].float(), final[0]


def errors(out, final, ref_out, ref_final) -> dict[str, float]:
    out_abs = (out.double() - ref_out.double()).abs().max().item()
    state_abs = (final.double() - ref_final.double()).abs().max().item()
    return {
        "out_abs": out_abs, "out_rel": out_abs / ref_out.abs().max().item(),
        "state_abs": state_abs, "state_rel": state_abs / ref_final.abs().max().item(),
    }


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device (this script checks and times the GPU kernels)")
        return 1
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    kernel, why = fla_kernel()
    try:
        import fla

        fla_version = fla.__version__
    except ImportError:
        fla_version = None
    import triton

    print(f"device {torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton {triton.__version__}, "
          f"fla {fla_version or 'not importable: ' + why}")
    print(f"layer: {VALUE_HEADS} value heads / {KEY_HEADS} key heads, Dk = Dv = {DK}; {GDN_LAYERS} such layers per forward; "
          f"torch.backends.cuda.matmul.allow_tf32 = {torch.backends.cuda.matmul.allow_tf32}")
    paths = ["torch"] + (["fla", "fla-gva"] if kernel is not None else [])
    gen = torch.Generator(device=device).manual_seed(17)
    failures, results = [], []
    for rows in args.lengths:
        base = layer_inputs(rows, gen, device)
        for dtype in (torch.float32, torch.bfloat16):
            x = in_dtype(base, dtype)
            ref_out, ref_final = sequential_reference(x)
            runs = {
                "torch": lambda x=x: with_backend("torch", x),
                "fla": lambda x=x: with_backend("fla", x),
                "fla-gva": lambda x=x: fla_gva(x),
            }
            outputs = {}
            for path in paths:
                out, final = runs[path]()
                outputs[path] = (out, final)
                err = errors(out, final, ref_out, ref_final)
                if path == "fla-gva":  # the same kernel: it must give what the 48-head call gives, up to rounding
                    err["vs_fla_rel"] = errors(out, final, *outputs["fla"])["out_rel"]
                if path != "torch":
                    err["vs_torch_rel"] = errors(out, final, *outputs["torch"])["out_rel"]
                ms = timed(runs[path], args.reps)
                row = {"T": rows, "dtype": str(dtype).removeprefix("torch."), "path": path, "ms_per_layer": ms,
                       "ms_48_layers": ms * GDN_LAYERS, "gdn_only_tok_s": rows / (ms * GDN_LAYERS) * 1e3, **err}
                limit = TOLERANCE[("torch" if path == "torch" else "fla", dtype)]
                row["pass"] = bool(err["out_rel"] <= limit and err["state_rel"] <= limit)
                if not row["pass"]:
                    failures.append(f"{path} {row['dtype']} T={rows}: out_rel {err['out_rel']:.2e}, state_rel {err['state_rel']:.2e} > {limit:.0e}")
                results.append(row)
            del outputs
        os.environ.pop(ENV, None)

    header = f"{'T':>5} {'inputs':>8} {'path':>8} | {'ms/layer':>9} {'x48 ms':>8} {'GDN-only tok/s':>14} | {'out abs':>9} {'out rel':>9} {'state abs':>9} {'state rel':>9} {'vs torch':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        print(f"{r['T']:>5} {r['dtype']:>8} {r['path']:>8} | {r['ms_per_layer']:>9.3f} {r['ms_48_layers']:>8.1f} {r['gdn_only_tok_s']:>14,.0f} | "
              f"{r['out_abs']:>9.2e} {r['out_rel']:>9.2e} {r['state_abs']:>9.2e} {r['state_rel']:>9.2e} {r.get('vs_torch_rel', float('nan')):>9.2e}"
              + ("" if r["pass"] else "  FAIL"))
    budget_ms = TARGET_T / TARGET_TOK_S * 1e3
    print(f"\nGoal: {TARGET_TOK_S:,} tok/s at {TARGET_T} tokens = {budget_ms:.1f} ms for the whole forward (all 64 layers, matmuls included).")
    for r in results:
        if r["T"] == TARGET_T and r["dtype"] == "float32":
            print(f"  {r['path']:>8}: the {GDN_LAYERS} Gated DeltaNet layers' delta rule takes {r['ms_48_layers']:.1f} ms "
                  f"({r['ms_48_layers'] / budget_ms:.0%} of that budget)")
    if kernel is None:
        failures.append(f"fla is not importable ({why}): install the wheels as the docstring says")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "delta_prefill.json").write_text(json.dumps({"fla": fla_version, "results": results, "failures": failures}, indent=1))
    for failure in failures:
        print("FAIL:", failure)
    print("PASS" if not failures else "FAIL")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
