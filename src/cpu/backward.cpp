// Backward operations of the CPU backend (spec §8) and dense attention's backward.
//
// 1. phi recomputes the compressed keys/values (fp32).
// 2. Query-major pass, one tile of queries at a time: each branch's output (taken from
//    saved.o_branch when given, else recomputed), dg = <dO, o_b>, delta_b = <g_b dO, o_b>, and
//    dq summed over the three branches: every dq row is written by the tile that owns it.
// 3. Key-major passes, one key chunk at a time, over the queries that see it (for the selection
//    branch an inverted index lists, per KV block, the tokens that selected it): dk/dv of every
//    key row come from exactly one work item. The compressed branch's dkc/dvc then go through
//    phi's backward to the raw keys/values and phi's parameters.
// No atomics and no reduction whose order depends on scheduling: bitwise the same result for
// any number of threads.
#include <algorithm>
#include <cmath>

#include "cpu/ops.h"
#include "cpu/phi.h"

namespace nsa::cpu {

namespace {

// Per KV block of the selection branch, the tokens that selected it (ascending).
struct InvIndex {
  int64_t* seq_block0;  // [B+1] first global block id of each sequence
  int64_t* offset;      // [(blocks) * Hkv + 1]
  int32_t* tokens;      // [T * Hkv * min(n, ns_max)]: a row holds each of its blocks once
};

int64_t total_slc_blocks_bound(int64_t T, int64_t B, int64_t lp) { return T / lp + B + 1; }

template <typename A>
InvIndex layout_inv(A& a, int64_t T, int64_t B, int64_t hkv, int64_t n, int64_t lp, int64_t max_seqlen) {
  InvIndex inv{};
  inv.seq_block0 = a.template take<int64_t>(B + 1);
  inv.offset = a.template take<int64_t>(total_slc_blocks_bound(T, B, lp) * hkv + 1);
  inv.tokens = a.template take<int32_t>(T * hkv * std::min(n, num_slc_blocks(max_seqlen, lp)));
  return inv;
}

void build_inv(const Plan& p, const TensorView& indices, InvIndex& inv) {
  const int64_t n = p.cfg.n_selected, lp = p.cfg.slc_block_len, H = p.hkv;
  inv.seq_block0[0] = 0;
  for (int64_t b = 0; b < p.B; ++b) inv.seq_block0[b + 1] = inv.seq_block0[b] + num_slc_blocks(p.seq_len(b), lp);
  const int64_t nb = inv.seq_block0[p.B];
  std::fill(inv.offset, inv.offset + nb * H + 1, 0);
  if (n == 0) return;  // every list empty (indices [T, Hkv, 0] may have no data at all)
  // seen[j]: the last row (a running count) that listed block j, so that a repeat is found in O(1)
  // whatever n is. The valid blocks of a row are [0, J_t], fewer than n_slc_max.
  std::vector<int64_t> seen(static_cast<size_t>(std::max<int64_t>(p.n_slc_max, 1)), -1);
  auto for_each_pick = [&](auto fn) {
    int64_t row_id = 0;
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t t = p.q_first(b); t < p.seq_len(b); ++t)  // the sequence's queries
        for (int64_t hk = 0; hk < H; ++hk, ++row_id) {
          const int32_t* row = static_cast<const int32_t*>(indices.data) + (p.q_row0(b) + t) * indices.stride[0] +
                               hk * indices.stride[1];
          for (int64_t k = 0; k < n; ++k) {
            const int64_t j = row[k];
            // A row is a set (api.h): a repeated index adds nothing, as in the forward.
            if (j < 0 || j * lp > t || seen[static_cast<size_t>(j)] == row_id) continue;
            seen[static_cast<size_t>(j)] = row_id;
            fn((inv.seq_block0[b] + j) * H + hk, t);
          }
        }
  };
  auto reset = [&] { std::fill(seen.begin(), seen.end(), -1); };
  for_each_pick([&](int64_t slot, int64_t) { ++inv.offset[slot + 1]; });
  reset();
  for (int64_t i = 0; i < nb * H; ++i) inv.offset[i + 1] += inv.offset[i];
  // Fill in token order, with a running cursor per list kept in the list's first free entry.
  std::vector<int64_t> cursor(inv.offset, inv.offset + nb * H);
  for_each_pick([&](int64_t slot, int64_t t) { inv.tokens[cursor[static_cast<size_t>(slot)]++] = static_cast<int32_t>(t); });
}

// Key-major pass of one branch. emit(seq, hk, chunk, dk [kChunk][dqkp], dv [kChunk][dvp]) stores
// the rows of a chunk; it runs for every chunk (also those no query sees: zero gradients).
template <typename Emit>
void key_major(const Plan& p, const Dims& d, const Branch& br, const QuerySide& qs, const InvIndex* inv,
               const Slots& slots, Emit emit) {
  // 64-key chunks per selection block: a block holds at most the longest sequence's keys, so the
  // work items follow the tensors, not l' (2^31 - 1 would make 2^25 empty items a block).
  const int64_t subs = (std::max<int64_t>(std::min(br.lp, p.max_seqlen), 1) + kChunk - 1) / kChunk;
  auto chunks_of = [&](int64_t b) -> int64_t {
    const int64_t len = p.seq_len(b);
    switch (br.kind) {
      case Kind::cmp: return (num_cmp_blocks(len, br.l, br.d) + kChunk - 1) / kChunk;
      case Kind::slc: return num_slc_blocks(len, br.lp) * subs;
      default: return (len + kChunk - 1) / kChunk;
    }
  };
  std::vector<int64_t> first(static_cast<size_t>(p.B) + 1, 0);
  for (int64_t b = 0; b < p.B; ++b) first[static_cast<size_t>(b) + 1] = first[static_cast<size_t>(b)] + chunks_of(b) * p.hkv;
  parallel_for(first.back(), slots, [&](int64_t id, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    const int64_t b = std::upper_bound(first.begin(), first.end(), id) - first.begin() - 1;
    const int64_t local = id - first[static_cast<size_t>(b)];
    const int64_t ci = local / p.hkv, hk = local % p.hkv;
    const Seq s = Seq::of(p, b);
    Chunk c;
    int64_t t_lo = 0, t_hi = -1;  // consecutive query tokens (all kinds but slc)
    const int32_t* list = nullptr;
    int64_t list_len = 0;
    switch (br.kind) {
      case Kind::cmp: {
        const int64_t nc = num_cmp_blocks(s.len, br.l, br.d);
        c = Chunk{ci * kChunk, std::min(kChunk, nc - ci * kChunk), -1};
        t_lo = c.k0 * br.d + br.l - 1;  // the first token that sees compressed block k0
        t_hi = s.len - 1;
        break;
      }
      case Kind::win:
        c = Chunk{ci * kChunk, std::min(kChunk, s.len - ci * kChunk), -1};
        if (br.w > 0) {
          t_lo = c.k0;
          t_hi = std::min(s.len - 1, c.k0 + c.nk - 1 + br.w - 1);
        }
        break;
      case Kind::dense:
        c = Chunk{ci * kChunk, std::min(kChunk, s.len - ci * kChunk), -1};
        t_lo = c.k0;
        t_hi = s.len - 1;
        break;
      case Kind::slc: {
        const int64_t j = ci / subs, sub = ci % subs;
        const int64_t k0 = j * br.lp + sub * kChunk;
        const int64_t k1 = std::min({(j + 1) * br.lp, k0 + kChunk, s.len});
        c = Chunk{k0, std::max<int64_t>(k1 - k0, 0), j};
        const int64_t slot = (inv->seq_block0[b] + j) * p.hkv + hk;
        list = inv->tokens + inv->offset[slot];
        list_len = inv->offset[slot + 1] - inv->offset[slot];
        // Tokens before the chunk's first key see none of it.
        const int32_t* from = std::lower_bound(list, list + list_len, static_cast<int32_t>(k0));
        list_len -= from - list;
        list = from;
        break;
      }
    }
    if (c.nk <= 0) return;
    t_lo = std::max(t_lo, s.first);  // only the sequence's queries (a query packing's last positions)
    const ChunkData cd = dkdv_begin(d, br, s, hk, c, sc);
    if (br.kind == Kind::slc) {
      for (int64_t i = 0; i < list_len; i += d.tile_tokens)
        dkdv_tile(d, br, s, hk, c, cd, list + i, std::min(d.tile_tokens, list_len - i), qs, sc);
    } else {
      for (int64_t t0 = t_lo; t0 <= t_hi; t0 += d.tile_tokens) {
        const int64_t nt = std::min(d.tile_tokens, t_hi - t0 + 1);
        fill_tokens(sc.tokens, t0, nt);
        dkdv_tile(d, br, s, hk, c, cd, sc.tokens, nt, qs, sc);
      }
    }
    emit(s, hk, c, sc.dk, sc.dv);
  });
}

struct BackwardShared {
  float *kc, *vc, *dkc, *dvc;  // [T/d][Hkv][D] fp32
  float* delta;                // [T][Hq][3]
  float *dk_acc, *dv_acc;      // [T][Hkv][D] (shared_kv only)
  InvIndex inv;
};

template <typename A>
BackwardShared layout_backward(A& a, const Config& cfg, int64_t T, int64_t B, int64_t hq, int64_t hkv,
                               int64_t dqk, int64_t dv, int64_t max_seqlen) {
  BackwardShared s{};
  const int64_t rows = cmp_rows(T, cfg.cmp_stride);
  s.kc = a.template take<float>(rows * hkv * dqk);
  s.vc = a.template take<float>(rows * hkv * dv);
  s.dkc = a.template take<float>(rows * hkv * dqk);
  s.dvc = a.template take<float>(rows * hkv * dv);
  s.delta = a.template take<float>(T * hq * 3);
  if (cfg.shared_kv) {
    s.dk_acc = a.template take<float>(T * hkv * dqk);
    s.dv_acc = a.template take<float>(T * hkv * dv);
  }
  s.inv = layout_inv(a, T, B, hkv, cfg.n_selected, cfg.slc_block_len, max_seqlen);
  return s;
}

size_t phi_backward_shared(const Config& cfg, const Problem& pr, size_t* slot) {
  Sizer shared_k, slot_k, shared_v, slot_v;
  phi_sizes(cfg, pr.total_tokens, pr.batch, pr.hkv, pr.dqk, pr.phi_hidden, true, shared_k, slot_k);
  phi_sizes(cfg, pr.total_tokens, pr.batch, pr.hkv, pr.dv, pr.phi_hidden, true, shared_v, slot_v);
  *slot = std::max(slot_k.bytes, slot_v.bytes);
  return std::max(shared_k.bytes, shared_v.bytes);
}

// A [T, Hq, Dv] slice b of o_branch [3, T, Hq, Dv].
TensorView branch_slice(const TensorView& all, int b) {
  TensorView s = all;
  s.data = static_cast<char*>(all.data) + b * all.stride[0] * static_cast<int64_t>(dtype_size(all.dtype));
  s.ndim = 3;
  for (int k = 0; k < 3; ++k) {
    s.shape[k] = all.shape[k + 1];
    s.stride[k] = all.stride[k + 1];
  }
  return s;
}

// Writes dk/dv chunk rows to a caller's tensors, or adds them to fp32 accumulators.
struct KeyGradSink {
  TensorView dk, dv;            // written when acc is null
  float *dk_acc = nullptr, *dv_acc = nullptr;
  int64_t hkv = 1, dqk = 0, dvdim = 0;
  void operator()(const Seq& s, int64_t hk, const Chunk& c, const float* dk_rows, const float* dv_rows,
                  int64_t dqkp, int64_t dvp) const {
    for (int64_t j = 0; j < c.nk; ++j) {
      const int64_t row = s.s0 + c.k0 + j;
      if (dk_acc != nullptr) {
        float* a = dk_acc + (row * hkv + hk) * dqk;
        float* b = dv_acc + (row * hkv + hk) * dvdim;
        for (int64_t e = 0; e < dqk; ++e) a[e] += dk_rows[j * dqkp + e];
        for (int64_t e = 0; e < dvdim; ++e) b[e] += dv_rows[j * dvp + e];
      } else {
        store_row(dk, row, hk, dk_rows + j * dqkp, dqk);
        store_row(dv, row, hk, dv_rows + j * dvp, dvdim);
      }
    }
  }
};

}  // namespace

void backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
              const Gradients& grads, Workspace ws) {
  const Dims d = dims_of(p);
  const Problem pr{p.T, p.B, p.max_seqlen, p.hq, p.hkv, p.dqk, p.dv, std::max(p.phi_hidden_k, p.phi_hidden_v),
                   p.dtype, p.device};
  const WsSizes sizes = backward_sizes(Op::backward, p.cfg, pr);
  const Slots slots = carve_slots(p, ws, sizes.shared, sizes.slot);
  Arena shared(ws.data, sizes.shared);
  BackwardShared bs = layout_backward(shared, p.cfg, p.T, p.B, p.hq, p.hkv, p.dqk, p.dv, p.max_seqlen);
  const int64_t rows = cmp_rows(p.T, p.cfg.cmp_stride);
  std::fill(bs.kc, bs.kc + rows * p.hkv * p.dqk, 0.0f);
  std::fill(bs.vc, bs.vc + rows * p.hkv * p.dv, 0.0f);

  const KV& cmp = detail::branch_kv(p.cfg, in, kCmp);
  const KV& slc = detail::branch_kv(p.cfg, in, kSlc);
  const KV& win = detail::branch_kv(p.cfg, in, kWin);
  {
    Arena a = shared;
    phi_forward(p, in.phi_k, cmp.k, bs.kc, a, slots);
  }
  {
    Arena a = shared;
    phi_forward(p, in.phi_v, cmp.v, bs.vc, a, slots);
  }
  Branch br[3] = {
      branch_of(p, Kind::cmp, Rows::of_f32(bs.kc, p.hkv, p.dqk), Rows::of_f32(bs.vc, p.hkv, p.dv)),
      [&] {
        Branch b = branch_of(p, Kind::slc, Rows::of(slc.k), Rows::of(slc.v));
        b.idx = static_cast<const int32_t*>(saved.indices.data);
        b.idx_s0 = saved.indices.stride[0];
        b.idx_s1 = saved.indices.stride[1];
        return b;
      }(),
      branch_of(p, Kind::win, Rows::of(win.k), Rows::of(win.v)),
  };
  // Keys/values of every branch in the layouts of both passes, converted once (this region is
  // reused by phi's backward at the end).
  {
    Arena packs_area = shared;
    for (int b = 0; b < 3; ++b)
      if (branch_packs(p.cfg, br[b].kind)) prepack(p, d, br[b], kBackwardNeeds, packs_area, slots);
  }
  const Rows qrows = Rows::of(in.q), dorows = Rows::of(d_o);
  const float* lse_all = static_cast<const float*>(saved.lse.data);

  // ---- Query-major: branch outputs, dg, delta, dq.
  for_each_tile(p, d.tile_tokens, p.hkv, slots, [&](const Seq& s, int64_t t0, int64_t nt, int64_t hk, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    fill_tokens(sc.tokens, t0, nt);
    const int64_t M = nt * d.G;
    pack_query(d, qrows, s, sc.tokens, nt, hk, sc.q, sc.qb);
    std::fill(sc.dq, sc.dq + M * d.dqkp, 0.0f);
    for (int b = 0; b < 3; ++b) {
      float* ob = sc.o[b];
      if (saved.o_branch.defined()) {
        pack_rows(Rows::of(branch_slice(saved.o_branch, b)), s, sc.tokens, nt, hk, d.G, 1.0f, ob, d.dvp);
      } else {
        attend_fwd(d, br[b], s, hk, sc.tokens, nt, sc.q, sc.qb, sc, ob, sc.lse);
      }
      // dout = g_b dO; lse and delta of the branch.
      pack_rows(dorows, s, sc.tokens, nt, hk, d.G, 1.0f, sc.dout, d.dvp);
      if (d.mm) kernels().f32_to_bf16(sc.dout, sc.doutb, M * d.dvp);  // dO, exact (see attend_dq)
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t g = 0; g < d.G; ++g) {
          const int64_t r = i * d.G + g, row = s.q0 + sc.tokens[i], h = hk * d.G + g;
          float* dr = sc.dout + r * d.dvp;
          const float* orow = ob + r * d.dvp;
          float dg = 0.0f;
          for (int64_t c = 0; c < d.dv; ++c) dg += dr[c] * orow[c];
          const float gate = load_scalar(in.g, row * in.g.stride[0] + h * in.g.stride[1] + b * in.g.stride[2]);
          for (int64_t c = 0; c < d.dv; ++c) dr[c] *= gate;
          sc.gate[r] = gate;
          store_scalar(grads.dg, row * grads.dg.stride[0] + h * grads.dg.stride[1] + b * grads.dg.stride[2], dg);
          sc.delta[r] = gate * dg;
          bs.delta[(row * p.hq + h) * 3 + b] = sc.delta[r];
          sc.lse3[r] = lse_all[row * saved.lse.stride[0] + h * saved.lse.stride[1] + b * saved.lse.stride[2]];
        }
      attend_dq(d, br[b], s, hk, sc.tokens, nt, sc.q, sc.qb, sc.dout, sc.doutb, sc.gate, sc.lse3, sc.delta, sc,
                sc.dq);
    }
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t g = 0; g < d.G; ++g) {
        const int64_t r = i * d.G + g;
        float* dq = sc.dq + r * d.dqkp;
        for (int64_t c = 0; c < d.dqk; ++c) dq[c] *= d.scale;
        store_row(grads.dq, s.q0 + sc.tokens[i], hk * d.G + g, dq, d.dqk);
      }
  });

  // ---- Key-major: dk/dv per branch.
  // Also without selection (n = 0): the selection's key-major pass still writes its zero dk/dv
  // and reads every list's offsets, which the workspace does not hold initialised.
  build_inv(p, saved.indices, bs.inv);
  if (p.cfg.shared_kv) {
    std::fill(bs.dk_acc, bs.dk_acc + p.T * p.hkv * p.dqk, 0.0f);
    std::fill(bs.dv_acc, bs.dv_acc + p.T * p.hkv * p.dv, 0.0f);
  }
  std::fill(bs.dkc, bs.dkc + rows * p.hkv * p.dqk, 0.0f);
  std::fill(bs.dvc, bs.dvc + rows * p.hkv * p.dv, 0.0f);
  auto query_side = [&](int b) {
    QuerySide qs;
    qs.q = qrows;
    qs.dout = dorows;
    qs.g = in.g;
    qs.gate = b;
    qs.lse = lse_all + b * saved.lse.stride[2];
    qs.lse_s0 = saved.lse.stride[0];
    qs.lse_s1 = saved.lse.stride[1];
    qs.delta = bs.delta + b;
    qs.delta_s0 = p.hq * 3;
    qs.delta_s1 = 3;
    return qs;
  };
  for (int b : {kWin, kSlc}) {
    KeyGradSink sink;
    sink.hkv = p.hkv;
    sink.dqk = p.dqk;
    sink.dvdim = p.dv;
    if (p.cfg.shared_kv) {
      sink.dk_acc = bs.dk_acc;
      sink.dv_acc = bs.dv_acc;
    } else {
      sink.dk = grads.dkv[b].k;
      sink.dv = grads.dkv[b].v;
    }
    // Branches that are off (w = 0, n = 0) still write their zero gradients.
    key_major(p, d, br[b], query_side(b), &bs.inv, slots,
              [&](const Seq& s, int64_t hk, const Chunk& c, const float* dk, const float* dv) {
                sink(s, hk, c, dk, dv, d.dqkp, d.dvp);
              });
  }
  key_major(p, d, br[kCmp], query_side(kCmp), nullptr, slots,
            [&](const Seq& s, int64_t hk, const Chunk& c, const float* dk, const float* dv) {
              const int64_t row0 = cmp_row_offset(s.s0, p.cfg.cmp_stride);
              for (int64_t j = 0; j < c.nk; ++j) {
                std::copy(dk + j * d.dqkp, dk + j * d.dqkp + p.dqk, bs.dkc + ((row0 + c.k0 + j) * p.hkv + hk) * p.dqk);
                std::copy(dv + j * d.dvp, dv + j * d.dvp + p.dv, bs.dvc + ((row0 + c.k0 + j) * p.hkv + hk) * p.dv);
              }
            });
  // ---- Through phi to the raw compression keys/values and phi's parameters.
  {
    Arena a = shared;
    phi_backward(p, in.phi_k, cmp.k, bs.dkc, grads.dkv[kCmp].k, p.cfg.shared_kv ? bs.dk_acc : nullptr, grads.dphi_k, a,
                 slots);
  }
  {
    Arena a = shared;
    phi_backward(p, in.phi_v, cmp.v, bs.dvc, grads.dkv[kCmp].v, p.cfg.shared_kv ? bs.dv_acc : nullptr, grads.dphi_v, a,
                 slots);
  }
  if (p.cfg.shared_kv) {
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        store_row(grads.dkv[kCmp].k, t, hk, bs.dk_acc + (t * p.hkv + hk) * p.dqk, p.dqk);
        store_row(grads.dkv[kCmp].v, t, hk, bs.dv_acc + (t * p.hkv + hk) * p.dv, p.dv);
      }
  }
}

