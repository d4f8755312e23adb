// y = x @ W^T for bf16 x [M, K] (M <= 64) and W [N, K] kept in its GGUF blocks (IQ4_XS here; Q4_K
// and Q6_K have their own kernels, native/gguf_q4k.cu and gguf_q6k.cu), on tensor cores: each
// thread expands its share of a super-block to float32 in registers, rounds it to bf16 and feeds it as the B operand of
// mma.sync m16n8k16 (x is the A operand). Built at first use by native/gguf_mma.py, which
// documents the design; this file is the device code.
//
// Layout of one warp's work: 8 * NT output features (NT n-tiles of 8), all M rows (MT m-tiles of
// 16), one super-block (256 values) per loop step. Lane t = 4 g + c holds, for each n-tile, the
// weights of feature g and the k slots {2c, 2c+1, 2c+8, 2c+9} of each 16-wide k step; the A
// operand's lane t holds rows g and g + 8 at the same k slots. A dot product does not depend on
// the order of k, so each c maps its slots to whichever real k its bytes hold, as long as A and
// B use the same map: lane c reads 16-byte runs of its rows' bytes and the matching x pairs.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "gguf_mma.cuh"

// native/gguf_q4k.cu and native/gguf_q6k.cu
void q4k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters,
             int64_t splits, bool interleaved, const std::vector<torch::Tensor>& prepared);
void q6k_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters,
             int64_t splits, bool interleaved, const std::vector<torch::Tensor>& prepared);
std::vector<torch::Tensor> q4k_prepare(const mma_common::Source& src, int64_t M, const torch::TensorOptions& options);
std::vector<torch::Tensor> q6k_prepare(const mma_common::Source& src, int64_t M, const torch::TensorOptions& options);

namespace {

using mma_common::add_splits;
using mma_common::kWarps;  // each warp with its own 8 * NT features
using mma_common::word_of;
#ifndef MIN_BLOCKS  // blocks a multiprocessor must hold (caps registers); benchmarks try others
#define MIN_BLOCKS 1
#endif

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte `sel` (0..3) of `word`, less `offset`, as an exact float: the byte under the bits
// 0x4B000000 makes the float 2^23 + byte (an integer conversion instruction runs at a quarter rate).
__device__ __forceinline__ float byte_f32(uint32_t word, int sel, float offset = 0.0f) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + sel)) - (8388608.0f + offset);
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Each block type has load(), which only issues the loads of one super-block's bytes for this
// lane (so the next super-block's can be in flight while this one is computed), prepare(), which
// decodes its scales once they arrived, fragment(s), the B operand of k step s (0..15), and
// k_of(c, s), the real k (in the super-block) of slots 2c, 2c + 1 of step s; slots 2c + 8, 2c + 9
// are 32 further.

// ---------------------------------------------------------------------------------------- IQ4_XS
// Super-block (136 bytes, 8-byte aligned): f16 d, a uint16 of the high two bits of each 6-bit
// scale (sub-block s at bits 2 s), 4 bytes of their low nibbles (nibble s % 2 of byte s / 2), then
// 16 bytes per sub-block s at 8 + 16 s, whose byte i holds the level indices of values 32 s + i
// (low nibble) and 32 s + 16 + i (high nibble); value = d * (scale - 32) * level[index], level
// being IQ4_NL's sixteen int8 values. Lane c takes sub-blocks 2c (slots 2c, 2c + 1) and 2c + 1
// (slots 2c + 8, 2c + 9: 32 values further), the 32 bytes at 8 + 32 c: step s takes bytes
// 2 (s % 8) + {0, 1} of both, their low nibbles for s < 8 and their high ones above.
struct IQ4XS {
  static constexpr int kBytes = 136;
  uint2 head, q[4];  // q[0], q[1]: sub-block 2c's 16 bytes; q[2], q[3]: sub-block 2c + 1's
  float scale[2];    // d * (scale - 32) of sub-blocks 2c, 2c + 1

  __device__ __forceinline__ void load(const uint8_t* block, int c) {
    head = __ldg(reinterpret_cast<const uint2*>(block));
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __ldg(reinterpret_cast<const uint2*>(block + 8 + 32 * c + 8 * i));
  }

