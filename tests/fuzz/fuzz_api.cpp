// A seeded fuzzer of the C++ API (include/nsa/api.h, nsa/cache.h) on the host backends.
//
// Each case draws a small problem (configuration, packed sequences, heads, head dims, dtype,
// layout), an operation (the layer's forward and backward, every stage, dense attention, the
// paged cache's append/decode/dense decode, workspace sizes) and a backend (reference or cpu),
// then either leaves it valid (awkward on purpose: empty and one-token sequences, n above the
// block count, l' = 2^31 - 1, a window of 2^31 - 1, a declared max_seqlen far above the longest
// sequence, caller indices with repeats, -1 and blocks past the query, padded strides) or breaks
// exactly one thing (a configuration integer, a tensor's shape, dtype, device, stride or data, the
// sequence table, the page table, the context, the workspace) and knows which parameter it broke.
// Every case must end in one of two ways:
//   - success, with results that match the reference backend (style.md's tolerance: twice the
//     error of the fp64 result rounded to the storage dtype, tests/test_cpu_support.h), or
//   - an nsa::Error whose parameter() is the one the case broke (and whose message names it).
// Anything else fails the run: a crash (the signal handler prints the case), a hang (a watchdog
// thread stops the run after --case-timeout seconds and prints the case), an exception other
// than nsa::Error, an accepted invalid input, an error naming another parameter, or a result
// that does not match.
//
// Usage: nsa_fuzz [--seed S] [--cases N] [--first K] [--case-timeout SEC] [--verbose]
// Case i of seed S is the same on every run and machine (its own generator, seeded from S and i):
// `--first i --cases 1` replays it.
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
namespace {

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

char g_case_text[4096];
std::atomic<int64_t> g_case_start_ms{-1};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic<bool> g_reported{false};

void print_current_case(const char* why) {
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

void on_fatal_signal(int sig) {
  print_current_case(sig == SIGSEGV ? "SIGSEGV" : sig == SIGABRT ? "SIGABRT" : sig == SIGFPE ? "SIGFPE" : "fatal signal");
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

#ifdef NSA_FUZZ_SANITIZER
void on_sanitizer_death() { print_current_case("sanitizer report"); }
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

uint64_t case_seed(uint64_t seed, uint64_t index) {
  // splitmix64 of (seed, index): cases are independent of each other and of the case count.
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string i64(int64_t v) { return std::to_string(v); }

// ---- Outcomes ----------------------------------------------------------------------------------

enum class Op {
  forward, backward, compress_fwd, compress_bwd, compressed_attention_fwd, select_topn, selected_attention_fwd,
  window_attention_fwd, dense_attention_fwd, dense_attention_bwd, decode, dense_decode, workspace_size,
};
const char* op_name(Op op) {
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
DType g_dtype = DType::f32;

double unit_roundoff(DType dt) {
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
void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& truth,
                  const std::vector<double>& rounded) {
  const double err = test::max_abs_diff(got, truth);
  const double tol = test::tolerance(truth, rounded) + 4.0 * unit_roundoff(g_dtype) * test::max_abs(truth);
  if (!(err <= tol))
    throw Defect{what + ": max error " + std::to_string(err) + " above the tolerance " + std::to_string(tol)};
}

// f32 outputs every run shares (lse, scores): the f32 rounding of the truth.
void expect_close_f32(const std::string& what, const std::vector<double>& got, const std::vector<double>& truth) {
  const double err = test::max_abs_diff(got, truth);
  const double tol = 2e-5 * std::max(1.0, test::max_abs(truth));
  if (!(err <= tol))
    throw Defect{what + ": max error " + std::to_string(err) + " above " + std::to_string(tol)};
}

void expect_equal(const std::string& what, const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) throw Defect{what + ": sizes differ"};
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))))
      throw Defect{what + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", expected " +
                   std::to_string(want[i])};
}

