// Benchmark of the CUDA forward: the whole forward and each stage, bf16, random data,
// CUDA events, warm-up, median of repeats. Writes a CSV that bench/sdpa_baseline.py joins with
// PyTorch SDPA (dense causal GQA attention) measured in the same gpu_check.sh run.
//
//   nsa_cuda_bench [--out FILE.csv] [--quick] [--no-locality] [--lengths 8192,65536]
//
// Shapes: T in {8K .. 128K}; Hq = 64, Hkv = 4 (G = 16) with D = 128 and with the
// paper's Dqk = 192 / Dv = 128; and G = 4 (Hq = 16, Hkv = 4), D = 128. Paper block settings
// l = 32, d = 16, l' = 64, n = 16, n_init = 1, n_local = 2, w = 512, phi = mean (the public NSA
// kernels' compression; mlp is timed once separately).
//
// Every input tensor is far larger than the 60 MB L2 at these sizes, so repeats are not
// flattered by cached inputs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "nsa/nsa.h"

namespace {


struct Buffer {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t b) : bytes(b) {
    if (b) BENCH_CHECK(cudaMalloc(&data, b));
  }
  ~Buffer() {
    if (data) cudaFree(data);
  }
  Buffer(const Buffer&) = delete;
};

struct Tensor {
  Buffer buf;
  nsa::TensorView view;
  Tensor(nsa::DType dt, std::initializer_list<int64_t> shape, uint32_t seed = 0, float lo = -1.f, float hi = 1.f)
      : buf([&] {
          size_t n = 1;
          for (int64_t s : shape) n *= static_cast<size_t>(s);
          return n * nsa::dtype_size(dt);
        }()) {
    view = nsa::make_view(buf.data, dt, shape, nsa::Device::cuda);
    if (seed != 0 && dt == nsa::DType::bf16)
      fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(buf.data), view.numel(), seed, lo, hi);
  }
};


struct Shape {
  int64_t T, hq, hkv, dqk, dv;
};