  __device__ __forceinline__ void prepare(int c) {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x & 0xFFFF)));
    const uint32_t high = head.x >> 16, low = (head.y >> (8 * c)) & 0xFF;
    // The products are exact in float32 (an 11-bit d times a 6-bit integer), as the dequantizer's.
    scale[0] = d * static_cast<float>(static_cast<int>((low & 15) | (((high >> (4 * c)) & 3) << 4)) - 32);
    scale[1] = d * static_cast<float>(static_cast<int>((low >> 4) | (((high >> (4 * c + 2)) & 3) << 4)) - 32);
  }

  // Four level indices (one a byte, each < 16) -> their levels plus 128, a byte each: two byte
  // permutes over the table's low and high halves, then a third that picks per byte by bit 3.
  __device__ __forceinline__ static uint32_t levels(uint32_t idx) {
    constexpr uint32_t t0 = 0x3F2D1801u, t1 = 0x766A5D4Fu, t2 = 0xA6998D81u, t3 = 0xF1D9C5B5u;  // -127 .. 113, + 128
    uint32_t sel = (idx | (idx >> 4)) & 0x00FF00FFu;
    sel = (sel | (sel >> 8)) & 0xFFFFu;  // the four indices as nibbles
    const uint32_t lo = __byte_perm(t0, t1, sel & 0x7777u), hi = __byte_perm(t2, t3, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
  }

  __device__ __forceinline__ void fragment(int s, uint32_t& b0, uint32_t& b1) const {
    const int w = (s & 7) >> 1, at = 2 * (s & 1), shift = s < 8 ? 0 : 4;
    const uint32_t word_a = (w & 1) ? q[w >> 1].y : q[w >> 1].x, word_b = (w & 1) ? q[2 + (w >> 1)].y : q[2 + (w >> 1)].x;
    const uint32_t la = levels((word_a >> shift) & 0x0F0F0F0Fu), lb = levels((word_b >> shift) & 0x0F0F0F0Fu);
    b0 = pack_bf16(byte_f32(la, at, 128.0f) * scale[0], byte_f32(la, at + 1, 128.0f) * scale[0]);
    b1 = pack_bf16(byte_f32(lb, at, 128.0f) * scale[1], byte_f32(lb, at + 1, 128.0f) * scale[1]);
  }

  __host__ __device__ __forceinline__ static int k_of(int c, int s) { return 64 * c + (s < 8 ? 0 : 16) + 2 * (s & 7); }
};

// x in the A operand's order: xf[sb][s][mt][lane][r] (uint32 = two bf16) is what lane (g, c) of
// m-tile mt passes as register r of k step s of super-block sb: rows g (r even) and g + 8 (r odd,
// only when R = 4), k = 256 sb + k_of(c, s) (r < 2, or r = 0 when R = 2) and 32 further. Rows
// from M on are zeros. Each lane then loads its whole A operand of a step in one 8- or 16-byte
// access, the warp's accesses contiguous.
template <typename Block, int MT, int R>
__global__ void permute_x_kernel(const __nv_bfloat16* __restrict__ x, uint32_t* __restrict__ xf, int M, int64_t stride_xm,
                                 int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int r = i % R, lane = (i / R) % 32;
  const int64_t rest = i / (R * 32);
  const int mt = rest % MT, s = (rest / MT) % 16;
  const int64_t sb = rest / (MT * 16);
  const int g = lane >> 2, c = lane & 3;
  const int row = 16 * mt + g + (R == 4 ? 8 * (r & 1) : 0);
  const int64_t k = 256 * sb + Block::k_of(c, s) + 32 * (R == 4 ? r >> 1 : r);
  xf[i] = row < M ? *reinterpret_cast<const uint32_t*>(x + row * stride_xm + k) : 0u;
}

