// The API layer of decoding (nsa/cache.h): checks the pools, the page table and the call's rows,
// resolves the backend, fills the Plan's page fields and calls down. Host metadata is checked
// here in full (every length, row range and page id a call will touch); device metadata is
// checked by the kernels, which report through PageTable::status.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "common/plan.h"
#include "common/validate.h"
#include "nsa/blocks.h"
#include "nsa/cache.h"
#include "nsa/error.h"

namespace nsa {

using detail::BackendOps;
using detail::Checker;
using detail::Plan;
using detail::kAny;
using detail::read_host_offsets;
using detail::str;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t read_i32(const TensorView& t, int64_t i) { return static_cast<const int32_t*>(t.data)[i * t.stride[0]]; }

// The page table: B, max_pages, the length bound and (host memory) the lengths and page ids.
// num_pages and page_size come from the pools.
void fill_page_table(Plan& p, const PageTable& pt, const Checker& chk) {
  chk.tensor("pages.block_table", pt.block_table, "[B, max_pages]", {kAny, kAny}, DType::i32);
  p.B = pt.block_table.shape[0];
  const int64_t max_pages = pt.block_table.shape[1];
  chk.tensor("pages.seq_lens", pt.seq_lens, "[B]", {p.B}, DType::i32);
  const bool host = pt.block_table.device == Device::cpu;
  if (!host) chk.tensor("pages.status", pt.status, "[B]", {p.B}, DType::i32);
  else if (pt.status.defined()) chk.tensor("pages.status", pt.status, "[B]", {p.B}, DType::i32);
  // Lengths are int32: a capacity beyond that is bounded by int32's range.
  const int64_t capacity = max_pages > kInt32Max / p.page_size ? kInt32Max : max_pages * p.page_size;
  if (pt.max_seqlen < 0 || pt.max_seqlen > capacity)
    throw Error("pages.max_seqlen", str(pt.max_seqlen),
                "must be 0 (the capacity) or in [1, " + str(capacity) + "] (max_pages * page_size = " +
                    str(max_pages) + " * " + str(p.page_size) + ")");
  p.max_seqlen = pt.max_seqlen ? pt.max_seqlen : capacity;
  p.lens.clear();
  if (!host) return;
  const int32_t* table = static_cast<const int32_t*>(pt.block_table.data);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = read_i32(pt.seq_lens, b);
    if (len < 0 || len > p.max_seqlen)
      throw Error("pages.seq_lens[" + str(b) + "]", str(len),
                  "must be in [0, " + str(p.max_seqlen) + "] (pages.max_seqlen, or the capacity)");
    for (int64_t pg = 0; pg < pages_of(len, p.page_size); ++pg) {
      const int64_t id = table[b * pt.block_table.stride[0] + pg * pt.block_table.stride[1]];
      if (id < 0 || id >= p.num_pages)
        throw Error("pages.block_table[" + str(b) + "][" + str(pg) + "]", str(id),
                    "must be a page of the pools, in [0, " + str(p.num_pages) + ") (sequence " + str(b) +
                        " has " + str(len) + " tokens)");
    }
    p.lens.push_back(len);
  }
}

// The call's new rows per sequence: cu_seqlens [B+1] over `rows`, or rows / B each.
void fill_rows(Plan& p, const Sequences& seqs, int64_t rows, const Checker& chk) {
  p.T = rows;
  p.cu_seqlens = seqs.cu_seqlens;
  p.cu.clear();
  if (seqs.max_seqlen < 0) throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= 0 (0: derive it)");
  if (seqs.max_seqlen > kMaxLength)
    throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be <= 2^31 - 1 = " + str(kMaxLength));
  if (rows > kMaxLength) throw Error("rows (Tq)", str(rows), "must be <= 2^31 - 1 = " + str(kMaxLength));
  int64_t longest = 0;
  const TensorView& cu = seqs.cu_seqlens;
  if (!cu.defined()) {
    if (p.B == 0 ? rows != 0 : rows % p.B != 0)
      throw Error("seqs.cu_seqlens", "absent",
                  "must be given unless the " + str(rows) + " rows divide evenly among the B = " + str(p.B) +
                      " sequences of the page table");
    longest = p.B ? rows / p.B : 0;
    for (int64_t b = 0; b <= p.B; ++b) p.cu.push_back(b * longest);
  } else {
    chk.tensor("seqs.cu_seqlens", cu, "[B+1]", {p.B + 1}, DType::i32);
    if (cu.device == Device::cpu) {
      p.cu = read_host_offsets(cu, "seqs.cu_seqlens", rows, "the number of rows", longest);
    } else if (seqs.max_seqlen == 0) {
      throw Error("seqs.max_seqlen", "0", "must be given (>= the most rows of one sequence) when cu_seqlens is on the GPU");
    }
  }
  if (seqs.max_seqlen != 0 && seqs.max_seqlen < longest)
    throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= the most rows of one sequence, " + str(longest));
  p.max_query_len = seqs.max_seqlen ? seqs.max_seqlen : longest;
  if (p.max_query_len > p.max_seqlen)
    throw Error("seqs.max_seqlen", str(p.max_query_len),
                "must be <= pages.max_seqlen = " + str(p.max_seqlen) + " (new rows are tokens of the sequence)");
  // Host lengths and rows: the new rows are the last tokens of their sequence.
  if (!p.lens.empty() && !p.cu.empty())
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t m = p.cu[static_cast<size_t>(b) + 1] - p.cu[static_cast<size_t>(b)];
      if (m > p.lens[static_cast<size_t>(b)])
        throw Error("pages.seq_lens[" + str(b) + "]", str(p.lens[static_cast<size_t>(b)]),
                    "must be >= the sequence's " + str(m) + " new rows (seq_lens counts them)");
    }
}

