// The fp32 inner kernels of the CPU backend, compiled once per instruction set and chosen at
// run time (kernels.cpp). Everything above this layer works on packed fp32 tiles.
#pragma once

#include <cstdint>

namespace nsa::cpu {

// Every packed right-hand matrix has its column count padded to a multiple of this, so the
// micro-kernels never need a column remainder (32 = two AVX-512 vectors, the widest panel).
inline constexpr int64_t kColPad = 32;

inline constexpr int64_t pad_cols(int64_t n) { return (n + kColPad - 1) / kColPad * kColPad; }

struct KernelTable {
  const char* isa;  // "avx512", "avx2" or "generic"
  // C[M, N] (+)= A[M, K] . B[K, N]; all row-major with leading dimensions lda, ldb, ldc.
  // N must be a multiple of kColPad. accumulate = false overwrites C.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate);
  // x[i] = exp(x[i]) for i < n (n a multiple of kColPad); arguments below about -87 give
  // exactly 0, so a masked -inf becomes a zero probability.
  void (*exp_inplace)(float* x, int64_t n);
  // max and sum of x[0..n) (n a multiple of kColPad), in a fixed vector order.
  float (*row_max)(const float* x, int64_t n);
  float (*row_sum)(const float* x, int64_t n);
  // dst[i] = float(src[i]) for the 16-bit storage formats.
  void (*bf16_to_f32)(const uint16_t* src, float* dst, int64_t n);
  void (*f16_to_f32)(const uint16_t* src, float* dst, int64_t n);
};

// The table for this CPU: AVX-512 when present, else AVX2+FMA+F16C, else portable code.
// NSA_CPU_ISA=generic|avx2|avx512 forces one (an unsupported request is an nsa::Error).
const KernelTable& kernels();

// Per-ISA tables (kernels_<isa>.cpp); avx512/avx2 are nullptr when the compiler lacks them.
const KernelTable* kernels_generic();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();

}  // namespace nsa::cpu
