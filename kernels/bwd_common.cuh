// What the two backward kernels share: kernels/bwd_kv_tile.cuh (mma.sync) and kernels/bwd_wgmma.cuh
// (wgmma) run the same FlashAttention-2 decomposition, one CTA per kv tile walking the q tiles that
// attend to it, and both hold Sᵀ, dPᵀ and dQ in the m16n8 accumulator layout (lane l: rows l/4 and
// l/4 + 8, columns 2(l%4) and 2(l%4) + 1 of each 16x8 tile; Sᵀ's rows are kv positions, its
// columns q positions). So the code that does not touch an MMA lives here, once:
//
//   the q-tile walk          QTile, next_q_tile (the transposed block index), after_q_tile
//   per-q-tile loads         load_row_stats_async (LSE, delta and fixed-point unit rows into shared memory)
//   Pᵀ from Sᵀ               ScoreTile, score_tile (or score_tile_staged: PARTIAL bits in
//                            shared memory, partial_index their pool block), plain_probs,
//                            masked_probs (scale, score modifier and its derivative, causal /
//                            partial / kv-tail masking)
//   fragments                store_ds_rows (dSᵀ to shared memory for dQ; zero and pack_a are in
//                            mma_tiles.cuh, shared with the decode)
//   dQ                       the mma.sync kernel's adds: red_add2, add_dq_rows (fp32 or int32
//                            fixed point); its ordered mode: dq_semaphore, load_acquire /
//                            store_release, wait_dq_turn, pass_dq_turn (the wgmma kernel stages dQ
//                            and adds it with bulk reductions of its own, kernels/dq_tiles.cuh)
//   epilogue                 store_dk_dv_rows (dK scaled, dV; padding columns skipped)
//
// Each helper works on explicit arguments (one warp's m16 tile of kv rows, or the CTA's q tile)
// and knows no warp layout or MMA instruction: those stay in the kernels. A lane's place in a 16x8
// tile comes in as lane_row = lane / 4 and lane_col = (lane % 4) * 2, and where a helper takes a
// row already offset by lane_row (store_ds_rows, add_dq_rows) or a split column (add_dq_rows'
// col as an i64 sum), that is the shape the kernels' inline code had: computed inside from other
// arguments, the compiler orders and hoists the adds differently and ptxas emits other code. As
// written, every backward cubin is byte-identical to the one the inline code gave; a change here
// wants the same check (sha256 of the rendered variants' cubins before and after).
//
// Templated on the configuration C only where its constants decide (kBr, kBc, kHasCausal,
// kHasPartial, kFuseMask, kTransformScores), on the per-score functions F and the parameter struct
// P (dispatch/params.py BACKWARD). The including template declares the BlockType enum (kMasked,
// kCausal, kFull, kPartial) first.
#pragma once
#include "mma_tiles.cuh"

