// The CUDA backward pass (spec §8): orchestration, the inverted selection index, and phi.
// docs/cuda_backward.md describes the design; attention.cuh holds the attention kernels.
//
// Order of work on the stream:
//   1. sequence table on the device; compressed keys/values recomputed through phi (fp32
//      accumulation, rounded to the storage dtype like the forward's), phi's hidden layer kept;
//   2. the inverted index of the selection (stable radix sort of (KV head, block) -> token);
//   3. dq_kernel: per-branch outputs recomputed from lse -> dg; dq of all branches at once;
//   4. dkv_kernel<cmp>: dkc/dvc partials per query split, reduced in a fixed order;
//   5. phi backward: parameter gradients (split-K GEMMs, fixed-order reductions), dpre;
//   6. dkv_kernel<raw>: window + selection dk/dv (shared_kv: plus phi's gradient, one rounding);
//      independent K/V: phi's gradient to k_cmp/v_cmp by its own kernel.
// Nothing uses floating-point atomics: same inputs, same bits.
#include "cuda/backward/backward.h"

#include <cub/cub.cuh>

#include <algorithm>
#include <vector>

#include "cuda/backward/attention.cuh"
#include "cuda/common/check.h"
#include "cuda/common/launch.h"
#include "cuda/testing.h"
#include "nsa/error.h"

namespace nsa::cuda_bwd {

// ---- the attention kernels: run-time dtype/head dims -> templates -------------------------
// (compiled in attention_<dtype>_hdim<Dqk>.cu)
#define NSA_BWD_EXTERN(E, DQK)                                                       \
  extern template void launch_attention<E, DQK, 64>(const BwdArgs&, cudaStream_t, int); \
  extern template void launch_attention<E, DQK, 128>(const BwdArgs&, cudaStream_t, int);
NSA_BWD_EXTERN(__nv_bfloat16, 64)
NSA_BWD_EXTERN(__nv_bfloat16, 128)
NSA_BWD_EXTERN(__nv_bfloat16, 192)
NSA_BWD_EXTERN(__half, 64)
NSA_BWD_EXTERN(__half, 128)
NSA_BWD_EXTERN(__half, 192)
#undef NSA_BWD_EXTERN

namespace {

using detail::Plan;
using cuda::WorkspaceCarver;

constexpr int kGemmTile = 64;     // output tile of the SIMT GEMM (phi only)
constexpr int kGemmK = 16;        // depth of one shared-memory step
constexpr int kGemmThreads = 256; // 16 x 16 threads, 4 x 4 outputs each
constexpr int kRowsPerSplit = 512;  // rows per partial sum of a reduction over compressed rows
constexpr int kMaxSplits = 8;
constexpr int64_t kMaxPartialBytes = int64_t(32) << 20;  // keeps mlp's dW1 partials at 32 MB
constexpr int64_t kMaxRawPool = 256;       // slots for the pieces of the raw blocks' long lists

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

// The sequence of packed token tok: the last b with cu[b] <= tok (< cu[b + 1]).
__device__ __forceinline__ int seq_of_token(const BwdArgs& a, int64_t tok) {
  int lo = 0, hi = a.B - 1, b = 0;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (a.cu[mid] <= tok) { b = mid; lo = mid + 1; } else { hi = mid - 1; }
  }
  return b;
}

// crow_token[crow] = packed first token of compressed row crow, or -1 when no block uses it.
__global__ void crow_token_kernel(const int32_t* cu, int B, int64_t rc, int l, int d, int32_t* crow_token) {
  const int64_t crow = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (crow >= rc) return;
  // The last sequence whose first compressed row is <= crow (rows of sequences never overlap).
  int lo = 0, hi = B - 1, b = -1;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] / d <= crow) { b = mid; lo = mid + 1; } else { hi = mid - 1; }
  }
  int32_t tok = -1;
  if (b >= 0) {
    const int64_t i = crow - cu[b] / d;
    if (i < num_cmp_blocks(cu[b + 1] - cu[b], l, d)) tok = int32_t(cu[b] + i * d);
  }
  crow_token[crow] = tok;
}

// Pair i (< T * Hkv * n, in token order) of the selection: its token, and its key
// (hk * B + b) * n_slc_max + j, or `sentinel` for a padding or not admissible entry.
__device__ __forceinline__ uint32_t selection_pair(const BwdArgs& a, int64_t i, uint32_t sentinel, int64_t& tok) {
  const int k = int(i % a.n);
  const int hk = int((i / a.n) % a.hkv);
  tok = i / (int64_t(a.n) * a.hkv);
  const int b = seq_of_token(a, tok);
  const int t = int(tok - a.cu[b]);
  const int j = static_cast<const int32_t*>(a.indices.p)[tok * a.indices.s0 + hk * a.indices.s1 + k];
  const bool valid = j >= 0 && int64_t(j) * a.lp <= t;
  return valid ? uint32_t((int64_t(hk) * a.B + b) * a.n_slc_max + j) : sentinel;
}

// The pairs as (key, token) arrays for the pair sort.
__global__ void selection_pairs_kernel(BwdArgs a, uint32_t sentinel, uint32_t* keys, int32_t* tokens) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.T * a.hkv * a.n) return;
  int64_t tok;
  keys[i] = selection_pair(a, i, sentinel, tok);
  tokens[i] = int32_t(tok);
}

// The same pairs packed into one 32-bit key, key << shift | token (shift = the token bits): sorting
// them sorts by key and, within a key, by token, which is the stable pair sort's order.
__global__ void selection_packed_kernel(BwdArgs a, uint32_t sentinel, int shift, uint32_t* packed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.T * a.hkv * a.n) return;
  int64_t tok;
  const uint32_t key = selection_pair(a, i, sentinel, tok);
  packed[i] = key << shift | uint32_t(tok);
}

// offsets[key] = first position of key in the sorted keys (lower bound; a sorted key's key is its
// bits from `shift` up), key in [0, nkeys].
__global__ void segment_offsets_kernel(const uint32_t* keys, int shift, int64_t n, int64_t nkeys, int32_t* offsets) {
  const int64_t key = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (key > nkeys) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if ((keys[mid] >> shift) < uint32_t(key)) lo = mid + 1; else hi = mid;
  }
  offsets[key] = int32_t(lo);
}

