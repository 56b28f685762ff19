// The CPU backend's gradients against the fp64 reference, and thread-count determinism.
#include <gtest/gtest.h>

#include <cstring>

#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

using Case = CpuCase;

std::vector<Case> cases() {
  return {
      {"small_packed_mlp", make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp), make_sizes({37, 0, 50, 1}, 4, 2, 16, 8)},
      {"paper_blocks_G16_linear", make_config(32, 16, 64, 4, 1, 2, 70, PhiKind::linear),
       make_sizes({200, 97}, 16, 1, 32, 16)},
      {"G1_shared_mean", make_config(16, 8, 32, 4, 0, 1, 40, PhiKind::mean, true), make_sizes({150}, 2, 2, 24, 40)},
      {"n_above_blocks_no_window", make_config(8, 4, 16, 20, 2, 1, 0, PhiKind::mlp), make_sizes({90}, 8, 1, 8, 8)},
      {"no_selection_shared_mlp", make_config(8, 8, 8, 0, 0, 0, 33, PhiKind::mlp, true), make_sizes({70, 3}, 6, 3, 8, 16)},
      {"long_selection_blocks", make_config(16, 16, 128, 3, 1, 1, 20, PhiKind::linear), make_sizes({300}, 4, 1, 8, 8)},
  };
}

// Copies the saved forward state (lse, indices) of `from` into `to`.
void take_saved(LayerProblem& to, const LayerProblem& from) {
  to.lse = from.lse;
  to.indices = from.indices;
}

class CpuBackward : public IsaTest {};

TEST_P(CpuBackward, LayerGradientsMatchReference) {
  for_each_case(cases(), dtype(), 1000, [](const Case& c, const Sizes& s, LayerProblem& cpu, uint64_t) {
    LayerProblem truth = to_f64(cpu);
    Context ref = context_of(Backend::reference);
    forward(ref, c.cfg, truth.inputs(), truth.outputs());  // lse and indices every run uses
    LayerProblem rounded = cpu;
    take_saved(cpu, truth);
    take_saved(rounded, truth);
    cpu.o_branch = HostTensor();  // absent: the backward recomputes the branch outputs
    backward(ref, c.cfg, truth.inputs(), truth.outputs(), truth.d_o.view(), truth.gradients());
    backward(ref, c.cfg, rounded.inputs(), rounded.outputs(), rounded.d_o.view(), rounded.gradients());
    Context ctx = context_of(Backend::cpu);
    const Problem pr = problem_of(c.cfg, cpu.inputs());
    OwnedWorkspace ws = cpu_workspace(Op::backward, c.cfg, pr);
    backward(ctx, c.cfg, cpu.inputs(), cpu.outputs(), cpu.d_o.view(), cpu.gradients(), ws.ws);
    compare_gradients(cpu, truth, rounded);

    if (s.dtype == DType::f32) {
      // With saved branch outputs (f32: nothing rounded) the recomputation is skipped.
      LayerProblem again = cpu;
      again.o_branch = convert(truth.o_branch, DType::f32);
      for (HostTensor* t : {&again.dq, &again.dg}) t->poison();
      backward(ctx, c.cfg, again.inputs(), again.outputs(), again.d_o.view(), again.gradients(), ws.ws);
      compare_gradients(again, truth, rounded);
    }
  });
}

TEST_P(CpuBackward, DenseGradientsMatchReference) {
  for_each_case(cases(), dtype(), 2000, [](const Case& c, const Sizes& s, LayerProblem& p, uint64_t) {
    const DType dtype = s.dtype;
    const int64_t T = p.T;
    Sequences seqs = p.inputs().seqs;
    HostTensor q64 = convert(p.q, DType::f64), k64 = convert(p.k[0], DType::f64), v64 = convert(p.v[0], DType::f64);
    HostTensor do64 = convert(p.d_o, DType::f64);
    HostTensor o64(DType::f64, {T, s.hq, s.dv}), lse(DType::f32, {T, s.hq});
    Context ref = context_of(Backend::reference);
    dense_attention_fwd(ref, 0.0, q64.view(), k64.view(), v64.view(), seqs, o64.view(), lse.view());
    HostTensor o = convert(o64, dtype);
    auto grads = [&](DType dt) {
      std::vector<HostTensor> g = {HostTensor(dt, {T, s.hq, s.dqk}), HostTensor(dt, {T, s.hkv, s.dqk}),
                                   HostTensor(dt, {T, s.hkv, s.dv})};
      for (auto& t : g) t.poison();
      return g;
    };
    std::vector<HostTensor> truth = grads(DType::f64), rounded = grads(dtype), cpu = grads(dtype);
    dense_attention_bwd(ref, 0.0, q64.view(), k64.view(), v64.view(), seqs, o64.view(), lse.view(), do64.view(),
                        truth[0].view(), truth[1].view(), truth[2].view());
    dense_attention_bwd(ref, 0.0, p.q.view(), p.k[0].view(), p.v[0].view(), seqs, o.view(), lse.view(), p.d_o.view(),
                        rounded[0].view(), rounded[1].view(), rounded[2].view());
    Context ctx = context_of(Backend::cpu);
    const Problem pr = problem_of(c.cfg, p.inputs());
    OwnedWorkspace ws = cpu_workspace(Op::dense_attention_bwd, c.cfg, pr);
    dense_attention_bwd(ctx, 0.0, p.q.view(), p.k[0].view(), p.v[0].view(), seqs, o.view(), lse.view(), p.d_o.view(),
                        cpu[0].view(), cpu[1].view(), cpu[2].view(), ws.ws);
    const char* names[3] = {"dense dq", "dense dk", "dense dv"};
    for (int i = 0; i < 3; ++i) expect_close(names[i], cpu[i].values(), truth[i].values(), rounded[i].values());
  });
}

