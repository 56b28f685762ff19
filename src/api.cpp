// The API layer: checks every argument, resolves the backend, fills a Plan and calls down.
// Nothing below this file validates user input again; everything here fails with nsa::Error.
#include "nsa/api.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/plan.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa {

using detail::BackendOps;
using detail::Plan;

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + str(t.shape[i]);
  return s + "]";
}

std::string where(Device d, int index) {
  return d == Device::cpu ? std::string("cpu") : "cuda:" + str(index);
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16 || t == DType::f64; }

// Expected extent of one dimension: a value, or kAny.
constexpr int64_t kAny = -1;

// Checks the properties every tensor argument shares with the call's reference tensor.
class Checker {
 public:
  Checker(DType dtype, Device device, int device_index)
      : dtype_(dtype), device_(device), device_index_(device_index) {}

  // `dims` names the dimensions for messages, e.g. "[T, Hq, Dqk]".
  void tensor(const std::string& name, const TensorView& t, const char* dims,
              std::initializer_list<int64_t> shape, DType dtype) const {
    if (!t.defined()) throw Error(name, "absent", std::string("required, shape ") + dims);
    if (t.ndim != static_cast<int>(shape.size()))
      throw Error(name + ".ndim", str(t.ndim),
                  "must be " + str(static_cast<int64_t>(shape.size())) + " (shape " + dims + ")");
    int i = 0;
    for (int64_t want : shape) {
      if (t.shape[i] < 0) throw Error(name + ".shape[" + str(i) + "]", str(t.shape[i]), "must be >= 0");
      if (want != kAny && t.shape[i] != want)
        throw Error(name + ".shape[" + str(i) + "]", str(t.shape[i]),
                    "must be " + str(want) + " (shape " + dims + ", got " + shape_str(t) + ")");
      ++i;
    }
    if (t.dtype != dtype)
      throw Error(name + ".dtype", dtype_name(t.dtype), std::string("must be ") + dtype_name(dtype));
    if (t.device != device_ || (device_ == Device::cuda && t.device_index != device_index_))
      throw Error(name + ".device", where(t.device, t.device_index),
                  "must be " + where(device_, device_index_) + " like the other tensors of the call");
    for (int d = 0; d < t.ndim; ++d)
      if (t.stride[d] < 0)
        throw Error(name + ".stride[" + str(d) + "]", str(t.stride[d]), "must be >= 0");
    if (t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1)
      throw Error(name + ".stride[" + str(t.ndim - 1) + "]", str(t.stride[t.ndim - 1]),
                  "must be 1 (the last dimension contiguous)");
    if (t.data == nullptr && t.numel() > 0)
      throw Error(name + ".data", "null", "must point to " + str(t.numel()) + " elements");
  }
  void floats(const std::string& name, const TensorView& t, const char* dims,
              std::initializer_list<int64_t> shape) const {
    tensor(name, t, dims, shape, dtype_);
  }
  void optional_floats(const std::string& name, const TensorView& t, const char* dims,
                       std::initializer_list<int64_t> shape) const {
    if (t.defined()) floats(name, t, dims, shape);
  }
  DType dtype() const { return dtype_; }

 private:
  DType dtype_;
  Device device_;
  int device_index_;
};

void require_absent(const std::string& name, const TensorView& t, const std::string& why) {
  if (t.defined()) throw Error(name, "given (shape " + shape_str(t) + ")", "must be absent: " + why);
}

const BackendOps& resolve_backend(Context& ctx, const TensorView& main, const char* main_name) {
  if (!main.defined()) throw Error(main_name, "absent", "required");
  if (!is_float(main.dtype))
    throw Error(std::string(main_name) + ".dtype", dtype_name(main.dtype), "must be f32, bf16, f16 or f64");
  if (ctx.num_threads < 0) throw Error("ctx.num_threads", str(ctx.num_threads), "must be >= 0 (0: default)");
  Backend b = ctx.backend;
  if (b == Backend::automatic) {
    if (main.device == Device::cuda) b = Backend::cuda;
    else if (main.dtype == DType::f64 || detail::cpu_backend() == nullptr) b = Backend::reference;
    else b = Backend::cpu;
  }
  if (b != Backend::reference && b != Backend::cpu && b != Backend::cuda)
    throw Error("ctx.backend", str(static_cast<int64_t>(b)), "must be automatic, reference, cpu or cuda");
  const bool host_backend = b != Backend::cuda;
  if (host_backend && main.device != Device::cpu)
    throw Error("ctx.backend", backend_name(b),
                std::string("works on host tensors, but ") + main_name + " is on cuda");
  if (!host_backend && main.device != Device::cuda)
    throw Error("ctx.backend", "cuda", std::string("needs device tensors, but ") + main_name + " is on the host");
  const BackendOps* ops = b == Backend::reference ? detail::reference_backend()
                          : b == Backend::cpu     ? detail::cpu_backend()
                                                  : detail::cuda_backend();
  if (ops == nullptr)
    throw Error("ctx.backend", backend_name(b), "is not compiled into this build of nsa");
  if (b == Backend::cuda && !detail::cuda_device_present())
    throw Error("ctx.backend", "cuda", "needs a CUDA device, and none is visible");
  if (main.dtype == DType::f64 && b != Backend::reference)
    throw Error(std::string(main_name) + ".dtype", "f64",
                std::string("is supported by the reference backend only, not ") + backend_name(b));
  ctx.backend = b;
  return *ops;
}