// The tokens of sorted packed keys (in place when src == dst: each thread reads its element first).
__global__ void unpack_tokens_kernel(const uint32_t* src, int64_t n, uint32_t mask, int32_t* dst) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = int32_t(src[i] & mask);
}

// cu [B+1] int32 from host values passed by value (up to kInlineCu entries: 256 bytes of
// kernel arguments), so that no host buffer has to outlive an asynchronous copy.
constexpr int kInlineCu = 64;
struct InlineCu {
  int32_t v[kInlineCu];
};
__global__ void set_cu_kernel(InlineCu c, int n, int32_t* dst) {
  const int i = threadIdx.x;
  if (i < n) dst[i] = c.v[i];
}

// cu [B+1] int32 from a device tensor with any stride.
__global__ void copy_cu_kernel(const int32_t* src, int64_t stride, int n, int32_t* dst) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i * stride];
}

// dg_b = <dO, o_b> for every (token, head, branch) from the forward's saved o_branch
// [3, T, Hq, Dv]: one warp per (token, head), the lanes' partial sums added by a fixed butterfly.
template <typename E>
__global__ void dg_from_branches_kernel(Mat3 d_o, const E* ob, int64_t ob_sb, int64_t ob_st, int64_t ob_sh,
                                        int64_t rows, int hq, int dv, float* dg32, OutMat3 dg) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t t = r / hq;
  const int h = int(r % hq);
  const E* dorow = static_cast<const E*>(d_o.p) + t * d_o.s0 + h * d_o.s1;
  for (int b = 0; b < 3; ++b) {
    const E* orow = ob + b * ob_sb + t * ob_st + h * ob_sh;
    float part = 0.f;
    for (int c = lane; c < dv; c += 32) part += to_float(dorow[c]) * to_float(orow[c]);
    for (int off = 16; off > 0; off /= 2) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) {
      dg32[r * 3 + b] = part;
      static_cast<E*>(dg.p)[t * dg.s0 + h * dg.s1 + b] = from_float<E>(part);
    }
  }
}

// The compressed dk (or dv) of element e of [Rc, Hkv, D]: the partials of the splits before the
// last that see its block, in split order, then the last split's value already in out[e]
// (cmp_split_of). Rows of no block (between sequences, or past the last block) stay as they are.
__global__ void reduce_cmp_parts_kernel(BwdArgs a, const float* part, const int32_t* crow_token, int D,
                                        float* out) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t per_row = int64_t(a.hkv) * D;
  if (e >= a.rc * per_row) return;
  const int64_t crow = e / per_row;
  const int32_t tok = crow_token[crow];
  if (tok < 0) return;
  const int b = seq_of_token(a, tok);
  const int64_t len = a.cu[b + 1] - a.cu[b];
  const int64_t i = crow - cmp_row_offset(a.cu[b], a.d);  // the block's index in its sequence
  const CmpSplit cs = cmp_split_of(len, a.cmp_splits);
  float acc = 0.f;
  int64_t rows_before = 0;
  for (int z = 0; z < cs.last; ++z) {
    if (i < cmp_split_rows(len, z, cs, a.l, a.d)) acc += part[rows_before * per_row + e];
    rows_before += a.cmp_part_rows[z];
  }
  out[e] = acc + out[e];
}

// Independent K/V: dk_cmp/dv_cmp = phi's gradient alone.
template <typename E>
__global__ void phi_dx_kernel(BwdArgs a, PhiDxArgs P, int D, OutMat3 out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.T * a.hkv * D) return;
  const int c = int(i % D);
  const int hk = int((i / D) % a.hkv);
  const int64_t tok = i / (int64_t(D) * a.hkv);
  const int b = seq_of_token(a, tok);
  const int64_t s0 = a.cu[b];
  const float v = phi_dx<E>(P, a, D, s0, int(a.cu[b + 1] - s0), int(tok - s0), hk, c);
  static_cast<E*>(out.p)[tok * out.s0 + hk * out.s1 + c] = cuda::from_float<E>(v);
}

inline unsigned blocks_for(int64_t n, int threads = 256) { return unsigned((n + threads - 1) / threads); }

// ---- workspace layout (one description for workspace_size and backward) ----------------------

struct Layout {
  int32_t* cu = nullptr;
  int32_t* crow_token = nullptr;
  void* kc = nullptr;
  void* vc = nullptr;
  float* pre_k = nullptr;  // [Rc*Hkv, F] (mlp): hidden pre-activation, then dpre in place
  float* pre_v = nullptr;
  float* dkc = nullptr;    // [Rc*Hkv, Dqk]
  float* dvc = nullptr;
  float* dkc_part = nullptr;  // the splits' partials (cmp_part_rows[z] rows each) [.., Hkv, Dqk]
  float* dvc_part = nullptr;
  int64_t cmp_part_rows[kMaxCmpSplits] = {};
  bool packed_sort = false;   // the index sort on 32-bit (key, token) keys (sort_bits of them)
  int key_shift = 0;          // bits of the token in a packed key
  int sort_bits = 0;
  float* dg32 = nullptr;      // [T, Hq, 3]
  uint32_t* keys[2] = {};     // radix-sort double buffers [T*Hkv*n] (packed: keys[1] only)
  int32_t* tokens[2] = {};
  int32_t* offsets = nullptr; // [Hkv*B*n_slc_max + 1]
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  float* gemm_part = nullptr; // [splits][max phi parameter size]
  float* colsum = nullptr;    // [max(F, D)]
  RawPieces raw;                // the raw lists' pieces' slots (pool, part_k / part_v, split, slot, arrived)
  int cmp_splits = 1;
  int row_splits = 1;
  size_t bytes = 0;
};

struct Sizes {
  int64_t T, B, max_seqlen, hq, hkv, dqk, dv, F, l, d, lp, n;
  bool has_params;  // phi = linear or mlp
};