// Pools of raw tokens: [P, page_size, Hkv, D]; fills num_pages, page_size, hkv, dqk, dv from the
// first branch.
void check_raw_pools(Plan& p, const Config& cfg, const PagedCache& c, const Checker& chk) {
  static const char* kNames[3][2] = {{"cache.k_cmp", "cache.v_cmp"}, {"cache.k_slc", "cache.v_slc"},
                                      {"cache.k_win", "cache.v_win"}};
  chk.floats(kNames[0][0], c.raw[kCmp].k, "[P, page_size, Hkv, Dqk]", {kAny, kAny, kAny, kAny});
  const TensorView& k0 = c.raw[kCmp].k;
  p.num_pages = k0.shape[0];
  p.page_size = k0.shape[1];
  p.hkv = k0.shape[2];
  p.dqk = k0.shape[3];
  chk.floats(kNames[0][1], c.raw[kCmp].v, "[P, page_size, Hkv, Dv]", {p.num_pages, p.page_size, p.hkv, kAny});
  p.dv = c.raw[kCmp].v.shape[3];
  if (p.page_size < 1 || p.page_size % cfg.slc_block_len != 0)
    throw Error("cache.k_cmp.shape[1] (page_size)", str(p.page_size),
                "must be a positive multiple of slc_block_len (l' = " + str(cfg.slc_block_len) +
                    "): a selection block lies in one page");
  if (p.hkv < 1) throw Error("cache.k_cmp.shape[2] (Hkv)", str(p.hkv), "must be >= 1");
  if (p.dqk < 1) throw Error("cache.k_cmp.shape[3] (Dqk)", str(p.dqk), "must be >= 1");
  if (p.dv < 1) throw Error("cache.v_cmp.shape[3] (Dv)", str(p.dv), "must be >= 1");
  for (int b = 1; b < 3; ++b) {
    if (cfg.shared_kv) {
      detail::require_absent(kNames[b][0], c.raw[b].k, "shared_kv keeps one K/V set, in k_cmp/v_cmp");
      detail::require_absent(kNames[b][1], c.raw[b].v, "shared_kv keeps one K/V set, in k_cmp/v_cmp");
    } else {
      chk.floats(kNames[b][0], c.raw[b].k, "[P, page_size, Hkv, Dqk]", {p.num_pages, p.page_size, p.hkv, p.dqk});
      chk.floats(kNames[b][1], c.raw[b].v, "[P, page_size, Hkv, Dv]", {p.num_pages, p.page_size, p.hkv, p.dv});
    }
  }
  const int64_t slots = p.page_size / cfg.cmp_stride;
  chk.floats("cache.kc", c.cmp.k, "[P, page_size/d, Hkv, Dqk]", {p.num_pages, slots, p.hkv, p.dqk});
  chk.floats("cache.vc", c.cmp.v, "[P, page_size/d, Hkv, Dv]", {p.num_pages, slots, p.hkv, p.dv});
}

