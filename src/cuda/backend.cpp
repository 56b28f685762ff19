// The CUDA backend's table (src/common/plan.h): checks what only this backend restricts
// (dtype, head dims, group size, alignment), fills the kernels' parameter structs and launches
// them on ctx.stream. No allocation, no synchronisation: temporary buffers come from the
// caller's workspace, laid out by ForwardWorkspace (shared by workspace_size and forward).
//
// Layers: api.cpp (validation) -> this file (dispatch) -> launch_* (grid, shared memory) -> kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/plan.h"
#include "cuda/backward/backward.h"
#include "cuda/common/check.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/launch.h"
#include "cuda/decode/decode.h"
#include "cuda/params.h"
#include "cuda/forward/topn.cuh"
#include "cuda/phi/phi.h"
#include "cuda/rotary/rotary.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda {

namespace {

using detail::Plan;


int log2_exact(int64_t v) {
  int r = 0;
  while ((int64_t(1) << r) < v) ++r;
  return r;
}

void require_attention_shapes(const Plan& p) {
  require_storage_dtype(p.dtype);
  require_supported_dims(p.dqk, p.dv);
  require_supported_group(p.group);
}

SeqParams seq_params(const Plan& p) {
  SeqParams s;
  s.cu_seqlens = p.cu_seqlens.defined() ? static_cast<const int32_t*>(p.cu_seqlens.data) : nullptr;
  s.total_tokens = p.T;
  s.batch = static_cast<int>(p.B);
  s.max_seqlen = p.max_seqlen;
  return s;
}

// Columns of the running S accumulator of the compressed kernel: the selection blocks one chunk
// of kKeyChunk compressed blocks can touch (cmp_attention.cuh).
int score_window(const Config& cfg) {
  const int64_t R = cfg.slc_block_len / cfg.cmp_stride, L = cfg.cmp_block_len / cfg.cmp_stride;
  return static_cast<int>((kKeyChunk + L - 2) / R + 2);
}

// The accumulator is a ring indexed by j mod score_ring: it must hold the W blocks one chunk
// touches plus the blocks the previous chunk finished (flushed while the next chunk adds).
int score_ring(const Config& cfg) {
  const int64_t R = cfg.slc_block_len / cfg.cmp_stride;
  const int64_t need = score_window(cfg) + (kKeyChunk + R - 1) / R;
  int ring = 1;
  while (ring < need) ring *= 2;
  return ring;
}

// ---- Workspace of forward() -----------------------------------------------------------------

// Ints of the selection's union-tile list (slc_attention.cuh; l' = 64 only, where those tiles run).
int64_t slc_union_list_len(const Config& cfg, const Problem& pr) {
  if (cfg.n_selected <= 0 || cfg.slc_block_len != kKeyChunk || pr.hkv <= 0) return 0;
  return slc_union_list_ints(pr.total_tokens, pr.batch, pr.hkv, pr.hq / pr.hkv);
}

// The scratch of phi's products on cuBLASLt for `rows` compressed rows (bf16 storage only: the
// products run there on bf16 operands), or nullptr.
void* take_phi_blas(WorkspaceCarver& w, const Config& cfg, const Problem& pr, int64_t rows) {
  const int64_t bytes = pr.dtype == DType::bf16
                            ? phi::blas_bytes(cfg.phi, rows, pr.hkv, std::max(pr.dqk, pr.dv), pr.phi_hidden,
                                              cfg.cmp_block_len, cfg.cmp_stride)
                            : 0;
  return bytes > 0 ? w.take<char>(size_t(bytes)) : nullptr;
}

struct ForwardWorkspace {
  void* kc = nullptr;        // [T/d, Hkv, Dqk] storage dtype
  void* vc = nullptr;        // [T/d, Hkv, Dv]
  float* hidden = nullptr;   // phi::forward's work for k (mlp: [T/d * Hkv, F] f32 first)
  float* hidden_v = nullptr; // and for v (phi::forward_pair runs both at once; else = hidden)
  int32_t* first_token = nullptr;  // [T/d] phi's row table
  void* phi_blas = nullptr;  // phi's products on cuBLASLt (phi::blas_bytes; nullptr: none)
  float* scores = nullptr;   // [T, Hkv, Ns] f32
  void* o_cmp = nullptr;     // [T, Hq, Dv] storage dtype (when o_branch is absent)
  void* o_part = nullptr;    // [T, Hq, Dv] storage dtype (n > 0): the branch output the combine reads
                             // back when the caller keeps it nowhere (o_win, or o_slc where the window combines)
  int32_t* slc_tiles = nullptr;  // [slc_union_list_len] the selection's union tiles (none: nullptr)
  size_t bytes = 0;

