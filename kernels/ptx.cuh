// PTX wrappers shared by every omnicupy kernel: async copies, bulk reductions, ldmatrix, smem
// addressing, ex2.
// Plain CUDA with no CUDA headers, so NVRTC needs no include path beyond this folder.
#pragma once

namespace omni {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// 16 bytes, for vectorised shared <-> global copies.
struct __align__(16) Vec16 {
  u32 x, y, z, w;
};

// Generic pointer -> 32-bit shared-state-space address, as cp.async and ldmatrix want it.
__device__ __forceinline__ u32 smem_u32(const void* ptr) {
  u32 addr;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
  return addr;
}

// ---- cp.async (sm_80+): global -> shared, 16 bytes, bypassing L1 --------------------------
// When `valid` is false the source size is 0: nothing is read and the 16 bytes are zero-filled,
// which is how tails past the end of a sequence become zeros in shared memory.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// 8 bytes (through L1: .cg takes 16 only), always valid.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}

// The same copy with a 128-byte L2 prefetch hint (.L2::128B): a miss brings in the copy's whole
// 128-byte line at once, so a warp's 16-byte requests over consecutive rows reach DRAM as whole
// lines. For streams read once (the decode's K and V): +2-3 % of K+V bandwidth on the H200 over
// the plain copy, and 1-2 % over .L2::256B (lab/notes/sessions.md#s20). A hint: it never faults, whatever the
// line holds beyond the 16 bytes.
__device__ __forceinline__ void cp_async_16_stream(u32 dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// ---- bulk reductions (sm_90): shared -> global, performed by the async proxy ------------------
// dst[i] += src[i] over `bytes` (a multiple of 16; both addresses 16-byte aligned) in fp32 at L2.
// The issuing thread tracks them in bulk groups: commit, then wait until the groups' reads of
// shared memory are done (before that memory is rewritten) or until they are complete.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
// The same in 32-bit two's complement (the deterministic backward's fixed-point dQ, bwd_rows.cuh):
// integer adds, so the sum is the same whatever order they land in.
__device__ __forceinline__ void bulk_reduce_add_s32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix: four 8x8 b16 matrices; lane l supplies the row address of matrix l/8 ----------
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- fast math ---------------------------------------------------------------------------
// 2^x with ex2.approx (flushes denormals; ex2(-inf) = +0, which the masked softmax relies on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (2^(2x log2 e) + 1): two MUFU ops instead of tanhf's long accurate sequence;
// relative error a few ulp, saturating to +-1 (2^x overflows to inf, then 2/inf = 0).
__device__ __forceinline__ float tanh_fast(float x) {
  float r;
  const float e = exp2_approx(2.f * 1.4426950408889634f * x);
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
  return fmaf(-2.f, r, 1.f);
}

// 2^x for x <= 0 on the FMA pipe instead of the MUFU unit: x = j + f with j = round(x), then 2^f
// from a cubic on [-0.5, 0.5] (least-squares fit to the relative error, max 7.5e-5: below fp16's
// half ulp, as P is rounded to 16 bits anyway) and 2^j added to the exponent bits. The magic
// constant 1.5 * 2^23 makes one FADD round x to an integer held in the low mantissa bits, and
// shifting those bits left by 23 puts j (mod 2^9) on the exponent field. x is clamped at -126
// so that -inf (a masked score) gives 2^-126 * ~1, which is 0 once P is packed to 16 bits.
__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  x = fmaxf(x, -126.f);
  const float t = x + kRound;
  const float f = x - (t - kRound);
  float p = fmaf(0.05517167f, f, 0.24261113f);
  p = fmaf(p, f, 0.69326097f);
  p = fmaf(p, f, 0.99992806f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Padded head dims (a caller's D below the tile's kHeadDim, both multiples of 8): whether 16-byte
// chunk `ch` of a row holds real columns. Chunks at or past kHeadDimValid / 8 are padding: loads
// zero-fill them (so they add nothing to Q Kᵀ and give output columns nobody reads), stores skip
// them. A constant true for unpadded variants, folded away: their code is unchanged.
template <class Cfg>
__device__ __forceinline__ bool real_chunk(int ch) {
  return Cfg::kHeadDimValid == Cfg::kHeadDim || ch < Cfg::kHeadDimValid / 8;
}

// The same for chunks of kElems elements (8 of 16 bits, 16 of fp8).
template <class Cfg, int kElems>
__device__ __forceinline__ bool real_chunk_of(int ch) {
  if constexpr (kElems == 8) {
    return real_chunk<Cfg>(ch);
  } else {
    return Cfg::kHeadDimValid == Cfg::kHeadDim || ch < Cfg::kHeadDimValid / kElems;
  }
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

}  // namespace omni
