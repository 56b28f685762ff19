// Benchmark of the CUDA backward: forward, backward and forward+backward of the whole
// layer, bf16, random data, CUDA events, warm-up, median of repeats; plus branch ablations
// (window off, selection off) that show where the backward's time goes, the full layer at 64K
// with locally alike queries (local_q, as the forward benchmark's), both also with the
// selection's union tiles off (per_token, local_q_per_token: their same-run A/B), the full layer
// with the backward not given the forward's o (full_without_o: the selection then recomputes
// o_slc for its D; every other variant passes o, as a training step would), and the backward's extra
// memory (its workspace) against the memory of q, k, v and o. Writes a CSV that
// bench/sdpa_backward_baseline.py joins with PyTorch SDPA forward+backward measured in the
// same gpu_check.sh run.
//
//   nsa_cuda_backward_bench [--out FILE.csv] [--quick] [--lengths 8192,65536] [--g16-only] [--once]
//                           [--variant NAME] [--shape HQ,HKV,DQK,DV]
//
// --once: one forward and one backward of the first shape and length, then exit (for a profiler
// such as `ncu --metrics gpu__time_duration.sum`, which then sees each kernel exactly once).
// --variant NAME: only that variant (full, saved_o_branch, no_window, no_selection, phi_mlp_F4D,
// full_without_o, per_token, local_q, local_q_per_token) where the length has it; with --once, the one that runs.
// --shape HQ,HKV,DQK,DV: only that shape (e.g. 64,4,192,128 to profile the paper's head dims).
//
// Shapes: Hq = 64, Hkv = 4 (G = 16), D = 128; the same with the paper's head dims Dqk = 192,
// Dv = 128 (the full layer only); and G = 4 (Hq = 16, Hkv = 4), D = 128; paper block settings
// (l = 32, d = 16, l' = 64, n = 16, n_init = 1, n_local = 2, w = 512), phi = mean (the public
// NSA kernels' compression) and once phi = mlp (F = 4 D) at 64K.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "nsa/nsa.h"

namespace {


size_t g_tensor_bytes = 0;  // device bytes of the live Tensors (the library allocates nothing itself)

struct Tensor {
  void* data = nullptr;
  size_t bytes = 0;
  nsa::TensorView view;
  Tensor() = default;
  Tensor(nsa::DType dt, std::initializer_list<int64_t> shape, uint32_t seed = 0, float lo = -1.f, float hi = 1.f) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    bytes = n * nsa::dtype_size(dt);
    if (bytes) BENCH_CHECK(cudaMalloc(&data, bytes));
    g_tensor_bytes += bytes;
    view = nsa::make_view(data, dt, shape, nsa::Device::cuda);
    if (seed != 0 && dt == nsa::DType::bf16)
      fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(data), view.numel(), seed, lo, hi);
  }
  ~Tensor() {
    if (data) cudaFree(data);
    g_tensor_bytes -= bytes;
  }
  Tensor(const Tensor&) = delete;
};


// Keys attended per (token, query head), summed over tokens, per branch.
void attended_keys(const nsa::Config& c, int64_t T, double keys[3]) {
  keys[0] = keys[1] = keys[2] = 0;
  for (int64_t t = 0; t < T; ++t) {
    keys[0] += double(nsa::visible_cmp_blocks(t, c.cmp_block_len, c.cmp_stride));
    const int64_t blocks = std::min<int64_t>(c.n_selected, nsa::last_slc_block(t, c.slc_block_len) + 1);
    keys[1] += double(std::min<int64_t>(t + 1, blocks * c.slc_block_len - c.slc_block_len / 2));
    keys[2] += double(std::min<int64_t>(t + 1, c.window));
  }
}

