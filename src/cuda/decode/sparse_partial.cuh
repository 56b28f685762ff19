// Decode, stage 3 of 4: one piece of the raw-token branches for one (query, KV head). Split s < n
// attends the query's s-th selected block (spec §5; its tokens up to the query), split n + c the
// c-th chunk of its window (spec §6); dense decoding has only window chunks, over every token.
// A flash loop over 64-token tiles (online softmax in the log2 domain) leaves the piece's
// (m, l) and unnormalised output for combine.cu to merge.
//
// Grid (queries, Hkv, n + win_splits); 4 warps. Pages are looked up per token (a window starts
// anywhere), guarded, and zero-filled when invalid or past the piece.
#pragma once

#include "cuda/decode/common.cuh"

namespace nsa::cuda::decode {

inline constexpr int kSparseThreads = 128;

template <typename S, int kDqk, int kDv>
constexpr size_t sparse_partial_smem() {
  return sizeof(S) * (kRows * (kDqk + 8) + kKeyTile * (kDqk + 8) + kKeyTile * (kDv + 8) + kRows * (kKeyTile + 8)) +
         sizeof(float) * (kRows * (kKeyTile + 4) + kRows * 3);
}

template <typename S, int kDqk, int kDv>
__global__ void __launch_bounds__(kSparseThreads) sparse_partial_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kLdq = kDqk + 8, kLdv = kDv + 8, kLdp = kKeyTile + 8, kLds = kKeyTile + 4;
  const int row = blockIdx.x, hk = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = p.group;
  S* sQ = reinterpret_cast<S*>(smem);
  S* sK = sQ + kRows * kLdq;
  S* sV = sK + kKeyTile * kLdq;
  S* sP = sV + kKeyTile * kLdv;
  float* sS = reinterpret_cast<float*>(sP + kRows * kLdp);
  float* sM = sS + kRows * kLds;  // running max, sum and this tile's correction per row
  float* sL = sM + kRows;
  float* sC = sL + kRows;

  const RowInfo ri = row_info(p.pages, row);
  const int n_sel = p.dense ? 0 : p.n_sel;
  // This piece's tokens [lo, hi) of the query's sequence.
  int64_t lo = 0, hi = 0;
  if (ri.ok) {
    if (split < n_sel) {
      const int64_t j = p.sel[int64_t(row) * p.sel_st + hk * p.sel_sh + split * p.sel_sn];
      if (j >= 0) {
        lo = j * p.lp;
        hi = (j + 1) * p.lp < ri.t + 1 ? (j + 1) * p.lp : ri.t + 1;
      }
    } else {
      const int64_t first = p.dense ? 0 : window_start(ri.t, p.window);
      lo = first + int64_t(split - n_sel) * p.win_chunk;
      hi = lo + p.win_chunk < ri.t + 1 ? lo + p.win_chunk : ri.t + 1;
    }
  }
  const int64_t item = (int64_t(row) * p.hkv + hk) * (n_sel + p.win_splits) + split;
  float* ml = p.sw_ml + item * G * 2;
  if (lo >= hi) {
    if (threadIdx.x < G) {
      ml[2 * threadIdx.x] = kNegInf;
      ml[2 * threadIdx.x + 1] = 0.f;
    }
    return;
  }
  const Pool& kpool = split < n_sel ? p.k_slc : p.k_win;
  const Pool& vpool = split < n_sel ? p.v_slc : p.v_win;
  const int b = ri.seq.b, ps = p.pages.page_size;
  load_queries<S, kDqk, kSparseThreads>(sQ, kLdq, p, row, hk);
  if (threadIdx.x < kRows) {
    sM[threadIdx.x] = kNegInf;
    sL[threadIdx.x] = 0.f;
  }
  constexpr int kTiles = kDv / 32;
  float o[kTiles][4] = {};
  for (int64_t k0 = lo; k0 < hi; k0 += kKeyTile) {
    const int n = hi - k0 < kKeyTile ? static_cast<int>(hi - k0) : kKeyTile;
    load_tile<S, kDqk, kSparseThreads>(sK, kLdq, n, kpool.data, [&](int k) { return pool_row<S>(p.pages, kpool, b, k0 + k, ps, hk); });
    load_tile<S, kDv, kSparseThreads>(sV, kLdv, n, vpool.data, [&](int k) { return pool_row<S>(p.pages, vpool, b, k0 + k, ps, hk); });
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    {
      float acc[2][4];
      qk_16x16<S, kDqk>(sQ, kLdq, sK, kLdq, warp * 16, acc);
      const int group = lane / 4, quad = lane % 4;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = group + (e / 2) * 8, key = warp * 16 + nt * 8 + 2 * quad + (e % 2);
          sS[r * kLds + key] = key < n ? acc[nt][e] * p.scale_log2 : kNegInf;
        }
    }
    __syncthreads();
    // Online softmax: each warp four rows, each lane two keys.
    for (int r = warp * 4; r < warp * 4 + 4; ++r) {
      const float s0 = sS[r * kLds + lane], s1 = sS[r * kLds + lane + 32];
      const float m_old = sM[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));  // finite: the tile has a key
      const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
      sP[r * kLdp + lane] = from_float<S>(p0);
      sP[r * kLdp + lane + 32] = from_float<S>(p1);
      const float sum = warp_sum(p0 + p1);
      __syncwarp();
      if (lane == 0) {
        const float corr = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        sC[r] = corr;
        sL[r] = sL[r] * corr + sum;
        sM[r] = m_new;
      }
    }
    __syncthreads();
    {
      const int group = lane / 4;
      const float c0 = sC[group], c1 = sC[group + 8];
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        o[nt][0] *= c0;
        o[nt][1] *= c0;
        o[nt][2] *= c1;
        o[nt][3] *= c1;
      }
    }
    pv_16x64<S, kTiles>(sP, kLdp, 0, sV, kLdv, warp * (kDv / 4), o);
    __syncthreads();  // the tiles are reused
  }
  if (threadIdx.x < G) {
    ml[2 * threadIdx.x] = sM[threadIdx.x];
    ml[2 * threadIdx.x + 1] = sL[threadIdx.x];
  }
  store_rows<kTiles>(o, p.sw_o + item * G * p.dv, p.dv, warp * (kDv / 4), G);
}

}  // namespace nsa::cuda::decode
