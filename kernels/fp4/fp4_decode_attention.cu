// Split-K decode attention over a paged NVFP4 KV cache, one warp per (sequence, KV head, chunk).
//
// The same arithmetic as paged_attention.py's Triton kernel: every K and V element becomes
// bf16(fl32(e2m1 * s * g)) (the trainer's fake-quantized value, bit for bit) before a BF16 MMA,
// with an online softmax in FP32. What differs is that the MMA fragments are built straight in
// registers from the loaded words, with no shared memory and no byte-by-byte repacking:
//
//  S = Q K^T: mma.m16n8k16, A = Q (rows: the group's query heads, padded to 16), B = K^T (8
//    tokens). A dot product does not care in which order it visits the head dimension, so lane
//    (g, t) (g = lane / 4, t = lane % 4) feeds the MMA the 32 contiguous dims [32t, 32t + 32) of
//    its token: one 16-byte load, and the same permutation applied to Q when it is loaded.
//  O^T = V^T P^T: A = V^T (16 dims x 16 tokens), B = P^T (16 tokens x 8 heads), which is S's C
//    fragment as it stands: no padded rows, no shuffles. Lane (g, t) owns dims [16g, 16g + 16)
//    (one scale block) of tokens 2t, 2t+1, 2t+8, 2t+9; row g of m-tile i is dim 16g + 2i, row
//    g + 8 dim 16g + 2i + 1, so its C fragments hold dims [16g, 16g + 16) of heads 2t, 2t + 1.
//
// Dequantization: a per-block table of the 8 magnitudes' BF16 values, looked up with byte
// permutes (`fp4_tables`, `dequant_word`, `dequant_word_pairs` in fp4_mma.cuh).
//
// Compile-time constants (-D): HQ, HKV, G (query heads per KV head, <= 16), BS (cache block
// size, a multiple of 16), MIN_CHUNK, DOUBLINGS, SPLITS (as the Triton kernel). D is 128.

#define D 128
#define NEG_INF __int_as_float(0xff800000)
#include "fp4_mma.cuh"

__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// What one lane reads of a 16-token step.
struct Raw {
  uint4 k[2];     // K codes, tokens g and g + 8, bytes [16t, 16t + 16)
  u32 ks[2];      // their two scale bytes (blocks 2t, 2t + 1)
  float kg[2];
  uint2 v[4];     // V codes, tokens 2t, 2t+1, 2t+8, 2t+9, bytes [8g, 8g + 8)
  u32 vs[4];      // their scale byte (block g)
  float vg[4];
};

