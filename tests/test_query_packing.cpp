// The layer with a query packing (Inputs::seqs_q: each sequence's last Tq_b positions are the
// queries, bottom-right aligned) against the same backend on every position: the outputs are the
// full call's rows, the gradients the full call's with d_o zero on the rows not queried.
// The reference backend agrees bitwise (each query and each key gradient term is computed the
// same way; the terms of the unqueried rows are exact zeros). The cpu backend (fp32, bf16, f16,
// every kernel table) agrees within fp32 rounding: its selection branch visits a tile's blocks in
// an order that depends on which queries share the tile (the union of their blocks, or each
// token's own: split_selection), and its key-gradient sums group the queries in tiles that start
// at the first query. So: the same indices as the full call; outputs within style.md's rule of
// the fp64 reference; gradients at most twice the full call's own error against the fp64
// reference away from the full call's, and within that of the reference too; the same bits on 1,
// 3 and the default number of threads. Plus the validation of a query packing.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

struct QueryCase {
  std::string name;
  Config cfg;
  Sizes sizes;               // the keys' sequences
  std::vector<int32_t> tq;  // queries per sequence (<= its length)
};

Config with_backbone(Config c, std::vector<int64_t> offsets) {
  c.set_backbone(offsets);
  return c;
}

// B >= 2 uneven sequences, Tq_b = 0, = Tk_b, = 1 and lengths that are no multiple of l, d, l', w
// or the cpu backend's 64-token tiles; every phi, shared and independent K/V, the backbone, each
// branch off once.
std::vector<QueryCase> cases() {
  return {
      {"packed_mlp", make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp), make_sizes({37, 0, 50, 21, 9}, 4, 2, 16, 8),
       {3, 0, 50, 1, 0}},
      {"long_tiles_linear_shared", make_config(16, 8, 32, 4, 1, 1, 40, PhiKind::linear, true),
       make_sizes({150, 97, 3}, 4, 1, 16, 16), {77, 97, 2}},
      {"mean_G1", make_config(16, 8, 32, 4, 0, 1, 40, PhiKind::mean), make_sizes({130, 66}, 2, 2, 24, 40), {65, 1}},
      {"backbone_no_window", with_backbone(make_config(8, 4, 16, 6, 1, 1, 0, PhiKind::mlp), {2, 4}),
       make_sizes({120, 41}, 4, 1, 8, 8), {119, 40}},
      // A partial first tile (queries 52..63 of the tile 32..63, G = 2) whose selection visits
      // its blocks in another order than the full call's tile.
      {"partial_tile_selection", make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp), make_sizes({3, 70}, 4, 2, 8, 6, 5),
       {0, 18}},
      {"no_selection_shared_mlp", make_config(8, 8, 8, 0, 0, 0, 33, PhiKind::mlp, true), make_sizes({70, 3}, 6, 3, 8, 16),
       {70, 0}},
  };
}

// The rows of the full call that a query packing keeps, and its cu_seqlens_q.
struct QueryRows {
  std::vector<int64_t> rows;  // full-call row of each query row
  HostTensor cu_q;
};

QueryRows query_rows(const std::vector<int32_t>& seqlens, const std::vector<int32_t>& tq) {
  QueryRows r;
  r.cu_q = HostTensor(DType::i32, {static_cast<int64_t>(seqlens.size()) + 1});
  int64_t start = 0, acc = 0;
  r.cu_q.set(0, 0);
  for (size_t b = 0; b < seqlens.size(); ++b) {
    for (int64_t t = seqlens[b] - tq[b]; t < seqlens[b]; ++t) r.rows.push_back(start + t);
    start += seqlens[b];
    r.cu_q.set(static_cast<int64_t>(b) + 1, static_cast<double>(acc += tq[b]));
  }
  return r;
}

// Rows `rows` of a [T, ...] tensor, or of each of the `lead` stacked [T, ...] of [lead, T, ...].
HostTensor take_rows(const HostTensor& t, const std::vector<int64_t>& rows, int lead = 1) {
  std::vector<int64_t> shape = t.shape();
  const int64_t T = shape[lead == 1 ? 0 : 1];
  const int64_t per = T > 0 ? t.numel() / lead / T : 0;
  shape[lead == 1 ? 0 : 1] = static_cast<int64_t>(rows.size());
  HostTensor out(t.dtype(), shape);
  const int64_t Tq = static_cast<int64_t>(rows.size());
  for (int l = 0; l < lead; ++l)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t e = 0; e < per; ++e)
        out.set((l * Tq + i) * per + e, t.get((l * T + rows[static_cast<size_t>(i)]) * per + e));
  return out;
}

