// The CUDA backward pass of the whole NSA layer (spec §8), see docs/cuda_backward.md.
//
// Entry points the CUDA backend's BackendOps table points at. The API layer has validated every
// argument (src/api.cpp); these functions only check what is specific to the CUDA backward
// (dtype, head dims) and fail with nsa::Error otherwise.
#pragma once

#include <cstddef>

#include "common/plan.h"

namespace nsa::cuda::bwd {

// Bytes of workspace backward() needs for `problem` (everything it recomputes or reorders:
// compressed keys/values, phi's hidden layer, dg in fp32, the inverted selection index, and the
// split partial sums of the compressed branch's dk/dv and of phi's parameter gradients).
size_t backward_workspace_size(const Context& ctx, const Config& cfg, const Problem& problem);

// Spec §8 on the GPU: every gradient is written (not accumulated). Deterministic: no
// floating-point atomics anywhere, every reduction in a fixed order.
void backward(const detail::Plan& plan, const Inputs& in, const ForwardOutputs& saved,
              const TensorView& d_o, const Gradients& grads, Workspace ws);

// Bytes of workspace compress_bwd() needs (the sequence table, dy in fp32, mlp's hidden layer, the
// parameter gradients' split partials).
size_t compress_bwd_workspace_size(const Context& ctx, const Config& cfg, const Problem& problem);

// compress_fwd's gradients on the GPU: dx (written for every token) and dphi (written; absent
// for mean) from dxc; rows of dxc without a compressed block are ignored. Deterministic.
void compress_bwd(const detail::Plan& plan, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace ws);

}  // namespace nsa::cuda::bwd
