// What native/gguf_mma.cu (IQ4_XS), native/gguf_q4k.cu (Q4_K) and native/gguf_q6k.cu (Q6_K) share:
// the block shape, 16-byte weight loads, how split programs of one tile add their partial sums,
// and (the last two) fp16 mma, x staged as fp16 scaled by a power of two, and the launch of the
// matmul as its x preparation's programmatic dependent.

#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef MMA_PDL  // 0: launch each matmul after its x preparation has finished (benchmarks compare)
#define MMA_PDL 1
#endif

namespace mma_common {

constexpr int kWarps = 4;  // warps per block

// A read-only load of weights (p 16-byte aligned) that leaves L1 to x, which every program along
// N reads again: the 23-row Q4_K calls of a 27B verify 2.6% faster in the step, one row the same
// (BENCHMARKS.md, [K1]). An L2::256B prefetch hint as well made the Q4_K kernel 1.02-1.29x faster
// called alone, and its calls in the 27B AR step 7% slower ([V1]). (Q6_K's words lost 2-28% alone
// without L1: its four lanes of a feature read words of the same lines.)
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {  // i a compile-time constant after unrolling
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ __half2 h2_bits(uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); }
__device__ __forceinline__ uint32_t bits_h2(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// D = A B + D, m16n8k16, fp16 operands, float32 accumulators.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One warp stages 256 values (8 a lane, in `v`) in `staged` as fp16 times 2^-e, e being the power
// of two that brings their largest |v| into [2^9, 2^10): bf16's 8-bit significands then fit fp16's
// 11 bits and every 32-value sum fits fp16's range. Returns 2^e; `sum` gets this lane's eight
// staged values added in float32. (e is kept where 2^-e and 2^e are normal floats; inf or NaN
// leave e = 0 and flow through as they are.)
__device__ __forceinline__ float stage_scaled(const float (&v)[8], __half* staged, int lane, float& sum) {
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) largest = fmaxf(largest, fabsf(v[i]));
#pragma unroll
  for (int o = 16; o; o >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xFFFFFFFFu, largest, o));
  // largest in [2^(E-127), 2^(E-126)) for its biased exponent E: e = E - 136.
  const int biased = static_cast<int>(__float_as_uint(largest) >> 23);
  const int e = biased == 255 ? 0 : max(-126, min(126, biased - 136));
  const float down = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
  sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half h = __float2half_rn(v[i] * down);
    staged[8 * lane + i] = h;
    sum += __half2float(h);
  }
  __syncwarp();
  return __uint_as_float(static_cast<uint32_t>(127 + e) << 23);
}

__device__ __forceinline__ void bf16x8(const __nv_bfloat16* p, float (&v)[8]) {  // p 16-byte aligned
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __uint_as_float((i & 1) ? words[i >> 1] & 0xFFFF0000u : words[i >> 1] << 16);  // exact
}

__device__ __forceinline__ uint32_t bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// What x's preparation reads: x itself (kRow), or the values of the launch that would have made x,
// computed here instead (native.gguf_mma.produce), so that launch and its trip through memory go:
// - kSiluMul: SwiGLU's silu(gate) * up from the fused gate/up projection's output `a` [M, 2K]
//   (gate first), rounded as native/silu_mul.py rounds (the SiLU to bf16, then the product);
// - kNorm: RMSNorm(a) * weight; kAddNorm: the same of a + b, rounded to bf16 first and written to
//   `sum` (the residual stream). The norm's 1 / rms is a reduction over the whole row: its
//   preparation runs a block a row (norm_row), whose warps stage x * weight a super-block at a
//   time and meet in shared memory, where 1 / rms is folded into the row's scales, which the
//   matmul already multiplies its sums by. So the matmul is unchanged. (A first form kept one warp
//   a super-block and had the row's last warp to finish fold 1 / rms in after a fence and an
//   atomic: on an H100 its preparations took 4.0 us against 1.8 apart, BENCHMARKS.md [K17].)
enum SourceKind : int { kRow = 0, kSiluMul = 1, kNorm = 2, kAddNorm = 3 };

