// The wgmma backward, warp-specialized (sm_90a): the products and per-score code of
// kernels/bwd_wgmma.cuh, with the loads and the dQ adds taken off the consumers.
//
// One CTA owns kBc kv rows of one (batch, kv head), 64 per consumer warpgroup, and walks the q
// tiles that attend to them, as bwd_wgmma.cuh does. Its warpgroups:
//
//   producer (warpgroup 0, registers given to the consumers)
//     warps 0, 2  loaders: K and V once, then per q tile Q, dO, LSE and delta into a two-deep
//             ring. Q and dO come by TMA where the host could encode tensor maps (p.tma_loads:
//             one thread announces their bytes on the stage's "full" mbarrier, which the copies
//             complete); else, like LSE, delta and a PARTIAL tile's bits, by cp.async into the
//             128-byte swizzled layout, each thread fencing its landed copies for the async proxy
//             and arriving on "full". Issuing Q and dO by cp.async took the loaders ~5,100 of
//             their ~5,800 cycles per q tile, and the consumers waited ~1,100 per tile for them
//             (lab/notes/backward.md#s33)
//     warp 1  dQ writer: per q tile, once the consumers have staged dQ (fp32, the accumulator's
//             tile layout, kernels/dq_tiles.cuh), adds it to the workspace with bulk reductions
//             and frees the staging buffer when they have read it (deterministic: int32 fixed
//             point, which the consumers convert as they stage it, bwd_rows.cuh)
//   consumers (warpgroups 1 ..): per q tile
//     Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ, dV += Pᵀ dO, dSᵀ, dK += dSᵀ Q    (bwd_wgmma.cuh's order)
//     dSᵀ to one of two shared buffers, one named barrier among the consumers
//     Q/dO stage released ("empty") once dK and dV have read it
//     dQ = dS K, staged once the writer has read the previous q tile's, "dQ full"
//
// So a consumer waits on three things per q tile: its stage's data, the other consumers' dSᵀ, and
// (rarely) the writer's reads of the previous dQ. The single-warpgroup kernel waited on its own
// copies, three CTA barriers and the previous tile's reductions (lab/notes/backward.md#s23).
//
// Every mbarrier completes once per q tile (kv_full once per CTA), and "full" and "dQ full" once
// more for the end: the q-tile counter n gives the stage (n % 2) and each barrier's parity. Only
// the loaders walk the q tiles (bwd::next_q_tile, a chain of dependent global loads): thread 0
// writes each tile's record (QTile) beside its stage, and the end as a record past the last
// tile; the consumers pass each record on to the writer with the tile's dQ. (Three walks, one
// per role, had each read the transposed index from L1 on their critical paths: lab/notes/backward.md#s33.)
#pragma once
#include "bwd_wgmma.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace omni {
namespace bwd_ws {

using bwd::QTile;

// Registers: every thread starts with the launch bounds' 168 (65536 / 384, rounded down to 8),
// then the producer warpgroup gives back down to kProducer and the consumers take kConsumer. The
// consumers can only take what the producer gave: the CTA's registers are fixed at launch (at
// 128 x 32 + 256 x 240 = 65536, 1024 over the CTA's 64512, the consumers waited forever on small
// grids). No split of those 64512 leaves both sides spill-free: at 56 / 224 the loaders spill
// 12-16 bytes and the consumers 8-20 (20-44 per kernel); 40 / 232 spilled 56-72, 72 / 216 over 180.
template <int kConsumerGroups>
struct Registers {
  static constexpr int kThreads = 128 * (kConsumerGroups + 1);
  static constexpr int kEntry = 65536 / kThreads / 8 * 8;
  static constexpr int kProducer = 56;
  static constexpr int kConsumer = 224;
  static_assert(kConsumerGroups == 2, "tuned for two consumer warpgroups (dispatch/variant.py)");
  static_assert(128 * kProducer + 128 * kConsumerGroups * kConsumer <= kThreads * kEntry,
                "the consumers take only what the producer gives back");
};

// Shared memory addresses (bwd_wgmma::Smem's warp-specialized layout, in that order).
template <class C>
struct Layout {
  using S = bwd_wgmma::Shape<C>;
  u32 k, v, q, dout, dq, ds, bits, bars;
  u16* ds_ptr;
  float* lse;    // [2][kBr], log2 units
  float* delta;  // [2][kBr]

