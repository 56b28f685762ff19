// Rotary embeddings (api.h rotary) on the host: the reference against the formula written out
// here, the CPU backend against the reference bit for bit (f32, bf16, f16; the awkward shapes of
// rotary_support.h, explicit and large positions, any thread count), the inverse as the undoing
// and the adjoint of the rotation, in place against out of place, every argument error, and the
// CUDA kernel's launch shape rule (a pure function of sizes, tile_sizes.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/tile_sizes.h"
#include "rotary_support.h"

namespace nsa::test {
namespace {

const DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

void run(Backend b, RotaryProblem& p, HostTensor& out, bool inverse, int threads = 0) {
  rotary(context_of(b, threads), p.x.view(), p.inv_freq.view(), p.seqs(), p.positions.view(), out.view(), inverse);
}

// The rotation of element (t, head, i) and (t, head, i + h) written out from the declaration, in
// W (float or double). Every product and sum goes through a volatile, so it is rounded on its own
// whatever the compiler's contraction setting.
template <typename W>
void formula(const RotaryProblem& p, bool inverse, HostTensor& out) {
  const int64_t H = p.c.H, D = p.c.D, h = D / 2;
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      volatile W rounded = static_cast<W>(p.position(t)) * static_cast<W>(p.inv_freq.get(i));
      const W angle = rounded;
      const W c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
      for (int64_t head = 0; head < H; ++head) {
        const int64_t e = (t * H + head) * D + i;
        const W x1 = static_cast<W>(p.x.get(e)), x2 = static_cast<W>(p.x.get(e + h));
        volatile W a = x1 * c, b = x2 * s, d = x2 * c, f = x1 * s;
        out.set(e, static_cast<W>(a - b));
        out.set(e + h, static_cast<W>(d + f));
      }
    }
}

TEST(Rotary, ReferenceIsTheFormula) {
  for (const RotaryCase& c : rotary_cases())
    for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16})
      for (bool inverse : {false, true}) {
        RotaryProblem p = make_rotary(c, dt, 1);
        HostTensor got = p.output(), want = p.output();
        run(Backend::reference, p, got, inverse);
        if (dt == DType::f64) formula<double>(p, inverse, want);
        else formula<float>(p, inverse, want);
        EXPECT_TRUE(same_bits(got, want)) << c.name << " " << dtype_name(dt) << (inverse ? " inverse" : "");
      }
}

TEST(Rotary, CpuEqualsReferenceBitForBit) {
  if (!backend_available(Backend::cpu)) GTEST_SKIP() << "no cpu backend";
  for (const RotaryCase& c : rotary_cases())
    for (DType dt : kDtypes)
      for (bool inverse : {false, true}) {
        RotaryProblem p = make_rotary(c, dt, 2);
        HostTensor want = p.output();
        run(Backend::reference, p, want, inverse);
        for (int threads : {1, 3, 0}) {
          HostTensor got = p.output();
          run(Backend::cpu, p, got, inverse, threads);
          EXPECT_TRUE(same_bits(got, want)) << c.name << " " << dtype_name(dt) << (inverse ? " inverse" : "")
                                            << " threads " << threads;
        }
      }
}

