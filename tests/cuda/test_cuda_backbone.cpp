// The reach backbone (spec §11) on the GPU: the prefill's top-n against the reference on identical
// scores (with ties), and the forward's selection holding every backbone block and matching the
// reference's. (Decoding with the backbone: tests/cuda/test_cuda_decode.cpp's backbone case.)
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cuda_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

TEST(CudaBackbone, TopnMatchesReference) {
  NSA_REQUIRE_GPU();
  for (const std::vector<int64_t>& offs : {std::vector<int64_t>{1}, {2, 8}, {1, 2, 4, 16, 64}}) {
    Config c = make_config(32, 16, 64, 9, 1, 2, 512, PhiKind::mean);
    c.set_backbone(offs);
    const int64_t T = 9000, hkv = 2, ns = 141;
    std::mt19937_64 rng(offs.size());
    HostTensor scores(DType::f32, {T, hkv, ns});
    for (int64_t i = 0; i < scores.numel(); ++i) scores.set(i, double(rng() % 7));  // ties
    HostTensor cu(DType::i32, {3});
    cu.set(0, 0);
    cu.set(1, 5000);
    cu.set(2, T);
    HostTensor want(DType::i32, {T, hkv, c.n_selected}), got(DType::i32, {T, hkv, c.n_selected});
    want.poison();
    got.poison();
    Sequences hs;
    hs.cu_seqlens = cu.view();
    select_topn(cuda_context(Backend::reference), c, scores.view(), hs, want.view());
    DeviceTensor ds(scores), dcu(cu), di(got);
    Sequences dseq;
    dseq.cu_seqlens = dcu.view();
    dseq.max_seqlen = 5000;
    select_topn(cuda_context(Backend::cuda), c, ds.view(), dseq, di.view());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    di.download(got);
    const std::vector<double> a = got.values(), b = want.values();
    EXPECT_EQ(a, b) << "offsets " << offs.size();
  }
}

}  // namespace