  __device__ __forceinline__ explicit Layout(unsigned char* raw) {
    const u32 base = smem_u32(raw);
    k = (base + wgmma::kAtomBytes - 1) & ~static_cast<u32>(wgmma::kAtomBytes - 1);
    v = k + S::kKvBytes;
    q = v + S::kKvBytes;                  // [2] Q tiles
    dout = q + C::kStages * S::kQBytes;   // [2] dO tiles
    dq = dout + C::kStages * S::kQBytes;  // the q tile's dQ, kHeadDim / 64 tiles of dq_tiles::kFloats
    ds = dq + C::kBr * C::kHeadDim * 4;   // [2][kBc][kLdS] dSᵀ
    ds_ptr = reinterpret_cast<u16*>(raw + (ds - base));
    lse = reinterpret_cast<float*>(ds_ptr + 2 * C::kBc * S::kLdS);
    delta = lse + C::kStages * C::kBr;
    bits = smem_u32(delta + C::kStages * C::kBr);  // [2][kBr] a PARTIAL tile's bits (kBitsRowBytes per row)
    bars = bits + C::kStages * C::kBr * S::kBitsRowBytes;
    info_ptr = raw + (bars + 64 - base);
  }
  // The Q/dO/LSE/delta stages (pipeline.cuh): q tile n in stage RingPos::of(n).
  __device__ __forceinline__ pipe::Ring<2> q_ring() const { return {bars, bars + 16}; }
  __device__ __forceinline__ u32 q_full(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ u32 kv_full() const { return bars + 32; }
  __device__ __forceinline__ u32 dq_full() const { return bars + 40; }
  __device__ __forceinline__ u32 dq_empty() const { return bars + 48; }
  // q-tile records (32 bytes each after the 8 mbarriers): [stage] the loader's, read by the
  // consumers after "full"; [2] the consumers', read by the writer after "dQ full"
  __device__ __forceinline__ QTile* info(int i) const { return reinterpret_cast<QTile*>(info_ptr + 32 * i); }
  // [2][kBr] the fixed-point units of a stage's q rows (deterministic), after the three records
  __device__ __forceinline__ float* unit(int s) const { return reinterpret_cast<float*>(info_ptr + 96) + s * C::kBr; }
  unsigned char* info_ptr;
};

// This lane's copies have landed; made visible to the async proxy (wgmma) before the arrival
// that publishes them. (wait_group waits for committed groups only: commit first.)
__device__ __forceinline__ void publish(u32 bar) {
  cp_async_commit();
  cp_async_wait<0>();
  wgmma::fence_proxy_async();
  tma::arrive(bar);
}

// ---------------------------------------------------------------- producer warps
// The loader threads: kLoadLanes of them (warps 0 and 2 of the producer warpgroup), t their index.
// One warp, copying chunk by chunk with each address formed in full, issued for longer than the
// consumers took per q tile (the backward ran at half speed); three warps measured no faster than
// two (lab/notes/backward.md#s31).
enum : int { kLoadLanes = 64 };

template <class C, bool kDeterministic, class P>
__device__ __forceinline__ void load_warp(const P& p, const P& maps, const Layout<C>& sm, int batch, int hk, int kv0,
                                          int t) {
  using S = bwd_wgmma::Shape<C>;
  constexpr int kBr = C::kBr;
  bwd_wgmma::load_tile_async<C::kBc, S::kChunks, kLoadLanes>(sm.k, p.k + batch * p.k_sb + hk * p.k_sh, p.k_sn, kv0, p.kv_len, t);
  bwd_wgmma::load_tile_async<C::kBc, S::kChunks, kLoadLanes>(sm.v, p.v + batch * p.v_sb + hk * p.v_sh, p.v_sn, kv0, p.kv_len, t);
  bool kv_published = false;
  constexpr bool kStagedBits = C::kHasPartial && !C::kFuseMask;
  static_assert(kLoadLanes >= kBr, "a loader thread per q row of bits");
  QTile tile = bwd::next_q_tile<C>(p, batch, hk, kv0, 0, 0, 0, false);
  for (int n = 0;; ++n) {
    const int s = n & 1;
    sm.q_ring().acquire(pipe::RingPos::of(n));  // the consumers are done with tile n - 2
    if (t == 0) *sm.info(s) = tile;  // the walk's record for the consumers, published with the stage
    if (tile.g >= p.kv_group) {  // the end of the walk, announced like a q tile
      if (p.tma_loads && t == 0) tma::arrive(sm.q_full(s));  // the arrival the copies' expect-tx would make
      publish(sm.q_full(s));
      break;
    }
    const int head = hk * p.kv_group + tile.g;
    if (p.tma_loads) {  // one thread: the tensor copies complete the stage's bytes themselves
      if (t == 0) {
        tma::arrive_expect_tx(sm.q_full(s), 2 * S::kQBytes);
#pragma unroll
        for (int c = 0; c < C::kHeadDim / wgmma::kBlockCols; ++c) {
          const u32 at = s * S::kQBytes + c * kBr * wgmma::kSwizzleBytes;
          tma::load_4d(sm.q + at, &maps.q_map, sm.q_full(s), c * wgmma::kBlockCols, tile.q0, head, batch);
          tma::load_4d(sm.dout + at, &maps.do_map, sm.q_full(s), c * wgmma::kBlockCols, tile.q0, head, batch);
        }
      }
    } else {
      bwd_wgmma::load_tile_async<kBr, S::kChunks, kLoadLanes>(sm.q + s * S::kQBytes, p.q + batch * p.q_sb + head * p.q_sh,
                                                              p.q_sn, tile.q0, p.q_len, t);
      bwd_wgmma::load_tile_async<kBr, S::kChunks, kLoadLanes>(sm.dout + s * S::kQBytes,
                                                              p.dout + batch * p.do_sb + head * p.do_sh, p.do_sn, tile.q0,
                                                              p.q_len, t);
    }
    // threads 0-15, 16-31 (and the fixed-point units 32-47)
    bwd::load_row_stats_async<kBr, kDeterministic>(sm.lse, sm.delta, s, p, batch, head, tile.q0, t, sm.unit(0));
    if (kStagedBits && tile.type == kPartial && t < kBr) {  // its bits, a thread per q row (bwd_wgmma.cuh)
      const int pidx = bwd::partial_index(p, batch, head, kv0, tile);
      bwd_wgmma::load_bits_async<C>(sm.bits + (s * kBr + t) * S::kBitsRowBytes, p, tile, pidx, kv0, t);
    }
    // The next q tile's walk (a chain of dependent global loads) while these copies are in flight:
    // 6-8 % faster than walking after the publish (lab/notes/backward.md#s31).
    const QTile next = bwd::next_q_tile<C>(p, batch, hk, kv0, tile.g, tile.slot, tile.tile + 1, false);
    if (!kv_published) {
      publish(sm.kv_full());
      kv_published = true;
    }
    publish(sm.q_full(s));
    tile = next;
  }  // (every exit publishes the end record, whose wait lands the last copies, K and V included)
}

template <class C, bool kDeterministic, class P>
__device__ __forceinline__ void dq_warp(const P& p, const Layout<C>& sm, int batch, int hk, int lane) {
  constexpr int kBr = C::kBr, kBlocks = C::kHeadDim / dq_tiles::kCols;
  for (int n = 0;; ++n) {
    tma::wait(sm.dq_full(), n & 1);
    // The consumers' record of this q tile, read by lane 0 alone (the lane whose "dQ empty" lets
    // them rewrite it) and shared with the warp.
    QTile t{};
    if (lane == 0) t = *sm.info(2);
    t.g = __shfl_sync(0xffffffffu, t.g, 0);
    if (t.g >= p.kv_group) break;
    if (lane == 0) {
      const int head = hk * p.kv_group + t.g;
      const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
      float* dst = p.dq_accum + dq_tiles::tile_offset<C::kHeadDim>(bh, p.q_len_pad, t.q0 / kBr, 0);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        bwd_wgmma::reduce_dq<kDeterministic>(dst + b * dq_tiles::kFloats, sm.dq + b * dq_tiles::kFloats * 4,
                                             dq_tiles::kFloats * 4);
      bulk_commit();
      bulk_wait_read<0>();
      tma::arrive(sm.dq_empty());
    }
    __syncwarp();
  }
  if (lane == 0) bulk_wait<0>();  // the last reductions, before the CTA's shared memory goes
}

// ---------------------------------------------------------------- consumer warpgroups
// What the consumers need of q tile `t` (stage s) to mask it: PARTIAL bits staged by the loaders,
// or (fused masks) the expression.
template <class C, class P>
__device__ __forceinline__ bwd::ScoreTile<C> score_tile(const P& p, const Layout<C>& sm, int s, const QTile& t, int batch,
                                                        int head, int kv0) {
  if constexpr (C::kFuseMask) {
    return bwd::score_tile<C>(p, t, batch, head, kv0);
  } else {
    return bwd::score_tile_staged<C>(t, kv0, sm.bits + s * C::kBr * bwd_wgmma::Shape<C>::kBitsRowBytes);
  }
}

template <class C, class F, bool kDeterministic, class P>
__device__ __forceinline__ void consume(const P& p, const Layout<C>& sm, int batch, int hk, int kv0, int tid) {
  using S = bwd_wgmma::Shape<C>;
  using T = typename C::T;
  using bwd_wgmma::issue_regs_rows;
  constexpr int kBr = C::kBr, kBc = C::kBc, kLdS = S::kLdS, kNT = S::kNT;
  constexpr int kConsumerBarrier = 1;  // named barrier of the consumer threads (0 is __syncthreads)

  const int ctid = tid - 128, warp = ctid / 32, lane = ctid % 32;  // among the consumers
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);     // warp-uniform: descriptors in uniform registers
  const int group = p.kv_group;
  const int warp_row0 = warp * 16;  // this warp's first kv row within the tile

