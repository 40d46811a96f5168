// Merge of split-KV partials (decode_split.cuh) into the output rows and their LSE.
//
// Split s left, for output row r, an unnormalized fp32 row acc_s = sum_j 2^(s_j - m_s) v_j (scores
// in log2 units), its max m_s and its sum l_s (m_s = -inf, l_s = 0, acc_s = 0 when the split had no
// allowed key). With M = max_s m_s and w_s = 2^(m_s - M) (0 for empty splits):
//     out = sum_s w_s acc_s / sum_s w_s l_s,    lse = (M + log2 sum_s w_s l_s) * ln 2,
// and a row no split saw gets zeros and -inf. One warp per row; lane l owns column pairs
// 2l, 2l + 64, ... The template supplies Cfg (kHeadDim, kHeadDimValid, kWarps, Mma) and CombineParams.
#pragma once
#include "mma.cuh"

namespace omni {
namespace decode {

template <class Cfg, class Params>
__device__ __forceinline__ void combine(const Params& p) {
  constexpr int kPairs = Cfg::kHeadDimValid / 2;  // the caller's columns; part_o rows keep the tile's stride
  constexpr int kSteps = (kPairs + 31) / 32;
  constexpr float kLn2 = 0.69314718055994531f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * Cfg::kWarps + warp;
  if (row >= p.rows) return;
  const i64 rows = p.rows;
  const int splits = p.num_splits;

  float mx = neg_inf();
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldg(p.part_ml + (s * rows + row) * 2));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float2 ml = __ldg(reinterpret_cast<const float2*>(p.part_ml) + s * rows + row);
    if (ml.x != neg_inf()) sum += exp2_approx(ml.x - mx) * ml.y;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += shfl_xor(sum, o);

  float2 acc[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) acc[i] = make_float2(0.f, 0.f);
  for (int s = 0; s < splits; ++s) {
    const float m = __ldg(p.part_ml + (s * rows + row) * 2);  // one address for the warp: a broadcast
    if (m == neg_inf()) continue;                            // an empty split adds nothing
    const float w = exp2_approx(m - mx);
    const float2* src = reinterpret_cast<const float2*>(p.part_o + (s * rows + row) * Cfg::kHeadDim);
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int pair = i * 32 + lane;
      if (pair < kPairs) {
        const float2 v = __ldg(src + pair);
        acc[i].x = fmaf(w, v.x, acc[i].x);
        acc[i].y = fmaf(w, v.y, acc[i].y);
      }
    }
  }

  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const int q_len = p.q_len, heads = p.num_heads;
  const int i_q = row % q_len, h = (row / q_len) % heads, b = row / (q_len * heads);
  u32* dst = reinterpret_cast<u32*>(p.o + b * p.o_sb + static_cast<i64>(h) * p.o_sh + static_cast<i64>(i_q) * p.o_sn);
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int pair = i * 32 + lane;
    if (pair < kPairs) dst[pair] = Cfg::Mma::pack(acc[i].x * inv, acc[i].y * inv);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[row] = sum > 0.f ? (mx + __log2f(sum)) * kLn2 : neg_inf();
}

}  // namespace decode
}  // namespace omni
