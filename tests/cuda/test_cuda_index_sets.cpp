// Caller-provided selection indices on the CUDA backward: a row of indices is a set (api.h). The
// same blocks with repeats in place of the -1 padding, in another order, must give the reference
// gradients of the plain row: a repeated block adds nothing to dq, dk, dv or dg.
//
// The saved lse and indices come from the reference forward in fp64; only the padding of each row
// is rewritten (every -1 becomes a copy of one of the row's blocks) and the row is shuffled, so the
// set of blocks, and with it lse, is unchanged. n is larger than the blocks a short sequence has,
// so most rows have padding to rewrite. Tolerance as tests/cuda/test_cuda_backward.cpp: twice a
// plain same-precision backward's error, 2 u (|x| + max|x|) + 1e-6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cases.h"
#include "cuda_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

void copy_values(const HostTensor& from, HostTensor& to) {
  for (int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
}

// Rows of indices [T, Hkv, n] with each -1 replaced by a repeat of one of the row's blocks, and
// the row shuffled. Returns how many entries became repeats.
int64_t repeat_padding(HostTensor& idx, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t n = idx.shape()[2], rows = idx.numel() / std::max<int64_t>(n, 1);
  int64_t repeats = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> row(static_cast<size_t>(n)), blocks;
    for (int64_t k = 0; k < n; ++k) {
      row[static_cast<size_t>(k)] = static_cast<int32_t>(idx.get(r * n + k));
      if (row[static_cast<size_t>(k)] >= 0) blocks.push_back(row[static_cast<size_t>(k)]);
    }
    if (blocks.empty()) continue;
    for (int32_t& v : row)
      if (v < 0) {
        v = blocks[rng() % blocks.size()];
        ++repeats;
      }
    std::shuffle(row.begin(), row.end(), rng);
    for (int64_t k = 0; k < n; ++k) idx.set(r * n + k, row[static_cast<size_t>(k)]);
  }
  return repeats;
}

class CudaIndexSets : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CudaIndexSets, RepeatedBlocksAddNothingToTheGradients) {
  NSA_REQUIRE_GPU();
  const AttentionCase& c = GetParam();
  const Config cfg = config_of(c);
  Sizes s = sizes_of(c);
  LayerProblem low = make_problem(cfg, s, 7);
  s.dtype = DType::f64;
  LayerProblem ref = make_problem(cfg, s, 7);
  copy_values(low.q, ref.q);
  copy_values(low.g, ref.g);
  copy_values(low.d_o, ref.d_o);
  for (int b = 0; b < 3; ++b) {
    copy_values(low.k[b], ref.k[b]);
    copy_values(low.v[b], ref.v[b]);
  }
  // The saved state of the reference forward, and the reference gradients of the plain rows.
  forward(cuda_context(Backend::reference), cfg, ref.inputs(), ref.outputs());
  backward(cuda_context(Backend::reference), cfg, ref.inputs(), ref.outputs(), ref.d_o.view(), ref.gradients());
  copy_values(ref.lse, low.lse);
  HostTensor dup = ref.indices;
  ASSERT_GT(repeat_padding(dup, 11), 0) << "no row had padding to turn into repeats";
  {  // the reference itself treats the rows as sets
    LayerProblem again = ref;
    again.indices = dup;
    backward(cuda_context(Backend::reference), cfg, again.inputs(), again.outputs(), again.d_o.view(), again.gradients());
    EXPECT_EQ(max_abs_diff(again.dq.values(), ref.dq.values()), 0.0);
    EXPECT_EQ(max_abs_diff(again.dk[c.shared_kv ? 0 : 1].values(), ref.dk[c.shared_kv ? 0 : 1].values()), 0.0);
  }

  // The CUDA backward with the repeated rows.
  DeviceTensor q(low.q), g(low.g), d_o(low.d_o), lse(low.lse), indices(dup), cu(low.cu);
  DeviceTensor k[3], v[3], dk[3], dv[3];
  DeviceTensor dq(low.dq), dg(low.dg);  // poisoned by make_problem
  Inputs in;
  Gradients grads;
  for (int b = 0; b < 3; ++b) {
    k[b] = DeviceTensor(low.k[b]);
    v[b] = DeviceTensor(low.v[b]);
    dk[b] = DeviceTensor(low.dk[b]);
    dv[b] = DeviceTensor(low.dv[b]);
    in.kv[b] = KV{k[b].view(), v[b].view()};
    grads.dkv[b] = KV{dk[b].view(), dv[b].view()};
  }
  in.q = q.view();
  in.g = g.view();
  if (c.seqlens.size() != 1) in.seqs.cu_seqlens = cu.view();
  in.seqs.max_seqlen = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  grads.dq = dq.view();
  grads.dg = dg.view();
  ForwardOutputs saved;
  saved.lse = lse.view();
  saved.indices = indices.view();
  const Context ctx = cuda_context(Backend::cuda);
  const DeviceWorkspace ws(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, in)));
  backward(ctx, cfg, in, saved, d_o.view(), grads, ws.view());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const double u = unit_roundoff(c.dtype);
  auto check = [&](const char* name, const DeviceTensor& got_dev, const HostTensor& like, const HostTensor& want) {
    if (!like.defined()) return;
    HostTensor got(like.dtype(), like.shape());
    got_dev.download(got);
    const std::vector<double> w = want.values();
    const double vmax = max_abs(w);
    EXPECT_TRUE(close(got.values(), w, [&](double x, size_t) { return 2.0 * u * (std::fabs(x) + vmax) + 1e-6; }))
        << name;
  };
  check("dq", dq, low.dq, ref.dq);
  check("dg", dg, low.dg, ref.dg);
  static const char* kBranch[3] = {"cmp", "slc", "win"};
  for (int b = 0; b < (c.shared_kv ? 1 : 3); ++b) {
    check((std::string("dk_") + kBranch[b]).c_str(), dk[b], low.dk[b], ref.dk[b]);
    check((std::string("dv_") + kBranch[b]).c_str(), dv[b], low.dv[b], ref.dv[b]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaIndexSets,
    ::testing::Values(
        // name, dtype, Dqk, Dv, Hq, Hkv, seqlens, l, d, l', n, n_init, n_local, w, phi, shared_kv
        AttentionCase{"bf16_d64_G2_packed", DType::bf16, 64, 64, 2, 1, {150, 37, 1}, 32, 16, 64, 6, 1, 1, 64, PhiKind::mean,
                      false},
        AttentionCase{"f16_d128_G4_shared", DType::f16, 128, 128, 8, 2, {300}, 16, 8, 32, 12, 1, 2, 40, PhiKind::mean, true},
        AttentionCase{"bf16_d192x128_G16_long_rows", DType::bf16, 192, 128, 16, 1, {200, 64}, 32, 16, 64, 16, 1, 2, 100,
                      PhiKind::mean, false}),
    [](const auto& info) { return info.param.name; });

}  // namespace
