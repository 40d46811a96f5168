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
//   dQ += dS K                 fp32 atomics into a workspace, optionally in a fixed order
//
// dK and dV stay in registers across the whole walk (the GQA group included), so they need no
// atomics; each warp owns kBc / kWarps kv rows of them. Sᵀ, dPᵀ, Pᵀ and dSᵀ live in the m16n8
// accumulator layout (lane l: rows l/4 and l/4 + 8, columns 2(l%4) and 2(l%4) + 1 of each 16x8
// tile; rows are kv positions here, columns q positions), Pᵀ and dSᵀ feed dV and dK as A
// fragments straight from registers, and dSᵀ goes through shared memory once for dQ, where the
// contraction runs over kv rows that belong to different warps.
//
// Plain CUDA, templated on
//   C  the configuration (kHeadDim, kHeadDimValid, kDOut, kBr, kBc, kWarps, kStages, kHasCausal, kHasPartial,
//      kFuseMask, kTransformScores, kHasScoreGrad, T = Fp16/Bf16), rendered by the template;
//   F  the per-score functions: F::transform(s, b, h, q, kv, p, grad) (scale, bias, modifier and
//      its derivative) and F::mask(b, h, q, kv, p) (a fused mask expression);
//   P  the parameter struct (dispatch/params.py BACKWARD).
// The including template declares the BlockType enum (kMasked, kCausal, kFull, kPartial) first.
#pragma once
#include "mma.cuh"

namespace omni {
namespace bwd {

template <class C>
struct Shape {
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kWarpRows = C::kBc / C::kWarps;  // kv rows per warp
  static constexpr int kMTiles = kWarpRows / 16;         // m16 tiles of kv rows per warp
  static constexpr int kNTiles = C::kBr / 8;             // n8 tiles of q columns (Sᵀ, dPᵀ)
  static constexpr int kKSteps = C::kHeadDim / 16;       // k16 steps of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
  static constexpr int kQSteps = C::kBr / 16;            // k16 steps of dV = Pᵀ dO and dK = dSᵀ Q
  static constexpr int kOutTiles = C::kDOut / 8;         // n8 tiles of dK / dV columns
  static constexpr int kPasses = C::kHeadDim / C::kDOut;
  static constexpr int kLd = C::kHeadDim + 8;            // smem row stride: +16 bytes, conflict-free ldmatrix
  static constexpr int kLdS = C::kBr + 8;                // dSᵀ row stride
  static constexpr int kChunks = C::kHeadDim / 8;        // 16-byte chunks per row
  // dQ = dS K: the warps split the q tile's m16 tiles, then the columns.
  static constexpr int kDqRowWarps = C::kWarps < C::kBr / 16 ? C::kWarps : C::kBr / 16;
  static constexpr int kDqColWarps = C::kWarps / kDqRowWarps;
  static constexpr int kDqMTiles = C::kBr / 16 / kDqRowWarps;
  static constexpr int kDqCols = C::kDOut / kDqColWarps;
  // Accumulator columns held at once: at most 64, in whole n16 pairs.
  static constexpr int kDqChunk = kDqCols <= 64 ? kDqCols : kDqCols % 64 == 0 ? 64 : kDqCols % 48 == 0 ? 48 : 16;
  static constexpr int kDqKSteps = C::kBc / 16;

