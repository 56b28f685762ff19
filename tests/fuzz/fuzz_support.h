// The API fuzzer's shared pieces (tests/fuzz/fuzz_main.cpp says what the fuzzer does): the case
// being run (for the crash handler and the watchdog), random draws, outcomes, comparisons with the
// reference, problems, and the mutations that break exactly one parameter.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "decode_support.h"
#include "test_cpu_support.h"

#if defined(__has_include)
#if __has_include(<sanitizer/common_interface_defs.h>) && (defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__))
#include <sanitizer/common_interface_defs.h>
#define NSA_FUZZ_SANITIZER 1
#endif
#endif

namespace nsa::fuzz {

using test::HostCache;
using test::HostTensor;
using test::LayerProblem;
using test::OwnedWorkspace;
using test::Sizes;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();
// A workspace this large for a problem of a few hundred tokens is itself a defect (a size that
// grows with a configuration integer instead of the tensors): reported, never allocated.
constexpr size_t kMaxCaseWorkspace = size_t{1} << 30;

// ---- The case being run (read by the watchdog and the crash handler) -------------------------

inline char g_case_text[4096];
inline std::atomic<int64_t> g_case_start_ms{-1};

inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline std::atomic<bool> g_reported{false};

inline void print_current_case(const char* why) {
  // Async-signal-safe: write(2) of preformatted text, once (every thread of a parallel region
  // may fault at the same time).
  if (g_reported.exchange(true)) return;
  const char* head = "\nnsa_fuzz: ";
  (void)!write(2, head, std::strlen(head));
  (void)!write(2, why, std::strlen(why));
  const char* mid = " in case: ";
  (void)!write(2, mid, std::strlen(mid));
  (void)!write(2, g_case_text, std::strlen(g_case_text));
  (void)!write(2, "\n", 1);
}

inline void on_fatal_signal(int sig) {
  print_current_case(sig == SIGSEGV ? "SIGSEGV" : sig == SIGABRT ? "SIGABRT" : sig == SIGFPE ? "SIGFPE" : "fatal signal");
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

#ifdef NSA_FUZZ_SANITIZER
inline void on_sanitizer_death() { print_current_case("sanitizer report"); }
#endif

// ---- Random draws ------------------------------------------------------------------------------

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  int64_t range(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(g() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(g) < p; }
  template <typename T>
  T pick(std::initializer_list<T> v) {
    return *(v.begin() + range(0, static_cast<int64_t>(v.size()) - 1));
  }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(range(0, static_cast<int64_t>(v.size()) - 1))];
  }
};

inline uint64_t case_seed(uint64_t seed, uint64_t index) {
  // splitmix64 of (seed, index): cases are independent of each other and of the case count.
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline std::string i64(int64_t v) { return std::to_string(v); }

// ---- Outcomes ----------------------------------------------------------------------------------

enum class Op {
  forward, backward, compress_fwd, compress_bwd, compressed_attention_fwd, select_topn, selected_attention_fwd,
  window_attention_fwd, dense_attention_fwd, dense_attention_bwd, decode, dense_decode, workspace_size,
};
inline const char* op_name(Op op) {
  switch (op) {
    case Op::forward: return "forward";
    case Op::backward: return "backward";
    case Op::compress_fwd: return "compress_fwd";
    case Op::compress_bwd: return "compress_bwd";
    case Op::compressed_attention_fwd: return "compressed_attention_fwd";
    case Op::select_topn: return "select_topn";
    case Op::selected_attention_fwd: return "selected_attention_fwd";
    case Op::window_attention_fwd: return "window_attention_fwd";
    case Op::dense_attention_fwd: return "dense_attention_fwd";
    case Op::dense_attention_bwd: return "dense_attention_bwd";
    case Op::decode: return "cache_append+decode";
    case Op::dense_decode: return "dense_decode";
    case Op::workspace_size: return "workspace_size";
  }
  return "?";
}

// What a case expects and what happened.
struct Case {
  uint64_t index = 0;
  Op op = Op::forward;
  std::string text;    // the case, for reports
  std::string expect;  // the parameter the case broke; empty: the call must succeed
  std::string mutation = "none";
};

// Thrown by a comparison that fails (a silent wrong answer) or by the harness for a defect.
struct Defect {
  std::string what;
};

// ---- Comparisons (the style.md rule of tests/test_cpu_support.h) -------------------------------

// The storage dtype of the case, for the tolerance's unit roundoff.
inline DType g_dtype = DType::f32;
// Whether the case computes on the CPU backend's bf16 matrix path (bf16 inputs where the kernel
// table has bf16 products): its results follow test::matrix_tolerance (tests/test_cpu_support.h).
inline bool g_matrix_rule = false;
// How far the fuzzer widens the bf16 matrix rule, in units of u max|x| (expect_close): 8 for
// forward results, 32 for gradients (run_case).
inline double g_matrix_widen = 8.0;

inline double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::bf16: return 0x1p-8;
    case DType::f16: return 0x1p-11;
    case DType::f32: return 0x1p-24;
    default: return 0.0;
  }
}

