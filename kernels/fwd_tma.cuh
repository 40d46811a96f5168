// The TMA forward (sm_90a): warp-specialized, TMA-fed block-sparse attention.
//
// One CTA owns kBr query rows of one (batch, head), as in the other families, but its warpgroups
// have different jobs:
//   consumers (warpgroups 0 .. kConsumers-1, 64 query rows each) only compute: S = Q Kᵀ and
//     O += P V (fwd_gemms.cuh), the mask, the online softmax and the epilogue, exactly as the
//     wgmma family (fwd_wgmma.cuh) does;
//   the producer (the last warpgroup) gives its registers to the consumers (setmaxnreg) and one
//     of its threads walks the block mask (find_tile: skipped blocks are never loaded) and issues
//     TMA loads: Q once, then K and V of every kv tile into a kStages-deep ring of 128-byte
//     swizzled buffers (the layout of wgmma.cuh; TMA writes it and zero-fills rows past the end
//     of a sequence).
// The rings (pipeline.cuh) are per operand: K and V have their own barriers, so K_{j+2} may load
// while P_j V_j still reads V_j. No CTA-wide barrier runs inside the loop.
//
// Persistent CTAs (Cfg::kPersistent): where the epilogue's staging rows fit beside Q and the ring
// (D <= 128), the host launches one CTA per SM and each walks flat tiles (tile_scheduler.cuh: its
// own list from the host when tiles cost different amounts, else grid stride). The producer then
// loads the next tile's Q (once every consumer released the last one: a one-stage Q ring) and K/V
// while the consumers still store this one; the ring's stage and phase run on across tiles. Where
// the rows do not fit (D = 256) they reuse Q and the ring, and the host launches one CTA per tile:
// the same loops run once.
//
// Pipelines (Cfg::kOverlap, Cfg::kPingPong):
//   plain:    per tile S_j, softmax, O += P_j V_j;
//   overlap:  S_j and O += P_{j-1} V_{j-1} issued back to back; the softmax of tile j runs while
//             the tensor cores still work on P_{j-1} V_{j-1} (FlashAttention-3's intra-warpgroup
//             pipeline);
//   pingpong: overlap, and the two consumer warpgroups take turns issuing their GEMMs (two named
//             barriers), so that one's softmax runs under the other's GEMMs.
#pragma once
#include "fwd_cta.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_gemms.cuh"
#include "mma_tiles.cuh"  // pack_a: P as A fragments for O += P V
#include "pipeline.cuh"
#include "tile_scores.cuh"
#include "tile_scheduler.cuh"

namespace omni {
namespace fwd_tma {

using pipe::RingPos;

template <class Cfg>
struct Shape {
  enum : int {
    kConsumers = Cfg::kBr / 64,  // consumer warpgroups, 64 query rows each
    kConsumerThreads = kConsumers * 128,
    kThreads = Cfg::kWarps * 32,  // the consumers plus the producer warpgroup
    kProducer = kConsumers,       // the producer's warpgroup index
    // Two consumer warpgroups (the tuned tiles): one CTA per SM; every thread starts with the 168
    // registers the launch bounds give 384 threads, then the producer keeps 24 and the consumers
    // take 240 (setmaxnreg; 128 x 24 + 256 x 240 <= 64 K; ptxas allocates each region to its
    // count). Three (192-row tiles): 128 at entry, the consumers take 160 (128 x 24 + 384 x 160
    // <= 64 K). One consumer warpgroup (the fallback tile): one CTA per SM with registers to spare,
    // no reallocation (at two CTAs per SM ptxas held the consumers to the 128 entry registers and
    // the D = 256 epilogue did not fit).
    kReallocate = kConsumers >= 2,
    kEntryRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8,
    kProducerRegs = 24,
    kConsumerRegs = kConsumers == 2 ? 240 : 160,
    // Named barriers (0 is __syncthreads): the consumers before the epilogue; ping-pong turns.
    kEpilogueBarrier = 1,
    kTurnBarrier = 2,  // + consumer warpgroup index
    kWarpRows = 16,    // rows per warp inside its warpgroup's m64 tile
    kColBlocks = Cfg::kHeadDim / wgmma::kBlockCols,  // 64-column blocks: one TMA box each
    // The epilogue's staging rows: padded, or unpadded in the XOR swizzle (fwd_epilogue.cuh) where
    // only those fit beside Q and the ring of a persistent CTA (Variant.staging_swizzled).
    kLd = Cfg::kSwizzledStaging ? Cfg::kHeadDim : Cfg::kHeadDim + 8,  // row stride of the staging rows
    kQBytes = Cfg::kBr * Cfg::kHeadDim * 2,
    kTileBytes = Cfg::kBc * Cfg::kHeadDim * 2,  // one K or V tile
    kRingBytes = 2 * Cfg::kStages * kTileBytes,
    kBarrierBytes = 8 * (2 + 4 * Cfg::kStages),  // Q full/empty; K/V full/empty per stage
    kStagingBytes = Cfg::kBr * kLd * 2,          // the epilogue's rows of O
  };
  static constexpr bool kPersistent = Cfg::kPersistent;

