// Decoding (spec §10, nsa/cache.h) on the host backends: appending to a paged cache in random
// steps (a first chunk, then single tokens and bursts, sequences of a batch at different lengths,
// pages shuffled) and attending each step's new rows gives the prefill rows of those tokens; each
// compressed block appears exactly when its last token arrives; appending in chunks equals
// appending at once; bad metadata is a named error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "decode_support.h"
#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

Config backbone(Config c, const std::vector<int64_t>& offsets) {
  c.set_backbone(offsets);
  return c;
}

struct DecodeCase {
  std::string name;
  Config cfg;
  Sizes sizes;
  int64_t page_size;
};

// Awkward shapes: lengths not multiples of l, d, l', w or the page; an empty and a one-token
// sequence; n above the block count; G from 1 to 16; shared and independent K/V; every phi.
std::vector<DecodeCase> cases() {
  return {
      {"packed_mlp_G2", make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp), make_sizes({37, 0, 50, 1}, 4, 2, 16, 8), 16},
      {"paper_blocks_G16_linear", make_config(32, 16, 64, 5, 1, 2, 100, PhiKind::linear),
       make_sizes({300, 129}, 16, 1, 32, 16), 128},
      {"G1_shared_mean", make_config(16, 8, 32, 4, 0, 1, 40, PhiKind::mean, true), make_sizes({200}, 2, 2, 24, 40), 32},
      {"n_above_blocks_no_window", make_config(8, 4, 16, 20, 2, 1, 0, PhiKind::mlp), make_sizes({90}, 8, 1, 8, 8), 48},
      {"no_selection", make_config(8, 8, 8, 0, 0, 0, 33, PhiKind::linear), make_sizes({70, 3}, 6, 3, 8, 16), 8},
      {"backbone_mlp_G2", backbone(make_config(8, 4, 16, 5, 1, 1, 12, PhiKind::mlp), {1, 3}),
       make_sizes({90, 41}, 4, 2, 16, 8), 32},
  };
}

int64_t longest(const Sizes& s) { return *std::max_element(s.seqlens.begin(), s.seqlens.end()); }

// Bits of two doubles (NaN patterns aside: any NaN equals any NaN).
bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0; }

// Rows [from, from + n) of sequence b of a packed [T, ...] tensor vs rows [r0, r0 + n) of a step's.
::testing::AssertionResult rows_equal(const HostTensor& step, int64_t r0, const HostTensor& full, int64_t f0, int64_t n,
                                      int64_t branch_axis_len = 0) {
  // branch_axis_len > 0: [3, rows, ...] tensors, compared branch by branch.
  const int branches = branch_axis_len > 0 ? 3 : 1;
  const int64_t step_rows = branch_axis_len > 0 ? step.shape()[1] : step.shape()[0];
  const int64_t full_rows = branch_axis_len > 0 ? full.shape()[1] : full.shape()[0];
  const int64_t inner = step.numel() / branches / std::max<int64_t>(step_rows, 1);
  for (int br = 0; br < branches; ++br)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < inner; ++e) {
        const double a = step.get((br * step_rows + r0 + i) * inner + e);
        const double b = full.get((br * full_rows + f0 + i) * inner + e);
        if (!same(a, b))
          return ::testing::AssertionFailure() << "row " << f0 + i << " element " << e << " (branch " << br
                                               << "): decode " << a << ", prefill " << b;
      }
  return ::testing::AssertionSuccess();
}

