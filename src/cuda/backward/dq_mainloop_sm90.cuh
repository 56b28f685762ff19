// dq_kernel's mainloop on sm_90a (dq_wgmma.cuh has the design): the key tiles in the 128-byte
// swizzle layout from a 1024-byte boundary (DqSmem::kSw*), copied by TMA where the tensor maps
// were made (DqMaps::on), else by cp.async; the products on wgmma, the whole 64-key tile at once
// by the warpgroup. Also sm_90a's own: the selection's union tiles (union_tiles). The masking, P
// and dS are the kernel's (DqMask, dq_kernel.cuh); the same interface on sm_80:
// dq_mainloop_sm80.cuh.
#pragma once

#include <type_traits>

#include "cuda/backward/dq_smem.cuh"

namespace nsa::cuda::bwd {

template <typename E, int DQK, int DV>
struct DqKeyTiles;  // dq_kernel.cuh

template <typename E, int DQK, int DV>
struct DqMainloopSm90 {
  using L = DqSmem<E, DQK, DV>;
  // Elements from one K (V) buffer to the next; 0 where the swizzled layout has one buffer.
  static constexpr bool kOneBuf = L::kSwBufs == 1;
  static constexpr int kKBuf = kOneBuf ? 0 : kKeys * DQK;
  static constexpr int kVBuf = kOneBuf ? 0 : kKeys * DV;
  unsigned char* base;  // the layout's 1024-byte boundary
  E* sK;
  E* sV;
  E* sQ;
  E* sDo;
  uint32_t q_wg = 0, do_wg = 0;  // this warpgroup's 64 rows of Q and dO (the A operands of S and dP)
  const DqMaps* maps = nullptr;
  bool tma = false;  // K/V tiles by TMA: one thread copies each (kDqk/64 + kDv/64 boxes)
  bool primed = false;  // the next sweep's first tile is on its way into buffer 0 (prime)
  uint64_t* bars = nullptr;
  uint32_t bar_phase = 0;  // bit b: the parity of buffer b's next fill
  // The overlapped sweep (sweep<true>: pass 2 with two buffers): each tile's dQ product stays in
  // flight into the next tile, whose S / dP go out behind it; tile next_i's copy (into buffer
  // next_buf, when has_next) goes out once every warp's previous dQ has retired (prefetch). The
  // dQ product's A operand df lives until then.
  // (At Dqk 192 the 96-register dQ accumulator and df spill: 224 bytes of stack at 192 / 64.)
  static constexpr bool kCanOverlap = !kOneBuf && DQK <= 128;
  bool overlap = false;
  bool has_next = false;
  int next_i = 0, next_buf = 0;
  const BwdArgs* args = nullptr;
  const DqKeyTiles<E, DQK, DV>* key_tiles = nullptr;
  uint32_t df[kKeys / 16][4];

  __device__ __forceinline__ explicit DqMainloopSm90(unsigned char* smem) : base(smem) {
    base += (1024u - (cuda::smem_address(smem) & 1023u)) & 1023u;
    sK = reinterpret_cast<E*>(base);
    sV = reinterpret_cast<E*>(base + L::kSwV);
    sQ = reinterpret_cast<E*>(base + L::kSwQ);
    sDo = reinterpret_cast<E*>(base + L::kSwDo);
  }
  // The rows' state (DqSmem::kSwRowState).
  __device__ __forceinline__ float* row_state() const { return reinterpret_cast<float*>(base + L::kSwRowState); }

  // The tile's Q and dO rows, swizzled (the A operands of S and dP in shared memory), not yet
  // committed.
  template <typename QRow, typename DoRow>
  __device__ __forceinline__ void load_q_do(const BwdArgs& a, QRow&& q_row, DoRow&& do_row, const E* qb, const E* dob) {
    copy_rows_sw128<E, DQK>(sQ, q_row, a.vec, qb);
    copy_rows_sw128<E, DV>(sDo, do_row, a.vec, dob);
    q_wg = cuda::smem_address(sQ) + (threadIdx.x / 128) * (64 * 128);
    do_wg = cuda::smem_address(sDo) + (threadIdx.x / 128) * (64 * 128);
  }