// Split-K partials of phi's parameter gradients (linear / mlp), capped in bytes.
void carve_phi_partials(const Sizes& z, int64_t rows, WorkspaceCarver& c, Layout& L) {
  const int64_t D = std::max(z.dqk, z.dv);
  const int64_t param = std::max({z.F * z.l * D, D * z.F, D * z.l * D});
  const int64_t by_rows = (rows + kRowsPerSplit - 1) / kRowsPerSplit;
  const int64_t by_bytes = kMaxPartialBytes / (param * int64_t(sizeof(float)));
  L.row_splits = int(std::clamp<int64_t>(std::min(by_rows, by_bytes), 1, kMaxSplits));
  L.gemm_part = c.take<float>(size_t(L.row_splits * param));
}

Layout carve(const Sizes& z, void* base, cudaStream_t stream) {
  WorkspaceCarver w(base);
  Layout L;
  const int64_t rc = cmp_rows(z.T, z.d);
  const int64_t rows = rc * z.hkv;
  const int64_t n_slc_max = num_slc_blocks(z.max_seqlen, z.lp);
  L.cu = w.take<int32_t>(size_t(z.B + 1));
  L.crow_token = w.take<int32_t>(size_t(std::max<int64_t>(rc, 1)));
  L.kc = w.take<uint16_t>(size_t(rows * z.dqk));
  L.vc = w.take<uint16_t>(size_t(rows * z.dv));
  if (z.F > 0) {
    L.pre_k = w.take<float>(size_t(rows * z.F));
    L.pre_v = w.take<float>(size_t(rows * z.F));
  }
  L.dkc = w.take<float>(size_t(rows * z.dqk));
  L.dvc = w.take<float>(size_t(rows * z.dv));
  const int test_splits = std::min(cuda::testing::cmp_splits(), kMaxCmpSplits);  // GPU tests only (0: off)
  L.cmp_splits = test_splits > 0 ? test_splits : cmp_splits_for(z.max_seqlen, z.hq / z.hkv, z.B);
  // Rows of each split's partial: with one sequence the blocks its queries see; with several (whose
  // lengths the host does not know) every row, indexed as dkc.
  int64_t part_rows = 0;
  for (int zz = 0; zz + 1 < L.cmp_splits; ++zz) {
    if (z.B == 1) {
      const CmpSplit cs = cmp_split_of(z.T, L.cmp_splits);
      L.cmp_part_rows[zz] = zz < cs.last ? cmp_split_rows(z.T, zz, cs, z.l, z.d) : 0;
    } else {
      L.cmp_part_rows[zz] = rc;
    }
    part_rows += L.cmp_part_rows[zz];
  }
  L.dg32 = w.take<float>(size_t(z.T * z.hq * 3));
  const int64_t pairs = z.T * z.hkv * z.n;
  if (pairs > 0) L.tokens[0] = w.take<int32_t>(size_t(pairs));  // the inverted index's token lists
  L.offsets = w.take<int32_t>(size_t(z.hkv * z.B * n_slc_max + 1));
  const int64_t D = std::max(z.dqk, z.dv);
  L.colsum = w.take<float>(size_t(std::max<int64_t>(z.F, D)));

  // One scratch region for the pieces of phases that never overlap on the stream; each phase
  // carves its own from the region's start (run_backward's step numbers):
  //   2. the index sort: both key buffers, the tokens' second buffer and CUB's scratch (the
  //      sorted tokens end in tokens[0], copied there when the sort leaves them in tokens[1]);
  //   4. the compressed branch's per-split partials (reduced into dkc / dvc);
  //   5. phi's split-K parameter partials;
  //   6. the raw lists' pieces (the forced initial blocks' lists among them; read by
  //      dkv_kernel<raw>), in a budget of max(the other phases' bytes, 1/32 of q, k, v and o).
  auto carve_scratch = [&](unsigned char* region) {
    size_t most = 0;
    {  // 2.
      WorkspaceCarver c(region);
      if (pairs > 0) {
        // Key bits (keys 0..nkeys, nkeys the sentinel) and token bits (0..T-1): when both fit in 32,
        // the sort runs on packed keys, key << token bits | token, one buffer of its two being the
        // persistent tokens[0]; else on (key, token) pairs.
        const int64_t nkeys = z.hkv * z.B * n_slc_max;
        int kbits = 1, tbits = 0;
        while ((int64_t(1) << kbits) <= nkeys) ++kbits;
        while ((int64_t(1) << tbits) < z.T) ++tbits;
        L.packed_sort = kbits + tbits <= 32 && cuda::testing::packed_sort_enabled();
        if (L.packed_sort) {
          L.key_shift = tbits;
          L.sort_bits = kbits + tbits;
          L.keys[1] = c.take<uint32_t>(size_t(pairs));
          cub::DoubleBuffer<uint32_t> kb(reinterpret_cast<uint32_t*>(L.tokens[0]), L.keys[1]);
          NSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, L.sort_temp_bytes, kb, int(pairs), 0, L.sort_bits,
                                                        stream));
        } else {
          L.sort_bits = kbits;
          L.keys[0] = c.take<uint32_t>(size_t(pairs));
          L.keys[1] = c.take<uint32_t>(size_t(pairs));
          L.tokens[1] = c.take<int32_t>(size_t(pairs));
          cub::DoubleBuffer<uint32_t> kb(L.keys[0], L.keys[1]);
          cub::DoubleBuffer<int32_t> vb(L.tokens[0], L.tokens[1]);
          NSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, L.sort_temp_bytes, kb, vb, int(pairs), 0,
                                                         L.sort_bits, stream));
        }
        L.sort_temp = c.take<unsigned char>(L.sort_temp_bytes);
      }
      most = std::max(most, c.bytes());
    }
    {  // 4.
      WorkspaceCarver c(region);
      L.dkc_part = c.take<float>(size_t(part_rows * z.hkv * z.dqk));
      L.dvc_part = c.take<float>(size_t(part_rows * z.hkv * z.dv));
      most = std::max(most, c.bytes());
    }
    if (z.has_params) {  // 5. split-K partials of phi's parameter gradients, capped in bytes
      WorkspaceCarver c(region);
      carve_phi_partials(z, rows, c, L);
      most = std::max(most, c.bytes());
    }
    if (z.n > 0) {  // 6.
      WorkspaceCarver c(region);
      const int64_t qkvo = z.T * (z.hq + z.hkv) * (z.dqk + z.dv) * 2;  // (one K/V: the least there is)
      const int64_t budget = std::max<int64_t>(int64_t(most), qkvo / 32);
      const int64_t chunks = (z.lp + kKeys - 1) / kKeys;
      const int64_t slot_bytes = kKeys * (z.dqk + z.dv) * 4 + 12;
      const int64_t raw_ctas = z.hkv * z.B * n_slc_max * chunks;
      const int64_t left = budget - int64_t(c.bytes()) - raw_ctas * 8;
      // (GPU tests that set the cap also get at least 64 slots, so that many lists are cut at their
      // short lengths, where the budget gives a few.)
      const int64_t want = cuda::testing::raw_piece_tiles() > 0 ? std::max<int64_t>(left / slot_bytes, 64) : left / slot_bytes;
      const int64_t pool = cuda::testing::raw_pieces_enabled() ? std::min<int64_t>(want, kMaxRawPool) : 0;
      if (pool >= 2) {
        L.raw.pool = int(pool);
        L.raw.x = int(z.B * n_slc_max * chunks);
        L.raw.extra_x = int((pool + z.hkv - 1) / z.hkv);
        L.raw.part_k = c.take<float>(size_t(pool * kKeys * z.dqk));
        L.raw.part_v = c.take<float>(size_t(pool * kKeys * z.dv));
        L.raw.split = c.take<int2>(size_t(raw_ctas));
        L.raw.slot = c.take<int2>(size_t(pool));
        L.raw.arrived = c.take<int>(size_t(pool));
      }
      most = std::max(most, c.bytes());
    }
    return most;
  };
  const size_t scratch_bytes = carve_scratch(nullptr);  // the sizes
  if (unsigned char* region = w.take<unsigned char>(scratch_bytes)) carve_scratch(region);
  L.bytes = w.bytes();
  return L;
}

