// Helpers of the CPU backend tests: fp64 copies of a problem (the "truth"), the reference on the
// storage dtype (the error of a plain same-precision implementation: its only error is rounding
// the outputs), workspaces, and the tolerance rule of style.md.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/common.h"
#include "cpu/kernels.h"
#include "support.h"

namespace nsa::test {

inline HostTensor convert(const HostTensor& t, DType dtype) {
  if (!t.defined()) return HostTensor();
  HostTensor out(dtype, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) out.set(i, t.get(i));
  return out;
}

// The same problem with every float tensor in fp64 (values identical: already rounded).
inline LayerProblem to_f64(const LayerProblem& p) {
  LayerProblem q = p;
  auto conv = [](HostTensor& t) {
    if (t.defined() && t.dtype() != DType::i32) t = convert(t, DType::f64);
  };
  conv(q.q);
  conv(q.g);
  for (int b = 0; b < 3; ++b) {
    conv(q.k[b]);
    conv(q.v[b]);
    conv(q.dk[b]);
    conv(q.dv[b]);
  }
  for (int i = 0; i < 5; ++i) {
    conv(q.phi_k[i]);
    conv(q.phi_v[i]);
    conv(q.dphi_k[i]);
    conv(q.dphi_v[i]);
  }
  conv(q.o);
  conv(q.o_branch);
  conv(q.d_o);
  conv(q.dq);
  conv(q.dg);
  q.sizes.dtype = DType::f64;
  return q;
}

// An owned, 256-byte aligned workspace.
// A named layer problem of the CPU test tables.
struct CpuCase {
  std::string name;
  Config cfg;
  Sizes sizes;
};

// Runs body(c, s, p, seed) for every case in order, under a trace of the case's name: s the case's
// sizes in `dtype`, p its problem made with `seed`, first_seed for the first case and one more for
// each next one.
template <class Body>
void for_each_case(const std::vector<CpuCase>& cases, DType dtype, uint64_t first_seed, Body body) {
  uint64_t seed = first_seed;
  for (const CpuCase& c : cases) {
    SCOPED_TRACE(c.name);
    Sizes s = c.sizes;
    s.dtype = dtype;
    LayerProblem p = make_problem(c.cfg, s, seed);
    body(c, s, p, seed++);
  }
}

struct OwnedWorkspace {
  std::vector<unsigned char> bytes;
  Workspace ws;
  explicit OwnedWorkspace(size_t n) : bytes(n + 256) {
    auto addr = reinterpret_cast<uintptr_t>(bytes.data());
    ws.data = bytes.data() + ((256 - addr % 256) % 256);
    ws.bytes = n;
  }
};

// Workspace of `op` for `threads` threads (0: the default) on the cpu backend.
inline OwnedWorkspace cpu_workspace(Op op, const Config& cfg, const Problem& pr, int threads = 0) {
  Context ctx = context_of(Backend::cpu);
  ctx.num_threads = threads;
  return OwnedWorkspace(workspace_size(ctx, op, cfg, pr));
}

// Whether the running test computes on the bf16 matrix path (bf16 inputs on the amx or
// avx512bf16 kernel table); set by IsaTest.
inline bool& matrix_rule() {
  static bool on = false;
  return on;
}

// Error bound of style.md: at most twice the error of the plain same-precision implementation
// (here: the exact result rounded to the storage dtype) plus a tiny floor relative to the size of
// the values (fp32 accumulation over long sums).
inline double tolerance(const std::vector<double>& truth, const std::vector<double>& rounded) {
  const double baseline = max_abs_diff(truth, rounded);
  constexpr double kFloor = 2e-5;
  return 2.0 * baseline + kFloor * std::max(1.0, max_abs(truth));
}

// The bf16 matrix path rounds the operands of its products to bf16 (P, dS, gate * dO, the fp32
// compressed values), as a plain bf16 implementation does (FlashAttention, PyTorch's bf16 SDPA),
// so the output-rounding baseline above is too optimistic for it: a plain bf16 forward or backward
// carries an error of about u (|x| + max|x|) per element (u = 2^-8; the second term is the rounding
// of the terms of the fp32 sums, which does not shrink with the element because of cancellation),
// also in its fp32 outputs (dg, phi's gradients). The same rule as the CUDA tests
// (tests/cuda/test_cuda_backward.cpp): twice that, plus the floor above. For phi's parameters
// max|x| is taken over all the parameters of the same phi (max_x; by default the tensor's own).
inline double matrix_tolerance(double x, double max_x) {
  constexpr double kU = 1.0 / 256;
  constexpr double kFloor = 2e-5;
  return 2.0 * kU * (std::fabs(x) + max_x) + kFloor * std::max(1.0, max_x);
}

// Expects `got` close to `truth` per tolerance() (or matrix_tolerance() on the bf16 matrix path);
// names the tensor on failure.
inline void expect_close(const std::string& name, const std::vector<double>& got,
                         const std::vector<double>& truth, const std::vector<double>& rounded,
                         double max_x = -1.0) {
  if (matrix_rule()) {
    ASSERT_EQ(got.size(), truth.size()) << name;
    const double mx = max_x >= 0 ? max_x : max_abs(truth);
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(got[i] - truth[i]);
      if (!(err <= matrix_tolerance(truth[i], mx)) && bad++ == 0) first = i;
      worst = std::max(worst, err);
    }
    EXPECT_EQ(bad, 0u) << name << ": " << bad << " of " << got.size() << " elements out of tolerance (bf16 matrix "
                       << "rule), first at " << first << ": " << (got.empty() ? 0.0 : got[first]) << " vs "
                       << (truth.empty() ? 0.0 : truth[first]) << "; max error " << worst << ", max|x| " << mx;
    return;
  }
  const double err = max_abs_diff(got, truth);
  const double tol = tolerance(truth, rounded);
  EXPECT_LE(err, tol) << name << ": max error " << err << " vs tolerance " << tol
                      << " (plain-precision error " << max_abs_diff(truth, rounded) << ")";
}

