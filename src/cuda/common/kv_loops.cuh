// The K/V chunk loops that the forward's attention kernels share (the compressed branch's pass 1,
// the window, the selection's union tiles): their shared-memory plan (AttnSmem: a Q tile and
// double-buffered K/V chunks), the sm_90a ring of K/V chunks copied by TMA with one mbarrier per
// stage and no CTA barriers (tma_ring_attention_rows, tma_ring_attention), and the cp.async loop
// with one CTA barrier per chunk (cp_async_chunk_loop) where no tensor map can be made or on sm_80.
#pragma once

#include <type_traits>

#include "cuda/common/attention_tile.cuh"
#include "cuda/common/tma.h"
#include "cuda/tile_sizes.h"
#include "nsa/api.h"

namespace nsa::cuda {

// The tensor map every forward kernel takes of its keys or values: a [rows, Hkv, kD] view of
// 16-bit elements with strides (st, sh), boxes of box_rows rows x 64 columns. False where the
// call's choices turn tensor maps off (CudaKernelChoices::tma) or one cannot be made: the kernel
// then copies by cp.async.
template <typename Storage, int kD>
inline bool kv_rows_tensor_map(CUtensorMap* map, const CudaKernelChoices& choices, const void* base, int64_t hkv,
                               int64_t rows, int64_t st, int64_t sh, uint32_t box_rows = kKeyChunk) {
  return choices.tma && make_rows_tensor_map(map, StorageTraits<Storage>::is_bf16, base, kD, uint64_t(hkv),
                                             uint64_t(rows), st, sh, box_rows);
}

// Shared-memory plan of the kernels: [Q tile | 2 K buffers | 2 V buffers or the score buffers].
// sm_90a (wgmma): K/V in the 128-byte swizzle layout without padding, from a 1024-byte boundary;
// elsewhere padded rows for ldmatrix. The host sizes it with the padded layout plus the alignment
// slack (cmp_smem_bytes), which covers both.
template <typename Storage, int kDqk, int kDv, int kRows>
struct AttnSmem {
  using Tile = TileAttention<Storage, kDqk, kDv, kRows>;
  static constexpr bool kWgmma = kWgmmaCompiled;
  static_assert(Tile::kQBytes % 1024 == 0, "the K tile after Q starts on a 1024-byte boundary");
  static constexpr int kKTile = kWgmma ? Tile::kKSwTile : kKeyChunk * Tile::kKStride;  // elements of a K buffer
  static constexpr int kVTile = kWgmma ? Tile::kVSwTile : kKeyChunk * Tile::kVStride;
  Storage* sq;
  Storage* sk;
  Storage* sv;
  __device__ __forceinline__ explicit AttnSmem(unsigned char* raw) {
    unsigned char* base = raw;
    if constexpr (kWgmma) base += (1024u - (smem_address(raw) & 1023u)) & 1023u;
    sq = reinterpret_cast<Storage*>(base);
    sk = reinterpret_cast<Storage*>(base + Tile::kQBytes);
    sv = sk + 2 * kKTile;
  }
  static __device__ __forceinline__ void load_k(Storage* dst, const Storage* src, int64_t st, int count) {
    if constexpr (kWgmma)
      Tile::template load_rows_sw128<kDqk>(dst, src, st, count);
    else
      Tile::template load_rows<kDqk>(dst, src, st, count);
  }
  static __device__ __forceinline__ void load_v(Storage* dst, const Storage* src, int64_t st, int count) {
    if constexpr (kWgmma)
      Tile::template load_rows_sw128<kDv>(dst, src, st, count);
    else
      Tile::template load_rows<kDv>(dst, src, st, count);
  }
  // This thread's copies have landed; with wgmma they are also made visible to the async proxy
  // (the CTA barrier that follows publishes them to every warp).
  template <int kPending>
  static __device__ __forceinline__ void wait_copies() {
    cp_async_wait<kPending>();
    if constexpr (kWgmma) fence_proxy_async();
  }
  // The Q tile: swizzled with wgmma (the A operand of the score products), else padded rows for
  // ldmatrix (the fragments are loaded once and held).
  __device__ __forceinline__ void load_q(const Storage* q, int64_t q_st, int64_t q_sh, int64_t first_token,
                                         int tokens_valid, int head0, int log2_group) const {
    if constexpr (kWgmma)
      load_q_tile<Storage, kDqk, kRows, true>(sq, q, q_st, q_sh, first_token, tokens_valid, head0, log2_group);
    else
      load_q_tile<Storage, kDqk, kRows>(sq, q, q_st, q_sh, first_token, tokens_valid, head0, log2_group);
  }
  // S = Q K^T of the chunk in k: with wgmma from the Q tile in shared memory, else from the
  // fragments in t.
  __device__ __forceinline__ void scores(const Tile& t, float (&s)[Tile::kSTiles][4], const Storage* k) const {
    if constexpr (kWgmma)
      t.scores_wgmma_sq(s, sq, k);
    else
      t.scores(s, k);
  }
  static __device__ __forceinline__ void accumulate_pv(Tile& t, const float (&s)[Tile::kSTiles][4], const Storage* v) {
    if constexpr (kWgmma)
      t.accumulate_pv_wgmma(s, v);
    else
      t.accumulate_pv(s, v);
  }
};

// The chunk loop of compressed pass 1 and of the window on sm_90a with the K/V chunks copied by
// TMA (common/tma.h) through a ring of kCmpTmaStages stages, without CTA barriers. Chunk c is the
// 64 rows row0 + 64 c of k_map / v_map (KV head hk); its stage (c % kCmpTmaStages) holds K in
// kDqk/64 and V in kDv/64 boxes of 64 rows x 128 bytes in the 128-byte swizzle (the layout the
// wgmma descriptors read), completing on the stage's mbarrier. Every warp waits on that barrier,
// multiplies the chunk (mask_fn(c, s) masks its raw scores) and then counts itself done with the
// stage (a shared counter that only grows); the warp that completes the count (the last of the
// CTA's warps to finish chunk c) refills the stage with chunk c + kCmpTmaStages. So no warp waits
// for another except for data that have not arrived, and the three warpgroups drift apart: one's
// softmax runs under another's products, where the CTA barrier per chunk of the cp.async loop
// kept them in step. Rows past the last chunk's count_last keys hold whatever the tensors hold
// there (later rows, a row no sequence uses, possibly NaN; TMA's zeros past the end): mask_fn
// must give their scores -inf (p = 0), and their V rows are zeroed before the chunk's P V (a NaN
// there would survive 0 * v).
// Before the call: the Q tile's cp.async copies committed. `ring`: 1024-byte aligned, kStages K
// tiles then kStages V tiles; `bars`: kStages mbarriers then as many counters
// (tma_ring_bar_bytes), outside anything the caller writes before the loop ends. The sizes:
// tma_ring_end (forward_params.h).
// row_of(c): the first row of chunk c in the maps (tma_ring_attention: row0 + c * kChunk; the
// selection's union tiles: the first key of their c-th block), called by the thread that copies.
//
// kVStages < kStages (the selection's union tiles, where one V buffer less lets a third CTA onto
// the SM): K and V have rings of their own, kStages K tiles then kVStages V tiles, each tile with
// its mbarrier and counter (bars: kStages + kVStages mbarriers, then as many counters:
// tma_ring_bar_bytes(kStages + kVStages)). A warp counts itself done with a K tile after its Q K^T and with a V
// tile after its P V, so each refill starts as soon as the tile is free. kIssueEarly (either ring;
// the selection's union tiles): the first copies are issued before the Q tile has landed (the
// caller's shared memory in the ring must be dead already, behind a fence.proxy.async and a CTA
// barrier: cta_union_list).
template <typename Storage, int kDqk, int kDv, int kRows, int kChunk, int kStages, int kVStages = kStages,
          bool kIssueEarly = false, bool kPingPong = false, typename RowOf, typename MaskFn>
__device__ __forceinline__ void tma_ring_attention_rows(TileAttention<Storage, kDqk, kDv, kRows, kChunk>& tile_state,
                                                        const Storage* sq, Storage* ring, uint64_t* bars,
                                                        const CUtensorMap* k_map, const CUtensorMap* v_map, int hk,
                                                        RowOf&& row_of, int num_chunks, int count_last,
                                                        float scale_log2, MaskFn&& mask_fn) {
  using Tile = TileAttention<Storage, kDqk, kDv, kRows, kChunk>;
  constexpr unsigned kCtaWarps = kRows / 16;
  static_assert(kVStages >= 1 && kVStages <= kStages, "V stages");
  constexpr bool kSplit = kVStages < kStages;
  static_assert(!kPingPong || !kSplit, "ping-pong with one ring of K + V stages");
  constexpr int kBars = kSplit ? kStages + kVStages : kStages;  // mbarriers, then as many counters
  Storage* const sk = ring;                              // kStages K tiles
  Storage* const sv = ring + kStages * Tile::kKSwTile;   // kVStages V tiles
  unsigned* const done = reinterpret_cast<unsigned*>(bars + kBars);
  // One thread: the kD columns of chunk c's rows (kD / 64 boxes) into `tile`, on `bar`.
  auto load_tile = [&](auto d, int row, Storage* tile, uint64_t* bar, const CUtensorMap* map) {
    constexpr int kD = decltype(d)::value;
#pragma unroll
    for (int b = 0; b < kD / 64; ++b) tma_load_3d(tile + b * kChunk * 64, map, 64 * b, hk, row, bar);
  };
  using DimK = std::integral_constant<int, kDqk>;
  using DimV = std::integral_constant<int, kDv>;
  // One thread: chunk c's K (split: on K tile c % kStages's mbarrier) and V (split: on V tile
  // c % kVStages's; joint: K and V of stage c % kStages on one mbarrier).
  auto issue_k = [&](int c) {
    const int st = c % kStages;
    mbarrier_expect_tx(bars + st, uint32_t(kChunk) * (kSplit ? kDqk : kDqk + kDv) * sizeof(Storage));
    const int row = row_of(c);
    load_tile(DimK{}, row, sk + st * Tile::kKSwTile, bars + st, k_map);
    if constexpr (!kSplit) load_tile(DimV{}, row, sv + st * Tile::kVSwTile, bars + st, v_map);
  };
  auto issue_v = [&](int c) {  // (split only)
    const int st = c % kVStages;
    uint64_t* const bar = bars + kStages + st;
    mbarrier_expect_tx(bar, uint32_t(kChunk) * kDv * sizeof(Storage));
    load_tile(DimV{}, row_of(c), sv + st * Tile::kVSwTile, bar, v_map);
  };
  auto prologue = [&] {
    for (int c = 0; c < kStages && c < num_chunks; ++c) issue_k(c);
    if constexpr (kSplit)
      for (int c = 0; c < kVStages && c < num_chunks; ++c) issue_v(c);
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kBars; ++st) {
      mbarrier_init(bars + st, 1);
      done[st] = 0;
    }
    fence_mbarrier_init();
    if constexpr (kIssueEarly) prologue();
  }
  cp_async_wait<0>();
  fence_proxy_async();  // the Q tile, for the score wgmma
  __syncthreads();      // Q, the mbarriers and the counters, before anyone uses them
  if constexpr (!kIssueEarly)
    if (threadIdx.x == 0) prologue();
  const int lane = threadIdx.x % 32;
  // The warp that completes counter `i`'s count for this use (the CTA's last warp done with its
  // tile) refills the tile with chunk `next`.
  auto release = [&](int i, int next, auto&& issue) {
    if (next < num_chunks) {
      __syncwarp();
      if (lane == 0) {
        __threadfence_block();  // this warp's reads of the tile are ordered before its count
        const unsigned before = atomicAdd(done + i, 1u);
        if (before % kCtaWarps == kCtaWarps - 1) {  // the CTA's last warp done with it
          __threadfence_block();
          fence_proxy_async();
          issue(next);
        }
      }
      __syncwarp();
    }
  };
  // Ping-pong (kPingPong; FA3's schedule, round robin over the kRows / 64 warpgroups): the
  // warpgroups issue their product batches in strict turns, Q K^T(0) of warpgroup 0, of 1, ...,
  // then P V(0) of 0, of 1, ... Each waits on its named barrier before a batch and, once the batch
  // is issued, arrives on the next one's, so a warpgroup's batch runs on the tensor cores ahead of
  // the next one's while the others do their softmax, instead of all batches interleaving and all
  // softmaxes then running at once. The last warpgroup opens warpgroup 0's first turn and leaves
  // out its arrive after its last batch, so that every arrive meets a wait.
  constexpr int kWgs = kRows / 64;
  constexpr int kPpBar = 1, kPpThreads = 256;  // named barriers 1 .. kWgs: the waiting and the arriving warpgroup
  static_assert(!kPingPong || (kRows % 64 == 0 && kWgs >= 2 && kWgs <= 4), "ping-pong of 2-4 warpgroups");
  const int wg = static_cast<int>(threadIdx.x / 128);
  const int wg_next = wg + 1 == kWgs ? 0 : wg + 1;
  if constexpr (kPingPong)
    if (wg == kWgs - 1 && num_chunks > 0) named_barrier_arrive(kPpBar, kPpThreads);
  // Once per tile, in its last chunk (landed in v_tile): the V rows past the keys become zeros
  // before any warp's P V.
  auto zero_v_tail = [&](int c, Storage* v_tile) {
    if (c == num_chunks - 1 && count_last < kChunk) {
      zero_sw128_rows<kChunk, kRows / 16 * 32>(v_tile, kDv / 64, count_last);
      fence_proxy_async();  // the zeros, for the P V wgmma
      __syncthreads();
    }
  };
  int kst = 0, vst = 0;
  uint32_t kphase = 0, vphase = 0;
  for (int c = 0; c < num_chunks; ++c) {
    mbarrier_wait_parity(bars + kst, kphase);
    if constexpr (kSplit) {
      float s[Tile::kSTiles][4];
      tile_state.scores_wgmma_sq(s, sq, sk + kst * Tile::kKSwTile);  // waits for its products
      release(kst, c + kStages, issue_k);
      mask_fn(c, s);
      tile_state.softmax_update(s, scale_log2);
      mbarrier_wait_parity(bars + kStages + vst, vphase);
      zero_v_tail(c, sv + vst * Tile::kVSwTile);
      tile_state.accumulate_pv_wgmma(s, sv + vst * Tile::kVSwTile);  // waits for its products
      release(kStages + vst, c + kVStages, issue_v);
      if (++vst == kVStages) vst = 0, vphase ^= 1u;
    } else {
      // The stage as a warp-uniform value to ptxas (a broadcast): the products' descriptors then
      // stay in uniform registers instead of two R2UR moves each.
      const int ust = __shfl_sync(0xffffffffu, kst, 0);
      zero_v_tail(c, sv + ust * Tile::kVSwTile);
      float s[Tile::kSTiles][4];
      if constexpr (kPingPong) {
        named_barrier_sync(kPpBar + wg, kPpThreads);
        tile_state.scores_wgmma_sq(s, sq, sk + ust * Tile::kKSwTile,
                                   [&] { named_barrier_arrive(kPpBar + wg_next, kPpThreads); });
      } else {
        tile_state.scores_wgmma_sq(s, sq, sk + ust * Tile::kKSwTile);
      }
      mask_fn(c, s);
      tile_state.softmax_update(s, scale_log2);
      if constexpr (kPingPong) {
        const bool last = wg == kWgs - 1 && c == num_chunks - 1;
        tile_state.accumulate_pv_wgmma(
            s, sv + ust * Tile::kVSwTile, [&] { if (!last) named_barrier_arrive(kPpBar + wg_next, kPpThreads); },
            [&] { named_barrier_sync(kPpBar + wg, kPpThreads); });
      } else {
        tile_state.accumulate_pv_wgmma(s, sv + ust * Tile::kVSwTile);  // waits for its products: the stage is read
      }
      release(kst, c + kStages, issue_k);
    }
    if (++kst == kStages) kst = 0, kphase ^= 1u;
  }
}

