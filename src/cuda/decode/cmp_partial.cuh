// Decode, stage 1 of 4: one split of the compressed branch (spec §2-§3) for one (query, KV head).
//
// Grid (queries, Hkv, cmp_splits); 4 warps. The split's compressed keys [i0, i1) are read in
// 64-key tiles through the page table (two buffers: the next tile's copies in flight while one is
// computed); the 16 x chunk logits stay in shared memory, so the split
// knows its exact maximum and sum before it writes anything: its probabilities relative to its own
// maximum give both its partial output (P V) and its partial selection scores
//   P_s[g][j] = sum_{i in split} ov(i, j) exp2(s_gi - m_sg),
// which select.cuh rescales by exp2(m_sg - M_g) / L_g once every split's (m, l) is known. The
// partials are written for the query heads g < G; a split past the query's visible blocks writes
// only an empty (m = -inf, l = 0) record, which the merges skip.
#pragma once

#include "cuda/decode/common.cuh"

namespace nsa::cuda::decode {

inline constexpr int kCmpThreads = 128;

template <int kDqk, int kDv>
constexpr int cmp_kv_ld() {
  return (kDqk > kDv ? kDqk : kDv) + 8;
}

// Shared bytes of cmp_partial_kernel for a chunk of `chunk` keys.
template <typename S, int kDqk, int kDv>
constexpr size_t cmp_partial_smem(int chunk) {
  return sizeof(S) * (kRows * (kDqk + 8) + 2 * kKeyTile * cmp_kv_ld<kDqk, kDv>() + kRows * (chunk + 8)) +
         sizeof(float) * kRows * (chunk + 4) + sizeof(TileRow) * 2 * kKeyTile;
}

template <typename S, int kDqk, int kDv>
__global__ void __launch_bounds__(kCmpThreads) cmp_partial_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kLdq = kDqk + 8, kLdkv = cmp_kv_ld<kDqk, kDv>();
  const int row = blockIdx.x, hk = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = p.cmp_chunk, lds = chunk + 4, ldp = chunk + 8, G = p.group;
  S* sQ = reinterpret_cast<S*>(smem);
  S* sKV = sQ + kRows * kLdq;  // [2][64][kLdkv]: K tiles, then V tiles
  S* sP = sKV + 2 * kKeyTile * kLdkv;
  float* sS = reinterpret_cast<float*>(sP + kRows * ldp);
  TileRow* rows = reinterpret_cast<TileRow*>(sS + kRows * lds);  // [2][64]: one per buffer

  const RowInfo ri = row_info(p.pages, row);
  const int64_t C = ri.ok ? visible_cmp_blocks(ri.t, p.l, p.d) : 0;
  const int64_t i0 = int64_t(split) * chunk, i1 = C < i0 + chunk ? C : i0 + chunk;
  const int64_t item = (int64_t(row) * p.hkv + hk) * p.cmp_splits + split;
  float* ml = p.cmp_ml + item * G * 2;
  if (i0 >= i1) {
    if (threadIdx.x < G) {
      ml[2 * threadIdx.x] = kNegInf;
      ml[2 * threadIdx.x + 1] = 0.f;
    }
    return;
  }
  const int n = static_cast<int>(i1 - i0);
  const int b = ri.seq.b, rpp = p.pages.page_size / p.d;
  load_queries<S, kDqk, kCmpThreads>(sQ, kLdq, p, row, hk);

  // Logits of every key of the split (log2 domain), -inf past n.
  const int ntiles = (n + kKeyTile - 1) / kKeyTile;
  pipelined_tiles(
      ntiles,
      [&](int i, int buf) {
        const int k0 = i * kKeyTile;
        tile_rows(p.pages, b, i0 + k0, n - k0 < kKeyTile ? n - k0 : kKeyTile, rpp, rows + buf * kKeyTile);
        load_rows<S, kDqk, kCmpThreads>(sKV + buf * kKeyTile * kLdkv, kLdkv, rows + buf * kKeyTile, p.kc, hk);
      },
      [&](int i, int buf) {
        const int k0 = i * kKeyTile;
        float acc[2][4];
        qk_16x16<S, kDqk>(sQ, kLdq, sKV + buf * kKeyTile * kLdkv, kLdkv, warp * 16, acc);
        const int group = lane / 4, quad = lane % 4;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = group + (e / 2) * 8, key = k0 + warp * 16 + nt * 8 + 2 * quad + (e % 2);
            sS[r * lds + key] = key < n ? acc[nt][e] * p.scale_log2 : kNegInf;
          }
      });

  // Each warp's four rows: maximum, sum, probabilities (fp32 in sS for the scores, storage type in
  // sP for the P V product, zero past n up to the tile end).
  const int n_pad = (n + kKeyTile - 1) / kKeyTile * kKeyTile;
  for (int r = warp * 4; r < warp * 4 + 4; ++r) {
    float* srow = sS + r * lds;
    float mx = kNegInf;
    for (int k = lane; k < n; k += 32) mx = fmaxf(mx, srow[k]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int k = lane; k < n_pad; k += 32) {
      const float e = k < n && r < G ? exp2f(srow[k] - mx) : 0.f;
      if (k < n) srow[k] = e;
      sP[r * ldp + k] = from_float<S>(e);
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0 && r < G) {
      ml[2 * r] = mx;
      ml[2 * r + 1] = sum;
    }
  }
  __syncthreads();

  // Partial selection scores of the blocks j this split touches (spec §3), [W][G].
  {
    const int R = p.lp / p.d, L = p.l / p.d, W = p.score_width;
    const int64_t jlo = i0 / R;
    float* out = p.cmp_s + item * G * W;
    for (int e = threadIdx.x; e < G * W; e += kCmpThreads) {  // out [W][G]: a row of heads per block
      const int g = e % G;
      const int64_t j = jlo + e / G;
      int64_t lo = j * R - L + 1, hi = (j + 1) * R;  // compressed blocks overlapping j: [lo, hi)
      lo = lo > i0 ? lo : i0;
      hi = hi < i1 ? hi : i1;
      float s = 0.f;
      for (int64_t i = lo; i < hi; ++i)
        s += static_cast<float>(cmp_slc_overlap(i, j, p.l, p.d, p.lp)) * sS[g * lds + (i - i0)];
      out[e] = s;
    }
  }

  // Partial output: O = P V, each warp a quarter of the columns.
  constexpr int kTiles = kDv / 32;
  float o[kTiles][4] = {};
  pipelined_tiles(
      ntiles,
      [&](int i, int buf) {
        const int k0 = i * kKeyTile;
        tile_rows(p.pages, b, i0 + k0, n - k0 < kKeyTile ? n - k0 : kKeyTile, rpp, rows + buf * kKeyTile);
        load_rows<S, kDv, kCmpThreads>(sKV + buf * kKeyTile * kLdkv, kLdkv, rows + buf * kKeyTile, p.vc, hk);
      },
      [&](int i, int buf) { pv_16x64<S, kTiles>(sP, ldp, i * kKeyTile, sKV + buf * kKeyTile * kLdkv, kLdkv, warp * (kDv / 4), o); });
  store_rows<kTiles>(o, p.cmp_o + item * G * p.dv, p.dv, warp * (kDv / 4), G);
}

}  // namespace nsa::cuda::decode
