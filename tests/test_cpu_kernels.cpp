// The CPU backend's kernel tables on their own: the bf16 matrix products against a plain double
// product of the same bf16 operands (awkward M, N, K; accumulate or overwrite), the fp32 -> bf16
// conversions, the row kernels of the attention engine (softmax, P, dS, packing) on every table
// against double arithmetic or the scalar packer, and the run-time choice (NSA_CPU_ISA values,
// named errors).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <utility>
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

// ---- The row kernels of the attention engine, on every table ----------------------------

class CpuRowKernels : public CpuMatrixKernels {};

constexpr float kInf = std::numeric_limits<float>::infinity();

// Visible intervals [a, b] of a row of n columns: whole, inside, one column, at either end, empty.
std::vector<std::pair<int64_t, int64_t>> intervals(int64_t n) {
  return {{0, n - 1}, {3, n - 5}, {7, 7}, {0, 0}, {n - 1, n - 1}, {n - 17, n - 1}, {0, 20}, {5, 4}, {0, -1}};
}

// softmax_row against double arithmetic: the new max, p_j = exp(scale s_j - mx) on [a, b] and
// exactly 0 elsewhere, its bf16 copy (the table's own rounding of its p), l and the returned
// factor exp(m_old - mx); an empty interval leaves m and l alone.
TEST_P(CpuRowKernels, SoftmaxRowMatchesDouble) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uni(-8.0f, 8.0f);
  for (int64_t n : {32, 64, 96, 256})
    for (auto [a, b] : intervals(n))
      for (float scale : {1.0f, 0.0883883476f})
        for (float m0 : {-kInf, -3.0f, 40.0f}) {
          SCOPED_TRACE("n " + std::to_string(n) + " [" + std::to_string(a) + ", " + std::to_string(b) + "] scale " +
                       std::to_string(scale) + " m " + std::to_string(m0));
          std::vector<float> s(n);
          for (auto& x : s) x = uni(rng);
          const float l0 = m0 == -kInf ? 0.0f : 2.5f;
          double want_mx = m0;
          for (int64_t j = a; j <= b; ++j) want_mx = std::max(want_mx, double(scale) * s[j]);
          std::vector<float> got = s;
          std::vector<uint16_t> pb(n, 0x1234);
          float m = m0, l = l0;
          const float corr = K.softmax_row(got.data(), n, a, b, scale, &m, &l, pb.data());
          if (a > b) {
            EXPECT_EQ(corr, 1.0f);
            EXPECT_EQ(m, m0);
            EXPECT_EQ(l, l0);
          } else {
            EXPECT_NEAR(m, want_mx, 1e-6 * std::fabs(want_mx));
            const double want_corr = std::exp(double(m0) - want_mx);
            EXPECT_NEAR(corr, want_corr, 1e-5 * want_corr + 1e-30);
            double want_l = l0 * want_corr;
            for (int64_t j = a; j <= b; ++j) want_l += std::exp(double(scale) * s[j] - want_mx);
            EXPECT_NEAR(l, want_l, 1e-5 * want_l);
          }
          for (int64_t j = 0; j < n; ++j) {
            if (j < a || j > b) {
              ASSERT_EQ(got[j], 0.0f) << j;
            } else {
              const double want = std::exp(double(scale) * s[j] - want_mx);
              ASSERT_NEAR(got[j], want, 1e-5 * want + 1e-37) << j;
            }
            ASSERT_EQ(pb[j], nsa::detail::f32_to_bf16(got[j])) << j;
          }
          float m2 = m0, l2 = l0;  // without the bf16 copy: the same values
          std::vector<float> again = s;
          K.softmax_row(again.data(), n, a, b, scale, &m2, &l2, nullptr);
          EXPECT_EQ(again, got);
          EXPECT_EQ(m2, m);
          EXPECT_EQ(l2, l);
        }
}

