// The API layer: checks every argument, resolves the backend, fills a Plan and calls down.
// Nothing below this file validates user input again; everything here fails with nsa::Error.
#include "nsa/api.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/plan.h"
#include "common/validate.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa {

using detail::BackendOps;
using detail::Checker;
using detail::Plan;
using detail::check_phi;
using detail::check_workspace;
using detail::fill_heads;
using detail::fill_query_sequences;
using detail::fill_sequences;
using detail::kAny;
using detail::require_absent;
using detail::require_op;
using detail::resolve_backend;
using detail::start_plan;
using detail::str;

namespace {

// Whether seqs_q is the very view seqs is (same tensor, same rows): the same as no query packing.
bool same_packing(const Sequences& seqs, const Sequences& seqs_q) {
  const TensorView &a = seqs.cu_seqlens, &b = seqs_q.cu_seqlens;
  if (!a.defined() || !b.defined() || a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype ||
      a.device != b.device || a.device_index != b.device_index)
    return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || a.stride[d] != b.stride[d]) return false;
  return seqs_q.max_seqlen == 0 || seqs_q.max_seqlen == seqs.max_seqlen;
}

// The layer's inputs with a query packing that is the keys' own dropped (see Inputs).
Inputs normalised(const Inputs& in) {
  Inputs out = in;
  if (same_packing(in.seqs, in.seqs_q)) out.seqs_q = Sequences{};
  return out;
}

