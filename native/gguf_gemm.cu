// y = x @ W^T for bf16 x [M, K] of many rows and W [N, K] in GGUF Q4_K or Q6_K blocks: a tiled GEMM
// whose weight tile is expanded from the blocks in shared memory. Built with gguf_mma.cu by
// native/gguf_mma.py; native/gguf_gemm.py documents the design and its numerics.
//
// A block: 128 features x BM rows of x, 8 warps, K in steps of half a super-block (128 values).
// The raw bytes of a super-block of the 128 features arrive by cp.async a super-block ahead, x's
// 128 values of the BM rows a step ahead; every thread expands a quarter super-block of one
// feature to bf16 into the half tile, and the warps multiply it by x's on mma.sync m16n8k16
// (bf16), both operands read by ldmatrix. Tiles of 128 bf16 a row are stored with 16-byte unit u
// of row r at u ^ (r % 8), so the eight rows an ldmatrix phase reads, and the eight features a
// phase of the expansion writes, fall in distinct banks.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;   // 8 warps
constexpr int kFeatures = 128;  // W rows (output features) a block
constexpr int kHalfUnits = 16;  // 16-byte units of a row of a half tile (128 bf16 values)

__device__ __forceinline__ uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// cp.async of `bytes` (16 or 4) with the source's first `valid` bytes, zeros after them.
template <int Bytes>
__device__ __forceinline__ void copy_async(uint32_t dst, const void* src, int valid) {
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid) : "memory");
}

__device__ __forceinline__ int swizzled(int row, int unit) { return row * kHalfUnits + (unit ^ (row & 7)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte i of `word` minus `offset`, as an exact float (2^23 + byte by its bits, then the subtraction).
__device__ __forceinline__ float byte_f32(uint32_t word, int i, float offset) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + i)) - (8388608.0f + offset);
}

__device__ __forceinline__ float f16_f32(uint32_t bits) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits))); }

// Four bytes of `quads` (one nibble or 6-bit value each, values l .. l + 3) expanded as D q - M
// (Q4_K) or D (q - 32) (Q6_K, M unused) into two bf16 pairs.
template <bool Q6>
__device__ __forceinline__ uint2 expand4(uint32_t quads, float D, float M) {
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = Q6 ? D * byte_f32(quads, i, 32.0f) : fmaf(D, byte_f32(quads, i, 0.0f), -M);
  return make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
}

// Q4_K: 144-byte super-blocks (f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes
// of nibbles: 32-byte group j holds sub-block 2j in its low nibbles, 2j + 1 in its high ones);
// value = (d sc) q - dmin m, as native/gguf_blocks.py computes it in float32.
struct Q4K {
  static constexpr int kRawBytes = 144;  // a feature's bytes in a stage: its super-block, 9 units
  static constexpr int kBlockBytes = 144;

  __device__ __forceinline__ static void fetch(uint8_t* stage, const uint8_t* w, int64_t row_bytes, int n0, int N, int sb) {
    for (int i = threadIdx.x; i < kFeatures * 9; i += kThreads) {
      const int f = i / 9, u = i % 9;
      const uint8_t* src = w + static_cast<int64_t>(min(n0 + f, N - 1)) * row_bytes + static_cast<int64_t>(sb) * kBlockBytes + 16 * u;
      copy_async<16>(shared_address(stage + f * kRawBytes + 16 * u), src, 16);
    }
  }

