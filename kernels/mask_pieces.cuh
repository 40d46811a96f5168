// Block masks from exact row bounds given by pieces (omnicupy/mask/pieces.py), on the GPU.
//
// Row q of such a mask allows exactly the keys start(q) <= kv < end(q), where start and end are
// pieces: over the rows q[i] .. q[i + 1] - 1, start(q) = start[i] + start_slope[i] * (q - q[i])
// (end likewise). Within one block a row is then one run of columns [lo, hi), which this header
// names by a code (lo * (kbs + 1) + hi; 0 for an empty run or a row past q_len), the same codes
// as omnicupy/mask/patterns.py. Equal codes mean equal bits, so a block's type, its hash (the one
// of omnicupy/mask/blocks.py: sum of word * multiplier over its packed words, mod 2**64) and its
// bits all follow from one code per row.
//
// The functions here run in CTAs of one q block: one thread per row (blockDim.x >= qbs, a
// multiple of 32, at most 256: the kernels' launch bounds), every thread of the CTA calling each function together (they
// hold barriers). The BlockType enum (kMasked ...) must be declared before this header.
#pragma once

namespace mask_pieces {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int kWordBits = 32;

// The pieces, as the host lays them out: five [count] int64 rows (q, start, start_slope, end,
// end_slope) one after the other.
struct Pieces {
  const i64* table;
  int count;
  __device__ i64 q(int i) const { return table[i]; }
  __device__ i64 start(int i) const { return table[count + i]; }
  __device__ i64 start_slope(int i) const { return table[2 * count + i]; }
  __device__ i64 end(int i) const { return table[3 * count + i]; }
  __device__ i64 end_slope(int i) const { return table[4 * count + i]; }
};

struct Sizes {
  int q_len, kv_len, qbs, kbs;
  __device__ int num_kv_blocks() const { return (kv_len + kbs - 1) / kbs; }
};

// This thread's row of the q block: its bounds, clipped to [0, kv_len], and whether it is real.
struct Row {
  int q;         // its position (q0 + threadIdx.x)
  bool real;     // a row of the block (threadIdx.x < qbs) inside the sequence (q < q_len)
  int start, end;
  __device__ bool allows_any() const { return real && start < end; }
};

__device__ inline i64 clip(i64 x, i64 lo, i64 hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Row q's bounds: the last piece that starts at or before q.
__device__ inline Row row_of(const Pieces& p, const Sizes& n, int q0) {
  Row row;
  row.q = q0 + static_cast<int>(threadIdx.x);
  row.real = static_cast<int>(threadIdx.x) < n.qbs && row.q < n.q_len;
  row.start = row.end = 0;
  if (row.real) {
    int lo = 0, hi = p.count;  // invariant: q(lo) <= q < q(hi) (q(count) = infinity; q(0) = 0)
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      if (p.q(mid) <= row.q) lo = mid; else hi = mid;
    }
    const i64 dq = row.q - p.q(lo);
    row.start = static_cast<int>(clip(p.start(lo) + p.start_slope(lo) * dq, 0, n.kv_len));
    row.end = static_cast<int>(clip(p.end(lo) + p.end_slope(lo) * dq, 0, n.kv_len));
  }
  return row;
}

// Block-wide min and max of an int, through shared memory (scratch: 32 ints). Every thread gets them.
__device__ inline int block_min(int x, int* scratch) {
  for (int o = 16; o > 0; o /= 2) x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  int m = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = min(m, scratch[w]);
  return m;
}

__device__ inline int block_max(int x, int* scratch) { return -block_min(-x, scratch); }

__device__ inline u64 block_sum(u64 x, u64* scratch) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  u64 total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  return total;
}

struct Scratch {
  int ints[32];
  u64 words[32];
};

// The kv blocks a q block can reach, [first, last), and within them the FULL ones [full_first,
// full_last) (empty when some real row allows nothing). Every other block of [first, last) is cut:
// its rows decide its type. All four are 0 when no row allows anything.
struct Window {
  int first, last, full_first, full_last;
  __device__ bool is_full(int kv_block) const { return kv_block >= full_first && kv_block < full_last; }
  // The i-th block of the window in the order first .. full_first - 1, full_last .. last - 1 (cut
  // blocks), for i < cut_blocks().
  __device__ int cut_blocks() const { return (last - first) - (full_last - full_first); }
  __device__ int cut_block(int i) const { return first + i < full_first ? first + i : full_last + (i - (full_first - first)); }
};

