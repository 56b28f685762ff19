// The API fuzzer: the layer's forward and backward (a case of each).
#include "fuzz/fuzz_run.h"

namespace nsa::fuzz {
namespace {

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
// The largest |value| each branch's softmax mixes, summed over the branches: the compressed values
// phi makes of v_cmp (linear and mlp can leave the raw values' range), the raw values of the
// selection and window branches.
double branch_value_bound(const Draw& d, LayerProblem& truth) {
  double sum = 0;
  for (int b = 0; b < 3; ++b) {
    const int kb = d.cfg.shared_kv ? 0 : b;
    if (b != kCmp || d.cfg.phi == PhiKind::mean) {
      sum += test::max_abs(truth.v[kb].values());
      continue;
    }
    const Inputs in = truth.inputs();
    HostTensor vc(DType::f64, {cmp_rows(truth.T, d.cfg.cmp_stride), truth.v[0].shape()[1], truth.v[0].shape()[2]});
    for (int64_t i = 0; i < vc.numel(); ++i) vc.set(i, 0.0);  // rows of no block stay 0
    compress_fwd(test::context_of(Backend::reference), d.cfg, LayerProblem::params(truth.phi_v), truth.v[0].view(),
                 in.seqs, vc.view());
    sum += test::max_abs(vc.values());
  }
  return sum;
}

void compare_forward(const Draw& d, LayerProblem& got, LayerProblem& truth, LayerProblem& rounded) {
  const int64_t T = got.T, hq = d.sizes.hq, hkv = d.sizes.hkv, n = d.cfg.n_selected;
  if (d.backend == Backend::reference) {
    // The same fp64 computation on the same values: equal indices, outputs within rounding.
    expect_equal("indices", got.indices.values(), truth.indices.values());
  }
  const test::Rowset rows = test::compare_indices(got.indices, truth.indices, T, hkv, n);
  // Near-ties may pick another block (fp32 against fp64 scores): nearly every row agrees, except at
  // an extreme scale, where every score is within an fp32 ulp of another.
  if (!d.extreme_scale && rows.disagree > std::max<int64_t>(1, T * hkv / 100))
    throw Defect{std::to_string(rows.disagree) + " rows select other blocks than the reference"};
  if (d.extreme_scale) {
    // A scale so large that a plain fp32 implementation's rounding moves the softmax's winner:
    // outputs must be finite where the truth is, and within the values' range (|o| <= max|g| sum_b
    // max|V_b|, V_cmp phi's compressed values). Past fp32's range (|scale * q.k| above 3.4e38) the
    // fast backends may return inf or NaN.
    const double bound = test::max_abs(truth.g.values()) * branch_value_bound(d, truth) * 1.01 + 1e-3;
    for (double x : got.o.values())
      if (std::isfinite(x) && std::fabs(x) > bound)
        throw Defect{"o outside the range of the values: " + std::to_string(x) + " (bound " + std::to_string(bound) + ")"};
    return;
  }
  test::compare_layer_outputs(got, truth, rounded, rows, expect_close);
  expect_close_f32("lse", test::on_rows(got.lse, rows, T, hq, hkv, 3), test::on_rows(truth.lse, rows, T, hq, hkv, 3));
}

// The common mutation step of a call: config (when `cfg` is given), tensors, sequences, context.
}  // namespace

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
  test::compare_gradients(p, truth, rounded, expect_close);
}

}  // namespace nsa::fuzz
