// dkv_kernel's mainloop on sm_90a (dkv_kernel.cuh has the design of its products): the key tile
// resident and the query tiles in the 128-byte swizzle layout from a 1024-byte boundary
// (DkvSmem::kSw*), the query tiles of consecutive tokens copied by TMA where the tensor maps were
// made (DkvMaps::on), the others by cp.async; the four products of a query tile on wgmma, in two
// halves of 32 rows. P and dS are the kernel's (dkv_kernel.cuh); the same interface on sm_80:
// dkv_mainloop_sm80.cuh.
#pragma once

#include "cuda/backward/dkv_smem.cuh"

namespace nsa::cuda::bwd {

// The four products of one query tile on wgmma (dkv_kernel.cuh has their design), for a warpgroup:
// the key tile at sK / sV, query buffer b's Q and dO rows at sQ + b * kQStride, sDo + b * kDoStride
// (elements), every tile in the 128-byte swizzle layout. dkv_kernel's sm_90a mainloop (below) and
// the warp-specialised dkv_ws_kernel (dkv_ws_kernel.cuh) run them.
template <typename E, int DQK, int DV, int kQStride, int kDoStride>
struct DkvWgmma {
  static constexpr int kQBuf = kQStride;
  static constexpr int kDoBuf = kDoStride;
  E* sK;
  E* sV;
  E* sQ;
  E* sDo;

