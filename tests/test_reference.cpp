// The reference backend checked against the spec from the outside: finite differences for every
// gradient, invariants that follow from the definitions, and hand-checked selection cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <string>

#include "support.h"
#include "test_cpu_support.h"

namespace nsa::test {
namespace {

void run_forward(LayerProblem& p) { forward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs()); }

// sum(o * d_o): a scalar loss whose gradient wrt o is d_o.
double loss(LayerProblem& p) {
  run_forward(p);
  double s = 0;
  const auto o = p.o.values(), d = p.d_o.values();
  for (size_t i = 0; i < o.size(); ++i) s += o[i] * d[i];
  return s;
}

// ---- Finite differences ------------------------------------------------------------------------

struct FdCase {
  std::string name;
  Config cfg;
  Sizes sizes;
};

std::vector<FdCase> fd_cases() {
  std::vector<FdCase> cases;
  {
    FdCase c{"paper_scaled_mlp_G2_packed", small_config(), {}};
    c.sizes.seqlens = {45, 30};
    c.sizes.hq = 4, c.sizes.hkv = 2, c.sizes.dqk = 6, c.sizes.dv = 4, c.sizes.phi_hidden = 5;
    cases.push_back(c);
  }
  {
    FdCase c{"l_eq_lp_eq_d_linear_G1", small_config(), {}};
    c.cfg.cmp_block_len = c.cfg.cmp_stride = c.cfg.slc_block_len = 4;
    c.cfg.phi = PhiKind::linear;
    c.cfg.window = 5;
    c.sizes.seqlens = {23};
    c.sizes.hq = 1, c.sizes.hkv = 1, c.sizes.dqk = 5, c.sizes.dv = 3;
    cases.push_back(c);
  }
  {
    FdCase c{"mean_shared_kv_G3", small_config(), {}};
    c.cfg.phi = PhiKind::mean;
    c.cfg.shared_kv = true;
    c.cfg.n_selected = 2;
    c.cfg.n_local = 1;
    c.cfg.n_init = 0;
    c.sizes.seqlens = {29};
    c.sizes.hq = 3, c.sizes.hkv = 1, c.sizes.dqk = 4, c.sizes.dv = 5;
    cases.push_back(c);
  }
  {
    FdCase c{"mlp_shared_kv_awkward_lengths", small_config(), {}};
    c.cfg.shared_kv = true;
    c.cfg.scale = 0.3;
    c.cfg.n_selected = 4;
    c.cfg.n_local = 2;
    c.sizes.seqlens = {19, 1, 0, 33};
    c.sizes.hq = 2, c.sizes.hkv = 2, c.sizes.dqk = 4, c.sizes.dv = 4, c.sizes.phi_hidden = 3;
    cases.push_back(c);
  }
  return cases;
}

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class FiniteDifference : public ::testing::TestWithParam<FdCase> {};

// Checks d loss / d x against central differences on a sample of x's elements.
void check_tensor_gradient(LayerProblem& p, HostTensor& x, HostTensor& grad, const std::string& what,
                           std::mt19937_64& rng) {
  ASSERT_TRUE(x.defined()) << what;
  const auto analytic = grad.values();
  const int64_t n = x.numel();
  std::vector<int64_t> sample;
  if (n <= 40) {
    for (int64_t i = 0; i < n; ++i) sample.push_back(i);
  } else {
    std::uniform_int_distribution<int64_t> pick(0, n - 1);
    for (int i = 0; i < 40; ++i) sample.push_back(pick(rng));
  }
  const double eps = 1e-5;
  double largest = 0;
  for (int64_t i : sample) {
    const double x0 = x.get(i);
    x.set(i, x0 + eps);
    const double up = loss(p);
    x.set(i, x0 - eps);
    const double down = loss(p);
    x.set(i, x0);
    const double fd = (up - down) / (2 * eps);
    const double an = analytic[static_cast<size_t>(i)];
    largest = std::max(largest, std::fabs(an));
    EXPECT_NEAR(an, fd, 1e-6 * (1 + std::fabs(fd))) << what << " element " << i;
  }
  (void)largest;
}

TEST_P(FiniteDifference, EveryInputAndPhiParameter) {
  const FdCase& c = GetParam();
  LayerProblem p = make_problem(c.cfg, c.sizes, 1234);
  run_forward(p);
  backward(context_of(Backend::reference), p.cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients());
  std::mt19937_64 rng(99);
  check_tensor_gradient(p, p.q, p.dq, "q", rng);
  check_tensor_gradient(p, p.g, p.dg, "g", rng);
  static const char* kBranch[3] = {"cmp", "slc", "win"};
  for (int b = 0; b < (c.cfg.shared_kv ? 1 : 3); ++b) {
    check_tensor_gradient(p, p.k[b], p.dk[b], std::string("k_") + kBranch[b], rng);
    check_tensor_gradient(p, p.v[b], p.dv[b], std::string("v_") + kBranch[b], rng);
  }
  static const char* kParam[5] = {"w1", "b1", "w2", "b2", "pe"};
  for (int i = 0; i < 5; ++i) {
    if (p.phi_k[i].defined()) check_tensor_gradient(p, p.phi_k[i], p.dphi_k[i], std::string("phi_k.") + kParam[i], rng);
    if (p.phi_v[i].defined()) check_tensor_gradient(p, p.phi_v[i], p.dphi_v[i], std::string("phi_v.") + kParam[i], rng);
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, FiniteDifference, ::testing::ValuesIn(fd_cases()),
                         [](const auto& info) { return info.param.name; });

// The stage entry points compress_bwd and the dense attention backward, by finite differences.
TEST(FiniteDifferenceStages, CompressBackward) {
  for (PhiKind kind : {PhiKind::mean, PhiKind::linear, PhiKind::mlp}) {
    Config cfg = small_config();
    cfg.phi = kind;
    std::mt19937_64 rng(7);
    const int64_t T = 27, H = 2, D = 3, F = 4;
    HostTensor x(DType::f64, {T, H, D}), dxc(DType::f64, {T / cfg.cmp_stride, H, D});
    x.fill_uniform(rng, -1, 1);
    dxc.fill_uniform(rng, -1, 1);
    HostTensor phi[5], dphi[5];
    make_phi(cfg, D, F, DType::f64, phi, &rng);
    make_phi(cfg, D, F, DType::f64, dphi, nullptr);
    HostTensor dx(DType::f64, {T, H, D});
    dx.poison();
    compress_bwd(context_of(Backend::reference), cfg, LayerProblem::params(phi), x.view(), {}, dxc.view(), dx.view(),
                 LayerProblem::params(dphi));
    auto compressed_loss = [&]() {
      HostTensor xc(DType::f64, {T / cfg.cmp_stride, H, D});
      compress_fwd(context_of(Backend::reference), cfg, LayerProblem::params(phi), x.view(), {}, xc.view());
      // Rows past N_c are untouched (zero here) and dxc there is ignored by the backward.
      const int64_t rows = num_cmp_blocks(T, cfg.cmp_block_len, cfg.cmp_stride) * H * D;
      double s = 0;
      for (int64_t i = 0; i < rows; ++i) s += xc.get(i) * dxc.get(i);
      return s;
    };
    auto check = [&](HostTensor& t, HostTensor& g, const char* what) {
      const auto an = g.values();
      for (int64_t i = 0; i < t.numel(); i += 3) {
        const double x0 = t.get(i), eps = 1e-5;
        t.set(i, x0 + eps);
        const double up = compressed_loss();
        t.set(i, x0 - eps);
        const double down = compressed_loss();
        t.set(i, x0);
        EXPECT_NEAR(an[static_cast<size_t>(i)], (up - down) / (2 * eps), 1e-7)
            << phi_kind_name(kind) << " " << what << " " << i;
      }
    };
    check(x, dx, "x");
    for (int i = 0; i < 5; ++i)
      if (phi[i].defined()) check(phi[i], dphi[i], "param");
  }
}

TEST(FiniteDifferenceStages, DenseAttentionBackward) {
  std::mt19937_64 rng(5);
  const int64_t T = 9, Hq = 4, Hkv = 2, D = 3;
  HostTensor q(DType::f64, {T, Hq, D}), k(DType::f64, {T, Hkv, D}), v(DType::f64, {T, Hkv, D});
  HostTensor o(DType::f64, {T, Hq, D}), lse(DType::f32, {T, Hq}), d_o(DType::f64, {T, Hq, D});
  HostTensor dq(DType::f64, {T, Hq, D}), dk(DType::f64, {T, Hkv, D}), dv(DType::f64, {T, Hkv, D});
  for (HostTensor* t : {&q, &k, &v, &d_o}) t->fill_uniform(rng, -1, 1);
  const Context ctx = context_of(Backend::reference);
  dense_attention_fwd(ctx, 0, q.view(), k.view(), v.view(), {}, o.view(), lse.view());
  dense_attention_bwd(ctx, 0, q.view(), k.view(), v.view(), {}, o.view(), lse.view(), d_o.view(), dq.view(),
                      dk.view(), dv.view());
  auto f = [&]() {
    dense_attention_fwd(ctx, 0, q.view(), k.view(), v.view(), {}, o.view(), lse.view());
    double s = 0;
    for (int64_t i = 0; i < o.numel(); ++i) s += o.get(i) * d_o.get(i);
    return s;
  };
  for (auto [t, g] : {std::pair{&q, &dq}, std::pair{&k, &dk}, std::pair{&v, &dv}}) {
    const auto an = g->values();
    for (int64_t i = 0; i < t->numel(); ++i) {
      const double x0 = t->get(i), eps = 1e-5;
      t->set(i, x0 + eps);
      const double up = f();
      t->set(i, x0 - eps);
      const double down = f();
      t->set(i, x0);
      EXPECT_NEAR(an[static_cast<size_t>(i)], (up - down) / (2 * eps), 1e-7);
    }
  }
}

// ---- Invariants --------------------------------------------------------------------------------

// Dense causal attention of the same q/k/v, as the NSA output's reference point.
std::vector<double> dense_output(LayerProblem& p, int branch) {
  HostTensor o(p.sizes.dtype, {p.T, p.sizes.hq, p.sizes.dv});
  Sequences seqs;
  if (p.sizes.seqlens.size() != 1) seqs.cu_seqlens = p.cu.view();
  const int b = p.cfg.shared_kv ? 0 : branch;
  dense_attention_fwd(context_of(Backend::reference), p.cfg.scale, p.q.view(), p.k[b].view(), p.v[b].view(), seqs, o.view(), {});
  return o.values();
}

void set_gates(LayerProblem& p, double c, double s, double w) {
  for (int64_t i = 0; i < p.g.numel(); i += 3) {
    p.g.set(i, c);
    p.g.set(i + 1, s);
    p.g.set(i + 2, w);
  }
}

// A forward of a fresh problem in which only `branch`'s gate is open (1; the others 0): o equals
// expected(p) to within 1e-12.
void expect_single_branch_output(const Config& cfg, const Sizes& s, uint64_t seed, int branch,
                                 std::vector<double> (*expected)(LayerProblem&)) {
  LayerProblem p = make_problem(cfg, s, seed);
  set_gates(p, branch == kCmp, branch == kSlc, branch == kWin);
  run_forward(p);
  EXPECT_LT(max_abs_diff(p.o.values(), expected(p)), 1e-12);
}

TEST(Invariants, SelectingEveryBlockIsDenseAttention) {
  Config cfg = small_config();
  cfg.n_selected = 5;
  cfg.n_local = 2;
  expect_single_branch_output(cfg, make_sizes({70, 33}, 4, 2, 8, 8), 11, kSlc,  // 5 and 3 selection blocks
                              [](LayerProblem& p) { return dense_output(p, kSlc); });
}

TEST(Invariants, WindowCoveringTheSequenceIsDenseAttention) {
  Config cfg = small_config();
  cfg.window = 41;
  expect_single_branch_output(cfg, make_sizes({41}, 2, 1, 8, 8), 12, kWin,
                              [](LayerProblem& p) { return dense_output(p, kWin); });
}

TEST(Invariants, WindowIsTheLastWTokens) {
  // With w = 1 each query attends only to itself: o_win[t] = v_win[t].
  Config cfg = small_config();
  cfg.window = 1;
  expect_single_branch_output(cfg, make_sizes({20}, 1, 1, 8, 8), 13, kWin,
                              [](LayerProblem& p) { return p.v[kWin].values(); });
}

TEST(Invariants, LaterTokensDoNotChangeEarlierOutputs) {
  Config cfg = small_config();
  Sizes s;
  s.seqlens = {60};
  s.hq = 4, s.hkv = 2;
  LayerProblem p = make_problem(cfg, s, 14);
  run_forward(p);
  const auto before = p.o.values();
  const int64_t t0 = 37;  // change every input at positions > t0
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(-1, 1);
  auto scramble = [&](HostTensor& t) {
    const int64_t row = t.numel() / p.T;
    for (int64_t i = (t0 + 1) * row; i < t.numel(); ++i) t.set(i, u(rng));
  };
  scramble(p.q);
  scramble(p.g);
  for (int b = 0; b < 3; ++b) {
    scramble(p.k[b]);
    scramble(p.v[b]);
  }
  run_forward(p);
  const auto after = p.o.values();
  const int64_t row = p.sizes.hq * p.sizes.dv;
  for (int64_t i = 0; i < (t0 + 1) * row; ++i) ASSERT_EQ(before[static_cast<size_t>(i)], after[static_cast<size_t>(i)]) << i;
  bool changed = false;
  for (size_t i = static_cast<size_t>((t0 + 1) * row); i < after.size(); ++i) changed |= before[i] != after[i];
  EXPECT_TRUE(changed);  // the scramble did reach the later rows
}

TEST(Invariants, PackedBatchEqualsSequencesAlone) {
  for (bool shared : {false, true}) {
    Config cfg = small_config();
    cfg.shared_kv = shared;
    Sizes s;
    s.seqlens = {37, 0, 1, 52, 16};
    s.hq = 4, s.hkv = 2;
    LayerProblem packed = make_problem(cfg, s, 15);
    run_forward(packed);
    backward(context_of(Backend::reference), cfg, packed.inputs(), packed.outputs(), packed.d_o.view(), packed.gradients());
    int64_t start = 0;
    for (int32_t len : s.seqlens) {
      Sizes one = s;
      one.seqlens = {len};
      LayerProblem alone = make_problem(cfg, one, 16);
      // Copy this sequence's rows of every per-token input.
      auto copy_rows = [&](HostTensor& from, HostTensor& to) {
        const int64_t row = from.numel() / packed.T;
        for (int64_t i = 0; i < len * row; ++i) to.set(i, from.get(start * row + i));
      };
      copy_rows(packed.q, alone.q);
      copy_rows(packed.g, alone.g);
      copy_rows(packed.d_o, alone.d_o);
      for (int b = 0; b < (shared ? 1 : 3); ++b) {
        copy_rows(packed.k[b], alone.k[b]);
        copy_rows(packed.v[b], alone.v[b]);
      }
      for (int i = 0; i < 5; ++i) {
        for (int64_t e = 0; e < packed.phi_k[i].numel(); ++e) alone.phi_k[i].set(e, packed.phi_k[i].get(e));
        for (int64_t e = 0; e < packed.phi_v[i].numel(); ++e) alone.phi_v[i].set(e, packed.phi_v[i].get(e));
      }
      run_forward(alone);
      backward(context_of(Backend::reference), cfg, alone.inputs(), alone.outputs(), alone.d_o.view(), alone.gradients());
      auto expect_rows_equal = [&](HostTensor& whole, HostTensor& part, const char* what) {
        const int64_t row = whole.numel() / packed.T;
        for (int64_t i = 0; i < len * row; ++i)
          ASSERT_NEAR(whole.get(start * row + i), part.get(i), 1e-12) << what << " seq at " << start;
      };
      expect_rows_equal(packed.o, alone.o, "o");
      expect_rows_equal(packed.indices, alone.indices, "indices");
      expect_rows_equal(packed.dq, alone.dq, "dq");
      expect_rows_equal(packed.dk[0], alone.dk[0], "dk_cmp");
      expect_rows_equal(packed.dv[0], alone.dv[0], "dv_cmp");
      start += len;
    }
  }
}

TEST(Invariants, GatesMixBranchOutputsLinearly) {
  Config cfg = small_config();
  Sizes s;
  s.seqlens = {40};
  LayerProblem p = make_problem(cfg, s, 17);
  run_forward(p);
  const auto o = p.o.values(), ob = p.o_branch.values(), g = p.g.values();
  const int64_t n = p.T * s.hq;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < s.dv; ++c) {
      double want = 0;
      for (int b = 0; b < 3; ++b) want += g[static_cast<size_t>(r * 3 + b)] * ob[static_cast<size_t>((b * n + r) * s.dv + c)];
      ASSERT_NEAR(o[static_cast<size_t>(r * s.dv + c)], want, 1e-12);
    }
}

// ---- Compression and selection edge cases ------------------------------------------------------

TEST(Selection, OverlapWeightsOfThePaper) {
  // l=32, d=16, l'=64: the compressed blocks touching selection block 1 weigh 1,2,2,2,1 (spec §3).
  std::vector<int64_t> w;
  for (int64_t i = 0; i < 10; ++i) w.push_back(cmp_slc_overlap(i, 1, 32, 16, 64));
  EXPECT_EQ(w, (std::vector<int64_t>{0, 0, 0, 1, 2, 2, 2, 1, 0, 0}));
  EXPECT_EQ(num_cmp_blocks(31, 32, 16), 0);
  EXPECT_EQ(num_cmp_blocks(32, 32, 16), 1);
  EXPECT_EQ(num_cmp_blocks(64, 32, 16), 3);
  EXPECT_EQ(visible_cmp_blocks(30, 32, 16), 0);
  EXPECT_EQ(visible_cmp_blocks(31, 32, 16), 1);
  EXPECT_EQ(visible_cmp_blocks(46, 32, 16), 1);
  EXPECT_EQ(visible_cmp_blocks(47, 32, 16), 2);
}

// Runs select_topn on hand-made scores [T, 1, Ns] for one sequence.
std::vector<int32_t> topn(const Config& cfg, int64_t T, const std::vector<double>& S_row, int64_t Ns,
                          Backend backend = Backend::reference) {
  HostTensor S(DType::f32, {T, 1, Ns});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < Ns; ++j) S.set(t * Ns + j, S_row[static_cast<size_t>(j)]);
  HostTensor idx(DType::i32, {T, 1, cfg.n_selected});
  idx.poison();
  OwnedWorkspace ws(workspace_size(context_of(backend), Op::select_topn, cfg, [&] {
    Problem pr;
    pr.total_tokens = T;
    pr.hq = pr.hkv = 1;
    pr.dqk = pr.dv = 1;
    pr.max_seqlen = T;
    pr.dtype = DType::f32;
    return pr;
  }()));
  select_topn(context_of(backend), cfg, S.view(), {}, idx.view(), ws.ws);
  std::vector<int32_t> out;
  for (double v : idx.values()) out.push_back(static_cast<int32_t>(v));
  return out;
}