namespace omni {
namespace bwd {

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

// The q tile after `cur`: the next tile of the same q block where there is one, with no loads (a
// step of the walk above is a chain of dependent global loads, which every warp of the mma.sync
// kernel waits for at each q tile, lab/notes/backward.md#s40), else the walk.
template <class C, class P>
__device__ __forceinline__ QTile after_q_tile(const P& p, int batch, int hk, int kv0, const QTile& cur,
                                              bool deterministic) {
  const int q0 = cur.q0 + C::kBr;
  const bool skipped = C::kHasCausal && !deterministic && cur.type == kCausal && q0 + C::kBr - 1 < kv0;
  if (cur.tile + 1 < p.q_block_size / C::kBr && q0 < p.q_len && !skipped)
    return QTile{cur.g, cur.slot, cur.tile + 1, q0, cur.type, cur.q_block};
  return next_q_tile<C>(p, batch, hk, kv0, cur.g, cur.slot, cur.tile + 1, deterministic);
}

// The pool index of PARTIAL q tile t's block (of head `head`, kv tile at kv0).
template <class P>
__device__ __forceinline__ int partial_index(const P& p, int batch, int head, int kv0, const QTile& t) {
  const i64 row = batch * p.t_row_sb + head * p.t_row_sh + kv0 / p.kv_block_size;
  return __ldg(p.q_partial_index + row * p.t_width + t.slot);
}

// ---------------------------------------------------------------- LSE and delta of one q tile
// The kBr LSE (log2 units) and delta values of q rows q0.. into buffer `buf` of sLse / sDelta
// (shared, [stages][kBr] each), one 16-byte cp.async per thread: threads 0 .. kBr/4 - 1 copy the
// LSE, the next kBr/4 delta (the kernels' Shape asserts kThreads >= kBr / 2), and with kUnits the
// next kBr/4 the rows' fixed-point dQ units into sUnit (the wgmma kernels' deterministic mode,
// bwd_rows.cuh; kThreads >= 3 kBr / 4). The row vectors are padded to whole q tiles (q_len_pad): no
// bounds to check. The caller commits the group. (buf, not the buffer's address: the offset is
// taken inside each branch, as in the kernels' inline code.)
template <int kBr, bool kUnits = false, class P>
__device__ __forceinline__ void load_row_stats_async(float* sLse, float* sDelta, int buf, const P& p, int batch,
                                                     int head, int q0, int tid, float* sUnit = nullptr) {
  const i64 row = (static_cast<i64>(batch) * p.num_heads + head) * p.q_len_pad + q0;
  if (tid < kBr / 4) {
    cp_async_16(smem_u32(sLse + buf * kBr + tid * 4), p.lse_log2 + row + tid * 4, true);
  } else if (tid < kBr / 2) {
    const int c = tid - kBr / 4;
    cp_async_16(smem_u32(sDelta + buf * kBr + c * 4), p.delta + row + c * 4, true);
  } else if (kUnits && tid < 3 * kBr / 4) {
    const int c = tid - kBr / 2;
    cp_async_16(smem_u32(sUnit + buf * kBr + c * 4), p.dq_unit + row + c * 4, true);
  }
}

// ---------------------------------------------------------------- Pᵀ from Sᵀ
// What the per-score code needs to know about the current (q tile, kv tile) pair.
template <class C>
struct ScoreTile {
  bool causal_cut;  // a CAUSAL q tile that the diagonal crosses: q < kv is masked
  bool partial;     // a PARTIAL block: masked by its bits or by F::mask
  const u32* bits;  // PARTIAL bits (not fused): q row q_local of the tile at bits + q_local * words
  int words;        // 32-bit words per q row of a partial mask (kv_block_size / 32)
  u32 staged;       // or, staged in shared memory by the wgmma kernels' loads: q row q_local's
                    // kBc / 32 words over the kv tile at shared address staged + q_local * kBc / 8