// A check of one tensor against the fp64 truth and the reference on the storage dtype, given the
// bf16 matrix rule's max|x| (negative: the tensor's own): expect_close, or the fuzzer's.
using CloseCheck = void (*)(const std::string& name, const std::vector<double>& got, const std::vector<double>& truth,
                            const std::vector<double>& rounded, double max_x);

// The gradients of `got` against `truth` and `rounded`, each tensor by `close`.
inline void compare_gradients(const LayerProblem& got, const LayerProblem& truth, const LayerProblem& rounded,
                              CloseCheck close = expect_close) {
  close("dq", got.dq.values(), truth.dq.values(), rounded.dq.values(), -1.0);
  close("dg", got.dg.values(), truth.dg.values(), rounded.dg.values(), -1.0);
  static const char* kNames[3] = {"cmp", "slc", "win"};
  for (int b = 0; b < 3; ++b) {
    if (!got.dk[b].defined()) continue;
    close(std::string("dk_") + kNames[b], got.dk[b].values(), truth.dk[b].values(), rounded.dk[b].values(), -1.0);
    close(std::string("dv_") + kNames[b], got.dv[b].values(), truth.dv[b].values(), rounded.dv[b].values(), -1.0);
  }
  static const char* kParams[5] = {"w1", "b1", "w2", "b2", "pe"};
  // The bf16 matrix rule's scale of phi's gradients: the largest over all parameters of that phi.
  double max_k = 0, max_v = 0;
  for (int i = 0; i < 5; ++i)
    if (truth.dphi_k[i].defined()) {
      max_k = std::max(max_k, max_abs(truth.dphi_k[i].values()));
      max_v = std::max(max_v, max_abs(truth.dphi_v[i].values()));
    }
  for (int i = 0; i < 5; ++i) {
    if (!got.dphi_k[i].defined()) continue;
    close(std::string("dphi_k.") + kParams[i], got.dphi_k[i].values(), truth.dphi_k[i].values(),
          rounded.dphi_k[i].values(), max_k);
    close(std::string("dphi_v.") + kParams[i], got.dphi_v[i].values(), truth.dphi_v[i].values(),
          rounded.dphi_v[i].values(), max_v);
  }
}

// ---- One run per kernel table of the CPU backend ------------------------------------------------

struct IsaDtype {
  std::string isa;  // a value of NSA_CPU_ISA
  DType dtype;
};

// Every table with every storage dtype, except that the bf16 matrix tables (whose fp32 and f16
// paths are the avx512 table's) run bf16 only.
inline std::vector<IsaDtype> isa_dtype_params() {
  std::vector<IsaDtype> out;
  for (const char* isa : {"generic", "avx2", "avx512"})
    for (DType t : {DType::f32, DType::bf16, DType::f16}) out.push_back({isa, t});
  for (const char* isa : {"avx512bf16", "amx"}) out.push_back({isa, DType::bf16});
  return out;
}

