// The CUDA forward against the fp64 reference: every stage on its own (same inputs, so top-n is
// compared on identical scores and the selection branch on identical indices), then the whole
// forward. Inputs are random, lengths awkward (not multiples of l, d, l', w; packed batches with
// empty and one-token sequences; n larger than the block count); outputs are poisoned (NaN,
// -7777) before each run so an unwritten element fails.
//
// Tolerances (style.md): a plain same-precision implementation rounds P to the storage type
// before P V and rounds its output, so its error is at most u (|o| + max|v|) per element (u the
// unit roundoff); we allow twice that. Log-sum-exps and scores are fp32 on both sides of every
// implementation and are compared tightly: they catch a wrong key set that o's tolerance could
// hide.
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/phi/blas.h"
#include "cuda_support.h"
#include "cases.h"

using namespace nsa;
using namespace nsa::test;

namespace {

using Case = AttentionCase;  // cases.h

Sequences host_seqs(LayerProblem& p) {
  Sequences s;
  if (p.sizes.seqlens.size() != 1) s.cu_seqlens = p.cu.view();
  return s;
}

// Device cu_seqlens (the GPU path never reads host memory) with max_seqlen given.
struct DeviceSeqs {
  DeviceTensor cu;
  Sequences seqs;
  DeviceSeqs(LayerProblem& p, int64_t longest) {
    if (p.sizes.seqlens.size() != 1) {
      cu = DeviceTensor(p.cu);
      seqs.cu_seqlens = cu.view();
    }
    seqs.max_seqlen = longest;
  }
};

// Rounds an f64 tensor to `dtype` and back (what a same-precision implementation stores).
HostTensor rounded(const HostTensor& t, DType dtype) {
  HostTensor r(dtype, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) r.set(i, t.get(i));
  return to_f64(r);
}

auto attention_tol(DType dtype, double vmax) {
  const double u = unit_roundoff(dtype);
  return [=](double want, size_t) { return 2.0 * u * (std::fabs(want) + vmax) + 1e-6; };
}
auto lse_tol = [](double want, size_t) { return 2e-4 * (1.0 + std::fabs(want)); };
auto score_tol = [](double want, size_t) { return 1e-4 * std::max(1.0, std::fabs(want)); };

Context cuda_ctx() { return cuda_context(); }
Context ref_ctx() {
  Context c;
  c.backend = Backend::reference;
  return c;
}

void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      // name, dtype, Dqk, Dv, Hq, Hkv, seqlens, l, d, l', n, n_init, n_local, w, phi, shared_kv
      {"bf16_d128_G16_paper", DType::bf16, 128, 128, 16, 1, {300}, 32, 16, 64, 6, 1, 2, 100, PhiKind::mean, false},
      {"f16_d64_G1_packed_linear", DType::f16, 64, 64, 2, 2, {37, 0, 130, 1}, 16, 8, 32, 5, 1, 1, 40, PhiKind::linear, false},
      {"bf16_d192x128_G4_mlp", DType::bf16, 192, 128, 8, 2, {257}, 32, 16, 64, 4, 1, 2, 70, PhiKind::mlp, false},
      // phi's products over several tiles each way (F = 136, 272 rows), and bf16 with F = 20 (no
      // multiple of 8: the converting products).
      {"bf16_d128_G4_mlp_F136", DType::bf16, 128, 128, 8, 2, {2100, 77}, 32, 16, 64, 4, 1, 2, 128, PhiKind::mlp, false, 136},
      {"bf16_d64_G2_mlp_F20", DType::bf16, 64, 64, 4, 2, {300, 45}, 32, 16, 64, 3, 1, 1, 64, PhiKind::mlp, false, 20},
      {"f16_d128x64_G2_shared_bigN", DType::f16, 128, 64, 4, 2, {99, 200}, 8, 4, 16, 20, 2, 2, 33, PhiKind::mean, true},
      {"bf16_d64x128_G8_w1", DType::bf16, 64, 128, 8, 1, {150}, 32, 8, 64, 3, 0, 1, 1, PhiKind::mean, false},
      {"f16_d192x64_G16_nowindow", DType::f16, 192, 64, 16, 1, {65, 64}, 32, 16, 64, 16, 1, 2, 0, PhiKind::mean, false},
      {"bf16_d128_G2_noselect", DType::bf16, 128, 128, 4, 2, {190}, 32, 16, 64, 0, 0, 0, 64, PhiKind::linear, false},
      {"f16_d128_G4_lp128", DType::f16, 128, 128, 8, 2, {333}, 16, 16, 128, 2, 1, 1, 200, PhiKind::mean, false},
      // The paper's settings at a length where n = 16 blocks and the whole window w = 512 are in use.
      {"bf16_d64_G16_paper_T1500", DType::bf16, 64, 64, 16, 1, {1500}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mean, false},
      // Three and more chunks of 64 compressed keys (T > 128 d + l): every K/V buffer of the
      // compressed kernel is reused at least once.
      {"bf16_d128_G16_paper_T2300", DType::bf16, 128, 128, 16, 1, {2300}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mean, false},
      {"f16_d64_G4_linear_T2200", DType::f16, 64, 64, 8, 2, {2200, 97}, 32, 16, 64, 8, 1, 2, 256, PhiKind::linear, false},
      // Three and more chunks of 128 compressed keys (d = 8: 324 of them): each stage of sm_90a's
      // 128-key pass 1 (2-stage TMA ring, cmp_pass1_wide_kernel) is refilled at least once.
      {"bf16_d128_G8_d8_T2600", DType::bf16, 128, 128, 8, 1, {2600}, 16, 8, 64, 8, 1, 2, 256, PhiKind::mean, false},
      // l' = 24: selection blocks that end inside a 16-key step of the selection kernels.
      {"bf16_d64x128_G8_lp24", DType::bf16, 64, 128, 8, 1, {333, 50}, 16, 8, 24, 5, 1, 1, 50, PhiKind::mean, false},
      // l' = d at G = 1: a score ring of 256 blocks per token, too large for the S pass's 128-row
      // tile on sm_90a (128 tokens): the 64-row S pass runs instead (scores_rows).
      {"bf16_d192x64_G1_lp16_ring", DType::bf16, 192, 64, 2, 2, {260}, 32, 16, 16, 4, 1, 1, 64, PhiKind::mean, false},
      // The score pass by chunk with a carry of more keys than a block has (l/d - 1 = 7 > l'/d = 4
      // at G = 16, 5 > 2 at G = 2): a chunk's first blocks and the blocks after the last chunk take
      // keys of the previous chunk over several blocks; three chunks, tokens with exactly 64 and
      // 128 keys.
      {"bf16_d128_G16_l64_d8_lp32", DType::bf16, 128, 128, 16, 1, {1100, 600}, 64, 8, 32, 8, 1, 2, 256, PhiKind::mean, false},
      {"f16_d64_G2_l48_d8_lp16", DType::f16, 64, 64, 4, 2, {1200}, 48, 8, 16, 6, 1, 2, 128, PhiKind::linear, false},
  };
  return all;
}

class CudaForward : public ::testing::TestWithParam<Case> {};

// ---- compress_fwd ---------------------------------------------------------------------------

