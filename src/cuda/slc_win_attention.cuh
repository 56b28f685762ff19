// Selection (spec §5) and sliding-window (spec §6) attention of one query tile, with the gated
// combine of spec §7 in the epilogue.
//
// Selection: the tile's tokens picked up to n blocks each; the CTA builds the union of their
// blocks (a bitmap, then a sorted list) and streams each union block through shared memory once,
// masking, row by row, the blocks a row's token did not pick and the keys after the token. With
// 64 rows per tile this gives every mma M = 64 rows at any G, and neighbouring tokens share most
// blocks (forced initial/local blocks, smooth scores), so a block is read once per tile instead
// of once per token.
// Window: the keys [t0 - w + 1, t_last] of the tile, masked per row to [t - w + 1, t].
// The two branches run one after the other with the same Q fragments; the gated sum
// g_slc o_slc + g_win o_win + g_cmp o_cmp is formed in registers and written once (o_slc held
// rounded to the storage type, as a plain implementation stores each branch output).
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

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kThreads) slc_win_attention_kernel(const SlcWinParams p) {
  using Tile = TileAttention<Storage, kDqk, kDv>;
  using Traits = StorageTraits<Storage>;
  // kStages K/V chunk buffers; with three, chunks c + 1 and c + 2 load while chunk c is
  // multiplied (the kernel is load-latency bound: with random picks one warp of four multiplies
  // most chunks). The Q tile is needed only until its fragments are in registers, so with three
  // stages it sits in the last K buffer (a Q tile is exactly one K tile) and costs no space.
  constexpr int kStages = slc_win_stages(kDqk, kDv);
  constexpr bool kQInStage = kStages == 3;
  static_assert(kTileRows == kKeyChunk, "the Q tile overlays one K chunk buffer");
  constexpr size_t kKTile = size_t(kKeyChunk) * Tile::kKStride;  // elements of one K buffer
  constexpr size_t kVTile = size_t(kKeyChunk) * Tile::kVStride;
  extern __shared__ __align__(16) unsigned char smem[];
  Storage* sk = reinterpret_cast<Storage*>(smem) + (kQInStage ? 0 : kKTile);  // [kStages][64][Dqk+8]
  Storage* sv = sk + kStages * kKTile;                                          // [kStages][64][Dv+8]
  Storage* sq = kQInStage ? sk + (kStages - 1) * kKTile : reinterpret_cast<Storage*>(smem);
  int32_t* s_idx = reinterpret_cast<int32_t*>(sv + kStages * kVTile);
  const int tokens_per_tile = kTileRows >> p.log2_group;
  uint32_t* s_bitmap = reinterpret_cast<uint32_t*>(s_idx + tokens_per_tile * p.n_sel);  // [bitmap_words]
  int32_t* s_union = reinterpret_cast<int32_t*>(s_bitmap + p.bitmap_words);            // [union_capacity]
  __shared__ int s_union_count;

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

  load_q_tile<Storage, kDqk>(sq, static_cast<const Storage*>(p.q), p.q_st, p.q_sh, s0 + t0, tokens_valid,
                             hk * p.group, p.log2_group);
  cp_async_commit();

  // ---- Union of the tile's selected blocks ----
  int slc_blocks = 0;
  if (p.has_slc && p.n_sel > 0) {
    for (int e = threadIdx.x; e < p.bitmap_words; e += kThreads) s_bitmap[e] = 0u;
    __syncthreads();
    for (int e = threadIdx.x; e < tokens_per_tile * p.n_sel; e += kThreads) {
      const int token = e / p.n_sel, k = e % p.n_sel;
      int32_t j = -1;
      if (token < tokens_valid) j = p.indices[(s0 + t0 + token) * p.idx_st + hk * p.idx_sh + k];
      s_idx[e] = j;
      // Blocks past the bitmap start after every token of the sequence: they hold no key.
      if (j >= 0 && j < p.bitmap_words * 32) atomicOr(&s_bitmap[j / 32], 1u << (j % 32));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // one warp compacts the bitmap into an ascending list
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
  const int chunks_per_block = (p.lp + kKeyChunk - 1) / kKeyChunk;
  const int slc_chunks = slc_blocks * chunks_per_block;
  const int64_t win_lo = p.window > 0 ? window_start(t0, p.window) : 0;
  const int win_chunks = p.has_win && p.window > 0 ? static_cast<int>((t_last - win_lo + kKeyChunk) / kKeyChunk) : 0;
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
      first = int64_t(block) * p.lp + int64_t(c % chunks_per_block) * kKeyChunk;
      end = min64(int64_t(block + 1) * p.lp, t_last + 1);
    } else {
      block = -1;
      first = win_lo + int64_t(c - slc_chunks) * kKeyChunk;
      end = t_last + 1;
    }
    count = static_cast<int>(max64(0, min64(kKeyChunk, end - first)));
  };
  auto load_chunk = [&](int c, int buf) {
    int64_t first;
    int count, block;
    chunk_range(c, first, count, block);
    const bool slc = c < slc_chunks;
    Tile::template load_rows<kDqk>(sk + buf * kKTile, (slc ? ks + first * p.ks_st : kw + first * p.kw_st),
                                   slc ? p.ks_st : p.kw_st, count);
    Tile::template load_rows<kDv>(sv + buf * kVTile, (slc ? vs + first * p.vs_st : vw + first * p.vw_st),
                                  slc ? p.vs_st : p.vw_st, count);
  };
  // One commit group per chunk slot, empty past the last chunk, so that the wait counts below
  // hold whatever the number of chunks.
  auto issue_chunk = [&](int c) {
    if (c < num_chunks) load_chunk(c, c % kStages);
    cp_async_commit();
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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

  // Prologue: chunks 0 .. kStages-2 into buffers 0 .. kStages-2 (not the one Q may occupy).
  for (int c = 0; c < kStages - 1; ++c) issue_chunk(c);
  cp_async_wait<kStages - 1>();  // the Q group has landed
  __syncthreads();
  st.load_q_fragments(sq);
  if constexpr (kQInStage) __syncthreads();  // Q's buffer is free once every warp holds its fragments
  for (int c = 0; c < num_chunks; ++c) {
    if (c == slc_chunks) finish_branch(0);  // the window branch starts
    cp_async_wait<kStages - 2>();  // chunk c has landed (later chunks may still be in flight)
    // One barrier per chunk: after it chunk c is visible to all and every warp is done with chunk
    // c - 1, whose buffer now receives chunk c + kStages - 1.
    __syncthreads();
    issue_chunk(c + kStages - 1);
    int64_t first;
    int count, block;
    chunk_range(c, first, count, block);
    // Which of this thread's two rows may see the chunk at all.
    bool row_on[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_on[h] = t_row[h] >= first;
      if (block >= 0 && row_on[h]) {
        bool picked = false;
        for (int k = 0; k < p.n_sel; ++k) picked |= s_idx[tok[h] * p.n_sel + k] == block;
        row_on[h] = picked;
      }
    }
    // A warp none of whose 16 rows picked this block (or precede its keys) skips the chunk: at
    // G = 16 a warp is one token, so it multiplies only its own token's blocks even when the
    // tile's union is wide (random scores: neighbouring tokens share few blocks).
    if (__any_sync(0xffffffffu, row_on[0] || row_on[1])) {
    float s[Tile::kSTiles][4];
    st.scores(s, sk + (c % kStages) * kKTile);
#pragma unroll
    for (int i = 0; i < Tile::kSTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = i * 8 + 2 * quad + (e & 1);
        const int h = e >> 1;
        const int64_t pos = first + col;
        bool on = row_on[h] && col < count && pos <= t_row[h];
        if (block < 0) on = on && pos > t_row[h] - p.window;
        s[i][e] = on ? s[i][e] * p.scale_log2 : kNegInf;
      }
    st.softmax_update(s);
    st.accumulate_pv(s, sv + (c % kStages) * kVTile);
    }
  }
  if (slc_chunks == num_chunks) finish_branch(0);  // no window chunk came
  finish_branch(1);
}

template <typename Storage, int kDqk, int kDv>
void launch_slc_win_attention(const SlcWinParams& p, cudaStream_t stream) {
  const size_t smem = slc_win_smem_bytes(kDqk, kDv, p.group, p.union_capacity, p.bitmap_words, p.n_sel);
  const auto kernel = slc_win_attention_kernel<Storage, kDqk, kDv>;
  NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // The whole unified L1/shared array as shared memory: two CTAs per SM need it (left to the
  // driver, the carve-out can be chosen smaller).
  NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  const int tokens_per_tile = kTileRows / p.group;
  const int64_t tiles = (p.seqs.max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
  const dim3 grid(static_cast<unsigned>(tiles * p.seqs.batch), static_cast<unsigned>(p.hkv));
  if (grid.x == 0) return;
  kernel<<<grid, kThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
