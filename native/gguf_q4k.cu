// y = x @ W^T for bf16 x [M, K] (M <= 64) and W [N, K] in GGUF Q4_K blocks, on tensor cores with
// the weights as the A operand of mma.sync m16n8k16 (fp16) and x as B. Built with gguf_mma.cu by
// native/gguf_mma.py, which documents the design and its numerics.
//
// One warp: 16 output features (A rows g and g + 8 of lane (g, c)), the x rows as the 8 columns
// of each B tile (n-tile nb: rows 8 nb .. 8 nb + 7), one super-block (256 values) a loop step.
// The weights enter the tensor cores as exact fp16 integers sc * q (at most 63 * 15 = 945): a
// lane ORs two nibbles into 0x6400 (the fp16 1024 + q) and one packed fused multiply-add,
// (1024 + q) * sc - 1024 * sc, leaves sc * q exactly. The super-block's d and the sub-blocks'
// minimums are applied in float32 after each super-block: y += d * sum_k sc_k q_k x_k
// - dmin * sum_j m_j X_j, X_j being the sum of sub-block j's 32 x values, which a second mma
// takes (as fp16 high and low halves) against the minimums. x enters as fp16 scaled by a power
// of two per row and super-block (prepare_x_kernel), undone in the same float32 step.
//
// k map of step s (0..15) for lane c (t = 2 (c / 2) + 4 (s / 8), l0 = 16 (c % 2) + 4 ((s % 8) / 2) + s % 2):
// slots 2c, 2c + 1 take values l0, l0 + 2 of sub-block t, slots 2c + 8, 2c + 9 the same positions
// of sub-block t + 1: the byte pair (l0, l0 + 2) of a word is what one mask selects into the two
// halves of a register, low nibbles (sub-block t) and high ones (t + 1).
//
// W's layout (kInterleaved): the file's, row n the super-blocks of feature n, or interleaved by
// native.gguf_matmul.interleave, [N / 16, super-blocks, 16, 144]: a warp's 16 features of one
// super-block 2,304 contiguous bytes. The interleaved layout ran 1.19-1.24x faster at one row on the
// 27B and 8B layer shapes, bit for bit the same sums (BENCHMARKS.md [V4]).

#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdint>

#include "gguf_mma.cuh"

namespace {

using mma_common::bits_h2;
using mma_common::h2_bits;
using mma_common::kWarps;
using mma_common::load16;
using mma_common::mma_f16;
using mma_common::word_of;

__device__ __forceinline__ uint32_t hfma2_bits(uint32_t a, uint32_t b, uint32_t c) {
  return bits_h2(__hfma2(h2_bits(a), h2_bits(b), h2_bits(c)));
}

// One feature's super-block for lane c: the 16-byte head and two 16-byte runs of its nibbles,
// bytes 16 + 16c .. (half c % 2 of group c / 2) and 80 + 16c .. (the same half of group 2 + c / 2):
// the four lanes of a feature read 64 contiguous bytes a load. Group j (32 bytes) holds sub-block
// 2j in its low nibbles and 2j + 1 in its high ones; value = d * sc * q - dmin * m.
struct Q4K {
  static constexpr int kBytes = 144;
  uint4 head, q0, q1;
  uint32_t scale[4], offset[4];  // fp16 multiplier and addend of sub-blocks t, t + 1, t + 4, t + 5 (see fragment)
  uint32_t mins;                 // fp16 {m_u, m_u + 1}, u = 2 (c / 2) + 4 (c % 2): this lane's share of the minimums
  float d, dmin;

  __device__ __forceinline__ void load(const uint8_t* block, int c) {
    head = load16(block);
    q0 = load16(block + 16 + 16 * c);
    q1 = load16(block + 80 + 16 * c);
  }