// The shapes of q, the compression branch's K/V, the heads, phi and both packings, without a
// backend (problem_of) or after resolving it (plan_layer). T counts the keys, Tq the queries.
void check_layer_shapes(Plan& p, const Config& cfg, const Inputs& in, const Checker& chk) {
  const bool packed_q = in.seqs_q.cu_seqlens.defined();
  chk.floats("q", in.q, packed_q ? "[Tq, Hq, Dqk]" : "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t Tq = in.q.shape[0];
  chk.floats("k_cmp", in.kv[kCmp].k, "[T, Hkv, Dqk]", {packed_q ? kAny : Tq, kAny, in.q.shape[2]});
  const int64_t T = in.kv[kCmp].k.shape[0];
  chk.floats("v_cmp", in.kv[kCmp].v, "[T, Hkv, Dv]", {T, in.kv[kCmp].k.shape[1], kAny});
  fill_heads(p, in.q, in.kv[kCmp].k, in.kv[kCmp].v);
  p.phi_hidden_k = check_phi(cfg, chk, "phi_k", in.phi_k, p.dqk);
  p.phi_hidden_v = check_phi(cfg, chk, "phi_v", in.phi_v, p.dv);
  fill_sequences(p, in.seqs, T, chk);
  fill_query_sequences(p, in.seqs_q, Tq, chk);
}

// Everything forward() and backward() share: q, the branch K/V, g, phi, both packings. `in` is
// normalised (a query packing that is the keys' own dropped).
Plan plan_layer(const Context& ctx, const Config& cfg, const Inputs& in, const BackendOps*& ops) {
  // The cuda backend reads query and key rows through one packing: a query packing for it is
  // refused first, whether or not this build and machine have it.
  const bool cuda = ctx.backend == Backend::cuda || (ctx.backend == Backend::automatic && in.q.device == Device::cuda);
  if (in.seqs_q.cu_seqlens.defined() && cuda)
    throw Error("seqs_q.cu_seqlens", "given (a query packing)",
                "is not supported by the cuda backend yet: leave it absent (queries at every position), or pass "
                "the very view of seqs.cu_seqlens");
  Plan p = start_plan(ctx, cfg, in.q, "q", ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  check_layer_shapes(p, cfg, in, chk);
  const int64_t T = p.T, Tq = p.query_rows();
  static const char* kNames[3][2] = {{"k_cmp", "v_cmp"}, {"k_slc", "v_slc"}, {"k_win", "v_win"}};
  for (int b = 1; b < 3; ++b) {
    if (cfg.shared_kv) {
      require_absent(kNames[b][0], in.kv[b].k, "shared_kv uses k_cmp/v_cmp for every branch");
      require_absent(kNames[b][1], in.kv[b].v, "shared_kv uses k_cmp/v_cmp for every branch");
    } else {
      chk.floats(kNames[b][0], in.kv[b].k, "[T, Hkv, Dqk]", {T, p.hkv, p.dqk});
      chk.floats(kNames[b][1], in.kv[b].v, "[T, Hkv, Dv]", {T, p.hkv, p.dv});
    }
  }
  chk.floats("g", in.g, p.has_query_packing() ? "[Tq, Hq, 3]" : "[T, Hq, 3]", {Tq, p.hq, 3});
  return p;
}

// The dims of a query-side tensor in messages: Tq rows with a query packing, else T.
const char* qdims(const Plan& p, const char* with_tq, const char* with_t) {
  return p.has_query_packing() ? with_tq : with_t;
}

void check_saved(const Plan& p, const Checker& chk, const ForwardOutputs& out, bool need_o) {
  const int64_t Tq = p.query_rows();
  if (need_o) chk.floats("o", out.o, qdims(p, "[Tq, Hq, Dv]", "[T, Hq, Dv]"), {Tq, p.hq, p.dv});
  else chk.optional_floats("o", out.o, qdims(p, "[Tq, Hq, Dv]", "[T, Hq, Dv]"), {Tq, p.hq, p.dv});
  chk.tensor("lse", out.lse, qdims(p, "[Tq, Hq, 3]", "[T, Hq, 3]"), {Tq, p.hq, 3}, DType::f32);
  chk.tensor("indices", out.indices, qdims(p, "[Tq, Hkv, n]", "[T, Hkv, n]"), {Tq, p.hkv, p.cfg.n_selected},
             DType::i32);
  // The branch outputs kept for the backward (optional): o_branch, or any of o_cmp and o_win.
  chk.optional_floats("o_branch", out.o_branch, qdims(p, "[3, Tq, Hq, Dv]", "[3, T, Hq, Dv]"), {3, Tq, p.hq, p.dv});
  chk.optional_floats("o_cmp", out.o_cmp, qdims(p, "[Tq, Hq, Dv]", "[T, Hq, Dv]"), {Tq, p.hq, p.dv});
  chk.optional_floats("o_win", out.o_win, qdims(p, "[Tq, Hq, Dv]", "[T, Hq, Dv]"), {Tq, p.hq, p.dv});
  if (out.o_branch.defined()) {
    require_absent("o_cmp", out.o_cmp, "o_branch holds the compressed branch's output already: pass one of the two");
    require_absent("o_win", out.o_win, "o_branch holds the window branch's output already: pass one of the two");
  }
}

// What the attention stages on q, k, v share (selected, window, dense): q [T, Hq, Dqk],
// k [T, Hkv, Dqk], v [T, Hkv, Dv], the heads and the sequences.
Plan plan_qkv(const Context& ctx, const Config& cfg, const TensorView& q, const TensorView& k,
              const TensorView& v, const Sequences& seqs, const BackendOps*& ops) {
  Plan p = start_plan(ctx, cfg, q, "q", ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("q", q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t T = q.shape[0];
  chk.floats("k", k, "[T, Hkv, Dqk]", {T, kAny, q.shape[2]});
  chk.floats("v", v, "[T, Hkv, Dv]", {T, k.shape[1], kAny});
  fill_heads(p, q, k, v);
  fill_sequences(p, seqs, T, chk);
  return p;
}

// The rest of window_attention_fwd and dense_attention_fwd once planned: o [T, Hq, Dv], the
// optional lse [T, Hq], the workspace, then the backend's op.
void run_qkv_fwd(const Plan& p, const BackendOps& ops, Op op, decltype(BackendOps::window_attention_fwd) fn,
                 const char* name, const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& o, const TensorView& lse, Workspace ws) {
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("o", o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[T, Hq]", {p.T, p.hq}, DType::f32);
  check_workspace(ops, p, op, detail::problem_of(p), ws);
  require_op(ops, fn, name)(p, q, k, v, o, lse, ws);
}

// What compress_fwd and compress_bwd share: x [T, Hkv, D], phi's parameters, the sequences.
Plan plan_compress(const Context& ctx, const Config& cfg, const PhiParams& phi, const TensorView& x,
                   const Sequences& seqs, const BackendOps*& ops) {
  Plan p = start_plan(ctx, cfg, x, "x", ops);
  const Checker chk(p.dtype, p.device, x.device_index);
  chk.floats("x", x, "[T, Hkv, D]", {kAny, kAny, kAny});
  p.hkv = x.shape[1];
  p.hq = p.hkv;
  p.dqk = p.dv = x.shape[2];
  if (p.hkv < 1) throw Error("x.shape[1] (Hkv)", str(p.hkv), "must be >= 1");
  if (p.dqk < 1) throw Error("x.shape[2] (D)", str(p.dqk), "must be >= 1");
  p.phi_hidden_k = check_phi(cfg, chk, "phi", phi, p.dqk);
  fill_sequences(p, seqs, x.shape[0], chk);
  return p;
}

}  // namespace

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::reference: return "reference";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "unknown";
}

Backend parse_backend(const char* text) {
  const std::string t = text ? text : "";
  if (t == "auto") return Backend::automatic;
  if (t == "reference") return Backend::reference;
  if (t == "cpu") return Backend::cpu;
  if (t == "cuda") return Backend::cuda;
  throw Error("backend", "\"" + t + "\"", "must be one of auto, reference, cpu, cuda");
}

bool backend_available(Backend backend) {
  switch (backend) {
    case Backend::automatic:
    case Backend::reference: return true;
    case Backend::cpu: return detail::cpu_backend() != nullptr;
    case Backend::cuda: return detail::cuda_backend() != nullptr && detail::cuda_device_present();
  }
  return false;
}

Problem problem_of(const Config& cfg, const Inputs& in) {
  // Shapes only: the same checks as a call, without resolving a backend.
  cfg.validate();
  Plan p;
  p.cfg = cfg;
  p.dtype = in.q.dtype;
  p.device = in.q.device;
  const Checker chk(p.dtype, p.device, in.q.device_index);
  check_layer_shapes(p, cfg, normalised(in), chk);
  return detail::problem_of(p);
}

size_t workspace_size(const Context& ctx, Op op, const Config& cfg, const Problem& problem) {
  cfg.validate();
  TensorView probe;  // stands in for the call's main tensor to resolve the backend
  probe.ndim = 1;
  probe.dtype = problem.dtype;
  probe.device = problem.device;
  Context c = ctx;
  const BackendOps& ops = resolve_backend(c, probe, "problem");
  const Problem pr = detail::checked_problem(op, cfg, problem);
  return ops.workspace_size ? ops.workspace_size(c, op, cfg, pr) : 0;
}

void compress_fwd(const Context& ctx, const Config& cfg, const PhiParams& phi, const TensorView& x,
                  const Sequences& seqs, const TensorView& xc, Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_compress(ctx, cfg, phi, x, seqs, ops);
  const Checker chk(p.dtype, p.device, x.device_index);
  chk.floats("xc", xc, "[T/d, Hkv, D]", {cmp_rows(p.T, cfg.cmp_stride), p.hkv, p.dqk});
  check_workspace(*ops, p, Op::compress_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->compress_fwd, "compress_fwd")(p, phi, x, xc, ws);
}

void compress_bwd(const Context& ctx, const Config& cfg, const PhiParams& phi, const TensorView& x,
                  const Sequences& seqs, const TensorView& dxc, const TensorView& dx,
                  const PhiParams& dphi, Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_compress(ctx, cfg, phi, x, seqs, ops);
  const Checker chk(p.dtype, p.device, x.device_index);
  check_phi(cfg, chk, "dphi", dphi, p.dqk);
  if (cfg.phi == PhiKind::mlp && dphi.w1.shape[0] != p.phi_hidden_k)
    throw Error("dphi.w1.shape[0]", str(dphi.w1.shape[0]), "must equal phi.w1.shape[0] = " + str(p.phi_hidden_k));
  chk.floats("dxc", dxc, "[T/d, Hkv, D]", {cmp_rows(p.T, cfg.cmp_stride), p.hkv, p.dqk});
  chk.floats("dx", dx, "[T, Hkv, D]", {p.T, p.hkv, p.dqk});
  check_workspace(*ops, p, Op::compress_bwd, detail::problem_of(p), ws);
  require_op(*ops, ops->compress_bwd, "compress_bwd")(p, phi, x, dxc, dx, dphi, ws);
}

void compressed_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                              const TensorView& kc, const TensorView& vc, const Sequences& seqs,
                              const TensorView& o, const TensorView& lse, const TensorView& scores,
                              Workspace ws) {
  const BackendOps* ops;
  Plan p = start_plan(ctx, cfg, q, "q", ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("q", q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t T = q.shape[0];
  const int64_t rows = cmp_rows(T, cfg.cmp_stride);
  chk.floats("kc", kc, "[T/d, Hkv, Dqk]", {rows, kAny, q.shape[2]});
  chk.floats("vc", vc, "[T/d, Hkv, Dv]", {rows, kc.shape[1], kAny});
  fill_heads(p, q, kc, vc);
  fill_sequences(p, seqs, T, chk);
  chk.floats("o", o, "[T, Hq, Dv]", {T, p.hq, p.dv});
  chk.tensor("lse", lse, "[T, Hq]", {T, p.hq}, DType::f32);
  if (scores.defined()) {
    chk.tensor("scores", scores, "[T, Hkv, Ns]", {T, p.hkv, kAny}, DType::f32);
    if (scores.shape[2] < p.n_slc_max)
      throw Error("scores.shape[2]", str(scores.shape[2]),
                  "must be >= ceil(max_seqlen / l') = " + str(p.n_slc_max));
  }
  check_workspace(*ops, p, Op::compressed_attention_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->compressed_attention_fwd, "compressed_attention_fwd")(p, q, kc, vc, o, lse, scores, ws);
}

void select_topn(const Context& ctx, const Config& cfg, const TensorView& scores,
                 const Sequences& seqs, const TensorView& indices, Workspace ws) {
  if (scores.defined() && scores.dtype != DType::f32)
    throw Error("scores.dtype", dtype_name(scores.dtype), "must be f32");
  const BackendOps* ops;
  Plan p = start_plan(ctx, cfg, scores, "scores", ops);
  const Checker chk(DType::f32, p.device, scores.device_index);
  chk.tensor("scores", scores, "[T, Hkv, Ns]", {kAny, kAny, kAny}, DType::f32);
  p.hkv = p.hq = scores.shape[1];
  if (p.hkv < 1) throw Error("scores.shape[1] (Hkv)", str(p.hkv), "must be >= 1");
  fill_sequences(p, seqs, scores.shape[0], chk);
  if (scores.shape[2] < p.n_slc_max)
    throw Error("scores.shape[2]", str(scores.shape[2]), "must be >= ceil(max_seqlen / l') = " + str(p.n_slc_max));
  chk.tensor("indices", indices, "[T, Hkv, n]", {p.T, p.hkv, cfg.n_selected}, DType::i32);
  check_workspace(*ops, p, Op::select_topn, detail::problem_of(p), ws);
  require_op(*ops, ops->select_topn, "select_topn")(p, scores, indices, ws);
}

void selected_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                            const TensorView& k, const TensorView& v, const TensorView& indices,
                            const Sequences& seqs, const TensorView& o, const TensorView& lse,
                            Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_qkv(ctx, cfg, q, k, v, seqs, ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.tensor("indices", indices, "[T, Hkv, n]", {p.T, p.hkv, cfg.n_selected}, DType::i32);
  chk.floats("o", o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[T, Hq]", {p.T, p.hq}, DType::f32);
  check_workspace(*ops, p, Op::selected_attention_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->selected_attention_fwd, "selected_attention_fwd")(p, q, k, v, indices, o, lse, ws);
}

void window_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                          const TensorView& k, const TensorView& v, const Sequences& seqs,
                          const TensorView& o, const TensorView& lse, Workspace ws) {
  const BackendOps* ops;
  const Plan p = plan_qkv(ctx, cfg, q, k, v, seqs, ops);
  run_qkv_fwd(p, *ops, Op::window_attention_fwd, ops->window_attention_fwd, "window_attention_fwd", q, k, v, o, lse, ws);
}

void forward(const Context& ctx, const Config& cfg, const Inputs& call_in, const ForwardOutputs& out,
             Workspace ws) {
  const BackendOps* ops;
  const Inputs in = normalised(call_in);
  Plan p = plan_layer(ctx, cfg, in, ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  check_saved(p, chk, out, /*need_o=*/true);
  check_workspace(*ops, p, Op::forward, detail::problem_of(p), ws);
  require_op(*ops, ops->forward, "forward")(p, in, out, ws);
}

void backward(const Context& ctx, const Config& cfg, const Inputs& call_in, const ForwardOutputs& saved,
              const TensorView& d_o, const Gradients& grads, Workspace ws) {
  const BackendOps* ops;
  const Inputs in = normalised(call_in);
  Plan p = plan_layer(ctx, cfg, in, ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  const int64_t Tq = p.query_rows();
  check_saved(p, chk, saved, /*need_o=*/false);
  chk.floats("d_o", d_o, qdims(p, "[Tq, Hq, Dv]", "[T, Hq, Dv]"), {Tq, p.hq, p.dv});
  chk.floats("dq", grads.dq, qdims(p, "[Tq, Hq, Dqk]", "[T, Hq, Dqk]"), {Tq, p.hq, p.dqk});
  static const char* kNames[3][2] = {{"dk_cmp", "dv_cmp"}, {"dk_slc", "dv_slc"}, {"dk_win", "dv_win"}};
  for (int b = 0; b < 3; ++b) {
    if (cfg.shared_kv && b > 0) {
      require_absent(kNames[b][0], grads.dkv[b].k, "shared_kv sums every branch's gradient into dk_cmp");
      require_absent(kNames[b][1], grads.dkv[b].v, "shared_kv sums every branch's gradient into dv_cmp");
    } else {
      chk.floats(kNames[b][0], grads.dkv[b].k, "[T, Hkv, Dqk]", {p.T, p.hkv, p.dqk});
      chk.floats(kNames[b][1], grads.dkv[b].v, "[T, Hkv, Dv]", {p.T, p.hkv, p.dv});
    }
  }
  chk.floats("dg", grads.dg, qdims(p, "[Tq, Hq, 3]", "[T, Hq, 3]"), {Tq, p.hq, 3});
  check_phi(cfg, chk, "dphi_k", grads.dphi_k, p.dqk);
  check_phi(cfg, chk, "dphi_v", grads.dphi_v, p.dv);
  if (cfg.phi == PhiKind::mlp) {
    if (grads.dphi_k.w1.shape[0] != p.phi_hidden_k)
      throw Error("dphi_k.w1.shape[0]", str(grads.dphi_k.w1.shape[0]), "must equal phi_k.w1.shape[0] = " + str(p.phi_hidden_k));
    if (grads.dphi_v.w1.shape[0] != p.phi_hidden_v)
      throw Error("dphi_v.w1.shape[0]", str(grads.dphi_v.w1.shape[0]), "must equal phi_v.w1.shape[0] = " + str(p.phi_hidden_v));
  }
  check_workspace(*ops, p, Op::backward, detail::problem_of(p), ws);
  require_op(*ops, ops->backward, "backward")(p, in, saved, d_o, grads, ws);
}

namespace {
Plan plan_dense(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                const TensorView& v, const Sequences& seqs, const BackendOps*& ops) {
  Config cfg;  // only the scale matters for dense attention
  if (!(scale >= 0.0 && scale <= kMaxScale))
    throw Error("scale", std::to_string(scale), "must be in (0, 3.4e38] (fp32's range), or 0 for 1/sqrt(Dqk)");
  cfg.scale = scale;
  return plan_qkv(ctx, cfg, q, k, v, seqs, ops);
}
}  // namespace

void dense_attention_fwd(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Sequences& seqs, const TensorView& o,
                         const TensorView& lse, Workspace ws) {
  const BackendOps* ops;
  const Plan p = plan_dense(ctx, scale, q, k, v, seqs, ops);
  run_qkv_fwd(p, *ops, Op::dense_attention_fwd, ops->dense_attention_fwd, "dense_attention_fwd", q, k, v, o, lse, ws);
}

void dense_attention_bwd(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Sequences& seqs, const TensorView& o,
                         const TensorView& lse, const TensorView& d_o, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_dense(ctx, scale, q, k, v, seqs, ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("o", o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  chk.tensor("lse", lse, "[T, Hq]", {p.T, p.hq}, DType::f32);
  chk.floats("d_o", d_o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  chk.floats("dq", dq, "[T, Hq, Dqk]", {p.T, p.hq, p.dqk});
  chk.floats("dk", dk, "[T, Hkv, Dqk]", {p.T, p.hkv, p.dqk});
  chk.floats("dv", dv, "[T, Hkv, Dv]", {p.T, p.hkv, p.dv});
  check_workspace(*ops, p, Op::dense_attention_bwd, detail::problem_of(p), ws);
  require_op(*ops, ops->dense_attention_bwd, "dense_attention_bwd")(p, q, k, v, o, lse, d_o, dq, dk, dv, ws);
}

namespace {
// The bytes [first, last + 1) a view's elements span (none when it has no element).
struct ByteRange {
  uintptr_t first = 0, end = 0;
};
ByteRange byte_range(const TensorView& t) {
  if (t.numel() == 0) return {};
  int64_t last = 0;  // element offset of the last element (strides are >= 0, checked)
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride[d];
  const auto first = reinterpret_cast<uintptr_t>(t.data);
  return {first, first + static_cast<uintptr_t>(last + 1) * dtype_size(t.dtype)};
}
}  // namespace

void rotary(const Context& ctx, const TensorView& x, const TensorView& inv_freq, const Sequences& seqs,
            const TensorView& positions, const TensorView& out, bool inverse) {
  const BackendOps* ops;
  Plan p = start_plan(ctx, Config{}, x, "x", ops);  // no NSA configuration: the defaults validate
  const Checker chk(p.dtype, p.device, x.device_index);
  chk.floats("x", x, "[T, H, D]", {kAny, kAny, kAny});
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2];
  if (H < 1) throw Error("x.shape[1] (H)", str(H), "must be >= 1");
  if (D < 2 || D % 2 != 0)
    throw Error("x.shape[2] (D)", str(D), "must be even and >= 2 (channel i rotates with channel i + D/2)");
  p.hq = p.hkv = H;
  p.dqk = p.dv = D;
  chk.floats("out", out, "[T, H, D]", {T, H, D});
  // In place, or apart: a partial overlap would read elements another one has already written.
  const ByteRange xr = byte_range(x), orr = byte_range(out);
  bool same = out.data == x.data;
  for (int d = 0; d < 3; ++d) same = same && out.stride[d] == x.stride[d];
  if (!same && xr.first < orr.end && orr.first < xr.end)
    throw Error("out", "a view overlapping x", "must be x itself (same data and strides: in place) or share no "
                                               "memory with x");
  chk.tensor("inv_freq", inv_freq, "[D/2]", {D / 2}, DType::f32);
  if (positions.defined()) {
    chk.tensor("positions", positions, "[T]", {T}, DType::i32);
    if (positions.device == Device::cpu) {  // device positions are the caller's contract (no sync)
      const auto* pos = static_cast<const int32_t*>(positions.data);
      for (int64_t t = 0; t < T; ++t)
        if (pos[t * positions.stride[0]] < 0)
          throw Error("positions[" + str(t) + "]", str(pos[t * positions.stride[0]]), "must be >= 0");
    }
  }
  // The longest sequence sizes nothing here: with device offsets and no bound given, T bounds it
  // (and 1 when T = 0, since 0 means "not given").
  Sequences s = seqs;
  if (s.cu_seqlens.defined() && s.cu_seqlens.device == Device::cuda && s.max_seqlen == 0)
    s.max_seqlen = std::max<int64_t>(T, 1);
  fill_sequences(p, s, T, chk);
  const auto run = require_op(*ops, ops->rotary, "rotary");
  if (T > 0) run(p, x, inv_freq, positions, out, inverse);
}

}  // namespace nsa
