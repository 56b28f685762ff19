// Tensor-core and async-copy wrappers (sm_80+: run unchanged on sm_90).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA "Matrix Fragments for mma.m16n8k16"), with
// group = lane / 4 and quad = lane % 4:
//   A 16x16 (row-major): a[0] = (row group,   cols 2*quad..+1), a[1] = (row group+8, same cols),
//                        a[2] = (row group,   cols 8+2*quad..+1), a[3] = (row group+8, same).
//   B 16x8  (k x n):     b[0] = (k 2*quad..+1, n group), b[1] = (k 8+2*quad..+1, n group).
//   C 16x8  (fp32):      c[0..1] = (row group, cols 2*quad..+1), c[2..3] = (row group+8, same).
// The C layout of two neighbouring n-tiles is the A layout of one k-tile: that is how softmax
// probabilities go from the QK^T accumulator straight into the PV product without shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace nsa::cuda {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D = A * B + C, 16x8x16, fp32 accumulation. kBf16 selects bf16 inputs, else fp16.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 16-bit matrices; lane i gives the row address of matrix i/8, row i%8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row_address)));
}

// The same, transposed: lane receives elements (rows 2*quad..+1, col group) of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row_address)));
}

// Both from a shared-memory address (addresses computed as 32-bit shared offsets, e.g. swizzled).
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
}
__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t (&r)[4], uint32_t row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
}

// 16-byte global -> shared copy that bypasses registers; zero-fills when !valid.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes));
}
// The same for a piece known to be in bounds (no source-size operand).
__device__ __forceinline__ void cp_async_16_full(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(smem)), "l"(gmem));
}
// 4-byte global -> shared copy (cp.async's smallest), cached in L1.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace nsa::cuda

// ---- mbarriers (sm_80+): completion of cp.async copies without CTA-wide barriers ----
namespace nsa::cuda {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

// Ends `bar`'s life as an mbarrier (before its memory is initialised again: a ring run once per
// tile of a persistent CTA). Every wait on it must have returned, and no copy may be pending.
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// Makes one arrival on `bar` when every cp.async this thread issued so far has landed (.noinc:
// the arrival counts towards the barrier's expected count, which must include it).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// This thread's arrival on `bar` (release: its earlier writes are visible to the threads that see
// the phase complete).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the phase of `bar` with the given parity has completed (acquire: the data the
// phase's copies wrote are visible afterwards).
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_address(bar);
  uint32_t done = 0;
  do {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#endif
  } while (!done);
}

}  // namespace nsa::cuda