struct Source {
  const __nv_bfloat16* a;       // x, or gate/up, or the residual's delta
  const __nv_bfloat16* b;       // kAddNorm: the residual
  const __nv_bfloat16* weight;  // norms: [K]
  __nv_bfloat16* sum;           // kAddNorm: a + b [M, K], written (rows contiguous)
  int64_t stride_a, stride_b;   // row strides, in values
  int kind, K;
  float eps;

  __host__ __device__ bool is_norm() const { return kind == kNorm || kind == kAddNorm; }

  // Lane `lane`'s 8 values of row r, super-block sb into v; `squares_part` their squares' sum (norms).
  __device__ __forceinline__ void values(int r, int sb, int lane, float (&v)[8], float& squares_part) const {
    const int k = 256 * sb + 8 * lane;
    bf16x8(a + r * stride_a + k, v);
    squares_part = 0.0f;
    if (kind == kSiluMul) {
      float up[8];
      bf16x8(a + r * stride_a + K + k, up);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float act = __bfloat162float(__float2bfloat16_rn(v[i] / (1.0f + __expf(-v[i]))));
        v[i] = __bfloat162float(__float2bfloat16_rn(act * up[i]));
      }
    } else if (is_norm()) {
      if (kind == kAddNorm) {
        float res[8];
        bf16x8(b + r * stride_b + k, res);
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(v[i] + res[i]));
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = bf16_bits(v[2 * i]) | (bf16_bits(v[2 * i + 1]) << 16);
        *reinterpret_cast<uint4*>(sum + static_cast<int64_t>(r) * K + k) = make_uint4(out[0], out[1], out[2], out[3]);
      }
      float w[8];
      bf16x8(weight + k, w);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        squares_part = fmaf(v[i], v[i], squares_part);
        v[i] *= w[i];
      }
    }
  }
};

// The (row r, super-block sb) item of this warp in a preparation of a warp an item, kWarps a
// block, rows varying fastest; false for a warp past the last item.
__device__ __forceinline__ bool warp_item(int rows_padded, int super_blocks, int& r, int& sb) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(super_blocks) * rows_padded) return false;
  r = static_cast<int>(item % rows_padded);
  sb = static_cast<int>(item / rows_padded);
  return true;
}

constexpr int kNormWarps = 32;  // a norm's row block: up to a warp a super-block (K <= 8192 in one round)

