// Rotary position embeddings (api.h rotary), GPT-NeoX layout, as the declaration reads.
//
// Unlike the attention stages, which the reference computes in fp64 whatever the dtype, this
// computes in the precision the operation defines: fp32 for f32/bf16/f16 tensors (the angle an fp32
// product, cos and sin of it in fp32, every product and the difference/sum rounded to fp32, then the
// result once to the dtype), fp64 for f64 tensors. The fast backends reproduce exactly that, so they
// are compared with it bit for bit. This file is compiled without floating-point contraction
// (src/reference/CMakeLists.txt): x1 * c - x2 * s is two products and one difference, never an FMA.
#include <cmath>
#include <cstdint>

#include "reference/reference.h"

namespace nsa::reference {

namespace {

// W: the working precision (float, or double for f64 tensors).
template <typename W>
void rotate(const detail::Plan& p, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
            const TensorView& out, bool inverse) {
  const int64_t H = x.shape[1], h = x.shape[2] / 2;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t t = p.seq_start(b); t < p.seq_start(b) + p.seq_len(b); ++t) {
      const int64_t pos = positions.defined() ? static_cast<int64_t>(load_element(positions, t * positions.stride[0]))
                                              : t - p.seq_start(b);
      for (int64_t i = 0; i < h; ++i) {
        const W angle = static_cast<W>(pos) * static_cast<W>(load_element(inv_freq, i * inv_freq.stride[0]));
        const W c = std::cos(angle);
        const W s = inverse ? -std::sin(angle) : std::sin(angle);
        for (int64_t head = 0; head < H; ++head) {
          const int64_t at1 = t * x.stride[0] + head * x.stride[1] + i * x.stride[2];
          const int64_t at2 = at1 + h * x.stride[2];
          const W x1 = static_cast<W>(load_element(x, at1));
          const W x2 = static_cast<W>(load_element(x, at2));
          const W o1 = x1 * c - x2 * s;
          const W o2 = x2 * c + x1 * s;
          // Both inputs are read before either output is written: out may be x itself.
          const int64_t ot1 = t * out.stride[0] + head * out.stride[1] + i * out.stride[2];
          store_element(out, ot1, o1);
          store_element(out, ot1 + h * out.stride[2], o2);
        }
      }
    }
  }
}

}  // namespace

void rotary(const detail::Plan& p, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
            const TensorView& out, bool inverse) {
  if (x.dtype == DType::f64) rotate<double>(p, x, inv_freq, positions, out, inverse);
  else rotate<float>(p, x, inv_freq, positions, out, inverse);
}

}  // namespace nsa::reference
