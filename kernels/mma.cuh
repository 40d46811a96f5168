// Tensor-core helpers for mma.sync.m16n8k16 with fp32 accumulation, one struct per input dtype.
//
// Fragment layout (PTX ISA, "mma.m16n8k16"): lane l = 4*g + t holds accumulator rows g and g+8,
// columns 2t and 2t+1 of the 16x8 tile: c[0], c[1] on row g and c[2], c[3] on row g+8.
// A (16x16, row-major) and B (16x8, "col" = k-contiguous) come from ldmatrix as four/two b32
// registers, each two packed 16-bit values.
// mma touches registers only, so its asm is not volatile: the compiler may interleave it with the
// (volatile, smem-reading) ldmatrix loads to hide their latency.
#pragma once
#include "ptx.cuh"

namespace omni {

// d += a * b on fp16 (kBf16 false) or bf16 inputs.
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#define OMNI_MMA_M16N8K16(TYPE)                                                          \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                     \
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (kBf16) {
    OMNI_MMA_M16N8K16("bf16");
  } else {
    OMNI_MMA_M16N8K16("f16");
  }
#undef OMNI_MMA_M16N8K16
}

struct Fp16 {
  using Storage = u16;  // one element in memory (element.cuh: the traits every operand names)
  // Two floats -> one register of two fp16, `lo` in the low half (column 2t), round to nearest.
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  }
  // d += a * b
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { mma_m16n8k16<false>(d, a, b0, b1); }
};

struct Bf16 {
  using Storage = u16;
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(static_cast<u32>(x) << 16); }
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { mma_m16n8k16<true>(d, a, b0, b1); }
};

}  // namespace omni