// ---- raw_pieces_plan_kernel: which raw blocks' lists are cut into pieces (BwdArgs::raw) --

constexpr int kPlanThreads = 1024;

// Query tiles of raw CTA x of KV head hk as dkv_kernel<raw> counts them: its window's (n0) and its
// block's list's (n1).
__device__ inline void raw_cta_tiles(const BwdArgs& a, int hk, int x, int& n0, int& n1) {
  n0 = n1 = 0;
  const int tq = kRows / a.G;
  const int chunks = (a.lp + kKeys - 1) / kKeys;
  const int per_seq = a.n_slc_max * chunks;
  const int b = x / per_seq, j = (x % per_seq) / chunks;
  const int key0 = j * a.lp + (x % chunks) * kKeys;
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  if (key0 >= len) return;
  const int nk = min(kKeys, min((j + 1) * a.lp, len) - key0);
  if (a.w > 0) n0 = (min(len - 1, key0 + nk - 1 + a.w - 1) - key0 + tq) / tq;
  if (a.n > 0) {
    const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
    const int first = a.sel_offsets[key], last = a.sel_offsets[key + 1];
    n1 = (last - first + tq - 1) / tq;
  }
}

// Block-wide sum (exclusive = false) or exclusive prefix sum (true) of one value per thread, in a
// fixed order (integers: exact either way). Every thread of the block calls it.
__device__ inline long long plan_block_scan(long long v, bool exclusive, long long* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const long long u = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += u;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  long long before = 0, all = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  __syncthreads();  // warp_sums may be reused
  return exclusive ? before + inc - v : all;
}

// One CTA: the cap from every raw CTA's tiles (doubled until the pieces fit the raw.pool slots),
// then the lists longer than cap in the order (j, chunk, b, hk), each in ceil(n1 / cap) pieces
// with one slot per piece. Writes raw.split for every raw CTA, raw.slot for every slot and zeroes the
// arrival counters. Depends only on the index: the same pieces, run after run.
__global__ void __launch_bounds__(kPlanThreads) raw_pieces_plan_kernel(const BwdArgs a) {
  __shared__ long long warp_sums[kPlanThreads / 32];
  const int ctas = a.hkv * a.raw.x;
  for (int s = threadIdx.x; s < a.raw.pool; s += blockDim.x) {
    a.raw.slot[s] = make_int2(-1, 0);
    a.raw.arrived[s] = 0;
  }
  long long mine = 0;
  for (int r = threadIdx.x; r < ctas; r += blockDim.x) {
    int n0, n1;
    raw_cta_tiles(a, r / a.raw.x, r % a.raw.x, n0, n1);
    mine += n0 + n1;
  }
  const long long total = plan_block_scan(mine, false, warp_sums);
  const long long rule = (total + kRawTargetCtas - 1) / kRawTargetCtas;
  // Thread t: positions [t per, (t + 1) per) of the order; position q = ((j chunks + c) B + b) Hkv + hk.
  const int chunks = (a.lp + kKeys - 1) / kKeys;
  const int per = (ctas + int(blockDim.x) - 1) / int(blockDim.x);
  const int q0 = min(ctas, int(threadIdx.x) * per), q1 = min(ctas, q0 + per);
  auto cta_of = [&](int q) {
    const int hk = q % a.hkv, rest = q / a.hkv;
    const int b = rest % a.B, jc = rest / a.B;
    return hk * a.raw.x + b * a.n_slc_max * chunks + jc;  // jc = j * chunks + c
  };
  long long cap = a.raw.piece_tiles > 0 ? a.raw.piece_tiles : rule > kRawMinPieceTiles ? rule : kRawMinPieceTiles;
  auto pieces_of = [&](int r) {
    int n0, n1;
    raw_cta_tiles(a, r / a.raw.x, r % a.raw.x, n0, n1);
    return n1 > cap ? int((n1 + cap - 1) / cap) : 1;
  };
  auto need_of = [&] {
    long long need = 0;
    for (int q = q0; q < q1; ++q) {
      const int p = pieces_of(cta_of(q));
      if (p > 1) need += p;
    }
    return need;
  };
  // Every cut list gets its slots: where they would not fit the pool, the cap doubles (the same for
  // every thread: a block-wide sum) until they do.
  long long need = need_of();
  while (plan_block_scan(need, false, warp_sums) > a.raw.pool) {
    cap *= 2;
    need = need_of();
  }
  long long base = plan_block_scan(need, true, warp_sums);
  __syncthreads();  // the slots' reset above is done
  for (int q = q0; q < q1; ++q) {
    const int r = cta_of(q);
    const int p = pieces_of(r);
    if (p > 1 && base + p <= a.raw.pool) {
      a.raw.split[r] = make_int2(int(base), p);
      for (int i = 0; i < p; ++i) a.raw.slot[base + i] = make_int2(r, i);
    } else {
      a.raw.split[r] = make_int2(-1, 1);
    }
    if (p > 1) base += p;
  }
}

