// Forward operations of the CPU backend: the stages on their own, the fused layer forward and
// dense causal attention. The layer forward does everything for one tile in one go: compressed
// attention with the selection scores, top-n, the selected and window branches and the gated
// combine, so S and the branch outputs never leave the thread's scratch.
#include <cmath>

#include "cpu/ops.h"
#include "cpu/phi.h"

namespace nsa::cpu {

namespace {

void set_indices(Branch& br, const TensorView& indices) {
  br.idx = static_cast<const int32_t*>(indices.data);
  br.idx_s0 = indices.stride[0];
  br.idx_s1 = indices.stride[1];
}

// Writes rows [M][ld] of a tile to o [T, Hq, Dv] and lse [T, Hq] (lse optional).
void store_tile(const Dims& d, const Seq& s, int64_t hk, const int32_t* tokens, int64_t nt,
                const float* o_rows, const float* lse_rows, const TensorView& o, const TensorView& lse) {
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t r = i * d.G + g, row = s.q0 + tokens[i], h = hk * d.G + g;
      store_row(o, row, h, o_rows + r * d.dvp, d.dv);
      if (lse.defined()) static_cast<float*>(lse.data)[row * lse.stride[0] + h * lse.stride[1]] = lse_rows[r];
    }
}

// One branch over all tiles: the three single-branch attention ops and dense attention.
void branch_op(const Plan& p, Branch br, const TensorView& q, const TensorView& o,
               const TensorView& lse, Workspace ws) {
  const Dims d = dims_of(p);
  const size_t shared_bytes = pack_bytes(p.cfg, problem_of(p), d, br.kind, kForwardNeeds);
  const Slots slots = carve_slots(p, ws, shared_bytes, attention_slot_bytes(d));
  if (branch_packs(p.cfg, br.kind)) {
    Arena shared(ws.data, shared_bytes);
    prepack(p, d, br, kForwardNeeds, shared, slots);
  }
  const Rows qrows = Rows::of(q);
  for_each_tile(p, d.tile_tokens, p.hkv, slots, [&](const Seq& s, int64_t t0, int64_t nt, int64_t hk, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    fill_tokens(sc.tokens, t0, nt);
    pack_query(d, qrows, s, sc.tokens, nt, hk, sc.q, sc.qb);
    attend_fwd(d, br, s, hk, sc.tokens, nt, sc.q, sc.qb, sc, sc.o[0], sc.lse);
    store_tile(d, s, hk, sc.tokens, nt, sc.o[0], sc.lse, o, lse);
  });
}

}  // namespace

void compressed_attention_fwd(const Plan& p, const TensorView& q, const TensorView& kc,
                              const TensorView& vc, const TensorView& o, const TensorView& lse,
                              const TensorView& scores, Workspace ws) {
  const Dims d = dims_of(p);
  const size_t shared_bytes = pack_bytes(p.cfg, problem_of(p), d, Kind::cmp, kForwardNeeds);
  const Slots slots = carve_slots(p, ws, shared_bytes, attention_slot_bytes(d));
  Branch br = branch_of(p, Kind::cmp, kc, vc);
  {
    Arena shared(ws.data, shared_bytes);
    prepack(p, d, br, kForwardNeeds, shared, slots);
  }
  const Rows qrows = Rows::of(q);
  const int64_t ns_out = scores.defined() ? scores.shape[2] : 0;
  for_each_tile(p, d.tile_tokens, p.hkv, slots, [&](const Seq& s, int64_t t0, int64_t nt, int64_t hk, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    fill_tokens(sc.tokens, t0, nt);
    pack_query(d, qrows, s, sc.tokens, nt, hk, sc.q, sc.qb);
    attend_cmp_fwd(d, br, p.cfg.slc_block_len, s, hk, sc.tokens, nt, sc.q, sc.qb, sc, sc.o[0], sc.lse,
                   scores.defined() ? sc.scores : nullptr);
    store_tile(d, s, hk, sc.tokens, nt, sc.o[0], sc.lse, o, lse);
    if (!scores.defined()) return;
    for (int64_t i = 0; i < nt; ++i) {
      float* out = static_cast<float*>(scores.data) + (s.q0 + sc.tokens[i]) * scores.stride[0] + hk * scores.stride[1];
      const float* S = sc.scores + i * d.ns_max_p;
      const int64_t valid = std::min(d.ns_max, ns_out);
      for (int64_t j = 0; j < valid; ++j) out[j] = S[j];
      for (int64_t j = valid; j < ns_out; ++j) out[j] = 0.0f;
    }
  });
}

