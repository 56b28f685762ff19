// phi on the GPU for the backward (spec §2's compression, recomputed, and its parameter
// gradients): deterministic SIMT GEMMs split over K with fixed-order reductions of their partials,
// and the kernels around them (bias, GELU, positional-encoding and mean-pooling gradients).
// Included by backward.cu (the backward and compress_bwd).
#pragma once

#include "cuda/backward/workspace.h"
#include "cuda/common/check.h"
#include "cuda/common/dtype.h"

namespace nsa::cuda::bwd {

constexpr int kGemmTile = 64;     // output tile of the SIMT GEMM (phi only)
constexpr int kGemmK = 16;        // depth of one shared-memory step
constexpr int kGemmThreads = 256; // 16 x 16 threads, 4 x 4 outputs each

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi), GELU's tanh form
constexpr float kGeluA = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.f + tanhf(kGeluC * (x + kGeluA * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float th = tanhf(kGeluC * (x + kGeluA * x * x * x));
  return 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * kGeluC * (1.f + 3.f * kGeluA * x * x);
}

// ---- generic deterministic GEMM: C[M x N] (+)= A[M x K] B[K x N], split over K by blockIdx.z --

template <class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(int M, int N, int K, int k_chunk, LoadA la,
                                                            LoadB lb, Store st) {
  __shared__ float sA[kGemmK][kGemmTile + 1];  // [k][m]
  __shared__ float sB[kGemmK][kGemmTile + 1];  // [k][n]
  const int m0 = blockIdx.y * kGemmTile, n0 = blockIdx.x * kGemmTile, z = blockIdx.z;
  const int k_begin = z * k_chunk, k_end = min(K, k_begin + k_chunk);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int k0 = k_begin; k0 < k_end; k0 += kGemmK) {
    for (int e = threadIdx.x; e < kGemmK * kGemmTile; e += kGemmThreads) {
      const int mm = e / kGemmK, kk = e % kGemmK;  // k fastest: A is usually row-major in k
      const int m = m0 + mm, k = k0 + kk;
      sA[kk][mm] = (m < M && k < k_end) ? la(m, k) : 0.f;
      const int kb = e / kGemmTile, nn = e % kGemmTile;  // n fastest for B
      const int n = n0 + nn, k2 = k0 + kb;
      sB[kb][nn] = (n < N && k2 < k_end) ? lb(k2, n) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sA[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = sB[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < M && n < N) st(m, n, z, acc[i][j]);
    }
}

template <class LoadA, class LoadB, class Store>
void gemm(cudaStream_t s, int M, int N, int K, int splits, LoadA la, LoadB lb, Store st) {
  if (M <= 0 || N <= 0) return;
  const int k_chunk = std::max(1, (K + splits - 1) / splits);
  const dim3 grid((N + kGemmTile - 1) / kGemmTile, (M + kGemmTile - 1) / kGemmTile, splits);
  gemm_kernel<<<grid, kGemmThreads, 0, s>>>(M, N, K, k_chunk, la, lb, st);
  NSA_CUDA_CHECK_LAUNCH();
}

// Operand loaders (device functors).
template <typename E>
struct BlockRows {  // A(m, k) = u_m[k] = x[block m's rows] + pe, m = crow * Hkv + hk
  const E* x;
  int64_t s0, s1;
  const E* pe;  // [l, D] (nullptr: none)
  int64_t pe_s0;
  const int32_t* crow_token;
  int hkv, D;
  __device__ float operator()(int m, int k) const {
    const int tok = crow_token[m / hkv];
    if (tok < 0) return 0.f;
    const int r = k / D, c = k % D;
    float v = cuda::to_float(x[(int64_t(tok) + r) * s0 + int64_t(m % hkv) * s1 + c]);
    if (pe != nullptr) v += cuda::to_float(pe[r * pe_s0 + c]);
    return v;
  }
};
template <typename E>
struct BlockRowsT {  // B(k, n) = u_k[n]: the transposed use (k = row)
  BlockRows<E> u;
  __device__ float operator()(int k, int n) const { return u(k, n); }
};
template <typename E>
struct MatT {  // B(k, n) = W[n, k]
  const E* w;
  int64_t s0;
  __device__ float operator()(int k, int n) const { return cuda::to_float(w[n * s0 + k]); }
};
template <typename E>
struct Mat {  // B(k, n) = W[k, n]
  const E* w;
  int64_t s0;
  __device__ float operator()(int k, int n) const { return cuda::to_float(w[k * s0 + n]); }
};
struct F32 {  // A(m, k) = a[m * ld + k]
  const float* a;
  int64_t ld;
  __device__ float operator()(int m, int k) const { return a[m * ld + k]; }
};
struct F32T {  // A(m, k) = a[k * ld + m]
  const float* a;
  int64_t ld;
  __device__ float operator()(int m, int k) const { return a[k * ld + m]; }
};
struct GeluOf {  // B(k, n) or A(m, k) = gelu(pre[i * ld + j])
  const float* pre;
  int64_t ld;
  __device__ float operator()(int i, int j) const { return gelu(pre[i * ld + j]); }
};

// Stores.
struct StorePre {  // pre[m, n] = v + b1[n]
  float* pre;
  int F;
  const void* b1;
  bool bf;
  __device__ void operator()(int m, int n, int, float v) const {
    const float b = bf ? cuda::to_float(static_cast<const __nv_bfloat16*>(b1)[n])
                       : cuda::to_float(static_cast<const __half*>(b1)[n]);
    pre[int64_t(m) * F + n] = v + b;
  }
};
template <typename E>
struct StoreCompressed {  // xc[m, n] = v (+ b2[n]), rounded to the storage dtype
  E* xc;
  int D;
  const E* b2;  // nullptr: none
  __device__ void operator()(int m, int n, int, float v) const {
    if (b2 != nullptr) v += cuda::to_float(b2[n]);
    xc[int64_t(m) * D + n] = cuda::from_float<E>(v);
  }
};
struct StorePartial {  // part[z][m, n] = v
  float* part;
  int N;
  int64_t plane;
  __device__ void operator()(int m, int n, int z, float v) const { part[z * plane + int64_t(m) * N + n] = v; }
};
struct StoreDpre {  // in place: pre[m, n] := v * gelu'(pre[m, n])
  float* pre;
  int F;
  __device__ void operator()(int m, int n, int, float v) const {
    float& p = pre[int64_t(m) * F + n];
    p = v * gelu_grad(p);
  }
};

// out[m, n] (storage dtype, row stride s0) = sum_z part[z][m, n], z ascending.
template <typename E>
__global__ void reduce_parts_kernel(const float* part, int splits, int M, int N, E* out, int64_t s0) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= int64_t(M) * N) return;
  float acc = 0.f;
  for (int z = 0; z < splits; ++z) acc += part[z * int64_t(M) * N + i];
  out[(i / N) * s0 + i % N] = cuda::from_float<E>(acc);
}

