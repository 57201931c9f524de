// Grouped FP4 GEMM for decode-sized batches: y[rows of e] = x[rows of e] @ dequantize(W_e)^T, for
// the MoE experts (rows sorted by expert). Dense layers run fp4_dense_gemm.cu, which shares rows.
//
// The same values as linear.py's Triton kernel: every weight element becomes
// bf16(fl32(e2m1 * s * g)) (`fp4_tables` and `dequant_word`, fp4_mma.cuh) before a BF16 MMA with FP32
// accumulation, and y is rounded to BF16 once. A decode step gives an expert a few rows, so the
// output is computed transposed, y^T = W x^T: mma.m16n8k16 with A = 16 weight rows (output
// features) and B = x^T (8 rows of x). Lane (g, t) (g = lane / 4, t = lane % 4) feeds the MMA
// the 32 contiguous K elements [32t, 32t + 32) of each 128-wide K chunk (a dot product does not
// care about the order it visits K; x is read in the same order): one 16-byte load per weight
// row and chunk, dequantized straight into MMA fragments, with no shared memory.
//
// Grid (tiles, cdiv(N, 128), splits), 4 warps of 32 output features each (two m16 tiles); a tile
// is up to 16 rows of one expert (two n8 tiles), listed by linear.py's `_tile_list_kernel` as
// (expert, first row, end row); tiles with no rows exit. With a row map (x_rows, `mapped`), row r
// of the product reads row x_rows[r] of x: the experts' sorted rows straight from the token rows.
// K is a multiple of 128, N of 32. With splits > 1 (few tiles, long K: a decode step of one
// sequence), program z covers K chunks [z * K / splits, ...) and writes FP32 partial products to
// y32 [splits, M, N]; `sum_splits` (below) adds them in a fixed order.

