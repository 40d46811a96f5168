// The backward pass's main kernel on Hopper's warpgroup MMA (sm_90a): the FlashAttention-2
// decomposition of kernels/bwd_kv_tile.cuh, its products on wgmma (FlashAttention-3's structure).
//
// One CTA owns kBc kv rows (one kv tile) of one (batch, kv head), 64 of them per consumer
// warpgroup, and walks every q tile of kBr = 64 rows that attends to it, for every query head of
// its GQA group, through the transposed block index (next_q_tile, bwd_common.cuh). Per q tile:
//
//   Sᵀ  = K Qᵀ        wgmma ss: K (this warpgroup's 64 rows) and Q, both K-major in smem
//   dPᵀ = V dOᵀ       wgmma ss, issued behind Sᵀ
//   Pᵀ  = exp2(Sᵀ scale_log2 - lse_log2) after scale/bias/score modifier and the mask
//   dV += Pᵀ dO       wgmma rs: Pᵀ packed in registers as the A operand, dO N-major in smem
//   dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod'
//   dK += dSᵀ Q       wgmma rs: dSᵀ in registers, Q N-major
//   dQ += dS K        dSᵀ through padded shared memory (ldmatrix.trans gives dS's A fragments),
//                     wgmma rs with K N-major; the fp32 result staged in Q's and dO's buffers
//                     in the accumulator's tile layout (dq_tiles.cuh) and added with bulk
//                     reductions (cp.reduce.async.bulk): by each warp for its own rows at D = 128,
//                     else by thread 0 for the q tile; when deterministic as int32 fixed point
//                     (bwd_rows.cuh), whose sum is the same in any order
//
// Every tile the tensor cores read (K, V, Q, dO) sits in the 128-byte-swizzled layout of
// kernels/wgmma.cuh, which serves as K-major (Sᵀ, dPᵀ: contraction over the head dim) and as
// N-major (dV, dK, dQ: contraction over rows) operand alike, exactly as the forward reads K and V.
// The accumulators come back in the m16n8 layout (rows: kv positions of this warp, columns: q
// positions), the layout of the mma.sync kernel, so the per-score code is the same: it, the
// LSE/delta loads, the dQ order and the epilogue are bwd_common.cuh's, shared with it. The dQ adds
// are this kernel's own: one element pair per lane and instruction (red.global, the mma.sync
// kernel's) kept the LSU and L2 so busy that the kernel ran 1.7x slower than with no dQ adds at all
// (lab/notes/backward.md#s21); a few 4-16 KB bulk reductions per q tile leave that work to the async proxy.
//
// dK and dV stay in registers across the whole walk. With two consumer warpgroups (kBc = 128) each
// computes dQ for half of the head dim's columns over all kBc kv rows.
//
// Plain CUDA, templated on the configuration C (kHeadDim, kBr, kBc, kWarps, kStages, kHasCausal,
// kHasPartial, kFuseMask, kTransformScores, kHasScoreGrad, T), the per-score functions F and the
// parameter struct P, as kernels/bwd_kv_tile.cuh; the including template declares BlockType first.
#pragma once
#include "bwd_common.cuh"  // the q-tile walk, per-score code, dQ order, epilogue
#include "dq_tiles.cuh"
#include "wgmma.cuh"

namespace omni {
namespace bwd_wgmma {

using bwd::QTile;

template <class C>
struct Shape {
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kWarpgroups = C::kBc / 64;          // consumer warpgroups: each owns 64 kv rows
  // A producer warpgroup that loads and adds dQ (kernels/bwd_ws.cuh), or none (this header's
  // kernel). Enumerators: static constexpr members become device symbols of every cubin that
  // includes this header, and this kernel's cubins stay byte-identical without them.
  enum : int { kConsumerThreads = kWarpgroups * 128, kWarpSpecialized = C::kWarps == C::kBc / 16 + 4 };
  enum : int { kBitsRowBytes = C::kBc / 8 };               // a q row's PARTIAL bits over the kv tile
  static constexpr int kNT = C::kBr / 8;                   // n8 tiles of Sᵀ / dPᵀ (q columns)
  static constexpr int kDTiles = C::kHeadDim / 8;          // n8 tiles of dK / dV
  static constexpr int kKSteps = C::kHeadDim / 16;         // k16 steps of Sᵀ, dPᵀ (head dim)
  static constexpr int kQSteps = C::kBr / 16;              // k16 steps of dV, dK (q rows)
  static constexpr int kKvSteps = C::kBc / 16;             // k16 steps of dQ (kv rows)
  static constexpr int kChunks = C::kHeadDim / 8;          // 16-byte chunks per row
  static constexpr int kKvBytes = C::kBc * C::kHeadDim * 2;  // one K or V tile
  static constexpr int kQBytes = C::kBr * C::kHeadDim * 2;   // one Q or dO tile
  static constexpr int kLdS = C::kBr + 8;                  // dSᵀ row stride: +16 bytes, conflict-free ldmatrix
  static constexpr int kDqCols = C::kHeadDim / kWarpgroups;  // dQ columns per warpgroup
  static constexpr int kDqN = kDqCols < 64 ? kDqCols : 64;   // columns per dQ wgmma (one swizzle column block)
  // dPᵀ issued right behind Sᵀ, its accumulators in flight while P is computed; per-score
  // transforms at D = 128 need those registers (a bias variant spilled), so they issue it after P.
  static constexpr bool kOverlapDp = !(C::kTransformScores && C::kHeadDim > 64);

