// Selection attention (spec §5) on sm_90a by TMA: the per-token kernel's tiles and warps
// (slc_attention.cuh: one warp per 16 query rows, the union of its tokens' blocks, 16 keys a step)
// with each step's K and V brought by one lane as 16-row boxes (64 columns each) into the warp's
// own ring of kSlcTmaStages stages, each completing on its own mbarrier, and read by ldmatrix from
// the 128-byte swizzle: no K/V rows in registers, no loads through L1 (which bounds the per-token
// kernel: ncu at 64K, G = 16, L1/TEX throughput 94%). The walk is slc_dq_kernel's (slc_dq.cuh):
// positions in 32 bits, each row's visible keys per block, no masks on a step every row sees.
// Q's A fragments in registers (natural order), O in natural column order.
// The warps never wait for each other; the union tiles (slc_union_tile_kernel) are handed over as
// by the per-token kernel.
#pragma once

#include "cuda/forward/slc_attention.cuh"

namespace nsa::cuda {

inline constexpr int kSlcTmaStages = 3;
// With the gated combine (BranchParams::combine) a warp prefetches its rows' o_cmp, o_win and gates
// into L2 this many steps before its walk ends (slc_prefetch_combine).
inline constexpr int kSlcPrefetchAhead = 8;
constexpr size_t slc_tma_stage_bytes(int dqk, int dv) { return size_t(16) * 128 * size_t(dqk / 64 + dv / 64); }
constexpr size_t slc_tma_ring_bytes(int dqk, int dv) { return kSlcTmaStages * slc_tma_stage_bytes(dqk, dv); }
// From a 1024-byte boundary: the warps' rings (a warp's sort keys live in its ring before the
// first box, its output rows after the last), their mbarriers, the warps' union lists (blocks and
// masks, cap ints each), 8 ints.
constexpr size_t slc_tma_lists_offset(int dqk, int dv) {
  return size_t(kSlcWarps) * (slc_tma_ring_bytes(dqk, dv) + kSlcTmaStages * 8);
}
constexpr size_t slc_tma_smem_bytes(int dqk, int dv, int cap) {
  return 1024 + slc_tma_lists_offset(dqk, dv) + size_t(kSlcWarps) * 2 * size_t(cap) * 4 + 8 * sizeof(int);
}
// Where it runs: Dqk and Dv up to 128, a warp's sort keys (3 ints per entry) within its ring, two
// CTAs per SM.
constexpr bool slc_tma_fits(int dqk, int dv, int cap) {
  return dqk <= 128 && dv <= 128 && size_t(cap) * 3 * 4 <= slc_tma_ring_bytes(dqk, dv) &&
         size_t(16) * (dv + 8) * 2 <= slc_tma_ring_bytes(dqk, dv) &&
         2 * (slc_tma_smem_bytes(dqk, dv, cap) + kSmemPerCtaReserved) <= kSmemPerSm;
}
struct SlcTmaMaps {
  CUtensorMap k, v;  // the selection's k, v as [T, Hkv, D], boxes of 16 rows x 64 columns
};

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kSlcWarpThreads, 2)
    slc_attention_tma_kernel(const BranchParams p, const __grid_constant__ SlcTmaMaps maps) {
  if constexpr (!kWgmmaCompiled || kDqk > 128 || kDv > 128) {
    __trap();  // launched only where the sm_90a body runs (launch_slc_attention)
  } else {
    constexpr bool kBf16 = StorageTraits<Storage>::is_bf16;
    constexpr int kOTiles = kDv / 8;
    constexpr int kStageBytes = int(slc_tma_stage_bytes(kDqk, kDv));
    constexpr int kKBytes = kSwStageBlockBytes * (kDqk / 64);
    constexpr int kRingBytes = kSlcTmaStages * kStageBytes;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* const base = smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, quad = lane % 4;
    const SlcTile tl(p, blockIdx.x, blockIdx.y);
    const int tokens_per_warp = tl.tokens_per_warp, hk = tl.hk;
    const int64_t s0 = tl.s0, len = tl.len;
    const int64_t t0 = tl.t0 + warp * tokens_per_warp;  // the warp's first token
    if (!p.slc_union_tiles && t0 >= len) return;       // a warp may leave alone
    const int tokens_valid = t0 < len ? static_cast<int>(min64(tokens_per_warp, len - t0)) : 0;
    const int tmax = static_cast<int>(t0) + tokens_valid - 1;

    const int cap = p.sort_capacity;
    unsigned char* const ring = base + warp * kRingBytes;
    uint64_t* const bars = reinterpret_cast<uint64_t*>(base + kSlcWarps * kRingBytes) + warp * kSlcTmaStages;
    int32_t* const lists = reinterpret_cast<int32_t*>(base + slc_tma_lists_offset(kDqk, kDv));
    int32_t* const ublk = lists + warp * 2 * cap;
    int32_t* const umask = ublk + cap;
    int* const meta = lists + kSlcWarps * 2 * cap;

    // ---- The union of the warp's tokens' blocks (slc_union.cuh), sorted in the ring ----
    const int num_blocks =
        warp_block_union(p.indices + (s0 + min64(t0, len - 1)) * p.idx_st + int64_t(hk) * p.idx_sh, p.idx_st,
                         p.n_sel, p.lp, t0, tokens_valid, cap, reinterpret_cast<int32_t*>(ring), ublk, umask);
    if (p.slc_union_tiles) {
      if (slc_tile_handed_over(p, tl, lists, 2 * cap, meta, num_blocks)) return;
      if (tokens_valid == 0) return;
    }

    // ---- This lane's rows (g and g + 8) and its Q fragments ----
    int tok[2], head[2], trow[2];  // trow -1: a padding row sees no key
    const Storage* qrow[2];
    slc_walk_rows<Storage>(p, hk, s0, t0, tokens_valid, g, tok, head, trow, qrow);
    uint32_t qf[kDqk / 16][4];
    load_a_fragments<Storage, kDqk>(qf, qrow[0], qrow[1]);

    // ---- The walk (SlcTmaWalk): a block's 16-key steps up to the warp's last token ----
    const SlcTmaWalk walk{ublk, umask, p.lp, tmax};
    const int n_steps = walk.steps(num_blocks);
    fence_proxy_async();  // the sort's ordinary stores, before boxes overwrite them
    if (lane == 0) {
      for (int st = 0; st < kSlcTmaStages; ++st) mbarrier_init(bars + st, 1);
      fence_mbarrier_init();
    }
    __syncwarp();
    int iu = 0, ioff = 0;  // lane 0: the next step to issue (block, key offset)
    auto issue = [&](int st) {
      if (lane == 0) {
        slc_issue_step<kDqk, kDv>(ring + st * kStageBytes, bars + st, &maps.k, &maps.v, hk,
                                  static_cast<int>(s0) + ublk[iu] * p.lp + ioff);
        ioff += 16;
        if (ioff >= walk.keys(iu)) ++iu, ioff = 0;
      }
    };
    int u = 0, off = 0, nkeys = 0, lim[2] = {0, 0};
    if (num_blocks > 0) nkeys = walk.enter(0, trow, tok, lim);
    for (int i = 0; i < kSlcTmaStages - 1 && i < n_steps; ++i) issue(i);

    float acc[kOTiles][4];
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m[2] = {kNegInf, kNegInf}, lsum[2] = {0.f, 0.f};
    int st = 0;
    uint32_t phase = 0;
    // The step at which the combine's reads are prefetched (-1: none).
    const int prefetch_at = p.combine && p.choices.combine_prefetch ? max(0, n_steps - kSlcPrefetchAhead) : -1;
    for (int i = 0; i < n_steps; ++i) {
      if (i + kSlcTmaStages - 1 < n_steps) issue(st == 0 ? kSlcTmaStages - 1 : st - 1);  // the stage step i - 1 left
      if (i == prefetch_at) slc_prefetch_combine<Storage, kDv>(p, s0 + t0, tokens_valid, hk, lane);
      mbarrier_wait_parity(bars + st, phase);
      unsigned char* const stage = ring + st * kStageBytes;
      const int nv = min(16, nkeys - off);
      if (nv < 16) slc_zero_stage_tail<kDqk / 64 + kDv / 64>(stage, nv, lane);
      const uint32_t sk = smem_address(stage);
      float s[2][4];
      mma_frags_stage_sw<kBf16, kDqk>(s, qf, sk);  // S = Q K^T
      const int hi0 = lim[0] - off, hi1 = lim[1] - off;
      if (!__all_sync(0xffffffffu, hi0 >= 16 && hi1 >= 16)) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (nt * 8 + 2 * quad + (e & 1) >= (e >> 1 ? hi1 : hi0)) s[nt][e] = kNegInf;
      }
      slc_softmax_step<kOTiles>(s, m, lsum, acc, p.scale_log2, softmax_slack(p.choices));
      mma_p_stage_sw<Storage, kDv>(acc, s, sk + kKBytes);  // O += P V
      __syncwarp();  // every lane is done with the stage
      off += 16;
      if (off >= nkeys && u + 1 < num_blocks) off = 0, nkeys = walk.enter(++u, trow, tok, lim);
      st = st + 1 == kSlcTmaStages ? 0 : st + 1;
      phase ^= st == 0 ? 1u : 0u;
    }

    // ---- Epilogue: lse, and o_slc's rows through the ring (every box has landed and been read) ----
    slc_finish_walk<Storage, kDv>(p, acc, m, lsum, reinterpret_cast<Storage*>(ring), s0, t0, tokens_valid, hk, trow,
                                  head);
  }
}

}  // namespace nsa::cuda
