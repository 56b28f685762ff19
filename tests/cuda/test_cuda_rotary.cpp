// Rotary embeddings (api.h rotary) on the GPU against the CPU backend (bf16, f16; the awkward shapes
// of rotary_support.h: D = 2, 6, 130 (the scalar path), H = 1, odd, 17 (several head groups), T = 0,
// packed sequences with empty and one-token ones, explicit positions up to 2e5), forward and
// inverse, in place, explicit positions against device offsets, and the scalar path against the
// vector path.
//
// Tolerance: both sides compute the same fp32 formula, except that cos and sin come from different
// libraries (CUDA's cosf/sinf, the C library's), which may differ by an ulp or two of fp32. So an
// element may differ by one ulp of the dtype at its magnitude (the fp32 difference moved a rounding
// boundary) plus, where the two products nearly cancel, the fp32 error of the terms: 4 fp32 ulps of
// |x1| + |x2|. Besides, at least 99.9% of the elements must be bit-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "rotary_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

// One ulp of a bf16 or f16 value of magnitude |v| (the subnormal spacing near 0).
double ulp_of(double v, DType dt) {
  const int mantissa = dt == DType::bf16 ? 7 : 10;
  const int min_exp = dt == DType::bf16 ? -126 : -14;
  const double a = std::fabs(v);
  const int e = a > 0 ? std::max(static_cast<int>(std::floor(std::log2(a))), min_exp) : min_exp;
  return std::ldexp(1.0, e - mantissa);
}

// got (cuda) against want (cpu) for input x [T, H, D], with the tolerance above.
::testing::AssertionResult rotary_close(HostTensor& got, HostTensor& want, const HostTensor& x, int64_t D) {
  const int64_t h = D / 2, n = want.numel();
  int64_t bad = 0, identical = 0, first = -1;
  for (int64_t e = 0; e < n; ++e) {
    uint16_t a, b;
    std::memcpy(&a, static_cast<char*>(got.data()) + 2 * e, 2);
    std::memcpy(&b, static_cast<char*>(want.data()) + 2 * e, 2);
    if (a == b) {
      ++identical;
      continue;
    }
    const int64_t i = e % D, partner = i < h ? e + h : e - h;
    const double terms = std::fabs(x.get(e)) + std::fabs(x.get(partner));
    const double tol = ulp_of(want.get(e), want.dtype()) + 4 * std::ldexp(1.0, -24) * terms;
    if (!(std::fabs(got.get(e) - want.get(e)) <= tol) && bad++ == 0) first = e;
  }
  if (bad > 0)
    return ::testing::AssertionFailure() << bad << " of " << n << " elements out of tolerance; first at " << first
                                         << ": got " << got.get(first) << ", want " << want.get(first);
  if (n > 0 && identical < n - n / 1000)
    return ::testing::AssertionFailure() << "only " << identical << " of " << n << " elements bit-identical";
  return ::testing::AssertionSuccess() << identical << " of " << n << " bit-identical";
}

// The problem's tensors on the device.
struct DeviceRotary {
  DeviceTensor x, inv_freq, cu, positions;
  explicit DeviceRotary(const RotaryProblem& p) : x(p.x), inv_freq(p.inv_freq), cu(p.cu), positions(p.positions) {}
  // Device offsets without max_seqlen: rotary needs no bound on the sequence lengths.
  Sequences seqs(const RotaryProblem& p) const {
    Sequences s;
    if (p.c.seqlens.size() > 1) s.cu_seqlens = cu.view();
    return s;
  }
};

HostTensor run_cuda(const RotaryProblem& p, const DeviceRotary& d, bool inverse, cudaStream_t stream = nullptr) {
  HostTensor got = p.output();
  DeviceTensor out(got);
  Context ctx = cuda_context();
  ctx.stream = stream;
  rotary(ctx, d.x.view(), d.inv_freq.view(), d.seqs(p), d.positions.view(), out.view(), inverse);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out.download(got);
  return got;
}