// What compress_fwd and compress_bwd (op) work in: phi's per-thread slots, the shared arena
// and, taken first from it, the fp32 compressed rows [rows, Hkv, D].
struct CompressScratch {
  Slots slots;
  Arena shared;
  int64_t rows;
  float* xc32;
};

CompressScratch compress_scratch(const Plan& p, Op op, Workspace ws) {
  const Problem pr{p.T, p.B, p.max_seqlen, p.hkv, p.hkv, p.dqk, p.dqk, p.phi_hidden_k, p.dtype, p.device};
  const WsSizes sizes = backward_sizes(op, p.cfg, pr);
  CompressScratch c{carve_slots(p, ws, sizes.shared, sizes.slot), Arena(ws.data, sizes.shared),
                    cmp_rows(p.T, p.cfg.cmp_stride), nullptr};
  c.xc32 = c.shared.take<float>(c.rows * p.hkv * p.dqk);
  return c;
}

void compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace ws) {
  CompressScratch c = compress_scratch(p, Op::compress_bwd, ws);
  const Rows src = Rows::of(dxc);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t h = 0; h < p.hkv; ++h) src.load(r, h, c.xc32 + (r * p.hkv + h) * p.dqk);
  phi_backward(p, phi, x, c.xc32, dx, nullptr, dphi, c.shared, c.slots);
}