  static_assert(kWarpRows % 16 == 0, "each warp owns whole m16 tiles of kv rows");
  static_assert(C::kBc % 32 == 0, "kv tiles cover whole 32-bit words of partial bits");
  static_assert(C::kBr % 16 == 0 && kThreads >= C::kBr / 2, "q tiles: whole k16 steps; one LSE/delta chunk per thread");
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

// ---------------------------------------------------------------- the q tiles of one kv tile
// Position in the walk: query head g of the GQA group, slot in the transposed row, q tile within
// the q block. g == kv_group means the walk is over.
struct QTile {
  int g;
  int slot;
  int tile;
  int q0;      // first query row
  int type;    // BlockType
  int q_block;
};

// The next q tile at or after (g, slot, tile). CAUSAL tiles wholly above the diagonal (every
// query before the first key of this kv tile) are skipped, except in deterministic mode, where
// every tile of a listed block takes its turn in the dQ order (its contribution is zero).
template <class C, class P>
__device__ __forceinline__ QTile next_q_tile(const P& p, int batch, int hk, int kv0, int g, int slot, int tile,
                                             bool deterministic) {
  const int tiles_per_block = p.q_block_size / C::kBr;
  const int kv_block = kv0 / p.kv_block_size;
  for (; g < p.kv_group; ++g, slot = 0, tile = 0) {
    const int head = hk * p.kv_group + g;
    const i64 row = batch * p.t_row_sb + head * p.t_row_sh + kv_block;
    const int count = __ldg(p.q_num_blocks + row);
    const int* types = p.q_types + row * p.t_width;
    const int* indices = p.q_indices + row * p.t_width;
    for (; slot < count; ++slot, tile = 0) {
      const int type = __ldg(types + slot);
      if (type == kMasked) continue;
      const int q_block = __ldg(indices + slot);
      for (; tile < tiles_per_block; ++tile) {
        const int q0 = q_block * p.q_block_size + tile * C::kBr;
        if (q0 >= p.q_len) break;  // later tiles of this block start later still
        if (C::kHasCausal && !deterministic && type == kCausal && q0 + C::kBr - 1 < kv0) continue;
        return QTile{g, slot, tile, q0, type, q_block};
      }
    }
  }
  return QTile{p.kv_group, 0, 0, 0, kMasked, 0};
}

// ---------------------------------------------------------------- tile products
// acc[mt][nt] = sum_k A[m][k] B[n][k]. A: this warp's rows, B: all kNT * 8 rows, both stored
// [row][k] in smem with stride kLd (a_addr / b_addr: this lane's ldmatrix row address at 0).
template <int kMT, int kNT, int kKSteps, int kLd, typename T>
__device__ __forceinline__ void mma_rows_rows(float (&acc)[kMT][kNT][4], u32 a_addr, u32 b_addr) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    u32 a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], a_addr + (mt * 16 * kLd + kk * 16) * 2);
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2) {
      u32 b[4];  // b0, b1 of n tile nt, then of nt + 1
      ldmatrix_x4(b, b_addr + (nt * 8 * kLd + kk * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        T::mma(acc[mt][nt], a[mt], b[0], b[1]);
        T::mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc[mt][dt] += sum_k A[m][k] B[k][n]. A in registers (packed A fragments, k = kKSteps * 16),
// B stored [k][n] in smem with stride kLd, read transposed (b_addr: this lane's address at 0).
template <int kMT, int kDT, int kKSteps, int kLd, typename T>
__device__ __forceinline__ void mma_regs_rows(float (&acc)[kMT][kDT][4], const u32 (&a)[kMT][kKSteps][4], u32 b_addr) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int dt = 0; dt < kDT; dt += 2) {
      u32 b[4];  // transposed: b0, b1 of n tile dt, then of dt + 1
      ldmatrix_x4_trans(b, b_addr + (kk * 16 * kLd + dt * 8) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        T::mma(acc[mt][dt], a[mt][kk], b[0], b[1]);
        T::mma(acc[mt][dt + 1], a[mt][kk], b[2], b[3]);
      }
    }
}

// The accumulator layout of two adjacent n8 tiles is the A fragment of one k16 step.
template <int kMT, int kNT, typename T>
__device__ __forceinline__ void pack_a(u32 (&a)[kMT][kNT / 2][4], const float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      a[mt][kk][0] = T::pack(acc[mt][2 * kk][0], acc[mt][2 * kk][1]);
      a[mt][kk][1] = T::pack(acc[mt][2 * kk][2], acc[mt][2 * kk][3]);
      a[mt][kk][2] = T::pack(acc[mt][2 * kk + 1][0], acc[mt][2 * kk + 1][1]);
      a[mt][kk][3] = T::pack(acc[mt][2 * kk + 1][2], acc[mt][2 * kk + 1][3]);
    }
}

