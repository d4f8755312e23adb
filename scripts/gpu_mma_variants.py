"""Variants of the Q4_K and Q6_K A-operand kernels (``native/gguf_q4k.cu``, ``gguf_q6k.cu``), timed
against the kernels as they are, and a sweep of K splits (GPU, nvcc; benchmark-only weights).

Each variant is the committed source with one text patch behind a macro (``patch``): Q4_K's weights
with a 256-byte or 128-byte L2 hint (``q4l2h``, ``q4l2h128``: the first won here and lost in the 27B
step, BENCHMARKS.md's [V1], so time a winner in the step too) or allocated in L1 as before [K1]
(``q4l1``); x read from global memory by every warp at every row count, as before its staging
in shared memory from three n-tiles (``xldg``), or staged from one or two n-tiles (``xs1``,
``xs2``); Q6_K's runs loaded a 32-bit word at a
time at one n-tile too, as before [K2] (``q6words``; the words lost 2-28% not allocated in L1 [K1],
and with a 256-byte L2 hint [V1]), or as 8-byte pairs up to two n-tiles (``q6pairs2``); Q4_K's
and Q6_K's weights interleaved so that a warp's 16 features of one super-block are 2,304 or 3,360
contiguous bytes (``interleaved``, the serving layout since [V4] and [V5]; the file's puts them
144 or 210 x super-blocks apart); Q4_K interleaved with each warp's super-blocks copied ahead by
``cp.async`` into a ring of shared memory, 4 or 8 slots (3 or 4 from three n-tiles, beside x's
stages) in place of the two super-blocks in registers (``q4smem4``, ``q4smem8``: more bytes in
flight a multiprocessor and fewer registers, 122 at one n-tile against 140; 0.71-0.95x of
``interleaved`` at 1-32 rows, BENCHMARKS.md [V5]); interleaved in blocks of 6 or 8 warps, which
share one staged x among 96 or 128 features (``w6``, ``w8``: at every row count; the committed Q4_K
kernels take 6 from 17 rows since [K10]), or Q4_K's in blocks of 4 at every row count as before
(``q4w4``); the super-block two ahead prefetched into L2
with ``cp.async.bulk.prefetch`` (``pf2``); the k steps' two mma chains accumulated apart (``chains2``: the sums' order changes, so its outputs differ from the
others' in the last bits); one n-tile capped at four blocks a multiprocessor (``mb4``: 121
registers); Q6_K's four n-tiles at three blocks (``q6nb4mb3``: spills; the kernels before [V1]). The
variants build in parallel, each an extension of the two kernel files and a binding; one process
then times every variant on each shape (27B and 8B layer shapes, the 27B LM head) at 1, 8, 16, 23
and 32 rows, the current kernels (both layouts) also at 1-8 splits, as ``gpu_gguf_mma.py`` times (a CUDA graph of
20 calls over weight copies L2 cannot hold, best of 5), beside a read of the same bytes by
``torch.amax``, and prints each variant's largest difference from the current kernel's output at the
same splits. Writes ``$OUT/gpu_mma_variants.json``.

Usage: python3 scripts/gpu_mma_variants.py   (``VARIANTS=q4l2h`` builds only those and base,
       ``CALLS=Q4_K:27b.gate_up,Q6_K:27b.lm_head`` times only those)
       python3 scripts/gpu_mma_variants.py --native COPY/native NAME   (variant NAME over a copy of native/)
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
SRC = Path(os.environ.get("TMPDIR", "/tmp")) / "splitspec_mma_variants"

VARIANTS = {
    "base": {},
    "q4l2h": {"PROBE_Q4_LOAD": 1},  # Q4_K's weights with a 256-byte L2 hint
    "q4l2h128": {"PROBE_Q4_LOAD": 2},  # Q4_K's weights with a 128-byte L2 hint
    "pf2": {"PROBE_PREFETCH": 2},
    "chains2": {"PROBE_CHAINS2": 1},
    "mb4": {"PROBE_MB1": 4},  # one n-tile capped at 4 blocks (121 registers)
    "q6nb4mb3": {"PROBE_Q6_MB4": 3},  # Q6_K at 4 n-tiles (25-32 rows) at 3 blocks (spills; the kernels before [V1])
    "q4l1": {"PROBE_Q4_LOAD": 0},  # Q4_K's weights allocated in L1 (the kernel before [K1])
    "xldg": {"X_STAGED_MIN_NB": 5},  # x read from global memory by every warp (before XStages)
    "xs1": {"X_STAGED_MIN_NB": 1},  # x staged in shared memory at every row count
    "xs2": {"X_STAGED_MIN_NB": 2},  # x staged from two n-tiles (9 rows) on
    "q6words": {"Q6K_PAIRS_MAX_NB": 0},  # Q6_K's runs loaded a word at a time at one n-tile too (before [K2])
    "q6pairs2": {"Q6K_PAIRS_MAX_NB": 2},  # Q6_K's runs loaded as 8-byte pairs up to two n-tiles
    "interleaved": {},  # the current kernels on blocks in ``gguf_matmul.interleave``'s layout
    # Q4_K interleaved, each warp's 2,304-byte super-blocks copied ahead into a ring of shared memory
    # (cp.async) instead of registers: stages below three n-tiles / from three on
    "q4smem4": {"PROBE_Q4_SMEM": 4, "PROBE_Q4_SMEM_X": 3},
    "q4smem8": {"PROBE_Q4_SMEM": 8, "PROBE_Q4_SMEM_X": 4},
    # interleaved, blocks of 6 or 8 warps (96 or 128 features) sharing one staged x, at the same
    # 12 warps a multiprocessor from two n-tiles (w8: 8): x's traffic into a multiprocessor over
    # its weights' falls from 1.4 to 0.95 or 0.71 at 23 rows
    "w6": {"PROBE_WARPS": 6},
    "w8": {"PROBE_WARPS": 8},
    "q4w4": {"PROBE_Q4_WARPS": 4},  # Q4_K in blocks of 4 warps at every row count (before [K10])
}
# variants timed on interleaved blocks, and of which types
INTERLEAVED = {"interleaved": ("Q4_K", "Q6_K"), "q4smem4": ("Q4_K",), "q4smem8": ("Q4_K",), "w6": ("Q4_K", "Q6_K"),
               "w8": ("Q4_K", "Q6_K"), "q4w4": ("Q4_K",)}
SPLIT_SWEEP = ("base", "interleaved")  # variants timed at 1-8 splits too

BIND = r"""
#include <torch/extension.h>
void q4k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters, int64_t splits, bool interleaved);
void q6k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters, int64_t splits, bool interleaved);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4k_mma", &q4k_mma, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("out"), pybind11::arg("partial"),
        pybind11::arg("counters"), pybind11::arg("splits"), pybind11::arg("interleaved") = false);
  m.def("q6k_mma", &q6k_mma, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("out"), pybind11::arg("partial"),
        pybind11::arg("counters"), pybind11::arg("splits"), pybind11::arg("interleaved") = false);
}
"""


def sub(text: str, old: str, new: str) -> str:
    """``text`` with its one ``old`` replaced (a source that no longer holds it exactly once fails here)."""
    assert text.count(old) == 1, old
    return text.replace(old, new)


PROBE_Q4_SMEM_LOOP = r"""
#ifndef PROBE_Q4_SMEM
#define PROBE_Q4_SMEM 0
#endif
#ifndef PROBE_Q4_SMEM_X
#define PROBE_Q4_SMEM_X 3
#endif
template <int NB>
__host__ __device__ constexpr int probe_stages() { return NB >= X_STAGED_MIN_NB ? PROBE_Q4_SMEM_X : PROBE_Q4_SMEM; }

