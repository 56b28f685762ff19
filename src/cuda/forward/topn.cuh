// Top-n block selection (spec §4) and the compression function phi (spec §2) on the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/params.h"
#include "nsa/blocks.h"
#include "nsa/config.h"

namespace nsa::cuda {

struct TopnParams {
  SeqParams seqs;
  const float* scores;  // [T, Hkv, Ns]
  int64_t s_st, s_sh;
  int32_t* indices;  // [T, Hkv, n]
  int64_t i_st, i_sh;
  int hkv;
  int lp, n_sel;
  ForcedBlocks forced;  // n_init, n_local, the backbone's offsets
  int64_t n_slc_max;  // Ns: scores columns a row may read (ceil(max_seqlen / l'))
};
void launch_select_topn(const TopnParams& p, cudaStream_t stream);
// Shared bytes per warp of the top-n kernel: its scores row and its chosen list, then from a
// 16-byte boundary its candidate scratch of 64 keys (common/topn_row.cuh, kTopnCandidates).
inline constexpr size_t kTopnCandidateBytes = 64 * sizeof(unsigned long long);
__host__ __device__ inline size_t topn_cand_offset(int64_t n_slc_max, int n_sel) {
  return (static_cast<size_t>(n_slc_max + n_sel) * sizeof(float) + 15) / 16 * 16;
}
__host__ __device__ inline size_t topn_smem_per_warp(int64_t n_slc_max, int n_sel) {
  return topn_cand_offset(n_slc_max, n_sel) + kTopnCandidateBytes;
}

}  // namespace nsa::cuda
