"""The GGUF-block matmul kernels (native.gguf_matmul) against their torch reference, and a
model loaded with ``keep_quantized=True`` against the dequantized load.

Triton kernels run on the CPU only under the interpreter and ``SPLITSPEC_NATIVE_CPU=1``. The
kernel checks run in one subprocess with both set: this file, run as a script, prints every
check's result as JSON; the tests assert on them.

The interpreter's ``tl.dot`` mishandles bfloat16 (numpy has no bfloat16), so bfloat16 is checked
here on the M = 1 path only; ``scripts/gpu_gguf_matmul.py`` checks it on a GPU for every M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0; the CPU interpreter runs these)")

TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # every KERNEL_TYPES member
# (qtype, N, K, M, dtype): M = 1 takes the GEMV kernel, larger M ``tl.dot`` in tiles of 16 rows
# (M = 2, 5), 32 (17) or 64 (33), most of them masked; small N splits K; N = 37 is a multiple of
# no block_n, so the last program of every kernel masks a partial tile.
CASES = [
    (qtype, n, k, m, dtype)
    for qtype in TYPES
    for n, k, ms in ((16, 512, (1, 2, 5, 17, 33)), (37, 768, (1, 5, 17)))
    for m in ms
    for dtype in ("float32", "float16", *(("bfloat16",) if m == 1 else ()))
] + [("Q8_0", 640, 224, 1, "float32")]  # rows not a multiple of 256, and too many tiles to split K
# Blocks of random bytes (finite f16 scales): every bit of every packed field, where a quantizer
# writes only some patterns (IQ4_XS's quantizer, for one, puts its largest value on one level).
RANDOM_BYTES = [(qtype, 24, 512, m, "float32") for qtype in TYPES for m in (1, 5)]
F16_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}  # byte offsets in a block
# (qtype, N, K, M, Tiling fields): every kernel with N not a multiple of block_n, K not a multiple
# of the asked chunk (it halves), odd M, and split-K; each runs twice and must give the same bits.
TILED = [
    (qtype, 40, 768, m, tiling)
    for qtype in TYPES
    for m, tiling in (
        (1, {"block_n": 16, "chunk": 512, "num_warps": 4, "split_k": 3, "gemv": True}),
        (3, {"block_n": 32, "chunk": 1024, "num_warps": 2, "gemv": True}),
        (5, {"block_n": 32, "chunk": 128, "num_warps": 4, "split_k": 2}),
    )
] + [("Q8_0", 24, 96, 2, {"block_n": 16, "chunk": 64, "num_warps": 4, "split_k": 3, "gemv": True})]  # K = 3 blocks of 32
# Relative to the largest output: float32 accumulation order only; half types round their output.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
QUANT_LINEAR_CASES = [(1, "bfloat16"), (5, "float16")]  # (M, x dtype): a decode step, a small tree pass (bfloat16 M = 1 only: see above)
# (qtype, N, K, first, end): rows of W that ``gguf_expand.expand`` writes; a tail of a program masked.
EXPAND_CASES = [(qtype, 37, 768, first, end) for qtype in TYPES for first, end in ((0, 37), (5, 29))] + [("Q8_0", 20, 224, 3, 20)]
# (qtype, M, dtype, tile rows): many rows go to gguf_expand; a tile of 16 rows makes N = 37 three tiles.
EXPAND_MATMULS = [(qtype, 70, dtype, tile) for qtype in TYPES for dtype in ("float32", "float16") for tile in (None, 16)]
# (type, N, first, end, M): Q4_K or Q6_K blocks interleaved (gguf_matmul.interleave): rows of W expanded from
# them, and gguf_matmul of M rows (5: the Triton kernels, on a de-interleaved copy; 70: gguf_expand).
INTERLEAVED_CASES = [("Q4_K", 48, 0, 48, 70), ("Q4_K", 48, 5, 29, 5), ("Q4_K", 32, 16, 32, 70), ("Q6_K", 48, 0, 48, 70), ("Q6_K", 48, 5, 29, 5)]
MODELS = [("llama", "q4_k_m"), ("qwen2", "q8_0"), ("qwen3", "q6_k"), ("qwen3", "q5_k")]  # permuted q/k rows; biases; one type everywhere


def _quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    from gguf.quants import quantize

    from tests.kquants import quantize_k

    return quantize(w, qtype) if qtype == Q.Q8_0 else quantize_k(w, qtype)


def _random_bytes(rng: np.random.Generator, qtype: Q, n: int, k: int) -> np.ndarray:
    """uint8 [n, row bytes]: random blocks whose f16 scales are finite (random bytes could be NaN)."""
    from gguf import GGML_QUANT_SIZES

    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_values, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype.name]:
        blocks[:, offset : offset + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return ((ours.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _kernel_checks() -> dict[str, float]:
    from native.gguf_matmul import Tiling, gguf_matmul, gguf_matmul_reference

    rng = np.random.default_rng(0)
    results = {}
    for name, n, k, m, dtype in RANDOM_BYTES:
        qtype = Q[name]
        raw = torch.from_numpy(_random_bytes(rng, qtype, n, k))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        results[repr(("random bytes", name, n, k, m, dtype))] = _relative_error(gguf_matmul(x, raw, qtype, n), gguf_matmul_reference(x, raw, qtype, n))
    for name, n, k, m, dtype in dict.fromkeys(CASES + [(name, n, k, m, "float32") for name, n, k, m, _ in TILED]):
        qtype = Q[name]
        raw = torch.from_numpy(_quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(getattr(torch, dtype))
        expected = gguf_matmul_reference(x, raw, qtype, n).float()
        if (name, n, k, m, dtype) in CASES:
            ours = gguf_matmul(x, raw, qtype, n)
            assert ours.dtype == x.dtype and ours.shape == (m, n)
            results[repr((name, n, k, m, dtype))] = _relative_error(ours, expected)
        for case in TILED:
            if case[:4] == (name, n, k, m) and dtype == "float32":
                tiling = Tiling(**case[4])
                first, again = gguf_matmul(x, raw, qtype, n, tiling), gguf_matmul(x, raw, qtype, n, tiling)
                results[repr(case)] = {"error": _relative_error(first, expected), "same_bits": torch.equal(first, again)}
    return results


def _expand_checks() -> dict[str, object]:
    """``gguf_expand``: expanded rows against the dequantizer (bit for bit in float32, and as torch
    rounds it in float16; the interpreter truncates to bfloat16 where GPUs round, so bfloat16 is
    checked by ``scripts/gpu_gguf_expand.py``), and ``gguf_matmul`` of many rows (which it routes there) against the reference."""
    from native import gguf_expand
    from native.gguf_blocks import levels
    from native.gguf_dequant import dequantize
    from native.gguf_matmul import gguf_matmul, gguf_matmul_reference, interleave

    rng = np.random.default_rng(2)
    results: dict[str, object] = {}
    for name, n, k, first, end in EXPAND_CASES:
        qtype = Q[name]
        raw = torch.from_numpy(_random_bytes(rng, qtype, n, k))
        expected = dequantize(raw, qtype, (n, k))[first:end]
        for dtype in (torch.float32, torch.float16):
            out = torch.full((end - first + 3, k), float("nan"), dtype=dtype)  # spare rows must stay untouched
            rows = gguf_expand.expand(raw, qtype, levels(raw.device), first, end, out)
            results[repr((name, n, k, first, end, str(dtype)))] = torch.equal(rows, expected.to(dtype)) and bool(out[end - first :].isnan().all())
    for name, n, first, end, m in INTERLEAVED_CASES:
        qtype = Q[name]
        raw = torch.from_numpy(_random_bytes(rng, qtype, n, 512))
        out = torch.empty(end - first, 512)
        rows = gguf_expand.expand(interleave(raw, qtype), qtype, raw, first, end, out, interleaved=True)
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        file_layout = gguf_matmul(x, raw, qtype, n)
        results[repr(("interleaved", name, n, first, end, m))] = {
            "rows": torch.equal(rows, dequantize(raw, qtype, (n, 512))[first:end]),
            "matmul": torch.equal(gguf_matmul(x, interleave(raw, qtype), qtype, n, interleaved=True), file_layout),
        }
    for name, m, dtype, tile in EXPAND_MATMULS:
        qtype = Q[name]
        raw = torch.from_numpy(_quantize((rng.standard_normal((37, 512)) * 0.05).astype(np.float32), qtype))
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(getattr(torch, dtype))
        saved, gguf_expand.TILE_BYTES = gguf_expand.TILE_BYTES, (tile * 512 * x.element_size() if tile else gguf_expand.TILE_BYTES)
        try:
            assert gguf_expand.takes(x, qtype) and gguf_expand.tile_rows(37, 512, x.element_size()) == (tile or 37)
            ours = gguf_matmul(x, raw, qtype, 37)
        finally:
            gguf_expand.TILE_BYTES = saved
        assert ours.dtype == x.dtype and ours.shape == (m, 37)
        results[repr((name, m, dtype, tile))] = _relative_error(ours, gguf_matmul_reference(x, raw, qtype, 37))
    return results


def _quant_linear_checks() -> dict[str, dict]:
    """Each type's QuantLinear (with a bias) filled with packed rows, for x [1, M, 512] of each
    ``QUANT_LINEAR_CASES``, against the reference plus the bias."""
    from native.gguf_matmul import QuantLinear, gguf_matmul_reference

    rng = np.random.default_rng(1)
    results = {}
    for name in TYPES:
        qtype = Q[name]
        layer = QuantLinear(qtype, 512, 24, bias=True)
        layer.raw.copy_(torch.from_numpy(_quantize((rng.standard_normal((24, 512)) * 0.05).astype(np.float32), qtype)))
        torch.nn.init.normal_(layer.bias, std=0.1)
        for m, dtype in QUANT_LINEAR_CASES:
            x = torch.randn(1, m, 512, generator=torch.Generator().manual_seed(m)).to(getattr(torch, dtype))  # [batch, M, K]
            with torch.inference_mode():
                ours = layer(x)
            expected = gguf_matmul_reference(x, layer.raw, qtype, 24) + layer.bias.to(x.dtype)
            results[f"{name}-{m}-{dtype}"] = {"shape": list(ours.shape), "dtype": str(ours.dtype), "error": _relative_error(ours, expected)}
    return results


def _model_checks(work: Path) -> dict[str, dict]:
    from native.gguf_matmul import QuantLinear
    from splitspec.models.loader import load_target
    from tests.dense_fixtures import hf_model, write_gguf

    tokens = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128]])
    results = {}
    for arch, quant in MODELS:
        path = write_gguf(hf_model(arch, seed=3, layers=1), work / f"{arch}-{quant}.gguf", quant)
        dense, _ = load_target(path)
        packed, _ = load_target(path, keep_quantized=True)
        with torch.inference_mode():
            expected = dense.lm_head(dense.forward_sequences(tokens)[0]).float()
            ours = packed.lm_head(packed.forward_sequences(tokens)[0]).float()
        kinds = sorted({m.qtype.name for m in packed.modules() if isinstance(m, QuantLinear)})
        error = ((ours - expected).abs().max() / expected.abs().max()).item()
        results[f"{arch}-{quant}"] = {"error": error, "quant_linear_types": kinds}
    return results


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every check's result, computed by this file run as a script under TRITON_INTERPRET=1."""
    work = tmp_path_factory.mktemp("interpreted")
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPLITSPEC_NATIVE_CPU": "1"}
    done = subprocess.run([sys.executable, __file__, str(work)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_the_reference(interpreted, case):
    assert interpreted["kernels"][repr(case)] < TOLERANCE[case[-1]]


@pytest.mark.parametrize("case", RANDOM_BYTES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_the_reference_on_random_bytes(interpreted, case):
    assert interpreted["kernels"][repr(("random bytes", *case))] < TOLERANCE["float32"]


@pytest.mark.parametrize("case", TILED, ids=lambda c: "-".join(map(str, c[:4])) + "-" + "-".join(f"{k}{v}" for k, v in c[4].items()))
def test_every_tiling_matches_the_reference_and_repeats_its_bits(interpreted, case):
    result = interpreted["kernels"][repr(case)]
    assert result["error"] < TOLERANCE["float32"]
    assert result["same_bits"]


@pytest.mark.parametrize("case", EXPAND_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
def test_expanded_rows_are_the_dequantizers_bit_for_bit(interpreted, case, dtype):
    assert interpreted["expand"][repr((*case, dtype))] is True


@pytest.mark.parametrize("case", EXPAND_MATMULS, ids=lambda c: "-".join(map(str, c)))
def test_many_rows_multiply_expanded_tiles_as_the_reference(interpreted, case):
    assert interpreted["expand"][repr(case)] < TOLERANCE[case[2]]


@pytest.mark.parametrize("case", INTERLEAVED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_interleaved_blocks_expand_and_multiply_as_the_files_layout(interpreted, case):
    assert interpreted["expand"][repr(("interleaved", *case))] == {"rows": True, "matmul": True}


@pytest.mark.parametrize("qtype, size", [(Q.Q4_K, 144), (Q.Q6_K, 210)], ids=["Q4_K", "Q6_K"])
def test_interleave_puts_16_features_of_a_super_block_side_by_side(qtype, size):
    from native.gguf_matmul import deinterleave, interleavable, interleave

    raw = torch.randint(0, 256, (48, 3 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ours = interleave(raw, qtype)
    assert ours.shape == raw.shape and torch.equal(deinterleave(ours, qtype), raw)
    for feature, block in ((0, 0), (17, 2), (47, 1)):
        start = (feature // 16) * 16 * raw.shape[1] + block * 16 * size + (feature % 16) * size
        assert torch.equal(ours.flatten()[start : start + size], raw[feature, block * size : (block + 1) * size])
    assert torch.equal(ours[16:32], interleave(raw[16:32], qtype))  # rows of whole groups hold those features
    assert interleavable(raw, qtype) and not interleavable(raw[:40], qtype) and not interleavable(raw, Q.Q8_0)


def test_interleaved_is_refused_where_it_cannot_be():
    from native.gguf_matmul import gguf_matmul

    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        gguf_matmul(x, torch.zeros(8, 144, dtype=torch.uint8), Q.Q4_K, 8, interleaved=True)
    with pytest.raises(ValueError, match="must be Q4_K or Q6_K"):
        gguf_matmul(x, torch.zeros(16, 34 * 8, dtype=torch.uint8), Q.Q8_0, 16, interleaved=True)


def test_expand_tiles_hold_at_most_tile_bytes():
    from native.gguf_expand import BLOCK_N, TILE_BYTES, tile_rows

    assert tile_rows(1024, 4096, 2) == 1024  # 8 MiB: the whole weight
    rows = tile_rows(248_320, 5120, 2)  # a 248K-vocabulary LM head: 2.5 GB as bf16
    assert rows * 5120 * 2 <= TILE_BYTES and rows % BLOCK_N == 0 and (rows + BLOCK_N) * 5120 * 2 > TILE_BYTES


def test_many_rows_go_to_the_expanded_path_only_where_kernels_run(monkeypatch):
    from native import gguf_expand

    x = torch.zeros(gguf_expand.MIN_ROWS[Q.Q4_K], 256)
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    assert gguf_expand.takes(x, Q.Q4_K) and not gguf_expand.takes(x[1:], Q.Q4_K)
    monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", "gguf_expand")
    assert not gguf_expand.takes(x, Q.Q4_K)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m, dtype", QUANT_LINEAR_CASES)
def test_quant_linear_runs_the_kernel_for_every_type(interpreted, qtype, m, dtype):
    result = interpreted["quant_linears"][f"{qtype}-{m}-{dtype}"]
    assert result["shape"] == [1, m, 24] and result["dtype"] == f"torch.{dtype}"
    assert result["error"] < TOLERANCE[dtype]


def test_every_kernel_type_is_tested():
    from native.gguf_matmul import KERNEL_TYPES

    assert sorted(TYPES) == sorted(t.name for t in KERNEL_TYPES)


@pytest.mark.parametrize("arch, quant", MODELS)
def test_keep_quantized_model_matches_the_dequantized_load(interpreted, arch, quant):
    result = interpreted["models"][f"{arch}-{quant}"]
    # q4_k_m mixes Q4_K and Q6_K; the kernels, not the fallback, must have run in every layer kind.
    assert result["quant_linear_types"] == {"q4_k_m": ["Q4_K", "Q6_K"], "q8_0": ["Q8_0"], "q6_k": ["Q6_K"], "q5_k": ["Q5_K"]}[quant]
    assert result["error"] < 1e-5


def test_keep_quantized_without_triton_runs_the_reference_bit_for_bit(tmp_path):
    """Without a GPU or the interpreter, QuantLinear falls back to dequantize + F.linear: the same
    weights, so the same logits to the bit."""
    from native.gguf_matmul import QuantLinear
    from splitspec.models.loader import load_target
    from splitspec.models.quantized import QuantEmbedding
    from tests.dense_fixtures import hf_model, write_gguf

    assert os.environ.get("SPLITSPEC_NATIVE_CPU") != "1"
    path = write_gguf(hf_model("llama", seed=3, layers=1), tmp_path / "model.gguf", "q4_k_m")
    dense, _ = load_target(path)
    packed, _ = load_target(path, keep_quantized=True)
    assert isinstance(packed.layers[0].self_attn.q_proj, QuantLinear) and isinstance(packed.lm_head, QuantLinear)
    assert isinstance(packed.embed_tokens, QuantEmbedding)  # Q4_K: kept too, its rows dequantized as looked up
    tokens = torch.tensor([[5, 9, 200, 31]])
    with torch.inference_mode():
        assert torch.equal(packed.forward_sequences(tokens)[0], dense.forward_sequences(tokens)[0])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2]))  # the checkout: tests.kquants, tests.dense_fixtures
    print(json.dumps({"kernels": _kernel_checks(), "expand": _expand_checks(), "quant_linears": _quant_linear_checks(), "models": _model_checks(Path(sys.argv[1]))}))
