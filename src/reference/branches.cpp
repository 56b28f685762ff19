// Spec §2-§6: the three attention branches, the selection scores S and top-n, in fp64.
//
// Every branch is softmax attention of one query over a list of key rows; the branches differ
// only in which rows a query sees. Each (sequence, token, head) is computed on its own.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "nsa/blocks.h"
#include "reference/reference.h"

namespace nsa::reference {

namespace {

using KeyRows = std::vector<int64_t>;

double dot(const double* a, const double* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Gradient of attend() for output gradient dout; accumulates into dq, dK, dV.
void attend_backward(const double* q, const Array& K, const Array& V, int64_t hk, const KeyRows& rows,
                     double scale, const double* dout, double* dq, Array& dK, Array& dV) {
  if (rows.empty()) return;
  const int64_t Dqk = K.dim(2), Dv = V.dim(2);
  const RowAttention r = attend(q, K, V, hk, rows, scale);
  const double delta = dot(dout, r.o.data(), Dv);  // sum_j p_j dp_j
  for (size_t j = 0; j < rows.size(); ++j) {
    const double dp = dot(dout, V.at(rows[j], hk), Dv);
    const double ds = r.p[j] * (dp - delta);
    const double* k = K.at(rows[j], hk);
    double* dk = dK.at(rows[j], hk);
    double* dv = dV.at(rows[j], hk);
    for (int64_t c = 0; c < Dqk; ++c) {
      dq[c] += scale * ds * k[c];
      dk[c] += scale * ds * q[c];
    }
    for (int64_t c = 0; c < Dv; ++c) dv[c] += r.p[j] * dout[c];
  }
}

// Where a query sits: its sequence's first packed key row s0, the query row q0 that position 0
// would have (query row of position t: q0 + t; spec §9 and api.h's query packing) and its position t.
struct QueryAt {
  int64_t s0, q0, t;
  int64_t row() const { return q0 + t; }
};

// The queries of sequence b: its last q_len(b) positions (every position without a query packing).
template <typename Fn>
void for_each_query(const detail::Plan& p, Fn fn) {
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = p.q_first(b); t < p.seq_len(b); ++t) fn(QueryAt{p.seq_start(b), p.q_row0(b), t});
}

// Which key rows query t (position within its sequence starting at packed row s0) sees.
KeyRows cmp_keys(const detail::Plan& p, int64_t s0, int64_t t) {
  KeyRows rows(static_cast<size_t>(visible_cmp_blocks(t, p.cfg.cmp_block_len, p.cfg.cmp_stride)));
  std::iota(rows.begin(), rows.end(), cmp_row_offset(s0, p.cfg.cmp_stride));
  return rows;
}

KeyRows slc_keys(const detail::Plan& p, const std::vector<int32_t>& indices, const QueryAt& at, int64_t hk) {
  const int64_t n = p.cfg.n_selected;
  const int32_t* row = indices.data() + (at.row() * p.hkv + hk) * n;  // indices: one row per query
  KeyRows rows = selected_positions(p.cfg, std::vector<int64_t>(row, row + n), at.t);
  for (int64_t& r : rows) r += at.s0;
  return rows;
}

KeyRows causal_keys(int64_t s0, int64_t first, int64_t t) {
  KeyRows rows;
  for (int64_t pos = first; pos <= t; ++pos) rows.push_back(s0 + pos);
  return rows;
}

KeyRows win_keys(const detail::Plan& p, int64_t s0, int64_t t) {
  if (p.cfg.window == 0) return {};  // branch off
  return causal_keys(s0, window_start(t, p.cfg.window), t);
}

// Runs attention for every (query, query head); keys(at, hk) gives the key rows.
template <typename Keys>
void branch_forward(const detail::Plan& p, const Array& q, const Array& K, const Array& V, Keys keys,
                    Array& o, Array& lse) {
  o = Array({p.query_rows(), p.hq, V.dim(2)});
  lse = Array({p.query_rows(), p.hq});
  for_each_query(p, [&](const QueryAt& at) {
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t hk = h / p.group;
      const RowAttention r = attend(q.at(at.row(), h), K, V, hk, keys(at, hk), p.scale);
      std::copy(r.o.begin(), r.o.end(), o.at(at.row(), h));
      lse.row(at.row())[h] = r.lse;
    }
  });
}

template <typename Keys>
void branch_backward(const detail::Plan& p, const Array& q, const Array& K, const Array& V, Keys keys,
                     const Array& d_o, Array& dq, Array& dK, Array& dV) {
  for_each_query(p, [&](const QueryAt& at) {
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t hk = h / p.group;
      attend_backward(q.at(at.row(), h), K, V, hk, keys(at, hk), p.scale, d_o.at(at.row(), h), dq.at(at.row(), h),
                      dK, dV);
    }
  });
}

}  // namespace

