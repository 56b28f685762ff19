// `nsa bench` on the CUDA backend: used by tools/nsa/main.cpp when a CUDA device is visible
// (tools/CMakeLists.txt compiles this file into nsa_cli with CUDA builds and sets
// NSA_CLI_CUDA_BENCH).
//
// run_cuda_bench: the default table. Same options and table as the CPU bench: random inputs
// (generated on the host, copied to the device once), CUDA-event timing (warm-up, median of
// --repeats), and the first --check-tokens rows compared with the fp64 reference on the truncated
// problem (rows whose selected blocks differ from the reference's are counted, not compared). The
// CUDA backend has no dense attention: the dense baseline on the GPU is PyTorch SDPA
// (bench/sdpa_baseline.py, run by scripts/gpu_check.sh).
//
// run_cuda_suite: `nsa bench --suite forward|backward`, the CSV benchmarks
// (cuda_suite_forward.cpp, cuda_suite_backward.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "nsa/nsa.h"

namespace {

uint16_t to_storage(float x, nsa::DType dt) {
  if (dt == nsa::DType::bf16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16(x)).x;
  return static_cast<__half_raw>(__float2half(x)).x;
}
float from_storage(uint16_t u, nsa::DType dt) {
  if (dt == nsa::DType::bf16) {
    __nv_bfloat16_raw r;
    r.x = u;
    return __bfloat162float(__nv_bfloat16(r));
  }
  __half_raw r;
  r.x = u;
  return __half2float(__half(r));
}

// A tensor with a host copy (16-bit storage or f32/i32) and a device copy.
struct Pair {
  std::vector<unsigned char> host;
  void* dev = nullptr;
  nsa::DType dtype = nsa::DType::bf16;
  std::vector<int64_t> shape;
  Pair() = default;
  Pair(nsa::DType dt, std::vector<int64_t> s) : dtype(dt), shape(std::move(s)) {
    host.assign(static_cast<size_t>(numel()) * nsa::dtype_size(dt) + 16, 0);
    NSA_CLI_CUDA(cudaMalloc(&dev, host.size()));
  }
  Pair(const Pair&) = delete;
  Pair(Pair&& o) noexcept { *this = std::move(o); }
  Pair& operator=(Pair&& o) noexcept {
    std::swap(host, o.host);
    std::swap(dev, o.dev);
    std::swap(dtype, o.dtype);
    std::swap(shape, o.shape);
    return *this;
  }
  ~Pair() {
    if (dev) cudaFree(dev);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  void fill(std::mt19937_64& rng, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    auto* h = reinterpret_cast<uint16_t*>(host.data());
    for (int64_t i = 0; i < numel(); ++i) h[i] = to_storage(u(rng), dtype);
    NSA_CLI_CUDA(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  void download() { NSA_CLI_CUDA(cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost)); }
  nsa::TensorView device_view() const { return view(dev, nsa::Device::cuda, shape[0]); }
  // The host copy's first `rows` rows (dim 0), for the reference check.
  nsa::TensorView host_rows(int64_t rows) { return view(host.data(), nsa::Device::cpu, rows); }
  nsa::TensorView view(void* data, nsa::Device dev_kind, int64_t rows) const {
    nsa::TensorView t;
    t.data = data;
    t.dtype = dtype;
    t.ndim = static_cast<int>(shape.size());
    t.device = dev_kind;
    int64_t st = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = d == 0 ? rows : shape[static_cast<size_t>(d)];
      t.stride[d] = st;
      st *= shape[static_cast<size_t>(d)];
    }
    return t;
  }
};

}  // namespace

int run_cuda_bench(const nsa_cli::BenchOptions& o) {
  if (o.dtype == nsa::DType::f32) {
    std::fprintf(stderr, "nsa: --dtype on the CUDA backend must be bf16 or f16, got f32\n");
    return 2;
  }
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cuda;
  std::printf("%8s  %-9s  %-7s  %10s  %10s  %8s  %11s  %10s  %s\n", "T", "backend", "pass", "NSA ms", "dense ms",
              "speedup", "NSA GFLOP/s", "max error", "rows checked (other blocks)");
  for (int64_t T : o.seqlens) {
    std::mt19937_64 rng(1234 + static_cast<uint64_t>(T));
    const nsa::DType dt = o.dtype;
    Pair q(dt, {T, o.hq, o.dqk}), g(dt, {T, o.hq, 3});
    Pair k[3], v[3];
    const int nkv = o.cfg.shared_kv ? 1 : 3;
    for (int b = 0; b < nkv; ++b) {
      k[b] = Pair(dt, {T, o.hkv, o.dqk});
      v[b] = Pair(dt, {T, o.hkv, o.dv});
      k[b].fill(rng, -1, 1);
      v[b].fill(rng, -1, 1);
    }
    q.fill(rng, -1, 1);
    g.fill(rng, 0, 1);
    // phi's parameters (shapes of nsa::PhiParams), scaled so that phi's output has unit size.
    Pair phk[5], phv[5];
    const int64_t l = o.cfg.cmp_block_len, F = o.phi_hidden;
    auto make_phi = [&](Pair* p, int64_t D) {
      const float s1 = 1.0f / std::sqrt(static_cast<float>(l * D));
      if (o.cfg.phi == nsa::PhiKind::linear) {
        p[0] = Pair(dt, {D, l * D});
        p[0].fill(rng, -2 * s1, 2 * s1);
        p[4] = Pair(dt, {l, D});
        p[4].fill(rng, -0.5f, 0.5f);
      } else if (o.cfg.phi == nsa::PhiKind::mlp) {
        p[0] = Pair(dt, {F, l * D});
        p[0].fill(rng, -2 * s1, 2 * s1);
        p[1] = Pair(dt, {F});
        p[1].fill(rng, -0.5f, 0.5f);
        p[2] = Pair(dt, {D, F});
        p[2].fill(rng, -1.5f / std::sqrt(float(F)), 1.5f / std::sqrt(float(F)));
        p[3] = Pair(dt, {D});
        p[3].fill(rng, -0.5f, 0.5f);
        p[4] = Pair(dt, {l, D});
        p[4].fill(rng, -0.5f, 0.5f);
      }
    };
    make_phi(phk, o.dqk);
    make_phi(phv, o.dv);
    auto params = [](Pair* p, bool device, int64_t) {
      nsa::PhiParams r;
      nsa::TensorView* f[5] = {&r.w1, &r.b1, &r.w2, &r.b2, &r.pe};
      for (int i = 0; i < 5; ++i)
        if (p[i].dev) *f[i] = device ? p[i].device_view() : p[i].host_rows(p[i].shape[0]);
      return r;
    };
    Pair o_out(dt, {T, o.hq, o.dv}), lse(nsa::DType::f32, {T, o.hq, 3}), idx(nsa::DType::i32, {T, o.hkv, o.cfg.n_selected});
    nsa::Inputs in;
    in.q = q.device_view();
    for (int b = 0; b < 3; ++b)
      if (k[b].dev) in.kv[b] = {k[b].device_view(), v[b].device_view()};
    in.g = g.device_view();
    in.phi_k = params(phk, true, 0);
    in.phi_v = params(phv, true, 0);
    const nsa::ForwardOutputs out{o_out.device_view(), lse.device_view(), idx.device_view(), {}, {}, {}};
    const nsa::Problem pr = nsa::problem_of(o.cfg, in);
    size_t bytes = nsa::workspace_size(ctx, nsa::Op::forward, o.cfg, pr);
    if (o.backward) bytes = std::max(bytes, nsa::workspace_size(ctx, nsa::Op::backward, o.cfg, pr));
    void* ws = nullptr;
    if (bytes) NSA_CLI_CUDA(cudaMalloc(&ws, bytes));
    const nsa::Workspace w{ws, bytes};
    const double fwd = nsa_cli::median_ms(o.warmup, o.repeats, [&] { nsa::forward(ctx, o.cfg, in, out, w); });

    // Check the first rows against the fp64 reference on the truncated problem.
    o_out.download();
    idx.download();
    const int64_t rows = std::min(o.check_tokens, T);
    int64_t checked = 0, disagree = 0;
    double err = 0;
    if (rows > 0) {
      Pair ro(dt, {rows, o.hq, o.dv}), rl(nsa::DType::f32, {rows, o.hq, 3}), ri(nsa::DType::i32, {rows, o.hkv, o.cfg.n_selected});
      nsa::Inputs hin;
      hin.q = q.host_rows(rows);
      for (int b = 0; b < 3; ++b)
        if (k[b].dev) hin.kv[b] = {k[b].host_rows(rows), v[b].host_rows(rows)};
      hin.g = g.host_rows(rows);
      hin.phi_k = params(phk, false, 0);
      hin.phi_v = params(phv, false, 0);
      nsa::Context ref;
      ref.backend = nsa::Backend::reference;
      nsa::forward(ref, o.cfg, hin, {ro.host_rows(rows), rl.host_rows(rows), ri.host_rows(rows), {}, {}, {}});
      const int64_t n = o.cfg.n_selected, G = o.hq / o.hkv;
      const auto* a = reinterpret_cast<const int32_t*>(idx.host.data());
      const auto* bb = reinterpret_cast<const int32_t*>(ri.host.data());
      const auto* go = reinterpret_cast<const uint16_t*>(o_out.host.data());
      const auto* wo = reinterpret_cast<const uint16_t*>(ro.host.data());
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t hk = 0; hk < o.hkv; ++hk) {
          if (!std::equal(a + (t * o.hkv + hk) * n, a + (t * o.hkv + hk + 1) * n, bb + (t * o.hkv + hk) * n)) {
            ++disagree;
            continue;
          }
          ++checked;
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
            for (int64_t c = 0; c < o.dv; ++c) {
              const int64_t i = (t * o.hq + h) * o.dv + c;
              err = std::max(err, static_cast<double>(std::fabs(from_storage(go[i], dt) - from_storage(wo[i], dt))));
            }
        }
    }
    // Keys attended per (token, head): visible compressed blocks, selected tokens, window.
    double keys = 0;
    for (int64_t t = 0; t < T; ++t) {
      keys += static_cast<double>(nsa::visible_cmp_blocks(t, l, o.cfg.cmp_stride));
      const int64_t blocks = std::min<int64_t>(o.cfg.n_selected, nsa::last_slc_block(t, o.cfg.slc_block_len) + 1);
      keys += static_cast<double>(std::min<int64_t>(t + 1, blocks * o.cfg.slc_block_len));
      keys += static_cast<double>(std::min<int64_t>(t + 1, o.cfg.window));
    }
    const double flop = keys * 2.0 * static_cast<double>(o.dqk + o.dv) * static_cast<double>(o.hq);
    std::printf("%8lld  %-9s  %-7s  %10.2f  %10s  %8s  %11.1f  %10.2e  %lld (%lld)\n", static_cast<long long>(T), "cuda",
                "fwd", fwd, "-", "-", flop / fwd * 1e-6, err, static_cast<long long>(checked), static_cast<long long>(disagree));
    if (o.backward) {
      try {
        nsa::Gradients gr;  // gradients into fresh device buffers
        Pair dq(dt, {T, o.hq, o.dqk}), dgg(dt, {T, o.hq, 3}), d_o(dt, {T, o.hq, o.dv}), dk[3], dv[3], dpk[5], dpv[5];
        d_o.fill(rng, -1, 1);
        for (int b = 0; b < nkv; ++b) {
          dk[b] = Pair(dt, {T, o.hkv, o.dqk});
          dv[b] = Pair(dt, {T, o.hkv, o.dv});
          gr.dkv[b] = {dk[b].device_view(), dv[b].device_view()};
        }
        for (int i = 0; i < 5; ++i) {
          if (phk[i].dev) dpk[i] = Pair(dt, phk[i].shape);
          if (phv[i].dev) dpv[i] = Pair(dt, phv[i].shape);
        }
        gr.dq = dq.device_view();
        gr.dg = dgg.device_view();
        gr.dphi_k = params(dpk, true, 0);
        gr.dphi_v = params(dpv, true, 0);
        const double fb = nsa_cli::median_ms(o.warmup, o.repeats, [&] {
          nsa::forward(ctx, o.cfg, in, out, w);
          nsa::backward(ctx, o.cfg, in, out, d_o.device_view(), gr, w);
        });
        std::printf("%8lld  %-9s  %-7s  %10.2f  %10s  %8s  %11.1f  %10s  -\n", static_cast<long long>(T), "cuda", "fwd+bwd",
                    fb, "-", "-", 3.5 * flop / fb * 1e-6, "-");
      } catch (const nsa::Error& e) {
        std::printf("%8lld  %-9s  %-7s  %s\n", static_cast<long long>(T), "cuda", "fwd+bwd", e.what());
      }
    }
    if (ws) cudaFree(ws);
  }
  std::printf("dense baseline on the GPU: PyTorch SDPA, bench/sdpa_baseline.py (scripts/gpu_check.sh)\n");
  return 0;
}

int run_cuda_suite(const std::string& suite, const std::vector<std::string>& args) {
  try {
    if (suite == "forward") return nsa_cli::run_forward_suite(args);
    if (suite == "backward") return nsa_cli::run_backward_suite(args);
    throw nsa_cli::UsageError("--suite must be forward or backward, got \"" + suite + "\"");
  } catch (const nsa_cli::UsageError& e) {
    std::fprintf(stderr, "nsa: %s\n", e.what());
    return 2;
  }
}
