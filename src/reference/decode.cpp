// Spec §10 in fp64: appending to a paged cache, and attending new queries at the end of its
// sequences. Each sequence's cache is read into dense fp64 arrays (positions 0 .. len-1, or
// compressed blocks 0 .. N_c-1), and every new query runs the per-query pieces of the prefill
// (attend, add_scores, select_blocks, selected_positions): the decode rule read off the code.
#include <algorithm>
#include <vector>

#include "nsa/blocks.h"
#include "reference/reference.h"

namespace nsa::reference {

namespace {

using detail::Plan;

// Rows of one sequence in a pool [P, rows_per_page, H, D]: row r (a position, or a compressed
// block) lives in page table[r / rows_per_page], slot r % rows_per_page.
struct PagedRows {
  const TensorView* pool = nullptr;
  const int32_t* table = nullptr;  // the sequence's block-table row
  int64_t table_stride = 1;
  int64_t rows_per_page = 1;

  int64_t offset(int64_t r, int64_t h, int64_t c) const {
    const int64_t page = table[(r / rows_per_page) * table_stride];
    return page * pool->stride[0] + (r % rows_per_page) * pool->stride[1] + h * pool->stride[2] + c * pool->stride[3];
  }
  // Rows [0, n) as an fp64 array [n, H, D].
  Array load(int64_t n) const {
    const int64_t H = pool->shape[2], D = pool->shape[3];
    Array a({n, H, D});
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < D; ++c) a.at(r, h)[c] = load_element(*pool, offset(r, h, c));
    return a;
  }
  void store_row(int64_t r, const Array& src, int64_t src_row) const {
    const int64_t H = pool->shape[2], D = pool->shape[3];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < D; ++c) store_element(*pool, offset(r, h, c), src.at(src_row, h)[c]);
  }
};

PagedRows paged(const TensorView& pool, const PageTable& pt, int64_t b, int64_t rows_per_page) {
  PagedRows r;
  r.pool = &pool;
  r.table = static_cast<const int32_t*>(pt.block_table.data) + b * pt.block_table.stride[0];
  r.table_stride = pt.block_table.stride[1];
  r.rows_per_page = rows_per_page;
  return r;
}

int64_t rows_of(const Plan& p, int64_t b) { return p.cu[static_cast<size_t>(b) + 1] - p.cu[static_cast<size_t>(b)]; }

// The rows [first, first + n) of a [T, H, D] view as an fp64 array.
Array load_rows(const TensorView& t, int64_t first, int64_t n) {
  const int64_t H = t.shape[1], D = t.shape[2];
  Array a({n, H, D});
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < D; ++c)
        a.at(r, h)[c] = load_element(t, (first + r) * t.stride[0] + h * t.stride[1] + c * t.stride[2]);
  return a;
}

// One phi over `blocks` gathered blocks: a plan whose sequences are the blocks (l tokens each,
// so one compressed block each, at compressed row k * l / d).
Array phi_of_blocks(const Plan& p, const Phi& phi, const Array& tokens, int64_t blocks) {
  Plan q;
  q.cfg = p.cfg;
  q.B = blocks;
  q.T = blocks * p.cfg.cmp_block_len;
  for (int64_t k = 0; k <= blocks; ++k) q.cu.push_back(k * p.cfg.cmp_block_len);
  return phi_forward(q, phi, tokens);
}

}  // namespace

void cache_append(const Plan& p, const PagedCache& cache, const CacheAppend& in, Workspace) {
  const int64_t l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride, ps = p.page_size;
  const int sets = p.cfg.shared_kv ? 1 : 3;
  const Phi phi_k = load_phi(in.phi_k), phi_v = load_phi(in.phi_v);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.lens[static_cast<size_t>(b)], m = rows_of(p, b), old = len - m;
    if (m == 0) continue;
    // The new tokens, at positions old .. len-1 of every raw pool.
    for (int s = 0; s < sets; ++s) {
      const Array k = load_rows(in.kv[s].k, p.cu[static_cast<size_t>(b)], m);
      const Array v = load_rows(in.kv[s].v, p.cu[static_cast<size_t>(b)], m);
      for (int64_t i = 0; i < m; ++i) {
        paged(cache.raw[s].k, cache.pages, b, ps).store_row(old + i, k, i);
        paged(cache.raw[s].v, cache.pages, b, ps).store_row(old + i, v, i);
      }
    }
    // The compressed blocks whose last token arrived: [N_c(old), N_c(len)), from the raw pool.
    const int64_t first = num_cmp_blocks(old, l, d), last = num_cmp_blocks(len, l, d);
    if (first == last) continue;
    const int64_t nb = last - first;
    const Array raw_k = paged(cache.raw[kCmp].k, cache.pages, b, ps).load(len);
    const Array raw_v = paged(cache.raw[kCmp].v, cache.pages, b, ps).load(len);
    Array blk_k({nb * l, p.hkv, p.dqk}), blk_v({nb * l, p.hkv, p.dv});
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t t0 = (first + k) * d;
      std::copy(raw_k.row(t0), raw_k.row(t0 + l), blk_k.row(k * l));
      std::copy(raw_v.row(t0), raw_v.row(t0 + l), blk_v.row(k * l));
    }
    const Array kc = phi_of_blocks(p, phi_k, blk_k, nb), vc = phi_of_blocks(p, phi_v, blk_v, nb);
    for (int64_t k = 0; k < nb; ++k) {
      paged(cache.cmp.k, cache.pages, b, ps / d).store_row(first + k, kc, k * l / d);
      paged(cache.cmp.v, cache.pages, b, ps / d).store_row(first + k, vc, k * l / d);
    }
  }
}

