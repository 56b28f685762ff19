// Selection (spec §5) and sliding-window (spec §6) attention of one query tile, with the gated
// combine of spec §7 in the epilogue.
//
// One CTA (4 warps) owns kSlcRows = 64 query rows: 64/G neighbouring tokens x the G heads of one
// KV head; each warp owns 16 rows. Selection: the tile's tokens picked up to n blocks each; the
// CTA builds the union of their blocks (a bitmap, then a sorted list) and streams each union block
// once, in chunks of kSlcChunk = 32 keys, through a ring of shared buffers; window: the keys
// [t0 - w + 1, t_last] of the tile, after the selection chunks in the same ring.
//
// No CTA-wide barrier in the loop: each warp waits by itself on the mbarrier of the chunk it
// needs (completed by the cp.async copies that fill it), multiplies the chunk only if one of its
// rows picked the block (at G = 16 with random picks a warp's token uses 16 of the ~55 union
// blocks), and then counts itself off the buffer; the last of the four warps to leave a buffer
// refills it with the chunk `stages` places ahead. Warps thus drift apart by up to a ring's
// length, and up to stages - 1 chunks are in flight per CTA: the kernel is bound by the bytes in
// flight from L2, not by waiting for the slowest warp (the previous version, one barrier per
// chunk, stalled 37.5% of the time there).
// Rows mask the blocks their token did not pick and the keys after the token; window rows are
// masked to [t - w + 1, t]. The two branches run one after the other with the same Q fragments;
// the gated sum g_slc o_slc + g_win o_win + g_cmp o_cmp is formed in registers and written once
// (o_slc held rounded to the storage type, as a plain implementation stores each branch output).
#pragma once

#include "cuda/attention_tile.cuh"
#include "cuda/common/check.h"
#include "nsa/blocks.h"

