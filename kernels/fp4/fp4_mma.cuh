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

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two_bytes) {
  u32 r;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(r) : "r"(two_bytes));
  return r;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void f16x2_to_f32(u32 h, float &lo, float &hi) {
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}"
      : "=f"(lo), "=f"(hi) : "r"(h));
}

// f16x2 (s, s) of an E4M3 scale byte.
__device__ __forceinline__ u32 scale_f16x2(u32 byte) {
  return e4m3x2_to_f16x2(byte | (byte << 8));
}

// The 8 values of word w (element 2j in byte j's low nibble, 2j + 1 in its high nibble), in order,
// as FP32 fl32(e2m1 * s * g) (the caller packs pairs to BF16, the value `dequantize` gives):
// the magnitude bits move into an E4M3 byte worth e2m1 / 64, Hopper converts two bytes to f16x2
// in one instruction, one f16x2 multiply by the scale s2 = (s, s) is exact (at most six
// significant bits), and (e2m1 * s / 64) * (64 g) rounds to FP32 as (e2m1 * s) * g does.
__device__ __forceinline__ void dequant_word(u32 w, u32 s2, float g64, float v[8]) {
  u32 even = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);  // E4M3 bytes: e2m1 / 64
  u32 odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
  u32 e01 = hmul2(e4m3x2_to_f16x2(even), s2), e23 = hmul2(e4m3x2_to_f16x2(even >> 16), s2);
  u32 o01 = hmul2(e4m3x2_to_f16x2(odd), s2), o23 = hmul2(e4m3x2_to_f16x2(odd >> 16), s2);
  f16x2_to_f32(e01, v[0], v[2]);
  f16x2_to_f32(e23, v[4], v[6]);
  f16x2_to_f32(o01, v[1], v[3]);
  f16x2_to_f32(o23, v[5], v[7]);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= g64;
}

__device__ __forceinline__ void mma_bf16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
