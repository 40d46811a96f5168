// The forward's epilogue: O /= l, LSE, 16-byte row stores. m16n8 accumulator layout, kMTiles row
// tiles per warp. (P's packing into A fragments for O += P V is mma_tiles.cuh's pack_a.)
#pragma once
#include "online_softmax.cuh"

namespace omni {

// The staging rows are kLd elements long: padded (kLd = head dim + 8), so that a column's rows fall
// in different banks, or, with kSwizzle, unpadded (kLd = head dim) with 16-byte chunk ch of row r
// stored at chunk ch ^ (r % 8), which spreads a column's eight rows over the banks the same way in
// fewer bytes (needs at least 8 chunks per row). The padded path is written out apart, so that its
// code stays what it was.
// O /= l, LSE, store. Each warp stages its own rows of O in its own rows of `stage` ([rows][kLd],
// no other warp reads them; the layout above), then writes whole rows of kValidChunks 16-byte
// chunks: the head dim (kDTiles chunks) or, in a padded variant, the caller's head dim (the padding
// columns stay in smem). Rows with nothing allowed get O = 0 and LSE = -inf.
template <class Mma, int kMTiles, int kDTiles, int kWarpRows, int kLd, int kValidChunks = kDTiles,
          bool kSwizzle = false, class Softmax>
__device__ __forceinline__ void store_output(const float (&acc_o)[kMTiles][kDTiles][4], const Softmax& softmax,
                                             u16* stage, u16* o_bh, i64 o_sn, float* lse_bh, int q0, int q_len,
                                             float scale_log2, int warp, int lane) {
  constexpr int kChunks = kValidChunks;  // 16-byte chunks stored per row
  static_assert(kValidChunks >= 1 && kValidChunks <= kDTiles, "the stored chunks lie inside the tile");
  static_assert(!kSwizzle || (kDTiles % 8 == 0 && kLd == kDTiles * 8), "the swizzle permutes whole unpadded rows");
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = softmax.row_sum(mt, half);
      const float inv = l > 0.f ? 1.f / l : 0.f;  // empty row -> zeros
      const int r = warp * kWarpRows + mt * 16 + lane / 4 + half * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const u32 packed = Mma::pack(acc_o[mt][dt][2 * half] * inv, acc_o[mt][dt][2 * half + 1] * inv);
        if constexpr (kSwizzle) {
          *reinterpret_cast<u32*>(stage + r * kLd + (dt ^ (r & 7)) * 8 + (lane % 4) * 2) = packed;
        } else {
          *reinterpret_cast<u32*>(stage + r * kLd + dt * 8 + (lane % 4) * 2) = packed;
        }
      }
      if (lse_bh != nullptr && lane % 4 == 0 && q0 + r < q_len) {
        lse_bh[q0 + r] = l > 0.f ? (softmax.m[mt][half] * scale_log2 + __log2f(l)) * kLn2 : neg_inf();
      }
    }
  __syncwarp();
  // Every unpadded tile stores a multiple of 32 chunks per warp; a padded one may end in a partial pass.
  constexpr int kStoreChunks = kWarpRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kStoreChunks + 31) / 32; ++i) {
    const int c = i * 32 + lane;
    const int r = warp * kWarpRows + c / kChunks, ch = c % kChunks;
    if ((kStoreChunks % 32 == 0 || c < kStoreChunks) && q0 + r < q_len) {
      const u16* chunk = kSwizzle ? stage + r * kLd + (ch ^ (r & 7)) * 8 : stage + r * kLd + ch * 8;
      *reinterpret_cast<Vec16*>(o_bh + static_cast<i64>(q0 + r) * o_sn + ch * 8) = *reinterpret_cast<const Vec16*>(chunk);
    }
  }
}

}  // namespace omni