// One program: kWarps warps x 8 NT features, K super-blocks [split's range). With splits > 1 the
// float32 partial sums go to `partial` [splits, M, N] and the block that finishes a tile last adds
// them in split order (so the result does not depend on which finished first) and writes `out`.
template <typename Block, int MT, int NT, int R>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) gguf_mma_kernel(
    const uint32_t* __restrict__ xf, const uint8_t* __restrict__ w, __nv_bfloat16* __restrict__ out,
    float* __restrict__ partial, int* __restrict__ counters, int M, int N, int64_t row_bytes, int super_blocks,
    int splits) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = (blockIdx.x * kWarps + warp) * 8 * NT;
  const int split = blockIdx.y;
  const int sb_begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int sb_end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);

  const uint8_t* rows[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) rows[i] = w + static_cast<int64_t>(min(n0 + 8 * i + g, N - 1)) * row_bytes;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.0f;

  Block cur[NT], next[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) cur[i].load(rows[i] + static_cast<int64_t>(sb_begin) * Block::kBytes, c);
  for (int sb = sb_begin; sb < sb_end; ++sb) {
    if (sb + 1 < sb_end) {  // the next super-block's bytes are in flight while this one is computed
#pragma unroll
      for (int i = 0; i < NT; ++i) next[i].load(rows[i] + static_cast<int64_t>(sb + 1) * Block::kBytes, c);
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) cur[i].prepare(c);
    const uint32_t* x_sb = xf + static_cast<int64_t>(sb) * 16 * MT * 32 * R + lane * R;
#pragma unroll
    for (int s = 0; s < 16; ++s) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t* at = x_sb + (s * MT + mt) * 32 * R;
        if constexpr (R == 4) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
          a[mt][0] = v.x, a[mt][1] = v.y, a[mt][2] = v.z, a[mt][3] = v.w;
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(at));
          a[mt][0] = v.x, a[mt][1] = 0u, a[mt][2] = v.y, a[mt][3] = 0u;
        }
      }
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        uint32_t b0, b1;
        cur[i].fragment(s, b0, b1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt][i], a[mt], b0, b1);
      }
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) cur[i] = next[i];
  }

  // The C fragment of lane (g, c): rows g, g + 8 of each m-tile, features 2c, 2c + 1 of each n-tile.
  if (splits == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = 16 * mt + 8 * h + g, n = n0 + 8 * i + 2 * c;
          if (m < M && n < N) out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(acc[mt][i][2 * h]);
          if (m < M && n + 1 < N) out[static_cast<int64_t>(m) * N + n + 1] = __float2bfloat16_rn(acc[mt][i][2 * h + 1]);
        }
    return;
  }
  float* mine = partial + static_cast<int64_t>(split) * M * N;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = 16 * mt + 8 * h + g, n = n0 + 8 * i + 2 * c;
        if (m < M && n < N) mine[static_cast<int64_t>(m) * N + n] = acc[mt][i][2 * h];
        if (m < M && n + 1 < N) mine[static_cast<int64_t>(m) * N + n + 1] = acc[mt][i][2 * h + 1];
      }
  add_splits(partial, out, counters, M, N, blockIdx.x * kWarps * 8 * NT, kWarps * 8 * NT, splits);
}

template <typename Block, int MT, int NT, int R>
void launch(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, torch::Tensor& partial,
            torch::Tensor& counters, int splits, cudaStream_t stream) {
  const int M = x.size(0), N = out.size(1), K = x.size(1);
  const int64_t total = static_cast<int64_t>(K / 256) * 16 * MT * 32 * R;
  torch::Tensor xf = torch::empty({total}, x.options().dtype(torch::kInt32));
  permute_x_kernel<Block, MT, R><<<(total + 255) / 256, 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), reinterpret_cast<uint32_t*>(xf.data_ptr()), M, x.stride(0), total);
  const int tiles = (N + kWarps * 8 * NT - 1) / (kWarps * 8 * NT);
  dim3 grid(tiles, splits);
  gguf_mma_kernel<Block, MT, NT, R><<<grid, kWarps * 32, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(xf.data_ptr()), w.data_ptr<uint8_t>(),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), splits > 1 ? partial.data_ptr<float>() : nullptr,
      splits > 1 ? counters.data_ptr<int>() : nullptr, M, N, w.stride(0), K / 256, splits);
}

template <typename Block, int NT>
void by_rows(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, torch::Tensor& partial,
             torch::Tensor& counters, int splits, cudaStream_t stream) {
  const int M = x.size(0);
  if (M <= 8) launch<Block, 1, NT, 2>(x, w, out, partial, counters, splits, stream);
  else if (M <= 16) launch<Block, 1, NT, 4>(x, w, out, partial, counters, splits, stream);
  else if (M <= 32) launch<Block, 2, NT, 4>(x, w, out, partial, counters, splits, stream);
  else launch<Block, 4, NT, 4>(x, w, out, partial, counters, splits, stream);
}

}  // namespace

