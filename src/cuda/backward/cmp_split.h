// Query splits of the compressed branch's dK/dV in the CUDA backward (dkv_kernel<cmp>, attention.cuh;
// reduce_cmp_parts_kernel and the workspace layout, backward.cu). Plain host/device arithmetic, so
// that the host tests check the invariants the kernels rely on (tests/test_cmp_split.cpp).
#pragma once

#include <cstdint>

#include "nsa/blocks.h"

namespace nsa::cuda_bwd {

constexpr int kMaxCmpSplits = 16;   // query splits of the compressed dk/dv, at most
constexpr int kCmpSplitTokens = 1024;  // one more split per this many tokens of max_seqlen

// Splits of one backward call: one per kCmpSplitTokens tokens of the longest sequence, at most 16
// for one sequence at G >= 16, 8 at G >= 8 (and for packed batches,
// whose earlier splits keep every row) and 4 below. Each split after the first keeps fp32
// partials of the rows its queries see (about 1.5 copies of the compressed rows at 4 splits, 3.5
// at 8, 7.5 at 16), which grow with Hkv while q, k, v and o grow with Hq: 8 splits instead of 4
// took the 64K backward at G = 16 from 124.0 to 121.6 ms on an H200 (`a5f2288`; load balance)
// for 34 MB, 1.3% of q, k, v and o, but at G = 4 the same 34 MB is 3.6% of them (workspace 8.5%
// -> 12.1%, past the 10% budget) for 0.4 ms (53.0 -> 52.6 ms). 16 splits at G = 16 (`8c78670`,
// with the heavy-first order): 64K backward 105.7 -> 104.7 ms, workspace 151 -> 218 MB = 8.5%.
NSA_HOST_DEVICE int cmp_splits_for(int64_t max_seqlen, int64_t group, int64_t batch = 1) {
  const int cap = group >= 16 && batch == 1 ? kMaxCmpSplits : group >= 8 ? 8 : 4;
  const int64_t want = (max_seqlen + kCmpSplitTokens - 1) / kCmpSplitTokens;
  return want < 1 ? 1 : want > cap ? cap : int(want);
}

// Query splits of the compressed dK/dV (dkv_kernel<cmp>, split z = cmp_split_index()): split z of
// a sequence of len tokens takes the query positions [z S, (z + 1) S), S = ceil(len / splits). Split `last`
// (the one holding position len - 1) sees every compressed block and writes dkc / dvc itself;
// an earlier split z sees only the blocks i with i d + l - 1 < (z + 1) S, the sequence's first
// cmp_split_rows(z) blocks, and writes fp32 partials for those, which reduce_cmp_parts_kernel adds
// in split order. Only what a split can see is stored: 1.5 instead of 4 copies of the rows at 4
// splits.
struct CmpSplit {
  int64_t S;
  int last;
};
NSA_HOST_DEVICE CmpSplit cmp_split_of(int64_t len, int splits) {
  const int64_t S = (len + splits - 1) / splits;
  return CmpSplit{S, len > 0 ? int((len - 1) / S) : 0};
}
NSA_HOST_DEVICE int64_t cmp_split_rows(int64_t len, int z, const CmpSplit& cs, int64_t l, int64_t d) {
  const int64_t lim = (z + 1) * cs.S - l + 1;  // blocks i with i d < lim
  const int64_t r = lim <= 0 ? 0 : (lim + d - 1) / d;
  const int64_t nc = num_cmp_blocks(len, l, d);
  return r < nc ? r : nc;
}

}  // namespace nsa::cuda_bwd