// A norm's preparation, a block a row: the warps of row blockIdx.x take its super-blocks in turn
// (sb = warp, warp + warps, ...), each staging one with `stage(sb, staged, squares_part)` (the
// type's arrays and the scale 2^e written; its lane's squares returned), or, for a padded row
// (>= M), `pad(sb)`. Then the warps' squares meet in shared memory, added in a fixed order (so a
// row's result does not depend on the other rows or on timing), and every scale of the row is
// multiplied by 1 / sqrt(mean square + eps). The block's threads read the scales its warps wrote,
// after the barrier that makes those writes visible to them.
template <typename Stage, typename Pad>
__device__ __forceinline__ void norm_row(const Source& src, float* scale, int M, int rows_padded, int super_blocks,
                                         Stage&& stage, Pad&& pad) {
  __shared__ __half staged[kNormWarps][256];
  __shared__ float warp_squares[kNormWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, r = blockIdx.x;
  if (r >= M) {
    for (int sb = warp; sb < super_blocks; sb += warps) pad(sb);
    return;  // the whole block: no barrier follows for it
  }
  float squares = 0.0f;
  for (int sb = warp; sb < super_blocks; sb += warps) {
    float part;
    stage(sb, staged[warp], part);
    squares += part;
    __syncwarp();  // this super-block's staged values are read before the next overwrites them
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) squares += __shfl_xor_sync(0xFFFFFFFFu, squares, o);
  if (lane == 0) warp_squares[warp] = squares;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += warp_squares[w];
  const float inverse_rms = 1.0f / sqrtf(total / src.K + src.eps);
  for (int sb = threadIdx.x; sb < super_blocks; sb += blockDim.x) scale[static_cast<int64_t>(sb) * rows_padded + r] *= inverse_rms;
}

inline int norm_threads(int super_blocks) { return 32 * std::min(super_blocks, kNormWarps); }

// Programmatic dependent launch (sm_90 on): a matmul is launched while its x preparation runs, so
// its blocks become resident and load their first weights (which do not depend on x) meanwhile,
// and wait for x at wait_for_x(). griddepcontrol.wait returns once the prerequisite grid has
// finished and its writes are visible, so the preparation may let it start at once.
__device__ __forceinline__ void let_dependents_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_x() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, size_t shared_bytes, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute overlap;
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &overlap;
  config.numAttrs = MMA_PDL && at::cuda::getCurrentDeviceProperties()->major >= 9 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

#ifndef X_STAGED_MIN_NB  // the fewest n-tiles whose kernels read x from shared memory (benchmarks compare)
#define X_STAGED_MIN_NB 3
#endif

// x of the A-operand kernels staged in shared memory, one super-block at a time for the whole
// block: x's prepared layout keeps each super-block's part of an array contiguous, so a stage is a
// few contiguous copies, made by cp.async (16 bytes a thread, through L2 only) while the block
// computes the super-block before. Read straight from global memory by every warp, x's loads were
// where the mma stalled in 20-35% of the samples at 23-32 rows (ncu on an H200, 27B Q4_K
// gate/up), and the registers of their 64-bit addresses made the kernels spill. Staged, the 27B
// calls ran 1.0-1.5x faster at 23-32 rows; at 1-16 rows the barrier a super-block cost more than
// it saved (BENCHMARKS.md, [Z2]), so those kernels still read x from global memory.
// `Regions` (x's arrays: a global base and 16-byte units a super-block) are copied into stage
// sb % 2 one after the other; the kernels read them there.
template <int Regions>
struct XStages {
  const uint4* base[Regions];
  int units[Regions];  // 16-byte units a super-block

  __device__ __forceinline__ uint4* stage(uint4* shared, int sb) const {
    int stage_units = 0;
#pragma unroll
    for (int r = 0; r < Regions; ++r) stage_units += units[r];
    return shared + (sb & 1) * stage_units;
  }

  // Every thread of the block: start copying super-block sb's x into its stage.
  __device__ __forceinline__ void fetch(uint4* shared, int sb) const {
    uint4* dst = stage(shared, sb);
#pragma unroll
    for (int r = 0; r < Regions; ++r) {
      const uint4* src = base[r] + static_cast<int64_t>(sb) * units[r];
      for (int i = threadIdx.x; i < units[r]; i += blockDim.x) {
        const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst + i));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src + i) : "memory");
      }
      dst += units[r];
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // Every thread of the block, once a super-block in order from `begin`: wait for sb's stage
  // (fetching it first at `begin`), then start sb + 1's into the other stage, which every warp
  // has finished reading once all have passed the barrier.
  __device__ __forceinline__ uint4* next(uint4* shared, int sb, int begin, int end) const {
    if (sb == begin) fetch(shared, sb);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (sb + 1 < end) fetch(shared, sb + 1);
    return stage(shared, sb);
  }
};

