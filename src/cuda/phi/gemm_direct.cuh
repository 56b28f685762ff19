// phi's large products on bf16 operands copied as they are stored: C[M x N] = A[M x K] B[K x N]
// with fp32 accumulation on the tensor cores. gemm.cuh's kernel converts every element on its way
// to shared memory (fp32 and fp16 operands); these serve the products whose operands are bf16 in
// memory: x's blocks (u without pe: phi.cu folds pe into a bias), bf16 weights, and an fp32
// gradient that phi.cu rounds once to bf16 (as the attention kernels round P and dS for their
// products). 16-byte pieces go from global memory straight into a ring of shared stages
// (cp.async, zero-filled where an operand has no element).
//
// An operand derives from DirOperand<kT>:
//   kT        false: its contiguous index is k (a tile row is one index i and a step's k);
//             true: it is i (a tile row is one k and 128 i; the index's extent is a multiple of 8);
// and has
//   Fixed fixed(batch, i)           what a thread's piece needs of its tile index (with kT: of the
//                                   piece's first index), computed once per tile;
//   int64_t at(batch, Fixed, i, k)  the element offset (from the batch's base) of the piece's 8
//                                   elements from (i, k) along the contiguous index, or -1 for zeros.
// The store is gemm.cuh's st(batch, m, n, split, value).
//
// Tiles: 128 x 128 outputs per CTA of 8 warps, on one of two kernels with the same operands, the
// same CTA setup and copies (DirCta, DirPieces) and the same stores:
//   gemm_direct_kernel (any GPU): mma.m16n8k16, warps of 64 x 32 outputs (2 x 4), 32-deep steps,
//     3 stages of tile rows padded by 16 bytes (the 8 rows an ldmatrix reads fall on distinct
//     banks), fragments by ldmatrix;
//   gemm_wgmma_kernel (sm_90a): wgmma m64n128k16 from shared memory, one warpgroup per 64 rows,
//     64-deep steps, stages in the 128-byte swizzle layout (wgmma.h): a K-major operand (kT false)
//     as rows of 64 k, an MN-major one (kT true) as 64 k rows of two 64-index blocks; 3 stages,
//     2 CTAs an SM. Every step waits for its products before the next step's barrier, so a stage
//     is free again one step after it is read.
// The products accumulate in the tensor cores' fp32 accumulators over the split's whole range of
// K, as cuBLAS's bf16 products do (gemm.cuh adds each 16-deep partial in an ordinary addition
// instead; here the registers that would take are the difference between spilling and not).
// blockIdx.z = batch * splits + split; a split multiplies its own range of K and stores its own
// partial: every output is one thread's fixed-order sum, so the same inputs give the same bits
// (on one kernel: the two split K in steps of different depth and sum in different orders).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/mma.h"
#include "cuda/common/wgmma.h"
#include "cuda/phi/gemm.cuh"

