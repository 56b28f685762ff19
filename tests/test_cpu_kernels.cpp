// The CPU backend's kernel tables on their own: the bf16 matrix products against a plain double
// product of the same bf16 operands (awkward M, N, K; accumulate or overwrite), the fp32 -> bf16
// conversions, and the run-time choice (NSA_CPU_ISA values, named errors).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "cpu/attention.h"
#include "cpu/kernels.h"
#include "nsa/error.h"

namespace {

using nsa::cpu::KernelTable;

class CpuMatrixKernels : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!nsa::cpu::isa_available(GetParam().c_str()))
      GTEST_SKIP() << "kernel table " << GetParam() << " not available here (the CPU, the OS or the compiler lacks it)";
    previous_ = nsa::cpu::kernels().isa;
    nsa::cpu::use_isa(GetParam().c_str());
  }
  void TearDown() override {
    if (!previous_.empty()) nsa::cpu::use_isa(previous_.c_str());
  }
  std::string previous_;
};

// C = A . B (+ C) with A, B bf16 values: the products are exact in fp32 and the sums short, so
// the kernel must agree with double arithmetic to fp32 accumulation accuracy.
TEST_P(CpuMatrixKernels, GemmBf16MatchesDoubleProduct) {
  const KernelTable& K = nsa::cpu::kernels();
  ASSERT_NE(K.gemm_bf16, nullptr);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (int64_t M : {1, 5, 16, 17, 31, 32, 33, 48, 64, 70})
    for (int64_t N : {32, 64, 160})
      for (int64_t K_ : {32, 64, 96, 192})
        for (bool acc : {false, true}) {
          SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K_) +
                       (acc ? " accumulate" : ""));
          const int64_t lda = K_ + 32, ldc = N + 32;  // leading dimensions wider than the matrices
          std::vector<float> a(M * lda), b(K_ * N), c(M * ldc);
          for (auto& x : a) x = nsa::detail::bf16_to_f32(nsa::detail::f32_to_bf16(uni(rng)));
          for (auto& x : b) x = nsa::detail::bf16_to_f32(nsa::detail::f32_to_bf16(uni(rng)));
          for (auto& x : c) x = uni(rng);
          std::vector<uint16_t> ab(M * lda), bb(K_ * N);
          K.f32_to_bf16(a.data(), ab.data(), M * lda);
          K.pack_b_bf16(b.data(), N, K_, N, bb.data(), K_);
          std::vector<float> got = c;
          K.gemm_bf16(M, N, K_, ab.data(), lda, bb.data(), N, got.data(), ldc, acc);
          double worst = 0;
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < ldc; ++j) {
              if (j >= N) {  // outside the product: untouched
                ASSERT_EQ(got[i * ldc + j], c[i * ldc + j]);
                continue;
              }
              double want = acc ? c[i * ldc + j] : 0.0;
              for (int64_t k = 0; k < K_; ++k) want += double(a[i * lda + k]) * b[k * N + j];
              worst = std::max(worst, std::fabs(want - got[i * ldc + j]));
            }
          EXPECT_LE(worst, 1e-5 * K_) << "max error";
        }
}

// The packers agree with each other: pack_b_bf16 (vector) and pack_vnni (scalar), with rows
// past K zero; f32_to_bf16 rounds to nearest even like the scalar conversion, tails included.
TEST_P(CpuMatrixKernels, PackingAndRounding) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
  for (int64_t rows : {1, 7, 32, 45})
    for (int64_t N : {32, 96}) {
      const int64_t Kp = (rows + 31) / 32 * 32, lds = N + 16;
      std::vector<float> src(Kp * lds + 16);
      for (auto& x : src) x = uni(rng);
      std::vector<uint16_t> vec(Kp * N, 0xffff), ref(Kp * N, 0xeeee);
      K.pack_b_bf16(src.data(), lds, rows, N, vec.data(), Kp);
      nsa::cpu::pack_vnni(src.data(), rows, N, lds, 1, ref.data(), Kp, N);
      EXPECT_EQ(vec, ref) << rows << " rows, N " << N;
    }
  for (int64_t n : {1, 15, 16, 17, 100}) {
    std::vector<float> x(n);
    for (auto& v : x) v = uni(rng) * 1e3f;
    x[0] = 1.0f + 1.0f / 256;  // a tie: rounds to the even 1.0
    std::vector<uint16_t> got(n + 1, 0x1234);
    K.f32_to_bf16(x.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], nsa::detail::f32_to_bf16(x[i])) << i;
    EXPECT_EQ(got[n], 0x1234) << "wrote past n";
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuMatrixKernels, ::testing::Values("avx512bf16", "amx"),
                         [](const auto& info) { return info.param; });

// The fp32 tables have no bf16 product: the engine then keeps its fp32 path for bf16 inputs.
TEST(CpuKernelChoice, Fp32TablesHaveNoMatrixPath) {
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (!nsa::cpu::isa_available(isa)) continue;
    const std::string previous = nsa::cpu::kernels().isa;
    nsa::cpu::use_isa(isa);
    EXPECT_EQ(nsa::cpu::kernels().gemm_bf16, nullptr) << isa;
    EXPECT_EQ(std::string(nsa::cpu::kernels().isa), isa);
    nsa::cpu::use_isa(previous.c_str());
  }
  EXPECT_TRUE(nsa::cpu::isa_available("generic"));
}

// An unknown or unavailable NSA_CPU_ISA value is an nsa::Error naming NSA_CPU_ISA and listing
// the values this CPU takes; the table in use does not change.
TEST(CpuKernelChoice, BadIsaIsANamedError) {
  const std::string before = nsa::cpu::kernels().isa;
  std::vector<std::string> bad = {"sse9", ""};
  for (const char* isa : {"avx2", "avx512", "avx512bf16", "amx"})
    if (!nsa::cpu::isa_available(isa)) bad.push_back(isa);
  for (const std::string& isa : bad) {
    try {
      nsa::cpu::use_isa(isa.c_str());
      ADD_FAILURE() << "no error for \"" << isa << "\"";
    } catch (const nsa::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("NSA_CPU_ISA"), std::string::npos) << what;
      EXPECT_NE(what.find("generic"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(nsa::cpu::kernels().isa, before);
}

}  // namespace