Sizes sizes_of(const Config& cfg, const Problem& p, int64_t F) {
  return Sizes{p.total_tokens, p.batch, p.max_seqlen, p.hq, p.hkv, p.dqk, p.dv, F,
               cfg.cmp_block_len, cfg.cmp_stride, cfg.slc_block_len, cfg.n_selected,
               cfg.phi != PhiKind::mean};
}

Mat3 mat3(const TensorView& t) { return Mat3{t.data, t.ndim > 0 ? t.stride[0] : 0, t.ndim > 1 ? t.stride[1] : 0}; }
OutMat3 out3(const TensorView& t) { return OutMat3{t.data, t.ndim > 0 ? t.stride[0] : 0, t.ndim > 1 ? t.stride[1] : 0}; }

// Whether every pair of neighbouring elements (2 i, 2 i + 1) of the last dimension of a 16-bit t is
// one aligned 32-bit word: the data 4-byte aligned, the other strides even.
bool aligned_pairs(const TensorView& t) {
  if (!t.defined()) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.stride[i] % 2 != 0) return false;
  return true;
}

bool aligned16(const TensorView& t) {
  if (!t.defined()) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.stride[i] % 8 != 0) return false;
  return true;
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


template <typename E>
void dispatch_dims(const BwdArgs& a, cudaStream_t s, int phase) {
  if (a.dqk == 64 && a.dv == 64) return launch_attention<E, 64, 64>(a, s, phase);
  if (a.dqk == 64 && a.dv == 128) return launch_attention<E, 64, 128>(a, s, phase);
  if (a.dqk == 128 && a.dv == 64) return launch_attention<E, 128, 64>(a, s, phase);
  if (a.dqk == 128 && a.dv == 128) return launch_attention<E, 128, 128>(a, s, phase);
  if (a.dqk == 192 && a.dv == 64) return launch_attention<E, 192, 64>(a, s, phase);
  if (a.dqk == 192 && a.dv == 128) return launch_attention<E, 192, 128>(a, s, phase);
  cuda::require_supported_dims(a.dqk, a.dv);  // throws
}

