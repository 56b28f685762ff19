// Constants every CUDA room uses, defined once: log2(e) (the kernels keep softmax scores in the
// log2 domain), and the shared memory of one sm_90 SM (H100 / H200) with what the hardware keeps
// per resident CTA (which decides how many CTAs of a layout fit an SM, and the opt-in maximum per
// block that the host checks kernels' needs against, so that a too-large configuration is an
// nsa::Error naming the value; an A100 allows 163 KB).
#pragma once

#include <cstddef>

namespace nsa::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr size_t kSmemPerSm = 228 * 1024;
inline constexpr size_t kSmemPerCtaReserved = 1024;
inline constexpr size_t kMaxSmem = kSmemPerSm - kSmemPerCtaReserved;

}  // namespace nsa::cuda
