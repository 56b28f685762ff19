// `nsa bench --suite backward`: forward, backward and forward+backward of the whole CUDA layer,
// bf16, random data (cuda_fill.cu), CUDA events, warm-up, median of repeats; plus branch ablations
// (window off, selection off) that show where the backward's time goes, the full layer at 64K
// with locally alike queries (local_q, as the forward suite's), both also with the selection's
// union tiles off (per_token, local_q_per_token: their same-run A/B), the full layer with the
// backward not given the forward's o (full_without_o: the selection then recomputes o_slc for its
// D; every other variant passes o, as a training step would), saved_o_cmp with dK / dV in one
// warpgroup per CTA where they would run warp-specialised (saved_o_cmp_one_warpgroup_dkv, Dqk = Dv
// = 128 at 8K and 64K: the same-run A/B of dkv_ws_kernel), phi = mlp (F = 4D) without and with
// the forward's o_cmp (phi_mlp_F4D, saved_o_cmp_phi_mlp: the torch layer's call; Hq 64 at 8K and
// 64K), the latter with phi's bf16 products on mma.sync where they would run on cuBLASLt or wgmma
// (saved_o_cmp_phi_mlp_mma_sync: their same-run A/B), saved_o_cmp with the score pass's ring
// accumulator where it would write each chunk's blocks directly (saved_o_cmp_score_ring, Dqk = Dv =
// 128 at 8K and 64K: their same-run A/B), saved_o_cmp_win with the sm_90a score pass in 64- and in
// 128-row tiles (saved_o_cmp_win_scores_64, _128; Dqk = Dv = 128 at 8K and 64K: their same-run A/B,
// beside saved_o_cmp_win, the rule's) and with every chunk of the 64-row tiles multiplied behind a
// CTA barrier where the next chunk's products would run beside this chunk's sums
// (saved_o_cmp_win_scores_unpipelined: its same-run A/B), saved_o_cmp_win with the forward's online softmax max moved
// at every rise (saved_o_cmp_win_softmax_no_slack: the same-run A/B of its slack) and with the
// combining kernel (the selection by TMA; the window where it combines) reading o_cmp, the other
// branch's output and the gates without their L2 prefetch, without the window's prefetch of a
// later CTA's Q tile, or without either
// (saved_o_cmp_win_no_combine_prefetch, _no_next_q_prefetch, _no_prefetch: their same-run
// A/B), with the gated combine in the window kernel after the selection instead of in the selection
// kernels after the window (saved_o_cmp_win_combine_in_window: its same-run A/B), with the sm_90a
// selection forward 16 keys a step instead of by whole blocks (saved_o_cmp_win_slc_16_key_steps: its
// same-run A/B), with the sm_90a window in 64- and in 112-key chunks (saved_o_cmp_win_win_64, _112:
// their same-run A/B beside the rule's), the forward's
// o_cmp and o_win kept, so that the backward
// recomputes no branch output (saved_o_cmp_win; saved_o_cmp_win_phi_mlp: the torch layer's default
// call, Hq 64 at 8K and 64K; saved_o_cmp_win_phi_mlp_own_products: the same with phi's large products
// on the library's own wgmma kernels instead of cuBLASLt, their same-run A/B), and the backward's
// extra memory (its workspace) against the memory of q, k, v and o.
// Writes a CSV (T,hq,hkv,dqk,dv,variant,fwd_ms,bwd_ms,fwd_bwd_ms,bwd_tflops,ws_mb,qkvo_mb,peak_mb)
// that bench/sdpa_backward_baseline.py joins with PyTorch SDPA forward+backward measured in the
// same scripts/gpu_check.sh run.
//
//   nsa bench --suite backward [--out FILE.csv] [--quick] [--lengths 8192,65536] [--g16-only] [--once]
//                              [--variant NAME] [--shape HQ,HKV,DQK,DV]
//
// --once: one forward and one backward of the first shape and length, then exit (for a profiler
// such as `ncu --metrics gpu__time_duration.sum`, which then sees each kernel exactly once).
// --variant NAME: only that variant (kVariantNames) where the length has it; with --once, the one
// that runs. --shape HQ,HKV,DQK,DV: only that shape (e.g. 64,4,192,128 to profile the paper's head
// dims).
//
// Shapes: Hq = 64, Hkv = 4 (G = 16), D = 128; the same with the paper's head dims Dqk = 192,
// Dv = 128 (the full layer only); and G = 4 (Hq = 16, Hkv = 4), D = 128; paper block settings
// (l = 32, d = 16, l' = 64, n = 16, n_init = 1, n_local = 2, w = 512), phi = mean (the public
// NSA kernels' compression) and once phi = mlp (F = 4 D) at 64K.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "nsa/nsa.h"

