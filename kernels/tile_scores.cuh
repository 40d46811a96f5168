// Per-score work on one tile of S = Q Kᵀ held in the m16n8 accumulator layout: the score transform
// (score_hooks.cuh: scale, additive bias, a score modifier) and the mask (causal diagonal, stored partial bits or a
// fused mask expression, sequence tails), applied before the softmax statistics see the scores.
//
// Layout (PTX ISA, mma.m16n8k16): lane l holds rows l/4 and l/4 + 8 of each m16 tile and columns
// 2(l%4), 2(l%4)+1 of each n8 tile; acc[mt][nt][i]: row half i/2, column i%2.
#pragma once
#include "block_walk.cuh"
#include "mma.cuh"
#include "score_hooks.cuh"

namespace omni {

// Where a tile of scores sits: this warp's first query row, the CTA's q tile and its mask row.
struct ScoreTile {
  int batch, head;
  int q0;        // first query row of the CTA
  int q_row0;    // first query row of this warp
  int q_block;   // q block of the CTA (the mask's row)
  i64 mask_row;  // row of the block mask
  int lane;
};

// Calls f(score, q, kv, mt, nt, i) on every score this lane holds, with its absolute position.
template <int kMTiles, int kNTiles, typename F>
__device__ __forceinline__ void for_each_score(float (&acc_s)[kMTiles][kNTiles][4], int q_row0, int kv0, int lane, F f) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        f(acc_s[mt][nt][i], q_row0 + mt * 16 + lane / 4 + (i / 2) * 8, kv0 + nt * 8 + (lane % 4) * 2 + (i % 2), mt, nt, i);
}

// Sets disallowed scores to -inf. `allowed(q, kv, mt, nt, i)` gets absolute positions; kv positions
// at or past kv_len are always masked here.
template <int kMTiles, int kNTiles, typename Allowed>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kMTiles][kNTiles][4], int q_row0, int kv0, int kv_len,
                                            int lane, Allowed allowed) {
  for_each_score(acc_s, q_row0, kv0, lane, [&](float& s, int q, int kv, int mt, int nt, int i) {
    if (kv >= kv_len || !allowed(q, kv, mt, nt, i)) s = neg_inf();
  });
}

// score = f(S, q, kv) for every real position (q < q_len, kv < kv_len). Positions past the ends are
// left alone (the tail mask or the discarded rows take care of them), so no user expression ever
// indexes its arrays out of range. Interior tiles (kCheck false) skip the per-score bounds test.
template <bool kCheck, int kMTiles, int kNTiles, typename Transform>
__device__ __forceinline__ void transform_scores(float (&acc_s)[kMTiles][kNTiles][4], int q_row0, int kv0, int q_len,
                                                 int kv_len, int lane, Transform f) {
  for_each_score(acc_s, q_row0, kv0, lane, [&](float& s, int q, int kv, int, int, int) {
    if (!kCheck || (q < q_len && kv < kv_len)) s = f(s, q, kv);
  });
}

// The whole per-score phase of one kv tile: transform (when the variant has per-score work), then
// the mask this tile's block type needs. FULL tiles (and CAUSAL tiles wholly below the diagonal)
// need no element work unless they cross the end of the sequence.
template <class Cfg, class Params>
__device__ __forceinline__ void score_tile(float (&acc_s)[Cfg::kMTiles][Cfg::kNTiles][4], const KvTile& cur,
                                           const ScoreTile& at, const Params& p) {
  constexpr int kBr = Cfg::kBr, kBc = Cfg::kBc, kMTiles = Cfg::kMTiles;
  if constexpr (Cfg::kTransformScores) {
    const auto transform = [&](float s, int q_idx, int kv_idx) {
      return ScoreHooks<Cfg>::transform(s, at.batch, at.head, q_idx, kv_idx, p);
    };
    if (cur.start + kBc > p.kv_len || at.q0 + kBr > p.q_len) {
      transform_scores<true>(acc_s, at.q_row0, cur.start, p.q_len, p.kv_len, at.lane, transform);
    } else {
      transform_scores<false>(acc_s, at.q_row0, cur.start, p.q_len, p.kv_len, at.lane, transform);
    }
  }
  const int lane = at.lane;
  const bool tail = cur.start + kBc > p.kv_len;
  const bool causal_cut = Cfg::kHasCausal && cur.type == kCausal && cur.start + kBc - 1 > at.q0;
  if (Cfg::kHasPartial && cur.type == kPartial) {
    if constexpr (Cfg::kFusedMask) {
      // The mask's own expression instead of its stored bits (identical by construction).
      mask_scores(acc_s, at.q_row0, cur.start, p.kv_len, lane, [&](int q_idx, int kv_idx, int, int, int) {
        return q_idx < p.q_len && ScoreHooks<Cfg>::mask(at.batch, at.head, q_idx, kv_idx, p);
      });
    } else {
      const int pidx = __ldg(p.partial_index + at.mask_row * p.max_blocks + cur.entry);
      const int words = p.kv_block_size / 32;
      const u32* bits = p.partial_masks + (static_cast<u32>(pidx) * static_cast<u64>(p.q_block_size) +
                                           static_cast<u32>(at.q_row0 - at.q_block * p.q_block_size)) * words +
                        cur.tile * (kBc / 32);
      // The bits of this lane's rows, loaded once per tile.
      u32 w[kMTiles][2][kBc / 32];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int j = 0; j < kBc / 32; ++j) w[mt][half][j] = __ldg(bits + (mt * 16 + lane / 4 + half * 8) * words + j);
      mask_scores(acc_s, at.q_row0, cur.start, p.kv_len, lane, [&](int, int, int mt, int nt, int i) {
        const int bit = (nt % 4) * 8 + (lane % 4) * 2 + (i % 2);
        return ((w[mt][i / 2][nt / 4] >> bit) & 1u) != 0;
      });
    }
  } else if (causal_cut) {
    mask_scores(acc_s, at.q_row0, cur.start, p.kv_len, lane, [](int q, int kv, int, int, int) { return q >= kv; });
  } else if (tail) {
    mask_scores(acc_s, at.q_row0, cur.start, p.kv_len, lane, [](int, int, int, int, int) { return true; });
  }
}

}  // namespace omni