  // The selection's union tile (a.slc_union): the union of the tile's tokens' blocks, each warp's
  // 16 / G tokens' as slc_dq_kernel's warps make it, then the CTA's. If it is small
  // (slc_union_takes, the forward's rule), its blocks become the key tiles of a selection stage
  // (n_slc of them, ascending in slc_blocks, with the tile's tokens that picked each in
  // slc_tokens), each row masked to the blocks its token picked; slc_dq_kernel makes the same
  // count from the same lists and leaves the tile. Otherwise the kernel has no selection tiles.
  // The sorts use the K/V buffers, before anything is copied there.
  __device__ __forceinline__ void union_tiles(const BwdArgs& a, int u0, int len, int64_t s0, int hk, int ntok,
                                              int warp, int lane, int& n_slc, const int32_t*& slc_blocks,
                                              const unsigned long long*& slc_tokens) {
    if (a.slc_union) {
      int32_t* const sorts = reinterpret_cast<int32_t*>(base);  // warp w: keys, blocks, masks at 3 cap w
      int* const meta = reinterpret_cast<int*>(base + L::kSwUnion);
      int32_t* const ulist = reinterpret_cast<int32_t*>(base + L::kSwUnionList);
      unsigned long long* const member = reinterpret_cast<unsigned long long*>(base + L::kSwUnionMember);
      const int cap = a.slc_cap, tpw = 16 / a.G;
      const int tw0 = u0 + warp * tpw;
      const int tw_valid = max(0, min(tpw, len - tw0));
      int32_t* const keys = sorts + warp * 3 * cap;
      const int32_t* idx = static_cast<const int32_t*>(a.indices.p) + (s0 + min(tw0, len - 1)) * a.indices.s0 +
                           int64_t(hk) * a.indices.s1;
      const int nb = cuda::warp_block_union(idx, a.indices.s0, a.n, a.lp, tw0, tw_valid, cap, keys, keys + cap,
                                            keys + 2 * cap);
      if (lane == 0) meta[warp] = nb;
      const int u = cuda::cta_union_size(sorts + cap, 3 * cap, meta, meta + kWarps);
      if (cuda::slc_union_takes(u, ntok, a.n)) {
        cuda::cta_union_list<cuda::kSlcUnionMax>(sorts + cap, sorts + 2 * cap, 3 * cap, meta, tpw, u,
                                                 ulist + cuda::kSlcUnionMax, meta + kWarps + 1, ulist, member);
        n_slc = u;
        slc_blocks = ulist;
        slc_tokens = member;
      }
    }
  }

  // With TMA: the K/V buffers' mbarriers (after dO), and Q and dO (cp.async) landed before the
  // first sweep.
  __device__ __forceinline__ void start(const DqMaps& m) {
    maps = &m;
    tma = m.on != 0;
    bars = reinterpret_cast<uint64_t*>(base + L::kSwBars);
    if (tma) {
      if (threadIdx.x == 0) {
        cuda::mbarrier_init(bars, 1);
        cuda::mbarrier_init(bars + 1, 1);
        cuda::fence_mbarrier_init();
      }
      cuda::cp_async_wait<0>();
      cuda::fence_proxy_async();  // Q and dO, for wgmma
      __syncthreads();
    }
  }

  // With TMA, where the next sweep is the one over every tile (pass 2) and nothing else uses
  // the K/V buffers before it: its first tile's copy goes out now (after start's barrier: the
  // union's sorts are done with the buffers), so that it lands under the work before that sweep
  // (pass 1's dg from the saved outputs); the sweep then waits for it without sending it again.
  template <typename Tiles>
  __device__ __forceinline__ void prime(const BwdArgs& a, const Tiles& tiles) {
    if (!tma || tiles.runs(false, false, false) == 0) return;
    if (threadIdx.x == 0) issue_tma(a, tiles, tiles.run_tile(0, false, false), 0);
    primed = true;
  }