  static_assert(C::kBr == 64, "dQ = dS K: one m64 wgmma covers the q tile");
  static_assert(C::kBc % 64 == 0 && (C::kWarps == C::kBc / 16 || kWarpSpecialized),
                "one consumer warpgroup per 64 kv rows (and one producer warpgroup when warp-specialized)");
  static_assert(C::kHeadDim % wgmma::kBlockCols == 0, "the 128-byte swizzle needs the head dim in 64-column blocks");
  static_assert(kDqCols % 64 == 0, "each warpgroup's dQ columns are whole swizzle column blocks");
  static_assert(C::kStages == 2, "Q and dO are double-buffered");
  static_assert(kThreads >= C::kBr / 2, "one LSE/delta chunk per thread");
};

// Shared memory of a variant (dispatch/variant.py Variant.smem_bytes mirrors it): one swizzle atom of
// alignment slack, K, V, kStages Q and dO tiles, dSᵀ (padded rows), then LSE and delta per stage.
// Per stage also a PARTIAL q tile's bits over the kv tile (Shape::kBitsRowBytes per q row).
// Warp-specialized (kernels/bwd_ws.cuh): also the q tile's fp32 dQ staging, a second dSᵀ buffer
// and the mbarriers and q-tile records (kWsBarriers slots of 8 bytes).
enum : int { kWsBarriers = 8 + 3 * 4 };  // 8 mbarriers, then three 32-byte q-tile records (bwd_ws.cuh)
template <class C>
struct Smem {
  using S = Shape<C>;
  static constexpr int kBytes = wgmma::kAtomBytes + 2 * S::kKvBytes + 2 * C::kStages * S::kQBytes +
                                (S::kWarpSpecialized ? 2 : 1) * C::kBc * S::kLdS * 2 + 2 * C::kStages * C::kBr * 4 +
                                C::kStages * C::kBr * S::kBitsRowBytes +
                                (S::kWarpSpecialized ? C::kBr * C::kHeadDim * 4 + kWsBarriers * 8 : 0) +
                                C::kStages * C::kBr * 4;  // last: the fixed-point units of the q rows (deterministic)
};

// ---------------------------------------------------------------- a PARTIAL tile's bits
// Q row r of PARTIAL q tile t: its kBc / 32 words over the kv tile at kv0 (from the pool's block
// pidx, bwd::partial_index) to shared address `dst`, one copy. Masking then reads shared memory:
// from the pool, two dependent global loads sat between the Sᵀ and dV products, and a PARTIAL q
// tile took 1.35x (D = 128) to 1.49x (D = 64) a FULL one (lab/notes/backward.md#s32).
template <class C, class P>
__device__ __forceinline__ void load_bits_async(u32 dst, const P& p, const QTile& t, int pidx, int kv0, int r) {
  const int kv_block = kv0 / p.kv_block_size, words = p.kv_block_size / 32;
  const int q_row = t.q0 - t.q_block * p.q_block_size + r;  // within the q block: the pool has every row
  const u32* src = p.partial_masks + (static_cast<i64>(pidx) * p.q_block_size + q_row) * words +
                   (kv0 - kv_block * p.kv_block_size) / 32;
  if constexpr (Shape<C>::kBitsRowBytes == 16) {
    cp_async_16(dst, src, true);
  } else {
    static_assert(Shape<C>::kBitsRowBytes == 8, "kBc of 64 or 128");
    cp_async_8(dst, src);
  }
}

// ---------------------------------------------------------------- the epilogue
// dK (scaled) and dV of one warp's 16 kv rows (rows warp_row0 ..) through shared memory: the
// accumulator fragments go to rows of kHeadDim * 2 bytes (16-byte chunk c of row r at chunk
// c ^ (r % 8): the eight rows a fragment store touches then fill all 32 banks), and the warp reads
// its own rows back as 16-byte chunks, whole rows per pass of 32 lanes, for whole-chunk global
// stores. Written from the fragments, each store covered 16 bytes of 8 rows, and the epilogue took
// 5-6 us of a warp-specialized CTA (the phase timings of lab/notes/backward.md#s32). dk_stage, dv_stage: kBc
// rows of kHeadDim * 2 bytes each, free of readers (both kernels pass their Q and dO buffers).
template <class C, class T, class P>
__device__ __forceinline__ void store_dk_dv_staged(const P& p, int batch, int hk, int kv0, int warp_row0,
                                                   const float (&dk)[C::kHeadDim / 8][4],
                                                   const float (&dv)[C::kHeadDim / 8][4], u32 dk_stage, u32 dv_stage,
                                                   int lane) {
  constexpr int kChunks = C::kHeadDim / 8, kRowBytes = C::kHeadDim * 2;
  static_assert(kChunks == 8 || kChunks == 16, "rows of 8 or 16 chunks: the swizzle spans 8, 32 lanes whole rows");
  static_assert(C::kStages * Shape<C>::kQBytes >= C::kBc * kRowBytes, "the Q (dO) buffers hold kBc rows of dK (dV)");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp_row0 + lane / 4 + half * 8;
    const u32 row = r * kRowBytes + (lane % 4) * 4;
#pragma unroll
    for (int dt = 0; dt < kChunks; ++dt) {
      const u32 at = row + ((dt ^ (r % 8)) << 4);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dk_stage + at),
                   "r"(T::pack(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale)));
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dv_stage + at), "r"(T::pack(dv[dt][2 * half], dv[dt][2 * half + 1])));
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int r = warp_row0 + i * (32 / kChunks) + lane / kChunks, c = lane % kChunks, kv = kv0 + r;
    const u32 at = r * kRowBytes + ((c ^ (r % 8)) << 4);
    Vec16 k4, v4;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(k4.x), "=r"(k4.y), "=r"(k4.z), "=r"(k4.w) : "r"(dk_stage + at));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v4.x), "=r"(v4.y), "=r"(v4.z), "=r"(v4.w) : "r"(dv_stage + at));
    if (kv < p.kv_len) {
      *reinterpret_cast<Vec16*>(p.dk + batch * p.dk_sb + hk * p.dk_sh + kv * p.dk_sn + c * 8) = k4;
      *reinterpret_cast<Vec16*>(p.dv + batch * p.dv_sb + hk * p.dv_sh + kv * p.dv_sn + c * 8) = v4;
    }
  }
}

