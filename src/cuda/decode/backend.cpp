// The CUDA backend's decoding entries (decode/decode.h): checks what only this backend restricts,
// fills the kernels' parameters from the plan, carves the workspace and launches on ctx.stream.
// No allocation, no synchronisation, no read of device metadata: the launches depend on shapes
// and declared maxima only, so a call can be captured in a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "cuda/common/check.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/launch.h"
#include "cuda/decode/decode.h"
#include "cuda/tile_sizes.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda::decode {

namespace {

using detail::Plan;

// Grid dimensions y and z hold at most 65535 blocks; the call's rows (grid x) at most 2^31 - 1.
constexpr int64_t kMaxGridYZ = 65535;

Pages pages_of_call(const Plan& p, const PageTable& pt) {
  Pages g;
  g.block_table = static_cast<const int32_t*>(pt.block_table.data);
  g.bt_st0 = pt.block_table.stride[0];
  g.bt_st1 = pt.block_table.stride[1];
  g.seq_lens = static_cast<const int32_t*>(pt.seq_lens.data);
  g.status = static_cast<int32_t*>(pt.status.data);
  g.cu = p.cu_seqlens.defined() ? static_cast<const int32_t*>(p.cu_seqlens.data) : nullptr;
  g.batch = static_cast<int>(p.B);
  g.rows = static_cast<int>(p.T);
  g.max_rows = static_cast<int>(p.max_query_len);
  g.num_pages = static_cast<int>(std::min<int64_t>(p.num_pages, INT32_MAX));
  g.page_size = static_cast<int>(p.page_size);
  g.max_pages = static_cast<int>(std::min<int64_t>(pt.block_table.shape[1], INT32_MAX));
  g.max_len = static_cast<int>(p.max_seqlen);
  return g;
}

Pool pool_of(const TensorView& t) {
  Pool q;
  q.data = t.data;
  q.page_st = t.stride[0];
  q.row_st = t.stride[1];
  q.head_st = t.stride[2];
  return q;
}

void require_limits(const Plan& p) {
  if (p.T > INT32_MAX) throw Error("rows (Tq)", std::to_string(p.T), "must be < 2^31 on the cuda backend");
  if (p.B > INT32_MAX) throw Error("pages.block_table.shape[0] (B)", std::to_string(p.B), "must be < 2^31 on the cuda backend");
}

// The pools, read and written in 16-byte pieces.
void require_pools_aligned(const Config& cfg, const PagedCache& c) {
  static const char* kNames[3][2] = {{"cache.k_cmp", "cache.v_cmp"}, {"cache.k_slc", "cache.v_slc"},
                                      {"cache.k_win", "cache.v_win"}};
  for (int s = 0; s < (cfg.shared_kv ? 1 : 3); ++s) {
    require_rows_aligned(kNames[s][0], c.raw[s].k);
    require_rows_aligned(kNames[s][1], c.raw[s].v);
  }
  require_rows_aligned("cache.kc", c.cmp.k);
  require_rows_aligned("cache.vc", c.cmp.v);
}

// The workspace of decode and dense_decode: the splits' partials, the selected blocks, the checks.
struct DecodeWorkspace {
  float *cmp_ml = nullptr, *cmp_o = nullptr, *cmp_s = nullptr;
  int32_t* sel = nullptr;
  int32_t* row_ok = nullptr;
  float *sw_ml = nullptr, *sw_o = nullptr;
  size_t bytes = 0;

