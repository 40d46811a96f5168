// Warp tile products on mma.sync.m16n8k16 (fp16) whose B operand is stored in shared memory as fp8
// (element.cuh's E4M3 / E5M2): the serving form of fp8, 16-bit queries against an fp8 KV cache.
// ldmatrix moves 16-bit elements, so the B fragments are read with 16-bit and 8-bit shared loads
// and converted to f16x2 in registers (cvt ... e4m3x2 / e5m2x2: sm_89 and later). Same layouts
// as mma_tiles.cuh's mma_rows_rows and mma_regs_rows; strides and addresses are in bytes (one
// byte per element). Compile-only so far: no shipped variant uses it.
#pragma once
#include "element.cuh"
#include "mma_tiles.cuh"

namespace omni {

__device__ __forceinline__ u16 ld_shared_u16(u32 addr) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ u16 ld_shared_u8(u32 addr) {
  u16 v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(v) : "r"(addr));
  return v;
}

// This lane's byte offsets of B fragment (0, 0) in an fp8 tile with row stride kLd:
//   stored [n][k] (K for S = Q Kᵀ): row lane / 4, columns 2 (lane % 4) + {0, 1} (one 16-bit load);
//   stored [k][n] (V for O += P V): rows 2 (lane % 4) + {0, 1}, column lane / 4 (two byte loads).
template <int kLd>
__device__ __forceinline__ u32 fp8_rows_lane(int lane) { return (lane / 4) * kLd + (lane % 4) * 2; }
template <int kLd>
__device__ __forceinline__ u32 fp8_cols_lane(int lane) { return (lane % 4) * 2 * kLd + lane / 4; }

// acc[mt][nt] = sum_k A[m][k] B[n][k]: A 16-bit [m][k] (a_addr: ldmatrix address, as mma_rows_rows),
// B fp8 [n][k] (b_addr: shared base + fp8_rows_lane).
template <int kMT, int kNT, int kKSteps, int kLdA, int kLdB, class E>
__device__ __forceinline__ void mma_rows_rows_fp8(float (&acc)[kMT][kNT][4], u32 a_addr, u32 b_addr) {
  zero(acc);
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    u32 a[kMT][4];
    load_a_step<kMT, kLdA>(a, a_addr, kk);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const u32 at = b_addr + nt * 8 * kLdB + kk * 16;
      const u32 b0 = E::to_f16x2(ld_shared_u16(at)), b1 = E::to_f16x2(ld_shared_u16(at + 8));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) Fp16::mma(acc[mt][nt], a[mt], b0, b1);
    }
  }
}

// acc[mt][dt] += sum_k A[m][k] B[k][n] for the first kLiveDT n8 tiles: A in registers (packed fp16
// fragments), B fp8 [k][n] (b_addr: shared base + fp8_cols_lane).
template <int kMT, int kDT, int kKSteps, int kLd, class E, int kLiveDT = kDT>
__device__ __forceinline__ void mma_regs_rows_fp8(float (&acc)[kMT][kDT][4], const u32 (&a)[kMT][kKSteps][4], u32 b_addr) {
  const auto pair = [&](u32 at) {  // B[k][n], B[k + 1][n] as two fp16 values, k's in the low half
    return E::to_f16x2(static_cast<u16>(ld_shared_u8(at) | (ld_shared_u8(at + kLd) << 8)));
  };
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int dt = 0; dt < kLiveDT; ++dt) {
      const u32 at = b_addr + kk * 16 * kLd + dt * 8;
      const u32 b0 = pair(at), b1 = pair(at + 8 * kLd);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) Fp16::mma(acc[mt][dt], a[mt][kk], b0, b1);
    }
}

}  // namespace omni
