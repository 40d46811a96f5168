// Tile math of the split-KV decode kernel (decode_split.cuh): S = Q Kᵀ, the online softmax and
// O += P V for one warp that owns kWarpRows query rows (kMTiles m16 tiles) and one 32-row kv tile
// at a time. Q sits in shared memory, shared by the CTA's warps; K and V in a ring slot. The
// products are mma_tiles.cuh's (shared with the backward's kv-tile kernel); fragment layouts are
// those of mma.cuh (m16n8k16): lane l holds rows l/4 and l/4 + 8, columns 2(l%4) and 2(l%4)+1 of
// each 16x8 accumulator tile.
//
// Plain CUDA, templated on the kernel's configuration Cfg (kHeadDim, kHeadDimValid, kBm, kBc, Mma),
// so the code is the same whatever the template renders.
#pragma once
#include "mma_tiles.cuh"

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

  // Calls f(mt, nt, i, col) for every score acc_s[mt][nt][i] this lane holds; col: its key within the tile.
  template <class F>
  static __device__ __forceinline__ void for_each_score(int lane, F f) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) f(mt, nt, i, nt * 8 + (lane % 4) * 2 + (i % 2));
  }

  // ---- S = Q Kᵀ (q_addr / k_addr: this lane's shared addresses for fragment (0, 0, 0)), over the
  // k16 steps that hold real columns
  static __device__ __forceinline__ void qk(S& acc_s, u32 q_addr, u32 k_addr) {
    mma_rows_rows<kMTiles, kNTiles, kQKSteps, kLd, typename Cfg::Mma>(acc_s, q_addr, k_addr);
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

  // ---- O += P V. P stays in registers: two adjacent n8 tiles of S are the A fragment of one k16
  // step. A padded variant's other columns of O stay zero, never stored.
  static __device__ __forceinline__ void pv(O& acc_o, const S& acc_s, u32 v_addr) {
    constexpr int kRealDTiles = (Cfg::kHeadDimValid + 15) / 16 * 2;  // n8 tiles of O holding real columns
    P p;
    pack_a<typename Cfg::Mma>(p, acc_s);
    mma_regs_rows<kMTiles, kDTiles, kPVSteps, kLd, typename Cfg::Mma, kRealDTiles>(acc_o, p, v_addr);
  }
};

}  // namespace decode
}  // namespace omni