void select_topn(const Plan& p, const TensorView& scores, const TensorView& indices, Workspace ws) {
  const int64_t ns_p = round_up(std::max<int64_t>(p.n_slc_max, 1), kColPad);
  const Slots slots = carve_slots(p, ws, 0, Arena::round_bytes(static_cast<size_t>(ns_p) * 4));
  const int64_t n = p.cfg.n_selected;
  if (n == 0) return;
  parallel_for(p.T * p.hkv, slots, [&](int64_t item, Arena arena) {
    int32_t* cand = arena.take<int32_t>(ns_p);
    const int64_t row = item / p.hkv, hk = item % p.hkv;
    const int64_t b = std::upper_bound(p.cu.begin(), p.cu.end(), row) - p.cu.begin() - 1;
    const int64_t t = row - p.seq_start(b);
    const float* S = static_cast<const float*>(scores.data) + row * scores.stride[0] + hk * scores.stride[1];
    int32_t* out = static_cast<int32_t*>(indices.data) + row * indices.stride[0] + hk * indices.stride[1];
    topn_row(p.cfg, t, S, cand, out, n);
  });
}

void selected_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& indices, const TensorView& o, const TensorView& lse,
                            Workspace ws) {
  Branch br = branch_of(p, Kind::slc, k, v);
  set_indices(br, indices);
  branch_op(p, br, q, o, lse, ws);
}

void window_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o, const TensorView& lse, Workspace ws) {
  branch_op(p, branch_of(p, Kind::win, k, v), q, o, lse, ws);
}

void dense_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse, Workspace ws) {
  branch_op(p, branch_of(p, Kind::dense, k, v), q, o, lse, ws);
}

// ---- The fused layer forward --------------------------------------------------------------

namespace {

// Shared part of the forward workspace: compressed keys and values in fp32, then phi's part.
struct ForwardShared {
  float* kc;  // [T/d][Hkv][Dqk]
  float* vc;  // [T/d][Hkv][Dv]
};

template <typename A>
ForwardShared layout_forward_shared(A& a, int64_t T, int64_t d, int64_t hkv, int64_t dqk, int64_t dv) {
  ForwardShared s;
  s.kc = a.template take<float>(cmp_rows(T, d) * hkv * dqk);
  s.vc = a.template take<float>(cmp_rows(T, d) * hkv * dv);
  return s;
}

size_t phi_shared_bytes(const Config& cfg, const Problem& pr, bool backward, size_t* slot) {
  Sizer shared_k, slot_k, shared_v, slot_v;
  phi_sizes(cfg, pr.total_tokens, pr.batch, pr.hkv, pr.dqk, pr.phi_hidden, backward, shared_k, slot_k);
  phi_sizes(cfg, pr.total_tokens, pr.batch, pr.hkv, pr.dv, pr.phi_hidden, backward, shared_v, slot_v);
  *slot = std::max(slot_k.bytes, slot_v.bytes);
  return std::max(shared_k.bytes, shared_v.bytes);  // phi_k and phi_v run one after the other
}

}  // namespace