HostTensor to_f64(const HostTensor& t) { return test::convert(t, DType::f64); }
std::vector<double> rounded_to(const HostTensor& truth, DType dt) {
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

std::string describe(const Draw& d) {
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
Config draw_config(Rng& r, bool for_cache) {
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

Sizes draw_sizes(Rng& r, DType dtype) {
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

Draw draw_problem(Rng& r, bool for_cache) {
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

int64_t longest(const Sizes& s) {
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
Padded padded_copy(const HostTensor& t, Rng& r) {
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
Mutation mutate_arg(Rng& r, Arg& a, DType call_dtype) {
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
Mutation mutate_config(Rng& r, Config& c, bool dense_only) {
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
Mutation mutate_sequences(Rng& r, HostTensor& cu, Sequences& seqs, int64_t T, int64_t longest_seq) {
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
Mutation mutate_context(Rng& r, Context& ctx, Workspace& ws, size_t need, const std::string& main_name,
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

// ---- Running a call ----------------------------------------------------------------------------

const Case* g_current = nullptr;

// The text the crash handler and the watchdog print: the case, its mutation and expectation.
void note_case() {
  if (g_current == nullptr) return;
  std::snprintf(g_case_text, sizeof g_case_text, "%s | mutation: %s | expected: %s", g_current->text.c_str(),
                g_current->mutation.c_str(), g_current->expect.empty() ? "success" : g_current->expect.c_str());
}

struct Outcome {
  bool ok = false;
  std::string parameter, message;
};

template <typename Fn>
Outcome attempt(Fn&& fn) {
  Outcome o;
  note_case();
  try {
    fn();
    o.ok = true;
  } catch (const Error& e) {
    o.parameter = e.parameter();
    o.message = e.what();
    if (o.parameter.empty() || e.allowed().empty() || o.message.find(o.parameter) == std::string::npos)
      throw Defect{"an nsa::Error without a parameter, an allowed range, or not naming its parameter: " + o.message};
  } catch (const Defect&) {
    throw;
  } catch (const std::exception& e) {
    throw Defect{std::string("an exception other than nsa::Error: ") + e.what()};
  }
  return o;
}

// Checks an outcome against the case's expectation; returns whether the results are to be compared.
bool settle(const Case& c, const Outcome& o) {
  if (c.expect.empty()) {
    if (!o.ok) throw Defect{"a valid call was rejected: " + o.message};
    return true;
  }
  if (o.ok) throw Defect{"an invalid call was accepted (expected an error naming " + c.expect + ")"};
  if (o.parameter != c.expect) throw Defect{"the error names " + o.parameter + ", expected " + c.expect + ": " + o.message};
  return false;
}

// A workspace of `bytes` for the case (none for 0).
struct CaseWorkspace {
  std::unique_ptr<OwnedWorkspace> owned;
  Workspace ws;
  size_t need = 0;
};
CaseWorkspace case_workspace(const Context& ctx, nsa::Op op, const Config& cfg, const Problem& pr) {
  CaseWorkspace w;
  w.need = workspace_size(ctx, op, cfg, pr);
  if (w.need > kMaxCaseWorkspace)
    throw Defect{"workspace_size asks " + std::to_string(w.need) + " bytes for a problem of " +
                 std::to_string(pr.total_tokens) + " tokens"};
  w.owned = std::make_unique<OwnedWorkspace>(w.need);
  w.ws = w.owned->ws;
  // Nothing may rely on the workspace's contents: it arrives full of arbitrary bytes (as from
  // numpy.empty), not zeros or a uniform pattern whose lists all look empty.
  std::mt19937_64 garbage(w.need);
  for (size_t i = 0; i + 8 <= w.owned->bytes.size(); i += 8) {
    const uint64_t x = garbage();
    std::memcpy(w.owned->bytes.data() + i, &x, 8);
  }
  return w;
}

// ---- The layer: forward and backward -----------------------------------------------------------

std::vector<Arg> layer_args(Inputs& in, const Config& cfg) {
  std::vector<Arg> a;
  a.push_back({"k_cmp", &in.kv[kCmp].k, {1, 0, 1}});
  a.push_back({"v_cmp", &in.kv[kCmp].v, {1, 1, 0}});
  if (!cfg.shared_kv) {
    static const char* kNames[3][2] = {{"k_cmp", "v_cmp"}, {"k_slc", "v_slc"}, {"k_win", "v_win"}};
    for (int b = 1; b < 3; ++b) {
      a.push_back({kNames[b][0], &in.kv[b].k, {1, 1, 1}});
      a.push_back({kNames[b][1], &in.kv[b].v, {1, 1, 1}});
    }
  }
  a.push_back({"g", &in.g, {1, 1, 1}});
  auto phi = [&](const std::string& name, PhiParams& p) {
    if (cfg.phi == PhiKind::linear) {
      a.push_back({name + ".w1", &p.w1, {1, 1}});
      a.push_back({name + ".pe", &p.pe, {1, 1}});
    } else if (cfg.phi == PhiKind::mlp) {
      a.push_back({name + ".w1", &p.w1, {0, 1}});
      a.push_back({name + ".b1", &p.b1, {1}});
      a.push_back({name + ".w2", &p.w2, {1, 1}});
      a.push_back({name + ".b2", &p.b2, {1}});
      a.push_back({name + ".pe", &p.pe, {1, 1}});
    }
  };
  phi("phi_k", in.phi_k);
  phi("phi_v", in.phi_v);
  if (in.seqs.cu_seqlens.defined()) a.push_back({"cu_seqlens", &in.seqs.cu_seqlens, {0}, false, true});
  return a;
}

// Caller-provided selection indices [T, Hkv, n] for `cfg`: valid blocks, repeats, -1 and other
// negatives, blocks past the query, past the sequence, up to INT32_MAX. api.h: a row is a set of
// blocks, entries that are negative or past the query add nothing.
HostTensor awkward_indices(Rng& r, const LayerProblem& p, const Config& cfg) {
  const int64_t n = cfg.n_selected, H = p.sizes.hkv;
  HostTensor idx(DType::i32, {p.T, H, n});
  int64_t s0 = 0;
  for (int32_t len : p.sizes.seqlens) {
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t Jt = t / cfg.slc_block_len, row = ((s0 + t) * H + h) * n;
        for (int64_t k = 0; k < n; ++k) {
          int64_t v;
          switch (r.range(0, 7)) {
            case 0: v = -1; break;
            case 1: v = r.pick<int64_t>({-2, kI32Min}); break;
            case 2: v = k > 0 ? static_cast<int64_t>(idx.get(row + r.range(0, k - 1))) : 0; break;  // a repeat
            case 3: v = Jt + r.range(1, 3); break;                                                  // past the query
            case 4: v = r.pick<int64_t>({kI32Max, kI32Max - 1, (len + cfg.slc_block_len - 1) / cfg.slc_block_len}); break;
            default: v = r.range(0, Jt); break;
          }
          idx.set(row + k, static_cast<double>(std::clamp<int64_t>(v, kI32Min, kI32Max)));
        }
      }
    s0 += len;
  }
  return idx;
}

void compare_forward(const Draw& d, LayerProblem& got, LayerProblem& truth, LayerProblem& rounded) {
  const int64_t T = got.T, hq = d.sizes.hq, hkv = d.sizes.hkv, n = d.cfg.n_selected, dv = d.sizes.dv;
  if (d.backend == Backend::reference) {
    // The same fp64 computation on the same values: equal indices, outputs within rounding.
    expect_equal("indices", got.indices.values(), truth.indices.values());
  }
  const test::Rowset all{std::vector<char>(static_cast<size_t>(T * hkv), 1), 0};
  const test::Rowset rows = test::compare_indices(got.indices, truth.indices, T, hkv, n);
  // Near-ties may pick another block (fp32 against fp64 scores): nearly every row agrees, except at
  // an extreme scale, where every score is within an fp32 ulp of another.
  if (!d.extreme_scale && rows.disagree > std::max<int64_t>(1, T * hkv / 100))
    throw Defect{std::to_string(rows.disagree) + " rows select other blocks than the reference"};
  if (d.extreme_scale) {
    // A scale so large that a plain fp32 implementation's rounding moves the softmax's winner:
    // outputs must be finite where the truth is, and within the values' range (|o| <= sum_b g_b max|v|).
    // Past fp32's range (|scale * q.k| above 3.4e38) the fast backends may return inf or NaN.
    for (double x : got.o.values())
      if (std::isfinite(x) && std::fabs(x) > 3.0 * 1.01 + 1e-3) throw Defect{"o outside the range of the values: " + std::to_string(x)};
    return;
  }
  for (int b : {kCmp, kWin})
    expect_close("o_branch[" + std::to_string(b) + "]", test::on_rows(got.o_branch, all, T, hq, hkv, dv, b),
                 test::on_rows(truth.o_branch, all, T, hq, hkv, dv, b),
                 test::on_rows(rounded.o_branch, all, T, hq, hkv, dv, b));
  expect_close("o_branch[slc]", test::on_rows(got.o_branch, rows, T, hq, hkv, dv, kSlc),
               test::on_rows(truth.o_branch, rows, T, hq, hkv, dv, kSlc),
               test::on_rows(rounded.o_branch, rows, T, hq, hkv, dv, kSlc));
  expect_close("o", test::on_rows(got.o, rows, T, hq, hkv, dv), test::on_rows(truth.o, rows, T, hq, hkv, dv),
               test::on_rows(rounded.o, rows, T, hq, hkv, dv));
  expect_close_f32("lse", test::on_rows(got.lse, rows, T, hq, hkv, 3), test::on_rows(truth.lse, rows, T, hq, hkv, 3));
}

void compare_gradients(const LayerProblem& got, const LayerProblem& truth, const LayerProblem& rounded) {
  expect_close("dq", got.dq.values(), truth.dq.values(), rounded.dq.values());
  expect_close("dg", got.dg.values(), truth.dg.values(), rounded.dg.values());
  static const char* kNames[3] = {"cmp", "slc", "win"};
  for (int b = 0; b < 3; ++b) {
    if (!got.dk[b].defined()) continue;
    expect_close(std::string("dk_") + kNames[b], got.dk[b].values(), truth.dk[b].values(), rounded.dk[b].values());
    expect_close(std::string("dv_") + kNames[b], got.dv[b].values(), truth.dv[b].values(), rounded.dv[b].values());
  }
  static const char* kParams[5] = {"w1", "b1", "w2", "b2", "pe"};
  for (int i = 0; i < 5; ++i) {
    if (!got.dphi_k[i].defined()) continue;
    expect_close(std::string("dphi_k.") + kParams[i], got.dphi_k[i].values(), truth.dphi_k[i].values(),
                 rounded.dphi_k[i].values());
    expect_close(std::string("dphi_v.") + kParams[i], got.dphi_v[i].values(), truth.dphi_v[i].values(),
                 rounded.dphi_v[i].values());
  }
}

// The common mutation step of a call: config (when `cfg` is given), tensors, sequences, context.
struct Target {
  Context ctx;
  Config cfg;
  std::vector<Arg> args;       // mutable arguments (none defines others in what is mutated)
  std::vector<Arg> outputs;    // the same for outputs
  HostTensor* cu = nullptr;    // host cu_seqlens storage (prefill)
  Sequences* seqs = nullptr;
  int64_t T = 0, longest = 0;
  std::string main_name = "q";
  TensorView* main = nullptr;
  bool dense_only = false;     // no configuration but the scale
};

// The sequence-length bound a prefill call works with: the declared max_seqlen, at most T (no
// sequence is longer than the packed tokens), or the longest sequence.
int64_t bound_of(const Target& t) {
  return t.seqs && t.seqs->max_seqlen > 0 ? std::min(t.seqs->max_seqlen, t.T) : t.longest;
}

// Chooses and applies the case's mutation (or none).
void choose_mutation(Rng& r, Case& c, Target& t, DType dtype) {
  const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
  Mutation m{"none", ""};
  if (u < 0.40) {
    // Valid: optionally a declared max_seqlen above the longest sequence (up to 2^31 - 1).
    if (t.seqs && r.chance(0.25)) {
      t.seqs->max_seqlen = r.pick<int64_t>({t.longest, t.longest + 1, t.longest + 1000, kMaxLength});
      m = {"max_seqlen = " + i64(t.seqs->max_seqlen), ""};
    }
  } else if (u < 0.58) {
    m = mutate_config(r, t.cfg, t.dense_only);
  } else if (u < 0.80) {
    std::vector<Arg*> pool;
    for (Arg& a : t.args) pool.push_back(&a);
    for (Arg& a : t.outputs) pool.push_back(&a);
    if (!pool.empty()) m = mutate_arg(r, *r.pick(pool), dtype);
  } else if (u < 0.92) {
    if (t.seqs && t.cu) m = mutate_sequences(r, *t.cu, *t.seqs, t.T, t.longest);
  } else {
    // The main tensor (absent, not a float, of another rank) or the thread count.
    switch (r.range(0, 3)) {
      case 0:
        *t.main = TensorView();
        m = {t.main_name + " absent", t.main_name};
        break;
      case 1:
        t.main->dtype = DType::i32;
        m = {t.main_name + ".dtype = i32", t.main_name + ".dtype"};
        break;
      case 2:
        t.main->ndim = 2;
        m = {t.main_name + ".ndim = 2", t.main_name + ".ndim"};
        break;
      case 3:
        t.ctx.num_threads = -1;
        m = {"ctx.num_threads = -1", "ctx.num_threads"};
        break;
    }
  }
  c.mutation = m.text;
  c.expect = m.expect;
}

// The Problem a stage call is sized by (its tensors' sizes).
Problem stage_problem(const Draw& d, int64_t T, int64_t hq, int64_t hkv, int64_t dqk, int64_t dv, int64_t F,
                      const Sequences& seqs) {
  Problem p;
  p.total_tokens = T;
  p.batch = static_cast<int64_t>(d.sizes.seqlens.size());
  p.max_seqlen = seqs.max_seqlen ? seqs.max_seqlen : longest(d.sizes);
  if (!seqs.cu_seqlens.defined() && !seqs.max_seqlen) p.max_seqlen = T;
  p.hq = hq;
  p.hkv = hkv;
  p.dqk = dqk;
  p.dv = dv;
  p.phi_hidden = F;
  p.dtype = d.sizes.dtype;
  p.device = Device::cpu;
  return p;
}

// Runs the call: the workspace from the (possibly mutated) problem; when sizing fails with a named
// error, the call still runs with a generous workspace and must fail the same way.
template <typename Call>
Outcome run_call(Rng& r, Case& c, Target& t, nsa::Op op, const Problem& pr, bool mutate_ctx, Call&& call) {
  CaseWorkspace w;
  Outcome sizing = attempt([&] { w = case_workspace(t.ctx, op, t.cfg, pr); });
  if (!sizing.ok) {
    w.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20);
    w.ws = w.owned->ws;
  }
  if (mutate_ctx && c.expect.empty() && r.chance(0.2)) {
    const Mutation m = mutate_context(r, t.ctx, w.ws, w.need, t.main_name, t.main ? t.main->dtype : DType::f32);
    c.mutation = m.text;
    c.expect = m.expect;
  }
  Outcome o = attempt([&] { call(w.ws); });
  if (!sizing.ok && o.ok) throw Defect{"workspace_size failed (" + sizing.message + ") but the call succeeded"};
  return o;
}

void case_forward(Rng& r, Case& c, Draw& d, bool backward_too) {
  LayerProblem p = test::make_problem(d.cfg, d.sizes, r.g());
  Target t;
  t.ctx = test::context_of(d.backend, d.threads);
  t.cfg = d.cfg;
  Inputs in = p.inputs();
  ForwardOutputs out = p.outputs();
  if (!r.chance(0.5)) out.o_branch = TensorView();  // optional
  t.args = layer_args(in, d.cfg);
  t.outputs = {{"o", &out.o, {1, 1, 1}}, {"lse", &out.lse, {1, 1, 1}, true, true},
               {"indices", &out.indices, {1, 1, 1}, true, true}};
  if (out.o_branch.defined()) t.outputs.push_back({"o_branch", &out.o_branch, {1, 1, 1, 1}, false});
  t.cu = &p.cu;
  t.seqs = &in.seqs;
  t.T = p.T;
  t.longest = longest(d.sizes);
  t.main = &in.q;
  // Padded (strided) copies of some inputs: valid layouts.
  std::vector<Padded> padded;
  auto pad_input = [&](TensorView& v, const HostTensor& src) {
    if (!src.defined() || !r.chance(0.25)) return;
    padded.push_back(padded_copy(src, r));
    v = padded.back().view;
  };
  padded.reserve(8);
  pad_input(in.q, p.q);
  pad_input(in.g, p.g);
  pad_input(in.kv[kCmp].k, p.k[0]);
  if (!d.cfg.shared_kv) pad_input(in.kv[kWin].v, p.v[2]);

  if (!backward_too) {
    choose_mutation(r, c, t, d.sizes.dtype);
    const Config cfg = t.cfg;
    Problem pr;
    Outcome sized = attempt([&] { pr = problem_of(cfg, in); });
    if (!sized.ok) pr = stage_problem(d, p.T, d.sizes.hq, d.sizes.hkv, d.sizes.dqk, d.sizes.dv, d.sizes.phi_hidden, in.seqs);
    const Outcome o = run_call(r, c, t, nsa::Op::forward, pr, true, [&](Workspace ws) { forward(t.ctx, cfg, in, out, ws); });
    if (!settle(c, o)) return;
    // The reference on the same values in fp64 (the truth) and in the storage dtype (rounded).
    LayerProblem truth = test::to_f64(p), rounded = p;
    Inputs tin = truth.inputs(), rin = rounded.inputs();
    tin.seqs.max_seqlen = rin.seqs.max_seqlen = in.seqs.max_seqlen;
    const Context ref = test::context_of(Backend::reference);
    forward(ref, cfg, tin, truth.outputs());
    forward(ref, cfg, rin, rounded.outputs());
    if (!out.o_branch.defined()) {  // compare the branches only where they were written
      p.o_branch = truth.o_branch;
      rounded.o_branch = truth.o_branch;
    }
    compare_forward(d, p, truth, rounded);
    return;
  }

  // Backward: the saved lse and indices of a reference forward in fp64, or caller-provided
  // indices (repeats, -1, blocks past the query) with the selection's lse for them.
  LayerProblem truth = test::to_f64(p);
  const Context ref = test::context_of(Backend::reference);
  forward(ref, d.cfg, truth.inputs(), truth.outputs());
  const bool awkward = d.cfg.n_selected > 0 && r.chance(0.5);
  if (awkward) {
    truth.indices = awkward_indices(r, p, d.cfg);
    HostTensor lse_slc(DType::f32, {p.T, d.sizes.hq}), o_slc(DType::f64, {p.T, d.sizes.hq, d.sizes.dv});
    const int kb = d.cfg.shared_kv ? 0 : 1;
    selected_attention_fwd(ref, d.cfg, truth.q.view(), truth.k[kb].view(), truth.v[kb].view(), truth.indices.view(),
                           truth.inputs().seqs, o_slc.view(), lse_slc.view());
    for (int64_t i = 0; i < p.T * d.sizes.hq; ++i) truth.lse.set(i * 3 + 1, lse_slc.get(i));
  }
  LayerProblem rounded = p;
  p.lse = rounded.lse = truth.lse;
  p.indices = rounded.indices = truth.indices;
  ForwardOutputs saved{TensorView(), p.lse.view(), p.indices.view(), TensorView()};
  Gradients grads = p.gradients();
  TensorView d_o = p.d_o.view();
  t.outputs = {{"lse", &saved.lse, {1, 1, 1}, true, true},
               {"indices", &saved.indices, {1, 1, 1}, true, true},
               {"d_o", &d_o, {1, 1, 1}},
               {"dq", &grads.dq, {1, 1, 1}},
               {"dg", &grads.dg, {1, 1, 1}}};
  static const char* kD[3][2] = {{"dk_cmp", "dv_cmp"}, {"dk_slc", "dv_slc"}, {"dk_win", "dv_win"}};
  for (int b = 0; b < (d.cfg.shared_kv ? 1 : 3); ++b) {
    t.outputs.push_back({kD[b][0], &grads.dkv[b].k, {1, 1, 1}});
    t.outputs.push_back({kD[b][1], &grads.dkv[b].v, {1, 1, 1}});
  }
  choose_mutation(r, c, t, d.sizes.dtype);
  const Config cfg = t.cfg;
  Problem pr;
  Outcome sized = attempt([&] { pr = problem_of(cfg, in); });
  if (!sized.ok) pr = stage_problem(d, p.T, d.sizes.hq, d.sizes.hkv, d.sizes.dqk, d.sizes.dv, d.sizes.phi_hidden, in.seqs);
  const Outcome o = run_call(r, c, t, nsa::Op::backward, pr, true,
                             [&](Workspace ws) { backward(t.ctx, cfg, in, saved, d_o, grads, ws); });
  if (!settle(c, o)) return;
  Inputs tin = truth.inputs(), rin = rounded.inputs();
  tin.seqs.max_seqlen = rin.seqs.max_seqlen = in.seqs.max_seqlen;
  backward(ref, cfg, tin, truth.outputs(), truth.d_o.view(), truth.gradients());
  backward(ref, cfg, rin, rounded.outputs(), rounded.d_o.view(), rounded.gradients());
  // At an extreme scale the fp32 scores' rounding (an ulp of scale * q.k) is far above 1, so the
  // gradients are ill-conditioned (docs/errors.md): the call must finish, nothing more.
  if (d.extreme_scale) return;
  compare_gradients(p, truth, rounded);
}

// ---- The stages --------------------------------------------------------------------------------

void case_stage(Rng& r, Case& c, Draw& d) {
  LayerProblem p = test::make_problem(d.cfg, d.sizes, r.g());
  const Sizes& s = d.sizes;
  const DType dt = s.dtype;
  const int64_t T = p.T, rows = T / d.cfg.cmp_stride;
  Target t;
  t.ctx = test::context_of(d.backend, d.threads);
  t.cfg = d.cfg;
  Sequences seqs = p.inputs().seqs;
  t.cu = &p.cu;
  t.seqs = &seqs;
  t.T = T;
  t.longest = longest(s);
  if (seqs.cu_seqlens.defined()) t.args.push_back({"cu_seqlens", &seqs.cu_seqlens, {0}, false, true});
  const Context ref = test::context_of(Backend::reference);
  LayerProblem p64 = test::to_f64(p);

  switch (c.op) {
    case Op::compress_fwd: {
      // x = k_cmp [T, Hkv, Dqk]; xc [T/d, Hkv, Dqk].
      TensorView x = p.k[0].view();
      PhiParams phi = LayerProblem::params(p.phi_k);
      HostTensor xc(dt, {rows, s.hkv, s.dqk});
      xc.poison();
      TensorView xcv = xc.view();
      t.main = &x;
      t.main_name = "x";
      auto phi_args = [&](const std::string& name, PhiParams& ph) {
        if (d.cfg.phi == PhiKind::linear) {
          t.args.push_back({name + ".w1", &ph.w1, {1, 1}});
          t.args.push_back({name + ".pe", &ph.pe, {1, 1}});
        } else if (d.cfg.phi == PhiKind::mlp) {
          t.args.push_back({name + ".w1", &ph.w1, {0, 1}});
          t.args.push_back({name + ".b1", &ph.b1, {1}});
          t.args.push_back({name + ".w2", &ph.w2, {1, 1}});
          t.args.push_back({name + ".b2", &ph.b2, {1}});
          t.args.push_back({name + ".pe", &ph.pe, {1, 1}});
        }
      };
      phi_args("phi", phi);
      t.outputs.push_back({"xc", &xcv, {1, 1, 1}});
      choose_mutation(r, c, t, dt);
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hkv, s.hkv, s.dqk, s.dqk, s.phi_hidden, seqs);
      const Outcome o = run_call(r, c, t, nsa::Op::compress_fwd, pr, true,
                                 [&](Workspace ws) { compress_fwd(t.ctx, cfg, phi, x, seqs, xcv, ws); });
      if (!settle(c, o)) return;
      HostTensor truth(DType::f64, {rows, s.hkv, s.dqk}), rounded(dt, {rows, s.hkv, s.dqk});
      truth.poison();
      rounded.poison();
      Sequences s2 = seqs;
      compress_fwd(ref, cfg, LayerProblem::params(p64.phi_k), p64.k[0].view(), s2, truth.view());
      compress_fwd(ref, cfg, phi, p.k[0].view(), s2, rounded.view());
      // Rows past a sequence's blocks stay untouched (poisoned) in every run.
      std::vector<double> a = xc.values(), b = truth.values(), rr = rounded.values();
      for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i]) != std::isnan(b[i])) throw Defect{"compress_fwd wrote (or skipped) row element " + std::to_string(i)};
        if (std::isnan(a[i])) a[i] = b[i] = rr[i] = 0;
      }
      expect_close("xc", a, b, rr);
      return;
    }
    case Op::compress_bwd: {
      TensorView x = p.k[0].view();
      PhiParams phi = LayerProblem::params(p.phi_k);
      PhiParams dphi = LayerProblem::params(p.dphi_k);
      HostTensor dxc(dt, {rows, s.hkv, s.dqk}), dx(dt, {T, s.hkv, s.dqk});
      dxc.fill_uniform(r.g, -1, 1);
      dx.poison();
      TensorView dxcv = dxc.view(), dxv = dx.view();
      t.main = &x;
      t.main_name = "x";
      t.args.push_back({"dxc", &dxcv, {1, 1, 1}});
      t.outputs.push_back({"dx", &dxv, {1, 1, 1}});
      choose_mutation(r, c, t, dt);
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hkv, s.hkv, s.dqk, s.dqk, s.phi_hidden, seqs);
      const Outcome o = run_call(r, c, t, nsa::Op::compress_bwd, pr, true,
                                 [&](Workspace ws) { compress_bwd(t.ctx, cfg, phi, x, seqs, dxcv, dxv, dphi, ws); });
      if (!settle(c, o)) return;
      LayerProblem rr = p;
      HostTensor dxc64 = to_f64(dxc), dx64(DType::f64, {T, s.hkv, s.dqk}), dxr(dt, {T, s.hkv, s.dqk});
      compress_bwd(ref, cfg, LayerProblem::params(p64.phi_k), p64.k[0].view(), seqs, dxc64.view(), dx64.view(),
                   LayerProblem::params(p64.dphi_k));
      compress_bwd(ref, cfg, LayerProblem::params(rr.phi_k), rr.k[0].view(), seqs, dxc.view(), dxr.view(),
                   LayerProblem::params(rr.dphi_k));
      expect_close("dx", dx.values(), dx64.values(), dxr.values());
      for (int i = 0; i < 5; ++i)
        if (p.dphi_k[i].defined())
          expect_close("dphi." + std::to_string(i), p.dphi_k[i].values(), p64.dphi_k[i].values(), rr.dphi_k[i].values());
      return;
    }
    case Op::compressed_attention_fwd: {
      HostTensor kc(dt, {rows, s.hkv, s.dqk}), vc(dt, {rows, s.hkv, s.dv});
      kc.fill_uniform(r.g, -1, 1);
      vc.fill_uniform(r.g, -1, 1);
      const int64_t ns = num_slc_blocks(std::max<int64_t>(t.longest, 0), d.cfg.slc_block_len) + r.range(0, 2);
      HostTensor o(dt, {T, s.hq, s.dv}), lse(DType::f32, {T, s.hq}), S(DType::f32, {T, s.hkv, ns});
      for (HostTensor* h : {&o, &lse, &S}) h->poison();
      TensorView q = p.q.view(), kcv = kc.view(), vcv = vc.view(), ov = o.view(), lv = lse.view(), sv = S.view();
      t.main = &q;
      t.args.push_back({"kc", &kcv, {1, 0, 1}});
      t.args.push_back({"vc", &vcv, {1, 1, 0}});
      t.outputs.push_back({"o", &ov, {1, 1, 1}});
      t.outputs.push_back({"lse", &lv, {1, 1}, true, true});
      t.outputs.push_back({"scores", &sv, {1, 1, 0}, false, true});
      choose_mutation(r, c, t, dt);
      if (c.expect.empty() && num_slc_blocks(bound_of(t), t.cfg.slc_block_len) > ns) {
        // A declared max_seqlen that needs a wider scores tensor than the one given.
        c.expect = "scores.shape[2]";
      }
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hq, s.hkv, s.dqk, s.dv, 0, seqs);
      const Outcome out = run_call(r, c, t, nsa::Op::compressed_attention_fwd, pr, true, [&](Workspace ws) {
        compressed_attention_fwd(t.ctx, cfg, q, kcv, vcv, seqs, ov, lv, sv, ws);
      });
      if (!settle(c, out)) return;
      HostTensor o64(DType::f64, {T, s.hq, s.dv}), orr(dt, {T, s.hq, s.dv}), l64(DType::f32, {T, s.hq}),
          S64(DType::f32, {T, s.hkv, ns});
      S64.poison();
      HostTensor kc64 = to_f64(kc), vc64 = to_f64(vc);
      compressed_attention_fwd(ref, cfg, p64.q.view(), kc64.view(), vc64.view(), seqs, o64.view(), l64.view(), S64.view());
      compressed_attention_fwd(ref, cfg, p.q.view(), kc.view(), vc.view(), seqs, orr.view(), HostTensor(DType::f32, {T, s.hq}).view(),
                               TensorView());
      if (d.extreme_scale) return;
      expect_close("o", o.values(), o64.values(), orr.values());
      expect_close_f32("lse", lse.values(), l64.values());
      expect_close_f32("scores", S.values(), S64.values());
      return;
    }
    case Op::select_topn: {
      const int64_t ns = num_slc_blocks(std::max<int64_t>(t.longest, 0), d.cfg.slc_block_len) + r.range(0, 2);
      HostTensor S(DType::f32, {T, s.hkv, ns});
      for (int64_t i = 0; i < S.numel(); ++i) S.set(i, static_cast<double>(r.range(0, 3)));  // many ties
      if (r.chance(0.1) && S.numel() > 0) S.set(r.range(0, S.numel() - 1), std::numeric_limits<double>::quiet_NaN());
      HostTensor idx(DType::i32, {T, s.hkv, d.cfg.n_selected}), want(DType::i32, {T, s.hkv, d.cfg.n_selected});
      idx.poison();
      want.poison();
      TensorView sv = S.view(), iv = idx.view();
      t.main = &sv;
      t.main_name = "scores";
      t.outputs.push_back({"indices", &iv, {1, 1, 1}, true, true});
      choose_mutation(r, c, t, DType::f32);
      if (c.expect.empty() && num_slc_blocks(bound_of(t), t.cfg.slc_block_len) > ns) c.expect = "scores.shape[2]";
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hkv, s.hkv, 1, 1, 0, seqs);
      const Outcome out = run_call(r, c, t, nsa::Op::select_topn, pr, true,
                                   [&](Workspace ws) { select_topn(t.ctx, cfg, sv, seqs, iv, ws); });
      if (!settle(c, out)) return;
      select_topn(ref, cfg, S.view(), seqs, want.view());
      expect_equal("indices", idx.values(), want.values());
      return;
    }
    case Op::selected_attention_fwd:
    case Op::window_attention_fwd:
    case Op::dense_attention_fwd: {
      const int kb = d.cfg.shared_kv ? 0 : (c.op == Op::selected_attention_fwd ? 1 : 2);
      HostTensor idx;
      if (c.op == Op::selected_attention_fwd) {
        if (r.chance(0.5)) {
          idx = awkward_indices(r, p, d.cfg);
        } else {  // a forward's own selection
          forward(ref, d.cfg, p64.inputs(), p64.outputs());
          idx = p64.indices;
        }
      }
      HostTensor o(dt, {T, s.hq, s.dv}), lse(DType::f32, {T, s.hq});
      o.poison();
      lse.poison();
      TensorView q = p.q.view(), k = p.k[kb].view(), v = p.v[kb].view(), iv = idx.view(), ov = o.view(), lv = lse.view();
      if (r.chance(0.3)) lv = TensorView();  // optional
      std::vector<Padded> padded;
      padded.reserve(2);
      if (r.chance(0.3)) { padded.push_back(padded_copy(p.k[kb], r)); k = padded.back().view; }
      if (r.chance(0.3)) { padded.push_back(padded_copy(p.q, r)); q = padded.back().view; }
      t.main = &q;
      t.args.push_back({"k", &k, {1, 0, 1}});
      t.args.push_back({"v", &v, {1, 1, 0}});
      if (c.op == Op::selected_attention_fwd) t.args.push_back({"indices", &iv, {1, 1, 1}, true, true});
      t.outputs.push_back({"o", &ov, {1, 1, 1}});
      if (lv.defined()) t.outputs.push_back({"lse", &lv, {1, 1}, false, true});
      const bool dense = c.op == Op::dense_attention_fwd;
      t.dense_only = dense;
      if (dense) t.cfg = Config{}, t.cfg.scale = d.cfg.scale;
      choose_mutation(r, c, t, dt);
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hq, s.hkv, s.dqk, s.dv, 0, seqs);
      const nsa::Op op = c.op == Op::selected_attention_fwd ? nsa::Op::selected_attention_fwd
                         : c.op == Op::window_attention_fwd ? nsa::Op::window_attention_fwd
                                                            : nsa::Op::dense_attention_fwd;
      const Outcome out = run_call(r, c, t, op, pr, true, [&](Workspace ws) {
        if (c.op == Op::selected_attention_fwd) selected_attention_fwd(t.ctx, cfg, q, k, v, iv, seqs, ov, lv, ws);
        else if (c.op == Op::window_attention_fwd) window_attention_fwd(t.ctx, cfg, q, k, v, seqs, ov, lv, ws);
        else dense_attention_fwd(t.ctx, cfg.scale, q, k, v, seqs, ov, lv, ws);
      });
      if (!settle(c, out)) return;
      HostTensor o64(DType::f64, {T, s.hq, s.dv}), orr(dt, {T, s.hq, s.dv}), l64(DType::f32, {T, s.hq});
      auto reference = [&](const TensorView& q2, const TensorView& k2, const TensorView& v2, const TensorView& o2,
                           const TensorView& l2) {
        if (c.op == Op::selected_attention_fwd) selected_attention_fwd(ref, cfg, q2, k2, v2, idx.view(), seqs, o2, l2);
        else if (c.op == Op::window_attention_fwd) window_attention_fwd(ref, cfg, q2, k2, v2, seqs, o2, l2);
        else dense_attention_fwd(ref, cfg.scale, q2, k2, v2, seqs, o2, l2);
      };
      reference(p64.q.view(), p64.k[kb].view(), p64.v[kb].view(), o64.view(), l64.view());
      reference(p.q.view(), p.k[kb].view(), p.v[kb].view(), orr.view(), TensorView());
      if (d.extreme_scale) {
        for (double x : o.values())
          if (std::isfinite(x) && std::fabs(x) > 1.01) throw Defect{"o outside the values' range at an extreme scale"};
        return;
      }
      expect_close("o", o.values(), o64.values(), orr.values());
      if (lv.defined()) expect_close_f32("lse", lse.values(), l64.values());
      return;
    }
    case Op::dense_attention_bwd: {
      HostTensor o64(DType::f64, {T, s.hq, s.dv}), lse(DType::f32, {T, s.hq});
      const double scale = d.cfg.scale;
      dense_attention_fwd(ref, scale, p64.q.view(), p64.k[0].view(), p64.v[0].view(), seqs, o64.view(), lse.view());
      HostTensor o = test::convert(o64, dt);
      HostTensor dq(dt, {T, s.hq, s.dqk}), dk(dt, {T, s.hkv, s.dqk}), dv(dt, {T, s.hkv, s.dv});
      for (HostTensor* h : {&dq, &dk, &dv}) h->poison();
      TensorView q = p.q.view(), k = p.k[0].view(), v = p.v[0].view(), ov = o.view(), lv = lse.view(), dov = p.d_o.view(),
                 dqv = dq.view(), dkv = dk.view(), dvv = dv.view();
      t.main = &q;
      t.args = {{"k", &k, {1, 0, 1}}, {"v", &v, {1, 1, 0}}, {"o", &ov, {1, 1, 1}}, {"lse", &lv, {1, 1}, true, true},
                {"d_o", &dov, {1, 1, 1}}};
      if (seqs.cu_seqlens.defined()) t.args.push_back({"cu_seqlens", &seqs.cu_seqlens, {0}, false, true});
      t.outputs = {{"dq", &dqv, {1, 1, 1}}, {"dk", &dkv, {1, 1, 1}}, {"dv", &dvv, {1, 1, 1}}};
      t.dense_only = true;
      t.cfg = Config{};
      t.cfg.scale = scale;
      choose_mutation(r, c, t, dt);
      const Config cfg = t.cfg;
      const Problem pr = stage_problem(d, T, s.hq, s.hkv, s.dqk, s.dv, 0, seqs);
      const Outcome out = run_call(r, c, t, nsa::Op::dense_attention_bwd, pr, true, [&](Workspace ws) {
        dense_attention_bwd(t.ctx, cfg.scale, q, k, v, seqs, ov, lv, dov, dqv, dkv, dvv, ws);
      });
      if (!settle(c, out)) return;
      HostTensor dq64(DType::f64, {T, s.hq, s.dqk}), dk64(DType::f64, {T, s.hkv, s.dqk}), dv64(DType::f64, {T, s.hkv, s.dv});
      HostTensor dqr(dt, {T, s.hq, s.dqk}), dkr(dt, {T, s.hkv, s.dqk}), dvr(dt, {T, s.hkv, s.dv});
      HostTensor do64 = to_f64(p.d_o);
      dense_attention_bwd(ref, cfg.scale, p64.q.view(), p64.k[0].view(), p64.v[0].view(), seqs, o64.view(), lse.view(),
                          do64.view(), dq64.view(), dk64.view(), dv64.view());
      dense_attention_bwd(ref, cfg.scale, p.q.view(), p.k[0].view(), p.v[0].view(), seqs, o.view(), lse.view(),
                          p.d_o.view(), dqr.view(), dkr.view(), dvr.view());
      if (d.extreme_scale) return;
      expect_close("dq", dq.values(), dq64.values(), dqr.values());
      expect_close("dk", dk.values(), dk64.values(), dkr.values());
      expect_close("dv", dv.values(), dv64.values(), dvr.values());
      return;
    }
    default: return;
  }
}