// ---------------------------------------------------------------- global -> shared, swizzled
// kRows rows of the head dim from sequence position row0 into the swizzled layout at shared
// address `dst`, by kThreads copying threads (t: this one's index among them); rows at or past
// `len` are zero-filled. Thread t copies chunk t % kChunks of rows t / kChunks + i * kRowStep
// (consecutive threads read consecutive chunks: coalesced), the global address of pass i one add
// from the first. When kRowStep is a multiple of the swizzle's 8-row period (this kernel's 128
// threads), a thread's chunk keeps its swizzled column in every pass: one shared offset per
// thread, the passes immediate offsets (as the forward's copies). Else (the warp-specialized
// kernel's 64 loader threads, kernels/bwd_ws.cuh) each pass forms its shared offset, two passes
// unrolled per iteration (its producer's registers are few).
template <int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_tile_async(u32 dst, const u16* src, i64 row_stride, int row0, int len, u32 t) {
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "whole rows per pass");
  if constexpr (kRowStep % 8 == 0) {
    const int r = t / kChunks, ch = t % kChunks;
    const u32 to = dst + wgmma::chunk_offset(kRows, r, ch);
    const u16* from = src + static_cast<i64>(row0 + r) * row_stride + ch * 8;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const bool valid = row0 + r + i * kRowStep < len;
      cp_async_16(to + i * kRowStep * wgmma::kSwizzleBytes, valid ? from + i * kRowStep * row_stride : src, valid);
    }
  } else {
    const int r = static_cast<int>(t) / kChunks, ch = static_cast<int>(t) % kChunks;
    const u16* from = src + static_cast<i64>(row0 + r) * row_stride + ch * 8;
#pragma unroll 2
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const int row = r + i * kRowStep;
      const bool valid = row0 + row < len;
      cp_async_16(dst + wgmma::chunk_offset(kRows, row, ch), valid ? from + i * kRowStep * row_stride : src, valid);
    }
  }
}

// ---------------------------------------------------------------- tile products
// acc = A Bᵀ over the head dim, both K-major swizzled tiles: A of kARows rows (this warpgroup's 64
// start at a_desc), B of kN rows. Asynchronous: the caller fences, commits, waits and pins.
template <int kN, int kKSteps, int kARows, typename T>
__device__ __forceinline__ void issue_rows_rows(float (&acc)[kN / 8][4], u64 a_desc, u64 b_desc) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const u32 column = kk * 16 / wgmma::kBlockCols, step = (kk * 16 % wgmma::kBlockCols) / 16;
    const u64 a = wgmma::advance(a_desc, column * kARows * wgmma::kSwizzleBytes + step * 32);
    const u64 b = wgmma::advance(b_desc, column * kN * wgmma::kSwizzleBytes + step * 32);
    if (kk == 0) {
      wgmma::Op<kN, T>::ss_init(acc, a, b);
    } else {
      wgmma::Op<kN, T>::ss(acc, a, b);
    }
  }
}

