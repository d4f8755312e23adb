// What native/gguf_mma.cu (Q6_K, IQ4_XS) and native/gguf_q4k.cu (Q4_K) share: the block shape,
// 16-byte weight loads, and how split programs of one tile add their partial sums.

#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mma_common {

constexpr int kWarps = 4;  // warps per block

__device__ __forceinline__ uint4 load16(const uint8_t* p) {  // p 16-byte aligned
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {  // i a compile-time constant after unrolling
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

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

}  // namespace mma_common
