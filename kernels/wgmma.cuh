// Hopper (sm_90a) warpgroup MMA: shared-memory layout, matrix descriptors and the wgmma protocol.
//
// Tiles live in shared memory in the "128-byte swizzle" canonical layout, the same for Q, K and V:
// a [rows][head_dim] tile is cut into column blocks of 64 elements (128 bytes per row); block c
// holds rows 0..rows-1 contiguously, 128 bytes each, and the 16-byte chunk j of row r sits at
// chunk position j ^ (r % 8). Eight rows (1024 bytes) form one swizzle atom, so every tile and
// column block starts on a 1024-byte boundary. The same bytes serve as
//   K-major (Q as A, K as B of S = Q Kᵀ): 8-row groups 1024 bytes apart (SBO), a k16 step is
//     32 bytes further along the row, 64 columns later is the next column block;
//   N-major (V as B of O += P V, imm-trans-b): k = kv row, n = head_dim column; 8-row groups
//     1024 bytes apart (SBO), column blocks rows * 128 bytes apart (LBO).
#pragma once
#include "wgmma_ops.cuh"

namespace omni {
namespace wgmma {

constexpr int kSwizzleBytes = 128;     // one row of a column block
constexpr int kBlockCols = 64;         // 16-bit elements per row of a column block
constexpr int kAtomBytes = 1024;       // 8 rows: the swizzle pattern's period

// Byte offset of 16-byte chunk `chunk` (of head_dim / 8) of row `row` in a [rows][head_dim] tile.
__device__ __forceinline__ u32 chunk_offset(int rows, int row, int chunk) {
  return (chunk / 8) * rows * kSwizzleBytes + row * kSwizzleBytes + (((chunk % 8) ^ (row % 8)) * 16);
}

// Matrix descriptor for a 128-byte-swizzled operand starting at shared address `addr`
// (PTX ISA "Matrix Descriptor Format": start >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in
// 32-45, swizzle mode 1 = 128 bytes in bits 62-63).
__device__ __forceinline__ u64 descriptor(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  return static_cast<u64>((addr & 0x3ffff) >> 4) | (static_cast<u64>((lbo_bytes >> 4) & 0x3fff) << 16) |
         (static_cast<u64>((sbo_bytes >> 4) & 0x3fff) << 32) | (1ull << 62);
}

// The descriptor of the operand `bytes` further on: the start address field is the low 14 bits
// (address >> 4), and shared-memory addresses stay below 2^18, so adding never carries out of it.
__device__ __forceinline__ u64 advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// Before the first wgmma of a batch: orders this warpgroup's earlier register writes (the A
// fragment, rescaled accumulators) before the asynchronous reads.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The accumulators are written behind the compiler's back until wait(): pin each register so the
// compiler neither reads it early nor moves other uses across the wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

// Shared memory written through the generic proxy (cp.async, st.shared) and read next by wgmma
// (the async proxy) needs this fence in each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace wgmma
}  // namespace omni
