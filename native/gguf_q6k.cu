// y = x @ W^T for bf16 x [M, K] (M <= 64) and W [N, K] in GGUF Q6_K blocks, on tensor cores with
// the weights as the A operand of mma.sync m16n8k16 (fp16) and x as B: the design of
// native/gguf_q4k.cu (read that first), for a block of 210 bytes that is only 2-byte aligned.
//
// One warp: 16 output features (A rows g and g + 8 of lane (g, c)), the x rows as the 8 columns
// of each B tile (n-tile nb: rows 8 nb .. 8 nb + 7), one super-block (256 values) a loop step.
// A super-block: ql[128] low nibbles, qh[64] high bit pairs, scales[16] int8, f16 d at byte 208.
// Value v = 128 h + 32 r + l (h < 2, r < 4, l < 32): low bits nibble r / 2 of ql byte
// 64 h + 32 (r % 2) + l, high bits 2r, 2r + 1 of qh byte 32 h + l, scale sc = scales[v / 16];
// value = d * sc * (q - 32).
//
// A register (two values) takes a byte permute, which puts a ql byte (its nibble at bits 4..7)
// under a qh byte (its pair at bits 0..1) in each half, one LOP3 that keeps bits 4..9 and ORs in
// 0x6400 (the fp16 1024 + 16 q), and one packed fused multiply-add, (1024 + 16 q) * sc / 16 - 96 sc
// (-1056 sc, with q in bits 0..5, would overflow fp16). One word of each of the three runs below
// serves eight registers after five shifts and, where the runs are loaded a word at a time, three
// funnel shifts (alignment): three to four instructions a register. The weights reach the tensor
// cores as sc * (q - 32) rounded once to fp16 (|.| <= 4096: exact up to 2048, an 11-bit significand
// above, where bf16 would keep 8 bits). d and x's per-row power-of-two scale (prepare_x_kernel) are
// applied in float32 after each super-block; products are exact and sums float32, as in
// gguf_q4k.cu.
//
// k map: lane c takes half h = c / 2 and l in 16 j + 0 .. 15 (j = c % 2), so its 64 values use
// four scales, and reads three 16-byte runs of each feature's block (ql at 64 h + 16 j and
// 64 h + 32 + 16 j, qh at 128 + 32 h + 16 j; word i of each run holds l0 = 16 j + 4 i .. + 3).
// Step s (0..15): word i = s / 4, rho = (s / 2) % 2, parity p = s % 2; slots 2c, 2c + 1 take
// r = rho at l0 + p, l0 + p + 2, slots 2c + 8, 2c + 9 take r = rho + 2 at the same l: bytes p and
// p + 2 of the ql word of r % 2 = rho (its low nibbles, then its high ones) and of the qh word.
//
// W's layout (kInterleaved), as gguf_q4k.cu's: the file's, or native.gguf_matmul.interleave's
// [N / 16, super-blocks, 16, 210] (a warp's 16 features of one super-block 3,360 contiguous bytes;
// 1.04-1.09x faster at one row on the 27B shapes, the same sums, BENCHMARKS.md [V5]). Each block
// keeps its own alignment there (210 g bytes into a run that starts 8-byte aligned).

#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#include "gguf_mma.cuh"

namespace {

using mma_common::bits_h2;
using mma_common::h2_bits;
using mma_common::kWarps;
using mma_common::mma_f16;

#ifndef Q6K_PAIRS_MAX_NB  // the most n-tiles whose kernel loads pairs (Q6KPairs); benchmarks compare
#define Q6K_PAIRS_MAX_NB 1
#endif

// What both load paths below share: the block's size, the k map, the scales and a fragment's
// arithmetic from a run's four aligned bytes.
struct Q6KCommon {
  static constexpr int kBytes = 210;
  uint32_t scale[2], offset[2];  // fp16 {sc_r / 16, sc_r+1 / 16} and -1536 times that, r = 0 and 2
  float d;

  // Scales r of this lane from `word` (bytes 4 p .. 4 p + 3 of scales 8 h ..): byte j + 2 r.
  // Flipping an int8's sign bit gives the byte sc + 128, which a byte permute puts under 0x54
  // (fp16 64 + byte / 16, `magic_scale` 0x54005400, `pick_scale` bytes j, j + 2 of a word);
  // less 72: sc / 16, exactly.
  __device__ __forceinline__ void set_scales(int p, uint32_t word, uint32_t pick_scale, uint32_t magic_scale) {
    const __half2 s = __hsub2(h2_bits(__byte_perm(word ^ 0x80808080u, magic_scale, pick_scale)), h2_bits(0x54805480u));
    scale[p] = bits_h2(s);
    offset[p] = bits_h2(__hmul2(s, h2_bits(0xE600E600u)));  // -96 sc
  }

