// Device pieces every decode kernel shares: where a call's row sits (sequence, position) with the
// checks of its device metadata, page lookups that never leave the pools, 64-key tile loads through
// the page table, and the 16 x 64 tensor-core tile products (mma.sync: one body for sm_80 and
// sm_90; decoding is memory-bound, and 16 query rows are a GQA group, not a wgmma's 64).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"
#include "cuda/params.h"
#include "cuda/tile_sizes.h"
#include "nsa/blocks.h"
#include "nsa/cache.h"

namespace nsa::cuda::decode {

inline constexpr float kNegInf = -__builtin_inff();
inline constexpr float kLn2 = 0.6931471805599453f;

// A sequence of the call: its length, its new rows [first, first + m), and what is wrong with it.
struct SeqInfo {
  int b = 0;
  int64_t len = 0, first = 0, m = 0;
  int32_t bad = 0;  // CacheStatus bits
};

// Checks sequence b's length and row range (not its pages).
__device__ __forceinline__ SeqInfo sequence_info(const Pages& p, int b) {
  SeqInfo s;
  s.b = b;
  if (p.cu != nullptr) {
    s.first = p.cu[b];
    s.m = static_cast<int64_t>(p.cu[b + 1]) - s.first;
    if (s.first < 0 || s.m < 0 || s.m > p.max_rows || s.first + s.m > p.rows || (b == 0 && s.first != 0))
      s.bad |= kCacheBadRows;
  } else {
    s.m = p.rows / p.batch;
    s.first = static_cast<int64_t>(b) * s.m;
  }
  s.len = p.seq_lens[b];
  if (s.len < s.m || s.len > p.max_len) s.bad |= kCacheBadLength;
  return s;
}

// The sequence of row `row` (the last b with cu[b] <= row) and the row's position in it.
struct RowInfo {
  SeqInfo seq;
  int64_t t = 0;  // position of the row's token in its sequence
  bool ok = false;
};

__device__ __forceinline__ RowInfo row_info(const Pages& p, int row) {
  int b;
  if (p.cu != nullptr) {
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.cu[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
  } else {
    b = row / (p.rows / p.batch);
  }
  RowInfo r;
  r.seq = sequence_info(p, b);
  if (row < r.seq.first || row >= r.seq.first + r.seq.m) r.seq.bad |= kCacheBadRows;
  r.t = r.seq.len - r.seq.m + (row - r.seq.first);
  r.ok = r.seq.bad == 0;
  return r;
}

// Pool page of page-sized piece `piece` of sequence b, or -1 when the table entry is outside the
// pools (or the piece outside the table).
__device__ __forceinline__ int64_t page_of(const Pages& p, int b, int64_t piece) {
  if (piece < 0 || piece >= p.max_pages) return -1;
  const int64_t id = p.block_table[b * p.bt_st0 + piece * p.bt_st1];
  return id >= 0 && id < p.num_pages ? id : -1;
}

// Row r of sequence b in a pool with rows_per_page rows a page; null when its page is invalid.
template <typename S>
__device__ __forceinline__ const S* pool_row(const Pages& p, const Pool& pool, int b, int64_t r, int rows_per_page,
                                             int head) {
  const int64_t page = page_of(p, b, r / rows_per_page);
  if (page < 0) return nullptr;
  return static_cast<const S*>(pool.data) + page * pool.page_st + (r % rows_per_page) * pool.row_st + head * pool.head_st;
}

// Where the rows of a 64-row tile live: pool page (-1: invalid or past the tile) and slot.
struct TileRow {
  int32_t page, slot;
};

// Rows [first, first + n) of sequence b (rows_per_page a page) into rows[0..64) (the buffer's own:
// pipelined_tiles): one page lookup per row, by the first 64 threads at once, then a barrier; the
// copies that follow read no table.
__device__ __forceinline__ void tile_rows(const Pages& p, int b, int64_t first, int n, int rows_per_page, TileRow* rows) {
  if (threadIdx.x < kKeyTile) {
    TileRow r{-1, 0};
    if (static_cast<int>(threadIdx.x) < n) {
      const int64_t pos = first + threadIdx.x;
      r.page = static_cast<int32_t>(page_of(p, b, pos / rows_per_page));
      r.slot = static_cast<int32_t>(pos % rows_per_page);
    }
    rows[threadIdx.x] = r;
  }
  __syncthreads();
}

// The tile's rows of one pool (KV head `head`) into smem [64][ld], 16-byte pieces by cp.async; rows
// with page -1 are zeros (a zero probability times garbage would not be zero).
template <typename S, int kD, int kThreads>
__device__ __forceinline__ void load_rows(S* smem, int ld, const TileRow* rows, const Pool& pool, int head) {
  constexpr int kPieces = kD * static_cast<int>(sizeof(S)) / 16;
  const S* base = static_cast<const S*>(pool.data);
  for (int e = threadIdx.x; e < kKeyTile * kPieces; e += kThreads) {
    const int k = e / kPieces, piece = e % kPieces;
    const TileRow r = rows[k];
    const S* src = r.page >= 0 ? base + r.page * pool.page_st + r.slot * pool.row_st + head * pool.head_st +
                                     piece * (16 / sizeof(S))
                               : base;
    cp_async_16(smem + k * ld + piece * (16 / sizeof(S)), src, r.page >= 0);
  }
}

// The group's query rows of `row` into smem [16][ld] (rows g >= G zero).
template <typename S, int kD, int kThreads>
__device__ __forceinline__ void load_queries(S* smem, int ld, const DecodeParams& p, int row, int hk) {
  constexpr int kPieces = kD * static_cast<int>(sizeof(S)) / 16;
  for (int e = threadIdx.x; e < kRows * kPieces; e += kThreads) {
    const int g = e / kPieces, piece = e % kPieces;
    const S* src = g < p.group ? static_cast<const S*>(p.q) + row * p.q_st + (hk * p.group + g) * p.q_sh : nullptr;
    cp_async_16(smem + g * ld + piece * (16 / sizeof(S)), src ? src + piece * (16 / sizeof(S)) : p.q, src != nullptr);
  }
}

// S = Q K^T for 16 rows x 16 keys [key0, key0 + 16) of a loaded K tile, by one warp: acc[n-tile][4]
// in the C layout of mma.h (rows group and group + 8, keys 2*quad, 2*quad + 1 of each n-tile).
template <typename S, int kD>
__device__ __forceinline__ void qk_16x16(const S* sQ, int ldq, const S* sK, int ldk, int key0, float (&acc)[2][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < kD; k0 += 16) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, sQ + (lane % 8 + ((lane / 8) % 2) * 8) * ldq + k0 + (lane / 16) * 8);
    ldmatrix_x4(b, sK + (key0 + (lane / 16) * 8 + lane % 8) * ldk + k0 + ((lane / 8) % 2) * 8);
    mma_16816<StorageTraits<S>::is_bf16>(acc[0], a, b[0], b[1]);
    mma_16816<StorageTraits<S>::is_bf16>(acc[1], a, b[2], b[3]);
  }
}

