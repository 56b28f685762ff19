// What the selection kernels of the forward (slc_attention.cuh) and the backward
// (backward/slc_dq.cuh) share: the union of the selected blocks of a warp's tokens (spec §5), the
// operand helpers, and the A fragments of 16 rows with a permuted reduction index.
//
// The union:
//
// A warp owns 16 query rows = `tokens` (<= 16) consecutive tokens x the G heads of one KV head.
// Their (block, token) pairs go to the warp's shared scratch `keys` (a power of two `cap` >=
// tokens x n entries), are sorted by the warp (bitonic), and compacted into the ascending list of
// distinct blocks `ublk` with, per block, the mask `umask` of the tokens that picked it. Index
// rows are sets (api.h): order, repeats and -1 padding do not matter. A block whose first key is
// after its token holds no key the token may see: it is dropped.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"
#include "cuda/common/tma.h"
#include "cuda/common/wgmma.h"

namespace nsa::cuda {

// idx: token 0's row of n indices, rows `idx_token_stride` apart; t_first: token 0's position in
// its sequence. Returns the number of union blocks (the same in every lane); ends with __syncwarp.
__device__ __forceinline__ int warp_block_union(const int32_t* idx, int64_t idx_token_stride, int n, int lp,
                                                int64_t t_first, int tokens, int cap, int32_t* keys, int32_t* ublk,
                                                int32_t* umask) {
  const int lane = threadIdx.x % 32;
  const int entries = tokens * n;
  for (int e = lane; e < cap; e += 32) {
    int32_t key = INT_MAX;
    if (e < entries) {
      const int tok = e / n, k = e % n;
      const int32_t j = idx[tok * idx_token_stride + k];
      if (j >= 0 && int64_t(j) * lp <= t_first + tok) key = (j << 4) | tok;
    }
    keys[e] = key;
  }
  __syncwarp();
  for (int k = 2; k <= cap; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = lane; i < cap; i += 32) {
        const int other = i ^ j;
        if (other > i) {
          const int32_t a = keys[i], c = keys[other];
          if ((a > c) == ((i & k) == 0)) {
            keys[i] = c;
            keys[other] = a;
          }
        }
      }
      __syncwarp();
    }
  }
  int num_blocks = 0;
  for (int base = 0; base < cap; base += 32) {
    const int i = base + lane;
    const int32_t key = i < cap ? keys[i] : INT_MAX;
    const int32_t blk = key >> 4;
    const bool first = key != INT_MAX && (i == 0 || (keys[i - 1] >> 4) != blk);
    uint32_t mask = 0;
    if (first)
      for (int e = i; e < cap && keys[e] != INT_MAX && (keys[e] >> 4) == blk; ++e) mask |= 1u << (keys[e] & 15);
    const uint32_t ballot = __ballot_sync(0xffffffffu, first);
    if (first) {
      const int pos = num_blocks + __popc(ballot & ((1u << lane) - 1u));
      ublk[pos] = blk;
      umask[pos] = static_cast<int32_t>(mask);
    }
    num_blocks += __popc(ballot);
  }
  __syncwarp();
  return num_blocks;
}

// ---- The union of a CTA's warps (the selection's union tiles, slc_attention.cuh) ----
//
// Each of the CTA's kWarps warps holds its ascending block list (warp_block_union's ublk, nblk[w]
// entries) at lists + w * list_stride, and its token masks at the same offsets of masks. Every
// thread of the CTA calls these functions (none may have left), and each ends with a CTA barrier.

// Whether the ascending a[0 .. n) holds x.
__device__ __forceinline__ bool sorted_contains(const int32_t* a, int n, int32_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && a[lo] == x;
}

// Calls f(e, i) for each block e = lists[w * list_stride + i] of this warp w that no earlier warp
// holds (so each distinct block of the CTA's union once), lane-strided.
template <typename F>
__device__ __forceinline__ void for_each_fresh_block(const int32_t* lists, int list_stride, const int* nblk, F&& f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* mine = lists + warp * list_stride;
  for (int i = lane; i < nblk[warp]; i += 32) {
    const int32_t e = mine[i];
    bool seen = false;
    for (int v = 0; v < warp && !seen; ++v) seen = sorted_contains(lists + v * list_stride, nblk[v], e);
    if (!seen) f(e, i);
  }
}

