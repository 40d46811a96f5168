// Row kernels of the backward pass: each query row read by a group of lanes, one 16-byte chunk
// of o and dout per lane, several rows per warp where a row has fewer than 32 chunks.
//
//   preprocess_rows: delta = rowsum(dO * O) in fp32, the LSE once in log2 units (+inf for rows
//                    with no allowed key and for padded rows, so that exp2(s - lse) is exactly 0
//                    there), and the row of the fp32 dQ accumulator zeroed.
//   convert_dq:      dq = scale * dq_accum in the input dtype.
//
// kTiledDq: the accumulator in the wgmma backward's tiles (dq_tiles.cuh), else in rows
// [bh][q_len][kHeadDim] (the mma.sync backward's).
//
// Plain CUDA templated on the head dim, the 16-bit type (Fp16/Bf16, mma.cuh) and the parameter
// struct P (rendered from dispatch/params.py BACKWARD); grid (row blocks, Hq, B).
#pragma once
#include "dq_tiles.cuh"
#include "mma.cuh"

namespace omni {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRowWarps = 8;  // warps per CTA of the row kernels (dispatch/variant.py BWD_ROW_WARPS)

// How a warp covers rows of kHeadDimValid columns: kLanes lanes per row (its 16-byte chunks rounded
// up to a power of two), kRowsPerWarp rows. With one warp per row, D = 64 kept 8 of 32 lanes busy
// and both kernels ran at a third of the DRAM bandwidth (NOTES.md §27). Mirrored by
// omnicupy/dispatch/variant.py row_kernel_rows (the templates static_assert that they agree).
template <int kHeadDimValid>
struct RowShape {
  static constexpr int kChunks = kHeadDimValid / 8;  // 16-byte chunks of a row of o, dout and dq
  static constexpr int kLanes = kChunks <= 1 ? 1 : kChunks <= 2 ? 2 : kChunks <= 4 ? 4 : kChunks <= 8 ? 8
                                : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kRowsPerCta = kRowWarps * kRowsPerWarp;
  static_assert(kChunks <= 32, "one lane group reads a row in one pass");
};

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }

// Sum of a[i] * b[i] over the eight 16-bit values of two 16-byte chunks.
template <typename T>
__device__ __forceinline__ float dot8(const Vec16& a, const Vec16& b) {
  const u32 wa[4] = {a.x, a.y, a.z, a.w};
  const u32 wb[4] = {b.x, b.y, b.z, b.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = fmaf(T::to_float(static_cast<u16>(wa[i] & 0xffffu)), T::to_float(static_cast<u16>(wb[i] & 0xffffu)), s);
    s = fmaf(T::to_float(static_cast<u16>(wa[i] >> 16)), T::to_float(static_cast<u16>(wb[i] >> 16)), s);
  }
  return s;
}

// kHeadDim: the tile's columns (the dQ accumulator's row stride); kHeadDimValid: the caller's (rows
// of o, dout and dq), smaller in a padded variant.
template <int kHeadDim, typename T, int kHeadDimValid = kHeadDim, bool kTiledDq = false, typename P>
__device__ __forceinline__ void preprocess_rows(const P& p) {
  using R = RowShape<kHeadDimValid>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int l = lane % R::kLanes;  // this lane's chunk of its row
  const int row = blockIdx.x * R::kRowsPerCta + warp * R::kRowsPerWarp + lane / R::kLanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  // No early return: every lane takes part in the shuffles below (a warp's rows may straddle q_len_pad).
  const bool in_workspace = row < p.q_len_pad;  // real or padding rows of the q_len_pad
  const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
  const bool real = row < p.q_len;
  float dot = 0.f;
  if (real && l < R::kChunks) {
    const Vec16 o = *reinterpret_cast<const Vec16*>(p.o + batch * p.o_sb + head * p.o_sh + row * p.o_sn + l * 8);
    const Vec16 d = *reinterpret_cast<const Vec16*>(p.dout + batch * p.do_sb + head * p.do_sh + row * p.do_sn + l * 8);
    dot = dot8<T>(o, d);
  }
#pragma unroll
  for (int m = R::kLanes / 2; m >= 1; m /= 2) dot += shfl_xor(dot, m);  // within the row's lane group
  if (!in_workspace) return;
  if (l == 0) {
    const float lse = real ? p.lse[bh * p.q_len + row] : neg_inf();
    p.lse_log2[bh * p.q_len_pad + row] = lse == neg_inf() ? pos_inf() : lse * kLog2e;
    p.delta[bh * p.q_len_pad + row] = real ? dot : 0.f;
  }
  if constexpr (kTiledDq) {  // every row of the q_len_pad (the tail tile's padding rows are added into too)
    const int tile = row / dq_tiles::kRows, r = row % dq_tiles::kRows;
    for (int c = l; c < kHeadDim / 4; c += R::kLanes) {  // a row's 256 bytes per column block, in any order
      const int block = c / (dq_tiles::kCols / 4), chunk = c % (dq_tiles::kCols / 4);
      float* at = p.dq_accum + dq_tiles::tile_offset<kHeadDim>(bh, p.q_len_pad, tile, block) + r * dq_tiles::kCols;
      reinterpret_cast<Vec16*>(at)[chunk] = Vec16{0u, 0u, 0u, 0u};
    }
  } else if (real) {
    Vec16* acc = reinterpret_cast<Vec16*>(p.dq_accum + (bh * p.q_len + row) * kHeadDim);
    for (int c = l; c < kHeadDim / 4; c += R::kLanes) acc[c] = Vec16{0u, 0u, 0u, 0u};
  }
}

template <int kHeadDim, typename T, int kHeadDimValid = kHeadDim, bool kTiledDq = false, typename P>
__device__ __forceinline__ void convert_dq(const P& p) {
  using R = RowShape<kHeadDimValid>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int l = lane % R::kLanes;  // this lane's chunk of its row
  const int row = blockIdx.x * R::kRowsPerCta + warp * R::kRowsPerWarp + lane / R::kLanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.q_len || l >= R::kChunks) return;
  const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
  Vec16 a, b;  // columns l * 8 .. + 7
  if constexpr (kTiledDq) {
    const int r = row % dq_tiles::kRows, col = l * 8 % dq_tiles::kCols;
    const float* tile = p.dq_accum + dq_tiles::tile_offset<kHeadDim>(bh, p.q_len_pad, row / dq_tiles::kRows,
                                                                      l * 8 / dq_tiles::kCols);
    a = *reinterpret_cast<const Vec16*>(tile + dq_tiles::within(r, col));
    b = *reinterpret_cast<const Vec16*>(tile + dq_tiles::within(r, col + 4));
  } else {
    const Vec16* src = reinterpret_cast<const Vec16*>(p.dq_accum + (bh * p.q_len + row) * kHeadDim + l * 8);
    a = src[0];
    b = src[1];
  }
  const float s = p.scale;
  Vec16 out;
  out.x = T::pack(__uint_as_float(a.x) * s, __uint_as_float(a.y) * s);
  out.y = T::pack(__uint_as_float(a.z) * s, __uint_as_float(a.w) * s);
  out.z = T::pack(__uint_as_float(b.x) * s, __uint_as_float(b.y) * s);
  out.w = T::pack(__uint_as_float(b.z) * s, __uint_as_float(b.w) * s);
  *reinterpret_cast<Vec16*>(p.dq + batch * p.dq_sb + head * p.dq_sh + row * p.dq_sn + l * 8) = out;
}

}  // namespace bwd
}  // namespace omni