// The compress_fwd stage op on the GPU: phi_k of p over p's k[0] into xc ([rows, Hkv, Dqk], its
// contents the output's before the call). pe_shift: pe's device copy that many elements off its
// allocation.
void compress_on_device(const Case& c, const Config& cfg, LayerProblem& p, HostTensor& xc, int pe_shift = 0) {
  DeviceSeqs ds(p, max_seqlen(c));
  DeviceTensor k(p.k[0]), out(xc);
  DeviceTensor phi[5];
  for (int i = 0; i < 5; ++i) phi[i] = DeviceTensor(p.phi_k[i], i == 4 ? pe_shift : 0);
  const PhiParams params{phi[0].view(), phi[1].view(), phi[2].view(), phi[3].view(), phi[4].view()};
  Problem pr;
  pr.total_tokens = p.T;
  pr.hkv = c.hkv;
  pr.hq = c.hkv;
  pr.dqk = pr.dv = c.dqk;
  pr.phi_hidden = cfg.phi == PhiKind::mlp ? p.sizes.phi_hidden : 0;
  pr.dtype = c.dtype;
  pr.device = Device::cuda;
  pr.max_seqlen = max_seqlen(c);
  const DeviceWorkspace ws(workspace_size(cuda_ctx(), Op::compress_fwd, cfg, pr));  // NaN pattern
  compress_fwd(cuda_ctx(), cfg, params, k.view(), ds.seqs, out.view(), ws.view());
  sync();
  out.download(xc);
}

// phi alone (the compress_fwd stage op), every kind, against the reference.
// pe_shift: pe's device copy that many elements off its allocation (1: off 16 bytes, where phi's
// folded bias reads pe one element at a time).
void check_compress(const Case& c, int pe_shift = 0) {
  for (PhiKind kind : {PhiKind::mean, PhiKind::linear, PhiKind::mlp}) {
    Case ck = c;
    ck.phi = kind;
    const Config cfg = config_of(ck);
    LayerProblem p = make_problem(cfg, sizes_of(ck), 11);
    const int64_t rows = cmp_rows(p.T, cfg.cmp_stride);
    HostTensor xc(c.dtype, {rows, c.hkv, c.dqk});
    xc.poison();
    HostTensor xc_ref = to_f64(xc);
    HostTensor k64 = to_f64(p.k[0]);
    HostTensor phi64[5];
    for (int i = 0; i < 5; ++i) phi64[i] = to_f64(p.phi_k[i]);
    compress_fwd(ref_ctx(), cfg, LayerProblem::params(phi64), k64.view(), host_seqs(p), xc_ref.view());

    compress_on_device(ck, cfg, p, xc, pe_shift);
    const double u = unit_roundoff(c.dtype);
    EXPECT_TRUE(close(xc.values(), xc_ref.values(), [&](double w, size_t) { return 2 * u * std::fabs(w) + 1e-5; }))
        << "phi = " << phi_kind_name(kind);
  }
}

TEST_P(CudaForward, CompressMatchesReference) {
  NSA_REQUIRE_GPU();
  check_compress(GetParam());
}

// phi's bf16 products on mma.sync (PhiOnMmaSync, PhiOwnProducts) where the default runs the large
// ones on cuBLASLt and the others on wgmma (sm_90a).
TEST_P(CudaForward, CompressOnMmaSyncMatchesReference) {
  NSA_REQUIRE_GPU();
  const PhiOwnProducts own;
  const PhiOnMmaSync mma_sync;
  check_compress(GetParam());
}

// phi's large bf16 products on the library's own kernels (PhiOwnProducts: wgmma on sm_90a) where
// the default runs them on cuBLASLt.
TEST_P(CudaForward, CompressOnOwnProductsMatchesReference) {
  NSA_REQUIRE_GPU();
  const PhiOwnProducts own;
  check_compress(GetParam());
}

// phi's cuBLASLt plans (one per product shape: a new sequence length brings new ones) are kept up
// to blas::kMaxPlans; past that the cache starts over, and a shape seen before gets the bits it had.
TEST(CudaPhiBlas, PlanCacheStartsOverAndKeepsTheBits) {
  NSA_REQUIRE_GPU();
  auto run = [](int32_t T) {
    const Case c{"bf16_d64_mlp", DType::bf16, 64, 64, 2, 2, {T}, 32, 16, 64, 4, 1, 1, 64, PhiKind::mlp, false, 64};
    const Config cfg = config_of(c);
    LayerProblem p = make_problem(cfg, sizes_of(c), 13);
    HostTensor xc(c.dtype, {cmp_rows(p.T, cfg.cmp_stride), c.hkv, c.dqk});
    xc.poison();
    compress_on_device(c, cfg, p, xc);
    return xc;
  };
  HostTensor first = run(300);
  EXPECT_GT(nsa::cuda::phi::blas::cached_plans(), 0u) << "the case's products do not run on cuBLASLt";
  size_t most = 0;
  bool started_over = false;
  for (int32_t T = 316; T < 300 + 16 * 400 && !started_over; T += 16) {  // a new row count each time
    const size_t before = nsa::cuda::phi::blas::cached_plans();
    run(T);
    const size_t after = nsa::cuda::phi::blas::cached_plans();
    most = std::max(most, after);
    started_over = after < before;
  }
  EXPECT_TRUE(started_over) << "the cache never started over (" << most << " plans)";
  EXPECT_LE(most, nsa::cuda::phi::blas::kMaxPlans);
  HostTensor again = run(300);
  EXPECT_EQ(std::memcmp(first.data(), again.data(), size_t(first.numel()) * dtype_size(first.dtype())), 0)
      << "phi's output at T = 300 after the cache started over";
}

// pe off 16-byte alignment (a view one element into a buffer: contiguous, which is all the API
// asks of phi's parameters): the folded bias reads it one element at a time.
TEST_P(CudaForward, CompressWithUnalignedPeMatchesReference) {
  NSA_REQUIRE_GPU();
  check_compress(GetParam(), 1);
}

// Scales row t of each sequence of x ([rows, H, D], the sequences' rows packed as `lens` gives them)
// by 1 + rate t: keys whose scores rise along the sequence, so that an online softmax's running max
// moves by more than the forward's slack (kSoftmaxMaxSlack: 2^8) between chunks, where random keys
// of one size move it by a few units at most and only at the first chunk past the slack.
void scale_rows_rising(HostTensor& x, const std::vector<int64_t>& lens, double rate) {
  const int64_t per_row = x.shape()[1] * x.shape()[2];
  int64_t row = 0;
  for (int64_t len : lens)
    for (int64_t t = 0; t < len; ++t, ++row)
      for (int64_t e = 0; e < per_row; ++e) x.set(row * per_row + e, x.get(row * per_row + e) * (1.0 + rate * t));
}

// ---- compressed attention + scores ----------------------------------------------------------

