// phi's matrix products on tensor cores: C[M x N] = A[M x K] B[K x N] with fp32 accumulation,
// for operands that are gathered rather than stored as matrices (a compressed block's l rows of
// x, a transposed fp32 gradient, GELU of a pre-activation). An operand is a device functor with
//   RowInfo row(batch, i)   what the elements of tile index i (A: m, B: n) need, computed once
//                           per CTA for the tile's indices (shared memory);
//   KInfo col(batch, k)     what the elements of k need, computed once per 32-deep step;
//   load8(RowInfo, KInfo, count, v)   8 elements from (i, k) on along the operand's contiguous
//                           index (count of them valid, the rest 0): one or two 16-byte loads
//                           where aligned;
//   kKFast                  whether that index is k (else i);
//   kExact                  whether every element is exact in bf16 (bf16 storage values are).
// The store is a functor st(batch, m, n, split, value) that owns the epilogue (bias, GELU,
// rounding, scatter, a split-K partial).
//
// The product runs on mma.m16n8k16 with bf16 operands (sm_80+, unchanged on sm_90): each fp32
// element is split into hi = bf16(x) and lo = bf16(x - hi), which carries about 17 significant
// bits (bf16 has fp32's exponent range: lo never underflows where x does not), and
// a b = hi_a hi_b + hi_a lo_b + lo_a hi_b ("3xBF16"); an operand exact in bf16 (bf16 storage)
// has lo = 0 and skips its term (bf16 weights: 2 products instead of 3). The split happens once,
// when a step's operands are stored to shared memory, as bf16 pairs along k (the fragments'
// order). The tensor cores sum 16 products at a time into a zeroed fragment, which is then added
// to the fp32 accumulator with an ordinary (round-to-nearest) addition: long sums (K = l*D =
// 4096, or every compressed row) do not accumulate the tensor cores' own rounding of their
// running sum.
//
// Tiles: 128 x 64 outputs per CTA of 8 warps (4 x 2, 32 x 32 each), 32-deep steps. Each step's
// operands arrive as runs of 8 (A: 2 runs a thread, B: 1), fetched into registers while the
// previous step multiplies, then split and stored to shared memory as [i][k] rows of 20 words
// (16 bf16 pairs + 4: a fragment read hits 32 different banks), one plane for hi and one for lo;
// a k-contiguous run is one 16-byte store per plane, another run 8 16-bit stores.
// blockIdx.z = batch * splits + split; a split multiplies its own range of K and stores its own
// partial: every output is one thread's fixed-order sum, so the same inputs give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"

