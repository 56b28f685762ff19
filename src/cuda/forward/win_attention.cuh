// Sliding-window attention (spec §6) of one query tile, with the gated combine of spec §7 in the
// epilogue. The selection branch (spec §5) runs before it in its own kernel (slc_attention.cuh),
// which leaves o_slc in memory for the combine.
//
// One CTA (4 warps) owns kWinRows = 64 query rows: 64/G neighbouring tokens x the G heads of one
// KV head; each warp owns 16 rows. The window keys [t0 - w + 1, t_last] of the tile stream in
// chunks of kWinChunk = 64 keys through a ring of shared buffers.
//
// No CTA-wide barrier in the loop: each warp waits by itself on the mbarrier of the chunk it
// needs (completed by the cp.async copies that fill it), multiplies it, and then counts itself
// off the buffer; the last of the four warps to leave a buffer refills it with the chunk `stages`
// places ahead. Warps thus drift apart by up to a ring's length, and up to stages - 1 chunks are
// in flight per CTA (one barrier per chunk, the version before, stalled 37.5% of the time there).
// Rows are masked to [t - w + 1, t]. o = g_cmp o_cmp + g_slc o_slc + g_win o_win is formed in
// registers (o_cmp and o_slc as stored, rounded to the storage type; o_win in fp32) and written once.
#pragma once

#include "cuda/common/attention_tile.cuh"
#include "cuda/common/kv_loops.cuh"
#include "cuda/common/check.h"
#include "cuda/common/launch.h"
#include "nsa/blocks.h"

namespace nsa::cuda {

inline constexpr int kWinThreads = kWinRows / 16 * 32;

// The query tile of a window CTA: rows / G tokens of one sequence x the G heads of KV head hk,
// later tiles first (blockIdx.x counts down within a sequence). False: past its sequence.
struct WinTile : SeqRowTile {
  int64_t t_last;  // the tile's last token
  __device__ __forceinline__ bool init(const BranchParams& p, int rows) {
    if (!SeqRowTile::init(p.seqs, p.log2_group, rows)) return false;
    t_last = t0 + tokens_valid - 1;
    return true;
  }
  // This thread's two rows (group and group + 8 of its warp's 16): query head, and token in the
  // sequence (-1: a padding row, which sees no key).
  __device__ __forceinline__ void thread_rows(const BranchParams& p, int (&head)[2], int64_t (&t_row)[2]) const {
    const int warp = threadIdx.x / 32, group_id = threadIdx.x % 32 / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + group_id + 8 * h;
      const int tok = row >> p.log2_group;
      head[h] = hk * p.group + (row & (p.group - 1));
      t_row[h] = tok < tokens_valid ? t0 + tok : -1;
    }
  }
};

// Row h's lse_win and normalised o_win (token t, query head `head`), where the caller asked for
// them (the public window op; the forward that keeps its branch outputs for the backward); with
// write_o false lse_win only (the staged epilogue writes o_win in whole pieces).
template <typename Storage, typename Tile>
__device__ __forceinline__ void win_write_branch(const BranchParams& p, const Tile& st, int h, int64_t t, int head,
                                                 float lse2, float inv, bool write_o = true) {
  const int quad = threadIdx.x % 4;
  if (p.lse[1] != nullptr && quad == 0)
    p.lse[1][t * p.lse_st[1] + head * p.lse_sh[1]] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
  if (write_o && p.o_branch[1] != nullptr) {
    Storage* orow = static_cast<Storage*>(p.o_branch[1]) + t * p.ob_st[1] + head * p.ob_sh[1];
#pragma unroll
    for (int i = 0; i < Tile::kOTiles; ++i)
      *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * quad) =
          StorageTraits<Storage>::pack(st.acc[i][2 * h] * inv, st.acc[i][2 * h + 1] * inv);
  }
}

