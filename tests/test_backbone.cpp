// The reach backbone (spec §11): the rule (the reference's top-n against the rule written out
// here, with ties, clipping at the sequence start, forced blocks that coincide, packed sequences),
// the CPU backend against the reference, the schedule, named errors, and the reach proof: a
// breadth-first search over the blocks the library itself selects shows every block reaching every
// later block within ceil(P / k) consecutive layers; dropping one offset of the schedule breaks it.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "support.h"
#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

Config with_backbone(Config c, std::vector<int64_t> offsets) {
  c.set_backbone(offsets);
  return c;
}

// §4 with §11, written out: the forced set, then the best others (ties to the smaller j), ascending.
std::vector<int32_t> rule(const Config& c, int64_t t, const std::vector<float>& S) {
  const int64_t J = t / c.slc_block_len, count = std::min(c.n_selected, J + 1);
  std::set<int64_t> forced;
  for (int64_t j = 0; j < c.n_init && j <= J; ++j) forced.insert(j);
  for (int64_t j = std::max<int64_t>(J - c.n_local + 1, 0); j <= J; ++j) forced.insert(j);
  for (int64_t k = 0; k < c.num_backbone; ++k)
    if (J - c.backbone_offsets[k] >= 0) forced.insert(J - c.backbone_offsets[k]);
  std::vector<int64_t> rest;
  for (int64_t j = 0; j <= J; ++j)
    if (!forced.count(j)) rest.push_back(j);
  std::stable_sort(rest.begin(), rest.end(), [&](int64_t a, int64_t b) { return S[a] > S[b]; });
  std::vector<int32_t> out(forced.begin(), forced.end());
  for (size_t k = 0; static_cast<int64_t>(out.size()) < count && k < rest.size(); ++k) out.push_back(static_cast<int32_t>(rest[k]));
  std::sort(out.begin(), out.end());
  out.resize(static_cast<size_t>(c.n_selected), -1);
  return out;
}

// top-n of scores [T, Hkv, Ns] on a backend, for packed sequences of the given lengths.
std::vector<int32_t> topn(Backend b, const Config& c, const std::vector<int32_t>& seqlens, HostTensor& scores) {
  HostTensor cu(DType::i32, {static_cast<int64_t>(seqlens.size()) + 1});
  int64_t acc = 0;
  cu.set(0, 0);
  for (size_t i = 0; i < seqlens.size(); ++i) cu.set(static_cast<int64_t>(i) + 1, double(acc += seqlens[i]));
  const int64_t T = scores.shape()[0], hkv = scores.shape()[1];
  HostTensor idx(DType::i32, {T, hkv, c.n_selected});
  Sequences s;
  s.cu_seqlens = cu.view();
  OwnedWorkspace ws(workspace_size(context_of(b), Op::select_topn, c, Problem{T, static_cast<int64_t>(seqlens.size()),
                                                                              c.slc_block_len * scores.shape()[2], hkv, hkv, 1, 1,
                                                                              0, DType::f32, Device::cpu}));
  select_topn(context_of(b), c, scores.view(), s, idx.view(), ws.ws);
  std::vector<int32_t> v(static_cast<size_t>(idx.numel()));
  for (int64_t i = 0; i < idx.numel(); ++i) v[static_cast<size_t>(i)] = static_cast<int32_t>(idx.get(i));
  return v;
}

TEST(Backbone, ReferenceAndCpuFollowTheRule) {
  const Config base = make_config(16, 8, 16, 7, 1, 2, 32, PhiKind::mean);
  // Offsets that coincide with initial or local blocks near the start, and far ones.
  for (const std::vector<int64_t>& offs : {std::vector<int64_t>{1}, {3}, {1, 2, 4}, {2, 8, 32, 5}}) {
    const Config c = with_backbone(base, offs);
    const std::vector<int32_t> seqlens = {700, 1, 0, 333};
    const int64_t T = 1034, hkv = 2, ns = 44;
    std::mt19937_64 rng(offs.size());
    HostTensor scores(DType::f32, {T, hkv, ns});
    // Few distinct values: many exact ties, so the tie rule decides often.
    for (int64_t i = 0; i < scores.numel(); ++i) scores.set(i, double(rng() % 5));
    const std::vector<int32_t> ref = topn(Backend::reference, c, seqlens, scores);
    const std::vector<int32_t> cpu = topn(Backend::cpu, c, seqlens, scores);
    EXPECT_EQ(ref, cpu) << "cpu against the reference";
    int64_t s0 = 0;
    for (int32_t len : seqlens) {
      for (int64_t t = 0; t < len; ++t)
        for (int64_t hk = 0; hk < hkv; ++hk) {
          std::vector<float> S(static_cast<size_t>(ns));
          for (int64_t j = 0; j < ns; ++j) S[static_cast<size_t>(j)] = static_cast<float>(scores.get(((s0 + t) * hkv + hk) * ns + j));
          const std::vector<int32_t> want = rule(c, t, S);
          const int32_t* got = ref.data() + ((s0 + t) * hkv + hk) * c.n_selected;
          ASSERT_TRUE(std::equal(want.begin(), want.end(), got)) << "token " << t << " of a sequence, offsets " << offs.size();
        }
      s0 += len;
    }
  }
}

