// Decode benchmark (nsa/cache.h): one decode step per sequence of a batch against T cached tokens,
// on the CPU or the GPU: the attend call, the append of the new token (with and without a
// compressed block completing), and the backend's own dense decoding over the same cache, eager
// and (CUDA) as CUDA-graph replays. Prints a table and writes a CSV that
// bench/sdpa_decode_baseline.py completes with PyTorch SDPA in the same run.
//
//   nsa_decode_bench [--backend cpu|cuda] [--batch 1,8,64] [--lens 8192,65536] [--hq 64] [--hkv 4]
//                    [--dqk 128] [--dv 128] [--phi mean|linear|mlp] [--phi-hidden 512] [--dtype bf16]
//                    [--page 64] [--shared-kv] [--repeats 50] [--threads 0] [--max-gb 100] [--out f.csv]
//
// The cache holds random values (a random buffer copied over the pools), pages are shuffled, and
// every sequence has T tokens after the step's append. Times are medians per call (CUDA events on
// the GPU; wall clock on the CPU). "GB/s" divides the bytes a call must read (compressed keys and
// values the query sees, its selected blocks, its window; dense: every cached key and value) by
// the time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "nsa/nsa.h"

#ifdef NSA_DECODE_BENCH_CUDA
#include <cuda_runtime.h>
#define CHECK(expr)                                                                                           \
  do {                                                                                                        \
    const cudaError_t e_ = (expr);                                                                            \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(e_));    \
  } while (0)
#endif

namespace {

struct Options {
  nsa::Backend backend = nsa::Backend::cpu;
  std::vector<int64_t> batch = {1};
  std::vector<int64_t> lens = {8192};
  int64_t hq = 64, hkv = 4, dqk = 128, dv = 128, phi_hidden = 512, page = 64;
  nsa::PhiKind phi = nsa::PhiKind::mlp;
  nsa::DType dtype = nsa::DType::bf16;
  bool shared_kv = false;
  int repeats = 50;
  int threads = 0;
  double max_gb = 100.0;
  std::string out;
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t comma = s.find(',', pos);
    v.push_back(std::stoll(s.substr(pos, comma - pos)));
    pos = comma == std::string::npos ? s.size() : comma + 1;
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--backend") o.backend = nsa::parse_backend(value().c_str());
    else if (a == "--batch") o.batch = parse_list(value());
    else if (a == "--lens") o.lens = parse_list(value());
    else if (a == "--hq") o.hq = std::stoll(value());
    else if (a == "--hkv") o.hkv = std::stoll(value());
    else if (a == "--dqk") o.dqk = std::stoll(value());
    else if (a == "--dv") o.dv = std::stoll(value());
    else if (a == "--phi") o.phi = nsa::parse_phi_kind(value(), "--phi");
    else if (a == "--phi-hidden") o.phi_hidden = std::stoll(value());
    else if (a == "--page") o.page = std::stoll(value());
    else if (a == "--dtype") {
      const std::string t = value();
      o.dtype = t == "f16" ? nsa::DType::f16 : t == "f32" ? nsa::DType::f32 : nsa::DType::bf16;
    } else if (a == "--shared-kv") o.shared_kv = true;
    else if (a == "--repeats") o.repeats = static_cast<int>(std::stoll(value()));
    else if (a == "--threads") o.threads = static_cast<int>(std::stoll(value()));
    else if (a == "--max-gb") o.max_gb = std::stod(value());
    else if (a == "--out") o.out = value();
    else if (a == "-h" || a == "--help") {
      std::puts("see the comment at the top of bench/decode_bench.cpp");
      std::exit(0);
    } else throw std::invalid_argument("unknown option " + a);
  }
  return o;
}

bool on_gpu(const Options& o) { return o.backend == nsa::Backend::cuda; }

// Memory on the backend's device.
struct Buffer {
  void* data = nullptr;
  size_t bytes = 0;
  bool gpu = false;
  Buffer() = default;
  Buffer(size_t n, bool device) : bytes(n), gpu(device) {
    if (n == 0) return;
#ifdef NSA_DECODE_BENCH_CUDA
    if (gpu) {
      CHECK(cudaMalloc(&data, n));
      return;
    }
#endif
    data = std::aligned_alloc(256, (n + 255) / 256 * 256);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& b) noexcept { *this = std::move(b); }
  Buffer& operator=(Buffer&& b) noexcept {
    std::swap(data, b.data);
    std::swap(bytes, b.bytes);
    std::swap(gpu, b.gpu);
    return *this;
  }
  ~Buffer() {
    if (!data) return;
#ifdef NSA_DECODE_BENCH_CUDA
    if (gpu) {
      cudaFree(data);
      return;
    }
#endif
    std::free(data);
  }
};