  DecodeWorkspace(const Config& cfg, const Problem& pr, const SplitPlan& sp, bool dense, void* base) {
    WorkspaceCarver w(base);
    const int64_t rows = pr.total_tokens, G = pr.hkv > 0 ? pr.hq / pr.hkv : 1;
    const int64_t items = rows * pr.hkv, n = dense ? 0 : cfg.n_selected;
    const int64_t cmp = dense ? 0 : items * sp.cmp.splits * G;
    cmp_ml = w.take<float>(cmp * 2);
    cmp_o = w.take<float>(cmp * pr.dv);
    cmp_s = w.take<float>(cmp * sp.score_width);
    sel = w.take<int32_t>(items * n);
    row_ok = w.take<int32_t>(rows);
    const int64_t sw = items * ((dense ? 0 : sp.slc_ctas) + sp.win.splits) * G;
    sw_ml = w.take<float>(sw * 2);
    sw_o = w.take<float>(sw * pr.dv);
    bytes = w.bytes();
  }
};

DecodeParams decode_params(const Plan& p, const PageTable& pt, const TensorView& q, const SplitPlan& sp,
                           const DecodeWorkspace& w, bool dense) {
  DecodeParams d;
  d.pages = pages_of_call(p, pt);
  d.q = q.data;
  d.q_st = q.stride[0];
  d.q_sh = q.stride[1];
  d.hkv = static_cast<int>(p.hkv);
  d.group = static_cast<int>(p.group);
  d.dv = static_cast<int>(p.dv);
  d.l = static_cast<int>(p.cfg.cmp_block_len);
  d.d = static_cast<int>(p.cfg.cmp_stride);
  d.lp = static_cast<int>(p.cfg.slc_block_len);
  d.n_sel = dense ? 0 : static_cast<int>(p.cfg.n_selected);
  d.forced = forced_blocks(p.cfg);
  d.window = static_cast<int>(std::min<int64_t>(p.cfg.window, INT32_MAX));
  d.scale_log2 = static_cast<float>(p.scale) * kLog2e;
  d.dense = dense;
  d.cmp_splits = sp.cmp.splits;
  d.cmp_chunk = sp.cmp.chunk;
  d.score_width = sp.score_width;
  d.slc_per_cta = sp.slc_per_cta;
  d.slc_ctas = dense ? 0 : sp.slc_ctas;
  d.win_splits = sp.win.splits;
  d.win_chunk = sp.win.chunk;
  d.cmp_ml = w.cmp_ml;
  d.cmp_o = w.cmp_o;
  d.cmp_s = w.cmp_s;
  d.sel = w.sel;
  d.sel_st = p.hkv * p.cfg.n_selected;
  d.sel_sh = p.cfg.n_selected;
  d.sel_sn = 1;
  d.row_ok = w.row_ok;
  d.sw_ml = w.sw_ml;
  d.sw_o = w.sw_o;
  return d;
}

void check_grid(const Plan& p, const SplitPlan& sp, int64_t n) {
  require_limits(p);
  if (sp.slc_ctas + sp.win.splits > kMaxGridYZ || sp.cmp.splits > kMaxGridYZ)
    throw Error("n_selected (n)", std::to_string(n), "plus the window's splits must be <= 65535 on the cuda backend");
}

}  // namespace

size_t workspace_size(Op op, const Config& cfg, const Problem& pr) {
  switch (op) {
    case Op::decode:
      return DecodeWorkspace(cfg, pr, split_plan(cfg, pr.total_tokens, pr.hkv, pr.max_seqlen, false), false, nullptr).bytes;
    case Op::dense_decode:
      return DecodeWorkspace(cfg, pr, split_plan(cfg, pr.total_tokens, pr.hkv, pr.max_seqlen, true), true, nullptr).bytes;
    case Op::cache_append: {
      if (cfg.phi != PhiKind::mlp) return 0;
      const int64_t per_seq = std::min((pr.max_query_len + cfg.cmp_stride - 1) / cfg.cmp_stride,
                                       num_cmp_blocks(pr.max_seqlen, cfg.cmp_block_len, cfg.cmp_stride));
      return 2 * align_up(static_cast<size_t>(pr.batch * per_seq * pr.hkv * pr.phi_hidden) * sizeof(float));
    }
    default: return 0;
  }
}

