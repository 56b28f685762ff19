// `nsa bench --suite forward`: the CUDA forward, whole and stage by stage, bf16, random data
// (cuda_fill.cu), CUDA events, warm-up, median of repeats. Writes a CSV (T,hq,hkv,dqk,dv,stage,ms,
// tflops) that bench/sdpa_baseline.py joins with PyTorch SDPA (dense causal GQA attention)
// measured in the same scripts/gpu_check.sh run.
//
//   nsa bench --suite forward [--out FILE.csv] [--quick] [--no-locality] [--lengths 8192,65536]
//
// Shapes: T in {8K .. 128K}; Hq = 64, Hkv = 4 (G = 16) with D = 128 and with the paper's
// Dqk = 192 / Dv = 128; and G = 4 (Hq = 16, Hkv = 4), D = 128. Paper block settings l = 32,
// d = 16, l' = 64, n = 16, n_init = 1, n_local = 2, w = 512, phi = mean (the public NSA kernels'
// compression; mlp is timed once separately, at 64K).
//
// Stages (CSV column `stage`): forward, compress(mean), cmp_attn+scores, cmp_attn(no scores), topn,
// selection, window; with queries alike over 64 tokens (D = 128 shapes, unless --no-locality):
// forward(local_q), selection(local_q); at 64K, Hq 64, D 128: compress(mlp_F=4D_k_only).
//
// Every input tensor is far larger than the 60 MB L2 at these sizes, so repeats are not
// flattered by cached inputs.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "nsa/nsa.h"