// The compressed attention and the scores S (the compressed_attention_fwd stage op) against the
// reference; with rise > 0 each sequence's compressed keys scaled by 1 + rise r (row r of its
// blocks: scale_rows_rising).
void check_cmp_and_scores(const Case& c, double rise = 0) {
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 21);
  const int64_t T = p.T, rows = cmp_rows(T, cfg.cmp_stride);
  const int64_t ns = num_slc_blocks(max_seqlen(c), cfg.slc_block_len) + 3;  // wider than needed
  std::mt19937_64 rng(5);
  HostTensor kc(c.dtype, {rows, c.hkv, c.dqk}), vc(c.dtype, {rows, c.hkv, c.dv});
  kc.fill_uniform(rng, -1, 1);
  vc.fill_uniform(rng, -1, 1);
  // Rows that no sequence's compressed blocks use (one after most packed sequences, the tail of
  // the tensor) hold NaN: the kernels' TMA copies read whole 64-row boxes past a tile's keys, and
  // nothing from those rows may reach a result.
  {
    std::vector<bool> used(static_cast<size_t>(rows), false);
    int64_t start = 0;
    for (int32_t len : p.sizes.seqlens) {
      const int64_t r0 = cmp_row_offset(start, cfg.cmp_stride);
      for (int64_t r = r0; r < r0 + num_cmp_blocks(len, cfg.cmp_block_len, cfg.cmp_stride); ++r)
        used[static_cast<size_t>(r)] = true;
      start += len;
    }
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (int64_t r = 0; r < rows; ++r) {
      if (used[static_cast<size_t>(r)]) continue;
      for (int64_t e = 0; e < c.hkv * c.dqk; ++e) kc.set(r * c.hkv * c.dqk + e, nan);
      for (int64_t e = 0; e < c.hkv * c.dv; ++e) vc.set(r * c.hkv * c.dv + e, nan);
    }
  }
  if (rise > 0) {  // (a sequence's rows start at cmp_row_offset: gaps between them are the unused rows)
    std::vector<int64_t> lens;
    int64_t start = 0, next_row = 0;
    for (int32_t len : p.sizes.seqlens) {
      const int64_t r0 = cmp_row_offset(start, cfg.cmp_stride);
      lens.push_back(r0 - next_row);  // the unused rows before it (NaN: scaled, they stay NaN)
      const int64_t n = num_cmp_blocks(len, cfg.cmp_block_len, cfg.cmp_stride);
      lens.push_back(n);
      next_row = r0 + n;
      start += len;
    }
    lens.push_back(rows - next_row);
    scale_rows_rising(kc, lens, rise);
  }
  HostTensor o(c.dtype, {T, c.hq, c.dv}), lse(DType::f32, {T, c.hq}), s(DType::f32, {T, c.hkv, ns});
  o.poison();
  lse.poison();
  s.poison();
  HostTensor q64 = to_f64(p.q), kc64 = to_f64(kc), vc64 = to_f64(vc), o64 = to_f64(o);
  HostTensor lse_ref = lse, s_ref = s;
  compressed_attention_fwd(ref_ctx(), cfg, q64.view(), kc64.view(), vc64.view(), host_seqs(p), o64.view(),
                           lse_ref.view(), s_ref.view());

  DeviceSeqs ds(p, max_seqlen(c));
  DeviceTensor q(p.q), dkc(kc), dvc(vc), dout(o), dlse(lse), ds_(s);
  compressed_attention_fwd(cuda_ctx(), cfg, q.view(), dkc.view(), dvc.view(), ds.seqs, dout.view(), dlse.view(),
                           ds_.view());
  sync();
  dout.download(o);
  dlse.download(lse);
  ds_.download(s);
  EXPECT_TRUE(close(o.values(), o64.values(), attention_tol(c.dtype, 1.0)));
  EXPECT_TRUE(close(lse.values(), lse_ref.values(), lse_tol));
  EXPECT_TRUE(close(s.values(), s_ref.values(), score_tol));
}

TEST_P(CudaForward, CompressedAttentionAndScoresMatchReference) {
  NSA_REQUIRE_GPU();
  check_cmp_and_scores(GetParam());
}

// Compressed keys whose scores rise along the sequence (1 + r / 2 for a sequence's row r): pass 1's
// running max moves past the softmax's slack between chunks; again with the max following every
// chunk (SoftmaxMaxWithoutSlack).
TEST_P(CudaForward, CompressedAttentionWithRisingScoresMatchesReference) {
  NSA_REQUIRE_GPU();
  check_cmp_and_scores(GetParam(), 0.5);
  const SoftmaxMaxWithoutSlack no_slack;
  check_cmp_and_scores(GetParam(), 0.5);
}

// The score pass's ring accumulator (ScoresByRing) where the default writes each chunk's blocks
// from the chunk and a carry (l'/d dividing the chunk: every case but l' = 24, which runs the ring
// in both tests).
TEST_P(CudaForward, CompressedAttentionAndScoresByRingMatchReference) {
  NSA_REQUIRE_GPU();
  const ScoresByRing ring;
  check_cmp_and_scores(GetParam());
}

// The sm_90a score pass in both of its row tiles (64: 4 tokens at G = 16, one warpgroup; 128: two
// warpgroups sharing every K chunk), whichever its rule picks for the case.
TEST_P(CudaForward, CompressedAttentionAndScoresIn64RowTilesMatchReference) {
  NSA_REQUIRE_GPU();
  const ScoresTileRows rows(64);
  check_cmp_and_scores(GetParam());
}
TEST_P(CudaForward, CompressedAttentionAndScoresIn128RowTilesMatchReference) {
  NSA_REQUIRE_GPU();
  const ScoresTileRows rows(128);
  check_cmp_and_scores(GetParam());
}

// The score pass on sm_90a at G = 16 and 4 with the paper's blocks runs in groups of four 64-key
// chunks with the next chunk's products beside this chunk's sums, and the chunks after the last
// whole group one by one (cmp_scores_pass): the cases above have at most three chunks a tile, so
// these have more. T 5000: 311 keys (one group and a chunk); T 4112: 256 keys (exactly one group);
// T 4150: 258 keys (one group and a chunk of two keys); T 300: a short sequence beside them. Again
// with every chunk behind a CTA barrier (ScoresUnpipelined) and in 64-row tiles at G = 4, Dqk 128
// (the rule takes 128 rows there).
TEST(CudaForwardScores, ChunkGroupsMatchReference) {
  NSA_REQUIRE_GPU();
  const std::vector<Case> long_cases = {
      // name, dtype, Dqk, Dv, Hq, Hkv, seqlens, l, d, l', n, n_init, n_local, w, phi, shared_kv
      {"bf16_d128_G16_groups", DType::bf16, 128, 128, 16, 1, {5000, 4112}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mean, false},
      {"f16_d64_G4_groups", DType::f16, 64, 64, 8, 2, {4150, 300}, 32, 16, 64, 8, 1, 2, 256, PhiKind::mean, false},
      {"bf16_d128_G4_groups", DType::bf16, 128, 128, 4, 1, {4150}, 32, 16, 64, 8, 1, 2, 256, PhiKind::mean, false},
  };
  for (const Case& c : long_cases) {
    SCOPED_TRACE(c.name);
    const ScoresTileRows rows(64);
    check_cmp_and_scores(c);
    const ScoresUnpipelined unpipelined;
    check_cmp_and_scores(c);
  }
}

// ---- top-n on identical scores --------------------------------------------------------------

// select_topn on the GPU against the reference for scores s [T, Hkv, blocks]: the same indices
// (poisoned output first).
void expect_topn_matches_reference(const Case& c, const Config& cfg, LayerProblem& p, HostTensor& s) {
  HostTensor idx(DType::i32, {p.T, c.hkv, cfg.n_selected});
  idx.poison();
  HostTensor idx_ref = idx;
  select_topn(ref_ctx(), cfg, s.view(), host_seqs(p), idx_ref.view());
  DeviceSeqs ds(p, max_seqlen(c));
  DeviceTensor dsc(s), didx(idx);
  select_topn(cuda_ctx(), cfg, dsc.view(), ds.seqs, didx.view());
  sync();
  didx.download(idx);
  EXPECT_EQ(idx.values(), idx_ref.values());
}

// expect_topn_matches_reference on scores [T, Hkv, blocks] that fill(s, rng) writes, for the case's
// problem (seed problem_seed; n = 3 where the case selects nothing), rng seeded with score_seed.
template <typename Fill>
void expect_topn_on_scores(const Case& c, uint64_t problem_seed, uint64_t score_seed, Fill&& fill) {
  Config cfg = config_of(c);
  if (cfg.n_selected == 0) cfg.n_selected = 3;
  LayerProblem p = make_problem(cfg, sizes_of(c), problem_seed);
  const int64_t ns = num_slc_blocks(max_seqlen(c), cfg.slc_block_len);
  std::mt19937_64 rng(score_seed);
  HostTensor s(DType::f32, {p.T, c.hkv, ns});
  fill(s, rng);
  expect_topn_matches_reference(c, cfg, p, s);
}

TEST_P(CudaForward, TopnMatchesReferenceOnIdenticalScores) {
  NSA_REQUIRE_GPU();
  // Few distinct values: many exact ties, so the tie rule (smaller j first) decides often.
  expect_topn_on_scores(GetParam(), 31, 7, [](HostTensor& s, std::mt19937_64& rng) {
    std::uniform_int_distribution<int> level(0, 3);
    for (int64_t i = 0; i < s.numel(); ++i) s.set(i, 0.25 * level(rng));
  });
}