  // Thread (f, p): group 2 h + p of feature f (sub-blocks 4 h + 2 p in its low nibbles and the
  // next in its high ones: values 64 p .. 64 p + 63 of half h) into row f of the half tile.
  __device__ __forceinline__ static void expand(const uint8_t* stage, uint4* tile, int h, const uint8_t*, int64_t, int, int, int) {
    const int f = threadIdx.x % kFeatures, p = threadIdx.x / kFeatures;
    const uint4* raw = reinterpret_cast<const uint4*>(stage + f * kRawBytes);
    const uint4 head = raw[0];
    const float d = f16_f32(head.x & 0xFFFF), dmin = f16_f32(head.x >> 16);
    // Scale bytes b[i] = head byte 4 + i: sub-block j < 4 has scale b[j] & 63, min b[j + 4] & 63;
    // j >= 4 scale b[j + 4] & 15 | (b[j - 4] >> 6) << 4, min b[j + 4] >> 4 | (b[j] >> 6) << 4.
    // Byte i of sc and mn: sub-block 4 h + i.
    const uint32_t sc = h == 0 ? head.y & 0x3F3F3F3Fu : (head.w & 0x0F0F0F0Fu) | ((head.y >> 2) & 0x30303030u);
    const uint32_t mn = h == 0 ? head.z & 0x3F3F3F3Fu : ((head.w >> 4) & 0x0F0F0F0Fu) | ((head.z >> 2) & 0x30303030u);
    const float d_lo = d * static_cast<float>((sc >> (16 * p)) & 0xFF), m_lo = dmin * static_cast<float>((mn >> (16 * p)) & 0xFF);
    const float d_hi = d * static_cast<float>((sc >> (16 * p + 8)) & 0xFF), m_hi = dmin * static_cast<float>((mn >> (16 * p + 8)) & 0xFF);
#pragma unroll
    for (int q16 = 0; q16 < 2; ++q16) {  // values 16 q16 .. 16 q16 + 15 of the two sub-blocks
      const uint4 q = raw[1 + 2 * (2 * h + p) + q16];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // 8 values: one 16-byte unit of each sub-block
        const uint2 lo0 = expand4<false>(words[2 * half] & 0x0F0F0F0Fu, d_lo, m_lo);
        const uint2 lo1 = expand4<false>(words[2 * half + 1] & 0x0F0F0F0Fu, d_lo, m_lo);
        const uint2 hi0 = expand4<false>((words[2 * half] >> 4) & 0x0F0F0F0Fu, d_hi, m_hi);
        const uint2 hi1 = expand4<false>((words[2 * half + 1] >> 4) & 0x0F0F0F0Fu, d_hi, m_hi);
        const int unit = 2 * q16 + half;  // of the sub-block's 4
        tile[swizzled(f, 8 * p + unit)] = make_uint4(lo0.x, lo0.y, lo1.x, lo1.y);
        tile[swizzled(f, 8 * p + 4 + unit)] = make_uint4(hi0.x, hi0.y, hi1.x, hi1.y);
      }
    }
  }
};

// Q6_K: 210-byte super-blocks, 2-byte aligned only: a stage holds the 212 bytes from the 4-byte
// word that holds the first (53 words; an odd count keeps a warp's word reads of 32 features in
// distinct banks), the super-block starting `shift` (0 or 2) bytes in. Value v = 128 h + 32 r + l
// has its low 4 bits in nibble r / 2 of byte 64 h + 32 (r % 2) + l, its high 2 bits at bit 2 r of
// byte 128 + 32 h + l and int8 scale v / 16 at byte 192 + v / 16; f16 d at 208;
// value = (d sc) (q - 32), as native/gguf_blocks.py computes it in float32.
struct Q6K {
  static constexpr int kRawBytes = 212;
  static constexpr int kBlockBytes = 210;

  __device__ __forceinline__ static const uint8_t* block(const uint8_t* w, int64_t row_bytes, int n, int sb) {
    return w + static_cast<int64_t>(n) * row_bytes + static_cast<int64_t>(sb) * kBlockBytes;
  }

  __device__ __forceinline__ static void fetch(uint8_t* stage, const uint8_t* w, int64_t row_bytes, int n0, int N, int sb) {
    const uint8_t* end = w + static_cast<int64_t>(N) * row_bytes;
    for (int i = threadIdx.x; i < kFeatures * 53; i += kThreads) {
      const int f = i / 53, u = i % 53;
      const uint8_t* first = block(w, row_bytes, min(n0 + f, N - 1), sb);
      const uint8_t* src = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{3}) + 4 * u;
      const int valid = static_cast<int>(end - src < 4 ? end - src : 4);  // the last word may pass the tensor's end
      copy_async<4>(shared_address(stage + f * kRawBytes + 4 * u), valid > 0 ? src : first, max(valid, 0));
    }
  }

  // Thread (f, p): values 128 h + 32 r + l for r = p (low nibbles of bytes 64 h + 32 p + l) and
  // r = p + 2 (their high nibbles) of feature f into row f of the half tile.
  __device__ __forceinline__ static void expand(const uint8_t* stage, uint4* tile, int h, const uint8_t* w, int64_t row_bytes, int n0,
                                                int N, int sb) {
    const int f = threadIdx.x % kFeatures, p = threadIdx.x / kFeatures;
    const uint32_t* raw = reinterpret_cast<const uint32_t*>(stage + f * kRawBytes);
    const uint32_t shift = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(block(w, row_bytes, min(n0 + f, N - 1), sb)) & 3);
    const uint32_t sel = shift ? 0x5432u : 0x3210u;
    const auto word = [&](int byte) { return __byte_perm(raw[byte / 4], raw[byte / 4 + 1], sel); };  // bytes byte .. byte + 3
    const float d = f16_f32(word(208) & 0xFFFF);
    const uint32_t scale_words[2] = {word(192 + 8 * h), word(196 + 8 * h)};  // scales 8 h + j, j = 2 r + (l >= 16)
    const auto scale = [&](int j) { return d * static_cast<float>(static_cast<int8_t>((scale_words[j / 4] >> (8 * (j % 4))) & 0xFF)); };
    const float D[2][2] = {{scale(2 * p), scale(2 * p + 1)}, {scale(2 * p + 4), scale(2 * p + 5)}};  // [r = p, p + 2][l >= 16]
