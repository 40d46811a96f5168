// Hopper (sm_90a) asynchronous data movement for warp-specialized kernels: TMA tensor loads,
// mbarriers (transaction counts and phase parity), named barriers and register reallocation.
//
// A TMA load copies one box of a tensor described by a tensor map (CUtensorMap, encoded on the
// host by the driver: omnicupy/ops/tma.py) into shared memory, zero-filling elements outside the
// tensor, and signals an mbarrier with the bytes it wrote (complete_tx). A consumer waits on the
// barrier's phase: phase k of a barrier has parity k % 2, and a fresh barrier is in phase 0, so
// waiting for parity 1 of a fresh barrier returns at once ("the phase before" counts as complete).
// Knows PTX; nothing of attention.
#pragma once
#include "ptx.cuh"

namespace omni {

// CUtensorMap as the kernel sees it: 128 opaque bytes, 64-byte aligned. TMA reads it through its
// generic address, which must be in the param, const or global space: pass the address of the
// field inside the __grid_constant__ parameter, never of a local copy.
struct __align__(64) TmaDesc {
  unsigned long long raw[16];
};

namespace tma {

// ---- mbarriers (shared::cta addresses) ---------------------------------------------------
__device__ __forceinline__ void barrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy (TMA) before any load uses them;
// a CTA barrier after it makes it visible to the other threads.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival that also announces `bytes` of TMA transactions the current phase must see land.
__device__ __forceinline__ void arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` has completed (try_wait suspends for a while in
// hardware before it reports false, so the loop does not spin hot).
__device__ __forceinline__ void wait(u32 bar, u32 parity) {
  while (!try_wait(bar, parity)) {
  }
}

// ---- TMA -----------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_map(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// One box of a rank-4 tensor at coordinates (c0 innermost .. c3) into shared memory at `dst`,
// completing `bytes`-many transactions on barrier `bar` (the box's full size, zero-filled parts
// included).
__device__ __forceinline__ void load_4d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// ---- warpgroups ------------------------------------------------------------------------------
// Register reallocation between warpgroups: every warp of a warpgroup executes the same one.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers (id 0 is __syncthreads): `threads` counts every arriving and syncing thread.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tma
}  // namespace omni