TEST_P(CpuBackward, CompressBackwardMatchesReference) {
  for_each_case(cases(), dtype(), 3000, [](const Case& c, const Sizes& s, LayerProblem& p, uint64_t seed) {
    const DType dtype = s.dtype;
    LayerProblem p64 = to_f64(p);
    const int64_t T = p.T, rows = T / c.cfg.cmp_stride;
    Sequences seqs = p.inputs().seqs;
    HostTensor dxc(dtype, {rows, s.hkv, s.dqk});
    std::mt19937_64 rng(seed + 1);
    dxc.fill_uniform(rng, -1, 1);
    HostTensor dxc64 = convert(dxc, DType::f64);
    Context ref = context_of(Backend::reference);
    Context ctx = context_of(Backend::cpu);
    HostTensor dx_truth(DType::f64, {T, s.hkv, s.dqk}), dx_round(dtype, {T, s.hkv, s.dqk}), dx_cpu(dtype, {T, s.hkv, s.dqk});
    for (HostTensor* t : {&dx_truth, &dx_round, &dx_cpu}) t->poison();
    compress_bwd(ref, c.cfg, LayerProblem::params(p64.phi_k), p64.k[0].view(), seqs, dxc64.view(), dx_truth.view(),
                 LayerProblem::params(p64.dphi_k));
    compress_bwd(ref, c.cfg, LayerProblem::params(p.phi_k), p.k[0].view(), seqs, dxc.view(), dx_round.view(),
                 LayerProblem::params(p.dphi_k));
    LayerProblem pc = p;
    for (auto& t : pc.dphi_k) if (t.defined()) t.poison();
    Problem pr = problem_of(c.cfg, p.inputs());
    pr.hq = pr.hkv;
    pr.dv = pr.dqk;
    OwnedWorkspace ws = cpu_workspace(Op::compress_bwd, c.cfg, pr);
    compress_bwd(ctx, c.cfg, LayerProblem::params(p.phi_k), p.k[0].view(), seqs, dxc.view(), dx_cpu.view(),
                 LayerProblem::params(pc.dphi_k), ws.ws);
    expect_close("compress_bwd dx", dx_cpu.values(), dx_truth.values(), dx_round.values());
    for (int i = 0; i < 5; ++i)
      if (pc.dphi_k[i].defined())
        expect_close("compress_bwd dphi[" + std::to_string(i) + "]", pc.dphi_k[i].values(), p64.dphi_k[i].values(),
                     p.dphi_k[i].values());
  });
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuBackward, ::testing::ValuesIn(isa_dtype_params()), isa_dtype_name);

// Bitwise the same outputs and gradients for 1, 2 and 3 threads, on every kernel table.
class CpuDeterminism : public IsaTest {};

TEST_P(CpuDeterminism, ThreadCountDoesNotChangeBits) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Sizes s = c.sizes;
    s.dtype = dtype();
    const LayerProblem base = make_problem(c.cfg, s, 77);
    std::vector<std::vector<unsigned char>> first;
    for (int threads : {1, 2, 3}) {
      LayerProblem p = base;
      Context ctx = context_of(Backend::cpu);
      ctx.num_threads = threads;
      const Problem pr = problem_of(c.cfg, p.inputs());
      OwnedWorkspace wf = cpu_workspace(Op::forward, c.cfg, pr, threads);
      forward(ctx, c.cfg, p.inputs(), p.outputs(), wf.ws);
      OwnedWorkspace wb = cpu_workspace(Op::backward, c.cfg, pr, threads);
      backward(ctx, c.cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients(), wb.ws);
      std::vector<std::vector<unsigned char>> bits;
      auto add = [&](HostTensor& t) {
        if (!t.defined()) return;
        const auto* b = static_cast<const unsigned char*>(t.data());
        bits.emplace_back(b, b + t.numel() * static_cast<int64_t>(dtype_size(t.dtype())));
      };
      for (HostTensor* t : {&p.o, &p.lse, &p.indices, &p.o_branch, &p.dq, &p.dg}) add(*t);
      for (int b = 0; b < 3; ++b) {
        add(p.dk[b]);
        add(p.dv[b]);
      }
      for (int i = 0; i < 5; ++i) {
        add(p.dphi_k[i]);
        add(p.dphi_v[i]);
      }
      if (first.empty()) first = bits;
      else EXPECT_TRUE(bits == first) << threads << " threads differ from 1 thread";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuDeterminism,
                         ::testing::Values(IsaDtype{"generic", DType::bf16}, IsaDtype{"avx2", DType::bf16},
                                           IsaDtype{"avx512", DType::bf16}, IsaDtype{"avx512bf16", DType::bf16},
                                           IsaDtype{"amx", DType::bf16}),
                         isa_dtype_name);