namespace nsa::cuda::phi {

constexpr int kDirM = 128;
constexpr int kDirN = 128;
constexpr int kDirK = 32;
constexpr int kDirStages = 3;
constexpr int kDirThreads = 256;  // 8 warps: 2 (m) x 4 (n), 64 x 32 outputs each (wgmma: 2 warpgroups)
constexpr int kWgK = 64;           // gemm_wgmma_kernel's step: one 128-byte row of 16-bit k

// An operand's layout and memory (derive from it and add fixed / at): p its data.
template <bool T>
struct DirOperand {
  static constexpr bool kT = T;
  const __nv_bfloat16* p;
  __device__ const __nv_bfloat16* base(int) const { return p; }  // the data of a batch (DirPair: its own)
};

// Two operands of one kind as one of two batches (batch b: op[b], called as its batch 0): phi of
// k and of v in one launch. Their data may lie anywhere; every offset is from the batch's base.
template <class Op>
struct DirPair : DirOperand<Op::kT> {
  Op op0, op1;
  using Fixed = typename Op::Fixed;
  DirPair(const Op& a, const Op& b) : DirOperand<Op::kT>{a.p}, op0(a), op1(b) {}
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

// The same for gemm_wgmma_kernel: 64-deep steps in the 128-byte swizzle layout (wgmma.h), from a
// 1024-byte boundary. kT false (K-major): kRows rows of 64 k; true (MN-major): 64 k rows of kRows
// indices, as kRows / 64 blocks of 64 indices, 64 x 128 bytes apart.
template <bool kT, int kRows>
struct WgTile {
  static_assert(kRows % 64 == 0, "whole 64-index blocks");
  static constexpr int kBytes = kRows * kWgK * 2;
  static constexpr int kElems = kBytes / 2;
  static constexpr int kPiecesPerRow = (kT ? kRows : kWgK) / 8;
  static constexpr int kPieces = kBytes / 16;
  __device__ static void piece(int q, int& i, int& k) {
    const int row = q / kPiecesPerRow, col = (q % kPiecesPerRow) * 8;
    i = kT ? col : row;
    k = kT ? row : col;
  }
  __host__ __device__ static uint32_t offset(int i, int k) {
    return kT ? sw128_offset(kWgK, k, i) : sw128_offset(kRows, i, k);
  }
  __device__ static int at(int i, int k) { return int(offset(i, k) / 2); }  // in 16-bit elements
  // The descriptor of the 64 indices from i0 (a multiple of 64) and k16 step kk of the tile at
  // shared address tile. K-major: rows 8 apart are 1024 bytes apart (SBO), a k16 step is 32 bytes
  // into the row. MN-major: 8 k rows are 1024 bytes (SBO), a k16 step 2048, the next 64 indices
  // the next block (LBO).
  __host__ __device__ static uint64_t desc(uint32_t tile, int i0, int kk) {
    if constexpr (kT)
      return wgmma_desc_sw128(tile, uint32_t(i0 / 64 * (kWgK * 128) + kk * 2048), kWgK * 128, 1024);
    else
      return wgmma_desc_sw128(tile, uint32_t(i0 * 128 + kk * 32), 16, 1024);
  }
};

// A thread's pieces of one operand's stage tile (Tile: DirTile or WgTile): their tile positions and
// what their indices need (past the extent: the last index's), then each step's copy into a stage.
template <class Load, class Tile>
struct DirPieces {
  static constexpr int kN = Tile::kPieces / kDirThreads;
  static_assert(kN * kDirThreads == Tile::kPieces, "whole pieces a thread");
  int i[kN], k[kN];
  typename Load::Fixed f[kN];
  __device__ DirPieces(const Load& ld, int batch, int64_t i0, int64_t extent) {
#pragma unroll
    for (int r = 0; r < kN; ++r) {
      Tile::piece(int(threadIdx.x) + r * kDirThreads, i[r], k[r]);
      f[r] = ld.fixed(batch, min(i0 + i[r], extent - 1));
    }
  }
  // The step at k0 (elements past k_end or the extent: zeros) into the stage tile at dst.
  __device__ void copy(const Load& ld, const __nv_bfloat16* base, int batch, int64_t i0, int64_t extent, int k0,
                       int k_end, __nv_bfloat16* dst) const {
#pragma unroll
    for (int r = 0; r < kN; ++r) {
      const int64_t ii = i0 + i[r];
      const int kk = k0 + k[r];
      const int64_t off = (ii < extent && kk < k_end) ? ld.at(batch, f[r], ii, kk) : -1;
      cp_async_16(dst + Tile::at(i[r], k[r]), off < 0 ? ld.p : base + off, off >= 0);
    }
  }
};

// A CTA's tile of C and its split's range of K (blockIdx: x the 128 rows, y the 128 columns, z =
// batch * splits + split), with the thread's pieces of A and B; copy(stage, k0) brings the step at
// k0 into a stage (A, then B) and steps(depth) counts the split's steps.
template <class LoadA, class LoadB, class TA, class TB>
struct DirCta {
  int64_t m0;
  int n0, batch, split, k_begin, k_end;
  DirPieces<LoadA, TA> pa;
  DirPieces<LoadB, TB> pb;
  const __nv_bfloat16* a_base;
  const __nv_bfloat16* b_base;
  __device__ DirCta(int64_t M, int N, int K, int k_chunk, int splits, const LoadA& la, const LoadB& lb)
      : m0(int64_t(blockIdx.x) * kDirM),
        n0(int(blockIdx.y) * kDirN),
        batch(int(blockIdx.z) / splits),
        split(int(blockIdx.z) % splits),
        k_begin(split * k_chunk),
        k_end(min(K, k_begin + k_chunk)),
        pa(la, batch, m0, M),
        pb(lb, batch, n0, N),
        a_base(la.base(batch)),
        b_base(lb.base(batch)) {}
  __device__ int steps(int depth) const { return k_begin < k_end ? (k_end - k_begin + depth - 1) / depth : 0; }
  // The ring's first kStages - 1 steps (of `depth`), one cp.async group each (empty past the split).
  template <int kStages, class LoadStage>
  __device__ void prologue(int steps, int depth, LoadStage&& load_stage) const {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) load_stage(s, k_begin + s * depth);
      cp_async_commit();
    }
  }
  __device__ void copy(const LoadA& la, const LoadB& lb, int64_t M, int N, __nv_bfloat16* stage, int k0) const {
    pa.copy(la, a_base, batch, m0, M, k0, k_end, stage);
    pb.copy(lb, b_base, batch, n0, N, k0, k_end, stage + TA::kElems);
  }
};