void forward(const Plan& p, const Inputs& in, const ForwardOutputs& out, Workspace ws) {
  const Dims d = dims_of(p);
  const WsSizes sizes = forward_sizes(Op::forward, p.cfg, problem_of(p));
  const Slots slots = carve_slots(p, ws, sizes.shared, sizes.slot);
  Arena shared(ws.data, sizes.shared);
  const ForwardShared fs = layout_forward_shared(shared, p.T, p.cfg.cmp_stride, p.hkv, p.dqk, p.dv);
  // §2: compressed keys and values (phi_k then phi_v, reusing phi's part of the workspace).
  const KV& cmp = detail::branch_kv(p.cfg, in, kCmp);
  {
    Arena phi_area = shared;
    phi_forward(p, in.phi_k, cmp.k, fs.kc, phi_area, slots);
  }
  {
    Arena phi_area = shared;
    phi_forward(p, in.phi_v, cmp.v, fs.vc, phi_area, slots);
  }
  Branch br_cmp;
  br_cmp.kind = Kind::cmp;
  br_cmp.k = Rows::of_f32(fs.kc, p.hkv, p.dqk);
  br_cmp.v = Rows::of_f32(fs.vc, p.hkv, p.dv);
  br_cmp.l = p.cfg.cmp_block_len;
  br_cmp.d = p.cfg.cmp_stride;
  const KV& slc = detail::branch_kv(p.cfg, in, kSlc);
  const KV& win = detail::branch_kv(p.cfg, in, kWin);
  Branch br_slc = branch_of(p, Kind::slc, slc.k, slc.v);
  set_indices(br_slc, out.indices);
  Branch br_win = branch_of(p, Kind::win, win.k, win.v);
  // Every branch's keys/values converted once (after phi, whose scratch they overwrite).
  {
    Arena packs_area = shared;
    prepack(p, d, br_cmp, kForwardNeeds, packs_area, slots);
    if (branch_packs(p.cfg, Kind::slc)) prepack(p, d, br_slc, kForwardNeeds, packs_area, slots);
    if (branch_packs(p.cfg, Kind::win)) prepack(p, d, br_win, kForwardNeeds, packs_area, slots);
  }
  const Rows qrows = Rows::of(in.q);
  const int64_t n = p.cfg.n_selected;

  for_each_tile(p, d.tile_tokens, p.hkv, slots, [&](const Seq& s, int64_t t0, int64_t nt, int64_t hk, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    fill_tokens(sc.tokens, t0, nt);
    pack_query(d, qrows, s, sc.tokens, nt, hk, sc.q, sc.qb);
    const int64_t M = nt * d.G;
    // §2-§4: compressed branch, selection scores, top-n (written to out.indices, then read by
    // the selection branch of this same tile).
    attend_cmp_fwd(d, br_cmp, p.cfg.slc_block_len, s, hk, sc.tokens, nt, sc.q, sc.qb, sc, sc.o[kCmp], sc.lse,
                   n > 0 ? sc.scores : nullptr);
    for (int64_t r = 0; r < M; ++r) sc.lse3[r * 3 + kCmp] = sc.lse[r];
    if (n > 0)
      for (int64_t i = 0; i < nt; ++i) {
        int32_t* row = static_cast<int32_t*>(out.indices.data) + (s.q0 + sc.tokens[i]) * out.indices.stride[0] +
                       hk * out.indices.stride[1];
        topn_row(p.cfg, sc.tokens[i], sc.scores + i * d.ns_max_p, sc.topn, row, n);
      }
    // §5, §6.
    attend_fwd(d, br_slc, s, hk, sc.tokens, nt, sc.q, sc.qb, sc, sc.o[kSlc], sc.lse);
    for (int64_t r = 0; r < M; ++r) sc.lse3[r * 3 + kSlc] = sc.lse[r];
    attend_fwd(d, br_win, s, hk, sc.tokens, nt, sc.q, sc.qb, sc, sc.o[kWin], sc.lse);
    for (int64_t r = 0; r < M; ++r) sc.lse3[r * 3 + kWin] = sc.lse[r];
    // §7: the gated combine.
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t g = 0; g < d.G; ++g) {
        const int64_t r = i * d.G + g, row = s.q0 + sc.tokens[i], h = hk * d.G + g;
        float* acc = sc.dout + r * d.dvp;  // free here: reused as the combine buffer
        std::fill(acc, acc + d.dv, 0.0f);
        for (int b = 0; b < 3; ++b) {
          const float gate = load_scalar(in.g, row * in.g.stride[0] + h * in.g.stride[1] + b * in.g.stride[2]);
          const float* ob = sc.o[b] + r * d.dvp;
          for (int64_t c = 0; c < d.dv; ++c) acc[c] += gate * ob[c];
          static_cast<float*>(out.lse.data)[row * out.lse.stride[0] + h * out.lse.stride[1] + b * out.lse.stride[2]] =
              sc.lse3[r * 3 + b];
          if (out.o_branch.defined()) {
            const TensorView& ob_view = out.o_branch;
            TensorView slice = ob_view;  // [T, Hq, Dv] of branch b
            slice.data = static_cast<char*>(ob_view.data) +
                         b * ob_view.stride[0] * static_cast<int64_t>(dtype_size(ob_view.dtype));
            slice.ndim = 3;
            for (int k = 0; k < 3; ++k) {
              slice.shape[k] = ob_view.shape[k + 1];
              slice.stride[k] = ob_view.stride[k + 1];
            }
            store_row(slice, row, h, ob, d.dv);
          }
          if (b == kCmp && out.o_cmp.defined()) store_row(out.o_cmp, row, h, ob, d.dv);
          if (b == kWin && out.o_win.defined()) store_row(out.o_win, row, h, ob, d.dv);
        }
        store_row(out.o, row, h, acc, d.dv);
      }
  });
}

WsSizes forward_sizes(Op op, const Config& cfg, const Problem& pr) {
  WsSizes w;
  const int64_t G = pr.hkv > 0 ? pr.hq / pr.hkv : 1;
  const Dims d = make_dims(cfg, std::max<int64_t>(G, 1), pr.dqk, pr.dv, 1.0, pr.max_seqlen, pr.dtype);
  switch (op) {
    case Op::compressed_attention_fwd:
    case Op::selected_attention_fwd:
    case Op::window_attention_fwd:
    case Op::dense_attention_fwd: {
      const Kind kind = op == Op::compressed_attention_fwd ? Kind::cmp
                        : op == Op::selected_attention_fwd ? Kind::slc
                        : op == Op::window_attention_fwd   ? Kind::win
                                                           : Kind::dense;
      w.shared = pack_bytes(cfg, pr, d, kind, kForwardNeeds);
      w.slot = attention_slot_bytes(d);
      return w;
    }
    case Op::select_topn:
      w.slot = Arena::round_bytes(static_cast<size_t>(round_up(std::max<int64_t>(d.ns_max, 1), kColPad)) * 4);
      return w;
    case Op::forward: {
      Sizer s;
      layout_forward_shared(s, pr.total_tokens, cfg.cmp_stride, pr.hkv, pr.dqk, pr.dv);
      size_t phi_slot = 0;
      const size_t packed = layer_pack_bytes(cfg, pr, d, kForwardNeeds);
      // phi's scratch and the packed keys/values share the space after kc/vc (one after the other).
      w.shared = s.bytes + std::max(phi_shared_bytes(cfg, pr, false, &phi_slot), packed);
      w.slot = std::max(attention_slot_bytes(d), phi_slot);
      return w;
    }
    default: return w;
  }
}

}  // namespace nsa::cpu