// Everything cache_append needs checked; p.dtype/device set from the new k_cmp.
void fill_append(Plan& p, const PagedCache& c, const CacheAppend& in) {
  const Config& cfg = p.cfg;
  const Checker chk(p.dtype, p.device, in.kv[kCmp].k.device_index);
  check_raw_pools(p, cfg, c, chk);
  p.hq = p.hkv;
  p.group = 1;
  static const char* kNames[3][2] = {{"k_cmp", "v_cmp"}, {"k_slc", "v_slc"}, {"k_win", "v_win"}};
  chk.floats("k_cmp", in.kv[kCmp].k, "[Tn, Hkv, Dqk]", {kAny, p.hkv, p.dqk});
  const int64_t rows = in.kv[kCmp].k.shape[0];
  for (int b = 0; b < 3; ++b) {
    if (b > 0 && cfg.shared_kv) {
      detail::require_absent(kNames[b][0], in.kv[b].k, "shared_kv appends one K/V set, k_cmp/v_cmp");
      detail::require_absent(kNames[b][1], in.kv[b].v, "shared_kv appends one K/V set, k_cmp/v_cmp");
      continue;
    }
    if (b > 0) chk.floats(kNames[b][0], in.kv[b].k, "[Tn, Hkv, Dqk]", {rows, p.hkv, p.dqk});
    chk.floats(kNames[b][1], in.kv[b].v, "[Tn, Hkv, Dv]", {rows, p.hkv, p.dv});
  }
  p.phi_hidden_k = detail::check_phi(cfg, chk, "phi_k", in.phi_k, p.dqk);
  p.phi_hidden_v = detail::check_phi(cfg, chk, "phi_v", in.phi_v, p.dv);
  fill_page_table(p, c.pages, chk);
  fill_rows(p, in.seqs, rows, chk);
  p.scale = cfg.softmax_scale(p.dqk);
  p.n_slc_max = num_slc_blocks(p.max_seqlen, cfg.slc_block_len);
}

// Everything decode needs checked (outputs aside); p.dtype/device set from q.
void fill_decode(Plan& p, const PagedCache& c, const DecodeInputs& in) {
  const Config& cfg = p.cfg;
  const Checker chk(p.dtype, p.device, in.q.device_index);
  chk.floats("q", in.q, "[Tq, Hq, Dqk]", {kAny, kAny, kAny});
  check_raw_pools(p, cfg, c, chk);
  p.hq = in.q.shape[1];
  if (in.q.shape[2] != p.dqk)
    throw Error("q.shape[2] (Dqk)", str(in.q.shape[2]), "must equal the cache's Dqk = " + str(p.dqk));
  if (p.hq < 1 || p.hq % p.hkv != 0)
    throw Error("q.shape[1] (Hq)", str(p.hq), "must be a positive multiple of the cache's Hkv = " + str(p.hkv));
  p.group = p.hq / p.hkv;
  p.scale = cfg.softmax_scale(p.dqk);
  const int64_t rows = in.q.shape[0];
  chk.floats("g", in.g, "[Tq, Hq, 3]", {rows, p.hq, 3});
  fill_page_table(p, c.pages, chk);
  fill_rows(p, in.seqs, rows, chk);
  p.n_slc_max = num_slc_blocks(p.max_seqlen, cfg.slc_block_len);
}

// dense_decode: pools [P, page_size, Hkv, D] (any page size), q, page table, rows.
void fill_dense_decode(Plan& p, const KV& pages, const PageTable& table, const TensorView& q, const Sequences& seqs) {
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("q", q, "[Tq, Hq, Dqk]", {kAny, kAny, kAny});
  chk.floats("pages_k", pages.k, "[P, page_size, Hkv, Dqk]", {kAny, kAny, kAny, q.shape[2]});
  p.num_pages = pages.k.shape[0];
  p.page_size = pages.k.shape[1];
  p.hkv = pages.k.shape[2];
  chk.floats("pages_v", pages.v, "[P, page_size, Hkv, Dv]", {p.num_pages, p.page_size, p.hkv, kAny});
  p.dqk = q.shape[2];
  p.dv = pages.v.shape[3];
  p.hq = q.shape[1];
  if (p.page_size < 1) throw Error("pages_k.shape[1] (page_size)", str(p.page_size), "must be >= 1");
  if (p.hkv < 1) throw Error("pages_k.shape[2] (Hkv)", str(p.hkv), "must be >= 1");
  if (p.dqk < 1) throw Error("q.shape[2] (Dqk)", str(p.dqk), "must be >= 1");
  if (p.dv < 1) throw Error("pages_v.shape[3] (Dv)", str(p.dv), "must be >= 1");
  if (p.hq < 1 || p.hq % p.hkv != 0)
    throw Error("q.shape[1] (Hq)", str(p.hq), "must be a positive multiple of the pools' Hkv = " + str(p.hkv));
  p.group = p.hq / p.hkv;
  p.scale = p.cfg.softmax_scale(p.dqk);
  fill_page_table(p, table, chk);
  fill_rows(p, seqs, q.shape[0], chk);
}