// Column sums in a fixed order: sum[n] = sum_m a[m * N + n]; optionally also stored as E.
template <typename E>
__global__ void column_sum_kernel(const float* a, int M, int N, float* sum, E* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float acc = 0.f;
  for (int m = 0; m < M; ++m) acc += a[int64_t(m) * N + n];
  sum[n] = acc;
  if (out != nullptr) out[n] = cuda::from_float<E>(acc);
}

// dpe[k] = sum_n W[n, k] s[n] (u = block + pe, so pe's gradient is W^T summed over blocks).
template <typename E>
__global__ void pe_grad_kernel(const E* w, int64_t w_s0, int N, int K, const float* s, E* dpe) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= K) return;
  float acc = 0.f;
  for (int n = 0; n < N; ++n) acc += cuda::to_float(w[n * w_s0 + k]) * s[n];
  dpe[k] = cuda::from_float<E>(acc);  // pe [l, D] is written row-major contiguous (checked on host)
}

// xc = mean of the block's rows.
template <typename E>
__global__ void phi_mean_kernel(const E* x, int64_t s0, int64_t s1, const int32_t* crow_token,
                                int64_t rc, int hkv, int D, int l, E* xc) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rc * hkv * D) return;
  const int c = int(i % D);
  const int64_t m = i / D;
  const int tok = crow_token[m / hkv];
  float acc = 0.f;
  if (tok >= 0)
    for (int r = 0; r < l; ++r) acc += cuda::to_float(x[(int64_t(tok) + r) * s0 + (m % hkv) * s1 + c]);
  xc[i] = cuda::from_float<E>(acc / float(l));
}

// ---- phi on the GPU ----------------------------------------------------------------------