  ForwardWorkspace(const Config& cfg, const Problem& pr, void* base) {
    WorkspaceCarver w(base);
    const size_t es = dtype_size(pr.dtype);
    const int64_t rows = cmp_rows(pr.total_tokens, cfg.cmp_stride);
    const int64_t ns = num_slc_blocks(pr.max_seqlen, cfg.slc_block_len);
    kc = w.take<char>(rows * pr.hkv * pr.dqk * es);
    vc = w.take<char>(rows * pr.hkv * pr.dv * es);
    hidden = w.take<float>(phi::work_floats(cfg.phi, rows * pr.hkv, pr.phi_hidden, std::max(pr.dqk, pr.dv)));
    // A second area only where the two phis can pair (phi::forward_pair: the same D); else v's phi
    // runs after k's in the same one.
    hidden_v = pr.dqk == pr.dv ? w.take<float>(phi::work_floats(cfg.phi, rows * pr.hkv, pr.phi_hidden, pr.dv)) : hidden;
    first_token = w.take<int32_t>(rows);
    phi_blas = take_phi_blas(w, cfg, pr, rows);
    scores = w.take<float>(cfg.n_selected > 0 ? pr.total_tokens * pr.hkv * ns : 0);
    o_cmp = w.take<char>(pr.total_tokens * pr.hq * pr.dv * es);
    o_part = w.take<char>(cfg.n_selected > 0 ? pr.total_tokens * pr.hq * pr.dv * es : 0);
    const int64_t list = slc_union_list_len(cfg, pr);
    slc_tiles = list > 0 ? w.take<int32_t>(list) : nullptr;
    bytes = w.bytes();
  }
};

// compress_fwd's: phi's row table and mlp's hidden layer.
struct CompressWorkspace {
  int32_t* first_token = nullptr;  // [T/d]
  float* hidden = nullptr;         // phi::forward's work (mlp: [T/d * Hkv, F] f32 first)
  void* phi_blas = nullptr;        // phi's products on cuBLASLt (phi::blas_bytes; nullptr: none)
  size_t bytes = 0;
  CompressWorkspace(const Config& cfg, const Problem& pr, void* base) {
    WorkspaceCarver w(base);
    const int64_t rows = cmp_rows(pr.total_tokens, cfg.cmp_stride);
    first_token = w.take<int32_t>(rows);
    hidden = w.take<float>(phi::work_floats(cfg.phi, rows * pr.hkv, pr.phi_hidden, std::max(pr.dqk, pr.dv)));
    phi_blas = take_phi_blas(w, cfg, pr, rows);
    bytes = w.bytes();
  }
};

size_t workspace_size(const Context& ctx, Op op, const Config& cfg, const Problem& pr) {
  switch (op) {
    case Op::compress_fwd: return CompressWorkspace(cfg, pr, nullptr).bytes;
    case Op::forward: return ForwardWorkspace(cfg, pr, nullptr).bytes;
    case Op::selected_attention_fwd: return align_up(slc_union_list_len(cfg, pr) * sizeof(int32_t));
    case Op::cache_append:
    case Op::decode:
    case Op::dense_decode: return decode::workspace_size(op, cfg, pr);
    case Op::backward: return bwd::backward_workspace_size(ctx, cfg, pr);
    case Op::compress_bwd: return bwd::compress_bwd_workspace_size(ctx, cfg, pr);
    default: return 0;
  }
}

// ---- Stages -----------------------------------------------------------------------------------

// phi's rows for x (and its parameters' checks); the row table is the caller's (phi::row_table).
phi::Rows phi_rows_of(const Plan& p, const PhiParams& phi, const TensorView& x, int64_t hidden_width,
                      int32_t* first_token, void* blas_scratch) {
  require_storage_dtype(p.dtype);
  for (const TensorView* t : {&phi.w1, &phi.b1, &phi.w2, &phi.b2, &phi.pe})
    if (t->defined() && !t->is_contiguous())
      throw Error("phi parameters", "strided", "must be contiguous on the cuda backend");
  phi::Rows r = phi::rows_of(p.cfg, p.T, x.shape[1], x.shape[2], hidden_width, first_token,
                             choices_of(p.ctx).phi_wgmma, choices_of(p.ctx).phi_blas);
  r.blas_scratch = blas_scratch;
  return r;
}
void row_table_of(const Plan& p, int32_t* first_token) {
  const SeqParams seqs = seq_params(p);
  phi::row_table(seqs.cu_seqlens, seqs.batch, p.T, static_cast<int>(p.cfg.cmp_block_len),
                 static_cast<int>(p.cfg.cmp_stride), first_token, stream_of(p));
}

// xc = phi(x) on every compressed row a sequence uses (rows of none are left as they are).
void run_phi(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& xc, int64_t hidden_width,
             float* hidden, int32_t* first_token, void* blas_scratch) {
  const phi::Rows r = phi_rows_of(p, phi, x, hidden_width, first_token, blas_scratch);
  if (r.rc == 0) return;
  row_table_of(p, first_token);
  dispatch_storage(p.dtype, [&]<typename S>() {
    phi::forward<S>(r, phi, x, hidden, xc.data, xc.stride[0], xc.stride[1], false, stream_of(p));
  });
}

void compress_fwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& xc, Workspace ws) {
  const CompressWorkspace w(p.cfg, detail::problem_of(p), ws.data);
  run_phi(p, phi, x, xc, p.phi_hidden_k, w.hidden, w.first_token, w.phi_blas);
}