  // dO[r][8 nt + 2 quad]: in the swizzled tile the pair lies in the 16-byte piece of columns 8 nt
  // .. 8 nt + 7 of row r.
  __device__ __forceinline__ const E* do_pair(int r, int quad, int nt) const {
    const unsigned char* dosw = reinterpret_cast<const unsigned char*>(sDo) + 4 * quad;
    return reinterpret_cast<const E*>(dosw + cuda::sw128_offset(kRows, r, nt * 8));
  }

  // TMA (one thread): tile i into buffer buf. Rows past the tile's keys arrive as whatever the
  // tensors hold there (later rows, the compressed row no sequence uses, TMA's zeros past the
  // end); sweep zeroes them before the tile is used.
  template <typename Tiles>
  __device__ __forceinline__ void issue_tma(const BwdArgs& a, const Tiles& tiles, int i, int buf) {
    const int n_cmp = tiles.n_cmp, n_slc = tiles.n_slc;
    uint64_t* bar = bars + buf;
    cuda::mbarrier_expect_tx(bar, kKeys * (DQK + DV) * sizeof(E));
    const bool cmp = i < n_cmp, slc = !cmp && i < n_cmp + n_slc;
    const CUtensorMap* km = cmp ? &maps->kc : slc ? &maps->ks : &maps->kw;
    const CUtensorMap* vm = cmp ? &maps->vc : slc ? &maps->vs : &maps->vw;
    const int row = cmp ? int(tiles.crow0) + i * kKeys
                        : slc ? int(tiles.s0) + tiles.slc_blocks[i - n_cmp] * kKeys
                              : int(tiles.s0) + tiles.p0 + (i - n_cmp - n_slc) * kKeys;
#pragma unroll
    for (int blk = 0; blk < DQK / 64; ++blk)
      cuda::tma_load_3d(sK + buf * kKBuf + blk * kKeys * 64, km, 64 * blk, tiles.hk, row, bar);
#pragma unroll
    for (int blk = 0; blk < DV / 64; ++blk)
      cuda::tma_load_3d(sV + buf * kVBuf + blk * kKeys * 64, vm, 64 * blk, tiles.hk, row, bar);
  }
  // The overlapped sweep, once this warp's previous dQ product has retired: when every warp's
  // has (the barrier), its buffer takes the next tile.
  __device__ __forceinline__ void prefetch() {
    cuda::wgmma_fence_operands(df);
    __syncthreads();
    if (!has_next) return;
    if (tma) {
      if (threadIdx.x == 0) issue_tma(*args, *key_tiles, next_i, next_buf);
    } else {
      issue(*args, *key_tiles, next_i, next_buf);
      cuda::cp_async_commit();
    }
  }

  // Without TMA: every thread copies its pieces of tile i into buffer buf (cp.async).
  template <typename Tiles>
  __device__ __forceinline__ void issue(const BwdArgs& a, const Tiles& tiles, int i, int buf) {
    const E* kb;
    const E* vb;
    int64_t ks, vs;
    const KeyTile kt = tiles.at(a, i, kb, ks, vb, vs);
    // (kb may point past the tensor for an empty chunk: zero-filled rows take qb as their address)
    copy_rows_sw128<E, DQK>(sK + buf * kKBuf, [&](int c) -> const E* { return c < kt.nk ? kb + c * ks : nullptr; },
                            a.vec, tiles.qb);
    copy_rows_sw128<E, DV>(sV + buf * kVBuf, [&](int c) -> const E* { return c < kt.nk ? vb + c * vs : nullptr; },
                           a.vec, tiles.qb);
  }