void decode(const Plan& p, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out, Workspace) {
  const int64_t l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride, ps = p.page_size, n = p.cfg.n_selected;
  const Array q = load(in.q), g = load(in.g);
  Array o({p.T, p.hq, p.dv}), lse({p.T, p.hq, 3}), o_branch({3, p.T, p.hq, p.dv});
  std::vector<int32_t> indices(static_cast<size_t>(p.T * p.hkv * n), -1);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.lens[static_cast<size_t>(b)], m = rows_of(p, b);
    if (m == 0) continue;
    const KV& slc = cache.raw[p.cfg.shared_kv ? kCmp : kSlc];
    const KV& win = cache.raw[p.cfg.shared_kv ? kCmp : kWin];
    const Array ks = paged(slc.k, cache.pages, b, ps).load(len), vs = paged(slc.v, cache.pages, b, ps).load(len);
    const Array kw = paged(win.k, cache.pages, b, ps).load(len), vw = paged(win.v, cache.pages, b, ps).load(len);
    const int64_t nc = num_cmp_blocks(len, l, d);
    const Array kc = paged(cache.cmp.k, cache.pages, b, ps / d).load(nc);
    const Array vc = paged(cache.cmp.v, cache.pages, b, ps / d).load(nc);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = p.cu[static_cast<size_t>(b)] + i, t = len - m + i;  // its own position
      std::vector<int64_t> cmp_keys(static_cast<size_t>(visible_cmp_blocks(t, l, d)));
      for (size_t r = 0; r < cmp_keys.size(); ++r) cmp_keys[r] = static_cast<int64_t>(r);
      std::vector<int64_t> win_rows;
      if (p.cfg.window > 0)
        for (int64_t pos = window_start(t, p.cfg.window); pos <= t; ++pos) win_rows.push_back(pos);
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        // §2-§4: the group's compressed attention, its scores, its own selection.
        std::vector<double> S(static_cast<size_t>(last_slc_block(t, p.cfg.slc_block_len) + 1), 0.0);
        std::vector<RowAttention> cmp(static_cast<size_t>(p.group));
        for (int64_t gi = 0; gi < p.group; ++gi) {
          cmp[static_cast<size_t>(gi)] = attend(q.at(row, hk * p.group + gi), kc, vc, hk, cmp_keys, p.scale);
          add_scores(p.cfg, cmp[static_cast<size_t>(gi)].p, S.data());
        }
        const std::vector<int64_t> blocks = n > 0 ? select_blocks(p.cfg, t, S.data()) : std::vector<int64_t>{};
        for (size_t k = 0; k < blocks.size(); ++k)
          indices[static_cast<size_t>((row * p.hkv + hk) * n) + k] = static_cast<int32_t>(blocks[k]);
        const std::vector<int64_t> slc_rows = selected_positions(p.cfg, blocks, t);
        for (int64_t gi = 0; gi < p.group; ++gi) {
          const int64_t h = hk * p.group + gi;
          const RowAttention r[3] = {cmp[static_cast<size_t>(gi)], attend(q.at(row, h), ks, vs, hk, slc_rows, p.scale),
                                     attend(q.at(row, h), kw, vw, hk, win_rows, p.scale)};
          for (int br = 0; br < 3; ++br) {
            const double gate = g.at(row, h)[br];
            for (int64_t c = 0; c < p.dv; ++c) {
              o.at(row, h)[c] += gate * r[br].o[static_cast<size_t>(c)];
              o_branch.data[static_cast<size_t>(((br * p.T + row) * p.hq + h) * p.dv + c)] = r[br].o[static_cast<size_t>(c)];
            }
            lse.at(row, h)[br] = r[br].lse;
          }
        }
      }
    }
  }
  store(o, out.o);
  store(lse, out.lse);
  if (out.indices.defined()) store_indices(indices, out.indices);
  store(o_branch, out.o_branch);
}

void dense_decode(const Plan& p, const KV& pages, const PageTable& table, const TensorView& q_view,
                  const TensorView& o_view, const TensorView& lse_view, Workspace) {
  const Array q = load(q_view);
  Array o({p.T, p.hq, p.dv}), lse({p.T, p.hq});
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.lens[static_cast<size_t>(b)], m = rows_of(p, b);
    if (m == 0) continue;
    const Array k = paged(pages.k, table, b, p.page_size).load(len), v = paged(pages.v, table, b, p.page_size).load(len);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = p.cu[static_cast<size_t>(b)] + i, t = len - m + i;
      std::vector<int64_t> rows(static_cast<size_t>(t + 1));
      for (int64_t r = 0; r <= t; ++r) rows[static_cast<size_t>(r)] = r;
      for (int64_t h = 0; h < p.hq; ++h) {
        const RowAttention r = attend(q.at(row, h), k, v, h / p.group, rows, p.scale);
        std::copy(r.o.begin(), r.o.end(), o.at(row, h));
        lse.row(row)[h] = r.lse;
      }
    }
  }
  store(o, o_view);
  store(lse, lse_view);
}

}  // namespace nsa::reference