template <int kMT, int kNT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
}

// ---------------------------------------------------------------- deterministic dQ order
__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(int* ptr, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

// ---------------------------------------------------------------- dQ accumulation
// ptr[0] += a, ptr[1] += b in fp32 at L2: one vector reduction on sm_90 (half the atomic
// instructions), two scalar ones before. ptr is 8-byte aligned (an even column).
__device__ __forceinline__ void red_add2(float* ptr, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(ptr, a);
  atomicAdd(ptr + 1, b);
#endif
}

// ================================================================ the kernel body
template <class C, class F, class P>
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
  float* sLse = reinterpret_cast<float*>(sdS + kBc * kLdS);  // [kStages][kBr] LSE, log2 units
  float* sDelta = sLse + C::kStages * kBr;                     // [kStages][kBr] rowsum(dO O)

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
  const int warp_row0 = warp * S::kWarpRows;  // this warp's first kv row within the tile

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
    // The row vectors are padded to whole q tiles: no bounds to check.
    const i64 row = (static_cast<i64>(batch) * p.num_heads + head) * p.q_len_pad + t.q0;
    if (tid < kBr / 4) {
      cp_async_16(smem_u32(sLse + buf * kBr + tid * 4), p.lse_log2 + row + tid * 4, true);
    } else if (tid < kBr / 2) {
      const int c = tid - kBr / 4;
      cp_async_16(smem_u32(sDelta + buf * kBr + c * 4), p.delta + row + c * 4, true);
    }
    cp_async_commit();
  };

  // This lane's ldmatrix row addresses (fragment layouts: kernels/mma.cuh):
  //   A from [row][k] (K, V: this warp's kv rows): row lane % 16, column half lane / 16;
  //   B from [n][k] (Q, dO as n): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2;
  //   B from [k][n] (Q, dO, K as k; .trans): row ((lane / 8) % 2) * 8 + lane % 8, column half lane / 16;
  //   A from [k][m] (dSᵀ for dS; .trans): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2.
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  const int bn_row = (lane / 16) * 8 + lane % 8, bn_col = ((lane / 8) % 2) * 8;
  const int bk_row = ((lane / 8) % 2) * 8 + lane % 8, bk_col = (lane / 16) * 8;
  const u32 k_a0 = smem_u32(sK + (warp_row0 + a_row) * kLd + a_col);
  const u32 v_a0 = smem_u32(sV + (warp_row0 + a_row) * kLd + a_col);
  const u32 q_bn0 = smem_u32(sQ + bn_row * kLd + bn_col);
  const u32 do_bn0 = smem_u32(sdO + bn_row * kLd + bn_col);
  const u32 q_bk0 = smem_u32(sQ + bk_row * kLd + bk_col + col0);
  const u32 do_bk0 = smem_u32(sdO + bk_row * kLd + bk_col + col0);
  const u32 k_bk0 = smem_u32(sK + bk_row * kLd + bk_col);
  const u32 ds_a0 = smem_u32(sdS + bn_row * kLdS + bn_col);
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
    const QTile nxt = next_q_tile<C>(p, batch, hk, kv0, cur.g, cur.slot, cur.tile + 1, deterministic);
    if (C::kStages == 2 && nxt.g < group) load_q_tile(nxt, buf ^ 1);

    const int head = hk * group + cur.g;
    const int q0 = cur.q0;
    const u32 buf_off = buf * kBufBytes;
    // Opaque copies of the lane addresses: otherwise ptxas hoists every fragment address out of
    // the loop as a register of its own (as in the forward kernel).
    u32 k_a = k_a0, v_a = v_a0, q_bn = q_bn0, do_bn = do_bn0, q_bk = q_bk0, do_bk = do_bk0, k_bk = k_bk0, ds_a = ds_a0;
    asm volatile("" : "+r"(k_a), "+r"(v_a), "+r"(q_bn), "+r"(do_bn), "+r"(q_bk), "+r"(do_bk), "+r"(k_bk), "+r"(ds_a));
    const float* lse_s = sLse + buf * kBr;
    const float* delta_s = sDelta + buf * kBr;

    // ---- Sᵀ = K Qᵀ ----
    float acc_s[kMT][kNT][4];
    mma_rows_rows<kMT, kNT, S::kKSteps, kLd, T>(acc_s, k_a, q_bn + buf_off);

    // ---- score transform, mask, Pᵀ = exp2(Sᵀ scale_log2 - lse_log2) ----
    const bool causal_cut = C::kHasCausal && cur.type == kCausal && q0 < kv0 + kBc - 1;
    const bool partial = C::kHasPartial && cur.type == kPartial;
    const u32* bits = nullptr;
    int words = 0;
    if (!C::kFuseMask && partial) {
      const i64 row = batch * p.t_row_sb + head * p.t_row_sh + kv_block;
      const int pidx = __ldg(p.q_partial_index + row * p.t_width + cur.slot);
      words = p.kv_block_size / 32;
      bits = p.partial_masks + (static_cast<i64>(pidx) * p.q_block_size + (q0 - cur.q_block * p.q_block_size)) * words;
    }
    float grad[kMT][kNT][4];
    if (!C::kTransformScores && !partial && !causal_cut && !kv_tail) {
      // A tile with nothing to mask or transform: P straight from the raw scores.
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc_s[mt][nt][i] = exp2_approx(fmaf(acc_s[mt][nt][i], p.scale_log2, -lse_s[nt * 8 + (lane % 4) * 2 + (i % 2)]));
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {  // j: column 2(l%4) + j; i = j (row l/4) and j + 2 (row l/4 + 8)
            const int q_local = nt * 8 + (lane % 4) * 2 + j;
            const int q = q0 + q_local;
            const float lse2 = lse_s[q_local];
            u32 word = 0;
            // The 16 kv rows of an m16 tile start 16-aligned within the block: one word holds them.
            const int kv_bit0 = kv_in_block + warp_row0 + mt * 16;  // bit of the tile's first kv row
            if (!C::kFuseMask && partial) word = __ldg(bits + q_local * words + kv_bit0 / 32);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int i = j + 2 * half;
              const int kv_local = warp_row0 + mt * 16 + lane / 4 + half * 8;
              const int kv = kv0 + kv_local;
              float s = acc_s[mt][nt][i];
              grad[mt][nt][i] = 0.f;
              if (C::kTransformScores && q < q_len && kv < kv_len) s = F::transform(s, batch, head, q, kv, p, grad[mt][nt][i]);
              bool ok = !kv_tail || kv < kv_len;
              if (partial) {
                if (C::kFuseMask) {
                  ok = ok && q < q_len && F::mask(batch, head, q, kv, p);
                } else {
                  ok = ok && ((word >> (kv_bit0 % 32 + lane / 4 + half * 8)) & 1u) != 0;
                }
              } else if (causal_cut) {
                ok = ok && q >= kv;
              }
              // Masked scores and rows with no allowed key (lse_log2 = +inf) give exactly 0.
              acc_s[mt][nt][i] = ok ? exp2_approx(fmaf(s, p.scale_log2, -lse2)) : 0.f;
            }
          }
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

    // ---- dV += Pᵀ dO ----
    {
      u32 a_p[kMT][S::kQSteps][4];
      pack_a<kMT, kNT, T>(a_p, acc_s);
      mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dv, a_p, do_bk + buf_off);
    }
    // ---- dK += dSᵀ Q; dSᵀ to shared memory for dQ ----
    {
      u32 a_ds[kMT][S::kQSteps][4];
      pack_a<kMT, kNT, T>(a_ds, acc_dp);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < S::kQSteps; ++kk) {
          u16* row0 = sdS + (warp_row0 + mt * 16 + lane / 4) * kLdS + kk * 16 + (lane % 4) * 2;
          *reinterpret_cast<u32*>(row0) = a_ds[mt][kk][0];
          *reinterpret_cast<u32*>(row0 + 8 * kLdS) = a_ds[mt][kk][1];
          *reinterpret_cast<u32*>(row0 + 8) = a_ds[mt][kk][2];
          *reinterpret_cast<u32*>(row0 + 8 * kLdS + 8) = a_ds[mt][kk][3];
        }
      mma_regs_rows<kMT, S::kOutTiles, S::kQSteps, kLd, T>(acc_dk, a_ds, q_bk + buf_off);
    }
    __syncthreads();  // dSᵀ complete

    // ---- dQ += dS K (fp32 atomics; in deterministic mode in increasing kv tile order) ----
    {
      const int wr = warp % S::kDqRowWarps, wc = warp / S::kDqRowWarps;
      const int m0 = wr * S::kDqMTiles * 16;   // first q row (local) of this warp
      const int c0 = wc * S::kDqCols;          // first column (within this pass) of this warp
      const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
      int* sem = nullptr;
      int turn = 0;
      if (deterministic) {
        const i64 row = batch * p.t_row_sb + head * p.t_row_sh + kv_block;
        turn = __ldg(p.q_rank + row * p.t_width + cur.slot) - kv_in_block / kBc;
        sem = p.dq_semaphore + ((bh * (p.q_len_pad / kBr) + q0 / kBr) * S::kPasses + pass);
      }
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
#pragma unroll
            for (int mt = 0; mt < S::kDqMTiles; ++mt) {
              T::mma(acc_dq[mt][dt], a[mt], b[0], b[1]);
              T::mma(acc_dq[mt][dt + 1], a[mt], b[2], b[3]);
            }
          }
        }
        if (deterministic && chunk == 0) {  // wait for the kv tiles before this one
          if (tid == 0) {
            while (load_acquire(sem) != turn) {
            }
          }
          __syncthreads();
        }
