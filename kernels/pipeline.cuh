// A ring of shared-memory stages between producer threads (TMA or cp.async loaders) and consumer
// warpgroups, guarded by mbarriers (tma.cuh): per stage a "full" barrier (the producer announces
// the stage's bytes or arrives after its copies) and an "empty" one (every consumer thread
// arrives once it no longer reads the stage). Used by the TMA forward (fwd_tma.cuh: Q, K and V
// rings) and the warp-specialized backward (bwd_ws.cuh: the Q/dO stages).
//
// A position in the ring is its stage and the parity of the barriers' current phase: the n-th use
// of a two-stage ring is stage n % 2, parity (n / 2) % 2. A producer waits on "empty" for the
// opposite parity, which returns at once on the first pass (a fresh barrier counts as having
// completed the phase before its first).
#pragma once
#include "tma.cuh"

namespace omni {
namespace pipe {

struct RingPos {
  int stage = 0;
  u32 phase = 0;
  // The position of use n of a two-stage ring.
  static __device__ __forceinline__ RingPos of(int n) { return {n & 1, static_cast<u32>((n >> 1) & 1)}; }
  __device__ __forceinline__ void advance() {
    stage ^= 1;
    phase ^= stage == 0;
  }
};

// kStages full barriers from `full`, kStages empty ones from `empty`, 8 bytes each.
template <int kStages>
struct Ring {
  u32 full0, empty0;
  __device__ __forceinline__ u32 full(int s) const { return full0 + 8 * s; }
  __device__ __forceinline__ u32 empty(int s) const { return empty0 + 8 * s; }
  // One thread, before the CTA's first barrier: `fills` arrivals complete a full phase (1 with
  // TMA's expect-tx), `releases` an empty one.
  __device__ __forceinline__ void init(u32 fills, u32 releases) const {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      tma::barrier_init(full(s), fills);
      tma::barrier_init(empty(s), releases);
    }
  }
  // producer: the consumers have released the stage (its previous use)
  __device__ __forceinline__ void acquire(RingPos at) const { tma::wait(empty(at.stage), at.phase ^ 1); }
  // consumers: the stage's data has landed
  __device__ __forceinline__ void wait_full(RingPos at) const { tma::wait(full(at.stage), at.phase); }
  // consumers: done reading the stage
  __device__ __forceinline__ void release(RingPos at) const { tma::arrive(empty(at.stage)); }
};

}  // namespace pipe
}  // namespace omni
