// Spec §4 on the GPU: one warp per (token, KV head) row of S, staged in shared memory and
// selected by warp_topn (common/topn_row.cuh, which says how).
#include "cuda/common/check.h"
#include "cuda/common/topn_row.cuh"
#include "cuda/forward/topn.cuh"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda {

namespace {

constexpr int kTopnWarps = 4;
static_assert(kTopnCandidateBytes == kTopnCandidates * sizeof(unsigned long long));
constexpr size_t kTopnSmemLimit = 200 * 1024;

__global__ void select_topn_kernel(const TopnParams p, int warps_per_block) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_id = int64_t(blockIdx.x) * warps_per_block + warp;
  if (row_id >= p.seqs.total_tokens * p.hkv) return;  // whole warp leaves together
  const int64_t tg = row_id / p.hkv;  // packed token
  const int hk = static_cast<int>(row_id % p.hkv);
  int64_t s0 = 0;
  if (p.seqs.cu_seqlens != nullptr) {  // the sequence holding tg: last b with cu[b] <= tg < cu[b+1]
    int lo = 0, hi = p.seqs.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.seqs.cu_seqlens[mid] <= tg) lo = mid;
      else hi = mid - 1;
    }
    s0 = p.seqs.cu_seqlens[lo];
  }
  const int64_t t = tg - s0;
  // The warp's slice (topn_smem_per_warp): its scores row, its chosen list, the candidate scratch.
  unsigned char* mine = smem + warp * topn_smem_per_warp(p.n_slc_max, p.n_sel);
  float* srow = reinterpret_cast<float*>(mine);
  int32_t* chosen = reinterpret_cast<int32_t*>(srow + p.n_slc_max);
  auto* cand = reinterpret_cast<unsigned long long*>(mine + topn_cand_offset(p.n_slc_max, p.n_sel));
  const int64_t J = last_slc_block(t, p.lp);
  const float* srcrow = p.scores + tg * p.s_st + hk * p.s_sh;
  const unsigned long long best = stage_topn_row(srow, J, p.forced, lane, [&](int64_t j) { return srcrow[j]; });
  __syncwarp();
  warp_topn(srow, J, p.n_sel, p.forced, chosen, p.indices + tg * p.i_st + hk * p.i_sh, 1, lane, best, cand);
}

}  // namespace

void launch_select_topn(const TopnParams& p, cudaStream_t stream) {
  const int64_t rows = p.seqs.total_tokens * p.hkv;
  if (rows == 0 || p.n_sel == 0) return;
  const size_t per_warp = topn_smem_per_warp(p.n_slc_max, p.n_sel);
  if (per_warp > kTopnSmemLimit)
    throw Error("max_seqlen / slc_block_len", std::to_string(p.n_slc_max),
                "is too large for the cuda top-n kernel (at most " +
                    std::to_string((kTopnSmemLimit - kTopnCandidateBytes) / sizeof(float) -
                                   p.n_sel) +
                    " selection blocks per sequence)");
  int warps = kTopnWarps;
  while (warps > 1 && per_warp * warps > kTopnSmemLimit) --warps;
  const size_t smem = per_warp * warps;
  NSA_CUDA_CHECK(cudaFuncSetAttribute(select_topn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (rows + warps - 1) / warps;
  select_topn_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(p, warps);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
