// Q4_K blocks x 1-64 bf16 rows on tensor cores, the sub-block scales applied after the mma
// (included by gguf_mma.cu, after its helpers; native/gguf_mma.py documents the design).
//
// Swapped operands: the weights are the A operand of mma.sync m16n8k16 (16 features x 16 k), x is
// the B operand (16 k x 8 rows), so C holds 16 features x 8 rows. Lane t = 4 g + c holds the A
// values of features g and g + 8 at the k slots {2c, 2c + 1, 2c + 8, 2c + 9} of a step, the B values
// of row g at the same slots, and C's features g, g + 8 at rows 2c, 2c + 1.
//
// A is the raw 4-bit q as the bf16 value 128 + q (bits 0x43qq: one byte permute makes two). A
// step's 16 k lie in one 32-value sub-block, whose weights are S q - M (S = d * scale, M = dmin *
// min). Its two steps start from C = -128 X (X: the sub-block's sum of x, from xsum_kernel), so
// C = sum q x (products exact, sums in float32), and then
//     y += S * C + (M / 128) * (-128 X).
// Per value that is half a byte permute and one and-or, against a permute, a subtract, a
// multiply-add and half a conversion when each value is scaled before the mma: few enough
// instructions a byte for one-row calls to run at the memory's pace. The four lanes of a feature
// decode two sub-blocks' S and M each and share them by shuffles.
//
// Step s = 4 j + 2 nib + p of a super-block (j < 4 groups of 32 bytes, nib: low or high nibbles,
// p: half of the lane's 8 bytes) has sub-block 2 j + nib. Lane c reads bytes 8c .. 8c + 7 of group
// j (one 8-byte load a group and feature): byte 8c + 4p + e (e < 4) feeds slot 2c + e (e < 2) or
// 2c + 8 + e - 2, and is value k = 64 j + 32 nib + 8 c + 4 p + e of the super-block. So each lane's
// B operand of a step is x[row][k .. k + 3] at e = 0: 8 bytes read straight from x's row.

template <int NX, bool ODD>  // NX n-tiles of 8 rows: M <= 8 NX; ODD: any odd row < M (M > 1)
__global__ void __launch_bounds__(kWarps * 32, Q4K_MIN_BLOCKS) q4k_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t stride_xm, const float* __restrict__ xsum,
    const uint8_t* __restrict__ w, __nv_bfloat16* __restrict__ out, float* __restrict__ partial,
    int* __restrict__ counters, int M, int N, int64_t row_bytes, int super_blocks, int splits) {
  constexpr int kBytes = 144;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int f0 = (blockIdx.x * kWarps + warp) * 16;
  const int split = blockIdx.y;
  const int sb_begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int sb_end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);

  // Features g, g + 8 at super-block sb_begin (the last feature stands in past N: computed, not
  // written): the head, and this lane's 8 bytes of group 0.
  const uint8_t* head_at[2];
  const uint8_t* q_at[2];
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    head_at[f] = w + static_cast<int64_t>(min(f0 + g + 8 * f, N - 1)) * row_bytes + sb_begin * kBytes;
    q_at[f] = head_at[f] + 16 + 8 * c;
  }
  // Row g of each n-tile at this lane's k, and this lane's -128 X. A row past M reads row 0: a C
  // column depends on its own B column alone, and those columns are not written.
  const __nv_bfloat16* xrow[NX];
#pragma unroll
  for (int nt = 0; nt < NX; ++nt) xrow[nt] = x + (8 * nt + g < M ? 8 * nt + g : 0) * stride_xm + 256 * sb_begin + 8 * c;
  const float4* xs = reinterpret_cast<const float4*>(xsum) + (static_cast<int64_t>(sb_begin) * NX * 4 + c) * 8;  // [nt][c][sub]

  float acc[NX][4];
#pragma unroll
  for (int nt = 0; nt < NX; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;

  uint4 head_a[2], head_b[2];
  uint2 q_a[2][4], q_b[2][4];  // [feature][group]: bytes 8c .. 8c + 7 of the group
  auto load = [&](uint4 (&h)[2], uint2 (&qq)[2][4]) {
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      h[f] = __ldg(reinterpret_cast<const uint4*>(head_at[f]));
#pragma unroll
      for (int j = 0; j < 4; ++j) qq[f][j] = __ldg(reinterpret_cast<const uint2*>(q_at[f] + 32 * j));
      head_at[f] += kBytes;
      q_at[f] += kBytes;
    }
  };
  auto compute = [&](const uint4 (&head)[2], const uint2 (&q)[2][4]) {
    // This lane's sub-blocks 2c + h of each feature: S, and M / 128 (exact: a power of two).
    float own_s[2][2], own_m[2][2];
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(head[f].x & 0xFFFF)));
      const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(head[f].x >> 16))) * (1.0f / 128.0f);
      // Scale bytes b[i] = head byte 4 + i. Sub-block t < 4: scale b[t] & 63, min b[t + 4] & 63;
      // t + 4: scale b[t + 8] & 15 | (b[t] >> 6) << 4, min b[t + 8] >> 4 | (b[t + 4] >> 6) << 4.
      const uint32_t scales = c < 2 ? head[f].y & 0x3F3F3F3Fu : (head[f].w & 0x0F0F0F0Fu) | ((head[f].y >> 2) & 0x30303030u);
      const uint32_t mins = c < 2 ? head[f].z & 0x3F3F3F3Fu : ((head[f].w >> 4) & 0x0F0F0F0Fu) | ((head[f].z >> 2) & 0x30303030u);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int at = 2 * (c & 1) + h;
        own_s[f][h] = d * byte_f32(scales, at);
        own_m[f][h] = dmin * byte_f32(mins, at);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int nib = 0; nib < 2; ++nib) {
        const int sub = 2 * j + nib;
        const int from = (lane & ~3) | (sub >> 1);  // the lane of this feature row that decoded sub
        float S[2], Mq[2];
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          S[f] = __shfl_sync(0xFFFFFFFFu, own_s[f][sub & 1], from);
          Mq[f] = __shfl_sync(0xFFFFFFFFu, own_m[f][sub & 1], from);
        }
        float start[NX][4], ct[NX][4];