CmpAttnParams cmp_params(const Plan& p, const TensorView& q, const void* kc, int64_t kc_rows, int64_t kc_st,
                         int64_t kc_sh, const void* vc, int64_t vc_st, int64_t vc_sh) {
  CmpAttnParams c{};
  c.choices = choices_of(p.ctx);
  c.seqs = seq_params(p);
  c.q = q.data;
  c.q_st = q.stride[0];
  c.q_sh = q.stride[1];
  c.kc = kc;
  c.kc_rows = kc_rows;
  c.kc_st = kc_st;
  c.kc_sh = kc_sh;
  c.vc = vc;
  c.vc_st = vc_st;
  c.vc_sh = vc_sh;
  c.hkv = static_cast<int>(p.hkv);
  c.group = static_cast<int>(p.group);
  c.log2_group = log2_exact(p.group);
  c.scale_log2 = static_cast<float>(p.scale) * kLog2e;
  c.l = static_cast<int>(p.cfg.cmp_block_len);
  c.d = static_cast<int>(p.cfg.cmp_stride);
  c.lp = static_cast<int>(p.cfg.slc_block_len);
  c.score_window = score_window(p.cfg);
  c.score_ring = score_ring(p.cfg);
  // By chunk: R = l'/d divides the chunk, and the carry (a chunk's last L - 1 keys, L = l/d) fits
  // the ring's slots of a token and comes from one chunk.
  const int R = c.lp / c.d, L = c.l / c.d;
  c.score_by_chunk =
      c.choices.cmp_scores_by_chunk && kKeyChunk % R == 0 && L - 1 <= std::min(c.score_ring, kKeyChunk);
  return c;
}