#pragma unroll
    for (int wi = 0; wi < 8; wi += 2) {  // values l = 4 wi .. 4 wi + 7: one 16-byte unit of each r
      uint32_t a[2], c[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        a[e] = word(64 * h + 32 * p + 4 * (wi + e));
        c[e] = word(128 + 32 * h + 4 * (wi + e)) >> (2 * p);  // bits 2 r of r = p at bits 0, 1; of r = p + 2 at bits 4, 5
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {  // r = p + 2 rr
        uint2 v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t quads = rr == 0 ? (a[e] & 0x0F0F0F0Fu) | ((c[e] << 4) & 0x30303030u) : ((a[e] >> 4) & 0x0F0F0F0Fu) | (c[e] & 0x30303030u);
          v[e] = expand4<true>(quads, D[rr][wi >= 4], 0.0f);
        }
        tile[swizzled(f, 4 * (p + 2 * rr) + wi / 2)] = make_uint4(v[0].x, v[0].y, v[1].x, v[1].y);
      }
    }
  }
};

// Shared memory: raw stages of whole super-blocks (two), x stages of half super-blocks (two: 128
// values of BM rows) and one half tile of weights (128 features x 128 values, bf16): about 100 KB
// for Q4_K, so two blocks share a multiprocessor and one expands while the other multiplies.
template <typename Block, int BM>
struct Layout {
  static constexpr int kRawStage = kFeatures * Block::kRawBytes;
  static constexpr int kXStage = BM * kHalfUnits * 16;
  static constexpr int kRaw = 0;
  static constexpr int kX = kRaw + 2 * kRawStage;
  static constexpr int kTile = kX + 2 * kXStage;
  static constexpr int kBytes = kTile + kFeatures * kHalfUnits * 16;
  static constexpr int kBlocksPerSM = 2 * (kBytes + 1024) <= 228 * 1024 ? 2 : 1;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid: (row tiles of BM, feature tiles of 128, splits of K). Steps of half a super-block: step t
// expands half t % 2 of super-block t / 2 and multiplies it. With splits > 1 each block writes
// float32 partial sums [splits, M, N] and the last of a tile to arrive adds them in split order.
template <typename Block, int BM>
__global__ void __launch_bounds__(kThreads, Layout<Block, BM>::kBlocksPerSM) gemm_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w, int64_t row_bytes,
    __nv_bfloat16* __restrict__ out, float* __restrict__ partial, int* __restrict__ counters, int M, int N, int super_blocks,
    int splits) {
  using L = Layout<Block, BM>;
  constexpr int kWarpsRows = BM / 32;                  // warps along x's rows, 32 rows each
  constexpr int kWarpsFeatures = 8 / kWarpsRows;       // along features
  constexpr int MT = kFeatures / kWarpsFeatures / 16;  // m16 tiles of features a warp
  constexpr int NT = 4;                                // n8 tiles of rows a warp
  extern __shared__ __align__(16) uint8_t smem[];
  uint4* tile = reinterpret_cast<uint4*>(smem + L::kTile);

  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * kFeatures, split = blockIdx.z;
  const int begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int f_warp = (warp % kWarpsFeatures) * MT * 16, r_warp = (warp / kWarpsFeatures) * 32;

  const auto fetch_raw = [&](int sb) { Block::fetch(smem + L::kRaw + (sb & 1) * L::kRawStage, w, row_bytes, n0, N, sb); };
  const auto fetch_x = [&](int t) {  // half t % 2 of super-block t / 2
    uint8_t* xs = smem + L::kX + (t & 1) * L::kXStage;
    for (int i = threadIdx.x; i < BM * kHalfUnits; i += kThreads) {
      const int r = i / kHalfUnits, u = i % kHalfUnits;
      const bool valid = m0 + r < M;
      const __nv_bfloat16* src = x + (valid ? (m0 + r) * x_stride + 128 * static_cast<int64_t>(t) + 8 * u : 0);
      copy_async<16>(shared_address(xs + 16 * swizzled(r, u)), src, valid ? 16 : 0);
    }
  };

  float acc[MT][NT][4] = {};
  fetch_raw(begin);
  fetch_x(2 * begin);
  asm volatile("cp.async.commit_group;" ::: "memory");
  for (int t = 2 * begin; t < 2 * end; ++t) {
    const int sb = t >> 1, h = t & 1;
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    // Stages t (x) and sb (raw) are in; every warp is done with the tile and x's other stage, and
    // (h = 0) with the raw stage of sb - 1.
    __syncthreads();
    if (t + 1 < 2 * end) fetch_x(t + 1);
    if (h == 0 && sb + 1 < end) fetch_raw(sb + 1);
    asm volatile("cp.async.commit_group;" ::: "memory");
    Block::expand(smem + L::kRaw + (sb & 1) * L::kRawStage, tile, h, w, row_bytes, n0, N, sb);
    __syncthreads();
    const uint32_t xs = shared_address(smem + L::kX + (t & 1) * L::kXStage), ws = shared_address(tile);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], ws + 16 * swizzled(f_warp + 16 * mt + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t r[4];
        ldmatrix_x4(r, xs + 16 * swizzled(r_warp + 16 * np + (lane & 7) + 8 * (lane >> 4), 2 * ks + ((lane >> 3) & 1)));
        b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }

  // C of (mt, nt): lane (g, c) holds features g (e < 2) and g + 8 (e >= 2), rows 2c + e % 2.
  const int g = lane >> 2, c = lane & 3;
  float* mine = splits == 1 ? nullptr : partial + static_cast<int64_t>(split) * M * N;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + r_warp + 8 * nt + 2 * c + (e & 1), n = n0 + f_warp + 16 * mt + g + 8 * (e >> 1);
        if (m >= M || n >= N) continue;
        if (splits == 1) out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(acc[mt][nt][e]);
        else mine[static_cast<int64_t>(m) * N + n] = acc[mt][nt][e];
      }
  if (splits == 1) return;
  __threadfence();  // this block's partial sums are visible before its arrival is counted
  __syncthreads();
  __shared__ bool last;
  int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < BM * kFeatures; i += kThreads) {
    const int m = m0 + i / kFeatures, n = n0 + i % kFeatures;
    if (m >= M || n >= N) continue;
    float sum = 0.0f;
    for (int sp = 0; sp < splits; ++sp) sum += __ldcg(partial + (static_cast<int64_t>(sp) * M + m) * N + n);
    out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(sum);
  }
  if (threadIdx.x == 0) *counter = 0;  // for the next launch (and graph replay)
}

