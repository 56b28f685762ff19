// The CPU reference backend: plain fp64 loops that read as the spec (../../docs/semantics.md).
//
// Every stage works on dense row-major fp64 arrays (Array) loaded from and stored to the
// caller's tensor views. Names follow the paper: phi, p_cmp, S, g, o_cmp/o_slc/o_win.
// Slow on purpose; the fast backends are tested against it.
#pragma once

#include <cstdint>
#include <limits>
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

// One element of a view at a strided offset (elements), as fp64, and back (rounded to its dtype).
double load_element(const TensorView& t, int64_t offset);
void store_element(const TensorView& t, int64_t offset, double v);

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

// ---- One query (the pieces every stage and the decode path are made of) ---------------------

// Softmax attention of one query over key rows `rows` of K/V [rows, Hkv, D] (KV head hk).
struct RowAttention {
  std::vector<double> p;  // probabilities, one per key row
  std::vector<double> o;  // [Dv]
  double lse = -std::numeric_limits<double>::infinity();  // log sum_j exp(s_j); -inf without keys
};
RowAttention attend(const double* q, const Array& K, const Array& V, int64_t hk, const std::vector<int64_t>& rows,
                    double scale);
// [§3] S[j] += sum_i ov(i, j) p_cmp[i]: one head's compressed probabilities over blocks 0..C-1.
void add_scores(const Config& cfg, const std::vector<double>& p_cmp, double* S);
// [§4] the blocks query t selects from its scores S[0 .. J_t], ascending.
std::vector<int64_t> select_blocks(const Config& cfg, int64_t t, const double* S);
// [§5] positions of the selected blocks' tokens at or before t (blocks: a set; -1 entries ignored).
std::vector<int64_t> selected_positions(const Config& cfg, const std::vector<int64_t>& blocks, int64_t t);

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

// ---- Decoding (spec §10; reference/decode.cpp) ----------------------------------------------

void cache_append(const detail::Plan& p, const PagedCache& cache, const CacheAppend& in, Workspace ws);
void decode(const detail::Plan& p, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out,
            Workspace ws);
void dense_decode(const detail::Plan& p, const KV& pages, const PageTable& table, const TensorView& q,
                  const TensorView& o, const TensorView& lse, Workspace ws);

// ---- Rotary embeddings (reference/rotary.cpp) --------------------------------------------------

// api.h rotary, in the precision it defines (fp32, or fp64 for f64 tensors), not in fp64 throughout.
void rotary(const detail::Plan& p, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
            const TensorView& out, bool inverse);

}  // namespace nsa::reference