// The sequence table cu [B+1] on the device, from a device tensor, or from the host table.
void upload_cu(const Plan& p, int32_t* dst, cudaStream_t s) {
  if (p.cu_seqlens.defined() && p.cu_seqlens.device == Device::cuda) {
    copy_cu_kernel<<<blocks_for(p.B + 1), 256, 0, s>>>(static_cast<const int32_t*>(p.cu_seqlens.data),
                                                      p.cu_seqlens.stride[0], int(p.B + 1), dst);
    NSA_CUDA_CHECK_LAUNCH();
  } else if (p.cu.size() <= size_t(kInlineCu)) {
    // Absent (one sequence: {0, T}) or a short host table: the offsets travel as a kernel
    // argument, so the call neither copies from host memory nor waits for the stream.
    InlineCu c{};
    for (size_t i = 0; i < p.cu.size(); ++i) c.v[i] = int32_t(p.cu[i]);
    set_cu_kernel<<<1, kInlineCu, 0, s>>>(c, int(p.cu.size()), dst);
    NSA_CUDA_CHECK_LAUNCH();
  } else {
    std::vector<int32_t> cu(p.cu.begin(), p.cu.end());
    NSA_CUDA_CHECK(cudaMemcpyAsync(dst, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    NSA_CUDA_CHECK(cudaStreamSynchronize(s));  // `cu` is a local: it must outlive the copy
  }
}

template <typename E>
void run_backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
                  const Gradients& grads, Workspace ws) {
  cudaStream_t s = cuda::stream_of(p);
  if (p.cfg.n_selected > 0) {  // the selection dq kernel's per-warp union scratch must fit
    const size_t smem = slc_dq_smem_bytes(int(p.dqk), int(p.dv), slc_dq_capacity(int(p.group), int(p.cfg.n_selected)));
    if (smem > cuda::kMaxSmem)
      throw Error("n_selected (n)", std::to_string(p.cfg.n_selected),
                  "needs more shared memory (" + std::to_string(smem) + " bytes) than the cuda backward's selection "
                  "kernel has at G = " + std::to_string(p.group));
  }

  const Problem prob = problem_of(p);
  const Layout L = carve(sizes_of(p.cfg, prob, p.cfg.phi == PhiKind::mlp ? prob.phi_hidden : 0), ws.data, s);
  if (p.T == 0) return;
  const int64_t rc = cmp_rows(p.T, p.cfg.cmp_stride);

  // 1. Sequence table on the device.
  upload_cu(p, L.cu, s);

  BwdArgs a;
  a.dtype = p.dtype == DType::bf16 ? 0 : 1;
  a.T = p.T;
  a.max_seqlen = p.max_seqlen;
  a.B = int(p.B);
  a.cu = L.cu;
  a.hq = int(p.hq);
  a.hkv = int(p.hkv);
  a.G = int(p.group);
  a.dqk = int(p.dqk);
  a.dv = int(p.dv);
  a.l = int(p.cfg.cmp_block_len);
  a.d = int(p.cfg.cmp_stride);
  a.lp = int(p.cfg.slc_block_len);
  a.n = int(p.cfg.n_selected);
  a.n_init = int(p.cfg.n_init);
  a.n_local = int(p.cfg.n_local);
  a.w = int(p.cfg.window);
  a.n_slc_max = int(p.n_slc_max);
  a.scale = float(p.scale);
  a.shared_kv = p.cfg.shared_kv;
  a.q = mat3(in.q);
  a.d_o = mat3(d_o);
  a.g = mat3(in.g);
  a.lse = mat3(saved.lse);
  a.indices = mat3(saved.indices);
  bool vec = aligned16(in.q) && aligned16(d_o);
  for (int b = 0; b < 3; ++b) {
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    a.k[b] = mat3(kv.k);
    a.v[b] = mat3(kv.v);
    vec = vec && aligned16(kv.k) && aligned16(kv.v);
    if (!p.cfg.shared_kv || b == kCmp) {
      a.grad_k[b] = out3(grads.dkv[b].k);
      a.grad_v[b] = out3(grads.dkv[b].v);
    }
  }
  a.vec = vec;
  a.kc = L.kc;
  a.vc = L.vc;
  a.dg32 = L.dg32;
  a.dq = out3(grads.dq);
  a.dq_pairs = aligned_pairs(grads.dq);
  a.dg = out3(grads.dg);
  a.sel_tokens = L.tokens[0];
  a.sel_offsets = L.offsets;
  a.dkc = L.dkc;
  a.dvc = L.dvc;
  a.dkc_part = L.dkc_part;
  a.dvc_part = L.dvc_part;
  a.cmp_splits = L.cmp_splits;
  for (int z = 0; z < kMaxCmpSplits; ++z) a.cmp_part_rows[z] = L.cmp_part_rows[z];
  a.raw = L.raw;
  a.raw.piece_tiles = cuda::testing::raw_piece_tiles();
  a.rc = rc;

  // 1b. Compressed keys/values through phi (as the forward computes them).
  if (rc > 0) {
    crow_token_kernel<<<blocks_for(rc), 256, 0, s>>>(L.cu, a.B, rc, a.l, a.d, L.crow_token);
    NSA_CUDA_CHECK_LAUNCH();
    phi_forward<E>(p, s, in.phi_k, in.kv[kCmp].k, a.dqk, L, L.kc, L.pre_k);
    phi_forward<E>(p, s, in.phi_v, in.kv[kCmp].v, a.dv, L, L.vc, L.pre_v);
  }

  // 2. Inverted selection index: stable sort of (key, token) pairs enumerated in token order,
  //    so each block's list is ascending in token: deterministic.
  const int64_t pairs = p.T * p.hkv * p.cfg.n_selected;
  const int64_t nkeys = p.hkv * p.B * p.n_slc_max;
  if (pairs > 0) {
    if (pairs > INT32_MAX || nkeys >= INT32_MAX)
      throw Error("T * Hkv * n_selected", std::to_string(pairs), "must be < 2^31 for the cuda backward");
    size_t temp = L.sort_temp_bytes;
    if (L.packed_sort) {  // (carve: key and token bits fit in 32)
      uint32_t* packed = reinterpret_cast<uint32_t*>(L.tokens[0]);
      selection_packed_kernel<<<blocks_for(pairs), 256, 0, s>>>(a, uint32_t(nkeys), L.key_shift, packed);
      NSA_CUDA_CHECK_LAUNCH();
      cub::DoubleBuffer<uint32_t> kb(packed, L.keys[1]);
      NSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(L.sort_temp, temp, kb, int(pairs), 0, L.sort_bits, s));
      segment_offsets_kernel<<<blocks_for(nkeys + 1), 256, 0, s>>>(kb.Current(), L.key_shift, pairs, nkeys, L.offsets);
      NSA_CUDA_CHECK_LAUNCH();
      // The token lists outlive the sort's scratch (which later phases reuse): into tokens[0].
      unpack_tokens_kernel<<<blocks_for(pairs), 256, 0, s>>>(kb.Current(), pairs, (uint32_t(1) << L.key_shift) - 1u,
                                                             L.tokens[0]);
      NSA_CUDA_CHECK_LAUNCH();
    } else {
      selection_pairs_kernel<<<blocks_for(pairs), 256, 0, s>>>(a, uint32_t(nkeys), L.keys[0], L.tokens[0]);
      NSA_CUDA_CHECK_LAUNCH();
      cub::DoubleBuffer<uint32_t> kb(L.keys[0], L.keys[1]);
      cub::DoubleBuffer<int32_t> vb(L.tokens[0], L.tokens[1]);
      NSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(L.sort_temp, temp, kb, vb, int(pairs), 0, L.sort_bits, s));
      segment_offsets_kernel<<<blocks_for(nkeys + 1), 256, 0, s>>>(kb.Current(), 0, pairs, nkeys, L.offsets);
      NSA_CUDA_CHECK_LAUNCH();
      // The token lists outlive the sort's scratch (which later phases reuse): keep them in tokens[0].
      if (vb.Current() != L.tokens[0])
        NSA_CUDA_CHECK(cudaMemcpyAsync(L.tokens[0], vb.Current(), sizeof(int32_t) * size_t(pairs),
                                       cudaMemcpyDeviceToDevice, s));
    }
    a.sel_tokens = L.tokens[0];
  }

  // 3. dq and dg (dg from the saved branch outputs when the caller kept them: dq_kernel then
  //    skips its recompute of each branch's output). dq_kernel does the compressed and window
  //    branches; slc_dq_kernel then adds the selection's dq (and writes its dg).
  if (saved.o_branch.defined() && p.T > 0) {
    const TensorView& ob = saved.o_branch;
    dg_from_branches_kernel<E><<<blocks_for(p.T * p.hq * 32), 256, 0, s>>>(
        a.d_o, static_cast<const E*>(ob.data), ob.stride[0], ob.stride[1], ob.stride[2], p.T * p.hq, int(p.hq),
        int(p.dv), a.dg32, a.dg);
    NSA_CUDA_CHECK_LAUNCH();
    a.dg_ready = true;
  }
  // Without o_branch but with the forward's o: slc_dq_kernel takes the selection's D from o and
  // the other branches' dg (which dq_kernel writes first) instead of recomputing o_slc.
  a.o = mat3(saved.o);
  a.d_from_o = !a.dg_ready && saved.o.defined() && p.T > 0;
  dispatch_dims<E>(a, s, 0);
  if (a.n > 0) dispatch_dims<E>(a, s, 4);

  // 4. Compressed branch dk/dv (fp32): the last query split of each sequence writes dkc / dvc,
  //    the earlier ones partials, added in split order (cmp_split_of). Rows of no block stay 0.
  if (rc > 0) {
    NSA_CUDA_CHECK(cudaMemsetAsync(L.dkc, 0, sizeof(float) * size_t(rc * p.hkv * p.dqk), s));
    NSA_CUDA_CHECK(cudaMemsetAsync(L.dvc, 0, sizeof(float) * size_t(rc * p.hkv * p.dv), s));
    dispatch_dims<E>(a, s, 1);
    if (L.cmp_splits > 1) {
      reduce_cmp_parts_kernel<<<blocks_for(rc * p.hkv * p.dqk), 256, 0, s>>>(a, L.dkc_part, L.crow_token, int(p.dqk),
                                                                            L.dkc);
      NSA_CUDA_CHECK_LAUNCH();
      reduce_cmp_parts_kernel<<<blocks_for(rc * p.hkv * p.dv), 256, 0, s>>>(a, L.dvc_part, L.crow_token, int(p.dv),
                                                                           L.dvc);
      NSA_CUDA_CHECK_LAUNCH();
    }
    // 5. phi's parameter gradients (and dpre for the raw keys).
    phi_backward_params<E>(p, s, in.phi_k, in.kv[kCmp].k, a.dqk, L, L.dkc, L.pre_k, grads.dphi_k);
    phi_backward_params<E>(p, s, in.phi_v, in.kv[kCmp].v, a.dv, L, L.dvc, L.pre_v, grads.dphi_v);
  } else {
    // No compressed block anywhere: phi's parameters get no gradient.
    auto zero = [&](const TensorView& t) {
      if (!t.defined()) return;
      for (int64_t r = 0; r < (t.ndim == 1 ? 1 : t.shape[0]); ++r)
        NSA_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t.data) + r * t.stride[0] * 2, 0,
                                       size_t(t.shape[t.ndim - 1]) * 2, s));
    };
    for (const PhiParams* d : {&grads.dphi_k, &grads.dphi_v}) {
      zero(d->w1); zero(d->b1); zero(d->w2); zero(d->b2); zero(d->pe);
    }
  }
  const int kind = int(p.cfg.phi);
  a.phi_k = PhiDxArgs{kind, L.dkc, L.pre_k, in.phi_k.w1.data, in.phi_k.w1.defined() ? in.phi_k.w1.stride[0] : 0,
                      int(p.phi_hidden_k)};
  a.phi_v = PhiDxArgs{kind, L.dvc, L.pre_v, in.phi_v.w1.data, in.phi_v.w1.defined() ? in.phi_v.w1.stride[0] : 0,
                      int(p.phi_hidden_v)};
  if (rc == 0) {  // phi_dx reads dkc/dvc only for existing blocks; keep the pointers harmless
    a.phi_k.kind = a.phi_v.kind = 0;
  }

  // 6. Window + selection dk/dv (shared K/V: plus phi's gradient).
  if (a.raw.pool > 0) {  // the long lists' pieces, from the index
    raw_pieces_plan_kernel<<<1, kPlanThreads, 0, s>>>(a);
    NSA_CUDA_CHECK_LAUNCH();
  }
  dispatch_dims<E>(a, s, 2);
  if (!p.cfg.shared_kv) {
    phi_dx_kernel<E><<<blocks_for(p.T * p.hkv * p.dqk), 256, 0, s>>>(a, a.phi_k, a.dqk, a.grad_k[kCmp]);
    NSA_CUDA_CHECK_LAUNCH();
    phi_dx_kernel<E><<<blocks_for(p.T * p.hkv * p.dv), 256, 0, s>>>(a, a.phi_v, a.dv, a.grad_v[kCmp]);
    NSA_CUDA_CHECK_LAUNCH();
  }
}

