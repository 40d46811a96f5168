// Split-KV attention for a few query rows per kv head (decode, speculative verification, chunked
// prefill), on contiguous or paged KV caches. See omnicupy/ops/decode.py for the host side.
//
// One CTA = (m tile, split, kv head hk, batch b), flattened on blockIdx.x in that order (the m tiles
// and splits of one (b, hk) launch side by side and share K/V in L2). Its kBm rows pack query heads
// of hk's GQA group with query positions: row r is query head h_first + r / Q at position
// q_first + r % Q (Q = p.q_per_tile), so one read of K and V serves the whole group.
//
// The CTA's kv tiles (32 keys each) are this split's share of one walk: either the key range the
// rows can see (rule mode: kv_lens, causal, sliding window) or the entries of one block-mask row
// (mask mode). The warps form kKvGroups groups of kRowWarps = kBm / 16 warps: the warps of a group
// split the rows (16 each) and share K/V tiles; the groups take the tiles round-robin and never
// wait for each other inside the walk. Each group streams its tiles through its own kStages-deep
// cp.async ring (16-byte copies with a 128-byte L2 prefetch hint, kStages - 1 tiles in flight) and
// each warp keeps the online softmax state of its rows. At the end the groups merge through shared memory, and the CTA writes
// either the final rows (one split) or its unnormalized fp32 partial rows with their (max, sum)
// for decode_combine.cuh. With one warp per group (kBm = 16) a group needs no barrier at all.
//
// Keys a sequence does not have (past kv_lens[b]) or whose page id is out of range are never
// read: their rows are zero-filled, their scores masked, and a bad length or page id sets a bit
// in p.errors. Expects, before inclusion: enum BlockType (kMasked, kCausal, kFull, kPartial) in
// omni::decode, rendered from omnicupy/mask/types.py. The template supplies Cfg (kHeadDim, kBm,
// kBc, kWarps, kStages, kThreads, kHasRule, kHasPartial, kHasScoreMod, Mma, and Hooks with kHasBias
// for score_hooks.cuh) and the
// parameter struct (DecodeParams, omnicupy/dispatch/params.py).
#pragma once
#include "decode_combine.cuh"
#include "decode_tile.cuh"
#include "score_hooks.cuh"

