// Spec §2 on the GPU: xc = phi(x) for every compressed block and KV head.
//
// Rows of the packed compressed layout (blocks.h) are numbered m = r * H + h for compressed row
// r and head h; each row finds its sequence by binary search over cu_seqlens, and rows that no
// sequence uses are skipped (left untouched, as the API says).
//   mean:   one thread per output element sums the block's l rows in fp32.
//   linear: xc = u W^T with u = flatten(block + pe): a tiled fp32 SIMT matrix product
//           [rows, l*D] x [l*D, D] that gathers u straight from x.
//   mlp:    hidden = gelu(u W1^T + b1) (fp32 workspace), then xc = hidden W2^T + b2.
// phi is a small part of the forward (the paper's defaults compress 1 of 16 positions); the
// matrix product is plain SIMT code, not tensor cores (docs/cuda.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/forward/topn.cuh"
#include "nsa/blocks.h"

namespace nsa::cuda {

namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi), GELU's tanh form
constexpr float kGeluA = 0.044715f;

// First packed token of compressed row r, or -1 when no sequence uses the row.
__device__ int64_t cmp_row_first_token(const SeqParams& s, int64_t r, int l, int d) {
  int64_t s0 = 0, len = s.total_tokens;
  if (s.cu_seqlens != nullptr) {  // last sequence b whose rows start at or before r
    int lo = 0, hi = s.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cmp_row_offset(s.cu_seqlens[mid], d) <= r) lo = mid;
      else hi = mid - 1;
    }
    s0 = s.cu_seqlens[lo];
    len = s.cu_seqlens[lo + 1] - s0;
  }
  const int64_t i = r - cmp_row_offset(s0, d);
  if (i < 0 || i >= num_cmp_blocks(len, l, d)) return -1;
  return s0 + i * d;
}

template <typename Storage>
__global__ void phi_mean_kernel(const PhiLaunch p) {
  const Storage* x = static_cast<const Storage*>(p.x);
  Storage* xc = static_cast<Storage*>(p.xc);
  const int64_t rows = cmp_rows(p.seqs.total_tokens, p.d);
  const int64_t total = rows * p.heads * p.dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(e % p.dim);
    const int64_t m = e / p.dim;
    const int h = static_cast<int>(m % p.heads);
    const int64_t r = m / p.heads;
    const int64_t first = cmp_row_first_token(p.seqs, r, p.l, p.d);
    if (first < 0) continue;
    float sum = 0.f;
    for (int k = 0; k < p.l; ++k) sum += to_float(x[(first + k) * p.x_st + h * p.x_sh + c]);
    xc[r * p.xc_st + h * p.xc_sh + c] = from_float<Storage>(sum / static_cast<float>(p.l));
  }
}

// C[M, N] = A[M, K] B[N, K]^T with M = rows * H. Tiles of 64 x 64, 256 threads, 4 x 4 each.
constexpr int kGemmTile = 64;
constexpr int kGemmK = 16;
constexpr int kGemmThreads = 256;

enum class PhiStage { linear, mlp_hidden, mlp_out };