void launch_cmp(const Plan& p, const CmpAttnParams& c) {
  const size_t smem = cmp_attention_smem_bytes(static_cast<int>(p.dqk), static_cast<int>(p.dv), c.group, c.score_ring,
                                               c.scores != nullptr, kMaxSmem, c.choices.cmp_scores_rows);
  if (smem > kMaxSmem)
    throw Error("cmp_block_len / cmp_stride", std::to_string(p.cfg.cmp_block_len / p.cfg.cmp_stride),
                "needs more shared memory (" + std::to_string(smem) + " bytes) than the cuda backend has");
  dispatch(p.dtype, p.dqk, p.dv, [&]<typename S, int kDqk, int kDv>() { launch_cmp_attention<S, kDqk, kDv>(c, stream_of(p)); });
}

void compressed_attention_fwd(const Plan& p, const TensorView& q, const TensorView& kc, const TensorView& vc,
                              const TensorView& o, const TensorView& lse, const TensorView& scores, Workspace) {
  require_attention_shapes(p);
  for (auto [name, t] : {std::pair{"q", &q}, {"kc", &kc}, {"vc", &vc}, {"o", &o}}) require_rows_aligned(name, *t);
  CmpAttnParams c =
      cmp_params(p, q, kc.data, kc.shape[0], kc.stride[0], kc.stride[1], vc.data, vc.stride[0], vc.stride[1]);
  c.o = o.data;
  c.o_st = o.stride[0];
  c.o_sh = o.stride[1];
  c.lse = static_cast<float*>(lse.data);
  c.lse_st = lse.stride[0];
  c.lse_sh = lse.stride[1];
  if (scores.defined()) {
    c.scores = static_cast<float*>(scores.data);
    c.s_st = scores.stride[0];
    c.s_sh = scores.stride[1];
    c.scores_width = scores.shape[2];
    c.scores_zero_fill = true;
  }
  launch_cmp(p, c);
}

TopnParams topn_params(const Plan& p, const float* scores, int64_t s_st, int64_t s_sh, const TensorView& indices) {
  TopnParams t{};
  t.seqs = seq_params(p);
  t.scores = scores;
  t.s_st = s_st;
  t.s_sh = s_sh;
  t.indices = static_cast<int32_t*>(indices.data);
  t.i_st = indices.stride[0];
  t.i_sh = indices.stride[1];
  t.hkv = static_cast<int>(p.hkv);
  t.lp = static_cast<int>(p.cfg.slc_block_len);
  t.n_sel = static_cast<int>(p.cfg.n_selected);
  t.forced = forced_blocks(p.cfg);
  t.n_slc_max = p.n_slc_max;
  return t;
}

void select_topn(const Plan& p, const TensorView& scores, const TensorView& indices, Workspace) {
  launch_select_topn(topn_params(p, static_cast<const float*>(scores.data), scores.stride[0], scores.stride[1], indices),
                     stream_of(p));
}

BranchParams branch_params(const Plan& p, const TensorView& q) {
  BranchParams s{};
  s.choices = choices_of(p.ctx);
  s.seqs = seq_params(p);
  s.q = q.data;
  s.q_st = q.stride[0];
  s.q_sh = q.stride[1];
  s.hkv = static_cast<int>(p.hkv);
  s.group = static_cast<int>(p.group);
  s.log2_group = log2_exact(p.group);
  s.scale_log2 = static_cast<float>(p.scale) * kLog2e;
  s.lp = static_cast<int>(p.cfg.slc_block_len);
  s.n_sel = static_cast<int>(p.cfg.n_selected);
  s.window = static_cast<int>(p.cfg.window);
  s.sort_capacity = slc_sort_capacity(s.group, s.n_sel);
  return s;
}

void set_kv(const TensorView& k, const TensorView& v, const void*& kp, int64_t& k_st, int64_t& k_sh, const void*& vp,
            int64_t& v_st, int64_t& v_sh) {
  kp = k.data;
  k_st = k.stride[0];
  k_sh = k.stride[1];
  vp = v.data;
  v_st = v.stride[0];
  v_sh = v.stride[1];
}

void set_indices(BranchParams& s, const TensorView& indices) {
  s.indices = static_cast<const int32_t*>(indices.data);
  s.idx_st = indices.stride[0];
  s.idx_sh = indices.stride[1];
}

