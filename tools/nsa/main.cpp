// The `nsa` command-line program.
//
//   nsa bench [options]   NSA forward and forward+backward against dense causal attention on the
//                         best available backend, checked against the reference, as a table
//   nsa bench --suite forward|backward [suite options]
//                         the CUDA backend's CSV benchmarks (tools/nsa/cuda_suite_*.cpp)
//   nsa --version         the library's version and the backends this program can run
//   nsa --help            (-h and --help are understood after `bench` too)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "cpu/kernels.h"
#include "nsa/nsa.h"
#include "options.h"

namespace {

using nsa::Backend;
using nsa::Config;
using nsa::DType;
using nsa::TensorView;

using nsa_cli::BenchOptions;
using nsa_cli::UsageError;

#ifndef NSA_VERSION
#error "NSA_VERSION (the project version) is set by tools/CMakeLists.txt"
#endif

const char* kHelp = R"(usage: nsa bench [options]
       nsa bench --suite forward|backward [--out FILE.csv] [suite options]
       nsa --version
       nsa --help          (or -h; also `nsa bench -h`)

bench: times the NSA layer (forward, and forward+backward) and this backend's dense causal
attention on random data, one sequence per length, and prints one table row per length and pass:
  T, backend, pass, NSA ms, dense ms, speedup, the same as process CPU time (robust to other
  programs sharing the machine), NSA GFLOP/s, max error.
The first --check-tokens rows of every NSA output are compared with the fp64 reference (attention
is causal, so they equal the output of the same problem truncated to those tokens); rows whose
selected blocks differ from the reference's (near-ties of fp32 scores) are counted, not compared.
Exit status 1 when the error exceeds a few roundings of the dtype or over 1% of rows differ.

sizes and run:
  --seqlens LIST        comma-separated sequence lengths T (default 8192)
  --hq N                query heads (default 16)
  --hkv N               key/value heads (default 1)
  --dqk N               query/key head dim (default 128)
  --dv N                value head dim (default 128)
  --phi-hidden N        hidden width F of phi = mlp (default 128)
  --dtype T             bf16, f16 or f32 (default bf16)
  --threads N           CPU threads, 0 = OpenMP default (default 0)
  --backend B           auto, cpu, cuda or reference (default auto: the best available)
  --repeats N           timed repeats; the median is reported (default 1)
  --warmup N            untimed runs before them (default 1)
  --check-tokens N      rows checked against the reference, 0 = none (default 256)
  --no-backward         time the forward pass only
  --no-dense            skip the dense baseline
NSA configuration (defaults: the paper's):
  --cmp-block-len N     l, compression block length (32)
  --cmp-stride N        d, compression stride (16)
  --slc-block-len N     l', selection block length (64)
  --n-selected N        n, selected blocks per query incl. forced ones (16)
  --n-init N            forced initial blocks (1)
  --n-local N           forced local blocks (2)
  --window N            w, sliding window (512)
  --backbone LIST       the reach backbone's block offsets, e.g. 1 or 1,4 (none)
  --scale X             softmax scale, 0 = 1/sqrt(dqk) (0)
  --phi K               mean, linear or mlp (mlp)
  --shared-kv           one K/V for all three branches (default: independent K/V per branch)

suites (CUDA backend only; bf16, random data, the paper's block settings with phi = mean, CUDA
events, warm-up, median of repeats; one CSV row per measurement, progress on stdout; none of the
options above apply):
  --suite forward       the whole forward and each stage (compress(mean), cmp_attn+scores,
                        cmp_attn(no scores), topn, selection, window; forward(local_q) and
                        selection(local_q) with queries alike over 64 tokens; at 64K
                        compress(mlp_F=4D_k_only)) for Hq/Hkv/Dqk/Dv = 64/4/128/128, 64/4/192/128
                        and 16/4/128/128. CSV columns: T,hq,hkv,dqk,dv,stage,ms,tflops
                        (bench/sdpa_baseline.py adds PyTorch SDPA)
  --suite backward      forward, backward and forward+backward of the layer, same shapes, with the
                        variants full, saved_o_branch, saved_o_cmp, saved_o_cmp_win,
                        saved_o_cmp_one_warpgroup_dkv, no_window, no_selection, phi_mlp_F4D,
                        saved_o_cmp_phi_mlp, saved_o_cmp_win_phi_mlp,
                        full_without_o, per_token, local_q, local_q_per_token (each where its
                        length and shape have it). CSV columns: T,hq,hkv,dqk,dv,variant,fwd_ms,
                        bwd_ms,fwd_bwd_ms,bwd_tflops,ws_mb,qkvo_mb,peak_mb
                        (bench/sdpa_backward_baseline.py adds PyTorch SDPA)
 both suites:
  --out FILE            the CSV (default nsa_bench.csv, backward: nsa_backward_bench.csv)
  --quick               T = 8192 only
  --lengths LIST        comma-separated T (default 8192,16384,32768,65536,131072;
                        backward: 8192,16384,32768,65536)
 forward only:
  --no-locality         leave out the local_q rows
 backward only:
  --g16-only            the first shape only (Hq 64, Hkv 4, D 128)
  --shape HQ,HKV,DQK,DV that shape only (HQ a multiple of HKV, DQK 64, 128 or 192, DV 64 or 128)
  --variant NAME        that variant only (one of the names above)
  --once                one forward and one backward of the first shape, length and variant, then
                        exit: no timing, no CSV rows (for a profiler that should see every kernel once)
)";

// `nsa bench --suite NAME`: the suites' names, in the order of the help.
const char* const kSuites[] = {"forward", "backward"};

// ---- Host tensors ---------------------------------------------------------------------------

struct Buffer {
  std::vector<unsigned char> bytes;
  void* data = nullptr;
  void resize(size_t n) {
    bytes.assign(n + 256, 0);
    const auto addr = reinterpret_cast<uintptr_t>(bytes.data());
    data = bytes.data() + (256 - addr % 256) % 256;
  }
};

struct Tensor {
  Buffer buf;
  TensorView view;
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    buf.resize(static_cast<size_t>(n) * nsa::dtype_size(dtype));
    view.data = buf.data;
    view.dtype = dtype;
    view.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int d = view.ndim - 1; d >= 0; --d) {
      view.shape[d] = shape[static_cast<size_t>(d)];
      view.stride[d] = st;
      st *= view.shape[d];
    }
  }
  int64_t numel() const { return view.numel(); }
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half from float for values in [-4, 4] (normal range; round to nearest even).
uint16_t to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs < 0x38800000u) return sign;  // tiny values flush to zero (random data rarely has them)
  uint32_t r = abs - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) return sign ? -0.0f : 0.0f;  // flushed subnormals (see to_f16)
  const uint32_t u = sign | ((exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float get(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[i];
    case DType::bf16: return from_bf16(static_cast<const uint16_t*>(t.data)[i]);
    case DType::f16: return from_f16(static_cast<const uint16_t*>(t.data)[i]);
    case DType::f64: return static_cast<float>(static_cast<const double*>(t.data)[i]);
    default: return 0.0f;
  }
}

void fill(Tensor& t, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = u(rng);
    switch (t.view.dtype) {
      case DType::f32: static_cast<float*>(t.view.data)[i] = v; break;
      case DType::bf16: static_cast<uint16_t*>(t.view.data)[i] = to_bf16(v); break;
      case DType::f16: static_cast<uint16_t*>(t.view.data)[i] = to_f16(v); break;
      default: break;
    }
  }
}

