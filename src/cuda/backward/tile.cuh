// Attention kernels of the CUDA backward (docs/cuda_backward.md).
//
// Every branch is softmax attention over a set of keys; the backward of one (row tile, key tile)
// pair is a few 64 x 64 x D products on the tensor cores (mma.sync m16n8k16, fp32 accumulation):
//   S = Q K^T,  P = exp(scale S - lse) (masked),  dP = dO V^T,
//   dS = g P (dP - dg),  dQ += scale dS K,  dK += scale dS^T Q,  dV += (g P)^T dO
// where g is the branch gate and dg = <dO, o_branch> (= the usual rowsum(dO_b * o_b) / g).
//
// Scores never leave registers: the C fragments of two neighbouring n8 tiles are the A fragments
// of one k16 tile (src/cuda/common/mma.h), so P and dS go from the accumulator of one product
// straight into the next as operands; K, V, Q, dO come from shared memory through ldmatrix
// (transposed where they are the k-major operand). The streamed tiles are double-buffered with
// cp.async: the copy of the next tile runs under the products of the current one.
//
// A row tile holds kRows = 64 rows: kRows / G consecutive query tokens of one sequence times the
// G query heads of one KV head, so every key row loaded serves G heads. Three kernels, none with
// floating-point atomics:
//   dq_kernel        query-centric, each warp owns 16 rows, compressed and window branches (and
//                    on sm_90a the selection of a row tile whose tokens' blocks have a small
//                    union: BwdArgs::slc_union): per row tile, (1) recompute each branch's output
//                    from lse to get dg (skipped when dg came from the saved o_branch), (2) sum
//                    the branches' dQ in registers, write dq.
//   slc_dq_kernel    (slc_dq.cuh) the selection branch's dg and dQ of the other row tiles, one
//                    warp per 16 rows with K/V from L2 into registers; adds its dQ to dq.
//   dkv_kernel       key-centric, each warp owns 16 keys (it computes S^T and dP^T, so P^T and
//                    dS^T are its A operands): per key tile, loop over the query tiles that see
//                    it; raw keys (window + selection, the latter through the inverted index) or
//                    compressed keys (split over query ranges, partial sums reduced in a fixed
//                    order later). On sm_90a at Dqk = Dv = 128 the same work runs warp-specialised
//                    (dkv_ws_kernel.cuh: a producer warpgroup and two consumer warpgroups).
//
//
// This header: the tile sizes every backward kernel shares and their small device helpers (row
// pointers, tile copies, fragment loads). The kernels: dq_kernel.cuh, dkv_kernel.cuh, slc_dq.cuh;
// their launchers: launch.cuh; their parameters: BwdArgs (cuda/params.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/tile_sizes.h"
#include "cuda/common/constants.h"
#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"
#include "cuda/common/tma.h"
#include "cuda/common/wgmma.h"
#include "cuda/params.h"
#include "cuda/common/slc_union.cuh"
#include "nsa/api.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda::bwd {

constexpr int kRows = 64;            // query rows per tile (tokens x heads of one group)
constexpr int kKeys = 64;            // keys per tile
constexpr int kWarps = kRows / 16;   // each warp owns 16 rows (dq) or 16 keys (dk/dv)
constexpr int kThreads = 32 * kWarps;
// dq_kernel's row tile is kRows rows, one warpgroup, 2 CTAs per SM. (Two warpgroups, 1 CTA per
// SM, measured slower, both with Q / dO fragments and from shared memory; three,
// at the 168 registers that 384 threads leave, spilled ~300 bytes in the tile loop at 128/128.)
// The warps work on 16 x 64 score blocks in two halves of 16 x 32 (kSubTiles n8 tiles): half the
// live score registers, so dK and dV (or dQ) accumulators of a 128-wide head fit without spills.
constexpr int kSub = 32;
constexpr int kSubTiles = kSub / 8;
// 16-bit elements of padding per shared row: a row starts 16 bytes further along the banks than
// the one before, so the 8 rows one ldmatrix reads hit 8 different bank groups.
constexpr int kPad = 8;
// Two CTAs asking for `bytes` each fit one sm_90 SM (the sm_90a layouts' buffer counts,
// DqSmem::kSwBufs and DkvSmem::kSwBufs).
constexpr bool two_ctas_fit_sm90(size_t bytes) { return 2 * (bytes + kSmemPerCtaReserved) <= kSmemPerSm; }
static_assert(kRows == kKeys && kKeys == 2 * kSub, "a score block is two halves, both ways");

// ---- small device helpers ----------------------------------------------------------------

using cuda::from_float;
using cuda::to_float;

template <typename E>
__device__ __forceinline__ float load_f32(const void* base, int64_t i) {
  return to_float(static_cast<const E*>(base)[i]);
}