void cache_append(const Plan& p, const PagedCache& cache, const CacheAppend& in, Workspace ws) {
  require_storage_dtype(p.dtype);
  require_supported_dims(p.dqk, p.dv);
  require_limits(p);
  require_pools_aligned(p.cfg, cache);
  for (const PhiParams* phi : {&in.phi_k, &in.phi_v})
    for (const TensorView* t : {&phi->w1, &phi->b1, &phi->w2, &phi->b2, &phi->pe})
      if (t->defined() && !t->is_contiguous())
        throw Error("phi parameters", "strided", "must be contiguous on the cuda backend");
  if (p.cfg.cmp_block_len > kMaxBlockTokens)
    throw Error("cmp_block_len (l)", std::to_string(p.cfg.cmp_block_len),
                "must be <= " + std::to_string(kMaxBlockTokens) + " on the cuda backend's append");
  AppendParams a;
  a.pages = pages_of_call(p, cache.pages);
  const int sets = p.cfg.shared_kv ? 1 : 3;
  static const char* kNames[6] = {"k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"};
  a.arrays = 2 * sets;
  for (int s = 0; s < sets; ++s)
    for (int kv = 0; kv < 2; ++kv) {
      const TensorView& src = kv == 0 ? in.kv[s].k : in.kv[s].v;
      const TensorView& dst = kv == 0 ? cache.raw[s].k : cache.raw[s].v;
      require_rows_aligned(kNames[2 * s + kv], src);
      a.src[2 * s + kv] = src.data;
      a.src_st[2 * s + kv] = src.stride[0];
      a.src_sh[2 * s + kv] = src.stride[1];
      a.dst[2 * s + kv] = pool_of(dst);
      a.dim[2 * s + kv] = static_cast<int>(dst.shape[3]);
    }
  a.hkv = static_cast<int>(p.hkv);
  a.l = static_cast<int>(p.cfg.cmp_block_len);
  a.d = static_cast<int>(p.cfg.cmp_stride);
  a.kind = static_cast<int>(p.cfg.phi);
  const Problem pr = detail::problem_of(p);
  a.blocks_per_seq = static_cast<int>(std::min((p.max_query_len + p.cfg.cmp_stride - 1) / p.cfg.cmp_stride,
                                               num_cmp_blocks(p.max_seqlen, p.cfg.cmp_block_len, p.cfg.cmp_stride)));
  // The widest input a phi CTA stages per head: a block (l * D) or the hidden layer (F).
  const int64_t widest = std::max({p.cfg.cmp_block_len * std::max(p.dqk, p.dv), p.phi_hidden_k, p.phi_hidden_v});
  a.heads_per_cta = static_cast<int>(std::min<int64_t>({p.hkv, kMaxHeadsPerCta, static_cast<int64_t>(kPhiSmemBudget / (4 * widest))}));
  if (p.cfg.phi != PhiKind::mean && a.heads_per_cta < 1)
    throw Error("cmp_block_len * D", std::to_string(widest),
                "is too large for the cuda backend's phi when appending (at most " + std::to_string(kPhiSmemBudget / 4) + ")");
  WorkspaceCarver w(ws.data);
  const int64_t slots = p.B * a.blocks_per_seq;
  for (int side = 0; side < 2; ++side) {
    const PhiParams& phi = side == 0 ? in.phi_k : in.phi_v;
    PhiSide& s = a.side[side];
    s.raw = pool_of(side == 0 ? cache.raw[kCmp].k : cache.raw[kCmp].v);
    s.cmp = pool_of(side == 0 ? cache.cmp.k : cache.cmp.v);
    s.dim = static_cast<int>(side == 0 ? p.dqk : p.dv);
    s.w1 = phi.w1.data;
    s.b1 = phi.b1.data;
    s.w2 = phi.w2.data;
    s.b2 = phi.b2.data;
    s.pe = phi.pe.data;
    s.hidden = static_cast<int>(side == 0 ? p.phi_hidden_k : p.phi_hidden_v);
    if (p.cfg.phi == PhiKind::mlp) s.hidden_buf = w.take<float>(static_cast<size_t>(slots * p.hkv * pr.phi_hidden));
  }
  if (p.T == 0) return;
  dispatch_storage(p.dtype, [&]<typename S>() { launch_append<S>(a, stream_of(p)); });
}