TEST(Selection, ForcedBlocksTiesAndPadding) {
  const Config cfg = make_config(4, 2, 4, 4, 1, 1, 512, PhiKind::mlp);
  const int64_t T = 32, Ns = 8;
  // Scores favour blocks 5 and 3; blocks 2, 4 and 6 tie.
  const std::vector<double> S = {0.0, 0.1, 0.5, 0.9, 0.5, 1.0, 0.5, 0.2};
  const auto idx = topn(cfg, T, S, Ns);
  auto row = [&](int64_t t) { return std::vector<int32_t>(idx.begin() + t * 4, idx.begin() + t * 4 + 4); };
  // t = 0: one admissible block: padded with -1.
  EXPECT_EQ(row(0), (std::vector<int32_t>{0, -1, -1, -1}));
  // t = 9: J_t = 2; all three admissible blocks fit.
  EXPECT_EQ(row(9), (std::vector<int32_t>{0, 1, 2, -1}));
  // t = 31: J_t = 7. Forced 0 (initial, despite the lowest score) and 7 (local); then 5 and 3.
  EXPECT_EQ(row(31), (std::vector<int32_t>{0, 3, 5, 7}));
  // t = 27: J_t = 6 forced; then 5 (1.0) and 3 (0.9): 2, 4 and 6 tie at 0.5 below them.
  EXPECT_EQ(row(27), (std::vector<int32_t>{0, 3, 5, 6}));
  // A tie decides the last place at t = 23 (J_t = 5): forced 0, 5; then 3; 2 and 4 tie -> 2.
  EXPECT_EQ(row(23), (std::vector<int32_t>{0, 2, 3, 5}));
}