// The number of distinct blocks over the warps' lists. `counter`: one int of shared memory.
// Before the call: each warp's list and nblk[w] written (the first barrier publishes them).
__device__ __forceinline__ int cta_union_size(const int32_t* lists, int list_stride, const int* nblk, int* counter) {
  if (threadIdx.x == 0) *counter = 0;
  __syncthreads();
  int fresh = 0;
  for_each_fresh_block(lists, list_stride, nblk, [&](int32_t, int) { ++fresh; });
  for (int o = 16; o > 0; o >>= 1) fresh += __shfl_xor_sync(0xffffffffu, fresh, o);
  if (threadIdx.x % 32 == 0 && fresh > 0) atomicAdd(counter, fresh);
  __syncthreads();
  return *counter;
}

// With u = cta_union_size(...) <= kMax: the ascending union in out[0 .. u), and per union block
// the tile's tokens that picked it in member[] (bit w * tokens_per_warp + t: token t of warp w;
// at most 64 tokens per tile). Scratch: cand[kMax] and one int `slot`.
template <int kMax>
__device__ __forceinline__ void cta_union_list(const int32_t* lists, const int32_t* masks, int list_stride,
                                               const int* nblk, int tokens_per_warp, int u, int32_t* cand, int* slot,
                                               int32_t* out, unsigned long long* member) {
  if (threadIdx.x == 0) *slot = 0;
  for (int i = threadIdx.x; i < u; i += blockDim.x) member[i] = 0ull;
  __syncthreads();
  for_each_fresh_block(lists, list_stride, nblk, [&](int32_t e, int) { cand[atomicAdd(slot, 1)] = e; });
  __syncthreads();
  for (int i = threadIdx.x; i < u; i += blockDim.x) {  // rank among distinct values: a sorted copy
    const int32_t e = cand[i];
    int rank = 0;
    for (int j = 0; j < u; ++j) rank += cand[j] < e;
    out[rank] = e;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* mine = lists + warp * list_stride;
  const int32_t* mask = masks + warp * list_stride;
  for (int i = lane; i < nblk[warp]; i += 32) {
    const int32_t e = mine[i];
    int lo = 0, hi = u;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (out[mid] < e) lo = mid + 1;
      else hi = mid;
    }
    atomicOr(member + lo, static_cast<unsigned long long>(static_cast<uint32_t>(mask[i]) & 0xffffu)
                              << (warp * tokens_per_warp));
  }
  // The lists live in the bytes of the caller's TMA ring, whose first copies (async proxy) may
  // follow this barrier at once (kIssueEarly): every thread's generic writes to them are ordered
  // before those copies by this fence and the barrier.
  fence_proxy_async();
  __syncthreads();
}

// Register pair helpers of the selection kernels: a byte permute, and word i of a 16-byte load.
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

__device__ __forceinline__ uint32_t word_of(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

// A 16-byte shared load the compiler may not hoist out of a loop (it would hold the operand in
// registers for the whole loop).
__device__ __forceinline__ void ld_shared_16(uint32_t (&r)[4], const void* p) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}

// The warp's 16 rows (row_g: row g, row_g8: row g + 8; nullptr: zeros) as A fragments of k16
// steps whose reduction index is permuted (step 2p + u holds columns 32p + 8q + 4u .. +3 of lane
// quad q), the order of the "A" row layout below.
template <typename E, int D>
__device__ __forceinline__ void load_permuted_fragments(uint32_t (&f)[D / 16][4], const E* row_g, const E* row_g8) {
  const int quad = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const E* row = h == 0 ? row_g : row_g8;
#pragma unroll
    for (int pp = 0; pp < D / 32; ++pp) {
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (row != nullptr) x = *reinterpret_cast<const uint4*>(row + 32 * pp + 8 * quad);
      f[2 * pp][h] = x.x;
      f[2 * pp][2 + h] = x.y;
      f[2 * pp + 1][h] = x.z;
      f[2 * pp + 1][2 + h] = x.w;
    }
  }
}
// The same, stored in lane order: frag[kk * 32 + lane].
template <typename E, int D>
__device__ __forceinline__ void store_permuted_fragments(uint4* frag, const E* row_g, const E* row_g8) {
  const int lane = threadIdx.x % 32;
  uint32_t f[D / 16][4];
  load_permuted_fragments<E, D>(f, row_g, row_g8);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) frag[kk * 32 + lane] = make_uint4(f[kk][0], f[kk][1], f[kk][2], f[kk][3]);
}