namespace nsa::cuda {

// The two values of a register packed by StorageTraits::pack, back to fp32 (exact).
template <typename Storage>
__device__ __forceinline__ float2 unpack_pair(uint32_t packed) {
  if constexpr (StorageTraits<Storage>::is_bf16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  }
}

inline constexpr int kSlcThreads = kSlcRows / 16 * 32;

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kSlcThreads) slc_win_attention_kernel(const SlcWinParams p) {
  using Tile = TileAttention<Storage, kDqk, kDv, kSlcRows, kSlcChunk>;
  using Traits = StorageTraits<Storage>;
  static_assert(Tile::kCtaThreads == kSlcThreads, "one thread count for the kernel and its tile");
  constexpr int kChunk = kSlcChunk;
  constexpr int kWarpsPerCta = kSlcThreads / 32;
  constexpr int kStages = slc_win_stages(kDqk, kDv);
  constexpr int kQStages = slc_win_q_stages(kDqk, kDv);
  static_assert(kQStages < kStages, "the Q tile borrows some stages of the ring, not all");
  constexpr size_t kKTile = size_t(kChunk) * Tile::kKStride;  // elements of one K buffer
  constexpr size_t kVTile = size_t(kChunk) * Tile::kVStride;
  constexpr size_t kStageElems = kKTile + kVTile;  // a stage: K [kChunk][Dqk+8], then V [kChunk][Dv+8]
  static_assert(kStageElems * sizeof(Storage) == slc_win_stage_bytes(kDqk, kDv), "one stage size");
  extern __shared__ __align__(16) unsigned char smem[];
  Storage* ring = reinterpret_cast<Storage*>(smem);                // [kStages][kStageElems]
  Storage* sq = ring + (kStages - kQStages) * kStageElems;          // the Q tile, at first
  int32_t* s_idx = reinterpret_cast<int32_t*>(ring + kStages * kStageElems);
  const int tokens_per_tile = kSlcRows >> p.log2_group;
  uint32_t* s_bitmap = reinterpret_cast<uint32_t*>(s_idx + tokens_per_tile * p.n_sel);  // [bitmap_words]
  int32_t* s_union = reinterpret_cast<int32_t*>(s_bitmap + p.bitmap_words);            // [union_capacity]
  __shared__ int s_union_count;
  // full[s]: completes when the copies of the chunk in stage s have landed (one arrival per lane
  // of the warp that issued them). left[s]: warps that have finished with stage s, counted up
  // forever: the use k of stage s ends at 4k + 4.
  __shared__ __align__(8) uint64_t s_full[kStages];
  __shared__ int s_left[kStages];

  const int64_t tiles_per_seq = (p.seqs.max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
  const int b = static_cast<int>(blockIdx.x / tiles_per_seq);
  const int64_t tile = tiles_per_seq - 1 - blockIdx.x % tiles_per_seq;
  const int hk = blockIdx.y;
  int64_t s0, len;
  sequence_bounds(p.seqs, b, s0, len);
  const int64_t t0 = tile * tokens_per_tile;
  if (t0 >= len) return;
  const int tokens_valid = static_cast<int>(min64(tokens_per_tile, len - t0));
  const int64_t t_last = t0 + tokens_valid - 1;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(&s_full[i], 32);
      s_left[i] = 0;
    }
  }
  load_q_tile<Storage, kDqk, kSlcRows>(sq, static_cast<const Storage*>(p.q), p.q_st, p.q_sh, s0 + t0, tokens_valid,
                                       hk * p.group, p.log2_group);
  cp_async_commit();

  __syncthreads();  // the barriers are initialised

  // ---- Union of the tile's selected blocks ----
  int slc_blocks = 0;
  if (p.has_slc && p.n_sel > 0) {
    for (int e = threadIdx.x; e < p.bitmap_words; e += kSlcThreads) s_bitmap[e] = 0u;
    __syncthreads();
    for (int e = threadIdx.x; e < tokens_per_tile * p.n_sel; e += kSlcThreads) {
      const int token = e / p.n_sel, k = e % p.n_sel;
      int32_t j = -1;
      if (token < tokens_valid) j = p.indices[(s0 + t0 + token) * p.idx_st + hk * p.idx_sh + k];
      s_idx[e] = j;
      // Blocks past the bitmap start after every token of the sequence: they hold no key.
      if (j >= 0 && j < p.bitmap_words * 32) atomicOr(&s_bitmap[j / 32], 1u << (j % 32));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the first warp compacts the bitmap into an ascending list
      const int lane = threadIdx.x;
      int total = 0;
      for (int base = 0; base < p.bitmap_words; base += 32) {
        const uint32_t word = base + lane < p.bitmap_words ? s_bitmap[base + lane] : 0u;
        const int cnt = __popc(word);
        int prefix = cnt;  // inclusive scan over the lanes
        for (int off = 1; off < 32; off *= 2) {
          const int other = __shfl_up_sync(0xffffffffu, prefix, off);
          if (lane >= off) prefix += other;
        }
        int pos = total + prefix - cnt;
        for (uint32_t w = word; w != 0u; w &= w - 1u) s_union[pos++] = (base + lane) * 32 + __ffs(w) - 1;
        total += __shfl_sync(0xffffffffu, prefix, 31);
      }
      if (lane == 0) s_union_count = total;
    }
    __syncthreads();
    slc_blocks = s_union_count;
  }
  const int chunks_per_block = (p.lp + kChunk - 1) / kChunk;
  const int slc_chunks = slc_blocks * chunks_per_block;
  const int64_t win_lo = p.window > 0 ? window_start(t0, p.window) : 0;
  const int win_chunks = p.has_win && p.window > 0 ? static_cast<int>((t_last - win_lo + kChunk) / kChunk) : 0;
  const int num_chunks = slc_chunks + win_chunks;

  const Storage* ks = static_cast<const Storage*>(p.k_slc) + s0 * p.ks_st + hk * p.ks_sh;
  const Storage* vs = static_cast<const Storage*>(p.v_slc) + s0 * p.vs_st + hk * p.vs_sh;
  const Storage* kw = static_cast<const Storage*>(p.k_win) + s0 * p.kw_st + hk * p.kw_sh;
  const Storage* vw = static_cast<const Storage*>(p.v_win) + s0 * p.vw_st + hk * p.vw_sh;
  // Chunk c: its first key position, how many keys are loaded, and (selection) its block.
  auto chunk_range = [&](int c, int64_t& first, int& count, int& block) {
    int64_t end;
    if (c < slc_chunks) {
      block = s_union[c / chunks_per_block];
      first = int64_t(block) * p.lp + int64_t(c % chunks_per_block) * kChunk;
      end = min64(int64_t(block + 1) * p.lp, t_last + 1);
    } else {
      block = -1;
      first = win_lo + int64_t(c - slc_chunks) * kChunk;
      end = t_last + 1;
    }
    count = static_cast<int>(max64(0, min64(kChunk, end - first)));
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Issued by the 32 lanes of one warp: chunk c into its stage, then one arrival per lane on the
  // stage's full barrier when the lane's copies have landed. Rows past the chunk are zero-filled.
  auto issue_chunk = [&](int c) {
    int64_t first;
    int count, block;
    chunk_range(c, first, count, block);
    const bool slc = c < slc_chunks;
    Storage* sk = ring + (c % kStages) * kStageElems;
    Storage* sv = sk + kKTile;
    const Storage* kbase = slc ? ks + first * p.ks_st : kw + first * p.kw_st;
    const Storage* vbase = slc ? vs + first * p.vs_st : vw + first * p.vw_st;
    const int64_t kst = slc ? p.ks_st : p.kw_st, vst = slc ? p.vs_st : p.vw_st;
    constexpr int kKPieces = kDqk / 8, kVPieces = kDv / 8;  // 16-byte pieces of a row
    for (int e = lane; e < kChunk * kKPieces; e += 32) {
      const int r = e / kKPieces, piece = e % kKPieces;
      cp_async_16(sk + r * Tile::kKStride + piece * 8, r < count ? kbase + r * kst + piece * 8 : kbase, r < count);
    }
    for (int e = lane; e < kChunk * kVPieces; e += 32) {
      const int r = e / kVPieces, piece = e % kVPieces;
      cp_async_16(sv + r * Tile::kVStride + piece * 8, r < count ? vbase + r * vst + piece * 8 : vbase, r < count);
    }
    cp_async_arrive_noinc(&s_full[c % kStages]);
  };
  const int group_id = lane / 4, quad = lane % 4;
  int row[2], tok[2], head[2];
  int64_t t_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + group_id + 8 * h;
    tok[h] = row[h] >> p.log2_group;
    head[h] = hk * p.group + (row[h] & (p.group - 1));
    t_row[h] = tok[h] < tokens_valid ? t0 + tok[h] : -1;  // -1: a padding row sees no key
  }

  Tile st;
  st.reset();
  // The selection branch's normalised output, rounded to the storage type as a plain
  // implementation stores o_slc, two values per register (rows group and group + 8 of each n8
  // tile). A second fp32 accumulator for the gated sum held 64 more registers through the window
  // loop (255 registers with spills); packed, it holds 32.
  uint32_t slc_out[Tile::kOTiles][2];

  // Normalises the finished branch (0 = slc, 1 = win) and writes what is wanted; after the
  // window branch, o = g_cmp o_cmp + g_slc o_slc + g_win o_win is formed and written once.
  auto finish_branch = [&](int branch) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lse2, inv;
      st.finish_row(h, lse2, inv);
      uint32_t packed[Tile::kOTiles];
