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
//   kExact                  whether every element is exact in tf32 (bf16 / fp16 values are).
// The store is a functor st(batch, m, n, split, value) that owns the epilogue (bias, GELU,
// rounding, scatter, a split-K partial).
//
// The product runs on mma.m16n8k8 with tf32 operands (sm_80+, unchanged on sm_90), each fp32
// element split into hi = tf32(x) and lo = tf32(x - hi): a b = hi_a hi_b + hi_a lo_b + lo_a hi_b
// ("3xTF32"), which carries about 22 significant bits; an exact operand has lo = 0 and skips
// its term (weights: 2 products instead of 3). The tensor cores sum 8 products at a time into a
// zeroed fragment, which is then added to the fp32 accumulator with an ordinary (round-to-nearest)
// addition: long sums (K = l*D = 4096, or every compressed row) do not accumulate the tensor
// cores' own rounding of their running sum.
//
// Tiles: 128 x 64 outputs per CTA of 8 warps (4 x 2, 32 x 32 each), 32-deep steps. Each step's
// operands arrive as runs of 8 (A: 2 runs a thread, B: 1), fetched into registers while the
// previous step multiplies, then stored to shared memory in the operand's own order: [i][k] rows
// of 36 words for k-contiguous operands, [k][i] rows of tile + 8 words otherwise; either way a
// fragment read hits 32 different banks and a run is two 16-byte stores.
// blockIdx.z = batch * splits + split; a split multiplies its own range of K and stores its own
// partial: every output is one thread's fixed-order sum, so the same inputs give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"

namespace nsa::cuda::phi {

constexpr int kTileM = 128;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kGemmThreads = 256;  // 8 warps: 4 (m) x 2 (n), 32 x 32 outputs each
constexpr int kRun = 8;            // elements per fetch

// A shared tile of kRows tile indices x kTileK: [i][k] (kKFast) or [k][i].
template <bool kKFast, int kRows>
struct TileLayout {
  static constexpr int kLd = kKFast ? kTileK + 4 : kRows + 8;  // 4 resp. 8 mod 32 words
  static constexpr int kWords = kKFast ? kRows * kLd : kTileK * kLd;
  static constexpr int kRuns = kRows * kTileK / kRun;
  __device__ static int at(int i, int k) { return kKFast ? i * kLd + k : k * kLd + i; }
  // Run q of a step: its first element (i, k). k-contiguous: a warp takes 8 indices x 4 runs of k.
  __device__ static void run(int q, int& i, int& k) {
    if (kKFast) {
      i = q / (kTileK / kRun);
      k = (q % (kTileK / kRun)) * kRun;
    } else {
      i = (q % (kRows / kRun)) * kRun;
      k = q / (kRows / kRun);
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

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// D = A B + C, 16x8x8, tf32 inputs, fp32 accumulation. Fragments (PTX ISA, m16n8k8 .tf32), with
// g = lane / 4, t = lane % 4: a = (g, t), (g+8, t), (g, t+4), (g+8, t+4); b = (k t, n g),
// (k t+4, n g); c = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element e (0 .. kTileM * kTileK) of a step's operand tile -> (row, k) within the tile. k-fast
// operands: a warp takes 8 consecutive k of 4 rows (coalesced 8-element runs; shared stores of a
// warp fall in 2 words per bank); otherwise 32 consecutive rows of one k (coalesced and
// conflict-free).
template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kGemmThreads, 2) gemm_kernel(int64_t M, int N, int K, int k_chunk, int splits,
                                                               LoadA la, LoadB lb, Store st) {
  using TA = TileLayout<LoadA::kKFast, kTileM>;
  using TB = TileLayout<LoadB::kKFast, kTileN>;
  constexpr int kRunsA = TA::kRuns / kGemmThreads, kRunsB = TB::kRuns / kGemmThreads;
  static_assert(kRunsA * kGemmThreads == TA::kRuns && kRunsB * kGemmThreads == TB::kRuns, "whole runs per thread");
  __shared__ __align__(16) float sa[TA::kWords];
  __shared__ __align__(16) float sb[TB::kWords];
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

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

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
      float4* d = reinterpret_cast<float4*>(&sa[TA::at(i, kk)]);
      d[0] = make_float4(ra[r][0], ra[r][1], ra[r][2], ra[r][3]);
      d[1] = make_float4(ra[r][4], ra[r][5], ra[r][6], ra[r][7]);
    }
#pragma unroll
    for (int r = 0; r < kRunsB; ++r) {
      int i, kk;
      TB::run(int(threadIdx.x) + r * kGemmThreads, i, kk);
      float4* d = reinterpret_cast<float4*>(&sb[TB::at(i, kk)]);
      d[0] = make_float4(rb[r][0], rb[r][1], rb[r][2], rb[r][3]);
      d[1] = make_float4(rb[r][4], rb[r][5], rb[r][6], rb[r][7]);
    }
  };
  auto split_tf32 = [](float x, uint32_t& hi, uint32_t& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
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
    for (int k8 = 0; k8 < kTileK; k8 += 8) {
      uint32_t bh[4][2], bl[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = wn + 8 * j + g;
        split_tf32(sb[TB::at(c, k8 + t)], bh[j][0], bl[j][0]);
        split_tf32(sb[TB::at(c, k8 + t + 4)], bh[j][1], bl[j][1]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wm + 16 * i + g;
        uint32_t ah[4], al[4];
        split_tf32(sa[TA::at(r, k8 + t)], ah[0], al[0]);
        split_tf32(sa[TA::at(r + 8, k8 + t)], ah[1], al[1]);
        split_tf32(sa[TA::at(r, k8 + t + 4)], ah[2], al[2]);
        split_tf32(sa[TA::at(r + 8, k8 + t + 4)], ah[3], al[3]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // 8 deep on the tensor cores, then into acc in fp32
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (!LoadA::kExact) mma_tf32(c, al, bh[j][0], bh[j][1]);
          if constexpr (!LoadB::kExact) mma_tf32(c, ah, bl[j][0], bl[j][1]);
          mma_tf32(c, ah, bh[j][0], bh[j][1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] += c[e];
        }
      }
    }
    __syncthreads();
    buf ^= 1;
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t m = m0 + wm + 16 * i + g + 8 * (c / 2);
        const int n = n0 + wn + 8 * j + 2 * t + c % 2;
        if (m < M && n < N) st(batch, m, n, split, acc[i][j][c]);
      }
}

// C = A B over `batches` independent products, each split over K into `splits` partials (every
// split stores, an empty range zeros).
template <class LoadA, class LoadB, class Store>
void gemm(cudaStream_t s, int64_t M, int N, int K, int splits, int batches, LoadA la, LoadB lb, Store st) {
  if (M <= 0 || N <= 0 || batches <= 0) return;
  int k_chunk = (K + splits - 1) / splits;
  k_chunk = (k_chunk + kTileK - 1) / kTileK * kTileK;  // whole steps per split
  const dim3 grid(unsigned((M + kTileM - 1) / kTileM), unsigned((N + kTileN - 1) / kTileN),
                  unsigned(batches * splits));
  gemm_kernel<<<grid, kGemmThreads, 0, s>>>(M, N, K, k_chunk, splits, la, lb, st);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::phi