  // Registers a (slots 2c, 2c + 1: r = rho) and b (slots 2c + 8, 2c + 9: r = rho + 2) of k step s
  // from the aligned ql word of r % 2 = rho and the qh word shifted right by 2 rho. Each half of a
  // permuted word: a ql byte (its low nibble moved up by `<< 4` for r = rho, its high nibble in
  // place for rho + 2) under the qh byte (pair r at bits 8, 9); the scales' halves are taken
  // broadcast (HFMA2 operand swizzles, no extra instruction). `magic` is 0x64006400 in a register
  // the compiler does not fold into an immediate (a LOP3 takes one).
  __device__ __forceinline__ void fragment_of(int s, uint32_t ql, uint32_t qh, uint32_t magic, uint32_t& a,
                                              uint32_t& b) const {
    const int rho = (s >> 1) & 1;
    const uint32_t pick = (s & 1) ? 0x7351u : 0x6240u;  // bytes {p, p + 4, p + 2, p + 6} of (ql, qh)
    const uint32_t lo = (__byte_perm(ql << 4, qh, pick) & 0x03F003F0u) | magic;
    const uint32_t hi = (__byte_perm(ql, qh >> 4, pick) & 0x03F003F0u) | magic;
    const auto half = [rho](uint32_t v) { return rho ? __high2half2(h2_bits(v)) : __low2half2(h2_bits(v)); };
    a = bits_h2(__hfma2(h2_bits(lo), half(scale[0]), half(offset[0])));
    b = bits_h2(__hfma2(h2_bits(hi), half(scale[1]), half(offset[1])));
  }

  // The real k of slot 2c of step s (2c + 1: k + 2; 2c + 8, 2c + 9: k + 64, k + 66).
  __host__ __device__ __forceinline__ static int k_of(int c, int s) {
    return 128 * (c >> 1) + 16 * (c & 1) + 4 * (s >> 2) + 32 * ((s >> 1) & 1) + (s & 1);
  }
};

// One feature's super-block for lane c, its runs loaded a 32-bit word at a time. The runs start at
// multiples of 4 in the block, so one funnel shift by 0 or 16 bits (the block's address mod 4)
// realigns all of them: a run is loaded as the aligned words from its first byte's word on (2
// bytes before the block when shifted), five for 16 bytes (the fifth, needed only when shifted,
// still lies inside the block). The scales' third word is loaded only when shifted: unshifted it
// would pass the end of the block, which may end the tensor. 18-19 loads a feature, few registers:
// the kernels of two to four n-tiles, whose registers are short, take this path.
struct Q6KWords : Q6KCommon {
  uint32_t low[2][5], high[5], sc[3];  // ql runs of r % 2 = 0, 1; the qh run; scales 8 h .. 8 h + 7
  unsigned short d_bits;

  __device__ __forceinline__ void load(const uint8_t* block, int c) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(block);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(addr & ~uintptr_t(3));
    const int h = c >> 1, j = c & 1;
#pragma unroll
    for (int t = 0; t < 5; ++t) {
      low[0][t] = __ldg(words + 16 * h + 4 * j + t);
      low[1][t] = __ldg(words + 16 * h + 8 + 4 * j + t);
      high[t] = __ldg(words + 32 + 8 * h + 4 * j + t);
    }
    sc[0] = __ldg(words + 48 + 2 * h);
    sc[1] = __ldg(words + 49 + 2 * h);
    sc[2] = (addr & 2) ? __ldg(words + 50 + 2 * h) : 0u;
    d_bits = __ldg(reinterpret_cast<const unsigned short*>(block + 208));
  }

  __device__ __forceinline__ void prepare(uint32_t shift, bool, uint32_t pick_scale, uint32_t magic_scale) {
    d = __half2float(__ushort_as_half(d_bits));
#pragma unroll
    for (int p = 0; p < 2; ++p) set_scales(p, __funnelshift_r(sc[p], sc[p + 1], shift), pick_scale, magic_scale);
  }

  __device__ __forceinline__ void fragment(int s, uint32_t shift, uint32_t magic, uint32_t& a, uint32_t& b) const {
    const int i = s >> 2, rho = (s >> 1) & 1;
    fragment_of(s, __funnelshift_r(low[rho][i], low[rho][i + 1], shift),
                __funnelshift_r(high[i], high[i + 1], shift) >> (2 * rho), magic, a, b);
  }
};

