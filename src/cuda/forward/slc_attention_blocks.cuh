// Selection attention (spec §5) on sm_90a by whole blocks: where l' = 64 and Dqk, Dv are 64 or
// 128, one warp per CTA walks the union of its tokens' blocks a whole block a step. A block's K and
// V come as 64-row TMA boxes (64 columns each, 8 KB) into the CTA's one K and one V buffer, each
// completing on its own mbarrier: the next block's K is copied while this block's softmax and
// P V run, its V while the next Q K^T runs. The step's scores are four 16-key pieces of the
// ring-stage products (slc_union.cuh) and one softmax update covers the 64 keys. With one buffer
// of each (32 KB at 128/128) six CTAs (six warps) share an SM. Against slc_attention_tma_kernel
// (four warps per CTA, 16-key steps, 2 KB boxes): four times fewer boxes and mbarrier waits per
// key and a quarter of the softmax updates.
//
// The tile of slc_attention.cuh (kSlcWarps warps' rows: SlcTile) is kept as the unit of the union
// tiles: CTA x of the grid is warp x % kSlcWarps of tile x / kSlcWarps. With
// BranchParams::slc_union_tiles every CTA of a tile counts the tile's union (warp_tile_union_size:
// the same blocks as the union kernel's lists) and leaves when slc_union_tile_kernel takes it; the
// tile's first CTA lists it.
#pragma once

#include "cuda/forward/slc_attention_tma.cuh"

namespace nsa::cuda {

inline constexpr int kSlcBlockKeys = 64;  // keys of a step: one block of l' = 64
// The bytes of one 64-column box, and of the K and V buffers (K's boxes, then V's).
inline constexpr int kSlcBlockBoxBytes = kSlcBlockKeys * 128;
constexpr size_t slc_block_ring_bytes(int dqk, int dv) { return size_t(kSlcBlockBoxBytes) * size_t(dqk / 64 + dv / 64); }
// Slots of the hash set that counts a tile's union (at most kSlcUnionMax + 32 entries are ever
// in it: the count is checked after each round of 32 insertions).
inline constexpr int kSlcUnionHashSlots = 2 * kSlcUnionMax;
static_assert(kSlcUnionMax + 32 < kSlcUnionHashSlots, "a free slot is always left");
// From a 1024-byte boundary: the buffers (the warp's sort keys first live in them, its output rows
// at the end), K's and V's mbarriers, the union list (blocks, masks: cap ints each), the hash set
// and its counter.
constexpr size_t slc_blocks_lists_offset(int dqk, int dv) { return slc_block_ring_bytes(dqk, dv) + 2 * 8; }
constexpr size_t slc_blocks_smem_bytes(int dqk, int dv, int cap) {
  return 1024 + slc_blocks_lists_offset(dqk, dv) + size_t(2) * size_t(cap) * 4 + size_t(kSlcUnionHashSlots) * 4 + 16;
}
// Where it runs: l' = 64 (checked by the launcher), Dqk and Dv 64 or 128, the warp's sort keys
// within the buffers, six CTAs per SM.
constexpr bool slc_blocks_fits(int dqk, int dv, int cap) {
  return (dqk == 64 || dqk == 128) && (dv == 64 || dv == 128) && size_t(cap) * 4 <= slc_block_ring_bytes(dqk, dv) &&
         6 * (slc_blocks_smem_bytes(dqk, dv, cap) + kSmemPerCtaReserved) <= kSmemPerSm;
}

// The number of distinct blocks the `tokens` tokens from t_first (index rows idx_token_stride apart)
// pick, each kept as warp_block_union keeps it (j >= 0, its first key not after its token): the
// count cta_union_size makes of the same tokens' lists. Above kSlcUnionMax the count stops early
// and is returned as some value above it. table: kSlcUnionHashSlots ints, count: one int, both
// shared. Order-independent: the same count in every CTA that asks. Ends with the warp converged.
__device__ __forceinline__ int warp_tile_union_size(const int32_t* idx, int64_t idx_token_stride, int n, int lp,
                                                    int64_t t_first, int tokens, int32_t* table, int* count) {
  const int lane = threadIdx.x % 32;
  for (int i = lane; i < kSlcUnionHashSlots; i += 32) table[i] = -1;
  if (lane == 0) *count = 0;
  __syncwarp();
  const int entries = tokens * n;
  int distinct = 0;
  for (int base = 0; base < entries; base += 32) {
    const int e = base + lane;
    if (e < entries) {
      const int tok = e / n, k = e % n;
      const int32_t j = idx[tok * idx_token_stride + k];
      if (j >= 0 && int64_t(j) * lp <= t_first + tok) {
        uint32_t h = (static_cast<uint32_t>(j) * 2654435761u) % kSlcUnionHashSlots;
        for (;;) {
          const int32_t prev = atomicCAS(table + h, -1, j);
          if (prev == -1) {
            atomicAdd(count, 1);
            break;
          }
          if (prev == j) break;
          h = h + 1 == kSlcUnionHashSlots ? 0 : h + 1;
        }
      }
    }
    __syncwarp();
    // Lane 0 reads the count before any lane's next insertion (the shuffle holds them back).
    distinct = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(count, 0) : 0, 0);
    if (distinct > kSlcUnionMax) break;
  }
  return distinct;
}