  const bwd_wgmma::Descs<C> d(sm.k, sm.q, warpgroup);
  const int m0 = (warp % 4) * 16;  // this warp's q rows in dQ
  const u32 ds_a = smem_u32(sm.ds_ptr + ((lane / 16) * 8 + lane % 8) * kLdS + ((lane / 8) % 2) * 8 + m0);

  float acc_dk[S::kDTiles][4], acc_dv[S::kDTiles][4];
  bwd_wgmma::zero_rows(acc_dk);
  bwd_wgmma::zero_rows(acc_dv);

  const int kv_block = kv0 / p.kv_block_size;
  const int kv_in_block = kv0 - kv_block * p.kv_block_size;
  const bool kv_tail = kv0 + kBc > p.kv_len;

  int n = 0;
  for (;; ++n) {
    const int s = n & 1;
    // q_ring().wait_full(RingPos::of(n)), written out: through the helper NVVM scheduled this loop
    // differently (the cubins changed), which the loader's and the release's calls do not.
    tma::wait(sm.q_full(s), (n >> 1) & 1);
    const QTile cur = *sm.info(s);  // the loader's walk (one walk per CTA, in the loader)
    if (cur.g >= group) break;
    if (n == 0) tma::wait(sm.kv_full(), 0);
    const int head = hk * group + cur.g;
    const int q0 = cur.q0;
    const u32 buf_off = s * S::kQBytes;
    const float* lse_s = sm.lse + s * kBr;
    const float* delta_s = sm.delta + s * kBr;

    // ---- Sᵀ = K Qᵀ, then dPᵀ = V dOᵀ behind it (kOverlapDp) ----
    // The steps are bwd_wgmma.cuh's functions, shared with the single-group kernel.
    float acc_s[1][kNT][4], acc_dp[1][kNT][4];
    bwd_wgmma::issue_s<C>(acc_s, acc_dp, d, buf_off);

    // ---- Pᵀ (bwd_common.cuh), packed for dV; acc_s keeps Pᵀ ∘ score_mod' for dSᵀ ----
    const bwd::ScoreTile<C> st = score_tile<C>(p, sm, s, cur, batch, head, kv0);
    u32 p_t[1][S::kQSteps][4];
    if (st.plain(kv_tail)) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float pf[4];
        const float one[4] = {1.f, 1.f, 1.f, 1.f};
        bwd::plain_probs(pf, acc_s[0][nt], lse_s, p.scale_log2, nt, (lane % 4) * 2);
        bwd_wgmma::keep_p_t<C>(p_t, acc_s, nt, pf, one);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float pf[4], g[4];
        bwd::masked_probs<C, F, !C::kFuseMask>(pf, g, acc_s[0][nt], p, st, kv_tail, batch, head, q0, kv0, kv_in_block,
                                               warp_row0, lse_s, nt, lane / 4, (lane % 4) * 2);
        bwd_wgmma::keep_p_t<C>(p_t, acc_s, nt, pf, g);
      }
    }