// Blocks of 2 tokens, n = 3 with one local block and no initial one.
Config three_of_pairs() { return make_config(2, 2, 2, 3, 0, 1, 512, PhiKind::mlp); }

TEST(Selection, ExactTiesGoToTheSmallerBlock) {
  const Config cfg = three_of_pairs();
  const int64_t T = 12, Ns = 6;
  const auto idx = topn(cfg, T, std::vector<double>(Ns, 0.25), Ns);
  // t = 11: J_t = 5 forced, then the two smallest of the tied blocks.
  EXPECT_EQ(std::vector<int32_t>(idx.begin() + 33, idx.begin() + 36), (std::vector<int32_t>{0, 1, 5}));
}

// A NaN score ranks above every number (as torch.topk ranks it), NaNs among themselves by the
// smaller block; the same on every host backend (they disagreed: the comparisons were no order).
TEST(Selection, NanScoresRankFirst) {
  const Config cfg = three_of_pairs();
  const int64_t T = 16, Ns = 8;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> S = {5.0, nan, 3.0, nan, 9.0, -1.0, 2.0, 0.0};
  for (Backend b : {Backend::reference, Backend::cpu}) {
    const auto idx = topn(cfg, T, S, Ns, b);
    auto row = [&](int64_t t) { return std::vector<int32_t>(idx.begin() + t * 3, idx.begin() + t * 3 + 3); };
    // t = 15: J_t = 7 forced; then the NaNs 1 and 3 before 9.0.
    EXPECT_EQ(row(15), (std::vector<int32_t>{1, 3, 7})) << backend_name(b);
    // t = 7: J_t = 3 forced; then NaN 1, then 5.0 (block 0).
    EXPECT_EQ(row(7), (std::vector<int32_t>{0, 1, 3})) << backend_name(b);
  }
}

