// dkv_kernel's mainloop on sm_80 (and in the compute_80 PTX): the key tile resident and the query
// tiles double-buffered by cp.async in the padded layout (DkvSmem::kK ..), the four products of a
// query tile on mma.sync from ldmatrix fragments, in two halves of 32 rows, each warp on its 16
// keys. P and dS are the kernel's (dkv_kernel.cuh); the same interface on sm_90a:
// dkv_mainloop_sm90.cuh.
#pragma once

#include "cuda/backward/dkv_smem.cuh"

namespace nsa::cuda::bwd {

template <typename E, int DQK, int DV, KeySet kSet>
struct DkvMainloopSm80 {
  using L = DkvSmem<E, DQK, DV>;
  static constexpr int kLdK = DQK + kPad, kLdV = DV + kPad;
  // Elements from one Q (dO) buffer to the next.
  static constexpr int kQBuf = kRows * kLdK;
  static constexpr int kDoBuf = kRows * kLdV;
  unsigned char* smem;  // the layout's start
  E* sK;
  E* sV;
  E* sQ;
  E* sDo;
  RowTile* ri;
  TileRing* ring;

  __device__ __forceinline__ explicit DkvMainloopSm80(unsigned char* smem_raw)
      : smem(smem_raw),
        sK(reinterpret_cast<E*>(smem + L::kK)),
        sV(reinterpret_cast<E*>(smem + L::kV)),
        sQ(reinterpret_cast<E*>(smem + L::kQ)),
        sDo(reinterpret_cast<E*>(smem + L::kDo)),
        ri(reinterpret_cast<RowTile*>(smem + L::kRi)),
        ring(reinterpret_cast<TileRing*>(smem + L::kRing)) {}

  // Starts copying the key tile (key c at kb + c * ks, vb + c * vs; rows from nk on zero-filled).
  __device__ __forceinline__ void load_kv(const BwdArgs& a, const E* kb, int64_t ks, const E* vb, int64_t vs, int nk,
                                          const E* qb) {
    copy_rows<E, DQK>(sK, [&](int c) -> const E* { return c < nk ? kb + c * ks : nullptr; }, a.vec, qb);
    copy_rows<E, DV>(sV, [&](int c) -> const E* { return c < nk ? vb + c * vs : nullptr; }, a.vec, qb);
  }
  // Nothing to set up (no tensor maps).
  __device__ __forceinline__ void start(const DkvMaps&) {}
  // Starts copying the Q and dO rows of RowTile R into buffer buf.
  __device__ __forceinline__ void load_rows(const BwdArgs& a, const RowTile& R, int buf, bool, int, int, int64_t, int,
                                            const E* qb, const E* dob) {
    copy_rows<E, DQK>(sQ + buf * kQBuf, [&](int r) { return static_cast<const E*>(R.q[r]); }, a.vec, qb);
    copy_rows<E, DV>(sDo + buf * kDoBuf, [&](int r) { return static_cast<const E*>(R.dO[r]); }, a.vec, dob);
  }
  // The key tile's copies have landed (all of this thread's groups), for every warp.
  __device__ __forceinline__ void wait_kv() {
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();
    __syncthreads();
  }

  // One query tile (buffer `buf`) against the resident key tile: this warp's 16 keys (from key_w),
  // the tile's rows in two halves of 32. grads(s, dp, R, buf, r0) turns S^T and dP^T into g P and dS.
  template <typename Grads>
  __device__ __forceinline__ void compute(float (&acc_k)[DQK / 8][4], float (&acc_v)[DV / 8][4], int key_w, int buf,
                                          Grads&& grads) {
    const RowTile& R = ri[buf];
#pragma unroll 1
    for (int r0 = 0; r0 < kRows; r0 += kSub) {
      float s[kSubTiles][4], dp[kSubTiles][4];
      {
        const E* q = sQ + (buf * kRows + r0) * kLdK;
        const E* dO = sDo + (buf * kRows + r0) * kLdV;
        mma_abt<E, DQK, kSubTiles>(s, sK + key_w * kLdK, q);   // S^T: keys x rows
        mma_abt<E, DV, kSubTiles>(dp, sV + key_w * kLdV, dO);  // dP^T
      }
      grads(s, dp, R, buf, r0);
      uint32_t pf[kSubTiles / 2][4], df[kSubTiles / 2][4];
      to_operand<E, kSubTiles>(s, pf);
      to_operand<E, kSubTiles>(dp, df);
      {
        const E* q = sQ + (buf * kRows + r0) * kLdK;
        const E* dO = sDo + (buf * kRows + r0) * kLdV;
        mma_ab<E, DV, kSubTiles / 2>(acc_v, pf, dO);  // dV += (g P)^T dO
        mma_ab<E, DQK, kSubTiles / 2>(acc_k, df, q);  // dK += scale dS^T Q
      }
    }
  }

  // The two-stage pipeline over query tiles 0 .. n_tiles - 1 (tile 0 and the key tile already
  // copied): tile i + 1's rows and copies go out (prefetch) before tile i is computed. Raw keys:
  // next_keys() swaps the window's key tile for the selection's before tile n0 (block-uniformly).
  template <typename Prefetch, typename NextKeys, typename Compute>
  __device__ __forceinline__ void run(int n_tiles, int n0, Prefetch&& prefetch, NextKeys&& next_keys,
                                      Compute&& compute_tile) {
    for (int i = 0; i < n_tiles; ++i) {
      if (i + 1 < n_tiles) prefetch(i + 1, (i + 1) & 1);  // its buffer's last reader (tile i-1) is done
      cuda::cp_async_commit();
      cuda::cp_async_wait<1>();
      __syncthreads();
      if (kSet == KeySet::raw && i == n0 && i > 0) next_keys();  // raw: the window's tiles done
      compute_tile(i & 1);
      __syncthreads();
    }
    cuda::cp_async_wait<0>();
    __syncthreads();
  }
};

}  // namespace nsa::cuda::bwd