// NaN scores of every sign and payload (the positive quiet NaN, a negative one, the all-ones
// pattern, a signalling one) rank above every number, +inf included, and among themselves by the
// smaller block: the reference's order.
TEST_P(CudaForward, TopnRanksEveryNanFirstAsTheReference) {
  NSA_REQUIRE_GPU();
  expect_topn_on_scores(GetParam(), 37, 13, [](HostTensor& s, std::mt19937_64& rng) {
    s.fill_uniform(rng, -1, 1);
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0xffffffffu, 0x7f800001u};
    float* f = static_cast<float*>(s.data());
    std::uniform_int_distribution<int> pick(0, 9);
    for (int64_t i = 0; i < s.numel(); ++i) {
      const int r = pick(rng);
      if (r < 4) std::memcpy(&f[i], &nans[r], 4);
      else if (r == 4) f[i] = std::numeric_limits<float>::infinity();
    }
  });
}

// ---- selection branch on identical indices, window branch -----------------------------------

// The sizes of c's attention calls on `device` (what workspace_size asks for).
Problem attention_problem(const Case& c, const LayerProblem& p, Device device) {
  Problem pr;
  pr.total_tokens = p.T;
  pr.batch = static_cast<int64_t>(c.seqlens.size());
  pr.max_seqlen = max_seqlen(c);
  pr.hq = c.hq;
  pr.hkv = c.hkv;
  pr.dqk = c.dqk;
  pr.dv = c.dv;
  pr.dtype = c.dtype;
  pr.device = device;
  return pr;
}

// selected_attention_fwd on the GPU against the reference on index rows idx. union_ctas < 0: the
// union tiles off (the per-token kernel everywhere); else on (sm_90a, l' = 64: wherever a tile's
// union is small) with the union kernel's persistent grid capped at union_ctas CTAs (0: no cap).
void expect_selection_matches_reference(const Case& c, const Config& cfg, LayerProblem& p, HostTensor& idx,
                                        int union_ctas) {
  const bool union_tiles = union_ctas >= 0;
  HostTensor q64 = to_f64(p.q), k64 = to_f64(p.k[0]), v64 = to_f64(p.v[0]);
  HostTensor o(c.dtype, {p.T, c.hq, c.dv}), lse(DType::f32, {p.T, c.hq});
  o.poison();
  lse.poison();
  HostTensor o64 = to_f64(o), lse_ref = lse;
  selected_attention_fwd(ref_ctx(), cfg, q64.view(), k64.view(), v64.view(), idx.view(), host_seqs(p), o64.view(),
                         lse_ref.view());
  DeviceSeqs ds(p, max_seqlen(c));
  DeviceTensor q(p.q), k(p.k[0]), v(p.v[0]), didx(idx), dout(o), dlse(lse);
  const DeviceWorkspace ws(
      workspace_size(cuda_ctx(), Op::selected_attention_fwd, cfg, attention_problem(c, p, Device::cuda)));
  kernel_choices().slc_union_tiles = union_tiles;
  kernel_choices().slc_union_ctas = union_tiles ? union_ctas : 0;
  selected_attention_fwd(cuda_ctx(), cfg, q.view(), k.view(), v.view(), didx.view(), ds.seqs, dout.view(), dlse.view(),
                         ws.view());
  kernel_choices().slc_union_tiles = true;
  kernel_choices().slc_union_ctas = 0;
  sync();
  dout.download(o);
  dlse.download(lse);
  EXPECT_TRUE(close(o.values(), o64.values(), attention_tol(c.dtype, 1.0))) << "selection, union CTAs " << union_ctas;
  EXPECT_TRUE(close(lse.values(), lse_ref.values(), lse_tol)) << "selection, union CTAs " << union_ctas;
}

// Valid top-n rows (sorted, -1 padded) of random scores.
HostTensor random_topn_rows(const Case& c, const Config& cfg, LayerProblem& p, uint64_t seed) {
  const int64_t ns = num_slc_blocks(max_seqlen(c), cfg.slc_block_len);
  std::mt19937_64 rng(seed);
  HostTensor s(DType::f32, {p.T, c.hkv, ns});
  s.fill_uniform(rng, 0, 1);
  HostTensor idx(DType::i32, {p.T, c.hkv, cfg.n_selected});
  select_topn(ref_ctx(), cfg, s.view(), host_seqs(p), idx.view());
  return idx;
}

// The window branch (window_attention_fwd) on p's q, k[0], v[0] against the reference.
void expect_window_matches_reference(const Case& c, const Config& cfg, LayerProblem& p) {
  HostTensor q64 = to_f64(p.q), k64 = to_f64(p.k[0]), v64 = to_f64(p.v[0]);
  HostTensor o(c.dtype, {p.T, c.hq, c.dv}), lse(DType::f32, {p.T, c.hq});
  o.poison();
  lse.poison();
  HostTensor o64 = to_f64(o), lse_ref = lse;
  DeviceSeqs ds(p, max_seqlen(c));
  DeviceTensor q(p.q), k(p.k[0]), v(p.v[0]), dout(o), dlse(lse);
  window_attention_fwd(ref_ctx(), cfg, q64.view(), k64.view(), v64.view(), host_seqs(p), o64.view(), lse_ref.view());
  window_attention_fwd(cuda_ctx(), cfg, q.view(), k.view(), v.view(), ds.seqs, dout.view(), dlse.view());
  sync();
  dout.download(o);
  dlse.download(lse);
  EXPECT_TRUE(close(o.values(), o64.values(), attention_tol(c.dtype, 1.0))) << "window";
  EXPECT_TRUE(close(lse.values(), lse_ref.values(), lse_tol)) << "window";
}

// The case's config with both the selection and the window on (n 2, w 17 where the case has none).
Config selection_and_window_config(const Case& c) {
  Config cfg = config_of(c);
  if (cfg.n_selected == 0) cfg.n_selected = 2;
  if (cfg.window == 0) cfg.window = 17;
  return cfg;
}

TEST_P(CudaForward, SelectedAndWindowAttentionMatchReference) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = selection_and_window_config(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 41);
  HostTensor idx = random_topn_rows(c, cfg, p, 9);
  // The selection with both kernels (with the union tiles: every tile of these short sequences
  // whose union is small; again with one union CTA running all of them in turn), by whole blocks
  // where the sm_90a selection walks them and again 16 keys a step, then the window.
  for (const bool blocks : {true, false}) {
    std::optional<SelectionBy16KeySteps> by_16;
    if (!blocks) by_16.emplace();
    expect_selection_matches_reference(c, cfg, p, idx, 0);
    expect_selection_matches_reference(c, cfg, p, idx, 1);
    expect_selection_matches_reference(c, cfg, p, idx, -1);
  }
  expect_window_matches_reference(c, cfg, p);
}

// Keys whose scores rise along each sequence (scale_rows_rising; key t times 1 + t / 32 for the
// selection, 1 + t / 8 for the window's shorter reach): the selection's per-token kernels (by TMA,
// by whole blocks and 16 keys a step, and, without tensor maps, by cp.async), its union tiles and
// the window, each with the forward's slack and again with the max following every step
// (SoftmaxMaxWithoutSlack).
TEST_P(CudaForward, SelectedAndWindowAttentionWithRisingScoresMatchReference) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = selection_and_window_config(c);
  const std::vector<int64_t> lens(c.seqlens.begin(), c.seqlens.end());
  LayerProblem p = make_problem(cfg, sizes_of(c), 47);
  const HostTensor k_random = p.k[0];
  scale_rows_rising(p.k[0], lens, 1.0 / 32);
  HostTensor idx = random_topn_rows(c, cfg, p, 12);
  for (const bool slack : {true, false}) {
    std::optional<SoftmaxMaxWithoutSlack> no_slack;
    if (!slack) no_slack.emplace();
    expect_selection_matches_reference(c, cfg, p, idx, 0);
    expect_selection_matches_reference(c, cfg, p, idx, -1);
    {
      const SelectionBy16KeySteps by_16;
      expect_selection_matches_reference(c, cfg, p, idx, -1);
    }
    {
      const NoTensorMaps no_tma;
      expect_selection_matches_reference(c, cfg, p, idx, -1);
    }
  }
  p.k[0] = k_random;
  scale_rows_rising(p.k[0], lens, 1.0 / 8);
  expect_window_matches_reference(c, cfg, p);
  const SoftmaxMaxWithoutSlack no_slack;
  expect_window_matches_reference(c, cfg, p);
}

