// The inner kernels of the CPU backend, compiled once per instruction set and chosen at run time
// (kernels.cpp). Everything above this layer works on packed tiles: fp32, or bf16 for the tile
// products of bf16 inputs where the CPU has bf16 matrix instructions (gemm_bf16).
#pragma once

#include <cstdint>

namespace nsa::cpu {

// Every packed right-hand matrix has its column count padded to a multiple of this, so the
// micro-kernels never need a column remainder (32 = two AVX-512 vectors, the widest panel).
inline constexpr int64_t kColPad = 32;
// The reduction length of a bf16 product is padded (with zeros) to a multiple of this: one AMX
// tile row holds 32 bf16 values.
inline constexpr int64_t kKPad = 32;

inline constexpr int64_t pad_cols(int64_t n) { return (n + kColPad - 1) / kColPad * kColPad; }

struct KernelTable {
  const char* isa;  // "amx", "avx512bf16", "avx512", "avx2" or "generic"
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
  // bf16 matrix product with fp32 accumulation, null where the CPU has no bf16 instructions:
  // C[M, N] (+)= A[M, K] . B[K, N], A bf16 row-major [M][lda]; B bf16 in the pair-interleaved
  // ("VNNI") layout of the matrix units: element (k, n) at B[(k / 2) * 2 * ldb + 2 * n + k % 2]
  // (pack_vnni in attention.h); C fp32 row-major. K a multiple of kKPad, N of kColPad.
  void (*gemm_bf16)(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                    const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);
  // dst[i] = bf16(src[i]), rounded to nearest even (a NaN stays a quiet NaN), as
  // detail::f32_to_bf16 (every table).
  void (*f32_to_bf16)(const float* src, uint16_t* dst, int64_t n);
  // The B operand of gemm_bf16 from a row-major fp32 matrix B [K][N] (row stride lds >= N): the
  // pair-interleaved bf16 layout with ldb = N, rows K .. Kp - 1 zero (Kp even; null with
  // gemm_bf16).
  void (*pack_b_bf16)(const float* src, int64_t lds, int64_t K, int64_t N, uint16_t* dst, int64_t Kp);

  // ---- Row kernels of the attention engine (kernels_rows_impl.h; every table) ----
  // Rows are n floats, n a multiple of kColPad; [a, b] the visible columns (empty when a > b).
  //
  // One row of the flash forward over a chunk: s holds the raw scores q.k. With m, l the row's
  // running max and sum (m = -inf, l = 0 before the first chunk):
  //   mx = max(m, max_{a<=j<=b} scale s_j), p_j = exp(scale s_j - mx) (0 outside [a, b]),
  //   l = l exp(m - mx) + sum_j p_j, m = mx; s_j = p_j and, when pb is not null, pb_j = bf16(p_j).
  // Returns exp(m_old - mx), the factor of the row's output accumulator (1 when a > b: then s
  // and pb are zeroed and m, l unchanged).
  float (*softmax_row)(float* s, int64_t n, int64_t a, int64_t b, float scale, float* m, float* l, uint16_t* pb);
  // s_j = exp(scale s_j - shift) for a <= j <= b, 0 elsewhere (P from the saved lse = shift).
  void (*exp_row)(float* s, int64_t n, int64_t a, int64_t b, float scale, float shift);
  // dS: p_j = p_j (gate dp_j - delta) factor; pb_j = bf16 of it when pb is not null.
  void (*ds_row)(float* p, const float* dp, int64_t n, float gate, float delta, float factor, uint16_t* pb);
  // x_j *= f for j < n (any n).
  void (*scale_row)(float* x, int64_t n, float f);
  // The B operand of gemm_bf16 from the transpose of a row-major fp32 matrix: B[k][n] =
  // src[n * lds + k] for n < N, k < K, zero for k in [K, Kp) and n in [N, ldb) (Kp even, ldb a
  // multiple of kColPad). lo = true packs the rounding error instead: bf16(x - float(bf16(x))).
  // Equal to pack_vnni (attention.h) with sk = 1, sn = lds.
  void (*pack_bt_bf16)(const float* src, int64_t lds, int64_t N, int64_t K, uint16_t* dst, int64_t Kp, int64_t ldb,
                       bool lo);
  // dst[c][r] = bf16(src[r * lds + c]) for c < n, r < M; zero for M <= r < ldt (ldt even): the
  // transpose of M rows as a bf16 A operand. lo (not null): the rounding errors, as pack_bt_bf16.
  void (*transpose_bf16)(const float* src, int64_t M, int64_t n, int64_t lds, uint16_t* dst, int64_t ldt,
                         uint16_t* lo);
};

// The table for this CPU, best first: AMX tiles (amx), AVX-512, AVX2+FMA+F16C, portable code;
// AVX-512-BF16 dot products (avx512bf16) before AVX-512 only on AMD CPUs of family 26 or later,
// elsewhere slower (kernels.cpp says where it was measured). NSA_CPU_ISA=generic|avx2|avx512|
// avx512bf16|amx forces one (an ISA this CPU, its OS or the compiler lacks is an nsa::Error
// naming NSA_CPU_ISA).
const KernelTable& kernels();
// The ISA of the table kernels() takes on this CPU when NSA_CPU_ISA is unset.
const char* auto_isa();

// Switches the table of the process to the named ISA, as NSA_CPU_ISA would (nsa::Error naming
// NSA_CPU_ISA when unsupported). For tests that run every path in one process; not thread-safe
// against calls in flight.
void use_isa(const char* isa);
// Whether the named ISA can run here (CPU, OS and compiler).
bool isa_available(const char* isa);

// Per-ISA tables (kernels_<isa>.cpp); nullptr when the compiler lacks the ISA (kernels.cpp asks
// the CPU and the OS).
const KernelTable* kernels_generic();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_avx512bf16();
const KernelTable* kernels_amx();

}  // namespace nsa::cpu
