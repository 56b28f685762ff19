// The backward's inverted selection index (the selection branch's dK/dV need, per selected
// block, the queries that picked it): a stable radix sort (cub) of the (KV head, block) keys of
// every (token, KV head, slot) pair enumerated in token order, so each block's list is ascending
// in token (deterministic); packed 32-bit keys where key and token bits fit, (key, token) pairs
// otherwise. Included by backward.cu.
#pragma once

#include <cub/cub.cuh>

#include <string>

#include "cuda/backward/workspace.h"
#include "cuda/common/check.h"
#include "nsa/error.h"

namespace nsa::cuda::bwd {

// The sequence of packed token tok: the last b with cu[b] <= tok (< cu[b + 1]).
__device__ __forceinline__ int seq_of_token(const BwdArgs& a, int64_t tok) {
  int lo = 0, hi = a.B - 1, b = 0;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (a.cu[mid] <= tok) { b = mid; lo = mid + 1; } else { hi = mid - 1; }
  }
  return b;
}


// Pair i (< T * Hkv * n, in token order) of the selection: its token, and its key
// (hk * B + b) * n_slc_max + j, or `sentinel` for a padding, not admissible or repeated entry.
__device__ __forceinline__ uint32_t selection_pair(const BwdArgs& a, int64_t i, uint32_t sentinel, int64_t& tok) {
  const int k = int(i % a.n);
  const int hk = int((i / a.n) % a.hkv);
  tok = i / (int64_t(a.n) * a.hkv);
  const int b = seq_of_token(a, tok);
  const int t = int(tok - a.cu[b]);
  const int32_t* row = static_cast<const int32_t*>(a.indices.p) + tok * a.indices.s0 + hk * a.indices.s1;
  const int j = row[k];
  bool valid = j >= 0 && int64_t(j) * a.lp <= t;
  // A row is a set (api.h): a block repeated in the row counts at its first entry only.
  for (int e = 0; valid && e < k; ++e) valid = row[e] != j;
  return valid ? uint32_t((int64_t(hk) * a.B + b) * a.n_slc_max + j) : sentinel;
}

// The pairs as (key, token) arrays for the pair sort.
__global__ void selection_pairs_kernel(BwdArgs a, uint32_t sentinel, uint32_t* keys, int32_t* tokens) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.T * a.hkv * a.n) return;
  int64_t tok;
  keys[i] = selection_pair(a, i, sentinel, tok);
  tokens[i] = int32_t(tok);
}

// The same pairs packed into one 32-bit key, key << shift | token (shift = the token bits): sorting
// them sorts by key and, within a key, by token, which is the stable pair sort's order.
__global__ void selection_packed_kernel(BwdArgs a, uint32_t sentinel, int shift, uint32_t* packed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.T * a.hkv * a.n) return;
  int64_t tok;
  const uint32_t key = selection_pair(a, i, sentinel, tok);
  packed[i] = key << shift | uint32_t(tok);
}

// offsets[key] = first position of key in the sorted keys (lower bound; a sorted key's key is its
// bits from `shift` up), key in [0, nkeys].
__global__ void segment_offsets_kernel(const uint32_t* keys, int shift, int64_t n, int64_t nkeys, int32_t* offsets) {
  const int64_t key = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (key > nkeys) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if ((keys[mid] >> shift) < uint32_t(key)) lo = mid + 1; else hi = mid;
  }
  offsets[key] = int32_t(lo);
}

// The tokens of sorted packed keys (in place when src == dst: each thread reads its element first).
__global__ void unpack_tokens_kernel(const uint32_t* src, int64_t n, uint32_t mask, int32_t* dst) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = int32_t(src[i] & mask);
}

// Sorts the selection's pairs (T * Hkv * n of them, at least one: the caller skips the index
// without selection) into L.tokens[0] (the lists, returned) and L.offsets (where each key's list
// starts), on stream s.
inline const int32_t* build_selection_index(const Plan& p, const BwdArgs& a, const Layout& L, cudaStream_t s) {
  const int64_t pairs = p.T * p.hkv * p.cfg.n_selected;
  const int64_t nkeys = p.hkv * p.B * p.n_slc_max;
  if (pairs > INT32_MAX || nkeys >= INT32_MAX)
    throw Error("T * Hkv * n_selected", std::to_string(pairs), "must be < 2^31 for the cuda backward");
  size_t temp = L.sort_temp_bytes;
  if (L.packed_sort) {  // (carve: key and token bits fit in 32)
    uint32_t* packed = reinterpret_cast<uint32_t*>(L.tokens[0]);
    selection_packed_kernel<<<blocks_for(pairs), 256, 0, s>>>(a, uint32_t(nkeys), L.key_shift, packed);
    NSA_CUDA_CHECK_LAUNCH();
    cub::DoubleBuffer<uint32_t> kb(packed, L.keys[1]);
    NSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(L.sort_temp, temp, kb, int(pairs), 0, L.sort_bits, s));
    segment_offsets_kernel<<<blocks_for(nkeys + 1), 256, 0, s>>>(kb.Current(), L.key_shift, pairs, nkeys, L.offsets);
    NSA_CUDA_CHECK_LAUNCH();
    // The token lists outlive the sort's scratch (which later phases reuse): into tokens[0].
    unpack_tokens_kernel<<<blocks_for(pairs), 256, 0, s>>>(kb.Current(), pairs, (uint32_t(1) << L.key_shift) - 1u,
                                                           L.tokens[0]);
    NSA_CUDA_CHECK_LAUNCH();
  } else {
    selection_pairs_kernel<<<blocks_for(pairs), 256, 0, s>>>(a, uint32_t(nkeys), L.keys[0], L.tokens[0]);
    NSA_CUDA_CHECK_LAUNCH();
    cub::DoubleBuffer<uint32_t> kb(L.keys[0], L.keys[1]);
    cub::DoubleBuffer<int32_t> vb(L.tokens[0], L.tokens[1]);
    NSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(L.sort_temp, temp, kb, vb, int(pairs), 0, L.sort_bits, s));
    segment_offsets_kernel<<<blocks_for(nkeys + 1), 256, 0, s>>>(kb.Current(), 0, pairs, nkeys, L.offsets);
    NSA_CUDA_CHECK_LAUNCH();
    // The token lists outlive the sort's scratch (which later phases reuse): keep them in tokens[0].
    if (vb.Current() != L.tokens[0])
      NSA_CUDA_CHECK(cudaMemcpyAsync(L.tokens[0], vb.Current(), sizeof(int32_t) * size_t(pairs),
                                     cudaMemcpyDeviceToDevice, s));
  }
  return L.tokens[0];
}

}  // namespace nsa::cuda::bwd
