// What every forward CTA works out first, whatever its matrix instructions: which q tile of which
// (batch, head) it owns, and that tile's row of the block mask.
#pragma once
#include "block_walk.cuh"

namespace omni {

struct FwdCta {
  int q_tile, head, batch;
  int q0;        // first query row of the tile
  int q_block;   // the block mask's q block holding the tile
  i64 mask_row;  // its row in the block mask
  MaskRow row;
};

// The CTA's work for q tile rank `q_rank` (0 = launched first) of (batch, head). Heaviest q tiles
// first shortens the tail of the launch: q_tile_order (omnicupy/dispatch/schedule.py) when the mask
// says which they are, else last first (causal-like masks are heaviest at the end).
template <int kBr, class Params>
__device__ __forceinline__ FwdCta fwd_cta_at(const Params& p, int q_rank, int q_tiles, int head, int batch) {
  FwdCta c;
  c.q_tile = p.q_tile_order == nullptr ? q_tiles - 1 - q_rank : __ldg(p.q_tile_order + q_rank);
  c.head = head;
  c.batch = batch;
  c.q0 = c.q_tile * kBr;
  c.q_block = c.q0 / p.q_block_size;
  c.mask_row = c.batch * p.mask_row_sb + c.head * p.mask_row_sh + c.q_block;
  c.row = mask_row(p.kv_num_blocks, p.kv_indices, p.block_types, c.mask_row, p.max_blocks, min(c.q0 + kBr, p.q_len) - 1);
  return c;
}

// grid = (q tiles, Hq, B): one CTA per tile.
template <int kBr, class Params>
__device__ __forceinline__ FwdCta fwd_cta(const Params& p) {
  return fwd_cta_at<kBr>(p, blockIdx.x, gridDim.x, blockIdx.y, blockIdx.z);
}

// A flat tile index (grid-stride loops of persistent CTAs): (batch, head) major, so that the CTAs
// running at one time share a few heads' K and V in L2; q tile rank minor.
template <int kBr, class Params>
__device__ __forceinline__ FwdCta fwd_cta_flat(const Params& p, int tile, int q_tiles) {
  const int bh = tile / q_tiles;
  return fwd_cta_at<kBr>(p, tile - bh * q_tiles, q_tiles, bh % p.num_heads, bh / p.num_heads);
}

// This (batch, head)'s LSE row, or null when the caller did not ask for the LSE.
template <class Params>
__device__ __forceinline__ float* lse_row(const Params& p, const FwdCta& c) {
  return p.lse == nullptr ? nullptr : p.lse + (static_cast<i64>(c.batch) * p.num_heads + c.head) * p.q_len;
}

}  // namespace omni
