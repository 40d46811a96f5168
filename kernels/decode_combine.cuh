// Merge of split-KV partials (decode_split.cuh) into the output rows and their LSE.
//
// Split s left, for output row r, an unnormalized fp32 row acc_s = sum_j 2^(s_j - m_s) v_j (scores
// in log2 units), its max m_s and its sum l_s (m_s = -inf, l_s = 0, acc_s = 0 when the split had no
// allowed key). With M = max_s m_s and w_s = 2^(m_s - M) (0 for empty splits):
//     out = sum_s w_s acc_s / sum_s w_s l_s,    lse = (M + log2 sum_s w_s l_s) * ln 2,
// and a row no split saw gets zeros and -inf. One warp per row; lane l owns column pairs
// 2l, 2l + 64, ...
//
// merge_row is shared by two callers: the combine kernel (its own launch after the split kernel,
// reading the partials through the read-only path) and the split kernel's fused tail (the last
// CTA of an (m tile, kv head, batch) merges while other CTAs of the same launch may still run, so
// it reads through L2 only: ld.global.cg, never a possibly stale L1 line). The combine template
// supplies Cfg (kHeadDim, kHeadDimValid, kWarps, Mma) and CombineParams.
#pragma once
#include "mma.cuh"

namespace omni {
namespace decode {

// Loads of partials: kCoherent reads through L2 (ld.global.cg: written by other CTAs of this
// launch); otherwise the read-only cache (written by an earlier launch).
template <bool kCoherent>
__device__ __forceinline__ float load_partial(const float* p) {
  if constexpr (kCoherent) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
  } else {
    return __ldg(p);
  }
}

template <bool kCoherent>
__device__ __forceinline__ float2 load_partial2(const float* p) {
  if constexpr (kCoherent) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
  } else {
    return __ldg(reinterpret_cast<const float2*>(p));
  }
}

// One output row from `splits` partial rows (row `row` of [splits, rows, D] and [splits, rows, 2]),
// by one warp: writes the kHeadDimValid elements at `dst` and, when lse is non-null, *lse. The
// partial rows keep the tile's stride kHeadDim (wider than the caller's when padded).
template <int kHeadDim, int kHeadDimValid, class Mma, bool kCoherent>
__device__ __forceinline__ void merge_row(const float* part_o, const float* part_ml, i64 rows, int splits, i64 row,
                                          u16* dst_row, float* lse, int lane) {
  constexpr int kPairs = kHeadDimValid / 2;  // the caller's columns
  constexpr int kSteps = (kPairs + 31) / 32;
  constexpr float kLn2 = 0.69314718055994531f;
  float mx = neg_inf();
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, load_partial<kCoherent>(part_ml + (s * rows + row) * 2));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float2 ml = load_partial2<kCoherent>(part_ml + (s * rows + row) * 2);
    if (ml.x != neg_inf()) sum += exp2_approx(ml.x - mx) * ml.y;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += shfl_xor(sum, o);

  float2 acc[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) acc[i] = make_float2(0.f, 0.f);
  for (int s = 0; s < splits; ++s) {
    const float m = load_partial<kCoherent>(part_ml + (s * rows + row) * 2);  // one address: a broadcast
    if (m == neg_inf()) continue;                                              // an empty split adds nothing
    const float w = exp2_approx(m - mx);
    const float* src = part_o + (s * rows + row) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int pair = i * 32 + lane;
      if (pair < kPairs) {
        const float2 v = load_partial2<kCoherent>(src + 2 * pair);
        acc[i].x = fmaf(w, v.x, acc[i].x);
        acc[i].y = fmaf(w, v.y, acc[i].y);
      }
    }
  }

  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  u32* dst = reinterpret_cast<u32*>(dst_row);
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int pair = i * 32 + lane;
    if (pair < kPairs) dst[pair] = Mma::pack(acc[i].x * inv, acc[i].y * inv);
  }
  if (lane == 0 && lse != nullptr) *lse = sum > 0.f ? (mx + __log2f(sum)) * kLn2 : neg_inf();
}

// The combine kernel: output row blockIdx.x * kWarps + warp, rows ordered (b, h, i).
template <class Cfg, class Params>
__device__ __forceinline__ void combine(const Params& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * Cfg::kWarps + warp;
  if (row >= p.rows) return;
  const int q_len = p.q_len, heads = p.num_heads;
  const int i_q = row % q_len, h = (row / q_len) % heads, b = row / (q_len * heads);
  u16* dst = p.o + b * p.o_sb + static_cast<i64>(h) * p.o_sh + static_cast<i64>(i_q) * p.o_sn;
  merge_row<Cfg::kHeadDim, Cfg::kHeadDimValid, typename Cfg::Mma, false>(p.part_o, p.part_ml, p.rows, p.num_splits, row, dst,
                                                     p.lse == nullptr ? nullptr : p.lse + row, lane);
}

}  // namespace decode
}  // namespace omni