#pragma unroll
      for (int i = 0; i < Tile::kOTiles; ++i) {
        packed[i] = Traits::pack(st.acc[i][2 * h] * inv, st.acc[i][2 * h + 1] * inv);
        if (branch == 0) slc_out[i][h] = packed[i];
      }
      if (t_row[h] < 0) continue;
      const int64_t t = s0 + t_row[h];
      if (p.lse[branch] != nullptr && quad == 0)
        p.lse[branch][t * p.lse_st[branch] + head[h] * p.lse_sh[branch]] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
      if (p.o_branch[branch] != nullptr) {
        Storage* orow = static_cast<Storage*>(p.o_branch[branch]) + t * p.ob_st[branch] + head[h] * p.ob_sh[branch];
#pragma unroll
        for (int i = 0; i < Tile::kOTiles; ++i) *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * quad) = packed[i];
      }
      if (branch == 1 && p.combine) {
        const Storage* g = static_cast<const Storage*>(p.g) + t * p.g_st + head[h] * p.g_sh;
        const float g_cmp = to_float(g[0]), g_slc = to_float(g[1]), g_win = to_float(g[2]);
        const Storage* oc = static_cast<const Storage*>(p.o_cmp) + t * p.oc_st + head[h] * p.oc_sh;
        Storage* orow = static_cast<Storage*>(p.o) + t * p.o_st + head[h] * p.o_sh;
#pragma unroll
        for (int i = 0; i < Tile::kOTiles; ++i) {
          const int col = i * 8 + 2 * quad;
          const float2 o_slc = unpack_pair<Storage>(slc_out[i][h]);
          const float lo = g_slc * o_slc.x + g_win * st.acc[i][2 * h] * inv + g_cmp * to_float(oc[col]);
          const float hi = g_slc * o_slc.y + g_win * st.acc[i][2 * h + 1] * inv + g_cmp * to_float(oc[col + 1]);
          *reinterpret_cast<uint32_t*>(orow + col) = Traits::pack(lo, hi);
        }
      }
    }
    st.reset();
  };

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

  bool picked[2] = {false, false};  // whether row h's token picked the current union block
  for (int c = 0; c < num_chunks; ++c) {
    if (c == slc_chunks) finish_branch(0);  // the window branch starts
    const int stage = c % kStages, use = c / kStages;
    // Every warp waits for every chunk, also one it skips: then all of a stage's departures of
    // use k precede its refill and every departure of use k + 1 (the count below stays exact).
    mbarrier_wait_parity(&s_full[stage], use & 1);
    int64_t first;
    int count, block;
    chunk_range(c, first, count, block);
    if (block >= 0 && c % chunks_per_block == 0) {  // a new union block: which rows picked it
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bool any = false;
        if (t_row[h] >= 0)
          for (int k = 0; k < p.n_sel; ++k) any |= s_idx[tok[h] * p.n_sel + k] == block;
        picked[h] = any;
      }
    }
    // Which of this thread's two rows may see the chunk at all.
    bool row_on[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_on[h] = t_row[h] >= first && (block < 0 || picked[h]);
    // A warp none of whose 16 rows picked this block (or precede its keys) skips the chunk.
    if (__any_sync(0xffffffffu, row_on[0] || row_on[1])) {
      const Storage* sk = ring + stage * kStageElems;
      float s[Tile::kSTiles][4];
      st.scores(s, sk);
      // Row h keeps the chunk's keys [lo, hi): loaded, not after its token, in its window.
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi[h] = row_on[h] ? static_cast<int>(min64(count, t_row[h] - first + 1)) : 0;
        lo[h] = block < 0 ? static_cast<int>(max64(0, min64(kChunk, t_row[h] - p.window + 1 - first))) : 0;
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
  if (slc_chunks == num_chunks) finish_branch(0);  // no window chunk came
  finish_branch(1);
}

template <typename Storage, int kDqk, int kDv>
void launch_slc_win_attention(const SlcWinParams& p, cudaStream_t stream) {
  const size_t smem = slc_win_smem_bytes(kDqk, kDv, p.group, p.union_capacity, p.bitmap_words, p.n_sel);
  const auto kernel = slc_win_attention_kernel<Storage, kDqk, kDv>;
  NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // The whole unified L1/shared array as shared memory: as many CTAs per SM as fit (left to the
  // driver, the carve-out can be chosen smaller).
  NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  const int tokens_per_tile = kSlcRows / p.group;
  const int64_t tiles = (p.seqs.max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
  const dim3 grid(static_cast<unsigned>(tiles * p.seqs.batch), static_cast<unsigned>(p.hkv));
  if (grid.x == 0) return;
  kernel<<<grid, kSlcThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
