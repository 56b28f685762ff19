// CPU micro-benchmarks: the per-core fp32 FMA peak, the backend's matrix micro-kernel on the
// shapes the attention engine uses, and the selection and window branches end to end (one
// thread), each as a fraction of the peak.
//
//   nsa_cpu_peak [--threads-note]
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/kernels.h"
#include "nsa/nsa.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// This thread's CPU time in seconds. The development machine is shared: wall time includes the
// time other programs held the core, CPU time does not, so every rate here is per CPU second.
double cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// 12 independent FMA chains (latency 4 x 2 ports + headroom) of 8 floats each.
__attribute__((target("avx2,fma"))) double fma_peak_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.01f * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  const double t0 = cpu_s();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  const double dt = cpu_s() - t0;
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
    const double t0 = cpu_s();
    for (int i = 0; i < reps; ++i) k.gemm(M, N, K, A.data(), K, B.data(), N, C.data(), N, true);
    best = std::min(best, cpu_s() - t0);
  }
  return 2.0 * static_cast<double>(M * N * K) * reps / best * 1e-9;
}

// Owned bf16 host tensor filled with uniform values in [-1, 1].
struct Bf16 {
  std::vector<uint16_t> data;
  nsa::TensorView view;
  Bf16(std::initializer_list<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    data.resize(static_cast<size_t>(n));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : data) {
      const float f = u(rng);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      x = static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
    view = nsa::make_view(data.data(), nsa::DType::bf16, shape);
  }
};

struct AlignedBytes {
  std::vector<unsigned char> bytes;
  nsa::Workspace ws;
  explicit AlignedBytes(size_t n) : bytes(n + 256) {
    const auto a = reinterpret_cast<uintptr_t>(bytes.data());
    ws.data = bytes.data() + (256 - a % 256) % 256;
    ws.bytes = n;
  }
};

// The selection and window branches end to end on one thread (Context::num_threads = 1 runs on
// the calling thread, so its CPU clock measures them) (T tokens, Hq=16, Hkv=1, D=128,
// bf16, l'=64, n=16, w=512): useful GFLOP/s (2 flops per multiply-add of q.k and p.v over the
// keys each query really attends) and the share of the process that was on a core.
void branch_rates(double peak) {
  constexpr int64_t T = 8192, Hq = 16, Hkv = 1, D = 128;
  nsa::Config cfg;  // the paper's blocks: l=32, d=16, l'=64, n=16, w=512
  std::mt19937_64 rng(7);
  Bf16 q({T, Hq, D}, rng), k({T, Hkv, D}, rng), v({T, Hkv, D}, rng);
  Bf16 o({T, Hq, D}, rng);
  const int64_t ns = (T + cfg.slc_block_len - 1) / cfg.slc_block_len;
  std::vector<float> scores(static_cast<size_t>(T * Hkv * ns));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& x : scores) x = u(rng);
  std::vector<int32_t> idx(static_cast<size_t>(T * Hkv * cfg.n_selected));
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cpu;
  ctx.num_threads = 1;
  const nsa::TensorView sv = nsa::make_view(scores.data(), nsa::DType::f32, {T, Hkv, ns});
  const nsa::TensorView iv = nsa::make_view(idx.data(), nsa::DType::i32, {T, Hkv, cfg.n_selected});
  nsa::Problem pr;
  pr.total_tokens = T;
  pr.max_seqlen = T;
  pr.hq = Hq;
  pr.hkv = Hkv;
  pr.dqk = pr.dv = D;
  pr.dtype = nsa::DType::bf16;
  size_t bytes = 0;
  for (nsa::Op op : {nsa::Op::select_topn, nsa::Op::selected_attention_fwd, nsa::Op::window_attention_fwd})
    bytes = std::max(bytes, nsa::workspace_size(ctx, op, cfg, pr));
  AlignedBytes ws(bytes);
  auto count_slc_keys = [&] {
    double keys = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < cfg.n_selected; ++j) {
        const int64_t b = idx[static_cast<size_t>(t * cfg.n_selected + j)];
        if (b >= 0) keys += static_cast<double>(std::min((b + 1) * cfg.slc_block_len, t + 1) - b * cfg.slc_block_len);
      }
    return keys;
  };
  double win_keys = 0;
  for (int64_t t = 0; t < T; ++t) win_keys += static_cast<double>(t - nsa::window_start(t, cfg.window) + 1);
  auto run = [&](const char* what, double keys, auto fn) {
    double best = 1e30, wall = 0;
    for (int r = 0; r < 3; ++r) {
      const double w0 = now_s(), t0 = cpu_s();
      fn();
      const double dt = cpu_s() - t0;
      if (dt < best) {
        best = dt;
        wall = now_s() - w0;
      }
    }
    const double flops = keys * static_cast<double>(Hq) * 4.0 * static_cast<double>(D);
    const double rate = flops / best * 1e-9;
    std::printf("T=8192 %-27s %8.1f cpu ms (%8.1f wall ms)  %6.1f GFLOP/s  %5.1f%% of peak\n", what, best * 1e3, wall * 1e3, rate,
                100.0 * rate / peak);
  };
  // Random scores: every token picks its own blocks (what random q/k give), so each selected
  // block serves one token's G rows.
  nsa::select_topn(ctx, cfg, sv, {}, iv, ws.ws);
  run("selected, random picks", count_slc_keys(),
      [&] { nsa::selected_attention_fwd(ctx, cfg, q.view, k.view, v.view, iv, {}, o.view, {}, ws.ws); });
  // Scores that change every 16 tokens (neighbouring queries agree, as on trained models): the
  // tile of 4 tokens shares its blocks, 64 rows per block.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < ns; ++j)
      scores[static_cast<size_t>(t * ns + j)] = static_cast<float>((j * 7919 + (t / 16) * 104729) % 1000);
  nsa::select_topn(ctx, cfg, sv, {}, iv, ws.ws);
  run("selected, neighbours agree", count_slc_keys(),
      [&] { nsa::selected_attention_fwd(ctx, cfg, q.view, k.view, v.view, iv, {}, o.view, {}, ws.ws); });
  run("window, w=512", win_keys,
      [&] { nsa::window_attention_fwd(ctx, cfg, q.view, k.view, v.view, {}, o.view, {}, ws.ws); });
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
  branch_rates(peak);
  return 0;
}
