// Bad input: every invalid configuration, shape, dtype, stride or sequence table is an nsa::Error
// naming the parameter and its value (docs/errors.md lists them). None may crash; the sanitizer
// build runs these too.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <string>

#include "test_cpu_support.h"

namespace nsa::test {
namespace {

struct BadCase {
  std::string name;
  std::string parameter;  // what nsa::Error::parameter() must say
  std::string value;      // what nsa::Error::value() must say ("" = not checked)
  // Breaks a valid problem (before the call) and may change the config.
  std::function<void(LayerProblem&, Config&, Context&, Inputs&, ForwardOutputs&)> spoil;
};

LayerProblem valid_problem(PhiKind phi = PhiKind::mlp, bool shared = false) {
  Config cfg = small_config();
  cfg.phi = phi;
  cfg.shared_kv = shared;
  Sizes s;
  s.seqlens = {20, 13};
  s.hq = 4, s.hkv = 2;
  return make_problem(cfg, s, 1);
}

std::vector<BadCase> bad_cases() {
  using P = LayerProblem;
  std::vector<BadCase> c;
  auto cfg_case = [&](std::string name, std::string param, std::string value, std::function<void(Config&)> f) {
    c.push_back({std::move(name), std::move(param), std::move(value),
                 [f](P&, Config& cfg, Context&, Inputs&, ForwardOutputs&) { f(cfg); }});
  };
  cfg_case("l_zero", "cmp_block_len (l)", "0", [](Config& g) { g.cmp_block_len = 0; });
  cfg_case("d_zero", "cmp_stride (d)", "0", [](Config& g) { g.cmp_stride = 0; });
  cfg_case("d_not_dividing_l", "cmp_stride (d)", "3", [](Config& g) { g.cmp_stride = 3; });
  cfg_case("d_not_dividing_lp", "cmp_stride (d)", "8", [](Config& g) { g.cmp_stride = 8; g.cmp_block_len = 16; g.slc_block_len = 12; });
  cfg_case("lp_zero", "slc_block_len (l')", "0", [](Config& g) { g.slc_block_len = 0; });
  cfg_case("n_negative", "n_selected (n)", "-1", [](Config& g) { g.n_selected = -1; });
  cfg_case("n_init_negative", "n_init", "-2", [](Config& g) { g.n_init = -2; });
  cfg_case("n_local_negative", "n_local", "-1", [](Config& g) { g.n_local = -1; });
  cfg_case("forced_over_n", "n_init + n_local", "4", [](Config& g) { g.n_init = 2; g.n_local = 2; });
  cfg_case("window_negative", "window (w)", "-3", [](Config& g) { g.window = -3; });
  cfg_case("scale_nan", "scale", "nan", [](Config& g) { g.scale = std::nan(""); });
  cfg_case("scale_negative", "scale", "-0.5", [](Config& g) { g.scale = -0.5; });
  cfg_case("phi_out_of_range", "phi", "7", [](Config& g) { g.phi = static_cast<PhiKind>(7); });
  // Upper bounds (kMaxLength, kMaxScale): products and sums of these fields must not wrap.
  cfg_case("lp_max", "slc_block_len (l')", "9223372036854775807", [](Config& g) { g.cmp_stride = 1; g.slc_block_len = INT64_MAX; });
  cfg_case("l_above_2_31", "cmp_block_len (l)", "2147483648", [](Config& g) { g.cmp_stride = 1; g.cmp_block_len = int64_t{1} << 31; });
  cfg_case("n_above_2_31", "n_selected (n)", "4294967296", [](Config& g) { g.n_selected = int64_t{1} << 32; });
  cfg_case("forced_sum_wraps", "n_init", "4611686018427387904", [](Config& g) { g.n_init = g.n_local = int64_t{1} << 62; });
  cfg_case("window_max", "window (w)", "9223372036854775807", [](Config& g) { g.window = INT64_MAX; });
  cfg_case("scale_above_fp32", "scale", "", [](Config& g) { g.scale = 1e39; });
  cfg_case("backbone_offset_above_2_31", "backbone_offsets[0]", "2147483648", [](Config& g) { g.set_backbone({int64_t{1} << 31}); });

  auto in_case = [&](std::string name, std::string param, std::string value,
                     std::function<void(P&, Inputs&)> f) {
    c.push_back({std::move(name), std::move(param), std::move(value),
                 [f](P& p, Config&, Context&, Inputs& in, ForwardOutputs&) { f(p, in); }});
  };
  in_case("q_absent", "q", "absent", [](P&, Inputs& in) { in.q = TensorView(); });
  in_case("q_2d", "q.ndim", "2", [](P&, Inputs& in) { in.q.ndim = 2; });
  in_case("q_int32", "q.dtype", "i32", [](P&, Inputs& in) { in.q.dtype = DType::i32; });
  in_case("hq_not_multiple_of_hkv", "q.shape[1] (Hq)", "3", [](P&, Inputs& in) { in.q.shape[1] = 3; });
  in_case("k_cmp_wrong_length", "k_cmp.shape[0]", "32", [](P&, Inputs& in) { in.kv[kCmp].k.shape[0] = 32; });
  in_case("k_cmp_wrong_head_dim", "k_cmp.shape[2]", "7", [](P&, Inputs& in) { in.kv[kCmp].k.shape[2] = 7; });
  in_case("v_slc_wrong_dv", "v_slc.shape[2]", "4", [](P&, Inputs& in) { in.kv[kSlc].v.shape[2] = 4; });
  in_case("k_win_absent", "k_win", "absent", [](P&, Inputs& in) { in.kv[kWin].k = TensorView(); });
  in_case("k_win_dtype_mismatch", "k_win.dtype", "f32", [](P&, Inputs& in) { in.kv[kWin].k.dtype = DType::f32; });
  in_case("g_two_gates", "g.shape[2]", "2", [](P&, Inputs& in) { in.g.shape[2] = 2; });
  in_case("q_inner_stride", "q.stride[2]", "2", [](P&, Inputs& in) { in.q.stride[2] = 2; });
  in_case("k_slc_negative_stride", "k_slc.stride[0]", "-16", [](P&, Inputs& in) { in.kv[kSlc].k.stride[0] = -16; });
  in_case("v_win_null", "v_win.data", "null", [](P&, Inputs& in) { in.kv[kWin].v.data = nullptr; });
  in_case("v_cmp_on_cuda", "v_cmp.device", "cuda:0", [](P&, Inputs& in) { in.kv[kCmp].v.device = Device::cuda; });
  in_case("phi_k_b1_absent", "phi_k.b1", "absent", [](P&, Inputs& in) { in.phi_k.b1 = TensorView(); });
  in_case("phi_v_w2_wrong", "phi_v.w2.shape[0]", "5", [](P&, Inputs& in) { in.phi_v.w2.shape[0] = 5; });
  in_case("phi_k_pe_wrong_l", "phi_k.pe.shape[0]", "9", [](P&, Inputs& in) { in.phi_k.pe.shape[0] = 9; });
  in_case("cu_seqlens_float", "cu_seqlens.dtype", "f32", [](P&, Inputs& in) { in.seqs.cu_seqlens.dtype = DType::f32; });
  in_case("cu_seqlens_not_from_zero", "cu_seqlens[0]", "1", [](P& p, Inputs&) { p.cu.set(0, 1); });
  in_case("cu_seqlens_decreasing", "cu_seqlens[2]", "5", [](P& p, Inputs&) { p.cu.set(2, 5); });
  in_case("cu_seqlens_short_of_T", "cu_seqlens[2]", "30", [](P& p, Inputs&) { p.cu.set(2, 30); });
  in_case("max_seqlen_too_small", "seqs.max_seqlen", "10", [](P&, Inputs& in) { in.seqs.max_seqlen = 10; });
  in_case("max_seqlen_negative", "seqs.max_seqlen", "-1", [](P&, Inputs& in) { in.seqs.max_seqlen = -1; });

  auto out_case = [&](std::string name, std::string param, std::string value,
                      std::function<void(ForwardOutputs&)> f) {
    c.push_back({std::move(name), std::move(param), std::move(value),
                 [f](P&, Config&, Context&, Inputs&, ForwardOutputs& out) { f(out); }});
  };
  out_case("lse_not_f32", "lse.dtype", "bf16", [](ForwardOutputs& o) { o.lse.dtype = DType::bf16; });
  out_case("indices_wrong_n", "indices.shape[2]", "2", [](ForwardOutputs& o) { o.indices.shape[2] = 2; });
  out_case("indices_not_int", "indices.dtype", "f32", [](ForwardOutputs& o) { o.indices.dtype = DType::f32; });
  out_case("o_absent", "o", "absent", [](ForwardOutputs& o) { o.o = TensorView(); });
  out_case("o_branch_wrong", "o_branch.shape[0]", "2", [](ForwardOutputs& o) { o.o_branch.shape[0] = 2; });
  out_case("o_cmp_with_o_branch", "o_cmp", "", [](ForwardOutputs& o) { o.o_cmp = o.o; });
  out_case("o_cmp_wrong_heads", "o_cmp.shape[1]", "3", [](ForwardOutputs& o) {
    o.o_branch = TensorView();
    o.o_cmp = o.o;
    o.o_cmp.shape[1] = 3;
  });
  out_case("o_cmp_int32", "o_cmp.dtype", "i32", [](ForwardOutputs& o) {
    o.o_branch = TensorView();
    o.o_cmp = o.o;
    o.o_cmp.dtype = DType::i32;
  });
  out_case("o_win_with_o_branch", "o_win", "", [](ForwardOutputs& o) { o.o_win = o.o; });
  out_case("o_win_wrong_dv", "o_win.shape[2]", "3", [](ForwardOutputs& o) {
    o.o_branch = TensorView();
    o.o_win = o.o;
    o.o_win.shape[2] = 3;
  });

  auto ctx_case = [&](std::string name, std::string param, std::string value, std::function<void(Context&)> f) {
    c.push_back({std::move(name), std::move(param), std::move(value),
                 [f](P&, Config&, Context& ctx, Inputs&, ForwardOutputs&) { f(ctx); }});
  };
  ctx_case("threads_negative", "ctx.num_threads", "-1", [](Context& x) { x.num_threads = -1; });
  ctx_case("backend_out_of_range", "ctx.backend", "9", [](Context& x) { x.backend = static_cast<Backend>(9); });
  if (!backend_available(Backend::cuda))
    ctx_case("cuda_backend_for_host_tensors", "ctx.backend", "cuda", [](Context& x) { x.backend = Backend::cuda; });
  // f64 is the reference's alone: any other backend says so, naming the dtype (or, where the
  // backend is not compiled in, the backend).
  ctx_case("f64_on_cpu_backend", backend_available(Backend::cpu) ? "q.dtype" : "ctx.backend",
           backend_available(Backend::cpu) ? "f64" : "cpu", [](Context& x) { x.backend = Backend::cpu; });
  return c;
}

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInput, IsAnErrorNamingTheParameter) {
  const BadCase& bc = GetParam();
  LayerProblem p = valid_problem();
  Config cfg = p.cfg;
  Context ctx = context_of(Backend::reference);
  Inputs in = p.inputs();
  ForwardOutputs out = p.outputs();
  // The unspoiled problem is valid: the error below is caused by the spoiling alone.
  ASSERT_NO_THROW(forward(ctx, cfg, in, out));
  bc.spoil(p, cfg, ctx, in, out);
  try {
    forward(ctx, cfg, in, out);
    FAIL() << "no error for " << bc.name;
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), bc.parameter) << e.what();
    if (!bc.value.empty()) EXPECT_EQ(e.value(), bc.value) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bc.parameter), std::string::npos) << msg;
    EXPECT_FALSE(e.allowed().empty()) << msg;
  }
}