// exp_row: exp(scale s_j - shift) on [a, b], exactly 0 elsewhere.
TEST_P(CpuRowKernels, ExpRowMatchesDouble) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> uni(-8.0f, 8.0f);
  for (int64_t n : {32, 64, 128})
    for (auto [a, b] : intervals(n))
      for (float shift : {0.0f, 9.5f, -2.0f}) {
        SCOPED_TRACE("n " + std::to_string(n) + " [" + std::to_string(a) + ", " + std::to_string(b) + "] shift " +
                     std::to_string(shift));
        std::vector<float> s(n);
        for (auto& x : s) x = uni(rng);
        std::vector<float> got = s;
        const float scale = 0.75f;
        K.exp_row(got.data(), n, a, b, scale, shift);
        for (int64_t j = 0; j < n; ++j) {
          if (j < a || j > b) {
            ASSERT_EQ(got[j], 0.0f) << j;
            continue;
          }
          const double want = std::exp(double(scale) * s[j] - shift);
          ASSERT_NEAR(got[j], want, 1e-5 * want + 1e-37) << j;
        }
      }
  std::vector<float> dead = {-200.0f, -kInf, -87.5f, 0.0f};  // far below: exactly 0
  dead.resize(32, -100.0f);
  K.exp_row(dead.data(), 32, 0, 31, 1.0f, 0.0f);
  EXPECT_EQ(dead[0], 0.0f);
  EXPECT_EQ(dead[1], 0.0f);
  EXPECT_EQ(dead[2], 0.0f);
  EXPECT_EQ(dead[3], 1.0f);
}

// ds_row: p (gate dp - delta) factor in place, and its bf16 copy.
TEST_P(CpuRowKernels, DsRowMatchesDouble) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  for (int64_t n : {32, 64, 160})
    for (float gate : {1.0f, 0.37f})
      for (float factor : {1.0f, 0.0883883476f}) {
        std::vector<float> p(n), dp(n);
        for (auto& x : p) x = std::fabs(uni(rng));
        for (auto& x : dp) x = uni(rng);
        const float delta = uni(rng);
        std::vector<float> got = p;
        std::vector<uint16_t> pb(n + 1, 0x1234);
        K.ds_row(got.data(), dp.data(), n, gate, delta, factor, pb.data());
        EXPECT_EQ(pb[n], 0x1234) << "wrote past n";
        for (int64_t j = 0; j < n; ++j) {
          const double want = double(p[j]) * (double(gate) * dp[j] - delta) * factor;
          const double size = double(p[j]) * (std::fabs(double(gate) * dp[j]) + std::fabs(delta)) * factor;
          ASSERT_NEAR(got[j], want, 4e-7 * size) << j;
          ASSERT_EQ(pb[j], nsa::detail::f32_to_bf16(got[j])) << j;
        }
        std::vector<float> again = p;
        K.ds_row(again.data(), dp.data(), n, gate, delta, factor, nullptr);
        EXPECT_EQ(again, got);
      }
}

// scale_row: one correctly rounded product per element, any n.
TEST_P(CpuRowKernels, ScaleRowIsExactProduct) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(14);
  std::uniform_real_distribution<float> uni(-5.0f, 5.0f);
  for (int64_t n : {1, 7, 16, 33, 128}) {
    std::vector<float> x(n + 1);
    for (auto& v : x) v = uni(rng);
    const float f = uni(rng);
    std::vector<float> got = x;
    K.scale_row(got.data(), n, f);
    for (int64_t j = 0; j < n; ++j) ASSERT_EQ(got[j], static_cast<float>(double(x[j]) * f)) << j;
    EXPECT_EQ(got[n], x[n]) << "wrote past n";
  }
}

// f32_to_bf16 on every table: round to nearest even as the scalar conversion, ties, infinities,
// NaN (quiet), tails. (Denormals are left out: vcvtneps2bf16 flushes them.)
TEST_P(CpuRowKernels, F32ToBf16Rounding) {
  const KernelTable& K = nsa::cpu::kernels();
  ASSERT_NE(K.f32_to_bf16, nullptr);
  std::mt19937 rng(15);
  std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
  for (int64_t n : {1, 15, 16, 17, 100}) {
    std::vector<float> x(n);
    for (auto& v : x) v = uni(rng) * 1e3f;
    x[0] = 1.0f + 1.0f / 256;  // a tie: rounds to the even 1.0
    if (n > 4) {
      x[1] = 1.0f + 3.0f / 256;  // a tie: rounds up to the even 1 + 4/256
      x[2] = kInf;
      x[3] = -kInf;
      x[4] = std::numeric_limits<float>::quiet_NaN();
    }
    std::vector<uint16_t> got(n + 1, 0x1234);
    K.f32_to_bf16(x.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], nsa::detail::f32_to_bf16(x[i])) << i;
    EXPECT_EQ(got[n], 0x1234) << "wrote past n";
  }
}