    // ---- dV += Pᵀ dO ----
    wgmma::fence();
    if constexpr (!S::kOverlapDp) bwd_wgmma::issue_dp<C>(acc_dp, d, buf_off);
    issue_regs_rows<C::kHeadDim, S::kQSteps, T>(acc_dv, p_t[0], wgmma::advance(d.do_nmaj0, buf_off));
    wgmma::commit();

    // ---- dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod', then dK += dSᵀ Q; dSᵀ to this tile's buffer for dQ ----
    u32 ds_t[1][S::kQSteps][4];
    bwd_wgmma::issue_dk<C>(acc_dk, ds_t, acc_dp, acc_s, delta_s, d, buf_off, lane);
    const u32 ds_off = s * kBc * kLdS * 2;
    bwd::store_ds_rows<kLdS>(sm.ds_ptr + s * kBc * kLdS, ds_t[0], warp_row0 + lane / 4, (lane % 4) * 2);
    // dSᵀ complete for dQ, which contracts over every consumer's kv rows. Two buffers: the one
    // written next (tile n + 1) was last read by every consumer's ldmatrix of tile n - 1, before
    // each of them arrived here for tile n.
    tma::named_sync(kConsumerBarrier, S::kConsumerThreads);
    bwd_wgmma::dk_dv_done<C>(p_t, ds_t, acc_dk, acc_dv);
    float dq_unit[2];  // deterministic: this lane's dQ rows' units, read before the stage goes back
    if constexpr (kDeterministic) {
      dq_unit[0] = sm.unit(s)[m0 + lane / 4];
      dq_unit[1] = sm.unit(s)[m0 + lane / 4 + 8];
    }
    sm.q_ring().release(pipe::RingPos::of(n));  // Q, dO, LSE, delta (and units) of stage s are no longer read