// A row of indices is a set (api.h): order, repeats and where the -1 padding sits do not matter.
// Rows here are the top-n rows reversed (padding first, blocks descending) with the first block
// repeated in the last place; the reference reads the same rows.
TEST_P(CudaForward, SelectedAttentionTreatsIndicesAsASet) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  Config cfg = config_of(c);
  if (cfg.n_selected < 3) cfg.n_selected = 3;
  LayerProblem p = make_problem(cfg, sizes_of(c), 43);
  const int64_t n = cfg.n_selected;
  HostTensor sorted = random_topn_rows(c, cfg, p, 10);
  HostTensor idx(DType::i32, {p.T, c.hkv, n});
  int64_t rows_with_repeat = 0;
  for (int64_t r = 0; r < p.T * c.hkv; ++r) {
    for (int64_t k = 0; k < n; ++k) idx.set(r * n + k, sorted.get(r * n + (n - 1 - k)));
    if (sorted.get(r * n + 1) >= 0) {  // two blocks or more: repeat one of them
      idx.set(r * n + n - 1, idx.get(r * n + 0));
      ++rows_with_repeat;
    }
  }
  if (rows_with_repeat == 0) GTEST_SKIP() << "no row selects two blocks: nothing to repeat";
  expect_selection_matches_reference(c, cfg, p, idx, 0);
  expect_selection_matches_reference(c, cfg, p, idx, -1);
}

// Union tiles and per-token tiles in one call: G = 1 and l' = 64, so a tile is 64 tokens; random
// scores give the tiles of the first ~4000 tokens (at most 64 blocks to pick from) a union the
// union-tile kernel takes, and most later tiles a larger one, left to the per-token kernel. Two
// sequences, the second short. Both must match the reference, with the per-token tiles by whole
// blocks (on sm_90a: each CTA counts its tile's union itself) and 16 keys a step.
TEST(CudaForwardSelection, UnionAndPerTokenTilesInOneCall) {
  NSA_REQUIRE_GPU();
  Case c{"x", DType::bf16, 128, 128, 2, 2, {6500, 300}, 32, 16, 64, 16, 1, 2, 64, PhiKind::mean, false};
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 47);
  HostTensor idx = random_topn_rows(c, cfg, p, 12);
  for (const bool blocks : {true, false}) {
    std::optional<SelectionBy16KeySteps> by_16;
    if (!blocks) by_16.emplace();
    expect_selection_matches_reference(c, cfg, p, idx, 0);
    expect_selection_matches_reference(c, cfg, p, idx, 3);  // a CTA runs tiles of both sequences in turn
  }
}

// ---- whole forward ----------------------------------------------------------------------------

// Device copies of p's forward inputs (q, g, the K/V sets, phi's parameters, the offsets) and
// their Inputs. v_pe_shift: phi_v's pe that many elements off its allocation (DeviceTensor).
struct DeviceInputs {
  DeviceSeqs ds;
  DeviceTensor q, g, k[3], v[3], phk[5], phv[5];
  Inputs in;

  DeviceInputs(const Case& c, const Config& cfg, LayerProblem& p, int v_pe_shift = 0)
      : ds(p, max_seqlen(c)), q(p.q), g(p.g) {
    for (int b = 0; b < (cfg.shared_kv ? 1 : 3); ++b) {
      k[b] = DeviceTensor(p.k[b]);
      v[b] = DeviceTensor(p.v[b]);
    }
    for (int i = 0; i < 5; ++i) {
      phk[i] = DeviceTensor(p.phi_k[i]);
      phv[i] = DeviceTensor(p.phi_v[i], i == 4 ? v_pe_shift : 0);
    }
    in.q = q.view();
    for (int b = 0; b < 3; ++b) in.kv[b] = KV{k[b].view(), v[b].view()};
    in.g = g.view();
    in.phi_k = PhiParams{phk[0].view(), phk[1].view(), phk[2].view(), phk[3].view(), phk[4].view()};
    in.phi_v = PhiParams{phv[0].view(), phv[1].view(), phv[2].view(), phv[3].view(), phv[4].view()};
    in.seqs = ds.seqs;
  }
};

// The CUDA forward of p (its inputs on the device, a workspace poisoned with the NaN pattern):
// o, lse, indices and o_branch of p downloaded from the GPU. With o_cmp (a [T, Hq, Dv] tensor of
// p's storage type): the forward writes the compressed branch's output there instead of o_branch,
// and with o_win as well the window branch's. v_pe_shift: as DeviceInputs.
void run_cuda_forward(const Case& c, const Config& cfg, LayerProblem& p, HostTensor* o_cmp = nullptr,
                      int v_pe_shift = 0, HostTensor* o_win = nullptr) {
  const DeviceInputs dev(c, cfg, p, v_pe_shift);
  const Inputs& in = dev.in;
  DeviceTensor o(p.o), lse(p.lse), idx(p.indices), ob(p.o_branch), oc, ow;  // poisoned
  if (o_cmp) oc = DeviceTensor(*o_cmp);
  if (o_win) ow = DeviceTensor(*o_win);
  const ForwardOutputs out{o.view(), lse.view(), idx.view(), o_cmp ? TensorView{} : ob.view(),
                           o_cmp ? oc.view() : TensorView{}, o_win ? ow.view() : TensorView{}};
  const DeviceWorkspace ws(workspace_size(cuda_ctx(), Op::forward, cfg, problem_of(cfg, in)));  // NaN pattern
  forward(cuda_ctx(), cfg, in, out, ws.view());
  sync();
  o.download(p.o);
  lse.download(p.lse);
  idx.download(p.indices);
  if (o_cmp)
    oc.download(*o_cmp);
  else
    ob.download(p.o_branch);
  if (o_win) ow.download(*o_win);
}