// A view of the first `rows` rows.
TensorView head_rows(TensorView v, int64_t rows) {
  v.shape[0] = rows;
  return v;
}

// ---- The problem ----------------------------------------------------------------------------

struct Layer {
  int64_t T = 0;
  Tensor q, g, k[3], v[3], o, lse, idx, d_o, dq, dg, dk[3], dv[3];
  Tensor phi_k[5], phi_v[5], dphi_k[5], dphi_v[5];  // w1, b1, w2, b2, pe
  Tensor o_branch;  // [3, T, Hq, Dv]: the forward saves each branch's output, the backward reads it
  Tensor dense_o, dense_lse;

  static nsa::PhiParams params(Tensor* t) {
    return nsa::PhiParams{t[0].view, t[1].view, t[2].view, t[3].view, t[4].view};
  }
  nsa::Inputs inputs(const Config& cfg, int64_t rows) {
    nsa::Inputs in;
    in.q = head_rows(q.view, rows);
    for (int b = 0; b < 3; ++b)
      if (b == 0 || !cfg.shared_kv) in.kv[b] = nsa::KV{head_rows(k[b].view, rows), head_rows(v[b].view, rows)};
    in.g = head_rows(g.view, rows);
    in.phi_k = params(phi_k);
    in.phi_v = params(phi_v);
    return in;
  }
  nsa::Gradients gradients(const Config& cfg) {
    nsa::Gradients gr;
    gr.dq = dq.view;
    for (int b = 0; b < 3; ++b)
      if (b == 0 || !cfg.shared_kv) gr.dkv[b] = nsa::KV{dk[b].view, dv[b].view};
    gr.dg = dg.view;
    gr.dphi_k = params(dphi_k);
    gr.dphi_v = params(dphi_v);
    return gr;
  }
};

