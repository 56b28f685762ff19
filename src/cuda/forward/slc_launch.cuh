// The selection forward's launcher: which per-token kernel runs (by whole blocks, by 16-key TMA
// steps, or by L1 loads), then the union tiles' kernel.
#pragma once

#include "cuda/forward/slc_attention_blocks.cuh"

namespace nsa::cuda {

// The per-token kernel (sm_90a with tensor maps: where l' = 64 and Dqk, Dv are 64 or 128 by whole
// blocks, slc_attention_blocks_kernel, unless CudaKernelChoices::slc_block_steps is off; else with Dqk,
// Dv up to 128 16 keys a step, slc_attention_tma_kernel; elsewhere slc_attention_kernel), then, on
// sm_90a with l' = 64 (and tensor maps, the warps' sorts fitting the ring, and the list in the
// workspace), the union tiles' kernel for the tiles with a small union, which the per-token kernel
// left in the list.
template <typename Storage, int kDqk, int kDv>
void launch_slc_attention(const BranchParams& p_in, cudaStream_t stream) {
  BranchParams p = p_in;
  const dim3 grid = row_tile_grid(p.seqs.max_seqlen, p.seqs.batch, (16 / p.group) * kSlcWarps, p.hkv);
  if (grid.x == 0) return;
  p.slc_union_tiles = false;
  const auto ukernel = slc_union_tile_kernel<Storage, kDqk, kDv>;
  const auto bkernel = slc_attention_blocks_kernel<Storage, kDqk, kDv>;
  const auto tkernel = slc_attention_tma_kernel<Storage, kDqk, kDv>;
  static_assert(kSlcBlockKeys == kKeyChunk, "the union tiles' chunks and the whole-block walk's steps are one block");
  // Where l' = 64, the union tiles and the whole-block walk read the same 64-row boxes: one pair of
  // maps, made when either runs.
  const bool union_tiles = p.lp == kKeyChunk && p.slc_union_list != nullptr && p.choices.slc_union_tiles &&
                           cmp_runs_wgmma(ukernel) && slc_union_sorts_fit(kDqk, kDv, p.sort_capacity);
  const bool block_steps = p.lp == kSlcBlockKeys && p.choices.slc_block_steps &&
                           slc_blocks_fits(kDqk, kDv, p.sort_capacity) && cmp_runs_wgmma(bkernel);
  SlcTmaMaps maps64{};
  const bool have_maps64 =
      (union_tiles || block_steps) &&
      kv_rows_tensor_map<Storage, kDqk>(&maps64.k, p.choices, p.k_slc, p.hkv, p.seqs.total_tokens, p.ks_st, p.ks_sh) &&
      kv_rows_tensor_map<Storage, kDv>(&maps64.v, p.choices, p.v_slc, p.hkv, p.seqs.total_tokens, p.vs_st, p.vs_sh);
  if (union_tiles && have_maps64) {
    p.slc_union_tiles = true;
    NSA_CUDA_CHECK(cudaMemsetAsync(p.slc_union_list, 0, sizeof(int32_t), stream));  // the count
  }
  SlcTmaMaps tmaps{};
  if (block_steps && have_maps64) {
    const size_t smem = slc_blocks_smem_bytes(kDqk, kDv, p.sort_capacity);
    allow_smem(bkernel, smem, /*max_carveout=*/true);  // six CTAs' buffers
    bkernel<<<dim3(grid.x * kSlcWarps, grid.y), 32, smem, stream>>>(p, maps64);
  } else if (slc_tma_fits(kDqk, kDv, p.sort_capacity) && cmp_runs_wgmma(tkernel) &&
      kv_rows_tensor_map<Storage, kDqk>(&tmaps.k, p.choices, p.k_slc, p.hkv, p.seqs.total_tokens, p.ks_st, p.ks_sh,
                                        16) &&
      kv_rows_tensor_map<Storage, kDv>(&tmaps.v, p.choices, p.v_slc, p.hkv, p.seqs.total_tokens, p.vs_st, p.vs_sh,
                                       16)) {
    const size_t smem = slc_tma_smem_bytes(kDqk, kDv, p.sort_capacity);
    allow_smem(tkernel, smem, /*max_carveout=*/true);  // the warps' rings
    tkernel<<<grid, kSlcWarpThreads, smem, stream>>>(p, tmaps);
  } else {
    const size_t smem = slc_smem_bytes(kDqk, kDv, p.sort_capacity);
    const auto kernel = slc_attention_kernel<Storage, kDqk, kDv>;
    allow_smem(kernel, smem, /*max_carveout=*/false);  // neighbouring warps' K/V rows hit in L1
    kernel<<<grid, kSlcWarpThreads, smem, stream>>>(p);
  }
  NSA_CUDA_CHECK_LAUNCH();
  if (!p.slc_union_tiles) return;
  const size_t usmem = slc_union_smem_bytes(kDqk, kDv);
  allow_smem(ukernel, usmem, /*max_carveout=*/true);
  // Persistent: as many CTAs as fit at once (the list's length is known only on the device).
  int64_t ctas = std::min<int64_t>(int64_t(grid.x) * grid.y, resident_ctas(ukernel, kSlcWarpThreads, usmem));
  if (p.choices.slc_union_ctas > 0) ctas = std::min<int64_t>(ctas, p.choices.slc_union_ctas);
  ukernel<<<static_cast<unsigned>(ctas), kSlcWarpThreads, usmem, stream>>>(p, grid.x, maps64.k, maps64.v);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