  // The products of one half (rows r0 .. r0 + 31 of query buffer `buf`) as warpgroup MMAs. The K
  // and V tiles are A operands read from shared memory (K-major descriptors, never held in
  // registers); P^T and dS^T are register A operands packed from this half's accumulators.
  static constexpr int kSwBlock = kRows * 128;  // bytes of one 64-column block of a 64-row swizzled tile
  static __device__ __forceinline__ uint64_t sw_desc(uint32_t base, uint32_t off, uint32_t lbo) {
    return cuda::wgmma_desc_sw128(base, off, lbo, 1024);
  }
  // S^T = K Q^T and dP^T = V dO^T (64 keys x 32 rows each): m64n32k16, A and B both K-major. The
  // issue alone (no fence, commit or wait: wg_scores and tile_overlapped wrap it).
  __device__ __forceinline__ void scores_issue(float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], int buf,
                                               int r0) const {
    const uint32_t k_base = cuda::smem_address(sK), v_base = cuda::smem_address(sV);
    const uint32_t q_base = cuda::smem_address(sQ + buf * kQBuf) + r0 * 128;
    const uint32_t do_base = cuda::smem_address(sDo + buf * kDoBuf) + r0 * 128;
    // (s and dp are overwritten: each one's first product has scale_d 0.)
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kSwBlock + (kk & 3) * 32;
      cuda::wgmma_ss<kSub, kIsBf16<E>, 0>(s, sw_desc(k_base, off, 16), sw_desc(q_base, off, 16), kk == 0 ? 0 : 1);
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kSwBlock + (kk & 3) * 32;
      cuda::wgmma_ss<kSub, kIsBf16<E>, 0>(dp, sw_desc(v_base, off, 16), sw_desc(do_base, off, 16), kk == 0 ? 0 : 1);
    }
  }
  __device__ __forceinline__ void wg_scores(float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], int buf, int r0) const {
    cuda::wgmma_batch([&] { scores_issue(s, dp, buf, r0); }, s, dp);
  }
  // dV += (g P)^T dO and dK += scale dS^T Q: m64n{Dv}k16 and m64n{Dqk}k16, two k16 steps (the
  // half's 32 rows) each, B = the same Q / dO buffers read MN-major (LBO: the next 64 columns).
  // The issue alone, as scores_issue.
  __device__ __forceinline__ void accumulate_issue(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4],
                                                   const uint32_t (&pf)[kSubTiles / 2][4],
                                                   const uint32_t (&df)[kSubTiles / 2][4], int buf, int r0) const {
    const uint32_t q_base = cuda::smem_address(sQ + buf * kQBuf) + r0 * 128;
    const uint32_t do_base = cuda::smem_address(sDo + buf * kDoBuf) + r0 * 128;
#pragma unroll
    for (int kk = 0; kk < kSubTiles / 2; ++kk)
      cuda::wgmma_rs<DV, kIsBf16<E>, 1>(acc_v, pf[kk], sw_desc(do_base, kk * 16 * 128, kSwBlock), 1);
#pragma unroll
    for (int kk = 0; kk < kSubTiles / 2; ++kk)
      cuda::wgmma_rs<DQK, kIsBf16<E>, 1>(acc_k, df[kk], sw_desc(q_base, kk * 16 * 128, kSwBlock), 1);
  }
  __device__ __forceinline__ void wg_accumulate(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4],
                                                const uint32_t (&pf)[kSubTiles / 2][4],
                                                const uint32_t (&df)[kSubTiles / 2][4], int buf, int r0) const {
    cuda::wgmma_batch([&] { accumulate_issue(acc_k, acc_v, pf, df, buf, r0); }, acc_v, acc_k);
  }

  // One query tile (buffer `buf`, row table R) against the resident key tile: the warpgroup's 64
  // keys (warp w of the warpgroup: keys 16w ..), the tile's rows in two halves of 32. grads(s, dp,
  // R, buf, r0) turns S^T and dP^T into g P and dS.
  template <typename Grads>
  __device__ __forceinline__ void tile(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4], const RowTile& R, int buf,
                                       Grads&& grads) const {
#pragma unroll 1
    for (int r0 = 0; r0 < kRows; r0 += kSub) {
      float s[kSubTiles][4], dp[kSubTiles][4];
      wg_scores(s, dp, buf, r0);
      grads(s, dp, R, buf, r0);
      uint32_t pf[kSubTiles / 2][4], df[kSubTiles / 2][4];
      to_operand<E, kSubTiles>(s, pf);
      to_operand<E, kSubTiles>(dp, df);
      wg_accumulate(acc_k, acc_v, pf, df, buf, r0);
    }
  }
  // The same products with the halves overlapped (dkv_ws_kernel's consumers): half 1's S^T / dP^T
  // are issued together with half 0's dV / dK (before them: wgmma groups complete in issue order),
  // so that half 1's P / dS are formed while half 0's dV / dK products run. Half 0's operand
  // registers stay untouched until the final wait (their products read them until then).
  template <typename Grads>
  __device__ __forceinline__ void tile_overlapped(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4],
                                                  const RowTile& R, int buf, Grads&& grads) const {
    uint32_t pf0[kSubTiles / 2][4], df0[kSubTiles / 2][4];
    {
      float s0[kSubTiles][4], dp0[kSubTiles][4];
      wg_scores(s0, dp0, buf, 0);
      grads(s0, dp0, R, buf, 0);
      to_operand<E, kSubTiles>(s0, pf0);
      to_operand<E, kSubTiles>(dp0, df0);
    }
    float s1[kSubTiles][4], dp1[kSubTiles][4];
    cuda::wgmma_fence_operands(s1);
    cuda::wgmma_fence_operands(dp1);
    cuda::wgmma_fence_operands(acc_k);
    cuda::wgmma_fence_operands(acc_v);
    cuda::wgmma_fence();
    scores_issue(s1, dp1, buf, kSub);
    cuda::wgmma_commit();
    accumulate_issue(acc_k, acc_v, pf0, df0, buf, 0);
    cuda::wgmma_commit();
    cuda::wgmma_wait<1>();  // half 1's scores (half 0's dV / dK may still run)
    cuda::wgmma_fence_operands(s1);
    cuda::wgmma_fence_operands(dp1);
    grads(s1, dp1, R, buf, kSub);
    uint32_t pf1[kSubTiles / 2][4], df1[kSubTiles / 2][4];
    to_operand<E, kSubTiles>(s1, pf1);
    to_operand<E, kSubTiles>(dp1, df1);
    cuda::wgmma_fence();
    accumulate_issue(acc_k, acc_v, pf1, df1, buf, kSub);
    cuda::wgmma_commit();
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operands(pf0);
    cuda::wgmma_fence_operands(df0);
    cuda::wgmma_fence_operands(pf1);
    cuda::wgmma_fence_operands(df1);
    cuda::wgmma_fence_operands(acc_k);
    cuda::wgmma_fence_operands(acc_v);
  }
};

