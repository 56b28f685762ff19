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

// The warp's 16 rows as A fragments of k16 steps whose reduction index is permuted (step 2p + u
// holds columns 32p + 8q + 4u .. +3 of lane quad q), stored in lane order: frag[kk * 32 + lane].
template <typename E, int D>
__device__ __forceinline__ void store_permuted_fragments(uint4* frag, const E* row_g, const E* row_g8) {
  const int lane = threadIdx.x % 32, quad = lane % 4;
  uint32_t f[D / 16][4];
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
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) frag[kk * 32 + lane] = make_uint4(f[kk][0], f[kk][1], f[kk][2], f[kk][3]);
}

}  // namespace nsa::cuda
