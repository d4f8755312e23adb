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
__global__ void __launch_bounds__(kWarps * 32, NX == 1 ? 4 : 3) q4k_kernel(  // 1 row: 124 registers unbounded
    const __nv_bfloat16* __restrict__ x, int64_t stride_xm, const float* __restrict__ xsum,
    const uint8_t* __restrict__ w, __nv_bfloat16* __restrict__ out, float* __restrict__ partial,
    int* __restrict__ counters, int M, int N, int64_t row_bytes, int super_blocks, int splits) {
  constexpr int kBytes = 144, kStages = Q4K_STAGES;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int f0 = (blockIdx.x * kWarps + warp) * 16;
  const int split = blockIdx.y;
  const int sb_begin = static_cast<int>(static_cast<int64_t>(super_blocks) * split / splits);
  const int sb_end = static_cast<int>(static_cast<int64_t>(super_blocks) * (split + 1) / splits);

  // The warp's 16 features' super-blocks stream through a ring of kStages in shared memory
  // (cp.async, no registers held while in flight): kStages - 1 super-blocks are always on their
  // way while one is computed. The last feature stands in past N: computed, not written.
  __shared__ __align__(16) uint8_t ring[kWarps][kStages][16 * kBytes];
  // Chunk lane + 32 r (r < 5, chunk < 144) of a stage: part chunk % 9 of feature chunk / 9.
  const uint8_t* src[5];  // at the next super-block to fill
  int dst[5];
#pragma unroll
  for (int r = 0; r < 5; ++r) {
    const int chunk = min(lane + 32 * r, 143), f = chunk / 9;
    src[r] = w + static_cast<int64_t>(min(f0 + f, N - 1)) * row_bytes + static_cast<int64_t>(sb_begin) * kBytes + 16 * (chunk % 9);
    dst[r] = chunk * 16;
  }
  auto fill = [&](int sb, int stage) {  // this lane's share of super-block sb (the one after the last filled)
    if (sb < sb_end) {
#pragma unroll
      for (int r = 0; r < 5; ++r) {
        if (r < 4 || lane < 16) cp_async16(&ring[warp][stage][dst[r]], src[r]);
        src[r] += kBytes;
      }
    }
    cp_async_commit();  // an empty group past the end keeps the count of groups in step
  };
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

  auto compute = [&](int stage) {
    uint4 head[2];
    uint2 q[2][4];  // [feature][group]: bytes 8c .. 8c + 7 of the group
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      const uint8_t* block = &ring[warp][stage][(g + 8 * f) * kBytes];
      head[f] = *reinterpret_cast<const uint4*>(block);
#pragma unroll
      for (int j = 0; j < 4; ++j) q[f][j] = *reinterpret_cast<const uint2*>(block + 16 + 32 * j + 8 * c);
    }
    // Per feature: d, dmin / 128 (exact: a power of two), and the 6-bit (scale, min) of each
    // sub-block, a byte each. Scale bytes b[i] = head byte 4 + i. Sub-block t < 4: scale b[t] & 63,
    // min b[t + 4] & 63; t + 4: scale b[t + 8] & 15 | (b[t] >> 6) << 4, min b[t + 8] >> 4 | (b[t + 4] >> 6) << 4.
    float d[2], dmin[2];
    uint32_t scales[2][2], mins[2][2];  // [feature][sub-blocks 0-3, 4-7]
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      d[f] = __half2float(__ushort_as_half(static_cast<unsigned short>(head[f].x & 0xFFFF)));
      dmin[f] = __half2float(__ushort_as_half(static_cast<unsigned short>(head[f].x >> 16))) * (1.0f / 128.0f);
      scales[f][0] = head[f].y & 0x3F3F3F3Fu;
      mins[f][0] = head[f].z & 0x3F3F3F3Fu;
      scales[f][1] = (head[f].w & 0x0F0F0F0Fu) | ((head[f].y >> 2) & 0x30303030u);
      mins[f][1] = ((head[f].w >> 4) & 0x0F0F0F0Fu) | ((head[f].z >> 2) & 0x30303030u);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int nib = 0; nib < 2; ++nib) {
        const int sub = 2 * j + nib;
        float S[2], Mq[2];  // S and M / 128 of this sub-block, features g and g + 8
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          S[f] = d[f] * byte_f32(scales[f][sub >> 2], sub & 3);
          Mq[f] = dmin[f] * byte_f32(mins[f][sub >> 2], sub & 3);
        }
        float start[NX][4], ct[NX][4];
#pragma unroll
        for (int nt = 0; nt < NX; ++nt) {
          const float4 v = __ldg(xs + nt * 32 + sub);  // -128 X of rows 2c, 2c + 1, 2c, 2c + 1
          start[nt][0] = v.x, start[nt][1] = v.y, start[nt][2] = v.z, start[nt][3] = v.w;
        }
        uint4 xb[NX];  // x[row][k .. k + 7] at k = 64 j + 32 nib + 8 c: steps p = 0 (.x, .y) and 1 (.z, .w)
#pragma unroll
        for (int nt = 0; nt < NX; ++nt) xb[nt] = __ldg(reinterpret_cast<const uint4*>(xrow[nt] + 64 * j + 32 * nib));
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
#pragma unroll
          for (int nt = 0; nt < NX; ++nt) {
            if (p == 0) mma_from(ct[nt], start[nt], a, xb[nt].x, xb[nt].y);
            else mma(ct[nt], a, xb[nt].z, xb[nt].w);
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
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) fill(sb_begin + i, i);
  for (int sb = sb_begin, stage = 0; sb < sb_end; ++sb, stage = stage + 1 == kStages ? 0 : stage + 1) {
    fill(sb + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);  // the stage computed last time
    cp_async_wait<kStages - 1>();  // super-block sb's group has landed (this lane's part)
    __syncwarp();  // ... and every other lane's
    compute(stage);
    __syncwarp();  // read before the stage is filled again
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
// fragment's order), X = the sum of x[row][256 sb + 32 sub ...+ 32] in float32, in a fixed order
// (a row's sums do not depend on M); zeros for rows from M on. One thread a (sb, nt, c, sub, row).
__global__ void xsum_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride_xm, float* __restrict__ xsum, int M,
                            int NX, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int h = i % 2, sub = (i / 2) % 8, c = (i / 16) % 4, nt = (i / 64) % NX;
  const int64_t sb = i / (64 * NX);
  const int row = 8 * nt + 2 * c + h;
  float sum = 0.0f;
  if (row < M) {  // four 16-byte loads, summed in a fixed tree
    const uint4* at = reinterpret_cast<const uint4*>(x + row * stride_xm + 256 * sb + 32 * sub);
    float part[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint4 v = at[r];
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      float s2[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[k]));
        s2[k] = pair.x + pair.y;
      }
      part[r] = (s2[0] + s2[1]) + (s2[2] + s2[3]);
    }
    sum = (part[0] + part[1]) + (part[2] + part[3]);
  }
  float* to = xsum + (i / 2) * 4;
  to[h] = to[2 + h] = -128.0f * sum;
}
