// The two GEMMs of the Hopper forward families (fwd_wgmma.cuh, fwd_tma.cuh) on wgmma, for one
// consumer warpgroup of 64 query rows: S = Q Kᵀ (m64n{kBc}k16, Q and K from 128-byte swizzled
// shared memory) and O += P V (m64n{kHeadDim}k16, P from registers, V from shared memory). Both
// are asynchronous: the caller fences, commits, waits and pins (wgmma.cuh).
#pragma once
#include "wgmma.cuh"

namespace omni {
namespace fwd_hopper {

template <class Cfg>
struct Gemms {
  using Mma = typename Cfg::Mma;
  using Storage = typename Cfg::QElem::Storage;  // Q's, K's and V's elements in memory
  enum : int {
    kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles,
    // k16 steps of S = Q Kᵀ: those holding real columns (a padded variant's last ones are zeros)
    kQKSteps = (Cfg::kHeadDimValid + 15) / 16,
    kPVSteps = Cfg::kBc / 16,  // k16 steps of O += P V
    kKStepBytes = 32,          // a k16 step along a 128-byte swizzled row
  };

  // S = Q Kᵀ: one m64n{kBc}k16 per k16 step; the first overwrites the accumulators. q_desc and
  // k_desc describe the tiles' first k16 step; later steps only move the start address
  // (compile-time offsets), so no descriptor is rebuilt per wgmma.
  static __device__ __forceinline__ void issue_qk(float (&acc_s)[kMTiles][kNTiles][4], u64 q_desc, u64 k_desc) {
#pragma unroll
    for (int kk = 0; kk < kQKSteps; ++kk) {
      const u32 column = kk * 16 / wgmma::kBlockCols, step = (kk * 16 % wgmma::kBlockCols) / 16;
      const u64 a = wgmma::advance(q_desc, column * Cfg::kBr * wgmma::kSwizzleBytes + step * kKStepBytes);
      const u64 b = wgmma::advance(k_desc, column * Cfg::kBc * wgmma::kSwizzleBytes + step * kKStepBytes);
      if (kk == 0) {
        wgmma::Op<Cfg::kBc, Mma>::ss_init(acc_s[0], a, b);
      } else {
        wgmma::Op<Cfg::kBc, Mma>::ss(acc_s[0], a, b);
      }
    }
  }

  // O += P V. P is the register A operand (pack_a's m16n8k16 fragments); V is N-major: k16 step kk
  // starts 16 rows (two swizzle atoms) further in, the next 64 head_dim columns are a column block
  // on (the descriptor's leading byte offset).
  static __device__ __forceinline__ void issue_pv(float (&acc_o)[kMTiles][kDTiles][4],
                                                  const u32 (&p)[kMTiles][kPVSteps][4], u64 v_desc) {
#pragma unroll
    for (int kk = 0; kk < kPVSteps; ++kk) {
      wgmma::Op<Cfg::kHeadDim, Mma>::rs(acc_o[0], p[0][kk], wgmma::advance(v_desc, kk * 16 * wgmma::kSwizzleBytes));
    }
  }

  // The same, waited for: S = Q Kᵀ / O += P V complete when these return.
  static __device__ __forceinline__ void qk_now(float (&acc_s)[kMTiles][kNTiles][4], u64 q_desc, u64 k_desc) {
    wgmma::fence();
    issue_qk(acc_s, q_desc, k_desc);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc_s[0]);
  }
  static __device__ __forceinline__ void pv_now(float (&acc_o)[kMTiles][kDTiles][4],
                                                const u32 (&p)[kMTiles][kPVSteps][4], u64 v_desc) {
    wgmma::fence();
    issue_pv(acc_o, p, v_desc);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc_o[0]);
  }

  // wgmma reads its register A operand asynchronously: keep P in its registers until the wait.
  static __device__ __forceinline__ void hold(const u32 (&p)[kMTiles][kPVSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPVSteps; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(p[0][kk][i]) : "memory");
  }
};

}  // namespace fwd_hopper
}  // namespace omni
