// Spec §4 on the GPU: one warp per (token, KV head) row of S.
//
// The row's admissible scores S[0..J_t] are staged in shared memory. Forced blocks are taken
// first; the remaining places go to repeated warp-wide arg-max rounds (no sort). Every lane keeps
// a sorted list of the kLaneList best keys among its own columns (j = lane mod 32), built by one
// scan; a round reduces the 32 list heads, and the lane that owned the winner pops its head. A
// lane whose list runs dry while it still has columns refills it by a scan of the keys below the
// last one it gave (rare: a round's winner is a random lane on real scores). Ties go to the
// smaller j because the comparison key is (score, -j). The chosen blocks are then written in
// ascending order (each lane computes the rank of its entries) and padded with -1.
//
// (Until session 9 each round's winner rescanned all its columns for its next best: a serial
// scan of J/32 shared loads per round in one lane while the warp waited.)
#include "cuda/common/check.h"
#include "cuda/topn.cuh"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda {

namespace {

constexpr int kTopnWarps = 4;
constexpr uint32_t kTakenBits = 0xffffffffu;  // a NaN pattern marking a column already chosen
constexpr size_t kTopnSmemLimit = 200 * 1024;

// Orders (score, -j) as one unsigned number; 0 for a column already taken.
__device__ __forceinline__ uint64_t rank_key(float score, int j) {
  uint32_t u = __float_as_uint(score);
  if (u == kTakenBits) return 0;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - uint32_t(j));
}

constexpr int kLaneList = 8;

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

__global__ void select_topn_kernel(const TopnParams p, int warps_per_block) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_id = int64_t(blockIdx.x) * warps_per_block + warp;
  if (row_id >= p.seqs.total_tokens * p.hkv) return;  // whole warp leaves together
  const int64_t tg = row_id / p.hkv;  // packed token
  const int hk = static_cast<int>(row_id % p.hkv);
  int64_t s0 = 0;
  if (p.seqs.cu_seqlens != nullptr) {  // the sequence holding tg: last b with cu[b] <= tg < cu[b+1]
    int lo = 0, hi = p.seqs.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.seqs.cu_seqlens[mid] <= tg) lo = mid;
      else hi = mid - 1;
    }
    s0 = p.seqs.cu_seqlens[lo];
  }
  const int64_t t = tg - s0;
  const size_t per_warp = static_cast<size_t>(p.n_slc_max + p.n_sel);  // floats, as topn_smem_per_warp
  float* srow = reinterpret_cast<float*>(smem) + warp * per_warp;
  int32_t* chosen = reinterpret_cast<int32_t*>(srow + p.n_slc_max);
  const int64_t J = last_slc_block(t, p.lp);
  const int count = static_cast<int>(J + 1 < p.n_sel ? J + 1 : p.n_sel);
  const float* srcrow = p.scores + tg * p.s_st + hk * p.s_sh;
  for (int64_t j = lane; j <= J; j += 32)
    srow[j] = is_forced_block(j, J, p.n_init, p.n_local) ? __uint_as_float(kTakenBits) : srcrow[j];
  // Forced blocks: [0, n_init) and (J - n_local, J], clipped to [0, J], without double counting.
  const int first_forced = static_cast<int>(J + 1 < p.n_init ? J + 1 : p.n_init);
  const int64_t local_lo = J - p.n_local + 1 > p.n_init ? J - p.n_local + 1 : p.n_init;
  const int local_forced = static_cast<int>(J - local_lo + 1 > 0 ? J - local_lo + 1 : 0);
  for (int k = lane; k < first_forced + local_forced; k += 32)
    chosen[k] = k < first_forced ? k : static_cast<int32_t>(local_lo + (k - first_forced));
  __syncwarp();
  LaneList list;
  list.fill(srow, lane, J, ~uint64_t(0));
  for (int r = first_forced + local_forced; r < count; ++r) {
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
  int32_t* out = p.indices + tg * p.i_st + hk * p.i_sh;
  for (int e = lane; e < count; e += 32) {
    const int32_t v = chosen[e];
    int rank = 0;
    for (int x = 0; x < count; ++x) rank += chosen[x] < v;
    out[rank] = v;
  }
  for (int e = count + lane; e < p.n_sel; e += 32) out[e] = -1;
}

}  // namespace

size_t topn_smem_per_warp(int64_t n_slc_max, int n_sel) {
  return static_cast<size_t>(n_slc_max + n_sel) * sizeof(float);
}

void launch_select_topn(const TopnParams& p, cudaStream_t stream) {
  const int64_t rows = p.seqs.total_tokens * p.hkv;
  if (rows == 0 || p.n_sel == 0) return;
  const size_t per_warp = topn_smem_per_warp(p.n_slc_max, p.n_sel);
  if (per_warp > kTopnSmemLimit)
    throw Error("max_seqlen / slc_block_len", std::to_string(p.n_slc_max),
                "is too large for the cuda top-n kernel (at most " +
                    std::to_string(kTopnSmemLimit / sizeof(float) - p.n_sel) + " selection blocks per sequence)");
  int warps = kTopnWarps;
  while (warps > 1 && per_warp * warps > kTopnSmemLimit) --warps;
  const size_t smem = per_warp * warps;
  NSA_CUDA_CHECK(cudaFuncSetAttribute(select_topn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (rows + warps - 1) / warps;
  select_topn_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(p, warps);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