namespace nsa::cuda::phi {

constexpr int kTileM = 128;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kGemmThreads = 256;  // 8 warps: 4 (m) x 2 (n), 32 x 32 outputs each
constexpr int kRun = 8;            // elements per fetch

// A shared tile of kRows tile indices x kTileK as bf16 pairs along k: word (i, w) holds k = 2w and
// 2w + 1 of index i, rows of kLdW words (16 + 4 words: rows 20 words apart put the 8 rows x 4 words
// of a fragment read on 32 different banks). Runs come in along k (kKFast) or along i.
template <bool kKFast, int kRows>
struct TileLayout {
  static constexpr int kLdW = kTileK / 2 + 4;
  static constexpr int kWords = kRows * kLdW;
  static constexpr int kRuns = kRows * kTileK / kRun;
  __device__ static int word(int i, int k) { return i * kLdW + k / 2; }
  // Run q of a step: its first element (i, k). k-contiguous: a warp takes 8 indices x 4 runs of k.
  // Otherwise a warp takes 8 k x 4 runs of i (32 consecutive indices): its 16-bit stores of one
  // element of each run fall on 4 banks, 4 words each (a warp of 2 k x 16 runs: one bank).
  static_assert(kKFast || kRows % (4 * kRun) == 0, "whole groups of 4 runs of i");
  __device__ static void run(int q, int& i, int& k) {
    if (kKFast) {
      i = q / (kTileK / kRun);
      k = (q % (kTileK / kRun)) * kRun;
    } else {
      const int lane = q % 32, w = q / 32;
      k = lane % 8 + 8 * (w % (kTileK / 8));
      i = (lane / 8 + 4 * (w / (kTileK / 8))) * kRun;
    }
  }
};

// Element loads of a run (count valid of 8, the rest 0): one 16-byte load for 8 16-bit values,
// two for 8 floats, when the run is whole and 16-byte aligned.
template <typename E>
__device__ __forceinline__ void load_run(const E* p, int count, float (&v)[kRun]) {
  if (count == kRun && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const E* e = reinterpret_cast<const E*>(&raw);
#pragma unroll
    for (int j = 0; j < kRun; ++j) v[j] = to_float(e[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < kRun; ++j) v[j] = j < count ? to_float(p[j]) : 0.f;
}
__device__ __forceinline__ void load_run(const float* p, int count, float (&v)[kRun]) {
  if (count == kRun && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
#pragma unroll
  for (int j = 0; j < kRun; ++j) v[j] = j < count ? p[j] : 0.f;
}
__device__ __forceinline__ void zero_run(float (&v)[kRun]) {
#pragma unroll
  for (int j = 0; j < kRun; ++j) v[j] = 0.f;
}

// x = hi + lo + (about 2^-17 |x|), both bf16.
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}
__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat16 a, __nv_bfloat16 b) {
  return uint32_t(__bfloat16_as_ushort(a)) | (uint32_t(__bfloat16_as_ushort(b)) << 16);
}

// A run's 8 elements into the hi (and, unless exact, lo) planes of a step's tile at (i, k): one
// 16-byte store per plane along k, else one 16-bit store per element.
template <class Tile, bool kKFast, bool kExact>
__device__ __forceinline__ void stash_run(uint32_t* hi_plane, uint32_t* lo_plane, int i, int k, const float (&v)[kRun]) {
  __nv_bfloat16 h[kRun], l[kRun];
#pragma unroll
  for (int j = 0; j < kRun; ++j) {
    if constexpr (kExact) {
      h[j] = __float2bfloat16_rn(v[j]);
    } else {
      split_bf16(v[j], h[j], l[j]);
    }
  }
  if constexpr (kKFast) {
    const int w = Tile::word(i, k);
    *reinterpret_cast<uint4*>(hi_plane + w) =
        make_uint4(pack_bf16(h[0], h[1]), pack_bf16(h[2], h[3]), pack_bf16(h[4], h[5]), pack_bf16(h[6], h[7]));
    if constexpr (!kExact)
      *reinterpret_cast<uint4*>(lo_plane + w) =
          make_uint4(pack_bf16(l[0], l[1]), pack_bf16(l[2], l[3]), pack_bf16(l[4], l[5]), pack_bf16(l[6], l[7]));
  } else {
    auto* hs = reinterpret_cast<__nv_bfloat16*>(hi_plane);
    auto* ls = reinterpret_cast<__nv_bfloat16*>(lo_plane);
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const int e = (i + j) * 2 * Tile::kLdW + k;  // 16-bit index of (i + j, k)
      hs[e] = h[j];
      if constexpr (!kExact) ls[e] = l[j];
    }
  }
}

// The fp32 accumulators of a warp's kI x 4 m16n8 fragments (rows from m_base, columns from
// n_base) through the store, where they lie inside M x N.
template <int kI, class Store>
__device__ __forceinline__ void store_fragments(const float (&acc)[kI][4][4], int64_t m_base, int n_base, int64_t M,
                                                int N, int batch, int split, const Store& st) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t m = m_base + 16 * i + g + 8 * (c / 2);
        const int n = n_base + 8 * j + 2 * t + c % 2;
        if (m < M && n < N) st(batch, m, n, split, acc[i][j][c]);
      }
}