template <typename Block, int BM>
void launch(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, torch::Tensor& partial, torch::Tensor& counters,
            int splits) {
  const auto kernel = gemm_kernel<Block, BM>;
  constexpr int kBytes = Layout<Block, BM>::kBytes;
  static bool configured[64] = {};  // per device: the attribute is set for the current one
  const int device = x.get_device();
  TORCH_CHECK(device < 64, "gguf_gemm: device index ", device);
  if (!configured[device]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    configured[device] = true;
  }
  const int M = x.size(0), N = out.size(1);
  const dim3 grid((M + BM - 1) / BM, (N + kFeatures - 1) / kFeatures, splits);
  kernel<<<grid, kThreads, kBytes, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), w.data_ptr<uint8_t>(), w.stride(0),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), splits > 1 ? partial.data_ptr<float>() : nullptr,
      splits > 1 ? counters.data_ptr<int>() : nullptr, M, N, x.size(1) / 256, splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// Called by gguf_mma.py's gemm(): x [M, K] bf16 (rows 16-byte aligned), w [N, K / 256 * block
// bytes] uint8 (Q4_K rows 16-byte aligned, Q6_K 2-byte), out [M, N] bf16, partial [splits, M, N]
// float32 and counters (one per tile, zero) where splits > 1; block_rows 32 or 64.
void gguf_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters, int64_t qtype,
               int64_t splits, int64_t block_rows) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "x: bf16 [M, K], rows contiguous");
  TORCH_CHECK(x.size(1) % 256 == 0, "K must be a multiple of 256");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, "x rows must be 16-byte aligned");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.stride(1) == 1, "w: uint8 [N, row bytes]");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.size(0) == x.size(0), "out: bf16 [M, N] contiguous");
  TORCH_CHECK(splits >= 1 && (block_rows == 32 || block_rows == 64), "splits >= 1, block_rows 32 or 64");
  const at::cuda::CUDAGuard guard(x.device());
  if (qtype == 12) {
    TORCH_CHECK(w.size(1) == x.size(1) / 256 * Q4K::kBlockBytes, "Q4_K row bytes");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 && w.stride(0) % 16 == 0, "Q4_K rows must be 16-byte aligned");
    if (block_rows == 32) launch<Q4K, 32>(x, w, out, partial, counters, splits);
    else launch<Q4K, 64>(x, w, out, partial, counters, splits);
  } else if (qtype == 14) {
    TORCH_CHECK(w.size(1) == x.size(1) / 256 * Q6K::kBlockBytes, "Q6_K row bytes");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 2 == 0 && w.stride(0) % 2 == 0, "Q6_K rows must be 2-byte aligned");
    if (block_rows == 32) launch<Q6K, 32>(x, w, out, partial, counters, splits);
    else launch<Q6K, 64>(x, w, out, partial, counters, splits);
  } else {
    TORCH_CHECK(false, "gguf_gemm: Q4_K (12) or Q6_K (14), got ", qtype);
  }
}