  static_assert(Cfg::kWarps == Cfg::kBr / 16 + 4 && (Cfg::kBr == 64 || Cfg::kBr == 128 || Cfg::kBr == 192) && Cfg::kMTiles == 1,
                "one consumer warpgroup per 64 query rows plus one producer warpgroup");
  static_assert(Cfg::kHeadDim % wgmma::kBlockCols == 0, "the 128-byte swizzle needs head_dim in 64-column blocks");
  static_assert(Cfg::kBc % 32 == 0 && Cfg::kBc <= 256 && Cfg::kBr <= 256, "wgmma N and TMA boxes are at most 256");
  static_assert(Cfg::kStages == 2, "stage and phase advance as bits");
  static_assert(!Cfg::kPingPong || (Cfg::kOverlap && kConsumers == 2), "ping-pong alternates two overlapped warpgroups");
  static_assert(wgmma::kAtomBytes + kQBytes + kRingBytes + kBarrierBytes <= Cfg::kSmemBytes, "tiles fit the launch's smem");
  static_assert(!Cfg::kSwizzledStaging || Cfg::kPersistent, "unpadded staging rows only where persistent CTAs need them");
  static_assert(Cfg::kPersistent ? wgmma::kAtomBytes + kQBytes + kRingBytes + kStagingBytes + kBarrierBytes <= Cfg::kSmemBytes
                                 : kStagingBytes <= kQBytes + kRingBytes,
                "the epilogue's staging rows fit: their own bytes when persistent, else Q's and the ring's");
  static_assert(!kReallocate || (kProducerRegs <= kEntryRegs && kEntryRegs <= kConsumerRegs &&
                                 kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536),
                "register reallocation stays within the SM's registers");
};

// ---------------------------------------------------------------- shared memory
template <class Cfg>
struct Smem {
  using S = Shape<Cfg>;
  u32 q;        // Q tile, kColBlocks column blocks of kBr rows
  u32 ring;     // stage s: K at ring + 2 s kTileBytes, V right after it
  u32 staging;  // the epilogue's rows: their own bytes when persistent, else Q's and the ring's
  u32 bars;     // mbarriers: Q full, Q empty, then K full, V full, K empty, V empty per stage

