// phi's products on cuBLASLt (the CUDA toolkit's own GEMM library): bf16 or fp32 operands, fp32
// accumulation and fp32 output, on the caller's stream and workspace. phi.cu lays its operands out
// for them (blocks as rows of d-token chunks) and does the work around them.
//
// Row-major throughout: C [M, N] (rows of ldc floats) = A B + beta C, A [M, K] and B [K, N] as
// stored: a_km = A stored as its transpose, rows of K (ld lda, [K, M]); b_nk = B stored as its
// transpose ([N, K]). cuBLASLt's answer for one shape, pointer alignment and workspace is looked
// up once per device (its heuristic) and kept, up to kMaxPlans shapes (a run whose lengths keep
// changing makes a new shape at every length: past that the cache starts over, and the heuristic
// gives the same answer again); with a caller-owned workspace and one algorithm per shape its
// results are the same bits on every run (cuBLAS's reproducibility rule: the same architecture and
// SM count).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace nsa::cuda::phi::blas {

// The workspace handed to every product (bytes, a multiple of 256).
inline constexpr size_t kWorkspaceBytes = size_t(32) << 20;
// The most plans (descriptors and algorithm of one shape) kept at once, all devices together.
inline constexpr size_t kMaxPlans = 256;

struct Product {
  int64_t M = 0, N = 0, K = 0;
  bool f32 = false;  // a and b fp32 (a plain fp32 product, no TF32), else bf16
  const void* a = nullptr;
  int64_t lda = 0;
  bool a_km = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool b_nk = false;
  float* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.f;  // 0: C is written, not read
};

// One operand of a product: its data, the leading dimension of its rows, and whether it is stored
// as its transpose (A as [K, M]: a_km; B as [N, K]: b_nk).
struct Operand {
  const void* p;
  int64_t ld;
  bool transposed = false;
};

// C [M, N] (rows of ldc) = A B + beta C, A and B in bf16 (product) or fp32 (product_f32).
inline Product product(int64_t M, int64_t N, int64_t K, Operand a, Operand b, float* c, int64_t ldc,
                       float beta = 0.f) {
  Product p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.a = a.p;
  p.lda = a.ld;
  p.a_km = a.transposed;
  p.b = b.p;
  p.ldb = b.ld;
  p.b_nk = b.transposed;
  p.c = c;
  p.ldc = ldc;
  p.beta = beta;
  return p;
}
inline Product product_f32(int64_t M, int64_t N, int64_t K, Operand a, Operand b, float* c, int64_t ldc) {
  Product p = product(M, N, K, a, b, c, ldc);
  p.f32 = true;
  return p;
}

// Runs p on stream s with workspace ws (kWorkspaceBytes, 256-byte aligned). Throws nsa::Error
// naming the cuBLASLt call and its status when cuBLASLt refuses or fails.
void matmul(const Product& p, void* ws, cudaStream_t s);

// The plans kept now (<= kMaxPlans).
size_t cached_plans();

}  // namespace nsa::cuda::phi::blas
