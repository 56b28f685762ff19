// The body of the fp32 kernels, written once with GCC vector extensions and compiled by each
// kernels_<isa>.cpp with its own instruction-set flags. Include it inside a namespace that is
// unique to the TU (the functions would otherwise be merged across ISAs by the linker).
//
// Before including, define:
//   NSA_VEC_BYTES  vector width in bytes (16 SSE2, 32 AVX2, 64 AVX-512)
//   NSA_MR         rows of the micro-kernel (register blocking; see kMr below)
//   NSA_ISA        the table's name ("generic", "avx2", ...)
// and where the ISA has them, NSA_BROADCAST(p) (see splat_load) and NSA_CVT_F16(src, dst) (kW
// f16 values at src to f32 at dst in one go).
#include "cpu/kernels_rows_impl.h"

// The micro-kernel keeps kMr x 2 vectors of C in registers: 12 of AVX2's 16 registers (the
// other 4 hold two B vectors, one broadcast A value and a spare), 24 of AVX-512's 32.
constexpr int kMr = NSA_MR;
constexpr int kNr = 2 * kW;
// Rows of B fetched ahead in the micro-kernel (~a memory latency of iterations).
constexpr int64_t kPrefetchRows = 8;
static_assert(nsa::cpu::kColPad % kNr == 0, "kColPad must be a multiple of the panel width");

// A broadcast of *p. NSA_BROADCAST (a one-instruction broadcast load) comes from the ISA's TU;
// the portable `vf{} + x` costs an extra add and a register shuffle per use.
__attribute__((always_inline)) inline vf splat_load(const float* p) {
#ifdef NSA_BROADCAST
  return NSA_BROADCAST(p);
#else
  return splat(*p);
#endif
}

template <int R>
__attribute__((always_inline)) inline void micro_kernel(int64_t K, const float* A, int64_t lda,
                                                        const float* B, int64_t ldb, float* C,
                                                        int64_t ldc, bool accumulate) {
  vf c0[R], c1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (accumulate) {
      c0[r] = load(C + r * ldc);
      c1[r] = load(C + r * ldc + kW);
    } else {
      c0[r] = vf{};
      c1[r] = vf{};
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    // B panels often come from L3 (a selected block is read by few rows): fetch ahead.
    __builtin_prefetch(B + (k + kPrefetchRows) * ldb);
    const vf b0 = load(B + k * ldb);
    const vf b1 = load(B + k * ldb + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf a = splat_load(A + r * lda + k);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store(C + r * ldc, c0[r]);
    store(C + r * ldc + kW, c1[r]);
  }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  nsa::cpu::gemm_blocks<kMr, kNr>(M, N, [&](auto rows, int64_t r, int64_t j) __attribute__((always_inline)) {
    micro_kernel<decltype(rows)::value>(K, A + r * lda, lda, B + j, ldb, C + r * ldc + j, ldc, accumulate);
  });
}

// x[i] = exp(x[i]) (vexp).
void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += kW) store(x + i, vexp(load(x + i)));
}

float row_max(const float* x, int64_t n) {
  vf m = load(x);
  for (int64_t i = kW; i < n; i += kW) m = kMaxOp(m, load(x + i));
  return fold(m, kMaxOp);
}

float row_sum(const float* x, int64_t n) {
  vf s = vf{};
  for (int64_t i = 0; i < n; i += kW) s += load(x + i);
  return fold(s, kSumOp);
}

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef NSA_CVT_F16
  for (; i + kW <= n; i += kW) NSA_CVT_F16(src + i, dst + i);
#endif
  for (; i < n; ++i) dst[i] = nsa::detail::f16_to_f32(src[i]);
}

const KernelTable kTable = {.isa = NSA_ISA, .gemm = gemm, .exp_inplace = exp_inplace, .row_max = row_max,
                            .row_sum = row_sum, .bf16_to_f32 = bf16_to_f32, .f16_to_f32 = f16_to_f32,
                            .gemm_bf16 = nullptr, .f32_to_bf16 = f32_to_bf16, .pack_b_bf16 = nullptr,
                            NSA_ROW_KERNELS};
