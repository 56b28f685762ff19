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
  const size_t per_warp = static_cast<size_t>(p.n_slc_max + p.n_sel);  // floats, as topn_smem_per_warp
  float* srow = reinterpret_cast<float*>(smem) + warp * per_warp;
  int32_t* chosen = reinterpret_cast<int32_t*>(srow + p.n_slc_max);
  const int64_t J = last_slc_block(t, p.lp);
  const float* srcrow = p.scores + tg * p.s_st + hk * p.s_sh;
  stage_topn_row(srow, J, p.forced, lane, [&](int64_t j) { return srcrow[j]; });
  __syncwarp();
  warp_topn(srow, J, p.n_sel, p.forced, chosen, p.indices + tg * p.i_st + hk * p.i_sh, 1, lane);
}

}  // namespace

size_t topn_smem_per_warp(int64_t n_slc_max, int n_sel) {
  return static_cast<size_t>(n_slc_max + n_sel) * sizeof(float);
}

void launch_select_topn(const TopnParams& p, cudaStream_t stream) {
  const int64_t rows = p.seqs.total_tokens * p.hkv;
  if (rows == 0 || p.n_sel == 0) return;
  const size_t per_warp = topn_smem_per_warp(p.n_slc_max, p.n_sel);
  if (per_warp > kTopnSmemLimit)
    throw Error("max_seqlen / slc_block_len", std::to_string(p.n_slc_max),
                "is too large for the cuda top-n kernel (at most " +
                    std::to_string(kTopnSmemLimit / sizeof(float) - p.n_sel) + " selection blocks per sequence)");
  int warps = kTopnWarps;
  while (warps > 1 && per_warp * warps > kTopnSmemLimit) --warps;
  const size_t smem = per_warp * warps;
  NSA_CUDA_CHECK(cudaFuncSetAttribute(select_topn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (rows + warps - 1) / warps;
  select_topn_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(p, warps);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