// ---- Decoding: cache_append, decode, dense_decode ----------------------------------------------

HostCache cache_f64(const HostCache& c) {
  HostCache e = c;
  for (int i = 0; i < 3; ++i) {
    e.k[i] = test::convert(c.k[i], DType::f64);
    e.v[i] = test::convert(c.v[i], DType::f64);
  }
  e.kc = test::convert(c.kc, DType::f64);
  e.vc = test::convert(c.vc, DType::f64);
  return e;
}

// Breaks the page table or the pools of a cache whose sequences hold `lens` tokens with `rows`
// new rows each; returns the parameter to be named.
Mutation mutate_cache(Rng& r, HostCache& h, Config& cfg, const std::vector<int64_t>& lens,
                      const std::vector<int64_t>& rows, PageTable& pt) {
  const int64_t B = h.B;
  for (;;) {
    switch (r.range(0, 7)) {
      case 0: {  // a page a sequence uses is outside the pools; the first such page is named
        std::vector<int64_t> used;
        for (int64_t b = 0; b < B; ++b)
          if (lens[static_cast<size_t>(b)] > 0) used.push_back(b);
        if (used.empty()) break;
        const int64_t b = r.pick(used);
        const int64_t pg = r.range(0, pages_of(lens[static_cast<size_t>(b)], h.page_size) - 1);
        const int64_t id = r.pick<int64_t>({-1, h.num_pages, kI32Max, kI32Min});
        h.block_table.set(b * h.max_pages + pg, static_cast<double>(id));
        return {"block_table[" + i64(b) + "][" + i64(pg) + "] = " + i64(id),
                "pages.block_table[" + i64(b) + "][" + i64(pg) + "]"};
      }
      case 1: {  // a page past a sequence's length: unused, valid
        for (int64_t b = 0; b < B; ++b) {
          const int64_t used = pages_of(lens[static_cast<size_t>(b)], h.page_size);
          if (used < h.max_pages) {
            h.block_table.set(b * h.max_pages + used, static_cast<double>(kI32Max));
            return {"an unused page id out of range", ""};
          }
        }
        break;
      }
      case 2: {  // a length beyond the capacity
        const int64_t b = r.range(0, B - 1);
        const int64_t len = r.pick<int64_t>({h.max_pages * h.page_size + 1, kI32Max, -1, kI32Min});
        h.seq_lens.set(b, static_cast<double>(len));
        return {"seq_lens[" + i64(b) + "] = " + i64(len), "pages.seq_lens[" + i64(b) + "]"};
      }
      case 3: {  // fewer tokens than the call's new rows (m > length)
        std::vector<int64_t> cand;
        for (int64_t b = 0; b < B; ++b)
          if (rows[static_cast<size_t>(b)] > 0) cand.push_back(b);
        if (cand.empty()) break;
        const int64_t b = r.pick(cand);
        h.seq_lens.set(b, static_cast<double>(r.range(0, rows[static_cast<size_t>(b)] - 1)));
        return {"seq_lens[" + i64(b) + "] below its new rows", "pages.seq_lens[" + i64(b) + "]"};
      }
      case 4: {  // a page size that is not a multiple of l'
        cfg.slc_block_len = h.page_size * 2;  // still a multiple of d: only the page size is wrong
        return {"l' = 2 x page_size", "cache.k_cmp.shape[1] (page_size)"};
      }
      case 5:
        pt.max_seqlen = r.pick<int64_t>({-1, h.max_pages * h.page_size + 1, kI64Max, kI64Min});
        return {"pages.max_seqlen = " + i64(pt.max_seqlen), "pages.max_seqlen"};
      case 6: {
        const int64_t below = *std::max_element(lens.begin(), lens.end());
        if (below < 2) break;
        pt.max_seqlen = r.range(1, below - 1);
        int64_t first = 0;
        while (lens[static_cast<size_t>(first)] <= pt.max_seqlen) ++first;
        return {"pages.max_seqlen below a length", "pages.seq_lens[" + i64(first) + "]"};
      }
      case 7:
        h.status = HostTensor(DType::i32, {B + 1});
        pt.status = h.status.view();
        return {"status [B+1]", "pages.status.shape[0]"};
    }
  }
}

