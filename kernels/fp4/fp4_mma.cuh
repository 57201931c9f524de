// Device helpers shared by the FP4 decode kernels (fp4_decode_attention.cu, fp4_grouped_gemm.cu):
// the in-register NVFP4 dequantization and the BF16 MMA. Header-only, no CUDA headers needed.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float((u32)v << 16); }

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two_bytes) {
  u32 r;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(r) : "r"(two_bytes));
  return r;
}

__device__ __forceinline__ void f16x2_to_f32(u32 h, float &lo, float &hi) {
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}"
      : "=f"(lo), "=f"(hi) : "r"(h));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// FP32 values of two E4M3 scale bytes (bits 0-7 and 8-15), exact.
__device__ __forceinline__ void e4m3x2_to_f32(u32 two_bytes, float &lo, float &hi) {
  f16x2_to_f32(e4m3x2_to_f16x2(two_bytes), lo, hi);
}

// Dequantization by table lookup. Within one scale block an element's BF16 value depends only on
// its 3 magnitude bits and its sign: value(code) = (-1)^sign * bf16(fl32(m * s * g)) for the 8
// magnitudes m of E2M1 (`dequantize` computes m * s exactly, then the FP32 product with g, then
// rounds once; RNE rounding is symmetric, so the sign is a bit flip). `fp4_tables` computes the 8
// values once per block and splits them into a plane of low bytes and one of high bytes, 8 bytes
// each: a PRMT (byte permute) then looks up 4 elements at once, with the magnitude bits as its
// selector nibbles. Byte selectors of PRMT: nibble i picks output byte i from (a: 0-3, b: 4-7).
constexpr u32 LO_BYTES = 0x6420u;      // the low bytes of two bf16 pairs
constexpr u32 HI_BYTES = 0x7531u;      // their high bytes
constexpr u32 PAIR_01 = 0x5140u;       // (lo 0, hi 0, lo 1, hi 1) of a low-byte and a high-byte plane
constexpr u32 PAIR_23 = 0x7362u;       // (lo 2, hi 2, lo 3, hi 3)
constexpr u32 SIGN_0123 = 0x1504u;     // sign of element j (w bit 4j + 3) to bit 7 of byte j, from (w, w << 4)
constexpr u32 SIGN_4567 = 0x3726u;     // the same for elements 4-7
constexpr u32 MAGNITUDES = 0x77777777u;
constexpr u32 BF16_DOUBLE = 0x00800080u;  // + 1 on the exponent of both halves of a bf16 pair

struct Fp4Table {
  u32 lo0, lo1;  // low bytes of the values of magnitude codes 0-3, 4-7
  u32 hi0, hi1;  // their high bytes
};

// fl32(s g) in [2^-120, 2^120] keeps the 8 values normal and finite: then `fp4_table_fast` is
// exact. One unsigned compare of its bits: zero, negatives and NaN fall outside.
constexpr u32 FAST_MIN = 0x03800000u;   // bits of 2^-120
constexpr u32 FAST_SPAN = 0x78000000u;  // bits of 2^120 minus those of 2^-120

__device__ __forceinline__ Fp4Table fp4_planes_of(u32 v01, u32 v23, u32 v45, u32 v67) {
  return {prmt(v01, v23, LO_BYTES), prmt(v45, v67, LO_BYTES), prmt(v01, v23, HI_BYTES), prmt(v45, v67, HI_BYTES)};
}

// The block's table from its scale s (FP32 of the E4M3 byte) and the global scale g. Magnitude
// codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 2^k * {1, 1.5}: with fl32(s g) and fl32(1.5 s g) in
// the normal range, doubling a value (in FP32, then in BF16) only adds 1 to its exponent, so two
// products and three integer adds give all 8. `exact` says whether s g was in that range.
__device__ __forceinline__ Fp4Table fp4_table_fast(float s, float g, bool &exact) {
  const float f1 = s * g, f15 = (1.5f * s) * g;
  const u32 v23 = pack_bf16(f1, f15);
  exact = __float_as_uint(f1) - FAST_MIN <= FAST_SPAN;
  return fp4_planes_of(v23 * 0x10000u - (BF16_DOUBLE << 16), v23, v23 + BF16_DOUBLE, v23 + 2 * BF16_DOUBLE);
}

// Any s and g (zero, tiny, huge, NaN): each value computed as `dequantize` computes it.
__device__ __forceinline__ Fp4Table fp4_table_exact(float s, float g) {
  return fp4_planes_of(pack_bf16((0.f * s) * g, (0.5f * s) * g), pack_bf16(s * g, (1.5f * s) * g),
                       pack_bf16((2.f * s) * g, (3.f * s) * g), pack_bf16((4.f * s) * g, (6.f * s) * g));
}

