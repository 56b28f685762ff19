// Spec §4 for one (query, KV head) row, by one warp: the top-n blocks of a row of scores in shared
// memory, used by the prefill's top-n kernel and the decode's.
//
// The caller stages the row's admissible scores S[0..J] in shared memory with every forced block
// replaced by kTakenBits. Forced blocks are taken first; the remaining places go to repeated
// warp-wide arg-max rounds (no sort). Every lane keeps a sorted list of the kLaneList best keys
// among its own columns (j = lane mod 32), built by one scan; a round reduces the 32 list heads,
// and the lane that owned the winner pops its head. A lane whose list runs dry while it still has
// columns refills it by a scan of the keys below the last one it gave (rare: a round's winner is a
// random lane on real scores). Ties go to the smaller j because the comparison key is (score, -j).
// The chosen blocks are then written in ascending order (each lane computes the rank of its
// entries) and padded with -1.
#pragma once

#include <cstdint>

#include "nsa/blocks.h"
#include "nsa/config.h"

namespace nsa::cuda {

inline constexpr uint32_t kTakenBits = 0xffffffffu;  // a NaN pattern marking a column already chosen

// Orders (score, -j) as one unsigned number; 0 for a column already taken.
__device__ __forceinline__ uint64_t rank_key(float score, int j) {
  uint32_t u = __float_as_uint(score);
  if (u == kTakenBits) return 0;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - uint32_t(j));
}

inline constexpr int kLaneList = 8;

// A lane's best keys, descending (0: empty), and how many of its columns' keys are at or below
// the bound of the scan that filled it (more than kLaneList: the list must be refilled when it
// runs dry).
struct LaneList {
  uint64_t key[kLaneList];
  int in_list, found;

  // Fills the list with the lane's best keys at or below `bound` (0 keys, taken columns, never).
  __device__ __forceinline__ void fill(const float* row, int lane, int64_t last, uint64_t bound) {
#pragma unroll
    for (int i = 0; i < kLaneList; ++i) key[i] = 0;
    found = 0;
    for (int64_t j = lane; j <= last; j += 32) {
      uint64_t k = rank_key(row[j], static_cast<int>(j));
      if (k == 0 || k > bound) continue;
      ++found;
#pragma unroll
      for (int i = 0; i < kLaneList; ++i) {  // insertion: k bubbles down to its place
        const uint64_t here = key[i];
        const bool above = k > here;
        key[i] = above ? k : here;
        k = above ? here : k;
      }
    }
    in_list = found < kLaneList ? found : kLaneList;
  }
  // Removes the head (the round's winner), refilling below it when the list runs dry.
  __device__ __forceinline__ void pop(const float* row, int lane, int64_t last) {
    const uint64_t gone = key[0];
#pragma unroll
    for (int i = 0; i + 1 < kLaneList; ++i) key[i] = key[i + 1];
    key[kLaneList - 1] = 0;
    if (--in_list == 0 && found > kLaneList) fill(row, lane, last, gone - 1);  // keys are unique
  }
};

// Stages one row: srow[j] = the score of block j, or kTakenBits for a forced block (j <= J).
// Every NaN, of either sign and any payload, is staged as the one positive NaN 0x7fffffff: it
// ranks above every number (+inf included) and NaNs among themselves by the smaller j, as on the
// host backends; no score can look like kTakenBits. Lane-strided; the caller syncs the warp before
// warp_topn reads it.
template <typename Score>
__device__ __forceinline__ void stage_topn_row(float* srow, int64_t J, const ForcedBlocks& forced, int lane, Score score) {
  for (int64_t j = lane; j <= J; j += 32) {
    const float s = score(j);
    srow[j] = forced.contains(j, J) ? __uint_as_float(kTakenBits) : (s != s ? __uint_as_float(0x7fffffffu) : s);
  }
}

// The whole warp: selects min(n_sel, J + 1) blocks of a staged row (forced blocks first: the
// configuration guarantees they fit) and writes them ascending to out[0], out[stride], ..., padded
// with -1 to n_sel entries. `chosen` is n_sel ints of shared memory.
__device__ __forceinline__ void warp_topn(const float* srow, int64_t J, int n_sel, const ForcedBlocks& forced,
                                          int32_t* chosen, int32_t* out, int64_t stride, int lane) {
  const int count = static_cast<int>(J + 1 < n_sel ? J + 1 : n_sel);
  // The forced blocks (ForcedBlocks): initial ones below the local ones, the local ones, then the
  // backbone's between them (every lane counts them alike; lane 0 writes them).
  const int64_t lo = forced.local_first(J);
  const int ni = static_cast<int>(forced.n_init < lo ? forced.n_init : lo);  // initial: [0, ni)
  const int nl = static_cast<int>(J - lo + 1);                               // local: [lo, J]
  for (int k = lane; k < ni + nl; k += 32) chosen[k] = k < ni ? k : static_cast<int32_t>(lo + (k - ni));
  int n_forced = ni + nl;
  for (int k = 0; k < forced.count; ++k) {
    const int64_t j = J - forced.offsets[k];
    if (j >= forced.n_init && j < lo) {
      if (lane == 0) chosen[n_forced] = static_cast<int32_t>(j);
      ++n_forced;
    }
  }
  __syncwarp();
  LaneList list;
  list.fill(srow, lane, J, ~uint64_t(0));
  for (int r = n_forced; r < count; ++r) {
    uint64_t top = list.key[0];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, top, off);
      top = other > top ? other : top;
    }
    const int j = static_cast<int>(0xffffffffu - uint32_t(top & 0xffffffffu));
    if (lane == 0) chosen[r] = j;
    if (lane == j % 32) list.pop(srow, lane, J);
  }
  __syncwarp();
  for (int e = lane; e < count; e += 32) {
    const int32_t v = chosen[e];
    int rank = 0;
    for (int x = 0; x < count; ++x) rank += chosen[x] < v;
    out[rank * stride] = v;
  }
  for (int e = count + lane; e < n_sel; e += 32) out[e * stride] = -1;
}

}  // namespace nsa::cuda
