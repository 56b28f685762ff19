// fp64 arrays of the reference backend and their conversion from/to tensor views.
#include <cstring>

#include "common/half.h"
#include "reference/reference.h"

namespace nsa::reference {

Array::Array(std::vector<int64_t> s) : shape(std::move(s)) {
  if (shape.empty()) return;  // an absent tensor
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  data.assign(static_cast<size_t>(n), 0.0);
}

int64_t Array::stride0() const {
  int64_t s = 1;
  for (size_t i = 1; i < shape.size(); ++i) s *= shape[i];
  return s;
}

double load_element(const TensorView& t, int64_t offset) {
  const char* base = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[offset];
    case DType::f64: return static_cast<const double*>(t.data)[offset];
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, base + offset * 2, 2);
      return detail::bf16_to_f32(h);
    }
    case DType::f16: {
      uint16_t h;
      std::memcpy(&h, base + offset * 2, 2);
      return detail::f16_to_f32(h);
    }
    case DType::i32: return static_cast<const int32_t*>(t.data)[offset];
  }
  return 0.0;
}

void store_element(const TensorView& t, int64_t offset, double v) {
  char* base = static_cast<char*>(t.data);
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[offset] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(t.data)[offset] = v; return;
    case DType::bf16: {
      const uint16_t h = detail::f32_to_bf16(static_cast<float>(v));
      std::memcpy(base + offset * 2, &h, 2);
      return;
    }
    case DType::f16: {
      const uint16_t h = detail::f32_to_f16(static_cast<float>(v));
      std::memcpy(base + offset * 2, &h, 2);
      return;
    }
    case DType::i32: static_cast<int32_t*>(t.data)[offset] = static_cast<int32_t>(v); return;
  }
}

namespace {

// Calls fn(dense_index, strided_offset) for every element in row-major order.
template <typename Fn>
void for_each_element(const TensorView& t, Fn fn) {
  int64_t idx[kMaxDims] = {};
  const int64_t n = t.numel();
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.stride[d];
    fn(e, off);
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

Array load(const TensorView& t) {
  if (!t.defined()) return Array();
  Array a(std::vector<int64_t>(t.shape, t.shape + t.ndim));
  for_each_element(t, [&](int64_t e, int64_t off) { a.data[static_cast<size_t>(e)] = load_element(t, off); });
  return a;
}

void store(const Array& a, const TensorView& t) {
  if (!t.defined()) return;
  for_each_element(t, [&](int64_t e, int64_t off) { store_element(t, off, a.data[static_cast<size_t>(e)]); });
}

std::vector<int32_t> load_indices(const TensorView& t) {
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  for_each_element(t, [&](int64_t e, int64_t off) { v[static_cast<size_t>(e)] = static_cast<const int32_t*>(t.data)[off]; });
  return v;
}

void store_indices(const std::vector<int32_t>& idx, const TensorView& t) {
  for_each_element(t, [&](int64_t e, int64_t off) { static_cast<int32_t*>(t.data)[off] = idx[static_cast<size_t>(e)]; });
}

Phi load_phi(const PhiParams& p) { return Phi{load(p.w1), load(p.b1), load(p.w2), load(p.b2), load(p.pe)}; }

void store_phi(const Phi& p, const PhiParams& view) {
  store(p.w1, view.w1);
  store(p.b1, view.b1);
  store(p.w2, view.w2);
  store(p.b2, view.b2);
  store(p.pe, view.pe);
}

Phi zeros_like(const Phi& p) {
  return Phi{Array(p.w1.shape), Array(p.b1.shape), Array(p.w2.shape), Array(p.b2.shape), Array(p.pe.shape)};
}

}  // namespace nsa::reference