INSTANTIATE_TEST_SUITE_P(Forward, BadInput, ::testing::ValuesIn(bad_cases()),
                         [](const auto& info) { return info.param.name; });

template <typename Fn>
void expect_error(const std::string& parameter, Fn fn) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << parameter;
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), parameter) << e.what();
  }
}

TEST(BadInputStages, PhiParametersMustMatchTheKind) {
  // phi = mean takes no parameters; a given one is an error, not silently ignored.
  LayerProblem p = valid_problem(PhiKind::mlp);
  Config cfg = p.cfg;
  cfg.phi = PhiKind::mean;
  expect_error("phi_k.w1", [&] { forward(context_of(Backend::reference), cfg, p.inputs(), p.outputs()); });
  cfg.phi = PhiKind::linear;  // linear reads w1 [D, l*D]: mlp's w1 [F, l*D] has the wrong rows
  expect_error("phi_k.w1.shape[0]", [&] { forward(context_of(Backend::reference), cfg, p.inputs(), p.outputs()); });
}

TEST(BadInputStages, SharedKvTakesOneKv) {
  LayerProblem p = valid_problem(PhiKind::mlp, /*shared=*/false);
  Config cfg = p.cfg;
  cfg.shared_kv = true;
  expect_error("k_slc", [&] { forward(context_of(Backend::reference), cfg, p.inputs(), p.outputs()); });
}