// test::tolerance (twice the error of the truth rounded to the storage dtype, plus a floor), with
// that rounding error widened by an ulp of the largest value (twice the unit roundoff): a tensor of
// a few elements can round luckily where a plain same-precision implementation need not, and the
// inputs a backward reads (o, lse) carry their own rounding.
// On the bf16 matrix path: test::matrix_tolerance per element, max_x the largest value of the
// tensor (or of the group the caller gives, as phi's parameters), widened by g_matrix_widen u
// max_x: 8 (3%) for forward results, 32 (12.5%) for gradients. The fuzzer's problems are tiny
// (head dims and phi widths down to 1, a handful of keys per row), and the rows of dS sum to zero:
// a gradient element is a cancelling sum whose bf16 rounding error follows the size of its terms,
// not max_x (seen: dq of a 2-token dense backward with Dqk = 1 off by 18 u max_x, phi's dW1 with
// F = 1 by 14 u max_x). The accuracy of the bf16 path on realistic shapes is pinned by the unit
// tests (tests/test_cpu_*.cpp, every kernel table, 2 u (|x| + max|x|)); here a wrong index, mask
// or missing term must still show.
inline void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& truth,
                         const std::vector<double>& rounded, double max_x = -1.0) {
  if (g_matrix_rule) {
    if (got.size() != truth.size()) throw Defect{what + ": sizes differ"};
    const double mx = max_x >= 0 ? max_x : test::max_abs(truth);
    for (size_t i = 0; i < got.size(); ++i)
      if (!(std::fabs(got[i] - truth[i]) <= test::matrix_tolerance(truth[i], mx) + g_matrix_widen * 0x1p-8 * mx))
        throw Defect{what + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", expected " +
                     std::to_string(truth[i]) + " (bf16 matrix rule, max|x| " + std::to_string(mx) + ")"};
    return;
  }
  const double err = test::max_abs_diff(got, truth);
  const double tol = test::tolerance(truth, rounded) + 4.0 * unit_roundoff(g_dtype) * test::max_abs(truth);
  if (!(err <= tol))
    throw Defect{what + ": max error " + std::to_string(err) + " above the tolerance " + std::to_string(tol)};
}

// f32 outputs every run shares (lse, scores): the f32 rounding of the truth.
inline void expect_close_f32(const std::string& what, const std::vector<double>& got, const std::vector<double>& truth) {
  const double err = test::max_abs_diff(got, truth);
  const double tol = 2e-5 * std::max(1.0, test::max_abs(truth));
  if (!(err <= tol))
    throw Defect{what + ": max error " + std::to_string(err) + " above " + std::to_string(tol)};
}

inline void expect_equal(const std::string& what, const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) throw Defect{what + ": sizes differ"};
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))))
      throw Defect{what + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", expected " +
                   std::to_string(want[i])};
}