  // `pick` (byte selectors, see q4k_kernel) places this lane's 6-bit values in fp16 1024 + v.
  __device__ __forceinline__ void prepare(int c, uint32_t pick_t, uint32_t pick_u, uint32_t magic) {
    d = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x & 0xFFFF)));
    dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x >> 16)));
    // Scale bytes b[i] = head byte 4 + i. Sub-block j < 4: scale b[j] & 63, min b[j + 4] & 63;
    // j >= 4: scale b[j + 4] & 15 | (b[j - 4] >> 6) << 4, min b[j + 4] >> 4 | (b[j] >> 6) << 4.
    // Four at a time, a byte each:
    const uint32_t sc_low = head.y & 0x3F3F3F3Fu, mn_low = head.z & 0x3F3F3F3Fu;
    const uint32_t sc_high = (head.w & 0x0F0F0F0Fu) | ((head.y >> 2) & 0x30303030u);
    const uint32_t mn_high = ((head.w >> 4) & 0x0F0F0F0Fu) | ((head.z >> 2) & 0x30303030u);
    const __half2 bias = h2_bits(0x64006400u);
    const __half2 minus_1024 = h2_bits(0xE400E400u), sixteenth = h2_bits(0x2C002C00u),
                  minus_64 = h2_bits(0xD400D400u);
    // pick_t: bytes t, t (even) or t + 1, t + 1 of a word, each under 0x64; t = 2 (c / 2).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sel = h ? pick_t >> 16 : pick_t & 0xFFFF;
      const uint32_t lo_bits = __byte_perm(sc_low, magic, sel), hi_bits = __byte_perm(sc_high, magic, sel);
      const __half2 lo = __hsub2(h2_bits(lo_bits), bias);  // {sc, sc} of sub-block t + h
      const __half2 hi = __hsub2(h2_bits(hi_bits), bias);  // of sub-block t + 4 + h
      // Sub-blocks t and t + 4 feed low nibbles (h = 0), t + 1 and t + 5 high ones.
      const __half2 sc_a = h ? __hmul2(lo, sixteenth) : lo, off_a = __hmul2(lo, h ? minus_64 : minus_1024);
      const __half2 sc_b = h ? __hmul2(hi, sixteenth) : hi, off_b = __hmul2(hi, h ? minus_64 : minus_1024);
      scale[h] = bits_h2(sc_a);
      offset[h] = bits_h2(off_a);
      scale[2 + h] = bits_h2(sc_b);
      offset[2 + h] = bits_h2(off_b);
    }
    const uint32_t min_bits = __byte_perm((c & 1) ? mn_high : mn_low, magic, pick_u);
    const __half2 m = __hsub2(h2_bits(min_bits), bias);  // {m_u, m_u+1}
    mins = bits_h2(m);
  }

  // Registers a (slots 2c, 2c + 1) and b (slots 2c + 8, 2c + 9) of k step s: fp16 sc * q. The high
  // nibbles are taken in place (fp16 1024 + 16 q) against {sc / 16, -64 sc}, which saves a shift;
  // `low`, `high` and `magic` are 0x000F000F, 0x00F000F0 and 0x64006400 in registers the compiler
  // does not fold back into immediates (a LOP3 takes one).
  __device__ __forceinline__ void fragment(int s, uint32_t low, uint32_t high, uint32_t magic, uint32_t& a, uint32_t& b) const {
    const uint32_t word = word_of(s < 8 ? q0 : q1, (s & 7) >> 1) >> (8 * (s & 1));
    const int t = s < 8 ? 0 : 2;
    a = hfma2_bits((word & low) | magic, scale[t], offset[t]);
    b = hfma2_bits((word & high) | magic, scale[t + 1], offset[t + 1]);
  }

  __host__ __device__ __forceinline__ static int k_of(int c, int s) {  // the real k of slot 2c of step s (2c + 1: k + 2)
    return 32 * (2 * (c >> 1) + 4 * (s >> 3)) + 16 * (c & 1) + 4 * ((s & 7) >> 1) + (s & 1);
  }
};

