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
// The kernels run a CTA per q block, a thread per row (blockDim.x >= qbs, a multiple of 32, at
// most kMaxRows = 256: their launch bounds). Rows and windows are CTA-wide (every thread calls
// them together: they hold barriers); a kv block's type, hash and comparison are warp-wide (one
// warp per block, its lanes over the rows kept in shared memory), so that a q block with many
// cut blocks takes them a warp each instead of one after the other. The BlockType enum (kMasked
// ...) must be declared before this header.
#pragma once

namespace mask_pieces {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int kWordBits = 32;
// The most rows of a q block (threads of a CTA: the kernels' __launch_bounds__).
constexpr int kMaxRows = 256;

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

// Row q's bounds [start, end), clipped to [0, kv_len]: from the last piece that starts at or before q.
__device__ inline void bounds_of(const Pieces& p, const Sizes& n, int q, int& start, int& end) {
  int lo = 0, hi = p.count;  // invariant: q(lo) <= q < q(hi) (q(count) = infinity; q(0) = 0)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (p.q(mid) <= q) lo = mid; else hi = mid;
  }
  const i64 dq = q - p.q(lo);
  start = static_cast<int>(clip(p.start(lo) + p.start_slope(lo) * dq, 0, n.kv_len));
  end = static_cast<int>(clip(p.end(lo) + p.end_slope(lo) * dq, 0, n.kv_len));
}

// This thread's row of the q block from q0.
__device__ inline Row row_of(const Pieces& p, const Sizes& n, int q0) {
  Row row;
  row.q = q0 + static_cast<int>(threadIdx.x);
  row.real = static_cast<int>(threadIdx.x) < n.qbs && row.q < n.q_len;
  row.start = row.end = 0;
  if (row.real) bounds_of(p, n, row.q, row.start, row.end);
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

struct Scratch {
  int ints[32];
};

// The kv blocks a q block can reach, [first, last), and within them the FULL ones [full_first,
// full_last) (empty when some real row allows nothing). Every other block of [first, last) is cut:
// its rows decide its type. All four are 0 when no row allows anything.
struct Window {
  int first, last, full_first, full_last;
  // The i-th block of the window in the order first .. full_first - 1, full_last .. last - 1 (cut
  // blocks), for i < cut_blocks().
  __device__ int cut_blocks() const { return (last - first) - (full_last - full_first); }
  __device__ int cut_block(int i) const {
    return first + i < full_first ? first + i : full_last + (i - (full_first - first));
  }
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

// The code of the run [start, end) in the block from kv0 with `cols` real columns.
__device__ inline int run_code(int start, int end, int kv0, int cols, int kbs) {
  const int lo = static_cast<int>(clip(static_cast<i64>(start) - kv0, 0, cols));
  const int hi = static_cast<int>(clip(static_cast<i64>(end) - kv0, 0, cols));
  return hi > lo ? lo * (kbs + 1) + hi : 0;
}

// Word w of the packed run of `code` (bit c = column 32 w + c).
__device__ inline u32 run_word(int code, int w, int kbs) {
  const int lo = code / (kbs + 1) - w * kWordBits, hi = code % (kbs + 1) - w * kWordBits;
  const auto below = [](int n) -> u32 { return n <= 0 ? 0u : n >= kWordBits ? 0xffffffffu : (1u << n) - 1u; };
  return below(hi) & ~below(lo);
}

// The q block's rows, once in shared memory (each thread stores its own), for warps that take
// one kv block each: lane l holds rows l, l + 32, ... of the block.
struct Rows {
  int* start;
  int* end;
  int q0, real;  // the first row's position; rows [0, real) lie inside the sequence
  __device__ void store(const Row& row) const {
    if (static_cast<int>(threadIdx.x) < kMaxRows) {
      start[threadIdx.x] = row.start;
      end[threadIdx.x] = row.end;
    }
  }
};

// A kv block as seen by one warp: its first column, real columns and index.
struct KvBlock {
  int index, kv0, cols;
  __device__ KvBlock(int kv_block, const Sizes& n)
      : index(kv_block), kv0(kv_block * n.kbs), cols(min(n.kbs, n.kv_len - kv_block * n.kbs)) {}
};

// The type of kv block `b` for the q block of `rows` (the rules of blocks.py: MASKED, FULL,
// CAUSAL, PARTIAL), by one warp.
__device__ inline int classify(const Rows& rows, const KvBlock& b, const Sizes& n) {
  const int lane = threadIdx.x % 32;
  bool full = true, any = false, causal = true;
  for (int r = lane; r < n.qbs; r += 32) {
    const bool real = r < rows.real;
    const int code = real ? run_code(rows.start[r], rows.end[r], b.kv0, b.cols, n.kbs) : 0;
    full = full && code == (real ? b.cols : 0);  // the run [0, cols)
    any = any || code != 0;
    // CAUSAL: each real row from 0 to its diagonal.
    const int diagonal = real ? static_cast<int>(clip(static_cast<i64>(rows.q0) + r + 1 - b.kv0, 0, b.cols)) : 0;
    causal = causal && code == diagonal;
  }
  if (__all_sync(0xffffffffu, full)) return kFull;
  if (!__any_sync(0xffffffffu, any)) return kMasked;
  // (Only a block the diagonal crosses can be CAUSAL without being FULL or MASKED.)
  const bool crossed = b.kv0 < rows.q0 + n.qbs && rows.q0 < b.kv0 + b.cols;
  return crossed && __all_sync(0xffffffffu, causal) ? kCausal : kPartial;
}

// blocks.py's hash of the block's packed bits, by one warp: the sum over rows r and words w of
// word * multipliers[r * words + w], mod 2**64.
__device__ inline u64 block_hash(const Rows& rows, const KvBlock& b, const Sizes& n, const u64* multipliers) {
  const int words = n.kbs / kWordBits;
  u64 h = 0;
  for (int r = threadIdx.x % 32; r < rows.real; r += 32) {
    const int code = run_code(rows.start[r], rows.end[r], b.kv0, b.cols, n.kbs);
    if (code == 0) continue;
    const u64* m = multipliers + static_cast<i64>(r) * words;
    for (int w = 0; w < words; ++w) h += static_cast<u64>(run_word(code, w, n.kbs)) * m[w];
  }
  for (int o = 16; o > 0; o /= 2) h += __shfl_xor_sync(0xffffffffu, h, o);
  return h;
}

// Whether block `other` (q block * nKVB + kv block) has the same bits as block `b` of `rows`, by
// one warp (the other block's rows from the pieces).
__device__ inline bool same_bits(const Rows& rows, const KvBlock& b, i64 other, const Pieces& p, const Sizes& n) {
  const int q0 = static_cast<int>(other / n.num_kv_blocks()) * n.qbs;
  const KvBlock o(static_cast<int>(other % n.num_kv_blocks()), n);
  const int real = min(n.qbs, n.q_len - q0);
  bool same = true;
  for (int r = threadIdx.x % 32; r < n.qbs; r += 32) {
    const int mine = r < rows.real ? run_code(rows.start[r], rows.end[r], b.kv0, b.cols, n.kbs) : 0;
    int start = 0, end = 0;
    if (r < real) bounds_of(p, n, q0 + r, start, end);
    same = same && mine == (r < real ? run_code(start, end, o.kv0, o.cols, n.kbs) : 0);
  }
  return __all_sync(0xffffffffu, same);
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
