// Argument validation shared by the API layer's entry points (see validate.h).
#include "common/validate.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "nsa/blocks.h"

namespace nsa::detail {

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

std::vector<int64_t> read_host_offsets(const TensorView& cu, const std::string& name, int64_t total,
                                       const char* total_what, int64_t& longest) {
  const auto* c = static_cast<const int32_t*>(cu.data);
  std::vector<int64_t> out(static_cast<size_t>(cu.shape[0]));
  longest = 0;
  for (size_t b = 0; b < out.size(); ++b) {
    const int64_t v = c[static_cast<int64_t>(b) * cu.stride[0]];
    if (b == 0 && v != 0) throw Error(name + "[0]", str(v), "must be 0");
    if (b > 0 && v < out[b - 1])
      throw Error(name + "[" + str(int64_t(b)) + "]", str(v),
                  "must be >= " + name + "[" + str(int64_t(b) - 1) + "] = " + str(out[b - 1]));
    out[b] = v;
    if (b > 0) longest = std::max(longest, v - out[b - 1]);
  }
  if (out.back() != total)
    throw Error(name + "[" + str(int64_t(out.size()) - 1) + "]", str(out.back()),
                "must equal " + std::string(total_what) + " = " + str(total));
  return out;
}

// Reads/validates the sequence table. T is the number of packed tokens of the call.
void fill_sequences(Plan& p, const Sequences& seqs, int64_t T, const Checker& chk) {
  p.T = T;
  p.cu_seqlens = seqs.cu_seqlens;
  if (seqs.max_seqlen < 0) throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be >= 0 (0: derive it)");
  if (seqs.max_seqlen > kMaxLength)
    throw Error("seqs.max_seqlen", str(seqs.max_seqlen), "must be <= 2^31 - 1 = " + str(kMaxLength));
  if (T > kMaxLength) throw Error("T (packed tokens)", str(T), "must be <= 2^31 - 1 = " + str(kMaxLength));
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
      int64_t longest = 0;
      p.cu = read_host_offsets(cu, "cu_seqlens", T, "the number of packed tokens T", longest);
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
  // No sequence is longer than the packed tokens: a declared bound above T sizes nothing past T
  // (scores widths, workspaces, launch grids follow the tensors, not the declaration).
  p.max_seqlen = std::min(p.max_seqlen, T);
  p.n_slc_max = num_slc_blocks(p.max_seqlen, p.cfg.slc_block_len);
}

void fill_query_sequences(Plan& p, const Sequences& seqs_q, int64_t Tq, const Checker& chk) {
  p.Tq = Tq;
  p.cu_q.clear();
  if (seqs_q.max_seqlen < 0)
    throw Error("seqs_q.max_seqlen", str(seqs_q.max_seqlen), "must be >= 0 (0: derive it)");
  const TensorView& cu = seqs_q.cu_seqlens;
  if (!cu.defined()) {
    if (seqs_q.max_seqlen != 0)
      throw Error("seqs_q.max_seqlen", str(seqs_q.max_seqlen),
                  "must be 0 without seqs_q.cu_seqlens (no query packing: the queries are every position)");
    if (Tq != p.T)
      throw Error("q.shape[0]", str(Tq),
                  "must equal the keys' rows T = " + str(p.T) + " without a query packing (seqs_q.cu_seqlens)");
    return;
  }
  chk.tensor("cu_seqlens_q", cu, "[B+1]", {p.B + 1}, DType::i32);
  if (cu.device != Device::cpu)  // the cuda backend rejects a query packing before this (api.cpp)
    throw Error("cu_seqlens_q.device", where(cu.device, cu.device_index), "must be cpu");
  int64_t longest = 0;
  std::vector<int64_t> cu_q = read_host_offsets(cu, "cu_seqlens_q", Tq, "the number of query rows Tq", longest);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t tq = cu_q[static_cast<size_t>(b) + 1] - cu_q[static_cast<size_t>(b)];
    if (tq > p.seq_len(b))
      throw Error("cu_seqlens_q[" + str(b + 1) + "] - cu_seqlens_q[" + str(b) + "]", str(tq),
                  "must be <= sequence " + str(b) + "'s keys, cu_seqlens[" + str(b + 1) + "] - cu_seqlens[" +
                      str(b) + "] = " + str(p.seq_len(b)) + " (the queries are the last positions of their sequence)");
  }
  if (seqs_q.max_seqlen != 0 && seqs_q.max_seqlen < longest)
    throw Error("seqs_q.max_seqlen", str(seqs_q.max_seqlen), "must be >= the most queries of a sequence, " + str(longest));
  p.cu_q = std::move(cu_q);
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

int64_t mul_sat(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}

Problem checked_problem(Op op, const Config& call_cfg, const Problem& problem) {
  if (static_cast<int32_t>(op) < static_cast<int32_t>(Op::compress_fwd) ||
      static_cast<int32_t>(op) > static_cast<int32_t>(Op::dense_decode))
    throw Error("op", str(static_cast<int32_t>(op)), "must be an nsa::Op");
  Problem pr = problem;
  const std::pair<const char*, int64_t> fields[] = {
      {"problem.total_tokens", pr.total_tokens}, {"problem.batch", pr.batch}, {"problem.max_seqlen", pr.max_seqlen},
      {"problem.hq", pr.hq}, {"problem.hkv", pr.hkv}, {"problem.dqk", pr.dqk}, {"problem.dv", pr.dv},
      {"problem.phi_hidden", pr.phi_hidden}, {"problem.max_query_len", pr.max_query_len}};
  for (const auto& [name, value] : fields)
    if (value < 0 || value > kMaxLength)
      throw Error(name, str(value), "must be in [0, 2^31 - 1] (kMaxLength)");
  const bool decoding = op == Op::cache_append || op == Op::decode || op == Op::dense_decode;
  const bool dense = op == Op::dense_attention_fwd || op == Op::dense_attention_bwd || op == Op::dense_decode;
  const Config cfg = dense ? Config{} : call_cfg;  // dense attention has no NSA configuration
  // Prefill: no sequence is longer than the packed tokens (fill_sequences bounds a call so).
  if (!decoding) pr.max_seqlen = std::min(pr.max_seqlen, pr.total_tokens);
  // Rows a backend may lay out per tensor: the tokens, one partial chunk per sequence, and (decoding)
  // each sequence's new rows plus a compressed block's worth of cached tokens.
  const int64_t rows = decoding ? mul_sat(pr.batch + 1, pr.max_query_len + cfg.cmp_block_len) + pr.total_tokens
                                : pr.total_tokens + pr.batch + 1;
  const int64_t heads = std::max({pr.hq, pr.hkv, int64_t{1}}), dim = std::max({pr.dqk, pr.dv, int64_t{1}});
  const int64_t width = std::max({dim, pr.phi_hidden, cfg.n_selected});
  const std::pair<const char*, int64_t> tensors[] = {
      {"rows x heads x max(Dqk, Dv, F, n)", mul_sat(mul_sat(rows, heads), width)},
      {"phi's w1 [max(F, D), l * D]", mul_sat(mul_sat(std::max(pr.phi_hidden, dim), cfg.cmp_block_len), dim)},
      {"heads x max_seqlen", mul_sat(heads, std::max<int64_t>(pr.max_seqlen, 1))},
      {"batch x max_seqlen", decoding ? mul_sat(pr.batch, pr.max_seqlen) : 0},
  };
  for (const auto& [what, elements] : tensors)
    if (elements > kMaxElements)
      throw Error("problem", std::string(what) + " = " + (elements == std::numeric_limits<int64_t>::max()
                                                               ? std::string("more than 2^63") : str(elements)),
                  "must be at most 2^48 elements (kMaxElements): no tensor of the call can be larger");
  return pr;
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

}  // namespace nsa::detail
