// Query splits of the compressed branch's dK/dV in the CUDA backward (dkv_kernel<cmp>, attention.cuh;
// reduce_cmp_parts_kernel and the workspace layout, backward.cu). Plain host/device arithmetic, so
// that the host tests check the invariants the kernels rely on (tests/test_cmp_split.cpp).
#pragma once

#include <cstdint>

#include "nsa/blocks.h"

namespace nsa::cuda_bwd {

constexpr int kMaxCmpSplits = 8;  // query splits of the compressed dk/dv (8: A/B against 4, session 13)

// Query splits of the compressed dK/dV (dkv_kernel<cmp>, blockIdx.z = z): split z of a sequence of
// len tokens takes the query positions [z S, (z + 1) S), S = ceil(len / splits). Split `last`
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
