// Hopper warpgroup matrix multiply (wgmma, sm_90a only) for the attention tiles: one warpgroup
// (4 warps, 128 threads) multiplies a 64-row A held in registers (wgmma_rs) or in shared memory
// (wgmma_ss: A through a K-major descriptor, the layout of a K-major B of 64 rows, or with kTransA
// an MN-major one, 16-bit types) by a B tile in shared memory.
//
// Register layouts (PTX ISA "Register Fragments and Shared Memory Matrix Layouts" of wgmma):
// warp w of the warpgroup owns rows 16w..16w+15, and within them
//   A (m64 x k16, registers): the mma.m16n8k16 A fragment (mma.h), 4 x 32-bit per thread;
//   D (m64 x N, fp32):        d[i][0..1] = (row g, cols 8i+2q..+1), d[i][2..3] = (row g+8, same),
//                             i.e. N/8 mma.m16n8 C fragments side by side (g = lane/4, q = lane%4).
// So the code that feeds mma.sync from registers feeds wgmma unchanged.
//
// B tiles live in shared memory in the 128-byte swizzle layout: a tile of R rows x 64 16-bit
// elements (128 bytes a row) is stored row after row, and the 16-byte piece c of row r sits at
// piece c ^ (r % 8) (sw128_offset). Wider tiles are several such 64-column blocks one after
// the other. A block must start on a 1024-byte boundary (the swizzle is applied to address bits
// 4-6 from bits 7-9).
//   K-major B (S = Q K^T, B = K^T, keys x head dim stored key by key): the descriptor of the k16
//     step kk points at block kk / 4 plus 32 * (kk % 4) bytes; SBO = 1024 (next 8 keys); LBO unused.
//   MN-major B (O += P V, B = V, keys x Dv stored key by key, transposed operand): the k16 step
//     kk starts 16 keys = 2048 bytes further; SBO = 1024 (next 8 keys), LBO = the byte distance
//     between neighbouring 64-column blocks (N = 128 spans two).
// Descriptor (64 bits): start address >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45,
// base offset 0 (blocks 1024-aligned) in 49-51, swizzle mode in 62-63 (1 = 128 bytes).
//
// Every wgmma of a batch is issued by all 128 threads, converged: wgmma_fence() before the first
// (registers written by ordinary instructions become visible to it), wgmma_commit() after the
// last, wgmma_wait<0>() before the results are read. Shared data written by cp.async (generic
// proxy) must be fenced with fence_proxy_async() by the writing thread before the barrier that
// publishes it to the async proxy that wgmma reads through.
#pragma once

#include <type_traits>

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/mma.h"

// The wgmma path is compiled only for sm_90a (the "a" features); every other target (sm_80,
// host) gets the mma.sync path and these wrappers trap if ever reached.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NSA_WGMMA_AVAILABLE 1
#else
#define NSA_WGMMA_AVAILABLE 0
#endif

namespace nsa::cuda {

inline constexpr bool kWgmmaCompiled = NSA_WGMMA_AVAILABLE;

// Whether a kernel with these attributes (cudaFuncGetAttributes) runs its wgmma body: the binary
// the driver loaded is for 9.0 (the only 9.x code this project builds is sm_90a) and was not
// compiled from older PTX. A build for 80 alone run on a Hopper GPU (the compute_80 PTX, JIT-compiled
// for 9.0, or sm_90 SASS made from compute_80 as scripts/gpu_check.sh's sm80_tests step builds it)
// also loads a 9.0 binary, but its body is the mma.sync one: ptxVersion 80 tells them apart. (A
// ptxVersion of 0, if a driver left it unset, keeps the binary version's answer.)
inline bool runs_wgmma_body(const cudaFuncAttributes& a) {
  return a.binaryVersion == 90 && !(a.ptxVersion > 0 && a.ptxVersion < 90);
}

__device__ __forceinline__ void wgmma_unavailable() {
#if defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Byte offset of element (row, col) in a 128-byte-swizzled tile of `rows` rows x (64 * blocks)
// columns of 16-bit elements; col must be a multiple of 8 (one 16-byte piece).
__host__ __device__ __forceinline__ uint32_t sw128_offset(int rows, int row, int col) {
  const int block = col >> 6, piece = (col >> 3) & 7;
  return static_cast<uint32_t>(block * rows * 128 + row * 128 + ((piece ^ (row & 7)) << 4));
}

// Threads that copy a 128-byte-swizzled tile of `rows` rows x `pieces` 16-byte pieces one fixed
// piece each (rows r0, r0 + step, ...: rows 8 apart share the swizzle pattern, so a thread's
// destinations are one address plus a constant per row): the CTA's `threads` where they divide the
// tile so, else its first 256 (three warpgroups at D = 64, 128), else 0 (no fixed-piece copy).
__host__ __device__ constexpr int sw128_copy_threads(int threads, int pieces, int rows) {
  auto fits = [pieces, rows](int t) { return t % pieces == 0 && (t / pieces) % 8 == 0 && rows % (t / pieces) == 0; };
  return fits(threads) ? threads : threads > 256 && fits(256) ? 256 : 0;
}

__host__ __device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = uint64_t((smem_addr & 0x3FFFFu) >> 4);
  d |= uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= uint64_t(1) << 62;  // 128-byte swizzle
  return d;
}

// The descriptor of shared address base + offset (offset a multiple of 16): base's descriptor with
// offset / 16 added to the start-address field in its low word. Every shared address is below 2^18,
// so the 14-bit field does not carry into LBO. An unrolled loop over constant offsets then builds
// the base descriptor once and adds a constant per product (about 3 instructions instead of 12).
__host__ __device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t base, uint32_t offset, uint32_t lbo_bytes,
                                                              uint32_t sbo_bytes) {
  const uint64_t d = wgmma_desc_sw128(base, lbo_bytes, sbo_bytes);
  return (d & ~uint64_t(0xFFFFFFFFu)) | uint32_t(uint32_t(d) + (offset >> 4));
}