HostTensor poisoned(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  t.poison();
  return t;
}

// The suffix call's problem from the full one: the same keys, values, phi and key packing; the
// query-side tensors cut to `rows`, outputs and gradients poisoned.
struct SuffixProblem {
  LayerProblem p;
  HostTensor cu_q;
  Inputs inputs() {
    Inputs in = p.inputs();
    in.seqs_q.cu_seqlens = cu_q.view();
    return in;
  }
};

SuffixProblem suffix_of(const LayerProblem& full, const QueryRows& qr) {
  SuffixProblem s{full, qr.cu_q};
  LayerProblem& p = s.p;
  const int64_t Tq = static_cast<int64_t>(qr.rows.size());
  const Sizes& z = full.sizes;
  p.q = take_rows(full.q, qr.rows);
  p.g = take_rows(full.g, qr.rows);
  p.d_o = take_rows(full.d_o, qr.rows);
  p.o = poisoned(z.dtype, {Tq, z.hq, z.dv});
  p.o_branch = poisoned(z.dtype, {3, Tq, z.hq, z.dv});
  p.lse = poisoned(DType::f32, {Tq, z.hq, 3});
  p.indices = poisoned(DType::i32, {Tq, z.hkv, full.cfg.n_selected});
  p.dq = poisoned(z.dtype, {Tq, z.hq, z.dqk});
  p.dg = poisoned(z.dtype, {Tq, z.hq, 3});
  return s;
}

// d_o zero on every row the query packing leaves out.
void mask_d_o(LayerProblem& full, const QueryRows& qr) {
  std::vector<char> keep(static_cast<size_t>(full.T), 0);
  for (int64_t r : qr.rows) keep[static_cast<size_t>(r)] = 1;
  const int64_t per = full.T > 0 ? full.d_o.numel() / full.T : 0;
  for (int64_t r = 0; r < full.T; ++r)
    if (!keep[static_cast<size_t>(r)])
      for (int64_t e = 0; e < per; ++e) full.d_o.set(r * per + e, 0.0);
}

// Bitwise: every element equal (NaN nowhere expected), naming the first difference.
void expect_same_bits(const std::string& name, const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.shape(), want.shape()) << name;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.get(i), b = want.get(i);
    if (!(a == b || (std::isnan(a) && std::isnan(b))) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << got.numel() << " elements differ, first at " << first << ": "
                    << (first >= 0 ? got.get(first) : 0.0) << " vs " << (first >= 0 ? want.get(first) : 0.0);
}

// Runs forward (and backward with o_branch absent, as a training step would) on `ctx`.
void run_layer(const Context& ctx, const Config& cfg, const Inputs& in, LayerProblem& p, bool with_backward) {
  const Problem pr = problem_of(cfg, in);
  OwnedWorkspace fw(workspace_size(ctx, Op::forward, cfg, pr));
  forward(ctx, cfg, in, p.outputs(), fw.ws);
  if (!with_backward) return;
  ForwardOutputs saved = p.outputs();
  saved.o_branch = TensorView{};
  OwnedWorkspace bw(workspace_size(ctx, Op::backward, cfg, pr));
  backward(ctx, cfg, in, saved, p.d_o.view(), p.gradients(), bw.ws);
}

// The query-side outputs of the suffix call against the full call's rows, bitwise.
void expect_forward_rows(const SuffixProblem& s, const LayerProblem& full, const QueryRows& qr) {
  expect_same_bits("o", s.p.o, take_rows(full.o, qr.rows));
  expect_same_bits("lse", s.p.lse, take_rows(full.lse, qr.rows));
  expect_same_bits("o_branch", s.p.o_branch, take_rows(full.o_branch, qr.rows, 3));
  if (full.cfg.n_selected > 0) expect_same_bits("indices", s.p.indices, take_rows(full.indices, qr.rows));
}