// x for the kernel below, per row r and super-block sb, from `src` (x itself or its producer's
// inputs: mma_common::Source), staged as fp16 x 2^-e by mma_common::stage_scaled (so fp16 holds
// every value and every 32-value sum): scale[sb][r] = 2^e (times a norm's 1 / rms), xq[sb][i][r][c]
// the B registers of k steps 2i and 2i + 1 for lane c (fp16 pairs of x 2^-e at the slots' k),
// xs[sb][r][c] the fp16 {high, low} parts of the sums X_u, X_u + 1 of this lane's minimum slots
// (u as in Q4K::mins). r runs to `rows_padded` (8 per n-tile); a padded row only gets scale 1.
// One warp's super-block, `staged` its 256 fp16 values; `squares` gets its lane's squares (norms).
__device__ __forceinline__ void prepare_super_block(const mma_common::Source& src, uint2* __restrict__ xq, uint2* __restrict__ xs,
                                                    float* __restrict__ scale, __half* staged, int r, int sb, int rows_padded,
                                                    int lane, float& squares) {
  float v[8], sum;
  src.values(r, sb, lane, v, squares);
  const float up = mma_common::stage_scaled(v, staged, lane, sum);
  // Sub-block j = lanes 4j .. 4j + 3: add their sums in a fixed order.
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
  if (lane == 0) scale[static_cast<int64_t>(sb) * rows_padded + r] = up;
  for (int idx = lane; idx < 64; idx += 32) {
    const int s = idx >> 2, c = idx & 3;
    const int k = Q4K::k_of(c, s);
    const __half2 lo = __halves2half2(staged[k], staged[k + 2]), hi = __halves2half2(staged[k + 32], staged[k + 34]);
    xq[((static_cast<int64_t>(sb) * 8 + (s >> 1)) * rows_padded + r) * 8 + 2 * c + (s & 1)] =
        make_uint2(bits_h2(lo), bits_h2(hi));
  }
  // Lanes 4j .. 4j + 3 hold sub-block j's sum; lane c of the kernel takes u = 2 (c / 2) + 4 (c % 2), u + 1.
  const int u = 2 * ((lane >> 1) & 1) + 4 * (lane & 1);
  const float su = __shfl_sync(0xFFFFFFFFu, sum, 4 * u), sv = __shfl_sync(0xFFFFFFFFu, sum, 4 * u + 4);
  if (lane < 4) {
    const __half uh = __float2half_rn(su), vh = __float2half_rn(sv);
    const __half2 high = __halves2half2(uh, vh);
    const __half2 low = __halves2half2(__float2half_rn(su - __half2float(uh)), __float2half_rn(sv - __half2float(vh)));
    xs[(static_cast<int64_t>(sb) * rows_padded + r) * 4 + lane] =
        make_uint2(bits_h2(high), bits_h2(low));
  }
}

// x's own rows or SwiGLU's activation: one warp a (row, super-block) item.
__global__ void prepare_x_kernel(const mma_common::Source src, uint2* __restrict__ xq, uint2* __restrict__ xs,
                                 float* __restrict__ scale, int M, int rows_padded, int super_blocks) {
  __shared__ __half staged[kWarps][256];
  mma_common::let_dependents_start();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int r, sb;
  if (!mma_common::warp_item(rows_padded, super_blocks, r, sb)) return;
  if (r >= M) {  // a padded row: its B registers are zeros, its scale must be finite
    if (lane == 0) scale[static_cast<int64_t>(sb) * rows_padded + r] = 1.0f;
    return;
  }
  float squares;
  prepare_super_block(src, xq, xs, scale, staged[warp], r, sb, rows_padded, lane, squares);
}

// A norm's x: a block a row (mma_common::norm_row).
__global__ void prepare_norm_kernel(const mma_common::Source src, uint2* __restrict__ xq, uint2* __restrict__ xs,
                                    float* __restrict__ scale, int M, int rows_padded, int super_blocks) {
  mma_common::let_dependents_start();
  const int lane = threadIdx.x & 31, r = blockIdx.x;
  mma_common::norm_row(
      src, scale, M, rows_padded, super_blocks,
      [&](int sb, __half* staged, float& squares) { prepare_super_block(src, xq, xs, scale, staged, r, sb, rows_padded, lane, squares); },
      [&](int sb) {
        if (lane == 0) scale[static_cast<int64_t>(sb) * rows_padded + r] = 1.0f;
      });
}

