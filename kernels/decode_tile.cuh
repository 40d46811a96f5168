// Tile math of the split-KV decode kernel (decode_split.cuh): S = Q Kᵀ, the online softmax and
// O += P V for one warp that owns kWarpRows query rows (kMTiles m16 tiles) and one 32-row kv tile
// at a time. Q sits in shared memory, shared by the CTA's warps; K and V in a ring slot. Fragment layouts are those of mma.cuh (m16n8k16): lane l holds rows l/4 and l/4 + 8,
// columns 2(l%4) and 2(l%4)+1 of each 16x8 accumulator tile.
//
// Plain CUDA, templated on the kernel's configuration Cfg (kHeadDim, kHeadDimValid, kBm, kBc, Mma), so the code
// is the same whatever the template renders.
#pragma once
#include "mma.cuh"

namespace omni {
namespace decode {

template <class Cfg, int kWarpRows>
struct Tile {
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kMTiles = kWarpRows / 16;   // m16 row tiles of one warp
  static constexpr int kNTiles = Cfg::kBc / 8;     // n8 column tiles of S
  static constexpr int kDTiles = kHeadDim / 8;     // n8 column tiles of O
  static constexpr int kQKSteps = (Cfg::kHeadDimValid + 15) / 16;  // k16 steps of S = Q Kᵀ holding real columns
  static constexpr int kPVSteps = Cfg::kBc / 16;   // k16 steps of O += P V
  static constexpr int kLd = kHeadDim + 8;         // smem row stride: +16 bytes keeps ldmatrix conflict-free
  static constexpr int kChunks = kHeadDim / 8;     // 16-byte chunks per row
  static_assert(kWarpRows % 16 == 0 && kNTiles % 2 == 0 && kDTiles % 2 == 0, "whole mma tiles");

  using S = float[kMTiles][kNTiles][4];
  using O = float[kMTiles][kDTiles][4];
  using Rows = float[kMTiles][2];  // per lane: rows l/4 (half 0) and l/4 + 8 (half 1) of each m tile
  using P = u32[kMTiles][kPVSteps][4];

  // This lane's ldmatrix row offsets (elements) inside a Q, K or V tile:
  //   Q (A, x4): row lane % 16, column half lane / 16;
  //   K (B, x4): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2;
  //   V (B, x4.trans): row ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16.
  static __device__ __forceinline__ int q_lane(int lane) { return (lane % 16) * kLd + (lane / 16) * 8; }
  static __device__ __forceinline__ int k_lane(int lane) { return ((lane / 16) * 8 + lane % 8) * kLd + ((lane / 8) % 2) * 8; }
  static __device__ __forceinline__ int v_lane(int lane) { return (((lane / 8) % 2) * 8 + lane % 8) * kLd + (lane / 16) * 8; }

  // ---- S = Q Kᵀ (q_addr / k_addr: this lane's shared addresses for fragment (0, 0, 0))
  static __device__ __forceinline__ void qk(S& acc_s, u32 q_addr, u32 k_addr) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kQKSteps; ++kk) {
      u32 a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q_addr + (mt * 16 * kLd + kk * 16) * 2);
#pragma unroll
      for (int nt = 0; nt < kNTiles; nt += 2) {
        u32 b[4];  // b0, b1 of n tile nt, then of nt + 1
        ldmatrix_x4(b, k_addr + (nt * 8 * kLd + kk * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Cfg::Mma::mma(acc_s[mt][nt], a[mt], b[0], b[1]);
          Cfg::Mma::mma(acc_s[mt][nt + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // ---- online softmax
  // m_i: running row max of the (transformed) scores; l_i: this lane's partial row sum of
  // exp2((s - m_i) * scale_log2) (the quad's four partials are added once, at the end). Turns S into
  // P in place and rescales O by alpha = exp2((m_old - m_new) * scale_log2). A row with nothing
  // allowed yet keeps m = -inf; it subtracts 0 instead, so exp2 sees -inf and gives 0, never NaN.
  static __device__ __forceinline__ void softmax(S& acc_s, Rows& m_i, Rows& l_i, O& acc_o, float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = m_i[mt][half];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        const float base = (mx == neg_inf()) ? 0.f : mx * scale_log2;
        const float alpha = exp2_approx(m_i[mt][half] * scale_log2 - base);
        m_i[mt][half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          float& s0 = acc_s[mt][nt][2 * half];
          float& s1 = acc_s[mt][nt][2 * half + 1];
          s0 = exp2_approx(fmaf(s0, scale_log2, -base));
          s1 = exp2_approx(fmaf(s1, scale_log2, -base));
          sum += s0 + s1;
        }
        l_i[mt][half] = l_i[mt][half] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mt][dt][2 * half] *= alpha;
          acc_o[mt][dt][2 * half + 1] *= alpha;
        }
      }
  }

  // ---- O += P V. P stays in registers: two adjacent n8 tiles of S are the A fragment of one k16 step.
  static __device__ __forceinline__ void pv(O& acc_o, const S& acc_s, u32 v_addr) {
    constexpr int kRealDTiles = (Cfg::kHeadDimValid + 15) / 16 * 2;  // n8 tiles of O holding real columns
    P p;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kk = 0; kk < kPVSteps; ++kk) {
        p[mt][kk][0] = Cfg::Mma::pack(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
        p[mt][kk][1] = Cfg::Mma::pack(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
        p[mt][kk][2] = Cfg::Mma::pack(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
        p[mt][kk][3] = Cfg::Mma::pack(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
      }
#pragma unroll
    for (int kk = 0; kk < kPVSteps; ++kk)
#pragma unroll
      for (int dt = 0; dt < kRealDTiles; dt += 2) {  // a padded variant's other columns stay zero, never stored
        u32 b[4];  // transposed: b0, b1 of d tile dt, then of dt + 1
        ldmatrix_x4_trans(b, v_addr + (kk * 16 * kLd + dt * 8) * 2);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Cfg::Mma::mma(acc_o[mt][dt], p[mt][kk], b[0], b[1]);
          Cfg::Mma::mma(acc_o[mt][dt + 1], p[mt][kk], b[2], b[3]);
        }
      }
  }
};

}  // namespace decode
}  // namespace omni