#pragma unroll
        for (int nt = 0; nt < NX; ++nt) {
          const float4 v = __ldg(xs + nt * 32 + sub);  // -128 X of rows 2c, 2c + 1, 2c, 2c + 1
          start[nt][0] = v.x, start[nt][1] = v.y, start[nt][2] = v.z, start[nt][3] = v.w;
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          uint32_t v[2];
#pragma unroll
          for (int f = 0; f < 2; ++f) {
            const uint32_t word = p ? q[f][j].y : q[f][j].x;
            v[f] = (nib ? word >> 4 : word) & 0x0F0F0F0Fu;
          }
          const uint32_t a[4] = {__byte_perm(v[0], 0x43434343u, 0x4140), __byte_perm(v[1], 0x43434343u, 0x4140),
                                 __byte_perm(v[0], 0x43434343u, 0x4342), __byte_perm(v[1], 0x43434343u, 0x4342)};
          const int k = 64 * j + 32 * nib + 4 * p;  // + 256 sb + 8c, in xrow
#pragma unroll
          for (int nt = 0; nt < NX; ++nt) {
            const uint2 b = __ldg(reinterpret_cast<const uint2*>(xrow[nt] + k));
            if (p == 0) mma_from(ct[nt], start[nt], a, b.x, b.y);
            else mma(ct[nt], a, b.x, b.y);
          }
        }
#pragma unroll
        for (int nt = 0; nt < NX; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (!ODD && (e & 1)) continue;  // one row: the odd rows are none of its own
            acc[nt][e] = fmaf(S[e >> 1], ct[nt][e], acc[nt][e]);
            acc[nt][e] = fmaf(Mq[e >> 1], start[nt][e], acc[nt][e]);
          }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NX; ++nt) xrow[nt] += 256;
    xs += NX * 32;
  };
  // Two register sets in turn: one super-block's bytes are in flight while the other's are computed.
  if (sb_begin < sb_end) load(head_a, q_a);
  for (int sb = sb_begin; sb < sb_end; sb += 2) {
    if (sb + 1 < sb_end) load(head_b, q_b);
    compute(head_a, q_a);
    if (sb + 1 == sb_end) break;
    if (sb + 2 < sb_end) load(head_a, q_a);
    compute(head_b, q_b);
  }

  // acc[nt][e]: feature f0 + g + 8 (e / 2), row 8 nt + 2c + e % 2.
#pragma unroll
  for (int nt = 0; nt < NX; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 8 * nt + 2 * c + (e & 1), n = f0 + g + 8 * (e >> 1);
      if ((!ODD && (e & 1)) || m >= M || n >= N) continue;
      if (splits == 1) out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(acc[nt][e]);
      else partial[(static_cast<int64_t>(split) * M + m) * N + n] = acc[nt][e];
    }
  if (splits > 1) add_splits(partial, counters, out, M, N, splits, kWarps * 16);
}

// xsum[sb][nt][c][sub] (float4) = -128 X for rows 2c, 2c + 1, 2c, 2c + 1 of n-tile nt (the C
// fragment's order), X = the sum of x[row][256 sb + 32 sub ...+ 32] in float32, in k order (a
// row's sums do not depend on M); zeros for rows from M on. One thread a (sb, nt, c, sub, row).
__global__ void xsum_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride_xm, float* __restrict__ xsum, int M,
                            int NX, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int h = i % 2, sub = (i / 2) % 8, c = (i / 16) % 4, nt = (i / 64) % NX;
  const int64_t sb = i / (64 * NX);
  const int row = 8 * nt + 2 * c + h;
  float sum = 0.0f;
  if (row < M) {
    const __nv_bfloat16* at = x + row * stride_xm + 256 * sb + 32 * sub;
#pragma unroll 8
    for (int k = 0; k < 32; ++k) sum += __bfloat162float(at[k]);
  }
  float* to = xsum + (i / 2) * 4;
  to[h] = to[2 + h] = -128.0f * sum;
}
