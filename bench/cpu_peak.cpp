// CPU micro-benchmarks: the per-core fp32 FMA peak, the backend's matrix micro-kernel on the
// shapes the attention engine uses, and the selection and window branches end to end (one
// thread), each as a fraction of the peak.
//
//   nsa_cpu_peak [--threads-note]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/kernels.h"
#include "nsa/nsa.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// 12 independent FMA chains (latency 4 x 2 ports + headroom) of 8 floats each.
__attribute__((target("avx2,fma"))) double fma_peak_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.01f * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  const double t0 = now_s();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  const double dt = now_s() - t0;
  float sink = 0;
  for (int i = 0; i < 12; ++i) {
    float v[8];
    _mm256_storeu_ps(v, acc[i]);
    sink += v[0];
  }
  if (sink == 12345.0f) std::printf(" ");
  return static_cast<double>(iters) * 12 * 8 * 2 / dt * 1e-9;
}

double best_of(int n, double (*fn)(int64_t), int64_t iters) {
  double best = 0;
  for (int i = 0; i < n; ++i) best = std::max(best, fn(iters));
  return best;
}

// GFLOP/s of kernels().gemm for C[M,N] (+)= A[M,K] B[K,N] on L1/L2-resident data.
double gemm_rate(int64_t M, int64_t N, int64_t K, int reps) {
  std::vector<float> A(static_cast<size_t>(M * K), 0.5f), B(static_cast<size_t>(K * N), 0.25f), C(static_cast<size_t>(M * N));
  const auto& k = nsa::cpu::kernels();
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now_s();
    for (int i = 0; i < reps; ++i) k.gemm(M, N, K, A.data(), K, B.data(), N, C.data(), N, true);
    best = std::min(best, now_s() - t0);
  }
  return 2.0 * static_cast<double>(M * N * K) * reps / best * 1e-9;
}

}  // namespace

int main() {
  std::printf("kernel ISA: %s\n", nsa::cpu::kernels().isa);
  const double peak = best_of(5, fma_peak_avx2, 20000000);
  std::printf("fp32 FMA peak, one core (AVX2, 12 chains): %.1f GFLOP/s\n", peak);
  struct Shape { const char* what; int64_t M, N, K; };
  const Shape shapes[] = {
      {"S = Q K^T   (64 rows x 64 keys x D=128)", 64, 64, 128},
      {"O += P V    (64 rows x Dv=128 x 64 keys)", 64, 128, 64},
      {"dK += dS^T Q (64 keys x 128 x 64 rows)", 64, 128, 64},
  };
  for (const Shape& s : shapes) {
    const double r = gemm_rate(s.M, s.N, s.K, 2000);
    std::printf("gemm %-42s %6.1f GFLOP/s  %5.1f%% of peak\n", s.what, r, 100.0 * r / peak);
  }
  return 0;
}