namespace omni {
namespace decode {

constexpr float kLn2 = 0.69314718055994531f;
// Bits of p.errors.
constexpr int kErrorKvLen = 1;  // a kv_lens entry outside [0, capacity]: clamped
constexpr int kErrorPage = 2;   // a page id outside [0, num_pages): its keys masked

// One kv tile in a warp's ring: what the consumer needs to know about it.
struct TileInfo {
  int start;  // first kv position; -1: the walk has ended
  int type;   // BlockType (kFull in rule mode)
  int pidx;   // partial-pool index (PARTIAL tiles)
  u32 valid;  // bit c: key start + c exists (inside the sequence, on a valid page)
};
static_assert(sizeof(TileInfo) == 16, "ring records are 16 bytes (DECODE_RING_BYTES in dispatch/variant.py)");

// Where this CTA works and what its rows see.
struct Cta {
  int b, hk, split;
  int h_first, q_first;   // first query head and position of the m tile
  int heads, queries;     // real heads and positions in the m tile (the other rows are padding)
  int len;                // keys of this sequence (kv_lens[b], clamped), or the capacity
  int shift;              // query i sits at position i + shift
  int pos_lo, pos_hi;     // positions of the tile's first and last query
  int walk_first;         // rule mode: position of the walk's tile 0
  int g_begin, g_end;     // this split's flat tiles
  i64 mask_row;           // mask mode: the block-mask row
  int tiles_per_block;    // mask mode: 32-key tiles per kv block
};

// Bits c of a 32-key tile with lo <= c < hi (either end may lie outside [0, 32]).
__device__ __forceinline__ u32 key_span(int lo, int hi) {
  lo = min(max(lo, 0), 32);
  hi = min(max(hi, 0), 32);
  const u32 below_hi = hi >= 32 ? 0xffffffffu : (1u << hi) - 1u;
  const u32 below_lo = lo >= 32 ? 0xffffffffu : (1u << lo) - 1u;
  return below_hi & ~below_lo;
}

template <class Params>
__device__ __forceinline__ void flag_error(const Params& p, int bit) {
  if (p.errors != nullptr) atomicOr(p.errors, bit);
}

template <class Cfg, class Params>
__device__ __forceinline__ Cta locate(const Params& p) {
  Cta c;
  int id = blockIdx.x;
  const int m_tile = id % p.m_tiles;
  id /= p.m_tiles;
  c.split = id % p.num_splits;
  id /= p.num_splits;
  c.hk = id % p.kv_heads;
  c.b = id / p.kv_heads;
  const int head_block = m_tile % p.head_blocks;
  c.q_first = (m_tile / p.head_blocks) * p.q_per_tile;
  c.h_first = c.hk * p.kv_group + head_block * p.heads_per_tile;
  c.heads = min(p.heads_per_tile, p.kv_group - head_block * p.heads_per_tile);
  c.queries = min(p.q_per_tile, p.q_len - c.q_first);

  c.len = p.kv_len;
  if (p.kv_lens != nullptr) {
    const int given = __ldg(p.kv_lens + c.b);
    c.len = min(max(given, 0), p.kv_len);
    if (given != c.len && threadIdx.x == 0 && c.split == 0 && m_tile == 0 && c.hk == 0) flag_error(p, kErrorKvLen);
  }
  c.shift = p.bottom_right ? c.len - p.q_len : 0;
  c.pos_lo = c.q_first + c.shift;
  c.pos_hi = c.q_first + c.queries - 1 + c.shift;

  long long tiles;
  c.walk_first = 0;
  c.mask_row = 0;
  c.tiles_per_block = 1;
  if (p.kv_num_blocks != nullptr) {
    // Mask mode: split the row's entries; each entry is tiles_per_block tiles.
    c.mask_row = c.b * p.mask_row_sb + static_cast<i64>(c.h_first) * p.mask_row_sh;
    const long long entries = __ldg(p.kv_num_blocks + c.mask_row);
    c.tiles_per_block = p.kv_block_size / Cfg::kBc;
    const long long e0 = entries * c.split / p.num_splits, e1 = entries * (c.split + 1) / p.num_splits;
    c.g_begin = static_cast<int>(e0 * c.tiles_per_block);
    c.g_end = static_cast<int>(e1 * c.tiles_per_block);
    return c;
  }
  // Rule mode: the keys any row of the tile may see, [lo, hi), in 32-key tiles from lo rounded down.
  int lo = 0, hi = c.len;
  if (p.causal) hi = min(hi, c.pos_hi + 1);
  if (p.window > 0) lo = max(lo, c.pos_lo - p.window + 1);
  c.walk_first = lo / Cfg::kBc * Cfg::kBc;
  tiles = hi > lo ? (hi - c.walk_first + Cfg::kBc - 1) / Cfg::kBc : 0;
  c.g_begin = static_cast<int>(tiles * c.split / p.num_splits);
  c.g_end = static_cast<int>(tiles * (c.split + 1) / p.num_splits);
  return c;
}

// The next tile of this group's share (flat tiles g, g + kKvGroups, ...), skipping what the mask rules
// out without a load: MASKED entries, tiles past the sequence, CAUSAL tiles above every row.
template <class Cfg, class Params>
__device__ __forceinline__ TileInfo next_tile(const Params& p, const Cta& c, int& g) {
  while (g < c.g_end) {
    const int cur = g;
    g += Cfg::kWarps / (Cfg::kBm / 16);
    if (p.kv_num_blocks == nullptr) return TileInfo{c.walk_first + cur * Cfg::kBc, kFull, 0, 0u};
    const int entry = cur / c.tiles_per_block, within = cur - entry * c.tiles_per_block;
    const i64 slot = c.mask_row * p.max_blocks + entry;
    const int type = __ldg(p.block_types + slot);
    if (type == kMasked) continue;
    const int start = __ldg(p.kv_indices + slot) * p.kv_block_size + within * Cfg::kBc;
    if (start >= c.len) continue;
    if (Cfg::kHasRule && type == kCausal && start > c.pos_hi) continue;
    const int pidx = (Cfg::kHasPartial && type == kPartial) ? __ldg(p.partial_index + slot) : 0;
    return TileInfo{start, type, pidx, 0u};
  }
  return TileInfo{-1, kMasked, 0, 0u};
}

// Where key t.start + lane lives: (page, slot) and whether it exists (inside the sequence, on a
// page of the pool). One page-table read per lane on a paged cache, taken from `hint` when the
// previous tile of this group prefetched it; then the page ids of the group's next tile (stride
// `next`) are prefetched into `hint`, so their latency hides behind this tile's math.
struct PageHint {
  int start;  // the tile start the prefetched page belongs to (-1: none)
  int page;
};

template <class Params>
__device__ __forceinline__ bool key_address(const Params& p, const Cta& c, int start, int next, int lane,
                                            PageHint& hint, int& page, int& slot) {
  const int key = start + lane;
  bool ok = key < c.len;
  page = c.b;
  slot = key;
  if (p.page_table == nullptr) return ok;
  const int* row = p.page_table + c.b * p.page_table_sb;
  page = 0;
  slot = 0;
  if (ok) {
    const int index = key / p.page_size;  // < max_pages: len <= max_pages * page_size
    page = hint.start == start ? hint.page : __ldg(row + index);
    slot = key - index * p.page_size;
    if (page < 0 || page >= p.num_pages) {
      flag_error(p, kErrorPage);
      ok = false;
      page = 0;
    }
  }
  const int ahead = key + next;
  hint.start = start + next;
  hint.page = ahead < c.len ? __ldg(row + ahead / p.page_size) : 0;
  return ok;
}

// This warp's share of the 16-byte copies of tile t into a ring slot (sK, sV), and
// the record of t (with its valid keys) in `info`. The copies take each row's address from its
// lane, two (or more) rows per instruction; the kRowWarps warps of a group find the same addresses
// and copy every kRowWarps-th 32-chunk slice of the tile each. Missing rows are zero-filled.
template <class Cfg, int kRowWarps, class Params>
__device__ __forceinline__ void issue_async(const Params& p, const Cta& c, TileInfo t, int next, u16* sK, u16* sV,
                                            TileInfo* info, const u16* k_base, const u16* v_base, int row_warp,
                                            int lane, PageHint& hint) {
  constexpr int kChunks = Cfg::kHeadDim / 8, kLd = Cfg::kHeadDim + 8;
  static_assert(kChunks % kRowWarps == 0, "the warps of a group share a tile's copies evenly");
  if (t.start >= 0) {
    int page, slot;
    const bool ok = key_address(p, c, t.start, next, lane, hint, page, slot);
    t.valid = __ballot_sync(0xffffffffu, ok);
    const i64 k_off = page * p.k_sb + slot * p.k_sn;
    const i64 v_off = page * p.v_sb + slot * p.v_sn;
    const u32 k_dst = smem_u32(sK), v_dst = smem_u32(sV);
#pragma unroll
    for (int i = 0; i < kChunks / kRowWarps; ++i) {
      const int chunk = (i * kRowWarps + row_warp) * 32 + lane, row = chunk / kChunks, col = (chunk % kChunks) * 8;
      const i64 k_row = __shfl_sync(0xffffffffu, k_off, row), v_row = __shfl_sync(0xffffffffu, v_off, row);
      const bool live = ((t.valid >> row) & 1u) && real_chunk<Cfg>(chunk % kChunks);
      const u32 dst = (row * kLd + col) * 2;
      cp_async_16_stream(k_dst + dst, live ? k_base + k_row + col : k_base, live);
      cp_async_16_stream(v_dst + dst, live ? v_base + v_row + col : v_base, live);
    }
  }
  if (row_warp == 0 && lane == 0) *info = t;
}

// Barrier of the kRowWarps warps of kv group `group` (named barrier 1 + group; 0 is __syncthreads).
template <int kRowWarps>
__device__ __forceinline__ void group_sync(int group) {
  if (kRowWarps == 1) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "r"(kRowWarps * 32) : "memory");
  }
}

