// The CPU backend's operations (BackendOps entries) and the helpers they share.
#pragma once

#include <exception>
#include <mutex>
#include <vector>

#include "cpu/attention.h"
#include "cpu/common.h"

namespace nsa::cpu {

// Runs fn(seq, t0, nt, hk, scratch_arena) for every query tile (tile_tokens consecutive tokens of
// one sequence and one KV head) on slots.count threads. Tiles are independent (each writes its
// own rows), so dynamic scheduling changes nothing in the results; the heaviest tiles (the
// latest tokens, which see the most keys) start first.
template <typename Fn>
void for_each_tile(const Plan& p, int64_t tile_tokens, int64_t hkv, const Slots& slots, Fn fn) {
  std::vector<int64_t> first(static_cast<size_t>(p.B) + 1, 0);  // first tile id of each sequence
  for (int64_t b = 0; b < p.B; ++b)
    first[static_cast<size_t>(b) + 1] =
        first[static_cast<size_t>(b)] + (p.seq_len(b) + tile_tokens - 1) / tile_tokens * hkv;
  const int64_t total = first.back();
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(slots.count)
  {
    Arena arena = slots.slot(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (int64_t id = 0; id < total; ++id) {
      try {
        const int64_t b = std::upper_bound(first.begin(), first.end(), id) - first.begin() - 1;
        const int64_t local = id - first[static_cast<size_t>(b)];
        const int64_t ntiles = (p.seq_len(b) + tile_tokens - 1) / tile_tokens;
        const int64_t tile = ntiles - 1 - local / hkv;
        const int64_t hk = local % hkv;
        const Seq s{p.seq_start(b), p.seq_len(b)};
        const int64_t t0 = tile * tile_tokens;
        fn(s, t0, std::min(tile_tokens, s.len - t0), hk, arena);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// Runs fn(i, arena) for i in [0, count) in parallel (static schedule), errors rethrown.
template <typename Fn>
void parallel_for(int64_t count, const Slots& slots, Fn fn) {
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(slots.count)
  {
    Arena arena = slots.slot(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      try {
        fn(i, arena);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

inline Dims dims_of(const Plan& p) {
  return make_dims(p.cfg, p.group, p.dqk, p.dv, p.scale, p.max_seqlen);
}

// Bytes of one slot of the attention engine.
inline size_t attention_slot_bytes(const Config& cfg, const Dims& d) {
  Sizer s;
  layout_scratch(s, d, cfg.n_selected);
  return s.bytes;
}

// Tokens t0 .. t0+nt-1 into a token list.
inline void fill_tokens(int32_t* tokens, int64_t t0, int64_t nt) {
  for (int64_t i = 0; i < nt; ++i) tokens[i] = static_cast<int32_t>(t0 + i);
}

// BackendOps entries.
void compress_fwd(const Plan&, const PhiParams& phi, const TensorView& x, const TensorView& xc, Workspace ws);
void compress_bwd(const Plan&, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace ws);
void compressed_attention_fwd(const Plan&, const TensorView& q, const TensorView& kc, const TensorView& vc,
                              const TensorView& o, const TensorView& lse, const TensorView& scores, Workspace ws);
void select_topn(const Plan&, const TensorView& scores, const TensorView& indices, Workspace ws);
void selected_attention_fwd(const Plan&, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& indices, const TensorView& o, const TensorView& lse, Workspace ws);
void window_attention_fwd(const Plan&, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o, const TensorView& lse, Workspace ws);
void forward(const Plan&, const Inputs& in, const ForwardOutputs& out, Workspace ws);
void backward(const Plan&, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
              const Gradients& grads, Workspace ws);
void dense_attention_fwd(const Plan&, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse, Workspace ws);
void dense_attention_bwd(const Plan&, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse, const TensorView& d_o,
                         const TensorView& dq, const TensorView& dk, const TensorView& dv, Workspace ws);

// Workspace sizes of each op: shared bytes and bytes per thread.
struct WsSizes {
  size_t shared = 0, slot = 0;
};
WsSizes forward_sizes(Op op, const Config& cfg, const Problem& pr);
WsSizes backward_sizes(Op op, const Config& cfg, const Problem& pr);

}  // namespace nsa::cpu