__device__ inline Window window_of(const Row& row, const Sizes& n, Scratch& scratch) {
  Window w{0, 0, 0, 0};
  const bool any = __syncthreads_or(row.allows_any());
  if (!any) return w;
  const bool every_real_row = __syncthreads_and(!row.real || row.allows_any());
  const int big = 0x7fffffff;
  const int least_start = block_min(row.allows_any() ? row.start : big, scratch.ints);
  const int greatest_end = block_max(row.allows_any() ? row.end : -big, scratch.ints);
  w.first = least_start / n.kbs;
  w.last = (greatest_end + n.kbs - 1) / n.kbs;
  w.full_first = w.full_last = w.first;
  if (every_real_row) {
    const int greatest_start = block_max(row.allows_any() ? row.start : -big, scratch.ints);
    const int least_end = block_min(row.allows_any() ? row.end : big, scratch.ints);
    // A block is FULL when every row runs over all its real columns: kv0 >= every start and
    // kv0 + real columns <= every end (the last block's real columns end at kv_len).
    const int full_first = (greatest_start + n.kbs - 1) / n.kbs;
    const int full_last = least_end == n.kv_len ? n.num_kv_blocks() : least_end / n.kbs;
    if (full_first < full_last) {
      w.full_first = full_first;
      w.full_last = full_last;
    }
  }
  return w;
}

// The code of this thread's row in the block from kv0 with `cols` real columns.
__device__ inline int run_code(const Row& row, int kv0, int cols, int kbs) {
  const int lo = static_cast<int>(clip(static_cast<i64>(row.start) - kv0, 0, cols));
  const int hi = static_cast<int>(clip(static_cast<i64>(row.end) - kv0, 0, cols));
  return row.real && hi > lo ? lo * (kbs + 1) + hi : 0;
}

// Word w of the packed run of `code` (bit c = column 32 w + c).
__device__ inline u32 run_word(int code, int w, int kbs) {
  const int lo = code / (kbs + 1) - w * kWordBits, hi = code % (kbs + 1) - w * kWordBits;
  const auto below = [](int n) -> u32 { return n <= 0 ? 0u : n >= kWordBits ? 0xffffffffu : (1u << n) - 1u; };
  return below(hi) & ~below(lo);
}

// The type of kv block `kv_block` for the q block from q0 (the rules of blocks.py: MASKED, FULL,
// CAUSAL, PARTIAL), and this thread's row code in it.
struct Cut {
  int type;
  int code;
};

__device__ inline Cut classify(const Row& row, int q0, int kv_block, const Sizes& n) {
  const int kv0 = kv_block * n.kbs;
  const int cols = min(n.kbs, n.kv_len - kv0);
  const int code = run_code(row, kv0, cols, n.kbs);
  const int full_code = row.real ? cols : 0;  // the run [0, cols)
  if (__syncthreads_and(code == full_code)) return {kFull, code};
  if (!__syncthreads_or(code != 0)) return {kMasked, code};
  // CAUSAL: each real row from 0 to its diagonal (only a block the diagonal crosses can be).
  const bool crossed = kv0 < q0 + n.qbs && q0 < kv0 + cols;
  const int diagonal = row.real ? static_cast<int>(clip(static_cast<i64>(row.q) + 1 - kv0, 0, cols)) : 0;
  if (crossed && __syncthreads_and(code == diagonal)) return {kCausal, code};
  return {kPartial, code};
}

// blocks.py's hash of the packed block whose row codes the threads hold: the sum over rows r and
// words w of word * multipliers[r * words + w], mod 2**64.
__device__ inline u64 block_hash(int code, const u64* multipliers, int kbs, Scratch& scratch) {
  const int words = kbs / kWordBits;
  u64 h = 0;
  if (code != 0) {
    const u64* m = multipliers + static_cast<i64>(threadIdx.x) * words;
    for (int w = 0; w < words; ++w) h += static_cast<u64>(run_word(code, w, kbs)) * m[w];
  }
  return block_sum(h, scratch.words);
}

// The first block to claim `hash` in an open-addressing table of `slots` (a power of two) keys
// and values (0: empty; a value is a block + 1), for thread 0: `block` itself when it claims the
// hash, else the block that did (waited for: its CTA writes the value right after its claim).
// The table needs room: fewer claims than slots. A hash of 0 (the empty key) returns -1. Not
// inlined: inlined, its loops made ptxas spill 8 bytes on sm_80 (the rest of the scan needs few registers).
__device__ __noinline__ i64 first_block_of(u64 hash, i64 block, u64* keys, i64* values, int slots) {
  if (hash == 0) return -1;
  u64 slot = (hash ^ (hash >> 29)) & static_cast<u64>(slots - 1);
  while (true) {
    const u64 found = atomicCAS(keys + slot, 0ull, hash);
    if (found == 0) {
      atomicExch(reinterpret_cast<u64*>(values + slot), static_cast<u64>(block + 1));
      return block;
    }
    if (found == hash) {
      i64 owner;
      while ((owner = *reinterpret_cast<volatile i64*>(values + slot)) == 0) {
      }
      return owner - 1;
    }
    slot = (slot + 1) & static_cast<u64>(slots - 1);
  }
}

}  // namespace mask_pieces
