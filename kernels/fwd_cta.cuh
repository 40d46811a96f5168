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

// grid = (q tiles, Hq, B). Heaviest q tiles first shortens the tail of the launch: q_tile_order
// (omnicupy/dispatch/schedule.py) when the mask says which they are, else last first (causal-like
// masks are heaviest at the end).
template <int kBr, class Params>
__device__ __forceinline__ FwdCta fwd_cta(const Params& p) {
  FwdCta c;
  c.q_tile = p.q_tile_order == nullptr ? gridDim.x - 1 - blockIdx.x : __ldg(p.q_tile_order + blockIdx.x);
  c.head = blockIdx.y;
  c.batch = blockIdx.z;
  c.q0 = c.q_tile * kBr;
  c.q_block = c.q0 / p.q_block_size;
  c.mask_row = c.batch * p.mask_row_sb + c.head * p.mask_row_sh + c.q_block;
  c.row = mask_row(p.kv_num_blocks, p.kv_indices, p.block_types, c.mask_row, p.max_blocks, min(c.q0 + kBr, p.q_len) - 1);
  return c;
}

// This (batch, head)'s LSE row, or null when the caller did not ask for the LSE.
template <class Params>
__device__ __forceinline__ float* lse_row(const Params& p, const FwdCta& c) {
  return p.lse == nullptr ? nullptr : p.lse + (static_cast<i64>(c.batch) * p.num_heads + c.head) * p.q_len;
}

}  // namespace omni