inline HostTensor to_f64(const HostTensor& t) { return test::convert(t, DType::f64); }
inline std::vector<double> rounded_to(const HostTensor& truth, DType dt) {
  return test::convert(test::convert(truth, dt), DType::f64).values();
}


// ---- Problems ----------------------------------------------------------------------------------

struct Draw {
  Config cfg;
  Sizes sizes;
  Backend backend = Backend::cpu;
  int threads = 0;
  bool extreme_scale = false;  // a valid scale so large that results are compared by their range only
  std::vector<int64_t> backbone;
};

inline std::string describe(const Draw& d) {
  std::ostringstream s;
  const Config& c = d.cfg;
  s << "backend=" << backend_name(d.backend) << " threads=" << d.threads << " dtype=" << dtype_name(d.sizes.dtype)
    << " l=" << c.cmp_block_len << " d=" << c.cmp_stride << " l'=" << c.slc_block_len << " n=" << c.n_selected
    << " n_init=" << c.n_init << " n_local=" << c.n_local << " w=" << c.window << " scale=" << c.scale
    << " phi=" << phi_kind_name(c.phi) << " shared_kv=" << c.shared_kv << " backbone=[";
  for (int64_t k = 0; k < c.num_backbone; ++k) s << (k ? "," : "") << c.backbone_offsets[k];
  s << "] seqlens=[";
  for (size_t b = 0; b < d.sizes.seqlens.size(); ++b) s << (b ? "," : "") << d.sizes.seqlens[b];
  s << "] hq=" << d.sizes.hq << " hkv=" << d.sizes.hkv << " dqk=" << d.sizes.dqk << " dv=" << d.sizes.dv
    << " F=" << d.sizes.phi_hidden;
  return s.str();
}

// A valid configuration with awkward values: lengths not dividing each other more than the spec
// requires, n above the block count, forced blocks filling n, the backbone, a window of 1 or of
// 2^31 - 1, l' = 2^31 - 1 (prime: d = 1).
inline Config draw_config(Rng& r, bool for_cache) {
  Config c;
  c.cmp_stride = r.pick<int64_t>({1, 2, 4, 8});
  c.cmp_block_len = c.cmp_stride * r.pick<int64_t>({1, 2, 3, 4});
  c.slc_block_len = c.cmp_stride * r.pick<int64_t>({1, 2, 3, 4, 8});
  if (r.chance(0.15)) c.slc_block_len = std::max<int64_t>(64, c.cmp_stride);  // whole 64-key chunks
  if (!for_cache && r.chance(0.08)) {
    c.cmp_stride = 1;
    c.cmp_block_len = r.pick<int64_t>({1, 2, 5});
    c.slc_block_len = r.pick<int64_t>({kMaxLength, int64_t{1} << 30});
  }
  c.n_selected = r.pick<int64_t>({0, 1, 2, 3, 4, 7, 20});
  if (c.n_selected > 0) {
    c.n_init = r.range(0, std::min<int64_t>(c.n_selected, 2));
    c.n_local = r.range(0, std::min<int64_t>(c.n_selected - c.n_init, 2));
    const int64_t room = std::min<int64_t>(c.n_selected - c.n_init - c.n_local, 2);
    std::vector<int64_t> offsets;
    for (int64_t k = 0, nb = r.chance(0.3) ? r.range(0, room) : 0; k < nb; ++k) {
      int64_t o = r.range(1, 6);
      while (std::find(offsets.begin(), offsets.end(), o) != offsets.end()) ++o;
      offsets.push_back(o);
    }
    c.set_backbone(offsets);
  } else {
    c.n_init = r.range(0, 3);  // ignored without selection
    c.n_local = r.range(0, 3);
  }
  c.window = r.pick<int64_t>({0, 1, 3, 12, 40, kMaxLength});
  c.scale = r.pick<double>({0.0, 0.0, 0.05, 0.3, 1.5});
  c.phi = r.pick<PhiKind>({PhiKind::mean, PhiKind::linear, PhiKind::mlp});
  c.shared_kv = r.chance(0.3);
  return c;
}