// Normalise, write o_win and lse_win if wanted, then o = g_cmp o_cmp + g_slc o_slc + g_win o_win:
// the end of both window kernels, for this thread's rows h (t_row[h] < 0: a padding row).
template <typename Storage, typename Tile>
__device__ __forceinline__ void win_epilogue(const BranchParams& p, const Tile& st, const int64_t (&t_row)[2],
                                             const int (&head)[2], int64_t s0) {
  using Traits = StorageTraits<Storage>;
  const int quad = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lse2, inv;
    st.finish_row(h, lse2, inv);
    if (t_row[h] < 0) continue;
    const int64_t t = s0 + t_row[h];
    win_write_branch<Storage>(p, st, h, t, head[h], lse2, inv);
    if (!p.combine) continue;
    const Storage* g = static_cast<const Storage*>(p.g) + t * p.g_st + head[h] * p.g_sh;
    const float g_cmp = to_float(g[0]), g_slc = to_float(g[1]), g_win = to_float(g[2]);
    const Storage* oc = static_cast<const Storage*>(p.o_cmp) + t * p.oc_st + head[h] * p.oc_sh;
    const Storage* os = p.o_slc != nullptr ? static_cast<const Storage*>(p.o_slc) + t * p.os_st + head[h] * p.os_sh
                                           : nullptr;  // no selection branch: o_slc = 0
    Storage* orow = static_cast<Storage*>(p.o) + t * p.o_st + head[h] * p.o_sh;
#pragma unroll
    for (int i = 0; i < Tile::kOTiles; ++i) {
      const int col = i * 8 + 2 * quad;
      const float2 o_win = make_float2(st.acc[i][2 * h] * inv, st.acc[i][2 * h + 1] * inv);
      const float2 o_slc =
          os != nullptr ? Traits::unpack(*reinterpret_cast<const uint32_t*>(os + col)) : make_float2(0.f, 0.f);
      const float2 o = gated_pair(Traits::unpack(*reinterpret_cast<const uint32_t*>(oc + col)), o_slc, o_win, g_cmp,
                                  g_slc, g_win);
      *reinterpret_cast<uint32_t*>(orow + col) = Traits::pack(o.x, o.y);
    }
  }
}

// The sm_90a CTA is alone on its SM: what it reads from memory after its last chunk (the staged
// combine's o_cmp, o_slc and gates) and what the CTA after it reads before its first (its Q tile:
// prefetch_q_tile_ahead) would be waited on with nothing to hide the wait. So while the loop still
// has kWinPrefetchAhead chunks to go, the CTA prefetches them into L2. Prefetches change no value.
inline constexpr int kWinPrefetchAhead = 4;
// The combine's reads (CudaKernelChoices::combine_prefetch): thread i takes row i % kRows of
// o_cmp (i < kRows, with the row's gates) or of o_slc, one prefetch per 128-byte line.
template <typename Storage, int kRows, int kDv>
__device__ __forceinline__ void win_prefetch_combine(const BranchParams& p, const WinTile& wt) {
  static_assert(kRows / 16 * 32 == 2 * kRows, "two threads a row: one for o_cmp, one for o_slc");
  const int row = threadIdx.x % kRows, tok = row >> p.log2_group;
  if (tok >= wt.tokens_valid) return;
  prefetch_combine_row<Storage, kDv>(p, wt.s0 + wt.t0 + tok, wt.hk * p.group + (row & (p.group - 1)),
                                     threadIdx.x < kRows, p.o_slc, p.os_st, p.os_sh);
}

