// The backward pass's main kernel on mma.sync.m16n8k16 (FlashAttention-2 decomposition).
//
// One CTA owns kBc kv rows (one kv tile) of one (batch, kv head) and, for D = 256, one half of the
// output columns (a "column pass": S and dP contract over the whole head dim, dK/dV/dQ are made
// for kDOut columns). It walks every q tile that attends to its kv tile, for every query head
// of its GQA group, through the transposed block index (for each kv block, the q blocks that list
// it, with their block types), and per q tile of kBr rows:
//
//   Sᵀ  = K Qᵀ                 (recomputed; P from the forward's LSE: no softmax statistics)
//   Pᵀ  = exp2(Sᵀ scale_log2 - lse_log2)    after scale/bias/score modifier and the mask
//   dVᵀ... dV += Pᵀ dO
//   dPᵀ = V dOᵀ
//   dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod'     (delta = rowsum(dO ∘ O), bwd_rows.cuh)
//   dK += dSᵀ Q
//   dQ += dS K                 fp32 atomics into a workspace (deterministic: int32 fixed point,
//                              or fp32 in a fixed order)
//
// dK and dV stay in registers across the whole walk (the GQA group included), so they need no
// atomics; each warp owns kWarpRows kv rows of them. With kQSplit = 2 (Variant.parts) the warps
// form two q parts: the warps of part h compute Sᵀ, dPᵀ and their dV, dK terms for q columns
// h kBr/2 .. of each q tile over twice as many kv rows per warp (the Q and dO fragments each warp
// reads from shared memory then serve two m16 tiles: a quarter less shared-memory traffic per q
// tile at D = 64, lab/notes/backward.md#s40), and the parts' dK and dV partial sums meet once, in the epilogue.
// At D = 128 the dK and dV of 32 rows do not fit a warp's registers: there (kColumnParts) the parts
// split dK and dV's columns instead, and both read Pᵀ and dSᵀ of the whole q tile back from shared
// memory. Sᵀ, dPᵀ, Pᵀ and dSᵀ live in the m16n8 accumulator layout (lane l: rows l/4 and l/4 + 8,
// columns 2(l%4) and 2(l%4) + 1 of each 16x8 tile; rows are kv positions here, columns q
// positions), Pᵀ and dSᵀ feed dV and dK as A fragments straight from registers (but with column
// parts), and dSᵀ goes through shared memory once for dQ, where the contraction runs over kv rows
// that belong to different warps.
//
// Plain CUDA, templated on
//   C  the configuration (kHeadDim, kHeadDimValid, kDOut, kBr, kBc, kWarps, kStages, kHasCausal, kHasPartial,
//      kFuseMask, kTransformScores, kHasScoreGrad, T = Fp16/Bf16), rendered by the template;
//   F  the per-score functions: F::transform(s, b, h, q, kv, p, grad) (scale, bias, modifier and
//      its derivative) and F::mask(b, h, q, kv, p) (a fused mask expression);
//   P  the parameter struct (dispatch/params.py BACKWARD).
// The including template declares the BlockType enum (kMasked, kCausal, kFull, kPartial) first.
// The q-tile walk and everything around the products that the wgmma kernel (bwd_wgmma.cuh) does
// alike (per-score code, LSE/delta loads, dQ order and reductions, epilogue) is in bwd_common.cuh.
#pragma once
#include "bwd_common.cuh"