// The same, each run loaded as the three 8-byte aligned pairs of words that hold its 16 bytes and
// the two after (a word before the run where the block's first word is odd, `odd`): 12 loads a
// feature, not 18-19 words, whose loads kept the L1 96% busy on the 27B LM head at one row; the
// one-row calls of a 27B AR step 9% faster (BENCHMARKS.md, [K2]). prepare() takes each run's five
// words from its six and realigns them once a super-block, not in every fragment. It needs more
// registers (167 at one n-tile): at two n-tiles it ran 1-45% slower, at three it spilled and ran
// 1.14-1.47x slower ([K2]). A pair past the block's end still holds one of its bytes, so it lies in
// the tensor's pages.
struct Q6KPairs : Q6KCommon {
  uint2 raw[3][3], raw_scales[2];  // the pairs of the ql runs of r % 2 = 0, 1 and of the qh run; of scales 8 h ..
  unsigned short d_bits;
  uint32_t run[3][4];  // after prepare(): bytes 4 i .. 4 i + 3 of each run

  __device__ __forceinline__ void load(const uint8_t* block, int c) {
    const uint2* pairs = reinterpret_cast<const uint2*>(reinterpret_cast<uintptr_t>(block) & ~uintptr_t(7));
    const int h = c >> 1, j = c & 1;
    const int first[3] = {8 * h + 2 * j, 8 * h + 4 + 2 * j, 16 + 4 * h + 2 * j};  // the runs' words / 2
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
      for (int t = 0; t < 3; ++t) raw[r][t] = __ldg(pairs + first[r] + t);
    raw_scales[0] = __ldg(pairs + 24 + h);
    raw_scales[1] = __ldg(pairs + 25 + h);
    d_bits = __ldg(reinterpret_cast<const unsigned short*>(block + 208));
  }

  __device__ __forceinline__ void prepare(uint32_t shift, bool odd, uint32_t pick_scale, uint32_t magic_scale) {
    d = __half2float(__ushort_as_half(d_bits));
#pragma unroll
    for (int r = 0; r < 3; ++r) {
      const uint32_t u[6] = {raw[r][0].x, raw[r][0].y, raw[r][1].x, raw[r][1].y, raw[r][2].x, raw[r][2].y};
      uint32_t w[5];
#pragma unroll
      for (int t = 0; t < 5; ++t) w[t] = odd ? u[t + 1] : u[t];
#pragma unroll
      for (int i = 0; i < 4; ++i) run[r][i] = __funnelshift_r(w[i], w[i + 1], shift);
    }
    const uint32_t u[4] = {raw_scales[0].x, raw_scales[0].y, raw_scales[1].x, raw_scales[1].y};
#pragma unroll
    for (int p = 0; p < 2; ++p)
      set_scales(p, __funnelshift_r(odd ? u[p + 1] : u[p], odd ? u[p + 2] : u[p + 1], shift), pick_scale, magic_scale);
  }

  __device__ __forceinline__ void fragment(int s, uint32_t, uint32_t magic, uint32_t& a, uint32_t& b) const {
    const int i = s >> 2, rho = (s >> 1) & 1;
    fragment_of(s, run[rho][i], run[2][i] >> (2 * rho), magic, a, b);
  }
};

template <int NB>
using Q6K = std::conditional_t<NB <= Q6K_PAIRS_MAX_NB, Q6KPairs, Q6KWords>;

// x for the kernel below, per row r and super-block sb, from `src` (x itself or its producer's
// inputs: mma_common::Source), staged as fp16 x 2^-e by mma_common::stage_scaled:
// scale[sb][r] = 2^e (times a norm's 1 / rms), xq[sb][i][r][c] the B registers of k steps 2i and 2i + 1
// for lane c (fp16 pairs of x 2^-e at the slots' k: b0, b1 of step 2i, then of 2i + 1). r runs to
// `rows_padded` (8 per n-tile); a padded row gets zeros and scale 1.
// One warp's super-block, `staged` its 256 fp16 values; `squares` gets its lane's squares (norms).
__device__ __forceinline__ void prepare_super_block(const mma_common::Source& src, uint4* __restrict__ xq, float* __restrict__ scale,
                                                    __half* staged, int r, int sb, int rows_padded, int lane, float& squares) {
  float v[8], sum;  // sum: unused (Q6_K has no minimums)
  src.values(r, sb, lane, v, squares);
  const float up = mma_common::stage_scaled(v, staged, lane, sum);
  if (lane == 0) scale[static_cast<int64_t>(sb) * rows_padded + r] = up;
  const int c = lane & 3, i = lane >> 2;
  uint32_t b[4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int k = Q6KCommon::k_of(c, 2 * i + t);
    b[2 * t] = bits_h2(__halves2half2(staged[k], staged[k + 2]));
    b[2 * t + 1] = bits_h2(__halves2half2(staged[k + 64], staged[k + 66]));
  }
  xq[((static_cast<int64_t>(sb) * 8 + i) * rows_padded + r) * 4 + c] = make_uint4(b[0], b[1], b[2], b[3]);
}