// Keys attended per query head, summed over tokens, per branch (spec §2, §5, §6).
void attended_keys(const nsa::Config& c, int64_t T, double keys[3]) {
  keys[0] = keys[1] = keys[2] = 0;
  for (int64_t t = 0; t < T; ++t) {
    keys[0] += static_cast<double>(nsa::visible_cmp_blocks(t, c.cmp_block_len, c.cmp_stride));
    const int64_t blocks = std::min<int64_t>(c.n_selected, nsa::last_slc_block(t, c.slc_block_len) + 1);
    // The block holding t is cut at t: count it as half a block on average.
    keys[1] += static_cast<double>(std::min<int64_t>(t + 1, blocks * c.slc_block_len - c.slc_block_len / 2));
    keys[2] += static_cast<double>(std::min<int64_t>(t + 1, c.window));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = "nsa_bench.csv";
  bool quick = false, locality = true;
  const char* lengths_arg = nullptr;  // comma-separated sequence lengths (a short device run)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--no-locality")) locality = false;
    else if (!std::strcmp(argv[i], "--lengths") && i + 1 < argc) lengths_arg = argv[++i];
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  FILE* csv = std::fopen(out_path, "w");
  if (!csv) {
    std::perror(out_path);
    return 1;
  }
  std::fprintf(csv, "T,hq,hkv,dqk,dv,stage,ms,tflops\n");

  nsa::Config cfg;  // paper settings
  cfg.phi = nsa::PhiKind::mean;
  std::vector<int64_t> lengths = quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 16384, 32768, 65536, 131072};
  if (lengths_arg != nullptr) {
    lengths.clear();
    for (const char* c = lengths_arg; *c != '\0';) {
      char* end = nullptr;
      const long long T = std::strtoll(c, &end, 10);
      if (end == c || T <= 0) {
        std::fprintf(stderr, "--lengths wants positive integers separated by commas, got %s\n", lengths_arg);
        return 2;
      }
      lengths.push_back(T);
      c = *end == ',' ? end + 1 : end;
    }
  }
  const std::vector<Shape> shapes = {{0, 64, 4, 128, 128}, {0, 64, 4, 192, 128}, {0, 16, 4, 128, 128}};
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cuda;
  const nsa::DType bf16 = nsa::DType::bf16;

  for (const Shape& base : shapes) {
    for (int64_t T : lengths) {
      const Shape s{T, base.hq, base.hkv, base.dqk, base.dv};
      const int64_t rows = nsa::cmp_rows(T, cfg.cmp_stride);
      const int64_t ns = nsa::num_slc_blocks(T, cfg.slc_block_len);
      Tensor q(bf16, {T, s.hq, s.dqk}, 1);
      Tensor k0(bf16, {T, s.hkv, s.dqk}, 2), v0(bf16, {T, s.hkv, s.dv}, 3);
      Tensor k1(bf16, {T, s.hkv, s.dqk}, 4), v1(bf16, {T, s.hkv, s.dv}, 5);
      Tensor k2(bf16, {T, s.hkv, s.dqk}, 6), v2(bf16, {T, s.hkv, s.dv}, 7);
      Tensor g(bf16, {T, s.hq, 3}, 8, 0.f, 1.f);
      Tensor o(bf16, {T, s.hq, s.dv}), lse(nsa::DType::f32, {T, s.hq, 3});
      Tensor idx(nsa::DType::i32, {T, s.hkv, cfg.n_selected});
      Tensor kc(bf16, {rows, s.hkv, s.dqk}), vc(bf16, {rows, s.hkv, s.dv});
      Tensor scores(nsa::DType::f32, {T, s.hkv, ns});
      Tensor o_stage(bf16, {T, s.hq, s.dv}), lse_stage(nsa::DType::f32, {T, s.hq});
      nsa::Inputs in;
      in.q = q.view;
      in.kv[0] = {k0.view, v0.view};
      in.kv[1] = {k1.view, v1.view};
      in.kv[2] = {k2.view, v2.view};
      in.g = g.view;
      const nsa::ForwardOutputs out{o.view, lse.view, idx.view, nsa::TensorView()};
      const size_t ws_bytes = nsa::workspace_size(ctx, nsa::Op::forward, cfg, nsa::problem_of(cfg, in));
      Buffer ws(ws_bytes);
      const nsa::Workspace w{ws.data, ws_bytes};
      nsa::Sequences seqs;
      const int reps = T >= 65536 ? 7 : 11;

      double keys[3];
      attended_keys(cfg, T, keys);
      const double per_key_flops = 2.0 * (s.dqk + s.dv) * s.hq;  // QK^T and PV per (token, head, key)
      const double flops_branch[3] = {keys[0] * per_key_flops, keys[1] * per_key_flops, keys[2] * per_key_flops};
      auto report = [&](const char* stage, double ms, double flops) {
        const double tf = flops > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0;
        std::printf("T=%6lld Hq=%2lld Hkv=%lld D=%lld/%lld  %-22s %9.3f ms  %7.1f TFLOP/s\n", (long long)T,
                    (long long)s.hq, (long long)s.hkv, (long long)s.dqk, (long long)s.dv, stage, ms, tf);
        std::fprintf(csv, "%lld,%lld,%lld,%lld,%lld,%s,%.4f,%.2f\n", (long long)T, (long long)s.hq, (long long)s.hkv,
                     (long long)s.dqk, (long long)s.dv, stage, ms, tf);
        std::fflush(csv);
      };

      const double full = time_ms([&] { nsa::forward(ctx, cfg, in, out, w); }, 2, reps);
      report("forward", full, flops_branch[0] + flops_branch[1] + flops_branch[2]);
      const double t_phi = time_ms([&] {
        nsa::compress_fwd(ctx, cfg, {}, k0.view, seqs, kc.view);
        nsa::compress_fwd(ctx, cfg, {}, v0.view, seqs, vc.view);
      }, 1, reps);
      report("compress(mean)", t_phi, 0);
      const double t_cmp = time_ms([&] {
        nsa::compressed_attention_fwd(ctx, cfg, q.view, kc.view, vc.view, seqs, o_stage.view, lse_stage.view, scores.view);
      }, 1, reps);
      // Pass 2 recomputes Q K^T: counted as useful work of the scores here.
      report("cmp_attn+scores", t_cmp, flops_branch[0] * (2.0 * s.dqk + (2.0 * s.dqk + 2.0 * s.dv)) / (2.0 * (s.dqk + s.dv)));
      const double t_cmp_only = time_ms([&] {
        nsa::compressed_attention_fwd(ctx, cfg, q.view, kc.view, vc.view, seqs, o_stage.view, lse_stage.view, nsa::TensorView());
      }, 1, reps);
      report("cmp_attn(no scores)", t_cmp_only, flops_branch[0]);
      const double t_topn = time_ms([&] { nsa::select_topn(ctx, cfg, scores.view, seqs, idx.view); }, 1, reps);
      report("topn", t_topn, 0);
      const double t_slc = time_ms([&] {
        nsa::selected_attention_fwd(ctx, cfg, q.view, k1.view, v1.view, idx.view, seqs, o_stage.view, lse_stage.view, w);
      }, 1, reps);
      report("selection", t_slc, flops_branch[1]);
      const double t_win = time_ms([&] {
        nsa::window_attention_fwd(ctx, cfg, q.view, k2.view, v2.view, seqs, o_stage.view, lse_stage.view);
      }, 1, reps);
      report("window", t_win, flops_branch[2]);
      if (locality && s.dqk == 128) {  // the same shapes with queries that are locally alike
        constexpr int64_t kPeriod = 64;
        fill_local<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q.buf.data), q.view.numel(), s.hq * s.dqk, kPeriod, 21);
        const double t_full = time_ms([&] { nsa::forward(ctx, cfg, in, out, w); }, 2, reps);
        report("forward(local_q)", t_full, flops_branch[0] + flops_branch[1] + flops_branch[2]);
        const double t_sel = time_ms([&] {
          nsa::selected_attention_fwd(ctx, cfg, q.view, k1.view, v1.view, idx.view, seqs, o_stage.view, lse_stage.view, w);
        }, 1, reps);
        report("selection(local_q)", t_sel, flops_branch[1]);
      }
      if (T == 65536 && s.hq == 64 && s.dqk == 128) {  // the paper's phi once, for scale
        nsa::Config mlp = cfg;
        mlp.phi = nsa::PhiKind::mlp;
        const int64_t F = 4 * s.dqk;
        Tensor w1(bf16, {F, cfg.cmp_block_len * s.dqk}, 9, -0.01f, 0.01f), b1(bf16, {F}, 10), w2(bf16, {s.dqk, F}, 11, -0.05f, 0.05f),
            b2(bf16, {s.dqk}, 12), pe(bf16, {cfg.cmp_block_len, s.dqk}, 13);
        const nsa::PhiParams phi{w1.view, b1.view, w2.view, b2.view, pe.view};
        nsa::Problem pr = nsa::problem_of(cfg, in);
        pr.phi_hidden = F;
        const size_t mws = nsa::workspace_size(ctx, nsa::Op::compress_fwd, mlp, pr);
        Buffer mbuf(mws);
        const double t_mlp = time_ms([&] { nsa::compress_fwd(ctx, mlp, phi, k0.view, seqs, kc.view, {mbuf.data, mws}); }, 1, 3);
        report("compress(mlp_F=4D_k_only)", t_mlp, 2.0 * rows * s.hkv * (double(cfg.cmp_block_len) * s.dqk * F + double(F) * s.dqk));
      }
    }
  }
  std::fclose(csv);
  return 0;
}
