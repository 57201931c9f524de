// Dense FP4 GEMM for decode batches: y = x @ dequantize(W)^T with x [M, K] bf16, M up to a few
// hundred rows (the attention projections of a decode step).
//
// The grouped kernel (fp4_grouped_gemm.cu) gives each 16 rows of x their own programs, so at
// batch 64 every weight is dequantized four times, and each warp loads its own copy of x. Here a
// program takes up to 8 * NT rows of x at once: the 4 warps share them through shared memory
// (cp.async, one K chunk ahead) and each dequantizes its 16 weight rows once for all of them.
//
// Per warp: y^T tile = W (16 output features) x^T (NT n8 tiles of rows), mma.m16n8k16 as in the
// grouped kernel, with the same lane-contiguous K order (lane (g, t) feeds the MMA the K elements
// [32t, 32t + 32) of each 128-wide chunk) and the same accumulation order (k-steps 0..7 of each
// chunk in turn): the outputs equal the grouped kernel's bit for bit, split or not.
//
// Grid (cdiv(M, 8 NT), cdiv(N, 64), splits); 128 threads. With splits > 1, program z covers K
// chunks [z * K / 128 / splits, ...) and writes FP32 partial products to y32 [splits, M, N]
// (summed by fp4_grouped_gemm.cu's `sum_splits`). K is a multiple of 128, N of 16.
//
// Compile-time constants (-D): NT (n8 tiles of rows a program, 1..8), MIN_BLOCKS, PREFETCH.

#include "fp4_mma.cuh"

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef PREFETCH
#define PREFETCH 0
#endif
#define ROWS (8 * NT)

// x chunk staging: ROWS rows x 16 units of 16 bytes (128 bf16). Unit u of row r sits at
// u ^ (2 * (u / 8 % 2)) ^ (r % 2): the 8 lanes of a 16-byte shared load ((g, t) for two g, unit
// 4t + i) then reach 8 different 16-byte bank groups.
__device__ __forceinline__ int x_unit(int row, int u) { return row * 16 + (u ^ (2 * ((u >> 3) & 1)) ^ (row & 1)); }

__device__ __forceinline__ void stage_x(uint4 *buf, const u16 *__restrict__ x, int m0, int M, int K, int chunk) {
  for (int i = threadIdx.x; i < ROWS * 16; i += 128) {
    const int row = i >> 4, u = i & 15;
    const bool ok = m0 + row < M;
    const u16 *src = x + (u64)(ok ? m0 + row : m0) * K + 128 * chunk + 8 * u;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + x_unit(row, u));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));  // 0: zeros
  }
  asm volatile("cp.async.commit_group;");
}

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)
fp4_dense_gemm(const u16 *__restrict__ x, const u8 *__restrict__ codes, const u8 *__restrict__ scales,
               const float *__restrict__ gs, u16 *__restrict__ y, float *__restrict__ y32, int M, int N, int K,
               int splits) {
  __shared__ __align__(16) uint4 stage[2][ROWS * 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * ROWS, n0 = blockIdx.y * 64 + 16 * warp;  // first row, this warp's first feature
  const bool active = n0 < N;  // a warp past N still stages its share of x and meets the barriers
  const float gscale = gs[0];
  const u8 *wc = codes + (u64)(active ? n0 : 0) * (K / 2);
  const u8 *ws = scales + (u64)(active ? n0 : 0) * (K / 16);

  float acc[NT][4];  // n-tile j: features n0 + g (+8) x rows m0 + 8j + 2t (+1)
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const int per_split = K / 128 / splits, first = blockIdx.z * per_split, chunks = first + per_split;
  WeightChunk<2> cur, nxt;  // the warp's weight rows g, g + 8
  load_chunk(cur, wc, ws, K, first, g, t);
  stage_x(stage[0], x, m0, M, K, first);
  // L2 prefetch of the codes PREFETCH chunks past the next: lanes t < 2 ask for row g + 8t.
  const u8 *ahead = wc + (u64)(g + 8 * (t & 1)) * (K / 2) + 64 * (first + 1 + PREFETCH);
  for (int c = first; c < chunks; ++c, ahead += 64) {
    if (c + 1 < chunks) load_chunk(nxt, wc, ws, K, c + 1, g, t);
    if (PREFETCH > 0 && t < 2 && c + 1 + PREFETCH < chunks) asm volatile("prefetch.global.L2 [%0];" ::"l"(ahead));
    if (c + 1 < chunks) stage_x(stage[(c + 1 - first) & 1], x, m0, M, K, c + 1);
    else asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group 1;" ::: "memory");  // this thread's copies of chunk c
    __syncthreads();                                       // and everyone's
    const uint4 *buf = stage[(c - first) & 1];

    float sc[4];  // rows g, g + 8: blocks 2t (words 0, 1) and 2t + 1 (words 2, 3)
    e4m3x2_to_f32(cur.s[0], sc[0], sc[1]);
    e4m3x2_to_f32(cur.s[1], sc[2], sc[3]);
    const float gs4[4] = {gscale, gscale, gscale, gscale};
    Fp4Table tb[4];
    fp4_tables(sc, gs4, tb);
    const u32 w0[4] = {cur.w[0].x, cur.w[0].y, cur.w[0].z, cur.w[0].w};
    const u32 w1[4] = {cur.w[1].x, cur.w[1].y, cur.w[1].z, cur.w[1].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // word w: K elements [32t + 8w, + 8), k-steps 2w and 2w + 1
      u32 a[4], b[4];                // rows g and g + 8 as bf16 pairs
      dequant_word(w0[w], tb[w >> 1], a);
      dequant_word(w1[w], tb[2 + (w >> 1)], b);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 xv = buf[x_unit(8 * j + g, 4 * t + w)];  // row 8j + g, the same 8 K elements
        mma_bf16(acc[j], a[0], b[0], a[1], b[1], xv.x, xv.y);
        mma_bf16(acc[j], a[2], b[2], a[3], b[3], xv.z, xv.w);
      }
    }
    __syncthreads();  // every warp is done with buf before chunk c + 2 is staged into it
    cur = nxt;
  }

  if (!active) return;
  float *part = y32 + (u64)blockIdx.z * M * N;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = m0 + 8 * j + 2 * t + (e & 1), feature = n0 + g + 8 * (e >> 1);
      if (row >= M) continue;
      if (splits == 1)
        y[(u64)row * N + feature] = to_bf16(acc[j][e]);
      else
        part[(u64)row * N + feature] = acc[j][e];
    }
}
