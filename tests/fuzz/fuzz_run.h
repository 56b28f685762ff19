// The API fuzzer: running one call of a case (its workspace, the outcome against the case's
// expectation) and the mutation step every operation shares; the operations' case functions.
#pragma once

#include "fuzz/fuzz_support.h"

namespace nsa::fuzz {

// ---- Running a call ----------------------------------------------------------------------------

inline const Case* g_current = nullptr;

// The text the crash handler and the watchdog print: the case, its mutation and expectation.
inline void note_case() {
  if (g_current == nullptr) return;
  std::snprintf(g_case_text, sizeof g_case_text, "%s | mutation: %s | expected: %s", g_current->text.c_str(),
                g_current->mutation.c_str(), g_current->expect.empty() ? "success" : g_current->expect.c_str());
}

struct Outcome {
  bool ok = false;
  std::string parameter, message;
};

template <typename Fn>
inline Outcome attempt(Fn&& fn) {
  Outcome o;
  note_case();
  try {
    fn();
    o.ok = true;
  } catch (const Error& e) {
    o.parameter = e.parameter();
    o.message = e.what();
    if (o.parameter.empty() || e.allowed().empty() || o.message.find(o.parameter) == std::string::npos)
      throw Defect{"an nsa::Error without a parameter, an allowed range, or not naming its parameter: " + o.message};
  } catch (const Defect&) {
    throw;
  } catch (const std::exception& e) {
    throw Defect{std::string("an exception other than nsa::Error: ") + e.what()};
  }
  return o;
}

// Checks an outcome against the case's expectation; returns whether the results are to be compared.
inline bool settle(const Case& c, const Outcome& o) {
  if (c.expect.empty()) {
    if (!o.ok) throw Defect{"a valid call was rejected: " + o.message};
    return true;
  }
  if (o.ok) throw Defect{"an invalid call was accepted (expected an error naming " + c.expect + ")"};
  if (o.parameter != c.expect) throw Defect{"the error names " + o.parameter + ", expected " + c.expect + ": " + o.message};
  return false;
}

// A workspace of `bytes` for the case (none for 0).
struct CaseWorkspace {
  std::unique_ptr<OwnedWorkspace> owned;
  Workspace ws;
  size_t need = 0;
};
inline CaseWorkspace case_workspace(const Context& ctx, nsa::Op op, const Config& cfg, const Problem& pr) {
  CaseWorkspace w;
  w.need = workspace_size(ctx, op, cfg, pr);
  if (w.need > kMaxCaseWorkspace)
    throw Defect{"workspace_size asks " + std::to_string(w.need) + " bytes for a problem of " +
                 std::to_string(pr.total_tokens) + " tokens"};
  w.owned = std::make_unique<OwnedWorkspace>(w.need);
  w.ws = w.owned->ws;
  // Nothing may rely on the workspace's contents: it arrives full of arbitrary bytes (as from
  // numpy.empty), not zeros or a uniform pattern whose lists all look empty.
  std::mt19937_64 garbage(w.need);
  for (size_t i = 0; i + 8 <= w.owned->bytes.size(); i += 8) {
    const uint64_t x = garbage();
    std::memcpy(w.owned->bytes.data() + i, &x, 8);
  }
  return w;
}


inline HostTensor awkward_indices(Rng& r, const LayerProblem& p, const Config& cfg) {
  const int64_t n = cfg.n_selected, H = p.sizes.hkv;
  HostTensor idx(DType::i32, {p.T, H, n});
  int64_t s0 = 0;
  for (int32_t len : p.sizes.seqlens) {
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t Jt = t / cfg.slc_block_len, row = ((s0 + t) * H + h) * n;
        for (int64_t k = 0; k < n; ++k) {
          int64_t v;
          switch (r.range(0, 7)) {
            case 0: v = -1; break;
            case 1: v = r.pick<int64_t>({-2, kI32Min}); break;
            case 2: v = k > 0 ? static_cast<int64_t>(idx.get(row + r.range(0, k - 1))) : 0; break;  // a repeat
            case 3: v = Jt + r.range(1, 3); break;                                                  // past the query
            case 4: v = r.pick<int64_t>({kI32Max, kI32Max - 1, (len + cfg.slc_block_len - 1) / cfg.slc_block_len}); break;
            default: v = r.range(0, Jt); break;
          }
          idx.set(row + k, static_cast<double>(std::clamp<int64_t>(v, kI32Min, kI32Max)));
        }
      }
    s0 += len;
  }
  return idx;
}


struct Target {
  Context ctx;
  Config cfg;
  std::vector<Arg> args;       // mutable arguments (none defines others in what is mutated)
  std::vector<Arg> outputs;    // the same for outputs
  HostTensor* cu = nullptr;    // host cu_seqlens storage (prefill)
  Sequences* seqs = nullptr;
  int64_t T = 0, longest = 0;
  std::string main_name = "q";
  TensorView* main = nullptr;
  bool dense_only = false;     // no configuration but the scale
};

