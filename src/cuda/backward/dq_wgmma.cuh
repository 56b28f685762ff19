// sm_90a building blocks of dq_kernel (dq_kernel.cuh; its sm_90a mainloop: dq_mainloop_sm90.cuh),
// some also used by dkv_kernel (its swizzled row copies, its exponentials): warpgroup MMAs
// (common/wgmma.h) instead of mma.sync.
//
// The CTA of dq_kernel is one warpgroup: 4 warps, kRows = 64 query rows, warp w owning rows
// 16w..16w+15 in both bodies.
// The wgmma register layouts are the mma.sync ones (an m64nN fp32 accumulator is, per warp, N/8
// m16n8 C fragments of its 16 rows; a register A operand is the m16n8k16 A fragment), so masking,
// probabilities, dS and the dg / dq epilogues are the same code.
// Per 64-key tile (all warps together: a tile is skipped only when no row of the CTA sees it):
//   S  = Q K^T     Dqk/16 x m64n64k16, A = the warpgroup's rows of the Q tile, B = the K tile,
//                  both from shared memory (K-major)
//   dP = dO V^T    Dv/16  x m64n64k16, A = its rows of the dO tile, B = the V tile (same)
//   dQ += dS K     4 k16 steps of m64n{Dqk}k16 (Dqk = 192: n128 + n64), A = dS packed from the
//                  scores, B = the K tile (MN-major)
//   pass 1: O += P V   4 x m64n{Dv}k16, A = P, B = the V tile (MN-major)
// Q and dO are stored 128-byte swizzled too and read by the products from shared
// memory (before: padded tiles and ldmatrix fragments per batch, 32 + 32 registers at D = 128),
// and the dg epilogue reads dO from the swizzled tile. No A operand is held in registers across
// the tile loop (the ptxas hazard of docs/cuda.md, "sm_80 and sm_90a"); dS and P are built in the iteration
// that uses them. K and V tiles are stored in the 128-byte swizzle layout (sw128_offset, 64-column
// blocks of 64 keys x 128 bytes, 1024-byte aligned); their rows past the tile's keys are
// zero-filled by the same copies, so the products there are 0 (and masked anyway).
// Descriptors as the forward's (docs/cuda.md): K-major SBO = 1024, k16 step +32 B within a 64-column
// block, +8 KB to the next block; MN-major SBO = 1024, LBO = 8 KB (next 64 columns), k16 step +2 KB.
// Each batch is wgmma_fence / issue / commit / wait<0> (cuda::wgmma_batch), accumulators fenced on both sides
// (wgmma_fence_operands), except pass 2's dQ product where Dqk <= 128, which the next tile's S wait
// retires (DqMainloopSm90::sweep<true>); every thread fences its landed copies to the async proxy
// before the tile's barrier (fence_proxy_async). Deterministic: the same fixed order of products every run.
// S and dP go out as two groups, S first: P is formed from S (wait_group 1) while dP's products
// still run, dS after the second wait (dq_mainloop_sm90.cuh). P uses ex2.approx (flushes below
// 2^-126), and a tile that every row of the warp sees whole skips the per-key mask.
// Shared memory: where this body runs the launch asks for DqSmem::kSwLaunch (the swizzled layout
// and its 1024-byte alignment slack; one K/V buffer at Dqk 192, DqSmem::kSwBufs), elsewhere for
// DqSmem::kEnd (the padded layout, which also holds the swizzled one: static_assert in DqSmem).
//
// With Q / dO fragments instead (64-row tiles): ptxas 255 registers at 128x128, 2 CTAs per SM;
// H200 at 64K dq_kernel 94.4 -> 65.8 ms against the mma.sync body (`8fb2178`), 39.3 ms with cheaper
// copies and descriptors (`9ae5052`). ncu then: 2 warps per scheduler, 0.46 instructions issued per
// cycle, bound by latency and instruction issue, not by the tensor cores. Q and dO from shared
// memory (one warpgroup per CTA, branch bwd-dq-q-smem-64): ncu 39.5 -> 35.6 ms (`3831e9f`); two
// warpgroups per CTA (bwd-dq-q-smem) measured slower (tile.cuh, at kRows).
#pragma once

#include "cuda/backward/tile.cuh"
#include "cuda/common/wgmma.h"