// Outputs of branch `b` (0 = slc, 1 = win): o [T, Hq, Dv] and lse [T, Hq], each with its token
// and head strides (nullptr: not wanted).
void set_branch_output(BranchParams& s, int b, void* o, int64_t o_st, int64_t o_sh, float* lse, int64_t lse_st,
                       int64_t lse_sh) {
  s.o_branch[b] = o;
  s.ob_st[b] = o_st;
  s.ob_sh[b] = o_sh;
  s.lse[b] = lse;
  s.lse_st[b] = lse_st;
  s.lse_sh[b] = lse_sh;
}
void set_branch_output(BranchParams& s, int b, const TensorView& o, const TensorView& lse) {
  set_branch_output(s, b, o.data, o.stride[0], o.stride[1], static_cast<float*>(lse.data),
                    lse.defined() ? lse.stride[0] : 0, lse.defined() ? lse.stride[1] : 0);
}

// Selection (slc_launch.cuh: slc_attention.cuh, slc_attention_tma.cuh, slc_attention_blocks.cuh):
// writes o_branch[0] and lse[0]. The kernel on L1 loads, which runs wherever the TMA kernels do not,
// sets the bound on n.
void launch_slc(const Plan& p, const BranchParams& s) {
  const size_t smem = slc_smem_bytes(static_cast<int>(p.dqk), static_cast<int>(p.dv), s.sort_capacity);
  if (smem > kMaxSmem)
    throw Error("n_selected (n)", std::to_string(p.cfg.n_selected),
                "needs more shared memory (" + std::to_string(smem) + " bytes) than the cuda selection kernel has");
  dispatch(p.dtype, p.dqk, p.dv,
           [&]<typename S, int kDqk, int kDv>() { launch_slc_attention<S, kDqk, kDv>(s, stream_of(p)); });
}

// Window, and the gated combine when s.combine (win_attention.cuh): writes o_branch[1], lse[1], o.
void launch_win(const Plan& p, const BranchParams& s) {
  dispatch(p.dtype, p.dqk, p.dv,
           [&]<typename S, int kDqk, int kDv>() { launch_win_attention<S, kDqk, kDv>(s, stream_of(p)); });
}

void selected_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& indices, const TensorView& o, const TensorView& lse, Workspace ws) {
  require_attention_shapes(p);
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}}) require_rows_aligned(name, *t);
  BranchParams s = branch_params(p, q);
  set_kv(k, v, s.k_slc, s.ks_st, s.ks_sh, s.v_slc, s.vs_st, s.vs_sh);
  set_indices(s, indices);
  if (slc_union_list_len(p.cfg, detail::problem_of(p)) > 0) s.slc_union_list = static_cast<int32_t*>(ws.data);
  set_branch_output(s, 0, o, lse);
  launch_slc(p, s);
}

void window_attention_fwd(const Plan& p, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o, const TensorView& lse, Workspace) {
  require_attention_shapes(p);
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}}) require_rows_aligned(name, *t);
  BranchParams s = branch_params(p, q);
  set_kv(k, v, s.k_win, s.kw_st, s.kw_sh, s.v_win, s.vw_st, s.vw_sh);
  set_branch_output(s, 1, o, lse);
  launch_win(p, s);
}