// The whole CUDA forward against the reference pipeline, stage by stage in fp64.
void check_forward_pipeline(const Case& c) {
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 51);
  const int64_t T = p.T, rows = cmp_rows(T, cfg.cmp_stride);
  const int64_t ns = num_slc_blocks(max_seqlen(c), cfg.slc_block_len);
  const int nkv = cfg.shared_kv ? 1 : 3;

  // Reference, stage by stage in fp64, storing kc/vc in the storage type as any same-precision
  // implementation does (the compressed branch and S then see the same keys as the GPU).
  HostTensor q64 = to_f64(p.q), g64 = to_f64(p.g), k64[3], v64[3], pk[5], pv[5];
  for (int b = 0; b < nkv; ++b) {
    k64[b] = to_f64(p.k[b]);
    v64[b] = to_f64(p.v[b]);
  }
  for (int i = 0; i < 5; ++i) {
    pk[i] = to_f64(p.phi_k[i]);
    pv[i] = to_f64(p.phi_v[i]);
  }
  HostTensor kc(DType::f64, {rows, c.hkv, c.dqk}), vc(DType::f64, {rows, c.hkv, c.dv});
  compress_fwd(ref_ctx(), cfg, LayerProblem::params(pk), k64[0].view(), host_seqs(p), kc.view());
  compress_fwd(ref_ctx(), cfg, LayerProblem::params(pv), v64[0].view(), host_seqs(p), vc.view());
  kc = rounded(kc, c.dtype);
  vc = rounded(vc, c.dtype);
  double vmax[3] = {max_abs(vc.values()), 1.0, 1.0};
  HostTensor ob_ref[3], lse_ref[3];
  for (int b = 0; b < 3; ++b) {
    ob_ref[b] = HostTensor(DType::f64, {T, c.hq, c.dv});
    lse_ref[b] = HostTensor(DType::f32, {T, c.hq});
  }
  HostTensor s_ref(DType::f32, {T, c.hkv, std::max<int64_t>(ns, 1)});
  compressed_attention_fwd(ref_ctx(), cfg, q64.view(), kc.view(), vc.view(), host_seqs(p), ob_ref[0].view(),
                           lse_ref[0].view(), s_ref.view());
  HostTensor idx_ref(DType::i32, {T, c.hkv, cfg.n_selected});
  select_topn(ref_ctx(), cfg, s_ref.view(), host_seqs(p), idx_ref.view());
  const int bs = cfg.shared_kv ? 0 : 1, bw = cfg.shared_kv ? 0 : 2;
  selected_attention_fwd(ref_ctx(), cfg, q64.view(), k64[bs].view(), v64[bs].view(), idx_ref.view(), host_seqs(p),
                         ob_ref[1].view(), lse_ref[1].view());
  window_attention_fwd(ref_ctx(), cfg, q64.view(), k64[bw].view(), v64[bw].view(), host_seqs(p), ob_ref[2].view(),
                       lse_ref[2].view());

  run_cuda_forward(c, cfg, p);  // o, lse, indices and o_branch of p, from the GPU

  // Rows (t, hk) whose selected blocks agree with the reference's.
  const int64_t n = cfg.n_selected, G = c.hq / c.hkv;
  const std::vector<double> got_idx = p.indices.values(), want_idx = idx_ref.values();
  std::vector<bool> agree(static_cast<size_t>(T * c.hq));
  int64_t agreeing = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hk = 0; hk < c.hkv; ++hk) {
      bool same = true;
      for (int64_t e = 0; e < n; ++e) same &= got_idx[(t * c.hkv + hk) * n + e] == want_idx[(t * c.hkv + hk) * n + e];
      agreeing += same;
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) agree[t * c.hq + h] = same;
    }
  EXPECT_GE(agreeing, (T * c.hkv * 99) / 100) << "selected blocks differ from the reference on too many rows";
  EXPECT_TRUE(std::none_of(got_idx.begin(), got_idx.end(), [](double x) { return x == -7777; })) << "unwritten index";

  // Per-row masks over [T, Hq, Dv] and [T, Hq, 3].
  std::vector<bool> mask_o(static_cast<size_t>(T * c.hq * c.dv)), mask_lse(static_cast<size_t>(T * c.hq * 3));
  for (size_t i = 0; i < mask_o.size(); ++i) mask_o[i] = agree[i / static_cast<size_t>(c.dv)];
  const std::vector<double> got_ob = p.o_branch.values(), got_lse = p.lse.values(), got_o = p.o.values();
  const size_t per_branch = static_cast<size_t>(T * c.hq * c.dv);
  for (int b = 0; b < 3; ++b) {
    std::vector<double> got(got_ob.begin() + b * per_branch, got_ob.begin() + (b + 1) * per_branch);
    std::vector<double> got_l(static_cast<size_t>(T * c.hq));
    for (size_t i = 0; i < got_l.size(); ++i) got_l[i] = got_lse[i * 3 + b];
    const std::vector<bool>* m = b == 1 ? &mask_o : nullptr;
    std::vector<bool> mask_rows(agree);
    EXPECT_TRUE(close(got, ob_ref[b].values(), attention_tol(c.dtype, vmax[b]), m)) << "o_branch[" << b << "]";
    EXPECT_TRUE(close(got_l, lse_ref[b].values(), lse_tol, b == 1 ? &mask_rows : nullptr)) << "lse[" << b << "]";
  }
  // o = sum_b g_b o_b; a plain implementation rounds each o_b and the sum.
  std::vector<double> o_ref(per_branch);
  const std::vector<double> gv = g64.values();
  std::vector<double> ref_b[3] = {ob_ref[0].values(), ob_ref[1].values(), ob_ref[2].values()};
  for (size_t i = 0; i < per_branch; ++i) {
    const size_t row = i / static_cast<size_t>(c.dv);
    o_ref[i] = gv[row * 3] * ref_b[0][i] + gv[row * 3 + 1] * ref_b[1][i] + gv[row * 3 + 2] * ref_b[2][i];
  }
  const double u = unit_roundoff(c.dtype), vsum = vmax[0] + vmax[1] + vmax[2];
  EXPECT_TRUE(close(got_o, o_ref, [&](double w, size_t) { return 2 * u * (2 * std::fabs(w) + vsum) + 1e-6; }, &mask_o))
      << "o";
}

TEST_P(CudaForward, ForwardMatchesReferencePipeline) {
  NSA_REQUIRE_GPU();
  check_forward_pipeline(GetParam());
}

// The same with no tensor maps (CudaKernelChoices::tma = false): the sm_90a kernels copy their
// K/V tiles by cp.async, as they do where a map cannot be encoded (the 192-row pass 1, the S
// pass's and the window's cp.async loops). Elsewhere the same kernels run as above.
TEST_P(CudaForward, ForwardWithoutTmaMatchesReferencePipeline) {
  NSA_REQUIRE_GPU();
  const NoTensorMaps no_tma;
  check_forward_pipeline(GetParam());
}

// The same with the sm_90a selection 16 keys a step where it would walk whole blocks
// (SelectionBy16KeySteps; elsewhere the same kernels as above).
TEST_P(CudaForward, ForwardBy16KeySelectionStepsMatchesReferencePipeline) {
  NSA_REQUIRE_GPU();
  const SelectionBy16KeySteps by_16;
  check_forward_pipeline(GetParam());
}

// The same with the gated combine in the window kernel after the selection (CombineInWindow), the
// order without a selection branch: elsewhere the selection kernels form it after the window.
TEST_P(CudaForward, ForwardWithCombineInWindowMatchesReferencePipeline) {
  NSA_REQUIRE_GPU();
  const CombineInWindow in_window;
  check_forward_pipeline(GetParam());
}

// The sm_90a window in both of its chunk sizes whatever its rule picks for the case: 64 keys, and
// 112 (five chunks a tile at w = 512 and G = 16, where 64-key chunks take nine; elsewhere the
// 112-key kernel runs where tensor maps can be made at Dqk, Dv <= 128, else 64): the window branch
// on random keys and on keys whose scores rise (the online softmax's rescales), then the forward
// with the gated combine in the window kernel (its staged epilogue after a 112-key ring).
TEST_P(CudaForward, WindowInEachChunkSizeMatchesReference) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = selection_and_window_config(c);
  const std::vector<int64_t> lens(c.seqlens.begin(), c.seqlens.end());
  for (const int keys : {64, 112}) {
    SCOPED_TRACE(keys);
    const WindowChunkKeys chunk(keys);
    LayerProblem p = make_problem(cfg, sizes_of(c), 43);
    expect_window_matches_reference(c, cfg, p);
    scale_rows_rising(p.k[0], lens, 1.0 / 8);
    expect_window_matches_reference(c, cfg, p);
    const CombineInWindow in_window;
    check_forward_pipeline(c);
  }
}