// Copies rows [first, first + 16) of a D-column tensor (rows `st` elements apart) into a ring stage
// of 16 rows x (D + 8) columns, in whole lines: lane l takes pieces l, l + 32, ... of the step's
// 16 x D/8 16-byte pieces (row-major). Rows at or past `end` are zero-filled, never read.
template <typename E, int D>
__device__ __forceinline__ void slc_copy_step(E* stage, const E* base, int64_t st, int64_t first, int64_t end) {
  constexpr int kPieces = D / 8, kStride = D + 8;
  static_assert((16 * kPieces) % 32 == 0, "whole warp copies");
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < 16 * kPieces / 32; ++k) {
    const int e = k * 32 + lane, row = e / kPieces, piece = e % kPieces;
    const bool valid = first + row < end;
    cp_async_16(stage + row * kStride + piece * 8, valid ? base + (first + row) * st + piece * 8 : base, valid);
  }
}

// p (16 rows x 16 keys, the accumulator layout of two n8 tiles) as an A fragment (storage type).
template <typename E>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&fa)[4], const float (&p)[2][4]) {
  using Traits = StorageTraits<E>;
  fa[0] = Traits::pack(p[0][0], p[0][1]);
  fa[1] = Traits::pack(p[0][2], p[0][3]);
  fa[2] = Traits::pack(p[1][0], p[1][1]);
  fa[3] = Traits::pack(p[1][2], p[1][3]);
}

// The warp's 16 rows (row_g: row g, row_g8: row g + 8; nullptr: zeros) as the A fragments of
// mma.m16n8k16 over D columns, natural order: f[kk] holds columns 16 kk + 2 quad (+1) and + 8.
template <typename E, int D>
__device__ __forceinline__ void load_a_fragments(uint32_t (&f)[D / 16][4], const E* row_g, const E* row_g8) {
  const int quad = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const E* row = h == 0 ? row_g : row_g8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        f[kk][2 * half + h] = row != nullptr ? *reinterpret_cast<const uint32_t*>(row + 16 * kk + 8 * half + 2 * quad) : 0u;
  }
}

// Ring-stage products (16 keys in rows of kStride columns, ldmatrix; lane l gives row l % 8 of
// matrix l / 8):
// s (16 rows x the 16 keys) = A (fragments f over D columns) x stage^T.
template <bool kBf16, int D, int kStride, typename E>
__device__ __forceinline__ void mma_frags_stage(float (&s)[2][4], const uint32_t (&f)[D / 16][4], const E* stage) {
  const int lane = threadIdx.x % 32, mrow = lane % 8, mat = lane / 8;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t b[4];  // matrices 0, 1: keys 0-7, columns 16 kk + 0-7, 8-15; 2, 3: keys 8-15
    ldmatrix_x4(b, stage + (mrow + 8 * (mat >> 1)) * kStride + 16 * kk + 8 * (mat & 1));
    mma_16816<kBf16>(s[0], f[kk], b[0], b[1]);
    mma_16816<kBf16>(s[1], f[kk], b[2], b[3]);
  }
}
// acc (D / 8 n8 tiles, natural columns) += p (16 rows x the 16 keys, accumulator layout) x stage.
template <bool kBf16, int D, int kStride, typename E>
__device__ __forceinline__ void mma_p_stage(float (*acc)[4], const float (&p)[2][4], const E* stage) {
  const int lane = threadIdx.x % 32, mrow = lane % 8, mat = lane / 8;
  uint32_t fa[4];
  pack_a_fragment<E>(fa, p);
#pragma unroll
  for (int dt = 0; dt < D / 16; ++dt) {
    uint32_t b[4];  // transposed; matrices 0, 1: keys 0-7, 8-15 of columns 16 dt + 0-7; 2, 3: + 8-15
    ldmatrix_x4_trans(b, stage + (mrow + 8 * (mat & 1)) * kStride + 16 * dt + 8 * (mat >> 1));
    mma_16816<kBf16>(acc[2 * dt], fa, b[0], b[1]);
    mma_16816<kBf16>(acc[2 * dt + 1], fa, b[2], b[3]);
  }
}