// The whole layer with the backbone: the CPU forward selects as the reference does and its output
// is the reference's within the usual tolerance.
TEST(Backbone, CpuForwardMatchesReference) {
  const Config c = with_backbone(make_config(16, 8, 32, 6, 1, 1, 40, PhiKind::mlp), {1, 4});
  Sizes s = make_sizes({300, 77}, 4, 2, 16, 16);
  s.dtype = DType::f32;
  LayerProblem cpu = make_problem(c, s, 3);
  LayerProblem truth = to_f64(cpu);
  forward(context_of(Backend::reference), c, truth.inputs(), truth.outputs());
  OwnedWorkspace ws = cpu_workspace(Op::forward, c, problem_of(c, cpu.inputs()));
  forward(context_of(Backend::cpu), c, cpu.inputs(), cpu.outputs(), ws.ws);
  const Rowset rows = compare_indices(cpu.indices, truth.indices, cpu.T, s.hkv, c.n_selected);
  EXPECT_LE(rows.disagree, 2) << "rows whose blocks differ";
  const std::vector<double> got = on_rows(cpu.o, rows, cpu.T, s.hq, s.hkv, s.dv), want = on_rows(truth.o, rows, cpu.T, s.hq, s.hkv, s.dv);
  EXPECT_LE(max_abs_diff(got, want), 1e-4);
  // Every query's selection holds its backbone blocks.
  for (int64_t t = 0; t < 300; ++t)
    for (int64_t o : {1, 4})
      if (t / 32 - o >= 0) {
        bool found = false;
        for (int64_t k = 0; k < c.n_selected; ++k) found |= truth.indices.get(t * s.hkv * c.n_selected + k) == t / 32 - o;
        ASSERT_TRUE(found) << "token " << t << ", offset " << o;
      }
}

TEST(Backbone, Schedule) {
  // N_s = 1000 blocks: P = 10; layer i gets 2^(i mod 10).
  for (int64_t layer = 0; layer < 25; ++layer)
    EXPECT_EQ(backbone_schedule(layer, 64000, 64), std::vector<int64_t>{int64_t(1) << (layer % 10)}) << layer;
  // k = 3: base 4, P = ceil(log4(1000)) = 5; layer 3: d * 4^3.
  EXPECT_EQ(backbone_schedule(3, 64000, 64, 3), (std::vector<int64_t>{64, 128, 192}));
  // Offsets at or past N_s reach nothing and are left out: layer 4 gives 256, 512, 768 (< 1000).
  EXPECT_EQ(backbone_schedule(4, 64000, 64, 3), (std::vector<int64_t>{256, 512, 768}));
  EXPECT_EQ(backbone_schedule(4, 40000, 64, 3), (std::vector<int64_t>{256, 512}));  // N_s = 625
  EXPECT_TRUE(backbone_schedule(0, 64, 64).empty()) << "one block: nothing to reach";
  EXPECT_EQ(backbone_schedule(0, 65, 64), std::vector<int64_t>{1});
  EXPECT_EQ(backbone_schedule(7, 65, 64, 4), std::vector<int64_t>{1}) << "offsets below N_s only";
  EXPECT_THROW(backbone_schedule(-1, 100, 64), Error);
  EXPECT_THROW(backbone_schedule(0, 0, 64), Error);
  EXPECT_THROW(backbone_schedule(0, 100, 64, 9), Error);
}