namespace nsa::cuda::bwd {

constexpr bool kDqWgmma = cuda::kWgmmaCompiled;

// 2^x on the special-function unit, subnormal results flushed to zero (a probability below 2^-126
// adds nothing a float sum keeps): exp2f adds a range fix-up around the same instruction.
__device__ __forceinline__ float dq_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Bytes of one swizzled tile of kKeys rows x D 16-bit columns (no padding).
template <int D>
constexpr int sw_tile_bytes() {
  return kKeys * D * 2;
}

// copy_rows into a 128-byte-swizzled tile of kKeys (= kRows) rows (dst 1024-byte aligned); same
// contract. Where the threads divide into whole rows of 16-byte pieces 8 rows apart (D = 64, 128;
// cuda::sw128_copy_threads), each copies one fixed piece of rows r0, r0 + kStep, ...: those rows
// share one swizzle pattern, so the destination is one address plus a constant per row, and
// row_ptr runs once per row and piece (about 7 instructions a copy instead of 35). kT threads
// copy, tid is this one's index among them.
template <typename E, int D, int kT = kThreads, typename RowPtr>
__device__ __forceinline__ void copy_rows_sw128(E* dst, RowPtr row_ptr, bool vec, const E* any,
                                                int tid = int(threadIdx.x)) {
  static_assert(D % 64 == 0, "swizzled tiles are made of 64-column blocks");
  constexpr int kR = kKeys;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(dst);
  constexpr int kChunks = D / 8;
  constexpr int kCopy = cuda::sw128_copy_threads(kT, kChunks, kR);
  if (vec) {
    if constexpr (kCopy > 0) {
      constexpr int kStep = kCopy / kChunks;
      if (kCopy < kT && tid >= kCopy) return;
      const int piece = tid % kChunks, r0 = tid / kChunks;
      unsigned char* d0 = bytes + cuda::sw128_offset(kR, r0, piece * 8);
#pragma unroll
      for (int k = 0; k < kR / kStep; ++k) {
        const E* src = row_ptr(r0 + k * kStep);
        cuda::cp_async_16(d0 + k * kStep * 128, src != nullptr ? src + piece * 8 : any, src != nullptr);
      }
    } else {
      for (int e = tid; e < kR * kChunks; e += kT) {
        const int r = e / kChunks, c = (e % kChunks) * 8;
        const E* src = row_ptr(r);
        cuda::cp_async_16(bytes + cuda::sw128_offset(kR, r, c), src != nullptr ? src + c : any, src != nullptr);
      }
    }
  } else {
    for (int e = tid; e < kR * D; e += kT) {
      const int r = e / D, c = e % D;
      const E* src = row_ptr(r);
      *reinterpret_cast<E*>(bytes + cuda::sw128_offset(kR, r, c & ~7) + (c & 7) * 2) =
          src != nullptr ? src[c] : from_float<E>(0.f);
    }
  }
}

// Issues acc (m64 x n D) += A B: A = af (4 k16 steps = the tile's kKeys keys), B = the swizzled
// kKeys x D tile at shared address b (MN-major). D = 64, 128, or 192 (n128 on columns 0..127, then
// n64 on 128..191). No fence, commit or wait.
template <typename E, int D>
__device__ __forceinline__ void wgmma_ab_issue(float (&acc)[D / 8][4], const uint32_t (&af)[kKeys / 16][4], uint32_t b) {
  constexpr uint32_t kLbo = sw_tile_bytes<64>();  // next 64-column block
  static_assert(D == 64 || D == 128 || D == 192, "head dims of the backward");
  using Lo = float[(D >= 128 ? 128 : 64) / 8][4];
  Lo& lo = *reinterpret_cast<Lo*>(&acc[0]);
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    const uint32_t off = kk * 16 * 128;
    cuda::wgmma_rs<(D >= 128 ? 128 : 64), kIsBf16<E>, 1>(lo, af[kk], cuda::wgmma_desc_sw128(b, off, kLbo, 1024), 1);
    if constexpr (D == 192) {
      using Hi = float[8][4];
      Hi& hi = *reinterpret_cast<Hi*>(&acc[16]);
      cuda::wgmma_rs<64, kIsBf16<E>, 1>(hi, af[kk], cuda::wgmma_desc_sw128(b, off + 2 * kLbo, kLbo, 1024), 1);
    }
  }
}

}  // namespace nsa::cuda::bwd