inline Sizes draw_sizes(Rng& r, DType dtype) {
  Sizes s;
  s.seqlens.clear();
  const int64_t B = r.range(1, 3);
  for (int64_t b = 0; b < B; ++b)
    s.seqlens.push_back(static_cast<int32_t>(r.pick<int64_t>({0, 1, 2, 7, r.range(3, 40), r.range(40, 90)})));
  s.hkv = r.range(1, 3);
  s.hq = s.hkv * r.pick<int64_t>({1, 2, 3, 4});
  s.dqk = r.pick<int64_t>({1, 3, 8, 16});
  s.dv = r.pick<int64_t>({1, 5, 8});
  s.phi_hidden = r.pick<int64_t>({1, 4, 6});
  s.dtype = dtype;
  return s;
}

inline Draw draw_problem(Rng& r, bool for_cache) {
  Draw d;
  d.backend = r.chance(0.7) ? Backend::cpu : Backend::reference;
  const DType dt = d.backend == Backend::reference ? r.pick<DType>({DType::f64, DType::f32, DType::bf16, DType::f16})
                                                   : r.pick<DType>({DType::f32, DType::bf16, DType::f16});
  d.cfg = draw_config(r, for_cache);
  d.sizes = draw_sizes(r, dt);
  d.threads = static_cast<int>(r.pick<int64_t>({0, 0, 1, 2, 3}));
  if (r.chance(0.04)) {
    d.cfg.scale = r.pick<double>({1e4, 1e30, static_cast<double>(std::numeric_limits<float>::max())});
    d.extreme_scale = true;
  }
  return d;
}

inline int64_t longest(const Sizes& s) {
  int64_t m = 0;
  for (int32_t n : s.seqlens) m = std::max<int64_t>(m, n);
  return m;
}

// A copy of `t` in storage with padding after every dimension but the last: a valid view whose
// outer strides are not the contiguous ones (a slice of a larger tensor).
struct Padded {
  HostTensor storage;
  TensorView view;
};
inline Padded padded_copy(const HostTensor& t, Rng& r) {
  Padded p;
  const std::vector<int64_t>& shape = t.shape();
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> pad(static_cast<size_t>(nd), 0), stride(static_cast<size_t>(nd), 1);
  for (int k = 0; k < nd - 1; ++k) pad[static_cast<size_t>(k)] = r.range(0, 3);
  // Strides from the padded extents (row-major over shape + pad, last dimension unpadded).
  int64_t st = 1;
  for (int k = nd - 1; k >= 0; --k) {
    stride[static_cast<size_t>(k)] = st;
    st *= shape[static_cast<size_t>(k)] + (k == nd - 1 ? 0 : pad[static_cast<size_t>(k)]);
  }
  p.storage = HostTensor(t.dtype(), {std::max<int64_t>(st, 1)});
  p.storage.poison();
  p.view = TensorView();
  p.view.data = p.storage.data();
  p.view.dtype = t.dtype();
  p.view.ndim = nd;
  for (int k = 0; k < nd; ++k) {
    p.view.shape[k] = shape[static_cast<size_t>(k)];
    p.view.stride[k] = stride[static_cast<size_t>(k)];
  }
  // Copy element by element.
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off = 0;
    for (int k = nd - 1; k >= 0; --k) {
      const int64_t e = shape[static_cast<size_t>(k)];
      off += (rem % e) * stride[static_cast<size_t>(k)];
      rem /= e;
    }
    p.storage.set(off, t.get(i));
  }
  return p;
}

// ---- Arguments and their mutations -------------------------------------------------------------

// One tensor argument of a call, as the validation sees it.
struct Arg {
  std::string name;
  TensorView* view = nullptr;
  std::vector<char> fixed;  // per dimension: checked against a value that other arguments define
  bool required = true;
  bool own_dtype = false;   // checked against its own dtype (f32 lse/scores, i32 indices), not the call's
};

struct Mutation {
  std::string text;
  std::string expect;  // empty: still valid
};