// Compressed slots of sequence b: block i (< N_c(len)) holds want's row s0/d + i (within tol, 0:
// bit for bit), later slots are still poisoned.
::testing::AssertionResult cmp_slots_as_expected(HostCache& c, const HostTensor& pool, const HostTensor& want,
                                                 int64_t b, int64_t s0, int64_t len, double tol = 0.0) {
  const Config& cfg = c.cfg;
  const int64_t d = cfg.cmp_stride, ps = c.page_size, H = pool.shape()[2], D = pool.shape()[3];
  const int64_t ready = num_cmp_blocks(len, cfg.cmp_block_len, d);
  for (int64_t i = 0; i < c.max_pages * ps / d; ++i) {
    const int64_t page = static_cast<int64_t>(c.block_table.get(b * c.max_pages + cmp_block_page(i, d, ps)));
    const int64_t base = (page * (ps / d) + cmp_block_slot(i, d, ps)) * H * D;
    for (int64_t e = 0; e < H * D; ++e) {
      const double got = pool.get(base + e);
      if (i < ready) {
        const double w = want.get((cmp_row_offset(s0, d) + i) * H * D + e);
        if (tol == 0.0 ? !same(got, w) : !(std::fabs(got - w) <= tol * (1.0 + std::fabs(w))))
          return ::testing::AssertionFailure() << "block " << i << " element " << e << ": " << got << " instead of " << w;
      } else if (!std::isnan(got)) {
        return ::testing::AssertionFailure() << "block " << i << " written before its last token (length " << len << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Appends the problem's tokens to a fresh cache by `schedule` on backend ctx, calling
// on_step(step, rows, done, cache) after each step's append and decode.
template <typename OnStep>
HostCache run_schedule(const Context& ctx, const DecodeCase& c, LayerProblem& p,
                       const std::vector<std::vector<int64_t>>& schedule, uint64_t seed, OnStep on_step) {
  HostCache cache = make_cache(c.cfg, p.sizes, c.page_size, longest(p.sizes) + 5, seed);
  std::vector<int64_t> done(p.sizes.seqlens.size(), 0);
  for (const auto& step : schedule) {
    for (size_t b = 0; b < step.size(); ++b) cache.seq_lens.set(int64_t(b), double(done[b] + step[b]));
    StepRows s = step_rows(p, done, step);
    CacheAppend a = s.append();
    a.phi_k = LayerProblem::params(p.phi_k);
    a.phi_v = LayerProblem::params(p.phi_v);
    PagedCache view = cache.view();
    const Problem pa = problem_of(c.cfg, view, a);
    OwnedWorkspace wa(workspace_size(ctx, Op::cache_append, c.cfg, pa));
    cache_append(ctx, c.cfg, view, a, wa.ws);
    const Problem pd = problem_of(c.cfg, view, s.queries());
    OwnedWorkspace wd(workspace_size(ctx, Op::decode, c.cfg, pd));
    decode(ctx, c.cfg, view, s.queries(), s.outputs(), wd.ws);
    on_step(step, s, done, cache);
    for (size_t b = 0; b < step.size(); ++b) done[b] += step[b];
  }
  return cache;
}

// The reference's decode is the prefill's rows bit for bit in fp64 (same per-query code, same
// compressed keys), every step of a random schedule, with each compressed block appearing
// exactly when its last token arrives.
TEST(ReferenceDecode, EqualsPrefillRowsAtEveryStep) {
  uint64_t seed = 1;
  for (const DecodeCase& c : cases()) {
    SCOPED_TRACE(c.name);
    LayerProblem p = make_problem(c.cfg, c.sizes, seed++);
    const Context ref = context_of(Backend::reference);
    forward(ref, c.cfg, p.inputs(), p.outputs());
    Sequences seqs;
    if (c.sizes.seqlens.size() != 1) seqs.cu_seqlens = p.cu.view();
    const int64_t rows = p.T / c.cfg.cmp_stride;
    HostTensor kc(DType::f64, {rows, c.sizes.hkv, c.sizes.dqk}), vc(DType::f64, {rows, c.sizes.hkv, c.sizes.dv});
    compress_fwd(ref, c.cfg, LayerProblem::params(p.phi_k), p.k[0].view(), seqs, kc.view());
    compress_fwd(ref, c.cfg, LayerProblem::params(p.phi_v), p.v[0].view(), seqs, vc.view());

    const auto schedule = random_schedule(c.sizes.seqlens, seed++, 40, 4);
    run_schedule(ref, c, p, schedule, seed++, [&](const std::vector<int64_t>& step, const StepRows& s,
                                                  const std::vector<int64_t>& done, HostCache& cache) {
      int64_t r0 = 0, s0 = 0;
      for (size_t b = 0; b < step.size(); ++b) {
        const int64_t f0 = s0 + done[b];
        ASSERT_TRUE(rows_equal(s.o, r0, p.o, f0, step[b])) << "o, sequence " << b;
        ASSERT_TRUE(rows_equal(s.lse, r0, p.lse, f0, step[b])) << "lse, sequence " << b;
        ASSERT_TRUE(rows_equal(s.indices, r0, p.indices, f0, step[b])) << "indices, sequence " << b;
        ASSERT_TRUE(rows_equal(s.o_branch, r0, p.o_branch, f0, step[b], 3)) << "o_branch, sequence " << b;
        const int64_t len = done[b] + step[b];
        ASSERT_TRUE(cmp_slots_as_expected(cache, cache.kc, kc, int64_t(b), s0, len)) << "kc, sequence " << b;
        ASSERT_TRUE(cmp_slots_as_expected(cache, cache.vc, vc, int64_t(b), s0, len)) << "vc, sequence " << b;
        r0 += step[b];
        s0 += c.sizes.seqlens[b];
      }
    });
  }
}

// Dense decode over the cache equals dense causal attention's rows.
TEST(ReferenceDecode, DenseDecodeEqualsDenseRows) {
  const DecodeCase c = cases()[0];
  LayerProblem p = make_problem(c.cfg, c.sizes, 7);
  const Context ref = context_of(Backend::reference);
  HostTensor o(DType::f64, {p.T, c.sizes.hq, c.sizes.dv}), lse(DType::f32, {p.T, c.sizes.hq});
  Sequences seqs;
  seqs.cu_seqlens = p.cu.view();
  dense_attention_fwd(ref, 0.0, p.q.view(), p.k[kSlc].view(), p.v[kSlc].view(), seqs, o.view(), lse.view());
  HostCache cache = make_cache(c.cfg, c.sizes, c.page_size, longest(c.sizes), 8);
  std::vector<int64_t> none(c.sizes.seqlens.size(), 0), all(c.sizes.seqlens.begin(), c.sizes.seqlens.end());
  for (size_t b = 0; b < all.size(); ++b) cache.seq_lens.set(int64_t(b), double(all[b]));
  StepRows s = step_rows(p, none, all);
  CacheAppend a = s.append();
  a.phi_k = LayerProblem::params(p.phi_k);
  a.phi_v = LayerProblem::params(p.phi_v);
  cache_append(ref, c.cfg, cache.view(), a);
  HostTensor od(DType::f64, {p.T, c.sizes.hq, c.sizes.dv}), lsed(DType::f32, {p.T, c.sizes.hq});
  PageTable table = cache.view().pages;
  dense_decode(ref, 0.0, KV{cache.k[kSlc].view(), cache.v[kSlc].view()}, table, s.q.view(),
               s.queries().seqs, od.view(), lsed.view());
  EXPECT_TRUE(rows_equal(od, 0, o, 0, p.T));
  EXPECT_TRUE(rows_equal(lsed, 0, lse, 0, p.T));
}

// ---- The CPU backend -------------------------------------------------------------------------


class CpuDecode : public IsaTest {};

// Decode on the CPU backend against the reference's decode of the same cache contents in fp64
// (the style.md tolerance: twice the error of that result rounded to the storage dtype), at every
// step; the cached compressed keys against the prefill's compress_fwd (a decode step's few blocks
// are summed in another order: a unit of the storage type); the decoded rows' selections against
// the CPU prefill's.
TEST_P(CpuDecode, MatchesPrefillRowsAtEveryStep) {
  uint64_t seed = 40;
  for (const DecodeCase& c : cases()) {
    SCOPED_TRACE(c.name);
    Sizes sz = c.sizes;
    sz.dtype = dtype();
    LayerProblem p = make_problem(c.cfg, sz, seed++);
    LayerProblem prefill = p;
    const Context ref = context_of(Backend::reference), cpu = context_of(Backend::cpu);
    {
      OwnedWorkspace ws = cpu_workspace(Op::forward, c.cfg, problem_of(c.cfg, prefill.inputs()));
      forward(cpu, c.cfg, prefill.inputs(), prefill.outputs(), ws.ws);
    }
    Sequences seqs;
    if (sz.seqlens.size() != 1) seqs.cu_seqlens = p.cu.view();
    const int64_t rows = p.T / c.cfg.cmp_stride;
    HostTensor kc(sz.dtype, {rows, sz.hkv, sz.dqk}), vc(sz.dtype, {rows, sz.hkv, sz.dv});
    for (int kv = 0; kv < 2; ++kv) {
      Problem pc = problem_of(c.cfg, p.inputs());  // compress_fwd's: H = Hkv, one head dim
      pc.hq = pc.hkv;
      pc.dqk = pc.dv = kv == 0 ? sz.dqk : sz.dv;
      OwnedWorkspace ws = cpu_workspace(Op::compress_fwd, c.cfg, pc);
      compress_fwd(cpu, c.cfg, LayerProblem::params(kv == 0 ? p.phi_k : p.phi_v), (kv == 0 ? p.k[0] : p.v[0]).view(), seqs,
                   (kv == 0 ? kc : vc).view(), ws.ws);
    }
    LayerProblem got = p, truth = to_f64(p);  // decoded rows over the steps: the cpu's, the reference's
    const int64_t T = p.T, hq = sz.hq, hkv = sz.hkv, n = c.cfg.n_selected;
    const auto schedule = random_schedule(sz.seqlens, seed++, 40, 4);
    HostCache cache = run_schedule(cpu, c, p, schedule, seed++, [&](const std::vector<int64_t>& step, StepRows& s,
                                                                   const std::vector<int64_t>& done, HostCache& live) {
      scatter_rows(s.o, got.o, step, done, sz);
      scatter_rows(s.lse, got.lse, step, done, sz);
      scatter_rows(s.indices, got.indices, step, done, sz);
      scatter_rows(s.o_branch, got.o_branch, step, done, sz, true);
      // The reference on the very cache the cpu just used (outputs in fp64).
      const int64_t r = s.q.shape()[0];
      StepRows t = s;
      t.q = convert(s.q, DType::f64);
      t.g = convert(s.g, DType::f64);
      t.o = HostTensor(DType::f64, {r, hq, sz.dv});
      t.o_branch = HostTensor(DType::f64, {3, r, hq, sz.dv});
      HostCache exact = live;  // the same values in fp64
      for (int i = 0; i < 3; ++i) {
        exact.k[i] = convert(live.k[i], DType::f64);
        exact.v[i] = convert(live.v[i], DType::f64);
      }
      exact.kc = convert(live.kc, DType::f64);
      exact.vc = convert(live.vc, DType::f64);
      decode(ref, c.cfg, exact.view(), t.queries(), t.outputs());
      scatter_rows(t.o, truth.o, step, done, sz);
      scatter_rows(t.lse, truth.lse, step, done, sz);
      scatter_rows(t.indices, truth.indices, step, done, sz);
      scatter_rows(t.o_branch, truth.o_branch, step, done, sz, true);
    });
    int64_t s0 = 0;
    const double unit = sz.dtype == DType::f32 ? 1e-5 : sz.dtype == DType::bf16 ? 0x1p-7 : 0x1p-10;
    for (size_t b = 0; b < sz.seqlens.size(); ++b) {
      EXPECT_TRUE(cmp_slots_as_expected(cache, cache.kc, kc, int64_t(b), s0, sz.seqlens[b], unit)) << "kc, sequence " << b;
      EXPECT_TRUE(cmp_slots_as_expected(cache, cache.vc, vc, int64_t(b), s0, sz.seqlens[b], unit)) << "vc, sequence " << b;
      s0 += sz.seqlens[b];
    }
    LayerProblem rounded = truth;  // the truth rounded to the storage dtype: a plain implementation's error
    rounded.o = convert(convert(truth.o, sz.dtype), DType::f64);
    rounded.o_branch = convert(convert(truth.o_branch, sz.dtype), DType::f64);
    const Rowset agree = compare_indices(got.indices, truth.indices, T, hkv, n);
    EXPECT_LE(agree.disagree, std::max<int64_t>(1, T * hkv / 100)) << "rows with other indices than the reference";
    EXPECT_LE(compare_indices(got.indices, prefill.indices, T, hkv, n).disagree, std::max<int64_t>(1, T * hkv / 100))
        << "rows with other indices than the cpu prefill";
    const Rowset all{std::vector<char>(size_t(T * hkv), 1), 0};
    for (int br : {kCmp, kWin})
      expect_close("o_branch[" + std::to_string(br) + "]", on_rows(got.o_branch, all, T, hq, hkv, sz.dv, br),
                   on_rows(truth.o_branch, all, T, hq, hkv, sz.dv, br), on_rows(rounded.o_branch, all, T, hq, hkv, sz.dv, br));
    expect_close("o_branch[slc]", on_rows(got.o_branch, agree, T, hq, hkv, sz.dv, kSlc),
                 on_rows(truth.o_branch, agree, T, hq, hkv, sz.dv, kSlc),
                 on_rows(rounded.o_branch, agree, T, hq, hkv, sz.dv, kSlc));
    expect_close("o", on_rows(got.o, agree, T, hq, hkv, sz.dv), on_rows(truth.o, agree, T, hq, hkv, sz.dv),
                 on_rows(rounded.o, agree, T, hq, hkv, sz.dv));
    const std::vector<double> lse_got = on_rows(got.lse, agree, T, hq, hkv, 3), lse_truth = on_rows(truth.lse, agree, T, hq, hkv, 3);
    EXPECT_LE(max_abs_diff(lse_got, lse_truth), 2e-5 * std::max(1.0, max_abs(lse_truth))) << "lse";
  }
}

// Same inputs, same bits, on 1, 2 and 3 threads; appending in one go fills the cache as the
// steps did (raw and compressed pools bit for bit: here every append is few enough blocks for
// phi_forward_rows, whose sums do not depend on how the blocks were batched).
TEST_P(CpuDecode, DeterministicAndChunkFree) {
  const DecodeCase c = cases()[0];
  Sizes sz = c.sizes;
  sz.dtype = dtype();
  LayerProblem p = make_problem(c.cfg, sz, 77);
  const auto schedule = random_schedule(sz.seqlens, 78, 30, 3);
  std::vector<HostTensor> first;
  HostCache stepped;
  for (int threads : {1, 2, 3}) {
    std::vector<HostTensor> outs;
    HostCache cache = run_schedule(context_of(Backend::cpu, threads), c, p, schedule, 79,
                                   [&](const std::vector<int64_t>&, StepRows& s, const std::vector<int64_t>&, HostCache&) {
                                     outs.push_back(s.o);
                                     outs.push_back(s.o_branch);
                                     outs.push_back(s.lse);
                                   });
    if (threads == 1) {
      first = outs;
      stepped = cache;
      continue;
    }
    ASSERT_EQ(outs.size(), first.size());
    for (size_t i = 0; i < outs.size(); ++i)
      EXPECT_EQ(std::memcmp(outs[i].data(), first[i].data(), outs[i].numel() * dtype_size(outs[i].dtype())), 0)
          << "threads " << threads << ", output " << i;
  }
  std::vector<int64_t> all(sz.seqlens.begin(), sz.seqlens.end());
  HostCache once = run_schedule(context_of(Backend::cpu), c, p, {all}, 79, [](auto&&...) {});
  for (int i = 0; i < 3; ++i) {
    if (!once.k[i].defined()) continue;
    EXPECT_EQ(std::memcmp(once.k[i].data(), stepped.k[i].data(), once.k[i].numel() * dtype_size(sz.dtype)), 0) << "k pool " << i;
    EXPECT_EQ(std::memcmp(once.v[i].data(), stepped.v[i].data(), once.v[i].numel() * dtype_size(sz.dtype)), 0) << "v pool " << i;
  }
  EXPECT_EQ(std::memcmp(once.kc.data(), stepped.kc.data(), once.kc.numel() * dtype_size(sz.dtype)), 0) << "kc pool";
  EXPECT_EQ(std::memcmp(once.vc.data(), stepped.vc.data(), once.vc.numel() * dtype_size(sz.dtype)), 0) << "vc pool";
}

// Dense decode on the CPU against the reference's dense causal attention.
TEST_P(CpuDecode, DenseDecodeMatchesReference) {
  const DecodeCase c = cases()[1];
  Sizes sz = c.sizes;
  sz.dtype = dtype();
  LayerProblem p = make_problem(c.cfg, sz, 90);
  LayerProblem truth = to_f64(p);
  const Context ref = context_of(Backend::reference), cpu = context_of(Backend::cpu);
  Sequences seqs;
  seqs.cu_seqlens = p.cu.view();
  HostTensor o64(DType::f64, {p.T, sz.hq, sz.dv}), lse64(DType::f32, {p.T, sz.hq});
  HostTensor orr(sz.dtype, {p.T, sz.hq, sz.dv}), lser(DType::f32, {p.T, sz.hq});
  dense_attention_fwd(ref, 0.0, truth.q.view(), truth.k[kSlc].view(), truth.v[kSlc].view(), seqs, o64.view(), lse64.view());
  dense_attention_fwd(ref, 0.0, p.q.view(), p.k[kSlc].view(), p.v[kSlc].view(), seqs, orr.view(), lser.view());
  HostCache cache = run_schedule(cpu, c, p, {std::vector<int64_t>(sz.seqlens.begin(), sz.seqlens.end())}, 91,
                                 [](auto&&...) {});
  std::vector<int64_t> none(sz.seqlens.size(), 0), all(sz.seqlens.begin(), sz.seqlens.end());
  StepRows s = step_rows(p, none, all);
  HostTensor o(sz.dtype, {p.T, sz.hq, sz.dv}), lse(DType::f32, {p.T, sz.hq});
  o.poison();
  lse.poison();
  const KV pool{cache.k[kSlc].view(), cache.v[kSlc].view()};
  const PageTable table = cache.view().pages;
  const Problem pr = problem_of(pool, table, s.q.view(), s.queries().seqs);
  OwnedWorkspace ws(workspace_size(cpu, Op::dense_decode, c.cfg, pr));
  dense_decode(cpu, 0.0, pool, table, s.q.view(), s.queries().seqs, o.view(), lse.view(), ws.ws);
  expect_close("o", o.values(), o64.values(), orr.values());
  EXPECT_LE(max_abs_diff(lse.values(), lse64.values()), 2e-5 * std::max(1.0, max_abs(lse64.values()))) << "lse";
}

// Bad host metadata and shapes: a named error before any work (the pools are untouched).
TEST(DecodeErrors, BadInputsAreNamedErrorsAndTouchNothing) {
  const DecodeCase c = cases()[0];  // B = 4, page 16, l' = 16
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    SCOPED_TRACE(backend_name(backend));
    const Context ctx = context_of(backend);
    Sizes sz = c.sizes;
    sz.dtype = DType::f32;
    LayerProblem p = make_problem(c.cfg, sz, 5);
    std::vector<int64_t> none(sz.seqlens.size(), 0), some = {3, 0, 2, 1};
    // Every case starts from a valid call and breaks one thing.
    struct Bad {
      std::string parameter;
      std::function<void(HostCache&, StepRows&, CacheAppend&, DecodeInputs&, Config&)> make;
    };
    const std::vector<Bad> bad = {
        {"pages.block_table[2][0]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.block_table.set(2 * h.max_pages, double(h.num_pages));
         }},
        {"pages.block_table[0][0]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.block_table.set(0, -1);
         }},
        {"pages.seq_lens[1]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.seq_lens.set(1, double(h.max_pages * h.page_size + 1));
         }},
        {"pages.seq_lens[3]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.seq_lens.set(3, -1);
         }},
        {"pages.seq_lens[0]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.seq_lens.set(0, 2);  // 3 new rows, 2 tokens
         }},
        {"cache.k_cmp.shape[1] (page_size)", [&](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config& cfg) {
           cfg.slc_block_len = 32;  // page 16 is not a multiple
           cfg.cmp_stride = 4;
           (void)h;
         }},
        {"seqs.cu_seqlens[4]", [](HostCache&, StepRows& s, CacheAppend& a, DecodeInputs& d, Config&) {
           s.cu.set(4, s.cu.get(4) - 1);
           a.seqs.cu_seqlens = s.cu.view();
           d.seqs.cu_seqlens = s.cu.view();
         }},
        {"seqs.cu_seqlens", [](HostCache&, StepRows&, CacheAppend& a, DecodeInputs& d, Config&) {
           a.seqs.cu_seqlens = TensorView{};  // 6 rows do not divide among 4 sequences
           d.seqs.cu_seqlens = TensorView{};
         }},
        {"seqs.max_seqlen", [](HostCache&, StepRows&, CacheAppend& a, DecodeInputs& d, Config&) {
           a.seqs.max_seqlen = 2;  // sequence 0 has 3 rows
           d.seqs.max_seqlen = 2;
         }},
        {"cache.kc.shape[1]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.kc = HostTensor(h.kc.dtype(), {h.num_pages, h.page_size / h.cfg.cmp_stride + 1, h.kc.shape()[2], h.kc.shape()[3]});
         }},
        {"cache.k_slc", [](HostCache&, StepRows&, CacheAppend&, DecodeInputs&, Config& cfg) { cfg.shared_kv = true; }},
        {"pages.status.shape[0]", [](HostCache& h, StepRows&, CacheAppend&, DecodeInputs&, Config&) {
           h.status = HostTensor(DType::i32, {h.B + 1});
         }},
    };
    for (const Bad& b : bad) {
      SCOPED_TRACE(b.parameter);
      HostCache cache = make_cache(c.cfg, sz, c.page_size, longest(sz), 6);
      for (size_t i = 0; i < some.size(); ++i) cache.seq_lens.set(int64_t(i), double(some[i]));
      StepRows s = step_rows(p, none, some);
      CacheAppend a = s.append();
      a.phi_k = LayerProblem::params(p.phi_k);
      a.phi_v = LayerProblem::params(p.phi_v);
      DecodeInputs d = s.queries();
      Config cfg = c.cfg;
      b.make(cache, s, a, d, cfg);
      const HostCache before = cache;
      std::vector<unsigned char> ws(1 << 22);
      const Workspace w{ws.data() + (256 - reinterpret_cast<uintptr_t>(ws.data()) % 256) % 256, (1 << 22) - 256};
      for (int call = 0; call < 2; ++call) {
        try {
          if (call == 0) cache_append(ctx, cfg, cache.view(), a, w);
          else decode(ctx, cfg, cache.view(), d, s.outputs(), w);
          ADD_FAILURE() << (call ? "decode" : "cache_append") << " accepted the input";
        } catch (const Error& e) {
          EXPECT_EQ(e.parameter(), b.parameter) << e.what();
        }
      }
      for (int i = 0; i < 3; ++i)
        if (cache.k[i].defined())
          EXPECT_EQ(std::memcmp(cache.k[i].data(), const_cast<HostCache&>(before).k[i].data(),
                                cache.k[i].numel() * dtype_size(sz.dtype)), 0);
    }
  }
}