void check_supported(const Config& cfg, const Problem& p) {
  cuda::require_storage_dtype(p.dtype);
  cuda::require_supported_dims(p.dqk, p.dv);
  cuda::require_supported_group(p.hq / std::max<int64_t>(p.hkv, 1));
  if (p.max_seqlen > INT32_MAX / 2)
    throw Error("max_seqlen", std::to_string(p.max_seqlen), "must be < 2^30 for the cuda backward");
  if (p.total_tokens > INT32_MAX / 2)  // packed token indices are int32 in the kernels
    throw Error("T (total tokens)", std::to_string(p.total_tokens), "must be < 2^30 for the cuda backward");
  (void)cfg;
}

}  // namespace

size_t backward_workspace_size(const Config& cfg, const Problem& problem) {
  check_supported(cfg, problem);
  const int64_t F = cfg.phi == PhiKind::mlp ? problem.phi_hidden : 0;
  return carve(sizes_of(cfg, problem, F), nullptr, nullptr).bytes;
}

void backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
              const Gradients& grads, Workspace ws) {
  const Problem prob = problem_of(p);
  check_supported(p.cfg, prob);
  // As in the forward: rows move in 16-byte pieces (slc_dq_kernel's K, V, Q and dO loads, the
  // tensor maps, the copies and the dq / dk / dv stores), so every row starts on 16 bytes. Without
  // this check an unaligned view failed inside a kernel with a misaligned-address error.
  cuda::require_rows_aligned("q", in.q);
  cuda::require_rows_aligned("d_o", d_o);
  cuda::require_rows_aligned("o_branch", saved.o_branch);
  cuda::require_rows_aligned("o", saved.o);
  cuda::require_rows_aligned("dq", grads.dq);
  for (int b = 0; b < 3; ++b) {
    const std::string i = "[" + std::to_string(b) + "]";
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    cuda::require_rows_aligned("kv" + i + ".k", kv.k);
    cuda::require_rows_aligned("kv" + i + ".v", kv.v);
    cuda::require_rows_aligned("dkv" + i + ".k", grads.dkv[b].k);
    cuda::require_rows_aligned("dkv" + i + ".v", grads.dkv[b].v);
  }
  if (p.cfg.phi != PhiKind::mean && (in.phi_k.pe.stride[0] != p.dqk || in.phi_v.pe.stride[0] != p.dv ||
                                      grads.dphi_k.pe.stride[0] != p.dqk || grads.dphi_v.pe.stride[0] != p.dv))
    throw Error("phi.pe / dphi.pe", "strided", "must be contiguous [l, D] for the cuda backward");
  if (p.dtype == DType::bf16) run_backward<__nv_bfloat16>(p, in, saved, d_o, grads, ws);
  else run_backward<__half>(p, in, saved, d_o, grads, ws);
}

