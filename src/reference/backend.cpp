// The reference backend's entry points: load the views into fp64, run the stages, store back.
// forward()/backward() compose the stages exactly as spec §7-§8 read.
#include <cmath>
#include <algorithm>
#include <limits>

#include "nsa/blocks.h"
#include "reference/reference.h"

namespace nsa::reference {

namespace {

using detail::Plan;

void compress_fwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& xc,
                  Workspace) {
  const Array out = phi_forward(p, load_phi(phi), load(x));
  // Rows past a sequence's N_c are left untouched (api.h): store only the rows phi wrote.
  Array current = load(xc);
  const int64_t l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t first = cmp_row_offset(p.seq_start(b), d);
    const int64_t nc = num_cmp_blocks(p.seq_len(b), l, d);
    std::copy(out.row(first), out.row(first + nc), current.row(first));
  }
  store(current, xc);
}

void compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace) {
  const Phi params = load_phi(phi);
  Array g;
  Phi dparams;
  phi_backward(p, params, load(x), load(dxc), g, dparams);
  store(g, dx);
  store_phi(dparams, dphi);
}

void compressed_attention_fwd(const Plan& p, const TensorView& q, const TensorView& kc,
                              const TensorView& vc, const TensorView& o, const TensorView& lse,
                              const TensorView& scores, Workspace) {
  Array out, l;
  Array S;
  if (scores.defined()) S = Array({p.T, p.hkv, scores.shape[2]});
  cmp_attention(p, load(q), load(kc), load(vc), out, l, scores.defined() ? &S : nullptr);
  store(out, o);
  store(l, lse);
  store(S, scores);
}

void select_topn_op(const Plan& p, const TensorView& scores, const TensorView& indices, Workspace) {
  store_indices(select_topn(p, load(scores)), indices);
}

void selected_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& indices, const TensorView& o,
                            const TensorView& lse, Workspace) {
  Array out, l;
  slc_attention(p, load(q), load(k), load(v), load_indices(indices), out, l);
  store(out, o);
  store(l, lse);
}

// window_attention_fwd and dense_attention_fwd: a branch of q, k, v alone (win_attention,
// dense_attention), its output and log-sum-exp stored back.
template <void (*attend)(const Plan&, const Array&, const Array&, const Array&, Array&, Array&)>
void qkv_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& o, const TensorView& lse, Workspace) {
  Array out, l;
  attend(p, load(q), load(k), load(v), out, l);
  store(out, o);
  store(l, lse);
}

void dense_bwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView&, const TensorView&, const TensorView& d_o, const TensorView& dq,
               const TensorView& dk, const TensorView& dv, Workspace) {
  const Array Q = load(q), K = load(k), V = load(v);
  Array dQ(Q.shape), dK(K.shape), dV(V.shape);
  dense_attention_backward(p, Q, K, V, load(d_o), dQ, dK, dV);
  store(dQ, dq);
  store(dK, dk);
  store(dV, dv);
}

// Everything the forward computes, in fp64.
struct LayerState {
  Array q, g;
  Array k[3], v[3];  // raw K/V per branch (equal copies in shared_kv mode)
  Phi phi_k, phi_v;
  Array kc, vc;                 // compressed keys/values
  Array o_branch[3], lse[3];    // per-branch outputs [T, Hq, Dv] and lse [T, Hq]
  std::vector<int32_t> indices; // [T, Hkv, n]
};

LayerState load_layer(const Plan& p, const Inputs& in) {
  LayerState s;
  s.q = load(in.q);
  s.g = load(in.g);
  for (int b = 0; b < 3; ++b) {
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    s.k[b] = load(kv.k);
    s.v[b] = load(kv.v);
  }
  s.phi_k = load_phi(in.phi_k);
  s.phi_v = load_phi(in.phi_v);
  s.kc = phi_forward(p, s.phi_k, s.k[kCmp]);
  s.vc = phi_forward(p, s.phi_v, s.v[kCmp]);
  return s;
}

// The branch outputs given the selected indices (§5, §6) and the compressed branch (§2).
void run_branches(const Plan& p, LayerState& s) {
  cmp_attention(p, s.q, s.kc, s.vc, s.o_branch[kCmp], s.lse[kCmp], nullptr);
  slc_attention(p, s.q, s.k[kSlc], s.v[kSlc], s.indices, s.o_branch[kSlc], s.lse[kSlc]);
  win_attention(p, s.q, s.k[kWin], s.v[kWin], s.o_branch[kWin], s.lse[kWin]);
}