// N tables (scales s[i], global scales g[i]): the fast way, redone the exact way for all N in the
// rare case that one of them needs it (one branch, not taken on ordinary data).
template <int N>
__device__ __forceinline__ void fp4_tables(const float (&s)[N], const float (&g)[N], Fp4Table (&t)[N]) {
  bool exact = true;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    bool e;
    t[i] = fp4_table_fast(s[i], g[i], e);
    exact &= e;
  }
  if (!exact) {
#pragma unroll
    for (int i = 0; i < N; ++i) t[i] = fp4_table_exact(s[i], g[i]);
  }
}

// Byte planes of the 8 elements of word w (element 2j in byte j's low nibble, 2j + 1 in its high
// nibble), signs applied: byte j of lo_a / hi_a is the low / high byte of element j, of lo_b /
// hi_b of element j + 4.
struct Fp4Planes {
  u32 lo_a, hi_a, lo_b, hi_b;
};

__device__ __forceinline__ Fp4Planes fp4_planes(u32 w, const Fp4Table &tb) {
  const u32 mag = w & MAGNITUDES, mag_hi = __umulhi(mag, 0x10000u), w4 = w << 4;  // >> 16 on the FMA pipe
  const u32 sign_a = prmt(w, w4, SIGN_0123) & 0x80808080u, sign_b = prmt(w, w4, SIGN_4567) & 0x80808080u;
  return {prmt(tb.lo0, tb.lo1, mag), prmt(tb.hi0, tb.hi1, mag) ^ sign_a, prmt(tb.lo0, tb.lo1, mag_hi),
          prmt(tb.hi0, tb.hi1, mag_hi) ^ sign_b};
}

// The 8 elements of word w as 4 bf16 pairs: out[p] = (element 2p, element 2p + 1).
__device__ __forceinline__ void dequant_word(u32 w, const Fp4Table &tb, u32 out[4]) {
  const Fp4Planes p = fp4_planes(w, tb);
  out[0] = prmt(p.lo_a, p.hi_a, PAIR_01);
  out[1] = prmt(p.lo_a, p.hi_a, PAIR_23);
  out[2] = prmt(p.lo_b, p.hi_b, PAIR_01);
  out[3] = prmt(p.lo_b, p.hi_b, PAIR_23);
}

// Element e of words x and y (two rows, each with its table) as one bf16 pair: out[e] = (x_e, y_e).
__device__ __forceinline__ void dequant_word_pairs(u32 x, const Fp4Table &tx, u32 y, const Fp4Table &ty, u32 out[8]) {
  const Fp4Planes a = fp4_planes(x, tx), b = fp4_planes(y, ty);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const u32 lo_x = half ? a.lo_b : a.lo_a, hi_x = half ? a.hi_b : a.hi_a;
    const u32 lo_y = half ? b.lo_b : b.lo_a, hi_y = half ? b.hi_b : b.hi_a;
    const u32 lo01 = prmt(lo_x, lo_y, PAIR_01), hi01 = prmt(hi_x, hi_y, PAIR_01);  // elements 0, 1 of x, y
    const u32 lo23 = prmt(lo_x, lo_y, PAIR_23), hi23 = prmt(hi_x, hi_y, PAIR_23);
    out[4 * half] = prmt(lo01, hi01, PAIR_01);
    out[4 * half + 1] = prmt(lo01, hi01, PAIR_23);
    out[4 * half + 2] = prmt(lo23, hi23, PAIR_01);
    out[4 * half + 3] = prmt(lo23, hi23, PAIR_23);
  }
}

__device__ __forceinline__ void mma_bf16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// What one lane (g, t) of a GEMM warp reads of one 128-wide K chunk of R weight rows: row i is
// 16 * (i / 2) + g + 8 * (i % 2) of the warp's (rows g, g + 8 of m-tile i / 2), its 16 code
// bytes [16t, 16t + 16) (K elements [32t, 32t + 32)) and their two scale bytes (blocks 2t, 2t + 1).
template <int R>
struct WeightChunk {
  uint4 w[R];
  u32 s[R];
};

template <int R>
__device__ __forceinline__ void load_chunk(WeightChunk<R> &c, const u8 *__restrict__ wc, const u8 *__restrict__ ws,
                                           int K, int chunk, int g, int t) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const u64 row = 16 * (i >> 1) + g + 8 * (i & 1);
    c.w[i] = *reinterpret_cast<const uint4 *>(wc + row * (K / 2) + 64 * chunk + 16 * t);
    c.s[i] = *reinterpret_cast<const u16 *>(ws + row * (K / 16) + 8 * chunk + 2 * t);
  }
}