// Two operands of one kind as the two batches of one launch (batch b: op b, called as its batch
// 0): phi of k and of v together where each alone would leave SMs idle. A tile index's RowInfo
// carries the batch to load8; the CTA's batch is uniform, so the branch never diverges.
template <class Op>
struct OpPair {
  static constexpr bool kKFast = Op::kKFast, kExact = Op::kExact;
  Op op0, op1;
  struct RowInfo {
    typename Op::RowInfo r;
    int b;
  };
  using KInfo = typename Op::KInfo;
  __device__ RowInfo row(int b, int64_t i) const { return RowInfo{b == 0 ? op0.row(0, i) : op1.row(0, i), b}; }
  __device__ KInfo col(int b, int k) const { return b == 0 ? op0.col(0, k) : op1.col(0, k); }
  __device__ void load8(const RowInfo& r, const KInfo& k, int count, float (&v)[kRun]) const {
    if (r.b == 0) op0.load8(r.r, k, count, v);
    else op1.load8(r.r, k, count, v);
  }
};
// The stores of an OpPair / DirPair launch: batch b's outputs through store b (as its batch 0).
template <class St>
struct StorePair {
  St st0, st1;
  __device__ void operator()(int b, int64_t m, int n, int z, float v) const {
    if (b == 0) st0(0, m, n, z, v);
    else st1(0, m, n, z, v);
  }
};

// Each split's range of K: ceil(K / splits) in whole steps of kStep.
inline int split_k_chunk(int K, int splits, int step) {
  const int chunk = (K + splits - 1) / splits;
  return (chunk + step - 1) / step * step;
}