namespace nsa_cli {
namespace {

struct ForwardSuiteOptions {
  SuiteOptions common;
  bool locality = true;
};

ForwardSuiteOptions parse_forward(const std::vector<std::string>& args) {
  ForwardSuiteOptions o;
  o.common = parse_suite("forward", args, {"nsa_bench.csv", {8192, 16384, 32768, 65536, 131072}},
                         "--out FILE, --quick, --no-locality, --lengths LIST",
                         [&](const std::string& a, const std::function<std::string()>&) {
                           if (a != "--no-locality") return false;
                           o.locality = false;
                           return true;
                         });
  return o;
}

struct Shape {
  int64_t T, hq, hkv, dqk, dv;
};

}  // namespace

int run_forward_suite(const std::vector<std::string>& args) {
  const ForwardSuiteOptions opt = parse_forward(args);
  require_device("forward");
  CsvFile file(opt.common.out);
  FILE* csv = file.f;
  std::fprintf(csv, "T,hq,hkv,dqk,dv,stage,ms,tflops\n");

  nsa::Config cfg;  // paper settings
  cfg.phi = nsa::PhiKind::mean;
  const std::vector<Shape> shapes = {{0, 64, 4, 128, 128}, {0, 64, 4, 192, 128}, {0, 16, 4, 128, 128}};
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cuda;
  const nsa::DType bf16 = nsa::DType::bf16;

  for (const Shape& base : shapes) {
    for (int64_t T : opt.common.lengths) {
      const Shape s{T, base.hq, base.hkv, base.dqk, base.dv};
      const int64_t rows = nsa::cmp_rows(T, cfg.cmp_stride);
      const int64_t ns = nsa::num_slc_blocks(T, cfg.slc_block_len);
      DeviceTensor q(bf16, {T, s.hq, s.dqk}, 1);
      DeviceTensor k0(bf16, {T, s.hkv, s.dqk}, 2), v0(bf16, {T, s.hkv, s.dv}, 3);
      DeviceTensor k1(bf16, {T, s.hkv, s.dqk}, 4), v1(bf16, {T, s.hkv, s.dv}, 5);
      DeviceTensor k2(bf16, {T, s.hkv, s.dqk}, 6), v2(bf16, {T, s.hkv, s.dv}, 7);
      DeviceTensor g(bf16, {T, s.hq, 3}, 8, 0.f, 1.f);
      DeviceTensor o(bf16, {T, s.hq, s.dv}), lse(nsa::DType::f32, {T, s.hq, 3});
      DeviceTensor idx(nsa::DType::i32, {T, s.hkv, cfg.n_selected});
      DeviceTensor kc(bf16, {rows, s.hkv, s.dqk}), vc(bf16, {rows, s.hkv, s.dv});
      DeviceTensor scores(nsa::DType::f32, {T, s.hkv, ns});
      DeviceTensor o_stage(bf16, {T, s.hq, s.dv}), lse_stage(nsa::DType::f32, {T, s.hq});
      nsa::Inputs in;
      in.q = q.view;
      in.kv[0] = {k0.view, v0.view};
      in.kv[1] = {k1.view, v1.view};
      in.kv[2] = {k2.view, v2.view};
      in.g = g.view;
      const nsa::ForwardOutputs out{o.view, lse.view, idx.view, nsa::TensorView(), nsa::TensorView(), nsa::TensorView()};
      const size_t ws_bytes = nsa::workspace_size(ctx, nsa::Op::forward, cfg, nsa::problem_of(cfg, in));
      DeviceBuffer ws(ws_bytes);
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
        std::fflush(stdout);
        std::fprintf(csv, "%lld,%lld,%lld,%lld,%lld,%s,%.4f,%.2f\n", (long long)T, (long long)s.hq, (long long)s.hkv,
                     (long long)s.dqk, (long long)s.dv, stage, ms, tf);
        std::fflush(csv);
      };

      const double full = median_ms(2, reps, [&] { nsa::forward(ctx, cfg, in, out, w); });
      report("forward", full, flops_branch[0] + flops_branch[1] + flops_branch[2]);
      const size_t cws_bytes = nsa::workspace_size(ctx, nsa::Op::compress_fwd, cfg, nsa::problem_of(cfg, in));
      DeviceBuffer cws(cws_bytes);  // phi's row table
      const double t_phi = median_ms(1, reps, [&] {
        nsa::compress_fwd(ctx, cfg, {}, k0.view, seqs, kc.view, {cws.data, cws_bytes});
        nsa::compress_fwd(ctx, cfg, {}, v0.view, seqs, vc.view, {cws.data, cws_bytes});
      });
      report("compress(mean)", t_phi, 0);
      const double t_cmp = median_ms(1, reps, [&] {
        nsa::compressed_attention_fwd(ctx, cfg, q.view, kc.view, vc.view, seqs, o_stage.view, lse_stage.view, scores.view);
      });
      // Pass 2 recomputes Q K^T: counted as useful work of the scores here.
      report("cmp_attn+scores", t_cmp, flops_branch[0] * (2.0 * s.dqk + (2.0 * s.dqk + 2.0 * s.dv)) / (2.0 * (s.dqk + s.dv)));
      const double t_cmp_only = median_ms(1, reps, [&] {
        nsa::compressed_attention_fwd(ctx, cfg, q.view, kc.view, vc.view, seqs, o_stage.view, lse_stage.view, nsa::TensorView());
      });
      report("cmp_attn(no scores)", t_cmp_only, flops_branch[0]);
      const double t_topn = median_ms(1, reps, [&] { nsa::select_topn(ctx, cfg, scores.view, seqs, idx.view); });
      report("topn", t_topn, 0);
      const double t_slc = median_ms(1, reps, [&] {
        nsa::selected_attention_fwd(ctx, cfg, q.view, k1.view, v1.view, idx.view, seqs, o_stage.view, lse_stage.view, w);
      });
      report("selection", t_slc, flops_branch[1]);
      const double t_win = median_ms(1, reps, [&] {
        nsa::window_attention_fwd(ctx, cfg, q.view, k2.view, v2.view, seqs, o_stage.view, lse_stage.view);
      });
      report("window", t_win, flops_branch[2]);
      if (opt.locality && s.dqk == 128) {  // the same shapes with queries that are locally alike
        constexpr int64_t kPeriod = 64;
        fill_local_bf16(q.data(), q.view.numel(), s.hq * s.dqk, kPeriod, 21);
        const double t_full = median_ms(2, reps, [&] { nsa::forward(ctx, cfg, in, out, w); });
        report("forward(local_q)", t_full, flops_branch[0] + flops_branch[1] + flops_branch[2]);
        const double t_sel = median_ms(1, reps, [&] {
          nsa::selected_attention_fwd(ctx, cfg, q.view, k1.view, v1.view, idx.view, seqs, o_stage.view, lse_stage.view, w);
        });
        report("selection(local_q)", t_sel, flops_branch[1]);
      }
      if (T == 65536 && s.hq == 64 && s.dqk == 128) {  // the paper's phi once, for scale
        nsa::Config mlp = cfg;
        mlp.phi = nsa::PhiKind::mlp;
        const int64_t F = 4 * s.dqk;
        DeviceTensor w1(bf16, {F, cfg.cmp_block_len * s.dqk}, 9, -0.01f, 0.01f), b1(bf16, {F}, 10),
            w2(bf16, {s.dqk, F}, 11, -0.05f, 0.05f), b2(bf16, {s.dqk}, 12), pe(bf16, {cfg.cmp_block_len, s.dqk}, 13);
        const nsa::PhiParams phi{w1.view, b1.view, w2.view, b2.view, pe.view};
        nsa::Problem pr = nsa::problem_of(cfg, in);
        pr.phi_hidden = F;
        const size_t mws = nsa::workspace_size(ctx, nsa::Op::compress_fwd, mlp, pr);
        DeviceBuffer mbuf(mws);
        const double t_mlp = median_ms(1, 3, [&] { nsa::compress_fwd(ctx, mlp, phi, k0.view, seqs, kc.view, {mbuf.data, mws}); });
        report("compress(mlp_F=4D_k_only)", t_mlp, 2.0 * rows * s.hkv * (double(cfg.cmp_block_len) * s.dqk * F + double(F) * s.dqk));
      }
    }
  }
  return 0;
}

}  // namespace nsa_cli