RowAttention attend(const double* q, const Array& K, const Array& V, int64_t hk, const std::vector<int64_t>& rows,
                    double scale) {
  const int64_t Dqk = K.dim(2), Dv = V.dim(2);
  RowAttention r;
  r.o.assign(static_cast<size_t>(Dv), 0.0);
  if (rows.empty()) return r;  // an empty branch outputs zeros (spec §2, §7)
  std::vector<double> s(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) s[j] = scale * dot(q, K.at(rows[j], hk), Dqk);
  const double m = *std::max_element(s.begin(), s.end());  // subtract the running maximum (§12)
  double sum = 0.0;
  r.p.resize(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) sum += (r.p[j] = std::exp(s[j] - m));
  for (size_t j = 0; j < rows.size(); ++j) {
    r.p[j] /= sum;
    const double* v = V.at(rows[j], hk);
    for (int64_t c = 0; c < Dv; ++c) r.o[static_cast<size_t>(c)] += r.p[j] * v[c];
  }
  r.lse = m + std::log(sum);
  return r;
}

void add_scores(const Config& cfg, const std::vector<double>& p_cmp, double* S) {
  const int64_t l = cfg.cmp_block_len, d = cfg.cmp_stride, lp = cfg.slc_block_len;
  for (size_t i = 0; i < p_cmp.size(); ++i) {
    const int64_t first_j = static_cast<int64_t>(i) * d / lp;
    const int64_t last_j = (static_cast<int64_t>(i) * d + l - 1) / lp;
    for (int64_t j = first_j; j <= last_j; ++j)
      S[j] += static_cast<double>(cmp_slc_overlap(static_cast<int64_t>(i), j, l, d, lp)) * p_cmp[i];
  }
}

std::vector<int64_t> select_blocks(const Config& cfg, int64_t t, const double* S) {
  const int64_t Jt = last_slc_block(t, cfg.slc_block_len);
  const int64_t count = std::min(cfg.n_selected, Jt + 1);
  const ForcedBlocks forced = forced_blocks(cfg);
  // §4 (§11): forced blocks first, then the rest by descending S, ties to the smaller j; a NaN
  // score ranks above every number (as torch.topk ranks it), NaNs among themselves by j.
  std::vector<int64_t> order(static_cast<size_t>(Jt + 1));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
    const bool fa = forced.contains(a, Jt);
    const bool fc = forced.contains(c, Jt);
    if (fa != fc) return fa;
    const bool na = std::isnan(S[a]), nc = std::isnan(S[c]);
    if (na || nc) return na && !nc;
    return S[a] > S[c];
  });
  std::vector<int64_t> chosen(order.begin(), order.begin() + count);
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

std::vector<int64_t> selected_positions(const Config& cfg, const std::vector<int64_t>& blocks, int64_t t) {
  const int64_t lp = cfg.slc_block_len;
  // The selected blocks are a set (api.h): -1 entries and repeats add nothing, order does not matter.
  std::set<int64_t> unique;
  for (int64_t j : blocks)
    if (j >= 0) unique.insert(j);
  std::vector<int64_t> rows;
  for (int64_t j : unique)
    for (int64_t pos = j * lp; pos < std::min((j + 1) * lp, t + 1); ++pos) rows.push_back(pos);
  return rows;
}