// acc += A B: A in registers (m16n8k16 A fragments of this warp's 16 rows, kKSteps of them), B an
// N-major swizzled tile whose k16 step kk starts 16 rows (two swizzle atoms) further on.
template <int kN, int kKSteps, typename T>
__device__ __forceinline__ void issue_regs_rows(float (&acc)[kN / 8][4], const u32 (&a)[kKSteps][4], u64 b_desc) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) wgmma::Op<kN, T>::rs(acc, a[kk], wgmma::advance(b_desc, kk * 16 * wgmma::kSwizzleBytes));
}

// wgmma reads its register A operand asynchronously: keep the fragments alive until the wait.
template <int kSteps>
__device__ __forceinline__ void hold(const u32 (&a)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(a[kk][i]) : "memory");
}

// One warp's 16 rows x kTiles n8 tiles of dQ (m16n8 accumulators) into a staged piece of the
// accumulator's tile layout at shared address `piece` (dq_tiles.cuh): rows `row` (this lane's,
// lane / 4 included) and row + 8, columns lane_col, lane_col + 1 of each n8 tile. Two wavefronts
// per store instruction (the layout's point). The swizzle only permutes the bits 5-7 of a row's
// byte offsets that n8 tile dt sets, so every store's address is one base XOR dt << 5: the base
// is formed here (opaque to the compiler), so that no table of 2 x kTiles addresses is hoisted out
// of the q-tile loop into registers. kFixedPoint: rows `row` and row + 8 as int32, times their
// units (bwd_rows.cuh's fixed-point dQ; cvt.rni saturates, never wraps).
template <int kTiles, bool kFixedPoint = false>
__device__ __forceinline__ void stage_dq(u32 piece, const float (&acc)[kTiles][4], int row, int lane_col,
                                         float unit_row = 1.f, float unit_row8 = 1.f) {
  static_assert(kTiles == dq_tiles::kCols / 8, "one n8 tile per 32 bytes of a 256-byte row");
  const int x = row & 7;
  u32 base = piece + row * dq_tiles::kCols * 4 + ((((lane_col >> 2) ^ x) & 1) << 4) + (lane_col & 3) * 4 + (x & 6) * 16;
  asm volatile("" : "+r"(base));
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt) {
      const u32 at = (base + half * 8 * dq_tiles::kCols * 4) ^ (dt << 5);
      if constexpr (kFixedPoint) {
        const float unit = half ? unit_row8 : unit_row;
        asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(at), "r"(__float2int_rn(acc[dt][2 * half] * unit)),
                     "r"(__float2int_rn(acc[dt][2 * half + 1] * unit))
                     : "memory");
      } else {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[dt][2 * half]), "f"(acc[dt][2 * half + 1])
                     : "memory");
      }
    }
}

// A staged q tile's dQ (`bytes` from shared `src`) added to the accumulator at `dst`: fp32, or the
// fixed-point int32 of the deterministic kernels.
template <bool kFixedPoint>
__device__ __forceinline__ void reduce_dq(float* dst, u32 src, u32 bytes) {
  if constexpr (kFixedPoint) {
    bulk_reduce_add_s32(dst, src, bytes);
  } else {
    bulk_reduce_add_f32(dst, src, bytes);
  }
}

// ================================================================ one q tile's products
// The steps both kernels (this one and bwd_ws.cuh's consumers) run per q tile, for one consumer
// warpgroup owning 64 kv rows: Sᵀ and dPᵀ, Pᵀ, dSᵀ and dK, dV, dQ.

// The operand descriptors, built once; stages and k-steps add compile-time offsets to the start address.
//   K, V as A of Sᵀ / dPᵀ (K-major): this warpgroup's 64 rows.
//   Q, dO as B of Sᵀ / dPᵀ (K-major) and as B of dK / dV (N-major: k = q row, n = head dim column).
//   K as B of dQ (N-major: k = kv row).
// V, dO: a compile-time offset from K, Q (one add each, which ptxas can redo instead of holding).
template <class C>
struct Descs {
  using S = Shape<C>;
  u64 k_a, v_a, q_kmaj0, do_kmaj0, q_nmaj0, do_nmaj0, k_nmaj;
  __device__ __forceinline__ Descs(u32 sK, u32 sQ, int warpgroup) {
    k_a = wgmma::descriptor(sK + warpgroup * 64 * wgmma::kSwizzleBytes, 16, wgmma::kAtomBytes);
    v_a = wgmma::advance(k_a, S::kKvBytes);
    q_kmaj0 = wgmma::descriptor(sQ, 16, wgmma::kAtomBytes);
    do_kmaj0 = wgmma::advance(q_kmaj0, C::kStages * S::kQBytes);
    q_nmaj0 = wgmma::descriptor(sQ, C::kBr * wgmma::kSwizzleBytes, wgmma::kAtomBytes);
    do_nmaj0 = wgmma::advance(q_nmaj0, C::kStages * S::kQBytes);
    k_nmaj = wgmma::descriptor(sK, C::kBc * wgmma::kSwizzleBytes, wgmma::kAtomBytes);
  }
};

template <int kN>
__device__ __forceinline__ void zero_rows(float (&acc)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
}

