// Warp tile products on mma.sync.m16n8k16 (mma.cuh), shared by the backward's kv-tile kernel
// (bwd_kv_tile.cuh; pack_a also by bwd_wgmma.cuh and the forward templates, for P V) and the
// split-KV decode (decode_tile.cuh):
//
//   zero           clear an accumulator tile
//   mma_rows_rows  acc = A Bᵀ, A (one warp's rows) and B both stored [row][k] in shared memory
//   pack_a         two adjacent n8 accumulator tiles -> the A fragment of one k16 step
//   mma_regs_rows  acc += A B, A in registers (packed fragments), B stored [k][n] in shared memory
//   mma_smem_rows  acc += A B, A stored [m][k] and B stored [k][n], both in shared memory
//   mma_smem       the shared-memory products' loop (load_a_step, mma_n16), B as [n][k] or [k][n]
//
// Fragment layouts are those of mma.cuh: lane l holds rows l/4 and l/4 + 8, columns 2(l%4) and
// 2(l%4) + 1 of each 16x8 accumulator tile. Everything a product depends on is an explicit
// argument: tile counts, k steps, the shared-memory row stride (elements), the dtype struct
// (Fp16 / Bf16), this lane's ldmatrix address; no kernel configuration and no warp layout.
#pragma once
#include "mma.cuh"

namespace omni {

template <int kMT, int kNT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
}

// The A fragments of k16 step kk of kMT m16 tiles stored [m][k] with stride kLd (a_addr: this
// lane's ldmatrix row address of fragment (0, 0): row lane % 16, column half lane / 16).
template <int kMT, int kLd>
__device__ __forceinline__ void load_a_step(u32 (&a)[kMT][4], u32 a_addr, int kk) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], a_addr + (mt * 16 * kLd + kk * 16) * 2);
}

// acc[mt][nt], acc[mt][nt + 1] += A B for every m16 tile: b holds b0, b1 of n tile nt, then of nt + 1.
template <typename T, int kMT, int kNT>
__device__ __forceinline__ void mma_n16(float (&acc)[kMT][kNT][4], int nt, const u32 (&a)[kMT][4], const u32 (&b)[4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    T::mma(acc[mt][nt], a[mt], b[0], b[1]);
    T::mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
  }
}

// acc[mt][nt] += sum_k A[m][k] B[k][n] over kKSteps k16 steps, both in shared memory: A stored
// [m][k] with stride kLdA (a_addr as for load_a_step), B stored [n][k] (kBKN false: b_addr row
// (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2) or [k][n] (kBKN true, read transposed:
// row ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16) with stride kLdB.
template <int kMT, int kNT, int kKSteps, int kLdA, int kLdB, bool kBKN, typename T>
__device__ __forceinline__ void mma_smem(float (&acc)[kMT][kNT][4], u32 a_addr, u32 b_addr) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    u32 a[kMT][4];
    load_a_step<kMT, kLdA>(a, a_addr, kk);
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2) {
      u32 b[4];  // b0, b1 of n tile nt, then of nt + 1
      if constexpr (kBKN) {
        ldmatrix_x4_trans(b, b_addr + (kk * 16 * kLdB + nt * 8) * 2);
      } else {
        ldmatrix_x4(b, b_addr + (nt * 8 * kLdB + kk * 16) * 2);
      }
      mma_n16<T>(acc, nt, a, b);
    }
  }
}

// acc[mt][nt] = sum_k A[m][k] B[n][k] over kKSteps k16 steps. A: this warp's kMT m16 tiles, B:
// kNT * 8 rows, both stored [row][k] with stride kLd (a_addr / b_addr: this lane's ldmatrix row
// address of fragment (0, 0), as from the x4 layouts: A row lane % 16, column half lane / 16;
// B row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2).
template <int kMT, int kNT, int kKSteps, int kLd, typename T>
__device__ __forceinline__ void mma_rows_rows(float (&acc)[kMT][kNT][4], u32 a_addr, u32 b_addr) {
  zero(acc);
  mma_smem<kMT, kNT, kKSteps, kLd, kLd, false, T>(acc, a_addr, b_addr);
}

// The accumulator layout of two adjacent n8 tiles is the A fragment of one k16 step (the tile
// counts follow from the arrays: pack_a<T>(a, acc)).
template <typename T, int kMT, int kNT>
__device__ __forceinline__ void pack_a(u32 (&a)[kMT][kNT / 2][4], const float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      a[mt][kk][0] = T::pack(acc[mt][2 * kk][0], acc[mt][2 * kk][1]);
      a[mt][kk][1] = T::pack(acc[mt][2 * kk][2], acc[mt][2 * kk][3]);
      a[mt][kk][2] = T::pack(acc[mt][2 * kk + 1][0], acc[mt][2 * kk + 1][1]);
      a[mt][kk][3] = T::pack(acc[mt][2 * kk + 1][2], acc[mt][2 * kk + 1][3]);
    }
}

// acc[mt][dt] += sum_k A[m][k] B[k][n] for the first kLiveDT n8 tiles of acc (the others, a padded
// head dim's, stay as they are). A in registers (packed A fragments, k = kKSteps * 16), B stored
// [k][n] with stride kLd, read transposed (b_addr: this lane's address of fragment (0, 0), row
// ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16).
template <int kMT, int kDT, int kKSteps, int kLd, typename T, int kLiveDT = kDT>
__device__ __forceinline__ void mma_regs_rows(float (&acc)[kMT][kDT][4], const u32 (&a)[kMT][kKSteps][4], u32 b_addr) {
  static_assert(kLiveDT % 2 == 0 && kLiveDT <= kDT, "whole n16 pairs of the accumulator");
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int dt = 0; dt < kLiveDT; dt += 2) {
      u32 b[4];  // transposed: b0, b1 of n tile dt, then of dt + 1
      ldmatrix_x4_trans(b, b_addr + (kk * 16 * kLd + dt * 8) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        T::mma(acc[mt][dt], a[mt][kk], b[0], b[1]);
        T::mma(acc[mt][dt + 1], a[mt][kk], b[2], b[3]);
      }
    }
}

// acc[mt][dt] += sum_k A[m][k] B[k][n] with both in shared memory: A stored [m][k] with stride
// kLdA (a_addr as for mma_rows_rows' A), B stored [k][n] with stride kLdB, read transposed (b_addr
// as for mma_regs_rows).
template <int kMT, int kDT, int kKSteps, int kLdA, int kLdB, typename T>
__device__ __forceinline__ void mma_smem_rows(float (&acc)[kMT][kDT][4], u32 a_addr, u32 b_addr) {
  mma_smem<kMT, kDT, kKSteps, kLdA, kLdB, true, T>(acc, a_addr, b_addr);
}

}  // namespace omni
