// What the API layer hands to a backend after validating a call: the resolved backend, the
// configuration, the sizes, and (for host tensors) the sequence table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nsa/api.h"
#include "nsa/cache.h"

namespace nsa::detail {

struct Plan {
  Context ctx;              // backend resolved (never automatic)
  Config cfg;               // validated
  double scale = 0.0;       // resolved softmax scale
  int64_t T = 0;            // total packed tokens
  int64_t B = 1;            // sequences
  int64_t max_seqlen = 0;   // max_b T_b
  int64_t hq = 0, hkv = 0, group = 1;  // G = hq / hkv
  int64_t dqk = 0, dv = 0;
  int64_t phi_hidden_k = 0, phi_hidden_v = 0;  // F of phi_k / phi_v (mlp)
  int64_t n_slc_max = 0;    // ceil(max_seqlen / l'): width of a scores tensor
  DType dtype = DType::f32;
  Device device = Device::cpu;
  // Token offsets of the sequences, B+1 entries, when cu_seqlens is host memory or absent.
  std::vector<int64_t> cu;
  // The caller's cu_seqlens (absent for one sequence); device backends read it on the device.
  TensorView cu_seqlens;

  // Decoding (nsa/cache.h). T and cu then count the call's new rows (appended tokens or queries),
  // B the sequences of the page table, max_seqlen the bound on their lengths.
  int64_t page_size = 0;      // tokens per page
  int64_t num_pages = 0;      // pages in the pools
  int64_t max_query_len = 0;  // most new rows of one sequence (declared or derived)
  std::vector<int64_t> lens;  // seq_lens[b] when the page table is host memory (else empty)

  // The query packing of a layer call (Inputs::seqs_q), host offsets [B+1]; empty without one (the
  // queries are then every position of the keys' sequences). Sequence b's queries are its last
  // q_len(b) positions, q_first(b) .. seq_len(b) - 1, and position t of it is query row
  // q_row0(b) + t. Tq: the query rows of the call (T without a query packing).
  std::vector<int64_t> cu_q;
  int64_t Tq = 0;

  int64_t seq_start(int64_t b) const { return cu[static_cast<size_t>(b)]; }
  int64_t seq_len(int64_t b) const { return cu[static_cast<size_t>(b) + 1] - cu[static_cast<size_t>(b)]; }
  bool has_query_packing() const { return !cu_q.empty(); }
  int64_t query_rows() const { return cu_q.empty() ? T : Tq; }
  int64_t q_len(int64_t b) const {
    return cu_q.empty() ? seq_len(b) : cu_q[static_cast<size_t>(b) + 1] - cu_q[static_cast<size_t>(b)];
  }
  int64_t q_first(int64_t b) const { return seq_len(b) - q_len(b); }
  // The query row position 0 would have (below the sequence's first query row when q_first(b) > 0).
  int64_t q_row0(int64_t b) const { return (cu_q.empty() ? seq_start(b) : cu_q[static_cast<size_t>(b)]) - q_first(b); }
};

// The operations of one backend. A backend that lacks one leaves it null; calling it then is an
// nsa::Error naming the backend and the operation (never a silent fallback).
struct BackendOps {
  const char* name;
  // ctx is resolved (never automatic); num_threads sizes the CPU backends' per-thread scratch.
  size_t (*workspace_size)(const Context& ctx, Op op, const Config& cfg, const Problem& problem);
  void (*compress_fwd)(const Plan&, const PhiParams& phi, const TensorView& x, const TensorView& xc,
                       Workspace ws);
  void (*compress_bwd)(const Plan&, const PhiParams& phi, const TensorView& x,
                       const TensorView& dxc, const TensorView& dx, const PhiParams& dphi,
                       Workspace ws);
  void (*compressed_attention_fwd)(const Plan&, const TensorView& q, const TensorView& kc,
                                   const TensorView& vc, const TensorView& o,
                                   const TensorView& lse, const TensorView& scores, Workspace ws);
  void (*select_topn)(const Plan&, const TensorView& scores, const TensorView& indices,
                      Workspace ws);
  void (*selected_attention_fwd)(const Plan&, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& indices,
                                 const TensorView& o, const TensorView& lse, Workspace ws);
  void (*window_attention_fwd)(const Plan&, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& o, const TensorView& lse,
                               Workspace ws);
  void (*forward)(const Plan&, const Inputs& in, const ForwardOutputs& out, Workspace ws);
  void (*backward)(const Plan&, const Inputs& in, const ForwardOutputs& saved,
                   const TensorView& d_o, const Gradients& grads, Workspace ws);
  void (*dense_attention_fwd)(const Plan&, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Workspace ws);
  void (*dense_attention_bwd)(const Plan&, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              const TensorView& d_o, const TensorView& dq, const TensorView& dk,
                              const TensorView& dv, Workspace ws);
  // Decoding (nsa/cache.h); the plan's page fields are set.
  void (*cache_append)(const Plan&, const PagedCache& cache, const CacheAppend& in, Workspace ws);
  void (*decode)(const Plan&, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out,
                 Workspace ws);
  void (*dense_decode)(const Plan&, const KV& pages, const PageTable& table, const TensorView& q,
                       const TensorView& o, const TensorView& lse, Workspace ws);
  // Rotary embeddings (api.h rotary): T, B and the sequences are set; positions may be absent.
  void (*rotary)(const Plan&, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
                 const TensorView& out, bool inverse);
};

// Each backend defines its table; a backend that is not compiled in returns nullptr.
const BackendOps* reference_backend();
const BackendOps* cpu_backend();
const BackendOps* cuda_backend();
// True when the CUDA backend is compiled in and a device is visible.
bool cuda_device_present();

// Helpers shared by backends.
inline const KV& branch_kv(const Config& cfg, const Inputs& in, int branch) {
  return cfg.shared_kv ? in.kv[kCmp] : in.kv[branch];
}
// The Problem a plan describes (what workspace_size is asked with for its call).
inline Problem problem_of(const Plan& p) {
  Problem pr;
  pr.total_tokens = p.T;
  pr.batch = p.B;
  pr.max_seqlen = p.max_seqlen;
  pr.hq = p.hq;
  pr.hkv = p.hkv;
  pr.dqk = p.dqk;
  pr.dv = p.dv;
  pr.phi_hidden = p.phi_hidden_k > p.phi_hidden_v ? p.phi_hidden_k : p.phi_hidden_v;
  pr.max_query_len = p.max_query_len;
  pr.dtype = p.dtype;
  pr.device = p.device;
  return pr;
}

}  // namespace nsa::detail