// O[16][col0 .. col0 + 8 * kTiles) += P[16][0..64) V[0..64)[cols], by one warp. P: smem [16][ldp]
// at column p0, V: smem [64][ldv]. kTiles is even (pairs of n-tiles per ldmatrix).
template <typename S, int kTiles>
__device__ __forceinline__ void pv_16x64(const S* sP, int ldp, int p0, const S* sV, int ldv, int col0,
                                         float (&o)[kTiles][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k0 = 0; k0 < kKeyTile; k0 += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, sP + (lane % 8 + ((lane / 8) % 2) * 8) * ldp + p0 + k0 + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < kTiles; nt += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV + (k0 + ((lane / 8) % 2) * 8 + lane % 8) * ldv + col0 + nt * 8 + (lane / 16) * 8);
      mma_16816<StorageTraits<S>::is_bf16>(o[nt], a, b[0], b[1]);
      mma_16816<StorageTraits<S>::is_bf16>(o[nt + 1], a, b[2], b[3]);
    }
  }
}

// Writes a warp's O accumulators (rows < G) to out[g * ld + col], fp32.
template <int kTiles>
__device__ __forceinline__ void store_rows(const float (&o)[kTiles][4], float* out, int ld, int col0, int G) {
  const int lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const int c = col0 + nt * 8 + 2 * quad;
    if (group < G) {
      out[group * ld + c] = o[nt][0];
      out[group * ld + c + 1] = o[nt][1];
    }
    if (group + 8 < G) {
      out[(group + 8) * ld + c] = o[nt][2];
      out[(group + 8) * ld + c + 1] = o[nt][3];
    }
  }
}

// A two-stage cp.async pipeline over tiles 0..n-1: load(i, buffer) issues tile i's copies into one
// of two buffers, body(i, buffer) consumes it. The next tile's copies run while a tile is computed;
// copies issued before the call (the queries) join the first tile's group. load(1) follows load(0)
// with no barrier between them, so whatever load keeps in shared memory (tile_rows' lookups) needs
// one copy per buffer too (with one, load(1)'s lookups overwrite those that load(0)'s slower
// threads still read).
template <typename Load, typename Body>
__device__ __forceinline__ void pipelined_tiles(int n, Load load, Body body) {
  if (n <= 0) return;
  load(0, 0);
  cp_async_commit();
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) load(i + 1, (i + 1) & 1);
    cp_async_commit();  // (an empty group past the end keeps the count uniform)
    cp_async_wait<1>();
    __syncthreads();
    body(i, i & 1);
    __syncthreads();  // the buffer is reloaded two tiles later
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

}  // namespace nsa::cuda::decode