  // Nothing to mask or transform: P straight from the raw scores (plain_probs). kv_tail: the kv
  // tile runs past kv_len (its rows there are masked). Spelled as one disjunction: with the flags
  // in this struct, !partial && !causal_cut && !kv_tail compiles to another predicate (xor).
  __device__ __forceinline__ bool plain(bool kv_tail) const {
    return !C::kTransformScores && !(partial || causal_cut || kv_tail);
  }
};

template <class C, class P>
__device__ __forceinline__ ScoreTile<C> score_tile(const P& p, const QTile& t, int batch, int head, int kv0) {
  ScoreTile<C> st;
  st.causal_cut = C::kHasCausal && t.type == kCausal && t.q0 < kv0 + C::kBc - 1;
  st.partial = C::kHasPartial && t.type == kPartial;
  st.bits = nullptr;
  st.words = 0;
  st.staged = 0;
  if (!C::kFuseMask && st.partial) {
    const int pidx = partial_index(p, batch, head, kv0, t);
    st.words = p.kv_block_size / 32;
    st.bits =
        p.partial_masks + (static_cast<i64>(pidx) * p.q_block_size + (t.q0 - t.q_block * p.q_block_size)) * st.words;
  }
  return st;
}

// The same for a kernel that staged a PARTIAL tile's bits in shared memory with its Q tile
// (`staged`: kBr rows of kBc / 32 words, the kv tile's), read by masked_probs<C, F, true>.
template <class C>
__device__ __forceinline__ ScoreTile<C> score_tile_staged(const QTile& t, int kv0, u32 staged) {
  static_assert(C::kBc % 64 == 0 && !C::kFuseMask, "whole 8-byte rows of bits, not fused");
  ScoreTile<C> st;
  st.causal_cut = C::kHasCausal && t.type == kCausal && t.q0 < kv0 + C::kBc - 1;
  st.partial = C::kHasPartial && t.type == kPartial;
  st.bits = nullptr;
  st.words = C::kBc / 32;
  st.staged = staged;
  return st;
}

// Pᵀ of one 16x8 accumulator tile (n8 tile nt of the q tile) when st.plain(): exp2(Sᵀ scale_log2 -
// lse_log2). lse_s: the q tile's LSE in shared memory; lane_col: (lane % 4) * 2. pf may be s (in
// place).
__device__ __forceinline__ void plain_probs(float (&pf)[4], const float (&s)[4], const float* lse_s, float scale_log2,
                                            int nt, int lane_col) {
#pragma unroll
  for (int i = 0; i < 4; ++i) pf[i] = exp2_approx(fmaf(s[i], scale_log2, -lse_s[nt * 8 + lane_col + (i % 2)]));
}

// Pᵀ of one 16x8 accumulator tile in general: kv rows row0 .. row0 + 15 of the kv tile (one warp's
// m16 tile), q columns nt * 8 .. of the q tile at q0. Scores are transformed (F::transform: scale,
// bias, modifier; g its derivative, 0 where not transformed) and masked (kv tail, PARTIAL bits or
// F::mask, the causal cut); a masked score and a row with no allowed key (lse_log2 = +inf) give
// exactly 0. kv_in_block: the kv tile's offset within its kv block; lane_row, lane_col: lane / 4,
// (lane % 4) * 2. pf may be s (in place: each score is read before its probability is written).
template <class C, class F, bool kStagedBits = false, class P>
__device__ __forceinline__ void masked_probs(float (&pf)[4], float (&g)[4], const float (&s)[4], const P& p,
                                             const ScoreTile<C>& st, bool kv_tail, int batch, int head, int q0, int kv0,
                                             int kv_in_block, int row0, const float* lse_s, int nt, int lane_row,
                                             int lane_col) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // j: column 2(l%4) + j; i = j (row l/4) and j + 2 (row l/4 + 8)
    const int q_local = nt * 8 + lane_col + j;
    const int q = q0 + q_local;
    const float lse2 = lse_s[q_local];
    u32 word = 0;
    // The 16 kv rows of an m16 tile start 16-aligned within the block: one word holds them.
    const int kv_bit0 = kv_in_block + row0;  // bit of the tile's first kv row
    if (!C::kFuseMask && st.partial) {
      if (kStagedBits) {  // the kv tile starts a group of kBc / 32 words: its word is (kv_bit0 / 32) % that
        constexpr int kWords = C::kBc / 32;
        // Spelled q_local * (kWords * 4) + ...: the same sum as (q_local * kWords + ...) * 4 spilled
        // 160 bytes instead of 56 in the warp-specialized kernel (lab/notes/backward.md#s32).
        const u32 at = st.staged + q_local * (kWords * 4) + ((kv_bit0 / 32) % kWords) * 4;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(word) : "r"(at));
      } else {
        word = __ldg(st.bits + q_local * st.words + kv_bit0 / 32);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = j + 2 * half;
      const int kv = kv0 + (row0 + lane_row + half * 8);
      float x = s[i];
      g[i] = 0.f;
      if (C::kTransformScores && q < p.q_len && kv < p.kv_len) x = F::transform(x, batch, head, q, kv, p, g[i]);
      bool ok = !kv_tail || kv < p.kv_len;
      if (st.partial) {
        if (C::kFuseMask) {
          ok = ok && q < p.q_len && F::mask(batch, head, q, kv, p);
        } else {
          ok = ok && ((word >> (kv_bit0 % 32 + lane_row + half * 8)) & 1u) != 0;
        }
      } else if (st.causal_cut) {
        ok = ok && q >= kv;
      }
      pf[i] = ok ? exp2_approx(fmaf(x, p.scale_log2, -lse2)) : 0.f;
    }
  }
}

// ---------------------------------------------------------------- fragments
// dSᵀ of one m16 tile (packed A fragments, kSteps k16 steps of q columns) into sdS [kv row][q]
// (row stride kLdS): dQ = dS K contracts over kv rows of every warp, so it reads dSᵀ back from
// shared memory (ldmatrix.trans). row, col: this lane's first row and column, row0 + lane_row and
// lane_col for the m16 tile at row0.
template <int kLdS, int kSteps>
__device__ __forceinline__ void store_ds_rows(u16* sdS, const u32 (&a)[kSteps][4], int row, int col) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    u16* r = sdS + row * kLdS + kk * 16 + col;
    *reinterpret_cast<u32*>(r) = a[kk][0];
    *reinterpret_cast<u32*>(r + 8 * kLdS) = a[kk][1];
    *reinterpret_cast<u32*>(r + 8) = a[kk][2];
    *reinterpret_cast<u32*>(r + 8 * kLdS + 8) = a[kk][3];
  }
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