// A padded row's super-block: zeros (so the kernel loads every row unconditionally), scale 1.
__device__ __forceinline__ void pad_super_block(uint4* __restrict__ xq, float* __restrict__ scale, int r, int sb, int rows_padded, int lane) {
  if (lane == 0) scale[static_cast<int64_t>(sb) * rows_padded + r] = 1.0f;
  xq[((static_cast<int64_t>(sb) * 8 + (lane >> 2)) * rows_padded + r) * 4 + (lane & 3)] = make_uint4(0u, 0u, 0u, 0u);
}

// x's own rows or SwiGLU's activation: one warp a (row, super-block) item.
__global__ void prepare_x_kernel(const mma_common::Source src, uint4* __restrict__ xq, float* __restrict__ scale,
                                 int M, int rows_padded, int super_blocks) {
  __shared__ __half staged[kWarps][256];
  mma_common::let_dependents_start();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int r, sb;
  if (!mma_common::warp_item(rows_padded, super_blocks, r, sb)) return;
  if (r >= M) {
    pad_super_block(xq, scale, r, sb, rows_padded, lane);
    return;
  }
  float squares;
  prepare_super_block(src, xq, scale, staged[warp], r, sb, rows_padded, lane, squares);
}

// A norm's x: a block a row (mma_common::norm_row).
__global__ void prepare_norm_kernel(const mma_common::Source src, uint4* __restrict__ xq, float* __restrict__ scale,
                                    int M, int rows_padded, int super_blocks) {
  mma_common::let_dependents_start();
  const int lane = threadIdx.x & 31, r = blockIdx.x;
  mma_common::norm_row(
      src, scale, M, rows_padded, super_blocks,
      [&](int sb, __half* staged, float& squares) { prepare_super_block(src, xq, scale, staged, r, sb, rows_padded, lane, squares); },
      [&](int sb) { pad_super_block(xq, scale, r, sb, rows_padded, lane); });
}

// x's arrays a super-block, in 16-byte units (one XStages stage; the launch's shared memory): xq 32 a row, xscale 1 / 4.
__host__ __device__ constexpr int x_stage_units(int rows_padded) { return 32 * rows_padded + rows_padded / 4; }

// One super-block of a warp's 16 features into acc: the mma over its 16 k steps and the float32
// step that applies d and x's scale.
// x_sb and scale_sb: super-block sb's part of prepare_x_kernel's arrays, in shared memory (XStages)
// or in global memory.
template <int NB>
__device__ __forceinline__ void accumulate(float (&acc)[NB][4], Q6K<NB> (&f)[2], const uint32_t (&shift)[2],
                                           const bool (&odd)[2], const uint4* x_sb, const float* scale_sb, int g, int c,
                                           uint32_t magic, uint32_t pick_scale, uint32_t magic_scale) {
  constexpr int kRowsPadded = 8 * NB;
  constexpr bool kShared = NB >= X_STAGED_MIN_NB;
  const auto load = [](const auto* p) { return kShared ? *p : __ldg(p); };
#pragma unroll
  for (int i = 0; i < 2; ++i) f[i].prepare(shift[i], odd[i], pick_scale, magic_scale);
  float part[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[nb][e] = 0.0f;
  // x_sb[i][r][c]: lane (g, c)'s B registers of steps 2i and 2i + 1 for row r, the warp's loads
  // of one i and n-tile contiguous.
  x_sb += g * 4 + c;
#pragma unroll
  for (int s = 0; s < 16; s += 2) {
    uint32_t a[4], a2[4];
    f[0].fragment(s, shift[0], magic, a[0], a[2]);
    f[1].fragment(s, shift[1], magic, a[1], a[3]);
    f[0].fragment(s + 1, shift[0], magic, a2[0], a2[2]);
    f[1].fragment(s + 1, shift[1], magic, a2[1], a2[3]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4 b = load(x_sb + (s / 2 * kRowsPadded + 8 * nb) * 4);
      mma_f16(part[nb], a, b.x, b.y);
      mma_f16(part[nb], a2, b.z, b.w);
    }
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float2 sx = load(reinterpret_cast<const float2*>(scale_sb + 8 * nb + 2 * c));
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nb][e] = fmaf(f[e >> 1].d * part[nb][e], (e & 1) ? sx.y : sx.x, acc[nb][e]);
  }
}

