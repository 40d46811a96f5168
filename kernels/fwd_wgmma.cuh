// The wgmma forward (sm_90a): block-sparse attention on wgmma with cp.async-fed tiles.
//
// Same block-mask walk, mask, softmax and epilogue as the mma.sync family (fwd_sync.cuh), different
// matrix engine: each warpgroup (4 warps) owns 64 query rows and computes S = Q Kᵀ and O += P V
// with fwd_gemms.cuh. The accumulators of both come back in the m16n8 layout per warp, so the
// shared code sees a warp owning 16 rows (kMTiles = 1). K and V tiles are copied with cp.async
// into the 128-byte swizzled layout of wgmma.cuh, two buffers each.
//
// Software pipeline (one barrier per tile, Cfg::kOverlap): tile j issues S_j = Q K_jᵀ and
// O += P_{j-1} V_{j-1} back to back, waits only for S_j, and runs the mask and softmax of tile j
// while the tensor cores still work on P_{j-1} V_{j-1}. Meanwhile K_{j+1} and V_j stream in.
// Without it (fewer live registers: measured faster at head_dim 128, lab/notes/forward.md#s9), tile by tile.
//
// Plain CUDA templated on the variant's Cfg (templates/fwd_config.cu.jinja); the template renders
// constants and the entry point (templates/attention_fwd_sm90.cu.jinja).
#pragma once
#include "fwd_cta.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_gemms.cuh"
#include "mma_tiles.cuh"  // pack_a: P as A fragments for O += P V
#include "tile_scores.cuh"

namespace omni {
namespace fwd_wgmma {

template <class Cfg>
struct Shape {
  enum : int {
    kThreads = Cfg::kWarps * 32,
    kWarpRows = 16,                          // rows per warp inside its warpgroup's m64 tile
    kChunks = Cfg::kHeadDim / 8,             // 16-byte chunks per row
    kLd = Cfg::kHeadDim + 8,                 // row stride of the epilogue's staging rows
    kQBytes = Cfg::kBr * Cfg::kHeadDim * 2,
    kTileBytes = Cfg::kBc * Cfg::kHeadDim * 2,  // one K or V tile
    // Registers per thread the accumulators need: S, O and P.
    kAccRegs = Cfg::kBc / 2 + Cfg::kHeadDim / 2 + Cfg::kBc / 4,
    // Two CTAs per SM when the accumulators leave room for them in 128 registers; a one-warpgroup
    // CTA whose accumulators fit 128 registers is held to 168, three per SM (the D = 64 tile
    // measured best at three, lab/notes/forward.md#s10; left to ptxas it lands at 166-172 depending on
    // unrelated code).
    kCtasPerSm = kAccRegs <= 80 ? 2 : (kThreads == 128 && kAccRegs <= 128 ? 3 : 1),
  };

