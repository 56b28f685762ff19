// Index math of NSA's blocks (spec §2-§6), shared by every backend, host and device.
//
// All positions are 0-based and counted from the start of the token's own sequence.
// Symbols: l = cmp_block_len, d = cmp_stride, l' = slc_block_len, w = window.
#pragma once

#include <cstdint>

#include "nsa/config.h"

#if defined(__CUDACC__)
#define NSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NSA_HOST_DEVICE inline
#endif

namespace nsa {

// Compressed blocks of a sequence of T tokens: N_c = floor((T - l)/d) + 1 when T >= l, else 0.
// Block i covers tokens [i*d, i*d + l - 1].
NSA_HOST_DEVICE constexpr int64_t num_cmp_blocks(int64_t T, int64_t l, int64_t d) {
  return T >= l ? (T - l) / d + 1 : 0;
}

// Compressed blocks visible to query t (the whole block at or before t):
// C_t = floor((t - l + 1)/d) + 1 when t >= l - 1, else 0.
NSA_HOST_DEVICE constexpr int64_t visible_cmp_blocks(int64_t t, int64_t l, int64_t d) {
  return t >= l - 1 ? (t - l + 1) / d + 1 : 0;
}

// Selection blocks of a sequence of T tokens: N_s = ceil(T / l').
NSA_HOST_DEVICE constexpr int64_t num_slc_blocks(int64_t T, int64_t lp) { return (T + lp - 1) / lp; }

// The last selection block that has started at query t: J_t = floor(t / l').
NSA_HOST_DEVICE constexpr int64_t last_slc_block(int64_t t, int64_t lp) { return t / lp; }

// ov(i, j) of spec §3 in stride-d pieces: compressed block i covers pieces [i, i + L - 1]
// (L = l/d), selection block j pieces [j R, (j + 1) R - 1] (R = l'/d); how many they share.
template <typename Int>
NSA_HOST_DEVICE constexpr Int piece_overlap(Int i, Int j, Int L, Int R) {
  const Int lo = i > j * R ? i : j * R;
  const Int hi = i + L - 1 < (j + 1) * R - 1 ? i + L - 1 : (j + 1) * R - 1;
  return hi >= lo ? hi - lo + 1 : 0;
}

// ov(i, j) of spec §3 from the block sizes: how many stride-d pieces compressed block i shares
// with selection block j.
NSA_HOST_DEVICE constexpr int64_t cmp_slc_overlap(int64_t i, int64_t j, int64_t l, int64_t d,
                                                  int64_t lp) {
  return piece_overlap<int64_t>(i, j, l / d, lp / d);
}

// The forced blocks of spec §4 and §11 for the queries of one configuration: the n_init initial
// blocks, the n_local blocks ending at J_t and the backbone's J_t - o, clipped to [0, J_t] and
// de-duplicated.
struct ForcedBlocks {
  int64_t n_init = 0, n_local = 0;
  int64_t offsets[kMaxBackbone] = {};  // the backbone's (Config::backbone_offsets)
  int count = 0;            // how many offsets

  NSA_HOST_DEVICE bool contains(int64_t j, int64_t Jt) const {
    if (j < 0 || j > Jt) return false;
    if (j < n_init || j > Jt - n_local) return true;
    for (int k = 0; k < count; ++k)
      if (j == Jt - offsets[k]) return true;
    return false;
  }
  // The first local block: J_t - n_local + 1, clipped to 0. The forced set is the initial blocks
  // below it ([0, min(n_init, local_first))), the local blocks [local_first, J_t] and the
  // backbone's J_t - o in [n_init, local_first) (each block once).
  NSA_HOST_DEVICE int64_t local_first(int64_t Jt) const { return Jt - n_local + 1 > 0 ? Jt - n_local + 1 : 0; }
};

// The forced blocks of a configuration.
inline ForcedBlocks forced_blocks(const Config& cfg) {
  ForcedBlocks f;
  f.n_init = cfg.n_init;
  f.n_local = cfg.n_local;
  f.count = static_cast<int>(cfg.num_backbone);
  for (int k = 0; k < f.count; ++k) f.offsets[k] = cfg.backbone_offsets[k];
  return f;
}

// First key position of query t's sliding window of length w (w >= 1).
NSA_HOST_DEVICE constexpr int64_t window_start(int64_t t, int64_t w) {
  return t - w + 1 > 0 ? t - w + 1 : 0;
}

// Packed layout of compressed keys/values (spec §9): the compressed blocks of the sequence that
// starts at packed token offset s are rows [s/d, s/d + N_c) of a tensor with floor(T_total/d)
// rows. Rows of different sequences never overlap because N_c(T) <= floor(T/d) when d divides l;
// at most one row per sequence is left unused.
NSA_HOST_DEVICE constexpr int64_t cmp_row_offset(int64_t seq_start, int64_t d) { return seq_start / d; }
NSA_HOST_DEVICE constexpr int64_t cmp_rows(int64_t total_tokens, int64_t d) { return total_tokens / d; }

// Paged caches (nsa/cache.h): page p of a sequence holds its tokens [p * page_size, (p+1) * page_size)
// (page_size a multiple of l', so of d), and compressed block i lives in the page of its first
// token i*d, at slot (i*d mod page_size) / d of that page's page_size / d compressed slots.
NSA_HOST_DEVICE constexpr int64_t cmp_block_page(int64_t i, int64_t d, int64_t page_size) { return i * d / page_size; }
NSA_HOST_DEVICE constexpr int64_t cmp_block_slot(int64_t i, int64_t d, int64_t page_size) {
  return i * d % page_size / d;
}
// Pages a sequence of T tokens occupies.
NSA_HOST_DEVICE constexpr int64_t pages_of(int64_t T, int64_t page_size) { return (T + page_size - 1) / page_size; }

}  // namespace nsa
