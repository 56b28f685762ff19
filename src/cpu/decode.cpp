// Decoding on the CPU backend (nsa/cache.h): appending to a paged cache and attending new queries.
//
// The attention engine (attention.h) reads keys through Rows, which can follow a sequence's page
// table (Rows::paged), so a new query is a tile of one token: the same compressed pass with its
// exact probabilities and scores S, the same top-n, the same selection and window loops as the
// prefill, on the cached keys. Work items are (query row, KV head); the threads take them
// dynamically and each writes its own rows, so results do not depend on the thread count.
// phi runs on the completed blocks gathered from the raw pool into the workspace: a few blocks (a
// decode step's) by phi_forward_rows, which reads the weights in place; many (a prefill's) by the
// prefill's phi_forward, whose cached compressed keys are then the prefill's bit for bit.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/ops.h"
#include "cpu/phi.h"

namespace nsa::cpu {

namespace {

// A query tile of one token: G rows.
Dims decode_dims(const Config& cfg, const Problem& pr, double scale) {
  const int64_t G = std::max<int64_t>(pr.hq / std::max<int64_t>(pr.hkv, 1), 1);
  Dims d = make_dims(cfg, G, pr.dqk, pr.dv, scale, pr.max_seqlen, pr.dtype);
  d.tile_tokens = 1;
  d.max_rows = G;
  d.max_rows_p = pad_cols(G);
  return d;
}

struct DecodeScratch {
  Scratch sc;
  int32_t* idx;  // [min(n, ns_max)] the query's selected blocks (no query selects more)
  float* o;      // [dvp] a gated output row
};

// Entries of a query's selection the decode keeps: at most one per selection block of the longest
// sequence (the indices output is padded with -1 up to n).
inline int64_t kept_selection(const Dims& d, int64_t n) { return std::min(n, d.ns_max); }

template <typename A>
DecodeScratch layout_decode(A& a, const Dims& d, int64_t n) {
  DecodeScratch s;
  s.sc = layout_scratch(a, d);
  s.idx = a.template take<int32_t>(std::max<int64_t>(kept_selection(d, n), 1));
  s.o = a.template take<float>(d.dvp);
  return s;
}

// Compressed blocks one append can complete: one per d new tokens of a sequence.
int64_t max_new_blocks(const Config& cfg, const Problem& pr) {
  const int64_t per_seq = (pr.max_query_len + cfg.cmp_stride - 1) / cfg.cmp_stride;
  return pr.batch * std::min(per_seq, num_cmp_blocks(pr.max_seqlen, cfg.cmp_block_len, cfg.cmp_stride));
}

// The workspace of cache_append: the completed blocks' tokens gathered in the storage dtype, phi's
// fp32 output, phi's own shared part (one at a time: k, then v).
struct AppendBuffers {
  char *k_tokens = nullptr, *v_tokens = nullptr;  // [blocks * l, Hkv, D]
  float *kc = nullptr, *vc = nullptr;              // [blocks * l / d, Hkv, D]
};

template <typename A>
AppendBuffers layout_append(A& a, const Config& cfg, const Problem& pr, int64_t blocks) {
  AppendBuffers b;
  const int64_t l = cfg.cmp_block_len, es = static_cast<int64_t>(dtype_size(pr.dtype));
  b.k_tokens = a.template take<char>(blocks * l * pr.hkv * pr.dqk * es);
  b.v_tokens = a.template take<char>(blocks * l * pr.hkv * pr.dv * es);
  b.kc = a.template take<float>(blocks * l / cfg.cmp_stride * pr.hkv * pr.dqk);
  b.vc = a.template take<float>(blocks * l / cfg.cmp_stride * pr.hkv * pr.dv);
  return b;
}

// Few items (blocks x heads) go through phi_forward_rows (no weight packing), many through the
// prefill's phi_forward: the workspace holds either.
bool few_items(int64_t blocks, int64_t hkv) { return blocks * hkv < kPhiTile; }

void phi_bytes(const Config& cfg, const Problem& pr, int64_t blocks, Sizer& shared, Sizer& slot) {
  size_t sh = 0, sl = 0;
  for (int64_t D : {pr.dqk, pr.dv}) {
    Sizer a, b, c, e;
    phi_sizes(cfg, blocks * cfg.cmp_block_len, blocks, pr.hkv, D, pr.phi_hidden, false, a, b);
    phi_rows_sizes(cfg, std::min(blocks, std::max<int64_t>(kPhiTile / std::max<int64_t>(pr.hkv, 1), 1)), pr.hkv, D,
                   pr.phi_hidden, c, e);
    sh = std::max({sh, a.bytes, c.bytes});
    sl = std::max({sl, b.bytes, e.bytes});
  }
  shared.bytes += sh;
  slot.bytes += sl;
}

const int32_t* table_row(const PageTable& pt, int64_t b) {
  return static_cast<const int32_t*>(pt.block_table.data) + b * pt.block_table.stride[0];
}

// Element (page, slot, head, 0) of a pool [P, rows, H, D], writable.
char* pool_row(const TensorView& pool, int64_t page, int64_t slot, int64_t head) {
  return static_cast<char*>(pool.data) +
         (page * pool.stride[0] + slot * pool.stride[1] + head * pool.stride[2]) * static_cast<int64_t>(dtype_size(pool.dtype));
}

// Stores n floats at element (page, slot, head, 0) of a pool, rounding to its dtype.
void store_pool_row(const TensorView& pool, int64_t page, int64_t slot, int64_t head, const float* src, int64_t n) {
  TensorView row;  // the one row as a [1, 1, n] view for store_row
  row.data = pool_row(pool, page, slot, head);
  row.dtype = pool.dtype;
  row.ndim = 3;
  row.shape[0] = row.shape[1] = 1;
  row.shape[2] = n;
  row.stride[2] = 1;
  store_row(row, 0, 0, src, n);
}

Branch paged_branch(const Config& cfg, Kind kind, const KV& pool, const PageTable& pt, int64_t b, int64_t rows_per_page) {
  Branch br;
  br.kind = kind;
  br.k = Rows::paged(pool.k, table_row(pt, b), pt.block_table.stride[1], rows_per_page);
  br.v = Rows::paged(pool.v, table_row(pt, b), pt.block_table.stride[1], rows_per_page);
  br.l = cfg.cmp_block_len;
  br.d = cfg.cmp_stride;
  br.lp = cfg.slc_block_len;
  br.w = cfg.window;
  br.n = cfg.n_selected;
  return br;
}

// The sequence of a row of the call and that row's position in it.
struct RowPos {
  int64_t b, t;
};
RowPos row_position(const Plan& p, int64_t row) {
  const int64_t b = std::upper_bound(p.cu.begin(), p.cu.end(), row) - p.cu.begin() - 1;
  const int64_t m = p.cu[static_cast<size_t>(b) + 1] - p.cu[static_cast<size_t>(b)];
  return {b, p.lens[static_cast<size_t>(b)] - m + (row - p.cu[static_cast<size_t>(b)])};
}

// Gathers the tokens of `blocks` ((sequence, compressed block) pairs) from a raw pool.
void gather_blocks(const Plan& p, const TensorView& pool, const PageTable& pt,
                   const std::vector<std::pair<int64_t, int64_t>>& blocks, char* dst, const Slots& slots) {
  const int64_t l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride, H = pool.shape[2];
  const size_t row_bytes = static_cast<size_t>(pool.shape[3]) * dtype_size(pool.dtype);
  parallel_for(static_cast<int64_t>(blocks.size()), slots, [&](int64_t k, Arena) {
    const auto [b, i] = blocks[static_cast<size_t>(k)];
    const Rows src = Rows::paged(pool, table_row(pt, b), pt.block_table.stride[1], p.page_size);
    for (int64_t r = 0; r < l; ++r)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + ((k * l + r) * H + h) * static_cast<int64_t>(row_bytes), src.ptr(i * d + r, h), row_bytes);
  });
}

// phi of the gathered blocks (a plan whose sequences are the blocks, one compressed row each at
// k * l / d), stored into the compressed pool.
void compress_blocks(const Plan& p, const PhiParams& phi, const TensorView& cmp_pool, const PageTable& pt,
                     const std::vector<std::pair<int64_t, int64_t>>& blocks, char* tokens, float* xc, int64_t D,
                     Arena shared, const Slots& slots) {
  const int64_t nb = static_cast<int64_t>(blocks.size()), l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride;
  Plan q = p;
  q.B = nb;
  q.T = nb * l;
  q.cu.resize(static_cast<size_t>(nb) + 1);
  for (int64_t k = 0; k <= nb; ++k) q.cu[static_cast<size_t>(k)] = k * l;
  q.max_seqlen = l;
  const TensorView x = make_view(tokens, p.dtype, {nb * l, p.hkv, D});
  if (few_items(nb, p.hkv)) phi_forward_rows(q, phi, x, xc, shared, slots);
  else phi_forward(q, phi, x, xc, shared, slots);
  for (int64_t k = 0; k < nb; ++k) {
    const auto [b, i] = blocks[static_cast<size_t>(k)];
    const int64_t page = table_row(pt, b)[cmp_block_page(i, d, p.page_size) * pt.block_table.stride[1]];
    for (int64_t h = 0; h < p.hkv; ++h)
      store_pool_row(cmp_pool, page, cmp_block_slot(i, d, p.page_size), h, xc + ((k * l / d) * p.hkv + h) * D, D);
  }
}

}  // namespace

