// Test support: owned host tensors, random problems, comparisons. Header-only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "nsa/nsa.h"

namespace nsa::test {

// A host tensor that owns its (contiguous) storage.
// A row-major view with no gaps of `shape` at `data` on `device`.
inline TensorView contiguous_view(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device = Device::cpu) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  t.device = device;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[static_cast<size_t>(d)];
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_.assign(static_cast<size_t>(n) * dtype_size(dtype) + 16, 0);  // +16: never a null pointer
  }
  bool defined() const { return !shape_.empty(); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return defined() ? n : 0;
  }
  const std::vector<int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  void* data() { return bytes_.data(); }

  TensorView view() { return defined() ? contiguous_view(bytes_.data(), dtype_, shape_) : TensorView{}; }

  double get(int64_t i) const {
    const char* p = reinterpret_cast<const char*>(bytes_.data());
    uint16_t h;
    switch (dtype_) {
      case DType::f32: return reinterpret_cast<const float*>(p)[i];
      case DType::f64: return reinterpret_cast<const double*>(p)[i];
      case DType::i32: return reinterpret_cast<const int32_t*>(p)[i];
      case DType::bf16: std::memcpy(&h, p + 2 * i, 2); return detail::bf16_to_f32(h);
      case DType::f16: std::memcpy(&h, p + 2 * i, 2); return detail::f16_to_f32(h);
    }
    return 0;
  }
  void set(int64_t i, double v) {
    char* p = reinterpret_cast<char*>(bytes_.data());
    uint16_t h;
    switch (dtype_) {
      case DType::f32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); return;
      case DType::f64: reinterpret_cast<double*>(p)[i] = v; return;
      case DType::i32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
      case DType::bf16: h = detail::f32_to_bf16(static_cast<float>(v)); std::memcpy(p + 2 * i, &h, 2); return;
      case DType::f16: h = detail::f32_to_f16(static_cast<float>(v)); std::memcpy(p + 2 * i, &h, 2); return;
    }
  }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[static_cast<size_t>(i)] = get(i);
    return v;
  }
  void fill_uniform(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (int64_t i = 0; i < numel(); ++i) set(i, u(rng));
  }
  // Fills with NaN (or -7777 for int32) so an unwritten element is caught.
  void poison() {
    for (int64_t i = 0; i < numel(); ++i)
      set(i, dtype_ == DType::i32 ? -7777.0 : std::numeric_limits<double>::quiet_NaN());
  }

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<unsigned char> bytes_;
};

struct Sizes {
  std::vector<int32_t> seqlens = {100};  // packed sequences
  int64_t hq = 2, hkv = 1, dqk = 8, dv = 8;
  int64_t phi_hidden = 6;
  DType dtype = DType::f64;
};

// A Config from the spec's symbols, for tables of test cases.
// A context for backend b (the other fields at their defaults).
inline Context context_of(Backend b, int num_threads = 0) {
  Context c;
  c.backend = b;
  c.num_threads = num_threads;
  return c;
}

inline Config make_config(int64_t l, int64_t d, int64_t lp, int64_t n, int64_t n_init, int64_t n_local,
                          int64_t w, PhiKind phi, bool shared_kv = false) {
  Config c;
  c.cmp_block_len = l;
  c.cmp_stride = d;
  c.slc_block_len = lp;
  c.n_selected = n;
  c.n_init = n_init;
  c.n_local = n_local;
  c.window = w;
  c.phi = phi;
  c.shared_kv = shared_kv;
  return c;
}

// The paper's l = 32, d = 16, l' = 64 scaled down by 4; n = 3 with one initial and one local
// block, w = 12, phi an MLP.
inline Config small_config() { return make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp); }

inline Sizes make_sizes(std::vector<int32_t> seqlens, int64_t hq, int64_t hkv, int64_t dqk, int64_t dv,
                        int64_t phi_hidden = 6) {
  return Sizes{std::move(seqlens), hq, hkv, dqk, dv, phi_hidden, DType::f64};
}

// A whole random problem: inputs, outputs and gradients, all owned.
struct LayerProblem {
  Config cfg;
  Sizes sizes;
  int64_t T = 0;
  HostTensor q, g, cu;
  HostTensor k[3], v[3];
  HostTensor phi_k[5], phi_v[5];  // w1, b1, w2, b2, pe
  HostTensor o, lse, indices, o_branch, d_o;
  HostTensor dq, dg, dk[3], dv[3], dphi_k[5], dphi_v[5];

  static PhiParams params(HostTensor* t) {
    return PhiParams{t[0].view(), t[1].view(), t[2].view(), t[3].view(), t[4].view()};
  }
  // Views of q, k/v, g and phi's parameters in the order Inputs and Gradients share.
  template <class Views>
  static Views layer_views(HostTensor& x, HostTensor* ks, HostTensor* vs, HostTensor& gates, HostTensor* pk,
                           HostTensor* pv) {
    return Views{x.view(), {KV{ks[0].view(), vs[0].view()}, KV{ks[1].view(), vs[1].view()}, KV{ks[2].view(), vs[2].view()}},
                 gates.view(), params(pk), params(pv)};
  }
  Inputs inputs() {
    Inputs in = layer_views<Inputs>(q, k, v, g, phi_k, phi_v);
    if (sizes.seqlens.size() != 1) in.seqs.cu_seqlens = cu.view();
    return in;
  }
  ForwardOutputs outputs() { return ForwardOutputs{o.view(), lse.view(), indices.view(), o_branch.view()}; }
  Gradients gradients() { return layer_views<Gradients>(dq, dk, dv, dg, dphi_k, dphi_v); }
};

