// The block walk of one q tile: the kv tiles it visits, in the block mask's order.
//
// A BlockMask row (batch, head, q block) lists kv blocks with a type each; a kv block wider than
// the kernel's kv tile is walked as several tiles. MASKED entries, tiles past kv_len and CAUSAL
// tiles wholly above the q tile's last row are skipped without a load.
#pragma once
#include "ptx.cuh"

namespace omni {

// Must equal omnicupy/mask/types.py BlockType (tests/test_abi.py compares them).
enum BlockType : int { kMasked = 0, kCausal = 1, kFull = 2, kPartial = 3 };

struct MaskRow {
  const int* indices;  // kv_indices of this row
  const int* types;    // block types of this row
  int count;           // active entries
  int q_last;          // last valid query row of the q tile
};

struct KvTile {
  int entry;  // position in the mask row; == count when there is no tile left
  int tile;   // tile within the kv block
  int start;  // first kv position
  int type;   // BlockType
};

// Row `row` of the mask (rows are b * row_sb + h * row_sh + q_block, see DeviceMetadata).
__device__ __forceinline__ MaskRow mask_row(const int* kv_num_blocks, const int* kv_indices, const int* block_types,
                                            i64 row, int max_blocks, int q_last) {
  MaskRow r;
  r.indices = kv_indices + row * max_blocks;
  r.types = block_types + row * max_blocks;
  r.count = __ldg(kv_num_blocks + row);
  r.q_last = q_last;
  return r;
}

// The first tile at or after (entry, tile). kv_block_size and kv_len come straight from the
// kernel parameters (constant bank) rather than from registers carried through the loop.
template <int kBc, bool kHasCausal>
__device__ __forceinline__ KvTile find_tile(const MaskRow& row, int entry, int tile, int kv_block_size, int kv_len) {
  const int tiles_per_block = kv_block_size / kBc;
  for (; entry < row.count; ++entry, tile = 0) {
    // Unsigned index: a pointer plus a u32 is one wide multiply-add, a sign-extended int is not.
    const int type = __ldg(row.types + static_cast<u32>(entry));
    if (type == kMasked) continue;
    const int block_start = __ldg(row.indices + static_cast<u32>(entry)) * kv_block_size;
    if (tile < tiles_per_block) {
      const int start = block_start + tile * kBc;
      // Later tiles of this block start later still: past the end, or past the causal diagonal.
      if (start >= kv_len) continue;
      if (kHasCausal && type == kCausal && start > row.q_last) continue;
      return KvTile{entry, tile, start, type};
    }
  }
  return KvTile{row.count, 0, 0, kMasked};
}

}  // namespace omni
