// The body of the fp32 kernels, written once with GCC vector extensions and compiled by each
// kernels_<isa>.cpp with its own instruction-set flags. Include it inside a namespace that is
// unique to the TU (the functions would otherwise be merged across ISAs by the linker).
//
// Before including, define:
//   NSA_VEC_BYTES  vector width in bytes (16 SSE2, 32 AVX2, 64 AVX-512)
//   NSA_MR         rows of the micro-kernel (register blocking; see kMr below)
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"

typedef float vf __attribute__((vector_size(NSA_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(NSA_VEC_BYTES)));

constexpr int kW = NSA_VEC_BYTES / 4;  // floats per vector
// The micro-kernel keeps kMr x 2 vectors of C in registers: 12 of AVX2's 16 registers (the
// other 4 hold two B vectors, one broadcast A value and a spare), 24 of AVX-512's 32.
constexpr int kMr = NSA_MR;
constexpr int kNr = 2 * kW;
// Rows of B fetched ahead in the micro-kernel (~a memory latency of iterations).
constexpr int64_t kPrefetchRows = 8;
static_assert(nsa::cpu::kColPad % kNr == 0, "kColPad must be a multiple of the panel width");

__attribute__((always_inline)) inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// A broadcast of *p. NSA_BROADCAST (a one-instruction broadcast load) comes from the ISA's TU;
// the portable `vf{} + x` costs an extra add and a register shuffle per use.
__attribute__((always_inline)) inline vf splat(float x) { return vf{} + x; }
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

template <int R>
inline void row_remainder(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                          float* C, int64_t ldc, bool accumulate, int rows) {
  if constexpr (R > 0) {
    if (rows == R) return micro_kernel<R>(K, A, lda, B, ldb, C, ldc, accumulate);
    return row_remainder<R - 1>(K, A, lda, B, ldb, C, ldc, accumulate, rows);
  }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  // Column panels outside: one K x kNr panel of B stays in L1 while every row block uses it.
  for (int64_t j = 0; j < N; j += kNr) {
    int64_t r = 0;
    for (; r + kMr <= M; r += kMr)
      micro_kernel<kMr>(K, A + r * lda, lda, B + j, ldb, C + r * ldc + j, ldc, accumulate);
    if (r < M)
      row_remainder<kMr - 1>(K, A + r * lda, lda, B + j, ldb, C + r * ldc + j, ldc, accumulate,
                             static_cast<int>(M - r));
  }
}

// exp by range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial for e^r
// (the Cephes expf coefficients, ~1 ulp); 2^n is built in the exponent bits.
void exp_inplace(float* x, int64_t n) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln2 split so that n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kUnderflow = -87.0f;        // below this e^x is under FLT_MIN: return 0
  for (int64_t i = 0; i < n; i += kW) {
    const vf v = load(x + i);
    const vi dead = v < kUnderflow;
    const vf xc = dead ? splat(kUnderflow) : v;
    const vf t = xc * kLog2e;
    const vf nf = (t + kRoundMagic) - kRoundMagic;
    vf r = xc - nf * kLn2Hi;
    r = r - nf * kLn2Lo;
    vf p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    const vi e = (__builtin_convertvector(nf, vi) + 127) << 23;
    vf scale;
    std::memcpy(&scale, &e, sizeof scale);
    vf out = p * scale;
    vi bits;
    std::memcpy(&bits, &out, sizeof bits);
    bits &= ~dead;
    std::memcpy(&out, &bits, sizeof out);
    store(x + i, out);
  }
}

float row_max(const float* x, int64_t n) {
  vf m = load(x);
  for (int64_t i = kW; i < n; i += kW) {
    const vf v = load(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int i = 1; i < kW; ++i) r = m[i] > r ? m[i] : r;
  return r;
}

float row_sum(const float* x, int64_t n) {
  vf s = vf{};
  for (int64_t i = 0; i < n; i += kW) s += load(x + i);
  float r = 0.0f;
  for (int i = 0; i < kW; ++i) r += s[i];
  return r;
}

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}
