// Portable kernels (SSE2 on x86-64, whatever the compiler vectorises elsewhere).
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"

#define NSA_VEC_BYTES 16
#define NSA_MR 6
namespace nsa::cpu::isa_generic {
#include "cpu/kernels_impl.h"

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = nsa::detail::f16_to_f32(src[i]);
}

const KernelTable kTable = {.isa = "generic", .gemm = gemm, .exp_inplace = exp_inplace, .row_max = row_max,
                              .row_sum = row_sum, .bf16_to_f32 = bf16_to_f32, .f16_to_f32 = f16_to_f32,
                              .gemm_bf16 = nullptr, .f32_to_bf16 = f32_to_bf16, .pack_b_bf16 = nullptr,
                              NSA_ROW_KERNELS};
}  // namespace nsa::cpu::isa_generic

namespace nsa::cpu {
const KernelTable* kernels_generic() { return &isa_generic::kTable; }
}  // namespace nsa::cpu
