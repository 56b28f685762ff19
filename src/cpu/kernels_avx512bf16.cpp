// AVX-512-BF16 kernels (compiled with -mavx512bf16 -mavx512bw -mavx512vl; called only when the
// CPU has them): the bf16 matrix product with vdpbf16ps dot products, and the fp32 -> bf16
// rounding that feeds it. The fp32 kernels are the AVX-512 ones.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"
#include "cpu/kernels_blocking.h"

// The row kernels again, with vcvtneps2bf16 for their bf16 roundings.
#define NSA_VEC_BYTES 64
#define NSA_CVT_BF16(x) bits_as<vh>(_mm512_cvtneps_pbh(x))
namespace nsa::cpu::isa_avx512bf16 {
#include "cpu/kernels_rows_impl.h"
}  // namespace nsa::cpu::isa_avx512bf16

namespace nsa::cpu {

namespace {

// 12 rows x 32 columns of C stay in 24 of the 32 registers (the others hold two B vectors and
// one broadcast pair of A), as in the fp32 AVX-512 micro-kernel.
constexpr int kMr = 12;
constexpr int kNr = 32;
// Pair-rows of B fetched ahead (a pair-row is 2 * ldb values: ~a memory latency of iterations).
constexpr int64_t kPrefetchPairs = 4;
static_assert(kColPad % kNr == 0, "kColPad must be a multiple of the panel width");

template <int R>
__attribute__((always_inline)) inline void micro_kernel(int64_t K, const uint16_t* A, int64_t lda,
                                                        const uint16_t* B, int64_t ldb, float* C,
                                                        int64_t ldc, bool accumulate) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? _mm512_loadu_ps(C + r * ldc) : _mm512_setzero_ps();
    c1[r] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const uint16_t* b = B + k2 * 2 * ldb;
    __builtin_prefetch(b + kPrefetchPairs * 2 * ldb);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);       // columns 0..15, pairs (2k2, 2k2+1)
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 32);  // columns 16..31
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * k2, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(C + r * ldc, c0[r]);
    _mm512_storeu_ps(C + r * ldc + 16, c1[r]);
  }
}

void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm_blocks<kMr, kNr>(M, N, [&](auto rows, int64_t r, int64_t j) __attribute__((always_inline)) {
    micro_kernel<decltype(rows)::value>(K, A + r * lda, lda, B + 2 * j, ldb, C + r * ldc + j, ldc, accumulate);
  });
}

}  // namespace

namespace {

void f32_to_bf16_avx512bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {  // the same instruction on the tail, so every element rounds the same way
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
  }
}

// Two rows of B converted at once (vcvtne2ps2bf16) and interleaved into pairs by one permute.
void pack_b_bf16_avx512bf16(const float* src, int64_t lds, int64_t K, int64_t N, uint16_t* dst, int64_t Kp) {
  // Word i of the result: i / 2 of the first row (words 0..15) or of the second (words 16..31).
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(kInterleave);
  for (int64_t k = 0; k < Kp; k += 2) {
    const float* r0 = src + k * lds;
    const float* r1 = r0 + lds;
    uint16_t* out = dst + k * N;
    const bool has0 = k < K, has1 = k + 1 < K;
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      const __m512 a = has0 ? _mm512_loadu_ps(r0 + n) : _mm512_setzero_ps();
      const __m512 b = has1 ? _mm512_loadu_ps(r1 + n) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0..15: a, 16..31: b
      _mm512_storeu_si512(out + 2 * n, _mm512_permutexvar_epi16(perm, both));
    }
    if (n < N) {
      const __mmask16 m = static_cast<__mmask16>((1u << (N - n)) - 1);
      const __m512 a = has0 ? _mm512_maskz_loadu_ps(m, r0 + n) : _mm512_setzero_ps();
      const __m512 b = has1 ? _mm512_maskz_loadu_ps(m, r1 + n) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_mask_storeu_epi16(out + 2 * n, static_cast<__mmask32>((1ull << (2 * (N - n))) - 1),
                               _mm512_permutexvar_epi16(perm, both));
    }
  }
}

}  // namespace

// The AMX table (kernels_amx.cpp) starts from this one: every AMX CPU has AVX-512-BF16.
const KernelTable* kernels_avx512bf16() {
  static const KernelTable table = [] {
    KernelTable t = *kernels_avx512();
    t.isa = "avx512bf16";
    t.gemm_bf16 = gemm_bf16;
    t.f32_to_bf16 = f32_to_bf16_avx512bf16;
    t.pack_b_bf16 = pack_b_bf16_avx512bf16;
    t.softmax_row = isa_avx512bf16::softmax_row;
    t.exp_row = isa_avx512bf16::exp_row;
    t.ds_row = isa_avx512bf16::ds_row;
    t.scale_row = isa_avx512bf16::scale_row;
    t.pack_bt_bf16 = isa_avx512bf16::pack_bt_bf16;
    t.transpose_bf16 = isa_avx512bf16::transpose_bf16;
    return t;
  }();
  return &table;
}

}  // namespace nsa::cpu