void forward(const Plan& p, const Inputs& in, const ForwardOutputs& out, Workspace) {
  LayerState s = load_layer(p, in);
  // §3-§4: selection scores from the compressed attention probabilities, then top-n.
  const int64_t Tq = p.query_rows();
  Array S({Tq, p.hkv, p.n_slc_max});
  Array o_tmp, lse_tmp;
  cmp_attention(p, s.q, s.kc, s.vc, o_tmp, lse_tmp, &S);
  s.indices = select_topn(p, S);
  run_branches(p, s);
  // §7: o = g_cmp o_cmp + g_slc o_slc + g_win o_win.
  Array o({Tq, p.hq, p.dv});
  Array lse({Tq, p.hq, 3});
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t h = 0; h < p.hq; ++h) {
      for (int b = 0; b < 3; ++b) {
        const double gate = s.g.at(t, h)[b];
        const double* ob = s.o_branch[b].at(t, h);
        for (int64_t c = 0; c < p.dv; ++c) o.at(t, h)[c] += gate * ob[c];
        lse.at(t, h)[b] = s.lse[b].row(t)[h];
      }
    }
  store(o, out.o);
  store(lse, out.lse);
  store_indices(s.indices, out.indices);
  if (out.o_branch.defined()) {
    Array all({3, Tq, p.hq, p.dv});
    for (int b = 0; b < 3; ++b)
      std::copy(s.o_branch[b].data.begin(), s.o_branch[b].data.end(), all.row(b));
    store(all, out.o_branch);
  }
  if (out.o_cmp.defined()) store(s.o_branch[kCmp], out.o_cmp);
  if (out.o_win.defined()) store(s.o_branch[kWin], out.o_win);
}

void backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
              const Gradients& grads, Workspace) {
  LayerState s = load_layer(p, in);
  s.indices = load_indices(saved.indices);  // §8: selection is a constant
  run_branches(p, s);
  const Array dO = load(d_o);
  // dg[t,h,b] = <dO, o_b>;  each branch's output gradient is g_b * dO.
  const int64_t Tq = p.query_rows();
  Array dg({Tq, p.hq, 3});
  Array dO_branch[3];
  for (int b = 0; b < 3; ++b) {
    dO_branch[b] = Array({Tq, p.hq, p.dv});
    for (int64_t t = 0; t < Tq; ++t)
      for (int64_t h = 0; h < p.hq; ++h) {
        const double gate = s.g.at(t, h)[b];
        double acc = 0.0;
        for (int64_t c = 0; c < p.dv; ++c) {
          acc += dO.at(t, h)[c] * s.o_branch[b].at(t, h)[c];
          dO_branch[b].at(t, h)[c] = gate * dO.at(t, h)[c];
        }
        dg.at(t, h)[b] = acc;
      }
  }
  Array dq(s.q.shape);
  Array dk[3], dv[3];
  for (int b = 0; b < 3; ++b) {
    dk[b] = Array(s.k[b].shape);
    dv[b] = Array(s.v[b].shape);
  }
  // Compression branch: through the attention to kc/vc, then through phi to the raw k/v.
  Array dkc(s.kc.shape), dvc(s.vc.shape);
  cmp_attention_backward(p, s.q, s.kc, s.vc, dO_branch[kCmp], dq, dkc, dvc);
  Phi dphi_k, dphi_v;
  phi_backward(p, s.phi_k, s.k[kCmp], dkc, dk[kCmp], dphi_k);
  phi_backward(p, s.phi_v, s.v[kCmp], dvc, dv[kCmp], dphi_v);
  slc_attention_backward(p, s.q, s.k[kSlc], s.v[kSlc], s.indices, dO_branch[kSlc], dq, dk[kSlc], dv[kSlc]);
  win_attention_backward(p, s.q, s.k[kWin], s.v[kWin], dO_branch[kWin], dq, dk[kWin], dv[kWin]);

  store(dq, grads.dq);
  store(dg, grads.dg);
  store_phi(dphi_k, grads.dphi_k);
  store_phi(dphi_v, grads.dphi_v);
  if (p.cfg.shared_kv) {  // one K/V serves all branches: its gradient is the sum
    for (int b = 1; b < 3; ++b)
      for (size_t e = 0; e < dk[0].data.size(); ++e) dk[0].data[e] += dk[b].data[e];
    for (int b = 1; b < 3; ++b)
      for (size_t e = 0; e < dv[0].data.size(); ++e) dv[0].data[e] += dv[b].data[e];
    store(dk[0], grads.dkv[kCmp].k);
    store(dv[0], grads.dkv[kCmp].v);
  } else {
    for (int b = 0; b < 3; ++b) {
      store(dk[b], grads.dkv[b].k);
      store(dv[b], grads.dkv[b].v);
    }
  }
}

size_t workspace_size(const Context&, Op, const Config&, const Problem&) { return 0; }

const detail::BackendOps kOps = {
    "reference",           workspace_size,          compress_fwd,         compress_bwd,
    compressed_attention_fwd, select_topn_op,      selected_attention_fwd, qkv_attention_fwd<win_attention>,
    forward,               backward,                qkv_attention_fwd<dense_attention>, dense_bwd,
    cache_append,          decode,                  dense_decode,         rotary,
};

}  // namespace

}  // namespace nsa::reference

namespace nsa::detail {
const BackendOps* reference_backend() { return &nsa::reference::kOps; }
}  // namespace nsa::detail
