// Row kernels of the backward pass: each query row read by a group of lanes, one 16-byte chunk
// of o and dout per lane, several rows per warp where a row has fewer than 32 chunks.
//
//   preprocess_rows: delta = rowsum(dO * O) in fp32, the LSE once in log2 units (+inf for rows
//                    with no allowed key and for padded rows, so that exp2(s - lse) is exactly 0
//                    there), and the row of the fp32 dQ accumulator zeroed.
//   convert_dq:      dq = scale * dq_accum in the input dtype.
//   kv_bounds:       max |K| and max |V_j| per (batch, kv head), for the fixed-point dQ below.
//
// Fixed-point dQ (deterministic=True in both families; p.dq_unit set): the kv tiles add their
// dQ contributions as 32-bit integers, round(c * unit_i) for row i, and integer adds give the same
// sum in any order, so no kv tile waits for another (the ordered fp32 adds they replace cost
// 1.2-2x the default's time: lab/notes/backward.md#s38). unit_i = 2^x is chosen per row so that no partial sum
// can leave the int32 range:
//   |dQ_i[d]| <= sum_j |dS_ij| |K_j[d]| <= (|dO_i| max_j |V_j| + |delta_i|) max_j,d |K_j[d]| sum_j P_ij
// (|dP_ij| = |dO_i . V_j| <= |dO_i| |V_j|; dS_ij = P_ij (dP_ij - delta_i) times a score modifier's
// derivative, which dispatch admits here only where it is at most 1 in size; sum_j P_ij = 1 for the
// forward's LSE). The bound sits below 2^30, so the other half of the range absorbs the rounding of
// each contribution and of P. Rows whose bound is not finite (inf or NaN inputs) get a NaN unit and
// a NaN dQ row, as the fp32 sum would.
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
// and both kernels ran at a third of the DRAM bandwidth (lab/notes/backward.md#s27). Mirrored by
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

// Where a lane of a row kernel works (grid (blocks of R::kRowsPerCta rows, Hq, B)): chunk l of row
// `row` of (batch, head), its lane group's row.
template <class R>
struct RowLane {
  int l, row, head, batch;
  __device__ __forceinline__ RowLane() {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    l = lane % R::kLanes;  // this lane's chunk of its row
    row = blockIdx.x * R::kRowsPerCta + warp * R::kRowsPerWarp + lane / R::kLanes;
    head = blockIdx.y;
    batch = blockIdx.z;
  }
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

// NaN-propagating max of non-negative values (fmaxf drops a NaN; the bound must keep it).
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (b > a || b != b) ? b : a; }

// Largest |x| over the eight 16-bit values of a chunk.
template <typename T>
__device__ __forceinline__ float abs_max8(const Vec16& a) {
  const u32 w[4] = {a.x, a.y, a.z, a.w};
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = max_keep_nan(m, fabsf(T::to_float(static_cast<u16>(w[i] & 0xffffu))));
    m = max_keep_nan(m, fabsf(T::to_float(static_cast<u16>(w[i] >> 16))));
  }
  return m;
}

// unit_i = 2^x for a row whose dQ is bounded by `bound` (above): bound * unit_i < 2^30. Built from
// the bits, exactly; x clamped to the normal range, so 1 / unit_i is a float too (dq_unit_inverse).
__device__ __forceinline__ float dq_unit_for(float bound) {
  if (!(bound <= 3.402823466e38f)) return __int_as_float(0x7fffffff);  // inf or NaN: a NaN unit
  const int e = static_cast<int>((__float_as_uint(bound) >> 23) & 0xffu) - 126;  // bound < 2^e
  const int x = min(126, max(-126, 30 - e));
  return __int_as_float((127 + x) << 23);
}
__device__ __forceinline__ float dq_unit_inverse(float unit) {
  return unit != unit ? unit : __int_as_float(0x7f000000 - __float_as_int(unit));  // 2^-x
}

// Rows of K and V one CTA of kv_bounds reads (a multiple of every RowShape's kRowsPerCta).
constexpr int kBoundRows = 256;

// (max |K|, max |V_j|^2) of (batch, kv head hk) in p.kv_bound.
template <typename P>
__device__ __forceinline__ float* kv_bound_of(const P& p, int batch, int hk) {
  return p.kv_bound + 2 * (static_cast<i64>(batch) * (p.num_heads / p.kv_group) + hk);
}