void make_phi(const Config& cfg, int64_t D, int64_t F, DType dt, Tensor* out, std::mt19937_64* rng) {
  const int64_t l = cfg.cmp_block_len;
  if (cfg.phi == nsa::PhiKind::linear) {
    out[0] = Tensor(dt, {D, l * D});
    out[4] = Tensor(dt, {l, D});
  } else if (cfg.phi == nsa::PhiKind::mlp) {
    out[0] = Tensor(dt, {F, l * D});
    out[1] = Tensor(dt, {F});
    out[2] = Tensor(dt, {D, F});
    out[3] = Tensor(dt, {D});
    out[4] = Tensor(dt, {l, D});
  }
  if (rng == nullptr) return;
  const float s1 = 2.0f / std::sqrt(static_cast<float>(l * D)), s2 = 1.5f / std::sqrt(static_cast<float>(std::max<int64_t>(F, 1)));
  if (out[0].numel()) fill(out[0], *rng, -s1, s1);
  if (out[1].numel()) fill(out[1], *rng, -0.5f, 0.5f);
  if (out[2].numel()) fill(out[2], *rng, -s2, s2);
  if (out[3].numel()) fill(out[3], *rng, -0.5f, 0.5f);
  if (out[4].numel()) fill(out[4], *rng, -0.5f, 0.5f);
}

Layer make_layer(const BenchOptions& o, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Layer L;
  L.T = T;
  const DType dt = o.dtype;
  L.q = Tensor(dt, {T, o.hq, o.dqk});
  fill(L.q, rng, -1, 1);
  for (int b = 0; b < (o.cfg.shared_kv ? 1 : 3); ++b) {
    L.k[b] = Tensor(dt, {T, o.hkv, o.dqk});
    L.v[b] = Tensor(dt, {T, o.hkv, o.dv});
    fill(L.k[b], rng, -1, 1);
    fill(L.v[b], rng, -1, 1);
    L.dk[b] = Tensor(dt, {T, o.hkv, o.dqk});
    L.dv[b] = Tensor(dt, {T, o.hkv, o.dv});
  }
  L.g = Tensor(dt, {T, o.hq, 3});
  fill(L.g, rng, 0, 1);
  make_phi(o.cfg, o.dqk, o.phi_hidden, dt, L.phi_k, &rng);
  make_phi(o.cfg, o.dv, o.phi_hidden, dt, L.phi_v, &rng);
  make_phi(o.cfg, o.dqk, o.phi_hidden, dt, L.dphi_k, nullptr);
  make_phi(o.cfg, o.dv, o.phi_hidden, dt, L.dphi_v, nullptr);
  L.o = Tensor(dt, {T, o.hq, o.dv});
  L.o_branch = Tensor(dt, {3, T, o.hq, o.dv});
  L.lse = Tensor(DType::f32, {T, o.hq, 3});
  L.idx = Tensor(DType::i32, {T, o.hkv, o.cfg.n_selected});
  L.d_o = Tensor(dt, {T, o.hq, o.dv});
  fill(L.d_o, rng, -1, 1);
  L.dq = Tensor(dt, {T, o.hq, o.dqk});
  L.dg = Tensor(dt, {T, o.hq, 3});
  L.dense_o = Tensor(dt, {T, o.hq, o.dv});
  L.dense_lse = Tensor(DType::f32, {T, o.hq});
  return L;
}