// One program: kWarps warps x 16 features, K super-blocks [split's range), NB n-tiles of 8 x rows.
// With splits > 1 each writes float32 partial sums and the last of a tile adds them (add_splits).
// Launch bounds: 3 blocks (168 registers) a multiprocessor at one to three n-tiles (one n-tile
// needs 167 without spills, where the compiler's own choice, 187, would fit only 2); 2 blocks at
// four (25-32 rows), where 3 would spill: 246 registers and no spills made the 27B LM head 1.58x
// faster at 32 rows on an H100 (BENCHMARKS.md, [V1]).
template <int NB, bool kInterleaved>
__global__ void __launch_bounds__(kWarps * 32, NB == 4 ? 2 : 3) q6k_kernel(
    const uint4* __restrict__ xq, const float* __restrict__ xscale, const uint8_t* __restrict__ w,
    __nv_bfloat16* __restrict__ out, float* __restrict__ partial, int* __restrict__ counters, int M, int N,
    int64_t row_bytes, int super_blocks, int splits) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = (blockIdx.x * kWarps + warp) * 16;
  const int split = blockIdx.y;
  const int sb_begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int sb_end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);
  // This lane's two features' first bytes (a warp past N re-reads the last features: its sums are
  // not stored), their super-blocks kStride bytes apart.
  constexpr int kStride = kInterleaved ? 16 * Q6KCommon::kBytes : Q6KCommon::kBytes;
  const uint8_t* rows[2];
  if constexpr (kInterleaved) {  // N % 16 == 0: the warp's 16 features, 210 bytes apart in each super-block
    const uint8_t* tile = w + static_cast<int64_t>(min(n0, N - 16) / 16) * 16 * row_bytes;
    rows[0] = tile + Q6KCommon::kBytes * g;
    rows[1] = tile + Q6KCommon::kBytes * (8 + g);
  } else {
    rows[0] = w + static_cast<int64_t>(min(n0 + g, N - 1)) * row_bytes;
    rows[1] = w + static_cast<int64_t>(min(n0 + 8 + g, N - 1)) * row_bytes;
  }

  float acc[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nb][e] = 0.0f;

  // (splits >> 31 is 0: it only hides the values from the compiler, which would rebuild each
  // constant before every use rather than keep it in a register.)
  const uint32_t hidden = static_cast<uint32_t>(splits) >> 31;
  const uint32_t magic = 0x64006400u | hidden, magic_scale = 0x54005400u | hidden;
  const uint32_t pick_scale = (c & 1) ? 0x5351u : 0x5250u;  // bytes {j, 0x54, j + 2, 0x54} of (scales, magic_scale)
  constexpr int kRowsPadded = 8 * NB;
  const mma_common::XStages<2> x_stages = {{xq, reinterpret_cast<const uint4*>(xscale)},
                                           {32 * kRowsPadded, kRowsPadded / 4}};
  extern __shared__ uint4 x_shared[];
  mma_common::over_super_blocks<Q6K<NB>, kStride>(rows, c, sb_begin, sb_end, [&](Q6K<NB>(&blocks)[2], int sb) {
    // The blocks' address mod 4 (0 or 2 bytes) as the funnel shift that realigns their runs
    // (recomputed here rather than kept per stage: registers are short).
    uint32_t shift[2];
    bool odd[2];  // the block's first word odd: its runs' pairs start a word early
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uintptr_t block = reinterpret_cast<uintptr_t>(rows[i] + static_cast<int64_t>(sb) * kStride);
      shift[i] = static_cast<uint32_t>(block & 2) * 8;
      odd[i] = (block >> 2) & 1;
    }
    if constexpr (NB >= X_STAGED_MIN_NB) {
      const uint4* stage = x_stages.next(x_shared, sb, sb_begin, sb_end);
      accumulate<NB>(acc, blocks, shift, odd, stage, reinterpret_cast<const float*>(stage + 32 * kRowsPadded), g, c,
                     magic, pick_scale, magic_scale);
    } else {
      accumulate<NB>(acc, blocks, shift, odd, xq + static_cast<int64_t>(sb) * 32 * kRowsPadded,
                     xscale + static_cast<int64_t>(sb) * kRowsPadded, g, c, magic, pick_scale, magic_scale);
    }
  });

  mma_common::store_c<NB>(acc, out, partial, counters, M, N, n0, g, c, split, splits);
}