TEST(CpuWorkspace, SizedForTheCallsThreads) {
  const Config cfg = make_config(8, 4, 16, 3, 1, 2, 12, PhiKind::mlp);
  Sizes s = make_sizes({40}, 2, 1, 8, 8);
  s.dtype = DType::f32;
  LayerProblem p = make_problem(cfg, s, 5);
  const Problem pr = problem_of(cfg, p.inputs());
  Context ctx = context_of(Backend::cpu);
  ctx.num_threads = 1;
  OwnedWorkspace one = cpu_workspace(Op::forward, cfg, pr, 1);
  ctx.num_threads = 5;
  OwnedWorkspace five = cpu_workspace(Op::forward, cfg, pr, 5);
  EXPECT_GT(five.ws.bytes, one.ws.bytes) << "per-thread scratch";
  EXPECT_EQ(five.ws.bytes, cpu::workspace_bytes(Op::forward, cfg, pr, 5));
  // A workspace planned for 1 thread is too small for a 5-thread call: an nsa::Error.
  try {
    forward(ctx, cfg, p.inputs(), p.outputs(), one.ws);
    FAIL() << "expected nsa::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.parameter(), "workspace.bytes");
  }
  forward(ctx, cfg, p.inputs(), p.outputs(), five.ws);
}

}  // namespace

namespace {

// Empty sequences only (T = 0) and strided (non-contiguous) inputs.
TEST(CpuEdges, EmptyBatchRuns) {
  const Config cfg = make_config(8, 4, 16, 3, 1, 2, 12, PhiKind::mlp);
  Sizes s = make_sizes({0, 0}, 4, 2, 8, 8);
  s.dtype = DType::bf16;
  LayerProblem p = make_problem(cfg, s, 3);
  Context ctx = context_of(Backend::cpu);
  const Problem pr = problem_of(cfg, p.inputs());
  OwnedWorkspace wf = cpu_workspace(Op::forward, cfg, pr);
  forward(ctx, cfg, p.inputs(), p.outputs(), wf.ws);
  OwnedWorkspace wb = cpu_workspace(Op::backward, cfg, pr);
  backward(ctx, cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients(), wb.ws);
  SUCCEED();
}

// A view whose rows are padded (stride larger than the row) reads the same numbers.
TensorView padded_copy(const HostTensor& t, std::vector<float>& storage, int64_t pad) {
  const auto& sh = t.shape();
  const int64_t rows = sh[0], heads = sh[1], dim = sh[2];
  storage.assign(static_cast<size_t>(rows * heads * (dim + pad)), -12345.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dim; ++c)
        storage[static_cast<size_t>((r * heads + h) * (dim + pad) + c)] = static_cast<float>(t.get((r * heads + h) * dim + c));
  return make_view(storage.data(), DType::f32, {rows, heads, dim}, {heads * (dim + pad), dim + pad, 1});
}

TEST(CpuEdges, StridedInputsGiveTheSameBits) {
  const Config cfg = make_config(8, 4, 16, 3, 1, 2, 12, PhiKind::linear);
  Sizes s = make_sizes({45, 20}, 4, 2, 8, 16);
  s.dtype = DType::f32;
  LayerProblem a = make_problem(cfg, s, 9);
  LayerProblem b = a;
  std::vector<float> qs, ks, vs;
  Inputs in_b = b.inputs();
  in_b.q = padded_copy(b.q, qs, 3);
  in_b.kv[kSlc].k = padded_copy(b.k[kSlc], ks, 5);
  in_b.kv[kWin].v = padded_copy(b.v[kWin], vs, 1);
  Context ctx = context_of(Backend::cpu);
  const Problem pr = problem_of(cfg, a.inputs());
  OwnedWorkspace wf = cpu_workspace(Op::forward, cfg, pr);
  forward(ctx, cfg, a.inputs(), a.outputs(), wf.ws);
  forward(ctx, cfg, in_b, b.outputs(), wf.ws);
  EXPECT_EQ(a.o.values(), b.o.values());
  EXPECT_EQ(a.indices.values(), b.indices.values());
  OwnedWorkspace wb = cpu_workspace(Op::backward, cfg, pr);
  backward(ctx, cfg, a.inputs(), a.outputs(), a.d_o.view(), a.gradients(), wb.ws);
  backward(ctx, cfg, in_b, b.outputs(), b.d_o.view(), b.gradients(), wb.ws);
  EXPECT_EQ(a.dq.values(), b.dq.values());
  EXPECT_EQ(a.dk[kSlc].values(), b.dk[kSlc].values());
  EXPECT_EQ(a.dv[kWin].values(), b.dv[kWin].values());
  EXPECT_EQ(a.dphi_k[0].values(), b.dphi_k[0].values());
}

}  // namespace