WsSizes decode_sizes(Op op, const Config& cfg, const Problem& pr) {
  WsSizes w;
  if (op == Op::cache_append) {
    Sizer shared, slot;
    const int64_t blocks = max_new_blocks(cfg, pr);
    layout_append(shared, cfg, pr, blocks);
    phi_bytes(cfg, pr, blocks, shared, slot);
    w.shared = shared.bytes;
    w.slot = slot.bytes;
    return w;
  }
  Sizer slot;
  layout_decode(slot, decode_dims(cfg, pr, 1.0), cfg.n_selected);
  w.slot = slot.bytes;
  return w;
}

void cache_append(const Plan& p, const PagedCache& cache, const CacheAppend& in, Workspace ws) {
  const Problem pr = detail::problem_of(p);
  const WsSizes sizes = decode_sizes(Op::cache_append, p.cfg, pr);
  const Slots slots = carve_slots(p, ws, sizes.shared, sizes.slot);
  const PageTable& pt = cache.pages;
  const int sets = p.cfg.shared_kv ? 1 : 3;
  // The new tokens into the raw pools.
  parallel_for(p.T, slots, [&](int64_t row, Arena) {
    const RowPos at = row_position(p, row);
    const int64_t page = table_row(pt, at.b)[(at.t / p.page_size) * pt.block_table.stride[1]];
    for (int s = 0; s < sets; ++s)
      for (const auto& [src, pool] : {std::pair{&in.kv[s].k, &cache.raw[s].k}, std::pair{&in.kv[s].v, &cache.raw[s].v}}) {
        const size_t bytes = static_cast<size_t>(src->shape[2]) * dtype_size(src->dtype);
        for (int64_t h = 0; h < p.hkv; ++h)
          std::memcpy(pool_row(*pool, page, at.t % p.page_size, h),
                      static_cast<const char*>(src->data) + (row * src->stride[0] + h * src->stride[1]) * static_cast<int64_t>(dtype_size(src->dtype)),
                      bytes);
      }
  });
  // The compressed blocks whose last token arrived: [N_c(old), N_c(len)) of each sequence.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.lens[static_cast<size_t>(b)];
    const int64_t old = len - (p.cu[static_cast<size_t>(b) + 1] - p.cu[static_cast<size_t>(b)]);
    for (int64_t i = num_cmp_blocks(old, p.cfg.cmp_block_len, p.cfg.cmp_stride);
         i < num_cmp_blocks(len, p.cfg.cmp_block_len, p.cfg.cmp_stride); ++i)
      blocks.emplace_back(b, i);
  }
  if (blocks.empty()) return;
  Arena shared(ws.data, Arena::round_bytes(sizes.shared));
  const AppendBuffers buf = layout_append(shared, p.cfg, pr, static_cast<int64_t>(blocks.size()));
  gather_blocks(p, cache.raw[kCmp].k, pt, blocks, buf.k_tokens, slots);
  gather_blocks(p, cache.raw[kCmp].v, pt, blocks, buf.v_tokens, slots);
  const size_t used = shared.used();
  Arena phi_shared(static_cast<char*>(ws.data) + used, Arena::round_bytes(sizes.shared) - used);
  compress_blocks(p, in.phi_k, cache.cmp.k, pt, blocks, buf.k_tokens, buf.kc, p.dqk, phi_shared, slots);
  compress_blocks(p, in.phi_v, cache.cmp.v, pt, blocks, buf.v_tokens, buf.vc, p.dv, phi_shared, slots);
}