void case_decode(Rng& r, Case& c, Draw& d) {
  // Page sizes a multiple of l' (kept small for the cache).
  Config cfg = d.cfg;
  Sizes s = d.sizes;
  if (cfg.slc_block_len > 64) cfg.slc_block_len = cfg.cmp_stride * 2;
  const int64_t page = cfg.slc_block_len * r.pick<int64_t>({1, 2, 3});
  LayerProblem p = test::make_problem(cfg, s, r.g());
  const DType dt = s.dtype;
  const int64_t B = static_cast<int64_t>(s.seqlens.size());
  const int64_t capacity = longest(s) + r.range(0, 9);
  HostCache cache = test::make_cache(cfg, s, page, std::max<int64_t>(capacity, 1), r.g(), r.range(0, 3));
  HostCache ref_cache = cache;  // appended by the reference, for the pools' check
  const Context ctx = test::context_of(d.backend, d.threads), ref = test::context_of(Backend::reference);
  // Two steps: a first chunk of each sequence, then the rest.
  std::vector<int64_t> first(static_cast<size_t>(B)), rest(static_cast<size_t>(B)), none(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    first[static_cast<size_t>(b)] = r.range(0, s.seqlens[static_cast<size_t>(b)]);
    rest[static_cast<size_t>(b)] = s.seqlens[static_cast<size_t>(b)] - first[static_cast<size_t>(b)];
  }
  const bool dense = c.op == Op::dense_decode;
  std::vector<int64_t> done = none;
  for (int step = 0; step < 2; ++step) {
    const std::vector<int64_t>& count = step == 0 ? first : rest;
    std::vector<int64_t> lens(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      lens[static_cast<size_t>(b)] = done[static_cast<size_t>(b)] + count[static_cast<size_t>(b)];
      cache.seq_lens.set(b, static_cast<double>(lens[static_cast<size_t>(b)]));
      ref_cache.seq_lens.set(b, static_cast<double>(lens[static_cast<size_t>(b)]));
    }
    test::StepRows rows = test::step_rows(p, done, count);
    const bool last = step == 1;
    Target t;
    t.ctx = ctx;
    t.cfg = cfg;
    PagedCache view = cache.view();
    CacheAppend app = rows.append();
    app.phi_k = LayerProblem::params(p.phi_k);
    app.phi_v = LayerProblem::params(p.phi_v);
    DecodeInputs q = rows.queries();
    ForwardOutputs out = rows.outputs();
    if (last && !dense) {
      // The mutation of the case, on the last step's append and decode.
      const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
      Mutation m{"none", ""};
      if (u < 0.45) {
        if (r.chance(0.2)) {  // declared bounds above what is used: valid
          view.pages.max_seqlen = r.range(std::max<int64_t>(*std::max_element(lens.begin(), lens.end()), 1),
                                          cache.max_pages * page);
          m = {"pages.max_seqlen declared", ""};
        }
      } else if (u < 0.6) {
        m = mutate_config(r, t.cfg, false);
      } else if (u < 0.85) {
        m = mutate_cache(r, cache, t.cfg, lens, count, view.pages);
        PageTable keep = view.pages;
        view = cache.view();
        view.pages.max_seqlen = keep.max_seqlen;
        if (keep.status.defined()) view.pages.status = cache.status.view();
      } else {
        // The rows: cu_seqlens broken or absent, max_seqlen (new rows) too small.
        const int64_t most = *std::max_element(count.begin(), count.end());
        switch (r.range(0, 3)) {
          case 0: {
            const int64_t Tn = rows.q.shape()[0];
            rows.cu.set(B, static_cast<double>(Tn + 1));
            m = {"seqs.cu_seqlens[B] = rows + 1", "seqs.cu_seqlens[" + i64(B) + "]"};
            break;
          }
          case 1:
            rows.cu.set(0, 1);
            m = {"seqs.cu_seqlens[0] = 1", "seqs.cu_seqlens[0]"};
            break;
          case 2:
            if (most < 2) break;
            app.seqs.max_seqlen = q.seqs.max_seqlen = r.range(1, most - 1);
            m = {"seqs.max_seqlen below the new rows", "seqs.max_seqlen"};
            break;
          case 3: {
            const int64_t Tn = rows.q.shape()[0];
            if (B > 0 && Tn % B != 0) {
              app.seqs.cu_seqlens = q.seqs.cu_seqlens = TensorView();
              m = {"seqs.cu_seqlens absent with uneven rows", "seqs.cu_seqlens"};
            }
            break;
          }
        }
      }
      c.mutation = m.text;
      c.expect = m.expect;
    }
    const Config call_cfg = t.cfg;
    const HostCache before = cache;
    if (!dense) {
      // cache_append
      Problem pa;
      Outcome sa = attempt([&] { pa = problem_of(call_cfg, view, app); });
      CaseWorkspace wa;
      if (sa.ok) wa = case_workspace(ctx, nsa::Op::cache_append, call_cfg, pa);
      else { wa.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20); wa.ws = wa.owned->ws; }
      const Outcome oa = attempt([&] { cache_append(ctx, call_cfg, view, app, wa.ws); });
      if (!c.expect.empty() || !oa.ok) {
        settle(c, oa);
        // A rejected call touches nothing.
        for (int i = 0; i < 3; ++i)
          if (cache.k[i].defined()) expect_equal("cache pool after a rejected append", cache.k[i].values(), before.k[i].values());
      }
      Outcome od;
      Problem pd;
      Outcome sd = attempt([&] { pd = problem_of(call_cfg, view, q); });
      CaseWorkspace wd;
      if (sd.ok) wd = case_workspace(ctx, nsa::Op::decode, call_cfg, pd);
      else { wd.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20); wd.ws = wd.owned->ws; }
      od = attempt([&] { decode(ctx, call_cfg, view, q, out, wd.ws); });
      if (!settle(c, od)) return;
      // The reference appends the same rows to its own cache: raw pools equal, compressed ones
      // within a unit of the storage type.
      {
        PagedCache rv = ref_cache.view();
        CacheAppend ra = app;
        cache_append(ref, call_cfg, rv, ra);
        for (int i = 0; i < 3; ++i)
          if (cache.k[i].defined()) {
            expect_equal("raw k pool", cache.k[i].values(), ref_cache.k[i].values());
            expect_equal("raw v pool", cache.v[i].values(), ref_cache.v[i].values());
          }
        const double unit = dt == DType::f64 || dt == DType::f32 ? 2e-5 : dt == DType::bf16 ? 0x1p-6 : 0x1p-9;
        for (const auto& [a, b] : {std::pair{&cache.kc, &ref_cache.kc}, std::pair{&cache.vc, &ref_cache.vc}}) {
          const std::vector<double> x = a->values(), y = b->values();
          for (size_t i = 0; i < x.size(); ++i) {
            if (std::isnan(x[i]) != std::isnan(y[i])) throw Defect{"compressed pool slot written by one backend only"};
            if (!std::isnan(x[i]) && std::fabs(x[i] - y[i]) > unit * (4.0 + std::fabs(y[i])))
              throw Defect{"compressed pool differs from the reference's: " + std::to_string(x[i]) + " vs " + std::to_string(y[i])};
          }
        }
      }
      // Decode against the reference's decode of the same cache in fp64.
      HostCache exact = cache_f64(cache);
      test::StepRows tr = rows;
      const int64_t Tq = rows.q.shape()[0];
      tr.q = to_f64(rows.q);
      tr.g = to_f64(rows.g);
      tr.o = HostTensor(DType::f64, {Tq, s.hq, s.dv});
      tr.o_branch = HostTensor(DType::f64, {3, Tq, s.hq, s.dv});
      tr.lse = HostTensor(DType::f32, {Tq, s.hq, 3});
      tr.indices = HostTensor(DType::i32, {Tq, s.hkv, cfg.n_selected});
      PagedCache ev = exact.view();
      ev.pages.max_seqlen = view.pages.max_seqlen;
      DecodeInputs tq = tr.queries();
      tq.seqs = q.seqs;
      tq.q = tr.q.view();
      tq.g = tr.g.view();
      decode(ref, call_cfg, ev, tq, tr.outputs());
      const int64_t hq = s.hq, hkv = s.hkv, n = call_cfg.n_selected, dv = s.dv;
      const test::Rowset agree = test::compare_indices(rows.indices, tr.indices, Tq, hkv, n);
      if (d.backend == Backend::reference) expect_equal("decode indices", rows.indices.values(), tr.indices.values());
      if (d.extreme_scale) return;  // scores within an fp32 ulp of each other: the selection may differ
      if (agree.disagree > std::max<int64_t>(1, Tq * hkv / 100)) throw Defect{"decoded rows select other blocks"};
      const test::Rowset all{std::vector<char>(static_cast<size_t>(Tq * hkv), 1), 0};
      const std::vector<double> ob_r = rounded_to(tr.o_branch, dt), o_r = rounded_to(tr.o, dt);
      HostTensor obr(DType::f64, {3, Tq, hq, dv}), orr(DType::f64, {Tq, hq, dv});
      for (size_t i = 0; i < ob_r.size(); ++i) obr.set(static_cast<int64_t>(i), ob_r[i]);
      for (size_t i = 0; i < o_r.size(); ++i) orr.set(static_cast<int64_t>(i), o_r[i]);
      for (int br : {kCmp, kWin})
        expect_close("decode o_branch[" + std::to_string(br) + "]", test::on_rows(rows.o_branch, all, Tq, hq, hkv, dv, br),
                     test::on_rows(tr.o_branch, all, Tq, hq, hkv, dv, br), test::on_rows(obr, all, Tq, hq, hkv, dv, br));
      expect_close("decode o", test::on_rows(rows.o, agree, Tq, hq, hkv, dv), test::on_rows(tr.o, agree, Tq, hq, hkv, dv),
                   test::on_rows(orr, agree, Tq, hq, hkv, dv));
      expect_close_f32("decode lse", test::on_rows(rows.lse, agree, Tq, hq, hkv, 3), test::on_rows(tr.lse, agree, Tq, hq, hkv, 3));
    } else {
      // dense_decode reads the raw pools of branch slc (or the shared ones): filled by the reference.
      cache_append(ref, cfg, view, app);
      if (!last) {
        for (int64_t b = 0; b < B; ++b) done[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
        continue;
      }
      const int kb = cfg.shared_kv ? 0 : 1;
      KV pools{cache.k[kb].view(), cache.v[kb].view()};
      PageTable table = view.pages;
      TensorView qv = rows.q.view();
      Sequences seqs = q.seqs;
      const int64_t Tq = rows.q.shape()[0];
      HostTensor o(dt, {Tq, s.hq, s.dv}), lse(DType::f32, {Tq, s.hq});
      o.poison();
      lse.poison();
      TensorView ov = o.view(), lv = lse.view();
      t.cfg = Config{};
      t.cfg.scale = cfg.scale;
      t.dense_only = true;
      t.main = &qv;
      t.args = {{"pages_v", &pools.v, {1, 1, 1, 0}}, {"pages.block_table", &table.block_table, {0, 0}, true, true},
                {"pages.seq_lens", &table.seq_lens, {1}, true, true}};
      t.outputs = {{"o", &ov, {1, 1, 1}}, {"lse", &lv, {1, 1}, false, true}};
      choose_mutation(r, c, t, dt);
      if (c.expect.empty() && r.chance(0.3)) {
        Config dummy = cfg;
        const Mutation m = mutate_cache(r, cache, dummy, lens, count, table);
        if (m.expect != "cache.k_cmp.shape[1] (page_size)") {
          c.mutation = m.text;
          c.expect = m.expect;
          const PageTable keep = table;
          table = cache.view().pages;
          table.max_seqlen = keep.max_seqlen;
          if (m.expect == "pages.status.shape[0]") table.status = cache.status.view();
        }
      }
      const Config dcfg = t.cfg;
      Problem pr;
      Outcome sz = attempt([&] { pr = problem_of(pools, table, qv, seqs); });
      if (!sz.ok) pr = stage_problem(d, Tq, s.hq, s.hkv, s.dqk, s.dv, 0, seqs);
      pr.max_query_len = std::max<int64_t>(pr.max_query_len, 1);
      const Outcome od = run_call(r, c, t, nsa::Op::dense_decode, pr, true, [&](Workspace ws) {
        dense_decode(t.ctx, dcfg.scale, pools, table, qv, seqs, ov, lv, ws);
      });
      if (!settle(c, od)) return;
      HostCache exact = cache_f64(cache);
      HostTensor q64 = to_f64(rows.q), o64(DType::f64, {Tq, s.hq, s.dv}), orr(dt, {Tq, s.hq, s.dv}),
          l64(DType::f32, {Tq, s.hq});
      dense_decode(ref, dcfg.scale, KV{exact.k[kb].view(), exact.v[kb].view()}, table, q64.view(), seqs, o64.view(),
                   l64.view());
      dense_decode(ref, dcfg.scale, KV{cache.k[kb].view(), cache.v[kb].view()}, table, rows.q.view(), seqs, orr.view(),
                   TensorView());
      if (d.extreme_scale) return;
      expect_close("dense_decode o", o.values(), o64.values(), orr.values());
      if (lv.defined()) expect_close_f32("dense_decode lse", lse.values(), l64.values());
      return;
    }
    for (int64_t b = 0; b < B; ++b) done[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
  }
}