// The gated combine of the sm_90a kernel, staged through shared memory (the K/V buffers and the Q
// tile are free after the loop): each thread normalises its rows of o_win into an fp32 tile
// [kRows][kDv + 8] (and its rows' gates), then the CTA forms o = g_cmp o_cmp + g_slc o_slc +
// g_win o_win in 16-byte pieces, consecutive threads on consecutive pieces of a row: o_cmp and
// o_slc are read and o (and o_win where wanted) written in whole 128-byte lines, all of a thread's
// pieces in flight at once. (Read in the accumulator layout, a warp's load touched 8 rows x 4
// bytes per 32-byte sector, two loads per column pair for o_cmp, and the CTA, alone on its SM,
// waited on them.) The numbers are those of win_epilogue: o_win in fp32, the same expression per
// element, and o_win rounded from the same fp32 values. Without p.combine (the selection kernels
// combine after the window) it writes o_win alone, in the same whole lines.
template <int kRows, int kDv>
constexpr size_t win_staged_bytes() {
  return size_t(kRows) * ((kDv + 8) + 4) * sizeof(float);
}
template <typename Storage, int kRows, int kDv, typename Tile>
__device__ __forceinline__ void win_epilogue_staged(const BranchParams& p, const Tile& st, const WinTile& wt,
                                                    const int64_t (&t_row)[2], const int (&head)[2],
                                                    unsigned char* smem) {
  using Traits = StorageTraits<Storage>;
  constexpr int kThreads = kRows / 16 * 32;
  constexpr int kStride = kDv + 8;  // floats per staged row: 8 rows of a warp on distinct banks
  float* ow = reinterpret_cast<float*>(smem);  // [kRows][kStride]
  float* gates = ow + kRows * kStride;         // [kRows][4]: g_cmp, g_slc, g_win
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4;
  __syncthreads();  // every warp is done with the K/V buffers and the Q tile
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lse2, inv;
    st.finish_row(h, lse2, inv);
    const int row = warp * 16 + lane / 4 + 8 * h;
    float* orow = ow + row * kStride;
#pragma unroll
    for (int i = 0; i < Tile::kOTiles; ++i)
      *reinterpret_cast<float2*>(orow + i * 8 + 2 * quad) = make_float2(st.acc[i][2 * h] * inv, st.acc[i][2 * h + 1] * inv);
    if (t_row[h] < 0) continue;
    const int64_t t = wt.s0 + t_row[h];
    win_write_branch<Storage>(p, st, h, t, head[h], lse2, inv, /*write_o=*/false);
    if (p.combine && quad < 3) {
      const Storage* g = static_cast<const Storage*>(p.g) + t * p.g_st + head[h] * p.g_sh;
      gates[row * 4 + quad] = to_float(g[quad]);
    }
  }
  __syncthreads();
  constexpr int kPieces = kDv / 8;  // 16-byte pieces of a row
  constexpr int kIters = kRows * kPieces / kThreads;
  static_assert(kRows * kPieces % kThreads == 0, "whole rounds of pieces");
  // All loads first (o may alias nothing here, but the compiler cannot know: loads after a store
  // would wait for it), then the sums and stores.
  uint4 oc[kIters], os[kIters];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int e = threadIdx.x + k * kThreads;
    const int row = e / kPieces, col = e % kPieces * 8;
    const int tok = row >> p.log2_group;
    oc[k] = os[k] = make_uint4(0u, 0u, 0u, 0u);  // no selection branch: o_slc = 0
    if (!p.combine || tok >= wt.tokens_valid) continue;
    const int64_t t = wt.s0 + wt.t0 + tok;
    const int hq = wt.hk * p.group + (row & (p.group - 1));
    oc[k] = *reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.o_cmp) + t * p.oc_st + hq * p.oc_sh + col);
    if (p.o_slc != nullptr)
      os[k] = *reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.o_slc) + t * p.os_st + hq * p.os_sh + col);
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int e = threadIdx.x + k * kThreads;
    const int row = e / kPieces, col = e % kPieces * 8;
    const int tok = row >> p.log2_group;
    if (tok >= wt.tokens_valid) continue;
    const int64_t t = wt.s0 + wt.t0 + tok;
    const int hq = wt.hk * p.group + (row & (p.group - 1));
    const float4 w0 = *reinterpret_cast<const float4*>(ow + row * kStride + col);
    const float4 w1 = *reinterpret_cast<const float4*>(ow + row * kStride + col + 4);
    const float win[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    if (p.combine) {
      const float g_cmp = gates[row * 4], g_slc = gates[row * 4 + 1], g_win = gates[row * 4 + 2];
      const uint32_t ocw[4] = {oc[k].x, oc[k].y, oc[k].z, oc[k].w}, osw[4] = {os[k].x, os[k].y, os[k].z, os[k].w};
      uint32_t out[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 o = gated_pair(Traits::unpack(ocw[q]), Traits::unpack(osw[q]),
                                    make_float2(win[2 * q], win[2 * q + 1]), g_cmp, g_slc, g_win);
        out[q] = Traits::pack(o.x, o.y);
      }
      *reinterpret_cast<uint4*>(static_cast<Storage*>(p.o) + t * p.o_st + hq * p.o_sh + col) =
          make_uint4(out[0], out[1], out[2], out[3]);
    }
    if (p.o_branch[1] != nullptr) {
      uint32_t ow4[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) ow4[q] = Traits::pack(win[2 * q], win[2 * q + 1]);
      *reinterpret_cast<uint4*>(static_cast<Storage*>(p.o_branch[1]) + t * p.ob_st[1] + hq * p.ob_sh[1] + col) =
          make_uint4(ow4[0], ow4[1], ow4[2], ow4[3]);
    }
  }
}

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kWinThreads) win_attention_kernel(const BranchParams p) {
  if constexpr (kWgmmaCompiled) {
    __trap();  // sm_90a runs win_attention_wgmma_kernel below
  } else {
    using Tile = TileAttention<Storage, kDqk, kDv, kWinRows, kWinChunk>;
    static_assert(Tile::kCtaThreads == kWinThreads, "one thread count for the kernel and its tile");
    constexpr int kChunk = kWinChunk;
    constexpr int kWarpsPerCta = kWinThreads / 32;
    constexpr int kStages = win_stages(kDqk, kDv);
    constexpr int kQStages = win_q_stages(kDqk, kDv);
    static_assert(kQStages < kStages, "the Q tile borrows some stages of the ring, not all");
    constexpr size_t kKTile = size_t(kChunk) * Tile::kKStride;  // elements of one K buffer
    constexpr size_t kVTile = size_t(kChunk) * Tile::kVStride;
    constexpr size_t kStageElems = kKTile + kVTile;  // a stage: K [kChunk][Dqk+8], then V [kChunk][Dv+8]
    static_assert(kStageElems * sizeof(Storage) == win_stage_bytes(kDqk, kDv), "one stage size");
    extern __shared__ __align__(16) unsigned char smem[];
    Storage* ring = reinterpret_cast<Storage*>(smem);        // [kStages][kStageElems]
    Storage* sq = ring + (kStages - kQStages) * kStageElems;  // the Q tile, at first
    // full[s]: completes when the copies of the chunk in stage s have landed (one arrival per lane
    // of the warp that issued them). left[s]: warps that have finished with stage s, counted up
    // forever: the use k of stage s ends at 4k + 4.
    __shared__ __align__(8) uint64_t s_full[kStages];
    __shared__ int s_left[kStages];

    WinTile wt;
    if (!wt.init(p, kWinRows)) return;
    const int hk = wt.hk, tokens_valid = wt.tokens_valid;
    const int64_t s0 = wt.s0, t0 = wt.t0, t_last = wt.t_last;

    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages; ++i) {
        mbarrier_init(&s_full[i], 32);
        s_left[i] = 0;
      }
    }
    load_q_tile<Storage, kDqk, kWinRows>(sq, static_cast<const Storage*>(p.q), p.q_st, p.q_sh, s0 + t0, tokens_valid,
                                         hk * p.group, p.log2_group);
    cp_async_commit();

    __syncthreads();  // the barriers are initialised

    const int64_t win_lo = p.window > 0 ? window_start(t0, p.window) : 0;
    const int num_chunks = p.window > 0 ? static_cast<int>((t_last - win_lo + kChunk) / kChunk) : 0;
    const Storage* kw = static_cast<const Storage*>(p.k_win) + s0 * p.kw_st + hk * p.kw_sh;
    const Storage* vw = static_cast<const Storage*>(p.v_win) + s0 * p.vw_st + hk * p.vw_sh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Issued by the 32 lanes of one warp: chunk c into its stage, then one arrival per lane on the
    // stage's full barrier when the lane's copies have landed. Rows past the chunk are zero-filled.
    auto issue_chunk = [&](int c) {
      const int64_t first = win_lo + int64_t(c) * kChunk;
      const int count = static_cast<int>(min64(kChunk, t_last + 1 - first));
      Storage* sk = ring + (c % kStages) * kStageElems;
      Storage* sv = sk + kKTile;
      const Storage* kbase = kw + first * p.kw_st;
      const Storage* vbase = vw + first * p.vw_st;
      constexpr int kKPieces = kDqk / 8, kVPieces = kDv / 8;  // 16-byte pieces of a row
      for (int e = lane; e < kChunk * kKPieces; e += 32) {
        const int r = e / kKPieces, piece = e % kKPieces;
        cp_async_16(sk + r * Tile::kKStride + piece * 8, r < count ? kbase + r * p.kw_st + piece * 8 : kbase, r < count);
      }
      for (int e = lane; e < kChunk * kVPieces; e += 32) {
        const int r = e / kVPieces, piece = e % kVPieces;
        cp_async_16(sv + r * Tile::kVStride + piece * 8, r < count ? vbase + r * p.vw_st + piece * 8 : vbase, r < count);
      }
      cp_async_arrive_noinc(&s_full[c % kStages]);
    };
    int head[2];
    int64_t t_row[2];
    wt.thread_rows(p, head, t_row);

    Tile st;
    st.reset(softmax_slack(p.choices));

    // Prologue: warp 0 fills the stages Q does not occupy, then every warp takes its Q fragments,
    // then warp 0 fills the stages Q occupied.
    if (warp == 0)
      for (int c = 0; c < min(kStages - kQStages, num_chunks); ++c) issue_chunk(c);
    cp_async_wait<0>();  // the Q tile's group (the chunk copies belong to no group)
    __syncthreads();
    st.load_q_fragments(sq);
    __syncthreads();  // Q's stages are free once every warp holds its fragments
    if (warp == 0)
      for (int c = kStages - kQStages; c < min(kStages, num_chunks); ++c) issue_chunk(c);

    for (int c = 0; c < num_chunks; ++c) {
      const int stage = c % kStages, use = c / kStages;
      mbarrier_wait_parity(&s_full[stage], use & 1);
      const int64_t first = win_lo + int64_t(c) * kChunk;
      const int count = static_cast<int>(min64(kChunk, t_last + 1 - first));
      // A warp whose 16 rows all precede the chunk, or whose windows all end before it, skips it.
      bool row_on[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) row_on[h] = t_row[h] >= first && t_row[h] - p.window + 1 < first + kChunk;
      if (__any_sync(0xffffffffu, row_on[0] || row_on[1])) {
        const Storage* sk = ring + stage * kStageElems;
        float s[Tile::kSTiles][4];
        st.scores(s, sk);
        // Row h keeps the chunk's keys [lo, hi): loaded, not after its token, in its window.
        int lo[2], hi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          hi[h] = row_on[h] ? static_cast<int>(min64(count, t_row[h] - first + 1)) : 0;
          lo[h] = static_cast<int>(max64(0, min64(kChunk, t_row[h] - p.window + 1 - first)));
        }
        st.mask(s, lo, hi);
        st.softmax_update(s, p.scale_log2);
        st.accumulate_pv(s, sk + kKTile);
      }
      // Leave the stage (every lane's shared reads are done: their values fed the mma above). The
      // last warp to leave refills it with chunk c + kStages.
      __syncwarp();
      int last = 0;
      if (lane == 0) {
        __threadfence_block();
        last = atomicAdd(&s_left[stage], 1) == kWarpsPerCta * use + kWarpsPerCta - 1;
      }
      last = __shfl_sync(0xffffffffu, last, 0);
      if (last && c + kStages < num_chunks) issue_chunk(c + kStages);
    }

    win_epilogue<Storage>(p, st, t_row, head, s0);
  }
}

