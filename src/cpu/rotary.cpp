// Rotary position embeddings on the CPU backend (api.h rotary): the reference's fp32 arithmetic
// (reference/rotary.cpp) with the tokens spread over threads. Each token's cos and sin are computed
// once per pair chunk and serve all of its heads. Every output element is one thread's fixed
// sequence of operations, so the bits do not depend on the thread count. Compiled without
// floating-point contraction (cpu/CMakeLists.txt): products and sums are rounded one by one, as
// the operation defines, never fused into an FMA.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/common.h"
#include "cpu/ops.h"

namespace nsa::cpu {

namespace {

// Pairs per chunk: the chunk's cos and sin and one head's two halves, in and out, live on the
// stack (6 x 256 bytes), so a call needs no workspace whatever D is.
constexpr int64_t kPairChunk = 64;

// Position of token t: positions[t], or t's offset in its sequence.
int64_t position_of(const Plan& p, const int32_t* positions, int64_t t) {
  if (positions != nullptr) return positions[t];
  // The last sequence starting at or before t (empty sequences before it start there too).
  const int64_t b = std::upper_bound(p.cu.begin(), p.cu.end(), t) - p.cu.begin() - 1;
  return t - p.seq_start(b);
}

}  // namespace

void rotary(const Plan& p, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
            const TensorView& out, bool inverse) {
  const int64_t H = x.shape[1], h = x.shape[2] / 2;
  const float* freq = static_cast<const float*>(inv_freq.data);  // [h], contiguous (api.cpp) when h > 1
  const int32_t* pos = positions.defined() ? static_cast<const int32_t*>(positions.data) : nullptr;
#pragma omp parallel for schedule(static) num_threads(call_threads(p))
  for (int64_t t = 0; t < p.T; ++t) {
    const float tp = static_cast<float>(position_of(p, pos, t));
    for (int64_t i0 = 0; i0 < h; i0 += kPairChunk) {
      const int64_t n = std::min(kPairChunk, h - i0);
      float c[kPairChunk], s[kPairChunk], x1[kPairChunk], x2[kPairChunk], o1[kPairChunk], o2[kPairChunk];
      for (int64_t i = 0; i < n; ++i) {
        const float angle = tp * freq[i0 + i];
        c[i] = std::cos(angle);
        s[i] = inverse ? -std::sin(angle) : std::sin(angle);
      }
      for (int64_t head = 0; head < H; ++head) {
        const int64_t in = t * x.stride[0] + head * x.stride[1] + i0;
        load_f32(x, in, x1, n);
        load_f32(x, in + h, x2, n);
        for (int64_t i = 0; i < n; ++i) {
          o1[i] = x1[i] * c[i] - x2[i] * s[i];
          o2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
        // Both halves are read before either is written: out may be x itself.
        const int64_t at = t * out.stride[0] + head * out.stride[1] + i0;
        store_f32(out, at, o1, n);
        store_f32(out, at + h, o2, n);
      }
    }
  }
}

}  // namespace nsa::cpu