// dPᵀ = V dOᵀ of the q tile in stage buffer `buf_off`, committed.
template <class C>
__device__ __forceinline__ void issue_dp(float (&acc_dp)[1][Shape<C>::kNT][4], const Descs<C>& d, u32 buf_off) {
  issue_rows_rows<C::kBr, Shape<C>::kKSteps, C::kBc, typename C::T>(acc_dp[0], d.v_a, wgmma::advance(d.do_kmaj0, buf_off));
  wgmma::commit();
}

// Sᵀ = K Qᵀ, then dPᵀ behind it (kOverlapDp; else the caller issues dPᵀ after P); Sᵀ waited for.
template <class C>
__device__ __forceinline__ void issue_s(float (&acc_s)[1][Shape<C>::kNT][4], float (&acc_dp)[1][Shape<C>::kNT][4],
                                       const Descs<C>& d, u32 buf_off) {
  wgmma::fence();
  issue_rows_rows<C::kBr, Shape<C>::kKSteps, C::kBc, typename C::T>(acc_s[0], d.k_a, wgmma::advance(d.q_kmaj0, buf_off));
  wgmma::commit();
  if constexpr (Shape<C>::kOverlapDp) {
    issue_dp<C>(acc_dp, d, buf_off);
    wgmma::wait<1>();  // Sᵀ only
  } else {
    wgmma::wait<0>();
  }
  wgmma::pin(acc_s[0]);
}

// Pᵀ from Sᵀ (bwd_common.cuh), one warp's n8 tiles: packed into the A fragments of dV (p_t), and
// acc_s keeps Pᵀ ∘ score_mod' in fp32 for dSᵀ (no array of derivatives stays live across the tile).
template <class C>
__device__ __forceinline__ void keep_p_t(u32 (&p_t)[1][Shape<C>::kQSteps][4], float (&acc_s)[1][Shape<C>::kNT][4], int nt,
                                         const float (&pf)[4], const float (&g)[4]) {
  using T = typename C::T;
  p_t[0][nt / 2][(nt % 2) * 2] = T::pack(pf[0], pf[1]);
  p_t[0][nt / 2][(nt % 2) * 2 + 1] = T::pack(pf[2], pf[3]);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc_s[0][nt][i] = C::kHasScoreGrad ? pf[i] * g[i] : pf[i];
}

// dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod' (acc_s: Pᵀ ∘ score_mod'), packed as ds_t; then dK += dSᵀ Q
// issued and committed. Waits for dPᵀ (dV may still run).
template <class C>
__device__ __forceinline__ void issue_dk(float (&acc_dk)[Shape<C>::kDTiles][4], u32 (&ds_t)[1][Shape<C>::kQSteps][4],
                                        float (&acc_dp)[1][Shape<C>::kNT][4], const float (&acc_s)[1][Shape<C>::kNT][4],
                                        const float* delta_s, const Descs<C>& d, u32 buf_off, int lane) {
  wgmma::wait<1>();
  wgmma::pin(acc_dp[0]);
#pragma unroll
  for (int nt = 0; nt < Shape<C>::kNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float dl = delta_s[nt * 8 + (lane % 4) * 2 + (i % 2)];
      acc_dp[0][nt][i] = acc_s[0][nt][i] * (acc_dp[0][nt][i] - dl);
    }
  pack_a<typename C::T>(ds_t, acc_dp);
  wgmma::fence();
  issue_regs_rows<C::kHeadDim, Shape<C>::kQSteps, typename C::T>(acc_dk, ds_t[0], wgmma::advance(d.q_nmaj0, buf_off));
  wgmma::commit();
}

// dV and dK complete; their register fragments released.
template <class C>
__device__ __forceinline__ void dk_dv_done(const u32 (&p_t)[1][Shape<C>::kQSteps][4], const u32 (&ds_t)[1][Shape<C>::kQSteps][4],
                                          float (&acc_dk)[Shape<C>::kDTiles][4], float (&acc_dv)[Shape<C>::kDTiles][4]) {
  wgmma::wait<0>();
  hold(p_t[0]);
  hold(ds_t[0]);
  wgmma::pin(acc_dk);
  wgmma::pin(acc_dv);
}

// dQ's columns [col, col + kDqN) = dS K over the CTA's kv rows (a_ds: dS's A fragments), issued
// and committed; the caller waits (dq_done).
template <class C>
__device__ __forceinline__ void issue_dq(float (&acc_dq)[Shape<C>::kDqN / 8][4], const u32 (&a_ds)[Shape<C>::kKvSteps][4],
                                        const Descs<C>& d, int col) {
  zero_rows(acc_dq);
  wgmma::fence();
  issue_regs_rows<Shape<C>::kDqN, Shape<C>::kKvSteps, typename C::T>(
      acc_dq, a_ds, wgmma::advance(d.k_nmaj, (col / wgmma::kBlockCols) * C::kBc * wgmma::kSwizzleBytes));
  wgmma::commit();
}

