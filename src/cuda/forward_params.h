// Parameter structs of the CUDA forward kernels: the contract between the launchers
// (forward.cu) and the kernels. Plain data: pointers with their shapes, strides in elements,
// sizes and the configuration. Nothing here knows about the public API's TensorView.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "nsa/tensor.h"

namespace nsa::cuda {

// Rows of the attention tile: 64 query rows = (64 / G) tokens x the G heads of one KV head, so
// every tensor-core instruction has M = 64 rows whatever G is (performance.md).
inline constexpr int kTileRows = 64;
// sm_90a: the window, and the compressed pass 1 where no tensor map can be made, take tiles of
// kWgRows rows, three warpgroups that share every K/V chunk (win_attention.cuh, cmp_attention.cuh).
inline constexpr int kWgRows = 3 * kTileRows;
// sm_90a: the S pass (cmp_scores_kernel) takes tiles of kScoresRows rows, two warpgroups.
inline constexpr int kScoresRows = 2 * kTileRows;
// Keys per step of the compressed attention loop.
inline constexpr int kKeyChunk = 64;
// The shared memory of a TMA ring (tma_ring_attention, cmp_attention.cuh): the Q tile of `rows`
// rows, then `stages` stages of one K and one V chunk of `chunk` keys in the 128-byte swizzle
// (from the unaligned start, with the alignment slack), then an mbarrier and a counter per stage.
constexpr size_t tma_ring_end(int rows, int dqk, int dv, int chunk, int stages) {
  const size_t es = 2, q = size_t(rows) * (dqk + 8) * es;
  return 1024 + q + size_t(stages) * chunk * (dqk + dv) * es;
}
constexpr size_t tma_ring_bar_bytes(int stages) { return size_t(stages) * (sizeof(uint64_t) + sizeof(unsigned)); }
// The window kernel: a tile of 64 rows (4 warps), keys in chunks of 64 streamed through a ring
// of shared buffers that each warp waits on by itself (win_attention.cuh).
inline constexpr int kWinRows = 64;
inline constexpr int kWinChunk = 64;

// Packed sequences: cu_seqlens [B+1] on the device, or nullptr for one sequence of T tokens.
struct SeqParams {
  const int32_t* cu_seqlens = nullptr;  // [B+1]
  int64_t total_tokens = 0;             // T
  int batch = 1;                        // B
  int64_t max_seqlen = 0;
};

// Compressed-branch attention (spec §2) and, optionally, the selection scores S (spec §3).
struct CmpAttnParams {
  SeqParams seqs;
  const void* q;  // [T, Hq, Dqk]
  int64_t q_st, q_sh;
  const void* kc;  // [T/d, Hkv, Dqk]
  int64_t kc_st, kc_sh;
  int64_t kc_rows;  // rows of kc (the bounds of the S pass's TMA tensor map)
  const void* vc;  // [T/d, Hkv, Dv]
  int64_t vc_st, vc_sh;
  void* o;  // [T, Hq, Dv] (storage dtype)
  int64_t o_st, o_sh;
  float* lse;  // [T, Hq] with strides (f32)
  int64_t lse_st, lse_sh;
  float* scores;  // [T, Hkv, Ns] f32, or nullptr
  int64_t s_st, s_sh;
  int64_t scores_width;      // Ns: columns of scores
  bool scores_zero_fill;     // write zeros up to scores_width (public op); else only j <= J_t
  int hkv, group, log2_group;
  float scale_log2;  // softmax scale * log2(e)
  int l, d, lp;      // cmp_block_len, cmp_stride, slc_block_len
  int score_window;  // W: selection blocks one chunk of compressed keys can touch (cmp_attention.cuh)
  int score_ring;    // columns of the ring accumulator: a power of two >= W + blocks per chunk
};

// Selection (spec §5, slc_attention.cuh) and sliding-window attention (spec §6,
// win_attention.cuh, fused with the gated combine of spec §7 when `combine` is set). Each kernel
// reads the fields of its branch.
struct BranchParams {
  SeqParams seqs;
  const void* q;  // [T, Hq, Dqk]
  int64_t q_st, q_sh;
  const void* k_slc;  // [T, Hkv, Dqk]
  int64_t ks_st, ks_sh;
  const void* v_slc;  // [T, Hkv, Dv]
  int64_t vs_st, vs_sh;
  const void* k_win;  // [T, Hkv, Dqk]
  int64_t kw_st, kw_sh;
  const void* v_win;  // [T, Hkv, Dv]
  int64_t vw_st, vw_sh;
  const int32_t* indices;  // [T, Hkv, n]: a set of blocks per row, -1 padded
  int64_t idx_st, idx_sh;
  // Per-branch outputs before gating (storage dtype), index 0 = slc, 1 = win; nullptr: not wanted.
  void* o_branch[2];  // [T, Hq, Dv]
  int64_t ob_st[2], ob_sh[2];
  float* lse[2];  // [T, Hq] f32 with strides; nullptr: not wanted
  int64_t lse_st[2], lse_sh[2];
  // Gated combine: o = g0 * o_cmp + g1 * o_slc + g2 * o_win.
  bool combine;
  const void* g;  // [T, Hq, 3]
  int64_t g_st, g_sh;
  const void* o_cmp;  // [T, Hq, Dv]
  int64_t oc_st, oc_sh;
  void* o;  // [T, Hq, Dv]
  int64_t o_st, o_sh;
  int hkv, group, log2_group;
  float scale_log2;
  int lp, n_sel, window;
  // The selection kernel (slc_attention.cuh): entries of a warp's sort of (block, token) pairs, a
  // power of two >= (16 / G) * n.
  int sort_capacity;
  // o_slc for the window kernel's combine, written by the selection kernel (nullptr: no
  // selection branch, o_slc = 0).
  const void* o_slc;
  int64_t os_st, os_sh;
  // The selection's union tiles (slc_attention.cuh): when set, the per-token kernel leaves every
  // tile whose union of blocks is small (slc_union_takes) and appends it to slc_union_list (entry
  // 0: their count, zeroed before the launch; then the tiles, blockIdx.y * gridDim.x +
  // blockIdx.x, in no particular order), which slc_union_tile_kernel then runs.
  bool slc_union_tiles;
  int32_t* slc_union_list;  // slc_union_list_ints(...) ints of the workspace; nullptr: no union tiles
};

// The selection kernel (slc_attention.cuh): CTAs of kSlcWarps independent warps, each owning 16
// query rows; slc_min_ctas CTAs per SM bound its registers (the kernel keeps no K/V in shared memory).
inline constexpr int kSlcWarps = 4;
// 3 CTAs (12 warps) per SM fit without spills up to Dqk = 128; Dqk = 192 takes 2.
constexpr int slc_min_ctas(int dqk) { return dqk > 128 ? 2 : 3; }
constexpr int slc_sort_capacity(int group, int n_sel) {
  int need = (16 / group) * n_sel, cap = 1;
  while (cap < need) cap *= 2;
  return cap;
}
// Bytes of one warp's shared region: its sort (keys, union blocks, union masks: 3 ints per entry)
// or, at the end, its 16 output rows (2-byte storage, Dv + 8 columns: 16-byte stores without bank
// conflicts, slc_attention.cuh).
__host__ __device__ constexpr size_t slc_warp_smem_bytes(int dv, int sort_capacity) {
  const size_t sort = size_t(sort_capacity) * 3 * 4, out = size_t(16) * (dv + 8) * 2;
  return sort > out ? sort : out;
}
// Per CTA: the warps' regions, then each warp's Q fragments (16 rows x Dqk, 2-byte storage), then
// 8 ints (the warps' union sizes and a counter: slc_union_tiles).
__host__ __device__ constexpr size_t slc_smem_bytes(int dqk, int dv, int sort_capacity) {
  return kSlcWarps * (slc_warp_smem_bytes(dv, sort_capacity) + size_t(16) * dqk * 2) + 8 * sizeof(int);
}
// The selection's union tiles (sm_90a, slc_union_tile_kernel): a CTA of kSlcWarps warps takes the
// 64 rows of the per-token kernel's CTA when their tokens' blocks have a union of at most
// kSlcUnionMax blocks (l' = 64: one 64-key chunk per block), streamed through a TMA ring of
// kSlcUnionStages K tiles and slc_union_v_stages V tiles shared by the four warps.
inline constexpr int kSlcUnionMax = 64, kSlcUnionStages = 2;
// Whether the union kernel takes a tile of `tokens` tokens whose union has u blocks: at most
// kSlcUnionMax, and at most half the blocks its tokens pick one by one (n each). From the measured
// rates (H200, 64K): the per-token kernel ~3-4 ns per (token, block) at G = 4 and 16, a 64-row
// wgmma tile ~7 ns per block (estimated): the union wins below about half. Random scores at G = 16
// (4 tokens, union ~55 of 64 picks) stay per token; neighbouring tokens that pick alike go to the
// union kernel.
__host__ __device__ constexpr bool slc_union_takes(int u, int tokens, int n_sel) {
  return u <= kSlcUnionMax && 2 * u <= tokens * n_sel;
}
// Its shared memory: the Q tile, the ring (the warps' sorts first live there, and the output rows
// at the end), the ring's mbarriers and counters, 8 ints, the union list and its scratch, the
// token masks.
// The kernel is latency-bound (one warpgroup per CTA, ncu at 64K with local_q: an instruction every
// 3 cycles per scheduler) and its shared memory decides how many CTAs share an SM: at 128/128 a
// ring of 2 K and 2 V tiles takes 85 KB (two CTAs), with one V tile 69 KB (three). One V tile
// where that is what lets a third CTA on (slc_union_v_stages), else one per K tile. (One CTA of
// 4-6 stages: 9.6 -> 15.5 ms, docs/cuda.md, "the union kernel at three CTAs per SM".)
inline constexpr size_t kSmemPerSm = 228 * 1024, kSmemPerCtaReserved = 1024;  // sm_90
__host__ __device__ constexpr int ctas_per_sm_by_smem(size_t bytes) { return static_cast<int>(kSmemPerSm / (bytes + kSmemPerCtaReserved)); }
// Mbarriers (and counters) of the union ring: one per stage, or one per K and per V tile when split.
__host__ __device__ constexpr int slc_union_bars(int v_stages) {
  return v_stages < kSlcUnionStages ? kSlcUnionStages + v_stages : kSlcUnionStages;
}
__host__ __device__ constexpr size_t slc_union_ring_bytes_v(int dqk, int dv, int v_stages) {
  return size_t(kKeyChunk) * (size_t(kSlcUnionStages) * dqk + size_t(v_stages) * dv) * 2;
}
__host__ __device__ constexpr size_t slc_union_bytes(int dqk, int dv, int v_stages) {
  // (tma_ring_end with no stages: the alignment slack and the Q tile.)
  return tma_ring_end(kSlcWarps * 16, dqk, dv, kKeyChunk, 0) + slc_union_ring_bytes_v(dqk, dv, v_stages) +
         tma_ring_bar_bytes(slc_union_bars(v_stages)) + 8 + 8 * sizeof(int) + 2 * kSlcUnionMax * sizeof(int32_t) +
         kSlcUnionMax * sizeof(unsigned long long);
}
__host__ __device__ constexpr int slc_union_v_stages(int dqk, int dv) {
  return ctas_per_sm_by_smem(slc_union_bytes(dqk, dv, kSlcUnionStages)) < 3 &&
                 ctas_per_sm_by_smem(slc_union_bytes(dqk, dv, 1)) >= 3
             ? 1
             : kSlcUnionStages;
}
__host__ __device__ constexpr size_t slc_union_ring_bytes(int dqk, int dv) {
  return slc_union_ring_bytes_v(dqk, dv, slc_union_v_stages(dqk, dv));
}
__host__ __device__ constexpr size_t slc_union_smem_bytes(int dqk, int dv) {
  return slc_union_bytes(dqk, dv, slc_union_v_stages(dqk, dv));
}
static_assert(slc_union_v_stages(128, 128) == 1 && slc_union_v_stages(192, 128) == 2 && slc_union_v_stages(64, 64) == 2,
              "the union ring's V tiles");
// Ints of the union tiles' list (BranchParams::slc_union_list): the count, then at most one entry
// per (tile with tokens, KV head). A sequence of len tokens has ceil(len / (64 / G)) tiles, so
// all of them at most T / (64 / G) + batch (G <= 16 divides 64).
constexpr int64_t slc_union_list_ints(int64_t total_tokens, int64_t batch, int64_t hkv, int64_t group) {
  const int64_t tokens_per_tile = group >= 1 && group <= 16 ? (16 / group) * kSlcWarps : 1;  // (G checked later)
  return 1 + hkv * (total_tokens / tokens_per_tile + batch);
}
// Whether the warps' sorts (3 ints per entry each) fit in the ring.
__host__ __device__ constexpr bool slc_union_sorts_fit(int dqk, int dv, int sort_capacity) {
  return size_t(kSlcWarps) * 3 * sort_capacity * sizeof(int32_t) <= slc_union_ring_bytes(dqk, dv);
}

// Launchers, one explicit instantiation per (storage, Dqk, Dv) in instantiations/.
template <typename Storage, int kDqk, int kDv>
void launch_cmp_attention(const CmpAttnParams& p, cudaStream_t stream);
template <typename Storage, int kDqk, int kDv>
void launch_win_attention(const BranchParams& p, cudaStream_t stream);
template <typename Storage, int kDqk, int kDv>
void launch_slc_attention(const BranchParams& p, cudaStream_t stream);

// The ring of K/V chunk buffers of the window kernel: as many stages of kWinChunk keys as fit in
// 108 KB (two CTAs per SM), at most 8: 3 at 128/128, 2 at 192/128. Up to stages - 1 chunks are in
// flight while one is multiplied.
inline constexpr size_t kWinStageBudget = 108 * 1024;
inline constexpr int kWinMaxStages = 8;
constexpr size_t win_stage_bytes(int dqk, int dv) { return size_t(kWinChunk) * ((dqk + 8) + (dv + 8)) * 2; }
constexpr int win_stages(int dqk, int dv) {
  const size_t n = kWinStageBudget / win_stage_bytes(dqk, dv);
  return n > size_t(kWinMaxStages) ? kWinMaxStages : static_cast<int>(n);
}
// Stages the Q tile (64 rows) borrows at the start: it is needed only until its fragments are in
// registers, so it sits in the last stages of the ring before their first chunks are loaded.
constexpr int win_q_stages(int dqk, int dv) {
  const size_t q = size_t(kWinRows) * (dqk + 8) * 2, stage = win_stage_bytes(dqk, dv);
  return static_cast<int>((q + stage - 1) / stage);
}

// Shared-memory bytes of the kernels (used by the launchers and to check limits up front).
// Compressed attention, a CTA of `rows` rows: Q tile + 2 K buffers + the larger of 2 V buffers
// (pass 1) and the score buffers (pass 2: per token kKeyChunk head sums, score_ring accumulator
// slots and its column limit), in the padded layout, plus 1024 bytes of alignment slack for the
// swizzled layout of sm_90a (which needs no more than the padded one).
constexpr size_t cmp_smem_bytes(int rows, int dqk, int dv, int group, int score_ring, bool with_v, bool with_scores) {
  const size_t es = 2, tokens = size_t(rows) / group;
  const size_t q = size_t(rows) * (dqk + 8) * es, k = 2 * size_t(kKeyChunk) * (dqk + 8) * es;
  const size_t v = with_v ? 2 * size_t(kKeyChunk) * (dv + 8) * es : 0;
  // The S pass: per token a row of the chunk's head sums and the score ring (floats) and a column
  // limit (int); then two mbarriers (the TMA copies of K on sm_90a) on 8 bytes.
  const size_t scores =
      with_scores ? tokens * ((kKeyChunk + score_ring) * sizeof(float) + sizeof(int)) + 8 + 2 * sizeof(uint64_t) : 0;
  return 1024 + q + k + (v > scores ? v : scores);
}
// The sm_90a window (win_attention.cuh places its mbarriers): kCmpTmaStages stages of kKeyChunk
// keys. 192 rows: 145 KB at 128/128, 198 KB at 192/128.
inline constexpr int kCmpTmaStages = 3;
inline constexpr size_t kTmaRingBarBytes = tma_ring_bar_bytes(kCmpTmaStages);
// sm_90a pass 1 in 128-row tiles and 128-key chunks (cmp_pass1_wide_kernel, cmp_attention.cuh), a
// 2-stage ring: 163 KB at 128/128, 211 KB at 192/128.
inline constexpr int kCmpWideRows = 128, kCmpWideChunk = 128, kCmpWideStages = 2;
// Its two warpgroups issue their product batches in turns (FA3's ping-pong; tma_ring_attention_rows).
inline constexpr bool kCmpWidePingPong = true;
// The same for the sm_90a window kernel's three warpgroups (win_attention.cuh).
inline constexpr bool kWinPingPong = true;
constexpr size_t cmp_wide_smem_bytes(int dqk, int dv) {
  return tma_ring_end(kCmpWideRows, dqk, dv, kCmpWideChunk, kCmpWideStages) + tma_ring_bar_bytes(kCmpWideStages);
}
// The head dims whose S pass may take kScoresRows-row tiles on sm_90a (the only ones for which that
// kernel is instantiated). H200, 64K, Hq 64 / Hkv 4, same run (docs/benchmarks/h200.md, `3831e9f`):
// Dqk 192 30.9 -> 24.5 ms for pass 1 + S with 128 rows; Dqk 128 20.9 -> 21.1 ms, so 64 rows stay there.
constexpr bool scores_wide_tiles(int dqk) { return dqk > 128; }
// The S pass's tile rows on sm_90a: kScoresRows where scores_wide_tiles and that tile's shared
// memory fits in max_smem (at G = 1 a 128-row tile holds 128 tokens, each with a ring of scores),
// else kTileRows.
constexpr int scores_rows(int dqk, int dv, int group, int score_ring, size_t max_smem) {
  return scores_wide_tiles(dqk) && cmp_smem_bytes(kScoresRows, dqk, dv, group, score_ring, false, true) <= max_smem
             ? kScoresRows
             : kTileRows;
}
// The most any of its kernels takes: the fused 64-row kernel (sm_80), or the kWgRows-row pass 1
// and the S pass in scores_rows() rows (sm_90a).
constexpr size_t cmp_attention_smem_bytes(int dqk, int dv, int group, int score_ring, bool with_scores,
                                          size_t max_smem) {
  const size_t fused = cmp_smem_bytes(kTileRows, dqk, dv, group, score_ring, true, with_scores);
  const size_t pass1_cp = cmp_smem_bytes(kWgRows, dqk, dv, group, score_ring, true, false);
  const size_t pass1_wide = cmp_wide_smem_bytes(dqk, dv);
  const size_t pass1 = pass1_cp > pass1_wide ? pass1_cp : pass1_wide;
  const size_t pass2 = with_scores ? cmp_smem_bytes(scores_rows(dqk, dv, group, score_ring, max_smem), dqk, dv, group,
                                                    score_ring, false, true)
                                   : 0;
  const size_t split = pass1 > pass2 ? pass1 : pass2;
  return fused > split ? fused : split;
}
constexpr size_t win_smem_bytes(int dqk, int dv) { return size_t(win_stages(dqk, dv)) * win_stage_bytes(dqk, dv); }

}  // namespace nsa::cuda