void compress_fwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& xc, Workspace ws) {
  CompressScratch c = compress_scratch(p, Op::compress_fwd, ws);
  phi_forward(p, phi, x, c.xc32, c.shared, c.slots);
  // Only the rows of real blocks are written (api.h: the others are left untouched).
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t r0 = cmp_row_offset(p.seq_start(b), p.cfg.cmp_stride);
    const int64_t nc = num_cmp_blocks(p.seq_len(b), p.cfg.cmp_block_len, p.cfg.cmp_stride);
    for (int64_t r = r0; r < r0 + nc; ++r)
      for (int64_t h = 0; h < p.hkv; ++h) store_row(xc, r, h, c.xc32 + (r * p.hkv + h) * p.dqk, p.dqk);
  }
}

// ---- Dense attention backward ---------------------------------------------------------------

void dense_attention_bwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse, const TensorView& d_o,
                         const TensorView& dq, const TensorView& dk, const TensorView& dv, Workspace ws) {
  const Dims d = dims_of(p);
  const Problem pr{p.T, p.B, p.max_seqlen, p.hq, p.hkv, p.dqk, p.dv, 0, p.dtype, p.device};
  const WsSizes sizes = backward_sizes(Op::dense_attention_bwd, p.cfg, pr);
  const Slots slots = carve_slots(p, ws, sizes.shared, sizes.slot);
  Arena shared(ws.data, sizes.shared);
  float* delta = shared.take<float>(p.T * p.hq);  // [T][Hq] = <dO, O>
  Branch br = branch_of(p, Kind::dense, Rows::of(k), Rows::of(v));
  prepack(p, d, br, kBackwardNeeds, shared, slots);
  const Rows qrows = Rows::of(q), dorows = Rows::of(d_o), orows = Rows::of(o);
  const float* lse_all = static_cast<const float*>(lse.data);
  for_each_tile(p, d.tile_tokens, p.hkv, slots, [&](const Seq& s, int64_t t0, int64_t nt, int64_t hk, Arena arena) {
    Scratch sc = layout_scratch(arena, d);
    fill_tokens(sc.tokens, t0, nt);
    pack_query(d, qrows, s, sc.tokens, nt, hk, sc.q, sc.qb);
    pack_rows(dorows, s, sc.tokens, nt, hk, d.G, 1.0f, sc.dout, d.dvp);
    pack_rows(orows, s, sc.tokens, nt, hk, d.G, 1.0f, sc.o[0], d.dvp);
    const int64_t M = nt * d.G;
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t g = 0; g < d.G; ++g) {
        const int64_t r = i * d.G + g, row = s.q0 + sc.tokens[i], h = hk * d.G + g;
        float acc = 0.0f;
        for (int64_t c = 0; c < d.dv; ++c) acc += sc.dout[r * d.dvp + c] * sc.o[0][r * d.dvp + c];
        sc.delta[r] = acc;
        delta[row * p.hq + h] = acc;
        sc.lse[r] = lse_all[row * lse.stride[0] + h * lse.stride[1]];
      }
    std::fill(sc.dq, sc.dq + M * d.dqkp, 0.0f);
    if (d.mm) kernels().f32_to_bf16(sc.dout, sc.doutb, M * d.dvp);
    attend_dq(d, br, s, hk, sc.tokens, nt, sc.q, sc.qb, sc.dout, sc.doutb, nullptr, sc.lse, sc.delta, sc, sc.dq);
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t g = 0; g < d.G; ++g) {
        float* row = sc.dq + (i * d.G + g) * d.dqkp;
        for (int64_t c = 0; c < d.dqk; ++c) row[c] *= d.scale;
        store_row(dq, s.q0 + sc.tokens[i], hk * d.G + g, row, d.dqk);
      }
  });
  QuerySide qs;
  qs.q = qrows;
  qs.dout = dorows;
  qs.lse = lse_all;
  qs.lse_s0 = lse.stride[0];
  qs.lse_s1 = lse.stride[1];
  qs.delta = delta;
  qs.delta_s0 = p.hq;
  qs.delta_s1 = 1;
  KeyGradSink sink;
  sink.dk = dk;
  sink.dv = dv;
  sink.hkv = p.hkv;
  sink.dqk = p.dqk;
  sink.dvdim = p.dv;
  key_major(p, d, br, qs, nullptr, slots, [&](const Seq& s, int64_t hk, const Chunk& c, const float* dkr, const float* dvr) {
    sink(s, hk, c, dkr, dvr, d.dqkp, d.dvp);
  });
}