// This thread's warpgroup (threadIdx.x / 128) as a value ptxas knows to be the same in every lane
// of the warp (a broadcast from lane 0): addresses and descriptors built from it then stay in
// uniform registers, where threadIdx.x / 128 puts them in per-thread ones and every descriptor
// of a product costs two R2UR moves.
__device__ __forceinline__ uint32_t warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

__device__ __forceinline__ void wgmma_fence() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Generic-proxy writes of this thread (cp.async included, once landed) become visible to the
// async proxy (wgmma operands) after the next barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving reads or writes of accumulator registers (float) across a wgmma
// wait or fence (the asm statements of those do not name the registers). On register A operands
// in flight (uint32_t), fenced after the wait that retires their product: they stay live, and
// unwritten, until then.
template <typename T, int kTiles>
__device__ __forceinline__ void wgmma_fence_operands(T (&d)[kTiles][4]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "accumulators or A operands");
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<T, float>)
        asm volatile("" : "+f"(d[i][j])::"memory");
      else
        asm volatile("" : "+r"(d[i][j])::"memory");
    }
}

// One synchronous batch of warpgroup MMAs: fences the accumulators `acc` and the warpgroup, runs
// `issue` (the wgmma instructions, in its order), commits the batch, runs `after()` while the
// products execute (the ping-pong's barrier arrive: the batch is issued, the other warpgroup may
// issue its own), waits for the batch and fences the accumulators again. Every thread of the
// warpgroup calls it.
template <typename Issue, typename After, typename... Acc>
__device__ __forceinline__ void wgmma_batch_then(Issue&& issue, After&& after, Acc&... acc) {
  (wgmma_fence_operands(acc), ...);
  wgmma_fence();
  issue();
  wgmma_commit();
  after();
  wgmma_wait<0>();
  (wgmma_fence_operands(acc), ...);
}
// The same with nothing between the commit and the wait.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};
template <typename Issue, typename... Acc>
__device__ __forceinline__ void wgmma_batch(Issue&& issue, Acc&... acc) {
  wgmma_batch_then(issue, NoHook{}, acc...);
}

// The warp's register budget (sm_90a, warp-specialised kernels): a producer warpgroup gives
// registers back (dec) so that the consumer warpgroups can take them (inc); every warp of a
// warpgroup executes the same one. kRegs: a multiple of 8 in [24, 256].
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if NSA_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Named CTA barriers (ids 1..15; __syncthreads is 0): `threads` counts both the arriving and the
// waiting threads (a multiple of 32). bar.arrive does not wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The inline PTX of one warpgroup MMA where wgmma is compiled; elsewhere a trap (never launched).
#if NSA_WGMMA_AVAILABLE
#define NSA_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define NSA_WGMMA_ASM(...) wgmma_unavailable()
#endif
// The "+f" operands of 4 fragments (16 accumulator registers) d[i .. i + 3] of an m64nN tile.
#define NSA_WGMMA_D(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define NSA_WGMMA_D4(i) NSA_WGMMA_D(i), NSA_WGMMA_D(i + 1), NSA_WGMMA_D(i + 2), NSA_WGMMA_D(i + 3)

// D (64 x kN, fp32) = A (64 x 16, registers) * B (16 x kN, descriptor) + (scale_d ? D : 0).
// kTransB = 0: B is K-major (rows of B^T contiguous); 1: B is MN-major.
template <int kN, bool kBf16>
struct WgmmaRs;