// x's arrays a super-block, in 16-byte units (one XStages stage; the launch's shared memory): xq 32 a row, xs 2, xscale 1 / 4.
__host__ __device__ constexpr int x_stage_units(int rows_padded) { return 32 * rows_padded + 2 * rows_padded + rows_padded / 4; }

// One super-block of a warp's 16 features into acc: the mma over its 16 k steps, the minimums' mma,
// and the float32 step that applies d, dmin and x's scale.
// x_sb, xs_sb and scale_sb: super-block sb's part of prepare_x_kernel's arrays, in shared memory
// (XStages) or in global memory.
template <int NB>
__device__ __forceinline__ void accumulate(float (&acc)[NB][4], Q4K (&f)[2], const uint4* x_sb, const uint2* xs_sb,
                                           const float* scale_sb, int M, int g, int c, uint32_t low, uint32_t high,
                                           uint32_t magic, uint32_t pick_t, uint32_t pick_u) {
  constexpr int kRowsPadded = 8 * NB;
  constexpr bool kShared = NB >= X_STAGED_MIN_NB;
  const auto load = [](const auto* p) { return kShared ? *p : __ldg(p); };
#pragma unroll
  for (int i = 0; i < 2; ++i) f[i].prepare(c, pick_t, pick_u, magic);
  float part[NB][4], by_min[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[nb][e] = by_min[nb][e] = 0.0f;
  // x_sb[i][r][c]: lane (g, c)'s B registers of steps 2i and 2i + 1 for row r (a uint4), the
  // warp's loads of one i and n-tile contiguous.
  x_sb += g * 4 + c;
#pragma unroll
  for (int s = 0; s < 16; s += 2) {
    uint32_t a[4], a2[4];
    f[0].fragment(s, low, high, magic, a[0], a[2]);
    f[1].fragment(s, low, high, magic, a[1], a[3]);
    f[0].fragment(s + 1, low, high, magic, a2[0], a2[2]);
    f[1].fragment(s + 1, low, high, magic, a2[1], a2[3]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4 b = 8 * nb + g < M ? load(x_sb + (s / 2 * kRowsPadded + 8 * nb) * 4) : make_uint4(0u, 0u, 0u, 0u);
      mma_f16(part[nb], a, b.x, b.y);
      mma_f16(part[nb], a2, b.z, b.w);
    }
  }
  const uint32_t m[4] = {f[0].mins, f[1].mins, f[0].mins, f[1].mins};
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int r = 8 * nb + g;
    const uint2 b = r < M ? load(xs_sb + r * 4 + c) : make_uint2(0u, 0u);
    mma_f16(by_min[nb], m, b.x, b.y);
    const float2 sx = load(reinterpret_cast<const float2*>(scale_sb + 8 * nb + 2 * c));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Q4K& h = f[e >> 1];
      const float t = fmaf(h.d, part[nb][e], -h.dmin * by_min[nb][e]);
      acc[nb][e] = fmaf(t, (e & 1) ? sx.y : sx.x, acc[nb][e]);
    }
  }
}

// Warps a block of q4k_kernel: from three n-tiles (17-32 rows) on interleaved blocks, six warps
// share each staged super-block of x, so a multiprocessor stages x once for 96 features, not 64
// (x's bytes into it from 1.4 to 0.95 of its weights' at 23 rows); that ran 8-17% faster at 23-32 rows on the 27B layer shapes
// and 12-14% slower at 1-8 rows (H100, BENCHMARKS.md [K10]).
template <int NB, bool kInterleaved>
constexpr int q4k_warps() { return kInterleaved && NB >= 3 ? 6 : kWarps; }

