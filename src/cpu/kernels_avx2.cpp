// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only when the CPU has them).
#include <immintrin.h>
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"
#include "cpu/kernels_blocking.h"

#define NSA_VEC_BYTES 32
#define NSA_MR 6
#define NSA_BROADCAST(p) _mm256_broadcast_ss(p)
#define NSA_CVT_F16(src, dst) \
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))))
#define NSA_ISA "avx2"
namespace nsa::cpu::isa_avx2 {
#include "cpu/kernels_impl.h"
}  // namespace nsa::cpu::isa_avx2

namespace nsa::cpu {
const KernelTable* kernels_avx2() { return &isa_avx2::kTable; }
}  // namespace nsa::cpu