// qtype: 12 (Q4_K), 14 (Q6_K) or 23 (IQ4_XS), gguf's GGMLQuantizationType values. `partial` [splits, M, N]
// float32 and `counters` [>= tiles] int32 zeros are the caller's (unused when splits == 1). n_tiles
// (1 or 2) is the IQ4_XS kernel's; the Q4_K and Q6_K kernels have one shape. `interleaved`: w in
// native.gguf_matmul.interleave's layout (Q4_K and Q6_K). `prepared`: empty, or gguf_prepare's
// arrays of x for this qtype (Q4_K and Q6_K, M <= 32), which the matmul then reads instead of x.
void gguf_mma(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor partial, torch::Tensor counters,
              int64_t qtype, int64_t splits, int64_t n_tiles, bool interleaved, std::vector<torch::Tensor> prepared) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "x: bf16 [M, K], rows contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "1 <= M <= 64, got ", x.size(0));
  TORCH_CHECK(x.size(1) % 256 == 0, "K must be a multiple of 256");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 && x.stride(0) % 2 == 0, "x rows must be 4-byte aligned");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.stride(1) == 1, "w: uint8 [N, row bytes]");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous(), "out: bf16 [M, N] contiguous");
  TORCH_CHECK(!interleaved || ((qtype == 12 || qtype == 14) && w.size(0) % 16 == 0 && w.is_contiguous()),
              "an interleaved weight must be Q4_K or Q6_K, contiguous, of a multiple of 16 rows");
  TORCH_CHECK(prepared.empty() || (x.size(0) <= 32 && prepared.size() == (qtype == 12 ? 3u : qtype == 14 ? 2u : 0u)),
              "prepared x: Q4_K's 3 or Q6_K's 2 arrays, for at most 32 rows");
  const at::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (qtype == 12) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 && w.stride(0) % 16 == 0, "Q4_K rows must be 16-byte aligned");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, "x rows must be 16-byte aligned for Q4_K");
    q4k_mma(x, w, out, partial, counters, splits, interleaved, prepared);
  } else if (qtype == 14) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 2 == 0 && w.stride(0) % 2 == 0, "Q6_K rows must be 2-byte aligned");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, "x rows must be 16-byte aligned for Q6_K");
    q6k_mma(x, w, out, partial, counters, splits, interleaved, prepared);
  } else if (qtype == 23) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 8 == 0 && w.stride(0) % 8 == 0, "IQ4_XS rows must be 8-byte aligned");
    if (n_tiles == 1) by_rows<IQ4XS, 1>(x, w, out, partial, counters, splits, stream);
    else by_rows<IQ4XS, 2>(x, w, out, partial, counters, splits, stream);
  } else {
    TORCH_CHECK(false, "gguf_mma: no kernel for quantization type ", qtype);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {
bool aligned_rows(const torch::Tensor& t) {  // bf16 rows whose 8-value groups load 16 bytes at a time
  return t.is_cuda() && t.scalar_type() == torch::kBFloat16 && t.dim() == 2 && t.stride(1) == 1 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0;
}
}  // namespace

// x's prepared arrays for the Q4_K (qtype 12) or Q6_K (14) matmul, made from x's producer's
// inputs (mma_common::Source; kind 1: SwiGLU's activation of gate_up `a` [M, 2K]; 2: RMSNorm of
// `a` [M, K] by `weight` [K] (bf16); 3: the same of a + b, written to `sum` [M, K]). M <= 32 rows.
std::vector<torch::Tensor> gguf_prepare(int64_t qtype, int64_t kind, torch::Tensor a, c10::optional<torch::Tensor> b,
                                        c10::optional<torch::Tensor> weight, c10::optional<torch::Tensor> sum, double eps,
                                        int64_t K) {
  TORCH_CHECK(qtype == 12 || qtype == 14, "gguf_prepare: Q4_K (12) or Q6_K (14), got ", qtype);
  TORCH_CHECK(kind >= mma_common::kSiluMul && kind <= mma_common::kAddNorm, "gguf_prepare: kind 1-3, got ", kind);
  TORCH_CHECK(aligned_rows(a) && a.size(0) >= 1 && a.size(0) <= 32, "a: bf16 [1-32, ...] rows 16-byte aligned");
  TORCH_CHECK(K % 256 == 0 && a.size(1) == (kind == mma_common::kSiluMul ? 2 * K : K), "a's width must be K (2K for SwiGLU), K a multiple of 256");
  const int64_t M = a.size(0);
  const bool norm = kind != mma_common::kSiluMul;
  TORCH_CHECK(!norm || (weight && aligned_rows(weight->view({1, -1})) && weight->numel() == K), "a norm needs a bf16 weight [K]");
  TORCH_CHECK(kind != mma_common::kAddNorm || (b && aligned_rows(*b) && b->sizes() == a.sizes() && sum && sum->is_contiguous() && aligned_rows(*sum) && sum->sizes() == a.sizes()),
              "an added norm needs b and sum like a");
  const at::cuda::CUDAGuard guard(a.device());
  mma_common::Source src = {};
  src.a = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr());
  src.stride_a = a.stride(0);
  src.kind = static_cast<int>(kind);
  src.K = static_cast<int>(K);
  src.eps = static_cast<float>(eps);
  if (norm) src.weight = reinterpret_cast<const __nv_bfloat16*>(weight->data_ptr());
  if (kind == mma_common::kAddNorm) {
    src.b = reinterpret_cast<const __nv_bfloat16*>(b->data_ptr());
    src.stride_b = b->stride(0);
    src.sum = reinterpret_cast<__nv_bfloat16*>(sum->data_ptr());
  }
  std::vector<torch::Tensor> arrays = qtype == 12 ? q4k_prepare(src, M, a.options()) : q6k_prepare(src, M, a.options());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return arrays;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_mma", &gguf_mma, "y = x @ W^T from GGUF blocks on tensor cores");
  m.def("gguf_prepare", &gguf_prepare, "x's prepared arrays for the Q4_K/Q6_K matmul, made from x's producer's inputs");
}