// One lane's copy of a whole block's K or V, rows [row, row + 64) of `map` (boxes of 64 rows x 64
// columns), as D / 64 boxes into buf, completing on bar.
template <int D>
__device__ __forceinline__ void slc_issue_block(unsigned char* buf, uint64_t* bar, const CUtensorMap* map, int hk,
                                                int row) {
  mbarrier_expect_tx(bar, kSlcBlockBoxBytes * (D / 64));
  slc_load_boxes<D, kSlcBlockBoxBytes>(buf, map, hk, row, bar);
}

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(32) slc_attention_blocks_kernel(const BranchParams p,
                                                                  const __grid_constant__ SlcTmaMaps maps) {
  if constexpr (!kWgmmaCompiled || !slc_blocks_fits(kDqk, kDv, 1)) {
    __trap();  // launched only where the sm_90a body runs and the head dims fit (launch_slc_attention)
  } else {
    constexpr bool kBf16 = StorageTraits<Storage>::is_bf16;
    constexpr int kOTiles = kDv / 8;
    constexpr int kPieces = kSlcBlockKeys / 16;
    constexpr int kKBytes = kSlcBlockBoxBytes * (kDqk / 64);
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* const base = smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u);

    const int lane = threadIdx.x, g = lane / 4, quad = lane % 4;
    const int warp = static_cast<int>(blockIdx.x % kSlcWarps);  // of the tile
    const unsigned tile_x = blockIdx.x / kSlcWarps, tiles_x = gridDim.x / kSlcWarps;
    const SlcTile tl(p, tile_x, blockIdx.y);
    const int tokens_per_warp = tl.tokens_per_warp, hk = tl.hk;
    const int64_t s0 = tl.s0, len = tl.len;
    const int64_t t0 = tl.t0 + warp * tokens_per_warp;  // the warp's first token
    if (t0 >= len) return;
    const int tokens_valid = static_cast<int>(min64(tokens_per_warp, len - t0));
    const int tmax = static_cast<int>(t0) + tokens_valid - 1;

    const int cap = p.sort_capacity;
    unsigned char* const ring = base;
    uint64_t* const bars = reinterpret_cast<uint64_t*>(base + slc_block_ring_bytes(kDqk, kDv));
    int32_t* const ublk = reinterpret_cast<int32_t*>(base + slc_blocks_lists_offset(kDqk, kDv));
    int32_t* const umask = ublk + cap;
    int32_t* const table = umask + cap;
    int* const counter = table + kSlcUnionHashSlots;

    // ---- The tile to the union kernel, or this warp's union of its tokens' blocks ----
    if (p.slc_union_tiles) {
      const int tile_tokens = tl.tokens();
      const int u = warp_tile_union_size(p.indices + (s0 + tl.t0) * p.idx_st + int64_t(hk) * p.idx_sh, p.idx_st,
                                         p.n_sel, p.lp, tl.t0, tile_tokens, table, counter);
      if (slc_union_takes(u, tile_tokens, p.n_sel)) {
        if (warp == 0 && lane == 0) p.slc_union_list[1 + atomicAdd(p.slc_union_list, 1)] = blockIdx.y * tiles_x + tile_x;
        return;
      }
    }
    const int num_blocks =
        warp_block_union(p.indices + (s0 + t0) * p.idx_st + int64_t(hk) * p.idx_sh, p.idx_st, p.n_sel, p.lp, t0,
                         tokens_valid, cap, reinterpret_cast<int32_t*>(ring), ublk, umask);

    // ---- This lane's rows (g and g + 8) and its Q fragments ----
    int tok[2], head[2], trow[2];  // trow -1: a padding row sees no key
    const Storage* qrow[2];
    slc_walk_rows<Storage>(p, hk, s0, t0, tokens_valid, g, tok, head, trow, qrow);
    uint32_t qf[kDqk / 16][4];
    load_a_fragments<Storage, kDqk>(qf, qrow[0], qrow[1]);

    // ---- The walk: a whole block a step; K of the next block in flight during this block's
    // softmax and P V, its V during the next Q K^T ----
    const SlcTmaWalk walk{ublk, umask, p.lp, tmax};
    unsigned char* const kbuf = ring;
    unsigned char* const vbuf = ring + kKBytes;
    fence_proxy_async();  // the sort's ordinary stores, before boxes overwrite them
    if (lane == 0) {
      mbarrier_init(bars, 1);      // K
      mbarrier_init(bars + 1, 1);  // V
      fence_mbarrier_init();
    }
    __syncwarp();
    auto block_row = [&](int u) { return static_cast<int>(s0) + ublk[u] * p.lp; };
    if (lane == 0 && num_blocks > 0) {
      slc_issue_block<kDqk>(kbuf, bars, &maps.k, hk, block_row(0));
      slc_issue_block<kDv>(vbuf, bars + 1, &maps.v, hk, block_row(0));
    }

    float acc[kOTiles][4];
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m[2] = {kNegInf, kNegInf}, lsum[2] = {0.f, 0.f};
    // The block at which the combine's reads are prefetched (-1: none).
    const int prefetch_at = p.combine && p.choices.combine_prefetch
                                ? max(0, num_blocks - kSlcPrefetchAhead * 16 / kSlcBlockKeys)
                                : -1;
    const uint32_t sk = smem_address(kbuf), sv = smem_address(vbuf);
    for (int u = 0; u < num_blocks; ++u) {
      const uint32_t parity = static_cast<uint32_t>(u & 1);
      if (u == prefetch_at) slc_prefetch_combine<Storage, kDv>(p, s0 + t0, tokens_valid, hk, lane);
      int lim[2];
      const int nkeys = walk.enter(u, trow, tok, lim);
      mbarrier_wait_parity(bars, parity);
      if (nkeys < kSlcBlockKeys) {  // the rows past the walk's last key: zeros, not whatever the box brought
        zero_sw128_rows<kSlcBlockKeys, 32>(kbuf, kDqk / 64, nkeys);
        fence_proxy_async();
        __syncwarp();
      }
      float s[kPieces][2][4];
#pragma unroll
      for (int k = 0; k < kPieces; ++k)
        mma_frags_stage_sw<kBf16, kDqk, kSlcBlockBoxBytes>(s[k], qf, sk + k * kSwStageBlockBytes);  // S = Q K^T
      __syncwarp();  // every lane is done with K
      if (lane == 0 && u + 1 < num_blocks) slc_issue_block<kDqk>(kbuf, bars, &maps.k, hk, block_row(u + 1));
      if (!__all_sync(0xffffffffu, lim[0] >= kSlcBlockKeys && lim[1] >= kSlcBlockKeys)) {
#pragma unroll
        for (int k = 0; k < kPieces; ++k)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (16 * k + nt * 8 + 2 * quad + (e & 1) >= (e >> 1 ? lim[1] : lim[0])) s[k][nt][e] = kNegInf;
      }
      slc_softmax_block<kOTiles, kPieces>(s, m, lsum, acc, p.scale_log2, softmax_slack(p.choices));
      mbarrier_wait_parity(bars + 1, parity);
      if (nkeys < kSlcBlockKeys) {
        zero_sw128_rows<kSlcBlockKeys, 32>(vbuf, kDv / 64, nkeys);
        fence_proxy_async();
        __syncwarp();
      }
#pragma unroll
      for (int k = 0; k < kPieces; ++k)  // O += P V
        mma_p_stage_sw<Storage, kDv, kSlcBlockBoxBytes>(acc, s[k], sv + k * kSwStageBlockBytes);
      __syncwarp();  // every lane is done with V
      if (lane == 0 && u + 1 < num_blocks) slc_issue_block<kDv>(vbuf, bars + 1, &maps.v, hk, block_row(u + 1));
    }

    // ---- Epilogue: lse, and o_slc's rows through the buffers (every box has landed and been read) ----
    slc_finish_walk<Storage, kDv>(p, acc, m, lsum, reinterpret_cast<Storage*>(ring), s0, t0, tokens_valid, hk, trow,
                                  head);
  }
}

}  // namespace nsa::cuda