// The sequence-length bound a prefill call works with: the declared max_seqlen, at most T (no
// sequence is longer than the packed tokens), or the longest sequence.
inline int64_t bound_of(const Target& t) {
  return t.seqs && t.seqs->max_seqlen > 0 ? std::min(t.seqs->max_seqlen, t.T) : t.longest;
}

// Chooses and applies the case's mutation (or none).
inline void choose_mutation(Rng& r, Case& c, Target& t, DType dtype) {
  const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
  Mutation m{"none", ""};
  if (u < 0.40) {
    // Valid: optionally a declared max_seqlen above the longest sequence (up to 2^31 - 1).
    if (t.seqs && r.chance(0.25)) {
      t.seqs->max_seqlen = r.pick<int64_t>({t.longest, t.longest + 1, t.longest + 1000, kMaxLength});
      m = {"max_seqlen = " + i64(t.seqs->max_seqlen), ""};
    }
  } else if (u < 0.58) {
    m = mutate_config(r, t.cfg, t.dense_only);
  } else if (u < 0.80) {
    std::vector<Arg*> pool;
    for (Arg& a : t.args) pool.push_back(&a);
    for (Arg& a : t.outputs) pool.push_back(&a);
    if (!pool.empty()) m = mutate_arg(r, *r.pick(pool), dtype);
  } else if (u < 0.92) {
    if (t.seqs && t.cu) m = mutate_sequences(r, *t.cu, *t.seqs, t.T, t.longest);
  } else {
    // The main tensor (absent, not a float, of another rank) or the thread count.
    switch (r.range(0, 3)) {
      case 0:
        *t.main = TensorView();
        m = {t.main_name + " absent", t.main_name};
        break;
      case 1:
        t.main->dtype = DType::i32;
        m = {t.main_name + ".dtype = i32", t.main_name + ".dtype"};
        break;
      case 2:
        t.main->ndim = 2;
        m = {t.main_name + ".ndim = 2", t.main_name + ".ndim"};
        break;
      case 3:
        t.ctx.num_threads = -1;
        m = {"ctx.num_threads = -1", "ctx.num_threads"};
        break;
    }
  }
  c.mutation = m.text;
  c.expect = m.expect;
}

// The Problem a stage call is sized by (its tensors' sizes).
inline Problem stage_problem(const Draw& d, int64_t T, int64_t hq, int64_t hkv, int64_t dqk, int64_t dv, int64_t F,
                      const Sequences& seqs) {
  Problem p;
  p.total_tokens = T;
  p.batch = static_cast<int64_t>(d.sizes.seqlens.size());
  p.max_seqlen = seqs.max_seqlen ? seqs.max_seqlen : longest(d.sizes);
  if (!seqs.cu_seqlens.defined() && !seqs.max_seqlen) p.max_seqlen = T;
  p.hq = hq;
  p.hkv = hkv;
  p.dqk = dqk;
  p.dv = dv;
  p.phi_hidden = F;
  p.dtype = d.sizes.dtype;
  p.device = Device::cpu;
  return p;
}

// Runs the call: the workspace from the (possibly mutated) problem; when sizing fails with a named
// error, the call still runs with a generous workspace and must fail the same way.
template <typename Call>
inline Outcome run_call(Rng& r, Case& c, Target& t, nsa::Op op, const Problem& pr, bool mutate_ctx, Call&& call) {
  CaseWorkspace w;
  Outcome sizing = attempt([&] { w = case_workspace(t.ctx, op, t.cfg, pr); });
  if (!sizing.ok) {
    w.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20);
    w.ws = w.owned->ws;
  }
  if (mutate_ctx && c.expect.empty() && r.chance(0.2)) {
    const Mutation m = mutate_context(r, t.ctx, w.ws, w.need, t.main_name, t.main ? t.main->dtype : DType::f32);
    c.mutation = m.text;
    c.expect = m.expect;
  }
  Outcome o = attempt([&] { call(w.ws); });
  if (!sizing.ok && o.ok) throw Defect{"workspace_size failed (" + sizing.message + ") but the call succeeded"};
  return o;
}


// One case of each kind (fuzz_layer.cpp, fuzz_stages.cpp, fuzz_decode.cpp).
void case_forward(Rng& r, Case& c, Draw& d, bool backward_too);
void case_stage(Rng& r, Case& c, Draw& d);
void case_decode(Rng& r, Case& c, Draw& d);
void case_workspace_sizes(Rng& r, Case& c, Draw& d);

}  // namespace nsa::fuzz