// Called by every thread of a block after it wrote its float32 partial sums of features
// [first, first + tile) to partial[split] ([splits, M, N]): the block that arrives last at its
// tile's counter adds the splits in split order (so the result does not depend on which finished
// first), writes `out` and resets the counter for the next launch (and graph replay).
__device__ __forceinline__ void add_splits(const float* __restrict__ partial, __nv_bfloat16* __restrict__ out,
                                           int* __restrict__ counters, int M, int N, int first, int tile, int splits) {
  __threadfence();  // this block's partial sums are visible before its arrival is counted
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < M * tile; idx += blockDim.x) {
    const int m = idx / tile, n = first + idx % tile;
    if (n >= N) continue;
    float sum = 0.0f;
    for (int sp = 0; sp < splits; ++sp) sum += __ldcg(partial + (static_cast<int64_t>(sp) * M + m) * N + n);
    out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(sum);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

// The A-operand kernels' main loop over super-blocks [begin, end) of a lane's two features (`rows`:
// each feature's first byte, its super-blocks kStride bytes apart): two super-blocks in hand, the
// next one's bytes in flight while one is computed by compute(blocks, sb). Block::load(bytes, c)
// only issues the loads; x is read only after wait_for_x(), so the first loads overlap x's
// preparation. (This loop form ran up to 24% faster on an H200 than an even/odd pair of steps
// written out; three stages ran 4-41% slower.)
template <typename Block, int kStride = Block::kBytes, typename Compute>
__device__ __forceinline__ void over_super_blocks(const uint8_t* const (&rows)[2], int c, int begin, int end,
                                                  Compute&& compute) {
  constexpr int kStages = 2;
  Block buf[kStages][2];
#pragma unroll
  for (int st = 0; st + 1 < kStages; ++st) {
    if (begin + st < end) {
#pragma unroll
      for (int i = 0; i < 2; ++i) buf[st][i].load(rows[i] + static_cast<int64_t>(begin + st) * kStride, c);
    }
  }
  wait_for_x();
  for (int sb0 = begin; sb0 < end; sb0 += kStages) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      const int sb = sb0 + st;
      if (sb >= end) break;
      if (sb + kStages - 1 < end) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
          buf[(st + kStages - 1) % kStages][i].load(rows[i] + static_cast<int64_t>(sb + kStages - 1) * kStride, c);
      }
      compute(buf[st], sb);
    }
  }
}

// Host side of the A-operand kernels: f(nb) for the n-tiles of 8 rows that m rows (1 to 32) take,
// nb a std::integral_constant of 1 to 4.
template <typename F>
auto by_n_tiles(int m, F&& f) {
  if (m <= 8) return f(std::integral_constant<int, 1>{});
  if (m <= 16) return f(std::integral_constant<int, 2>{});
  if (m <= 24) return f(std::integral_constant<int, 3>{});
  return f(std::integral_constant<int, 4>{});
}

// x's rows 32 at a time (a row's result does not depend on the others), each chunk by
// launch(nb, x rows, out rows) with nb its n-tiles (by_n_tiles).
template <typename Launch>
void by_32_rows(const at::Tensor& x, const at::Tensor& out, Launch&& launch) {
  const int M = x.size(0);
  for (int r0 = 0; r0 < M; r0 += 32) {
    const at::Tensor xc = x.narrow(0, r0, std::min(32, M - r0));
    at::Tensor oc = out.narrow(0, r0, xc.size(0));
    by_n_tiles(xc.size(0), [&](auto nb) { launch(nb, xc, oc); });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The Source of x itself (rows 16-byte aligned).
inline Source row_source(const at::Tensor& x) {
  Source src = {};
  src.a = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  src.stride_a = x.stride(0);
  src.kind = kRow;
  src.K = x.size(1);
  return src;
}

// The end of a program of the A-operand kernels (gguf_q4k.cu, gguf_q6k.cu): lane (g, c)'s
// accumulators of NB n-tiles of its warp's 16 features from n0 (C of n-tile nb: features g for
// e < 2, g + 8 for e >= 2; rows 8 nb + 2c + e % 2) into `out`, or with splits > 1 into
// partial[split] and through add_splits. Called by every thread of the block (Warps warps).
template <int NB, int Warps = kWarps>
__device__ __forceinline__ void store_c(const float (&acc)[NB][4], __nv_bfloat16* __restrict__ out, float* __restrict__ partial,
                                        int* __restrict__ counters, int M, int N, int n0, int g, int c, int split, int splits) {
  float* mine = splits == 1 ? nullptr : partial + static_cast<int64_t>(split) * M * N;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 8 * nb + 2 * c + (e & 1), n = n0 + g + 8 * (e >> 1);
      if (m >= M || n >= N) continue;
      if (splits == 1) out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(acc[nb][e]);
      else mine[static_cast<int64_t>(m) * N + n] = acc[nb][e];
    }
  if (splits > 1) add_splits(partial, out, counters, M, N, blockIdx.x * Warps * 16, Warps * 16, splits);
}

}  // namespace mma_common
