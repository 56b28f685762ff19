// Helpers of the CPU backend tests: fp64 copies of a problem (the "truth"), the reference on the
// storage dtype (the error of a plain same-precision implementation: its only error is rounding
// the outputs), workspaces, and the tolerance rule of style.md.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/common.h"
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

// Error bound of style.md: at most twice the error of the plain same-precision implementation
// (here: the exact result rounded to the storage dtype) plus a tiny floor relative to the size of
// the values (fp32 accumulation over long sums).
inline double tolerance(const std::vector<double>& truth, const std::vector<double>& rounded) {
  const double baseline = max_abs_diff(truth, rounded);
  constexpr double kFloor = 2e-5;
  return 2.0 * baseline + kFloor * std::max(1.0, max_abs(truth));
}

// Expects `got` close to `truth` per tolerance(); names the tensor on failure.
inline void expect_close(const std::string& name, const std::vector<double>& got,
                         const std::vector<double>& truth, const std::vector<double>& rounded) {
  const double err = max_abs_diff(got, truth);
  const double tol = tolerance(truth, rounded);
  EXPECT_LE(err, tol) << name << ": max error " << err << " vs tolerance " << tol
                      << " (plain-precision error " << max_abs_diff(truth, rounded) << ")";
}

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

inline std::vector<double> values_of(const HostTensor& t) { return t.values(); }

inline const char* dtype_label(DType d) { return dtype_name(d); }

}  // namespace nsa::test