#include "fp4_mma.cuh"

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef PREFETCH
#define PREFETCH 0  // K chunks past the next one that a warp asks L2 for (0: none)
#endif

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)
fp4_grouped_gemm(const u16 *__restrict__ x, const u8 *__restrict__ codes, const u8 *__restrict__ scales,
                 const float *__restrict__ gs, const int *__restrict__ tiles,
                 const long long *__restrict__ x_rows, u16 *__restrict__ y, float *__restrict__ y32, int M, int N,
                 int K, int splits, int mapped) {
  const int expert = tiles[3 * blockIdx.x], r0 = tiles[3 * blockIdx.x + 1], r1 = tiles[3 * blockIdx.x + 2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.y * 128 + 32 * warp;  // this warp's first output feature
  if (r1 <= r0 || n0 >= N) return;
  const bool second = r1 - r0 > 8;  // rows 8..15 of the tile: a second n8 tile
  const float gscale = gs[expert];
  const u8 *wc = codes + ((u64)expert * N + n0) * (K / 2);
  const u8 *ws = scales + ((u64)expert * N + n0) * (K / 16);
  const int xrow[2] = {r0 + g, r0 + 8 + g};  // the product row lane group g brings to n-tile j
  int xat[2];                                 // and the row of x that holds it
#pragma unroll
  for (int j = 0; j < 2; ++j) xat[j] = mapped && xrow[j] < r1 ? (int)x_rows[xrow[j]] : xrow[j];

  float acc[2][2][4];  // [m-tile][n-tile]: features n0 + 16m + g (+8) x rows 8j + 2t (+1)
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 2; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;

  const int per_split = K / 128 / splits, first = blockIdx.z * per_split, chunks = first + per_split;
  WeightChunk<4> cur, nxt;  // m-tile m's rows g, g + 8 are 2m, 2m + 1
  load_chunk(cur, wc, ws, K, first, g, t);
  // L2 prefetch of the codes PREFETCH chunks past the one loaded into registers: lane (g, t) asks
  // for weight row 16 * (t / 2) + g + 8 * (t % 2) of the warp's 32 (64 bytes a row and chunk).
  const u8 *ahead = wc + (u64)(16 * (t >> 1) + g + 8 * (t & 1)) * (K / 2) + 64 * (first + 2);
#pragma unroll
  for (int d = 2; d <= PREFETCH; ++d)
    if (first + d < chunks) asm volatile("prefetch.global.L2 [%0];" ::"l"(ahead + 64 * (d - 2)));
  ahead += 64 * (PREFETCH - 1);  // chunk first + 1 + PREFETCH
  for (int c = first; c < chunks; ++c, ahead += 64) {
    if (c + 1 < chunks) load_chunk(nxt, wc, ws, K, c + 1, g, t);
    if (PREFETCH > 0 && c + 1 + PREFETCH < chunks) asm volatile("prefetch.global.L2 [%0];" ::"l"(ahead));
    // x^T fragments: row xrow[j], K elements [128c + 32t, + 32) as 16 bf16 pairs (zero past the tile)
    u32 xb[2][16];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool ok = xrow[j] < r1 && (j == 0 || second);
      const uint4 *src = reinterpret_cast<const uint4 *>(x + (u64)xat[j] * K + 128 * c + 32 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = ok ? src[i] : make_uint4(0u, 0u, 0u, 0u);
        xb[j][4 * i] = v.x; xb[j][4 * i + 1] = v.y; xb[j][4 * i + 2] = v.z; xb[j][4 * i + 3] = v.w;
      }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      u32 wb[2][16];  // rows g, g + 8 of m-tile m: K elements [32t, 32t + 32) of the chunk as bf16 pairs
      float sc[4];  // rows g, g + 8: blocks 2t (words 0, 1) and 2t + 1 (words 2, 3)
      e4m3x2_to_f32(cur.s[2 * m], sc[0], sc[1]);
      e4m3x2_to_f32(cur.s[2 * m + 1], sc[2], sc[3]);
      const float gs4[4] = {gscale, gscale, gscale, gscale};
      Fp4Table tb[4];
      fp4_tables(sc, gs4, tb);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 q = cur.w[2 * m + h];
        const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) dequant_word(words[w], tb[2 * h + (w >> 1)], wb[h] + 4 * w);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        mma_bf16(acc[m][0], wb[0][2 * k], wb[1][2 * k], wb[0][2 * k + 1], wb[1][2 * k + 1], xb[0][2 * k], xb[0][2 * k + 1]);
        if (second)
          mma_bf16(acc[m][1], wb[0][2 * k], wb[1][2 * k], wb[0][2 * k + 1], wb[1][2 * k + 1], xb[1][2 * k],
                   xb[1][2 * k + 1]);
      }
    }
    cur = nxt;
  }

  // y[row, feature] in BF16 (or FP32 partials): C fragment (feature g (+8), rows 2t, 2t + 1 of n-tile j)
  float *part = y32 + (u64)blockIdx.z * M * N;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + 8 * j + 2 * t + (e & 1), feature = n0 + 16 * m + g + 8 * (e >> 1);
        if (row >= r1) continue;
        if (splits == 1)
          y[(u64)row * N + feature] = to_bf16(acc[m][j][e]);
        else
          part[(u64)row * N + feature] = acc[m][j][e];
      }
}

// y = bf16(sum of the `splits` FP32 partial products [splits, mn], in split order), with
// `residual` (bf16 [mn]) then added when has_residual, as torch adds two BF16 tensors: in FP32, rounded.
extern "C" __global__ void __launch_bounds__(256)
sum_splits(const float *__restrict__ part, const u16 *__restrict__ residual, u16 *__restrict__ y, int mn, int splits,
           int has_residual) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i >= mn) return;
  float acc = part[i];
  for (int z = 1; z < splits; ++z) acc += part[(u64)z * mn + i];
  u16 r = to_bf16(acc);
  if (has_residual) r = to_bf16(bf16_to_f32(r) + bf16_to_f32(residual[i]));
  y[i] = r;
}