// The compressed branch's output kept alone (ForwardOutputs::o_cmp), then with the window's
// (o_win, as the torch layer keeps them for the backward), is o_branch's first (and third) plane
// bit for bit, and o, lse and indices are unchanged.
TEST_P(CudaForward, CompressedAndWindowOutputsAreTheirBranchOutputs) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = config_of(c);
  LayerProblem with_ob = make_problem(cfg, sizes_of(c), 71);
  run_cuda_forward(c, cfg, with_ob);
  const std::vector<double> ob = with_ob.o_branch.values();
  auto same_plane = [&](const HostTensor& got_t, int plane) {
    const std::vector<double> got = got_t.values();
    EXPECT_EQ(got.size() * 3, ob.size());
    size_t differ = 0;
    for (size_t i = 0; i < got.size() && i + plane * got.size() < ob.size(); ++i) {
      const double want = ob[i + plane * got.size()];
      differ += !(got[i] == want || (std::isnan(got[i]) && std::isnan(want)));
    }
    return differ;
  };
  for (bool win : {false, true}) {
    SCOPED_TRACE(win ? "o_cmp and o_win" : "o_cmp");
    LayerProblem with_oc = make_problem(cfg, sizes_of(c), 71);
    HostTensor oc(with_oc.o.dtype(), with_oc.o.shape()), ow(with_oc.o.dtype(), with_oc.o.shape());
    oc.poison();  // as o_branch was
    ow.poison();
    run_cuda_forward(c, cfg, with_oc, &oc, 0, win ? &ow : nullptr);
    EXPECT_EQ(same_plane(oc, 0), 0u) << "o_cmp against o_branch[0]";
    if (win) EXPECT_EQ(same_plane(ow, 2), 0u) << "o_win against o_branch[2]";
    EXPECT_TRUE(same_outside_rows(with_oc.o, with_ob.o, 0, 0)) << "o";
    EXPECT_TRUE(same_outside_rows(with_oc.lse, with_ob.lse, 0, 0)) << "lse";
    EXPECT_TRUE(same_outside_rows(with_oc.indices, with_ob.indices, 0, 0)) << "indices";
  }
}

// The L2 prefetches (the combining kernel's of its combine's reads: o_cmp, the other branch's output,
// the gates; the window's of a later CTA's Q tile) change no value: o, lse, indices and every branch output are the bits of a forward
// without them (NoCombinePrefetch, NoNextQPrefetch).
TEST_P(CudaForward, PrefetchesGiveTheBitsWithoutThem) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = config_of(c);
  LayerProblem with = make_problem(cfg, sizes_of(c), 79), without = make_problem(cfg, sizes_of(c), 79);
  run_cuda_forward(c, cfg, with);
  {
    const NoCombinePrefetch no_combine;
    const NoNextQPrefetch no_next_q;
    run_cuda_forward(c, cfg, without);
  }
  EXPECT_TRUE(same_outside_rows(with.o, without.o, 0, 0)) << "o";
  EXPECT_TRUE(same_outside_rows(with.lse, without.lse, 0, 0)) << "lse";
  EXPECT_TRUE(same_outside_rows(with.indices, without.indices, 0, 0)) << "indices";
  EXPECT_TRUE(same_outside_rows(with.o_branch, without.o_branch, 0, 0)) << "o_branch";
}

// phi of k and of v as the two batches of one launch per product (the default where both have the
// same shapes and path: phi = linear or mlp) give the bits of their launches one at a time
// (SeparatePhis): o, lse, indices and every branch output; also with v's pe off 16 bytes (its
// folded bias read one element at a time, k's in 16-byte runs).
TEST_P(CudaForward, PairedPhisGiveTheBitsOfSeparateOnes) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = config_of(c);
  for (int v_pe_shift : {0, 1}) {
    LayerProblem paired = make_problem(cfg, sizes_of(c), 73), separate = make_problem(cfg, sizes_of(c), 73);
    run_cuda_forward(c, cfg, paired, nullptr, v_pe_shift);
    {
      const SeparatePhis one_at_a_time;
      run_cuda_forward(c, cfg, separate, nullptr, v_pe_shift);
    }
    EXPECT_TRUE(same_outside_rows(paired.o, separate.o, 0, 0)) << "o, v's pe shifted by " << v_pe_shift;
    EXPECT_TRUE(same_outside_rows(paired.lse, separate.lse, 0, 0)) << "lse, v's pe shifted by " << v_pe_shift;
    EXPECT_TRUE(same_outside_rows(paired.indices, separate.indices, 0, 0)) << "indices, v's pe shifted by " << v_pe_shift;
    EXPECT_TRUE(same_outside_rows(paired.o_branch, separate.o_branch, 0, 0)) << "o_branch, v's pe shifted by "
                                                                             << v_pe_shift;
  }
}

// The forward captured in a CUDA graph on the caller's stream (after one eager call there, which
// makes phi's cuBLASLt handle and plans) and replayed, its outputs poisoned first, gives the eager
// call's bits: o, lse, indices, o_branch. A host synchronisation, a pageable copy or a host read of
// device data inside the call would fail the capture.
TEST_P(CudaForward, ReplayOfACapturedForwardGivesTheEagerBits) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 89);
  const DeviceInputs dev_in(c, cfg, p);
  const Inputs& in = dev_in.in;
  DeviceTensor o(p.o), lse(p.lse), idx(p.indices), ob(p.o_branch);
  const ForwardOutputs out{o.view(), lse.view(), idx.view(), ob.view(), TensorView{}, TensorView{}};
  cudaStream_t stream;
  NSA_TEST_CUDA(cudaStreamCreate(&stream));
  Context ctx = cuda_ctx();
  ctx.stream = stream;
  const DeviceWorkspace ws(workspace_size(ctx, Op::forward, cfg, problem_of(cfg, in)));
  forward(ctx, cfg, in, out, ws.view());
  NSA_TEST_CUDA(cudaStreamSynchronize(stream));
  HostTensor eager[4] = {p.o, p.lse, p.indices, p.o_branch};
  const DeviceTensor* dev[4] = {&o, &lse, &idx, &ob};
  for (int i = 0; i < 4; ++i) dev[i]->download(eager[i]);

  const std::string failed = capture_and_replay(stream, [&] { forward(ctx, cfg, in, out, ws.view()); }, [&] {
    for (const DeviceTensor* d : dev)
      if (const cudaError_t e = d->poison(stream); e != cudaSuccess) return e;
    return cudaSuccess;
  });
  ASSERT_TRUE(failed.empty()) << "the forward's capture and replay: " << failed;
  const char* names[4] = {"o", "lse", "indices", "o_branch"};
  for (int i = 0; i < 4; ++i) {
    HostTensor replayed = eager[i];
    dev[i]->download(replayed);
    EXPECT_EQ(std::memcmp(replayed.data(), eager[i].data(), eager[i].numel() * dtype_size(eager[i].dtype())), 0)
        << names[i] << " of the replay";
  }
  cudaStreamDestroy(stream);
}

