// Decode, stage 3 of 4: one piece of the raw-token branches for one (query, KV head). Split
// s < slc_ctas attends the query's selected blocks [s * slc_per_cta, (s + 1) * slc_per_cta) (spec
// §5; their tokens up to the query), split slc_ctas + c the c-th chunk of its window (spec §6);
// dense decoding has only window chunks, over every token. A flash loop over 64-token tiles
// (online softmax in the log2 domain, the next tile's copies in flight while one is computed)
// leaves the piece's (m, l) and unnormalised output for combine.cu to merge.
//
// Grid (queries, Hkv, slc_ctas + win_splits); 4 warps. Pages are looked up per token (a window
// starts anywhere), guarded, and zero-filled when invalid or past the piece.
#pragma once

#include "cuda/decode/common.cuh"

namespace nsa::cuda::decode {

inline constexpr int kSparseThreads = 128;

template <typename S, int kDqk, int kDv>
constexpr size_t sparse_partial_smem() {
  return sizeof(S) * (kRows * (kDqk + 8) + 2 * kKeyTile * (kDqk + 8) + 2 * kKeyTile * (kDv + 8) + kRows * (kKeyTile + 8)) +
         sizeof(float) * (kRows * (kKeyTile + 4) + kRows * 3) + sizeof(TileRow) * 2 * kKeyTile;
}

// The tiles of one piece: selected blocks (each cut at the query) or one stretch of tokens.
struct PieceTiles {
  const int32_t* blocks = nullptr;  // the piece's selected blocks (stride sel_sn), or null: a stretch
  int64_t sel_sn = 1;
  int nblocks = 0, lp = 0, tiles_per_block = 0;
  int64_t lo = 0, hi = 0;  // the stretch [lo, hi), or the query's limit hi = t + 1 for blocks
  int count = 0;

  // Tokens [first, first + n) of tile i (n = 0: nothing, e.g. a -1 block).
  __device__ __forceinline__ void tile(int i, int64_t& first, int& n) const {
    int64_t a, b;
    if (blocks != nullptr) {
      const int64_t j = blocks[(i / tiles_per_block) * sel_sn];
      a = j * lp + int64_t(i % tiles_per_block) * kKeyTile;
      b = j < 0 ? a : (j + 1) * lp < hi ? (j + 1) * lp : hi;
      if (j < 0) a = b = 0;
    } else {
      a = lo + int64_t(i) * kKeyTile;
      b = hi;
    }
    first = a;
    n = b - a < kKeyTile ? static_cast<int>(b > a ? b - a : 0) : kKeyTile;
  }
};

template <typename S, int kDqk, int kDv>
__global__ void __launch_bounds__(kSparseThreads) sparse_partial_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kLdq = kDqk + 8, kLdv = kDv + 8, kLdp = kKeyTile + 8, kLds = kKeyTile + 4;
  const int row = blockIdx.x, hk = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = p.group;
  S* sQ = reinterpret_cast<S*>(smem);
  S* sK = sQ + kRows * kLdq;          // [2][64][kLdq]
  S* sV = sK + 2 * kKeyTile * kLdq;   // [2][64][kLdv]
  S* sP = sV + 2 * kKeyTile * kLdv;
  float* sS = reinterpret_cast<float*>(sP + kRows * kLdp);
  float* sM = sS + kRows * kLds;  // running max, sum and this tile's correction per row
  float* sL = sM + kRows;
  float* sC = sL + kRows;
  TileRow* rows = reinterpret_cast<TileRow*>(sC + kRows);  // [2][64]: one per buffer

  const RowInfo ri = row_info(p.pages, row);
  const int slc_ctas = p.dense ? 0 : p.slc_ctas;
  PieceTiles piece;
  if (ri.ok) {
    if (split < slc_ctas) {
      const int first = split * p.slc_per_cta;
      piece.blocks = p.sel + int64_t(row) * p.sel_st + hk * p.sel_sh + first * p.sel_sn;
      piece.sel_sn = p.sel_sn;
      piece.nblocks = p.n_sel - first < p.slc_per_cta ? p.n_sel - first : p.slc_per_cta;
      piece.lp = p.lp;
      piece.tiles_per_block = (p.lp + kKeyTile - 1) / kKeyTile;
      piece.hi = ri.t + 1;
      piece.count = piece.nblocks * piece.tiles_per_block;
    } else {
      const int64_t start = p.dense ? 0 : window_start(ri.t, p.window);
      piece.lo = start + int64_t(split - slc_ctas) * p.win_chunk;
      piece.hi = piece.lo + p.win_chunk < ri.t + 1 ? piece.lo + p.win_chunk : ri.t + 1;
      piece.count = piece.hi > piece.lo ? static_cast<int>((piece.hi - piece.lo + kKeyTile - 1) / kKeyTile) : 0;
    }
  }
  const int64_t item = (int64_t(row) * p.hkv + hk) * (slc_ctas + p.win_splits) + split;
  float* ml = p.sw_ml + item * G * 2;
  const Pool& kpool = split < slc_ctas ? p.k_slc : p.k_win;
  const Pool& vpool = split < slc_ctas ? p.v_slc : p.v_win;
  const int b = ri.seq.b, ps = p.pages.page_size;
  if (threadIdx.x < kRows) {
    sM[threadIdx.x] = kNegInf;
    sL[threadIdx.x] = 0.f;
  }
  if (piece.count > 0) load_queries<S, kDqk, kSparseThreads>(sQ, kLdq, p, row, hk);
  constexpr int kTiles = kDv / 32;
  float o[kTiles][4] = {};
  auto load = [&](int i, int buf) {
    int64_t first;
    int n;
    piece.tile(i, first, n);
    TileRow* r = rows + buf * kKeyTile;
    tile_rows(p.pages, b, first, n, ps, r);
    load_rows<S, kDqk, kSparseThreads>(sK + buf * kKeyTile * kLdq, kLdq, r, kpool, hk);
    load_rows<S, kDv, kSparseThreads>(sV + buf * kKeyTile * kLdv, kLdv, r, vpool, hk);
  };
  auto body = [&](int i, int buf) {
    int64_t first;
    int n;
    piece.tile(i, first, n);
    if (n == 0) return;  // a -1 block: nothing (uniform across the CTA)
    {
      float acc[2][4];
      qk_16x16<S, kDqk>(sQ, kLdq, sK + buf * kKeyTile * kLdq, kLdq, warp * 16, acc);
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
    const int group = lane / 4;
    const float c0 = sC[group], c1 = sC[group + 8];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      o[nt][0] *= c0;
      o[nt][1] *= c0;
      o[nt][2] *= c1;
      o[nt][3] *= c1;
    }
    pv_16x64<S, kTiles>(sP, kLdp, 0, sV + buf * kKeyTile * kLdv, kLdv, warp * (kDv / 4), o);
  };
  pipelined_tiles(piece.count, load, body);
  __syncthreads();
  if (threadIdx.x < G) {
    ml[2 * threadIdx.x] = sM[threadIdx.x];  // -inf and 0 for an empty piece: combine skips it
    ml[2 * threadIdx.x + 1] = sL[threadIdx.x];
  }
  if (sM[0] != kNegInf) store_rows<kTiles>(o, p.sw_o + item * G * p.dv, p.dv, warp * (kDv / 4), G);
}

}  // namespace nsa::cuda::decode
