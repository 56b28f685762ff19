// CUDA error checks shared by every CUDA source of the backend (forward and backward).
//
// Every runtime call and every launch goes through NSA_CUDA_CHECK / NSA_CUDA_CHECK_LAUNCH; a
// failure becomes an nsa::Error naming the call, the CUDA error and where it happened.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "nsa/error.h"

namespace nsa::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(std::string("CUDA call ") + what, cudaGetErrorName(err),
              std::string(cudaGetErrorString(err)) + " (at " + file + ":" + std::to_string(line) + ")");
}

}  // namespace nsa::cuda

#define NSA_CUDA_CHECK(expr)                                                                  \
  do {                                                                                        \
    const cudaError_t nsa_cuda_err_ = (expr);                                                 \
    if (nsa_cuda_err_ != cudaSuccess)                                                         \
      ::nsa::cuda::throw_cuda_error(nsa_cuda_err_, #expr, __FILE__, __LINE__);                \
  } while (0)

// After a <<<...>>> launch: catches bad launch configurations (the kernel runs asynchronously).
#define NSA_CUDA_CHECK_LAUNCH() NSA_CUDA_CHECK(cudaGetLastError())

namespace nsa::cuda {

// Dynamic shared memory above 48 KB must be allowed per kernel. max_carveout: also ask for the
// largest shared-memory split of the unified L1/shared array (kernels that need two ~105 KB
// blocks per SM); without it the driver keeps the L1 that kernels reading through L1 want.
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes, bool max_carveout) {
  NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (max_carveout)
    NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
}

// How many CTAs of `kernel` (`threads` threads, `smem` dynamic shared bytes, allowed already) the
// device holds at once: SMs x CTAs an SM (at least one an SM).
template <typename Kernel>
int resident_ctas(Kernel* kernel, int threads, size_t smem) {
  int device = 0, sms = 0, per_sm = 0;
  NSA_CUDA_CHECK(cudaGetDevice(&device));
  NSA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  NSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return sms * (per_sm > 0 ? per_sm : 1);
}

// The grid of the row-tile kernels: x = the tiles of `tokens_per_tile` tokens of every sequence
// (max_seqlen bounds them; a tile past its sequence's end returns at once), y = KV heads.
inline dim3 row_tile_grid(int64_t max_seqlen, int64_t batch, int tokens_per_tile, int hkv) {
  const int64_t tiles = (max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
  return dim3(static_cast<unsigned>(tiles * batch), static_cast<unsigned>(hkv));
}

}  // namespace nsa::cuda
