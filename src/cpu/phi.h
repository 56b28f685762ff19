// phi (spec §2) on the CPU backend: compressed keys/values from raw blocks, and its gradients.
// Blocks are processed kPhiTile at a time as small matrix products (U [blocks, l*D] times the
// packed weights), every (block, head) written by one work item.
#pragma once

#include "cpu/common.h"

namespace nsa::cpu {

// Bytes phi needs: `shared` for packed weights and block lists, `slot` per thread.
void phi_sizes(const Config& cfg, int64_t T, int64_t B, int64_t H, int64_t D, int64_t F, bool backward,
               Sizer& shared, Sizer& slot);

// xc [T/d][H][D] fp32 = phi(x) for every compressed block of every sequence (other rows untouched).
void phi_forward(const Plan& p, const PhiParams& phi, const TensorView& x, float* xc, Arena& shared,
                 const Slots& slots);

// From dxc [T/d][H][D] fp32: dx [T][H][D] (written to `dx`, or added to `dx_acc` fp32 when it is
// not null) and the parameter gradients dphi (written; absent for mean).
void phi_backward(const Plan& p, const PhiParams& phi, const TensorView& x, const float* dxc,
                  const TensorView& dx, float* dx_acc, const PhiParams& dphi, Arena& shared,
                  const Slots& slots);

// The same for a few blocks (decoding's appends): the weights are read row by row in place of
// being packed, each output one dot product (items = blocks x heads, fewer than kPhiTile). x holds
// one block per sequence of the plan (l tokens each). Bytes of `shared` and per thread:
void phi_rows_sizes(const Config& cfg, int64_t blocks, int64_t H, int64_t D, int64_t F, Sizer& shared, Sizer& slot);
void phi_forward_rows(const Plan& p, const PhiParams& phi, const TensorView& x, float* xc, Arena& shared,
                      const Slots& slots);

}  // namespace nsa::cpu