// ---- Workspace sizes ---------------------------------------------------------------------------

// workspace_size on valid configurations with extreme integers (l' and n and w up to 2^31 - 1, a
// declared max_seqlen up to 2^31 - 1) and small tensors: a size that grows with the tensors, never
// with a configuration integer; and Problems with bad fields: a named error.
void case_workspace_sizes(Rng& r, Case& c, Draw& d) {
  Config cfg = d.cfg;
  Problem pr;
  pr.total_tokens = r.range(0, 300);
  pr.batch = r.range(1, 4);
  pr.max_seqlen = r.chance(0.5) ? pr.total_tokens : r.pick<int64_t>({pr.total_tokens, kMaxLength, int64_t{1} << 20});
  pr.hq = d.sizes.hq;
  pr.hkv = d.sizes.hkv;
  pr.dqk = d.sizes.dqk;
  pr.dv = d.sizes.dv;
  pr.phi_hidden = cfg.phi == PhiKind::mlp ? d.sizes.phi_hidden : 0;
  pr.dtype = d.sizes.dtype;
  pr.max_query_len = r.range(0, 8);
  const nsa::Op op = static_cast<nsa::Op>(r.range(0, static_cast<int64_t>(nsa::Op::dense_decode)));
  const bool decoding = op == nsa::Op::cache_append || op == nsa::Op::decode || op == nsa::Op::dense_decode;
  if (decoding) {
    pr.max_seqlen = std::min<int64_t>(pr.max_seqlen, 4096);  // the cache's capacity: its pools are tensors
    cfg.slc_block_len = std::min<int64_t>(cfg.slc_block_len, 64);
    if (cfg.slc_block_len % cfg.cmp_stride != 0) cfg.slc_block_len = cfg.cmp_stride;
  }
  switch (r.range(0, 5)) {
    case 0: cfg.slc_block_len = kMaxLength, cfg.cmp_stride = 1, cfg.cmp_block_len = 1; break;
    case 1: cfg.n_selected = r.pick<int64_t>({kMaxLength, int64_t{1} << 20}); break;
    case 2: cfg.window = kMaxLength; break;
    default: break;
  }
  if (decoding && cfg.slc_block_len > 64) cfg.slc_block_len = 64, cfg.cmp_stride = 1;
  if (cfg.n_init + cfg.n_local + cfg.num_backbone > cfg.n_selected && cfg.n_selected > 0) cfg.n_local = cfg.n_init = 0, cfg.set_backbone({});
  Context ctx = test::context_of(d.backend, d.threads);
  const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
  if (u < 0.4) {
    static const char* kFields[] = {"problem.total_tokens", "problem.batch", "problem.max_seqlen", "problem.hq",
                                    "problem.hkv", "problem.dqk", "problem.dv", "problem.phi_hidden",
                                    "problem.max_query_len"};
    int64_t* fields[] = {&pr.total_tokens, &pr.batch, &pr.max_seqlen, &pr.hq, &pr.hkv, &pr.dqk, &pr.dv,
                         &pr.phi_hidden, &pr.max_query_len};
    const int k = static_cast<int>(r.range(0, 8));
    *fields[k] = r.pick<int64_t>({-1, kI64Min, int64_t{1} << 31, int64_t{1} << 62, kI64Max});
    c.mutation = std::string(kFields[k]) + " = " + i64(*fields[k]);
    c.expect = kFields[k];
  }
  c.text += " op=" + std::to_string(static_cast<int>(op)) + " T=" + i64(pr.total_tokens) + " max_seqlen=" + i64(pr.max_seqlen) +
            " l'=" + i64(cfg.slc_block_len) + " n=" + i64(cfg.n_selected) + " w=" + i64(cfg.window);
  size_t bytes = 0;
  const Outcome o = attempt([&] { bytes = workspace_size(ctx, op, cfg, pr); });
  if (!settle(c, o)) return;
  // A few hundred tokens: the scratch is at most a few MB per thread whatever the configuration.
  const size_t threads = static_cast<size_t>(std::max(d.threads, 1)) + 64;
  if (bytes > (size_t{64} << 20) * threads)
    throw Defect{"workspace_size is " + std::to_string(bytes) + " bytes for a problem of " + i64(pr.total_tokens) +
                 " tokens (grows with a configuration integer)"};
}

