// Launch utilities shared by the CUDA forward and backward: streams, workspace carving,
// run-time -> compile-time dispatch of dtype and head dims, and the supported-value checks.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/plan.h"
#include "cuda/common/constants.h"
#include "nsa/error.h"

namespace nsa::cuda {

inline cudaStream_t stream_of(const detail::Plan& p) { return static_cast<cudaStream_t>(p.ctx.stream); }

// The call's kernel choices (Context::cuda_choices; the defaults when it has none).
inline const CudaKernelChoices& choices_of(const Context& ctx) {
  static const CudaKernelChoices kDefaults;
  return ctx.cuda_choices != nullptr ? *ctx.cuda_choices : kDefaults;
}

// CTAs of `threads` threads that cover n items (one item per thread).
inline unsigned blocks_for(int64_t n, int threads = 256) { return unsigned((n + threads - 1) / threads); }

inline constexpr size_t kWorkspaceAlign = 256;
inline constexpr size_t align_up(size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Hands out consecutive aligned pieces of one workspace. With data == nullptr it only counts,
// so workspace_size() and the call that uses the workspace share one description of the layout.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* data = nullptr) : base_(static_cast<char*>(data)) {}
  template <typename T>
  T* take(size_t count) {
    char* p = base_ ? base_ + used_ : nullptr;
    used_ += align_up(count * sizeof(T));
    return reinterpret_cast<T*>(p);
  }
  size_t bytes() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// The head dims, group sizes and dtypes the CUDA kernels are compiled for.
inline void require_supported_dims(int64_t dqk, int64_t dv) {
  if (dqk != 64 && dqk != 128 && dqk != 192)
    throw Error("Dqk", std::to_string(dqk), "is not supported by the cuda backend (supported: 64, 128, 192)");
  if (dv != 64 && dv != 128)
    throw Error("Dv", std::to_string(dv), "is not supported by the cuda backend (supported: 64, 128)");
}
inline void require_supported_group(int64_t group) {
  if (group != 1 && group != 2 && group != 4 && group != 8 && group != 16)
    throw Error("G = Hq / Hkv", std::to_string(group),
                "is not supported by the cuda backend (supported: 1, 2, 4, 8, 16)");
}
inline void require_storage_dtype(DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16)
    throw Error("dtype", dtype_name(dtype), "is not supported by the cuda backend (supported: bf16, f16)");
}
// The kernels move rows in 16-byte pieces (cp.async, TMA, vector loads and stores): every row of
// a 16-bit tensor must start on 16 bytes. `name`: the parameter, as the error names it.
inline void require_rows_aligned(const std::string& name, const TensorView& t) {
  if (!t.defined()) return;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    throw Error(name + ".data", "not 16-byte aligned", "the cuda backend needs 16-byte aligned tensors");
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[d] > 1 && t.stride[d] % 8 != 0)
      throw Error(name + ".stride[" + std::to_string(d) + "]", std::to_string(t.stride[d]),
                  "must be a multiple of 8 elements on the cuda backend (rows start on 16 bytes)");
}

}  // namespace nsa::cuda