// Reads/validates the sequence table. T is the number of packed tokens of the call.
void fill_sequences(Plan& p, const Sequences& seqs, int64_t T, const Checker& chk) {
  p.T = T;
  p.cu_seqlens = seqs.cu_seqlens;
  if (seqs.max_seqlen < 0) throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= 0 (0: derive it)");
  const TensorView& cu = seqs.cu_seqlens;
  if (!cu.defined()) {
    p.B = 1;
    p.cu = {0, T};
    if (seqs.max_seqlen != 0 && seqs.max_seqlen < T)
      throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= the sequence length " + str(T));
    p.max_seqlen = seqs.max_seqlen ? seqs.max_seqlen : T;
  } else {
    chk.tensor("cu_seqlens", cu, "[B+1]", {kAny}, DType::i32);
    if (cu.shape[0] < 1) throw Error("cu_seqlens.shape[0]", str(cu.shape[0]), "must be >= 1 (B+1 entries)");
    p.B = cu.shape[0] - 1;
    if (cu.device == Device::cpu) {
      const auto* c = static_cast<const int32_t*>(cu.data);
      p.cu.resize(static_cast<size_t>(cu.shape[0]));
      int64_t longest = 0;
      for (int64_t b = 0; b <= p.B; ++b) {
        const int64_t v = c[b * cu.stride[0]];
        if (b == 0 && v != 0) throw Error("cu_seqlens[0]", str(v), "must be 0");
        if (b > 0 && v < p.cu[static_cast<size_t>(b - 1)])
          throw Error("cu_seqlens[" + str(b) + "]", str(v),
                      "must be >= cu_seqlens[" + str(b - 1) + "] = " + str(p.cu[static_cast<size_t>(b - 1)]));
        p.cu[static_cast<size_t>(b)] = v;
        if (b > 0) longest = std::max(longest, v - p.cu[static_cast<size_t>(b - 1)]);
      }
      if (p.cu.back() != T)
        throw Error("cu_seqlens[" + str(p.B) + "]", str(p.cu.back()),
                    "must equal the number of packed tokens T = " + str(T));
      if (seqs.max_seqlen != 0 && seqs.max_seqlen < longest)
        throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= the longest sequence, " + str(longest));
      p.max_seqlen = seqs.max_seqlen ? seqs.max_seqlen : longest;
    } else {
      if (seqs.max_seqlen == 0)
        throw Error("seqs.max_seqlen", "0",
                    "must be given (>= the longest sequence) when cu_seqlens is on the GPU");
      p.max_seqlen = seqs.max_seqlen;
    }
  }
  p.n_slc_max = num_slc_blocks(p.max_seqlen, p.cfg.slc_block_len);
}

// Shapes of phi's parameters for head dim D; returns F (0 unless mlp).
int64_t check_phi(const Config& cfg, const Checker& chk, const std::string& name, const PhiParams& phi,
                  int64_t D) {
  const int64_t l = cfg.cmp_block_len;
  const std::string kind = std::string("phi = ") + phi_kind_name(cfg.phi);
  switch (cfg.phi) {
    case PhiKind::mean:
      require_absent(name + ".w1", phi.w1, kind + " has no parameters");
      require_absent(name + ".b1", phi.b1, kind + " has no parameters");
      require_absent(name + ".w2", phi.w2, kind + " has no parameters");
      require_absent(name + ".b2", phi.b2, kind + " has no parameters");
      require_absent(name + ".pe", phi.pe, kind + " has no parameters");
      return 0;
    case PhiKind::linear:
      chk.floats(name + ".w1", phi.w1, "[D, l*D]", {D, l * D});
      chk.floats(name + ".pe", phi.pe, "[l, D]", {l, D});
      require_absent(name + ".b1", phi.b1, kind + " uses w1 and pe only");
      require_absent(name + ".w2", phi.w2, kind + " uses w1 and pe only");
      require_absent(name + ".b2", phi.b2, kind + " uses w1 and pe only");
      return 0;
    case PhiKind::mlp: {
      chk.floats(name + ".w1", phi.w1, "[F, l*D]", {kAny, l * D});
      const int64_t F = phi.w1.shape[0];
      if (F < 1) throw Error(name + ".w1.shape[0]", str(F), "must be >= 1 (the hidden width F)");
      chk.floats(name + ".b1", phi.b1, "[F]", {F});
      chk.floats(name + ".w2", phi.w2, "[D, F]", {D, F});
      chk.floats(name + ".b2", phi.b2, "[D]", {D});
      chk.floats(name + ".pe", phi.pe, "[l, D]", {l, D});
      return F;
    }
  }
  return 0;
}