namespace nsa_cli {
namespace {

const char* const kVariantNames[] = {"full",
                                     "saved_o_branch",
                                     "saved_o_cmp",
                                     "no_window",
                                     "no_selection",
                                     "phi_mlp_F4D",
                                     "saved_o_cmp_phi_mlp",
                                     "saved_o_cmp_phi_mlp_mma_sync",
                                     "full_without_o",
                                     "per_token",
                                     "local_q",
                                     "local_q_per_token",
                                     "saved_o_cmp_one_warpgroup_dkv",
                                     "saved_o_cmp_score_ring",
                                     "saved_o_cmp_win",
                                     "saved_o_cmp_win_phi_mlp",
                                     "saved_o_cmp_win_phi_mlp_own_products",
                                     "saved_o_cmp_win_scores_64",
                                     "saved_o_cmp_win_scores_128",
                                     "saved_o_cmp_win_scores_unpipelined",
                                     "saved_o_cmp_win_softmax_no_slack",
                                     "saved_o_cmp_win_no_combine_prefetch",
                                     "saved_o_cmp_win_no_next_q_prefetch",
                                     "saved_o_cmp_win_no_prefetch",
                                     "saved_o_cmp_win_combine_in_window",
                                     "saved_o_cmp_win_slc_16_key_steps",
                                     "saved_o_cmp_win_win_64",
                                     "saved_o_cmp_win_win_112"};

struct Shape {
  int64_t hq, hkv, dqk, dv;
};

struct BackwardSuiteOptions {
  SuiteOptions common;
  std::vector<Shape> shapes = {{64, 4, 128, 128}, {64, 4, 192, 128}, {16, 4, 128, 128}};
  std::string variant;  // empty: every variant
  bool once = false;
};

std::string variant_list() {
  std::string s;
  for (const char* v : kVariantNames) s += (s.empty() ? "" : ", ") + std::string(v);
  return s;
}

Shape parse_shape(const std::string& opt, const std::string& text) {
  std::vector<int64_t> v;
  for (const std::string& item : split_commas(text)) v.push_back(parse_int(opt, item));
  if (v.size() != 4 || v[0] <= 0 || v[1] <= 0 || v[0] % v[1] != 0 || (v[2] != 64 && v[2] != 128 && v[2] != 192) ||
      (v[3] != 64 && v[3] != 128))
    throw UsageError(opt + " \"" + text +
                     "\": expected HQ,HKV,DQK,DV with HQ a multiple of HKV, DQK in {64,128,192}, DV in {64,128}");
  return Shape{v[0], v[1], v[2], v[3]};
}

BackwardSuiteOptions parse_backward(const std::vector<std::string>& args) {
  BackwardSuiteOptions o;
  bool g16_only = false;
  Shape only_shape{0, 0, 0, 0};
  auto own = [&](const std::string& a, const std::function<std::string()>& value) {
    if (a == "--g16-only") g16_only = true;
    else if (a == "--once") o.once = true;
    else if (a == "--shape") only_shape = parse_shape(a, value());
    else if (a == "--variant") {
      o.variant = value();
      if (std::none_of(std::begin(kVariantNames), std::end(kVariantNames), [&](const char* v) { return o.variant == v; }))
        throw UsageError("--variant must be one of " + variant_list() + ", got \"" + o.variant + "\"");
    } else
      return false;
    return true;
  };
  o.common = parse_suite("backward", args, {"nsa_backward_bench.csv", {8192, 16384, 32768, 65536}},
                         "--out FILE, --quick, --lengths LIST, --g16-only, --once, --variant NAME, --shape HQ,HKV,DQK,DV",
                         own);
  if (g16_only) o.shapes.resize(1);
  if (only_shape.hq) o.shapes = {only_shape};
  return o;
}

struct Variant {
  const char* name;
  int64_t n, w;
  nsa::PhiKind phi;
  bool o_branch = false;   // the forward keeps each branch's output, the backward takes dg from it
  bool local_q = false;    // queries alike over 64 tokens (fill_local_bf16), as in trained models: last
  bool per_token = false;  // the selection's union tiles off (forward and backward): the A/B of them
  bool without_o = false;  // the backward is not given the forward's o (its selection recomputes o_slc)
  bool o_cmp = false;      // the forward keeps the compressed branch's output, the backward takes its dg from it
  bool o_win = false;      // the same for the window branch's (with o_cmp: no branch output recomputed)
  bool one_warpgroup_dkv = false;  // dK / dV by dkv_kernel where dkv_ws_kernel would run (CudaKernelChoices)
  bool phi_mma_sync = false;       // phi's bf16 products on mma.sync where they would run on cuBLASLt / wgmma (CudaKernelChoices)
  bool phi_own = false;            // phi's large bf16 products on wgmma where they would run on cuBLASLt (CudaKernelChoices)
  bool score_ring = false;         // the score pass's ring accumulator everywhere (CudaKernelChoices)
  int scores_rows = 0;             // the sm_90a score pass's row tiles, 64 or 128 (0: the rule; CudaKernelChoices)
  bool scores_unpipelined = false;  // the sm_90a score pass's chunks behind a CTA barrier each (CudaKernelChoices)
  bool no_slack = false;           // the forward's online softmax max at every rise (CudaKernelChoices)
  bool no_prefetch = false;        // the combining kernel's reads without their L2 prefetch (CudaKernelChoices)
  bool no_next_q = false;          // the window without its prefetch of a later CTA's Q (CudaKernelChoices)
  bool combine_in_window = false;  // the gated combine in the window kernel after the selection (CudaKernelChoices)
  bool slc_16_key_steps = false;   // the selection forward 16 keys a step, not by whole blocks (CudaKernelChoices)
  int win_chunk = 0;               // the sm_90a window's chunk keys, 64 or 112 (0: the rule; CudaKernelChoices)
};

// The variants of one shape and length: the full layer, then one branch off at a time (64K and 8K
// only, G = 16); at Dqk 192 the full layer only.
std::vector<Variant> variants_of(const Shape& s, int64_t T) {
  using nsa::PhiKind;
  const bool square = s.dqk == s.dv;
  std::vector<Variant> variants = {{.name = "full", .n = 16, .w = 512, .phi = PhiKind::mean}};
  if (square) {
    variants.push_back({.name = "saved_o_branch", .n = 16, .w = 512, .phi = PhiKind::mean, .o_branch = true});
    variants.push_back({.name = "saved_o_cmp", .n = 16, .w = 512, .phi = PhiKind::mean, .o_cmp = true});
    variants.push_back(
        {.name = "saved_o_cmp_win", .n = 16, .w = 512, .phi = PhiKind::mean, .o_cmp = true, .o_win = true});
  }
  if (square && s.dqk == 128 && (T == 65536 || T == 8192)) {
    variants.push_back({.name = "saved_o_cmp_one_warpgroup_dkv", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .one_warpgroup_dkv = true});
    variants.push_back(
        {.name = "saved_o_cmp_score_ring", .n = 16, .w = 512, .phi = PhiKind::mean, .o_cmp = true, .score_ring = true});
    for (int rows : {64, 128})
      variants.push_back({.name = rows == 64 ? "saved_o_cmp_win_scores_64" : "saved_o_cmp_win_scores_128", .n = 16,
                          .w = 512, .phi = PhiKind::mean, .o_cmp = true, .o_win = true, .scores_rows = rows});
    variants.push_back({.name = "saved_o_cmp_win_scores_unpipelined", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .scores_unpipelined = true});
    variants.push_back({.name = "saved_o_cmp_win_softmax_no_slack", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .no_slack = true});
    variants.push_back({.name = "saved_o_cmp_win_no_combine_prefetch", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .no_prefetch = true});
    variants.push_back({.name = "saved_o_cmp_win_no_next_q_prefetch", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .no_next_q = true});
    variants.push_back({.name = "saved_o_cmp_win_no_prefetch", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .no_prefetch = true, .no_next_q = true});
    variants.push_back({.name = "saved_o_cmp_win_combine_in_window", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .combine_in_window = true});
    variants.push_back({.name = "saved_o_cmp_win_slc_16_key_steps", .n = 16, .w = 512, .phi = PhiKind::mean,
                        .o_cmp = true, .o_win = true, .slc_16_key_steps = true});
    for (int keys : {64, 112})
      variants.push_back({.name = keys == 64 ? "saved_o_cmp_win_win_64" : "saved_o_cmp_win_win_112", .n = 16,
                          .w = 512, .phi = PhiKind::mean, .o_cmp = true, .o_win = true, .win_chunk = keys});
  }
  if (square && s.hq == 64 && (T == 65536 || T == 8192)) {
    variants.push_back({.name = "no_window", .n = 16, .w = 0, .phi = PhiKind::mean});
    variants.push_back({.name = "no_selection", .n = 0, .w = 512, .phi = PhiKind::mean});
    variants.push_back({.name = "phi_mlp_F4D", .n = 16, .w = 512, .phi = PhiKind::mlp});
    variants.push_back({.name = "saved_o_cmp_phi_mlp", .n = 16, .w = 512, .phi = PhiKind::mlp, .o_cmp = true});
    variants.push_back({.name = "saved_o_cmp_phi_mlp_mma_sync", .n = 16, .w = 512, .phi = PhiKind::mlp, .o_cmp = true,
                        .phi_mma_sync = true});
    variants.push_back({.name = "saved_o_cmp_win_phi_mlp", .n = 16, .w = 512, .phi = PhiKind::mlp, .o_cmp = true,
                        .o_win = true});
    variants.push_back({.name = "saved_o_cmp_win_phi_mlp_own_products", .n = 16, .w = 512, .phi = PhiKind::mlp,
                        .o_cmp = true, .o_win = true, .phi_own = true});
  }
  if (square && T == 65536) {
    variants.push_back({.name = "full_without_o", .n = 16, .w = 512, .phi = PhiKind::mean, .without_o = true});
    variants.push_back({.name = "per_token", .n = 16, .w = 512, .phi = PhiKind::mean, .per_token = true});
    variants.push_back({.name = "local_q", .n = 16, .w = 512, .phi = PhiKind::mean, .local_q = true});
    variants.push_back(
        {.name = "local_q_per_token", .n = 16, .w = 512, .phi = PhiKind::mean, .local_q = true, .per_token = true});
  }
  return variants;
}

}  // namespace

int run_backward_suite(const std::vector<std::string>& args) {
  const BackwardSuiteOptions opt = parse_backward(args);
  require_device("backward");
  CsvFile file(opt.common.out);
  FILE* csv = file.f;
  std::fprintf(csv, "T,hq,hkv,dqk,dv,variant,fwd_ms,bwd_ms,fwd_bwd_ms,bwd_tflops,ws_mb,qkvo_mb,peak_mb\n");
  nsa::CudaKernelChoices choices;  // per variant: the selection's union tiles or its per-token kernels
  nsa::Context ctx;
  ctx.backend = nsa::Backend::cuda;
  ctx.cuda_choices = &choices;
  const nsa::DType bf16 = nsa::DType::bf16;

  for (const Shape& s : opt.shapes) {
    for (int64_t T : opt.common.lengths) {
      const std::vector<Variant> variants = variants_of(s, T);
      DeviceTensor q(bf16, {T, s.hq, s.dqk}, 1);
      std::unique_ptr<DeviceTensor> k[3], v[3], dk[3], dv[3];
      for (int b = 0; b < 3; ++b) {
        k[b] = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dqk}, 2 + 2 * b);
        v[b] = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dv}, 3 + 2 * b);
        dk[b] = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dqk});
        dv[b] = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hkv, s.dv});
      }
      DeviceTensor g(bf16, {T, s.hq, 3}, 8, 0.f, 1.f);
      DeviceTensor d_o(bf16, {T, s.hq, s.dv}, 9);
      DeviceTensor o(bf16, {T, s.hq, s.dv}), lse(nsa::DType::f32, {T, s.hq, 3});
      DeviceTensor dq(bf16, {T, s.hq, s.dqk}), dg(bf16, {T, s.hq, 3});
      const double qkvo_bytes = double(q.bytes()) + double(o.bytes()) + 3.0 * double(k[0]->bytes() + v[0]->bytes());
      for (const Variant& var : variants) {
        if (!opt.variant.empty() && opt.variant != var.name) continue;
        if (var.local_q)  // (q is this length's own: the variants after it, if any, would see it too)
          fill_local_bf16(q.data(), q.view.numel(), s.hq * s.dqk, 64, 21);
        choices.slc_union_tiles = !var.per_token;
        choices.dkv_warp_specialized = !var.one_warpgroup_dkv;
        choices.phi_wgmma = !var.phi_mma_sync;
        choices.phi_blas = !var.phi_mma_sync && !var.phi_own;
        choices.cmp_scores_by_chunk = !var.score_ring;
        choices.cmp_scores_rows = var.scores_rows;
        choices.cmp_scores_pipelined = !var.scores_unpipelined;
        choices.softmax_max_slack = !var.no_slack;
        choices.combine_prefetch = !var.no_prefetch;
        choices.next_q_prefetch = !var.no_next_q;
        choices.combine_in_selection = !var.combine_in_window;
        choices.slc_block_steps = !var.slc_16_key_steps;
        choices.win_chunk = var.win_chunk;
        nsa::Config cfg;
        cfg.phi = var.phi;
        cfg.n_selected = var.n;
        cfg.n_init = var.n ? 1 : 0;
        cfg.n_local = var.n ? 2 : 0;
        cfg.window = var.w;
        const int64_t l = cfg.cmp_block_len;
        const bool mlp = var.phi == nsa::PhiKind::mlp;
        // phi's parameters and their gradients (mlp only): w1, b1, w2, b2, pe per phi_k / phi_v.
        std::vector<std::unique_ptr<DeviceTensor>> params;
        nsa::PhiParams phik, phiv, dphik, dphiv;
        if (mlp) {
          auto make = [&](std::initializer_list<int64_t> shape, uint32_t seed, float lo, float hi) {
            params.push_back(std::make_unique<DeviceTensor>(bf16, shape, seed, lo, hi));
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
        DeviceTensor idx(nsa::DType::i32, {T, s.hkv, cfg.n_selected});
        nsa::Inputs in;
        in.q = q.view;
        for (int b = 0; b < 3; ++b) in.kv[b] = {k[b]->view, v[b]->view};
        in.g = g.view;
        in.phi_k = phik;
        in.phi_v = phiv;
        std::unique_ptr<DeviceTensor> ob;
        if (var.o_branch) ob = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{3, T, s.hq, s.dv});
        if (var.o_cmp) ob = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hq, s.dv});
        std::unique_ptr<DeviceTensor> ow;
        if (var.o_win) ow = std::make_unique<DeviceTensor>(bf16, std::initializer_list<int64_t>{T, s.hq, s.dv});
        const nsa::TensorView kept = ob ? ob->view : nsa::TensorView();
        const nsa::ForwardOutputs out{o.view, lse.view, idx.view, var.o_branch ? kept : nsa::TensorView(),
                                      var.o_cmp ? kept : nsa::TensorView(), ow ? ow->view : nsa::TensorView()};
        // What the backward is given: the forward's outputs, o left out for `without_o`.
        const nsa::ForwardOutputs saved{var.without_o ? nsa::TensorView() : o.view, lse.view, idx.view, out.o_branch,
                                        out.o_cmp, out.o_win};
        nsa::Gradients grads;
        grads.dq = dq.view;
        for (int b = 0; b < 3; ++b) grads.dkv[b] = {dk[b]->view, dv[b]->view};
        grads.dg = dg.view;
        grads.dphi_k = dphik;
        grads.dphi_v = dphiv;
        const nsa::Problem pr = nsa::problem_of(cfg, in);
        const size_t fws = nsa::workspace_size(ctx, nsa::Op::forward, cfg, pr);
        const size_t bws = nsa::workspace_size(ctx, nsa::Op::backward, cfg, pr);
        const DeviceBuffer fbuf(fws), bbuf(bws);
        const nsa::Workspace fw{fbuf.data, fws}, bw{bbuf.data, bws};
        const int reps = T >= 65536 ? 5 : 9;
        nsa::forward(ctx, cfg, in, out, fw);  // lse and indices for the backward
        NSA_CLI_CUDA(cudaDeviceSynchronize());
        if (opt.once) {
          nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw);
          NSA_CLI_CUDA(cudaDeviceSynchronize());
          std::printf("T=%lld Hq=%lld: one forward and one backward done\n", (long long)T, (long long)s.hq);
          return 0;
        }
        const double t_f = median_ms(1, reps, [&] { nsa::forward(ctx, cfg, in, out, fw); });
        const double t_b = median_ms(1, reps, [&] { nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw); });
        const double t_fb = median_ms(1, reps, [&] {
          nsa::forward(ctx, cfg, in, out, fw);
          nsa::backward(ctx, cfg, in, saved, d_o.view, grads, bw);
        });
        // Useful backward FLOPs as a plain attention backward counts them: per (token, head, key)
        // QK^T, dO V^T, dQ, dK, dV = 2 * (3 Dqk + 2 Dv).
        double keys[3];
        attended_keys(cfg, T, keys);
        const double bwd_flops = (keys[0] + keys[1] + keys[2]) * s.hq * 2.0 * (3.0 * s.dqk + 2.0 * s.dv);
        const double tf = bwd_flops / (t_b * 1e-3) / 1e12;
        // Peak device memory of a training step through the layer: every tensor it reads or writes
        // (inputs with three K/V pairs, o, lse, indices, o_branch, o_cmp or o_win where kept, dO, every gradient, phi's
        // parameters) and the larger of the two workspaces (the forward's is not needed once it ran).
        const double peak_bytes = double(g_tensor_bytes) + double(std::max(fws, bws));
        std::printf("T=%6lld Hq=%2lld Hkv=%lld D=%lld/%lld %-12s fwd %8.2f ms  bwd %8.2f ms  fwd+bwd %8.2f ms  "
                    "(bwd %5.1f TFLOP/s)  bwd workspace %.1f MB = %.1f%% of q,k,v,o (%.0f MB), peak %.0f MB\n",
                    (long long)T, (long long)s.hq, (long long)s.hkv, (long long)s.dqk, (long long)s.dv, var.name, t_f, t_b,
                    t_fb, tf, bws / 1e6, 100.0 * bws / qkvo_bytes, qkvo_bytes / 1e6, peak_bytes / 1e6);
        std::fflush(stdout);
        std::fprintf(csv, "%lld,%lld,%lld,%lld,%lld,%s,%.4f,%.4f,%.4f,%.2f,%.2f,%.2f,%.2f\n", (long long)T,
                     (long long)s.hq, (long long)s.hkv, (long long)s.dqk, (long long)s.dv, var.name, t_f, t_b, t_fb, tf,
                     bws / 1e6, qkvo_bytes / 1e6, peak_bytes / 1e6);
        std::fflush(csv);
      }
    }
  }
  return 0;
}

}  // namespace nsa_cli