template <typename E, int DQK, int DV, KeySet kSet>
struct DkvMainloopSm90 {
  using L = DkvSmem<E, DQK, DV>;
  // Elements from one Q (dO) buffer to the next; 0 where the swizzled layout has one buffer.
  static constexpr bool kOneBuf = L::kSwBufs == 1;
  static constexpr int kQBuf = kOneBuf ? 0 : kRows * DQK;
  static constexpr int kDoBuf = kOneBuf ? 0 : kRows * DV;
  // Thread 0 copies each query tile of consecutive tokens (the compressed keys' tiles, the raw
  // keys' window tiles; not the selection's gathered ones) by TMA (DQK / 64 + DV / 64 boxes of tq
  // tokens x G heads), completing on the buffer's mbarrier. A box reads whole tokens past the
  // tile's (the next sequence's or split's, or TMA's zeros past the end); those rows are zeroed
  // after the wait (tile_rows), as the copies' zero fill did. tile_rows < 0: the buffer's tile
  // came by cp.async.
  // (<raw> at Dqk 192 keeps its copies: there the TMA path's registers raised its spills from 22 to
  // 70 bytes.)
  static constexpr bool kTmaSet = kSet == KeySet::cmp || (kSet == KeySet::raw && DQK <= 128);
  unsigned char* smem;  // the layout's 1024-byte boundary
  E* sK;
  E* sV;
  E* sQ;
  E* sDo;
  RowTile* ri;
  TileRing* ring;
  const DkvMaps* maps = nullptr;
  bool tma = false;
  uint64_t* bars = nullptr;
  uint32_t bar_phase = 0;                // bit b: the parity of buffer b's next fill
  int tile_rows0 = -1, tile_rows1 = -1;  // rows of real queries in buffers 0 / 1 (TMA: the rest zeroed)

  __device__ __forceinline__ explicit DkvMainloopSm90(unsigned char* smem_raw) : smem(smem_raw) {
    smem += (1024u - (cuda::smem_address(smem_raw) & 1023u)) & 1023u;
    sK = reinterpret_cast<E*>(smem + L::kSwK);
    sV = reinterpret_cast<E*>(smem + L::kSwV);
    sQ = reinterpret_cast<E*>(smem + L::kSwQ);
    sDo = reinterpret_cast<E*>(smem + L::kSwDo);
    ri = reinterpret_cast<RowTile*>(smem + L::kSwRi);
    ring = reinterpret_cast<TileRing*>(smem + L::kSwRing);
  }