// Fills head counts and dims from q and the first branch's k/v.
void fill_heads(Plan& p, const TensorView& q, const TensorView& k, const TensorView& v) {
  p.hq = q.shape[1];
  p.dqk = q.shape[2];
  p.hkv = k.shape[1];
  p.dv = v.shape[2];
  if (p.hq < 1) throw Error("q.shape[1] (Hq)", str(p.hq), "must be >= 1");
  if (p.dqk < 1) throw Error("q.shape[2] (Dqk)", str(p.dqk), "must be >= 1");
  if (p.hkv < 1) throw Error("k.shape[1] (Hkv)", str(p.hkv), "must be >= 1");
  if (p.dv < 1) throw Error("v.shape[2] (Dv)", str(p.dv), "must be >= 1");
  if (p.hq % p.hkv != 0)
    throw Error("q.shape[1] (Hq)", str(p.hq), "must be a multiple of the KV heads Hkv = " + str(p.hkv));
  p.group = p.hq / p.hkv;
  p.scale = p.cfg.softmax_scale(p.dqk);
}

Plan start_plan(const Context& ctx, const Config& cfg, const TensorView& main, const char* main_name,
                const BackendOps*& ops) {
  cfg.validate();
  Plan p;
  p.ctx = ctx;
  p.cfg = cfg;
  ops = &resolve_backend(p.ctx, main, main_name);
  p.dtype = main.dtype;
  p.device = main.device;
  return p;
}

template <typename Fn>
Fn require_op(const BackendOps& ops, Fn fn, const char* op) {
  if (fn == nullptr)
    throw Error("ctx.backend", ops.name, std::string("does not implement ") + op + " yet");
  return fn;
}

void check_workspace(const BackendOps& ops, const Plan& p, Op op, const Problem& prob, Workspace ws) {
  const size_t need = ops.workspace_size ? ops.workspace_size(p.ctx, op, p.cfg, prob) : 0;
  if (need == 0) return;
  if (ws.bytes < need)
    throw Error("workspace.bytes", std::to_string(ws.bytes),
                "must be >= " + std::to_string(need) + " for this call (ask workspace_size)");
  if (ws.data == nullptr) throw Error("workspace.data", "null", "must point to the workspace");
  if (reinterpret_cast<uintptr_t>(ws.data) % 256 != 0)
    throw Error("workspace.data", "misaligned", "must be 256-byte aligned");
}