// ---- The driver --------------------------------------------------------------------------------

void run_case(Case& c, uint64_t seed) {
  Rng r(case_seed(seed, c.index));
  c.op = r.pick<Op>({Op::forward, Op::forward, Op::backward, Op::backward, Op::compress_fwd, Op::compress_bwd,
                     Op::compressed_attention_fwd, Op::select_topn, Op::selected_attention_fwd,
                     Op::selected_attention_fwd, Op::window_attention_fwd, Op::dense_attention_fwd,
                     Op::dense_attention_bwd, Op::decode, Op::decode, Op::dense_decode, Op::workspace_size});
  const bool cache = c.op == Op::decode || c.op == Op::dense_decode;
  Draw d = draw_problem(r, cache);
  g_dtype = d.sizes.dtype;
  c.text = "case " + std::to_string(c.index) + " (seed " + std::to_string(seed) + "): " + op_name(c.op) + " " + describe(d);
  g_current = &c;
  note_case();
  switch (c.op) {
    case Op::forward: case_forward(r, c, d, false); break;
    case Op::backward: case_forward(r, c, d, true); break;
    case Op::decode:
    case Op::dense_decode: case_decode(r, c, d); break;
    case Op::workspace_size: case_workspace_sizes(r, c, d); break;
    default: case_stage(r, c, d); break;
  }
}