TEST(Selection, ShortSequencesAndEmptyCompression) {
  // T < l: no compressed block is visible anywhere: o_cmp = 0, lse = -inf, nothing NaN.
  // T < l': one selection block only.
  Config cfg = small_config();
  cfg.n_selected = 3;
  Sizes s;
  s.seqlens = {7};
  LayerProblem p = make_problem(cfg, s, 21);
  run_forward(p);
  const auto lse = p.lse.values();
  const auto ob = p.o_branch.values();
  const int64_t n = p.T * s.hq;
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_TRUE(std::isinf(lse[static_cast<size_t>(r * 3)]) && lse[static_cast<size_t>(r * 3)] < 0);
    EXPECT_TRUE(std::isfinite(lse[static_cast<size_t>(r * 3 + 1)]));
    for (int64_t c = 0; c < s.dv; ++c) EXPECT_EQ(ob[static_cast<size_t>(r * s.dv + c)], 0.0);
  }
  for (double x : p.o.values()) EXPECT_TRUE(std::isfinite(x));
  const auto idx = p.indices.values();
  for (int64_t r = 0; r < p.T; ++r) {
    EXPECT_EQ(idx[static_cast<size_t>(r * 3)], 0);
    EXPECT_EQ(idx[static_cast<size_t>(r * 3 + 1)], -1);
    EXPECT_EQ(idx[static_cast<size_t>(r * 3 + 2)], -1);
  }
  // Gradients stay finite, and the compression branch (empty) gives phi no gradient.
  backward(context_of(Backend::reference), cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients());
  for (double x : p.dq.values()) EXPECT_TRUE(std::isfinite(x));
  for (double x : p.dphi_k[0].values()) EXPECT_EQ(x, 0.0);
}