// Breaks one property of one argument (the argument must not define other arguments' shapes in the
// broken property); returns what the validation must name.
inline Mutation mutate_arg(Rng& r, Arg& a, DType call_dtype) {
  TensorView& t = *a.view;
  for (int attempt = 0; attempt < 20; ++attempt) {
    switch (r.range(0, 7)) {
      case 0:
        if (!a.required || !t.defined()) break;
        t = TensorView();
        return {a.name + " absent", a.name};
      case 1: {
        if (!t.defined()) break;
        if (t.ndim > 1 && r.chance(0.5)) {
          t.ndim -= 1;
        } else if (t.ndim < kMaxDims) {
          t.shape[t.ndim] = 1;
          t.stride[t.ndim] = 1;
          t.ndim += 1;
        } else {
          break;
        }
        return {a.name + ".ndim = " + std::to_string(t.ndim), a.name + ".ndim"};
      }
      case 2: {
        if (!t.defined()) break;
        std::vector<int> dims;
        for (int k = 0; k < t.ndim; ++k)
          if (a.fixed[static_cast<size_t>(k)]) dims.push_back(k);
        if (dims.empty()) break;
        const int k = r.pick(dims);
        const int64_t was = t.shape[k];
        const int64_t now = r.pick<int64_t>({was + 1, was - 1, -1, 0, int64_t{1} << 31, kI64Max, kI64Min});
        if (now == was) break;
        t.shape[k] = now;
        return {a.name + ".shape[" + std::to_string(k) + "] = " + i64(now), a.name + ".shape[" + std::to_string(k) + "]"};
      }
      case 3: {
        if (!t.defined()) break;
        const DType want = a.own_dtype ? t.dtype : call_dtype;
        DType now = r.pick<DType>({DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32});
        if (now == want) break;
        t.dtype = now;
        return {a.name + ".dtype = " + dtype_name(now), a.name + ".dtype"};
      }
      case 4:
        if (!t.defined()) break;
        t.device = Device::cuda;
        return {a.name + ".device = cuda", a.name + ".device"};
      case 5: {
        if (!t.defined()) break;
        const int last = t.ndim - 1;
        if (t.shape[last] > 1 && r.chance(0.5)) {
          t.stride[last] = r.pick<int64_t>({2, 0});
          return {a.name + ".stride[last] = " + i64(t.stride[last]), a.name + ".stride[" + std::to_string(last) + "]"};
        }
        const int k = static_cast<int>(r.range(0, last));
        t.stride[k] = r.pick<int64_t>({-1, -t.stride[k] - 1, kI64Min});
        return {a.name + ".stride[" + std::to_string(k) + "] negative", a.name + ".stride[" + std::to_string(k) + "]"};
      }
      case 6:
        if (!t.defined() || t.numel() == 0) break;
        t.data = nullptr;
        return {a.name + ".data = null", a.name + ".data"};
      case 7:
        break;
    }
  }
  return {"none", ""};
}