int main_impl(int argc, char** argv) {
  uint64_t seed = 1, cases = 300, first = 0;
  double case_timeout = 60.0;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nsa_fuzz: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seed") seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--cases") cases = std::strtoull(next(), nullptr, 10);
    else if (a == "--first") first = std::strtoull(next(), nullptr, 10);
    else if (a == "--case-timeout") case_timeout = std::strtod(next(), nullptr);
    else if (a == "--verbose") verbose = true;
    else {
      std::fprintf(stderr, "usage: nsa_fuzz [--seed S] [--cases N] [--first K] [--case-timeout SEC] [--verbose]\n");
      return 2;
    }
  }
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_fatal_signal);
#ifdef NSA_FUZZ_SANITIZER
  __sanitizer_set_death_callback(on_sanitizer_death);
#endif
  // The watchdog: a case that runs past the limit is a hang; the run stops and names it.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int64_t start = g_case_start_ms.load();
      if (start >= 0 && now_ms() - start > static_cast<int64_t>(case_timeout * 1000)) {
        print_current_case("HANG (case timeout)");
        std::_Exit(3);
      }
    }
  });

  const auto t0 = std::chrono::steady_clock::now();
  std::map<std::string, int> matched, rejected;
  std::vector<std::string> failures;
  for (uint64_t i = first; i < first + cases; ++i) {
    Case c;
    c.index = i;
    g_case_start_ms.store(now_ms());
    try {
      run_case(c, seed);
      (c.expect.empty() ? matched : rejected)[op_name(c.op)]++;
    } catch (const Defect& e) {
      failures.push_back(c.text + "\n    mutation: " + c.mutation + "\n    expected: " +
                         (c.expect.empty() ? std::string("success matching the reference") : "an error naming " + c.expect) +
                         "\n    got: " + e.what);
    } catch (const std::exception& e) {
      failures.push_back(c.text + "\n    mutation: " + c.mutation + "\n    harness exception: " + e.what());
    }
    const int64_t took = now_ms() - g_case_start_ms.exchange(-1);
    if (verbose)
      std::printf("%s | %s | %s | %" PRId64 " ms\n", c.text.c_str(), c.mutation.c_str(),
                  c.expect.empty() ? "success" : c.expect.c_str(), took);
  }
  done = true;
  watchdog.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int n_ok = 0, n_err = 0;
  std::printf("nsa_fuzz: seed %" PRIu64 ", cases %" PRIu64 "..%" PRIu64 " in %.1f s\n", seed, first, first + cases - 1, secs);
  std::printf("  %-26s %8s %8s\n", "operation", "matched", "named");
  std::map<std::string, int> ops;
  for (auto& [k, v] : matched) ops[k] += 0;
  for (auto& [k, v] : rejected) ops[k] += 0;
  for (auto& [k, v] : ops) {
    std::printf("  %-26s %8d %8d\n", k.c_str(), matched[k], rejected[k]);
    n_ok += matched[k];
    n_err += rejected[k];
  }
  std::printf("  %d matched the reference, %d named errors, %zu failures (crashes and hangs stop the run)\n", n_ok, n_err,
              failures.size());
  for (const std::string& f : failures) std::printf("FAIL %s\n", f.c_str());
  return failures.empty() ? 0 : 1;
}

}  // namespace
}  // namespace nsa::fuzz

int main(int argc, char** argv) { return nsa::fuzz::main_impl(argc, argv); }