namespace omni {
namespace bwd {

template <class C>
struct Shape {
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kKvWarps = C::kWarps / C::kQSplit;  // warps per q part, splitting the kv rows
  static constexpr int kWarpRows = C::kBc / kKvWarps;      // kv rows per warp
  static constexpr int kQCols = C::kBr / C::kQSplit;       // q columns per warp (its q part)
  static constexpr int kMTiles = kWarpRows / 16;           // m16 tiles of kv rows per warp
  static constexpr int kNTiles = kQCols / 8;               // n8 tiles of q columns (Sᵀ, dPᵀ)
  static constexpr int kKSteps = C::kHeadDim / 16;         // k16 steps of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
  static constexpr int kQSteps = kQCols / 16;              // k16 steps of dV = Pᵀ dO and dK = dSᵀ Q
  // dK/dV columns per warp: all of the pass's, or with kColumnParts the q part's half of them
  static constexpr int kOutCols = C::kColumnParts ? C::kDOut / 2 : C::kDOut;
  static constexpr int kOutTiles = kOutCols / 8;          // n8 tiles of dK / dV columns
  static constexpr int kTileQSteps = C::kBr / 16;         // k16 steps of a whole q tile (kColumnParts' dV, dK)
  static constexpr int kPasses = C::kHeadDim / C::kDOut;
  static constexpr int kLd = C::kHeadDim + 8;            // smem row stride: +16 bytes, conflict-free ldmatrix
  static constexpr int kLdS = C::kBr + 8;                // dSᵀ row stride
  static constexpr int kChunks = C::kHeadDim / 8;        // 16-byte chunks per row
  // dQ = dS K: the warps split the q tile's m16 tiles and the columns (rendered from
  // dispatch/variant.py bwd_dq_row_warps).
  static constexpr int kDqRowWarps = C::kDqRowWarps;
  static constexpr int kDqColWarps = C::kWarps / kDqRowWarps;
  static constexpr int kDqMTiles = C::kBr / 16 / kDqRowWarps;
  static constexpr int kDqCols = C::kDOut / kDqColWarps;
  // Accumulator columns held at once: at most 64, in whole n16 pairs.
  static constexpr int kDqChunk = kDqCols <= 64 ? kDqCols : kDqCols % 64 == 0 ? 64 : kDqCols % 48 == 0 ? 48 : 16;
  static constexpr int kDqKSteps = C::kBc / 16;

