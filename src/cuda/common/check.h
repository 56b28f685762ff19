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
