// dkv_ws_kernel: the key-centric backward (dkv_kernel.cuh) warp-specialised, on sm_90a for Dqk = Dv
// = 128 with 16-byte aligned rows (launch.cuh picks it; CudaKernelChoices::dkv_warp_specialized
// = false keeps dkv_kernel). Same plan (DkvPlan: which key tile, which query tiles), same
// products (DkvWgmma) and same P / dS (dkv_grads); what differs is who waits for what.
//
// dkv_kernel is one warpgroup that builds each query tile's row table, copies its Q / dO rows and
// runs its products, with CTA barriers between them; two CTAs per SM hide part of each one's
// waits. Here one CTA per SM has three warpgroups and kStages = 5 Q / dO stages (tile i in stage
// i % 5):
//   producer   (warpgroup 0, 40 registers): warp w fills query tiles w, w + 4, ...: loads the
//              tile's row statistics (tokens, lse, gate, dg) while its previous tile's copies
//              land, waits until the stage is free (empty), writes the row table (RowTile),
//              copies the Q and dO rows (consecutive tokens by TMA; the selection's gathered
//              rows by TMA too at G >= 8, a box of G heads per token, else by cp.async; the rows
//              past the tile zeroed), fences them for wgmma and arrives on the tile's full barrier;
//   consumers  (warpgroups 1 and 2, 232 registers each): consumer c takes the tiles i = c, c + 2,
//              ...: waits on full, runs the tile's four products and its P / dS into its own
//              dK / dV accumulators, arrives on empty.
// The consumers share the key tile (they copy it: one K, the other V) and meet only at named
// barriers: before the raw keys' window -> selection switch (the window's dK / dV written, the
// selection's keys copied) and in the epilogues, which add consumer 0's and consumer 1's sums in
// that order (a fixed order: the result is deterministic, and differs in rounding from
// dkv_kernel's one running sum).
//
// No cycle of waits: when a consumer waits at a named barrier it has released every tile before
// its own current one, and the other consumer's next tile j is earlier than that; filling j (and
// the producer warp's tiles before it) needs only tiles before j - kStages released, which both
// consumers have done.
#pragma once

#include "cuda/backward/dkv_mainloop_sm90.cuh"
#include "cuda/backward/dkv_plan.cuh"

