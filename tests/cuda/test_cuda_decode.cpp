// Decoding on the GPU (nsa/cache.h): random schedules of appends (a long first chunk, then single
// tokens and bursts; sequences of a batch at different lengths; pages shuffled), each step's rows
// attended, against the reference's decode of the very cache the GPU filled (fp64, the style.md
// tolerance), against the GPU's own prefill, with the compressed blocks appearing exactly when
// their last token arrives. Bad device metadata sets status bits, zeroes only its sequence's rows
// and writes nothing outside the pools; a captured CUDA graph replays the eager bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_support.h"
#include "decode_support.h"
#include "cases.h"

using namespace nsa;
using namespace nsa::test;

namespace {

// A decode case: an attention case with its page size, first appends and backbone offsets (the
// fields cases.h's random draws fill).
using DCase = RandomDraw;

Config config_of(const DCase& dc) {
  Config cfg = config_of(dc.c);
  cfg.set_backbone(dc.backbone);
  return cfg;
}

Sizes sizes_of(const DCase& dc) {
  Sizes s = make_sizes(dc.c.seqlens, dc.c.hq, dc.c.hkv, dc.c.dqk, dc.c.dv, 40);
  s.dtype = dc.c.dtype;
  return s;
}

void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

// Every head dim and group size the backend compiles, each phi, shared and independent K/V,
// page sizes from l' to 4 l', lengths that are multiples of nothing.
std::vector<DCase> cases() {
  return {
      {{"bf16_d128_G16_paper", DType::bf16, 128, 128, 16, 1, {1500, 700}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mlp, false}, 64, 900},
      {{"f16_d64_G1_shared_mean", DType::f16, 64, 64, 2, 2, {300, 0, 129}, 16, 8, 32, 4, 0, 1, 40, PhiKind::mean, true}, 32, 120},
      {{"bf16_d192x128_G8_linear", DType::bf16, 192, 128, 16, 2, {900}, 32, 16, 64, 8, 1, 1, 100, PhiKind::linear, false}, 128, 700},
      {{"f16_d128x64_G4_mlp_packed", DType::f16, 128, 64, 8, 2, {257, 1, 640, 77}, 16, 8, 32, 6, 1, 2, 64, PhiKind::mlp, true}, 64, 500},
      {{"bf16_d64_G2_n_above_no_window", DType::bf16, 64, 64, 4, 2, {200}, 8, 4, 16, 20, 2, 1, 0, PhiKind::mlp, false}, 16, 60},
      {{"bf16_d192x64_G16_long", DType::bf16, 192, 64, 16, 1, {2100}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mean, false}, 256, 1200},
      {{"bf16_d128_G8_backbone", DType::bf16, 128, 128, 16, 2, {1300, 500}, 32, 16, 64, 8, 1, 2, 256, PhiKind::mlp, false},
       128,
       600,
       {1, 4, 16}},
  };
}

// A host cache's device copy (same layout), and back.
struct DeviceCache {
  DeviceTensor k[3], v[3], kc, vc, block_table, seq_lens, status;
  explicit DeviceCache(const HostCache& h)
      : kc(h.kc), vc(h.vc), block_table(h.block_table), seq_lens(h.seq_lens), status(h.status) {
    for (int i = 0; i < 3; ++i) {
      k[i] = DeviceTensor(h.k[i]);
      v[i] = DeviceTensor(h.v[i]);
    }
  }
  PagedCache view(int64_t max_seqlen = 0) const {
    PagedCache c;
    for (int i = 0; i < 3; ++i) c.raw[i] = KV{k[i].view(), v[i].view()};
    c.cmp = KV{kc.view(), vc.view()};
    c.pages.block_table = block_table.view();
    c.pages.seq_lens = seq_lens.view();
    c.pages.status = status.view();
    c.pages.max_seqlen = max_seqlen;
    return c;
  }
  void download(HostCache& h) const {
    for (int i = 0; i < 3; ++i) {
      k[i].download(h.k[i]);
      v[i].download(h.v[i]);
    }
    kc.download(h.kc);
    vc.download(h.vc);
    status.download(h.status);
  }
};

// One step's rows on the device.
struct DeviceStep {
  DeviceTensor q, g, cu, o, lse, indices, o_branch, k[3], v[3];
  explicit DeviceStep(const StepRows& s)
      : q(s.q), g(s.g), cu(s.cu), o(s.o), lse(s.lse), indices(s.indices), o_branch(s.o_branch) {
    for (int i = 0; i < 3; ++i) {
      k[i] = DeviceTensor(s.k[i]);
      v[i] = DeviceTensor(s.v[i]);
    }
  }
  CacheAppend append(const LayerProblem& p, const std::vector<DeviceTensor>& phk, const std::vector<DeviceTensor>& phv,
                     int64_t max_rows) const {
    CacheAppend a;
    for (int i = 0; i < 3; ++i) a.kv[i] = KV{k[i].view(), v[i].view()};
    a.phi_k = PhiParams{phk[0].view(), phk[1].view(), phk[2].view(), phk[3].view(), phk[4].view()};
    a.phi_v = PhiParams{phv[0].view(), phv[1].view(), phv[2].view(), phv[3].view(), phv[4].view()};
    a.seqs.cu_seqlens = cu.view();
    a.seqs.max_seqlen = max_rows;
    (void)p;
    return a;
  }
  DecodeInputs queries(int64_t max_rows) const {
    DecodeInputs d;
    d.q = q.view();
    d.g = g.view();
    d.seqs.cu_seqlens = cu.view();
    d.seqs.max_seqlen = max_rows;
    return d;
  }
  ForwardOutputs outputs() const { return ForwardOutputs{o.view(), lse.view(), indices.view(), o_branch.view()}; }
  void download(StepRows& s) const {
    o.download(s.o);
    lse.download(s.lse);
    indices.download(s.indices);
    o_branch.download(s.o_branch);
  }
};

std::vector<DeviceTensor> device_phi(HostTensor* t) {
  std::vector<DeviceTensor> out;
  for (int i = 0; i < 5; ++i) out.emplace_back(t[i]);
  return out;
}

HostCache exact_copy(const HostCache& h) {
  HostCache e = h;
  for (int i = 0; i < 3; ++i) {
    e.k[i] = to_f64(h.k[i]);
    e.v[i] = to_f64(h.v[i]);
  }
  e.kc = to_f64(h.kc);
  e.vc = to_f64(h.vc);
  return e;
}

// Rows whose indices agree (per (row, KV head)) and an element mask over [rows, Hq, X].
std::vector<bool> agreeing_rows(const HostTensor& a, const HostTensor& b, int64_t T, int64_t hkv, int64_t n,
                                int64_t* disagree) {
  std::vector<bool> ok(static_cast<size_t>(T * hkv), true);
  *disagree = 0;
  for (int64_t r = 0; r < T * hkv; ++r)
    for (int64_t k = 0; k < n; ++k)
      if (a.get(r * n + k) != b.get(r * n + k)) {
        ok[static_cast<size_t>(r)] = false;
        ++*disagree;
        break;
      }
  return ok;
}

std::vector<bool> mask_of(const std::vector<bool>& rows, int64_t T, int64_t hq, int64_t hkv, int64_t X, int branches = 1) {
  std::vector<bool> m(static_cast<size_t>(branches * T * hq * X));
  for (size_t i = 0; i < m.size(); ++i) {
    const int64_t e = static_cast<int64_t>(i) % (T * hq * X);
    const int64_t t = e / (hq * X), h = (e / X) % hq;
    m[i] = rows[static_cast<size_t>(t * hkv + h / (hq / hkv))];
  }
  return m;
}

class CudaDecode : public ::testing::TestWithParam<DCase> {};

// Every step: GPU append + decode; the reference decodes the downloaded cache in fp64. At the end:
// every row against the reference (o, each branch, lse, indices), against the GPU prefill's rows,
// and the compressed pools against phi of the tokens (poisoned slots where no block ended yet).
TEST_P(CudaDecode, MatchesReferenceAndPrefillAtEveryStep) {
  NSA_REQUIRE_GPU();
  const DCase& dc = GetParam();
  const AttentionCase& c = dc.c;
  const Config cfg = config_of(dc);
  const Sizes sz = sizes_of(dc);
  LayerProblem p = make_problem(cfg, sz, 11);
  const int64_t T = p.T, hq = c.hq, hkv = c.hkv, n = c.n, longest = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  const Context cuda = cuda_context(Backend::cuda), ref = cuda_context(Backend::reference);
  const auto phk = device_phi(p.phi_k), phv = device_phi(p.phi_v);
  HostCache host = make_cache(cfg, sz, dc.page_size, longest + 3, 12);
  DeviceCache dev(host);
  const auto schedule = random_schedule(c.seqlens, 13, dc.first_max, 4);
  LayerProblem got = p, truth = p;  // the decoded rows: the GPU's, and the reference's (fp64)
  truth.o = HostTensor(DType::f64, p.o.shape());
  truth.o_branch = HostTensor(DType::f64, p.o_branch.shape());
  std::vector<int64_t> done(c.seqlens.size(), 0);
  int64_t max_rows = 0;
  for (const auto& step : schedule) max_rows = std::max(max_rows, *std::max_element(step.begin(), step.end()));
  for (const auto& step : schedule) {
    for (size_t b = 0; b < step.size(); ++b) host.seq_lens.set(int64_t(b), double(done[b] + step[b]));
    dev.seq_lens = DeviceTensor(host.seq_lens);
    StepRows s = step_rows(p, done, step);
    const DeviceStep ds(s);
    const PagedCache view = dev.view(longest + 3);
    const CacheAppend a = ds.append(p, phk, phv, max_rows);
    const DeviceWorkspace wa(workspace_size(cuda, Op::cache_append, cfg, problem_of(cfg, view, a)));
    cache_append(cuda, cfg, view, a, wa.view());
    const DecodeInputs d = ds.queries(max_rows);
    const DeviceWorkspace wd(workspace_size(cuda, Op::decode, cfg, problem_of(cfg, view, d)));
    decode(cuda, cfg, view, d, ds.outputs(), wd.view());
    sync();
    ds.download(s);
    dev.download(host);
    for (int64_t b = 0; b < host.B; ++b) ASSERT_EQ(host.status.get(b), 0) << "status of sequence " << b;
    // The reference on the cache the GPU filled, in fp64.
    StepRows t = s;
    t.q = to_f64(s.q);
    t.g = to_f64(s.g);
    t.o = HostTensor(DType::f64, s.o.shape());
    t.o_branch = HostTensor(DType::f64, s.o_branch.shape());
    HostCache exact = exact_copy(host);
    decode(ref, cfg, exact.view(), t.queries(), t.outputs());
    for (auto [from, to, br] : {std::tuple{&s.o, &got.o, false}, {&s.lse, &got.lse, false}, {&s.indices, &got.indices, false},
                                {&s.o_branch, &got.o_branch, true}})
      scatter_rows(*from, *to, step, done, sz, br);
    for (auto [from, to, br] : {std::tuple{&t.o, &truth.o, false}, {&t.lse, &truth.lse, false},
                                {&t.indices, &truth.indices, false}, {&t.o_branch, &truth.o_branch, true}})
      scatter_rows(*from, *to, step, done, sz, br);
    // Compressed blocks exist exactly up to N_c(len) (the poison pattern elsewhere).
    for (int64_t b = 0; b < host.B; ++b) {
      const int64_t len = done[static_cast<size_t>(b)] + step[static_cast<size_t>(b)];
      const int64_t ready = num_cmp_blocks(len, c.l, c.d), ps = dc.page_size, slots = ps / c.d;
      for (int64_t i = 0; i < host.max_pages * slots; ++i) {
        const int64_t page = static_cast<int64_t>(host.block_table.get(b * host.max_pages + cmp_block_page(i, c.d, ps)));
        const double x = host.kc.get((page * slots + cmp_block_slot(i, c.d, ps)) * hkv * c.dqk);
        ASSERT_EQ(std::isnan(x), i >= ready) << "compressed block " << i << " of sequence " << b << " at length " << len;
      }
    }
    for (size_t b = 0; b < step.size(); ++b) done[b] += step[b];
  }

  // The compressed pools against the fp64 reference's phi of the same tokens.
  {
    Sequences seqs;
    if (c.seqlens.size() > 1) seqs.cu_seqlens = p.cu.view();
    HostTensor pk[5], pv[5];
    for (int i = 0; i < 5; ++i) {
      pk[i] = to_f64(p.phi_k[i]);
      pv[i] = to_f64(p.phi_v[i]);
    }
    const int64_t rows = T / c.d;
    HostTensor kc64(DType::f64, {rows, hkv, c.dqk}), vc64(DType::f64, {rows, hkv, c.dv});
    compress_fwd(ref, cfg, LayerProblem::params(pk), to_f64(p.k[0]).view(), seqs, kc64.view());
    compress_fwd(ref, cfg, LayerProblem::params(pv), to_f64(p.v[0]).view(), seqs, vc64.view());
    const double u = unit_roundoff(c.dtype);
    for (auto [pool, want, D] : {std::tuple{&host.kc, &kc64, c.dqk}, {&host.vc, &vc64, c.dv}}) {
      std::vector<double> g, w;
      int64_t s0 = 0;
      for (int64_t b = 0; b < host.B; ++b) {
        const int64_t slots = dc.page_size / c.d;
        for (int64_t i = 0; i < num_cmp_blocks(c.seqlens[static_cast<size_t>(b)], c.l, c.d); ++i) {
          const int64_t page = static_cast<int64_t>(host.block_table.get(b * host.max_pages + cmp_block_page(i, c.d, dc.page_size)));
          for (int64_t e = 0; e < hkv * D; ++e) {
            g.push_back(pool->get((page * slots + cmp_block_slot(i, c.d, dc.page_size)) * hkv * D + e));
            w.push_back(want->get((s0 / c.d + i) * hkv * D + e));
          }
        }
        s0 += c.seqlens[static_cast<size_t>(b)];
      }
      const double wmax = max_abs(w);
      EXPECT_TRUE(close(g, w, [&](double x, size_t) { return 2 * u * std::fabs(x) + 1e-4 * (1 + wmax); })) << "compressed pool";
    }
  }

  // Rows against the reference.
  int64_t disagree = 0;
  const std::vector<bool> agree = agreeing_rows(got.indices, truth.indices, T, hkv, n, &disagree);
  EXPECT_LE(disagree, std::max<int64_t>(1, T * hkv / 100)) << "rows whose selection differs from the reference's";
  double vmax = 0;
  for (const HostTensor* v : {&host.vc, &host.v[0], &host.v[1], &host.v[2]})
    if (v->defined()) vmax = std::max(vmax, max_abs(v->values()));
  const std::vector<bool> m_o = mask_of(agree, T, hq, hkv, c.dv), m_ob = mask_of(agree, T, hq, hkv, c.dv, 3);
  const double u = unit_roundoff(c.dtype);
  auto tol = [&](double w, size_t) { return 2 * u * (std::fabs(w) + vmax) + 1e-6; };
  EXPECT_TRUE(close(got.o_branch.values(), truth.o_branch.values(), tol, &m_ob)) << "o_branch";
  EXPECT_TRUE(close(got.o.values(), truth.o.values(), [&](double w, size_t) { return 2 * u * (2 * std::fabs(w) + 3 * vmax) + 1e-6; },
                    &m_o))
      << "o";
  const std::vector<bool> m_lse = mask_of(agree, T, hq, hkv, 3);
  EXPECT_TRUE(close(got.lse.values(), truth.lse.values(), [](double w, size_t) { return 2e-4 * (1.0 + std::fabs(w)); }, &m_lse))
      << "lse";

  // Rows against the GPU prefill of the whole problem.
  LayerProblem pre = p;
  {
    DeviceTensor q(p.q), g(p.g), cu(p.cu), k[3], v[3];
    for (int i = 0; i < 3; ++i) {
      k[i] = DeviceTensor(p.k[i]);
      v[i] = DeviceTensor(p.v[i]);
    }
    DeviceTensor o(pre.o), lse(pre.lse), idx(pre.indices), ob(pre.o_branch);
    Inputs in;
    in.q = q.view();
    for (int i = 0; i < 3; ++i) in.kv[i] = KV{k[i].view(), v[i].view()};
    in.g = g.view();
    in.phi_k = PhiParams{phk[0].view(), phk[1].view(), phk[2].view(), phk[3].view(), phk[4].view()};
    in.phi_v = PhiParams{phv[0].view(), phv[1].view(), phv[2].view(), phv[3].view(), phv[4].view()};
    if (c.seqlens.size() > 1) in.seqs.cu_seqlens = cu.view();
    in.seqs.max_seqlen = longest;
    const ForwardOutputs out{o.view(), lse.view(), idx.view(), ob.view()};
    const DeviceWorkspace ws(workspace_size(cuda, Op::forward, cfg, problem_of(cfg, in)));
    forward(cuda, cfg, in, out, ws.view());
    sync();
    o.download(pre.o);
    lse.download(pre.lse);
    idx.download(pre.indices);
    ob.download(pre.o_branch);
  }
  const std::vector<bool> agree_pre = agreeing_rows(got.indices, pre.indices, T, hkv, n, &disagree);
  EXPECT_LE(disagree, std::max<int64_t>(1, T * hkv / 100)) << "rows whose selection differs from the GPU prefill's";
  // The prefill keeps its compressed keys in fp32, the cache in the storage type: one more rounding.
  const std::vector<bool> m_pre = mask_of(agree_pre, T, hq, hkv, c.dv);
  EXPECT_TRUE(close(got.o.values(), pre.o.values(), [&](double w, size_t) { return 4 * u * (2 * std::fabs(w) + 3 * vmax) + 1e-5; },
                    &m_pre))
      << "o against the prefill";
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDecode, ::testing::ValuesIn(cases()), [](const auto& info) { return info.param.c.name; });

INSTANTIATE_TEST_SUITE_P(Random, CudaDecode, ::testing::ValuesIn(random_draws(3, 1200)), [](const auto& info) { return info.param.c.name; });

// ---- bad device metadata, and CUDA graphs --------------------------------------------------------

// A device copy with guard bytes on both sides (a pattern that must survive every call).
class Guarded {
 public:
  static constexpr size_t kGuard = 4096;
  explicit Guarded(const HostTensor& h) : shape_(h.shape()), dtype_(h.dtype()) {
    bytes_ = static_cast<size_t>(h.numel()) * dtype_size(dtype_);
    if (cudaMalloc(&base_, bytes_ + 2 * kGuard) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    cudaMemset(base_, 0x5a, bytes_ + 2 * kGuard);
    cudaMemcpy(static_cast<char*>(base_) + kGuard, const_cast<HostTensor&>(h).data(), bytes_, cudaMemcpyHostToDevice);
  }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  ~Guarded() { cudaFree(base_); }
  TensorView view() const {
    return contiguous_view(static_cast<char*>(base_) + kGuard, dtype_, shape_, Device::cuda);
  }
  bool guards_intact() const {
    std::vector<unsigned char> g(2 * kGuard);
    cudaMemcpy(g.data(), base_, kGuard, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.data() + kGuard, static_cast<char*>(base_) + kGuard + bytes_, kGuard, cudaMemcpyDeviceToHost);
    return std::all_of(g.begin(), g.end(), [](unsigned char x) { return x == 0x5a; });
  }
  void download(HostTensor& h) const {
    cudaMemcpy(h.data(), static_cast<char*>(base_) + kGuard, bytes_, cudaMemcpyDeviceToHost);
  }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::vector<int64_t> shape_;
  DType dtype_;
};

struct GuardedCache {
  std::vector<std::unique_ptr<Guarded>> pools;  // k0 v0 k1 v1 k2 v2 kc vc
  PagedCache view;
  GuardedCache(const HostCache& h, const HostTensor& block_table, const DeviceTensor& lens, const DeviceTensor& status) {
    for (int i = 0; i < 3; ++i) {
      pools.push_back(std::make_unique<Guarded>(h.k[i]));
      pools.push_back(std::make_unique<Guarded>(h.v[i]));
    }
    pools.push_back(std::make_unique<Guarded>(h.kc));
    pools.push_back(std::make_unique<Guarded>(h.vc));
    pools.push_back(std::make_unique<Guarded>(block_table));
    for (int i = 0; i < 3; ++i) view.raw[i] = KV{pools[2 * i]->view(), pools[2 * i + 1]->view()};
    view.cmp = KV{pools[6]->view(), pools[7]->view()};
    view.pages.block_table = pools[8]->view();
    view.pages.seq_lens = lens.view();
    view.pages.status = status.view();
  }
  bool intact() const {
    return std::all_of(pools.begin(), pools.end(), [](const auto& g) { return g->guards_intact(); });
  }
};

// After a clean prefill of four sequences, one decode step with one thing broken for sequence 2:
// its status bit is set, its rows are zeros (lse -inf), the other sequences' rows are the clean
// run's bits, other status entries stay 0, and no byte next to a pool, the table or the outputs
// changes (the pools' neighbours are guarded).
TEST(CudaDecodeStatus, BadDeviceMetadataIsReportedAndContained) {
  NSA_REQUIRE_GPU();
  const Config cfg = make_config(16, 8, 32, 4, 1, 1, 40, PhiKind::mlp);
  Sizes sz = make_sizes({101, 91, 81, 71}, 4, 2, 64, 64, 24);
  sz.dtype = DType::bf16;
  LayerProblem p = make_problem(cfg, sz, 21);
  const Context cuda = cuda_context(Backend::cuda);
  const auto phk = device_phi(p.phi_k), phv = device_phi(p.phi_v);
  const std::vector<int64_t> prompt = {100, 90, 80, 70}, one = {1, 1, 1, 1}, none = {0, 0, 0, 0};
  struct Bad {
    std::string name;
    int32_t bit;
    bool also_seq3;  // a broken cu_seqlens entry is shared by sequences 2 and 3
    std::function<void(HostTensor& table, HostTensor& lens, HostTensor& cu, const HostCache&)> make;
  };
  const std::vector<Bad> bads = {
      {"new token's page out of range", kCacheBadPage, false,
       [](HostTensor& t, HostTensor&, HostTensor&, const HostCache& h) { t.set(2 * h.max_pages + 80 / h.page_size, h.num_pages + 5); }},
      {"an old page negative", kCacheBadPage, false,
       [](HostTensor& t, HostTensor&, HostTensor&, const HostCache& h) { t.set(2 * h.max_pages, -3); }},
      {"length past max_seqlen", kCacheBadLength, false,
       [](HostTensor&, HostTensor& l, HostTensor&, const HostCache&) { l.set(2, 1000000); }},
      {"length below the new rows", kCacheBadLength, false, [](HostTensor&, HostTensor& l, HostTensor&, const HostCache&) { l.set(2, 0); }},
      {"cu_seqlens decreasing", kCacheBadRows, true, [](HostTensor&, HostTensor&, HostTensor& cu, const HostCache&) { cu.set(3, 1); }},
  };
  auto run = [&](const Bad* bad, StepRows& out, HostTensor& status_out, bool& intact) {
    HostCache host = make_cache(cfg, sz, 32, 128, 22);
    for (int b = 0; b < 4; ++b) host.seq_lens.set(b, double(prompt[static_cast<size_t>(b)]));
    DeviceTensor lens(host.seq_lens), status(host.status);
    GuardedCache gc(host, host.block_table, lens, status);
    gc.view.pages.max_seqlen = 128;
    {  // the prompts
      StepRows s = step_rows(p, none, prompt);
      const DeviceStep ds(s);
      const CacheAppend a = ds.append(p, phk, phv, 100);
      const DeviceWorkspace w(workspace_size(cuda, Op::cache_append, cfg, problem_of(cfg, gc.view, a)));
      cache_append(cuda, cfg, gc.view, a, w.view());
    }
    HostTensor table = host.block_table, l = host.seq_lens;
    for (int b = 0; b < 4; ++b) l.set(b, double(prompt[static_cast<size_t>(b)] + 1));
    StepRows s = step_rows(p, prompt, one);
    HostTensor cu = s.cu;
    if (bad) bad->make(table, l, cu, host);
    s.cu = cu;
    cudaMemcpy(const_cast<void*>(gc.view.pages.block_table.data), table.data(), table.numel() * 4, cudaMemcpyHostToDevice);
    lens = DeviceTensor(l);
    gc.view.pages.seq_lens = lens.view();
    const DeviceStep ds(s);
    Guarded o(s.o), lse(s.lse), idx(s.indices), ob(s.o_branch);
    const CacheAppend a = ds.append(p, phk, phv, 1);
    DecodeInputs d = ds.queries(1);
    const DeviceWorkspace wa(workspace_size(cuda, Op::cache_append, cfg, problem_of(cfg, gc.view, a)));
    cache_append(cuda, cfg, gc.view, a, wa.view());
    const DeviceWorkspace wd(workspace_size(cuda, Op::decode, cfg, problem_of(cfg, gc.view, d)));
    decode(cuda, cfg, gc.view, d, ForwardOutputs{o.view(), lse.view(), idx.view(), ob.view()}, wd.view());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    o.download(out.o);
    lse.download(out.lse);
    idx.download(out.indices);
    ob.download(out.o_branch);
    status.download(status_out);
    intact = gc.intact() && o.guards_intact() && lse.guards_intact() && idx.guards_intact() && ob.guards_intact();
  };
  StepRows clean = step_rows(p, prompt, one);
  HostTensor clean_status(DType::i32, {4});
  bool intact = false;
  run(nullptr, clean, clean_status, intact);
  ASSERT_TRUE(intact);
  for (int b = 0; b < 4; ++b) ASSERT_EQ(clean_status.get(b), 0);
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.name);
    StepRows got = step_rows(p, prompt, one);
    HostTensor status(DType::i32, {4});
    run(&bad, got, status, intact);
    EXPECT_TRUE(intact) << "a byte outside the pools, the table or the outputs changed";
    for (int b = 0; b < 4; ++b) {
      const bool broken = b == 2 || (bad.also_seq3 && b == 3);
      const int32_t st = static_cast<int32_t>(status.get(b));
      if (broken) EXPECT_NE(st & bad.bit, 0) << "status of sequence " << b << " = " << st;
      else EXPECT_EQ(st, 0) << "status of sequence " << b;
      // Row b: zeros if broken, else the clean bits.
      const int64_t per = sz.hq * sz.dv;
      for (int64_t e = 0; e < per; ++e) {
        const double g = got.o.get(b * per + e), c = clean.o.get(b * per + e);
        if (broken) ASSERT_EQ(g, 0.0) << "o of broken sequence " << b;
        else ASSERT_TRUE(g == c) << "o of sequence " << b << " element " << e << ": " << g << " vs " << c;
      }
      for (int64_t e = 0; e < sz.hq * 3; ++e)
        if (broken) ASSERT_TRUE(std::isinf(got.lse.get(b * sz.hq * 3 + e))) << "lse of broken sequence " << b;
    }
  }
}