TEST(Selection, ForcedBlocksAlwaysPresentAndSortedPadded) {
  Config cfg = small_config();
  cfg.n_selected = 4;
  cfg.n_init = 1;
  cfg.n_local = 2;
  Sizes s;
  s.seqlens = {150, 20};
  s.hq = 4, s.hkv = 2;
  LayerProblem p = make_problem(cfg, s, 22);
  run_forward(p);
  const auto idx = p.indices.values();
  for (int64_t b = 0, start = 0; b < 2; start += s.seqlens[static_cast<size_t>(b)], ++b)
    for (int64_t t = 0; t < s.seqlens[static_cast<size_t>(b)]; ++t)
      for (int64_t hk = 0; hk < s.hkv; ++hk) {
        const double* row = &idx[static_cast<size_t>(((start + t) * s.hkv + hk) * 4)];
        const int64_t Jt = t / cfg.slc_block_len;
        const int64_t count = std::min<int64_t>(4, Jt + 1);
        for (int64_t k = 0; k < 4; ++k) {
          if (k < count) {
            EXPECT_GE(row[k], 0);
            EXPECT_LE(row[k], Jt);
            if (k > 0) EXPECT_LT(row[k - 1], row[k]);
          } else {
            EXPECT_EQ(row[k], -1);
          }
        }
        auto has = [&](int64_t j) { return std::find(row, row + 4, double(j)) != row + 4; };
        EXPECT_TRUE(has(0));
        EXPECT_TRUE(has(Jt));
        if (Jt >= 1) EXPECT_TRUE(has(Jt - 1));
      }
}