TEST(BadInputStages, BackwardGradientShapes) {
  LayerProblem p = valid_problem();
  forward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs());
  Gradients g = p.gradients();
  g.dkv[kSlc].v.shape[1] = 3;
  expect_error("dv_slc.shape[1]", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs(), p.d_o.view(), g); });
  g = p.gradients();
  g.dphi_v.b2 = TensorView();
  expect_error("dphi_v.b2", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs(), p.d_o.view(), g); });
  expect_error("d_o", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs(), TensorView(), p.gradients()); });
  // The saved compressed output: not beside o_branch (which holds it), and [T, Hq, Dv].
  ForwardOutputs saved = p.outputs();
  saved.o_cmp = p.o.view();
  expect_error("o_cmp", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()); });
  saved.o_branch = TensorView();
  saved.o_cmp.shape[0] = 5;
  expect_error("o_cmp.shape[0]", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()); });
  saved.o_cmp = p.o.view();  // valid: the reference reads it not, and computes the same gradients
  EXPECT_NO_THROW(backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()));
  // The saved window output likewise.
  saved = p.outputs();
  saved.o_win = p.o.view();
  expect_error("o_win", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()); });
  saved.o_branch = TensorView();
  saved.o_win.shape[1] = 5;
  expect_error("o_win.shape[1]", [&] { backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()); });
  saved.o_win = p.o.view();
  EXPECT_NO_THROW(backward(context_of(Backend::reference), p.cfg, p.inputs(), saved, p.d_o.view(), p.gradients()));
}