// One program: W warps x 16 features, K super-blocks [split's range), NB n-tiles of 8 x rows.
// With splits > 1 each writes float32 partial sums and the last of a tile adds them (add_splits).
// At one n-tile the compiler's own register choice (about 130) ran fastest on an H200; from two
// on, a cap of 168 registers (12 warps a multiprocessor) did (BENCHMARKS.md, the ninth session's probes).
template <int NB, bool kInterleaved, int W = q4k_warps<NB, kInterleaved>()>
__global__ void __launch_bounds__(W * 32, NB == 1 ? 1 : 12 / W) q4k_kernel(
    const uint2* __restrict__ xq, const uint2* __restrict__ xs, const float* __restrict__ xscale,
    const uint8_t* __restrict__ w, __nv_bfloat16* __restrict__ out, float* __restrict__ partial,
    int* __restrict__ counters, int M, int N, int64_t row_bytes, int super_blocks, int splits) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = (blockIdx.x * W + warp) * 16;
  const int split = blockIdx.y;
  const int sb_begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int sb_end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);
  // This lane's two features' first bytes (a warp past N re-reads the last features: its sums are not stored).
  const uint8_t* rows[2];
  if constexpr (kInterleaved) {  // N % 16 == 0: the warp's 16 features, 144 bytes apart in each super-block
    const uint8_t* tile = w + static_cast<int64_t>(min(n0, N - 16) / 16) * 16 * row_bytes;
    rows[0] = tile + 144 * g;
    rows[1] = tile + 144 * (8 + g);
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
  const uint32_t low = 0x000F000Fu | hidden, high = 0x00F000F0u | hidden, magic = 0x64006400u | hidden;
  // __byte_perm selectors over (word, magic), magic's byte 1 (selector 5) being 0x64: bytes
  // {t, 0x64, t, 0x64} and {t + 1, 0x64, t + 1, 0x64} in the low and high 16 bits of pick_t
  // (t = 2 (c / 2)), {t, 0x64, t + 1, 0x64} in pick_u.
  const uint32_t t = 2 * (c >> 1);
  const uint32_t pick_t = (0x5050u | t | (t << 8)) | ((0x5050u | (t + 1) | ((t + 1) << 8)) << 16);
  const uint32_t pick_u = 0x5050u | t | ((t + 1) << 8);
  constexpr int kRowsPadded = 8 * NB;
  const mma_common::XStages<3> x_stages = {{reinterpret_cast<const uint4*>(xq), reinterpret_cast<const uint4*>(xs),
                                            reinterpret_cast<const uint4*>(xscale)},
                                           {32 * kRowsPadded, 2 * kRowsPadded, kRowsPadded / 4}};
  extern __shared__ uint4 x_shared[];
  mma_common::over_super_blocks<Q4K, kInterleaved ? 16 * Q4K::kBytes : Q4K::kBytes>(rows, c, sb_begin, sb_end, [&](Q4K(&blocks)[2], int sb) {
    if constexpr (NB >= X_STAGED_MIN_NB) {
      const uint4* stage = x_stages.next(x_shared, sb, sb_begin, sb_end);
      accumulate<NB>(acc, blocks, stage, reinterpret_cast<const uint2*>(stage + 32 * kRowsPadded),
                     reinterpret_cast<const float*>(stage + 34 * kRowsPadded), M, g, c, low, high, magic, pick_t, pick_u);
    } else {
      accumulate<NB>(acc, blocks, reinterpret_cast<const uint4*>(xq) + static_cast<int64_t>(sb) * 32 * kRowsPadded,
                     xs + static_cast<int64_t>(sb) * 4 * kRowsPadded, xscale + static_cast<int64_t>(sb) * kRowsPadded,
                     M, g, c, low, high, magic, pick_t, pick_u);
    }
  });

  mma_common::store_c<NB, W>(acc, out, partial, counters, M, N, n0, g, c, split, splits);
}