TEST(Selection, ScoresMatchTheirDefinition) {
  // S[t,hk,j] = sum over the group and visible compressed blocks of ov(i,j) * p_cmp, from the
  // stage entry points, recomputed here from the published p_cmp pieces (lse and q.kc).
  Config cfg = small_config();
  const int64_t T = 50, Hq = 4, Hkv = 2, D = 3;
  std::mt19937_64 rng(23);
  HostTensor q(DType::f64, {T, Hq, D}), kc(DType::f64, {T / 4, Hkv, D}), vc(DType::f64, {T / 4, Hkv, D});
  q.fill_uniform(rng, -1, 1);
  kc.fill_uniform(rng, -1, 1);
  vc.fill_uniform(rng, -1, 1);
  const int64_t Ns = num_slc_blocks(T, cfg.slc_block_len);
  HostTensor o(DType::f64, {T, Hq, D}), lse(DType::f32, {T, Hq}), S(DType::f32, {T, Hkv, Ns});
  S.poison();
  compressed_attention_fwd(context_of(Backend::reference), cfg, q.view(), kc.view(), vc.view(), {}, o.view(), lse.view(), S.view());
  const double scale = 1 / std::sqrt(double(D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t j = 0; j < Ns; ++j) {
        double want = 0;
        for (int64_t h = hk * 2; h < hk * 2 + 2; ++h) {
          const int64_t C = visible_cmp_blocks(t, 8, 4);
          std::vector<double> s(static_cast<size_t>(C));
          double m = -1e300, z = 0;
          for (int64_t i = 0; i < C; ++i) {
            double d = 0;
            for (int64_t c = 0; c < D; ++c) d += q.get((t * Hq + h) * D + c) * kc.get((i * Hkv + hk) * D + c);
            m = std::max(m, s[static_cast<size_t>(i)] = scale * d);
          }
          for (double x : s) z += std::exp(x - m);
          for (int64_t i = 0; i < C; ++i)
            want += double(cmp_slc_overlap(i, j, 8, 4, 16)) * std::exp(s[static_cast<size_t>(i)] - m) / z;
        }
        EXPECT_NEAR(S.get((t * Hkv + hk) * Ns + j), want, 1e-6) << t << " " << hk << " " << j;
      }
}

TEST(Selection, SelectionOffAndWindowOffContributeZero) {
  Config cfg = small_config();
  cfg.n_selected = 0;
  cfg.n_init = 0;
  cfg.n_local = 0;
  cfg.window = 0;
  Sizes s;
  s.seqlens = {30};
  LayerProblem p = make_problem(cfg, s, 24);
  run_forward(p);
  const auto ob = p.o_branch.values();
  const size_t n = static_cast<size_t>(p.T * s.hq * s.dv);
  for (size_t i = n; i < 3 * n; ++i) ASSERT_EQ(ob[i], 0.0);
  const auto lse = p.lse.values();
  for (size_t r = 0; r < lse.size(); r += 3) {
    EXPECT_TRUE(std::isinf(lse[r + 1]));
    EXPECT_TRUE(std::isinf(lse[r + 2]));
  }
  backward(context_of(Backend::reference), cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients());
  for (double x : p.dk[kSlc].values()) EXPECT_EQ(x, 0.0);
  for (double x : p.dk[kWin].values()) EXPECT_EQ(x, 0.0);
}

TEST(Storage, LowPrecisionInputsRoundOnlyAtTheBoundary) {
  // bf16/f16/f32 storage gives the fp64 result of the rounded inputs, rounded once.
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    Config cfg = small_config();
    Sizes s;
    s.seqlens = {33};
    s.dtype = dt;
    LayerProblem low = make_problem(cfg, s, 25);
    run_forward(low);
    s.dtype = DType::f64;
    LayerProblem high = make_problem(cfg, s, 25);
    auto copy = [](HostTensor& from, HostTensor& to) {
      for (int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
    };
    copy(low.q, high.q);
    copy(low.g, high.g);
    for (int b = 0; b < 3; ++b) {
      copy(low.k[b], high.k[b]);
      copy(low.v[b], high.v[b]);
    }
    for (int i = 0; i < 5; ++i) {
      copy(low.phi_k[i], high.phi_k[i]);
      copy(low.phi_v[i], high.phi_v[i]);
    }
    run_forward(high);
    const double ulp = dt == DType::bf16 ? 1.0 / 128 : dt == DType::f16 ? 1.0 / 1024 : 1e-7;
    const auto a = low.o.values(), b = high.o.values();
    for (size_t i = 0; i < a.size(); ++i) ASSERT_LE(std::fabs(a[i] - b[i]), ulp * std::fabs(b[i]) + 1e-7);
  }
}

}  // namespace
}  // namespace nsa::test