template <class C>
__device__ __forceinline__ void dq_done(float (&acc_dq)[Shape<C>::kDqN / 8][4], const u32 (&a_ds)[Shape<C>::kKvSteps][4]) {
  wgmma::wait<0>();
  wgmma::pin(acc_dq);
  hold(a_ds);
}

// ================================================================ the kernel body
// kDeterministic: dQ added as int32 fixed point (bwd_rows.cuh), a kernel of its own so that the
// default carries none of the conversion.
template <class C, class F, bool kDeterministic, class P>
__device__ __forceinline__ void kv_tile_backward(const P& p, unsigned char* smem_raw) {
  using S = Shape<C>;
  using T = typename C::T;
  constexpr int kBr = C::kBr, kBc = C::kBc, kLdS = S::kLdS, kNT = S::kNT;

  // Swizzle atoms are address-based: the tiles start on a 1024-byte boundary (one atom of slack).
  const u32 smem_raw_addr = smem_u32(smem_raw);
  const u32 sK = (smem_raw_addr + wgmma::kAtomBytes - 1) & ~static_cast<u32>(wgmma::kAtomBytes - 1);
  const u32 sV = sK + S::kKvBytes;
  const u32 sQ = sV + S::kKvBytes;                       // [kStages] Q tiles
  const u32 sdO = sQ + C::kStages * S::kQBytes;          // [kStages] dO tiles
  const u32 sdS_addr = sdO + C::kStages * S::kQBytes;    // [kBc][kLdS] dSᵀ of the current q tile
  u16* sdS = reinterpret_cast<u16*>(smem_raw + (sdS_addr - smem_raw_addr));
  float* sLse = reinterpret_cast<float*>(sdS + kBc * kLdS);  // [kStages][kBr] LSE, log2 units
  float* sDelta = sLse + C::kStages * kBr;                     // [kStages][kBr] rowsum(dO O)
  const u32 sBits = smem_u32(sDelta + C::kStages * kBr);       // [kStages][kBr] a PARTIAL tile's bits
  float* sUnit = reinterpret_cast<float*>(smem_raw + (sBits + C::kStages * kBr * S::kBitsRowBytes - smem_raw_addr));
  // Tiles whose PARTIAL bits are staged with Q (not fused masks: those are evaluated per score).
  constexpr bool kStagedBits = C::kHasPartial && !C::kFuseMask;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Through a shuffle, so that the compiler knows it is warp-uniform (descriptors in uniform registers).
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int kv_tile = blockIdx.x, hk = blockIdx.y, batch = blockIdx.z;
  const int kv0 = kv_tile * kBc;
  const int group = p.kv_group, q_len = p.q_len, kv_len = p.kv_len;
  const int warp_row0 = warp * 16;  // this warp's first kv row within the tile (wgmma: 16 per warp)

  // ---- K and V: loaded once ----
  load_tile_async<kBc, S::kChunks, S::kThreads>(sK, p.k + batch * p.k_sb + hk * p.k_sh, p.k_sn, kv0, kv_len, threadIdx.x);
  load_tile_async<kBc, S::kChunks, S::kThreads>(sV, p.v + batch * p.v_sb + hk * p.v_sh, p.v_sn, kv0, kv_len, threadIdx.x);
  cp_async_commit();

  // Q, dO, LSE and delta of one q tile into buffer `buf`.
  const auto load_q_tile = [&](const QTile& t, int buf) {
    const int head = hk * group + t.g;
    load_tile_async<kBr, S::kChunks, S::kThreads>(sQ + buf * S::kQBytes, p.q + batch * p.q_sb + head * p.q_sh, p.q_sn,
                                                  t.q0, q_len, threadIdx.x);
    load_tile_async<kBr, S::kChunks, S::kThreads>(sdO + buf * S::kQBytes, p.dout + batch * p.do_sb + head * p.do_sh,
                                                  p.do_sn, t.q0, q_len, threadIdx.x);
    // threads 0 .. kBr / 2 - 1 (3 kBr / 4 - 1 with the units: in shared memory with LSE and delta,
    // since read from global memory where dQ is staged their latency cost 6-10 %, lab/notes/backward.md#s38)
    bwd::load_row_stats_async<kBr, kDeterministic>(sLse, sDelta, buf, p, batch, head, t.q0, tid, sUnit);
    if (kStagedBits && t.type == kPartial && tid >= S::kThreads - kBr)  // the last kBr threads: a q row each
      load_bits_async<C>(sBits + (buf * kBr + tid - (S::kThreads - kBr)) * S::kBitsRowBytes, p, t,
                         bwd::partial_index(p, batch, head, kv0, t), kv0, tid - (S::kThreads - kBr));
    cp_async_commit();
  };

  const Descs<C> d(sK, sQ, warpgroup);
  // dS's A fragments from dSᵀ [kv][q] (ldmatrix.trans): row (lane / 16) * 8 + lane % 8, column half (lane / 8) % 2.
  const int m0 = (warp % 4) * 16;  // this warp's q rows in dQ
  const u32 ds_a = smem_u32(sdS + ((lane / 16) * 8 + lane % 8) * kLdS + ((lane / 8) % 2) * 8 + m0);
  // dQ staging: the q tile's kHeadDim / 64 tiles (dq_tiles.cuh) as 8 KB pieces of 32 rows, piece
  // 2 * column block + half (rows 32 * half ..), in order: the first half of them in Q's current
  // buffer, the rest in dO's, so that each buffer is one contiguous run of the accumulator.
  constexpr int kPieceBytes = dq_tiles::kFloats * 4 / 2;
  static_assert(2 * C::kHeadDim / dq_tiles::kCols * kPieceBytes == 2 * S::kQBytes, "Q's and dO's buffers hold a q tile's dQ");
  int buf = 0;
  const auto dq_stage_addr = [&](int piece) -> u32 {
    constexpr int kInQ = S::kQBytes / kPieceBytes;
    return (piece < kInQ ? sQ + piece * kPieceBytes : sdO + (piece - kInQ) * kPieceBytes) + buf * S::kQBytes;
  };
  const auto bh_of = [&](int head) -> i64 { return static_cast<i64>(batch) * p.num_heads + head; };
  // Who adds the staged dQ: at D = 128 each warp its own rows as soon as they are staged (no CTA
  // barrier; 3.5-6 % faster than below, and the bias variants keep their registers), elsewhere
  // thread 0 the whole q tile after a barrier (at D = 64 the per-warp adds measured 3.5-4 % slower;
  // lab/notes/backward.md#s21).
  constexpr bool kWarpReductions = C::kHeadDim >= 128;

  float acc_dk[S::kDTiles][4], acc_dv[S::kDTiles][4];
  zero_rows(acc_dk);
  zero_rows(acc_dv);
  const int kv_block = kv0 / p.kv_block_size;
  const int kv_in_block = kv0 - kv_block * p.kv_block_size;  // kv tile offset within its block
  const bool kv_tail = kv0 + kBc > kv_len;

  QTile cur = bwd::next_q_tile<C>(p, batch, hk, kv0, 0, 0, 0, false);
  if (cur.g < group) load_q_tile(cur, 0);
  while (cur.g < group) {
    // Buffer `buf` has landed for everyone (and, through the proxy fence, for wgmma), and every
    // warp is done with the previous q tile: dSᵀ is free for rewriting. The other buffer still
    // holds the previous q tile's staged dQ, which its bulk reductions may be reading: it is
    // refilled after the dSᵀ barrier below, once every reduction has read it.
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    __syncthreads();

    const int head = hk * group + cur.g;
    const int q0 = cur.q0;
    const u32 buf_off = buf * S::kQBytes;
    const float* lse_s = sLse + buf * kBr;
    const float* delta_s = sDelta + buf * kBr;

    // ---- Sᵀ = K Qᵀ, then dPᵀ = V dOᵀ behind it (kOverlapDp) ----
    float acc_s[1][kNT][4], acc_dp[1][kNT][4];
    issue_s<C>(acc_s, acc_dp, d, buf_off);

    // ---- score transform, mask, Pᵀ = exp2(Sᵀ scale_log2 - lse_log2) (bwd_common.cuh) ----
    bwd::ScoreTile<C> st;
    if constexpr (C::kFuseMask) {
      st = bwd::score_tile<C>(p, cur, batch, head, kv0);
    } else {
      st = bwd::score_tile_staged<C>(cur, kv0, sBits + buf * kBr * S::kBitsRowBytes);
    }
    u32 p_t[1][S::kQSteps][4];
    if (st.plain(kv_tail)) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float pf[4];
        const float one[4] = {1.f, 1.f, 1.f, 1.f};
        bwd::plain_probs(pf, acc_s[0][nt], lse_s, p.scale_log2, nt, (lane % 4) * 2);
        keep_p_t<C>(p_t, acc_s, nt, pf, one);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float pf[4], g[4];
        bwd::masked_probs<C, F, !C::kFuseMask>(pf, g, acc_s[0][nt], p, st, kv_tail, batch, head, q0, kv0, kv_in_block,
                                               warp_row0, lse_s, nt, lane / 4, (lane % 4) * 2);
        keep_p_t<C>(p_t, acc_s, nt, pf, g);
      }
    }

    // ---- dV += Pᵀ dO (runs while dSᵀ is computed) ----
    wgmma::fence();
    if constexpr (!S::kOverlapDp) issue_dp<C>(acc_dp, d, buf_off);
    issue_regs_rows<C::kHeadDim, S::kQSteps, T>(acc_dv, p_t[0], wgmma::advance(d.do_nmaj0, buf_off));
    wgmma::commit();

    // ---- dSᵀ = Pᵀ ∘ (dPᵀ - delta) ∘ score_mod', then dK += dSᵀ Q; dSᵀ to shared memory for dQ ----
    u32 ds_t[1][S::kQSteps][4];
    issue_dk<C>(acc_dk, ds_t, acc_dp, acc_s, delta_s, d, buf_off, lane);
    bwd::store_ds_rows<kLdS>(sdS, ds_t[0], warp_row0 + lane / 4, (lane % 4) * 2);
    // The previous q tile's reductions have had most of this one to read its staged dQ: wait for
    // them here, not at the loop top (where that wait was the kernel's largest stall, lab/notes/backward.md#s25).
    if (kWarpReductions ? lane == 0 : tid == 0) bulk_wait_read<0>();
    __syncthreads();  // dSᵀ complete: dQ contracts over the kv rows of every warp; the other buffer is free
    const QTile nxt = bwd::after_q_tile<C>(p, batch, hk, kv0, cur, false);
    if (nxt.g < group) load_q_tile(nxt, buf ^ 1);
    // dV and dK ran behind the dSᵀ stores; their register fragments are released before dQ's
    // (at D = 128 holding both through dQ costs the registers that keep bias variants spill-free).
    dk_dv_done<C>(p_t, ds_t, acc_dk, acc_dv);

    // ---- dQ += dS K: staged in the accumulator's tile layout (dq_tiles.cuh) in Q's and dO's buffers,
    // free once every warpgroup's dK and dV have read them, then added with bulk reductions: by
    // each warp for its rows (kWarpReductions), else by thread 0 for the q tile ----
    {
      u32 a_ds[S::kKvSteps][4];
#pragma unroll
      for (int kk = 0; kk < S::kKvSteps; ++kk) ldmatrix_x4_trans(a_ds[kk], ds_a + kk * 16 * kLdS * 2);
#pragma unroll
      for (int chunk = 0; chunk < S::kDqCols; chunk += S::kDqN) {
        const int col = warpgroup * S::kDqCols + chunk;  // first dQ column of this wgmma
        float acc_dq[S::kDqN / 8][4];
        issue_dq<C>(acc_dq, a_ds, d, col);
        if (chunk == 0) __syncthreads();  // every warpgroup's dK and dV wgmma are done with Q and dO
        dq_done<C>(acc_dq, a_ds);
        const int block = col / dq_tiles::kCols;
        if constexpr (kDeterministic) {
          const float* unit = sUnit + buf * kBr + m0 + lane / 4;  // this lane's dQ rows'
          stage_dq<S::kDqN / 8, true>(dq_stage_addr(2 * block + m0 / 32), acc_dq, m0 % 32 + lane / 4, (lane % 4) * 2,
                                      unit[0], unit[8]);
        } else {
          stage_dq(dq_stage_addr(2 * block + m0 / 32), acc_dq, m0 % 32 + lane / 4, (lane % 4) * 2);
        }
        if constexpr (kWarpReductions) {  // each warp adds its own 16 rows (4 KB, contiguous in both layouts)
          wgmma::fence_proxy_async();  // the staged rows (generic stores) are read by the async proxy
          __syncwarp();
          if (lane == 0) {
            reduce_dq<kDeterministic>(
                p.dq_accum + dq_tiles::tile_offset<C::kHeadDim>(bh_of(head), p.q_len_pad, q0 / kBr, block) +
                    m0 * dq_tiles::kCols,
                dq_stage_addr(2 * block + m0 / 32) + (m0 % 32) * dq_tiles::kCols * 4, 16 * dq_tiles::kCols * 4);
            bulk_commit();
          }
        }
      }
      if constexpr (!kWarpReductions) {
        wgmma::fence_proxy_async();  // the staged tiles (generic stores) are read by the async proxy
        __syncthreads();
        if (tid == 0) {
          // The q tile's column blocks are consecutive tiles: Q's buffer holds the first half of the
          // pieces, dO's the rest, each one contiguous run of the accumulator.
          constexpr int kInQ = S::kQBytes / kPieceBytes;
          float* dst = p.dq_accum + dq_tiles::tile_offset<C::kHeadDim>(bh_of(head), p.q_len_pad, q0 / kBr, 0);
          reduce_dq<kDeterministic>(dst, dq_stage_addr(0), S::kQBytes);
          reduce_dq<kDeterministic>(dst + S::kQBytes / 4, dq_stage_addr(kInQ), S::kQBytes);
          bulk_commit();
        }
      }
    }
    cur = nxt;
    buf ^= 1;
  }
  cp_async_wait<0>();  // a kv tile that no q tile sees still has K and V in flight
  if (kWarpReductions ? lane == 0 : tid == 0) bulk_wait<0>();  // the last q tile's dQ reductions, before the CTA's shared memory goes

  // ---- epilogue: dK (scaled) and dV, zeros for kv rows that no query sees ----
  // Unpadded head dims only (dispatch/variant.py): every column is real. Staged in Q's and dO's
  // buffers once every warp is past its last products and the last dQ reductions have read them.
  __syncthreads();
  store_dk_dv_staged<C, T>(p, batch, hk, kv0, warp_row0, acc_dk, acc_dv, sQ, sdO, lane);
}

}  // namespace bwd_wgmma
}  // namespace omni