// Every gradient tensor of a problem with its name, the query side cut to `rows` (null: whole).
std::vector<std::pair<std::string, HostTensor>> gradient_tensors(const LayerProblem& p, const QueryRows* qr) {
  std::vector<std::pair<std::string, HostTensor>> out;
  out.emplace_back("dq", qr ? take_rows(p.dq, qr->rows) : p.dq);
  out.emplace_back("dg", qr ? take_rows(p.dg, qr->rows) : p.dg);
  static const char* kBranch[3] = {"cmp", "slc", "win"};
  for (int b = 0; b < 3; ++b)
    if (p.dk[b].defined()) {
      out.emplace_back(std::string("dk_") + kBranch[b], p.dk[b]);
      out.emplace_back(std::string("dv_") + kBranch[b], p.dv[b]);
    }
  static const char* kParam[5] = {"w1", "b1", "w2", "b2", "pe"};
  for (int i = 0; i < 5; ++i)
    if (p.dphi_k[i].defined()) {
      out.emplace_back(std::string("dphi_k.") + kParam[i], p.dphi_k[i]);
      out.emplace_back(std::string("dphi_v.") + kParam[i], p.dphi_v[i]);
    }
  return out;
}

// The reference backend: the suffix call's rows and gradients are the full call's, bitwise.
// The full call (d_o zero on the rows the suffix call does not query) and the suffix call, both
// forward and backward on `backend`.
struct BothCalls {
  Sizes z;
  LayerProblem full;
  QueryRows qr;
  SuffixProblem s;
};
BothCalls run_both(const QueryCase& c, DType dtype, uint64_t seed, Backend backend) {
  BothCalls r;
  r.z = c.sizes;
  r.z.dtype = dtype;
  r.full = make_problem(c.cfg, r.z, seed);
  r.qr = query_rows(r.z.seqlens, c.tq);
  r.s = suffix_of(r.full, r.qr);
  mask_d_o(r.full, r.qr);
  const Context ctx = context_of(backend);
  run_layer(ctx, c.cfg, r.full.inputs(), r.full, true);
  run_layer(ctx, c.cfg, r.s.inputs(), r.s.p, true);
  return r;
}

void check_reference(const QueryCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(c.name + " " + dtype_name(dtype));
  BothCalls b = run_both(c, dtype, seed, Backend::reference);
  LayerProblem& full = b.full;
  const QueryRows& qr = b.qr;
  SuffixProblem& s = b.s;
  expect_forward_rows(s, full, qr);
  const auto got = gradient_tensors(s.p, nullptr), want = gradient_tensors(full, &qr);
  for (size_t i = 0; i < got.size(); ++i) expect_same_bits(got[i].first, got[i].second, want[i].second);
}