// The loop over super-blocks: interleaved blocks with PROBE_Q4_SMEM, each warp's 16 features'
// super-block (2,304 contiguous bytes) copied into a ring of probe_stages<NB>() slots in shared
// memory (after x's stages), S - 1 super-blocks ahead, the lanes loading their blocks from there;
// otherwise mma_common::over_super_blocks (two super-blocks in registers).
template <int NB, bool kInterleaved, typename Compute>
__device__ __forceinline__ void probe_over(const uint8_t* const (&rows)[2], uint4* shared, int x_units, int lane, int warp,
                                           int g, int c, int begin, int end, Compute&& compute) {
  if constexpr (kInterleaved && PROBE_Q4_SMEM > 0) {
    constexpr int S = probe_stages<NB>();
    constexpr int kChunk = 16 * Q4K::kBytes;
    uint8_t* ring = reinterpret_cast<uint8_t*>(shared + x_units) + warp * S * kChunk;
    const uint8_t* tile = rows[0] - Q4K::kBytes * g;
    const auto fetch = [&](int sb) {
      const uint8_t* src = tile + static_cast<int64_t>(sb) * kChunk;
      uint8_t* dst = ring + (sb % S) * kChunk;
      for (int i = lane; i < kChunk / 16; i += 32) {
        const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst + 16 * i));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src + 16 * i) : "memory");
      }
    };