// ---- FLOP counts (multiply-add = 2) ---------------------------------------------------------

// Keys each query attends per branch, summed over the sequence, per query head.
struct KeyCounts {
  double cmp = 0, slc = 0, win = 0, dense = 0;
};

KeyCounts key_counts(const Config& cfg, int64_t T, const int32_t* idx, int64_t hkv) {
  KeyCounts k;
  for (int64_t t = 0; t < T; ++t) {
    k.cmp += static_cast<double>(nsa::visible_cmp_blocks(t, cfg.cmp_block_len, cfg.cmp_stride));
    k.win += static_cast<double>(cfg.window > 0 ? t - nsa::window_start(t, cfg.window) + 1 : 0);
    k.dense += static_cast<double>(t + 1);
    double s = 0;  // averaged over KV heads
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t j = 0; j < cfg.n_selected; ++j) {
        const int64_t b = idx[(t * hkv + h) * cfg.n_selected + j];
        if (b >= 0) s += static_cast<double>(std::max<int64_t>(0, std::min((b + 1) * cfg.slc_block_len, t + 1) - b * cfg.slc_block_len));
      }
    k.slc += s / static_cast<double>(hkv);
  }
  return k;
}

// ---- Timing ---------------------------------------------------------------------------------

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Process CPU time (user + system) in ms: with the wall time it shows how much of the machine a
// run really had (other programs on a shared machine slow a benchmark down).
double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-3;
}

struct Timing {
  double ms = 0;      // median wall time
  double cpu_ms = 0;  // process CPU time of the same run (all threads)
};

// `warmup` untimed runs, then `repeats` timed runs; the median in ms.
Timing time_median(int warmup, int repeats, const std::string& what, const std::function<void()>& fn) {
  std::fprintf(stderr, "  %s:", what.c_str());
  for (int w = 0; w < warmup; ++w) {
    std::fprintf(stderr, " warm-up%s", w + 1 < warmup ? "," : "");
    std::fflush(stderr);
    fn();
  }
  std::vector<std::pair<double, double>> times;  // (wall, cpu)
  for (int r = 0; r < repeats; ++r) {
    std::fprintf(stderr, " run %d/%d", r + 1, repeats);
    std::fflush(stderr);
    const double t0 = now_ms(), c0 = cpu_ms();
    fn();
    times.emplace_back(now_ms() - t0, cpu_ms() - c0);
  }
  std::sort(times.begin(), times.end());
  const auto [wall, cpu] = times[times.size() / 2];
  std::fprintf(stderr, " -> %.1f ms (cpu %.1f ms, busy cores %.2f)\n", wall, cpu, cpu / wall);
  return Timing{wall, cpu};
}

struct Row {
  int64_t T;
  const char* backend;
  const char* pass;
  Timing nsa, dense;
  double gflops, max_err;
  int64_t idx_disagree, checked;
};

// ---- The CUDA backend's benchmarks ----------------------------------------------------------
// tools/nsa/cuda_bench.cpp, compiled in by CUDA builds (tools/CMakeLists.txt sets
// NSA_CLI_CUDA_BENCH): run_cuda_bench() takes the same options as bench() and prints rows in the
// same table format; run_cuda_suite() runs `--suite NAME` with the other options after `bench`.
#ifdef NSA_CLI_CUDA_BENCH
}  // namespace
// Defined in another file: declared outside the anonymous namespace (external linkage).
int run_cuda_bench(const nsa_cli::BenchOptions& o);
int run_cuda_suite(const std::string& suite, const std::vector<std::string>& args);
namespace {
#endif

// `--suite NAME` among the options after `bench`: the name ("" when not given) and the other
// options. An unknown name, a missing one or a second --suite is a usage error.
std::string find_suite(int argc, char** argv, std::vector<std::string>* rest) {
  std::string suite;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--suite") != 0) {
      rest->push_back(argv[i]);
      continue;
    }
    std::string names;
    for (const char* n : kSuites) names += std::string(names.empty() ? "" : " or ") + n;
    if (!suite.empty()) throw UsageError("--suite given twice");
    if (i + 1 >= argc) throw UsageError("--suite needs a value: " + names);
    suite = argv[++i];
    if (std::none_of(std::begin(kSuites), std::end(kSuites), [&](const char* n) { return suite == n; }))
      throw UsageError("--suite must be " + names + ", got \"" + suite + "\"");
  }
  return suite;
}