TEST(BadInputStages, StageShapes) {
  Config mean = small_config();
  mean.phi = PhiKind::mean;
  HostTensor x(DType::f32, {30, 2, 4}), xc(DType::f32, {30 / 4 + 1, 2, 4});
  expect_error("xc.shape[0]", [&] { compress_fwd(context_of(Backend::reference), mean, {}, x.view(), {}, xc.view()); });
  expect_error("phi.w1", [&] { compress_fwd(context_of(Backend::reference), small_config(), {}, x.view(), {}, xc.view()); });
  HostTensor scores(DType::f32, {30, 2, 1}), idx(DType::i32, {30, 2, 3});
  expect_error("scores.shape[2]", [&] { select_topn(context_of(Backend::reference), mean, scores.view(), {}, idx.view()); });
  HostTensor scores_f64(DType::f64, {30, 2, 2});
  expect_error("scores.dtype", [&] { select_topn(context_of(Backend::reference), mean, scores_f64.view(), {}, idx.view()); });
  HostTensor q(DType::f32, {30, 4, 4}), o(DType::f32, {30, 4, 4});
  expect_error("scale", [&] { dense_attention_fwd(context_of(Backend::reference), -1.0, q.view(), x.view(), x.view(), {}, o.view(), {}); });
  for (Backend b : {Backend::reference, Backend::cpu}) {
    expect_error("scale", [&] { dense_attention_fwd(context_of(b), 1e300, q.view(), x.view(), x.view(), {}, o.view(), {}); });
    expect_error("seqs.max_seqlen",
                 [&] { dense_attention_fwd(context_of(b), 0.0, q.view(), x.view(), x.view(), Sequences{{}, INT64_MAX}, o.view(), {}); });
  }
  expect_error("max_seqlen", [&] { backbone_schedule(0, INT64_MAX, 64); });
  expect_error("slc_block_len (l')", [&] { backbone_schedule(0, 4096, INT64_MAX); });
  expect_error("phi", [&] { parse_phi_kind("gated"); });
  expect_error("backend", [&] { parse_backend("tpu"); });
}