namespace nsa::test {
namespace {

TEST(Selection, IndicesAreASet) {
  // selected_attention_fwd reads each row of indices as a set: order, repeats, -1 and blocks past
  // the query change nothing (every backend follows api.h here).
  Config cfg;
  cfg.slc_block_len = 4, cfg.cmp_block_len = 4, cfg.cmp_stride = 2, cfg.n_selected = 4;
  const int64_t T = 20, H = 2, D = 3;
  std::mt19937_64 rng(31);
  HostTensor q(DType::f64, {T, H, D}), k(DType::f64, {T, 1, D}), v(DType::f64, {T, 1, D});
  for (HostTensor* t : {&q, &k, &v}) t->fill_uniform(rng, -1, 1);
  HostTensor plain(DType::i32, {T, 1, 4}), messy(DType::i32, {T, 1, 4});
  for (int64_t t = 0; t < T; ++t) {
    const int64_t Jt = t / 4;
    const int32_t a = 0, b = static_cast<int32_t>(Jt);
    const int32_t rows_plain[4] = {a, b == a ? -1 : b, -1, -1};
    const int32_t rows_messy[4] = {b, a, b, static_cast<int32_t>(Jt + 1)};  // unsorted, repeated, future
    for (int i = 0; i < 4; ++i) {
      plain.set(t * 4 + i, rows_plain[i]);
      messy.set(t * 4 + i, rows_messy[i]);
    }
  }
  Context ctx = context_of(Backend::reference);
  HostTensor o1(DType::f64, {T, H, D}), o2(DType::f64, {T, H, D});
  selected_attention_fwd(ctx, cfg, q.view(), k.view(), v.view(), plain.view(), {}, o1.view(), {});
  selected_attention_fwd(ctx, cfg, q.view(), k.view(), v.view(), messy.view(), {}, o2.view(), {});
  EXPECT_EQ(max_abs_diff(o1.values(), o2.values()), 0.0);
}

}  // namespace
}  // namespace nsa::test