void cmp_attention(const detail::Plan& p, const Array& q, const Array& kc, const Array& vc, Array& o,
                   Array& lse, Array* scores) {
  o = Array({p.query_rows(), p.hq, vc.dim(2)});
  lse = Array({p.query_rows(), p.hq});
  for_each_query(p, [&](const QueryAt& at) {
    const KeyRows rows = cmp_keys(p, at.s0, at.t);
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t hk = h / p.group;
      const RowAttention r = attend(q.at(at.row(), h), kc, vc, hk, rows, p.scale);  // p_cmp = r.p
      std::copy(r.o.begin(), r.o.end(), o.at(at.row(), h));
      lse.row(at.row())[h] = r.lse;
      // §3: S[t, hk, j] += sum_i ov(i, j) * p_cmp[t, h, i], summed over the group's heads.
      if (scores != nullptr) add_scores(p.cfg, r.p, scores->at(at.row(), hk));
    }
  });
}

std::vector<int32_t> select_topn(const detail::Plan& p, const Array& scores) {
  const int64_t n = p.cfg.n_selected;
  std::vector<int32_t> indices(static_cast<size_t>(p.query_rows() * p.hkv * n), -1);
  for_each_query(p, [&](const QueryAt& at) {
    for (int64_t hk = 0; hk < p.hkv; ++hk) {
      const std::vector<int64_t> chosen = select_blocks(p.cfg, at.t, scores.at(at.row(), hk));
      int32_t* out = indices.data() + (at.row() * p.hkv + hk) * n;
      for (size_t k = 0; k < chosen.size(); ++k) out[k] = static_cast<int32_t>(chosen[k]);
    }
  });
  return indices;
}

void slc_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                   const std::vector<int32_t>& indices, Array& o, Array& lse) {
  branch_forward(p, q, k, v, [&](const QueryAt& at, int64_t hk) { return slc_keys(p, indices, at, hk); },
                 o, lse);
}

void win_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v, Array& o,
                   Array& lse) {
  branch_forward(p, q, k, v, [&](const QueryAt& at, int64_t) { return win_keys(p, at.s0, at.t); }, o, lse);
}

void dense_attention(const detail::Plan& p, const Array& q, const Array& k, const Array& v, Array& o,
                     Array& lse) {
  branch_forward(p, q, k, v, [&](const QueryAt& at, int64_t) { return causal_keys(at.s0, 0, at.t); }, o, lse);
}

void cmp_attention_backward(const detail::Plan& p, const Array& q, const Array& kc, const Array& vc,
                            const Array& d_o, Array& dq, Array& dkc, Array& dvc) {
  branch_backward(p, q, kc, vc, [&](const QueryAt& at, int64_t) { return cmp_keys(p, at.s0, at.t); }, d_o, dq,
                  dkc, dvc);
}

void slc_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                            const std::vector<int32_t>& indices, const Array& d_o, Array& dq,
                            Array& dk, Array& dv) {
  branch_backward(p, q, k, v,
                  [&](const QueryAt& at, int64_t hk) { return slc_keys(p, indices, at, hk); }, d_o,
                  dq, dk, dv);
}

void win_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                            const Array& d_o, Array& dq, Array& dk, Array& dv) {
  branch_backward(p, q, k, v, [&](const QueryAt& at, int64_t) { return win_keys(p, at.s0, at.t); }, d_o, dq,
                  dk, dv);
}

void dense_attention_backward(const detail::Plan& p, const Array& q, const Array& k, const Array& v,
                              const Array& d_o, Array& dq, Array& dk, Array& dv) {
  branch_backward(p, q, k, v, [&](const QueryAt& at, int64_t) { return causal_keys(at.s0, 0, at.t); }, d_o,
                  dq, dk, dv);
}

}  // namespace nsa::reference