    // ---- dQ = dS K over every consumer's kv rows, this warpgroup's columns; staged for the writer ----
    u32 a_ds[S::kKvSteps][4];
#pragma unroll
    for (int kk = 0; kk < S::kKvSteps; ++kk) ldmatrix_x4_trans(a_ds[kk], ds_a + ds_off + kk * 16 * kLdS * 2);
#pragma unroll
    for (int chunk = 0; chunk < S::kDqCols; chunk += S::kDqN) {
      const int col = warpgroup * S::kDqCols + chunk;  // first dQ column of this wgmma
      float acc_dq[S::kDqN / 8][4];
      bwd_wgmma::issue_dq<C>(acc_dq, a_ds, d, col);
      if (chunk == 0) tma::wait(sm.dq_empty(), (n & 1) ^ 1);  // the writer has read tile n - 1's dQ
      bwd_wgmma::dq_done<C>(acc_dq, a_ds);
      const int block = col / dq_tiles::kCols;
      if constexpr (kDeterministic) {
        bwd_wgmma::stage_dq<S::kDqN / 8, true>(sm.dq + block * dq_tiles::kFloats * 4, acc_dq, m0 + lane / 4,
                                               (lane % 4) * 2, dq_unit[0], dq_unit[1]);
      } else {
        bwd_wgmma::stage_dq(sm.dq + block * dq_tiles::kFloats * 4, acc_dq, m0 + lane / 4, (lane % 4) * 2);
      }
    }
    wgmma::fence_proxy_async();  // the staged rows (generic stores) are read by the async proxy
    if (ctid == 0) *sm.info(2) = cur;  // for the writer (it read tile n - 1's before "dQ empty")
    tma::arrive(sm.dq_full());
  }
  // The end, for the writer: once it has read tile n - 1's record, "dQ full" with an end record.
  tma::wait(sm.dq_empty(), (n & 1) ^ 1);
  if (ctid == 0) *sm.info(2) = QTile{group, 0, 0, 0, kMasked, 0};
  tma::arrive(sm.dq_full());

  // ---- epilogue: dK (scaled) and dV, zeros for kv rows that no query sees ----
  // Staged in the Q and dO ring (kBc rows of 256 bytes each), once every consumer's products,
  // whose last reads of it their own waits completed, are done: the loaders have nothing left to
  // copy there.
  tma::named_sync(kConsumerBarrier, S::kConsumerThreads);
  bwd_wgmma::store_dk_dv_staged<C, T>(p, batch, hk, kv0, warp_row0, acc_dk, acc_dv, sm.q, sm.dout, lane);
}

