// The CPU reference backend: plain fp64 loops that read as the spec (../../docs/semantics.md).
//
// Every stage works on dense row-major fp64 arrays (Array) loaded from and stored to the
// caller's tensor views. Names follow the paper: phi, p_cmp, S, g, o_cmp/o_slc/o_win.
// Slow on purpose; the fast backends are tested against it.
#pragma once

#include <cstdint>
#include <vector>

#include "common/plan.h"

namespace nsa::reference {

// A dense row-major fp64 array (up to 4 dims).
struct Array {
  std::vector<int64_t> shape;
  std::vector<double> data;

  Array() = default;
  explicit Array(std::vector<int64_t> s);
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
  double* row(int64_t i) { return data.data() + i * stride0(); }
  const double* row(int64_t i) const { return data.data() + i * stride0(); }
  // Element pointer of [i, j, :] for a 3-D array.
  double* at(int64_t i, int64_t j) { return data.data() + (i * dim(1) + j) * dim(2); }
  const double* at(int64_t i, int64_t j) const { return data.data() + (i * dim(1) + j) * dim(2); }
  int64_t stride0() const;
};

// Copies a tensor view (any float dtype, any strides) into fp64, and back (rounding to the
// view's dtype). An absent view loads as an empty Array.
Array load(const TensorView& t);
void store(const Array& a, const TensorView& t);
std::vector<int32_t> load_indices(const TensorView& t);  // [T, Hkv, n] int32, dense
void store_indices(const std::vector<int32_t>& idx, const TensorView& t);

// phi's parameters in fp64 (absent ones empty).
struct Phi {
  Array w1, b1, w2, b2, pe;
};
Phi load_phi(const PhiParams& p);
void store_phi(const Phi& p, const PhiParams& view);
Phi zeros_like(const Phi& p);

// ---- Stages (spec sections in brackets) ----------------------------------------------------

// [§2] xc [T/d, H, D] = phi(x [T, H, D]) per sequence (packed layout of blocks.h).
Array phi_forward(const detail::Plan& p, const Phi& phi, const Array& x);
// [§2] dx [T, H, D] and dphi from dxc (both written from zero).
void phi_backward(const detail::Plan& p, const Phi& phi, const Array& x, const Array& dxc, Array& dx,
                  Phi& dphi);

// [§2, §3] o_cmp [T, Hq, Dv], lse [T, Hq] and (when scores != nullptr) S [T, Hkv, Ns].
void cmp_attention(const detail::Plan& p, const Array& q, const Array& kc, const Array& vc, Array& o,
                   Array& lse, Array* scores);
// [§4] indices [T, Hkv, n] from S [T, Hkv, Ns].
std::vector<int32_t> select_topn(const detail::Plan& p, const Array& scores);
// [§5] selection branch with the given indices.
void slc_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                   const std::vector<int32_t>& indices, Array& o, Array& lse);
// [§6] sliding-window branch.
void win_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v, Array& o,
                   Array& lse);
// Dense causal attention (all positions 0..t): the baseline.
void dense_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v, Array& o,
                     Array& lse);

// Backward of the three branches and of dense attention, given each branch's output gradient
// d_o [T, Hq, Dv] (already multiplied by the gate); accumulates into dq, dk, dv.
void cmp_attention_backward(const detail::Plan& p, const Array& q, const Array& kc, const Array& vc,
                            const Array& d_o, Array& dq, Array& dkc, Array& dvc);
void slc_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                            const std::vector<int32_t>& indices, const Array& d_o, Array& dq,
                            Array& dk, Array& dv);
void win_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                            const Array& d_o, Array& dq, Array& dk, Array& dv);
void dense_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                              const Array& d_o, Array& dq, Array& dk, Array& dv);

}  // namespace nsa::reference
