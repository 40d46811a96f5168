// Which output tiles a CTA computes. Three launches:
//   grid:       one CTA per tile, the tile is the CTA's index (grid_tile; the backward's kv tiles,
//               a non-persistent TMA forward through TileWalk with one pass);
//   persistent: one CTA per SM walking flat tile indices with a grid stride (TileWalk);
//   per-CTA lists: persistent CTAs each walking their own slice of a host-made list
//               (dispatch/schedule.cta_tile_lists: balanced with the mask's work estimates).
// Flat indices are (batch, head) major (fwd_cta.cuh's fwd_cta_flat), so that the CTAs running
// together share K/V in L2.
#pragma once
#include "ptx.cuh"

namespace omni {

// A CTA of a (tiles, heads, batch) grid. Unsigned, as the grid's indices are: products such as
// tile * rows then compile as they did from blockIdx itself.
struct GridTile {
  u32 tile, head, batch;
};

__device__ __forceinline__ GridTile grid_tile() { return {blockIdx.x, blockIdx.y, blockIdx.z}; }

// This CTA's flat tiles: its slice [next, end) of `list`, else every step-th index from next.
struct TileWalk {
  const int* list;
  int next, end, step;
  __device__ __forceinline__ int tile() const { return list != nullptr ? __ldg(list + next) : next; }
};

// `tiles` flat tiles over CTAs `stride` apart (stride = tiles: one pass, one tile per CTA). With
// per-CTA lists (`cta_tiles` non-null), CTA b walks tile_list[cta_tiles[b] .. cta_tiles[b + 1]).
__device__ __forceinline__ TileWalk tile_walk(const int* cta_tiles, const int* tile_list, int tiles, int stride) {
  if (cta_tiles != nullptr) return {tile_list, __ldg(cta_tiles + blockIdx.x), __ldg(cta_tiles + blockIdx.x + 1), 1};
  return {nullptr, static_cast<int>(blockIdx.x), tiles, stride};
}

}  // namespace omni