// Compares the first `rows` tokens of the NSA output with the fp64 reference on the truncated
// problem. Returns the max error over rows whose indices agree; counts the others.
double check_rows(const BenchOptions& o, Layer& L, int64_t rows, int64_t* disagree, int64_t* checked, double* ref_max) {
  *disagree = 0;
  *checked = 0;
  *ref_max = 0.0;
  if (rows == 0) return 0.0;
  nsa::Context ref;
  ref.backend = Backend::reference;
  Tensor ro(o.dtype, {rows, o.hq, o.dv}), rl(DType::f32, {rows, o.hq, 3}), ri(DType::i32, {rows, o.hkv, o.cfg.n_selected});
  nsa::forward(ref, o.cfg, L.inputs(o.cfg, rows), nsa::ForwardOutputs{ro.view, rl.view, ri.view, {}, {}, {}});
  const int64_t n = o.cfg.n_selected, G = o.hq / o.hkv;
  const auto* a = static_cast<const int32_t*>(L.idx.view.data);
  const auto* b = static_cast<const int32_t*>(ri.view.data);
  double err = 0.0;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t hk = 0; hk < o.hkv; ++hk) {
      if (!std::equal(a + (t * o.hkv + hk) * n, a + (t * o.hkv + hk + 1) * n, b + (t * o.hkv + hk) * n)) {
        ++*disagree;
        continue;
      }
      ++*checked;
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
        for (int64_t c = 0; c < o.dv; ++c) {
          const int64_t i = (t * o.hq + h) * o.dv + c;
          err = std::max(err, static_cast<double>(std::fabs(get(L.o.view, i) - get(ro.view, i))));
          *ref_max = std::max(*ref_max, static_cast<double>(std::fabs(get(ro.view, i))));
        }
    }
  return err;
}

// The CPU's model name (/proc/cpuinfo), or "unknown".
std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    const char* colon = std::strchr(line, ':');
    if (std::strncmp(line, "model name", 10) == 0 && colon != nullptr) {
      model = colon + 1;
      model.erase(0, model.find_first_not_of(" \t"));
      model.erase(model.find_last_not_of(" \n\r\t") + 1);
      break;
    }
  }
  std::fclose(f);
  return model;
}