#pragma unroll
    for (int st = 0; st + 1 < S; ++st) {
      if (begin + st < end) fetch(begin + st);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    mma_common::wait_for_x();
    for (int sb = begin; sb < end; ++sb) {
      // Super-block sb's group is complete when at most S - 2 later ones are pending; the
      // warp's barrier makes every lane's copies visible and ends every lane's reads of slot
      // (sb - 1) % S, which the fetch below overwrites.
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
      __syncwarp();
      const uint8_t* stage = ring + (sb % S) * kChunk;
      Q4K blocks[2];
      blocks[0].load_shared(stage + Q4K::kBytes * g, c);
      blocks[1].load_shared(stage + Q4K::kBytes * (8 + g), c);
      if (sb + S - 1 < end) fetch(sb + S - 1);
      asm volatile("cp.async.commit_group;" ::: "memory");
      compute(blocks, sb);
    }
  } else {
    mma_common::over_super_blocks<Q4K, kInterleaved ? 16 * Q4K::kBytes : Q4K::kBytes>(rows, c, begin, end, compute);
  }
}

"""


def patch() -> None:
    SRC.mkdir(exist_ok=True)
    h = (ROOT / "native/gguf_mma.cuh").read_text()
    h = sub(h, "constexpr int kWarps = 4;", """#ifndef PROBE_WARPS
#define PROBE_WARPS 4
#endif
constexpr int kWarps = PROBE_WARPS;""")
    h = sub(h, "namespace mma_common {", """#ifndef PROBE_Q4_LOAD
#define PROBE_Q4_LOAD 3
#endif
#ifndef PROBE_PREFETCH
#define PROBE_PREFETCH 0
#endif
#ifndef PROBE_CHAINS2
#define PROBE_CHAINS2 0
#endif
#ifndef PROBE_MB1
#define PROBE_MB1 1
#endif
#ifndef PROBE_Q6_MB4
#define PROBE_Q6_MB4 2
#endif
#ifndef PROBE_Q6_MB1
#define PROBE_Q6_MB1 3
#endif
#ifndef PROBE_Q4_WARPS
#define PROBE_Q4_WARPS 0
#endif
namespace mma_common {""")
    start = h.index("__device__ __forceinline__ uint4 load16(")
    end = h.index("\n}\n", start) + 3
    h = h[:start] + """#define PROBE_HINT_1 ".L1::no_allocate.L2::256B"
#define PROBE_HINT_2 ".L1::no_allocate.L2::128B"
#define PROBE_HINT_3 ".L1::no_allocate"
#define PROBE_HINT_(kind) PROBE_HINT_##kind
#define PROBE_HINT(kind) PROBE_HINT_(kind)
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
#if PROBE_Q4_LOAD == 0
  return __ldg(reinterpret_cast<const uint4*>(p));  // allocated in L1 (the kernel before [K1])
#else
  uint4 v;
  asm("ld.global.nc" PROBE_HINT(PROBE_Q4_LOAD) ".v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ void bulk_prefetch(const uint8_t* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(15);
  const uint32_t size = static_cast<uint32_t>(((reinterpret_cast<uintptr_t>(p) + bytes + 15) & ~uintptr_t(15)) - a);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(size) : "memory");
#endif
}
""" + h[end:]
    h = sub(h, """      compute(buf[st], sb);""", """#if PROBE_PREFETCH
      if (c < 2 && sb + PROBE_PREFETCH < end) bulk_prefetch((c ? rows[1] : rows[0]) + static_cast<int64_t>(sb + PROBE_PREFETCH) * kStride, Block::kBytes);