namespace nsa::cuda::bwd {

// The warp-specialised layout (from a 1024-byte boundary; the launch adds 1024 bytes of slack):
// the key tile, kStages Q / dO stages, their row tables and flags, the mbarriers.
template <typename E, int DQK, int DV>
struct DkvWsSmem {
  // Tile i lands in stage i % kStages; its full and empty mbarriers are slot i % kSlots, so the
  // tiles that share a slot (i, i + kSlots, ...) are all one consumer's, which waits on every phase
  // of its slots in order. A parity wait is exact only if the waiter is at most one phase ahead of
  // the barrier: one mbarrier per stage would break that here, since a stage's successive tiles
  // alternate between the consumers (an odd kStages) and a consumer would skip phases.
  static constexpr int kStages = 5;
  static constexpr int kSlots = 2 * kStages;
  static constexpr int kK = 0;                                   // [kKeys][DQK], swizzled
  static constexpr int kV = kK + kKeys * DQK * 2;                // [kKeys][DV]
  static constexpr int kQ = kV + kKeys * DV * 2;                 // [kStages][kRows][DQK]
  static constexpr int kDo = kQ + kStages * kRows * DQK * 2;     // [kStages][kRows][DV]
  static constexpr int kRt = kDo + kStages * kRows * DV * 2;     // [kStages] RowTile
  static constexpr int kWhole = kRt + kStages * int(sizeof(RowTile));  // [kStages] int: every row sees every key
  static constexpr int kBars = kWhole + 32;                      // full, empty: [kSlots] mbarriers each; tma: [4]
  static constexpr int kEnd = kBars + (2 * kSlots + 4) * 8;
  static_assert(kStages <= 8 && kSlots % 2 == 0, "wholes fit their 32 bytes; a slot's tiles are one consumer's");
  static constexpr int kLaunch = kEnd + 1024;
  // The epilogue's fp32 scratch, [2 consumers][kKeys][kSub + 4], over the key tile.
  static constexpr int kLdS = kSub + 4;
  static_assert(2 * kKeys * kLdS * 4 <= kQ, "the epilogue's scratch fits the K and V tiles");
  static_assert(kBars % 8 == 0 && kRt % 16 == 0, "mbarriers on 8 bytes, RowTile's float4 on 16");
};

constexpr int kWsThreads = 3 * 128;  // one producer and two consumer warpgroups
constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;
static_assert(kWsProducerRegs * 128 + kWsConsumerRegs * 256 <= 65536, "the register file holds the three warpgroups");

// Warp-wide copy of kRows rows of D 16-bit elements into a swizzled [kRows][D] tile by cp.async:
// row r from rows[r] (nullptr: zeros; `any` a valid address for the zero fill). Lane l copies
// 16-byte piece l % (D / 8) of rows l / (D / 8) + k * 32 / (D / 8): rows 8 apart share their
// swizzle, so each lane has 8 / (32 / (D / 8)) destination patterns plus a constant per 8 rows.
template <typename E, int D>
__device__ __forceinline__ void warp_copy_rows_sw128(E* dst, const void* const* rows, const E* any, int lane) {
  constexpr int kChunks = D / 8, kStep = 32 / kChunks;
  static_assert(32 % kChunks == 0 && 8 % kStep == 0, "a warp covers whole rows, a swizzle period in whole passes");
  unsigned char* bytes = reinterpret_cast<unsigned char*>(dst);
  const int piece = lane % kChunks;
#pragma unroll
  for (int m = 0; m < 8 / kStep; ++m) {
    const int r0 = lane / kChunks + kStep * m;
    unsigned char* d0 = bytes + cuda::sw128_offset(kRows, r0, piece * 8);
#pragma unroll
    for (int k = 0; k < kRows / 8; ++k) {
      const E* src = static_cast<const E*>(rows[r0 + 8 * k]);
      cuda::cp_async_16(d0 + k * 8 * 128, src != nullptr ? src + piece * 8 : any, src != nullptr);
    }
  }
}

template <typename E, int DQK, int DV, KeySet kSet>
__global__ void __launch_bounds__(kWsThreads, 1) dkv_ws_kernel(const BwdArgs a, const __grid_constant__ DkvMaps maps) {
  if constexpr (!cuda::kWgmmaCompiled || DQK != 128 || DV != 128) {
    cuda::wgmma_unavailable();  // launched only where the sm_90a body runs (launch.cuh)
  } else {
    using L = DkvWsSmem<E, DQK, DV>;
    constexpr int kStages = L::kStages, kSlots = L::kSlots;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (cuda::smem_address(smem_raw) & 1023u)) & 1023u);
    E* const sK = reinterpret_cast<E*>(smem + L::kK);
    E* const sV = reinterpret_cast<E*>(smem + L::kV);
    E* const sQ = reinterpret_cast<E*>(smem + L::kQ);
    E* const sDo = reinterpret_cast<E*>(smem + L::kDo);
    RowTile* const rt = reinterpret_cast<RowTile*>(smem + L::kRt);
    int* const wholes = reinterpret_cast<int*>(smem + L::kWhole);
    uint64_t* const full = reinterpret_cast<uint64_t*>(smem + L::kBars);
    uint64_t* const empty = full + kSlots;
    uint64_t* const tma_bar = empty + kSlots;

    DkvPlan<kSet> p;
    if (!p.init(a)) return;  // the same for every thread of the CTA
    const int n_tiles = p.n_tiles();
    if (threadIdx.x == 0) {
      for (int s = 0; s < kSlots; ++s) {
        cuda::mbarrier_init(full + s, 32);    // the producer warp of the slot's tile
        cuda::mbarrier_init(empty + s, 128);  // the consumer warpgroup of the slot's tiles
      }
      for (int w = 0; w < 4; ++w) cuda::mbarrier_init(tma_bar + w, 1);  // producer warp w's TMA copies
      cuda::fence_mbarrier_init();
    }
    __syncthreads();  // the last CTA-wide barrier: from here on the warpgroups meet at mbarriers and named barriers
    const E* qb = static_cast<const E*>(a.q.p);
    const E* dob = static_cast<const E*>(a.d_o.p);
    const int lane = threadIdx.x % 32;