// pack_bt_bf16 equals the scalar pack_vnni of the transpose, hi and lo parts, with K odd, K < Kp,
// N < ldb.
TEST_P(CpuRowKernels, PackTransposedMatchesScalar) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
  for (int64_t N : {1, 30, 64})
    for (int64_t K_ : {5, 32, 100, 128})
      for (bool lo : {false, true}) {
        const int64_t Kp = (K_ + 31) / 32 * 32, ldb = (N + 31) / 32 * 32, lds = Kp + 8;
        std::vector<float> src(N * lds);
        for (auto& x : src) x = uni(rng);
        std::vector<uint16_t> got(Kp * ldb, 0xffff), want(Kp * ldb, 0xeeee);
        K.pack_bt_bf16(src.data(), lds, N, K_, got.data(), Kp, ldb, lo);
        nsa::cpu::pack_vnni(src.data(), K_, N, 1, lds, want.data(), Kp, ldb, lo);
        EXPECT_EQ(got, want) << "N " << N << " K " << K_ << (lo ? " lo" : "");
      }
}

// transpose_bf16: dst[c][r] = bf16(src[r][c]), rows M .. ldt - 1 zero, and the rounding errors.
TEST_P(CpuRowKernels, TransposeBf16MatchesScalar) {
  const KernelTable& K = nsa::cpu::kernels();
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
  for (int64_t M : {1, 16, 33, 64})
    for (int64_t n : {32, 64})
      for (bool with_lo : {false, true}) {
        const int64_t ldt = (M + 31) / 32 * 32, lds = n + 16;
        std::vector<float> src(M * lds);
        for (auto& x : src) x = uni(rng);
        std::vector<uint16_t> got(n * ldt, 0xffff), lo(n * ldt, 0xffff);
        K.transpose_bf16(src.data(), M, n, lds, got.data(), ldt, with_lo ? lo.data() : nullptr);
        for (int64_t c = 0; c < n; ++c)
          for (int64_t r = 0; r < ldt; ++r) {
            const float x = r < M ? src[r * lds + c] : 0.0f;
            const uint16_t hi = nsa::detail::f32_to_bf16(x);
            ASSERT_EQ(got[c * ldt + r], hi) << "M " << M << " n " << n << " c " << c << " r " << r;
            const uint16_t want_lo = with_lo ? nsa::detail::f32_to_bf16(x - nsa::detail::bf16_to_f32(hi)) : 0xffff;
            ASSERT_EQ(lo[c * ldt + r], want_lo) << "M " << M << " n " << n << " c " << c << " r " << r << " lo";
          }
      }
}

// bf16_to_f32 on every table: exact (the bits shifted), tails included.
TEST_P(CpuRowKernels, Bf16ToF32IsExact) {
  const KernelTable& K = nsa::cpu::kernels();
  for (int64_t n : {1, 15, 16, 17, 100}) {
    std::vector<uint16_t> h(n);
    for (int64_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(0x3f00 + 977 * i);
    std::vector<float> got(n + 1, 7.0f);
    K.bf16_to_f32(h.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) {  // bit patterns: some are NaN
      uint32_t bits;
      std::memcpy(&bits, &got[i], 4);
      ASSERT_EQ(bits, uint32_t(h[i]) << 16) << i;
    }
    EXPECT_EQ(got[n], 7.0f) << "wrote past n";
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuRowKernels, ::testing::Values("generic", "avx2", "avx512", "avx512bf16", "amx"),
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

// The automatic choice: amx where it runs, else avx512bf16 on an AMD CPU of family 26 or later,
// else the widest fp32 table. The vendor and family come from /proc/cpuinfo here, not cpuid.
TEST(CpuKernelChoice, AutomaticChoiceFollowsTheCpu) {
  std::ifstream info("/proc/cpuinfo");
  if (!info) GTEST_SKIP() << "no /proc/cpuinfo";
  std::string line, vendor;
  int family = -1;
  while (std::getline(info, line) && (vendor.empty() || family < 0)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string value = line.substr(colon + 1 + (colon + 1 < line.size() && line[colon + 1] == ' '));
    if (line.rfind("vendor_id", 0) == 0) vendor = value;
    if (line.rfind("cpu family", 0) == 0) family = std::stoi(value);
  }
  using nsa::cpu::isa_available;
  const std::string want = isa_available("amx")                                                  ? "amx"
                           : vendor == "AuthenticAMD" && family >= 26 && isa_available("avx512bf16") ? "avx512bf16"
                           : isa_available("avx512")                                             ? "avx512"
                           : isa_available("avx2")                                               ? "avx2"
                                                                                                 : "generic";
  EXPECT_EQ(std::string(nsa::cpu::auto_isa()), want) << vendor << ", family " << family;
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