// Decoding keeps nothing for a backward: an o_cmp or o_win output is a named error (o_branch holds
// every branch's output), and the cache is untouched.
TEST(DecodeErrors, CompressedOutputIsRefused) {
  const DecodeCase c = cases()[0];
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    SCOPED_TRACE(backend_name(backend));
    Sizes sz = c.sizes;
    sz.dtype = DType::f32;
    LayerProblem p = make_problem(c.cfg, sz, 5);
    std::vector<int64_t> none(sz.seqlens.size(), 0), some = {3, 0, 2, 1};
    HostCache cache = make_cache(c.cfg, sz, c.page_size, longest(sz), 6);
    for (size_t i = 0; i < some.size(); ++i) cache.seq_lens.set(int64_t(i), double(some[i]));
    StepRows s = step_rows(p, none, some);
    std::vector<unsigned char> ws(1 << 22);
    const Workspace w{ws.data() + (256 - reinterpret_cast<uintptr_t>(ws.data()) % 256) % 256, (1 << 22) - 256};
    for (const char* name : {"o_cmp", "o_win"}) {
      ForwardOutputs out = s.outputs();
      (std::string(name) == "o_cmp" ? out.o_cmp : out.o_win) = out.o;
      try {
        decode(context_of(backend), c.cfg, cache.view(), s.queries(), out, w);
        ADD_FAILURE() << "decode accepted " << name;
      } catch (const Error& e) {
        EXPECT_EQ(e.parameter(), name) << e.what();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuDecode, ::testing::ValuesIn(isa_dtype_params()), isa_dtype_name);

}  // namespace