int bench(const BenchOptions& o) {
  nsa::Context ctx;
  ctx.backend = o.backend;
  ctx.num_threads = o.threads;
  if (o.backend == Backend::automatic)  // host tensors here: the cpu backend (CUDA: see above)
    ctx.backend = nsa::backend_available(Backend::cpu) ? Backend::cpu : Backend::reference;
  if (ctx.backend == Backend::cuda)
    throw UsageError("--backend cuda: the CUDA benchmark is not built into this nsa program yet");
  const char* bname = nsa::backend_name(ctx.backend);
  if (ctx.backend == Backend::cpu) {
    // The kernel table (NSA_CPU_ISA forces one) and whether this run's products use bf16 units.
    const nsa::cpu::KernelTable& K = nsa::cpu::kernels();
    const bool matrix = K.gemm_bf16 != nullptr && o.dtype == nsa::DType::bf16;
    std::printf("cpu: %s; kernels: %s; tile products: %s\n", cpu_model().c_str(), K.isa,
                matrix ? "bf16 (fp32 accumulation)" : "fp32");
  }
  std::vector<Row> rows;
  bool failed = false;
  for (int64_t T : o.seqlens) {
    std::fprintf(stderr, "T = %lld (%s, Hq=%lld, Hkv=%lld, Dqk=%lld, Dv=%lld, %s)\n", static_cast<long long>(T), bname,
                 static_cast<long long>(o.hq), static_cast<long long>(o.hkv), static_cast<long long>(o.dqk),
                 static_cast<long long>(o.dv), nsa::dtype_name(o.dtype));
    Layer L = make_layer(o, T, 1234 + static_cast<uint64_t>(T));
    const nsa::Inputs in = L.inputs(o.cfg, T);
    const nsa::Problem pr = nsa::problem_of(o.cfg, in);
    size_t bytes = 0;
    for (nsa::Op op : {nsa::Op::forward, nsa::Op::backward, nsa::Op::dense_attention_fwd, nsa::Op::dense_attention_bwd})
      bytes = std::max(bytes, nsa::workspace_size(ctx, op, o.cfg, pr));
    Buffer wsbuf;
    wsbuf.resize(bytes);
    const nsa::Workspace ws{wsbuf.data, bytes};
    // o_branch saved by the forward spares the backward recomputing the branch outputs (as dense
    // attention's backward reads the saved o).
    const nsa::ForwardOutputs out{L.o.view, L.lse.view, L.idx.view, L.o_branch.view, {}, {}};
    const TensorView& kd = L.k[o.cfg.shared_kv ? 0 : nsa::kWin].view;
    const TensorView& vd = L.v[o.cfg.shared_kv ? 0 : nsa::kWin].view;
    Tensor dq2(o.dtype, {T, o.hq, o.dqk}), dk2(o.dtype, {T, o.hkv, o.dqk}), dv2(o.dtype, {T, o.hkv, o.dv});

    const Timing nsa_fwd = time_median(o.warmup, o.repeats, "NSA forward", [&] { nsa::forward(ctx, o.cfg, in, out, ws); });
    Timing dense_fwd;
    if (o.dense)
      dense_fwd = time_median(o.warmup, o.repeats, "dense forward", [&] {
        nsa::dense_attention_fwd(ctx, o.cfg.scale, L.q.view, kd, vd, {}, L.dense_o.view, L.dense_lse.view, ws);
      });
    int64_t disagree = 0, checked = 0;
    const int64_t check = std::min(o.check_tokens, T);
    if (check > 0) std::fprintf(stderr, "  checking %lld rows against the reference\n", static_cast<long long>(check));
    double ref_max = 0;
    const double err = check_rows(o, L, check, &disagree, &checked, &ref_max);
    // Both outputs are rounded to the storage dtype: a few units of its rounding, plus fp32 sums.
    const double unit = o.dtype == DType::bf16 ? 0x1p-8 : o.dtype == DType::f16 ? 0x1p-11 : 0x1p-23;
    const double bound = 4.0 * unit * std::max(1.0, ref_max) + 1e-5;
    if (err > bound || disagree * 100 > std::max<int64_t>(checked + disagree, 1)) {
      std::fprintf(stderr, "nsa: CHECK FAILED at T = %lld: max error %.3e (bound %.3e), %lld of %lld rows chose other blocks\n",
                   static_cast<long long>(T), err, bound, static_cast<long long>(disagree),
                   static_cast<long long>(checked + disagree));
      failed = true;
    }
    const KeyCounts kc = key_counts(o.cfg, T, static_cast<const int32_t*>(L.idx.view.data), o.hkv);
    const double per_key = 2.0 * static_cast<double>(o.dqk + o.dv) * static_cast<double>(o.hq);
    const double nsa_flop = (kc.cmp + kc.slc + kc.win) * per_key;
    rows.push_back({T, bname, "fwd", nsa_fwd, dense_fwd, nsa_flop / nsa_fwd.ms * 1e-6, err, disagree, checked});
    if (o.backward) {
      const Timing nsa_fb = time_median(o.warmup, o.repeats, "NSA forward+backward", [&] {
        nsa::forward(ctx, o.cfg, in, out, ws);
        nsa::backward(ctx, o.cfg, in, out, L.d_o.view, L.gradients(o.cfg), ws);
      });
      Timing dense_fb;
      if (o.dense)
        dense_fb = time_median(o.warmup, o.repeats, "dense forward+backward", [&] {
          nsa::dense_attention_fwd(ctx, o.cfg.scale, L.q.view, kd, vd, {}, L.dense_o.view, L.dense_lse.view, ws);
          nsa::dense_attention_bwd(ctx, o.cfg.scale, L.q.view, kd, vd, {}, L.dense_o.view, L.dense_lse.view, L.d_o.view,
                                   dq2.view, dk2.view, dv2.view, ws);
        });
      // Forward 2 matrix products per key, backward 5 (S, dP, dV, dK, dQ): 3.5x the forward.
      rows.push_back({T, bname, "fwd+bwd", nsa_fb, dense_fb, 3.5 * nsa_flop / nsa_fb.ms * 1e-6, err, disagree, checked});
    }
  }
  // "cpu" columns: process CPU time of the same runs. On a machine shared with other programs the
  // wall times stretch; the CPU-time speedup is the one such sharing does not distort.
  std::printf("\n%8s  %-9s  %-7s  %10s  %10s  %8s  %11s  %11s  %9s  %11s  %10s  %s\n", "T", "backend", "pass", "NSA ms",
              "dense ms", "speedup", "NSA cpu ms", "dense cpu ms", "cpu speedup", "NSA GFLOP/s", "max error",
              "rows checked (other blocks)");
  for (const Row& r : rows) {
    char dense[32] = "-", speed[32] = "-", dense_cpu[32] = "-", speed_cpu[32] = "-";
    if (r.dense.ms > 0) {
      std::snprintf(dense, sizeof dense, "%.1f", r.dense.ms);
      std::snprintf(speed, sizeof speed, "%.2fx", r.dense.ms / r.nsa.ms);
      std::snprintf(dense_cpu, sizeof dense_cpu, "%.1f", r.dense.cpu_ms);
      std::snprintf(speed_cpu, sizeof speed_cpu, "%.2fx", r.dense.cpu_ms / r.nsa.cpu_ms);
    }
    std::printf("%8lld  %-9s  %-7s  %10.1f  %10s  %8s  %11.1f  %11s  %9s  %11.1f  %10.2e  %lld (%lld)\n",
                static_cast<long long>(r.T), r.backend, r.pass, r.nsa.ms, dense, speed, r.nsa.cpu_ms, dense_cpu,
                speed_cpu, r.gflops, r.max_err, static_cast<long long>(r.checked), static_cast<long long>(r.idx_disagree));
  }
  return failed ? 1 : 0;
}