  // One sweep over the key tiles (DqKeyTiles), two-stage: tile j + 1's copy goes out before tile
  // j is computed (kOneBuf: after, into the same buffer; the SM's other CTA computes meanwhile).
  // enter(prev, next) runs (block-uniformly) between stages (prev = -1 first, next = 3 last; the
  // stages are the branches in index order); half(tk, tv, kt, c0) does the whole tile (c0 = 0) in
  // K/V buffers tk, tv where a row of the CTA sees it (the warpgroup multiplies together).
  // skip_cmp, skip_slc, skip_win: the sweep leaves out the compressed tiles (pass 1 with
  // a.dg_cmp_ready), the selection's (pass 1 with a.d_from_o), the window's (pass 1 with
  // a.dg_win_ready); j counts the tiles it takes (buffers alternate with j), real(j) is the tile.
  // kOverlap (pass 2, with two buffers): dq_products leaves each tile's dQ product in flight and
  // sends tile j + 1's copy from inside tile j (prefetch), so no barrier ends a tile; every tile
  // runs its products (a tile no row sees adds dS = 0); drain() retires the last product.
  template <bool kOverlap = false, typename Tiles, typename Choose, typename CtaSees, typename Enter, typename Half>
  __device__ __forceinline__ void sweep(const BwdArgs& a, const Tiles& tiles, bool skip_cmp, bool skip_slc,
                                        bool skip_win, Choose&& choose, CtaSees&& cta_sees, Enter&& enter,
                                        Half&& half) {
    constexpr bool kOv = kOverlap && kCanOverlap;
    int cur = -1;
    const int n_run = tiles.runs(skip_cmp, skip_slc, skip_win);
    auto real = [&](int j) { return tiles.run_tile(j, skip_cmp, skip_slc); };
    overlap = kOv;
    if constexpr (kOv) {
      args = &a;
      key_tiles = &tiles;
    }
    if (tma) {
      // (primed: prime sent this sweep's first tile, the whole sweep's tile 0, already)
      if (n_run > 0 && primed) primed = false;
      else if (threadIdx.x == 0 && n_run > 0) issue_tma(a, tiles, real(0), 0);
    } else {
      if (n_run > 0) issue(a, tiles, real(0), 0);
      cuda::cp_async_commit();
    }
    for (int j = 0; j < n_run; ++j) {
      const int i = real(j);
      const E* kb;
      const E* vb;
      int64_t ks, vs;
      const KeyTile kt = tiles.at(a, i, kb, ks, vb, vs);
      if constexpr (kOv) {  // tile j + 1's copy: prefetch() sends it
        has_next = j + 1 < n_run;
        next_i = has_next ? real(j + 1) : 0;
        next_buf = (j + 1) & 1;
      }
      if (tma) {
        // Tile j + 1's buffer: its last reader (tile j - 1) passed the barrier that ends its tile.
        if (!kOv && !kOneBuf && threadIdx.x == 0 && j + 1 < n_run) issue_tma(a, tiles, real(j + 1), (j + 1) & 1);
        const int buf = j & 1;
        cuda::mbarrier_wait_parity(bars + buf, (bar_phase >> buf) & 1u);
        bar_phase ^= 1u << buf;
        if (kt.nk < kKeys) {
          // The rows past the tile's keys become zeros (a NaN there would survive 0 * k).
          cuda::zero_sw128_rows<kKeys, kThreads>(sK + buf * kKBuf, DQK / 64, kt.nk);
          cuda::zero_sw128_rows<kKeys, kThreads>(sV + buf * kVBuf, DV / 64, kt.nk);
          cuda::fence_proxy_async();  // the zeros, for wgmma
          __syncthreads();
        }
      } else {
        if constexpr (kOv) {
          cuda::cp_async_wait<0>();  // tile j (prefetch sent it in tile j - 1)
        } else {
          // Its buffer's last reader (tile j - 1) is done.
          if (!kOneBuf && j + 1 < n_run) issue(a, tiles, real(j + 1), (j + 1) & 1);
          cuda::cp_async_commit();
          if constexpr (kOneBuf)
            cuda::cp_async_wait<0>();
          else
            cuda::cp_async_wait<1>();
        }
        cuda::fence_proxy_async();  // the landed K/V copies, for wgmma
        __syncthreads();
      }
      const int stage = tiles.branch_of(i);
      for (; cur < stage; ++cur) enter(cur, cur + 1);
      choose(kt);  // the rows that see the tile (its P's mask), whichever the CTA's decision
      if (kOv || cta_sees(kt)) {
#pragma unroll 1
        for (int c0 = 0; c0 < kKeys; c0 += kKeys) half(sK + (j & 1) * kKBuf, sV + (j & 1) * kVBuf, kt, c0);
      }
      if constexpr (kOv) continue;
      __syncthreads();
      if constexpr (kOneBuf) {  // the one buffer's readers are done: tile j + 1 into it
        if (j + 1 < n_run) {
          if (tma) {
            if (threadIdx.x == 0) issue_tma(a, tiles, real(j + 1), (j + 1) & 1);
          } else {
            issue(a, tiles, real(j + 1), 0);
          }
        }
      }
    }
    if constexpr (kOv) {
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operands(df);
    }
    cuda::cp_async_wait<0>();
    __syncthreads();
    for (; cur < 2; ++cur) enter(cur, cur + 1);
    enter(2, 3);
  }
  // After an overlapped sweep: its last dQ product retired there; acc is read from here on.
  template <int N>
  __device__ __forceinline__ void drain(float (&acc)[N][4]) {
    if (overlap) cuda::wgmma_fence_operands(acc);
    overlap = false;
  }