// grid (cdiv(kv_len, kBoundRows), Hkv, B). p.kv_bound[b, hk] = (max |K|, max |V_j|^2) over the
// kv_len rows, by atomicMax on the floats' bits (non-negative floats order as their bits, and a
// NaN above every number); the host zeroes it first.
template <int kHeadDimValid, typename T, typename P>
__device__ __forceinline__ void kv_bounds(const P& p) {
  using R = RowShape<kHeadDimValid>;
  static_assert(kBoundRows % R::kRowsPerCta == 0, "every warp takes the same number of rows");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int l = lane % R::kLanes;
  const int hk = blockIdx.y, batch = blockIdx.z;
  float k_max = 0.f, v_max = 0.f;
  for (int r = warp * R::kRowsPerWarp + lane / R::kLanes; r < kBoundRows; r += R::kRowsPerCta) {
    const int row = blockIdx.x * kBoundRows + r;
    float v_sq = 0.f;
    if (row < p.kv_len && l < R::kChunks) {
      const Vec16 k = *reinterpret_cast<const Vec16*>(p.k + batch * p.k_sb + hk * p.k_sh + row * p.k_sn + l * 8);
      const Vec16 v = *reinterpret_cast<const Vec16*>(p.v + batch * p.v_sb + hk * p.v_sh + row * p.v_sn + l * 8);
      k_max = max_keep_nan(k_max, abs_max8<T>(k));
      v_sq = dot8<T>(v, v);
    }
#pragma unroll
    for (int m = R::kLanes / 2; m >= 1; m /= 2) v_sq += shfl_xor(v_sq, m);  // the row's |V_j|^2
    v_max = max_keep_nan(v_max, v_sq);
  }
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) {
    k_max = max_keep_nan(k_max, shfl_xor(k_max, m));
    v_max = max_keep_nan(v_max, shfl_xor(v_max, m));
  }
  __shared__ float warp_max[2][kRowWarps];
  if (lane == 0) {
    warp_max[0][warp] = k_max;
    warp_max[1][warp] = v_max;
  }
  __syncthreads();
  if (threadIdx.x < 2) {
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kRowWarps; ++w) m = max_keep_nan(m, warp_max[threadIdx.x][w]);
    atomicMax(reinterpret_cast<unsigned*>(kv_bound_of(p, batch, hk)) + threadIdx.x, __float_as_uint(m));
  }
}

// kHeadDim: the tile's columns (the dQ accumulator's row stride); kHeadDimValid: the caller's (rows
// of o, dout and dq), smaller in a padded variant.
template <int kHeadDim, typename T, int kHeadDimValid = kHeadDim, bool kTiledDq = false, typename P>
__device__ __forceinline__ void preprocess_rows(const P& p) {
  using R = RowShape<kHeadDimValid>;
  const RowLane<R> at;
  const int l = at.l, row = at.row, head = at.head, batch = at.batch;
  // No early return: every lane takes part in the shuffles below (a warp's rows may straddle q_len_pad).
  const bool in_workspace = row < p.q_len_pad;  // real or padding rows of the q_len_pad
  const i64 bh = static_cast<i64>(batch) * p.num_heads + head;
  const bool real = row < p.q_len;
  const bool fixed_point = p.dq_unit != nullptr;  // the deterministic backward (above)
  float dot = 0.f, do_sq = 0.f;
  if (real && l < R::kChunks) {
    const Vec16 o = *reinterpret_cast<const Vec16*>(p.o + batch * p.o_sb + head * p.o_sh + row * p.o_sn + l * 8);
    const Vec16 d = *reinterpret_cast<const Vec16*>(p.dout + batch * p.do_sb + head * p.do_sh + row * p.do_sn + l * 8);
    dot = dot8<T>(o, d);
    if (fixed_point) do_sq = dot8<T>(d, d);
  }
#pragma unroll
  for (int m = R::kLanes / 2; m >= 1; m /= 2) dot += shfl_xor(dot, m);  // within the row's lane group
  if (fixed_point) {
#pragma unroll
    for (int m = R::kLanes / 2; m >= 1; m /= 2) do_sq += shfl_xor(do_sq, m);
  }
  if (!in_workspace) return;
  if (l == 0) {
    const float lse = real ? p.lse[bh * p.q_len + row] : neg_inf();
    p.lse_log2[bh * p.q_len_pad + row] = lse == neg_inf() ? pos_inf() : lse * kLog2e;
    p.delta[bh * p.q_len_pad + row] = real ? dot : 0.f;
    if (fixed_point) {
      const float* kv = kv_bound_of(p, batch, head / p.kv_group);
      const float k_max = kv[0], v_max = sqrtf(kv[1]);
      const float bound = (sqrtf(do_sq) * v_max + fabsf(dot)) * k_max;
      p.dq_unit[bh * p.q_len_pad + row] = dq_unit_for(real ? bound : 0.f);
    }
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
  const RowLane<R> at;
  const int l = at.l, row = at.row, head = at.head, batch = at.batch;
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
  float s = p.scale;
  if (p.dq_unit != nullptr) {  // fixed point (above): the int32 sums, scaled by 1 / unit
    s *= dq_unit_inverse(p.dq_unit[bh * p.q_len_pad + row]);
    const auto int_to_float = [](u32 w) { return __float_as_uint(static_cast<float>(static_cast<int>(w))); };
    a = Vec16{int_to_float(a.x), int_to_float(a.y), int_to_float(a.z), int_to_float(a.w)};
    b = Vec16{int_to_float(b.x), int_to_float(b.y), int_to_float(b.z), int_to_float(b.w)};
  }
  Vec16 out;
  out.x = T::pack(__uint_as_float(a.x) * s, __uint_as_float(a.y) * s);
  out.y = T::pack(__uint_as_float(a.z) * s, __uint_as_float(a.w) * s);
  out.z = T::pack(__uint_as_float(b.x) * s, __uint_as_float(b.y) * s);
  out.w = T::pack(__uint_as_float(b.z) * s, __uint_as_float(b.w) * s);
  *reinterpret_cast<Vec16*>(p.dq + batch * p.dq_sb + head * p.dq_sh + row * p.dq_sn + l * 8) = out;
}

}  // namespace bwd
}  // namespace omni
