// The mma.sync forward (sm_80 and later): block-sparse FlashAttention-2 on mma.sync.m16n8k16.
// One CTA owns kBr query rows of one (batch, head); each warp owns kWarpRows of them and all kBc
// columns of every kv tile (no cross-warp reduction). The block walk, score masking, online
// softmax and epilogue are the shared headers'; this file is the main loop and its tile loads.
//
// Plain CUDA templated on the variant's configuration Cfg (templates/fwd_config.cu.jinja), so the
// template only renders constants and the entry point (templates/attention_fwd.cu.jinja).
#pragma once
#include "fwd_cta.cuh"
#include "fwd_epilogue.cuh"
#include "mma_fp8.cuh"    // an fp8 KV cache (Cfg::KvElem): B fragments converted in registers
#include "mma_tiles.cuh"  // pack_a: P as A fragments for O += P V
#include "tile_scores.cuh"

namespace omni {
namespace fwd_sync {

// Enumerators, not static constexpr members: NVRTC emits each constexpr variable as a device global.
template <class Cfg>
struct Shape {
  enum : int {
    kThreads = Cfg::kWarps * 32,
    kWarpRows = Cfg::kBr / Cfg::kWarps,
    // k16 steps of S = Q Kᵀ: those holding real columns (a padded variant's last ones are zeros in
    // Q and K, which add nothing; kHeadDimValid == kHeadDim otherwise)
    kQKSteps = (Cfg::kHeadDimValid + 15) / 16,
    kPVSteps = Cfg::kBc / 16,                 // k16 steps of O += P V
  };

  static_assert(Cfg::kMTiles * 16 == kWarpRows, "each warp owns whole m16 tiles");
  static_assert(Cfg::kBc % 32 == 0, "kv tiles cover whole 32-bit words of partial bits");
  static_assert(Cfg::kHeadDim % 16 == 0 && Cfg::kDTiles % 2 == 0, "head_dim must be a multiple of 16");
  static_assert(Cfg::kStages == 1 || Cfg::kStages == 2, "kStage is 1 or 2");
};

// The shared-memory rows of a tile of elements T (Q's 16-bit; K's and V's, 16-bit or fp8).
template <class Cfg, class T>
struct Rows {
  enum : int {
    kElems = 16 / static_cast<int>(sizeof(T)),  // elements per 16-byte chunk
    kChunks = Cfg::kHeadDim / kElems,           // 16-byte chunks per row
    // row stride (elements): +16 bytes keeps ldmatrix conflict-free
    kLd = Cfg::kHeadDim + Cfg::kSmemPad * 2 / static_cast<int>(sizeof(T)),
  };
};

// ---------------------------------------------------------------- global -> shared tiles
// Copy kRows rows of head_dim elements starting at sequence position row0 into smem, zero-filling
// rows at or past `len` (never read past the end of the sequence) and, in a padded variant, the
// chunks past the caller's head dim (real_chunk). When the chunks of a row divide the threads,
// thread t copies chunk t % kChunks of rows t / kChunks + i * kRowStep: one base pointer per thread
// advanced by a constant, so no per-chunk addresses stay live across the kv loop.
template <class Cfg, int kRows, class T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, i64 row_stride, int row0, int len) {
  using R = Rows<Cfg, T>;
  constexpr int kThreads = Shape<Cfg>::kThreads, kChunks = R::kChunks, kLd = R::kLd, kE = R::kElems;
  if constexpr (kThreads % kChunks == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "tile copy divides evenly among threads");
    const int r = threadIdx.x / kChunks, ch = threadIdx.x % kChunks;
    const bool real = real_chunk_of<Cfg, kE>(ch);
    const T* src = gmem + static_cast<i64>(row0 + r) * row_stride + ch * kE;
    const u32 dst = smem_u32(smem + r * kLd + ch * kE);
    const i64 src_step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const bool valid = real && row0 + r + i * kRowStep < len;
      cp_async_16(dst + i * kRowStep * kLd * static_cast<int>(sizeof(T)), valid ? src + i * src_step : gmem, valid);
    }
  } else {  // head_dim 96: 12 chunks per row, so a thread's chunk column changes from row to row
#pragma unroll
    for (int i = 0; i < (kRows * kChunks + kThreads - 1) / kThreads; ++i) {
      const int c = i * kThreads + threadIdx.x;
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = real_chunk_of<Cfg, kE>(ch) && row0 + r < len;
      if (c < kRows * kChunks)
        cp_async_16(smem_u32(smem + r * kLd + ch * kE), valid ? gmem + static_cast<i64>(row0 + r) * row_stride + ch * kE : gmem,
                    valid);
    }
  }
}

