// The Tensor Memory Accelerator (sm_90): tiled tensor maps on the host, bulk tensor copies into
// shared memory that complete on an mbarrier on the device.
//
// Host: make_tensor_map_3d encodes a [rows][heads][cols] tensor of 16-bit elements (the layout
// of the compressed keys, [Rc, Hkv, D]) with boxes of box_rows x 1 x 64 columns in the 128-byte
// swizzle, which is the layout sw128_offset (common/wgmma.h) describes: a box lands as one
// 64-column block of box_rows rows x 128 bytes, piece c of row r at piece c ^ (r % 8), from a
// 1024-byte aligned address. Elements past the tensor's bounds arrive as zeros. The encoder is the
// driver's cuTensorMapEncodeTiled, reached through the runtime (no link against libcuda).
//
// Device: one thread announces the bytes (mbarrier_expect_tx) and issues the copies
// (tma_load_3d); every thread then waits on the mbarrier's phase (mbarrier_wait_parity, mma.h),
// after which the data are visible to the async proxy (wgmma) and to ordinary loads.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/mma.h"

namespace nsa::cuda {

// False where the driver has no encoder or rejects the layout (the caller then copies without TMA).
inline bool make_tensor_map_3d(CUtensorMap* map, bool bf16, const void* base, uint64_t cols, uint64_t heads,
                               uint64_t rows, uint64_t head_stride_bytes, uint64_t row_stride_bytes,
                               uint32_t box_rows, uint32_t box_heads = 1) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr || rows == 0 || heads == 0) return false;
  const cuuint64_t dims[3] = {cols, heads, rows};
  const cuuint64_t strides[2] = {head_stride_bytes, row_stride_bytes};  // dims 1 and 2
  const cuuint32_t box[3] = {64, box_heads, box_rows};
  const cuuint32_t unit[3] = {1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// make_tensor_map_3d for a [rows, heads, cols] view of 16-bit elements with strides in elements
// (row_stride, head_stride), boxes of box_rows rows x 64 columns: the form every kernel's K/V map
// takes. A dimension of extent 1 gets a valid stride whatever the view says. With box_heads > 1 a
// box is box_rows rows x box_heads heads x 64 columns and lands as box_rows * box_heads rows of
// 128 bytes, row-major in (row, head): a query tile of box_rows tokens x the G heads of a group.
inline bool make_rows_tensor_map(CUtensorMap* map, bool bf16, const void* base, uint64_t cols, uint64_t heads,
                                 uint64_t rows, int64_t row_stride, int64_t head_stride, uint32_t box_rows,
                                 uint32_t box_heads = 1) {
  const uint64_t head_bytes = (heads > 1 ? uint64_t(head_stride) : cols) * 2;
  const uint64_t row_bytes = rows > 1 ? uint64_t(row_stride) * 2 : head_bytes * heads;
  return make_tensor_map_3d(map, bf16, base, cols, heads, rows, head_bytes, row_bytes, box_rows, box_heads);
}

// Zeroes rows [r0, kTileRows) of `blocks` consecutive 64-column blocks of kTileRows rows x 128
// bytes in the 128-byte swizzle (a row's bytes stay in its row), with kThreads threads: the rows a
// TMA box brings past a tile's keys (later rows, other sequences', possibly NaN, which would
// survive a zero probability). The caller then fences them for wgmma (fence_proxy_async) and
// publishes them to the CTA.
template <int kTileRows, int kThreads>
__device__ __forceinline__ void zero_sw128_rows(void* tile, int blocks, int r0) {
  const int pieces = (kTileRows - r0) * 8;  // 16-byte pieces per 64-column block
  for (int e = threadIdx.x; e < pieces * blocks; e += kThreads) {
    const int b = e / pieces, r = r0 + e % pieces / 8, piece = e % 8;
    *reinterpret_cast<uint4*>(static_cast<unsigned char*>(tile) + b * (kTileRows * 128) + r * 128 + piece * 16) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

// Makes the mbarriers this thread initialised visible to the async proxy (the TMA unit).
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}

// mbarrier_expect_tx and tma_load_3d by the threads where `issue` holds, as predicated instructions
// with no branch around them: for code that runs while a wgmma is in flight in the same warpgroup,
// where a divergent branch makes ptxas serialise the wgmmas (C7518).
__device__ __forceinline__ void mbarrier_expect_tx_if(bool issue, uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %2, 0;\n @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n}\n" ::"r"(
          smem_address(bar)),
      "r"(bytes), "r"(static_cast<uint32_t>(issue))
      : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void tma_load_3d_if(bool issue, void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %6, 0;\n"
      " @p cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n}\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(bar)),
      "r"(static_cast<uint32_t>(issue))
      : "memory");
#else
  __trap();
#endif
}

// This thread's arrival on `bar`, which then also waits for `bytes` of copies to complete on it.
// (ptxas folds the constant predicate: the same SASS as the bare instruction, checked with
// cuobjdump on the forward and backward instantiations.)
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbarrier_expect_tx_if(true, bar, bytes);
}

// Copies the box at coordinates (c0 = column, c1 = head, c2 = row) of `map` (a __grid_constant__
// kernel parameter) to dst; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  tma_load_3d_if(true, dst, map, c0, c1, c2, bar);
}

// mbarrier_wait_parity with its spin loop inside one asm block (sm_90): for code that runs while
// a wgmma is in flight, where the C++ loop is a divergent path to ptxas (C7518).
__device__ __forceinline__ void mbarrier_wait_parity_asm(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n wait_parity:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra wait_parity;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

}  // namespace nsa::cuda
