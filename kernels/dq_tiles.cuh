// The wgmma backward's fp32 dQ accumulator in tiles (kernels/bwd_wgmma.cuh adds into it; the row
// kernels of kernels/bwd_rows.cuh zero it and convert it). The mma.sync backward keeps the plain
// row layout [bh][q_len][kHeadDim] and adds element pairs with red.global.
//
// Layout: [bh][q tile of 64 rows][column block of 64][64 rows][64 columns], fp32. Inside a tile each
// 256-byte row keeps its sixteen 16-byte chunks XOR-swizzled by row % 8. A 64 x 64 tile is one
// contiguous 16 KB block, so a CTA adds its share of a q tile with bulk reductions
// (cp.reduce.async.bulk) from shared memory laid out the same way; in that layout the stores of
// the m16n8 accumulators (8 rows x 32 bytes per warp instruction) reach every bank twice, the
// least possible for 256 bytes, where plain 256-byte rows would put all eight rows in the same
// banks. The accumulator holds q_len_pad rows per head (the tail tile's padding rows are added
// into and never read).
#pragma once

namespace omni {
namespace dq_tiles {

// (Enumerators, not constexpr variables: NVRTC emits those as globals of every module including
// this header, which would change the mma.sync kernels' cubins for nothing.)
enum : int {
  kRows = 64,  // rows of a tile (the wgmma backward's q tile)
  kCols = 64,  // columns of a tile (one wgmma N of dQ)
  kFloats = kRows * kCols,
};

// First float of tile (bh, q tile, column block) in a head of q_len_pad rows.
template <int kHeadDim>
__device__ __forceinline__ long long tile_offset(long long bh, int q_len_pad, int q_tile, int col_block) {
  static_assert(kHeadDim % kCols == 0, "whole column blocks");
  return ((bh * (q_len_pad / kRows) + q_tile) * (kHeadDim / kCols) + col_block) * static_cast<long long>(kFloats);
}

// Float offset of (row, col) inside a tile: the 16-byte chunk col / 4 swizzled by row % 8.
__device__ __forceinline__ int within(int row, int col) {
  return row * kCols + ((((col >> 2) ^ row) & 7) | ((col >> 2) & ~7)) * 4 + (col & 3);
}

}  // namespace dq_tiles
}  // namespace omni