  // Pass 1, the whole tile: S = Q K^T, P, then O += P V (64 keys).
  template <typename P, typename PWg>
  __device__ __forceinline__ void output_products(float (&acc_o)[DV / 8][4], int, const E* tk, const E* tv,
                                                  const KeyTile& kt, int, P&&, PWg&& probabilities_wg) {
    float s[kKeys / 8][4];  // (overwritten: the first product has scale_d 0)
    cuda::wgmma_batch(
        [&] { cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DQK, kRows, true>(s, q_wg, cuda::smem_address(tk)); }, s);
    probabilities_wg(s, kt);
    uint32_t pf[kKeys / 16][4];
    to_operand<E, kKeys / 8>(s, pf);
    cuda::wgmma_batch([&] { wgmma_ab_issue<E, DV>(acc_o, pf, cuda::smem_address(tv)); }, acc_o);
  }
  // Pass 2, the whole tile: S = Q K^T, dP = dO V^T, dS (dscores; acc_dg: the union tiles' dg_slc
  // as well), then dQ += dS K (64 keys).
  template <typename P, typename PWg, typename DScores>
  __device__ __forceinline__ void dq_products(float (&acc_q)[DQK / 8][4], int, const E* tk, const E* tv,
                                              const KeyTile& kt, int, P&&, PWg&& probabilities_wg, DScores&& dscores,
                                              bool acc_dg) {
    float s[kKeys / 8][4], dp[kKeys / 8][4];  // (overwritten: the first products have scale_d 0)
    // S and dP as two groups, both operands from shared memory (no A fragments in registers): P
    // is formed from S while dP's products still run (groups complete in issue order).
    cuda::wgmma_fence_operands(s);
    cuda::wgmma_fence_operands(dp);
    cuda::wgmma_fence();
    cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DQK, kRows, true>(s, q_wg, cuda::smem_address(tk));
    cuda::wgmma_commit();
    cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DV, kRows, true>(dp, do_wg, cuda::smem_address(tv));
    cuda::wgmma_commit();
    cuda::wgmma_wait<1>();  // S (dP may still run), and before it the previous tile's dQ (overlap)
    cuda::wgmma_fence_operands(s);
    if (overlap) {
      cuda::wgmma_fence_operands(acc_q);
      prefetch();
    }
    probabilities_wg(s, kt);
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operands(dp);
    if (acc_dg)
      dscores(s, dp, std::true_type{});
    else
      dscores(s, dp, std::false_type{});
    to_operand<E, kKeys / 8>(s, df);
    if (overlap) {  // dQ += dS K left in flight: the next tile's S wait (or the sweep's end) retires it
      cuda::wgmma_fence_operands(acc_q);
      cuda::wgmma_fence();
      wgmma_ab_issue<E, DQK>(acc_q, df, cuda::smem_address(tk));
      cuda::wgmma_commit();
      return;
    }
    cuda::wgmma_batch([&] { wgmma_ab_issue<E, DQK>(acc_q, df, cuda::smem_address(tk)); }, acc_q);
  }
};

}  // namespace nsa::cuda::bwd