TEST(BadInputStages, ViewsWithStridesAreAccepted) {
  // Outer strides are the caller's business: q may be a slice of a fused [T, (Hq + 2 Hkv) * D] tensor.
  LayerProblem p = valid_problem();
  forward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs());
  const auto want = p.o.values();
  const int64_t T = p.T, Hq = p.sizes.hq, D = p.sizes.dqk;
  HostTensor fused(p.sizes.dtype, {T, Hq + 3, D});  // 3 heads of padding per token
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Hq * D; ++i) fused.set(t * (Hq + 3) * D + i, p.q.get(t * Hq * D + i));
  Inputs in = p.inputs();
  in.q = fused.view();
  in.q.shape[1] = Hq;  // same strides, fewer heads
  p.o.poison();
  forward(context_of(Backend::reference), p.cfg, in, p.outputs());
  EXPECT_EQ(max_abs_diff(p.o.values(), want), 0.0);
}

// ---- Sizes that follow the tensors, not the configuration integers -----------------------------

// workspace_size of a small problem is small whatever the (valid) configuration: l' = 2^31 - 1,
// n = 2^31 - 1, a window of 2^31 - 1 and a declared max_seqlen of 2^31 - 1 once asked for hundreds
// of GiB (a selection block's chunks, the top-n lists and the inverted index grew with l' and n).
TEST(WorkspaceSizes, FollowTheTensorsNotTheConfiguration) {
  if (!backend_available(Backend::cpu)) GTEST_SKIP() << "no cpu backend";
  Problem pr;
  pr.total_tokens = 24;
  pr.max_seqlen = kMaxLength;  // declared; no sequence is longer than T
  pr.hq = 4, pr.hkv = 2, pr.dqk = 8, pr.dv = 8, pr.phi_hidden = 6;
  pr.dtype = DType::f32;
  pr.max_query_len = 3;
  Config huge_lp = small_config();
  huge_lp.cmp_stride = 1;
  huge_lp.slc_block_len = kMaxLength;
  Config huge_n = small_config();
  huge_n.n_selected = kMaxLength;
  Config huge_w = small_config();
  huge_w.window = kMaxLength;
  const Context ctx = context_of(Backend::cpu, 4);
  for (const Config& cfg : {huge_lp, huge_n, huge_w})
    for (Op op : {Op::forward, Op::backward, Op::selected_attention_fwd, Op::compressed_attention_fwd, Op::select_topn,
                  Op::decode, Op::cache_append}) {
      Problem p = pr;
      if (op == Op::decode || op == Op::cache_append) p.max_seqlen = 4096;  // the cache's capacity
      EXPECT_LE(workspace_size(ctx, op, cfg, p), size_t{64} << 20) << "op " << static_cast<int>(op);
    }
}

// Problem fields outside [0, 2^31 - 1], and sizes whose tensors could not exist, are named errors
// (they used to wrap into small or negative byte counts).
TEST(WorkspaceSizes, BadProblemsAreNamedErrors) {
  Problem pr;
  pr.total_tokens = 24;
  pr.hq = 4, pr.hkv = 2, pr.dqk = 8, pr.dv = 8;
  pr.dtype = DType::f32;
  for (Backend b : {Backend::reference, Backend::cpu}) {
    const Context ctx = context_of(b);
    Problem p = pr;
    p.hq = -1;
    expect_error("problem.hq", [&] { workspace_size(ctx, Op::forward, small_config(), p); });
    p = pr;
    p.max_seqlen = INT64_MAX;
    expect_error("problem.max_seqlen", [&] { workspace_size(ctx, Op::forward, small_config(), p); });
    p = pr;
    p.total_tokens = p.hq = p.dqk = kMaxLength;  // each allowed, together 2^93 elements
    expect_error("problem", [&] { workspace_size(ctx, Op::backward, small_config(), p); });
    expect_error("op", [&] { workspace_size(ctx, static_cast<Op>(99), small_config(), pr); });
  }
}