Plan shapes_plan(const Config& cfg, const TensorView& main, const char* main_name) {
  cfg.validate();
  if (!main.defined()) throw Error(main_name, "absent", "required");
  Plan p;
  p.cfg = cfg;
  p.dtype = main.dtype;
  p.device = main.device;
  return p;
}

Config dense_config(double scale) {
  Config cfg;  // only the scale matters
  if (!(scale >= 0.0 && scale <= kMaxScale))
    throw Error("scale", std::to_string(scale), "must be in (0, 3.4e38] (fp32's range), or 0 for 1/sqrt(Dqk)");
  cfg.scale = scale;
  return cfg;
}

}  // namespace

void cache_append(const Context& ctx, const Config& cfg, const PagedCache& cache, const CacheAppend& in,
                  Workspace ws) {
  const BackendOps* ops;
  Plan p = detail::start_plan(ctx, cfg, in.kv[kCmp].k, "k_cmp", ops);
  fill_append(p, cache, in);
  detail::check_workspace(*ops, p, Op::cache_append, detail::problem_of(p), ws);
  detail::require_op(*ops, ops->cache_append, "cache_append")(p, cache, in, ws);
}

void decode(const Context& ctx, const Config& cfg, const PagedCache& cache, const DecodeInputs& in,
            const ForwardOutputs& out, Workspace ws) {
  const BackendOps* ops;
  Plan p = detail::start_plan(ctx, cfg, in.q, "q", ops);
  fill_decode(p, cache, in);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  chk.floats("o", out.o, "[Tq, Hq, Dv]", {p.T, p.hq, p.dv});
  if (out.lse.defined()) chk.tensor("lse", out.lse, "[Tq, Hq, 3]", {p.T, p.hq, 3}, DType::f32);
  if (out.indices.defined())
    chk.tensor("indices", out.indices, "[Tq, Hkv, n]", {p.T, p.hkv, cfg.n_selected}, DType::i32);
  chk.optional_floats("o_branch", out.o_branch, "[3, Tq, Hq, Dv]", {3, p.T, p.hq, p.dv});
  detail::require_absent("o_cmp", out.o_cmp,
                         "decode keeps nothing for a backward (o_branch holds each branch's output)");
  detail::require_absent("o_win", out.o_win,
                         "decode keeps nothing for a backward (o_branch holds each branch's output)");
  detail::check_workspace(*ops, p, Op::decode, detail::problem_of(p), ws);
  detail::require_op(*ops, ops->decode, "decode")(p, cache, in, out, ws);
}

void dense_decode(const Context& ctx, double scale, const KV& pages, const PageTable& table, const TensorView& q,
                  const Sequences& seqs, const TensorView& o, const TensorView& lse, Workspace ws) {
  const BackendOps* ops;
  Plan p = detail::start_plan(ctx, dense_config(scale), q, "q", ops);
  fill_dense_decode(p, pages, table, q, seqs);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("o", o, "[Tq, Hq, Dv]", {p.T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[Tq, Hq]", {p.T, p.hq}, DType::f32);
  detail::check_workspace(*ops, p, Op::dense_decode, detail::problem_of(p), ws);
  detail::require_op(*ops, ops->dense_decode, "dense_decode")(p, pages, table, q, o, lse, ws);
}

Problem problem_of(const Config& cfg, const PagedCache& cache, const CacheAppend& in) {
  Plan p = shapes_plan(cfg, in.kv[kCmp].k, "k_cmp");
  fill_append(p, cache, in);
  return detail::problem_of(p);
}

Problem problem_of(const Config& cfg, const PagedCache& cache, const DecodeInputs& in) {
  Plan p = shapes_plan(cfg, in.q, "q");
  fill_decode(p, cache, in);
  return detail::problem_of(p);
}

Problem problem_of(const KV& pages, const PageTable& table, const TensorView& q, const Sequences& seqs) {
  Plan p = shapes_plan(Config{}, q, "q");
  fill_dense_decode(p, pages, table, q, seqs);
  return detail::problem_of(p);
}

}  // namespace nsa