TEST(Backbone, BadOffsetsAreNamedErrors) {
  const Config base = make_config(32, 16, 64, 6, 1, 2, 64, PhiKind::mean);
  struct Bad {
    std::vector<int64_t> offsets;
    int64_t n;
    std::string parameter;
  };
  for (const Bad& b : {Bad{{0}, 6, "backbone_offsets[0]"}, Bad{{2, -3}, 6, "backbone_offsets[1]"},
                       Bad{{4, 2, 4}, 6, "backbone_offsets[2]"}, Bad{{1, 2, 4, 8}, 6, "n_init + n_local + num_backbone"}}) {
    Config c = base;
    c.n_selected = b.n;
    c.set_backbone(b.offsets);
    try {
      c.validate();
      ADD_FAILURE() << b.parameter << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.parameter(), b.parameter) << e.what();
    }
  }
  Config c = base;
  try {
    c.set_backbone({1, 2, 3, 4, 5, 6, 7, 8, 9});
    ADD_FAILURE() << "nine offsets accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), "backbone_offsets");
  }
  c.num_backbone = 9;  // set by hand
  EXPECT_THROW(c.validate(), Error);
}

// The blocks each block's queries select in one layer, from the library's own top-n (reference
// backend; zero scores, n = k and no initial or local blocks, so that what is selected beyond the
// backbone are the tie rule's smallest blocks near the sequence start).
std::vector<std::vector<int64_t>> layer_edges(const std::vector<int64_t>& offsets, int64_t Ns) {
  const int64_t lp = 4;
  Config c = make_config(4, 4, lp, static_cast<int64_t>(offsets.size()), 0, 0, 0, PhiKind::mean);
  c.set_backbone(offsets);
  const int64_t T = Ns * lp;
  HostTensor scores(DType::f32, {T, 1, Ns});
  HostTensor idx(DType::i32, {T, 1, c.n_selected});
  select_topn(context_of(Backend::reference), c, scores.view(), Sequences{}, idx.view());
  std::vector<std::vector<int64_t>> sel(static_cast<size_t>(Ns));
  for (int64_t J = 0; J < Ns; ++J)  // the first query of block J (all of the block's select alike)
    for (int64_t k = 0; k < c.n_selected; ++k) {
      const int64_t j = static_cast<int64_t>(idx.get(J * lp * c.n_selected + k));
      if (j >= 0) sel[static_cast<size_t>(J)].push_back(j);
    }
  return sel;
}

// Whether, for every window of `window` consecutive layers of the schedule, every block reaches
// every later block (information in block j moves to block J in a layer where J's queries select
// j, and stays put otherwise: the residual stream).
::testing::AssertionResult reaches_within(const std::vector<std::vector<int64_t>>& schedule, int64_t Ns, int64_t window) {
  std::vector<std::vector<std::vector<int64_t>>> edges;
  for (const auto& offs : schedule) edges.push_back(layer_edges(offs, Ns));
  const int64_t L = static_cast<int64_t>(schedule.size());
  for (int64_t first = 0; first + window <= L; ++first)
    for (int64_t src = 0; src < Ns; ++src) {
      std::vector<char> reached(static_cast<size_t>(Ns), 0);
      reached[static_cast<size_t>(src)] = 1;
      for (int64_t layer = first; layer < first + window; ++layer) {
        std::vector<char> next = reached;
        for (int64_t J = 0; J < Ns; ++J)
          for (int64_t j : edges[static_cast<size_t>(layer)][static_cast<size_t>(J)])
            if (reached[static_cast<size_t>(j)]) next[static_cast<size_t>(J)] = 1;
        reached = next;
      }
      for (int64_t J = src + 1; J < Ns; ++J)
        if (!reached[static_cast<size_t>(J)])
          return ::testing::AssertionFailure() << "block " << src << " does not reach block " << J << " in layers " << first
                                               << ".." << first + window - 1;
    }
  return ::testing::AssertionSuccess();
}

TEST(Backbone, ReachProof) {
  for (auto [L, Ns, k] : {std::tuple<int64_t, int64_t, int64_t>{12, 64, 1}, {9, 100, 1}, {8, 256, 2}, {10, 37, 3}}) {
    SCOPED_TRACE("L " + std::to_string(L) + ", N_s " + std::to_string(Ns) + ", k " + std::to_string(k));
    int64_t window = 0;  // ceil(log_(k+1)(N_s)): the least any k offsets a layer allow
    for (int64_t power = 1; power < Ns; power *= k + 1) ++window;
    std::vector<std::vector<int64_t>> schedule;
    for (int64_t layer = 0; layer < L; ++layer) schedule.push_back(backbone_schedule(layer, Ns * 4, 4, k));
    EXPECT_TRUE(reaches_within(schedule, Ns, window));
    // Broken: one layer loses an offset (the distance 2^e it carried is then missed by some window).
    std::vector<std::vector<int64_t>> broken = schedule;
    broken[static_cast<size_t>(L / 2)].erase(broken[static_cast<size_t>(L / 2)].begin());
    EXPECT_FALSE(reaches_within(broken, Ns, window)) << "the proof must fail without one offset";
  }
}

}  // namespace