// ================================================================ the kernel body
template <class C, class F, bool kDeterministic, class P>
__device__ __forceinline__ void kv_tile_backward(const P& p, const P& maps, unsigned char* smem_raw) {
  using S = bwd_wgmma::Shape<C>;
  using R = Registers<S::kWarpgroups>;
  static_assert(S::kWarpSpecialized, "a producer warpgroup and kBc / 64 consumer warpgroups");
  const Layout<C> sm(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32;
  const GridTile tile = grid_tile();  // one CTA per (kv tile, kv head, batch): tile_scheduler.cuh
  const int batch = tile.batch, hk = tile.head, kv0 = tile.tile * C::kBc;
  if (tid == 0) {
    // full: every loader thread, its copies landed (with TMA loads also the expect-tx arrival);
    // empty: every consumer thread
    sm.q_ring().init(kLoadLanes + (p.tma_loads ? 1 : 0), S::kConsumerThreads);
    tma::barrier_init(sm.kv_full(), kLoadLanes);
    tma::barrier_init(sm.dq_full(), S::kConsumerThreads);
    tma::barrier_init(sm.dq_empty(), 1);  // the writer's lane 0, its reductions' reads done
    tma::fence_barrier_init();
  }
  __syncthreads();
  if (warp < 4) {
    tma::release_registers<R::kProducer>();
    if (warp == 0 || warp == 2) {
      load_warp<C, kDeterministic>(p, maps, sm, batch, hk, kv0, (warp / 2) * 32 + tid % 32);
    } else if (warp == 1) {
      dq_warp<C, kDeterministic>(p, sm, batch, hk, tid % 32);
    }
    return;
  }
  tma::claim_registers<R::kConsumer>();
  consume<C, F, kDeterministic>(p, sm, batch, hk, kv0, tid);
}

}  // namespace bwd_ws
}  // namespace omni
