// The CPU backend's operations (BackendOps entries) and the helpers they share.
#pragma once

#include <exception>
#include <mutex>
#include <vector>

#include "cpu/attention.h"
#include "cpu/common.h"

namespace nsa::cpu {

// Runs fn(i, arena) for i in [0, count) in parallel (dynamic schedule), errors rethrown.
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

// Runs fn(seq, t0, nt, hk, scratch_arena) for every query tile (up to tile_tokens consecutive
// query positions of one sequence and one KV head) on slots.count threads. Tiles are aligned to
// multiples of tile_tokens of the position, so a call with a query packing tiles its queries as
// the call on every position does (except the first, partial tile). Tiles are independent (each
// writes its own rows), so dynamic scheduling changes nothing in the results; the heaviest tiles
// (the latest tokens, which see the most keys) start first.
template <typename Fn>
void for_each_tile(const Plan& p, int64_t tile_tokens, int64_t hkv, const Slots& slots, Fn fn) {
  auto tiles_of = [&](int64_t b) -> int64_t {
    const int64_t len = p.seq_len(b), first = p.q_first(b);
    return first >= len ? 0 : (len + tile_tokens - 1) / tile_tokens - first / tile_tokens;
  };
  std::vector<int64_t> first(static_cast<size_t>(p.B) + 1, 0);  // first tile id of each sequence
  for (int64_t b = 0; b < p.B; ++b)
    first[static_cast<size_t>(b) + 1] = first[static_cast<size_t>(b)] + tiles_of(b) * hkv;
  parallel_for(first.back(), slots, [&](int64_t id, Arena& arena) {
    const int64_t b = std::upper_bound(first.begin(), first.end(), id) - first.begin() - 1;
    const int64_t local = id - first[static_cast<size_t>(b)];
    const Seq s = Seq::of(p, b);
    const int64_t tile = (s.len + tile_tokens - 1) / tile_tokens - 1 - local / hkv;
    const int64_t hk = local % hkv;
    const int64_t t0 = std::max(tile * tile_tokens, s.first);
    fn(s, t0, std::min((tile + 1) * tile_tokens, s.len) - t0, hk, arena);
  });
}

// A branch of the given kind over k and v, with the plan's block sizes, window and n.
inline Branch branch_of(const Plan& p, Kind kind, const Rows& k, const Rows& v) {
  Branch br;
  br.kind = kind;
  br.k = k;
  br.v = v;
  br.l = p.cfg.cmp_block_len;
  br.d = p.cfg.cmp_stride;
  br.lp = p.cfg.slc_block_len;
  br.w = p.cfg.window;
  br.n = p.cfg.n_selected;
  return br;
}
inline Branch branch_of(const Plan& p, Kind kind, const TensorView& k, const TensorView& v) {
  return branch_of(p, kind, Rows::of(k), Rows::of(v));
}

inline Dims dims_of(const Plan& p) {
  return make_dims(p.cfg, p.group, p.dqk, p.dv, p.scale, p.max_seqlen, p.dtype);
}

// Bytes of one slot of the attention engine.
inline size_t attention_slot_bytes(const Dims& d) {
  Sizer s;
  layout_scratch(s, d);
  return s.bytes;
}

// Tokens t0 .. t0+nt-1 into a token list.
inline void fill_tokens(int32_t* tokens, int64_t t0, int64_t nt) {
  for (int64_t i = 0; i < nt; ++i) tokens[i] = static_cast<int32_t>(t0 + i);
}

// ---- Pre-packed keys/values (see Packed in attention.h) ------------------------------------

// Upper bound of the chunks of a branch's keys: token rows, or compressed rows (cmp).
inline int64_t chunk_bound(const Config& cfg, int64_t T, int64_t B, bool cmp) {
  return (cmp ? cmp_rows(T, cfg.cmp_stride) : T) / kChunk + B + 1;
}

struct PackBuffers {
  float *kt = nullptr, *kn = nullptr, *vt = nullptr, *vn = nullptr;
  uint16_t *ktb = nullptr, *knb = nullptr, *vtb = nullptr, *vnb = nullptr;  // bf16 storage (Dims::b16)
  uint16_t* ktb_lo = nullptr;  // the compressed keys (fp32): see Packed
  int64_t* chunk0 = nullptr;  // [B+1]
};

template <typename A>
PackBuffers layout_pack(A& a, const Config& cfg, int64_t T, int64_t B, int64_t hkv, const Dims& d, bool cmp,
                        unsigned need) {
  PackBuffers pb;
  const int64_t chunks = chunk_bound(cfg, T, B, cmp) * hkv;
  pb.chunk0 = a.template take<int64_t>(B + 1);
  if (need & kNeedKt) pb.kt = a.template take<float>(chunks * d.dqk * kChunk);
  if (need & kNeedKn) pb.kn = a.template take<float>(chunks * kChunk * d.dqkp);
  if (need & kNeedVt) pb.vt = a.template take<float>(chunks * d.dv * kChunk);
  if (need & kNeedVn) pb.vn = a.template take<float>(chunks * kChunk * d.dvp);
  if (d.b16) {
    if (need & kNeedKt) pb.ktb = a.template take<uint16_t>(chunks * d.dqkp * kChunk);
    if (need & kNeedKn) pb.knb = a.template take<uint16_t>(chunks * kChunk * d.dqkp);
    if (need & kNeedVt) pb.vtb = a.template take<uint16_t>(chunks * d.dvp * kChunk);
    if (need & kNeedVn) pb.vnb = a.template take<uint16_t>(chunks * kChunk * d.dvp);
    if ((need & kNeedKt) && cmp) pb.ktb_lo = a.template take<uint16_t>(chunks * d.dqkp * kChunk);
  }
  return pb;
}

// Whether a branch's keys/values are packed once per call (selection only when its blocks are
// whole chunks; otherwise they are packed per tile).
inline bool branch_packs(const Config& cfg, Kind kind) {
  switch (kind) {
    case Kind::slc: return cfg.n_selected > 0 && cfg.slc_block_len % kChunk == 0;
    case Kind::win: return cfg.window > 0;
    default: return true;
  }
}

// Shared bytes of a branch's packed keys/values in the layouts of `need` (0 if not packed).
inline size_t pack_bytes(const Config& cfg, const Problem& pr, const Dims& d, Kind kind, unsigned need) {
  if (!branch_packs(cfg, kind)) return 0;
  Sizer s;
  layout_pack(s, cfg, pr.total_tokens, pr.batch, pr.hkv, d, kind == Kind::cmp, need);
  return s.bytes;
}

// The same for the three branches of a layer call.
inline size_t layer_pack_bytes(const Config& cfg, const Problem& pr, const Dims& d, unsigned need) {
  return pack_bytes(cfg, pr, d, Kind::cmp, need) + pack_bytes(cfg, pr, d, Kind::slc, need) +
         pack_bytes(cfg, pr, d, Kind::win, need);
}

// Converts a branch's keys/values once into the layouts of `need` (carved from `shared`) and
// points br.pk at them. Every chunk is written by one work item.
inline void prepack(const Plan& p, const Dims& d, Branch& br, unsigned need, Arena& shared, const Slots& slots) {
  const bool cmp = br.kind == Kind::cmp;
  PackBuffers pb = layout_pack(shared, p.cfg, p.T, p.B, p.hkv, d, cmp, need);
  pb.chunk0[0] = 0;
  std::vector<int64_t> keys(static_cast<size_t>(p.B));
  for (int64_t b = 0; b < p.B; ++b) {
    keys[static_cast<size_t>(b)] = cmp ? num_cmp_blocks(p.seq_len(b), p.cfg.cmp_block_len, p.cfg.cmp_stride) : p.seq_len(b);
    pb.chunk0[b + 1] = pb.chunk0[b] + (keys[static_cast<size_t>(b)] + kChunk - 1) / kChunk;
  }
  const int64_t chunks = pb.chunk0[p.B];
  parallel_for(chunks * p.hkv, slots, [&](int64_t item, Arena arena) {
    float* kn = arena.take<float>(kChunk * d.dqkp);
    float* vn = arena.take<float>(kChunk * d.dvp);
    const int64_t hk = item / chunks, ci = item % chunks;
    const int64_t b = std::upper_bound(pb.chunk0, pb.chunk0 + p.B + 1, ci) - pb.chunk0 - 1;
    const Seq s{p.seq_start(b), p.seq_len(b), b};
    const int64_t k0 = (ci - pb.chunk0[b]) * kChunk;
    const Chunk c{k0, std::min(kChunk, keys[static_cast<size_t>(b)] - k0), -1};
    const int64_t row0 = key_row0(br, s);
    const int64_t at = hk * chunks + ci;
    pack_keys(br.k, row0, hk, c, kn, d.dqkp);
    pack_keys(br.v, row0, hk, c, vn, d.dvp);
    if (d.mm) {  // the bf16 layouts only
      pack_chunk_b16(d, kn, vn, pb.ktb ? pb.ktb + at * d.dqkp * kChunk : nullptr,
                     pb.knb ? pb.knb + at * kChunk * d.dqkp : nullptr, pb.vtb ? pb.vtb + at * d.dvp * kChunk : nullptr,
                     pb.vnb ? pb.vnb + at * kChunk * d.dvp : nullptr,
                     pb.ktb_lo && br.k.dtype != DType::bf16 ? pb.ktb_lo + at * d.dqkp * kChunk : nullptr);
      return;
    }
    if (pb.kt) transpose_keys(kn, d.dqkp, d.dqk, pb.kt + at * d.dqk * kChunk);
    if (pb.kn) std::copy(kn, kn + kChunk * d.dqkp, pb.kn + at * kChunk * d.dqkp);
    if (pb.vt) transpose_keys(vn, d.dvp, d.dv, pb.vt + at * d.dv * kChunk);
    if (pb.vn) std::copy(vn, vn + kChunk * d.dvp, pb.vn + at * kChunk * d.dvp);
  });
  const uint16_t* ktb_lo = br.k.dtype != DType::bf16 ? pb.ktb_lo : nullptr;
  br.pk = d.mm ? Packed{nullptr, nullptr, nullptr, nullptr, pb.ktb, pb.knb, pb.vtb, pb.vnb, ktb_lo, pb.chunk0, chunks}
               : Packed{pb.kt, pb.kn, pb.vt, pb.vn, nullptr, nullptr, nullptr, nullptr, nullptr, pb.chunk0, chunks};
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

// Decoding (decode.cpp).
void cache_append(const Plan&, const PagedCache& cache, const CacheAppend& in, Workspace ws);
void decode(const Plan&, const PagedCache& cache, const DecodeInputs& in, const ForwardOutputs& out, Workspace ws);
void dense_decode(const Plan&, const KV& pages, const PageTable& table, const TensorView& q, const TensorView& o,
                  const TensorView& lse, Workspace ws);

// Rotary embeddings (rotary.cpp): no workspace.
void rotary(const Plan&, const TensorView& x, const TensorView& inv_freq, const TensorView& positions,
            const TensorView& out, bool inverse);

// Workspace sizes of each op: shared bytes and bytes per thread.
struct WsSizes {
  size_t shared = 0, slot = 0;
};
WsSizes forward_sizes(Op op, const Config& cfg, const Problem& pr);
WsSizes backward_sizes(Op op, const Config& cfg, const Problem& pr);
WsSizes decode_sizes(Op op, const Config& cfg, const Problem& pr);

}  // namespace nsa::cpu
