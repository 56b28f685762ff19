// Decoding (spec §10, nsa/cache.h) on the host backends: appending to a paged cache in random
// steps (a first chunk, then single tokens and bursts, sequences of a batch at different lengths,
// pages shuffled) and attending each step's new rows gives the prefill rows of those tokens; each
// compressed block appears exactly when its last token arrives; appending in chunks equals
// appending at once; bad metadata is a named error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "decode_support.h"
#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

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

// Compressed slots of sequence b: block i (< N_c(len)) holds want's row s0/d + i, later slots are
// still poisoned.
::testing::AssertionResult cmp_slots_as_expected(HostCache& c, const HostTensor& pool, const HostTensor& want,
                                                 int64_t b, int64_t s0, int64_t len) {
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
        if (!same(got, w))
          return ::testing::AssertionFailure() << "block " << i << " element " << e << ": " << got << " instead of " << w;
      } else if (!std::isnan(got)) {
        return ::testing::AssertionFailure() << "block " << i << " written before its last token (length " << len << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
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

    HostCache cache = make_cache(c.cfg, c.sizes, c.page_size, longest(c.sizes) + 5, seed++);
    const auto schedule = random_schedule(c.sizes.seqlens, seed++, 40, 4);
    std::vector<int64_t> done(c.sizes.seqlens.size(), 0);
    for (const auto& step : schedule) {
      for (size_t b = 0; b < step.size(); ++b) cache.seq_lens.set(int64_t(b), double(done[b] + step[b]));
      StepRows s = step_rows(p, done, step);
      CacheAppend a = s.append();
      a.phi_k = LayerProblem::params(p.phi_k);
      a.phi_v = LayerProblem::params(p.phi_v);
      cache_append(ref, c.cfg, cache.view(), a);
      decode(ref, c.cfg, cache.view(), s.queries(), s.outputs());
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
      for (size_t b = 0; b < step.size(); ++b) done[b] += step[b];
    }
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

}  // namespace