// Fused combine (p.split_counters non-null): the CTAs of one (m tile, kv head, batch) count
// themselves out on split_counters[unit] once their partial rows are written; the last one merges
// every split's rows into the output (merge_row, through L2) and resets the counter to 0 for the
// next launch, so that no combine kernel is launched. Each thread fences its own partial writes
// before the CTA's barrier and the count (the pattern of CUDA's threadFenceReduction sample);
// the last CTA fences again before it reads. `flag`: one int of shared memory no longer in use.
template <class Cfg, class Params>
__device__ __forceinline__ void fused_combine(const Params& p, const Cta& c, int* flag) {
  constexpr int kBm = Cfg::kBm, kWarps = Cfg::kWarps, D = Cfg::kHeadDim;
  __threadfence();
  __syncthreads();  // every thread's partial rows are written and fenced (and the merge buffers read)
  const int m_tile = blockIdx.x % p.m_tiles;
  const i64 unit = (static_cast<i64>(c.b) * p.kv_heads + c.hk) * p.m_tiles + m_tile;
  if (threadIdx.x == 0) {
    const int done_before = atomicAdd(p.split_counters + unit, 1);
    const bool last = done_before == p.num_splits - 1;
    if (last) p.split_counters[unit] = 0;  // nobody else counts on this unit in this launch any more
    *flag = last;
  }
  __syncthreads();
  if (*flag == 0) return;
  __threadfence();  // the other splits' rows, which their fences made visible before their counts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, Q = p.q_per_tile;
  const i64 rows_total = static_cast<i64>(p.batch) * p.num_heads * p.q_len;
  for (int r = warp; r < kBm; r += kWarps) {
    const int qh = r / Q, qi = r % Q;
    if (qh >= c.heads || qi >= c.queries) continue;
    const int h = c.h_first + qh, i = c.q_first + qi;
    const i64 row = (static_cast<i64>(c.b) * p.num_heads + h) * p.q_len + i;
    u16* dst = p.o + c.b * p.o_sb + static_cast<i64>(h) * p.o_sh + static_cast<i64>(i) * p.o_sn;
    merge_row<D, Cfg::kHeadDimValid, typename Cfg::Mma, true>(p.part_o, p.part_ml, rows_total, p.num_splits, row, dst,
                                          p.lse == nullptr ? nullptr : p.lse + row, lane);
  }
}