// A tensor on the backend's device, contiguous.
struct Tensor {
  Buffer buf;
  nsa::TensorView view;
  Tensor() = default;
  Tensor(nsa::DType dt, std::vector<int64_t> shape, bool gpu) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    buf = Buffer(static_cast<size_t>(n) * nsa::dtype_size(dt), gpu);
    view.data = buf.data;
    view.dtype = dt;
    view.ndim = static_cast<int>(shape.size());
    view.device = gpu ? nsa::Device::cuda : nsa::Device::cpu;
    int64_t st = 1;
    for (int d = view.ndim - 1; d >= 0; --d) {
      view.shape[d] = shape[static_cast<size_t>(d)];
      view.stride[d] = st;
      st *= view.shape[d];
    }
  }
  size_t bytes() const { return buf.bytes; }
};

uint16_t to_half_bits(float f, nsa::DType dt) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (dt == nsa::DType::bf16) return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  // f16 of a value in [-1, 1]: exponent rebias with rounding (no overflow or subnormal care needed)
  const uint32_t sign = (u >> 16) & 0x8000u, abs = u & 0x7fffffffu;
  if (abs < 0x38800000u) return static_cast<uint16_t>(sign);
  uint32_t r = abs - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Fills a tensor with values of a fixed random buffer (uniform in [lo, hi)), copied over it.
class Filler {
 public:
  Filler(nsa::DType dt, bool gpu) : dt_(dt), gpu_(gpu) {
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const size_t es = nsa::dtype_size(dt);
    host_.resize(kElems * es);
    for (size_t i = 0; i < kElems; ++i) {
      const float x = u(rng);
      if (es == 4) std::memcpy(host_.data() + 4 * i, &x, 4);
      else {
        const uint16_t h = to_half_bits(x, dt);
        std::memcpy(host_.data() + 2 * i, &h, 2);
      }
    }
    src_ = Buffer(host_.size(), gpu);
#ifdef NSA_DECODE_BENCH_CUDA
    if (gpu) CHECK(cudaMemcpy(src_.data, host_.data(), host_.size(), cudaMemcpyHostToDevice));
#endif
    if (!gpu) std::memcpy(src_.data, host_.data(), host_.size());
  }
  void fill(Tensor& t, size_t offset = 0) const {
    for (size_t done = 0; done < t.bytes();) {
      const size_t n = std::min(t.bytes() - done, src_.bytes - offset % src_.bytes);
      const char* from = static_cast<const char*>(src_.data) + offset % src_.bytes;
#ifdef NSA_DECODE_BENCH_CUDA
      if (gpu_) CHECK(cudaMemcpy(static_cast<char*>(t.buf.data) + done, from, n, cudaMemcpyDeviceToDevice));
#endif
      if (!gpu_) std::memcpy(static_cast<char*>(t.buf.data) + done, from, n);
      done += n;
      offset += n;
    }
  }

 private:
  static constexpr size_t kElems = size_t(1) << 26;  // 128 MB of bf16
  nsa::DType dt_;
  bool gpu_;
  std::vector<char> host_;
  Buffer src_;
};

void upload(Tensor& t, const void* host) {
#ifdef NSA_DECODE_BENCH_CUDA
  if (t.buf.gpu) {
    CHECK(cudaMemcpy(t.buf.data, host, t.bytes(), cudaMemcpyHostToDevice));
    return;
  }
#endif
  std::memcpy(t.buf.data, host, t.bytes());
}

// Median milliseconds per call of fn.
double time_ms(const Options& o, int reps, const std::function<void()>& fn) {
  fn();  // warm-up (kernel attributes, caches)
#ifdef NSA_DECODE_BENCH_CUDA
  if (on_gpu(o)) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < 5; ++r) {
      CHECK(cudaEventRecord(a));
      for (int i = 0; i < reps; ++i) fn();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t / reps);
    }
    CHECK(cudaGetLastError());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