#endif
      compute(buf[st], sb);""")
    (SRC / "gguf_mma.cuh").write_text(h)

    q4 = (ROOT / "native/gguf_q4k.cu").read_text()
    q4 = sub(q4, "float part[NB][4], by_min[NB][4];", "float part[NB][4], by_min[NB][4], part2[NB][4];")
    q4 = sub(q4, "part[nb][e] = by_min[nb][e] = 0.0f;", "part[nb][e] = by_min[nb][e] = part2[nb][e] = 0.0f;")
    q4 = sub(q4, "mma_f16(part[nb], a2, b.z, b.w);", "mma_f16((PROBE_CHAINS2 ? part2 : part)[nb], a2, b.z, b.w);")
    q4 = sub(q4, "  const uint32_t m[4] = {f[0].mins", """  if (PROBE_CHAINS2)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[nb][e] += part2[nb][e];
  const uint32_t m[4] = {f[0].mins""")
    q4 = sub(q4, "NB == 1 ? 1 : 12 / W", "NB == 1 ? PROBE_MB1 : 12 / W")
    # PROBE_Q4_WARPS: every Q4_K kernel in blocks of that many warps (0: the committed choice)
    q4 = sub(q4, "{ return kInterleaved && NB >= 3 ? 6 : kWarps; }",
             "{ return PROBE_Q4_WARPS ? PROBE_Q4_WARPS : kInterleaved && NB >= 3 ? 6 : kWarps; }")
    q4 = sub(q4, "  __device__ __forceinline__ void load(const uint8_t* block, int c) {", """  __device__ __forceinline__ void load_shared(const uint8_t* block, int c) {
    head = *reinterpret_cast<const uint4*>(block);
    q0 = *reinterpret_cast<const uint4*>(block + 16 + 16 * c);
    q1 = *reinterpret_cast<const uint4*>(block + 80 + 16 * c);
  }
  __device__ __forceinline__ void load(const uint8_t* block, int c) {""")
    q4 = sub(q4, "// One program: W warps", PROBE_Q4_SMEM_LOOP + "// One program: W warps")
    q4 = sub(q4, "mma_common::over_super_blocks<Q4K, kInterleaved ? 16 * Q4K::kBytes : Q4K::kBytes>(rows, c, sb_begin, sb_end, ",
             "probe_over<NB, kInterleaved>(rows, x_shared, NB >= X_STAGED_MIN_NB ? 2 * x_stage_units(kRowsPadded) : 0, lane, warp, g, c, "
             "sb_begin, sb_end, ")
    q4 = sub(q4, "  const size_t shared_bytes = NB >= X_STAGED_MIN_NB ? 2 * sizeof(uint4) * x_stage_units(rows_padded) : 0;",
             """  const size_t shared_bytes = (NB >= X_STAGED_MIN_NB ? 2 * sizeof(uint4) * x_stage_units(rows_padded) : 0) +
      (kInterleaved && PROBE_Q4_SMEM ? size_t(W) * probe_stages<NB>() * 16 * Q4K::kBytes : 0);
  static const bool sized = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(q4k_kernel<NB, kInterleaved>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
    return true;
  }();
  (void)sized;""")
    (SRC / "gguf_q4k.cu").write_text(q4)

    q6 = (ROOT / "native/gguf_q6k.cu").read_text()
    q6 = sub(q6, "  float part[NB][4];\n", "  float part[NB][4], part2[NB][4];\n")
    q6 = sub(q6, "    for (int e = 0; e < 4; ++e) part[nb][e] = 0.0f;", "    for (int e = 0; e < 4; ++e) part[nb][e] = part2[nb][e] = 0.0f;")
    q6 = sub(q6, "mma_f16(part[nb], a2, b.z, b.w);", "mma_f16((PROBE_CHAINS2 ? part2 : part)[nb], a2, b.z, b.w);")
    q6 = sub(q6, """#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float2 sx =""", """  if (PROBE_CHAINS2)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[nb][e] += part2[nb][e];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float2 sx =""")
    q6 = sub(q6, "NB == 4 ? 2 : 3", "(NB == 1 ? PROBE_Q6_MB1 : NB == 4 ? PROBE_Q6_MB4 : 3) * 4 / kWarps")
    (SRC / "gguf_q6k.cu").write_text(q6)
    (SRC / "bind.cpp").write_text(BIND)


def extension(name: str):
    """Variant ``name``'s extension of the patched sources (built once, then loaded from torch's cache)."""
    from torch.utils.cpp_extension import load

    return load(name=f"mma_variant_{name}", sources=[str(SRC / f) for f in ("gguf_q4k.cu", "gguf_q6k.cu", "bind.cpp")],
                extra_cuda_cflags=["-O3"] + [f"-D{k}={v}" for k, v in VARIANTS[name].items()], verbose=False)


def build(name: str):
    t0 = time.time()
    try:
        extension(name)
    except Exception as exc:  # noqa: BLE001 - one variant's failure must not cost the others
        print(f"build {name} FAILED: {str(exc)[-2000:]}", flush=True)
        return name, None
    return name, time.time() - t0


def cycling(tensors: list[torch.Tensor]):
    """A function returning the next of ``tensors`` at each call (a graph's calls read them in turn)."""
    it = iter(range(1 << 62))
    return lambda: tensors[next(it) % len(tensors)]


def build_all(names: list[str]) -> list[str]:
    """Build ``names`` in parallel; the ones that built (a failure is printed and skipped)."""
    os.environ.setdefault("MAX_JOBS", "4")
    built = []
    with ProcessPoolExecutor(len(names)) as pool:
        for name, seconds in pool.map(build, names):
            if seconds is not None:
                built.append(name)
                print(f"built {name} in {seconds:.0f} s", flush=True)
    if "base" not in built:
        raise SystemExit("the current kernels (base) did not build")
    return built


def time_shape(exts, names, qtype, shape, counters, sms, results) -> None:
    """Every variant on one layer shape at 1, 8, 23 and 32 rows (the current kernels at 1-8 splits too)."""
    from gguf import GGMLQuantizationType as Q
    from gpu_quant_libraries import SHAPES, random_blocks, timed

    from native.gguf_matmul import interleave

    dev = counters.device
    n, k = SHAPES[shape]
    first = random_blocks(qtype, n, k, dev)
    copies = [first] + [random_blocks(qtype, n, k, dev) for _ in range(max(1, -(-400_000_000 // first.numel())) - 1)]
    mb = first.numel() / 1e6
    default = max(1, min(round(2.5 * sms / -(-n // 64)), k // 256 // 2, 32))  # gguf_mma.a_operand_splits
    next_ints = cycling([c.view(torch.int32) for c in copies])
    read_us = timed(lambda: torch.amax(next_ints()), reps=20)
    print(f"\n{qtype.name} {shape} N={n} K={k} {mb:.1f} MB, default splits {default}; amax read {read_us:.1f} us "
          f"({mb / read_us:.2f} TB/s)", flush=True)
    wanted = [name for name in names if qtype.name in INTERLEAVED.get(name, (qtype.name,))]
    interleaved = [interleave(c, qtype) for c in copies] if set(INTERLEAVED) & set(wanted) else []
    for m in (1, 8, 16, 23, 32):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        base_out = {}
        for name in wanted:
            weights = interleaved if name in INTERLEAVED else copies
            kernel = getattr(exts[name], "q4k_mma" if qtype == Q.Q4_K else "q6k_mma")
            fn = functools.partial(kernel, interleaved=True) if name in INTERLEAVED else kernel
            for splits in sorted({1, 2, 3, 4, 6, 8, default}) if name in SPLIT_SWEEP else (default,):
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                partial = torch.empty(splits, min(m, 32), n, dtype=torch.float32, device=dev)
                fn(x, weights[0], out, partial, counters, splits)
                torch.cuda.synchronize()
                if name == "base":
                    base_out[splits] = out.clone()
                ref = base_out[splits].float()
                err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                next_raw = cycling(weights)
                us = timed(lambda: fn(x, next_raw(), out, partial, counters, splits), reps=20)  # noqa: B023 - timed now
                results.append(dict(type=qtype.name, shape=shape, m=m, variant=name, splits=splits, us=us, err=err))
                mark = "*" if splits == default else " "
                print(f"  m={m:2d} {name:9s} splits {splits}{mark} {us:8.1f} us {mb / us:5.2f} TB/s  vs base {err:.1e}", flush=True)


def emit_native(directory: Path, name: str) -> None:
    """Write variant ``name``'s kernels over a copy of ``native/`` at ``directory``, its macros
    defined in the shared header, so that the target's engine runs it in the step
    (``gpu_kernel_table.py`` from a copy of the tree: a variant is judged in the step)."""
    defines = "".join(f"#define {k} {v}\n" for k, v in VARIANTS[name].items())
    header = (SRC / "gguf_mma.cuh").read_text().replace("#pragma once\n", "#pragma once\n" + defines, 1)
    (directory / "gguf_mma.cuh").write_text(header)
    for f in ("gguf_q4k.cu", "gguf_q6k.cu"):
        (directory / f).write_text((SRC / f).read_text())


def main() -> None:
    patch()
    if sys.argv[1:2] == ["--native"]:
        emit_native(Path(sys.argv[2]), sys.argv[3])
        return
    from gguf import GGMLQuantizationType as Q
    from gpu_quant_libraries import copy_bandwidth
    t0 = time.time()
    wanted = {"base", *os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",")}  # base: every variant's reference
    names = build_all([n for n in VARIANTS if n in wanted])
    print(f"builds {time.time() - t0:.0f} s", flush=True)
    exts = {n: extension(n) for n in names}
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), f"copy {copy_bandwidth(dev) / 1e12:.2f} TB/s", flush=True)
    counters = torch.zeros(1 << 15, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results: list[dict] = []
    calls = [(Q.Q4_K, "27b.gate_up"), (Q.Q4_K, "27b.down"), (Q.Q4_K, "27b.attn_qkv"), (Q.Q4_K, "8b.gate_up"),
             (Q.Q6_K, "27b.down"), (Q.Q6_K, "27b.attn_qkv"), (Q.Q6_K, "27b.lm_head")]
    only = os.environ.get("CALLS")  # e.g. Q4_K:27b.gate_up,Q6_K:27b.lm_head
    for qtype, shape in [c for c in calls if not only or f"{c[0].name}:{c[1]}" in only.split(",")]:
        time_shape(exts, names, qtype, shape, counters, sms, results)
        torch.cuda.empty_cache()
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    (out_dir / "gpu_mma_variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