// Breaks one configuration field; dense calls only have a scale.
inline Mutation mutate_config(Rng& r, Config& c, bool dense_only) {
  if (dense_only) {
    c.scale = r.pick<double>({-0.5, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(),
                              std::nan(""), 1e39, std::numeric_limits<double>::max(), -0.0 - 1e-300});
    return {"scale = " + std::to_string(c.scale), "scale"};
  }
  const std::vector<int64_t> huge = {int64_t{1} << 31, int64_t{1} << 62, kI64Max};
  const std::vector<int64_t> low = {0, -1, -7, kI64Min};
  for (;;) {
    switch (r.range(0, 13)) {
      case 0: {
        c.cmp_block_len = r.chance(0.5) ? r.pick(huge) : r.pick(low);
        return {"l = " + i64(c.cmp_block_len), "cmp_block_len (l)"};
      }
      case 1: {
        c.cmp_stride = r.chance(0.5) ? r.pick(huge) : r.pick(low);
        return {"d = " + i64(c.cmp_stride), "cmp_stride (d)"};
      }
      case 2: {
        c.slc_block_len = r.chance(0.5) ? r.pick(huge) : r.pick(low);
        return {"l' = " + i64(c.slc_block_len), "slc_block_len (l')"};
      }
      case 3: {  // d does not divide l, or does not divide l'
        int64_t nd = c.cmp_stride + r.range(1, 5);
        if (c.cmp_block_len % nd != 0 || c.slc_block_len % nd != 0) {
          c.cmp_stride = nd;
          return {"d = " + i64(nd) + " not dividing l or l'", "cmp_stride (d)"};
        }
        break;
      }
      case 4:
        c.n_selected = r.chance(0.5) ? r.pick(huge) : r.pick<int64_t>({-1, kI64Min});
        return {"n = " + i64(c.n_selected), "n_selected (n)"};
      case 5:
        c.n_init = r.chance(0.5) ? r.pick(huge) : r.pick<int64_t>({-1, kI64Min});
        return {"n_init = " + i64(c.n_init), "n_init"};
      case 6:
        c.n_local = r.chance(0.5) ? r.pick(huge) : r.pick<int64_t>({-1, kI64Min});
        return {"n_local = " + i64(c.n_local), "n_local"};
      case 7:  // the forced blocks exceed n
        if (c.n_selected > 0) {
          c.n_local = c.n_selected - c.n_init + r.range(1, 3);
          return {"n_local = " + i64(c.n_local) + " above n - n_init",
                  c.num_backbone > 0 ? "n_init + n_local + num_backbone" : "n_init + n_local"};
        }
        break;
      case 8:
        c.window = r.chance(0.5) ? r.pick(huge) : r.pick<int64_t>({-1, kI64Min});
        return {"w = " + i64(c.window), "window (w)"};
      case 9:
        c.scale = r.pick<double>({-0.5, -std::numeric_limits<double>::infinity(),
                                  std::numeric_limits<double>::infinity(), std::nan(""), 1e39,
                                  std::numeric_limits<double>::max()});
        return {"scale = " + std::to_string(c.scale), "scale"};
      case 10:
        c.phi = static_cast<PhiKind>(r.pick<int64_t>({3, -1, 1000}));
        return {"phi = " + i64(static_cast<int64_t>(c.phi)), "phi"};
      case 11: {  // a bad backbone offset
        std::vector<int64_t> offsets(c.backbone_offsets, c.backbone_offsets + c.num_backbone);
        const int64_t bad = r.pick<int64_t>({0, -1, int64_t{1} << 31, kI64Max, kI64Min});
        offsets.push_back(bad);
        c.set_backbone(offsets);
        if (c.n_selected > 0) c.n_selected = std::min<int64_t>(kMaxLength, c.n_init + c.n_local + c.num_backbone + 1);
        return {"backbone offset " + i64(bad), "backbone_offsets[" + i64(c.num_backbone - 1) + "]"};
      }
      case 12: {  // a repeated backbone offset
        if (c.num_backbone == 0) break;
        std::vector<int64_t> offsets(c.backbone_offsets, c.backbone_offsets + c.num_backbone);
        offsets.push_back(offsets.front());
        c.set_backbone(offsets);
        if (c.n_selected > 0) c.n_selected = c.n_init + c.n_local + c.num_backbone + 1;
        return {"backbone offset repeated", "backbone_offsets[" + i64(c.num_backbone - 1) + "]"};
      }
      case 13:
        c.num_backbone = r.pick<int64_t>({-1, kMaxBackbone + 1, kI64Max});
        return {"num_backbone = " + i64(c.num_backbone), "num_backbone"};
    }
  }
}