// A declared max_seqlen above T (here 2^31 - 1) bounds nothing past T: the same result as the
// derived one, and a scores tensor ceil(T / l') wide is enough (the reference used to allocate
// per declared position and hang).
TEST(DeclaredBounds, MaxSeqlenAboveTCountsAsT) {
  for (Backend b : {Backend::reference, Backend::cpu}) {
    SCOPED_TRACE(backend_name(b));
    const Context ctx = context_of(b);
    LayerProblem a = make_problem(small_config(), Sizes{{20, 13}, 4, 2, 8, 8, 6, DType::f32}, 3), c = a;
    Inputs in = a.inputs();
    OwnedWorkspace ws(workspace_size(ctx, Op::forward, a.cfg, problem_of(a.cfg, in)));
    forward(ctx, a.cfg, in, a.outputs(), ws.ws);
    Inputs declared = c.inputs();
    declared.seqs.max_seqlen = kMaxLength;
    OwnedWorkspace ws2(workspace_size(ctx, Op::forward, c.cfg, problem_of(c.cfg, declared)));
    forward(ctx, c.cfg, declared, c.outputs(), ws2.ws);
    EXPECT_EQ(max_abs_diff(a.o.values(), c.o.values()), 0.0);
    EXPECT_EQ(a.indices.values(), c.indices.values());
  }
}

// The CPU backward without selection (n = 0) read the inverted index's offsets from the
// workspace without writing them: with a workspace of arbitrary bytes (numpy.empty's) it crashed.
TEST(WorkspaceContents, BackwardWithoutSelectionReliesOnNothing) {
  if (!backend_available(Backend::cpu)) GTEST_SKIP() << "no cpu backend";
  Config cfg = small_config();
  cfg.n_selected = cfg.n_init = cfg.n_local = 0;
  LayerProblem p = make_problem(cfg, Sizes{{29}, 4, 2, 3, 8, 6, DType::f32}, 5);
  LayerProblem truth = p;
  const Context ref = context_of(Backend::reference);
  forward(ref, cfg, truth.inputs(), truth.outputs());
  p.lse = truth.lse;
  p.indices = truth.indices;
  backward(ref, cfg, truth.inputs(), truth.outputs(), truth.d_o.view(), truth.gradients());
  for (int threads : {1, 2}) {
    const Context ctx = context_of(Backend::cpu, threads);
    std::vector<unsigned char> bytes(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, p.inputs())) + 256);
    std::mt19937_64 rng(threads);
    for (auto& b : bytes) b = static_cast<unsigned char>(rng());
    const Workspace ws{bytes.data() + (256 - reinterpret_cast<uintptr_t>(bytes.data()) % 256) % 256, bytes.size() - 256};
    ForwardOutputs saved{TensorView(), p.lse.view(), p.indices.view(), TensorView()};
    backward(ctx, cfg, p.inputs(), saved, p.d_o.view(), p.gradients(), ws);
    EXPECT_LE(max_abs_diff(p.dq.values(), truth.dq.values()), 1e-4);
    EXPECT_LE(max_abs_diff(p.dk[kSlc].values(), truth.dk[kSlc].values()), 1e-4);
  }
}

// A row of caller indices with many repeats costs time linear in n (the backward's inverted index
// used to look each entry up in the entries before it: 50,000 repeats took seconds a row).
TEST(CallerIndices, ManyRepeatsAreLinear) {
  Config cfg = small_config();
  cfg.n_selected = 50000;
  cfg.n_init = cfg.n_local = 0;
  LayerProblem p = make_problem(cfg, Sizes{{16}, 2, 1, 4, 4, 6, DType::f32}, 9);
  for (int64_t i = 0; i < p.indices.numel(); ++i) p.indices.set(i, i % 3 == 0 ? 0 : -1);
  std::mt19937_64 rng(1);
  p.lse.fill_uniform(rng, 0.0, 1.0);
  for (Backend b : {Backend::reference, Backend::cpu}) {
    const Context ctx = context_of(b);
    ForwardOutputs saved{TensorView(), p.lse.view(), p.indices.view(), TensorView()};
    OwnedWorkspace ws(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, p.inputs())));
    const auto t0 = std::chrono::steady_clock::now();
    backward(ctx, cfg, p.inputs(), saved, p.d_o.view(), p.gradients(), ws.ws);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << backend_name(b);
  }
}

}  // namespace
}  // namespace nsa::test
