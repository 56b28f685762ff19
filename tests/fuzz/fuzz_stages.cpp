// The API fuzzer: the stages (compress, compressed attention, top-n, selected and window
// attention, dense attention), a case of each.
#include "fuzz/fuzz_run.h"

namespace nsa::fuzz {
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

}  // namespace nsa::fuzz
