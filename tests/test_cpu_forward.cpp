// The CPU backend's forward stages and layer forward against the fp64 reference.
#include <gtest/gtest.h>

#include <cstring>

#include "test_cpu_support.h"

using namespace nsa;
using namespace nsa::test;

namespace {

using Case = CpuCase;

// Awkward shapes on purpose: lengths not multiples of l, d, l', w; empty and one-token
// sequences; n above the block count; G from 1 to 16; shared and independent K/V; each phi.
std::vector<Case> cases() {
  return {
      {"small_packed_mlp", make_config(8, 4, 16, 3, 1, 1, 12, PhiKind::mlp), make_sizes({37, 0, 50, 1}, 4, 2, 16, 8)},
      {"paper_blocks_G16_linear", make_config(32, 16, 64, 5, 1, 2, 100, PhiKind::linear),
       make_sizes({300, 129}, 16, 1, 32, 16)},
      {"G1_shared_mean", make_config(16, 8, 32, 4, 0, 1, 40, PhiKind::mean, true), make_sizes({200}, 2, 2, 24, 40)},
      {"n_above_blocks_no_window", make_config(8, 4, 16, 20, 2, 1, 0, PhiKind::mlp), make_sizes({90}, 8, 1, 8, 8)},
      {"no_selection", make_config(8, 8, 8, 0, 0, 0, 33, PhiKind::linear), make_sizes({70, 3}, 6, 3, 8, 16)},
      {"head_dim_128_G16", make_config(32, 16, 64, 3, 1, 1, 64, PhiKind::mlp, true), make_sizes({150}, 16, 1, 128, 128, 16)},
  };
}

class CpuForward : public IsaTest {};

TEST_P(CpuForward, LayerMatchesReference) {
  for_each_case(cases(), dtype(), 10, [](const Case& c, const Sizes& s, LayerProblem& cpu, uint64_t) {
    LayerProblem rounded = cpu;          // reference, outputs rounded to the storage dtype
    LayerProblem truth = to_f64(cpu);    // reference in fp64 on the same values
    Context ref = context_of(Backend::reference);
    forward(ref, c.cfg, truth.inputs(), truth.outputs());
    forward(ref, c.cfg, rounded.inputs(), rounded.outputs());
    Context ctx = context_of(Backend::cpu);
    const Problem pr = problem_of(c.cfg, cpu.inputs());
    OwnedWorkspace ws = cpu_workspace(Op::forward, c.cfg, pr);
    forward(ctx, c.cfg, cpu.inputs(), cpu.outputs(), ws.ws);

    const int64_t T = cpu.T, hq = s.hq, hkv = s.hkv, n = c.cfg.n_selected;
    const Rowset rows = compare_indices(cpu.indices, truth.indices, T, hkv, n);
    // Near-ties may legitimately pick another block (fp32 vs fp64 scores); nearly all agree.
    EXPECT_LE(rows.disagree, std::max<int64_t>(1, T * hkv / 100)) << "rows with other indices";
    // The branches that do not depend on the selection on every row, the rest where indices agree.
    compare_layer_outputs(cpu, truth, rounded, rows);
    // lse is f32 in every run: the plain-precision error is the f32 rounding of the truth.
    const std::vector<double> lse_cpu = on_rows(cpu.lse, rows, T, hq, hkv, 3);
    const std::vector<double> lse_truth = on_rows(truth.lse, rows, T, hq, hkv, 3);
    EXPECT_LE(max_abs_diff(lse_cpu, lse_truth), 2e-5 * std::max(1.0, max_abs(lse_truth))) << "lse";
  });
}

// The compressed and window branches' outputs kept without o_branch (ForwardOutputs::o_cmp and
// o_win, which the CUDA backward reads) are o_branch's first and third planes bit for bit, on the
// reference and the cpu backend, and o is unchanged.
TEST_P(CpuForward, CompressedAndWindowOutputsAreTheirBranchOutputs) {
  for_each_case(cases(), dtype(), 10, [](const Case& c, const Sizes&, LayerProblem& p, uint64_t) {
    for (Backend backend : {Backend::reference, Backend::cpu}) {
      SCOPED_TRACE(backend_name(backend));
      Context ctx = context_of(backend);
      const Problem pr = problem_of(c.cfg, p.inputs());
      OwnedWorkspace ws = cpu_workspace(Op::forward, c.cfg, pr);
      LayerProblem with_oc = p;
      forward(ctx, c.cfg, p.inputs(), p.outputs(), ws.ws);
      HostTensor oc(with_oc.o.dtype(), with_oc.o.shape()), ow(with_oc.o.dtype(), with_oc.o.shape());
      oc.poison();
      ow.poison();
      ForwardOutputs out = with_oc.outputs();
      out.o_branch = TensorView();
      out.o_cmp = oc.view();
      out.o_win = ow.view();
      forward(ctx, c.cfg, with_oc.inputs(), out, ws.ws);
      const std::vector<double> ob = p.o_branch.values(), got = oc.values(), got_w = ow.values();
      ASSERT_EQ(got.size() * 3, ob.size());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), ob.begin())) << "o_cmp against o_branch[0]";
      EXPECT_TRUE(std::equal(got_w.begin(), got_w.end(), ob.begin() + 2 * got.size())) << "o_win against o_branch[2]";
      EXPECT_EQ(with_oc.o.values(), p.o.values()) << "o";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuForward, ::testing::ValuesIn(isa_dtype_params()), isa_dtype_name);

// The stages on their own, each fed identical inputs (so top-n sees the very same scores).
class CpuStages : public IsaTest {};

TEST_P(CpuStages, StagesMatchReference) {
  for_each_case(cases(), dtype(), 100, [](const Case& c, const Sizes& s, LayerProblem& p, uint64_t seed) {
    const DType dtype = s.dtype;
    const int64_t T = p.T, d = c.cfg.cmp_stride, rows = T / d;
    Context ref = context_of(Backend::reference);
    Context cpu = context_of(Backend::cpu);
    Sequences seqs = p.inputs().seqs;
    const Problem pr = problem_of(c.cfg, p.inputs());
    Problem prc = pr;  // compress_* see one head group: hq = hkv and D = Dqk
    prc.hq = prc.hkv;
    prc.dv = prc.dqk;

    // compress_fwd: kc of the compression keys.
    HostTensor kc_cpu(dtype, {rows, s.hkv, s.dqk}), kc_ref(dtype, {rows, s.hkv, s.dqk}), kc_truth(DType::f64, {rows, s.hkv, s.dqk});
    kc_cpu.poison();
    kc_ref.poison();
    kc_truth.poison();
    {
      OwnedWorkspace ws = cpu_workspace(Op::compress_fwd, c.cfg, prc);
      compress_fwd(cpu, c.cfg, LayerProblem::params(p.phi_k), p.k[0].view(), seqs, kc_cpu.view(), ws.ws);
      compress_fwd(ref, c.cfg, LayerProblem::params(p.phi_k), p.k[0].view(), seqs, kc_ref.view());
      LayerProblem p64 = to_f64(p);
      compress_fwd(ref, c.cfg, LayerProblem::params(p64.phi_k), p64.k[0].view(), seqs, kc_truth.view());
      // Rows past a sequence's blocks stay poisoned in all three (NaN == NaN for this check).
      std::vector<double> a = kc_cpu.values(), b = kc_truth.values(), r = kc_ref.values();
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(std::isnan(a[i]), std::isnan(b[i])) << "kc element " << i;
        if (std::isnan(a[i])) a[i] = b[i] = r[i] = 0;
      }
      expect_close("compress_fwd", a, b, r);
    }
    // compressed attention + scores, from kc/vc in the storage dtype (the reference's kc/vc).
    HostTensor vc(dtype, {rows, s.hkv, s.dv});
    {
      LayerProblem pv = p;
      for (auto& t : kc_ref.values()) (void)t;
      compress_fwd(ref, c.cfg, LayerProblem::params(p.phi_v), p.v[0].view(), seqs, vc.view());
      std::vector<double> kv = kc_ref.values(), vv = vc.values();
      for (size_t i = 0; i < kv.size(); ++i)
        if (std::isnan(kv[i])) kc_ref.set(static_cast<int64_t>(i), 0.0);
      for (int64_t i = 0; i < vc.numel(); ++i)
        if (std::isnan(vv[static_cast<size_t>(i)])) vc.set(i, 0.0);
    }
    const int64_t ns = (std::max<int64_t>(*std::max_element(s.seqlens.begin(), s.seqlens.end()), 1) +
                        c.cfg.slc_block_len - 1) / c.cfg.slc_block_len;
    HostTensor o_cpu(dtype, {T, s.hq, s.dv}), o_ref(dtype, {T, s.hq, s.dv}), o_truth(DType::f64, {T, s.hq, s.dv});
    HostTensor lse_cpu(DType::f32, {T, s.hq}), lse_truth(DType::f32, {T, s.hq});
    HostTensor S_cpu(DType::f32, {T, s.hkv, ns + 2}), S_truth(DType::f32, {T, s.hkv, ns + 2});
    for (HostTensor* t : {&o_cpu, &o_ref, &o_truth, &lse_cpu, &lse_truth, &S_cpu, &S_truth}) t->poison();
    {
      OwnedWorkspace ws = cpu_workspace(Op::compressed_attention_fwd, c.cfg, pr);
      compressed_attention_fwd(cpu, c.cfg, p.q.view(), kc_ref.view(), vc.view(), seqs, o_cpu.view(), lse_cpu.view(),
                               S_cpu.view(), ws.ws);
      compressed_attention_fwd(ref, c.cfg, p.q.view(), kc_ref.view(), vc.view(), seqs, o_ref.view(), lse_truth.view(),
                               S_truth.view());
      HostTensor q64 = convert(p.q, DType::f64), kc64 = convert(kc_ref, DType::f64), vc64 = convert(vc, DType::f64);
      HostTensor lse2(DType::f32, {T, s.hq});
      compressed_attention_fwd(ref, c.cfg, q64.view(), kc64.view(), vc64.view(), seqs, o_truth.view(), lse2.view(),
                               HostTensor().view());
      expect_close("compressed_attention_fwd o", o_cpu.values(), o_truth.values(), o_ref.values());
      EXPECT_LE(max_abs_diff(lse_cpu.values(), lse_truth.values()), 2e-5 * std::max(1.0, max_abs(lse_truth.values())));
      EXPECT_LE(max_abs_diff(S_cpu.values(), S_truth.values()), 2e-5 * std::max(1.0, max_abs(S_truth.values())))
          << "selection scores";
    }
    // top-n on identical scores: exactly the reference's choice. Quantised scores make many ties.
    if (c.cfg.n_selected > 0) {
      HostTensor S(DType::f32, {T, s.hkv, ns});
      std::mt19937_64 rng(seed + 1);
      for (int64_t i = 0; i < S.numel(); ++i) S.set(i, static_cast<double>(rng() % 4));
      HostTensor i_cpu(DType::i32, {T, s.hkv, c.cfg.n_selected}), i_ref(DType::i32, {T, s.hkv, c.cfg.n_selected});
      i_cpu.poison();
      i_ref.poison();
      OwnedWorkspace ws = cpu_workspace(Op::select_topn, c.cfg, pr);
      select_topn(cpu, c.cfg, S.view(), seqs, i_cpu.view(), ws.ws);
      select_topn(ref, c.cfg, S.view(), seqs, i_ref.view());
      EXPECT_EQ(i_cpu.values(), i_ref.values()) << "select_topn";
    }
    // Selection branch with the very same indices (those of a reference forward).
    {
      LayerProblem f = to_f64(p);
      forward(ref, c.cfg, f.inputs(), f.outputs());
      HostTensor so_cpu(dtype, {T, s.hq, s.dv}), so_ref(dtype, {T, s.hq, s.dv}), so_truth(DType::f64, {T, s.hq, s.dv});
      HostTensor sl_cpu(DType::f32, {T, s.hq}), sl_truth(DType::f32, {T, s.hq});
      for (HostTensor* t : {&so_cpu, &so_ref, &so_truth, &sl_cpu, &sl_truth}) t->poison();
      const int kb = c.cfg.shared_kv ? 0 : 1;
      OwnedWorkspace ws = cpu_workspace(Op::selected_attention_fwd, c.cfg, pr);
      selected_attention_fwd(cpu, c.cfg, p.q.view(), p.k[kb].view(), p.v[kb].view(), f.indices.view(), seqs,
                             so_cpu.view(), sl_cpu.view(), ws.ws);
      selected_attention_fwd(ref, c.cfg, p.q.view(), p.k[kb].view(), p.v[kb].view(), f.indices.view(), seqs,
                             so_ref.view(), HostTensor().view());
      selected_attention_fwd(ref, c.cfg, f.q.view(), f.k[kb].view(), f.v[kb].view(), f.indices.view(), seqs,
                             so_truth.view(), sl_truth.view());
      expect_close("selected_attention_fwd", so_cpu.values(), so_truth.values(), so_ref.values());
      EXPECT_LE(max_abs_diff(sl_cpu.values(), sl_truth.values()), 2e-5 * std::max(1.0, max_abs(sl_truth.values())));
    }
    // Window and dense attention.
    for (bool dense : {false, true}) {
      HostTensor wo_cpu(dtype, {T, s.hq, s.dv}), wo_ref(dtype, {T, s.hq, s.dv}), wo_truth(DType::f64, {T, s.hq, s.dv});
      HostTensor wl_cpu(DType::f32, {T, s.hq}), wl_truth(DType::f32, {T, s.hq});
      for (HostTensor* t : {&wo_cpu, &wo_ref, &wo_truth, &wl_cpu, &wl_truth}) t->poison();
      const int kb = c.cfg.shared_kv ? 0 : 2;
      HostTensor q64 = convert(p.q, DType::f64), k64 = convert(p.k[kb], DType::f64), v64 = convert(p.v[kb], DType::f64);
      if (dense) {
        OwnedWorkspace ws = cpu_workspace(Op::dense_attention_fwd, c.cfg, pr);
        dense_attention_fwd(cpu, 0.0, p.q.view(), p.k[kb].view(), p.v[kb].view(), seqs, wo_cpu.view(), wl_cpu.view(), ws.ws);
        dense_attention_fwd(ref, 0.0, p.q.view(), p.k[kb].view(), p.v[kb].view(), seqs, wo_ref.view(), HostTensor().view());
        dense_attention_fwd(ref, 0.0, q64.view(), k64.view(), v64.view(), seqs, wo_truth.view(), wl_truth.view());
      } else {
        OwnedWorkspace ws = cpu_workspace(Op::window_attention_fwd, c.cfg, pr);
        window_attention_fwd(cpu, c.cfg, p.q.view(), p.k[kb].view(), p.v[kb].view(), seqs, wo_cpu.view(), wl_cpu.view(), ws.ws);
        window_attention_fwd(ref, c.cfg, p.q.view(), p.k[kb].view(), p.v[kb].view(), seqs, wo_ref.view(), HostTensor().view());
        window_attention_fwd(ref, c.cfg, q64.view(), k64.view(), v64.view(), seqs, wo_truth.view(), wl_truth.view());
      }
      const char* what = dense ? "dense_attention_fwd" : "window_attention_fwd";
      expect_close(what, wo_cpu.values(), wo_truth.values(), wo_ref.values());
      EXPECT_LE(max_abs_diff(wl_cpu.values(), wl_truth.values()), 2e-5 * std::max(1.0, max_abs(wl_truth.values())))
          << what << " lse";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuStages, ::testing::ValuesIn(isa_dtype_params()), isa_dtype_name);

}  // namespace