__device__ __forceinline__ void load_step(Raw &r, const u8 *__restrict__ kc, const u8 *__restrict__ ks,
                                          const float *__restrict__ kg, const u8 *__restrict__ vc,
                                          const u8 *__restrict__ vs, const float *__restrict__ vg, u64 row0,
                                          int g, int t) {
  // row0: (first slot of the step) * HKV + h; token k's row is row0 + k * HKV.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    u64 row = row0 + (u64)(g + 8 * j) * HKV;
    r.k[j] = *reinterpret_cast<const uint4 *>(kc + row * (D / 2) + 16 * t);
    r.ks[j] = *reinterpret_cast<const u16 *>(ks + row * (D / 16) + 2 * t);
    r.kg[j] = kg[row];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u64 row = row0 + (u64)(2 * t + (j & 1) + 8 * (j >> 1)) * HKV;
    r.v[j] = *reinterpret_cast<const uint2 *>(vc + row * (D / 2) + 8 * g);
    r.vs[j] = vs[row * (D / 16) + g];
    r.vg[j] = vg[row];
  }
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(32, MIN_BLOCKS)
fp4_decode_split(const u16 *__restrict__ q, const u8 *__restrict__ kc, const u8 *__restrict__ ks,
                 const float *__restrict__ kg, const u8 *__restrict__ vc, const u8 *__restrict__ vs,
                 const float *__restrict__ vg, const int *__restrict__ tables, const int *__restrict__ lens,
                 float *__restrict__ part_o, float *__restrict__ part_ml, int max_blocks, double scale) {
  const int b = blockIdx.x, h = blockIdx.y, c = blockIdx.z;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int n = lens[b];
  int chunk = MIN_CHUNK;
#pragma unroll
  for (int i = 0; i < DOUBLINGS; ++i) chunk = chunk * SPLITS < n ? chunk * 2 : chunk;
  const int start = c * chunk;
  if (start >= n) return;
  const int end = min(n, start + chunk);
  const float scale_log2 = (float)scale * 1.4426950408889634f;

  // Q rows g and g + 8 of the group, dims [32t, 32t + 32) as 16 bf16 pairs (the permuted order).
  u32 qa[16], qb[16];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = g + 8 * r;
    u32 *dst = r ? qb : qa;
    if (head < G) {
      const uint4 *src = reinterpret_cast<const uint4 *>(q + ((u64)b * HQ + h * G + head) * D + 32 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 x = src[i];
        dst[4 * i] = x.x; dst[4 * i + 1] = x.y; dst[4 * i + 2] = x.z; dst[4 * i + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[i] = 0u;
    }
  }

  // O^T: m-tile i (dims 16g + 2i, 16g + 2i + 1) x heads (2t, 2t + 1) + 8n for n-tile n.
  constexpr int NT = G > 8 ? 2 : 1;
  float acc[NT][8][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[n][i][0] = acc[n][i][1] = acc[n][i][2] = acc[n][i][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  const int *table = tables + (u64)b * max_blocks;
  auto row_of = [&](int t0) -> u64 {
    const u64 slot = (u64)table[t0 / BS] * BS + t0 % BS;
    return slot * HKV + h;
  };
  Raw cur, nxt;
  load_step(cur, kc, ks, kg, vc, vs, vg, row_of(start), g, t);

  for (int t0 = start; t0 < end; t0 += 16) {
    if (t0 + 16 < end) load_step(nxt, kc, ks, kg, vc, vs, vg, row_of(t0 + 16), g, t);
    const int valid = end - t0;  // tokens of this step that exist (may exceed 16)

    // ---- S = Q K^T for the step's two 8-token tiles ----
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const u32 words[4] = {cur.k[j].x, cur.k[j].y, cur.k[j].z, cur.k[j].w};
      float ksc[2];  // blocks 2t (words 0, 1) and 2t + 1 (words 2, 3)
      e4m3x2_to_f32(cur.ks[j], ksc[0], ksc[1]);
      const float kg2[2] = {cur.kg[j], cur.kg[j]};
      Fp4Table kt[2];
      fp4_tables(ksc, kg2, kt);
      u32 kb[16];
#pragma unroll
      for (int w = 0; w < 4; ++w) dequant_word(words[w], kt[w >> 1], kb + 4 * w);
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) mma_bf16(s[j], qa[2 * k], qb[2 * k], qa[2 * k + 1], qb[2 * k + 1], kb[2 * k], kb[2 * k + 1]);
    }

    // ---- online softmax (log2 domain); row r of the fragment is query head g + 8r ----
    float p[2][4];
    bool moved = false;
    float alpha[2];
#pragma unroll
    for (int r = 0; r < (G > 8 ? 2 : 1); ++r) {
      float x[4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = 8 * j + 2 * t + e;
          x[2 * j + e] = tok < valid ? s[j][2 * r + e] * scale_log2 : NEG_INF;
        }
      float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      alpha[r] = exp2_approx(m[r] - m_new);
      moved |= m_new != m[r];
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float e = exp2_approx(x[i] - m_new);
        p[i >> 1][2 * r + (i & 1)] = e;
        sum += e;
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = m_new;
    }
    if (__any_sync(0xffffffffu, moved)) {  // heads 2t, 2t + 1 (+ 8) of the accumulators: their alphas live in quads 2t, 2t + 1
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float a0 = __shfl_sync(0xffffffffu, alpha[n], 8 * t), a1 = __shfl_sync(0xffffffffu, alpha[n], 8 * t + 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[n][i][0] *= a0;
          acc[n][i][1] *= a1;
          acc[n][i][2] *= a0;
          acc[n][i][3] *= a1;
        }
      }
    }
    // P^T fragments (tokens 2t, 2t+1 | 2t+8, 2t+9 of head g + 8n): S's C fragments
    u32 pb[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      pb[n][0] = pack_bf16(p[0][2 * n], p[0][2 * n + 1]);
      pb[n][1] = pack_bf16(p[1][2 * n], p[1][2 * n + 1]);
    }

    // ---- O^T += V^T P^T, one scale block (16 dims) per lane, one 8-dim word at a time ----
    const u32 vwords[4][2] = {{cur.v[0].x, cur.v[0].y}, {cur.v[1].x, cur.v[1].y}, {cur.v[2].x, cur.v[2].y},
                              {cur.v[3].x, cur.v[3].y}};
    float vsc[4], vgs[4];
    e4m3x2_to_f32(cur.vs[0] | (cur.vs[1] << 8), vsc[0], vsc[1]);
    e4m3x2_to_f32(cur.vs[2] | (cur.vs[3] << 8), vsc[2], vsc[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // past the end: scale 0, so zeros whatever the cache holds there
      const bool ok = 2 * t + (j & 1) + 8 * (j >> 1) < valid;
      vsc[j] = ok ? vsc[j] : 0.f;
      vgs[j] = ok ? cur.vg[j] : 0.f;
    }
    Fp4Table vt[4];
    fp4_tables(vsc, vgs, vt);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      u32 v01[8], v23[8];  // dim e of the word: (token 2t, 2t + 1), (token 2t + 8, 2t + 9)
      dequant_word_pairs(vwords[0][w], vt[0], vwords[1][w], vt[1], v01);
      dequant_word_pairs(vwords[2][w], vt[2], vwords[3][w], vt[3], v23);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_bf16(acc[n][4 * w + i], v01[2 * i], v01[2 * i + 1], v23[2 * i], v23[2 * i + 1], pb[n][0], pb[n][1]);
    }
    cur = nxt;
  }

  // ---- partial results: rows of this chunk in part_o [B, HQ, SPLITS, D], (m, l) in part_ml ----
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float ln = l[n];  // head g + 8n
    ln += __shfl_xor_sync(0xffffffffu, ln, 1);
    ln += __shfl_xor_sync(0xffffffffu, ln, 2);
    const int head = g + 8 * n;
    if (t == 0 && head < G) {
      const u64 row = ((u64)b * HQ + h * G + head) * SPLITS + c;
      part_ml[row * 2] = m[n] * 0.6931471805599453f;  // natural-log units, as the combine expects
      part_ml[row * 2 + 1] = ln;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // accumulator columns: heads 2t + e (+ 8n), dims [16g, 16g + 16)
      const int col = 2 * t + e + 8 * n;
      if (col >= G) continue;
      const u64 row = ((u64)b * HQ + h * G + col) * SPLITS + c;
      float4 *dst = reinterpret_cast<float4 *>(part_o + row * D + 16 * g);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        dst[i] = make_float4(acc[n][2 * i][e], acc[n][2 * i][2 + e], acc[n][2 * i + 1][e], acc[n][2 * i + 1][2 + e]);
    }
  }
}