template <class Cfg, class Params>
__device__ __forceinline__ void split_kv(const Params& p) {
  constexpr int kWarpRows = 16;
  using T = Tile<Cfg, kWarpRows>;
  constexpr int kBm = Cfg::kBm, kBc = Cfg::kBc, kWarps = Cfg::kWarps, kStages = Cfg::kStages;
  constexpr int kRowWarps = kBm / kWarpRows, kKvGroups = kWarps / kRowWarps;
  constexpr int D = Cfg::kHeadDim, kLd = T::kLd, kMTiles = T::kMTiles, kNTiles = T::kNTiles, kDTiles = T::kDTiles;
  constexpr int kTile = kBc * kLd;      // elements of one K or V tile
  constexpr int kMergeLd = D + 4;       // fp32 merge rows
  static_assert(kBc == 32, "a kv tile is one key per lane");
  static_assert(kWarps % kRowWarps == 0 && kKvGroups <= 8, "whole kv groups of kBm / 16 warps, at most 8");
  static_assert(kStages >= 2, "the ring fills one slot while the group computes on another");
  static_assert(kBm * kLd * 2 + kKvGroups * kStages * (2 * kTile * 2 + (int)sizeof(TileInfo)) <= Cfg::kSmemBytes &&
                    kBm * kLd * 2 + kKvGroups * kBm * (kMergeLd + 2) * 4 <= Cfg::kSmemBytes,
                "shared memory layout exceeds what the host launches with (Variant.smem_bytes)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  u16* sQ = reinterpret_cast<u16*>(smem_raw);                  // [kBm][kLd]
  u16* sRing = sQ + kBm * kLd;                                 // [kKvGroups][kStages][K, V][kBc][kLd]
  TileInfo* sInfo = reinterpret_cast<TileInfo*>(sRing + kKvGroups * kStages * 2 * kTile);  // [kKvGroups][kStages]
  // After the walk, the same bytes as the ring:
  float* sMergeO = reinterpret_cast<float*>(sRing);            // [kKvGroups][kBm][kMergeLd]
  float* sMergeM = sMergeO + kKvGroups * kBm * kMergeLd;       // [kKvGroups][kBm]
  float* sMergeL = sMergeM + kKvGroups * kBm;                  // [kKvGroups][kBm]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_warp = warp % kRowWarps, group = warp / kRowWarps;
  const Cta c = locate<Cfg>(p);
  const int Q = p.q_per_tile;

  // ---- Q tile (every thread), zero rows for padding
  for (int chunk = threadIdx.x; chunk < kBm * T::kChunks; chunk += Cfg::kThreads) {
    const int r = chunk / T::kChunks, col = (chunk % T::kChunks) * 8;
    const int qh = r / Q, qi = r % Q;
    const bool live = qh < c.heads && qi < c.queries && real_chunk<Cfg>(chunk % T::kChunks);
    const u16* src = p.q + c.b * p.q_sb + static_cast<i64>(c.h_first + qh) * p.q_sh + static_cast<i64>(c.q_first + qi) * p.q_sn + col;
    cp_async_16(smem_u32(sQ + r * kLd + col), live ? src : p.q, live);
  }
  cp_async_commit();

  // ---- this lane's rows: query head, position for the rules (also the row of a partial block's
  // bits: q block 0, no shift in mask mode), q_idx for score modifiers
  int row_head[kMTiles][2], row_pos[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row_warp * kWarpRows + mt * 16 + lane / 4 + half * 8, qh = r / Q, qi = r % Q;
      const bool live = qh < c.heads && qi < c.queries;
      row_head[mt][half] = c.h_first + (live ? qh : 0);
      row_pos[mt][half] = (live ? c.q_first + qi : c.q_first) + c.shift;
    }

  const u16* k_base = p.k + static_cast<i64>(c.hk) * p.k_sh;
  const u16* v_base = p.v + static_cast<i64>(c.hk) * p.v_sh;
  u16* ring = sRing + group * kStages * 2 * kTile;
  TileInfo* ring_info = sInfo + group * kStages;
  constexpr int kNext = kKvGroups * kBc;  // from one tile of the group to its next
  PageHint hint{-1, 0};
  auto issue = [&](TileInfo t, int slot) {
    u16* sK = ring + slot * 2 * kTile;
    issue_async<Cfg, kRowWarps>(p, c, t, kNext, sK, sK + kTile, ring_info + slot, k_base, v_base, row_warp, lane, hint);
    cp_async_commit();
  };

  // ---- fill the ring: kStages - 1 tiles in flight
  int g = c.g_begin + group;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue(next_tile<Cfg>(p, c, g), s);
  }
  cp_async_wait<kStages - 1>();  // Q has landed (this thread's part) ...
  __syncthreads();               // ... and everyone's

  float acc_o[kMTiles][kDTiles][4];
  float m_i[kMTiles][2], l_i[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
    m_i[mt][0] = m_i[mt][1] = neg_inf();
    l_i[mt][0] = l_i[mt][1] = 0.f;
  }
  const u32 q_addr = smem_u32(sQ + row_warp * kWarpRows * kLd) + T::q_lane(lane) * 2;
  const u32 ring_addr = smem_u32(ring);
  const int k_lane = T::k_lane(lane) * 2, v_lane = (kTile + T::v_lane(lane)) * 2;

  // ---- the walk. Each tile: refill the slot the previous tile freed, wait for this tile's copies
  // (the group's barrier makes every warp's share visible), compute, and let the group finish with
  // the slot (second barrier) before it is refilled.
  for (int stage = 0;; stage = (stage + 1) % kStages) {
    issue(next_tile<Cfg>(p, c, g), (stage + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();
    group_sync<kRowWarps>(group);
    const TileInfo t = ring_info[stage];
    if (t.start < 0) break;
    const u32 slot_addr = ring_addr + stage * 2 * kTile * 2;

    // ---- S = Q Kᵀ
    float acc_s[kMTiles][kNTiles][4];
    T::qk(acc_s, q_addr, slot_addr + k_lane);

    // ---- score modifier (scores scaled first; the softmax then works in natural units)
    if (Cfg::kHasScoreMod) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = nt * 8 + (lane % 4) * 2 + (i % 2);
            const int q_idx = p.q_abs ? row_pos[mt][i / 2] : row_pos[mt][i / 2] - c.shift;
            if ((t.valid >> col) & 1u)
              acc_s[mt][nt][i] = ScoreHooks<Cfg>::transform(acc_s[mt][nt][i], c.b, row_head[mt][i / 2], q_idx,
                                                            t.start + col, p);
          }
    }

    // ---- mask: missing keys, then the rule (or the block's type); untouched when nothing is cut
    bool cut = t.valid != 0xffffffffu;
    if (p.kv_num_blocks != nullptr) {
      cut |= (Cfg::kHasPartial && t.type == kPartial) || (Cfg::kHasRule && t.type == kCausal && t.start + kBc - 1 > c.pos_lo);
    } else if (Cfg::kHasRule) {
      cut |= (p.causal && t.start + kBc - 1 > c.pos_lo) || (p.window > 0 && t.start < c.pos_hi - p.window + 1);
    }
    if (cut) {
      // One word per row: bit c set when key t.start + c is allowed for that row.
      const bool mask_mode = p.kv_num_blocks != nullptr;
      const bool rule_causal = mask_mode ? t.type == kCausal : p.causal != 0;
      const int window = mask_mode ? 0 : p.window;
      u32 allowed[kMTiles][2];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          u32 bits = t.valid;
          if (Cfg::kHasPartial && mask_mode && t.type == kPartial) {
            const int words = p.kv_block_size / 32;
            bits &= __ldg(p.partial_masks + (static_cast<i64>(t.pidx) * p.q_block_size + row_pos[mt][half]) * words +
                          (t.start % p.kv_block_size) / 32);
          }
          if (Cfg::kHasRule) {
            const int pos = row_pos[mt][half] - t.start;  // the row's position, relative to the tile
            bits &= key_span(window > 0 ? pos - window + 1 : 0, rule_causal ? pos + 1 : kBc);
          }
          allowed[mt][half] = bits;
        }
      T::for_each_score(lane, [&](int mt, int nt, int i, int col) {
        if (!((allowed[mt][i / 2] >> col) & 1u)) acc_s[mt][nt][i] = neg_inf();
      });
    }

    // ---- online softmax, O += P V
    T::softmax(acc_s, m_i, l_i, acc_o, p.scale_log2);
    T::pv(acc_o, acc_s, slot_addr + v_lane);
    group_sync<kRowWarps>(group);  // the whole group is done with this slot before it is refilled
  }

  // ---- merge the groups: common row max M, rows rescaled to it and summed
  cp_async_wait<0>();
  __syncthreads();  // every group has left its ring: the merge reuses those bytes
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = l_i[mt][half];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      const int r = row_warp * kWarpRows + mt * 16 + lane / 4 + half * 8;
      if (lane % 4 == 0) {
        sMergeM[group * kBm + r] = m_i[mt][half];
        sMergeL[group * kBm + r] = l;
      }
    }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row_warp * kWarpRows + mt * 16 + lane / 4 + half * 8;
      float mx = neg_inf();