inline void make_phi(const Config& cfg, int64_t D, int64_t F, DType dt, HostTensor* out,
                     std::mt19937_64* rng) {
  const int64_t l = cfg.cmp_block_len;
  for (int i = 0; i < 5; ++i) out[i] = HostTensor();
  if (cfg.phi == PhiKind::linear) {
    out[0] = HostTensor(dt, {D, l * D});
    out[4] = HostTensor(dt, {l, D});
  } else if (cfg.phi == PhiKind::mlp) {
    out[0] = HostTensor(dt, {F, l * D});
    out[1] = HostTensor(dt, {F});
    out[2] = HostTensor(dt, {D, F});
    out[3] = HostTensor(dt, {D});
    out[4] = HostTensor(dt, {l, D});
  }
  if (rng == nullptr) return;
  // Scaled so that phi's output has roughly unit size.
  const double s1 = 1.0 / std::sqrt(static_cast<double>(l * D));
  if (out[0].defined()) out[0].fill_uniform(*rng, -2 * s1, 2 * s1);
  if (out[1].defined()) out[1].fill_uniform(*rng, -0.5, 0.5);
  if (out[2].defined()) out[2].fill_uniform(*rng, -1.5 / std::sqrt(double(F)), 1.5 / std::sqrt(double(F)));
  if (out[3].defined()) out[3].fill_uniform(*rng, -0.5, 0.5);
  if (out[4].defined()) out[4].fill_uniform(*rng, -0.5, 0.5);
}

// Random inputs in [-1, 1] (q, k, v), gates in [0, 1]; outputs poisoned.
inline LayerProblem make_problem(const Config& cfg, const Sizes& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  LayerProblem p;
  p.cfg = cfg;
  p.sizes = s;
  p.T = 0;
  for (int32_t n : s.seqlens) p.T += n;
  const int64_t T = p.T;
  p.cu = HostTensor(DType::i32, {static_cast<int64_t>(s.seqlens.size()) + 1});
  int64_t acc = 0;
  p.cu.set(0, 0);
  for (size_t b = 0; b < s.seqlens.size(); ++b) p.cu.set(static_cast<int64_t>(b) + 1, double(acc += s.seqlens[b]));
  p.q = HostTensor(s.dtype, {T, s.hq, s.dqk});
  p.q.fill_uniform(rng, -1, 1);
  const int nkv = cfg.shared_kv ? 1 : 3;
  for (int b = 0; b < nkv; ++b) {
    p.k[b] = HostTensor(s.dtype, {T, s.hkv, s.dqk});
    p.v[b] = HostTensor(s.dtype, {T, s.hkv, s.dv});
    p.k[b].fill_uniform(rng, -1, 1);
    p.v[b].fill_uniform(rng, -1, 1);
    p.dk[b] = HostTensor(s.dtype, {T, s.hkv, s.dqk});
    p.dv[b] = HostTensor(s.dtype, {T, s.hkv, s.dv});
    p.dk[b].poison();
    p.dv[b].poison();
  }
  p.g = HostTensor(s.dtype, {T, s.hq, 3});
  p.g.fill_uniform(rng, 0, 1);
  make_phi(cfg, s.dqk, s.phi_hidden, s.dtype, p.phi_k, &rng);
  make_phi(cfg, s.dv, s.phi_hidden, s.dtype, p.phi_v, &rng);
  make_phi(cfg, s.dqk, s.phi_hidden, s.dtype, p.dphi_k, nullptr);
  make_phi(cfg, s.dv, s.phi_hidden, s.dtype, p.dphi_v, nullptr);
  for (int i = 0; i < 5; ++i) {
    if (p.dphi_k[i].defined()) p.dphi_k[i].poison();
    if (p.dphi_v[i].defined()) p.dphi_v[i].poison();
  }
  p.o = HostTensor(s.dtype, {T, s.hq, s.dv});
  p.o.poison();
  p.o_branch = HostTensor(s.dtype, {3, T, s.hq, s.dv});
  p.o_branch.poison();
  p.lse = HostTensor(DType::f32, {T, s.hq, 3});
  p.lse.poison();
  p.indices = HostTensor(DType::i32, {T, s.hkv, cfg.n_selected});
  p.indices.poison();
  p.d_o = HostTensor(s.dtype, {T, s.hq, s.dv});
  p.d_o.fill_uniform(rng, -1, 1);
  p.dq = HostTensor(s.dtype, {T, s.hq, s.dqk});
  p.dq.poison();
  p.dg = HostTensor(s.dtype, {T, s.hq, 3});
  p.dg.poison();
  return p;
}

// max |a - b| over elements; NaN anywhere (in one and not the other) gives +inf.
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace nsa::test