// The same two products on a stage a TMA box filled: 16 keys x D columns as D / 64 blocks of 16
// rows x 128 bytes in the 128-byte swizzle (piece c of row r at piece c ^ (r % 8), common/tma.h),
// the stage at a 1024-byte boundary (`stage`: its shared-memory address). A lane's row address
// differs from its unswizzled one only in bits 4-6, so each ldmatrix is one XOR of a per-lane base
// with a constant. kBlockBytes: the distance of the 64-column blocks (a stage of more rows, such as
// slc_attention_blocks_kernel's 64, holds its 16-key pieces 2048 bytes apart inside each block).
constexpr int kSwStageBlockBytes = 16 * 128;  // one 64-column block of a 16-row stage
template <bool kBf16, int D, int kBlockBytes = kSwStageBlockBytes>
__device__ __forceinline__ void mma_frags_stage_sw(float (&s)[2][4], const uint32_t (&f)[D / 16][4], uint32_t stage) {
  const int lane = threadIdx.x % 32, mrow = lane % 8, mat = lane / 8;
  // matrices 0, 1: keys 0-7, columns 16 kk + 0-7, 8-15; 2, 3: keys 8-15
  const uint32_t base = stage + (mrow + 8 * (mat >> 1)) * 128 + (((mat & 1) ^ mrow) << 4);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t b[4];
    ldmatrix_x4_at(b, (base ^ uint32_t((2 * (kk % 4)) << 4)) + (kk / 4) * kBlockBytes);
    mma_16816<kBf16>(s[0], f[kk], b[0], b[1]);
    mma_16816<kBf16>(s[1], f[kk], b[2], b[3]);
  }
}
template <typename E, int D, int kBlockBytes = kSwStageBlockBytes>
__device__ __forceinline__ void mma_p_stage_sw(float (*acc)[4], const float (&p)[2][4], uint32_t stage) {
  constexpr bool kBf16 = StorageTraits<E>::is_bf16;
  const int lane = threadIdx.x % 32, mrow = lane % 8, mat = lane / 8;
  // transposed; matrices 0, 1: keys 0-7, 8-15 of columns 16 dt + 0-7; 2, 3: + 8-15
  const uint32_t base = stage + (mrow + 8 * (mat & 1)) * 128 + (((mat >> 1) ^ mrow) << 4);
  uint32_t fa[4];
  pack_a_fragment<E>(fa, p);
#pragma unroll
  for (int dt = 0; dt < D / 16; ++dt) {
    uint32_t b[4];
    ldmatrix_x4_trans_at(b, (base ^ uint32_t((2 * (dt % 4)) << 4)) + (dt / 4) * kBlockBytes);
    mma_16816<kBf16>(acc[2 * dt], fa, b[0], b[1]);
    mma_16816<kBf16>(acc[2 * dt + 1], fa, b[2], b[3]);
  }
}

// The walk of a warp's union blocks by TMA on sm_90a (slc_attention_tma_kernel, slc_dq_kernel):
// 16-key steps from each block's first key to its end or the warp's last token tmax, positions in
// 32 bits within the sequence. Every union block has a key up to tmax (warp_block_union keeps a
// block only up to its token), so every block has a step.
struct SlcTmaWalk {
  const int32_t* ublk;
  const int32_t* umask;
  int lp;    // l'
  int tmax;  // the warp's last token