// ---------------------------------------------------------------- the CTA's work
// `params`: the kernel's __grid_constant__ parameter.
template <class Cfg, class Params>
__device__ __forceinline__ void forward(const Params& params) {
  // A by-value copy: every field becomes a plain value read at a fixed offset of the parameter
  // bank. Helpers that take `params` by reference made NVVM compute its address at run time
  // (mov param_0 + add + ld.param [reg+off]) for each use inside the kv loop.
  const Params p = params;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using S = Shape<Cfg>;
  using Mma = typename Cfg::Mma;
  using QT = typename Cfg::QElem::Storage;   // Q's (and O's) elements in memory
  using KvT = typename Cfg::KvElem::Storage;  // K's and V's
  constexpr bool kFp8Kv = sizeof(KvT) == 1;    // an fp8 KV cache: B fragments converted in registers
  constexpr int kBr = Cfg::kBr, kBc = Cfg::kBc, kStages = Cfg::kStages;
  constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
  constexpr int kWarpRows = S::kWarpRows, kPVSteps = S::kPVSteps;
  constexpr int kLd = Rows<Cfg, QT>::kLd, kLdKv = Rows<Cfg, KvT>::kLd;
  QT* sQ = reinterpret_cast<QT*>(smem_raw);
  KvT* sK = reinterpret_cast<KvT*>(sQ + kBr * kLd);
  KvT* sV = (kStages == 1) ? sK : sK + kBc * kLdKv;  // kStage 1: V overwrites K once S is computed

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const FwdCta cta = fwd_cta<kBr>(p);
  const int q0 = cta.q0;
  const ScoreTile at{cta.batch, cta.head, q0, q0 + warp * kWarpRows, cta.q_block, cta.mask_row, lane};

  // The parameter struct's pointers are device addresses; the traits say what they point at.
  const QT* q_bh = reinterpret_cast<const QT*>(p.q) + cta.batch * p.q_sb + cta.head * p.q_sh;
  const KvT* k_bh = reinterpret_cast<const KvT*>(p.k) + cta.batch * p.k_sb + (cta.head / p.kv_group) * p.k_sh;
  const KvT* v_bh = reinterpret_cast<const KvT*>(p.v) + cta.batch * p.v_sb + (cta.head / p.kv_group) * p.v_sh;

  // This lane's ldmatrix row addresses (mma_tiles.cuh's products take them for fragment (0, 0)):
  //   Q (A, x4): rows lane % 16 of the warp's first m tile, column half lane / 16;
  //   K (B, x4): rows (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2;
  //   V (B, x4.trans): rows ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16;
  // fp8 K and V: mma_fp8.cuh's lane offsets.
  const u32 q_lane = smem_u32(sQ + (warp * kWarpRows + lane % 16) * kLd + (lane / 16) * 8);
  const u32 k_lane = kFp8Kv ? smem_u32(sK) + fp8_rows_lane<kLdKv>(lane)
                            : smem_u32(sK + ((lane / 16) * 8 + lane % 8) * kLdKv + ((lane / 8) % 2) * 8);
  const u32 v_lane = kFp8Kv ? smem_u32(sV) + fp8_cols_lane<kLdKv>(lane)
                            : smem_u32(sV + (((lane / 8) % 2) * 8 + lane % 8) * kLdKv + (lane / 16) * 8);

  // ---- load Q ----
  load_tile_async<Cfg, kBr>(sQ, q_bh, p.q_sn, q0, p.q_len);
  cp_async_commit();

  float acc_o[kMTiles][kDTiles][4];
  zero(acc_o);
  OnlineSoftmax<kMTiles, kNTiles, Cfg::kPolyExpEvery> softmax;
  softmax.init();

  // S = Q Kᵀ of tile `cur` with K from smem. Opaque copies of the lane addresses: otherwise ptxas
  // hoists every fragment address out of the loop as its own register.
  const auto scores = [&](float (&acc_s)[kMTiles][kNTiles][4]) {
    u32 q_addr = q_lane, k_addr = k_lane;
    asm volatile("" : "+r"(q_addr), "+r"(k_addr));
    if constexpr (kFp8Kv) {
      mma_rows_rows_fp8<kMTiles, kNTiles, S::kQKSteps, kLd, kLdKv, typename Cfg::KvElem>(acc_s, q_addr, k_addr);
    } else {
      mma_rows_rows<kMTiles, kNTiles, S::kQKSteps, kLd, Mma>(acc_s, q_addr, k_addr);
    }
  };
  // Mask, softmax statistics and O rescaled; P packed as the A operand of P V.
  const auto scores_to_p = [&](const KvTile& cur, float (&acc_s)[kMTiles][kNTiles][4], u32 (&pk)[kMTiles][kPVSteps][4]) {
    score_tile<Cfg>(acc_s, cur, at, p);
    float alpha[kMTiles][2];
    softmax.update(acc_s, alpha, p.scale_log2);
    rescale_o(acc_o, alpha);
    pack_a<Mma>(pk, acc_s);
  };
  const auto pv = [&](const u32 (&pk)[kMTiles][kPVSteps][4]) {
    u32 v_addr = v_lane;
    asm volatile("" : "+r"(v_addr));
    // The n8 tiles of O holding real columns: a padded variant's others stay zero, never stored.
    constexpr int kRealDTiles = (Cfg::kHeadDimValid + 15) / 16 * 2;
    if constexpr (kFp8Kv) {
      mma_regs_rows_fp8<kMTiles, kDTiles, kPVSteps, kLdKv, typename Cfg::KvElem, kRealDTiles>(acc_o, pk, v_addr);
    } else {
      mma_regs_rows<kMTiles, kDTiles, kPVSteps, kLdKv, Mma, kRealDTiles>(acc_o, pk, v_addr);
    }
  };

  // ---- walk kv tiles ----
  KvTile cur = find_tile<kBc, Cfg::kHasCausal>(cta.row, 0, 0, p.kv_block_size, p.kv_len);
  if constexpr (kStages == 2) {
    // K and V in separate buffers, two barriers per tile, each doing two jobs:
    //   top:       K[j] has landed for everyone  +  every warp finished P V[j-1], so V's buffer is free
    //   before PV: V[j] has landed for everyone  +  every warp finished Q K[j]ᵀ, so K's buffer is free
    // V[j] streams in during Q Kᵀ and the softmax, K[j+1] during P V.
    if (cur.entry < cta.row.count) {
      load_tile_async<Cfg, kBc>(sK, k_bh, p.k_sn, cur.start, p.kv_len);
      cp_async_commit();
    }
    while (cur.entry < cta.row.count) {
      cp_async_wait<0>();
      __syncthreads();
      load_tile_async<Cfg, kBc>(sV, v_bh, p.v_sn, cur.start, p.kv_len);
      cp_async_commit();

      float acc_s[kMTiles][kNTiles][4];
      u32 pk[kMTiles][kPVSteps][4];
      scores(acc_s);
      scores_to_p(cur, acc_s, pk);

      const KvTile nxt = find_tile<kBc, Cfg::kHasCausal>(cta.row, cur.entry, cur.tile + 1, p.kv_block_size, p.kv_len);
      cp_async_wait<0>();
      __syncthreads();
      if (nxt.entry < cta.row.count) {
        load_tile_async<Cfg, kBc>(sK, k_bh, p.k_sn, nxt.start, p.kv_len);
        cp_async_commit();
      }
      pv(pk);
      cur = nxt;
    }
  } else {
    // One buffer shared by K and V, four barriers per tile: V[j] can only start after Q K[j]ᵀ,
    // and K[j+1] only after P V[j].
    while (cur.entry < cta.row.count) {
      load_tile_async<Cfg, kBc>(sK, k_bh, p.k_sn, cur.start, p.kv_len);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();

      float acc_s[kMTiles][kNTiles][4];
      u32 pk[kMTiles][kPVSteps][4];
      scores(acc_s);
      __syncthreads();  // every warp is done with K[j]: V[j] may overwrite it
      load_tile_async<Cfg, kBc>(sV, v_bh, p.v_sn, cur.start, p.kv_len);
      cp_async_commit();
      scores_to_p(cur, acc_s, pk);

      const KvTile nxt = find_tile<kBc, Cfg::kHasCausal>(cta.row, cur.entry, cur.tile + 1, p.kv_block_size, p.kv_len);
      cp_async_wait<0>();
      __syncthreads();
      pv(pk);
      __syncthreads();  // every warp is done with V[j]: K[j+1] may overwrite it
      cur = nxt;
    }
  }
  cp_async_wait<0>();  // rows with no kv tile still have Q in flight
  __syncthreads();

  store_output<Mma, kMTiles, kDTiles, kWarpRows, kLd, Cfg::kHeadDimValid / 8>(acc_o, softmax, sQ, p.o + cta.batch * p.o_sb + cta.head * p.o_sh,
                                                       p.o_sn, lse_row(p, cta), q0, p.q_len, p.scale_log2, warp, lane);
}

}  // namespace fwd_sync
}  // namespace omni