// Spec §2-§7: phi, compressed attention + S, top-n, then selection + window + gated combine.
void forward(const Plan& p, const Inputs& in, const ForwardOutputs& out, Workspace ws) {
  require_attention_shapes(p);
  require_rows_aligned("q", in.q);
  require_rows_aligned("o", out.o);
  require_rows_aligned("o_branch", out.o_branch);
  require_rows_aligned("o_cmp", out.o_cmp);
  require_rows_aligned("o_win", out.o_win);
  for (int b = 0; b < 3; ++b) {
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    require_rows_aligned("k", kv.k);
    require_rows_aligned("v", kv.v);
  }
  const ForwardWorkspace w(p.cfg, detail::problem_of(p), ws.data);
  const cudaStream_t stream = stream_of(p);
  const size_t es = dtype_size(p.dtype);
  const int64_t rows = cmp_rows(p.T, p.cfg.cmp_stride);

  // §2: compressed keys and values, contiguous [T/d, Hkv, D].
  const KV& cmp = detail::branch_kv(p.cfg, in, kCmp);
  TensorView kc = make_view(w.kc, p.dtype, {rows, p.hkv, p.dqk}, Device::cuda);
  TensorView vc = make_view(w.vc, p.dtype, {rows, p.hkv, p.dv}, Device::cuda);
  if (rows > 0) {  // both at once (phi::forward_pair), each with its own hidden area
    const phi::Rows rk = phi_rows_of(p, in.phi_k, cmp.k, p.phi_hidden_k, w.first_token, w.phi_blas);
    const phi::Rows rv = phi_rows_of(p, in.phi_v, cmp.v, p.phi_hidden_v, w.first_token, w.phi_blas);
    row_table_of(p, w.first_token);
    dispatch_storage(p.dtype, [&]<typename S>() {
      phi::forward_pair<S>(rk, phi::Job{in.phi_k, cmp.k, w.hidden, kc.data, kc.stride[0], kc.stride[1]}, rv,
                           phi::Job{in.phi_v, cmp.v, w.hidden_v, vc.data, vc.stride[0], vc.stride[1]}, false,
                           choices_of(p.ctx).phi_pairs, stream_of(p));
    });
  }

  // §2-§3: o_cmp, lse_cmp and S in one kernel.
  CmpAttnParams c = cmp_params(p, in.q, w.kc, rows, p.hkv * p.dqk, p.dqk, w.vc, p.hkv * p.dv, p.dv);
  void* o_cmp = w.o_cmp;
  int64_t oc_st = p.hq * p.dv, oc_sh = p.dv;
  if (out.o_branch.defined()) {  // o_branch[0] is o_cmp: write it there and read it back
    o_cmp = out.o_branch.data;
    oc_st = out.o_branch.stride[1];
    oc_sh = out.o_branch.stride[2];
  } else if (out.o_cmp.defined()) {  // the caller keeps o_cmp (for the backward)
    o_cmp = out.o_cmp.data;
    oc_st = out.o_cmp.stride[0];
    oc_sh = out.o_cmp.stride[1];
  }
  c.o = o_cmp;
  c.o_st = oc_st;
  c.o_sh = oc_sh;
  c.lse = static_cast<float*>(out.lse.data) + kCmp * out.lse.stride[2];
  c.lse_st = out.lse.stride[0];
  c.lse_sh = out.lse.stride[1];
  const int64_t ns = p.n_slc_max;
  if (p.cfg.n_selected > 0) {
    c.scores = w.scores;
    c.s_st = p.hkv * ns;
    c.s_sh = ns;
    c.scores_width = ns;
    c.scores_zero_fill = false;  // top-n reads only the admissible blocks j <= J_t
  }
  launch_cmp(p, c);

  // §4: top-n.
  if (p.cfg.n_selected > 0) launch_select_topn(topn_params(p, w.scores, p.hkv * ns, ns, out.indices), stream);

  // §5-§7. With a selection branch (and CudaKernelChoices::combine_in_selection): the window first,
  // into o_branch[kWin], the caller's o_win or the workspace, then the selection with the gated
  // combine, which reads o_cmp and o_win back: the combine's memory traffic then runs beside the
  // selection's gathers from L2 instead of after the window's loop. Otherwise the selection into
  // o_branch[kSlc] or the workspace, then the window with the combine, reading o_cmp and o_slc back.
  const bool slc_combines = p.cfg.n_selected > 0 && choices_of(p.ctx).combine_in_selection;
  BranchParams s = branch_params(p, in.q);
  const KV& slc = detail::branch_kv(p.cfg, in, kSlc);
  const KV& win = detail::branch_kv(p.cfg, in, kWin);
  set_kv(slc.k, slc.v, s.k_slc, s.ks_st, s.ks_sh, s.v_slc, s.vs_st, s.vs_sh);
  set_kv(win.k, win.v, s.k_win, s.kw_st, s.kw_sh, s.v_win, s.vw_st, s.vw_sh);
  set_indices(s, out.indices);
  s.slc_union_list = w.slc_tiles;
  for (int b = 0; b < 2; ++b) {
    float* lse = static_cast<float*>(out.lse.data) + (kSlc + b) * out.lse.stride[2];
    if (out.o_branch.defined())
      set_branch_output(s, b, static_cast<char*>(out.o_branch.data) + (kSlc + b) * out.o_branch.stride[0] * es,
                        out.o_branch.stride[1], out.o_branch.stride[2], lse, out.lse.stride[0], out.lse.stride[1]);
    else if (b == 1 && out.o_win.defined())  // the caller keeps o_win (for the backward)
      set_branch_output(s, b, out.o_win.data, out.o_win.stride[0], out.o_win.stride[1], lse, out.lse.stride[0],
                        out.lse.stride[1]);
    else {  // the combine's read-back in the workspace; the combining kernel's own output nowhere
      const bool read_back = slc_combines ? b == 1 && p.cfg.window > 0 : b == 0 && p.cfg.n_selected > 0;
      set_branch_output(s, b, read_back ? w.o_part : nullptr, p.hq * p.dv, p.dv, lse, out.lse.stride[0],
                        out.lse.stride[1]);
    }
  }
  s.g = in.g.data;
  s.g_st = in.g.stride[0];
  s.g_sh = in.g.stride[1];
  s.o_cmp = o_cmp;
  s.oc_st = oc_st;
  s.oc_sh = oc_sh;
  s.o = out.o.data;
  s.o_st = out.o.stride[0];
  s.o_sh = out.o.stride[1];
  if (slc_combines) {
    launch_win(p, s);
    s.o_win = s.o_branch[1];  // nullptr at w = 0: o_win = 0
    s.ow_st = s.ob_st[1];
    s.ow_sh = s.ob_sh[1];
    s.combine = true;
    launch_slc(p, s);
    return;
  }
  // Also at n = 0: the kernel then writes lse_slc = -inf and o_slc = 0 (if wanted).
  launch_slc(p, s);
  if (p.cfg.n_selected > 0) {
    s.o_slc = s.o_branch[0];
    s.os_st = s.ob_st[0];
    s.os_sh = s.ob_sh[0];
  }
  s.combine = true;
  launch_win(p, s);
}