// sm_90a: the window in tiles of kWinWgRows = kWgRows = 192 rows (three warpgroups share every K/V
// chunk: a third of the L2 reads per row of the 64-row kernel), scores and P V as warpgroup MMAs
// (TileAttention::scores_wgmma_sq / accumulate_pv_wgmma), K/V chunks of kChunk keys (64, or
// kWinLongChunk = 112 where win_chunk_keys takes it) through the TMA ring of the compressed branch's
// pass 1 (tma_ring_attention, win_tma_stages stages; with 64-key chunks double-buffered cp.async
// and one CTA barrier per chunk where a tensor map cannot be encoded, cmp_attention.cuh) over the
// keys [t0 - w + 1, t_last] of the tile, each row masked to [t - w + 1, t], and the same epilogue as
// win_attention_kernel. Q is read by the score products from the swizzled Q tile
// (scores_wgmma_sq). Not compiled for other targets.
inline constexpr int kWinWgRows = kWgRows;
// With TMA (tma_ring_attention) the ring's mbarriers and counters sit past both the ring and the
// staged combine's bytes, which reuse the ring's.
constexpr size_t win_staged_bytes_of(int dv) {
  return dv == 64 ? win_staged_bytes<kWinWgRows, 64>() : win_staged_bytes<kWinWgRows, 128>();
}
constexpr size_t win_tma_bar_offset(int dqk, int dv, int chunk = kWinChunk) {
  const size_t staged = win_staged_bytes_of(dv);
  const size_t ring = tma_ring_end(kWinWgRows, dqk, dv, chunk, win_tma_stages(dqk, dv, chunk));
  return ((ring > staged ? ring : staged) + 7) / 8 * 8;
}
constexpr size_t win_wgmma_smem_bytes(int dqk, int dv, int chunk = kWinChunk) {
  const size_t tma = win_tma_bar_offset(dqk, dv, chunk) + tma_ring_bar_bytes(win_tma_stages(dqk, dv, chunk));
  if (chunk != kWinChunk) return tma;  // TMA only
  const size_t loop = cmp_smem_bytes(kWinWgRows, dqk, dv, 1, 0, /*with_v=*/true, /*with_scores=*/false);
  const size_t staged = win_staged_bytes_of(dv);
  const size_t cp = loop > staged ? loop : staged;  // the staged combine reuses the loop's buffers
  return cp > tma ? cp : tma;
}
static_assert(win_tma_stages(128, 128, kWinChunk) == kCmpTmaStages && win_tma_stages(192, 128, kWinChunk) == kCmpTmaStages,
              "64-key chunks keep the 3-stage ring");

