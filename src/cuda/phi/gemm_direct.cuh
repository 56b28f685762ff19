// phi's large products on bf16 operands copied as they are stored: C[M x N] = A[M x K] B[K x N]
// with fp32 accumulation on mma.m16n8k16. gemm.cuh's kernel converts every element on its way to
// shared memory (fp32 and fp16 operands); this one serves the products whose operands are bf16 in
// memory: x's blocks (u without pe: phi.cu folds pe into a bias), bf16 weights, and an fp32
// gradient that phi.cu splits once into bf16 high and low planes (A's planes: a b = a_hi b + a_lo b,
// about 17 significant bits of a). 16-byte pieces go from global memory straight into a ring of
// shared stages (cp.async, zero-filled where an operand has no element) and fragments come out with
// ldmatrix.
//
// An operand derives from DirOperand<kT, kPlanes>:
//   kT        false: its contiguous index is k (a tile row is one index i and 32 k);
//             true: it is i (a tile row is one k and 128 i; the index's extent is a multiple of 8);
//   kPlanes   1, or 2 for A's high and low planes at p and p + plane;
// and has
//   Fixed fixed(batch, i)           what a thread's piece needs of its tile index (with kT: of the
//                                   piece's first index), computed once per tile;
//   int64_t at(batch, Fixed, i, k)  the element offset (from p) of the piece's 8 elements from
//                                   (i, k) along the contiguous index, or -1 for zeros.
// The store is gemm.cuh's st(batch, m, n, split, value).
//
// Tiles: 128 x 128 outputs per CTA of 8 warps (2 x 4, 64 x 32 each), 32-deep steps, 3 stages of
// tile rows padded by 16 bytes (the 8 rows an ldmatrix reads fall on distinct banks). The products
// accumulate in the mma's fp32 accumulators over the split's whole range of K, as cuBLAS's bf16
// products do (gemm.cuh adds each 16-deep partial in an ordinary addition instead; here the
// registers that would take are the difference between spilling and not). blockIdx.z = batch *
// splits + split; a split multiplies its own range of K and stores its own partial: every output
// is one thread's fixed-order sum, so the same inputs give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/mma.h"
#include "cuda/phi/gemm.cuh"