    if (threadIdx.x < 128) {
      // ---- producer: warp w fills tiles w, w + 4, ... in stage w
      cuda::setmaxnreg_dec<kWsProducerRegs>();
      const int w = threadIdx.x / 32;
      const bool tma = maps.on != 0;  // consecutive tokens by TMA (the raw keys' maps exist only with a window)
      const float* lse_p = static_cast<const float*>(a.lse.p);
      // Rows lane and lane + 32 of a tile: token (-1: padding) and statistics, loaded a tile ahead
      // (while the previous tile's copies land) so that a freed stage waits for copies alone.
      struct Rows {
        int tok[2];
        float lse[2], g[2], dg[2];
      };
      auto load_rows = [&](int i, Rows& rows) {
        const auto q = p.query_tile(i);
        const int branch = p.branch_of(q);
        const int32_t* tokens = a.sel_tokens + q.i0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = lane + 32 * h;
          const int tok = p.row_token(q, tokens, r, a.G);
          rows.tok[h] = tok;
          if (tok >= 0) {
            const int head = p.hk * a.G + r % a.G;
            const int64_t e = (int64_t(tok) * a.hq + head) * 3 + branch;
            rows.lse[h] = lse_p[tok * a.lse.s0 + head * a.lse.s1 + branch];
            rows.g[h] = a.g32[e];
            rows.dg[h] = a.dg32[e];
          }
        }
      };
      Rows rows;
      if (w < n_tiles) load_rows(w, rows);
      uint32_t tma_phase = 0;  // the parity of this warp's next TMA fill
#pragma unroll 1
      for (int i = w; i < n_tiles; i += 4) {
        const int s = i % kStages;
        // The stage's previous tile (i - kStages, the other consumer's) released. The slot's phase
        // before that one (tile i - kStages - kSlots) is done: this warp's previous tile waited for
        // tile i - 4 - kStages, a later tile of the same consumer.
        if (i >= kStages)
          cuda::mbarrier_wait_parity(empty + (i - kStages) % kSlots, ((i - kStages) / kSlots) & 1);
        RowTile& R = rt[s];
        E* const q_st = sQ + s * kRows * DQK;
        E* const do_st = sDo + s * kRows * DV;
        const auto q = p.query_tile(i);
        const int branch = p.branch_of(q);
        bool whole = true;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = lane + 32 * h, tok = rows.tok[h];
          if (tok < 0) {
            R.q[r] = R.dO[r] = nullptr;
            R.st[r] = make_float4(0.f, 0.f, 0.f, 0.f);
            R.vis[r] = make_int2(0, -1);
            continue;
          }
          const int head = p.hk * a.G + r % a.G;
          R.q[r] = qb + int64_t(tok) * a.q.s0 + int64_t(head) * a.q.s1;
          R.dO[r] = dob + int64_t(tok) * a.d_o.s0 + int64_t(head) * a.d_o.s1;
          p.row_stats(a, branch, tok, rows.lse[h], rows.g[h], rows.dg[h], R.st[r], R.vis[r], whole);
        }
        whole = __all_sync(0xffffffffu, whole);
        if (lane == 0) wholes[s] = whole;
        __syncwarp();  // the row pointers, for every lane's copies
        const bool by_tma = tma && !q.list;
        const bool list_by_tma = q.list && maps.list != 0;  // G >= 8: a box of G rows per token
        if (list_by_tma) {
          // Token u's G rows from its box (its position from the row table: vis.y = t); the
          // padding rows past the list's end are zeroed below like a window tile's.
          if (lane == 0) cuda::mbarrier_expect_tx(tma_bar + w, q.ntok * a.G * (DQK + DV) * sizeof(E));
          __syncwarp();
          const int h0 = p.hk * a.G;
          for (int u = lane; u < q.ntok; u += 32) {
            const int tok = int(p.s0) + R.vis[u * a.G].y;
#pragma unroll
            for (int blk = 0; blk < DQK / 64; ++blk)
              cuda::tma_load_3d(q_st + blk * kRows * 64 + u * a.G * 64, &maps.q1, 64 * blk, h0, tok, tma_bar + w);
#pragma unroll
            for (int blk = 0; blk < DV / 64; ++blk)
              cuda::tma_load_3d(do_st + blk * kRows * 64 + u * a.G * 64, &maps.d_o1, 64 * blk, h0, tok, tma_bar + w);
          }
        } else if (by_tma) {
          // Whole tokens from s0 + t0 (boxes of tq tokens x G heads); rows past the tile's zeroed below.
          if (lane == 0) {
            cuda::mbarrier_expect_tx(tma_bar + w, kRows * (DQK + DV) * sizeof(E));
            const int tok = int(p.s0) + q.t0, h0 = p.hk * a.G;
#pragma unroll
            for (int blk = 0; blk < DQK / 64; ++blk)
              cuda::tma_load_3d(q_st + blk * kRows * 64, &maps.q, 64 * blk, h0, tok, tma_bar + w);
#pragma unroll
            for (int blk = 0; blk < DV / 64; ++blk)
              cuda::tma_load_3d(do_st + blk * kRows * 64, &maps.d_o, 64 * blk, h0, tok, tma_bar + w);
          }
        } else {
          warp_copy_rows_sw128<E, DQK>(q_st, R.q, qb, lane);
          warp_copy_rows_sw128<E, DV>(do_st, R.dO, dob, lane);
          cuda::cp_async_commit();
        }
        if (i + 4 < n_tiles) load_rows(i + 4, rows);  // (the loads overlap the copies' flight)
        if (by_tma || list_by_tma) {
          cuda::mbarrier_wait_parity(tma_bar + w, tma_phase);
          tma_phase ^= 1u;
          const int real = q.ntok * a.G;
          if (real < kRows) {
            // (row r's 16-byte pieces stay in row r under the swizzle)
            for (int e = lane; e < (kRows - real) * 8 * (DQK / 64); e += 32) {
              const int blk = e / ((kRows - real) * 8), r = real + e % ((kRows - real) * 8) / 8, pc = e % 8;
              *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(q_st) + blk * kRows * 128 + r * 128 + pc * 16) =
                  make_uint4(0u, 0u, 0u, 0u);
            }
            for (int e = lane; e < (kRows - real) * 8 * (DV / 64); e += 32) {
              const int blk = e / ((kRows - real) * 8), r = real + e % ((kRows - real) * 8) / 8, pc = e % 8;
              *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(do_st) + blk * kRows * 128 + r * 128 + pc * 16) =
                  make_uint4(0u, 0u, 0u, 0u);
            }
          }
        } else {
          cuda::cp_async_wait<0>();
        }
        cuda::fence_proxy_async();  // this lane's copies, zeros and table -> the consumers' wgmma
        cuda::mbarrier_arrive(full + i % kSlots);
      }
      return;
    }

    // ---- consumers: consumer c takes tiles c, c + 2, ...
    cuda::setmaxnreg_inc<kWsConsumerRegs>();
    const int c = threadIdx.x / 128 - 1;
    const int ctid = threadIdx.x - 128;  // 0 .. 255 over both consumers
    const int wtid = threadIdx.x % 128;
    const int group = lane / 4, quad = lane % 4;
    const int key_w = (wtid / 32) * 16;  // the warp's first key of the tile
    auto cbar = [] { cuda::named_barrier_sync(1, 256); };
    int kpos[2];
    bool kin[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = key_w + group + 8 * h;
      kin[h] = k < p.nk;
      kpos[h] = p.kt.kp0 + k * p.kt.kstep;
    }
    const float scale_log2 = a.scale * kLog2e;
    float acc_k[DQK / 8][4], acc_v[DV / 8][4];
    zero(acc_k);
    zero(acc_v);

    // The key tile of `phase`: consumer 0 copies K, consumer 1 V; landed and fenced for wgmma, and
    // visible to both, on return.
    auto load_kv = [&](int phase) {
      p.template key_rows<E, DQK, DV>(a, phase, [&](const E* kb, int64_t ks, const E* vb, int64_t vs) {
        if (c == 0)
          copy_rows_sw128<E, DQK>(sK, [&](int k) -> const E* { return k < p.nk ? kb + k * ks : nullptr; }, true, qb, wtid);
        else
          copy_rows_sw128<E, DV>(sV, [&](int k) -> const E* { return k < p.nk ? vb + k * vs : nullptr; }, true, qb, wtid);
      });
      cuda::cp_async_commit();
      cuda::cp_async_wait<0>();
      cuda::fence_proxy_async();
      cbar();
    };

    // Writes the tile's dK (which = 0) or dV rows, consumer 0's sum plus consumer 1's, through the
    // fp32 scratch over the key tile 32 columns at a time (DkvPlan::emit_element), then clears the
    // accumulators. The caller has passed a barrier after both consumers' last products with the
    // key tile, and copies it again (if at all) after.
    float* scratch = reinterpret_cast<float*>(smem + L::kK);
    constexpr int kLdS = L::kLdS;
    auto emit = [&](auto& acc, int which, OutMat3 out, bool add_phi, float* part) {
      constexpr int kTiles = int(std::extent_v<std::remove_reference_t<decltype(acc)>>);
      float* mine = scratch + c * kKeys * kLdS;
#pragma unroll 1
      for (int col0 = 0; col0 < kTiles * 8; col0 += kSub) {
        acc_columns_to_scratch<kLdS>(acc, mine, col0, key_w, group, quad);
        cbar();
        for (int e = ctid; e < p.nk_emit * kSub; e += 256) {
          const int k = e / kSub, col = e % kSub;
          const float val = scratch[k * kLdS + col] + scratch[(kKeys + k) * kLdS + col];
          p.template emit_element<E>(a, which, kTiles * 8, k, col0 + col, val, out, add_phi, part);
        }
        cbar();
      }
    };
    auto epilogue = [&](OutMat3 dk_out, OutMat3 dv_out, bool add_phi, float* part_k, float* part_v) {
      emit(acc_k, 0, dk_out, add_phi, part_k);
      emit(acc_v, 1, dv_out, add_phi, part_v);
    };

    if (kSet == KeySet::raw && !a.shared_kv && p.n0 == 0 && p.piece == 0)
      epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);  // no window: zeros
    if (n_tiles > 0) load_kv(p.n0 > 0 ? 0 : 1);
    // Raw keys with both a window and a list: the window's tiles done (both consumers), its dK / dV
    // written (independent K/V), then the selection's keys.
    bool switched = !(kSet == KeySet::raw && p.n0 > 0 && p.n1 > 0);
    auto switch_keys = [&] {
      cbar();
      if (!a.shared_kv) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);
      load_kv(1);
      switched = true;
    };
    const DkvWgmma<E, DQK, DV, kRows * DQK, kRows * DV> mma{sK, sV, sQ, sDo};
#pragma unroll 1
    for (int i = c; i < n_tiles; i += 2) {
      if (!switched && i >= p.n0) switch_keys();
      const int s = i % kStages;
      cuda::mbarrier_wait_parity(full + i % kSlots, (i / kSlots) & 1);
      const bool whole = wholes[s] != 0;
      mma.tile_overlapped(acc_k, acc_v, rt[s], s, [&](float (&sc)[kSubTiles][4], float (&dp)[kSubTiles][4], const RowTile& R, int, int r0) {
        dkv_grads(sc, dp, R, whole, kpos, kin, a.scale, scale_log2, r0);
      });
      cuda::mbarrier_arrive(empty + i % kSlots);  // this tile's wgmma reads are done (each batch waited)
    }
    if (!switched) switch_keys();  // this consumer had no list tile; the other one has
    cbar();                        // both consumers' products are done: the key tile is free for the scratch

    p.template final_writes<E, DQK, DV>(a, epilogue, cbar, ctid, 256);
  }
}

}  // namespace nsa::cuda::bwd