template <typename Storage, int kDqk, int kDv, int kChunk = kWinChunk>
__global__ void __launch_bounds__(kWinWgRows / 16 * 32)
    win_attention_wgmma_kernel(const BranchParams p, const __grid_constant__ CUtensorMap kw_map,
                               const __grid_constant__ CUtensorMap vw_map, int kv_tma, int next_q_ahead) {
  if constexpr (!kWgmmaCompiled) {
    __trap();  // launched only where the wgmma body runs (sm_90a)
  } else {
    constexpr int kRows = kWinWgRows;
    constexpr int kStages = win_tma_stages(kDqk, kDv, kChunk);
    using Tile = TileAttention<Storage, kDqk, kDv, kRows, kChunk>;
    using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;  // the Q tile, the ring after it; the 64-key cp.async plan
    static_assert(Smem::kWgmma && Smem::Tile::kQBytes == Tile::kQBytes, "the pass-1 plan's Q tile, swizzled");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm(smem_raw);

    WinTile wt;
    if (!wt.init(p, kRows)) return;
    const int hk = wt.hk, tokens_valid = wt.tokens_valid;
    const int64_t s0 = wt.s0, t0 = wt.t0, t_last = wt.t_last;
    sm.load_q(static_cast<const Storage*>(p.q), p.q_st, p.q_sh, s0 + t0, tokens_valid, hk * p.group, p.log2_group);
    cp_async_commit();

    const int64_t win_lo = p.window > 0 ? window_start(t0, p.window) : 0;
    const int num_chunks = p.window > 0 ? static_cast<int>((t_last - win_lo + kChunk) / kChunk) : 0;
    int head[2];
    int64_t t_row[2];
    wt.thread_rows(p, head, t_row);

    Tile st;
    st.reset(softmax_slack(p.choices));
    // The chunk at which the combine's reads and the next CTA's Q are prefetched (about
    // kWinPrefetchAhead 64-key chunks before the end).
    constexpr int kPrefetchAhead = (kWinPrefetchAhead * kWinChunk + kChunk / 2) / kChunk;
    const int prefetch_at = max(0, num_chunks - kPrefetchAhead);
    const bool prefetch_combine = p.combine && p.choices.combine_prefetch;
    // Row h keeps chunk c's keys [lo, hi): loaded, not after its token, in its window.
    auto limits = [&](int c, int (&lo)[2], int (&hi)[2]) {
      if (c == prefetch_at) {
        if (prefetch_combine) win_prefetch_combine<Storage, kRows, kDv>(p, wt);
        prefetch_q_tile_ahead<Storage, kRows, kDqk>(p.q, p.q_st, p.q_sh, p.seqs, p.log2_group, next_q_ahead);
      }
      const int64_t first = win_lo + int64_t(c) * kChunk;
      const int count = static_cast<int>(min64(kChunk, t_last + 1 - first));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi[h] = t_row[h] >= first ? static_cast<int>(min64(count, t_row[h] - first + 1)) : 0;
        lo[h] = static_cast<int>(max64(0, min64(kChunk, t_row[h] - p.window + 1 - first)));
      }
    };
    if (kv_tma) {
      uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + win_tma_bar_offset(kDqk, kDv, kChunk));
      const int count_last =
          num_chunks > 0 ? static_cast<int>(t_last + 1 - (win_lo + int64_t(num_chunks - 1) * kChunk)) : kChunk;
      tma_ring_attention<Storage, kDqk, kDv, kRows, kChunk, kStages, /*kPingPong=*/true>(
          st, sm.sq, sm.sk, bars, &kw_map, &vw_map, hk, static_cast<int>(s0 + win_lo), num_chunks, count_last,
          p.scale_log2, [&](int c, float (&s)[Tile::kSTiles][4]) {
            int lo[2], hi[2];
            limits(c, lo, hi);
            st.mask(s, lo, hi);
          });
    } else if constexpr (kChunk == kWinChunk) {  // without TMA: one CTA barrier per chunk (cmp_attention.cuh)
      const Storage* kw = static_cast<const Storage*>(p.k_win) + s0 * p.kw_st + hk * p.kw_sh;
      const Storage* vw = static_cast<const Storage*>(p.v_win) + s0 * p.vw_st + hk * p.vw_sh;
      auto load_chunk = [&](int c, int buf) {
        const int64_t first = win_lo + int64_t(c) * kChunk;
        const int count = static_cast<int>(min64(kChunk, t_last + 1 - first));
        Smem::load_k(sm.sk + buf * Smem::kKTile, kw + first * p.kw_st, p.kw_st, count);
        Smem::load_v(sm.sv + buf * Smem::kVTile, vw + first * p.vw_st, p.vw_st, count);
        cp_async_commit();
      };
      cp_async_chunk_loop(sm, st, num_chunks, p.scale_log2, load_chunk, limits);
    } else {
      __trap();  // longer chunks are launched only with tensor maps
    }
    if (p.combine || p.o_branch[1] != nullptr)  // o (and o_win), or o_win alone, in whole lines
      win_epilogue_staged<Storage, kRows, kDv>(p, st, wt, t_row, head, smem_raw);
    else
      win_epilogue<Storage>(p, st, t_row, head, s0);
  }
}