template <class LoadA, class LoadB>
constexpr int dir_stage_elems() {
  return DirTile<LoadA::kT, kDirM>::kElems + DirTile<LoadB::kT, kDirN>::kElems;
}

template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kDirThreads, 2)
    gemm_direct_kernel(int64_t M, int N, int K, int k_chunk, int splits, LoadA la, LoadB lb, Store st) {
  using TA = DirTile<LoadA::kT, kDirM>;
  using TB = DirTile<LoadB::kT, kDirN>;
  constexpr int kStage = dir_stage_elems<LoadA, LoadB>();
  extern __shared__ __align__(16) __nv_bfloat16 dir_smem[];

  const DirCta<LoadA, LoadB, TA, TB> cta(M, N, K, k_chunk, splits, la, lb);
  const int64_t m0 = cta.m0;
  const int n0 = cta.n0, k_begin = cta.k_begin, steps = cta.steps(kDirK);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
  auto load_stage = [&](int stage, int k0) {
    cta.copy(la, lb, M, N, dir_smem + stage * kStage, k0);
  };

  float acc[4][4][4] = {};

  const int mi = lane / 8, mr = lane % 8;  // the ldmatrix row this lane addresses: matrix mi, row mr
  cta.template prologue<kDirStages>(steps, kDirK, load_stage);
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
    const __nv_bfloat16* sb = sa + TA::kElems;
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
        uint32_t af[4];
        if constexpr (LoadA::kT) {  // [k][m]: matrices (m lo, k lo), (m hi, k lo), (m lo, k hi), (m hi, k hi)
          ldmatrix_x4_trans(af, sa + TA::at(wm + 16 * i + 8 * (mi % 2), 16 * h + mr + 8 * (mi / 2)));
        } else {  // [m][k]
          ldmatrix_x4(af, sa + TA::at(wm + 16 * i + mr + 8 * (mi % 2), 16 * h + 8 * (mi / 2)));
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16816<true>(acc[i][j], af, bf[j][0], bf[j][1]);
      }
    }
  }
  cp_async_wait<0>();

  store_fragments(acc, m0 + wm, n0 + wn, M, N, cta.batch, cta.split, st);
}

// gemm_wgmma_kernel's ring: stages of A then B, each tile from a 1024-byte boundary.
constexpr int kWgStages = 3;
template <class LoadA, class LoadB>
constexpr int wg_stage_bytes() {
  return WgTile<LoadA::kT, kDirM>::kBytes + WgTile<LoadB::kT, kDirN>::kBytes;
}
template <class LoadA, class LoadB>
constexpr size_t wg_smem_bytes() {  // with the slack that aligns the ring
  return size_t(kWgStages) * wg_stage_bytes<LoadA, LoadB>() + 1024;
}