  static_assert(C::kQSplit == 1 || C::kQSplit == 2, "one or two q parts");
  static_assert(!C::kColumnParts || (C::kQSplit == 2 && kOutTiles % 2 == 0), "column parts: two q parts, n16 pairs");
  static_assert(kWarpRows % 16 == 0 && kQCols % 16 == 0, "each warp owns whole m16 tiles of kv rows, k16 steps of q");
  static_assert(C::kBc % 32 == 0, "kv tiles cover whole 32-bit words of partial bits");
  static_assert(C::kBr % 16 == 0 && kThreads >= 3 * C::kBr / 4,
                "q tiles: whole k16 steps; one LSE/delta/unit chunk per thread");
  static_assert(C::kHeadDim % C::kDOut == 0 && kOutTiles % 2 == 0, "column passes split the head dim evenly");
  static_assert(C::kWarps % kDqRowWarps == 0 && (C::kBr / 16) % kDqRowWarps == 0, "dQ warp grid");
  static_assert(kDqCols % 16 == 0 && kDqCols % kDqChunk == 0, "dQ columns per warp: whole n16 pairs");
};

// ---------------------------------------------------------------- global -> shared rows
// kRows rows of kChunks 16-byte chunks from row0 on; rows at or past `len` are zero-filled, and so
// are the chunks at or past kValidChunks (a padded head dim: the caller's rows end there).
template <int kRows, int kChunks, int kLd, int kThreads, int kValidChunks = kChunks>
__device__ __forceinline__ void load_rows_async(u16* smem, const u16* gmem, i64 row_stride, int row0, int len) {
#pragma unroll
  for (int i = 0; i < (kRows * kChunks + kThreads - 1) / kThreads; ++i) {
    const int c = i * kThreads + threadIdx.x;
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = (kValidChunks == kChunks || ch < kValidChunks) && row0 + r < len;
    if (c < kRows * kChunks)
      cp_async_16(smem_u32(smem + r * kLd + ch * 8), valid ? gmem + static_cast<i64>(row0 + r) * row_stride + ch * 8 : gmem,
                  valid);
  }
}

// Tile products (mma_rows_rows, mma_regs_rows, mma_smem_rows, pack_a, zero): kernels/mma_tiles.cuh.

// kQSplit = 2: the accumulators of q part 1's warps added into those of part 0's warps with the
// same kv rows, through `exchange` (shared, kKvWarps * kMT * kDT * 128 floats, free to overwrite).
// Stored in fragment order, lane fastest: conflict-free, whatever the accumulator layout.
template <int kKvWarps, int kMT, int kDT>
__device__ __forceinline__ void add_q_part(float (&acc)[kMT][kDT][4], float* exchange, int kv_warp, int q_part,
                                           int lane) {
  constexpr int kFloats = kMT * kDT * 4;
  float* mine = exchange + kv_warp * kFloats * 32 + lane;
  float* flat = &acc[0][0][0];  // (constant indices once unrolled: the accumulators stay in registers)
  if (q_part == 1) {
#pragma unroll
    for (int e = 0; e < kFloats; ++e) mine[e * 32] = flat[e];
  }
  __syncthreads();
  if (q_part == 0) {
#pragma unroll
    for (int e = 0; e < kFloats; ++e) flat[e] += mine[e * 32];
  }
  __syncthreads();  // read before the next exchange overwrites it
}

// ================================================================ the kernel body
// kFixedPoint: dQ added as int32 fixed point (bwd_rows.cuh), the deterministic mode whose sums do not
// depend on the order of the adds (an entry of its own, so that the default carries none of it);
// otherwise fp32 adds, in a fixed kv tile order when p.dq_semaphore is set (score derivatives
// that may exceed 1, which the fixed point's bound does not cover).
template <class C, class F, bool kFixedPoint = false, class P>
__device__ __forceinline__ void kv_tile_backward(const P& p, unsigned char* smem_raw) {
  using S = Shape<C>;
  using T = typename C::T;
  constexpr int kBr = C::kBr, kBc = C::kBc, kLd = S::kLd, kLdS = S::kLdS;
  constexpr int kMT = S::kMTiles, kNT = S::kNTiles;

  u16* sK = reinterpret_cast<u16*>(smem_raw);
  u16* sV = sK + kBc * kLd;
  u16* sQ = sV + kBc * kLd;                       // [kStages][kBr][kLd]
  u16* sdO = sQ + C::kStages * kBr * kLd;         // [kStages][kBr][kLd]
  u16* sdS = sdO + C::kStages * kBr * kLd;        // [kBc][kLdS]: dSᵀ of the current q tile
  u16* sP = sdS + kBc * kLdS;                     // [kBc][kLdS]: Pᵀ of the current q tile (kColumnParts)
  float* sLse = reinterpret_cast<float*>(sP + (C::kColumnParts ? kBc * kLdS : 0));  // [kStages][kBr] LSE, log2 units
  float* sDelta = sLse + C::kStages * kBr;                     // [kStages][kBr] rowsum(dO O)
  float* sUnit = sDelta + C::kStages * kBr;                    // [kStages][kBr] fixed-point dQ units (kFixedPoint)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Deterministic dQ adds each q tile's kv tiles in decreasing order (ops/backward_index.py,
  // ranks), so the last kv tile is launched first: a CTA only ever waits for CTAs launched before it.
  const int kv_tiles = gridDim.x / S::kPasses, pass = blockIdx.x % S::kPasses;
  const int kv_tile = p.dq_semaphore != nullptr ? kv_tiles - 1 - static_cast<int>(blockIdx.x) / S::kPasses
                                                : static_cast<int>(blockIdx.x) / S::kPasses;
  const int hk = blockIdx.y, batch = blockIdx.z;
  const int kv0 = kv_tile * kBc;
  const int col0 = pass * C::kDOut;  // first dK/dV/dQ column of this CTA
  const int group = p.kv_group, q_len = p.q_len, kv_len = p.kv_len;
  const bool deterministic = p.dq_semaphore != nullptr;
  const int kv_warp = warp % S::kKvWarps, q_part = warp / S::kKvWarps;
  const int warp_row0 = kv_warp * S::kWarpRows;  // this warp's first kv row within the tile
  const int q_off = q_part * S::kQCols;           // and its first q column within a q tile
  // The q rows (k of dV = Pᵀ dO, dK = dSᵀ Q) and the dK/dV columns of this warp's products.
  const int kq_off = C::kColumnParts ? 0 : q_off;
  const int out_col = col0 + (C::kColumnParts ? q_part * S::kOutCols : 0);

  // ---- K and V: loaded once ----
  load_rows_async<kBc, S::kChunks, kLd, S::kThreads, C::kHeadDimValid / 8>(sK, p.k + batch * p.k_sb + hk * p.k_sh, p.k_sn, kv0, kv_len);
  load_rows_async<kBc, S::kChunks, kLd, S::kThreads, C::kHeadDimValid / 8>(sV, p.v + batch * p.v_sb + hk * p.v_sh, p.v_sn, kv0, kv_len);
  cp_async_commit();

  // Q, dO, LSE and delta of one q tile into buffer `buf`.
  const auto load_q_tile = [&](const QTile& t, int buf) {
    const int head = hk * group + t.g;
    load_rows_async<kBr, S::kChunks, kLd, S::kThreads, C::kHeadDimValid / 8>(sQ + buf * kBr * kLd, p.q + batch * p.q_sb + head * p.q_sh,
                                                       p.q_sn, t.q0, q_len);
    load_rows_async<kBr, S::kChunks, kLd, S::kThreads, C::kHeadDimValid / 8>(sdO + buf * kBr * kLd, p.dout + batch * p.do_sb + head * p.do_sh,
                                                       p.do_sn, t.q0, q_len);
    load_row_stats_async<kBr, kFixedPoint>(sLse, sDelta, buf, p, batch, head, t.q0, tid, sUnit);
    cp_async_commit();
  };

  // This lane's ldmatrix row addresses (fragment layouts: kernels/mma.cuh):
  //   A from [row][k] (K, V: this warp's kv rows): row lane % 16, column half lane / 16;
  //   B from [n][k] (Q, dO as n): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2;
  //   B from [k][n] (Q, dO, K as k; .trans): row ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16;
  //   A from [k][m] (dSᵀ for dS; .trans): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2;
  //   A from [row][k] (Pᵀ, dSᵀ: this warp's kv rows, kColumnParts): as K and V.
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  const int bn_row = (lane / 16) * 8 + lane % 8, bn_col = ((lane / 8) % 2) * 8;
  const int bk_row = ((lane / 8) % 2) * 8 + lane % 8, bk_col = (lane / 16) * 8;
  const u32 k_a0 = smem_u32(sK + (warp_row0 + a_row) * kLd + a_col);
  const u32 v_a0 = smem_u32(sV + (warp_row0 + a_row) * kLd + a_col);
  const u32 q_bn0 = smem_u32(sQ + (q_off + bn_row) * kLd + bn_col);
  const u32 do_bn0 = smem_u32(sdO + (q_off + bn_row) * kLd + bn_col);
  const u32 q_bk0 = smem_u32(sQ + (kq_off + bk_row) * kLd + bk_col + out_col);
  const u32 do_bk0 = smem_u32(sdO + (kq_off + bk_row) * kLd + bk_col + out_col);
  const u32 k_bk0 = smem_u32(sK + bk_row * kLd + bk_col);
  const u32 ds_a0 = smem_u32(sdS + bn_row * kLdS + bn_col);
  const u32 p_rows0 = smem_u32(sP + (warp_row0 + a_row) * kLdS + a_col);
  const u32 ds_rows0 = smem_u32(sdS + (warp_row0 + a_row) * kLdS + a_col);
  constexpr u32 kBufBytes = kBr * kLd * 2;

  float acc_dk[kMT][S::kOutTiles][4], acc_dv[kMT][S::kOutTiles][4];
  zero(acc_dk);
  zero(acc_dv);

  const int kv_block = kv0 / p.kv_block_size;
  const int kv_in_block = kv0 - kv_block * p.kv_block_size;  // kv tile offset within its block
  const bool kv_tail = kv0 + kBc > kv_len;

  QTile cur = next_q_tile<C>(p, batch, hk, kv0, 0, 0, 0, deterministic);
  if (cur.g < group) load_q_tile(cur, 0);
  int buf = 0;
  while (cur.g < group) {
    // Buffer `buf` has landed for everyone, and every warp is done with the previous q tile
    // (its buffer, now free for the prefetch, and dSᵀ).
    cp_async_wait<0>();
    __syncthreads();
    const QTile nxt = after_q_tile<C>(p, batch, hk, kv0, cur, deterministic);
    if (C::kStages == 2 && nxt.g < group) load_q_tile(nxt, buf ^ 1);

    const int head = hk * group + cur.g;
    const int q0 = cur.q0;
    const u32 buf_off = buf * kBufBytes;
    // Opaque copies of the lane addresses: otherwise ptxas hoists every fragment address out of
    // the loop as a register of its own (as in the forward kernel).
    u32 k_a = k_a0, v_a = v_a0, q_bn = q_bn0, do_bn = do_bn0, q_bk = q_bk0, do_bk = do_bk0, k_bk = k_bk0, ds_a = ds_a0;
    asm volatile("" : "+r"(k_a), "+r"(v_a), "+r"(q_bn), "+r"(do_bn), "+r"(q_bk), "+r"(do_bk), "+r"(k_bk), "+r"(ds_a));
    const float* lse_s = sLse + buf * kBr + q_off;  // this warp's q columns
    const float* delta_s = sDelta + buf * kBr + q_off;

    // ---- Sᵀ = K Qᵀ ----
    float acc_s[kMT][kNT][4];
    mma_rows_rows<kMT, kNT, S::kKSteps, kLd, T>(acc_s, k_a, q_bn + buf_off);

    // ---- score transform, mask, Pᵀ = exp2(Sᵀ scale_log2 - lse_log2) ----
    ScoreTile<C> st = score_tile<C>(p, cur, batch, head, kv0);
    if (C::kQSplit > 1 && st.bits != nullptr) st.bits += q_off * st.words;  // rows of this warp's q columns
    float grad[kMT][kNT][4];
    if (st.plain(kv_tail)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
          plain_probs(acc_s[mt][nt], acc_s[mt][nt], lse_s, p.scale_log2, nt, (lane % 4) * 2);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
          masked_probs<C, F>(acc_s[mt][nt], grad[mt][nt], acc_s[mt][nt], p, st, kv_tail, batch, head, q0 + q_off, kv0,
                             kv_in_block, warp_row0 + mt * 16, lse_s, nt, lane / 4, (lane % 4) * 2);
    }

    // ---- dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod' ----
    float acc_dp[kMT][kNT][4];
    mma_rows_rows<kMT, kNT, S::kKSteps, kLd, T>(acc_dp, v_a, do_bn + buf_off);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float d = delta_s[nt * 8 + (lane % 4) * 2 + (i % 2)];
          float ds = acc_s[mt][nt][i] * (acc_dp[mt][nt][i] - d);
          if (C::kHasScoreGrad) ds *= grad[mt][nt][i];
          acc_dp[mt][nt][i] = ds;
        }

    // ---- Pᵀ and dSᵀ as A fragments; dSᵀ to shared memory for dQ (and with kColumnParts Pᵀ and
    // dSᵀ for both parts' dV and dK, which contract over the whole q tile) ----
    u32 a_p[kMT][S::kQSteps][4], a_ds[kMT][S::kQSteps][4];
    pack_a<T>(a_p, acc_s);
    pack_a<T>(a_ds, acc_dp);
    if (C::kQSplit == 1) {  // dV += Pᵀ dO, dK += dSᵀ Q now, releasing the fragments' registers before dQ
      mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dv, a_p, do_bk + buf_off);
      mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dk, a_ds, q_bk + buf_off);
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      store_ds_rows<kLdS>(sdS, a_ds[mt], warp_row0 + mt * 16 + lane / 4, q_off + (lane % 4) * 2);
      if (C::kColumnParts) store_ds_rows<kLdS>(sP, a_p[mt], warp_row0 + mt * 16 + lane / 4, q_off + (lane % 4) * 2);
    }
    __syncthreads();  // dSᵀ (and Pᵀ) complete