void decode(const Plan& p, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out, Workspace ws) {
  const Problem pr = detail::problem_of(p);
  const Dims d = decode_dims(p.cfg, pr, p.scale);
  const int64_t n = p.cfg.n_selected, G = d.G, Rp = d.max_rows_p, kept = kept_selection(d, n);
  Sizer slot_size;
  layout_decode(slot_size, d, n);
  const Slots slots = carve_slots(p, ws, 0, slot_size.bytes);
  const Rows qrows = Rows::of(in.q);
  const PageTable& pt = cache.pages;
  const KV& slc = cache.raw[p.cfg.shared_kv ? kCmp : kSlc];
  const KV& win = cache.raw[p.cfg.shared_kv ? kCmp : kWin];
  const size_t es = dtype_size(p.dtype);
  parallel_for(p.T * p.hkv, slots, [&](int64_t item, Arena arena) {
    DecodeScratch ds = layout_decode(arena, d, n);
    Scratch& sc = ds.sc;
    const int64_t row = item / p.hkv, hk = item % p.hkv;
    const RowPos at = row_position(p, row);
    const Seq keys{0, p.lens[static_cast<size_t>(at.b)], at.b};  // keys at their positions
    sc.tokens[0] = static_cast<int32_t>(at.t);
    pack_query(d, qrows, Seq{row - at.t, 1, at.b}, sc.tokens, 1, hk, sc.q, sc.qb);
    float* lse = sc.lse3;  // [3][Rp]: one row of log-sum-exps per branch
    // §2-§4: the compressed branch with its scores, then this query's own top-n.
    const Branch cmp = paged_branch(p.cfg, Kind::cmp, cache.cmp, pt, at.b, p.page_size / p.cfg.cmp_stride);
    attend_cmp_fwd(d, cmp, p.cfg.slc_block_len, keys, hk, sc.tokens, 1, sc.q, sc.qb, sc, sc.o[kCmp], lse, sc.scores);
    if (n > 0) topn_row(p.cfg, at.t, sc.scores, sc.topn, ds.idx, kept);
    Branch sel = paged_branch(p.cfg, Kind::slc, slc, pt, at.b, p.page_size);
    sel.idx = ds.idx;  // one query: the row does not depend on t or hk
    sel.n = kept;
    attend_fwd(d, sel, keys, hk, sc.tokens, 1, sc.q, sc.qb, sc, sc.o[kSlc], lse + Rp);
    const Branch wnd = paged_branch(p.cfg, Kind::win, win, pt, at.b, p.page_size);
    attend_fwd(d, wnd, keys, hk, sc.tokens, 1, sc.q, sc.qb, sc, sc.o[kWin], lse + 2 * Rp);
    // §7: the gated sum, and what the caller asked for.
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t h = hk * G + gi;
      std::fill(ds.o, ds.o + d.dv, 0.0f);
      for (int br = 0; br < 3; ++br) {
        const float gate = load_scalar(in.g, row * in.g.stride[0] + h * in.g.stride[1] + br * in.g.stride[2]);
        const float* ob = sc.o[br] + gi * d.dvp;
        for (int64_t c = 0; c < d.dv; ++c) ds.o[c] += gate * ob[c];
        if (out.lse.defined())
          static_cast<float*>(out.lse.data)[row * out.lse.stride[0] + h * out.lse.stride[1] + br * out.lse.stride[2]] =
              lse[br * Rp + gi];
        if (out.o_branch.defined()) {
          TensorView ob_view = out.o_branch;  // branch br as a [Tq, Hq, Dv] view
          ob_view.data = static_cast<char*>(out.o_branch.data) + br * out.o_branch.stride[0] * static_cast<int64_t>(es);
          ob_view.ndim = 3;
          for (int k = 0; k < 3; ++k) {
            ob_view.shape[k] = out.o_branch.shape[k + 1];
            ob_view.stride[k] = out.o_branch.stride[k + 1];
          }
          store_row(ob_view, row, h, ob, d.dv);
        }
      }
      store_row(out.o, row, h, ds.o, d.dv);
    }
    if (out.indices.defined()) {
      int32_t* dst = static_cast<int32_t*>(out.indices.data) + row * out.indices.stride[0] + hk * out.indices.stride[1];
      for (int64_t k = 0; k < n; ++k) dst[k * out.indices.stride[2]] = k < kept ? ds.idx[k] : -1;
    }
  });
}

