// Online softmax over kv tiles (FlashAttention's m_i, l_i, alpha) on scores in the m16n8
// accumulator layout, each warp owning kMTiles m16 row tiles.
//
// Statistics live in the raw-score domain: m = running max of S, l = this lane's partial sum of
// exp2((S - m) * scale_log2) (the quad's four partials are added once, in finalize). update() turns
// S into P in place and returns per row the factor alpha = exp2((m_old - m_new) * scale_log2) by
// which O must be rescaled (rescale_o) before P V of this tile is added.
#pragma once
#include "ptx.cuh"

namespace omni {

constexpr float kLn2 = 0.69314718055994531f;

// Pairwise reduction of v[0..N) into v[0] (depth log2 N instead of N).
template <int N, typename Op>
__device__ __forceinline__ void tree_reduce(float (&v)[N], Op op) {
#pragma unroll
  for (int stride = 1; stride < N; stride *= 2)
#pragma unroll
    for (int i = 0; i + stride < N; i += 2 * stride) v[i] = op(v[i], v[i + stride]);
}

// kPolyExpEvery: every kPolyExpEvery-th n8 tile takes its exp2 on the FMA pipe (exp2_fma) instead of
// MUFU, whose throughput (16 per clock per SM) bounds the softmax at small head dims. 0: all MUFU.
template <int kMTiles, int kNTiles, int kPolyExpEvery>
struct OnlineSoftmax {
  float m[kMTiles][2];  // row max of raw scores, rows g and g + 8 of each m tile
  float l[kMTiles][2];  // this lane's partial row sum

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      m[mt][0] = m[mt][1] = neg_inf();
      l[mt][0] = l[mt][1] = 0.f;
    }
  }

  __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTiles][4], float (&alpha)[kMTiles][2],
                                         float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // half 0: row g, half 1: row g + 8
        // Row max and row sum as trees, not chains: with two warps per scheduler, dependent
        // fixed-latency instructions were the top stall.
        float part[kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) part[nt] = fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]);
        tree_reduce<kNTiles>(part, [](float a, float b) { return fmaxf(a, b); });
        float m_new = fmaxf(m[mt][half], part[0]);
        m_new = fmaxf(m_new, shfl_xor(m_new, 1));
        m_new = fmaxf(m_new, shfl_xor(m_new, 2));
        // A row with nothing allowed yet keeps m = -inf; subtract 0 instead so exp2 sees -inf, not NaN.
        const float base = (m_new == neg_inf()) ? 0.f : m_new * scale_log2;
        alpha[mt][half] = exp2_approx(m[mt][half] * scale_log2 - base);
        m[mt][half] = m_new;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          float& s0 = acc_s[mt][nt][2 * half];
          float& s1 = acc_s[mt][nt][2 * half + 1];
          // Every kPolyExpEvery-th n8 tile takes the FMA pipe's exp2 (compile-time choice per tile).
          const bool on_fma = kPolyExpEvery > 0 && nt % kPolyExpEvery == kPolyExpEvery - 1;
          const float x0 = fmaf(s0, scale_log2, -base), x1 = fmaf(s1, scale_log2, -base);
          s0 = on_fma ? exp2_fma(x0) : exp2_approx(x0);
          s1 = on_fma ? exp2_fma(x1) : exp2_approx(x1);
          part[nt] = s0 + s1;
        }
        tree_reduce<kNTiles>(part, [](float a, float b) { return a + b; });
        l[mt][half] = l[mt][half] * alpha[mt][half] + part[0];
      }
  }

  // The row's full sum (the quad's four partials) of row half `half` of m tile `mt`.
  __device__ __forceinline__ float row_sum(int mt, int half) const {
    float s = l[mt][half];
    s += shfl_xor(s, 1);
    s += shfl_xor(s, 2);
    return s;
  }
};

template <int kMTiles, int kDTiles>
__device__ __forceinline__ void rescale_o(float (&acc_o)[kMTiles][kDTiles][4], const float (&alpha)[kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] *= alpha[mt][i / 2];
}

}  // namespace omni
