// Every tuning rule of the CUDA backend, as pure functions of sizes (never of device data, so a
// CUDA graph captured once replays with the same launches): tile rows, chunk sizes, shared-memory
// plans and the CTAs they let share an SM, split counts (the backward's compressed splits also of
// how many CTAs the device holds). One section per room (forward:
// nsa::cuda; backward: nsa::cuda::bwd; decode: nsa::cuda::decode; rotary embeddings:
// nsa::cuda::rotary). Plain C++ with NSA_HOST_DEVICE,
// so the host tests check the invariants the kernels rely on (tests/test_cmp_split.cpp,
// tests/test_decode_tiles.cpp) and the kernels use the same functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/common/constants.h"
#include "nsa/blocks.h"
#include "nsa/config.h"

// ---- forward ------------------------------------------------------------------------------------

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

// The selection's per-token kernels (slc_attention.cuh, slc_attention_tma.cuh): CTAs of kSlcWarps
// independent warps, each owning 16 query rows (slc_attention_blocks.cuh: one warp per CTA, the
// tile of kSlcWarps warps' rows kept for the union tiles). slc_min_ctas CTAs per SM bound the
// registers of the kernel on L1 loads (it keeps no K/V in shared memory); the TMA kernel's rings
// hold two (slc_tma_fits).
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
NSA_HOST_DEVICE constexpr size_t slc_warp_smem_bytes(int dv, int sort_capacity) {
  const size_t sort = size_t(sort_capacity) * 3 * 4, out = size_t(16) * (dv + 8) * 2;
  return sort > out ? sort : out;
}
// Per CTA: the warps' regions, then each warp's Q fragments (16 rows x Dqk, 2-byte storage), then
// 8 ints (the warps' union sizes and a counter: slc_union_tiles).
NSA_HOST_DEVICE constexpr size_t slc_smem_bytes(int dqk, int dv, int sort_capacity) {
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
NSA_HOST_DEVICE constexpr bool slc_union_takes(int u, int tokens, int n_sel) {
  return u <= kSlcUnionMax && 2 * u <= tokens * n_sel;
}
// Its shared memory: the Q tile, the ring (the warps' sorts first live there, and the output rows
// at the end), the ring's mbarriers and counters, 8 ints, the union list and its scratch, the
// token masks.
// The kernel is latency-bound (one warpgroup per CTA, ncu at 64K with local_q: an instruction every
// 3 cycles per scheduler) and its shared memory decides how many CTAs share an SM: at 128/128 a
// ring of 2 K and 2 V tiles takes 85 KB (two CTAs), with one V tile 69 KB (three). One V tile
// where that is what lets a third CTA on (slc_union_v_stages), else one per K tile. (One CTA of
// 4-6 stages: 9.6 -> 15.5 ms, `be59d88`.)
NSA_HOST_DEVICE constexpr int ctas_per_sm_by_smem(size_t bytes) { return static_cast<int>(kSmemPerSm / (bytes + kSmemPerCtaReserved)); }
// Mbarriers (and counters) of the union ring: one per stage, or one per K and per V tile when split.
NSA_HOST_DEVICE constexpr int slc_union_bars(int v_stages) {
  return v_stages < kSlcUnionStages ? kSlcUnionStages + v_stages : kSlcUnionStages;
}
NSA_HOST_DEVICE constexpr size_t slc_union_ring_bytes_v(int dqk, int dv, int v_stages) {
  return size_t(kKeyChunk) * (size_t(kSlcUnionStages) * dqk + size_t(v_stages) * dv) * 2;
}
NSA_HOST_DEVICE constexpr size_t slc_union_bytes(int dqk, int dv, int v_stages) {
  // (tma_ring_end with no stages: the alignment slack and the Q tile.)
  return tma_ring_end(kSlcWarps * 16, dqk, dv, kKeyChunk, 0) + slc_union_ring_bytes_v(dqk, dv, v_stages) +
         tma_ring_bar_bytes(slc_union_bars(v_stages)) + 8 + 8 * sizeof(int) + 2 * kSlcUnionMax * sizeof(int32_t) +
         kSlcUnionMax * sizeof(unsigned long long);
}
NSA_HOST_DEVICE constexpr int slc_union_v_stages(int dqk, int dv) {
  return ctas_per_sm_by_smem(slc_union_bytes(dqk, dv, kSlcUnionStages)) < 3 &&
                 ctas_per_sm_by_smem(slc_union_bytes(dqk, dv, 1)) >= 3
             ? 1
             : kSlcUnionStages;
}
NSA_HOST_DEVICE constexpr size_t slc_union_ring_bytes(int dqk, int dv) {
  return slc_union_ring_bytes_v(dqk, dv, slc_union_v_stages(dqk, dv));
}
NSA_HOST_DEVICE constexpr size_t slc_union_smem_bytes(int dqk, int dv) {
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
NSA_HOST_DEVICE constexpr bool slc_union_sorts_fit(int dqk, int dv, int sort_capacity) {
  return size_t(kSlcWarps) * 3 * sort_capacity * sizeof(int32_t) <= slc_union_ring_bytes(dqk, dv);
}

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

// The S pass's score buffers: per token a row of the chunk's head sums and the score ring (floats)
// and a column limit (int); then `bars` mbarriers (the TMA copies of K on sm_90a) on 8 bytes.
constexpr size_t score_buffers_bytes(size_t tokens, int score_ring, int bars) {
  return tokens * ((kKeyChunk + score_ring) * sizeof(float) + sizeof(int)) + 8 + size_t(bars) * sizeof(uint64_t);
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
  const size_t scores = with_scores ? score_buffers_bytes(tokens, score_ring, 2) : 0;
  return 1024 + q + k + (v > scores ? v : scores);
}
// The sm_90a S pass in 64-row tiles with chunk c + 1's score products issued before chunk c's sums
// (cmp_scores_pass<..., kPipelined>), in groups of kScoresPipelinedGroup chunks: the Q tile,
// kScoresPipelinedStages swizzled K buffers (unpadded), the score buffers and as many mbarriers;
// kScoresPipelinedCtas CTAs share an SM (128 registers, 4 bytes spilled; 51 KB at Dqk 128, G 16).
// ncu at 64K, G = 16 (H100, one warm machine, `a54c6fc` and `12096bd`): 5.17 ms with 2 buffers at
// 4 CTAs, 5.69 with 3 at 3 CTAs (130 registers), 5.52 without the pipeline (102 registers, 4 CTAs).
// Only where the head sums stay in registers (scores_pipelined_shape: G = 16 or 4 with l / d = 2,
// l' / d = 4, by chunk; the other shapes' sums go through shared memory in lane loops, and ptxas
// serialises products in flight across such branches) and its shared memory fits; else the
// unpipelined pass runs.
inline constexpr int kScoresPipelinedStages = 2, kScoresPipelinedCtas = 4, kScoresPipelinedGroup = 4;
constexpr bool scores_pipelined_shape(int group, int l_over_d, int lp_over_d, bool by_chunk) {
  return by_chunk && l_over_d == 2 && lp_over_d == 4 && (group == 16 || group == 4);
}
constexpr size_t cmp_scores_pipelined_smem_bytes(int dqk, int group, int score_ring) {
  const size_t es = 2, tokens = size_t(kTileRows) / group;
  const size_t q = size_t(kTileRows) * (dqk + 8) * es, k = size_t(kScoresPipelinedStages) * kKeyChunk * dqk * es;
  return 1024 + q + k + score_buffers_bytes(tokens, score_ring, kScoresPipelinedStages);
}
// The sm_90a window (win_attention.cuh places its mbarriers): kCmpTmaStages stages of kKeyChunk
// keys. 192 rows: 145 KB at 128/128, 198 KB at 192/128.
inline constexpr int kCmpTmaStages = 3;
// The sm_90a window's chunks: kWinChunk = 64 keys through kCmpTmaStages stages, or kWinLongChunk = 112
// where fewer chunks cost less. A tile of kWgRows rows (192 / G tokens) reads the window span
// w - 1 + 192 / G keys in ceil(span / chunk) chunks; each chunk costs its keys' products plus fixed
// work (the turn barriers, the waits, the row maxima and sums) that measured about kWinChunkCostKeys
// keys' worth (H100, 64K, G = 16, ncu: nine 64-key chunks a tile, 576 keys, 3.34 ms; five 128-key
// chunks, 640 keys, 3.32 ms). At the paper's w = 512 and G = 16 (span 523): nine chunks of 64
// (576 keys) or five of 112 (560). 112 keys = 7 k16 steps of P V and one m64n112k16 score product
// per 16 head dims; compiled where Dqk and Dv are at most 128 and run only with tensor maps.
inline constexpr int kWinLongChunk = 112, kWinChunkCostKeys = 16;
constexpr bool win_long_chunk_compiled(int dqk, int dv) { return dqk <= 128 && dv <= 128; }
constexpr int win_chunk_cost(int span, int chunk) { return (span + chunk - 1) / chunk * (chunk + kWinChunkCostKeys); }
// The chunk of the sm_90a window: `forced` where it is 64 or 112 (CudaKernelChoices::win_chunk) and
// compiled, else the one of lower win_chunk_cost over a whole tile's span (64 on a tie).
constexpr int win_chunk_keys(int window, int group, int dqk, int dv, int forced = 0) {
  if (!win_long_chunk_compiled(dqk, dv) || window <= 0 || group <= 0) return kWinChunk;
  if (forced == kWinChunk || forced == kWinLongChunk) return forced;
  const int span = window - 1 + kWgRows / group;
  return win_chunk_cost(span, kWinLongChunk) < win_chunk_cost(span, kWinChunk) ? kWinLongChunk : kWinChunk;
}
// Stages of the window's TMA ring at `chunk` keys: kCmpTmaStages where they fit beside the 192-row Q
// tile (225 KB at 112 keys, 128/128), else 2.
constexpr int win_tma_stages(int dqk, int dv, int chunk) {
  return tma_ring_end(kWgRows, dqk, dv, chunk, kCmpTmaStages) + tma_ring_bar_bytes(kCmpTmaStages) + 8 <= kMaxSmem
             ? kCmpTmaStages
             : 2;
}
static_assert(win_chunk_keys(512, 16, 128, 128) == kWinLongChunk && win_chunk_keys(512, 8, 128, 128) == kWinLongChunk &&
                  win_chunk_keys(512, 4, 128, 128) == kWinLongChunk && win_chunk_keys(512, 2, 128, 128) == kWinLongChunk &&
                  win_chunk_keys(512, 1, 128, 128) == kWinChunk && win_chunk_keys(512, 16, 192, 128) == kWinChunk &&
                  win_tma_stages(128, 128, kWinLongChunk) == 3,
              "the window's chunks at the paper's settings");
// sm_90a pass 1 in 128-key chunks through a 2-stage ring (cmp_pass1_wide_kernel, cmp_attention.cuh),
// in tiles of cmp_wide_rows(dqk, dv) rows: 192 (three warpgroups) where that Q tile and the ring fit
// in shared memory (180 KB at 128/128, 204 KB at 192/64), else 128 (211 KB at 192/128).
inline constexpr int kCmpWideChunk = 128, kCmpWideStages = 2;
constexpr size_t cmp_wide_smem_bytes_at(int rows, int dqk, int dv) {
  return tma_ring_end(rows, dqk, dv, kCmpWideChunk, kCmpWideStages) + tma_ring_bar_bytes(kCmpWideStages);
}
constexpr int cmp_wide_rows(int dqk, int dv) {
  return cmp_wide_smem_bytes_at(kWgRows, dqk, dv) <= kMaxSmem ? kWgRows : 2 * kTileRows;
}
constexpr size_t cmp_wide_smem_bytes(int dqk, int dv) {
  return cmp_wide_smem_bytes_at(cmp_wide_rows(dqk, dv), dqk, dv);
}
// Where the S pass takes kScoresRows-row tiles on sm_90a by its rule: Dqk above 128, and Dqk 128 at
// G <= 4 (a 128-row tile: 32 tokens share each K chunk at G = 4, 8 at G = 16). H200, 64K, Hq 64 /
// Hkv 4, same run (`3831e9f`): Dqk 192 30.9 -> 24.5 ms for pass 1 + S with 128 rows. H100, 64K, ncu
// of the S pass (`180f14a`): G = 16 5.86 ms in 64-row tiles, 6.15 in 128; G = 4 (Hq 16) 2.04 -> 1.86
// (8K: G = 16 0.182 / 0.194, G = 4 0.067 / 0.064). Measured at G = 4 and 16 only.
constexpr bool scores_wide_tiles(int dqk, int group) { return dqk > 128 || (dqk == 128 && group <= 4); }
// The head dims for which the kScoresRows-row S kernel is compiled.
constexpr bool scores_wide_compiled(int dqk) { return dqk >= 128; }
// The S pass's tile rows on sm_90a: kScoresRows where asked for (rows = 128) or, with rows = 0, where
// scores_wide_tiles, and only where that kernel is compiled and its tile's shared memory fits in
// max_smem (at G = 1 a 128-row tile holds 128 tokens, each with a ring of scores); else kTileRows.
constexpr int scores_rows(int dqk, int dv, int group, int score_ring, size_t max_smem, int rows = 0) {
  const bool wide = rows == 0 ? scores_wide_tiles(dqk, group) : rows == kScoresRows;
  return wide && scores_wide_compiled(dqk) &&
                 cmp_smem_bytes(kScoresRows, dqk, dv, group, score_ring, false, true) <= max_smem
             ? kScoresRows
             : kTileRows;
}
// The most any of its kernels takes: the fused 64-row kernel (sm_80), or the kWgRows-row pass 1
// and the S pass in scores_rows() rows (sm_90a).
constexpr size_t cmp_attention_smem_bytes(int dqk, int dv, int group, int score_ring, bool with_scores,
                                          size_t max_smem, int scores_tile_rows = 0) {
  const size_t fused = cmp_smem_bytes(kTileRows, dqk, dv, group, score_ring, true, with_scores);
  const size_t pass1_cp = cmp_smem_bytes(kWgRows, dqk, dv, group, score_ring, true, false);
  const size_t pass1_wide = cmp_wide_smem_bytes(dqk, dv);
  const size_t pass1 = pass1_cp > pass1_wide ? pass1_cp : pass1_wide;
  const size_t pass2 = with_scores ? cmp_smem_bytes(scores_rows(dqk, dv, group, score_ring, max_smem, scores_tile_rows),
                                                    dqk, dv, group, score_ring, false, true)
                                   : 0;
  const size_t split = pass1 > pass2 ? pass1 : pass2;
  return fused > split ? fused : split;
}
constexpr size_t win_smem_bytes(int dqk, int dv) { return size_t(win_stages(dqk, dv)) * win_stage_bytes(dqk, dv); }

}  // namespace nsa::cuda

// ---- backward: query splits of the compressed branch's dK/dV (dkv_kernel<cmp>, reduce_cmp_parts_kernel)

namespace nsa::cuda::bwd {

constexpr int kMaxCmpSplits = 16;   // query splits of the compressed dk/dv, at most
constexpr int kCmpSplitTokens = 1024;  // one more split per this many tokens of max_seqlen

// Splits of a backward call over packed sequences (one sequence: cmp_splits_balanced below, under
// the same cap): one per kCmpSplitTokens tokens of the longest sequence, at most 16
// for one sequence at G >= 16, 8 at G >= 8 (and for packed batches,
// whose earlier splits keep every row) and 4 below. Each split after the first keeps fp32
// partials of the rows its queries see (about 1.5 copies of the compressed rows at 4 splits, 3.5
// at 8, 7.5 at 16), which grow with Hkv while q, k, v and o grow with Hq: 8 splits instead of 4
// took the 64K backward at G = 16 from 124.0 to 121.6 ms on an H200 (`a5f2288`; load balance)
// for 34 MB, 1.3% of q, k, v and o, but at G = 4 the same 34 MB is 3.6% of them (workspace 8.5%
// -> 12.1%, past the 10% budget) for 0.4 ms (53.0 -> 52.6 ms). 16 splits at G = 16 (`8c78670`,
// with the heavy-first order): 64K backward 105.7 -> 104.7 ms, workspace 151 -> 218 MB = 8.5%.
NSA_HOST_DEVICE int cmp_splits_cap(int64_t group, int64_t batch = 1) {
  return group >= 16 && batch == 1 ? kMaxCmpSplits : group >= 8 ? 8 : 4;
}
NSA_HOST_DEVICE int cmp_splits_for(int64_t max_seqlen, int64_t group, int64_t batch = 1) {
  const int cap = cmp_splits_cap(group, batch);
  const int64_t want = (max_seqlen + kCmpSplitTokens - 1) / kCmpSplitTokens;
  return want < 1 ? 1 : want > cap ? cap : int(want);
}

// Query splits of the compressed dK/dV (dkv_kernel<cmp>, split z = cmp_split_index()): split z of
// a sequence of len tokens takes the query positions [z S, (z + 1) S), S = ceil(len / splits). Split `last`
// (the one holding position len - 1) sees every compressed block and writes dkc / dvc itself;
// an earlier split z sees only the blocks i with i d + l - 1 < (z + 1) S, the sequence's first
// cmp_split_rows(z) blocks, and writes fp32 partials for those, which reduce_cmp_parts_kernel adds
// in split order. Only what a split can see is stored: 1.5 instead of 4 copies of the rows at 4
// splits.
struct CmpSplit {
  int64_t S;
  int last;
};
NSA_HOST_DEVICE CmpSplit cmp_split_of(int64_t len, int splits) {
  const int64_t S = (len + splits - 1) / splits;
  return CmpSplit{S, len > 0 ? int((len - 1) / S) : 0};
}
NSA_HOST_DEVICE int64_t cmp_split_rows(int64_t len, int z, const CmpSplit& cs, int64_t l, int64_t d) {
  const int64_t lim = (z + 1) * cs.S - l + 1;  // blocks i with i d < lim
  const int64_t r = lim <= 0 ? 0 : (lim + d - 1) / d;
  const int64_t nc = num_cmp_blocks(len, l, d);
  return r < nc ? r : nc;
}

// ---- the split count for one sequence, from the kernel's schedule

// Compressed keys a dkv_kernel<cmp> CTA owns (the backward's kKeys), and a CTA's fixed work (its
// K / V tile, the epilogue's fp32 rows) in query tiles, for the model below.
constexpr int kCmpKeyTile = 64;
constexpr int kCmpCtaFixedTiles = 8;

// The query positions [q0, q1) split z of one sequence gives the compressed keys whose first
// query is t_first (key tile x: x kCmpKeyTile d + l - 1): dkv_kernel<cmp>'s range (DkvPlan) and
// the schedule model's. Empty (q0 >= q1) where the split sees none of the tile or z > cs.last.
struct CmpQueries {
  int64_t q0, q1;
};
NSA_HOST_DEVICE CmpQueries cmp_split_queries(int64_t len, const CmpSplit& cs, int z, int64_t t_first) {
  if (z > cs.last) return CmpQueries{0, 0};
  const int64_t q0 = t_first > z * cs.S ? t_first : z * cs.S;
  const int64_t q1 = z == cs.last ? len : ((z + 1) * cs.S < len ? (z + 1) * cs.S : len);
  return CmpQueries{q0, q1};
}
// Query tiles (tq tokens each) CTA (key tile x, split z) of one sequence works through, as
// DkvPlan's compressed phase counts them; 0: it returns at once.
NSA_HOST_DEVICE int64_t cmp_cta_query_tiles(int64_t len, const CmpSplit& cs, int z, int64_t x, int64_t l, int64_t d,
                                            int64_t tq) {
  const CmpQueries r = cmp_split_queries(len, cs, z, x * kCmpKeyTile * d + l - 1);
  return r.q0 < r.q1 ? (r.q1 - r.q0 + tq - 1) / tq : 0;
}

// Tokens of a query tile (64 rows of G heads) and compressed key tiles of one sequence, as the
// kernel has them.
NSA_HOST_DEVICE int64_t cmp_query_tile_tokens(int64_t group) { return group >= kTileRows ? 1 : kTileRows / group; }
NSA_HOST_DEVICE int64_t cmp_key_tiles(int64_t len, int64_t l, int64_t d) {
  return (num_cmp_blocks(len, l, d) + kCmpKeyTile - 1) / kCmpKeyTile;
}

// Rows of every split's partial together, one sequence of len tokens in `splits` splits.
NSA_HOST_DEVICE int64_t cmp_split_part_rows(int64_t len, int splits, int64_t l, int64_t d) {
  const CmpSplit cs = cmp_split_of(len, splits);
  int64_t rows = 0;
  for (int z = 0; z < cs.last; ++z) rows += cmp_split_rows(len, z, cs, l, d);
  return rows;
}

// The modelled time of dkv_kernel<cmp> over one sequence in `splits` splits, in query tiles:
// the CTAs in launch order (blockIdx.z = 0 is the last split, then the KV heads, then the key
// tiles), each started on the first of `slots` resident places to free up (a greedy list
// schedule), costing its query tiles plus kCmpCtaFixedTiles; an empty CTA costs nothing.
// The CTAs of a split cost the same but the diagonal one, so the time is set by how many rounds
// of `slots` the working CTAs fill: at 8K, G = 16, eight splits give 144 CTAs of 1024 tokens on
// an H100's 132 SMs (two rounds, the second almost empty), fourteen 268 of 586 tokens.
inline int64_t cmp_split_makespan(int64_t len, int splits, int64_t group, int64_t hkv, int64_t l, int64_t d,
                                  int slots) {
  if (len <= 0 || slots <= 0) return 0;
  const CmpSplit cs = cmp_split_of(len, splits);
  const int64_t tq = cmp_query_tile_tokens(group), tiles = cmp_key_tiles(len, l, d);
  std::vector<int64_t> free_at(size_t(slots), 0);  // a min-heap of when each place frees up
  auto later = [](int64_t a, int64_t b) { return a > b; };
  for (int bz = 0; bz < splits; ++bz) {
    const int z = splits - 1 - bz;
    for (int64_t y = 0; y < hkv; ++y)
      for (int64_t x = 0; x < tiles; ++x) {
        const int64_t n = cmp_cta_query_tiles(len, cs, z, x, l, d, tq);
        if (n == 0) continue;
        std::pop_heap(free_at.begin(), free_at.end(), later);
        free_at.back() += n + kCmpCtaFixedTiles;
        std::push_heap(free_at.begin(), free_at.end(), later);
      }
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

// Splits of one sequence where the device holds `slots` dkv_kernel<cmp> CTAs at once: the count
// up to cmp_splits_cap of least modelled time (ties: fewer splits, fewer partials). Where the
// working CTAs at the cap fill more than kCmpModelRounds rounds of the slots the last round's
// tail is a small part, and the count stays cmp_splits_for's. The last few answers are kept per
// thread (a training loop's backward asks the same every step).
constexpr int64_t kCmpModelRounds = 8;
inline int cmp_splits_balanced(int64_t len, int64_t group, int64_t hkv, int64_t l, int64_t d, int slots) {
  if (slots <= 0 || len <= 0) return cmp_splits_for(len, group);
  struct Answer {
    int64_t len, group, hkv, l, d;
    int slots, splits;
  };
  thread_local Answer kept[4] = {};
  thread_local int next = 0;
  for (const Answer& k : kept)
    if (k.splits > 0 && k.len == len && k.group == group && k.hkv == hkv && k.l == l && k.d == d && k.slots == slots)
      return k.splits;
  const int splits = [&] {
    const int cap = cmp_splits_cap(group);
    const CmpSplit cs = cmp_split_of(len, cap);
    const int64_t tq = cmp_query_tile_tokens(group), tiles = cmp_key_tiles(len, l, d);
    int64_t ctas = 0;  // the working CTAs at the cap
    for (int z = 0; z <= cs.last; ++z)
      for (int64_t x = 0; x < tiles; ++x) ctas += cmp_cta_query_tiles(len, cs, z, x, l, d, tq) > 0 ? 1 : 0;
    if (ctas * hkv > kCmpModelRounds * slots) return cmp_splits_for(len, group);
    int best = 1;
    int64_t best_t = cmp_split_makespan(len, 1, group, hkv, l, d, slots);
    for (int s = 2; s <= cap; ++s) {
      const int64_t t = cmp_split_makespan(len, s, group, hkv, l, d, slots);
      if (t < best_t) best = s, best_t = t;
    }
    return best;
  }();
  kept[next] = Answer{len, group, hkv, l, d, slots, splits};
  next = (next + 1) % 4;
  return splits;
}

}  // namespace nsa::cuda::bwd

// ---- decode: the split plan. Decoding attends few queries over many keys: one CTA per (query, KV
// head) would leave most of the GPU idle (batch 1: four CTAs), so each branch's keys are split over
// several CTAs whose partial results a later kernel merges in a fixed order (flash-decoding;
// deterministic).

namespace nsa::cuda::decode {

// Keys per tile of every decode loop (the MMA's 16 query rows times 64 keys).
inline constexpr int kKeyTile = 64;
// Query rows of a tile: the heads of one GQA group, padded (G <= 16).
inline constexpr int kRows = 16;
// A compressed split keeps its logits in shared memory (its exact probabilities feed the
// selection scores): 16 rows x 256 keys x (4 + 2) bytes, with two 64-key tiles of K or V, keeps a
// CTA near 64 KB, three to an SM.
inline constexpr int kMaxCmpChunk = 256;
// CTAs a split plan aims for: four per SM of an H100/H200 (132 SMs) keeps the copy engines
// busy; fewer splits when the batch alone gives that many (fewer partials to merge).
inline constexpr int64_t kTargetCtas = 528;

struct Split {
  int splits = 0, chunk = 0;  // CTAs per (query, KV head) and keys per CTA (a multiple of kKeyTile)
};

// Splits `keys` keys (0 allowed) so that items * splits approaches kTargetCtas, chunks at most max_chunk.
inline Split split_keys(int64_t keys, int64_t items, int64_t max_chunk) {
  const int64_t tiles = std::max<int64_t>((keys + kKeyTile - 1) / kKeyTile, 1);
  const int64_t want = std::clamp<int64_t>((kTargetCtas + items - 1) / std::max<int64_t>(items, 1), 1, tiles);
  const int64_t chunk = std::min<int64_t>((tiles + want - 1) / want * kKeyTile, max_chunk);
  Split s;
  s.chunk = static_cast<int>(chunk);
  s.splits = static_cast<int>(std::max<int64_t>((keys + chunk - 1) / chunk, 1));
  return s;
}

struct SplitPlan {
  Split cmp;            // compressed keys (none for dense decoding)
  int score_width = 0;  // selection blocks one compressed split touches
  int slc_per_cta = 0;  // selected blocks per CTA (a large batch gives each CTA several, pipelined)
  int slc_ctas = 0;     // CTAs of the selection per (query, KV head)
  Split win;            // window keys (dense decoding: every key); splits = 0 without a window
};

// rows: queries of the call; max_len: the declared bound on sequence lengths.
inline SplitPlan split_plan(const Config& cfg, int64_t rows, int64_t hkv, int64_t max_len, bool dense) {
  SplitPlan p;
  const int64_t items = std::max<int64_t>(rows * hkv, 1);
  if (!dense) {
    p.cmp = split_keys(num_cmp_blocks(max_len, cfg.cmp_block_len, cfg.cmp_stride), items, kMaxCmpChunk);
    // A split of compressed blocks [i0, i0 + chunk) touches selection blocks floor(i0 / r) ..
    // floor((i0 + chunk + L - 2) / r), r = l'/d stride pieces per selection block, L = l/d per
    // compressed block.
    const int64_t r = cfg.slc_block_len / cfg.cmp_stride, L = cfg.cmp_block_len / cfg.cmp_stride;
    p.score_width = static_cast<int>((p.cmp.chunk + L - 2 + r - 1) / r + 1);
    if (cfg.n_selected > 0) {
      p.slc_per_cta = static_cast<int>(std::clamp<int64_t>((items * cfg.n_selected + kTargetCtas - 1) / kTargetCtas, 1,
                                                           cfg.n_selected));
      p.slc_ctas = static_cast<int>((cfg.n_selected + p.slc_per_cta - 1) / p.slc_per_cta);
    }
  }
  const int64_t win_keys = dense ? max_len : std::min<int64_t>(cfg.window, max_len);
  if (win_keys > 0) p.win = split_keys(win_keys, items, INT32_MAX / 2);
  return p;
}

}  // namespace nsa::cuda::decode

// ---- rotary embeddings (rotary/rotary.cu): one thread rotates one chunk of channel pairs of one
// token for a group of heads, computing the chunk's cos and sin once for all of them. The
// operation is memory-bound: every element is read and written once.

namespace nsa::cuda::rotary {

inline constexpr int kThreads = 256;  // per CTA
// Pairs per chunk on the vector path: their first halves are one 16-byte load of 2-byte elements,
// their second halves another (the scalar path, for other h or unaligned rows, takes 1 pair).
inline constexpr int kVecPairs = 8;
// Heads one thread rotates with its cos and sin: the trigonometry costs 1/8 of a pass per head
// group; the loads of kHeadBatch heads are in flight at once.
inline constexpr int64_t kHeadsPerGroup = 8;
inline constexpr int kHeadBatch = 4;
inline constexpr int64_t kMaxGridY = 65535;  // gridDim.y's limit

struct Shape {
  int lanes = 1;                // threads across one token's chunks (blockDim.x): a power of 2, <= 32
  int tokens = kThreads;        // tokens per CTA (blockDim.y): lanes * tokens = kThreads
  int64_t heads_per_group = 1;  // heads one thread rotates
  int64_t grid_x = 0;           // CTAs over the tokens (<= T <= 2^31 - 1)
  int64_t grid_y = 0;           // head groups (<= kMaxGridY)
};

// chunks: pair chunks of one head (h / kVecPairs on the vector path, h on the scalar one). More
// chunks than 32: each lane loops over several. More heads than kHeadsPerGroup * kMaxGridY: larger
// groups, so that gridDim.y stays within its limit.
inline Shape shape_of(int64_t T, int64_t H, int64_t chunks) {
  Shape s;
  while (s.lanes < chunks && s.lanes < 32) s.lanes *= 2;
  s.tokens = kThreads / s.lanes;
  s.heads_per_group = std::max(kHeadsPerGroup, (H + kMaxGridY - 1) / kMaxGridY);
  s.grid_x = (T + s.tokens - 1) / s.tokens;
  s.grid_y = (H + s.heads_per_group - 1) / s.heads_per_group;
  return s;
}

}  // namespace nsa::cuda::rotary