// The sm_90a window in chunks of kChunk keys, its K/V boxes of kChunk rows; false (nothing
// launched) where kChunk is longer than 64 and a tensor map cannot be made.
template <typename Storage, int kDqk, int kDv, int kChunk>
bool launch_win_wgmma(const BranchParams& p, dim3 grid, cudaStream_t stream) {
  const auto wg = win_attention_wgmma_kernel<Storage, kDqk, kDv, kChunk>;
  constexpr size_t kSmem = win_wgmma_smem_bytes(kDqk, kDv, kChunk);
  static_assert(kSmem <= kMaxSmem, "the sm_90a window tile fits in shared memory");
  CUtensorMap kw_map{}, vw_map{};
  const int64_t T = p.seqs.total_tokens;
  const int kv_tma = p.window > 0 &&
                             kv_rows_tensor_map<Storage, kDqk>(&kw_map, p.choices, p.k_win, p.hkv, T, p.kw_st, p.kw_sh,
                                                               kChunk) &&
                             kv_rows_tensor_map<Storage, kDv>(&vw_map, p.choices, p.v_win, p.hkv, T, p.vw_st, p.vw_sh,
                                                              kChunk)
                         ? 1
                         : 0;
  if (kChunk != kWinChunk && !kv_tma) return false;
  allow_smem(wg, kSmem, /*max_carveout=*/true);
  const int next_q_ahead = p.choices.next_q_prefetch ? resident_ctas(wg, kWinWgRows / 16 * 32, kSmem) : 0;
  wg<<<grid, kWinWgRows / 16 * 32, kSmem, stream>>>(p, kw_map, vw_map, kv_tma, next_q_ahead);
  NSA_CUDA_CHECK_LAUNCH();
  return true;
}