#endif
  std::vector<double> ms;
  for (int r = 0; r < std::max(3, reps / 10); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

#ifdef NSA_DECODE_BENCH_CUDA
// Median milliseconds per replay of a graph of fn.
double time_graph_ms(const Options& o, int reps, const std::function<void()>& fn, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  fn();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = time_ms(o, reps, [&] { CHECK(cudaGraphLaunch(exec, stream)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms;
}
#endif

struct Row {
  int64_t B, T;
  double attend = 0, attend_graph = 0, append_block = 0, append_plain = 0, step_graph = 0, dense = 0, dense_graph = 0;
  double nsa_bytes = 0, dense_bytes = 0;
};

// Bytes one attend call must read: per sequence and KV head, the compressed keys/values its query
// sees, its selected blocks and its window (overlaps counted once would be fewer: this is the sum).
double attend_bytes(const Options& o, const nsa::Config& c, int64_t B, int64_t T) {
  const int64_t t = T - 1, C = nsa::visible_cmp_blocks(t, c.cmp_block_len, c.cmp_stride);
  const int64_t n = std::min(c.n_selected, nsa::last_slc_block(t, c.slc_block_len) + 1);
  const double per_token = static_cast<double>((o.dqk + o.dv) * nsa::dtype_size(o.dtype));
  return static_cast<double>(B * o.hkv) * per_token * static_cast<double>(C + n * c.slc_block_len + std::min(c.window, T));
}

Row run(const Options& o, const nsa::Config& cfg, int64_t B, int64_t T, const Filler& filler, nsa::Context ctx) {
  const bool gpu = on_gpu(o);
  const int64_t ps = o.page, max_pages = (T + ps - 1) / ps, P = B * max_pages, d = cfg.cmp_stride;
  const int sets = o.shared_kv ? 1 : 3;
  Row r{B, T};
  std::vector<Tensor> pools;
  for (int s = 0; s < sets; ++s) {
    pools.emplace_back(o.dtype, std::vector<int64_t>{P, ps, o.hkv, o.dqk}, gpu);
    pools.emplace_back(o.dtype, std::vector<int64_t>{P, ps, o.hkv, o.dv}, gpu);
  }
  pools.emplace_back(o.dtype, std::vector<int64_t>{P, ps / d, o.hkv, o.dqk}, gpu);
  pools.emplace_back(o.dtype, std::vector<int64_t>{P, ps / d, o.hkv, o.dv}, gpu);
  size_t offset = 0;
  for (Tensor& t : pools) {
    filler.fill(t, offset);
    offset += 4096 * 7;
  }
  std::vector<int32_t> ids(static_cast<size_t>(P));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  Tensor table(nsa::DType::i32, {B, max_pages}, gpu), lens(nsa::DType::i32, {B}, gpu), status(nsa::DType::i32, {B}, gpu);
  upload(table, ids.data());
  std::vector<int32_t> zeros(static_cast<size_t>(B), 0), host_lens(static_cast<size_t>(B));
  upload(status, zeros.data());
  nsa::PagedCache cache;
  for (int s = 0; s < sets; ++s) cache.raw[s] = nsa::KV{pools[2 * s].view, pools[2 * s + 1].view};
  cache.cmp = nsa::KV{pools[2 * sets].view, pools[2 * sets + 1].view};
  cache.pages.block_table = table.view;
  cache.pages.seq_lens = lens.view;
  cache.pages.status = status.view;
  auto set_lens = [&](int64_t len) {
    std::fill(host_lens.begin(), host_lens.end(), static_cast<int32_t>(len));
    upload(lens, host_lens.data());
  };
  // The step's rows: one new token per sequence.
  Tensor q(o.dtype, {B, o.hq, o.dqk}, gpu), g(o.dtype, {B, o.hq, 3}, gpu), o_out(o.dtype, {B, o.hq, o.dv}, gpu);
  filler.fill(q, 77);
  filler.fill(g, 91);  // gates in [-1, 1]: fine for timing
  std::vector<Tensor> newkv;
  for (int s = 0; s < sets; ++s) {
    newkv.emplace_back(o.dtype, std::vector<int64_t>{B, o.hkv, o.dqk}, gpu);
    newkv.emplace_back(o.dtype, std::vector<int64_t>{B, o.hkv, o.dv}, gpu);
    filler.fill(newkv.back(), 1000 * s);
  }
  // phi's parameters.
  std::vector<Tensor> phk, phv;
  auto make_phi = [&](std::vector<Tensor>& p, int64_t D) {
    if (o.phi == nsa::PhiKind::mean) return;
    const int64_t l = cfg.cmp_block_len, F = o.phi_hidden;
    if (o.phi == nsa::PhiKind::linear) {
      p.emplace_back(o.dtype, std::vector<int64_t>{D, l * D}, gpu);
    } else {
      p.emplace_back(o.dtype, std::vector<int64_t>{F, l * D}, gpu);
      p.emplace_back(o.dtype, std::vector<int64_t>{F}, gpu);
      p.emplace_back(o.dtype, std::vector<int64_t>{D, F}, gpu);
      p.emplace_back(o.dtype, std::vector<int64_t>{D}, gpu);
    }
    p.emplace_back(o.dtype, std::vector<int64_t>{l, D}, gpu);
    for (Tensor& t : p) filler.fill(t, 333);
  };
  make_phi(phk, o.dqk);
  make_phi(phv, o.dv);
  auto params = [&](const std::vector<Tensor>& p) {
    nsa::PhiParams x;
    if (p.empty()) return x;
    if (o.phi == nsa::PhiKind::linear) return nsa::PhiParams{p[0].view, {}, {}, {}, p[1].view};
    return nsa::PhiParams{p[0].view, p[1].view, p[2].view, p[3].view, p[4].view};
  };
  nsa::CacheAppend app;
  for (int s = 0; s < sets; ++s) app.kv[s] = nsa::KV{newkv[2 * s].view, newkv[2 * s + 1].view};
  app.phi_k = params(phk);
  app.phi_v = params(phv);
  nsa::DecodeInputs dec;
  dec.q = q.view;
  dec.g = g.view;
  const nsa::ForwardOutputs out{o_out.view, {}, {}, {}};
  set_lens(T);
  const nsa::Problem pd = nsa::problem_of(cfg, cache, dec), pa = nsa::problem_of(cfg, cache, app);
  Tensor wsd(nsa::DType::i32, {static_cast<int64_t>(nsa::workspace_size(ctx, nsa::Op::decode, cfg, pd) / 4 + 64)}, gpu);
  Tensor wsa(nsa::DType::i32, {static_cast<int64_t>(nsa::workspace_size(ctx, nsa::Op::cache_append, cfg, pa) / 4 + 64)}, gpu);
  const nsa::KV dense_pool = cache.raw[o.shared_kv ? 0 : nsa::kSlc];
  const nsa::Problem pdd = nsa::problem_of(dense_pool, cache.pages, q.view, {});
  Tensor wsdd(nsa::DType::i32, {static_cast<int64_t>(nsa::workspace_size(ctx, nsa::Op::dense_decode, cfg, pdd) / 4 + 64)}, gpu);
  const nsa::Workspace wd{wsd.buf.data, wsd.bytes()}, wa{wsa.buf.data, wsa.bytes()}, wdd{wsdd.buf.data, wsdd.bytes()};
  auto attend = [&] { nsa::decode(ctx, cfg, cache, dec, out, wd); };
  auto append = [&] { nsa::cache_append(ctx, cfg, cache, app, wa); };
  auto dense = [&] { nsa::dense_decode(ctx, cfg.scale, dense_pool, cache.pages, q.view, {}, o_out.view, {}, wdd); };
  // A block completes when the new token is the last of one: (T - l) % d == 0 after the step.
  const bool completes = T >= cfg.cmp_block_len && (T - cfg.cmp_block_len) % d == 0;
  set_lens(completes ? T : T - 1);
  r.append_block = completes ? time_ms(o, o.repeats, append) : 0;
  set_lens(completes ? T - 1 : T);
  r.append_plain = time_ms(o, o.repeats, append);
  set_lens(T);
  r.attend = time_ms(o, o.repeats, attend);
  r.dense = time_ms(o, std::max(3, o.repeats / 5), dense);
#ifdef NSA_DECODE_BENCH_CUDA
  if (gpu) {
    cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream);
    r.attend_graph = time_graph_ms(o, o.repeats, attend, stream);
    set_lens(completes ? T - 1 : T);
    r.step_graph = time_graph_ms(o, o.repeats, [&] { append(); attend(); }, stream);
    set_lens(T);
    r.dense_graph = time_graph_ms(o, std::max(3, o.repeats / 5), dense, stream);
    std::vector<int32_t> st(static_cast<size_t>(B));
    CHECK(cudaMemcpy(st.data(), status.buf.data, 4 * B, cudaMemcpyDeviceToHost));
    for (int32_t s : st)
      if (s != 0) throw std::runtime_error("a decode kernel reported bad metadata (status " + std::to_string(s) + ")");
  }
#endif
  r.nsa_bytes = attend_bytes(o, cfg, B, T);
  r.dense_bytes = static_cast<double>(B * o.hkv * T * (o.dqk + o.dv)) * static_cast<double>(nsa::dtype_size(o.dtype));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    nsa::Config cfg;  // the paper's blocks
    cfg.phi = o.phi;
    cfg.shared_kv = o.shared_kv;
    nsa::Context ctx;
    ctx.backend = o.backend;
    ctx.num_threads = o.threads;
#ifdef NSA_DECODE_BENCH_CUDA
    cudaStream_t stream = nullptr;
    if (on_gpu(o)) {
      CHECK(cudaStreamCreate(&stream));
      ctx.stream = stream;
    }
#else
    if (on_gpu(o)) throw std::invalid_argument("this nsa_decode_bench was built without CUDA");
#endif
    const Filler filler(o.dtype, on_gpu(o));
    std::vector<Row> rows;
    for (int64_t B : o.batch)
      for (int64_t T : o.lens) {
        const int sets = o.shared_kv ? 1 : 3;
        const double gb = static_cast<double>(B * ((T + o.page - 1) / o.page) * o.page) *
                          static_cast<double>(o.hkv * (o.dqk + o.dv) * nsa::dtype_size(o.dtype)) * (sets + 1.0 / cfg.cmp_stride) / 1e9;
        if (gb > o.max_gb) {
          std::fprintf(stderr, "B = %lld, T = %lld: skipped (the cache needs %.1f GB, --max-gb %.1f)\n",
                       static_cast<long long>(B), static_cast<long long>(T), gb, o.max_gb);
          continue;
        }
        std::fprintf(stderr, "B = %lld, T = %lld (%.1f GB of cache)\n", static_cast<long long>(B), static_cast<long long>(T), gb);
        rows.push_back(run(o, cfg, B, T, filler, ctx));
      }
    const bool gpu = on_gpu(o);
    const char* unit = gpu ? "us" : "ms";
    const double scale = gpu ? 1000.0 : 1.0;
    std::printf("\n%s decode, Hq %lld, Hkv %lld, Dqk %lld, Dv %lld, %s, phi %s, %s K/V, page %lld; per call, %s\n",
                nsa::backend_name(o.backend), static_cast<long long>(o.hq), static_cast<long long>(o.hkv),
                static_cast<long long>(o.dqk), static_cast<long long>(o.dv), nsa::dtype_name(o.dtype),
                nsa::phi_kind_name(o.phi), o.shared_kv ? "shared" : "independent", static_cast<long long>(o.page), unit);
    std::printf("| B | T | attend | attend graph | append (block) | append | step graph | dense | dense graph | attend GB/s | dense GB/s | dense / attend |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    FILE* csv = o.out.empty() ? nullptr : std::fopen(o.out.c_str(), "w");
    if (csv)
      std::fprintf(csv, "backend,B,T,hq,hkv,dqk,dv,dtype,phi,attend_ms,attend_graph_ms,append_block_ms,append_ms,"
                        "step_graph_ms,dense_ms,dense_graph_ms,attend_bytes,dense_bytes\n");
    for (const Row& r : rows) {
      const double best = r.attend_graph > 0 ? r.attend_graph : r.attend, best_dense = r.dense_graph > 0 ? r.dense_graph : r.dense;
      const int dec = gpu ? 1 : 2;  // us on the GPU, ms on the CPU
      std::printf("| %lld | %lldK | %.*f | %.*f | %.*f | %.*f | %.*f | %.*f | %.*f | %.0f | %.0f | %.2fx |\n",
                  static_cast<long long>(r.B), static_cast<long long>(r.T / 1024), dec, r.attend * scale, dec,
                  r.attend_graph * scale, dec, r.append_block * scale, dec, r.append_plain * scale, dec,
                  r.step_graph * scale, dec, r.dense * scale, dec, r.dense_graph * scale, r.nsa_bytes / (best * 1e6),
                  r.dense_bytes / (best_dense * 1e6), best_dense / best);
      if (csv)
        std::fprintf(csv, "%s,%lld,%lld,%lld,%lld,%lld,%lld,%s,%s,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.0f,%.0f\n",
                     nsa::backend_name(o.backend), static_cast<long long>(r.B), static_cast<long long>(r.T),
                     static_cast<long long>(o.hq), static_cast<long long>(o.hkv), static_cast<long long>(o.dqk),
                     static_cast<long long>(o.dv), nsa::dtype_name(o.dtype), nsa::phi_kind_name(o.phi), r.attend,
                     r.attend_graph, r.append_block, r.append_plain, r.step_graph, r.dense, r.dense_graph, r.nsa_bytes,
                     r.dense_bytes);
    }
    if (csv) std::fclose(csv);
    return 0;
  } catch (const nsa::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nsa_decode_bench: %s\n", e.what());
    return 1;
  }
}