  static_assert(Cfg::kWarps * 16 == Cfg::kBr && Cfg::kBr % 64 == 0 && Cfg::kMTiles == 1, "one warpgroup per 64 query rows");
  static_assert(Cfg::kHeadDim % wgmma::kBlockCols == 0, "the 128-byte swizzle needs head_dim in 64-column blocks");
  static_assert(Cfg::kBc % 32 == 0 && Cfg::kBc <= 256, "wgmma N is at most 256; kv tiles cover whole words of partial bits");
  static_assert(Cfg::kStages == 2, "the wgmma pipeline double-buffers K and V");
  static_assert(wgmma::kAtomBytes + kQBytes + 2 * Cfg::kStages * kTileBytes <= Cfg::kSmemBytes, "tiles fit the launch's smem");
  static_assert(Cfg::kBr * kLd * 2 <= kQBytes + 2 * Cfg::kStages * kTileBytes, "the epilogue's staging rows fit");
};

// ---------------------------------------------------------------- global -> shared tiles
// Copies kRows rows of head_dim elements from sequence position row0 into the swizzled layout at
// shared address `dst`, zero-filling rows at or past `len` and the padding chunks of a padded
// variant (real_chunk; their `src` is the row's first chunk, never read). Thread t copies chunk t % kChunks of
// rows t / kChunks + i * kRowStep; `src` is the thread's chunk of row 0 (gmem + chunk * 8). When
// kRowStep is a multiple of the swizzle's 8-row period (every shipped tile), a thread's chunk keeps
// its swizzled column in every pass: one shared offset per thread, the passes immediate offsets.
template <class Cfg, int kRows, class T>
__device__ __forceinline__ void load_tile_async(u32 dst, const T* src, i64 row_stride, int row0, int len) {
  constexpr int kThreads = Shape<Cfg>::kThreads, kChunks = Shape<Cfg>::kChunks;
  static_assert(kThreads % kChunks == 0, "whole rows per pass");
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kPasses = (kRows + kRowStep - 1) / kRowStep;
  const int r = threadIdx.x / kChunks, ch = threadIdx.x % kChunks;
  const u32 to = dst + wgmma::chunk_offset(kRows, r, ch);
  // Unsigned 32 x 64-bit products: row0 + r >= 0, and a signed index would cost a sign extension
  // and a full 64-bit multiply per tile. A negative stride (a reversed view) wraps modulo 2^64 to
  // the same address.
  const T* from = src + static_cast<u32>(row0 + r) * static_cast<u64>(row_stride);
  const u64 pass_stride = kRowStep * static_cast<u64>(row_stride);
  const bool interior = row0 + kRows <= len;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    if (kRows % kRowStep != 0 && r + i * kRowStep >= kRows) break;  // 192-row CTAs: the last pass is partial
    const bool valid = real_chunk<Cfg>(ch) && (interior || row0 + r + i * kRowStep < len);
    const u32 to_i = kRowStep % 8 == 0 ? to + i * kRowStep * wgmma::kSwizzleBytes
                                       : dst + wgmma::chunk_offset(kRows, r + i * kRowStep, ch);
    cp_async_16(to_i, valid ? from + i * pass_stride : src, valid);
  }
}

// All threads: the cp.async copies of this thread have landed, and after the barrier everyone's.
__device__ __forceinline__ void tiles_landed() {
  cp_async_wait<0>();
  wgmma::fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
  __syncthreads();
}

// ---------------------------------------------------------------- the CTA's work
// grid = (q tiles, Hq, B); q tiles in the order of q_tile_order (schedule.py), else last first.
// `params`: the kernel's __grid_constant__ parameter.
template <class Cfg, class Params>
__device__ __forceinline__ void forward(const Params& params) {
  using S = Shape<Cfg>;
  using G = fwd_hopper::Gemms<Cfg>;  // S = Q Kᵀ, O += P V
  using Mma = typename G::Mma;
  using T = typename G::Storage;  // Q's, K's, V's and O's elements in memory
  constexpr int kBr = Cfg::kBr, kBc = Cfg::kBc, kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
  constexpr int kPVSteps = G::kPVSteps, kTileBytes = S::kTileBytes, kWarpRows = S::kWarpRows;
  constexpr bool kOverlap = Cfg::kOverlap;
  // A by-value copy: every field becomes a plain value read at a fixed offset of the parameter
  // bank. Helpers that take `params` by reference made NVVM compute its address at run time
  // (mov param_0 + add + ld.param [reg+off]) for each use inside the kv loop.
  const Params p = params;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzle atoms are address-based: start the tiles on a 1024-byte boundary (the launch adds one
  // atom of slack for this).
  const u32 smem_raw_addr = smem_u32(smem_raw);
  const u32 sQ = (smem_raw_addr + wgmma::kAtomBytes - 1) & ~static_cast<u32>(wgmma::kAtomBytes - 1);
  const u32 sKV = sQ + S::kQBytes;  // stage s: K at sKV + 2 s kTileBytes, V right after it

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Read through a shuffle so that the compiler knows it is warp-uniform: the descriptors derived
  // from it then live in uniform registers, as the wgmma operands want them.
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int chunk = threadIdx.x % S::kChunks;  // the 16-byte chunk of each row this thread copies
  // Its source column: the chunk itself, or chunk 0 for a padding chunk (zero-filled: an address
  // inside the row that is never read).
  const int src_chunk = real_chunk<Cfg>(chunk) ? chunk : 0;
  const FwdCta cta = fwd_cta<kBr>(p);
  const int q0 = cta.q0, head = cta.head, batch = cta.batch;
  const ScoreTile at{batch, head, q0, q0 + warp * kWarpRows, cta.q_block, cta.mask_row, lane};
  const MaskRow& row = cta.row;

  // This thread's chunk of row 0 of each operand (load_tile_async adds the rows). Adding the
  // chunk here, once, rather than in load_tile_async measured 17 % faster on the D = 64 masks
  // (lab/notes/forward.md#s10; the SASS difference behind it was not analysed).
  const T* q_bh = p.q + batch * p.q_sb + head * p.q_sh + src_chunk * 8;
  const T* k_bh = p.k + batch * p.k_sb + (head / p.kv_group) * p.k_sh + src_chunk * 8;
  const T* v_bh = p.v + batch * p.v_sb + (head / p.kv_group) * p.v_sh + src_chunk * 8;

  // ---- load Q ----
  load_tile_async<Cfg, kBr>(sQ, q_bh, p.q_sn, q0, p.q_len);
  cp_async_commit();
  // This warpgroup's 64 rows of Q: 64 rows into every column block.
  const u64 q_desc = wgmma::descriptor(sQ + warpgroup * 64 * wgmma::kSwizzleBytes, 16, wgmma::kAtomBytes);

  float acc_o[kMTiles][kDTiles][4];
  zero(acc_o);
  OnlineSoftmax<kMTiles, kNTiles, Cfg::kPolyExpEvery> softmax;
  softmax.init();

  // ---- walk kv tiles ----
  // Buffers: K_j in k_buf(j % 2), V_j in v_buf(j % 2). After the barrier at the top of tile j every
  // warpgroup has finished S_{j-1} and the P V before it, so K_{j+1} may overwrite K_{j-1}, and
  // K_j has landed. kOverlap: V_j is loaded during tile j for P_j V_j at tile j+1 (overwriting
  // V_{j-2}); otherwise V_{j+1} comes with K_{j+1}. Tile 0 is peeled off so that the loop issues
  // every wgmma unconditionally (a wgmma under a branch makes ptxas add warpgroup waits).
  const auto k_buf = [&](int s) { return sKV + s * 2 * kTileBytes; };
  const auto v_buf = [&](int s) { return sKV + s * 2 * kTileBytes + kTileBytes; };
  // Descriptors of stage 0; stage s is 2 s kTileBytes further on.
  const u64 k_desc0 = wgmma::descriptor(k_buf(0), 16, wgmma::kAtomBytes);
  const u64 v_desc0 = wgmma::descriptor(v_buf(0), kBc * wgmma::kSwizzleBytes, wgmma::kAtomBytes);
  const auto k_desc = [&](int s) { return wgmma::advance(k_desc0, s * 2 * kTileBytes); };
  const auto v_desc = [&](int s) { return wgmma::advance(v_desc0, s * 2 * kTileBytes); };

  // mask, then the softmax statistics: S -> P (fp32, in place), alpha for O
  const auto scores_to_p = [&](const KvTile& cur, float (&acc_s)[kMTiles][kNTiles][4], float (&alpha)[kMTiles][2]) {
    score_tile<Cfg>(acc_s, cur, at, p);
    softmax.update(acc_s, alpha, p.scale_log2);
  };
  const auto load_kv = [&](int s, const KvTile& t, bool with_v) {
    load_tile_async<Cfg, kBc>(k_buf(s), k_bh, p.k_sn, t.start, p.kv_len);
    if (with_v) load_tile_async<Cfg, kBc>(v_buf(s), v_bh, p.v_sn, t.start, p.kv_len);
  };
  // O += P V from v_buf(s), waited for
  const auto pv_now = [&](const u32 (&pk)[kMTiles][kPVSteps][4], int s) { G::pv_now(acc_o, pk, v_desc(s)); };

  const auto next_tile = [&](int entry, int tile) {
    return find_tile<kBc, Cfg::kHasCausal>(row, entry, tile, p.kv_block_size, p.kv_len);
  };
  KvTile cur = next_tile(0, 0);
  if (cur.entry < row.count) {
    u32 pk[kMTiles][kPVSteps][4];  // P packed; kOverlap: P_{j-1}, waiting for its P V
    float acc_s[kMTiles][kNTiles][4];
    float alpha[kMTiles][2];

    // ---- tile 0: S = Q Kᵀ and softmax; nothing to overlap with yet ----
    load_kv(0, cur, true);
    cp_async_commit();
    KvTile nxt = next_tile(cur.entry, cur.tile + 1);
    tiles_landed();
    if (nxt.entry < row.count) {
      load_kv(1, nxt, !kOverlap);
      cp_async_commit();
    }
    G::qk_now(acc_s, q_desc, k_desc(0));
    scores_to_p(cur, acc_s, alpha);  // O is still zero: nothing to rescale
    pack_a<Mma>(pk, acc_s);
    if (!kOverlap) pv_now(pk, 0);
    int stage = 1;  // buffer of tile j
    cur = nxt;

    // ---- tiles 1, 2, ... ----
    while (cur.entry < row.count) {
      nxt = next_tile(cur.entry, cur.tile + 1);
      tiles_landed();
      if (nxt.entry < row.count) load_kv(stage ^ 1, nxt, !kOverlap);
      if (kOverlap) load_tile_async<Cfg, kBc>(v_buf(stage), v_bh, p.v_sn, cur.start, p.kv_len);
      cp_async_commit();

      // S_j = Q K_jᵀ (kOverlap: then O += P_{j-1} V_{j-1} behind it, busy during the softmax)
      wgmma::fence();
      G::issue_qk(acc_s, q_desc, k_desc(stage));
      wgmma::commit();
      if constexpr (kOverlap) {
        G::issue_pv(acc_o, pk, v_desc(stage ^ 1));
        wgmma::commit();
        wgmma::wait<1>();  // S_j only
      } else {
        wgmma::wait<0>();
      }
      wgmma::pin(acc_s[0]);
      scores_to_p(cur, acc_s, alpha);
      if constexpr (kOverlap) {
        wgmma::wait<0>();
        wgmma::pin(acc_o[0]);
        G::hold(pk);
      }
      rescale_o(acc_o, alpha);
      pack_a<Mma>(pk, acc_s);
      if (!kOverlap) pv_now(pk, stage);
      stage ^= 1;
      cur = nxt;
    }

    if (kOverlap) {  // P V of the last tile
      tiles_landed();
      pv_now(pk, stage ^ 1);
    }
  }
  cp_async_wait<0>();  // rows with no kv tile still have Q in flight
  __syncthreads();     // every warpgroup is done with the tiles: the staging rows may overwrite them

  // ---- epilogue: O /= l, LSE, store ----
  T* stage_rows = reinterpret_cast<T*>(smem_raw + (sQ - smem_raw_addr));
  store_output<Mma, kMTiles, kDTiles, kWarpRows, S::kLd, Cfg::kHeadDimValid / 8>(acc_o, softmax, stage_rows, p.o + batch * p.o_sb + head * p.o_sh,
                                                       p.o_sn, lse_row(p, cta), q0, p.q_len, p.scale_log2, warp, lane);
}

}  // namespace fwd_wgmma
}  // namespace omni
