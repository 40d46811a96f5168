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
//
// Written for memory latency, not arithmetic: every load's address is known up front and no
// branch waits for a loaded value, so the loads of many splits are in flight together (the fused
// tail used to wait one L2 round trip per split: 16 splits took ~5 µs, lab/notes/decode.md#s35).
//   1. The rows of the first kBatch splits are requested first; while they travel, lane l reads
//      (m, l) of splits l, l + 32, ... and the warp merges the lanes' running (max, sum) into M
//      and sum_s w_s l_s.
//   2. Per 32 splits, lane l holds w of split 32 c + l (the first 32 from step 1, no reload); the
//      rows arrive kBatch splits at a time, each batch requested whole before any of it is used,
//      and each split's weight comes by a shuffle. An empty split has w = 0 and zero rows.
template <int kHeadDim, int kHeadDimValid, class Mma, bool kCoherent>
__device__ __forceinline__ void merge_row(const float* part_o, const float* part_ml, i64 rows, int splits, i64 row,
                                          u16* dst_row, float* lse, int lane) {
  constexpr int kPairs = kHeadDimValid / 2;  // the caller's columns
  constexpr int kSteps = (kPairs + 31) / 32;
  constexpr int kBatch = kSteps <= 2 ? 16 : 8;  // splits whose rows are in flight together (64 registers)
  static_assert(32 % kBatch == 0, "batches inside one 32-split chunk");
  constexpr float kLn2 = 0.69314718055994531f;
  const auto weight = [](float m, float mx) { return m == neg_inf() ? 0.f : exp2_approx(m - mx); };
  float2 v[kBatch][kSteps];  // one batch of rows: this lane's column pairs of splits b0 .. b0 + kBatch - 1
  const auto load_batch = [&](int b0) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float* src = part_o + ((b0 + j) * rows + row) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        const int pair = i * 32 + lane;
        v[j][i] = b0 + j < splits && pair < kPairs ? load_partial2<kCoherent>(src + 2 * pair) : make_float2(0.f, 0.f);
      }
    }
  };
  load_batch(0);

  // ---- 1. M and sum_s w_s l_s: each lane's running pair, then the warp's
  float m_lane = neg_inf(), l_lane = 0.f, m_first = neg_inf();
  for (int s = lane; s < splits; s += 32) {
    const float2 ml = load_partial2<kCoherent>(part_ml + (s * rows + row) * 2);
    if (s == lane) m_first = ml.x;
    const float m_new = fmaxf(m_lane, ml.x);
    l_lane = l_lane * weight(m_lane, m_new) + ml.y * weight(ml.x, m_new);
    m_lane = m_new;
  }
  float mx = m_lane;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = l_lane * weight(m_lane, mx);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += shfl_xor(sum, o);

  // ---- 2. sum_s w_s acc_s
  float2 acc[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) acc[i] = make_float2(0.f, 0.f);
  for (int c0 = 0; c0 < splits; c0 += 32) {
    const int s_lane = c0 + lane;
    const float m = c0 == 0 ? m_first : (s_lane < splits ? load_partial<kCoherent>(part_ml + (s_lane * rows + row) * 2)
                                                         : neg_inf());
    const float w_lane = weight(m, mx);
    for (int b0 = c0; b0 < min(c0 + 32, splits); b0 += kBatch) {
      if (b0 != 0) load_batch(b0);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = __shfl_sync(0xffffffffu, w_lane, b0 + j - c0);  // 0 past the last split (its v is 0 too)
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
          acc[i].x = fmaf(w, v[j][i].x, acc[i].x);
          acc[i].y = fmaf(w, v[j][i].y, acc[i].y);
        }
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