TEST(Rotary, PositionsFromSequencesEqualExplicitPositions) {
  // Packed sequences, an empty one first and one inside, a one-token one: t - cu_seqlens[b].
  for (Backend b : {Backend::reference, Backend::cpu}) {
    if (!backend_available(b)) continue;
    RotaryProblem p = make_rotary({"packed", {0, 5, 0, 1, 12}, 3, 8, 0}, DType::f32, 3);
    HostTensor from_seqs = p.output(), from_positions = p.output();
    run(b, p, from_seqs, false);
    p.positions = HostTensor(DType::i32, {p.T});
    const int64_t want[] = {0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    ASSERT_EQ(p.T, 18);
    for (int64_t t = 0; t < p.T; ++t) p.positions.set(t, double(want[t]));
    run(b, p, from_positions, false);
    EXPECT_TRUE(same_bits(from_seqs, from_positions)) << backend_name(b);
    // Position 0 is the identity; one sequence of all tokens counts from 0 throughout.
    for (int64_t e = 0; e < p.c.H * p.c.D; ++e) EXPECT_EQ(from_seqs.get(e), p.x.get(e));
  }
}

TEST(Rotary, InverseUndoesAndIsTheAdjoint) {
  for (const RotaryCase& c : rotary_cases()) {
    // f64 (reference): inverse(rotary(x)) = x, <rotary(x), y> = <x, inverse(y)> (the gradient),
    // and every pair keeps its length.
    RotaryProblem p = make_rotary(c, DType::f64, 4);
    RotaryProblem q = p;  // the same shape, offsets and positions, another x
    q.x = make_rotary(c, DType::f64, 5).x;
    HostTensor rx = p.output(), back = p.output(), iy = q.output();
    run(Backend::reference, p, rx, false);
    RotaryProblem r = p;
    r.x = rx;
    run(Backend::reference, r, back, true);
    run(Backend::reference, q, iy, true);
    double dot_a = 0, dot_b = 0, scale = 0;
    for (int64_t e = 0; e < p.x.numel(); ++e) {
      EXPECT_NEAR(back.get(e), p.x.get(e), 1e-13) << c.name << " element " << e;
      dot_a += rx.get(e) * q.x.get(e);
      dot_b += p.x.get(e) * iy.get(e);
      scale += std::fabs(p.x.get(e) * q.x.get(e));
    }
    EXPECT_NEAR(dot_a, dot_b, 1e-13 * (scale + 1)) << c.name;
    const int64_t h = c.D / 2;
    for (int64_t row = 0; row < p.T * c.H; ++row)
      for (int64_t i = 0; i < h; ++i) {
        const int64_t e = row * c.D + i;
        const double before = std::hypot(p.x.get(e), p.x.get(e + h)), after = std::hypot(rx.get(e), rx.get(e + h));
        EXPECT_NEAR(after, before, 1e-14 * (before + 1)) << c.name;
      }
  }
  // f32 (cpu): each of the two passes rounds cos, sin, two products and a sum: a few ulps.
  if (!backend_available(Backend::cpu)) return;
  for (const RotaryCase& c : rotary_cases()) {
    RotaryProblem p = make_rotary(c, DType::f32, 6);
    HostTensor rx = p.output(), back = p.output();
    run(Backend::cpu, p, rx, false);
    RotaryProblem r = p;
    r.x = rx;
    run(Backend::cpu, r, back, true);
    EXPECT_LE(max_abs_diff(back.values(), p.x.values()), 8 * std::ldexp(1.0, -24) * 2) << c.name;  // |x| <= 2
  }
}

TEST(Rotary, InPlaceEqualsOutOfPlace) {
  for (Backend b : {Backend::reference, Backend::cpu}) {
    if (!backend_available(b)) continue;
    for (const RotaryCase& c : rotary_cases())
      for (DType dt : kDtypes)
        for (bool inverse : {false, true}) {
          RotaryProblem p = make_rotary(c, dt, 7);
          HostTensor want = p.output();
          run(b, p, want, inverse);
          // x in place, as a strided view: each token's heads padded by two more (a slice of a
          // fused projection).
          HostTensor fused(dt, {p.T, c.H + 2, c.D});
          for (int64_t t = 0; t < p.T; ++t)
            for (int64_t e = 0; e < c.H * c.D; ++e) fused.set(t * (c.H + 2) * c.D + e, p.x.get(t * c.H * c.D + e));
          TensorView v = fused.view();
          v.shape[1] = c.H;
          rotary(context_of(b), v, p.inv_freq.view(), p.seqs(), p.positions.view(), v, inverse);
          HostTensor got = p.output();
          for (int64_t t = 0; t < p.T; ++t)
            for (int64_t e = 0; e < c.H * c.D; ++e) got.set(t * c.H * c.D + e, fused.get(t * (c.H + 2) * c.D + e));
          EXPECT_TRUE(same_bits(got, want)) << backend_name(b) << " " << c.name << " " << dtype_name(dt);
          // The padding heads are untouched.
          for (int64_t t = 0; t < p.T; ++t)
            for (int64_t e = c.H * c.D; e < (c.H + 2) * c.D; ++e) ASSERT_EQ(fused.get(t * (c.H + 2) * c.D + e), 0.0);
        }
  }
}

TEST(Rotary, NoTokensIsANoOp) {
  for (Backend b : {Backend::reference, Backend::cpu}) {
    if (!backend_available(b)) continue;
    HostTensor x(DType::f32, {0, 2, 4}), out(DType::f32, {0, 2, 4}), cu(DType::i32, {1}), pos(DType::i32, {0});
    const HostTensor f = rope_inv_freq(4);
    HostTensor freq = f;
    Sequences s;
    EXPECT_NO_THROW(rotary(context_of(b), x.view(), freq.view(), s, {}, out.view()));
    s.cu_seqlens = cu.view();
    EXPECT_NO_THROW(rotary(context_of(b), x.view(), freq.view(), s, pos.view(), out.view(), true));
  }
}

// ---- Errors ---------------------------------------------------------------------------------

struct RotaryArgs {
  Context ctx;
  TensorView x, inv_freq, positions, out;
  Sequences seqs;
};

void expect_rotary_error(const std::string& name, const std::string& parameter, const std::string& value,
                         const std::function<void(RotaryArgs&)>& spoil) {
  for (Backend b : {Backend::reference, Backend::cpu}) {
    if (!backend_available(b)) continue;
    // A valid call: 2 sequences (3 + 4 tokens), H = 2, D = 6, explicit positions.
    HostTensor x(DType::f32, {7, 2, 6}), out(DType::f32, {7, 2, 6});
    HostTensor freq = rope_inv_freq(6), cu(DType::i32, {3}), pos(DType::i32, {7});
    cu.set(1, 3);
    cu.set(2, 7);
    for (int64_t t = 0; t < 7; ++t) pos.set(t, double(t));
    RotaryArgs a{context_of(b), x.view(), freq.view(), pos.view(), out.view(), Sequences{cu.view(), 0}};
    ASSERT_NO_THROW(rotary(a.ctx, a.x, a.inv_freq, a.seqs, a.positions, a.out)) << name;
    spoil(a);
    try {
      rotary(a.ctx, a.x, a.inv_freq, a.seqs, a.positions, a.out);
      ADD_FAILURE() << name << " (" << backend_name(b) << "): no error; expected one naming " << parameter;
    } catch (const Error& e) {
      EXPECT_EQ(e.parameter(), parameter) << name << ": " << e.what();
      if (!value.empty()) EXPECT_EQ(e.value(), value) << name << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(parameter), std::string::npos) << e.what();
      EXPECT_FALSE(e.allowed().empty()) << e.what();
    }
  }
}