// Breaks the host sequence table `cu` ([B+1] int32 over T) or the declared max_seqlen of a
// prefill call.
inline Mutation mutate_sequences(Rng& r, HostTensor& cu, Sequences& seqs, int64_t T, int64_t longest_seq) {
  const std::string name = "cu_seqlens";
  const int64_t B = cu.defined() ? cu.shape()[0] - 1 : 0;
  for (;;) {
    switch (r.range(0, 6)) {
      case 0:
        if (!seqs.cu_seqlens.defined()) break;
        cu.set(0, r.pick<int64_t>({1, -1, kI32Max, kI32Min}));
        return {name + "[0] != 0", name + "[0]"};
      case 1: {  // an interior entry below its predecessor
        if (!seqs.cu_seqlens.defined() || B < 2) break;
        const int64_t b = r.range(1, B - 1);
        const int64_t before = static_cast<int64_t>(cu.get(b - 1));
        cu.set(b, static_cast<double>(r.chance(0.5) ? before - 1 : kI32Min));
        return {name + "[" + i64(b) + "] decreasing", name + "[" + i64(b) + "]"};
      }
      case 2: {  // an interior entry above its successor: the successor is named
        if (!seqs.cu_seqlens.defined() || B < 2) break;
        const int64_t b = r.range(1, B - 1);
        const int64_t after = static_cast<int64_t>(cu.get(b + 1));
        cu.set(b, static_cast<double>(r.chance(0.5) ? after + 1 : kI32Max));
        return {name + "[" + i64(b) + "] above the next", name + "[" + i64(b + 1) + "]"};
      }
      case 3: {  // the total is not T
        if (!seqs.cu_seqlens.defined()) break;
        const int64_t now = r.pick<int64_t>({T + 1, T + 1000, kI32Max, kI32Min, T - 1});
        if (now == T) break;
        cu.set(B, static_cast<double>(now));
        return {name + "[B] = " + i64(now), name + "[" + i64(B) + "]"};
      }
      case 4:
        seqs.max_seqlen = r.pick<int64_t>({-1, kI64Min, int64_t{1} << 31, kI64Max});
        return {"max_seqlen = " + i64(seqs.max_seqlen), "seqs.max_seqlen"};
      case 5:
        if (longest_seq < 2) break;
        seqs.max_seqlen = r.range(1, longest_seq - 1);
        return {"max_seqlen below the longest", "seqs.max_seqlen"};
      case 6:
        if (!seqs.cu_seqlens.defined()) break;
        seqs.cu_seqlens.shape[0] = 0;
        return {name + " with no entries", name + ".shape[0]"};
    }
  }
}

// Breaks the context or the workspace of a call that needs `need` bytes.
inline Mutation mutate_context(Rng& r, Context& ctx, Workspace& ws, size_t need, const std::string& main_name,
                        DType dtype) {
  for (;;) {
    switch (r.range(0, 5)) {
      case 0:
        ctx.num_threads = static_cast<int>(r.pick<int64_t>({-1, INT_MIN}));
        return {"ctx.num_threads = " + std::to_string(ctx.num_threads), "ctx.num_threads"};
      case 1:
        ctx.backend = static_cast<Backend>(r.pick<int64_t>({4, -1, 99}));
        return {"ctx.backend out of range", "ctx.backend"};
      case 2:
        if (backend_available(Backend::cuda)) break;
        ctx.backend = Backend::cuda;
        return {"ctx.backend = cuda without a device", "ctx.backend"};
      case 3:
        if (need == 0) break;
        ws.bytes = need - 1 - static_cast<size_t>(r.range(0, static_cast<int64_t>(std::min<size_t>(need - 1, 100))));
        return {"workspace one short", "workspace.bytes"};
      case 4:
        if (need == 0) break;
        if (r.chance(0.5)) {
          ws.data = nullptr;
        } else {
          ws.data = static_cast<char*>(ws.data) + 64;
          ws.bytes -= 64;
          if (ws.bytes < need) return {"workspace misaligned and short", "workspace.bytes"};
        }
        return {"workspace.data null or misaligned", "workspace.data"};
      case 5:
        if (dtype != DType::f64 || ctx.backend != Backend::reference) break;
        ctx.backend = Backend::cpu;
        return {"f64 on the cpu backend", main_name + ".dtype"};
    }
  }
}


}  // namespace nsa::fuzz