// sm_90a: the wgmma kernel in 192-row tiles, in the chunks win_chunk_keys picks (112 keys only with
// tensor maps, else 64); elsewhere (sm_80 and the compute_80 PTX) the 64-row mma.sync kernel with its
// ring of stages.
template <typename Storage, int kDqk, int kDv>
void launch_win_attention(const BranchParams& p, cudaStream_t stream) {
  if (cmp_runs_wgmma(win_attention_wgmma_kernel<Storage, kDqk, kDv>)) {
    const dim3 grid = row_tile_grid(p.seqs.max_seqlen, p.seqs.batch, kWinWgRows / p.group, p.hkv);
    if (grid.x == 0) return;
    if constexpr (win_long_chunk_compiled(kDqk, kDv)) {
      if (win_chunk_keys(p.window, p.group, kDqk, kDv, p.choices.win_chunk) == kWinLongChunk &&
          launch_win_wgmma<Storage, kDqk, kDv, kWinLongChunk>(p, grid, stream))
        return;
    }
    launch_win_wgmma<Storage, kDqk, kDv, kWinChunk>(p, grid, stream);
    return;
  }
  const size_t smem = win_smem_bytes(kDqk, kDv);
  const auto kernel = win_attention_kernel<Storage, kDqk, kDv>;
  allow_smem(kernel, smem, /*max_carveout=*/true);  // as many 108 KB rings per SM as fit
  const dim3 grid = row_tile_grid(p.seqs.max_seqlen, p.seqs.batch, kWinRows / p.group, p.hkv);
  if (grid.x == 0) return;
  kernel<<<grid, kWinThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