  __device__ __forceinline__ u32 k(int s) const { return ring + s * 2 * S::kTileBytes; }
  __device__ __forceinline__ u32 v(int s) const { return ring + s * 2 * S::kTileBytes + S::kTileBytes; }
  __device__ __forceinline__ pipe::Ring<1> q_ring() const { return {bars, bars + 8}; }
  __device__ __forceinline__ pipe::Ring<Cfg::kStages> k_ring() const {
    return {bars + 8 * 2, bars + 8 * (2 + 2 * Cfg::kStages)};
  }
  __device__ __forceinline__ pipe::Ring<Cfg::kStages> v_ring() const {
    return {bars + 8 * (2 + Cfg::kStages), bars + 8 * (2 + 3 * Cfg::kStages)};
  }
};

// ---------------------------------------------------------------- producer
// One K or V tile (kBc rows from row0) into stage `at` of `ring` at shared address `dst`, once the
// consumers have released it: its bytes announced, then one TMA box per 64-column block.
template <class Cfg>
__device__ __forceinline__ void load_kv_tile(const pipe::Ring<Cfg::kStages>& ring, RingPos at, u32 dst, const TmaDesc* map,
                                             int row0, int kv_head, int batch) {
  ring.acquire(at);
  tma::arrive_expect_tx(ring.full(at.stage), Shape<Cfg>::kTileBytes);
#pragma unroll
  for (int c = 0; c < Shape<Cfg>::kColBlocks; ++c) {
    tma::load_4d(dst + c * Cfg::kBc * wgmma::kSwizzleBytes, map, ring.full(at.stage), c * wgmma::kBlockCols, row0, kv_head,
                 batch);
  }
}

// One thread: for every tile of this CTA, Q (once the consumers released the previous one), then
// K and V of every kv tile the consumers will visit, in the same order (the same find_tile walk),
// each into the next stage once the consumers have released it. Reads the __grid_constant__
// parameter directly: after giving its registers away it has no room for a copy.
template <class Cfg, class Params>
__device__ __forceinline__ void produce(const Params& params, const Smem<Cfg>& sm, int q_tiles, int tiles, int stride) {
  using S = Shape<Cfg>;
  constexpr int kBr = Cfg::kBr, kBc = Cfg::kBc;
  const TmaDesc* q_map = &params.q_map;
  const TmaDesc* k_map = &params.k_map;
  const TmaDesc* v_map = &params.v_map;
  tma::prefetch_map(q_map);
  tma::prefetch_map(k_map);
  tma::prefetch_map(v_map);
  const auto q_ring = sm.q_ring();
  const auto k_ring = sm.k_ring();
  const auto v_ring = sm.v_ring();
  RingPos ring;
  u32 q_phase = 0;
  for (TileWalk w = tile_walk(params.cta_tiles, params.tile_list, tiles, stride); w.next < w.end;
       w.next += w.step, q_phase ^= 1) {
    const FwdCta cta = fwd_cta_flat<kBr>(params, w.tile(), q_tiles);
    q_ring.acquire({0, q_phase});
    tma::arrive_expect_tx(q_ring.full(0), S::kQBytes);
#pragma unroll
    for (int c = 0; c < S::kColBlocks; ++c) {
      tma::load_4d(sm.q + c * kBr * wgmma::kSwizzleBytes, q_map, q_ring.full(0), c * wgmma::kBlockCols, cta.q0,
                   cta.head, cta.batch);
    }
    const int kv_head = cta.head / params.kv_group;
    for (KvTile t = find_tile<kBc, Cfg::kHasCausal>(cta.row, 0, 0, params.kv_block_size, params.kv_len);
         t.entry < cta.row.count;
         t = find_tile<kBc, Cfg::kHasCausal>(cta.row, t.entry, t.tile + 1, params.kv_block_size, params.kv_len)) {
      load_kv_tile<Cfg>(k_ring, ring, sm.k(ring.stage), k_map, t.start, kv_head, cta.batch);
      load_kv_tile<Cfg>(v_ring, ring, sm.v(ring.stage), v_map, t.start, kv_head, cta.batch);
      ring.advance();
    }
  }
}

// ---------------------------------------------------------------- the CTA's work
// grid = (CTAs, 1, 1): one per SM when persistent, else one per tile; tiles are flat indices over
// (q tile rank, head, batch), q tiles in the order of q_tile_order (schedule.py), else last first;
// persistent CTAs take them from the host's per-CTA lists when the tiles' costs differ.
// `params`: the kernel's __grid_constant__ parameter, whose tensor maps TMA reads by address.
template <class Cfg, class Params>
__device__ __forceinline__ void forward(const Params& params) {
  using S = Shape<Cfg>;
  using G = fwd_hopper::Gemms<Cfg>;
  using Mma = typename G::Mma;
  using T = typename G::Storage;
  constexpr int kBc = Cfg::kBc, kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
  constexpr int kPVSteps = G::kPVSteps, kWarpRows = S::kWarpRows;
  constexpr bool kOverlap = Cfg::kOverlap, kPingPong = Cfg::kPingPong, kPersistent = S::kPersistent;
  // A by-value copy for every scalar field (lab/notes/host-path.md#s11); the tensor maps are read by TMA from
  // `params` itself.
  const Params p = params;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzle atoms are address-based: start the tiles on a 1024-byte boundary (the launch adds one
  // atom of slack for this).
  const u32 smem_raw_addr = smem_u32(smem_raw);
  Smem<Cfg> sm;
  sm.q = (smem_raw_addr + wgmma::kAtomBytes - 1) & ~static_cast<u32>(wgmma::kAtomBytes - 1);
  sm.ring = sm.q + S::kQBytes;
  sm.staging = kPersistent ? sm.ring + S::kRingBytes : sm.q;
  sm.bars = kPersistent ? sm.staging + S::kStagingBytes : sm.ring + S::kRingBytes;
  const auto q_ring = sm.q_ring();
  const auto k_ring = sm.k_ring();
  const auto v_ring = sm.v_ring();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Read through a shuffle so that the compiler knows it is warp-uniform (uniform descriptors).
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);

  if (threadIdx.x == 0) {
    q_ring.init(1, S::kConsumerThreads);
    // full: the producer's arrive.expect_tx, TMA completes the bytes; empty: every consumer
    // thread, once done reading
    k_ring.init(1, S::kConsumerThreads);
    v_ring.init(1, S::kConsumerThreads);
    tma::fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the warpgroups go their own ways

  const int q_tiles = (p.q_len + Cfg::kBr - 1) / Cfg::kBr;
  const int tiles = q_tiles * p.num_heads * p.batch;
  const int stride = kPersistent ? static_cast<int>(gridDim.x) : tiles;  // one pass unless persistent

  if (warpgroup == S::kProducer) {
    if constexpr (S::kReallocate) tma::release_registers<S::kProducerRegs>();
    if (threadIdx.x == S::kConsumerThreads) produce<Cfg>(params, sm, q_tiles, tiles, stride);
    return;
  }
  if constexpr (S::kReallocate) tma::claim_registers<S::kConsumerRegs>();

  // ---------------------------------------------------------------- consumers
  // This warpgroup's 64 rows of Q: 64 rows into every column block.
  const u64 q_desc = wgmma::descriptor(sm.q + warpgroup * 64 * wgmma::kSwizzleBytes, 16, wgmma::kAtomBytes);
  // Descriptors of stage 0; stage s is 2 s kTileBytes further on.
  const u64 k_desc0 = wgmma::descriptor(sm.k(0), 16, wgmma::kAtomBytes);
  const u64 v_desc0 = wgmma::descriptor(sm.v(0), kBc * wgmma::kSwizzleBytes, wgmma::kAtomBytes);
  const auto k_desc = [&](int s) { return wgmma::advance(k_desc0, s * 2 * S::kTileBytes); };
  const auto v_desc = [&](int s) { return wgmma::advance(v_desc0, s * 2 * S::kTileBytes); };
  // Ping-pong: wait for this warpgroup's turn at the tensor cores / hand the turn to the other.
  const auto take_turn = [&]() {
    if constexpr (kPingPong) tma::named_sync(S::kTurnBarrier + warpgroup, 2 * 128);
  };
  const auto pass_turn = [&]() {
    if constexpr (kPingPong) tma::named_arrive(S::kTurnBarrier + (warpgroup ^ 1), 2 * 128);
  };
  T* stage_rows = reinterpret_cast<T*>(smem_raw + (sm.staging - smem_raw_addr));

  RingPos ring;  // runs on across this CTA's tiles, as the producer's does
  u32 q_phase = 0;
  for (TileWalk w = tile_walk(p.cta_tiles, p.tile_list, tiles, stride); w.next < w.end; w.next += w.step, q_phase ^= 1) {
    const FwdCta cta = fwd_cta_flat<Cfg::kBr>(p, w.tile(), q_tiles);
    const int q0 = cta.q0, head = cta.head, batch = cta.batch;
    const ScoreTile at{batch, head, q0, q0 + warp * kWarpRows, cta.q_block, cta.mask_row, lane};
    const MaskRow& row = cta.row;

    float acc_o[kMTiles][kDTiles][4];
    zero(acc_o);
    OnlineSoftmax<kMTiles, kNTiles, Cfg::kPolyExpEvery> softmax;
    softmax.init();

    const auto next_tile = [&](int entry, int t) {
      return find_tile<kBc, Cfg::kHasCausal>(row, entry, t, p.kv_block_size, p.kv_len);
    };
    // mask, then the softmax statistics: S -> P (fp32, in place), alpha for O
    const auto scores_to_p = [&](const KvTile& cur, float (&acc_s)[kMTiles][kNTiles][4],
                                 float (&alpha)[kMTiles][2]) {
      score_tile<Cfg>(acc_s, cur, at, p);
      softmax.update(acc_s, alpha, p.scale_log2);
    };

    q_ring.wait_full({0, q_phase});  // always: the producer loads every tile's Q
    KvTile cur = next_tile(0, 0);
    if (cur.entry < row.count) {
      u32 pk[kMTiles][kPVSteps][4];  // P packed; overlap: P_{j-1}, waiting for its P V
      float acc_s[kMTiles][kNTiles][4];
      float alpha[kMTiles][2];

      if constexpr (!kOverlap) {
        while (cur.entry < row.count) {
          const KvTile nxt = next_tile(cur.entry, cur.tile + 1);
          k_ring.wait_full(ring);
          G::qk_now(acc_s, q_desc, k_desc(ring.stage));
          k_ring.release(ring);
          scores_to_p(cur, acc_s, alpha);
          rescale_o(acc_o, alpha);  // tile 0: O and alpha are 0
          pack_a<Mma>(pk, acc_s);
          v_ring.wait_full(ring);
          G::pv_now(acc_o, pk, v_desc(ring.stage));
          v_ring.release(ring);
          ring.advance();
          cur = nxt;
        }
      } else {
        // Turns: each warpgroup runs T + 1 GEMM sections (tile 0, tiles 1 .. T-1, the last P V).
        // Warpgroup 1 lets 0 go first and passes no turn after its last section, so every named
        // barrier generation gets exactly its 256 threads.
        if (kPingPong && warpgroup == 1) tma::named_arrive(S::kTurnBarrier + 0, 2 * 128);

        // ---- tile 0: S_0 and its softmax; nothing to overlap with yet ----
        k_ring.wait_full(ring);
        take_turn();
        wgmma::fence();
        G::issue_qk(acc_s, q_desc, k_desc(ring.stage));
        wgmma::commit();
        pass_turn();
        wgmma::wait<0>();
        wgmma::pin(acc_s[0]);
        k_ring.release(ring);
        scores_to_p(cur, acc_s, alpha);  // O is still zero: nothing to rescale
        pack_a<Mma>(pk, acc_s);
        RingPos prev = ring;  // tile j - 1, whose V the next P V reads
        ring.advance();
        cur = next_tile(cur.entry, cur.tile + 1);

        // ---- tiles 1, 2, ...: S_j and P_{j-1} V_{j-1} back to back ----
        while (cur.entry < row.count) {
          const KvTile nxt = next_tile(cur.entry, cur.tile + 1);
          k_ring.wait_full(ring);
          v_ring.wait_full(prev);
          take_turn();
          wgmma::fence();
          G::issue_qk(acc_s, q_desc, k_desc(ring.stage));
          wgmma::commit();
          G::issue_pv(acc_o, pk, v_desc(prev.stage));
          wgmma::commit();
          pass_turn();
          wgmma::wait<1>();  // S_j only
          wgmma::pin(acc_s[0]);
          k_ring.release(ring);
          scores_to_p(cur, acc_s, alpha);
          wgmma::wait<0>();
          wgmma::pin(acc_o[0]);
          G::hold(pk);
          v_ring.release(prev);
          rescale_o(acc_o, alpha);
          pack_a<Mma>(pk, acc_s);
          prev = ring;
          ring.advance();
          cur = nxt;
        }

        // ---- P V of the last tile ----
        v_ring.wait_full(prev);
        take_turn();
        wgmma::fence();
        G::issue_pv(acc_o, pk, v_desc(prev.stage));
        wgmma::commit();
        if (warpgroup == 0) pass_turn();
        wgmma::wait<0>();
        wgmma::pin(acc_o[0]);
        G::hold(pk);
        v_ring.release(prev);
      }
    }
    // Every S of this tile has completed: the producer may load the next tile's Q.
    q_ring.release({0, q_phase});
    // One pass (not persistent): the staging rows overwrite Q and the ring once every consumer is
    // done with them (and every load has landed: the consumers waited for each one).
    if constexpr (!kPersistent) tma::named_sync(S::kEpilogueBarrier, S::kConsumerThreads);

    // ---- epilogue: O /= l, LSE, store ----
    store_output<Mma, kMTiles, kDTiles, kWarpRows, S::kLd, Cfg::kHeadDimValid / 8, Cfg::kSwizzledStaging != 0>(
        acc_o, softmax, stage_rows, p.o + batch * p.o_sb + head * p.o_sh, p.o_sn, lse_row(p, cta), q0, p.q_len,
        p.scale_log2, warp, lane);
    __syncwarp();  // the warp's staging rows are free again before its next tile writes them
  }
}

}  // namespace fwd_tma
}  // namespace omni