TEST(CudaRotary, MatchesCpu) {
  NSA_REQUIRE_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (const RotaryCase& c : rotary_cases())
    for (DType dt : {DType::bf16, DType::f16})
      for (bool inverse : {false, true}) {
        RotaryProblem p = make_rotary(c, dt, 11);
        HostTensor want = p.output();
        rotary(cuda_context(Backend::cpu), p.x.view(), p.inv_freq.view(), p.seqs(), p.positions.view(), want.view(),
               inverse);
        const DeviceRotary d(p);
        HostTensor got = run_cuda(p, d, inverse, inverse ? stream : nullptr);  // a stream of its own too
        EXPECT_TRUE(rotary_close(got, want, p.x, c.D))
            << c.name << " " << dtype_name(dt) << (inverse ? " inverse" : "");
      }
  cudaStreamDestroy(stream);
}

TEST(CudaRotary, InPlaceEqualsOutOfPlace) {
  NSA_REQUIRE_GPU();
  for (const RotaryCase& c : rotary_cases())
    for (DType dt : {DType::bf16, DType::f16}) {
      RotaryProblem p = make_rotary(c, dt, 12);
      const DeviceRotary d(p);
      HostTensor want = run_cuda(p, d, false);
      rotary(cuda_context(), d.x.view(), d.inv_freq.view(), d.seqs(p), d.positions.view(), d.x.view());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      HostTensor got = p.output();
      d.x.download(got);
      EXPECT_TRUE(same_bits(got, want)) << c.name << " " << dtype_name(dt);
    }
}

TEST(CudaRotary, ExplicitPositionsEqualDeviceOffsets) {
  NSA_REQUIRE_GPU();
  for (const RotaryCase& c : rotary_cases()) {
    if (c.max_position > 0) continue;
    RotaryProblem p = make_rotary(c, DType::bf16, 13);
    HostTensor from_offsets = run_cuda(p, DeviceRotary(p), false);
    HostTensor positions(DType::i32, {p.T});  // filled before p has them: p.position(t) reads p.positions
    for (int64_t t = 0; t < p.T; ++t) positions.set(t, double(p.position(t)));
    p.positions = positions;
    HostTensor from_positions = run_cuda(p, DeviceRotary(p), false);
    EXPECT_TRUE(same_bits(from_positions, from_offsets)) << c.name;
  }
}

TEST(CudaRotary, ScalarPathEqualsVectorPath) {
  // The same rows with a head stride of D + 2 elements: rows off 16 bytes, so the scalar path.
  NSA_REQUIRE_GPU();
  for (const RotaryCase& c : rotary_cases()) {
    if (c.D % 16 != 0) continue;  // h a multiple of 8: the vector path for contiguous rows
    for (DType dt : {DType::bf16, DType::f16}) {
      RotaryProblem p = make_rotary(c, dt, 14);
      const DeviceRotary d(p);
      HostTensor want = run_cuda(p, d, true);
      HostTensor padded(dt, {p.T, c.H, c.D + 2});
      for (int64_t row = 0; row < p.T * c.H; ++row)
        for (int64_t i = 0; i < c.D; ++i) padded.set(row * (c.D + 2) + i, p.x.get(row * c.D + i));
      DeviceTensor dx(padded);
      TensorView v = dx.view();
      v.shape[2] = c.D;
      rotary(cuda_context(), v, d.inv_freq.view(), d.seqs(p), d.positions.view(), v, true);  // in place
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      dx.download(padded);
      HostTensor got = p.output();
      for (int64_t row = 0; row < p.T * c.H; ++row)
        for (int64_t i = 0; i < c.D; ++i) got.set(row * c.D + i, padded.get(row * (c.D + 2) + i));
      EXPECT_TRUE(same_bits(got, want)) << c.name << " " << dtype_name(dt);
    }
  }
}

TEST(CudaRotary, NoTokensLaunchesNothingAndF32IsANamedError) {
  NSA_REQUIRE_GPU();
  RotaryProblem p = make_rotary({"empty", {0, 0}, 2, 4, 0}, DType::bf16, 15);
  const DeviceRotary d(p);
  HostTensor out = p.output();
  DeviceTensor dout(out);
  EXPECT_NO_THROW(rotary(cuda_context(), d.x.view(), d.inv_freq.view(), d.seqs(p), {}, dout.view()));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  RotaryProblem q = make_rotary({"f32", {5}, 1, 8, 0}, DType::f32, 16);
  const DeviceRotary dq(q);
  HostTensor o32 = q.output();
  DeviceTensor do32(o32);
  try {
    rotary(cuda_context(), dq.x.view(), dq.inv_freq.view(), {}, {}, do32.view());
    ADD_FAILURE() << "f32 on the cuda backend: no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), "dtype") << e.what();
  }
}

}  // namespace