template <typename E>
void phi_forward(const Plan& p, cudaStream_t s, const PhiParams& phi, const TensorView& x, int D,
                 const Layout& L, void* xc, float* pre) {
  const int64_t rows = cmp_rows(p.T, p.cfg.cmp_stride) * p.hkv;
  const int l = int(p.cfg.cmp_block_len);
  const E* xb = static_cast<const E*>(x.data);
  if (p.cfg.phi == PhiKind::mean) {
    phi_mean_kernel<E><<<blocks_for(rows * D), 256, 0, s>>>(xb, x.stride[0], x.stride[1], L.crow_token,
                                                           cmp_rows(p.T, p.cfg.cmp_stride), int(p.hkv), D, l,
                                                           static_cast<E*>(xc));
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const BlockRows<E> u{xb, x.stride[0], x.stride[1], static_cast<const E*>(phi.pe.data), phi.pe.stride[0],
                       L.crow_token, int(p.hkv), D};
  const int K = l * D;
  if (p.cfg.phi == PhiKind::linear) {
    gemm(s, int(rows), D, K, 1, u, MatT<E>{static_cast<const E*>(phi.w1.data), phi.w1.stride[0]},
         StoreCompressed<E>{static_cast<E*>(xc), D, nullptr});
    return;
  }
  const int F = int(phi.w1.shape[0]);
  gemm(s, int(rows), F, K, 1, u, MatT<E>{static_cast<const E*>(phi.w1.data), phi.w1.stride[0]},
       StorePre{pre, F, phi.b1.data, p.dtype == DType::bf16});
  gemm(s, int(rows), D, F, 1, GeluOf{pre, F}, MatT<E>{static_cast<const E*>(phi.w2.data), phi.w2.stride[0]},
       StoreCompressed<E>{static_cast<E*>(xc), D, static_cast<const E*>(phi.b2.data)});
}

// Parameter gradients of phi from dy = dLoss/dxc [rows, D] (fp32); leaves dpre in `pre` (mlp).
template <typename E>
void phi_backward_params(const Plan& p, cudaStream_t s, const PhiParams& phi, const TensorView& x, int D,
                         const Layout& L, const float* dy, float* pre, const PhiParams& dphi) {
  if (p.cfg.phi == PhiKind::mean) return;
  const int rows = int(cmp_rows(p.T, p.cfg.cmp_stride) * p.hkv);
  const int l = int(p.cfg.cmp_block_len), K = l * D;
  const int splits = L.row_splits;
  const BlockRowsT<E> u{BlockRows<E>{static_cast<const E*>(x.data), x.stride[0], x.stride[1],
                                     static_cast<const E*>(phi.pe.data), phi.pe.stride[0], L.crow_token,
                                     int(p.hkv), D}};
  auto reduce_to = [&](int M, int N, const TensorView& out) {
    reduce_parts_kernel<E><<<blocks_for(int64_t(M) * N), 256, 0, s>>>(L.gemm_part, splits, M, N,
                                                                     static_cast<E*>(out.data), out.stride[0]);
    NSA_CUDA_CHECK_LAUNCH();
  };
  if (p.cfg.phi == PhiKind::linear) {
    // dW [D, l*D] = dy^T u;  dpe = W^T (sum over rows of dy).
    gemm(s, D, K, rows, splits, F32T{dy, D}, u, StorePartial{L.gemm_part, K, int64_t(D) * K});
    reduce_to(D, K, dphi.w1);
    column_sum_kernel<E><<<blocks_for(D), 256, 0, s>>>(dy, rows, D, L.colsum, nullptr);
    NSA_CUDA_CHECK_LAUNCH();
    pe_grad_kernel<E><<<blocks_for(K), 256, 0, s>>>(static_cast<const E*>(phi.w1.data), phi.w1.stride[0], D, K,
                                                    L.colsum, static_cast<E*>(dphi.pe.data));
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const int F = int(phi.w1.shape[0]);
  // db2 = column sums of dy; dW2 [D, F] = dy^T gelu(pre).
  column_sum_kernel<E><<<blocks_for(D), 256, 0, s>>>(dy, rows, D, L.colsum, static_cast<E*>(dphi.b2.data));
  NSA_CUDA_CHECK_LAUNCH();
  gemm(s, D, F, rows, splits, F32T{dy, D}, GeluOf{pre, F}, StorePartial{L.gemm_part, F, int64_t(D) * F});
  reduce_to(D, F, dphi.w2);
  // dpre = (dy W2) * gelu'(pre), in place.
  gemm(s, rows, F, D, 1, F32{dy, D}, Mat<E>{static_cast<const E*>(phi.w2.data), phi.w2.stride[0]},
       StoreDpre{pre, F});
  // db1 = column sums of dpre; dW1 [F, l*D] = dpre^T u; dpe = W1^T db1.
  column_sum_kernel<E><<<blocks_for(F), 256, 0, s>>>(pre, rows, F, L.colsum, static_cast<E*>(dphi.b1.data));
  NSA_CUDA_CHECK_LAUNCH();
  gemm(s, F, K, rows, splits, F32T{pre, F}, u, StorePartial{L.gemm_part, K, int64_t(F) * K});
  reduce_to(F, K, dphi.w1);
  pe_grad_kernel<E><<<blocks_for(K), 256, 0, s>>>(static_cast<const E*>(phi.w1.data), phi.w1.stride[0], F, K,
                                                  L.colsum, static_cast<E*>(dphi.pe.data));
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::bwd
