// AVX-512F kernels (compiled with -mavx512f -mfma -mf16c; called only when the CPU has them).
#include <immintrin.h>
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"

#define NSA_VEC_BYTES 64
#define NSA_MR 12
#define NSA_BROADCAST(p) _mm512_set1_ps(*(p))
namespace nsa::cpu::isa_avx512 {
#include "cpu/kernels_impl.h"

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = nsa::detail::f16_to_f32(src[i]);
}

const KernelTable kTable = {.isa = "avx512", .gemm = gemm, .exp_inplace = exp_inplace, .row_max = row_max,
                              .row_sum = row_sum, .bf16_to_f32 = bf16_to_f32, .f16_to_f32 = f16_to_f32,
                              .gemm_bf16 = nullptr, .f32_to_bf16 = f32_to_bf16, .pack_b_bf16 = nullptr,
                              NSA_ROW_KERNELS};
}  // namespace nsa::cpu::isa_avx512

namespace nsa::cpu {
const KernelTable* kernels_avx512() { return &isa_avx512::kTable; }
}  // namespace nsa::cpu
