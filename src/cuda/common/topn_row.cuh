// Spec §4 for one (query, KV head) row, by one warp: the top-n blocks of a row of scores in shared
// memory, used by the prefill's top-n kernel and the decode's.
//
// The caller stages the row's admissible scores S[0..J] in shared memory with every forced block
// replaced by kTakenBits. Forced blocks are taken first. Every column has a unique key (score, -j)
// (ties go to the smaller j); the remaining `need` places go to the largest keys.
// - With candidate scratch (the prefill's kernel and the decode's): each lane's largest key (its
//   columns j = lane mod 32; the prefill's staging returns it, the decode scans its staged row).
//   The need-th largest of those 32 is a floor: at least `need` keys reach it, so every pick does.
//   One scan compacts the keys at or above the floor into the scratch (by ballot, in column
//   order); if they fit (kTopnCandidates), each candidate's rank among them says whether and where
//   it is picked. On random scores few columns per row pass the floor, so
//   most columns cost a compare instead of an insertion.
// - Else (no scratch, the floor is 0, or too many candidates: ties, picks concentrated in few
//   lanes), repeated warp-wide arg-max rounds: every lane keeps a sorted list of the kLaneList best
//   keys among its own columns, built by one scan; a round reduces the 32 list heads, and the lane
//   that owned the winner pops its head. A lane whose list runs dry while it still has columns
//   refills it by a scan of the keys below the last one it gave.
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
// host backends; no score can look like kTakenBits. Lane-strided, four columns' loads before their
// stores; returns the lane's largest key (0: none), warp_topn's floor. The caller syncs the warp
// before warp_topn reads the row.
template <typename Score>
__device__ __forceinline__ unsigned long long stage_topn_row(float* srow, int64_t J, const ForcedBlocks& forced,
                                                             int lane, Score score) {
  unsigned long long best = 0;
  for (int64_t j0 = lane; j0 <= J; j0 += 128) {
    float s[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) s[u] = j0 + 32 * u <= J ? score(j0 + 32 * u) : 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t j = j0 + 32 * u;
      if (j > J) break;
      const float v = forced.contains(j, J) ? __uint_as_float(kTakenBits) : (s[u] != s[u] ? __uint_as_float(0x7fffffffu) : s[u]);
      srow[j] = v;
      const unsigned long long k = rank_key(v, static_cast<int>(j));
      best = k > best ? k : best;
    }
  }
  return best;
}

// The candidate scratch of warp_topn: kTopnCandidates keys per warp in shared memory.
inline constexpr int kTopnCandidates = 64;

// The picks after the forced ones by the floor (the header): chosen[first + r] = the block of the
// r-th largest key for r < need. False (nothing written) where the floor is 0 or more than
// kTopnCandidates keys reach it. need in [1, 32].
__device__ __forceinline__ bool topn_by_floor(const float* srow, int64_t J, int need, unsigned long long lane_best,
                                              unsigned long long* cand, int32_t* chosen, int first, int lane) {
  int above = 0;  // lanes with a larger best key (keys are unique; 0 is no key)
  for (int src = 0; src < 32; ++src) above += __shfl_sync(0xffffffffu, lane_best, src) > lane_best;
  const unsigned at = __ballot_sync(0xffffffffu, lane_best != 0 && above == need - 1);
  if (at == 0) return false;
  const unsigned long long floor = __shfl_sync(0xffffffffu, lane_best, __ffs(at) - 1);
  int n = 0;  // keys at or above the floor so far (every lane alike)
  for (int64_t j0 = 0; j0 <= J; j0 += 32) {
    const int64_t j = j0 + lane;
    const unsigned long long k = j <= J ? rank_key(srow[j], static_cast<int>(j)) : 0;  // floor > 0
    const bool q = k >= floor;
    const unsigned m = __ballot_sync(0xffffffffu, q);
    if (q) {
      const int pos = n + __popc(m & ((1u << lane) - 1u));
      if (pos < kTopnCandidates) cand[pos] = k;
    }
    n += __popc(m);
  }
  if (n > kTopnCandidates) return false;
  __syncwarp();
  for (int c = lane; c < n; c += 32) {
    const unsigned long long k = cand[c];
    int rank = 0;
    for (int x = 0; x < n; ++x) rank += cand[x] > k;
    if (rank < need) chosen[first + rank] = static_cast<int32_t>(0xffffffffu - uint32_t(k & 0xffffffffu));
  }
  return true;
}

// The whole warp: selects min(n_sel, J + 1) blocks of a staged row (forced blocks first: the
// configuration guarantees they fit) and writes them ascending to out[0], out[stride], ..., padded
// with -1 to n_sel entries. `chosen` is n_sel ints of shared memory; `cand` (optional) the
// candidate scratch and lane_best the lane's largest key of the staged row (stage_topn_row's).
__device__ __forceinline__ void warp_topn(const float* srow, int64_t J, int n_sel, const ForcedBlocks& forced,
                                          int32_t* chosen, int32_t* out, int64_t stride, int lane,
                                          unsigned long long lane_best = 0, unsigned long long* cand = nullptr) {
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
  const int need = count - n_forced;
  const bool by_floor =
      cand != nullptr && need >= 1 && need <= 32 && topn_by_floor(srow, J, need, lane_best, cand, chosen, n_forced, lane);
  if (!by_floor) {
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