// Consecutive chunks: chunk c is the kChunk rows row0 + c * kChunk.
template <typename Storage, int kDqk, int kDv, int kRows, int kChunk = kKeyChunk, int kStages = kCmpTmaStages,
          bool kPingPong = false, typename MaskFn>
__device__ __forceinline__ void tma_ring_attention(TileAttention<Storage, kDqk, kDv, kRows, kChunk>& tile_state,
                                                   const Storage* sq, Storage* ring, uint64_t* bars,
                                                   const CUtensorMap* k_map, const CUtensorMap* v_map, int hk,
                                                   int row0, int num_chunks, int count_last, float scale_log2,
                                                   MaskFn&& mask_fn) {
  tma_ring_attention_rows<Storage, kDqk, kDv, kRows, kChunk, kStages, kStages, false, kPingPong>(
      tile_state, sq, ring, bars, k_map, v_map, hk, [row0](int c) { return row0 + c * kChunk; }, num_chunks,
      count_last, scale_log2, mask_fn);
}

// The chunk loop without TMA (the fused kernel on sm_80; on sm_90a pass 1's 192-row kernel and the
// window where no tensor map can be made): chunks double-buffered in sm's K/V buffers by cp.async,
// load_chunk(c, buf) issuing and committing chunk c into buffer buf. One CTA barrier per chunk:
// after it chunk c (and the Q tile) has landed for everyone and every warp is done with chunk
// c - 1, whose buffer then receives chunk c + 1 while c is multiplied. limits(c, lo, hi): row h
// keeps chunk c's keys [lo[h], hi[h]). Before the call: the Q tile's copies committed; after it
// every copy has landed.
template <typename Smem, typename Tile, typename LoadChunk, typename Limits>
__device__ __forceinline__ void cp_async_chunk_loop(const Smem& sm, Tile& tile_state, int num_chunks, float scale_log2,
                                                    LoadChunk&& load_chunk, Limits&& limits) {
  if (num_chunks > 0) load_chunk(0, 0);
  Smem::template wait_copies<0>();
  __syncthreads();
  if constexpr (!Smem::kWgmma) tile_state.load_q_fragments(sm.sq);  // held (wgmma reads the Q tile)
  for (int c = 0; c < num_chunks; ++c) {
    Smem::template wait_copies<0>();
    __syncthreads();
    if (c + 1 < num_chunks) load_chunk(c + 1, (c + 1) & 1);
    const int buf = c & 1;
    float s[Tile::kSTiles][4];
    sm.scores(tile_state, s, sm.sk + buf * Smem::kKTile);
    int lo[2], hi[2];
    limits(c, lo, hi);
    tile_state.mask(s, lo, hi);
    tile_state.softmax_update(s, scale_log2);
    Smem::accumulate_pv(tile_state, s, sm.sv + buf * Smem::kVTile);
  }
}

}  // namespace nsa::cuda