#pragma unroll
        for (int mt = 0; mt < S::kDqMTiles; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int q = q0 + m0 + mt * 16 + lane / 4 + half * 8;
            if (q >= q_len) continue;
            float* row = p.dq_accum + (bh * q_len + q) * C::kHeadDim + col0 + c0 + chunk + (lane % 4) * 2;
#pragma unroll
            for (int dt = 0; dt < S::kDqChunk / 8; ++dt)
              red_add2(row + dt * 8, acc_dq[mt][dt][2 * half], acc_dq[mt][dt][2 * half + 1]);
          }
      }
      if (deterministic) {  // hand the q tile to the next kv tile
        __threadfence();
        __syncthreads();
        if (tid == 0) store_release(sem, turn + 1);
      }
    }

    if (C::kStages == 1) {
      __syncthreads();  // every warp is done with Q, dO and dSᵀ: the next tile may overwrite them
      if (nxt.g < group) load_q_tile(nxt, 0);
    }
    cur = nxt;
    if (C::kStages == 2) buf ^= 1;
  }
  cp_async_wait<0>();  // a kv tile that no q tile sees still has K and V in flight

  // ---- epilogue: dK (scaled) and dV, zeros for kv rows that no query sees ----
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int kv = kv0 + warp_row0 + mt * 16 + lane / 4 + half * 8;
      if (kv >= kv_len) continue;
      u16* dk_row = p.dk + batch * p.dk_sb + hk * p.dk_sh + kv * p.dk_sn + col0 + (lane % 4) * 2;
      u16* dv_row = p.dv + batch * p.dv_sb + hk * p.dv_sh + kv * p.dv_sn + col0 + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < S::kOutTiles; ++dt) {
        if (C::kHeadDimValid == C::kHeadDim || col0 + dt * 8 < C::kHeadDimValid) {  // not a padding column
          *reinterpret_cast<u32*>(dk_row + dt * 8) =
              T::pack(acc_dk[mt][dt][2 * half] * p.scale, acc_dk[mt][dt][2 * half + 1] * p.scale);
          *reinterpret_cast<u32*>(dv_row + dt * 8) = T::pack(acc_dv[mt][dt][2 * half], acc_dv[mt][dt][2 * half + 1]);
        }
      }
    }
}

}  // namespace bwd
}  // namespace omni