    // ---- with q parts, dV += Pᵀ dO and dK += dSᵀ Q run after dQ's MMAs (column parts read the
    // other part's Pᵀ and dSᵀ, complete only after the barrier). The reductions read their registers
    // late, when the LSU takes them, and a product issued after them waits for that wherever its
    // fragments reuse those registers; with column parts the products go before the reductions
    // (+3-7 % at D = 128) but with PARTIAL blocks (-2 %, 356 bytes of spills against 32); at D = 64
    // after them (before, their register fragments spilled 56-84 bytes for -1..+4 %), where they
    // run while the reductions drain (lab/notes/backward.md#s40). The fixed-point entry, whose integer reductions
    // are twice as many, puts them first with PARTIAL blocks too (-4..-5 %, lab/notes/backward.md#s42). ----
    constexpr bool kProductsFirst = C::kColumnParts && (!C::kHasPartial || kFixedPoint);
    const auto dkv_products = [&]() {
      if (C::kColumnParts) {
        u32 p_rows = p_rows0, ds_rows = ds_rows0;
        asm volatile("" : "+r"(p_rows), "+r"(ds_rows));
        mma_smem_rows<kMT, S::kOutTiles, S::kTileQSteps, kLdS, kLd, T>(acc_dv, p_rows, do_bk + buf_off);
        mma_smem_rows<kMT, S::kOutTiles, S::kTileQSteps, kLdS, kLd, T>(acc_dk, ds_rows, q_bk + buf_off);
      } else {
        mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dv, a_p, do_bk + buf_off);
        mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dk, a_ds, q_bk + buf_off);
      }
    };

    // ---- dQ += dS K (fp32 atomics; in deterministic mode in decreasing kv tile order) ----
    {
      const int wr = warp % S::kDqRowWarps, wc = warp / S::kDqRowWarps;
      const int m0 = wr * S::kDqMTiles * 16;   // first q row (local) of this warp
      const int c0 = wc * S::kDqCols;          // first column (within this pass) of this warp
      const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
      int* sem = nullptr;
      int turn = 0;
      if (deterministic)
        sem = dq_semaphore<kBr, kBc, S::kPasses>(p, batch, head, bh, kv_block, kv_in_block, cur, pass, turn);
#pragma unroll 1
      for (int chunk = 0; chunk < S::kDqCols; chunk += S::kDqChunk) {
        float acc_dq[S::kDqMTiles][S::kDqChunk / 8][4];
        zero(acc_dq);
#pragma unroll
        for (int kk = 0; kk < S::kDqKSteps; ++kk) {
          u32 a[S::kDqMTiles][4];
#pragma unroll
          for (int mt = 0; mt < S::kDqMTiles; ++mt) ldmatrix_x4_trans(a[mt], ds_a + (kk * 16 * kLdS + m0 + mt * 16) * 2);
#pragma unroll
          for (int dt = 0; dt < S::kDqChunk / 8; dt += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, k_bk + (kk * 16 * kLd + col0 + c0 + chunk + dt * 8) * 2);
            mma_n16<T>(acc_dq, dt, a, b);
          }
        }
        if (kProductsFirst && chunk + S::kDqChunk >= S::kDqCols) dkv_products();  // the last reductions next
        if (deterministic && chunk == 0) wait_dq_turn(sem, turn, tid);  // the kv tiles before this one
#pragma unroll
        for (int mt = 0; mt < S::kDqMTiles; ++mt)
          add_dq_rows<C::kHeadDim, kFixedPoint>(p, bh, q0, m0 + mt * 16 + lane / 4, static_cast<i64>(c0) + col0 + chunk,
                                                acc_dq[mt], (lane % 4) * 2, sUnit + buf * kBr + m0 + mt * 16 + lane / 4);
      }
      if (deterministic) pass_dq_turn(sem, turn, tid);  // hand the q tile to the next kv tile
    }
    if (C::kQSplit > 1 && !kProductsFirst) dkv_products();

    if (C::kStages == 1) {
      __syncthreads();  // every warp is done with Q, dO and dSᵀ: the next tile may overwrite them
      if (nxt.g < group) load_q_tile(nxt, 0);
    }
    cur = nxt;
    if (C::kStages == 2) buf ^= 1;
  }
  cp_async_wait<0>();  // a kv tile that no q tile sees still has K and V in flight

  // ---- epilogue: the q parts' sums met, dK (scaled) and dV, zeros for kv rows that no query sees ----
  if (C::kQSplit > 1 && !C::kColumnParts) {
    static_assert(C::kBc * C::kDOut * 4 <= (2 * kBc + 2 * C::kStages * kBr) * kLd * 2, "the exchange fits in K, V, Q, dO");
    __syncthreads();  // every warp is done with the tiles whose bytes the exchange reuses
    float* exchange = reinterpret_cast<float*>(smem_raw);
    add_q_part<S::kKvWarps>(acc_dv, exchange, kv_warp, q_part, lane);
    add_q_part<S::kKvWarps>(acc_dk, exchange, kv_warp, q_part, lane);
    if (q_part != 0) return;
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
    store_dk_dv_rows<S::kOutTiles, C::kHeadDim, C::kHeadDimValid, T>(p, batch, hk, kv0 + warp_row0 + mt * 16, out_col,
                                                                      acc_dk[mt], acc_dv[mt], lane / 4, (lane % 4) * 2);
}

}  // namespace bwd
}  // namespace omni