TEST(Rotary, BadArgumentsAreNamedErrors) {
  expect_rotary_error("x_absent", "x", "absent", [](RotaryArgs& a) { a.x = {}; });
  expect_rotary_error("x_int", "x.dtype", "i32", [](RotaryArgs& a) { a.x.dtype = DType::i32; });
  expect_rotary_error("x_rank", "x.ndim", "2", [](RotaryArgs& a) { a.x.ndim = 2; });
  expect_rotary_error("d_odd", "x.shape[2] (D)", "5", [](RotaryArgs& a) { a.x.shape[2] = 5; });
  expect_rotary_error("d_zero", "x.shape[2] (D)", "0", [](RotaryArgs& a) { a.x.shape[2] = 0; });
  expect_rotary_error("h_zero", "x.shape[1] (H)", "0", [](RotaryArgs& a) { a.x.shape[1] = 0; });
  expect_rotary_error("x_last_stride", "x.stride[2]", "2", [](RotaryArgs& a) { a.x.stride[2] = 2; });
  expect_rotary_error("x_negative_stride", "x.stride[0]", "-12", [](RotaryArgs& a) { a.x.stride[0] = -12; });
  expect_rotary_error("out_absent", "out", "absent", [](RotaryArgs& a) { a.out = {}; });
  expect_rotary_error("out_heads", "out.shape[1]", "1", [](RotaryArgs& a) { a.out.shape[1] = 1; });
  expect_rotary_error("out_dtype", "out.dtype", "bf16", [](RotaryArgs& a) { a.out.dtype = DType::bf16; });
  expect_rotary_error("out_shifted_over_x", "out", "", [](RotaryArgs& a) {
    a.out = a.x;
    a.out.data = static_cast<float*>(a.x.data) + 1;
    a.out.shape[0] = 6;
    a.x.shape[0] = 6;
    a.positions.shape[0] = 6;
    a.seqs = {};
  });
  expect_rotary_error("out_x_with_other_strides", "out", "", [](RotaryArgs& a) {
    a.out = a.x;
    a.out.stride[0] = 6;  // the same first element, rows read as heads
    a.out.shape[1] = 1;
    a.x.shape[1] = 1;
  });
  expect_rotary_error("f64_on_a_fast_backend", "x.dtype", "", [](RotaryArgs& a) {
    a.x.dtype = DType::f64;
    a.ctx.backend = Backend::cpu;
  });
  expect_rotary_error("cuda_with_host_tensors", "ctx.backend", "",
                      [](RotaryArgs& a) { a.ctx.backend = Backend::cuda; });
  expect_rotary_error("threads_negative", "ctx.num_threads", "-1", [](RotaryArgs& a) { a.ctx.num_threads = -1; });
  expect_rotary_error("inv_freq_absent", "inv_freq", "absent", [](RotaryArgs& a) { a.inv_freq = {}; });
  expect_rotary_error("inv_freq_length", "inv_freq.shape[0]", "2", [](RotaryArgs& a) { a.inv_freq.shape[0] = 2; });
  expect_rotary_error("inv_freq_dtype", "inv_freq.dtype", "f64",
                      [](RotaryArgs& a) { a.inv_freq.dtype = DType::f64; });
  expect_rotary_error("inv_freq_device", "inv_freq.device", "cuda:0",
                      [](RotaryArgs& a) { a.inv_freq.device = Device::cuda; });
  expect_rotary_error("positions_length", "positions.shape[0]", "6",
                      [](RotaryArgs& a) { a.positions.shape[0] = 6; });
  expect_rotary_error("positions_dtype", "positions.dtype", "f32",
                      [](RotaryArgs& a) { a.positions.dtype = DType::f32; });
  expect_rotary_error("positions_rank", "positions.ndim", "2", [](RotaryArgs& a) { a.positions.ndim = 2; });
  expect_rotary_error("positions_negative", "positions[3]", "-1",
                      [](RotaryArgs& a) { static_cast<int32_t*>(a.positions.data)[3] = -1; });
  expect_rotary_error("cu_seqlens_end", "cu_seqlens[2]", "6",
                      [](RotaryArgs& a) { static_cast<int32_t*>(a.seqs.cu_seqlens.data)[2] = 6; });
  expect_rotary_error("cu_seqlens_dtype", "cu_seqlens.dtype", "f32",
                      [](RotaryArgs& a) { a.seqs.cu_seqlens.dtype = DType::f32; });
  expect_rotary_error("max_seqlen_negative", "seqs.max_seqlen", "-1", [](RotaryArgs& a) { a.seqs.max_seqlen = -1; });
  expect_rotary_error("max_seqlen_short", "seqs.max_seqlen", "3", [](RotaryArgs& a) { a.seqs.max_seqlen = 3; });
}