// x's arrays (xq, xs, xscale) for the kernel of NB n-tiles, made from `src`'s M rows.
template <int NB>
std::vector<torch::Tensor> prepare(const mma_common::Source& src, int M, const torch::TensorOptions& options, cudaStream_t stream) {
  const int sbs = src.K / 256, rows_padded = 8 * NB;
  auto opts = options.dtype(torch::kInt32);
  torch::Tensor xq = torch::empty({static_cast<int64_t>(sbs) * rows_padded * 64 * 2}, opts);
  torch::Tensor xs = torch::empty({static_cast<int64_t>(sbs) * rows_padded * 4 * 2}, opts);
  torch::Tensor xscale = torch::empty({static_cast<int64_t>(sbs) * rows_padded}, options.dtype(torch::kFloat32));
  uint2* q = reinterpret_cast<uint2*>(xq.data_ptr());
  uint2* sums = reinterpret_cast<uint2*>(xs.data_ptr());
  if (src.is_norm()) {
    prepare_norm_kernel<<<rows_padded, mma_common::norm_threads(sbs), 0, stream>>>(src, q, sums, xscale.data_ptr<float>(), M, rows_padded, sbs);
  } else {
    const int64_t items = static_cast<int64_t>(sbs) * rows_padded;
    prepare_x_kernel<<<(items + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(src, q, sums, xscale.data_ptr<float>(), M, rows_padded, sbs);
  }
  return {xq, xs, xscale};
}

// The matmul of x's M rows (M <= 32), its arrays `prepared` by a producer or made here from x.
template <int NB, bool kInterleaved>
void launch(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, torch::Tensor& partial,
            torch::Tensor& counters, int splits, cudaStream_t stream, const std::vector<torch::Tensor>& prepared) {
  const int M = x.size(0), N = out.size(1), K = x.size(1), sbs = K / 256;
  const int rows_padded = 8 * NB;
  const std::vector<torch::Tensor> arrays = prepared.empty() ? prepare<NB>(mma_common::row_source(x), M, x.options(), stream) : prepared;
  const torch::Tensor &xq = arrays[0], &xs = arrays[1], &xscale = arrays[2];
  constexpr int W = q4k_warps<NB, kInterleaved>();
  const int tiles = (N + W * 16 - 1) / (W * 16);
  const size_t shared_bytes = NB >= X_STAGED_MIN_NB ? 2 * sizeof(uint4) * x_stage_units(rows_padded) : 0;  // XStages' two stages
  mma_common::launch_dependent(
      q4k_kernel<NB, kInterleaved>, dim3(tiles, splits), W * 32, shared_bytes, stream, reinterpret_cast<const uint2*>(xq.data_ptr()),
      reinterpret_cast<const uint2*>(xs.data_ptr()), static_cast<const float*>(xscale.data_ptr<float>()),
      static_cast<const uint8_t*>(w.data_ptr<uint8_t>()), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
      splits > 1 ? partial.data_ptr<float>() : nullptr, splits > 1 ? counters.data_ptr<int>() : nullptr, M, N,
      static_cast<int64_t>(w.stride(0)), sbs, splits);
}

}  // namespace

// Called by gguf_mma() (native/gguf_mma.cu), which checks shapes and alignment: x [M, K] bf16 rows
// 16-byte aligned, w [N, K / 256 * 144] uint8 (interleaved: N % 16 == 0), out [M, N] bf16;
// partial [splits, >= 32, N] float32 and counters as there; `prepared`: empty, or q4k_prepare's
// arrays of x (M <= 32).
void q4k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters,
             int64_t splits, bool interleaved, const std::vector<torch::Tensor>& prepared) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  mma_common::by_32_rows(x, out, [&](auto nb, const torch::Tensor& xc, torch::Tensor& oc) {
    if (interleaved) launch<decltype(nb)::value, true>(xc, w, oc, partial, counters, splits, stream, prepared);
    else launch<decltype(nb)::value, false>(xc, w, oc, partial, counters, splits, stream, prepared);
  });
}

// The arrays q4k_mma takes as `prepared`, from `src`'s M rows (M <= 32).
std::vector<torch::Tensor> q4k_prepare(const mma_common::Source& src, int64_t M, const torch::TensorOptions& options) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return mma_common::by_n_tiles(M, [&](auto nb) { return prepare<decltype(nb)::value>(src, M, options, stream); });
}