  // Starts copying the key tile (key c at kb + c * ks, vb + c * vs; rows from nk on zero-filled).
  __device__ __forceinline__ void load_kv(const BwdArgs& a, const E* kb, int64_t ks, const E* vb, int64_t vs, int nk,
                                          const E* qb) {
    copy_rows_sw128<E, DQK>(sK, [&](int c) -> const E* { return c < nk ? kb + c * ks : nullptr; }, a.vec, qb);
    copy_rows_sw128<E, DV>(sV, [&](int c) -> const E* { return c < nk ? vb + c * vs : nullptr; }, a.vec, qb);
  }
  // With TMA: the Q / dO buffers' mbarriers (every thread waits on them only after the prefetch's
  // __syncthreads_and).
  __device__ __forceinline__ void start(const DkvMaps& m) {
    maps = &m;
    tma = kTmaSet && m.on != 0;
    bars = reinterpret_cast<uint64_t*>(smem + L::kSwBars);
    if constexpr (kTmaSet) {
      if (tma && threadIdx.x == 0) {
        cuda::mbarrier_init(bars, 1);
        cuda::mbarrier_init(bars + 1, 1);
        cuda::fence_mbarrier_init();
      }
    }
  }
  // Starts copying the Q and dO rows of RowTile R (ntok tokens from s0 + t0 unless a list) into
  // buffer buf: by TMA where it can, else by cp.async.
  __device__ __forceinline__ void load_rows(const BwdArgs& a, const RowTile& R, int buf, bool list, int t0, int ntok,
                                            int64_t s0, int hk, const E* qb, const E* dob) {
    if constexpr (kTmaSet) {
      (buf ? tile_rows1 : tile_rows0) = tma && !list ? ntok * a.G : -1;
      if (tma && !list) {
        if (threadIdx.x == 0) {
          uint64_t* bar = bars + buf;
          cuda::mbarrier_expect_tx(bar, kRows * (DQK + DV) * sizeof(E));
          const int tok = int(s0) + t0, h0 = hk * a.G;
#pragma unroll
          for (int blk = 0; blk < DQK / 64; ++blk)
            cuda::tma_load_3d(sQ + buf * kQBuf + blk * kRows * 64, &maps->q, 64 * blk, h0, tok, bar);
#pragma unroll
          for (int blk = 0; blk < DV / 64; ++blk)
            cuda::tma_load_3d(sDo + buf * kDoBuf + blk * kRows * 64, &maps->d_o, 64 * blk, h0, tok, bar);
        }
        return;
      }
    }
    copy_rows_sw128<E, DQK>(sQ + buf * kQBuf, [&](int r) { return static_cast<const E*>(R.q[r]); }, a.vec, qb);
    copy_rows_sw128<E, DV>(sDo + buf * kDoBuf, [&](int r) { return static_cast<const E*>(R.dO[r]); }, a.vec, dob);
  }
  // The key tile's copies have landed (all of this thread's groups), for every warp and wgmma.
  __device__ __forceinline__ void wait_kv() {
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();
    cuda::fence_proxy_async();
    __syncthreads();
  }
  // TMA: waits for buffer buf's Q and dO, then zeroes its rows past the tile's queries (a NaN
  // there would survive P = 0) and makes the zeros visible to wgmma.
  __device__ __forceinline__ void land_tma(int buf) {
    if constexpr (kTmaSet) {
      const int r0 = buf ? tile_rows1 : tile_rows0;
      if (r0 < 0) return;  // copied by cp.async
      cuda::mbarrier_wait_parity(bars + buf, (bar_phase >> buf) & 1u);
      bar_phase ^= 1u << buf;
      if (r0 < kRows) {
        cuda::zero_sw128_rows<kRows, kThreads>(sQ + buf * kQBuf, DQK / 64, r0);
        cuda::zero_sw128_rows<kRows, kThreads>(sDo + buf * kDoBuf, DV / 64, r0);
        cuda::fence_proxy_async();  // the zeros, for wgmma
        __syncthreads();
      }
    }
  }

  // One query tile (buffer `buf`) against the resident key tile (DkvWgmma::tile).
  template <typename Grads>
  __device__ __forceinline__ void compute(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4], int, int buf,
                                          Grads&& grads) {
    DkvWgmma<E, DQK, DV, kQBuf, kDoBuf>{sK, sV, sQ, sDo}.tile(acc_k, acc_v, ri[buf], buf, grads);
  }

  // The two-stage pipeline over query tiles 0 .. n_tiles - 1 (tile 0 and the key tile already
  // copied): tile i + 1's rows and copies go out (prefetch) before tile i is computed (kOneBuf:
  // after, into the same Q / dO buffer; the SM's other CTA computes meanwhile). Raw keys:
  // next_keys() swaps the window's key tile for the selection's before tile n0 (block-uniformly).
  template <typename Prefetch, typename NextKeys, typename Compute>
  __device__ __forceinline__ void run(int n_tiles, int n0, Prefetch&& prefetch, NextKeys&& next_keys,
                                      Compute&& compute_tile) {
    for (int i = 0; i < n_tiles; ++i) {
      if (!kOneBuf && i + 1 < n_tiles) prefetch(i + 1, (i + 1) & 1);  // its buffer's last reader (tile i-1) is done
      cuda::cp_async_commit();
      if constexpr (kOneBuf)
        cuda::cp_async_wait<0>();
      else
        cuda::cp_async_wait<1>();
      cuda::fence_proxy_async();  // landed copies (and plain stores) -> wgmma
      __syncthreads();
      if (kSet == KeySet::raw && i == n0 && i > 0) next_keys();  // raw: the window's tiles done
      if (tma) land_tma(i & 1);
      compute_tile(i & 1);
      __syncthreads();
      if constexpr (kOneBuf)
        if (i + 1 < n_tiles) prefetch(i + 1, (i + 1) & 1);  // the one buffer's readers are done
    }
    cuda::cp_async_wait<0>();
    __syncthreads();
  }
};

}  // namespace nsa::cuda::bwd