// The sequences of a packed batch do not see each other: with every input row of one sequence
// NaN (q, the gates, k and v of every branch), every output row of the others is bit for bit what
// it was. The kernels read whole tiles of keys (a TMA box, 64 or 128 rows), so rows of the next
// sequence, or the compressed row no sequence uses, land in shared memory past a tile's keys; they
// must be masked or zeroed, since a zero probability times NaN is NaN.
TEST_P(CudaForward, SequencesAreIsolated) {
  NSA_REQUIRE_GPU();
  const Case& c = GetParam();
  if (c.seqlens.size() < 2) GTEST_SKIP() << "one sequence";
  const Config cfg = config_of(c);
  // The selection by whole blocks where the sm_90a walk takes them, again 16 keys a step, and by
  // whole blocks without the union tiles (which take most tiles of these short sequences, those at
  // their ends included: the per-token walks' last boxes reach into the next sequence).
  for (const int walk_kind : {0, 1, 2}) {
    std::optional<SelectionBy16KeySteps> by_16;
    std::optional<NoSelectionUnionTiles> per_token;
    if (walk_kind == 1) by_16.emplace();
    if (walk_kind == 2) per_token.emplace();
    SCOPED_TRACE(walk_kind == 0   ? "selection by blocks"
                 : walk_kind == 1 ? "selection by 16-key steps"
                                  : "selection by blocks without union tiles");
    LayerProblem clean = make_problem(cfg, sizes_of(c), 61);
    run_cuda_forward(c, cfg, clean);
    int64_t r0 = 0;
    for (int32_t len : c.seqlens) {
      const int64_t r1 = r0 + len;
      if (len > 0) {
        LayerProblem p = make_problem(cfg, sizes_of(c), 61);  // the same inputs
        poison_rows(p.q, r0, r1);
        poison_rows(p.g, r0, r1);
        for (int b = 0; b < 3; ++b) {
          poison_rows(p.k[b], r0, r1);
          poison_rows(p.v[b], r0, r1);
        }
        run_cuda_forward(c, cfg, p);
        EXPECT_TRUE(same_outside_rows(p.o, clean.o, r0, r1)) << "o, sequence at rows " << r0 << ".." << r1;
        EXPECT_TRUE(same_outside_rows(p.lse, clean.lse, r0, r1)) << "lse, sequence at rows " << r0 << ".." << r1;
        EXPECT_TRUE(same_outside_rows(p.indices, clean.indices, r0, r1)) << "indices, sequence at rows " << r0;
        EXPECT_TRUE(same_outside_rows(p.o_branch, clean.o_branch, r0, r1, 1)) << "o_branch, sequence at rows " << r0;
      }
      r0 = r1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaForward, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Drawn cases (cases.h), through every test of the suite.
INSTANTIATE_TEST_SUITE_P(Random, CudaForward, ::testing::ValuesIn(random_attention_cases(1)),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Top-n where most picks come from the columns of one lane of the kernel's warp (j = 7 mod 32):
// rows of 563 blocks (l' = 16, T = 9000, n = 24) whose largest scores all sit in those columns,
// with ties among them (the tie rule and the forced blocks as everywhere). With the other columns
// uniform below them, few columns reach the floor of the lanes' best keys and the candidates pick
// (common/topn_row.cuh). With two more lanes above the rest (j = 19, 27 mod 32), more columns reach
// the floor than the candidate scratch holds: the rounds over per-lane lists pick, and the lane of
// j = 7 wins more rounds than its list holds and must go back to its columns. Must match the
// reference either way.
TEST(CudaForwardTopn, PicksConcentratedInOneLaneMatchReference) {
  NSA_REQUIRE_GPU();
  Case c{"x", DType::bf16, 64, 64, 2, 2, {9000, 700}, 32, 16, 16, 24, 1, 1, 64, PhiKind::mean, false};
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 5);
  const int64_t ns = num_slc_blocks(max_seqlen(c), cfg.slc_block_len);
  for (bool more_lanes : {false, true}) {
    SCOPED_TRACE(more_lanes ? "lanes 7, 19, 27" : "lane 7");
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<double> small(0.0, 1.0);
    HostTensor s(DType::f32, {p.T, c.hkv, ns});
    for (int64_t i = 0; i < s.numel(); ++i) {
      const int64_t j = i % ns;
      const bool second = more_lanes && (j % 32 == 19 || j % 32 == 27);
      s.set(i, j % 32 == 7 ? 3.0 + 0.25 * double((j / 32) % 3) : second ? 2.0 + 0.5 * small(rng) : small(rng));
    }
    expect_topn_matches_reference(c, cfg, p, s);
  }
}

// ---- errors -----------------------------------------------------------------------------------

TEST(CudaForwardErrors, UnsupportedShapesNameTheValue) {
  NSA_REQUIRE_GPU();
  Config cfg;
  cfg.window = 16;
  cfg.n_selected = 2;
  cfg.n_local = 1;
  cfg.phi = PhiKind::mean;
  for (auto [dqk, hq, what] : {std::tuple{96, 2, "Dqk"}, std::tuple{64, 3, "G = Hq / Hkv"}}) {
    Case c{"x", DType::bf16, dqk, 64, hq, 1, {40}, 32, 16, 64, 2, 1, 1, 16, PhiKind::mean, false};
    LayerProblem p = make_problem(cfg, sizes_of(c), 1);
    DeviceTensor q(p.q), k(p.k[0]), v(p.v[0]), o(p.o);
    HostTensor oo(DType::bf16, {p.T, hq, 64});
    DeviceTensor out(oo);
    Sequences s;
    try {
      window_attention_fwd(cuda_ctx(), cfg, q.view(), k.view(), v.view(), s, out.view(), TensorView());
      ADD_FAILURE() << "expected an error for " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.parameter(), what) << e.what();
    }
  }
}

// With l' = 64 the CUDA selection keeps its union-tile list in the workspace (slc_attention.cuh):
// workspace_size says how much, and a call without it is an error naming the workspace.
TEST(CudaForwardErrors, SelectionWithoutItsWorkspaceNamesTheWorkspace) {
  NSA_REQUIRE_GPU();
  Case c{"x", DType::bf16, 64, 64, 4, 1, {300, 40}, 32, 16, 64, 4, 1, 1, 16, PhiKind::mean, false};
  const Config cfg = config_of(c);
  LayerProblem p = make_problem(cfg, sizes_of(c), 1);
  const Problem pr = attention_problem(c, p, Device::cuda);
  // The count, then one entry per (tile with tokens, KV head): 64 / G = 16 tokens a tile.
  EXPECT_GE(workspace_size(cuda_ctx(), Op::selected_attention_fwd, cfg, pr), sizeof(int32_t) * (1 + 19 + 3));
  Config other = cfg;
  other.slc_block_len = 32;
  EXPECT_EQ(workspace_size(cuda_ctx(), Op::selected_attention_fwd, other, pr), 0u);
  DeviceSeqs ds(p, max_seqlen(c));
  HostTensor idx = random_topn_rows(c, cfg, p, 5);
  HostTensor oo(DType::bf16, {p.T, c.hq, c.dv});
  DeviceTensor q(p.q), k(p.k[0]), v(p.v[0]), di(idx), out(oo);
  try {
    selected_attention_fwd(cuda_ctx(), cfg, q.view(), k.view(), v.view(), di.view(), ds.seqs, out.view(), TensorView());
    ADD_FAILURE() << "expected an error for the missing workspace";
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), "workspace.bytes") << e.what();
  }
}

// The selection kernel sorts each warp's (16 / G) * n picks in shared memory: an n too large for
// it is an error naming n, not a launch failure or a silent truncation.
TEST(CudaForwardErrors, SelectionTooManyBlocksNamesN) {
  NSA_REQUIRE_GPU();
  Config cfg;
  cfg.window = 16;
  cfg.n_selected = 8192;
  cfg.n_local = 1;
  cfg.phi = PhiKind::mean;
  Case c{"x", DType::bf16, 64, 64, 1, 1, {40}, 32, 16, 64, 8192, 1, 1, 16, PhiKind::mean, false};
  LayerProblem p = make_problem(cfg, sizes_of(c), 1);
  DeviceTensor q(p.q), k(p.k[0]), v(p.v[0]);
  HostTensor idx(DType::i32, {p.T, 1, cfg.n_selected});
  for (int64_t i = 0; i < idx.numel(); ++i) idx.set(i, -1);
  HostTensor oo(DType::bf16, {p.T, 1, 64});
  DeviceTensor di(idx), out(oo);
  const DeviceWorkspace ws(
      workspace_size(cuda_ctx(), Op::selected_attention_fwd, cfg, attention_problem(c, p, Device::cuda)));
  try {
    selected_attention_fwd(cuda_ctx(), cfg, q.view(), k.view(), v.view(), di.view(), Sequences(), out.view(),
                           TensorView(), ws.view());
    ADD_FAILURE() << "expected an error for n_selected = 8192";
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), "n_selected (n)") << e.what();
  }
}

}  // namespace