  // Keys of block u the walk reads (>= 1).
  __device__ __forceinline__ int keys(int u) const {
    const int first = ublk[u] * lp;
    return min(first + lp, tmax + 1) - first;
  }
  __device__ __forceinline__ int steps(int num_blocks) const {
    int n = 0;
    for (int u = 0; u < num_blocks; ++u) n += (keys(u) + 15) / 16;
    return n;
  }
  // Block u's keys, and each row's count of visible keys from the block's first (lim): its token
  // tok[h] picked the block, up to the row's position trow[h] (-1: a padding row, none), at most l'.
  __device__ __forceinline__ int enter(int u, const int (&trow)[2], const int (&tok)[2], int (&lim)[2]) const {
    const int first = ublk[u] * lp;
    const uint32_t picked = static_cast<uint32_t>(umask[u]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      lim[h] = trow[h] >= 0 && ((picked >> tok[h]) & 1u) ? min(lp, trow[h] + 1 - first) : 0;
    return min(first + lp, tmax + 1) - first;
  }
};

// One lane's TMA copies of rows [row, row + box rows) of `map` (D columns) as D / 64 boxes of 64
// columns into dst, kBoxBytes apart, completing on bar (whose bytes the caller announces).
template <int D, int kBoxBytes>
__device__ __forceinline__ void slc_load_boxes(unsigned char* dst, const CUtensorMap* map, int hk, int row,
                                               uint64_t* bar) {
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) tma_load_3d(dst + blk * kBoxBytes, map, 64 * blk, hk, row, bar);
}

// One lane's copy of a walk step, rows [row, row + 16) of the k and v maps (boxes of 16 rows x 64
// columns), into a stage of DK / 64 then DV / 64 blocks, completing on bar.
template <int DK, int DV>
__device__ __forceinline__ void slc_issue_step(unsigned char* stage, uint64_t* bar, const CUtensorMap* k,
                                               const CUtensorMap* v, int hk, int row) {
  mbarrier_expect_tx(bar, kSwStageBlockBytes * (DK / 64 + DV / 64));
  slc_load_boxes<DK, kSwStageBlockBytes>(stage, k, hk, row, bar);
  slc_load_boxes<DV, kSwStageBlockBytes>(stage + (DK / 64) * kSwStageBlockBytes, v, hk, row, bar);
}

// Zeroes rows [nv, 16) of a landed stage's kBlocks blocks by the warp's lanes (the keys a box
// brings past a step's end: the next block's, another sequence's, possibly NaN, which a zero
// probability would not stop), fenced before a later box overwrites them.
template <int kBlocks>
__device__ __forceinline__ void slc_zero_stage_tail(unsigned char* stage, int nv, int lane) {
  const int pieces = (16 - nv) * 8;  // 16-byte pieces per block (a row's bytes stay in its row)
  for (int e = lane; e < pieces * kBlocks; e += 32)
    *reinterpret_cast<uint4*>(stage + (e / pieces) * kSwStageBlockBytes + (nv + e % pieces / 8) * 128 + (e % 8) * 16) =
        make_uint4(0u, 0u, 0u, 0u);
  fence_proxy_async();
  __syncwarp();
}

// The steps of a warp's walk over its union blocks: step i is 16 keys of block ublk[i / per_block].
struct SlcWalk {
  const int32_t* ublk;
  const int32_t* umask;
  int lp;         // l'
  int per_block;  // steps per block, ceil(l' / 16)
  int64_t t_max;  // the warp's last token

  // Keys [first, first + 16) of union entry u; loads stop at `end` (the block's end, or after the
  // warp's last token).
  __device__ __forceinline__ void step(int i, int64_t& first, int64_t& end, int& u) const {
    u = i / per_block;
    const int64_t blk_first = int64_t(ublk[u]) * lp;
    first = blk_first + int64_t(i % per_block) * 16;
    end = min(blk_first + lp, t_max + 1);
  }
  // How many keys of the step (from `first`) a row may see: its token `tok` picked the block, the
  // keys are in the block and not after the row's position t (-1: a padding row, none).
  __device__ __forceinline__ int visible(int u, int64_t first, int64_t t, int tok) const {
    if (t < 0 || !((static_cast<uint32_t>(umask[u]) >> tok) & 1u)) return 0;
    const int64_t stop = min(int64_t(ublk[u]) * lp + lp, t + 1);
    return int(max(int64_t(0), min(int64_t(16), stop - first)));
  }
};

