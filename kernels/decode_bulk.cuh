// Hopper (sm_90) bulk copies and transaction barriers for the decode kernel's K/V ring
// (decode_split.cuh): one cp.async.bulk per 16-byte-aligned row, completion counted in bytes on an
// mbarrier per ring slot. Everything here compiles to nothing below sm_90 (kBulkCopies is false
// there and the kernel keeps its cp.async ring).
#pragma once
#include "ptx.cuh"

namespace omni {
namespace bulk {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopies = true;

__device__ __forceinline__ void init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the async proxy (before the CTA's barrier that follows).
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival that also expects `bytes` more bytes of bulk copies before the phase completes.
__device__ __forceinline__ void arrive_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Global -> shared, `bytes` (a multiple of 16, both addresses 16-byte aligned), counted on `bar`.
__device__ __forceinline__ void copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Until the phase with this parity has completed (acquire: the copies' bytes are visible).
__device__ __forceinline__ void wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

// Generic-proxy writes of this thread (zero-filled rows) ordered before later bulk copies into them.
__device__ __forceinline__ void fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#else
constexpr bool kBulkCopies = false;
__device__ __forceinline__ void init(u32, u32) {}
__device__ __forceinline__ void fence_init() {}
__device__ __forceinline__ void arrive_expect(u32, u32) {}
__device__ __forceinline__ void copy(u32, const void*, u32, u32) {}
__device__ __forceinline__ void wait(u32, u32) {}
__device__ __forceinline__ void fence_proxy() {}
#endif

}  // namespace bulk
}  // namespace omni