template <typename Storage, PhiStage kStage>
__global__ void __launch_bounds__(kGemmThreads) phi_gemm_kernel(const PhiLaunch p) {
  __shared__ float sa[kGemmK][kGemmTile + 4];
  __shared__ float sb[kGemmK][kGemmTile + 4];
  __shared__ int64_t first_token[kGemmTile];
  const int D = p.dim;
  const int K = kStage == PhiStage::mlp_out ? p.hidden : p.l * D;
  const int N = kStage == PhiStage::mlp_hidden ? p.hidden : D;
  const int64_t M = cmp_rows(p.seqs.total_tokens, p.d) * p.heads;
  const int64_t m0 = int64_t(blockIdx.x) * kGemmTile;
  const int n0 = blockIdx.y * kGemmTile;
  const Storage* x = static_cast<const Storage*>(p.x);
  const Storage* pe = static_cast<const Storage*>(p.pe);
  const Storage* w = static_cast<const Storage*>(kStage == PhiStage::mlp_out ? p.w2 : p.w1);  // [N, K]
  for (int i = threadIdx.x; i < kGemmTile; i += kGemmThreads) {
    const int64_t m = m0 + i;
    first_token[i] = m < M ? cmp_row_first_token(p.seqs, m / p.heads, p.l, p.d) : -1;
  }
  __syncthreads();
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // 16 x 16 threads, 4 x 4 outputs each
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += kGemmK) {
    for (int e = threadIdx.x; e < kGemmTile * kGemmK; e += kGemmThreads) {
      const int i = e / kGemmK, kk = e % kGemmK;
      const int k = k0 + kk;
      float a = 0.f;
      if (k < K && first_token[i] >= 0) {
        const int64_t m = m0 + i;
        if constexpr (kStage == PhiStage::mlp_out) {
          a = p.hidden_buf[m * p.hidden + k];
        } else {
          const int h = static_cast<int>(m % p.heads);
          a = to_float(x[(first_token[i] + k / D) * p.x_st + h * p.x_sh + k % D]) + to_float(pe[k]);
        }
      }
      sa[kk][i] = a;
      const int n = n0 + i;
      sb[kk][i] = (k < K && n < N) ? to_float(w[int64_t(n) * K + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        av[u] = sa[kk][ty * 4 + u];
        bv[u] = sb[kk][tx * 4 + u];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[u][v] += av[u] * bv[v];
    }
    __syncthreads();
  }
  Storage* xc = static_cast<Storage*>(p.xc);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int i = ty * 4 + u;
    if (first_token[i] < 0) continue;
    const int64_t m = m0 + i;
    const int64_t r = m / p.heads;
    const int h = static_cast<int>(m % p.heads);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int n = n0 + tx * 4 + v;
      if (n >= N) continue;
      float y = acc[u][v];
      if constexpr (kStage == PhiStage::mlp_hidden) {
        y += to_float(static_cast<const Storage*>(p.b1)[n]);
        y = 0.5f * y * (1.f + tanhf(kGeluC * (y + kGeluA * y * y * y)));
        p.hidden_buf[m * p.hidden + n] = y;
      } else {
        if constexpr (kStage == PhiStage::mlp_out) y += to_float(static_cast<const Storage*>(p.b2)[n]);
        xc[r * p.xc_st + h * p.xc_sh + n] = from_float<Storage>(y);
      }
    }
  }
}

template <typename Storage, PhiStage kStage>
void launch_gemm(const PhiLaunch& p, int n_cols, cudaStream_t stream) {
  const int64_t M = cmp_rows(p.seqs.total_tokens, p.d) * p.heads;
  const dim3 grid(static_cast<unsigned>((M + kGemmTile - 1) / kGemmTile), static_cast<unsigned>((n_cols + kGemmTile - 1) / kGemmTile));
  phi_gemm_kernel<Storage, kStage><<<grid, kGemmThreads, 0, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <typename Storage>
void launch_phi_forward(const PhiLaunch& p, cudaStream_t stream) {
  const int64_t rows = cmp_rows(p.seqs.total_tokens, p.d);
  if (rows == 0) return;
  switch (p.kind) {
    case PhiKind::mean: {
      constexpr int kThreadsMean = 256;
      const int64_t total = rows * p.heads * p.dim;
      const int64_t blocks = (total + kThreadsMean - 1) / kThreadsMean;
      constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride beyond this
      phi_mean_kernel<Storage><<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreadsMean, 0, stream>>>(p);
      NSA_CUDA_CHECK_LAUNCH();
      return;
    }
    case PhiKind::linear:
      launch_gemm<Storage, PhiStage::linear>(p, p.dim, stream);
      return;
    case PhiKind::mlp:
      launch_gemm<Storage, PhiStage::mlp_hidden>(p, p.hidden, stream);
      launch_gemm<Storage, PhiStage::mlp_out>(p, p.dim, stream);
      return;
  }
}

template void launch_phi_forward<__nv_bfloat16>(const PhiLaunch&, cudaStream_t);
template void launch_phi_forward<__half>(const PhiLaunch&, cudaStream_t);

}  // namespace nsa::cuda