// The two register layouts of a step's K or V rows (P 16-byte pieces per row and lane):
// "A" (the B operand of a product reducing over the head dim: Q K^T, dO V^T): lane (g, q) holds
//   keys first + g and first + 8 + g, pieces at columns 32 p + 8 q;
// "B" (the B operand of a product reducing over the keys: P V, dS K): lane holds keys first +
//   {2q, 2q+1, 2q+8, 2q+9}, pieces at columns 64 v + 8 g.
// Rows at or past `end` are zeros.
template <typename E, int P>
__device__ __forceinline__ void load_rows_a(uint4 (&r)[2][P], const E* base, int64_t row_stride, int64_t first,
                                            int64_t end) {
  const int lane = threadIdx.x % 32, g = lane / 4, quad = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int64_t key = first + 8 * nt + g;
    const E* row = base + key * row_stride + 8 * quad;
#pragma unroll
    for (int pp = 0; pp < P; ++pp)
      r[nt][pp] = key < end ? *reinterpret_cast<const uint4*>(row + 32 * pp) : make_uint4(0u, 0u, 0u, 0u);
  }
}
template <typename E, int P>
__device__ __forceinline__ void load_rows_b(uint4 (&r)[4][P], const E* base, int64_t row_stride, int64_t first,
                                            int64_t end) {
  const int lane = threadIdx.x % 32, g = lane / 4, quad = lane % 4;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int64_t key = first + 2 * quad + (rr & 1) + 8 * (rr >> 1);
    const E* row = base + key * row_stride + 8 * g;
#pragma unroll
    for (int v = 0; v < P; ++v)
      r[rr][v] = key < end ? *reinterpret_cast<const uint4*>(row + 64 * v) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// s = (the 16 rows' A fragments, permuted reduction order) x (A-layout rows r)^T over 32 P columns:
// two n8 tiles of 16 x 8. fragment(kk, fa) gives k16 step kk's fragment.
template <typename E, int P, typename Fragment>
__device__ __forceinline__ void mma_rows_a(float (&s)[2][4], Fragment&& fragment, const uint4 (&r)[2][P]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < 2 * P; ++kk) {
    uint32_t fa[4];
    fragment(kk, fa);
    const int pp = kk / 2, w = 2 * (kk % 2);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
      mma_16816<StorageTraits<E>::is_bf16>(s[nt], fa, word_of(r[nt][pp], w), word_of(r[nt][pp], w + 1));
  }
}
// With the fragments in shared memory in lane order (store_permuted_fragments), read per step.
template <typename E, int P>
__device__ __forceinline__ void mma_frags_rows_a(float (&s)[2][4], const uint4* frag, const uint4 (&r)[2][P]) {
  const int lane = threadIdx.x % 32;
  mma_rows_a<E, P>(s, [&](int kk, uint32_t (&fa)[4]) { ld_shared_16(fa, frag + kk * 32 + lane); }, r);
}
// With the fragments in registers (load_permuted_fragments).
template <typename E, int P>
__device__ __forceinline__ void mma_regs_rows_a(float (&s)[2][4], const uint32_t (&f)[2 * P][4], const uint4 (&r)[2][P]) {
  mma_rows_a<E, P>(
      s, [&](int kk, uint32_t (&fa)[4]) { fa[0] = f[kk][0], fa[1] = f[kk][1], fa[2] = f[kk][2], fa[3] = f[kk][3]; }, r);
}

// acc (8 P n8 tiles, output columns permuted: column n of tile 8 v + e is 64 v + 8 n + e) +=
// p (16 rows x the step's 16 keys, accumulator layout) x (B-layout rows r). Tile 8 v + 2 w (+1)
// takes the low (high) halves of word w of two rows' pieces, paired by a byte permute.
template <typename E, int P>
__device__ __forceinline__ void mma_p_rows_b(float (*acc)[4], const float (&p)[2][4], const uint4 (&r)[4][P]) {
  using Traits = StorageTraits<E>;
  uint32_t fa[4];
  pack_a_fragment<E>(fa, p);
#pragma unroll
  for (int v = 0; v < P; ++v)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t r0 = word_of(r[0][v], w), r1 = word_of(r[1][v], w);
      const uint32_t r2 = word_of(r[2][v], w), r3 = word_of(r[3][v], w);
      mma_16816<Traits::is_bf16>(acc[8 * v + 2 * w], fa, byte_perm(r0, r1, 0x5410u), byte_perm(r2, r3, 0x5410u));
      mma_16816<Traits::is_bf16>(acc[8 * v + 2 * w + 1], fa, byte_perm(r0, r1, 0x7632u), byte_perm(r2, r3, 0x7632u));
    }
}

}  // namespace nsa::cuda
