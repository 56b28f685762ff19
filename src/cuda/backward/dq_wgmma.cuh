// sm_90a building blocks of dq_kernel (attention.cuh, which includes this header after its
// constants and helpers): warpgroup MMAs (common/wgmma.h) instead of mma.sync.
//
// The CTA of dq_kernel is two warpgroups: 8 warps, kDqRows = 128 query rows, warp w owning rows
// 16w..16w+15 in both bodies; each warpgroup multiplies its 64 rows against the same K/V tile. The wgmma register layouts are the mma.sync ones (an m64nN fp32
// accumulator is, per warp, N/8 m16n8 C fragments of its 16 rows; a register A operand is the
// m16n8k16 A fragment), so masking, probabilities, dS and the dg / dq epilogues are the same code.
// Per 64-key tile (all four warps together: a tile is skipped only when no row of the CTA sees it):
//   S  = Q K^T     Dqk/16 x m64n64k16, A = Q fragments, B = the K tile (K-major)
//   dP = dO V^T    Dv/16  x m64n64k16, A = dO fragments, B = the V tile (K-major)
//   dQ += dS K     4 k16 steps of m64n{Dqk}k16 (Dqk = 192: n128 + n64), A = dS packed from the
//                  scores, B = the K tile (MN-major)
//   pass 1: O += P V   4 x m64n{Dv}k16, A = P, B = the V tile (MN-major)
// Q and dO stay in their padded shared tiles (the dg epilogue reads dO there) and the warps load
// their A fragments with ldmatrix right before each batch: no A operand is held in registers across
// the tile loop (the ptxas hazard of docs/cuda.md, "wgmma"), and every A operand is built in the
// iteration that uses it. K and V tiles are stored in the 128-byte swizzle layout (sw128_offset,
// 64-column blocks of 64 keys x 128 bytes, 1024-byte aligned); their rows past the tile's keys are
// zero-filled by the same copies, so the products there are 0 (and masked anyway).
// Descriptors as the forward's (docs/cuda.md): K-major SBO = 1024, k16 step +32 B within a 64-column
// block, +8 KB to the next block; MN-major SBO = 1024, LBO = 8 KB (next 64 columns), k16 step +2 KB.
// Each batch is wgmma_fence / issue / commit / wait<0> (cuda::wgmma_batch), accumulators fenced on both sides
// (wgmma_fence_operands); every thread fences its landed copies to the async proxy before the
// tile's barrier (fence_proxy_async). Deterministic: the same fixed order of products every run.
// S and dP go out as one batch where the registers allow (Dqk 64; Dqk 128 with Dv 128), else one
// batch each (Dqk 128 with Dv 64 spilled a register, Dqk 192 more). P uses ex2.approx (flushes
// below 2^-126), and a tile that every row of the warp sees whole skips the per-key mask.
// Shared memory: the host's DqSmem::kEnd (padded layout) also holds the swizzled one after the
// 1024-byte alignment (static_assert in DqSmem), so the launch is unchanged.
//
// ptxas (CUDA 13.0, sm_90a): 128x128 255 registers, 128x64 240, 192x128 / 192x64 255, 64x128 255, 64x64
// 185, no spills (the mma.sync body: 228 / 221 at 128); 2 CTAs per SM as before (registers and
// shared memory both allow 2). tools/check_wgmma_a_regs.py: clean.
// H200 (one run, bf16, Hq 64 / Hkv 4, D 128, paper settings, sm_90a build): dq_kernel at 64K
// 94.4 -> 65.8 ms (ncu); backward 64K 214.3 -> 193.6 ms (G = 4: 79.6 -> 73.9), saved o_branch
// 166.8 -> 155.1; fwd+bwd 271.3 -> 250.8. ncu at 64K: 2 warps per scheduler, 0.46 instructions
// issued per cycle, SM throughput 46%, L2 21%: bound by latency and instruction issue (the
// copies' address arithmetic, masks and exponentials between dependent wgmma batches), not by
// the tensor cores. Next steps: fewer instructions per tile (TMA for the K/V tiles, one
// descriptor-built copy), overlapping tile i + 1's S / dP with tile i's softmax work, and 128-row
// tiles (two warpgroups on one K/V tile: half the L2 reads per row).
#pragma once

#include "cuda/common/wgmma.h"

namespace nsa::cuda_bwd {

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

// copy_rows into a 128-byte-swizzled tile of kKeys rows (dst 1024-byte aligned); same contract.
// Where the CTA's threads divide into whole rows of 16-byte pieces 8 rows apart (D = 64, 128),
// each thread copies one fixed piece of rows r0, r0 + kStep, ...: those rows share one swizzle
// pattern, so the destination is one address plus a constant per row, and row_ptr runs once per
// row and piece (about 7 instructions a copy instead of 35).
// kT: the CTA's threads (default kThreads).
template <typename E, int D, int kT = kThreads, typename RowPtr>
__device__ __forceinline__ void copy_rows_sw128(E* dst, RowPtr row_ptr, bool vec, const E* any) {
  static_assert(D % 64 == 0, "swizzled tiles are made of 64-column blocks");
  unsigned char* bytes = reinterpret_cast<unsigned char*>(dst);
  constexpr int kChunks = D / 8;
  constexpr int kStep = kT / kChunks;
  if (vec) {
    if constexpr (kT % kChunks == 0 && kStep % 8 == 0 && kKeys % kStep == 0) {
      const int piece = threadIdx.x % kChunks, r0 = threadIdx.x / kChunks;
      unsigned char* d0 = bytes + cuda::sw128_offset(kKeys, r0, piece * 8);
#pragma unroll
      for (int k = 0; k < kKeys / kStep; ++k) {
        const E* src = row_ptr(r0 + k * kStep);
        cuda::cp_async_16(d0 + k * kStep * 128, src != nullptr ? src + piece * 8 : any, src != nullptr);
      }
    } else {
      for (int e = threadIdx.x; e < kKeys * kChunks; e += kT) {
        const int r = e / kChunks, c = (e % kChunks) * 8;
        const E* src = row_ptr(r);
        cuda::cp_async_16(bytes + cuda::sw128_offset(kKeys, r, c), src != nullptr ? src + c : any, src != nullptr);
      }
    }
  } else {
    for (int e = threadIdx.x; e < kKeys * D; e += kT) {
      const int r = e / D, c = e % D;
      const E* src = row_ptr(r);
      *reinterpret_cast<E*>(bytes + cuda::sw128_offset(kKeys, r, c & ~7) + (c & 7) * 2) =
          src != nullptr ? src[c] : from_float<E>(0.f);
    }
  }
}

// The A fragments (k16 steps of D) of this warp's 16 rows of a padded shared tile (rows from sA).
template <typename E, int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&f)[D / 16][4], const E* sA) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  const E* row = sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) cuda::ldmatrix_x4(f[kk], row + kk * 16);
}

// Issues acc (m64 x n64, scale_d 1) += A B^T over D: A = f (this iteration's fragments), B = the
// kKeys x D swizzled tile at shared address b (K-major). No fence, commit or wait.
template <typename E, int D>
__device__ __forceinline__ void wgmma_abt_issue(float (&acc)[kKeys / 8][4], const uint32_t (&f)[D / 16][4], uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = (kk >> 2) * sw_tile_bytes<64>() + (kk & 3) * 32;
    cuda::wgmma_rs<kKeys, kIsBf16<E>, 0>(acc, f[kk], cuda::wgmma_desc_sw128(b, off, 16, 1024), 1);
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

}  // namespace nsa::cuda_bwd