template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kDirThreads, 2)
    gemm_wgmma_kernel(int64_t M, int N, int K, int k_chunk, int splits, LoadA la, LoadB lb, Store st) {
#if NSA_WGMMA_AVAILABLE
  using TA = WgTile<LoadA::kT, kDirM>;
  using TB = WgTile<LoadB::kT, kDirN>;
  constexpr int kStages = kWgStages;
  constexpr int kStage = wg_stage_bytes<LoadA, LoadB>();
  static_assert(kStage % 1024 == 0 && TA::kBytes % 1024 == 0, "every tile on a 1024-byte boundary");
  extern __shared__ __align__(16) unsigned char wg_smem[];
  unsigned char* const ring = wg_smem + ((1024u - (smem_address(wg_smem) & 1023u)) & 1023u);
  const uint32_t ring_addr = smem_address(ring);

  const DirCta<LoadA, LoadB, TA, TB> cta(M, N, K, k_chunk, splits, la, lb);
  const int64_t m0 = cta.m0;
  const int n0 = cta.n0, k_begin = cta.k_begin, steps = cta.steps(kWgK);
  const int wg = int(threadIdx.x) / 128;  // the warpgroup's 64 rows: 64 wg ..
  auto load_stage = [&](int stage, int k0) {
    cta.copy(la, lb, M, N, reinterpret_cast<__nv_bfloat16*>(ring + stage * kStage), k0);
  };

  float acc[kDirN / 8][4];
#pragma unroll
  for (int j = 0; j < kDirN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  cta.template prologue<kStages>(steps, kWgK, load_stage);
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    fence_proxy_async();  // this thread's copies of the step, for wgmma's reads
    __syncthreads();      // the step's stage has landed; every product of the previous step has retired
    const uint32_t sa = ring_addr + uint32_t((step % kStages) * kStage), sb = sa + TA::kBytes;
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgK / 16; ++kk) {
      wgmma_ss<kDirN, true, LoadB::kT ? 1 : 0, LoadA::kT ? 1 : 0>(acc, TA::desc(sa, 64 * wg, kk), TB::desc(sb, 0, kk),
                                                                  1);
    }
    wgmma_commit();
    {  // into the stage the previous step read, while this step's products run
      const int next = step + kStages - 1;
      if (next < steps) load_stage(next % kStages, k_begin + next * kWgK);
      cp_async_commit();
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
  }
  cp_async_wait<0>();

  // Warp w of the warpgroup holds rows 16 w .. of its 64, all 128 columns: 4 x (4 n8 fragments).
  const int64_t m_base = m0 + 64 * wg + 16 * ((int(threadIdx.x) / 32) % 4);
#pragma unroll
  for (int jj = 0; jj < kDirN / 32; ++jj)
    store_fragments(*reinterpret_cast<const float(*)[1][4][4]>(&acc[4 * jj][0]), m_base, n0 + 32 * jj, M, N,
                    cta.batch, cta.split, st);
#else
  wgmma_unavailable();
#endif
}

// Whether gemm_wgmma_kernel<...> runs its sm_90a body on this GPU (asked once per instantiation).
template <class LoadA, class LoadB, class Store>
bool wgmma_products_run() {
  static const bool runs = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, gemm_wgmma_kernel<LoadA, LoadB, Store>) == cudaSuccess && runs_wgmma_body(a);
  }();
  return runs;
}

// C = A B over `batches` independent products, each split over K into `splits` partials (every
// split stores; an empty range stores zeros). K: a multiple of 8. wgmma: on gemm_wgmma_kernel
// where the GPU runs its body (CudaKernelChoices::phi_wgmma), else on gemm_direct_kernel.
template <class LoadA, class LoadB, class Store>
void gemm_direct(cudaStream_t s, int64_t M, int N, int K, int splits, int batches, LoadA la, LoadB lb, Store st,
                 bool wgmma) {
  if (M <= 0 || N <= 0 || batches <= 0) return;
  const dim3 grid(unsigned((M + kDirM - 1) / kDirM), unsigned((N + kDirN - 1) / kDirN), unsigned(batches * splits));
  if (wgmma && wgmma_products_run<LoadA, LoadB, Store>()) {
    constexpr size_t smem = wg_smem_bytes<LoadA, LoadB>();
    allow_smem(gemm_wgmma_kernel<LoadA, LoadB, Store>, smem, true);
    gemm_wgmma_kernel<<<grid, kDirThreads, smem, s>>>(M, N, K, split_k_chunk(K, splits, kWgK), splits, la, lb, st);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr size_t smem = size_t(kDirStages) * dir_stage_elems<LoadA, LoadB>() * sizeof(__nv_bfloat16);
  allow_smem(gemm_direct_kernel<LoadA, LoadB, Store>, smem, false);
  gemm_direct_kernel<<<grid, kDirThreads, smem, s>>>(M, N, K, split_k_chunk(K, splits, kDirK), splits, la, lb, st);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::phi