// C tile of 128 x 64 per CTA; a step's runs are fetched and stored as TileLayout::run says.
template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kGemmThreads, 2) gemm_kernel(int64_t M, int N, int K, int k_chunk, int splits,
                                                               LoadA la, LoadB lb, Store st) {
  using TA = TileLayout<LoadA::kKFast, kTileM>;
  using TB = TileLayout<LoadB::kKFast, kTileN>;
  constexpr int kRunsA = TA::kRuns / kGemmThreads, kRunsB = TB::kRuns / kGemmThreads;
  static_assert(kRunsA * kGemmThreads == TA::kRuns && kRunsB * kGemmThreads == TB::kRuns, "whole runs per thread");
  constexpr int kPlanesA = LoadA::kExact ? 1 : 2, kPlanesB = LoadB::kExact ? 1 : 2;
  __shared__ __align__(16) uint32_t sa[kPlanesA][TA::kWords];  // hi (and lo)
  __shared__ __align__(16) uint32_t sb[kPlanesB][TB::kWords];
  __shared__ typename LoadA::RowInfo rows_a[kTileM];
  __shared__ typename LoadB::RowInfo rows_b[kTileN];
  __shared__ typename LoadA::KInfo ks_a[2][kTileK];
  __shared__ typename LoadB::KInfo ks_b[2][kTileK];
  const int64_t m0 = int64_t(blockIdx.x) * kTileM;
  const int n0 = int(blockIdx.y) * kTileN;
  const int batch = int(blockIdx.z) / splits, split = int(blockIdx.z) % splits;
  const int k_begin = split * k_chunk;
  const int k_end = min(K, k_begin + k_chunk);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  const int g = lane / 4, t = lane % 4;

  // What each tile index needs (indices past M / N: the last one's, never used), and the first
  // step's k; threads 0-31 fill A's k table of a step, 32-63 B's.
  for (int i = int(threadIdx.x); i < kTileM; i += kGemmThreads) rows_a[i] = la.row(batch, min(m0 + i, M - 1));
  for (int i = int(threadIdx.x); i < kTileN; i += kGemmThreads) rows_b[i] = lb.row(batch, min(n0 + i, N - 1));
  auto k_tables = [&](int k0, int buf) {
    const int kk = int(threadIdx.x) % 32, k = min(k0 + kk, k_end - 1);
    if (threadIdx.x < 32) ks_a[buf][kk] = la.col(batch, k);
    else if (threadIdx.x < 64) ks_b[buf][kk] = lb.col(batch, k);
  };
  if (k_begin < k_end) k_tables(k_begin, 0);
  __syncthreads();

  float acc[2][4][4] = {};

  // Valid elements of a run at tile index i (of `rows`, limit) and k: along k when k-contiguous.
  auto count_of = [&](bool k_fast, int64_t index, int64_t limit, int k) -> int {
    const int64_t n = k_fast ? (index < limit ? int64_t(k_end) - k : 0) : (k < k_end ? limit - index : 0);
    return n <= 0 ? 0 : (n >= kRun ? kRun : int(n));
  };
  float ra[kRunsA][kRun], rb[kRunsB][kRun];
  auto fetch = [&](int k0, int buf) {
#pragma unroll
    for (int r = 0; r < kRunsA; ++r) {
      int i, kk;
      TA::run(int(threadIdx.x) + r * kGemmThreads, i, kk);
      la.load8(rows_a[i], ks_a[buf][kk], count_of(LoadA::kKFast, m0 + i, M, k0 + kk), ra[r]);
    }
#pragma unroll
    for (int r = 0; r < kRunsB; ++r) {
      int i, kk;
      TB::run(int(threadIdx.x) + r * kGemmThreads, i, kk);
      lb.load8(rows_b[i], ks_b[buf][kk], count_of(LoadB::kKFast, int64_t(n0) + i, N, k0 + kk), rb[r]);
    }
  };
  auto stash = [&]() {
#pragma unroll
    for (int r = 0; r < kRunsA; ++r) {
      int i, kk;
      TA::run(int(threadIdx.x) + r * kGemmThreads, i, kk);
      stash_run<TA, LoadA::kKFast, LoadA::kExact>(sa[0], sa[kPlanesA - 1], i, kk, ra[r]);
    }
#pragma unroll
    for (int r = 0; r < kRunsB; ++r) {
      int i, kk;
      TB::run(int(threadIdx.x) + r * kGemmThreads, i, kk);
      stash_run<TB, LoadB::kKFast, LoadB::kExact>(sb[0], sb[kPlanesB - 1], i, kk, rb[r]);
    }
  };

  int buf = 0;
  if (k_begin < k_end) fetch(k_begin, 0);
#pragma unroll 1
  for (int k0 = k_begin; k0 < k_end; k0 += kTileK) {
    stash();
    const bool next = k0 + kTileK < k_end;
    if (next) k_tables(k0 + kTileK, buf ^ 1);
    __syncthreads();
    if (next) fetch(k0 + kTileK, buf ^ 1);  // in flight while this step multiplies
#pragma unroll
    for (int k16 = 0; k16 < kTileK; k16 += 16) {
      const int kw = k16 + 2 * t;  // the lane's first k of each fragment half
      uint32_t bh[4][2], bl[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = wn + 8 * j + g;
#pragma unroll
        for (int p = 0; p < kPlanesB; ++p) {
          uint32_t(&b)[2] = p == 0 ? bh[j] : bl[j];
          b[0] = sb[p][TB::word(c, kw)];
          b[1] = sb[p][TB::word(c, kw + 8)];
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wm + 16 * i + g;
        uint32_t ah[4], al[4];
#pragma unroll
        for (int p = 0; p < kPlanesA; ++p) {
          uint32_t(&a)[4] = p == 0 ? ah : al;
          a[0] = sa[p][TA::word(r, kw)];
          a[1] = sa[p][TA::word(r + 8, kw)];
          a[2] = sa[p][TA::word(r, kw + 8)];
          a[3] = sa[p][TA::word(r + 8, kw + 8)];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // 16 deep on the tensor cores, then into acc in fp32
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (!LoadA::kExact) mma_16816<true>(c, al, bh[j][0], bh[j][1]);
          if constexpr (!LoadB::kExact) mma_16816<true>(c, ah, bl[j][0], bl[j][1]);
          mma_16816<true>(c, ah, bh[j][0], bh[j][1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] += c[e];
        }
      }
    }
    __syncthreads();
    buf ^= 1;
  }

  store_fragments(acc, m0 + wm, n0 + wn, M, N, batch, split, st);
}

// C = A B over `batches` independent products, each split over K into `splits` partials (every
// split stores, an empty range zeros).
template <class LoadA, class LoadB, class Store>
void gemm(cudaStream_t s, int64_t M, int N, int K, int splits, int batches, LoadA la, LoadB lb, Store st) {
  if (M <= 0 || N <= 0 || batches <= 0) return;
  const int k_chunk = split_k_chunk(K, splits, kTileK);
  const dim3 grid(unsigned((M + kTileM - 1) / kTileM), unsigned((N + kTileN - 1) / kTileN),
                  unsigned(batches * splits));
  gemm_kernel<<<grid, kGemmThreads, 0, s>>>(M, N, K, k_chunk, splits, la, lb, st);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::phi