#pragma unroll
      for (int w = 0; w < kKvGroups; ++w) mx = fmaxf(mx, sMergeM[w * kBm + r]);
      const float m = m_i[mt][half];
      const float f = m == neg_inf() ? 0.f : exp2_approx((m - mx) * p.scale_log2);
      float* dst = sMergeO + (group * kBm + r) * kMergeLd + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc_o[mt][dt][2 * half] * f, acc_o[mt][dt][2 * half + 1] * f);
    }
  __syncthreads();

  // ---- write: 4 columns of one row per thread and step; the caller's kHeadDimValid columns (the
  // partial rows keep the tile's stride D, decode_combine.cuh reads them so)
  const i64 rows_total = static_cast<i64>(p.batch) * p.num_heads * p.q_len;
  constexpr int kOut4 = Cfg::kHeadDimValid / 4;  // 4-column groups written per row
  for (int item = threadIdx.x; item < kBm * kOut4; item += Cfg::kThreads) {
    const int r = item / kOut4, d = (item % kOut4) * 4;
    const int qh = r / Q, qi = r % Q;
    if (qh >= c.heads || qi >= c.queries) continue;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < kKvGroups; ++w) mx = fmaxf(mx, sMergeM[w * kBm + r]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kKvGroups; ++w) {
      const float m = sMergeM[w * kBm + r];
      sum += m == neg_inf() ? 0.f : exp2_approx((m - mx) * p.scale_log2) * sMergeL[w * kBm + r];
      const float4 part = *reinterpret_cast<const float4*>(sMergeO + (w * kBm + r) * kMergeLd + d);
      acc.x += part.x;
      acc.y += part.y;
      acc.z += part.z;
      acc.w += part.w;
    }
    const int h = c.h_first + qh, i = c.q_first + qi;
    const float m_log2 = mx == neg_inf() ? neg_inf() : mx * p.scale_log2;
    if (p.num_splits == 1) {
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row with no allowed key -> zeros
      uint2 packed;
      packed.x = Cfg::Mma::pack(acc.x * inv, acc.y * inv);
      packed.y = Cfg::Mma::pack(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(p.o + c.b * p.o_sb + static_cast<i64>(h) * p.o_sh + static_cast<i64>(i) * p.o_sn + d) = packed;
      if (d == 0 && p.lse != nullptr)
        p.lse[(static_cast<i64>(c.b) * p.num_heads + h) * p.q_len + i] = sum > 0.f ? (m_log2 + __log2f(sum)) * kLn2 : neg_inf();
    } else {
      const i64 part = c.split * rows_total + (static_cast<i64>(c.b) * p.num_heads + h) * p.q_len + i;
      *reinterpret_cast<float4*>(p.part_o + part * D + d) = acc;
      if (d == 0) *reinterpret_cast<float2*>(p.part_ml + part * 2) = make_float2(m_log2, sum);
    }
  }
  if (p.num_splits > 1 && p.split_counters != nullptr) fused_combine<Cfg>(p, c, reinterpret_cast<int*>(smem_raw));
}

}  // namespace decode
}  // namespace omni