// A step captured in a CUDA graph, replayed with the next steps' rows and lengths copied into its
// buffers (as an engine does), gives the eager steps' bits.
TEST(CudaDecodeGraph, ReplayEqualsEager) {
  NSA_REQUIRE_GPU();
  const Config cfg = make_config(32, 16, 64, 8, 1, 2, 128, PhiKind::mlp);
  Sizes sz = make_sizes({640, 400}, 16, 2, 128, 128, 32);
  sz.dtype = DType::bf16;
  LayerProblem p = make_problem(cfg, sz, 31);
  const auto phk = device_phi(p.phi_k), phv = device_phi(p.phi_v);
  const std::vector<int64_t> prompt = {600, 360}, one = {1, 1};
  const int steps = 20;  // crosses compressed-block ends (every 16 tokens)
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  Context cuda = cuda_context(Backend::cuda);
  cuda.stream = stream;
  auto prefilled = [&](HostCache& host) {
    for (int b = 0; b < 2; ++b) host.seq_lens.set(b, double(prompt[static_cast<size_t>(b)]));
    auto dev = std::make_unique<DeviceCache>(host);
    StepRows s = step_rows(p, {0, 0}, prompt);
    const DeviceStep ds(s);
    const PagedCache view = dev->view(640);
    const CacheAppend a = ds.append(p, phk, phv, 600);
    const DeviceWorkspace w(workspace_size(cuda, Op::cache_append, cfg, problem_of(cfg, view, a)));
    cache_append(cuda, cfg, view, a, w.view());
    cudaStreamSynchronize(stream);
    return dev;
  };
  HostCache h1 = make_cache(cfg, sz, 64, 640, 32), h2 = h1;
  auto eager = prefilled(h1), graphed = prefilled(h2);
  // Fixed buffers of the graph: one step's rows, lengths, outputs, workspaces.
  StepRows s0 = step_rows(p, prompt, one);
  DeviceStep fixed(s0);
  HostTensor lens(DType::i32, {2});
  graphed->seq_lens = DeviceTensor(lens);
  const PagedCache gview = graphed->view(640);
  const CacheAppend ga = fixed.append(p, phk, phv, 1);
  const DecodeInputs gd = fixed.queries(1);
  const DeviceWorkspace wa(workspace_size(cuda, Op::cache_append, cfg, problem_of(cfg, gview, ga)));
  const DeviceWorkspace wd(workspace_size(cuda, Op::decode, cfg, problem_of(cfg, gview, gd)));
  auto upload_step = [&](int i, DeviceStep& dst, DeviceTensor& dlens) {
    const std::vector<int64_t> at = {prompt[0] + i, prompt[1] + i};
    StepRows s = step_rows(p, at, one);
    for (auto [h, d] : {std::pair{&s.q, &dst.q}, {&s.g, &dst.g}, {&s.k[0], &dst.k[0]}, {&s.v[0], &dst.v[0]},
                        {&s.k[1], &dst.k[1]}, {&s.v[1], &dst.v[1]}, {&s.k[2], &dst.k[2]}, {&s.v[2], &dst.v[2]}})
      cudaMemcpyAsync(const_cast<void*>(d->view().data), h->data(), h->numel() * dtype_size(h->dtype()), cudaMemcpyHostToDevice, stream);
    HostTensor l(DType::i32, {2});
    for (int b = 0; b < 2; ++b) l.set(b, double(at[static_cast<size_t>(b)] + 1));
    cudaMemcpyAsync(const_cast<void*>(dlens.view().data), l.data(), 8, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);  // l and s live on this frame
  };
  upload_step(0, fixed, graphed->seq_lens);
  // Warm-up outside the capture (kernel attributes), then capture.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cache_append(cuda, cfg, gview, ga, wa.view());
  decode(cuda, cfg, gview, gd, fixed.outputs(), wd.view());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < steps; ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    // Eager.
    StepRows se = step_rows(p, {prompt[0] + i, prompt[1] + i}, one);
    DeviceStep de(se);
    HostTensor l(DType::i32, {2});
    for (int b = 0; b < 2; ++b) l.set(b, double(prompt[static_cast<size_t>(b)] + i + 1));
    eager->seq_lens = DeviceTensor(l);
    const PagedCache ev = eager->view(640);
    cache_append(cuda, cfg, ev, de.append(p, phk, phv, 1), wa.view());
    decode(cuda, cfg, ev, de.queries(1), de.outputs(), wd.view());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    de.download(se);
    // Graph.
    upload_step(i, fixed, graphed->seq_lens);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    StepRows sg = step_rows(p, {prompt[0] + i, prompt[1] + i}, one);
    fixed.download(sg);
    for (auto [a, b] : {std::pair{&se.o, &sg.o}, {&se.lse, &sg.lse}, {&se.indices, &sg.indices}, {&se.o_branch, &sg.o_branch}})
      ASSERT_EQ(std::memcmp(a->data(), b->data(), a->numel() * dtype_size(a->dtype())), 0);
  }
  HostCache e1 = h1, g2 = h2;
  eager->download(e1);
  graphed->download(g2);
  EXPECT_EQ(std::memcmp(e1.kc.data(), g2.kc.data(), e1.kc.numel() * 2), 0) << "compressed pools";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