void decode(const Plan& p, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out, Workspace ws) {
  require_storage_dtype(p.dtype);
  require_supported_dims(p.dqk, p.dv);
  require_supported_group(p.group);
  require_pools_aligned(p.cfg, cache);
  require_rows_aligned("q", in.q);
  const Problem pr = detail::problem_of(p);
  const SplitPlan sp = split_plan(p.cfg, p.T, p.hkv, p.max_seqlen, false);
  check_grid(p, sp, p.cfg.n_selected);
  const DecodeWorkspace w(p.cfg, pr, sp, false, ws.data);
  DecodeParams d = decode_params(p, cache.pages, in.q, sp, w, false);
  d.g = in.g.data;
  d.g_st = in.g.stride[0];
  d.g_sh = in.g.stride[1];
  d.g_sb = in.g.stride[2];
  d.kc = pool_of(cache.cmp.k);
  d.vc = pool_of(cache.cmp.v);
  const KV& slc = cache.raw[p.cfg.shared_kv ? kCmp : kSlc];
  const KV& win = cache.raw[p.cfg.shared_kv ? kCmp : kWin];
  d.k_slc = pool_of(slc.k);
  d.v_slc = pool_of(slc.v);
  d.k_win = pool_of(win.k);
  d.v_win = pool_of(win.v);
  d.o = out.o.data;
  d.o_st = out.o.stride[0];
  d.o_sh = out.o.stride[1];
  if (out.lse.defined()) {
    d.lse = static_cast<float*>(out.lse.data);
    d.lse_st = out.lse.stride[0];
    d.lse_sh = out.lse.stride[1];
    d.lse_sb = out.lse.stride[2];
  }
  if (out.indices.defined()) {  // the selection reads the blocks back from the output
    d.sel = static_cast<int32_t*>(out.indices.data);
    d.sel_st = out.indices.stride[0];
    d.sel_sh = out.indices.stride[1];
    d.sel_sn = out.indices.stride[2];
  }
  if (out.o_branch.defined()) {
    d.o_branch = out.o_branch.data;
    d.ob_sb = out.o_branch.stride[0];
    d.ob_st = out.o_branch.stride[1];
    d.ob_sh = out.o_branch.stride[2];
  }
  const int64_t ns_max = num_slc_blocks(p.max_seqlen, p.cfg.slc_block_len);
  if (select_smem(d, ns_max) > kMaxSmem)
    throw Error("pages.max_seqlen", std::to_string(p.max_seqlen),
                "is too long for the cuda decode's top-n (its scores row must fit in shared memory)");
  if (p.T == 0) return;
  const cudaStream_t stream = stream_of(p);
  dispatch(p.dtype, p.dqk, p.dv, [&]<typename S, int kDqk, int kDv>() {
    launch_cmp_partial<S, kDqk, kDv>(d, stream);
    launch_select(d, ns_max, stream);
    launch_sparse_partial<S, kDqk, kDv>(d, stream);
    launch_combine<S>(d, stream);
  });
}

void dense_decode(const Plan& p, const KV& pages, const PageTable& table, const TensorView& q, const TensorView& o,
                  const TensorView& lse, Workspace ws) {
  require_storage_dtype(p.dtype);
  require_supported_dims(p.dqk, p.dv);
  require_supported_group(p.group);
  require_rows_aligned("pages_k", pages.k);
  require_rows_aligned("pages_v", pages.v);
  require_rows_aligned("q", q);
  const Problem pr = detail::problem_of(p);
  const SplitPlan sp = split_plan(p.cfg, p.T, p.hkv, p.max_seqlen, true);
  check_grid(p, sp, 0);
  const DecodeWorkspace w(p.cfg, pr, sp, true, ws.data);
  DecodeParams d = decode_params(p, table, q, sp, w, true);
  d.k_win = pool_of(pages.k);
  d.v_win = pool_of(pages.v);
  d.o = o.data;
  d.o_st = o.stride[0];
  d.o_sh = o.stride[1];
  if (lse.defined()) {
    d.lse = static_cast<float*>(lse.data);
    d.lse_st = lse.stride[0];
    d.lse_sh = lse.stride[1];
  }
  if (p.T == 0) return;
  const cudaStream_t stream = stream_of(p);
  dispatch(p.dtype, p.dqk, p.dv, [&]<typename S, int kDqk, int kDv>() {
    launch_select(d, 0, stream);
    if (sp.win.splits > 0) launch_sparse_partial<S, kDqk, kDv>(d, stream);
    launch_combine<S>(d, stream);
  });
}

}  // namespace nsa::cuda::decode