void dense_decode(const Plan& p, const KV& pages, const PageTable& table, const TensorView& q, const TensorView& o,
                  const TensorView& lse, Workspace ws) {
  const Problem pr = detail::problem_of(p);
  const Dims d = decode_dims(Config{}, pr, p.scale);
  Sizer slot_size;
  layout_decode(slot_size, d, 0);
  const Slots slots = carve_slots(p, ws, 0, slot_size.bytes);
  const Rows qrows = Rows::of(q);
  parallel_for(p.T * p.hkv, slots, [&](int64_t item, Arena arena) {
    DecodeScratch ds = layout_decode(arena, d, 0);
    Scratch& sc = ds.sc;
    const int64_t row = item / p.hkv, hk = item % p.hkv;
    const RowPos at = row_position(p, row);
    const Seq keys{0, p.lens[static_cast<size_t>(at.b)], at.b};
    sc.tokens[0] = static_cast<int32_t>(at.t);
    pack_query(d, qrows, Seq{row - at.t, 1, at.b}, sc.tokens, 1, hk, sc.q, sc.qb);
    const Branch all = paged_branch(p.cfg, Kind::dense, pages, table, at.b, p.page_size);
    attend_fwd(d, all, keys, hk, sc.tokens, 1, sc.q, sc.qb, sc, sc.o[0], sc.lse);
    for (int64_t gi = 0; gi < d.G; ++gi) {
      const int64_t h = hk * d.G + gi;
      store_row(o, row, h, sc.o[0] + gi * d.dvp, d.dv);
      if (lse.defined()) static_cast<float*>(lse.data)[row * lse.stride[0] + h * lse.stride[1]] = sc.lse[gi];
    }
  });
}

}  // namespace nsa::cpu