// The cpu backend on the current kernel table: the full call's indices, outputs within style.md's
// rule of the fp64 truth, gradients within twice the full call's own error of it (and of the
// truth), the same bits on 1 and 3 threads.
void check_cpu(const QueryCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(c.name + " " + dtype_name(dtype));
  BothCalls b = run_both(c, dtype, seed, Backend::cpu);
  const Sizes& z = b.z;
  LayerProblem& full = b.full;
  const QueryRows& qr = b.qr;
  SuffixProblem& s = b.s;
  // Forward: the full call's selection, and outputs within style.md's rule of the fp64 truth's
  // rows (on the rows whose selection agrees with the truth's, as in test_cpu_forward.cpp).
  if (c.cfg.n_selected > 0) expect_same_bits("indices", s.p.indices, take_rows(full.indices, qr.rows));
  const Context ref = context_of(Backend::reference);
  {
    LayerProblem truth = to_f64(full), rounded = full;
    run_layer(ref, c.cfg, truth.inputs(), truth, false);
    run_layer(ref, c.cfg, rounded.inputs(), rounded, false);
    const int64_t Tq = static_cast<int64_t>(qr.rows.size());
    auto rows_of = [&](LayerProblem p) {
      p.o = take_rows(p.o, qr.rows);
      p.o_branch = take_rows(p.o_branch, qr.rows, 3);
      p.lse = take_rows(p.lse, qr.rows);
      p.indices = take_rows(p.indices, qr.rows);
      p.T = Tq;
      return p;
    };
    const LayerProblem t = rows_of(truth), r = rows_of(rounded);
    LayerProblem got = s.p;
    got.T = Tq;
    const Rowset agree = compare_indices(got.indices, t.indices, Tq, z.hkv, c.cfg.n_selected);
    EXPECT_LE(agree.disagree, std::max<int64_t>(1, Tq * z.hkv / 100)) << "rows with other indices than the truth";
    compare_layer_outputs(got, t, r, agree);
  }
  // Gradients: the fp64 truth of the full call (its selection: the cpu's own, a constant of the
  // backward).
  LayerProblem truth = to_f64(full);
  ForwardOutputs saved = truth.outputs();
  truth.indices = full.indices;
  saved.indices = truth.indices.view();
  backward(ref, c.cfg, truth.inputs(), saved, truth.d_o.view(), truth.gradients());
  const auto got = gradient_tensors(s.p, nullptr), cpu_full = gradient_tensors(full, &qr),
             exact = gradient_tensors(truth, &qr);
  for (size_t i = 0; i < got.size(); ++i) {
    const std::vector<double> g = got[i].second.values(), f = cpu_full[i].second.values(),
                              t = exact[i].second.values();
    const double err_full = max_abs_diff(f, t);
    const double tol = 2.0 * err_full + 2e-5 * std::max(1.0, max_abs(t));
    const double err = max_abs_diff(g, f);
    EXPECT_LE(err, tol) << got[i].first << ": suffix vs full call " << err << ", full call's own error " << err_full;
    EXPECT_LE(max_abs_diff(g, t), tol) << got[i].first << ": suffix vs fp64 truth";
  }
  // The same bits on any thread count.
  for (int threads : {1, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    SuffixProblem again = suffix_of(full, qr);
    again.p.d_o = s.p.d_o;
    run_layer(context_of(Backend::cpu, threads), c.cfg, again.inputs(), again.p, true);
    for (auto [name, a, b] : {std::tuple{"o", &again.p.o, &s.p.o}, std::tuple{"lse", &again.p.lse, &s.p.lse},
                              std::tuple{"indices", &again.p.indices, &s.p.indices},
                              std::tuple{"o_branch", &again.p.o_branch, &s.p.o_branch}})
      expect_same_bits(name, *a, *b);
    const auto same = gradient_tensors(again.p, nullptr);
    for (size_t i = 0; i < got.size(); ++i) expect_same_bits(got[i].first, same[i].second, got[i].second);
  }
}

// Random valid configurations and packings: 1-4 sequences of 0-90 tokens, each with no query,
// all, one, or any number in between; every phi, shared or not, branches off at times.
std::vector<QueryCase> random_cases(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::vector<QueryCase> out;
  while (static_cast<int>(out.size()) < count) {
    const int64_t d = int64_t{1} << pick(0, 2), l = d * pick(1, 3), lp = d * pick(1, 8);
    const int64_t n = pick(0, 5), n_init = n ? pick(0, std::min<int64_t>(2, n)) : 0;
    const int64_t n_local = n ? pick(0, n - n_init) : 0;
    const int64_t w = std::vector<int64_t>{0, 1, 5, 17, 40}[static_cast<size_t>(pick(0, 4))];
    const PhiKind phi = static_cast<PhiKind>(pick(0, 2));
    Config cfg = make_config(l, d, lp, n, n_init, n_local, w, phi, pick(0, 1) == 1);
    if (n > n_init + n_local && pick(0, 2) == 0) cfg.set_backbone({pick(1, 3)});
    try {
      cfg.validate();
    } catch (const Error&) {
      continue;
    }
    const int64_t hkv = pick(1, 2), G = pick(1, 3);
    std::vector<int32_t> lens, tq;
    for (int64_t b = pick(1, 4); b > 0; --b) {
      const int32_t len = static_cast<int32_t>(pick(0, 90));
      const int64_t kind = pick(0, 3);
      lens.push_back(len);
      tq.push_back(kind == 0 ? 0 : kind == 1 ? len : kind == 2 ? std::min<int32_t>(len, 1)
                                                                : static_cast<int32_t>(pick(0, len)));
    }
    out.push_back({"random_" + std::to_string(out.size()), cfg,
                   make_sizes(lens, hkv * G, hkv, 4 * pick(1, 2), 2 * pick(2, 3), pick(2, 6)), tq});
  }
  return out;
}

TEST(QueryPacking, ReferenceRowsAndGradientsEqualFullCallBitwise) {
  uint64_t seed = 700;
  for (DType dtype : {DType::f64, DType::f32, DType::bf16})
    for (const QueryCase& c : cases()) check_reference(c, dtype, seed++);
}

TEST(QueryPacking, RandomShapesReferenceBitwise) {
  uint64_t seed = 1700;
  for (const QueryCase& c : random_cases(24, 17))
    for (DType dtype : {DType::f64, DType::f32}) check_reference(c, dtype, seed++);
}

TEST(QueryPacking, RandomShapesCpu) {
  uint64_t seed = 2700;
  for (const QueryCase& c : random_cases(24, 27))
    for (DType dtype : {DType::f32, DType::bf16}) {
      // The process's own kernel table: bf16 takes the matrix path's rule where it has one.
      matrix_rule() = dtype == DType::bf16 && cpu::kernels().gemm_bf16 != nullptr;
      check_cpu(c, dtype, seed++);
      matrix_rule() = false;
    }
}

// The cpu backend on one kernel table and storage dtype.
class CpuQueryPacking : public IsaTest {};

TEST_P(CpuQueryPacking, RowsAndGradientsMatchFullCall) {
  uint64_t seed = 900;
  for (const QueryCase& c : cases()) check_cpu(c, dtype(), seed++);
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuQueryPacking, ::testing::ValuesIn(isa_dtype_params()), isa_dtype_name);

// ---- Validation -------------------------------------------------------------------------------

struct Bad {
  LayerProblem full;
  QueryRows qr;
  SuffixProblem s;
  explicit Bad(std::vector<int32_t> tq = {3, 0, 50, 1, 2})
      : full(make_problem(cases()[0].cfg, with_dtype(cases()[0].sizes), 5)),
        qr(query_rows(full.sizes.seqlens, tq)),
        s(suffix_of(full, qr)) {}
  static Sizes with_dtype(Sizes z) {
    z.dtype = DType::f32;
    return z;
  }
  // The error message of forward() on the reference backend (empty: none).
  std::string forward_error(const Inputs& in) {
    try {
      forward(context_of(Backend::reference), full.cfg, in, s.p.outputs());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

void expect_error(const std::string& msg, const std::string& parameter, const std::string& words) {
  EXPECT_NE(msg.find(parameter), std::string::npos) << msg;
  EXPECT_NE(msg.find(words), std::string::npos) << msg;
}

TEST(QueryPacking, RejectsMoreQueriesThanKeys) {
  Bad bad;
  bad.s.cu_q.set(2, 4);  // sequence 1 has no keys but would get one query
  for (int64_t b = 3; b <= 5; ++b) bad.s.cu_q.set(b, bad.s.cu_q.get(b) + 1);
  bad.s.p.q = HostTensor(DType::f32, {57, 4, 16});
  expect_error(bad.forward_error(bad.s.inputs()), "cu_seqlens_q[2] - cu_seqlens_q[1]", "must be <= sequence 1's keys");
}

TEST(QueryPacking, RejectsWrongBatchAndTotals) {
  Bad bad;
  Inputs in = bad.s.inputs();
  HostTensor short_cu(DType::i32, {3});
  in.seqs_q.cu_seqlens = short_cu.view();
  expect_error(bad.forward_error(in), "cu_seqlens_q.shape[0]", "must be 6");
  Bad total;  // cu_seqlens_q's last entry is not q's rows
  Inputs in2 = total.s.inputs();
  total.s.cu_q.set(5, total.s.cu_q.get(5) - 1);
  expect_error(total.forward_error(in2), "cu_seqlens_q[5]", "the number of query rows Tq");
  Bad order;  // decreasing offsets
  Inputs in3 = order.s.inputs();
  order.s.cu_q.set(1, 9);
  expect_error(order.forward_error(in3), "cu_seqlens_q[2]", "must be >= cu_seqlens_q[1]");
  Bad dtype;
  Inputs in4 = dtype.s.inputs();
  HostTensor f(DType::f32, {6});
  in4.seqs_q.cu_seqlens = f.view();
  expect_error(dtype.forward_error(in4), "cu_seqlens_q.dtype", "must be i32");
}

TEST(QueryPacking, RejectsQuerySideShapesOfTheKeys) {
  Bad bad;
  Inputs in = bad.s.inputs();
  in.g = bad.full.g.view();  // [T, Hq, 3], not [Tq, Hq, 3]
  expect_error(bad.forward_error(in), "g.shape[0]", "[Tq, Hq, 3]");
  Bad out;
  ForwardOutputs o = out.s.p.outputs();
  o.o = out.full.o.view();
  try {
    forward(context_of(Backend::reference), out.full.cfg, out.s.inputs(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    expect_error(e.what(), "o.shape[0]", "[Tq, Hq, Dv]");
  }
  Bad keys;  // keys cut to the queries' rows
  Inputs in3 = keys.s.inputs();
  HostTensor k(DType::f32, {keys.s.p.q.shape()[0], 2, 16});
  in3.kv[kSlc].k = k.view();
  expect_error(keys.forward_error(in3), "k_slc.shape[0]", "must be 117");
}

TEST(QueryPacking, WithoutPackingQueriesMustCoverTheKeys) {
  Bad bad;
  Inputs in = bad.s.inputs();
  in.seqs_q = Sequences{};  // q has Tq rows but no query packing says which
  expect_error(bad.forward_error(in), "k_cmp.shape[0]", "must be 56");
  Inputs in2 = bad.full.inputs();
  in2.seqs_q.max_seqlen = 4;
  expect_error(bad.forward_error(in2), "seqs_q.max_seqlen", "must be 0 without seqs_q.cu_seqlens");
  Bad small;
  Inputs in3 = small.s.inputs();
  in3.seqs_q.max_seqlen = 3;  // sequence 2 has 50 queries
  expect_error(small.forward_error(in3), "seqs_q.max_seqlen", "must be >= the most queries of a sequence, 50");
}

TEST(QueryPacking, CudaBackendRefusesOne) {
  Bad bad;
  Context cuda = context_of(Backend::cuda);
  std::string msg;
  try {
    forward(cuda, bad.full.cfg, bad.s.inputs(), bad.s.p.outputs());
  } catch (const Error& e) {
    msg = e.what();
  }
  expect_error(msg, "seqs_q.cu_seqlens", "is not supported by the cuda backend yet");
  // The keys' own view is no query packing: whatever cuda says then, it is not this.
  Inputs in = bad.full.inputs();
  in.seqs_q = in.seqs;
  try {
    forward(cuda, bad.full.cfg, in, bad.full.outputs());
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("seqs_q"), std::string::npos) << e.what();
  }
}

TEST(QueryPacking, WorkspaceIsTheKeys) {
  Bad bad;
  const Problem pr = problem_of(bad.full.cfg, bad.s.inputs());
  EXPECT_EQ(pr.total_tokens, bad.full.T);  // the keys' rows, not the queries'
  EXPECT_EQ(pr.batch, 5);
  EXPECT_EQ(pr.max_seqlen, 50);
  const Problem full = problem_of(bad.full.cfg, bad.full.inputs());
  for (Op op : {Op::forward, Op::backward})
    EXPECT_EQ(workspace_size(context_of(Backend::cpu), op, bad.full.cfg, pr),
              workspace_size(context_of(Backend::cpu), op, bad.full.cfg, full));
}

TEST(QueryPacking, KeysOwnPackingIsNoQueryPacking) {
  // The very view of seqs.cu_seqlens as cu_seqlens_q: the same as none (what the cuda backend takes).
  LayerProblem a = make_problem(cases()[0].cfg, Bad::with_dtype(cases()[0].sizes), 11);
  LayerProblem b = a;
  Inputs in = b.inputs();
  in.seqs_q = in.seqs;
  const Context ref = context_of(Backend::reference);
  forward(ref, a.cfg, a.inputs(), a.outputs());
  forward(ref, b.cfg, in, b.outputs());
  expect_same_bits("o", b.o, a.o);
  EXPECT_EQ(problem_of(a.cfg, in).total_tokens, a.T);
}

}  // namespace
