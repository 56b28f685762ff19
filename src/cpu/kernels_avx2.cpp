// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only when the CPU has them).
#include <immintrin.h>
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"

#define NSA_VEC_BYTES 32
#define NSA_MR 6
#define NSA_BROADCAST(p) _mm256_broadcast_ss(p)
namespace nsa::cpu::isa_avx2 {
#include "cpu/kernels_impl.h"

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = nsa::detail::f16_to_f32(src[i]);
}

const KernelTable kTable = {.isa = "avx2", .gemm = gemm, .exp_inplace = exp_inplace, .row_max = row_max,
                              .row_sum = row_sum, .bf16_to_f32 = bf16_to_f32, .f16_to_f32 = f16_to_f32,
                              .gemm_bf16 = nullptr, .f32_to_bf16 = f32_to_bf16, .pack_b_bf16 = nullptr,
                              NSA_ROW_KERNELS};
}  // namespace nsa::cpu::isa_avx2

namespace nsa::cpu {
const KernelTable* kernels_avx2() { return &isa_avx2::kTable; }
}  // namespace nsa::cpu
