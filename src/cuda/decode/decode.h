// The CUDA backend's decoding (nsa/cache.h): the BackendOps entries (decode/backend.cpp) and the
// launchers of the kernels they run, in call order:
//   cache_append:  scatter_kernel, then phi (append.cu)
//   decode:        cmp_partial -> select -> sparse_partial -> combine
//   dense_decode:  select (checks only) -> sparse_partial (window = everything) -> combine
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/plan.h"
#include "cuda/params.h"

namespace nsa::cuda::decode {

// Heads of one slot a phi CTA stages at once (their inputs in fp32 shared memory).
inline constexpr int kMaxHeadsPerCta = 4;
// Shared memory a phi CTA may use for its inputs.
inline constexpr size_t kPhiSmemBudget = 96 * 1024;
// A compressed block's tokens a phi CTA addresses (their row pointers sit in shared memory).
inline constexpr int kMaxBlockTokens = 1024;

template <typename S>
void launch_append(const AppendParams& p, cudaStream_t stream);
size_t phi_layer_smem(int heads_per_cta, int64_t k);

template <typename S, int kDqk, int kDv>
void launch_cmp_partial(const DecodeParams& p, cudaStream_t stream);
template <typename S, int kDqk, int kDv>
void launch_sparse_partial(const DecodeParams& p, cudaStream_t stream);
void launch_select(const DecodeParams& p, int64_t ns_max, cudaStream_t stream);
size_t select_smem(const DecodeParams& p, int64_t ns_max);
template <typename S>
void launch_combine(const DecodeParams& p, cudaStream_t stream);

// BackendOps entries and the workspace sizes of Op::cache_append, Op::decode, Op::dense_decode.
void cache_append(const detail::Plan& p, const PagedCache& cache, const CacheAppend& in, Workspace ws);
void decode(const detail::Plan& p, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out,
            Workspace ws);
void dense_decode(const detail::Plan& p, const KV& pages, const PageTable& table, const TensorView& q,
                  const TensorView& o, const TensorView& lse, Workspace ws);
size_t workspace_size(Op op, const Config& cfg, const Problem& pr);

}  // namespace nsa::cuda::decode

// One (storage, Dqk, Dv) of the attend kernels, in decode/instantiations/.
#define NSA_DECODE_INSTANTIATE(S, DQK, DV)                                                              \
  template <>                                                                                          \
  void launch_cmp_partial<S, DQK, DV>(const DecodeParams& p, cudaStream_t stream) {                    \
    const size_t smem = cmp_partial_smem<S, DQK, DV>(p.cmp_chunk);                                     \
    NSA_CUDA_CHECK(cudaFuncSetAttribute(cmp_partial_kernel<S, DQK, DV>,                                \
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))); \
    cmp_partial_kernel<S, DQK, DV><<<dim3(p.pages.rows, p.hkv, p.cmp_splits), kCmpThreads, smem, stream>>>(p); \
    NSA_CUDA_CHECK_LAUNCH();                                                                           \
  }                                                                                                    \
  template <>                                                                                          \
  void launch_sparse_partial<S, DQK, DV>(const DecodeParams& p, cudaStream_t stream) {                 \
    const size_t smem = sparse_partial_smem<S, DQK, DV>();                                             \
    NSA_CUDA_CHECK(cudaFuncSetAttribute(sparse_partial_kernel<S, DQK, DV>,                             \
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))); \
    const int splits = (p.dense ? 0 : p.slc_ctas) + p.win_splits;                                         \
    sparse_partial_kernel<S, DQK, DV><<<dim3(p.pages.rows, p.hkv, splits), kSparseThreads, smem, stream>>>(p); \
    NSA_CUDA_CHECK_LAUNCH();                                                                           \
  }
