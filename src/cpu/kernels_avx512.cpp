// AVX-512F kernels (compiled with -mavx512f -mfma -mf16c; called only when the CPU has them).
#include <immintrin.h>
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"
#include "cpu/kernels_blocking.h"

#define NSA_VEC_BYTES 64
#define NSA_MR 12
#define NSA_BROADCAST(p) _mm512_set1_ps(*(p))
#define NSA_CVT_F16(src, dst) \
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))))
#define NSA_ISA "avx512"
namespace nsa::cpu::isa_avx512 {
#include "cpu/kernels_impl.h"
}  // namespace nsa::cpu::isa_avx512

namespace nsa::cpu {
const KernelTable* kernels_avx512() { return &isa_avx512::kTable; }
}  // namespace nsa::cpu