// x's arrays (xq, xscale) for the kernel of NB n-tiles, made from `src`'s M rows.
template <int NB>
std::vector<torch::Tensor> prepare(const mma_common::Source& src, int M, const torch::TensorOptions& options, cudaStream_t stream) {
  const int sbs = src.K / 256, rows_padded = 8 * NB;
  torch::Tensor xq = torch::empty({static_cast<int64_t>(sbs) * rows_padded * 32 * 4}, options.dtype(torch::kInt32));
  torch::Tensor xscale = torch::empty({static_cast<int64_t>(sbs) * rows_padded}, options.dtype(torch::kFloat32));
  uint4* q = reinterpret_cast<uint4*>(xq.data_ptr());
  if (src.is_norm()) {
    prepare_norm_kernel<<<rows_padded, mma_common::norm_threads(sbs), 0, stream>>>(src, q, xscale.data_ptr<float>(), M, rows_padded, sbs);
  } else {
    const int64_t items = static_cast<int64_t>(sbs) * rows_padded;
    prepare_x_kernel<<<(items + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(src, q, xscale.data_ptr<float>(), M, rows_padded, sbs);
  }
  return {xq, xscale};
}

// The matmul of x's M rows (M <= 32), its arrays `prepared` by a producer or made here from x.
template <int NB, bool kInterleaved>
void launch(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, torch::Tensor& partial,
            torch::Tensor& counters, int splits, cudaStream_t stream, const std::vector<torch::Tensor>& prepared) {
  const int M = x.size(0), N = out.size(1), K = x.size(1), sbs = K / 256;
  const int rows_padded = 8 * NB;
  const std::vector<torch::Tensor> arrays = prepared.empty() ? prepare<NB>(mma_common::row_source(x), M, x.options(), stream) : prepared;
  const torch::Tensor &xq = arrays[0], &xscale = arrays[1];
  const int tiles = (N + kWarps * 16 - 1) / (kWarps * 16);
  const size_t shared_bytes = NB >= X_STAGED_MIN_NB ? 2 * sizeof(uint4) * x_stage_units(rows_padded) : 0;  // XStages' two stages
  mma_common::launch_dependent(
      q6k_kernel<NB, kInterleaved>, dim3(tiles, splits), kWarps * 32, shared_bytes, stream, reinterpret_cast<const uint4*>(xq.data_ptr()),
      static_cast<const float*>(xscale.data_ptr<float>()), static_cast<const uint8_t*>(w.data_ptr<uint8_t>()),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), splits > 1 ? partial.data_ptr<float>() : nullptr,
      splits > 1 ? counters.data_ptr<int>() : nullptr, M, N, static_cast<int64_t>(w.stride(0)), sbs, splits);
}

}  // namespace

// x [M, K] bf16 rows 16-byte aligned, w [N, K / 256 * 210] uint8 rows 2-byte aligned (interleaved:
// N % 16 == 0), out [M, N] bf16; partial [splits, >= min(M, 32), N] float32 and counters as q4k_mma's;
// `prepared`: empty, or q6k_prepare's arrays of x (M <= 32).
void q6k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters,
             int64_t splits, bool interleaved, const std::vector<torch::Tensor>& prepared) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  mma_common::by_32_rows(x, out, [&](auto nb, const torch::Tensor& xc, torch::Tensor& oc) {
    if (interleaved) launch<decltype(nb)::value, true>(xc, w, oc, partial, counters, splits, stream, prepared);
    else launch<decltype(nb)::value, false>(xc, w, oc, partial, counters, splits, stream, prepared);
  });
}

// The arrays q6k_mma takes as `prepared`, from `src`'s M rows (M <= 32).
std::vector<torch::Tensor> q6k_prepare(const mma_common::Source& src, int64_t M, const torch::TensorOptions& options) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return mma_common::by_n_tiles(M, [&](auto nb) { return prepare<decltype(nb)::value>(src, M, options, stream); });
}