// Everything forward() and backward() share: q, the branch K/V, g, phi, sequences.
Plan plan_layer(const Context& ctx, const Config& cfg, const Inputs& in, const BackendOps*& ops) {
  Plan p = start_plan(ctx, cfg, in.q, "q", ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  chk.floats("q", in.q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t T = in.q.shape[0];
  chk.floats("k_cmp", in.kv[kCmp].k, "[T, Hkv, Dqk]", {T, kAny, in.q.shape[2]});
  chk.floats("v_cmp", in.kv[kCmp].v, "[T, Hkv, Dv]", {T, in.kv[kCmp].k.shape[1], kAny});
  fill_heads(p, in.q, in.kv[kCmp].k, in.kv[kCmp].v);
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
  chk.floats("g", in.g, "[T, Hq, 3]", {T, p.hq, 3});
  p.phi_hidden_k = check_phi(cfg, chk, "phi_k", in.phi_k, p.dqk);
  p.phi_hidden_v = check_phi(cfg, chk, "phi_v", in.phi_v, p.dv);
  fill_sequences(p, in.seqs, T, chk);
  return p;
}

void check_saved(const Plan& p, const Checker& chk, const ForwardOutputs& out, bool need_o) {
  if (need_o) chk.floats("o", out.o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  chk.tensor("lse", out.lse, "[T, Hq, 3]", {p.T, p.hq, 3}, DType::f32);
  chk.tensor("indices", out.indices, "[T, Hkv, n]", {p.T, p.hkv, p.cfg.n_selected}, DType::i32);
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
  chk.floats("q", in.q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  chk.floats("k_cmp", in.kv[kCmp].k, "[T, Hkv, Dqk]", {in.q.shape[0], kAny, in.q.shape[2]});
  chk.floats("v_cmp", in.kv[kCmp].v, "[T, Hkv, Dv]", {in.q.shape[0], in.kv[kCmp].k.shape[1], kAny});
  fill_heads(p, in.q, in.kv[kCmp].k, in.kv[kCmp].v);
  p.phi_hidden_k = check_phi(cfg, chk, "phi_k", in.phi_k, p.dqk);
  p.phi_hidden_v = check_phi(cfg, chk, "phi_v", in.phi_v, p.dv);
  fill_sequences(p, in.seqs, in.q.shape[0], chk);
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
  return ops.workspace_size ? ops.workspace_size(c, op, cfg, problem) : 0;
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
  Plan p = start_plan(ctx, cfg, q, "q", ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("q", q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t T = q.shape[0];
  chk.floats("k", k, "[T, Hkv, Dqk]", {T, kAny, q.shape[2]});
  chk.floats("v", v, "[T, Hkv, Dv]", {T, k.shape[1], kAny});
  fill_heads(p, q, k, v);
  fill_sequences(p, seqs, T, chk);
  chk.tensor("indices", indices, "[T, Hkv, n]", {T, p.hkv, cfg.n_selected}, DType::i32);
  chk.floats("o", o, "[T, Hq, Dv]", {T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[T, Hq]", {T, p.hq}, DType::f32);
  check_workspace(*ops, p, Op::selected_attention_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->selected_attention_fwd, "selected_attention_fwd")(p, q, k, v, indices, o, lse, ws);
}

void window_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                          const TensorView& k, const TensorView& v, const Sequences& seqs,
                          const TensorView& o, const TensorView& lse, Workspace ws) {
  const BackendOps* ops;
  Plan p = start_plan(ctx, cfg, q, "q", ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("q", q, "[T, Hq, Dqk]", {kAny, kAny, kAny});
  const int64_t T = q.shape[0];
  chk.floats("k", k, "[T, Hkv, Dqk]", {T, kAny, q.shape[2]});
  chk.floats("v", v, "[T, Hkv, Dv]", {T, k.shape[1], kAny});
  fill_heads(p, q, k, v);
  fill_sequences(p, seqs, T, chk);
  chk.floats("o", o, "[T, Hq, Dv]", {T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[T, Hq]", {T, p.hq}, DType::f32);
  check_workspace(*ops, p, Op::window_attention_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->window_attention_fwd, "window_attention_fwd")(p, q, k, v, o, lse, ws);
}

void forward(const Context& ctx, const Config& cfg, const Inputs& in, const ForwardOutputs& out,
             Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_layer(ctx, cfg, in, ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  check_saved(p, chk, out, /*need_o=*/true);
  chk.optional_floats("o_branch", out.o_branch, "[3, T, Hq, Dv]", {3, p.T, p.hq, p.dv});
  check_workspace(*ops, p, Op::forward, detail::problem_of(p), ws);
  require_op(*ops, ops->forward, "forward")(p, in, out, ws);
}

void backward(const Context& ctx, const Config& cfg, const Inputs& in, const ForwardOutputs& saved,
              const TensorView& d_o, const Gradients& grads, Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_layer(ctx, cfg, in, ops);
  const Checker chk(p.dtype, p.device, in.q.device_index);
  check_saved(p, chk, saved, /*need_o=*/false);
  chk.optional_floats("o", saved.o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  chk.optional_floats("o_branch", saved.o_branch, "[3, T, Hq, Dv]", {3, p.T, p.hq, p.dv});
  chk.floats("d_o", d_o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  chk.floats("dq", grads.dq, "[T, Hq, Dqk]", {p.T, p.hq, p.dqk});
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
  chk.floats("dg", grads.dg, "[T, Hq, 3]", {p.T, p.hq, 3});
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
  if (!(scale >= 0.0) || scale > 1e300)
    throw Error("scale", std::to_string(scale), "must be a finite number > 0, or 0 for 1/sqrt(Dqk)");
  cfg.scale = scale;
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
}  // namespace

void dense_attention_fwd(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Sequences& seqs, const TensorView& o,
                         const TensorView& lse, Workspace ws) {
  const BackendOps* ops;
  Plan p = plan_dense(ctx, scale, q, k, v, seqs, ops);
  const Checker chk(p.dtype, p.device, q.device_index);
  chk.floats("o", o, "[T, Hq, Dv]", {p.T, p.hq, p.dv});
  if (lse.defined()) chk.tensor("lse", lse, "[T, Hq]", {p.T, p.hq}, DType::f32);
  check_workspace(*ops, p, Op::dense_attention_fwd, detail::problem_of(p), ws);
  require_op(*ops, ops->dense_attention_fwd, "dense_attention_fwd")(p, q, k, v, o, lse, ws);
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

}  // namespace nsa