// Deterministic dQ adds each q tile's kv tiles in a fixed order (ops/backward_index.py, ranks):
// the semaphore of q tile t (of head bh = batch * num_heads + head) and column pass `pass` of
// kPasses counts the kv tiles that have added; `turn` is this kv tile's place in that order (its
// kv block's rank in the q row, less the tiles of the block before it).
template <int kBr, int kBc, int kPasses, class P>
__device__ __forceinline__ int* dq_semaphore(const P& p, int batch, int head, i64 bh, int kv_block, int kv_in_block,
                                             const QTile& t, int pass, int& turn) {
  const i64 row = batch * p.t_row_sb + head * p.t_row_sh + kv_block;
  turn = __ldg(p.q_rank + row * p.t_width + t.slot) - kv_in_block / kBc;
  return p.dq_semaphore + ((bh * (p.q_len_pad / kBr) + t.q0 / kBr) * kPasses + pass);
}

// Wait for the kv tiles before this one (thread 0 spins; the barrier holds the others).
__device__ __forceinline__ void wait_dq_turn(const int* sem, int turn, int tid) {
  if (tid == 0) {
    while (load_acquire(sem) != turn) {
    }
  }
  __syncthreads();
}

// Hand the q tile to the next kv tile once every thread's reductions are visible. The barrier
// orders every thread's reductions before thread 0's release, and a gpu-scope release is
// cumulative (PTX memory model): one fence in one thread, not a fence in each of them.
__device__ __forceinline__ void pass_dq_turn(int* sem, int turn, int tid) {
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    store_release(sem, turn + 1);
  }
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

// One m16 tile of dQ (accumulators of kTiles n8 tiles) added into the workspace (rows of kHeadDim,
// head bh): this lane's rows q0 + row and q0 + row + 8 (row: the tile's first row within the q tile
// plus lane_row), columns col + lane_col ..; rows at or past q_len are skipped. fp32 adds, or with
// kFixedPoint int32 ones of round(acc * unit) (the mma.sync kernel's deterministic mode,
// bwd_rows.cuh; `units`: rows row and row + 8; no vector form for integers: two per pair; cvt.rni
// saturates, never wraps).
template <int kHeadDim, bool kFixedPoint = false, int kTiles, class P>
__device__ __forceinline__ void add_dq_rows(const P& p, i64 bh, int q0, int row, i64 col, const float (&acc)[kTiles][4],
                                            int lane_col, const float* units = nullptr) {
  float unit[2] = {0.f, 0.f};
  if constexpr (kFixedPoint) unit[0] = units[0], unit[1] = units[8];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int q = q0 + row + half * 8;
    if (q >= p.q_len) continue;
    float* dst = p.dq_accum + (bh * p.q_len + q) * kHeadDim + col + lane_col;
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt) {
      if constexpr (kFixedPoint) {
        int* fixed = reinterpret_cast<int*>(dst + dt * 8);
        atomicAdd(fixed, __float2int_rn(acc[dt][2 * half] * unit[half]));
        atomicAdd(fixed + 1, __float2int_rn(acc[dt][2 * half + 1] * unit[half]));
      } else {
        red_add2(dst + dt * 8, acc[dt][2 * half], acc[dt][2 * half + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------- epilogue
// dK (times scale) and dV of one m16 tile (kv rows kv_first .. kv_first + 15 of kv head hk,
// columns col0 .. of kTiles n8 tiles; lane_row, lane_col: lane / 4, (lane % 4) * 2); rows at or
// past kv_len are skipped, and so are the columns at or past kHeadDimValid (a padded head dim: the
// caller's rows end there).
template <int kTiles, int kHeadDim, int kHeadDimValid, typename T, class P>
__device__ __forceinline__ void store_dk_dv_rows(const P& p, int batch, int hk, int kv_first, int col0,
                                                 const float (&dk)[kTiles][4], const float (&dv)[kTiles][4],
                                                 int lane_row, int lane_col) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int kv = kv_first + lane_row + half * 8;
    if (kv >= p.kv_len) continue;
    u16* dk_row = p.dk + batch * p.dk_sb + hk * p.dk_sh + kv * p.dk_sn + col0 + lane_col;
    u16* dv_row = p.dv + batch * p.dv_sb + hk * p.dv_sh + kv * p.dv_sn + col0 + lane_col;
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt) {
      if (kHeadDimValid == kHeadDim || col0 + dt * 8 < kHeadDimValid) {  // not a padding column
        *reinterpret_cast<u32*>(dk_row + dt * 8) = T::pack(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
        *reinterpret_cast<u32*>(dv_row + dt * 8) = T::pack(dv[dt][2 * half], dv[dt][2 * half + 1]);
      }
    }
  }
}

}  // namespace bwd
}  // namespace omni