struct Shape {
  int64_t hq, hkv, dqk, dv;
};

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = "nsa_backward_bench.csv";
  bool quick = false, g16_only = false, once = false;
  Shape only_shape{0, 0, 0, 0};
  const char* only_variant = nullptr;
  std::vector<int64_t> chosen;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--g16-only")) g16_only = true;
    else if (!std::strcmp(argv[i], "--once")) once = true;
    else if (!std::strcmp(argv[i], "--variant") && i + 1 < argc) only_variant = argv[++i];
    else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      int v[4] = {0, 0, 0, 0}, n = 0;
      const std::string given = argv[++i];  // (strtok cuts argv[i])
      for (char* tok = std::strtok(argv[i], ","); tok; tok = std::strtok(nullptr, ",")) {
        if (n < 4) v[n] = std::atoi(tok);
        ++n;  // (a fifth value is an error too)
      }
      if (n != 4 || v[0] <= 0 || v[1] <= 0 || v[0] % v[1] != 0 || (v[2] != 64 && v[2] != 128 && v[2] != 192) ||
          (v[3] != 64 && v[3] != 128)) {
        std::fprintf(stderr, "--shape '%s': expected HQ,HKV,DQK,DV with HQ a multiple of HKV, DQK in {64,128,192}, DV in {64,128}\n",
                     given.c_str());
        return 2;
      }
      only_shape = Shape{v[0], v[1], v[2], v[3]};
    } else if (!std::strcmp(argv[i], "--lengths") && i + 1 < argc)
      for (char* tok = std::strtok(argv[++i], ","); tok; tok = std::strtok(nullptr, ",")) chosen.push_back(std::atoll(tok));
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  FILE* csv = std::fopen(out_path, "w");
  if (!csv) {
    std::perror(out_path);
    return 1;
  }
  std::fprintf(csv, "T,hq,hkv,dqk,dv,variant,fwd_ms,bwd_ms,fwd_bwd_ms,bwd_tflops,ws_mb,qkvo_mb,peak_mb\n");
  std::vector<int64_t> lengths = quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 16384, 32768, 65536};
  if (!chosen.empty()) lengths = chosen;
  std::vector<Shape> shapes = {{64, 4, 128, 128}, {64, 4, 192, 128}, {16, 4, 128, 128}};
  if (g16_only) shapes.resize(1);
  if (only_shape.hq) shapes = {only_shape};
  nsa::CudaKernelChoices choices;  // per variant: the selection's union tiles or its per-token kernels
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cuda;
  ctx.cuda_choices = &choices;
  const nsa::DType bf16 = nsa::DType::bf16;

  for (const Shape& s : shapes) {
    for (int64_t T : lengths) {
      // Variants: the full layer, then one branch off at a time (64K and 8K only, G = 16); at Dqk 192
      // the full layer only.
      const bool square = s.dqk == s.dv;
      struct Variant {
        const char* name;
        int64_t n, w;
        nsa::PhiKind phi;
        bool o_branch;  // the forward keeps each branch's output, the backward takes dg from it
        bool local_q = false;  // queries alike over 64 tokens (fill_local), as in trained models: last
        bool per_token = false;  // the selection's union tiles off (forward and backward): the A/B of them
        bool without_o = false;  // the backward is not given the forward's o (its selection recomputes o_slc)
      };
      std::vector<Variant> variants = {{"full", 16, 512, nsa::PhiKind::mean, false}};
      if (square) variants.push_back({"saved_o_branch", 16, 512, nsa::PhiKind::mean, true});
      if (square && s.hq == 64 && (T == 65536 || T == 8192)) {
        variants.push_back({"no_window", 16, 0, nsa::PhiKind::mean, false});
        variants.push_back({"no_selection", 0, 512, nsa::PhiKind::mean, false});
        if (T == 65536) variants.push_back({"phi_mlp_F4D", 16, 512, nsa::PhiKind::mlp, false});
      }
      if (square && T == 65536) {
        variants.push_back({"full_without_o", 16, 512, nsa::PhiKind::mean, false, false, false, true});
        variants.push_back({"per_token", 16, 512, nsa::PhiKind::mean, false, false, true});
        variants.push_back({"local_q", 16, 512, nsa::PhiKind::mean, false, true});
        variants.push_back({"local_q_per_token", 16, 512, nsa::PhiKind::mean, false, true, true});
      }
      Tensor q(bf16, {T, s.hq, s.dqk}, 1);
      std::unique_ptr<Tensor> k[3], v[3], dk[3], dv[3];
      for (int b = 0; b < 3; ++b) {
        k[b] = std::make_unique<Tensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dqk}, 2 + 2 * b);
        v[b] = std::make_unique<Tensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dv}, 3 + 2 * b);
        dk[b] = std::make_unique<Tensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dqk});
        dv[b] = std::make_unique<Tensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dv});
      }
      Tensor g(bf16, {T, s.hq, 3}, 8, 0.f, 1.f);
      Tensor d_o(bf16, {T, s.hq, s.dv}, 9);
      Tensor o(bf16, {T, s.hq, s.dv}), lse(nsa::DType::f32, {T, s.hq, 3});
      Tensor dq(bf16, {T, s.hq, s.dqk}), dg(bf16, {T, s.hq, 3});
      const double qkvo_bytes = double(q.bytes) + double(o.bytes) + 3.0 * double(k[0]->bytes + v[0]->bytes);
      for (const Variant& var : variants) {
        if (only_variant != nullptr && std::strcmp(only_variant, var.name) != 0) continue;
        if (var.local_q)  // (q is this length's own: the variants after it, if any, would see it too)
          fill_local<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q.data), q.view.numel(), s.hq * s.dqk, 64, 21);
        choices.slc_union_tiles = !var.per_token;
        nsa::Config cfg;
        cfg.phi = var.phi;
        cfg.n_selected = var.n;
        cfg.n_init = var.n ? 1 : 0;
        cfg.n_local = var.n ? 2 : 0;
        cfg.window = var.w;
        const int64_t l = cfg.cmp_block_len;
        const bool mlp = var.phi == nsa::PhiKind::mlp;
        // phi's parameters and their gradients (mlp only): w1, b1, w2, b2, pe per phi_k / phi_v.
        std::vector<std::unique_ptr<Tensor>> params;
        nsa::PhiParams phik, phiv, dphik, dphiv;
        if (mlp) {
          auto make = [&](std::initializer_list<int64_t> shape, uint32_t seed, float lo, float hi) {
            params.push_back(std::make_unique<Tensor>(bf16, shape, seed, lo, hi));
            return params.back()->view;
          };
          auto make_phi = [&](uint32_t seed, int64_t D) {  // F = 4 D
            const int64_t F = 4 * D;
            return nsa::PhiParams{make({F, l * D}, seed, -0.01f, 0.01f), make({F}, seed + 1, -1.f, 1.f),
                                  make({D, F}, seed + 2, -0.05f, 0.05f), make({D}, seed + 3, -1.f, 1.f),
                                  make({l, D}, seed + 4, -1.f, 1.f)};
          };
          phik = make_phi(21, s.dqk);
          phiv = make_phi(31, s.dv);
          dphik = make_phi(0, s.dqk);
          dphiv = make_phi(0, s.dv);
        }
        Tensor idx(nsa::DType::i32, {T, s.hkv, cfg.n_selected});
        nsa::Inputs in;
        in.q = q.view;
        for (int b = 0; b < 3; ++b) in.kv[b] = {k[b]->view, v[b]->view};
        in.g = g.view;
        in.phi_k = phik;
        in.phi_v = phiv;
        std::unique_ptr<Tensor> ob;
        if (var.o_branch) ob = std::make_unique<Tensor>(bf16, std::initializer_list<int64_t>{3, T, s.hq, s.dv});
        const nsa::ForwardOutputs out{o.view, lse.view, idx.view, ob ? ob->view : nsa::TensorView()};
        // What the backward is given: the forward's outputs, o left out for `without_o`.
        const nsa::ForwardOutputs saved{var.without_o ? nsa::TensorView() : o.view, lse.view, idx.view, out.o_branch};
        nsa::Gradients grads;
        grads.dq = dq.view;
        for (int b = 0; b < 3; ++b) grads.dkv[b] = {dk[b]->view, dv[b]->view};
        grads.dg = dg.view;
        grads.dphi_k = dphik;
        grads.dphi_v = dphiv;
        const nsa::Problem pr = nsa::problem_of(cfg, in);
        const size_t fws = nsa::workspace_size(ctx, nsa::Op::forward, cfg, pr);
        const size_t bws = nsa::workspace_size(ctx, nsa::Op::backward, cfg, pr);
        void *fbuf = nullptr, *bbuf = nullptr;
        if (fws) BENCH_CHECK(cudaMalloc(&fbuf, fws));
        if (bws) BENCH_CHECK(cudaMalloc(&bbuf, bws));
        const nsa::Workspace fw{fbuf, fws}, bw{bbuf, bws};
        const int reps = T >= 65536 ? 5 : 9;
        nsa::forward(ctx, cfg, in, out, fw);  // lse and indices for the backward
        BENCH_CHECK(cudaDeviceSynchronize());
        if (once) {
          nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw);
          BENCH_CHECK(cudaDeviceSynchronize());
          std::printf("T=%lld Hq=%lld: one forward and one backward done\n", (long long)T, (long long)s.hq);
          return 0;
        }
        const double t_f = time_ms([&] { nsa::forward(ctx, cfg, in, out, fw); }, 1, reps);
        const double t_b = time_ms([&] { nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw); }, 1, reps);
        const double t_fb = time_ms([&] {
          nsa::forward(ctx, cfg, in, out, fw);
          nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw);
        }, 1, reps);
        // Useful backward FLOPs as a plain attention backward counts them: per (token, head, key)
        // QK^T, dO V^T, dQ, dK, dV = 2 * (3 Dqk + 2 Dv).
        double keys[3];
        attended_keys(cfg, T, keys);
        const double bwd_flops = (keys[0] + keys[1] + keys[2]) * s.hq * 2.0 * (3.0 * s.dqk + 2.0 * s.dv);
        const double tf = bwd_flops / (t_b * 1e-3) / 1e12;
        // Peak device memory of a training step through the layer: every tensor it reads or writes
        // (inputs with three K/V pairs, o, lse, indices, o_branch where kept, dO, every gradient, phi's
        // parameters) and the larger of the two workspaces (the forward's is not needed once it ran).
        const double peak_bytes = double(g_tensor_bytes) + double(std::max(fws, bws));
        std::printf("T=%6lld Hq=%2lld Hkv=%lld D=%lld/%lld %-12s fwd %8.2f ms  bwd %8.2f ms  fwd+bwd %8.2f ms  "
                    "(bwd %5.1f TFLOP/s)  bwd workspace %.1f MB = %.1f%% of q,k,v,o (%.0f MB), peak %.0f MB\n",
                    (long long)T, (long long)s.hq, (long long)s.hkv, (long long)s.dqk, (long long)s.dv, var.name, t_f, t_b,
                    t_fb, tf,
                    bws / 1e6, 100.0 * bws / qkvo_bytes, qkvo_bytes / 1e6, peak_bytes / 1e6);
        std::fprintf(csv, "%lld,%lld,%lld,%lld,%lld,%s,%.4f,%.4f,%.4f,%.2f,%.2f,%.2f,%.2f\n", (long long)T,
                     (long long)s.hq, (long long)s.hkv, (long long)s.dqk, (long long)s.dv, var.name, t_f, t_b, t_fb, tf,
                     bws / 1e6, qkvo_bytes / 1e6, peak_bytes / 1e6);
        std::fflush(csv);
        if (fbuf) cudaFree(fbuf);
        if (bbuf) cudaFree(bbuf);
      }
    }
  }
  std::fclose(csv);
  return 0;
}