// Rotary embeddings: bf16 and f16, as every kernel of the backend.
void rotary_op(const Plan& p, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
               const TensorView& out, bool inverse) {
  rotary::Params r;
  r.seqs = seq_params(p);
  r.x = x.data;
  r.x_st = x.stride[0];
  r.x_sh = x.stride[1];
  r.out = out.data;
  r.o_st = out.stride[0];
  r.o_sh = out.stride[1];
  r.inv_freq = static_cast<const float*>(inv_freq.data);
  r.positions = positions.defined() ? static_cast<const int32_t*>(positions.data) : nullptr;
  r.H = x.shape[1];
  r.h = x.shape[2] / 2;
  r.inverse = inverse;
  dispatch_storage(p.dtype, [&]<typename S>() { rotary::launch<S>(r, stream_of(p)); });
}

const detail::BackendOps kOps = {
    "cuda",
    workspace_size,
    compress_fwd,
    bwd::compress_bwd,
    compressed_attention_fwd,
    select_topn,
    selected_attention_fwd,
    window_attention_fwd,
    forward,
    bwd::backward,
    nullptr,  // dense_attention_fwd
    nullptr,  // dense_attention_bwd
    decode::cache_append,
    decode::decode,
    decode::dense_decode,
    rotary_op,
};

}  // namespace

}  // namespace nsa::cuda

namespace nsa::detail {

const BackendOps* cuda_backend() { return &nsa::cuda::kOps; }

bool cuda_device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

}  // namespace nsa::detail