// One specialization per (N, type): TYPE is "bf16" or "f16"; DREGS the accumulator placeholders,
// AREGS those of A, the descriptor, the predicate and the transpose flag; then the "+f" operands.
#define NSA_WGMMA_RS(N, BF16, TYPE, PRED, DREGS, AREGS, ...)                                                    \
  template <>                                                                                                   \
  struct WgmmaRs<N, BF16> {                                                                                     \
    template <int kTransB>                                                                                      \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc,     \
                                               int scale_d) {                                                   \
      NSA_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" PRED ", 0;\n"                                          \
                    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DREGS ", " AREGS        \
                    : __VA_ARGS__                                                                               \
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(kTransB));      \
    }                                                                                                           \
  };
// Both types of one shape (the instruction differs only in its type).
#define NSA_WGMMA_RS_BOTH(N, PRED, DREGS, AREGS, ...)         \
  NSA_WGMMA_RS(N, true, "bf16", PRED, DREGS, AREGS, __VA_ARGS__) \
  NSA_WGMMA_RS(N, false, "f16", PRED, DREGS, AREGS, __VA_ARGS__)

NSA_WGMMA_RS_BOTH(64, "37", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n", NSA_WGMMA_D4(0),
                  NSA_WGMMA_D4(4))
NSA_WGMMA_RS_BOTH(128, "69", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n", NSA_WGMMA_D4(0),
                  NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D4(12))
NSA_WGMMA_RS_BOTH(192, "101", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}", "{%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n", NSA_WGMMA_D4(0),
                  NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D4(12), NSA_WGMMA_D4(16), NSA_WGMMA_D4(20))
#undef NSA_WGMMA_RS_BOTH
#undef NSA_WGMMA_RS

template <int kN, bool kBf16, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 8][4], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  WgmmaRs<kN, kBf16>::template run<kTransB>(d, a, desc, scale_d);
}

// D (64 x kN, fp32) = A (64 x 16, shared memory: descriptor desc_a, the same layout rules as a B of
// 64 rows) * B (16 x kN, descriptor desc_b) + (scale_d ? D : 0). kTransA = 0: A is K-major; 1:
// MN-major (16-bit types only, as kTransB).
template <int kN, bool kBf16>
struct WgmmaSs;

#define NSA_WGMMA_SS(N, BF16, TYPE, PRED, DREGS, BREGS, ...)                                                    \
  template <>                                                                                                   \
  struct WgmmaSs<N, BF16> {                                                                                     \
    template <int kTransB, int kTransA = 0>                                                                     \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b,          \
                                               int scale_d) {                                                   \
      NSA_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" PRED ", 0;\n"                                          \
                    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DREGS ", " BREGS        \
                    : __VA_ARGS__                                                                               \
                    : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA));                      \
    }                                                                                                           \
  };
NSA_WGMMA_SS(32, true, "bf16", "18", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", "%16, %17, p, 1, 1, %20, %19;\n}\n", NSA_WGMMA_D4(0))
NSA_WGMMA_SS(32, false, "f16", "18", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", "%16, %17, p, 1, 1, %20, %19;\n}\n", NSA_WGMMA_D4(0))
NSA_WGMMA_SS(64, true, "bf16", "34", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "%32, %33, p, 1, 1, %36, %35;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4))
NSA_WGMMA_SS(64, false, "f16", "34", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "%32, %33, p, 1, 1, %36, %35;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4))
NSA_WGMMA_SS(112, true, "bf16", "58", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}", "%56, %57, p, 1, 1, %60, %59;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D(12), NSA_WGMMA_D(13))
NSA_WGMMA_SS(112, false, "f16", "58", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}", "%56, %57, p, 1, 1, %60, %59;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D(12), NSA_WGMMA_D(13))
NSA_WGMMA_SS(128, true, "bf16", "66", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "%64, %65, p, 1, 1, %68, %67;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D4(12))
NSA_WGMMA_SS(128, false, "f16", "66", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "%64, %65, p, 1, 1, %68, %67;\n}\n", NSA_WGMMA_D4(0), NSA_WGMMA_D4(4), NSA_WGMMA_D4(8), NSA_WGMMA_D4(12))
#undef NSA_WGMMA_SS
#undef NSA_WGMMA_D4
#undef NSA_WGMMA_D
#undef NSA_WGMMA_ASM

template <int kN, bool kBf16, int kTransB, int kTransA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  WgmmaSs<kN, kBf16>::template run<kTransB, kTransA>(d, desc_a, desc_b, scale_d);
}

// acc (m64 x kN, scale_d 1) += A B^T over D columns, both operands 128-byte-swizzled tiles in
// shared memory, K-major: A = 64 rows at shared address a of a tile of kRowsA rows (its 64-column
// blocks kRowsA x 128 bytes apart), B = the kN x D tile at b. One m64nNk16 product per 16 columns:
// +32 bytes per k16 step inside a 64-column block. No fence, commit or wait (wgmma_batch).
// kOverwrite: acc = A B^T instead (the first product with scale_d 0: acc need not be zeroed
// first, which took kN / 2 register moves per thread and product, as CUTLASS's ScaleOut::Zero).
// kRowsB: the rows of B's tile (its 64-column blocks kRowsB x 128 bytes apart), kN of them from b
// (b on a 1024-byte boundary: rows from a multiple of 8 of a larger tile).
template <int kN, bool kBf16, int D, int kRowsA, bool kOverwrite = false, int kRowsB = kN>
__device__ __forceinline__ void wgmma_abt_ss_sw128(float (&acc)[kN / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t in_block = (kk & 3) * 32;
    wgmma_ss<kN, kBf16, 0>(acc, wgmma_desc_sw128(a, (kk >> 2) * (kRowsA * 128) + in_block, 16, 1024),
                           wgmma_desc_sw128(b, (kk >> 2) * (kRowsB * 128) + in_block, 16, 1024),
                           kOverwrite && kk == 0 ? 0 : 1);
  }
}

}  // namespace nsa::cuda