namespace {

// ---- compress_bwd: phi's backward as a stage op ---------------------------------------------
// The layer backward's phi pieces on their own: dxc (storage type) -> dy in fp32 (rows of no
// block: 0, as the layer backward's dkc there), phi's forward again for mlp's hidden layer, the
// parameter gradients (split-K partials added in a fixed order), then dx for every raw token.

// dy [Rc * Hkv, D] fp32 from dxc [Rc, Hkv, D] (any strides); rows of no compressed block are 0.
template <typename E>
__global__ void dy_from_dxc_kernel(const E* dxc, int64_t s0, int64_t s1, int64_t s2, int64_t rc, int hkv, int D,
                                   const int32_t* crow_token, float* dy) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rc * hkv * D) return;
  const int c = int(i % D);
  const int hk = int((i / D) % hkv);
  const int64_t crow = i / (int64_t(D) * hkv);
  dy[i] = crow_token[crow] < 0 ? 0.f : to_float(dxc[crow * s0 + hk * s1 + c * s2]);
}

Layout carve_compress(const Sizes& z, void* base) {
  WorkspaceCarver w(base);
  Layout L;
  const int64_t rc = cmp_rows(z.T, z.d), rows = rc * z.hkv;
  L.cu = w.take<int32_t>(size_t(z.B + 1));
  L.crow_token = w.take<int32_t>(size_t(std::max<int64_t>(rc, 1)));
  L.dkc = w.take<float>(size_t(rows * z.dqk));  // dy
  if (z.F > 0) {  // mlp: phi's forward again for the hidden layer (its output unused)
    L.kc = w.take<uint16_t>(size_t(rows * z.dqk));
    L.pre_k = w.take<float>(size_t(rows * z.F));
  }
  L.colsum = w.take<float>(size_t(std::max(z.F, z.dqk)));
  if (z.has_params) carve_phi_partials(z, rows, w, L);
  L.bytes = w.bytes();
  return L;
}

void check_compress_supported(const Problem& p) {
  cuda::require_storage_dtype(p.dtype);
  if (p.dqk != 64 && p.dqk != 128 && p.dqk != 192)  // the key head dims of the layer backward
    throw Error("D", std::to_string(p.dqk), "is not supported by the cuda compress_bwd (supported: 64, 128, 192)");
  if (p.total_tokens > INT32_MAX / 2)
    throw Error("T (total tokens)", std::to_string(p.total_tokens), "must be < 2^30 for the cuda compress_bwd");
}

template <typename E>
void run_compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                      const TensorView& dx, const PhiParams& dphi, Workspace ws) {
  cudaStream_t s = cuda::stream_of(p);
  Problem prob = problem_of(p);  // (a compress plan: one phi, x [T, Hkv, D])
  prob.hq = p.hkv;
  prob.dv = p.dqk;
  const int64_t F = p.cfg.phi == PhiKind::mlp ? p.phi_hidden_k : 0;
  const Layout L = carve_compress(sizes_of(p.cfg, prob, F), ws.data);
  if (p.T == 0) return;
  const int64_t rc = cmp_rows(p.T, p.cfg.cmp_stride);
  const int D = int(p.dqk);
  upload_cu(p, L.cu, s);
  BwdArgs a;
  a.T = p.T;
  a.max_seqlen = p.max_seqlen;
  a.B = int(p.B);
  a.cu = L.cu;
  a.hq = a.hkv = int(p.hkv);
  a.dqk = a.dv = D;
  a.l = int(p.cfg.cmp_block_len);
  a.d = int(p.cfg.cmp_stride);
  a.rc = rc;
  if (rc > 0) {
    crow_token_kernel<<<blocks_for(rc), 256, 0, s>>>(L.cu, a.B, rc, a.l, a.d, L.crow_token);
    NSA_CUDA_CHECK_LAUNCH();
    dy_from_dxc_kernel<E><<<blocks_for(rc * p.hkv * D), 256, 0, s>>>(
        static_cast<const E*>(dxc.data), dxc.stride[0], dxc.stride[1], dxc.stride[2], rc, int(p.hkv), D,
        L.crow_token, L.dkc);
    NSA_CUDA_CHECK_LAUNCH();
    if (p.cfg.phi == PhiKind::mlp) phi_forward<E>(p, s, phi, x, D, L, L.kc, L.pre_k);
    phi_backward_params<E>(p, s, phi, x, D, L, L.dkc, L.pre_k, dphi);
  } else {
    // No compressed block: phi's parameters get no gradient.
    for (const TensorView* t : {&dphi.w1, &dphi.b1, &dphi.w2, &dphi.b2, &dphi.pe}) {
      if (!t->defined()) continue;
      for (int64_t r = 0; r < (t->ndim == 1 ? 1 : t->shape[0]); ++r)
        NSA_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t->data) + r * t->stride[0] * 2, 0,
                                       size_t(t->shape[t->ndim - 1]) * 2, s));
    }
  }
  PhiDxArgs P{int(p.cfg.phi), L.dkc, L.pre_k, phi.w1.data, phi.w1.defined() ? phi.w1.stride[0] : 0, int(F)};
  if (rc == 0) P.kind = 0;  // phi_dx then reads no row
  phi_dx_kernel<E><<<blocks_for(p.T * p.hkv * D), 256, 0, s>>>(a, P, D, out3(dx));
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t compress_bwd_workspace_size(const Config& cfg, const Problem& problem) {
  check_compress_supported(problem);
  const int64_t F = cfg.phi == PhiKind::mlp ? problem.phi_hidden : 0;
  return carve_compress(sizes_of(cfg, problem, F), nullptr).bytes;
}

void compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace ws) {
  check_compress_supported(problem_of(p));
  if (p.cfg.phi != PhiKind::mean && (phi.pe.stride[0] != p.dqk || dphi.pe.stride[0] != p.dqk))
    throw Error("phi.pe / dphi.pe", "strided", "must be contiguous [l, D] for the cuda compress_bwd");
  if (p.dtype == DType::bf16) run_compress_bwd<__nv_bfloat16>(p, phi, x, dxc, dx, dphi, ws);
  else run_compress_bwd<__half>(p, phi, x, dxc, dx, dphi, ws);
}

}  // namespace nsa::cuda_bwd