namespace nsa::cuda::phi {

constexpr int kDirM = 128;
constexpr int kDirN = 128;
constexpr int kDirK = 32;
constexpr int kDirStages = 3;
constexpr int kDirThreads = 256;  // 8 warps: 2 (m) x 4 (n), 64 x 32 outputs each

// An operand's layout and memory (derive from it and add fixed / at): p its data (the high plane),
// plane the low plane's offset from p.
template <bool T, int kP>
struct DirOperand {
  static constexpr bool kT = T;
  static constexpr int kPlanes = kP;
  const __nv_bfloat16* p;
  int64_t plane;
  __device__ const __nv_bfloat16* base(int) const { return p; }  // the data of a batch (DirPair: its own)
};

// Two operands of one kind as one of two batches (batch b: op[b], called as its batch 0): phi of
// k and of v in one launch. Their data may lie anywhere; every offset is from the batch's base.
template <class Op>
struct DirPair : DirOperand<Op::kT, Op::kPlanes> {
  Op op0, op1;
  using Fixed = typename Op::Fixed;
  DirPair(const Op& a, const Op& b) : DirOperand<Op::kT, Op::kPlanes>{a.p, a.plane}, op0(a), op1(b) {}
  __device__ const __nv_bfloat16* base(int b) const { return b == 0 ? op0.p : op1.p; }
  __device__ Fixed fixed(int b, int64_t i) const { return b == 0 ? op0.fixed(0, i) : op1.fixed(0, i); }
  __device__ int64_t at(int b, const Fixed& f, int64_t i, int k) const {
    return b == 0 ? op0.at(0, f, i, k) : op1.at(0, f, i, k);
  }
};

// One stage's tile of an operand with kRows tile indices, in 16-bit elements: rows of kLd.
template <bool kT, int kRows>
struct DirTile {
  static constexpr int kLd = (kT ? kRows : kDirK) + 8;
  static constexpr int kElems = (kT ? kDirK : kRows) * kLd;
  static constexpr int kPiecesPerRow = (kT ? kRows : kDirK) / 8;
  static constexpr int kPieces = (kT ? kDirK : kRows) * kPiecesPerRow;
  // Piece q's first element (i, k) in the tile.
  __device__ static void piece(int q, int& i, int& k) {
    const int row = q / kPiecesPerRow, col = (q % kPiecesPerRow) * 8;
    i = kT ? col : row;
    k = kT ? row : col;
  }
  __device__ static int at(int i, int k) { return kT ? k * kLd + i : i * kLd + k; }
};

template <class LoadA, class LoadB>
constexpr int dir_stage_elems() {
  return LoadA::kPlanes * DirTile<LoadA::kT, kDirM>::kElems + DirTile<LoadB::kT, kDirN>::kElems;
}

template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kDirThreads, 2)
    gemm_direct_kernel(int64_t M, int N, int K, int k_chunk, int splits, LoadA la, LoadB lb, Store st) {
  using TA = DirTile<LoadA::kT, kDirM>;
  using TB = DirTile<LoadB::kT, kDirN>;
  constexpr int kPA = LoadA::kPlanes;
  constexpr int kStage = dir_stage_elems<LoadA, LoadB>();
  constexpr int kPiecesA = TA::kPieces / kDirThreads, kPiecesB = TB::kPieces / kDirThreads;
  static_assert(kPiecesA * kDirThreads == TA::kPieces && kPiecesB * kDirThreads == TB::kPieces, "whole pieces");
  static_assert(LoadB::kPlanes == 1, "B is one plane");
  extern __shared__ __align__(16) __nv_bfloat16 dir_smem[];

  const int64_t m0 = int64_t(blockIdx.x) * kDirM;
  const int n0 = int(blockIdx.y) * kDirN;
  const int batch = int(blockIdx.z) / splits, split = int(blockIdx.z) % splits;
  const int k_begin = split * k_chunk;
  const int k_end = min(K, k_begin + k_chunk);
  const int steps = k_begin < k_end ? (k_end - k_begin + kDirK - 1) / kDirK : 0;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;

  // The thread's pieces: tile position and what their index needs (past M / N: the last index's).
  int ia[kPiecesA], ka[kPiecesA], ib[kPiecesB], kb[kPiecesB];
  typename LoadA::Fixed fa[kPiecesA];
  typename LoadB::Fixed fb[kPiecesB];
#pragma unroll
  for (int r = 0; r < kPiecesA; ++r) {
    TA::piece(int(threadIdx.x) + r * kDirThreads, ia[r], ka[r]);
    fa[r] = la.fixed(batch, min(m0 + ia[r], M - 1));
  }
#pragma unroll
  for (int r = 0; r < kPiecesB; ++r) {
    TB::piece(int(threadIdx.x) + r * kDirThreads, ib[r], kb[r]);
    fb[r] = lb.fixed(batch, min(int64_t(n0) + ib[r], int64_t(N) - 1));
  }
  const __nv_bfloat16* const a_base = la.base(batch);
  const __nv_bfloat16* const b_base = lb.base(batch);
  auto load_stage = [&](int stage, int k0) {
    __nv_bfloat16* sa = dir_smem + stage * kStage;
    __nv_bfloat16* sb = sa + kPA * TA::kElems;
#pragma unroll
    for (int r = 0; r < kPiecesA; ++r) {
      const int64_t i = m0 + ia[r];
      const int k = k0 + ka[r];
      const int64_t off = (i < M && k < k_end) ? la.at(batch, fa[r], i, k) : -1;
#pragma unroll
      for (int p = 0; p < kPA; ++p)
        cp_async_16(sa + p * TA::kElems + TA::at(ia[r], ka[r]), off < 0 ? la.p : a_base + p * la.plane + off, off >= 0);
    }
#pragma unroll
    for (int r = 0; r < kPiecesB; ++r) {
      const int64_t i = int64_t(n0) + ib[r];
      const int k = k0 + kb[r];
      const int64_t off = (i < N && k < k_end) ? lb.at(batch, fb[r], i, k) : -1;
      cp_async_16(sb + TB::at(ib[r], kb[r]), off < 0 ? lb.p : b_base + off, off >= 0);
    }
  };

  float acc[4][4][4] = {};

  const int mi = lane / 8, mr = lane % 8;  // the ldmatrix row this lane addresses: matrix mi, row mr
#pragma unroll
  for (int s = 0; s < kDirStages - 1; ++s) {
    if (s < steps) load_stage(s, k_begin + s * kDirK);
    cp_async_commit();
  }
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kDirStages - 2>();
    __syncthreads();  // the step's stage has landed; every warp is done with the stage refilled next
    {
      const int next = step + kDirStages - 1;
      if (next < steps) load_stage(next % kDirStages, k_begin + next * kDirK);
      cp_async_commit();
    }
    const __nv_bfloat16* sa = dir_smem + (step % kDirStages) * kStage;
    const __nv_bfloat16* sb = sa + kPA * TA::kElems;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // k16 steps
      uint32_t bf[4][2];           // [n8 tile][b0, b1]
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        uint32_t r[4];
        if constexpr (LoadB::kT) {  // [k][n]: matrices (k lo, n lo), (k hi, n lo), (k lo, n hi), (k hi, n hi)
          ldmatrix_x4_trans(r, sb + TB::at(wn + 16 * jj + 8 * (mi / 2), 16 * h + mr + 8 * (mi % 2)));
        } else {  // [n][k]: matrices (n lo, k lo), (n lo, k hi), (n hi, k lo), (n hi, k hi)
          ldmatrix_x4(r, sb + TB::at(wn + 16 * jj + mr + 8 * (mi / 2), 16 * h + 8 * (mi % 2)));
        }
        bf[2 * jj][0] = r[0];
        bf[2 * jj][1] = r[1];
        bf[2 * jj + 1][0] = r[2];
        bf[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t af[kPA][4];
#pragma unroll
        for (int p = 0; p < kPA; ++p) {
          const __nv_bfloat16* plane = sa + p * TA::kElems;
          if constexpr (LoadA::kT) {  // [k][m]: matrices (m lo, k lo), (m hi, k lo), (m lo, k hi), (m hi, k hi)
            ldmatrix_x4_trans(af[p], plane + TA::at(wm + 16 * i + 8 * (mi % 2), 16 * h + mr + 8 * (mi / 2)));
          } else {  // [m][k]
            ldmatrix_x4(af[p], plane + TA::at(wm + 16 * i + mr + 8 * (mi % 2), 16 * h + 8 * (mi / 2)));
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int p = kPA - 1; p >= 0; --p) mma_16816<true>(acc[i][j], af[p], bf[j][0], bf[j][1]);
      }
    }
  }
  cp_async_wait<0>();

  store_fragments(acc, m0 + wm, n0 + wn, M, N, batch, split, st);
}

// C = A B over `batches` independent products, each split over K into `splits` partials (every
// split stores; an empty range stores zeros). K: a multiple of 8.
template <class LoadA, class LoadB, class Store>
void gemm_direct(cudaStream_t s, int64_t M, int N, int K, int splits, int batches, LoadA la, LoadB lb, Store st) {
  if (M <= 0 || N <= 0 || batches <= 0) return;
  const int k_chunk = split_k_chunk(K, splits, kDirK);
  const dim3 grid(unsigned((M + kDirM - 1) / kDirM), unsigned((N + kDirN - 1) / kDirN), unsigned(batches * splits));
  constexpr size_t smem = size_t(kDirStages) * dir_stage_elems<LoadA, LoadB>() * sizeof(__nv_bfloat16);
  allow_smem(gemm_direct_kernel<LoadA, LoadB, Store>, smem, false);
  gemm_direct_kernel<<<grid, kDirThreads, smem, s>>>(M, N, K, k_chunk, splits, la, lb, st);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::phi