// ---- The CUDA kernel's launch shape (tile_sizes.h) ----------------------------------------------

TEST(Rotary, CudaLaunchShapeCoversEveryTokenChunkAndHead) {
  using namespace cuda::rotary;
  int checked = 0;
  for (int64_t T : {int64_t(1), int64_t(7), int64_t(255), int64_t(256), int64_t(65536), int64_t(2147483647)})
    for (int64_t H : {int64_t(1), int64_t(8), int64_t(9), int64_t(17), int64_t(524280), int64_t(524281),
                      int64_t(2147483647)})
      for (int64_t chunks : {int64_t(1), int64_t(3), int64_t(8), int64_t(16), int64_t(32), int64_t(33), int64_t(65)}) {
        const Shape s = shape_of(T, H, chunks);
        ASSERT_TRUE(s.lanes >= 1 && s.lanes <= 32 && (s.lanes & (s.lanes - 1)) == 0) << s.lanes;
        ASSERT_EQ(s.lanes * s.tokens, kThreads);
        ASSERT_GE(s.lanes, std::min<int64_t>(chunks, 32));  // no lane idle while another loops
        ASSERT_GE(s.grid_x * s.tokens, T);
        ASSERT_LT((s.grid_x - 1) * s.tokens, T);
        ASSERT_LE(s.grid_x, int64_t{2147483647});
        ASSERT_GE(s.grid_y * s.heads_per_group, H);
        ASSERT_LE(s.grid_y, kMaxGridY);
        ASSERT_GE(s.heads_per_group, kHeadsPerGroup);
        ++checked;
      }
  EXPECT_EQ(checked, 6 * 7 * 7);
}

}  // namespace
}  // namespace nsa::test