__device__ __forceinline__ int64_t seq_start(const int32_t* cu, int b) { return cu[b]; }

// The selection's D = g_slc <dO, o_slc> of token `tok`, head `head` from the forward's o (spec §7:
// o = sum_b g_b o_b): <dO, o> - g_cmp dg_cmp - g_win dg_win, with dg_cmp and dg_win from dg32
// (dq_kernel's pass 1 wrote them). BwdArgs::d_from_o; dq_kernel's union tiles and slc_dq_kernel.
template <typename E, typename Args>
__device__ __forceinline__ float slc_d_from_o(const Args& a, int64_t tok, int head, float dot_o_do) {
  const float* dgr = a.dg32 + (tok * a.hq + head) * 3;
  return dot_o_do - load_f32<E>(a.g.p, tok * a.g.s0 + head * a.g.s1 + kCmp) * dgr[kCmp] -
         load_f32<E>(a.g.p, tok * a.g.s0 + head * a.g.s1 + kWin) * dgr[kWin];
}

// Bytes of a shared tile of kRows (= kKeys) rows of D 16-bit elements, padded rows.
template <int D>
constexpr int tile_bytes() {
  return kRows * (D + kPad) * 2;
}

// Starts copying kRows rows of D elements into a shared tile [kRows][D + kPad]; row r comes from
// row_ptr(r) (nullptr: zeros). With `vec` (every row 16-byte aligned) the copy is cp.async and
// lands at the caller's next cp_async_wait; otherwise plain loads. Either way it is visible after
// the caller's next barrier. `any` is a valid global address: cp.async needs one even for a
// zero-filled row, whose bytes it does not read.
template <typename E, int D, typename RowPtr>
__device__ __forceinline__ void copy_rows(E* dst, RowPtr row_ptr, bool vec, const E* any) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunks = D / 8;
    for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
      const int r = e / kChunks, c = (e % kChunks) * 8;
      const E* src = row_ptr(r);
      cuda::cp_async_16(dst + r * kLd + c, src != nullptr ? src + c : any, src != nullptr);
    }
  } else {
    for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
      const int r = e / D, c = e % D;
      const E* src = row_ptr(r);
      dst[r * kLd + c] = src != nullptr ? src[c] : from_float<E>(0.f);
    }
  }
}

template <typename E>
constexpr bool kIsBf16 = cuda::StorageTraits<E>::is_bf16;

// acc = A B^T for the 16 rows of A starting at sA and the NT * 8 rows of B starting at sB (shared
// tiles of depth D): the C fragments of NT n8 tiles, columns = B's rows.
template <typename E, int D, int NT>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const E* sA, const E* sB) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  const E* arow = sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
  const E* brow = sB + ((lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[4];
    cuda::ldmatrix_x4(af, arow + kk * 16);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      cuda::ldmatrix_x4(b, brow + np * 16 * kLd + kk * 16);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * np], af, b[0], b[1]);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * np + 1], af, b[2], b[3]);
    }
  }
}

// The A fragments of a 16 x (NT * 8) operand from the C fragments of its NT n8 tiles, rounded to E.
template <typename E, int NT>
__device__ __forceinline__ void to_operand(const float (&c)[NT][4], uint32_t (&af)[NT / 2][4]) {
  using T = cuda::StorageTraits<E>;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    af[kk][0] = T::pack(c[2 * kk][0], c[2 * kk][1]);
    af[kk][1] = T::pack(c[2 * kk][2], c[2 * kk][3]);
    af[kk][2] = T::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    af[kk][3] = T::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// acc += A B for A 16 x (KT * 16) (operand fragments) and B the (KT * 16) x D rows of the shared
// tile at sB (row-major, so it is read with ldmatrix.trans).
template <typename E, int D, int KT>
__device__ __forceinline__ void mma_ab(float (&acc)[D / 8][4], const uint32_t (&af)[KT][4], const E* sB) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  const E* row = sB + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      cuda::ldmatrix_x4_trans(b, row + kk * 16 * kLd + dp * 16);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * dp], af[kk], b[0], b[1]);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * dp + 1], af[kk], b[2], b[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Key geometry of one key tile: key c (< nk) has "visibility position" kp0 + c * kstep: a row at
// position t with window start lo sees it when lo <= pos <= t (compressed keys: the last token of
// the block).
struct KeyTile {
  int nk;
  int kp0, kstep;
  // The row tile's tokens that may see the tile (bit: token index in the tile; the selection's
  // union tiles in dq_kernel: the tokens that picked the block), all for the other branches.
  unsigned long long tokens = ~0ull;
};

}  // namespace nsa::cuda::bwd
