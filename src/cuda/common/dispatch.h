// The one dispatcher of the CUDA backend, from run-time (dtype, Dqk, Dv) to the compiled
// templates: every room's launcher goes through it (host code; C++17, so nvcc's sources use it too).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/launch.h"
#include "nsa/tensor.h"

namespace nsa::cuda {

// Runs fn.template operator()<Storage>() for the storage dtype (bf16 or f16; else an nsa::Error).
template <typename Fn>
void dispatch_storage(DType dtype, Fn&& fn) {
  require_storage_dtype(dtype);
  if (dtype == DType::bf16) fn.template operator()<__nv_bfloat16>();
  else fn.template operator()<__half>();
}

// Runs fn.template operator()<Storage, Dqk, Dv>() for the compiled head dims (else an nsa::Error
// naming the value).
template <typename Storage, typename Fn>
void dispatch_dims(int64_t dqk, int64_t dv, Fn&& fn) {
  switch (dqk * 1000 + dv) {
    case 64064: fn.template operator()<Storage, 64, 64>(); return;
    case 64128: fn.template operator()<Storage, 64, 128>(); return;
    case 128064: fn.template operator()<Storage, 128, 64>(); return;
    case 128128: fn.template operator()<Storage, 128, 128>(); return;
    case 192064: fn.template operator()<Storage, 192, 64>(); return;
    case 192128: fn.template operator()<Storage, 192, 128>(); return;
  }
  require_supported_dims(dqk, dv);  // throws
}

// Both: fn.template operator()<Storage, Dqk, Dv>().
template <typename Fn>
void dispatch(DType dtype, int64_t dqk, int64_t dv, Fn&& fn) {
  require_storage_dtype(dtype);
  require_supported_dims(dqk, dv);
  if (dtype == DType::bf16) dispatch_dims<__nv_bfloat16>(dqk, dv, fn);
  else dispatch_dims<__half>(dqk, dv, fn);
}

}  // namespace nsa::cuda