inline std::string isa_dtype_name(const ::testing::TestParamInfo<IsaDtype>& info) {
  return info.param.isa + "_" + dtype_name(info.param.dtype);
}

// Switches the process to the parameter's kernel table for one test (as NSA_CPU_ISA would) and
// back afterwards; a table this machine cannot run is a skip that names it.
class IsaTest : public ::testing::TestWithParam<IsaDtype> {
 protected:
  void SetUp() override {
    const std::string& isa = GetParam().isa;
    if (!cpu::isa_available(isa.c_str()))
      GTEST_SKIP() << "kernel table " << isa << " not available here (the CPU, the OS or the compiler lacks it)";
    previous_ = cpu::kernels().isa;
    cpu::use_isa(isa.c_str());
    matrix_rule() = GetParam().dtype == DType::bf16 && cpu::kernels().gemm_bf16 != nullptr;
  }
  void TearDown() override {
    if (!previous_.empty()) cpu::use_isa(previous_.c_str());
    matrix_rule() = false;
  }
  DType dtype() const { return GetParam().dtype; }

 private:
  std::string previous_;
};

struct Rowset {
  // (token, kv head) rows whose selected indices agree between two runs.
  std::vector<char> agree;
  int64_t disagree = 0;
};

inline Rowset compare_indices(const HostTensor& a, const HostTensor& b, int64_t T, int64_t hkv, int64_t n) {
  Rowset r;
  r.agree.assign(static_cast<size_t>(T * hkv), 1);
  for (int64_t row = 0; row < T * hkv; ++row)
    for (int64_t k = 0; k < n; ++k)
      if (a.get(row * n + k) != b.get(row * n + k)) {
        r.agree[static_cast<size_t>(row)] = 0;
        ++r.disagree;
        break;
      }
  return r;
}

// Elements of a [T, Hq, X] tensor (or branch b of [3, T, Hq, X]) on rows whose indices agree.
inline std::vector<double> on_rows(const HostTensor& t, const Rowset& rows, int64_t T, int64_t hq, int64_t hkv,
                            int64_t X, int64_t branch = -1) {
  std::vector<double> out;
  const int64_t G = hq / hkv;
  const int64_t base = branch >= 0 ? branch * T * hq * X : 0;
  for (int64_t tok = 0; tok < T; ++tok)
    for (int64_t h = 0; h < hq; ++h) {
      if (!rows.agree[static_cast<size_t>(tok * hkv + h / G)]) continue;
      for (int64_t x = 0; x < X; ++x) out.push_back(t.get(base + (tok * hq + h) * X + x));
    }
  return out;
}

// The layer outputs of `got` against `truth` and `rounded`, each by `close`: the compressed and
// window branches on every row, the selected branch and o on the rows whose indices agree (`rows`).
inline void compare_layer_outputs(const LayerProblem& got, const LayerProblem& truth, const LayerProblem& rounded,
                                  const Rowset& rows, CloseCheck close = expect_close) {
  const int64_t T = got.T, hq = got.sizes.hq, hkv = got.sizes.hkv, dv = got.sizes.dv;
  const Rowset all{std::vector<char>(static_cast<size_t>(T * hkv), 1), 0};
  for (int b : {kCmp, kWin})
    close("o_branch[" + std::to_string(b) + "]", on_rows(got.o_branch, all, T, hq, hkv, dv, b),
          on_rows(truth.o_branch, all, T, hq, hkv, dv, b), on_rows(rounded.o_branch, all, T, hq, hkv, dv, b), -1.0);
  close("o_branch[slc]", on_rows(got.o_branch, rows, T, hq, hkv, dv, kSlc),
        on_rows(truth.o_branch, rows, T, hq, hkv, dv, kSlc), on_rows(rounded.o_branch, rows, T, hq, hkv, dv, kSlc),
        -1.0);
  close("o", on_rows(got.o, rows, T, hq, hkv, dv), on_rows(truth.o, rows, T, hq, hkv, dv),
        on_rows(rounded.o, rows, T, hq, hkv, dv), -1.0);
}

inline std::vector<double> values_of(const HostTensor& t) { return t.values(); }

inline const char* dtype_label(DType d) { return dtype_name(d); }

}  // namespace nsa::test