bool is_help(const char* arg) {
  return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0;
}

// "nsa 0.1.0" and the backends that can run here (cuda: compiled in and a device visible).
void print_version() {
  std::printf("nsa %s\nbackends available here:", NSA_VERSION);
  for (Backend b : {Backend::reference, Backend::cpu, Backend::cuda})
    if (nsa::backend_available(b)) std::printf(" %s", nsa::backend_name(b));
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2 || is_help(argv[1]) || std::strcmp(argv[1], "help") == 0) {
      std::fputs(kHelp, stdout);
      return argc < 2 ? 2 : 0;
    }
    if (std::strcmp(argv[1], "--version") == 0) {
      print_version();
      return 0;
    }
    if (std::strcmp(argv[1], "bench") != 0) throw UsageError(std::string("unknown command ") + argv[1] + " (see nsa --help)");
    for (int i = 2; i < argc; ++i)
      if (is_help(argv[i])) {
        std::fputs(kHelp, stdout);
        return 0;
      }
    std::vector<std::string> suite_args;
    const std::string suite = find_suite(argc, argv, &suite_args);
#ifdef NSA_CLI_CUDA_BENCH
    if (!suite.empty()) return run_cuda_suite(suite, suite_args);  // (it checks for a device)
#else
    if (!suite.empty())
      throw UsageError("--suite " + suite + " times the CUDA backend, which this nsa program was built without " +
                       "(a CUDA build: cmake -DNSA_CUDA=ON)");
#endif
    const BenchOptions options = nsa_cli::parse_bench(argc, argv);
#ifdef NSA_CLI_CUDA_BENCH
    // The CUDA table unless a host backend is asked for (--backend cpu / reference).
    const bool host = options.backend == Backend::cpu || options.backend == Backend::reference;
    if (!host && nsa::backend_available(Backend::cuda)) return run_cuda_bench(options);
#endif
    return bench(options);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "nsa: %s\n", e.what());
    return 2;
  } catch (const nsa::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nsa: error: %s\n", e.what());
    return 1;
  }
}