WsSizes backward_sizes(Op op, const Config& cfg, const Problem& pr) {
  WsSizes w;
  const int64_t G = pr.hkv > 0 ? std::max<int64_t>(pr.hq / pr.hkv, 1) : 1;
  const Dims d = make_dims(cfg, G, pr.dqk, pr.dv, 1.0, pr.max_seqlen, pr.dtype);
  switch (op) {
    case Op::compress_fwd:
    case Op::compress_bwd: {
      Sizer shared, slot;
      shared.take<float>(cmp_rows(pr.total_tokens, cfg.cmp_stride) * pr.hkv * pr.dqk);
      phi_sizes(cfg, pr.total_tokens, pr.batch, pr.hkv, pr.dqk, pr.phi_hidden, op == Op::compress_bwd, shared, slot);
      w.shared = shared.bytes;
      w.slot = slot.bytes;
      return w;
    }
    case Op::dense_attention_bwd: {
      Sizer shared;
      shared.take<float>(pr.total_tokens * pr.hq);
      w.shared = shared.bytes + pack_bytes(cfg, pr, d, Kind::dense, kBackwardNeeds);
      w.slot = attention_slot_bytes(d);
      return w;
    }
    case Op::backward: {
      Sizer shared;
      layout_backward(shared, cfg, pr.total_tokens, pr.batch, pr.hq, pr.hkv, pr.dqk, pr.dv, pr.max_seqlen);
      size_t phi_slot = 0;
      const size_t packed = layer_pack_bytes(cfg, pr, d, kBackwardNeeds);
      w.shared = shared.bytes + std::max(phi_backward_shared(cfg, pr, &phi_slot), packed);
      w.slot = std::max(attention_slot_bytes(d), phi_slot);
      return w;
    }
    default: return w;
  }
}

}  // namespace nsa::cpu
