// phi on the GPU: tables, operand functors and the forward / backward products (phi.h says what
// each computes; gemm.cuh how the products run).
#include "cuda/phi/phi.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/common/launch.h"
#include "cuda/phi/blas.h"
#include "cuda/phi/gemm.cuh"
#include "cuda/phi/gemm_direct.cuh"
#include "nsa/blocks.h"

namespace nsa::cuda::phi {

namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi), GELU's tanh form
constexpr float kGeluA = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.f + tanhf(kGeluC * (x + kGeluA * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float th = tanhf(kGeluC * (x + kGeluA * x * x * x));
  return 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * kGeluC * (1.f + 3.f * kGeluA * x * x);
}

// ---- tables ---------------------------------------------------------------------------------

__global__ void row_table_kernel(const int32_t* cu, int B, int64_t T, int64_t rc, int l, int d,
                                 int32_t* first_token) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rc) return;
  int64_t s0 = 0, len = T;
  if (cu != nullptr) {  // the last sequence whose first compressed row is <= r (rows never overlap)
    int lo = 0, hi = B - 1, b = 0;
    while (lo <= hi) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] / d <= r) { b = mid; lo = mid + 1; } else { hi = mid - 1; }
    }
    s0 = cu[b];
    len = cu[b + 1] - s0;
  }
  const int64_t i = r - cmp_row_offset(s0, d);
  first_token[r] = (i >= 0 && i < num_cmp_blocks(len, l, d)) ? int32_t(s0 + i * d) : -1;
}

__global__ void slot_table_kernel(const int32_t* cu, int B, int64_t T, int d, int64_t n_slots, int4* slots) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= n_slots) return;
  int b = 0;
  int64_t s0 = 0, end = T;
  if (cu != nullptr) {  // the last sequence whose first slot is <= j
    int lo = 0, hi = B - 1;
    while (lo <= hi) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] / d + mid <= j) { b = mid; lo = mid + 1; } else { hi = mid - 1; }
    }
    s0 = cu[b];
    end = cu[b + 1];
  }
  const int64_t q = j - s0 / d - b;
  slots[j] = (q >= 0 && s0 + q * d < end) ? make_int4(int(s0 + q * d), int(s0 / d + q), int(end), int(q))
                                          : make_int4(-1, 0, 0, 0);
}

// ---- operands (gemm.cuh: row / col / element; kKFast = k contiguous; kExact = exact in bf16) --------

// Where compressed row m's block lies in x (rows of stride s0, heads of stride s1): base(m), the
// offset of the block's first token at the row's head (-1: no block); column(k), the offset of
// u's column k (token k / D, column k % D of the block) from there.
template <typename E>
struct XRows {
  const E* x;
  int64_t s0, s1;
  const int32_t* first;
  int hkv, D;
  __device__ int64_t base(int64_t m) const {
    const int64_t r = m / hkv;
    const int tok = first[r];
    return tok < 0 ? -1 : tok * s0 + (m - r * hkv) * s1;
  }
  __device__ int64_t column(int k) const {
    const int r = k / D;
    return r * s0 + (k - r * D);
  }
};

template <typename E>
struct BlockInput {  // A(m, k) = u_m[k] = x[row m's block, token k / D, column k % D] + pe[k]
  static constexpr bool kKFast = true, kExact = false;
  XRows<E> x;
  const E* pe;  // [l, D] rows of stride pe_s0 (nullptr: none)
  int64_t pe_s0;
  using RowInfo = int64_t;  // XRows::base
  struct KInfo {
    int64_t off;  // XRows::column
    int64_t pe_off;
  };
  __device__ RowInfo row(int, int64_t m) const { return x.base(m); }
  __device__ KInfo col(int, int k) const {
    const int r = k / x.D;
    return KInfo{x.column(k), r * pe_s0 + (k - r * x.D)};
  }
  // The 8 elements of a run stay in one token's row: D and the run's first k are multiples of 8.
  __device__ void elements(RowInfo a, const KInfo& b, int count, float (&v)[kRun]) const {
    if (a < 0) return zero_run(v);
    load_run(x.x + a + b.off, count, v);
    if (pe == nullptr) return;
    float p[kRun];
    load_run(pe + b.pe_off, count, p);
#pragma unroll
    for (int j = 0; j < kRun; ++j) v[j] += p[j];
  }
  __device__ void load8(RowInfo a, const KInfo& b, int count, float (&v)[kRun]) const { elements(a, b, count, v); }
};
template <typename E>
struct BlockInputT {  // B(k, n) = u_k[n]
  static constexpr bool kKFast = false, kExact = false;
  BlockInput<E> u;
  using RowInfo = typename BlockInput<E>::KInfo;
  using KInfo = int64_t;
  __device__ RowInfo row(int b, int64_t n) const { return u.col(b, int(n)); }
  __device__ KInfo col(int b, int k) const { return u.row(b, k); }
  __device__ void load8(const RowInfo& a, KInfo b, int count, float (&v)[kRun]) const { u.elements(b, a, count, v); }
};
template <typename E>
struct WeightT {  // B(k, n) = W[n, k]: phi's weights as stored, [out, in]
  static constexpr bool kKFast = true, kExact = std::is_same_v<E, __nv_bfloat16>;
  const E* w;
  int64_t s0;
  using RowInfo = int64_t;
  using KInfo = int;
  __device__ RowInfo row(int, int64_t n) const { return n * s0; }
  __device__ KInfo col(int, int k) const { return k; }
  __device__ void load8(RowInfo a, KInfo b, int count, float (&v)[kRun]) const { load_run(w + a + b, count, v); }
};
template <typename E>
struct Weight {  // B(k, n) = W[k, n]
  static constexpr bool kKFast = false, kExact = std::is_same_v<E, __nv_bfloat16>;
  const E* w;
  int64_t s0;
  using RowInfo = int;
  using KInfo = int64_t;
  __device__ RowInfo row(int, int64_t n) const { return int(n); }
  __device__ KInfo col(int, int k) const { return k * s0; }
  __device__ void load8(RowInfo a, KInfo b, int count, float (&v)[kRun]) const { load_run(w + b + a, count, v); }
};
template <bool kGelu>
__device__ __forceinline__ void gelu_run(float (&v)[kRun]) {
  if constexpr (kGelu) {
#pragma unroll
    for (int j = 0; j < kRun; ++j) v[j] = gelu(v[j]);
  }
}
template <bool kGelu>
struct Rows32 {  // A(m, k) = a[m, k] (fp32 rows of ld), or GELU of it
  static constexpr bool kKFast = true, kExact = false;
  const float* a;
  int64_t ld;
  using RowInfo = int64_t;
  using KInfo = int;
  __device__ RowInfo row(int, int64_t m) const { return m * ld; }
  __device__ KInfo col(int, int k) const { return k; }
  __device__ void load8(RowInfo r, KInfo k, int count, float (&v)[kRun]) const {
    load_run(a + r + k, count, v);
    gelu_run<kGelu>(v);  // (GELU(0) = 0 past the count)
  }
};
template <bool kGelu>
struct Cols32 {  // A(m, k) = a[k, m] or B(k, n) = a[k, n] (fp32 rows of ld), or GELU of it
  static constexpr bool kKFast = false, kExact = false;
  const float* a;
  int64_t ld;
  using RowInfo = int64_t;
  using KInfo = int64_t;
  __device__ RowInfo row(int, int64_t i) const { return i; }
  __device__ KInfo col(int, int k) const { return k * ld; }
  __device__ void load8(RowInfo r, KInfo k, int count, float (&v)[kRun]) const {
    load_run(a + k + r, count, v);
    gelu_run<kGelu>(v);
  }
};

// x's gradient (phi.h): batch b = rr * Hkv + h; A's row is slot j, its column s * F + f.
struct DxRows {
  const int4* slots;  // {first token, compressed row, sequence end, q}
  int hkv, l, d;
  // Of slot j's token at rr: the range of s (block q - s) that exist and reach it, and the row
  // index (compressed row * Hkv + h) of block q; an empty range for no slot.
  struct Range {
    int64_t row0;
    int lo, hi;
  };
  __device__ Range range(int b, int64_t j) const {
    const int4 sl = slots[j];
    const int rr = b / hkv, h = b - rr * hkv;
    if (sl.x < 0) return Range{0, 1, 0};
    const int q = sl.w;
    const int64_t len = int64_t(sl.z) - (int64_t(sl.x) - int64_t(q) * d);
    const int64_t nc = num_cmp_blocks(len, l, d);
    const int lo = q - nc + 1 > 0 ? int(q - nc + 1) : 0;
    const int hi = min(q, (l - 1 - rr) / d);
    return Range{int64_t(sl.y) * hkv + h, lo, hi};
  }
};
struct DxGrad {  // A(j, s * F + f) = g[row of block q - s, h][f] when that block holds the token
  static constexpr bool kKFast = true, kExact = false;
  DxRows rows;
  const float* g;  // dpre [rc * Hkv, F] (mlp) or dy [rc * Hkv, D] (linear, F = D)
  int F;
  using RowInfo = DxRows::Range;
  struct KInfo {
    int s, f;
  };
  __device__ RowInfo row(int b, int64_t j) const { return rows.range(b, j); }
  __device__ KInfo col(int, int k) const { return KInfo{k / F, k % F}; }
  __device__ float element(const RowInfo& r, int s, int f) const {
    return (s < r.lo || s > r.hi) ? 0.f : g[(r.row0 - int64_t(s) * rows.hkv) * F + f];
  }
  __device__ void load8(const RowInfo& r, KInfo k, int count, float (&v)[kRun]) const {
    if (k.f + count <= F) {  // the run within one block's row
      if (k.s < r.lo || k.s > r.hi) return zero_run(v);
      return load_run(g + (r.row0 - int64_t(k.s) * rows.hkv) * F + k.f, count, v);
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j) {  // F not a multiple of 8: the run crosses into the next block
      const int f = k.f + j, s = k.s + f / F;
      v[j] = j < count ? element(r, s, f % F) : 0.f;
    }
  }
};
template <typename E>
struct DxWeight {  // B(s * F + f, n) = W[f, (rr + s d) * D + n] (0 past the block's l rows)
  static constexpr bool kKFast = false, kExact = std::is_same_v<E, __nv_bfloat16>;
  const E* w;
  int64_t s0;
  int F, hkv, d, l, D;
  using RowInfo = int;
  using KInfo = int64_t;
  __device__ RowInfo row(int, int64_t n) const { return int(n); }
  __device__ KInfo col(int b, int k) const {
    const int s = k / F, f = k - s * F;
    const int r = b / hkv + s * d;
    return r < l ? f * s0 + int64_t(r) * D : -1;
  }
  __device__ void load8(RowInfo n, KInfo k, int count, float (&v)[kRun]) const {
    if (k < 0) return zero_run(v);
    load_run(w + k + n, count, v);
  }
};

// ---- operands of the direct products (gemm_direct.cuh: fixed / at; kT = index contiguous) ------

using bf16 = __nv_bfloat16;

struct XBlockA : DirOperand<false> {  // A(m, k) = x[row m's block, token k / D, column k % D]: u without pe
  XRows<bf16> x;
  using Fixed = int64_t;
  __device__ Fixed fixed(int, int64_t m) const { return x.base(m); }
  __device__ int64_t at(int, Fixed base, int64_t, int k) const { return base < 0 ? -1 : base + x.column(k); }
};
struct XBlockBT : DirOperand<true> {  // B(m, k) = u_m[k] without pe (m: the product's k, u's column: its n)
  XRows<bf16> x;
  using Fixed = int64_t;
  __device__ Fixed fixed(int, int64_t n) const { return x.column(int(n)); }
  __device__ int64_t at(int, Fixed col, int64_t, int m) const {
    const int64_t base = x.base(m);
    return base < 0 ? -1 : base + col;
  }
};
struct WRowsB : DirOperand<false> {  // B(k, n) = W[n, k]: a bf16 weight as stored, [out, in]
  int64_t s0;
  using Fixed = int64_t;
  __device__ Fixed fixed(int, int64_t n) const { return n * s0; }
  __device__ int64_t at(int, Fixed row, int64_t, int k) const { return row + k; }
};
struct GradAT : DirOperand<true> {  // A(f, m) = g[m, f] from its bf16 copy [rows, F] (dW = g^T u)
  int F;
  using Fixed = int;
  __device__ Fixed fixed(int, int64_t) const { return 0; }
  __device__ int64_t at(int, Fixed, int64_t f, int m) const { return int64_t(m) * F + f; }
};
struct DxGradA : DirOperand<false> {  // DxGrad's A from the bf16 copy of g
  DxRows rows;
  int F;
  using Fixed = DxRows::Range;
  __device__ Fixed fixed(int b, int64_t j) const { return rows.range(b, j); }
  __device__ int64_t at(int, const Fixed& r, int64_t, int k) const {
    const int s = k / F, f = k - s * F;
    return (s < r.lo || s > r.hi) ? -1 : (r.row0 - int64_t(s) * rows.hkv) * F + f;
  }
};
struct DxWeightBT : DirOperand<true> {  // DxWeight as stored: B(s * F + f, n) = W[f, (rr + s d) * D + n]
  int64_t s0;
  int F, hkv, d, l, D;
  using Fixed = int;
  __device__ Fixed fixed(int, int64_t) const { return 0; }
  __device__ int64_t at(int b, Fixed, int64_t n, int k) const {
    const int s = k / F, f = k - s * F;
    const int r = b / hkv + s * d;
    return r < l ? f * s0 + int64_t(r) * D + n : -1;
  }
};

// ---- stores (st(batch, m, n, split, value)) ----------------------------------------------------

template <typename E>
struct StorePre {  // pre[m, n] = v + b1[n]; with a folded bias, v + bias[n] on rows of a block
  float* pre;
  int F;
  const E* b1;
  const float* bias = nullptr;  // b1 + pe W1^T (direct products: u without pe)
  const int32_t* first = nullptr;
  int hkv = 1;
  __device__ void operator()(int, int64_t m, int n, int, float v) const {
    pre[m * F + n] = v + (bias != nullptr && first[m / hkv] >= 0 ? bias[n] : to_float(b1[n]));
  }
};
template <typename E>
struct StoreOut {  // xc[row, head, n] = v (+ b2[n]), rounded to the storage dtype
  E* xc;
  int64_t st, sh;
  int hkv;
  const E* b2;  // nullptr: none
  const int32_t* first;
  bool write_unused;
  const float* bias = nullptr;  // linear's pe W^T, on rows of a block (direct products)
  __device__ void operator()(int, int64_t m, int n, int, float v) const {
    const int64_t r = m / hkv;
    if (!write_unused && first[r] < 0) return;
    if (b2 != nullptr) v += to_float(b2[n]);
    if (bias != nullptr && first[r] >= 0) v += bias[n];
    xc[r * st + (m % hkv) * sh + n] = from_float<E>(v);
  }
};
struct StorePartial {  // part[split][m, n] = v
  float* part;
  int N;
  int64_t plane;
  __device__ void operator()(int, int64_t m, int n, int z, float v) const { part[z * plane + m * N + n] = v; }
};
struct StoreDpre {  // in place: pre[m, n] := v * gelu'(pre[m, n])
  float* pre;
  int F;
  __device__ void operator()(int, int64_t m, int n, int, float v) const {
    float& p = pre[m * F + n];
    p = v * gelu_grad(p);
  }
};
// Where dx row b of slot j lands: the slot's token + b / hkv, or -1 (an unused slot, or a token
// past its sequence); its head is b % hkv.
__device__ __forceinline__ int64_t dx_token(const int4* slots, int64_t j, int b, int hkv) {
  const int4 sl = slots[j];
  if (sl.x < 0) return -1;
  const int64_t tok = int64_t(sl.x) + b / hkv;
  return tok < sl.z ? tok : -1;
}
template <typename E, int V>
__device__ __forceinline__ void store_dx(const DxOut& out, int64_t tok, int h, int hkv, int D, int c, const float (&v)[V]);
template <typename E>
struct StoreDx {  // dx[slot j's token + rr, h, n] = v (tokens past the sequence: none)
  const int4* slots;
  int hkv, D;
  DxOut out;
  __device__ void operator()(int b, int64_t j, int n, int, float v) const {
    const int64_t tok = dx_token(slots, j, b, hkv);
    if (tok < 0) return;
    const float one[1] = {v};
    store_dx<E, 1>(out, tok, b % hkv, hkv, D, n, one);
  }
};

// ---- the small kernels around the products -----------------------------------------------------

// V consecutive elements at p: one 16-byte access where V elements are 16 bytes (the caller
// checked the alignment), else V scalar ones.
template <int V, typename T>
__device__ __forceinline__ void load_run(const T* p, T (&v)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    memcpy(v, &u, 16);
  } else {
    for (int i = 0; i < V; ++i) v[i] = p[i];
  }
}
template <int V, typename T>
__device__ __forceinline__ void store_run(T* p, const T (&v)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    uint4 u;
    memcpy(&u, v, 16);
    *reinterpret_cast<uint4*>(p) = u;
  } else if constexpr (V * sizeof(T) == 8) {
    uint2 u;
    memcpy(&u, v, 8);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    for (int i = 0; i < V; ++i) p[i] = v[i];
  }
}

// dx[tok, h, c .. c + V) = v: fp32 rows of hkv x D, or the storage dtype at out's strides.
template <typename E, int V>
__device__ __forceinline__ void store_dx(const DxOut& out, int64_t tok, int h, int hkv, int D, int c, const float (&v)[V]) {
  if (out.f32) {
    store_run<V>(static_cast<float*>(out.p) + (tok * hkv + h) * D + c, v);
  } else {
    E o[V];
    for (int i = 0; i < V; ++i) o[i] = from_float<E>(v[i]);
    store_run<V>(static_cast<E*>(out.p) + tok * out.s0 + h * out.s1 + c, o);
  }
}

// xc[r, h, c] = mean over the block's l tokens of x[., h, c]: a thread per V columns of one
// (row, head), the tokens summed in order (the same bits at any V).
template <typename E, int V>
__global__ void mean_kernel(const E* x, int64_t s0, int64_t s1, const int32_t* first, int64_t rc, int hkv, int D,
                            int l, E* xc, int64_t xc_st, int64_t xc_sh, bool write_unused) {
  const int groups = D / V;
  const int64_t total = rc * hkv * groups;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / groups;
    const int c = int(e - m * groups) * V;
    const int64_t r = m / hkv;
    const int h = int(m - r * hkv);
    const int tok = first[r];
    if (tok < 0 && !write_unused) continue;
    float sum[V] = {};
    if (tok >= 0) {
      const E* p = x + int64_t(tok) * s0 + h * s1 + c;
      for (int k = 0; k < l; ++k, p += s0) {
        E v[V];
        load_run<V>(p, v);
        for (int i = 0; i < V; ++i) sum[i] += to_float(v[i]);
      }
    }
    E out[V];
    for (int i = 0; i < V; ++i) out[i] = from_float<E>(sum[i] / float(l));
    store_run<V>(xc + r * xc_st + h * xc_sh + c, out);
  }
}

// mean's x gradient: dx[token] = sum over its blocks of dy[block] / l (block q first); a thread
// per V columns of one (slot, token in the slot, head).
template <typename E, int V>
__global__ void mean_dx_kernel(DxRows rows, const float* dy, int D, int64_t n_slots, DxOut out) {
  const int groups = D / V, batches = rows.d * rows.hkv;
  const int64_t total = n_slots * batches * groups;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / groups;
    const int c = int(e - m * groups) * V;
    const int64_t j = m / batches;
    const int b = int(m - j * batches);
    const int64_t tok = dx_token(rows.slots, j, b, rows.hkv);
    if (tok < 0) continue;
    const DxRows::Range r = rows.range(b, j);
    float acc[V] = {};
    for (int s = r.lo; s <= r.hi; ++s) {
      float v[V];
      load_run<V>(dy + (r.row0 - int64_t(s) * rows.hkv) * D + c, v);
      for (int i = 0; i < V; ++i) acc[i] += v[i] / float(rows.l);
    }
    store_dx<E, V>(out, tok, b % rows.hkv, rows.hkv, D, c, acc);
  }
}

// out[m, n] (storage dtype, rows of stride s0) = sum over z of part[z][m, n], z ascending, plus
// rs[m] pe[n] where pe is given (the direct products' u without pe: dW = g^T x + colsum(g) pe).
template <typename E>
__global__ void reduce_parts_kernel(const float* part, int splits, int M, int N, E* out, int64_t s0,
                                    const float* rs, const E* pe) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= int64_t(M) * N) return;
  float acc = 0.f;
  for (int z = 0; z < splits; ++z) acc += part[z * int64_t(M) * N + i];
  const int64_t m = i / N, n = i % N;
  if (pe != nullptr) acc += rs[m] * to_float(pe[n]);
  out[m * s0 + n] = from_float<E>(acc);
}

// bias[n] = b[n] + sum_k pe[k] W[n, k] (b, pe: nullptr for none): one warp per n, each lane over
// runs of V consecutive k (V = 8: one 16-byte load of each operand; the caller checked that K, s0
// and both rows allow it), then a fixed butterfly.
template <typename E, int V>
__global__ void fold_bias_kernel(const E* w, int64_t s0, int N, int K, const E* b, const E* pe, float* bias) {
  const int n = int(blockIdx.x) * (int(blockDim.x) / 32) + int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (n >= N) return;
  float acc = 0.f;
  if (pe != nullptr)
    for (int k = lane * V; k < K; k += 32 * V) {
      E x[V], y[V];
      load_run<V>(pe + k, x);
      load_run<V>(w + n * s0 + k, y);
#pragma unroll
      for (int i = 0; i < V; ++i) acc += to_float(x[i]) * to_float(y[i]);
    }
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) bias[n] = acc + (b != nullptr ? to_float(b[n]) : 0.f);
}

// An fp32 matrix rounded to bf16 (to nearest even).
__global__ void round_bf16_kernel(const float* a, int64_t n, bf16* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(a[i]);
}

// h[i] = gelu(a[i]) (mlp's hidden layer for its second product on cuBLASLt).
__global__ void gelu_kernel(const float* a, int64_t n, float* h) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    h[i] = gelu(a[i]);
}
// out [rows, cols] (fp32, contiguous) = w (rows of ld) in fp32.
template <typename E>
__global__ void to_f32_kernel(const E* w, int64_t ld, int rows, int cols, float* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= int64_t(rows) * cols) return;
  const int64_t m = i / cols;
  out[i] = to_float(w[m * ld + (i - m * cols)]);
}

// ---- the products on cuBLASLt: blocks as rows of d-token chunks -----------------------------
// With S = l / d, block r (compressed row r) is the S chunks r .. r + S - 1 of d tokens each,
// chunk c of a sequence being its tokens c d .. c d + d - 1 (blocks start every d tokens). Row m
// = r Hkv + h of u is then chunk rows (r + s) Hkv + h, s < S, of xg [(rc + S - 1) Hkv, d D]
// (chunk c, head h: the d tokens' rows of x for h): u_s = xg from row s Hkv, uniform rows of d D.
// So u W1^T = sum_s u_s W1_s^T, dW1_s = dpre^T u_s and x's gradient by chunk sum_s (dpre W1_s)
// shifted down s Hkv rows, W1_s being W1's columns s d D .. (s + 1) d D.
//
// The chunk of compressed row c: its d tokens from the first token of a block that holds it
// (block r, c - S < r <= c, starting at first_token[r]: the blocks holding one chunk belong to
// one sequence and agree on it), or -1 when no block holds it.
__device__ __forceinline__ int64_t chunk_first_token(const int32_t* first, int64_t rc, int S, int d, int64_t c) {
  for (int s = 0; s < S; ++s) {
    const int64_t r = c - s;
    if (r < 0) break;
    if (r < rc && first[r] >= 0) return int64_t(first[r]) + int64_t(s) * d;
  }
  return -1;
}

// xg (above) from x (rows of stride s0, heads of stride s1): one 16-byte piece a thread, zeros
// for a chunk no block holds.
__global__ void chunk_gather_kernel(const bf16* x, int64_t s0, int64_t s1, const int32_t* first, int64_t rc, int S,
                                    int d, int hkv, int D, int64_t chunks, bf16* xg) {
  const int pieces = D / 8;
  const int64_t per_chunk = int64_t(hkv) * d * pieces;
  const int64_t total = chunks * per_chunk;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = e / per_chunk;
    const int rem = int(e - c * per_chunk);
    const int h = rem / (d * pieces), j = (rem / pieces) % d, p = rem % pieces;
    const int64_t tok = chunk_first_token(first, rc, S, d, c);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (tok >= 0) v = *reinterpret_cast<const uint4*>(x + (tok + j) * s0 + h * s1 + p * 8);
    *reinterpret_cast<uint4*>(xg + e * 8) = v;
  }
}

// The store st (gemm_direct's: biases, rounding, rows of no block) of a product's fp32 result acc
// [M, N] (rows of N). acc may be st's own output (each element read, then written, by one thread).
// With first (the row table; u W1^T's result): 0 instead of acc on a row of no block, as the own
// kernels multiply a zero block there. Its product read chunk rows that may hold other sequences'
// tokens: its pre must not depend on them (a NaN there would reach dpre = 0 * gelu'(pre) and, through
// x's gradient by chunk, the tokens of the chunks it shares with its neighbours).
template <class St>
__global__ void blas_store_kernel(const float* acc, int64_t M, int N, const int32_t* first, int hkv, St st) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < M * N; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / N;
    const float v = first == nullptr || first[m / hkv] >= 0 ? acc[e] : 0.f;
    st(0, m, int(e - m * N), 0, v);
  }
}

// x's gradient from its sums by chunk dxg [(rc + S - 1) Hkv, d D] (fp32): a thread per V columns of
// one (slot, token in the slot, head). A token gets its chunk row's sum when a block of its own
// sequence holds that chunk (the row may be another sequence's chunk: a sequence's last, partial
// chunk shares its row with the next sequence's first), else 0 (a token of no block).
template <typename E, int V>
__global__ void chunk_scatter_dx_kernel(const float* dxg, const int4* slots, int64_t n_slots, const int32_t* first,
                                        int64_t rc, int S, int d, int hkv, int D, DxOut out) {
  const int groups = D / V;
  const int64_t per_slot = int64_t(d) * hkv * groups;
  const int64_t total = n_slots * per_slot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e / per_slot;
    const int rem = int(e - j * per_slot);
    const int jj = rem / (hkv * groups), h = (rem / groups) % hkv, c = (rem % groups) * V;
    const int4 sl = slots[j];
    if (sl.x < 0) continue;
    const int64_t tok = int64_t(sl.x) + jj;
    if (tok >= sl.z) continue;
    float v[V] = {};
    if (chunk_first_token(first, rc, S, d, sl.y) == sl.x)
      load_run<V>(dxg + ((int64_t(sl.y) * hkv + h) * d + jj) * D + c, v);
    store_dx<E, V>(out, tok, h, hkv, D, c, v);
  }
}

// Column sums in a fixed order: sum[n] = sum_m a[m, n]; also stored as E when out != nullptr.
// A CTA takes kSumCols columns: its kSumLanes row lanes each add the rows m = lane, lane +
// kSumLanes, .. (one coalesced 128-byte row piece per warp and step), then lane 0 adds the lanes'
// sums in lane order. The order depends on M and N only, so the same inputs give the same bits.
// (One thread per column walking all M rows took 1.75 ms for [16384, 512] on an H200: M
// dependent loads per thread, a few CTAs on the whole GPU.)
constexpr int kSumCols = 32, kSumLanes = 32;
template <typename E>
__global__ void __launch_bounds__(kSumCols* kSumLanes) column_sum_kernel(const float* a, int64_t M, int N, float* sum,
                                                                          E* out) {
  __shared__ float lanes[kSumLanes][kSumCols + 1];
  const int c = threadIdx.x, lane = threadIdx.y;
  const int n = blockIdx.x * kSumCols + c;
  float acc = 0.f;
  if (n < N)
    for (int64_t m = lane; m < M; m += kSumLanes) acc += a[m * N + n];
  lanes[lane][c] = acc;
  __syncthreads();
  if (lane != 0 || n >= N) return;
  float total = 0.f;
  for (int i = 0; i < kSumLanes; ++i) total += lanes[i][c];
  sum[n] = total;
  if (out != nullptr) out[n] = from_float<E>(total);
}
template <typename E>
void column_sum(const float* a, int64_t M, int N, float* sum, E* out, cudaStream_t s) {
  column_sum_kernel<E><<<unsigned((N + kSumCols - 1) / kSumCols), dim3(kSumCols, kSumLanes), 0, s>>>(a, M, N, sum, out);
  NSA_CUDA_CHECK_LAUNCH();
}

// dpe[k] = sum_n W[n, k] s[n] (u = block + pe: pe's gradient is W^T times the summed dpre). A CTA
// takes 32 columns k: warp g sums the rows n = g, g + 8, .. (a coalesced piece of a row per step),
// then thread k of warp 0 adds the 8 warps' sums in warp order (fixed: the same bits every run).
// (One thread per column walking all N rows took ~35 us at N 512, K 4096: 16 CTAs on the GPU.)
constexpr int kPeWarps = 8;
template <typename E>
__global__ void __launch_bounds__(32 * kPeWarps) pe_grad_kernel(const E* w, int64_t w_s0, int N, int K, const float* s,
                                                               E* dpe) {
  __shared__ float part[kPeWarps][32];
  const int lane = int(threadIdx.x) % 32, g = int(threadIdx.x) / 32;
  const int k = int(blockIdx.x) * 32 + lane;
  float acc = 0.f;
  if (k < K)
    for (int n = g; n < N; n += kPeWarps) acc += to_float(w[n * w_s0 + k]) * s[n];
  part[g][lane] = acc;
  __syncthreads();
  if (g != 0 || k >= K) return;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPeWarps; ++i) sum += part[i][lane];
  dpe[k] = from_float<E>(sum);  // pe [l, D] is contiguous (checked on the host)
}

constexpr unsigned kMaxGrid = 1u << 20;  // grid-stride beyond this
unsigned capped_blocks(int64_t n) { return std::min<unsigned>(blocks_for(n), kMaxGrid); }
bool on16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool on8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }

template <typename E>
XRows<E> x_rows(const Rows& r, const TensorView& x) {
  return XRows<E>{static_cast<const E*>(x.data), x.stride[0], x.stride[1], r.first_token, r.hkv, r.D};
}

template <typename E>
BlockInput<E> block_input(const Rows& r, const PhiParams& phi, const TensorView& x) {
  return BlockInput<E>{x_rows<E>(r, x), static_cast<const E*>(phi.pe.data), phi.pe.defined() ? phi.pe.stride[0] : 0};
}

// Whether the products run on gemm_direct.cuh: bf16 storage, x's and W1's rows in whole 16-byte
// pieces (x's last dimension contiguous, as everywhere), F a multiple of 8.
template <typename E>
bool direct_products(const Rows& r, const PhiParams& phi, const TensorView& x) {
  if constexpr (!std::is_same_v<E, bf16>) {
    return false;
  } else {
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    return r.kind != PhiKind::mean && r.D % 8 == 0 && (r.kind != PhiKind::mlp || r.F % 8 == 0) && aligned(x.data) &&
           x.stride[0] % 8 == 0 && x.stride[1] % 8 == 0 && aligned(phi.w1.data) && phi.w1.stride[0] % 8 == 0;
  }
}

// Whether r's products can run on cuBLASLt: asked for, l a multiple of d (a block is l / d whole
// chunks) and the caller's scratch. blas_products adds the direct products' conditions on the
// operands (backward_x, which has no x, relies on backward_params having checked them: g16).
bool blas_rows(const Rows& r) { return r.blas && r.blas_scratch != nullptr && r.l % r.d == 0; }
template <typename E>
bool blas_products(const Rows& r, const PhiParams& phi, const TensorView& x) {
  return blas_rows(r) && direct_products<E>(r, phi, x);
}

// The scratch of the products on cuBLASLt (one description for blas_bytes and the calls):
// cuBLASLt's workspace, then one of three uses of the same place, one after another on the
// stream: xg with linear's product after it; dxg; mlp's second layer (h, w2, c). base nullptr:
// the sizes alone.
struct BlasScratch {
  void* ws;
  bf16* xg;
  float* lin;  // linear's u W^T [M, D]
  float* dxg;
  float* h;    // mlp's second layer: gelu(pre), then (dy W2) [M, F]
  float* w2;   // W2 in fp32 [D, F]
  float* c;    // gelu(pre) W2^T [M, D]
  int S;
  int64_t chunk_rows;  // (rc + S - 1) Hkv
  size_t bytes;
};
BlasScratch blas_scratch(PhiKind kind, int64_t rc, int64_t hkv, int64_t D, int64_t F, int64_t l, int64_t d,
                         void* base) {
  BlasScratch b{};
  b.S = int(l / d);
  b.chunk_rows = (rc + b.S - 1) * hkv;
  WorkspaceCarver w(base);
  b.ws = w.take<char>(blas::kWorkspaceBytes);
  char* const area = base ? static_cast<char*>(base) + w.bytes() : nullptr;
  const size_t chunk_elems = size_t(b.chunk_rows * d * D), M = size_t(rc * hkv);
  WorkspaceCarver chunks(area), sums(area), second(area);
  b.xg = chunks.take<bf16>(chunk_elems);
  b.lin = kind == PhiKind::linear ? chunks.take<float>(M * D) : nullptr;
  b.dxg = sums.take<float>(chunk_elems);
  if (kind == PhiKind::mlp) {
    b.h = second.take<float>(M * F);
    b.w2 = second.take<float>(size_t(D * F));
    b.c = second.take<float>(M * D);
  }
  b.bytes = w.bytes() + std::max({chunks.bytes(), sums.bytes(), second.bytes()});
  return b;
}
BlasScratch blas_scratch(const Rows& r) {
  return blas_scratch(r.kind, r.rc, r.hkv, r.D, r.F, r.l, r.d, r.blas_scratch);
}

// xg (chunk_gather_kernel) of x for r's rows.
void gather_chunks(const Rows& r, const TensorView& x, const BlasScratch& b, cudaStream_t s) {
  const int64_t pieces = b.chunk_rows * r.d * (r.D / 8);
  chunk_gather_kernel<<<capped_blocks(pieces), 256, 0, s>>>(static_cast<const bf16*>(x.data), x.stride[0],
                                                            x.stride[1], r.first_token, r.rc, b.S, r.d, r.hkv, r.D,
                                                            b.chunk_rows / r.hkv, b.xg);
  NSA_CUDA_CHECK_LAUNCH();
}

// mlp's second layer on cuBLASLt reads gelu(pre) [M, F] and W2 [D, F] in fp32: into bs.h and bs.w2.
template <typename E>
void gelu_and_w2_f32(const float* pre, int64_t M, const PhiParams& phi, int D, int F, const BlasScratch& bs,
                     cudaStream_t s) {
  gelu_kernel<<<capped_blocks(M * F), 256, 0, s>>>(pre, M * F, bs.h);
  NSA_CUDA_CHECK_LAUNCH();
  to_f32_kernel<E><<<blocks_for(int64_t(D) * F), 256, 0, s>>>(static_cast<const E*>(phi.w2.data), phi.w2.stride[0], D,
                                                             F, bs.w2);
  NSA_CUDA_CHECK_LAUNCH();
}

// out [M, N] (fp32, rows of N; beta: add to it) = u W1^T over the S chunk products.
void blas_u_w1t(const Rows& r, const PhiParams& phi, const BlasScratch& b, int N, float* out, cudaStream_t s) {
  const int64_t M = r.rc * r.hkv, dD = int64_t(r.d) * r.D;
  const bf16* w1 = static_cast<const bf16*>(phi.w1.data);
  for (int i = 0; i < b.S; ++i)  // W1_s [N, d D] as stored: B^T
    blas::matmul(blas::product(M, N, dD, {b.xg + i * r.hkv * dD, dD}, {w1 + i * dD, phi.w1.stride[0], true}, out, N,
                               i == 0 ? 0.f : 1.f),
                 b.ws, s);
}

}  // namespace

void row_table(const int32_t* cu, int B, int64_t T, int l, int d, int32_t* first_token, cudaStream_t s) {
  const int64_t rc = cmp_rows(T, d);
  if (rc == 0) return;
  row_table_kernel<<<blocks_for(rc), 256, 0, s>>>(cu, B, T, rc, l, d, first_token);
  NSA_CUDA_CHECK_LAUNCH();
}

void slot_table(const int32_t* cu, int B, int64_t T, int d, int32_t* slots, cudaStream_t s) {
  const int64_t n = slot_count(T, B, d);
  if (n == 0) return;
  slot_table_kernel<<<blocks_for(n), 256, 0, s>>>(cu, B, T, d, n, reinterpret_cast<int4*>(slots));
  NSA_CUDA_CHECK_LAUNCH();
}

int64_t work_floats(PhiKind kind, int64_t rows, int64_t F, int64_t D) {
  if (kind == PhiKind::mean) return 0;
  return kind == PhiKind::mlp ? rows * F + F : D;
}

int64_t blas_bytes(PhiKind kind, int64_t rc, int64_t hkv, int64_t D, int64_t F, int64_t l, int64_t d) {
  if (kind == PhiKind::mean || d <= 0 || l % d != 0 || rc <= 0) return 0;
  return int64_t(blas_scratch(kind, rc, hkv, D, F, l, d, nullptr).bytes);
}

int64_t grad_bf16_elems(PhiKind kind, int64_t rows, int64_t F, int64_t D) {
  if (kind == PhiKind::mean) return 0;
  return rows * (kind == PhiKind::mlp ? F : D);
}

// The stores of one job's products: xc (rounded, + b2) and mlp's pre (+ b1).
template <typename E>
struct JobStores {
  StoreOut<E> out;
  StorePre<E> pre;
};
template <typename E>
JobStores<E> job_stores(const Rows& r, const Job& j, bool write_unused) {
  return JobStores<E>{StoreOut<E>{static_cast<E*>(j.xc), j.xc_st, j.xc_sh, r.hkv, nullptr, r.first_token, write_unused},
                      StorePre<E>{j.work, r.F, static_cast<const E*>(j.phi.b1.data)}};
}

// Job j's product alone (n = 1), or jobs 0 and 1 as the two batches of one launch (n = 2, Pair:
// DirPair or OpPair): `launch(batches, a, b, store)`.
template <template <class> class Pair, class A, class B, class St, class Launch>
void run_jobs(int n, const A (&a)[2], const B (&b)[2], const St (&st)[2], Launch&& launch) {
  if (n == 1) launch(1, a[0], b[0], st[0]);
  else launch(2, Pair<A>{a[0], a[1]}, Pair<B>{b[0], b[1]}, StorePair<St>{st[0], st[1]});
}

// phi's products for jobs[0 .. n) (n = 2: the same Rows, as the two batches of each launch): u W1^T
// (mlp: + b1, into pre; linear: into xc), then mlp's gelu(pre) W2^T + b2 into xc. u W1^T runs on
// gemm_direct where it applies, as x's block W1^T + (pe W1^T + b1): the second term is one bias
// vector in the job's work, after pre.
template <typename E>
void products(const Rows& r, const Job (&jobs)[2], int n, bool write_unused, cudaStream_t s) {
  const bool mlp = r.kind == PhiKind::mlp;
  const int64_t M = r.rc * r.hkv;
  const int K = r.l * r.D, N = mlp ? r.F : r.D;
  JobStores<E> st[2]{};
  for (int i = 0; i < n; ++i) st[i] = job_stores<E>(r, jobs[i], write_unused);
  bool direct = false, blas = false;
  if constexpr (std::is_same_v<E, bf16>) {
    direct = direct_products<E>(r, jobs[0].phi, jobs[0].x);
    if (direct) {
      XBlockA a[2]{};
      WRowsB b[2]{};
      for (int i = 0; i < n; ++i) {
        const Job& j = jobs[i];
        float* bias = j.work + (mlp ? M * r.F : 0);
        const bf16* w1 = static_cast<const bf16*>(j.phi.w1.data);
        // 16-byte runs of W1's rows and pe where they allow (W1's do: direct_products).
        const bf16* pe = static_cast<const bf16*>(j.phi.pe.data);
        const bf16* b1 = mlp ? static_cast<const bf16*>(j.phi.b1.data) : nullptr;
        auto* fold = pe == nullptr || (on16(pe) && K % 8 == 0) ? fold_bias_kernel<bf16, 8> : fold_bias_kernel<bf16, 1>;
        fold<<<blocks_for(int64_t(N) * 32, 128), 128, 0, s>>>(w1, j.phi.w1.stride[0], N, K, b1, pe, bias);
        NSA_CUDA_CHECK_LAUNCH();
        a[i] = XBlockA{{static_cast<const bf16*>(j.x.data)}, x_rows<bf16>(r, j.x)};
        b[i] = WRowsB{{w1}, j.phi.w1.stride[0]};
        if (mlp) {
          st[i].pre.bias = bias;
          st[i].pre.first = r.first_token;
          st[i].pre.hkv = r.hkv;
        } else {
          st[i].out.bias = bias;
        }
      }
      blas = true;
      for (int i = 0; i < n; ++i) blas = blas && blas_products<E>(r, jobs[i].phi, jobs[i].x);
      if (blas) {  // each job's chunks, its S products into pre (linear: lin), then the store
        const BlasScratch bs = blas_scratch(r);
        for (int i = 0; i < n; ++i) {
          gather_chunks(r, jobs[i].x, bs, s);
          float* acc = mlp ? jobs[i].work : bs.lin;
          blas_u_w1t(r, jobs[i].phi, bs, N, acc, s);
          if (mlp)
            blas_store_kernel<<<capped_blocks(M * N), 256, 0, s>>>(acc, M, N, r.first_token, r.hkv, st[i].pre);
          else
            blas_store_kernel<<<capped_blocks(M * N), 256, 0, s>>>(acc, M, N, r.first_token, r.hkv, st[i].out);
          NSA_CUDA_CHECK_LAUNCH();
        }
      } else {
        auto launch = [&](int batches, auto la, auto lb, auto store) {
          gemm_direct(s, M, N, K, 1, batches, la, lb, store, r.wgmma);
        };
        if (mlp) run_jobs<DirPair>(n, a, b, {st[0].pre, st[1].pre}, launch);
        else run_jobs<DirPair>(n, a, b, {st[0].out, st[1].out}, launch);
      }
    }
  }
  if (!direct) {
    BlockInput<E> u[2]{};
    WeightT<E> w1[2]{};
    for (int i = 0; i < n; ++i) {
      u[i] = block_input<E>(r, jobs[i].phi, jobs[i].x);
      w1[i] = WeightT<E>{static_cast<const E*>(jobs[i].phi.w1.data), jobs[i].phi.w1.stride[0]};
    }
    auto launch = [&](int batches, auto la, auto lb, auto store) { gemm(s, M, N, K, 1, batches, la, lb, store); };
    if (mlp) run_jobs<OpPair>(n, u, w1, {st[0].pre, st[1].pre}, launch);
    else run_jobs<OpPair>(n, u, w1, {st[0].out, st[1].out}, launch);
  }
  if (!mlp) return;
  if (blas) {  // gelu(pre) W2^T in fp32 on cuBLASLt, each job in turn (its pre, its W2)
    const BlasScratch bs = blas_scratch(r);
    for (int i = 0; i < n; ++i) {
      const PhiParams& phi = jobs[i].phi;
      gelu_and_w2_f32<E>(jobs[i].work, M, phi, r.D, r.F, bs, s);
      // W2 [D, F]: B^T
      blas::matmul(blas::product_f32(M, r.D, r.F, {bs.h, r.F}, {bs.w2, r.F, true}, bs.c, r.D), bs.ws, s);
      st[i].out.b2 = static_cast<const E*>(phi.b2.data);
      blas_store_kernel<<<capped_blocks(M * r.D), 256, 0, s>>>(bs.c, M, r.D, nullptr, r.hkv, st[i].out);
      NSA_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  Rows32<true> h[2]{};
  WeightT<E> w2[2]{};
  for (int i = 0; i < n; ++i) {
    st[i].out.b2 = static_cast<const E*>(jobs[i].phi.b2.data);
    h[i] = Rows32<true>{jobs[i].work, r.F};
    w2[i] = WeightT<E>{static_cast<const E*>(jobs[i].phi.w2.data), jobs[i].phi.w2.stride[0]};
  }
  run_jobs<OpPair>(n, h, w2, {st[0].out, st[1].out},
                   [&](int batches, auto la, auto lb, auto store) { gemm(s, M, r.D, r.F, 1, batches, la, lb, store); });
}

template <typename E>
void forward(const Rows& r, const PhiParams& phi, const TensorView& x, float* work, void* xc, int64_t xc_st,
             int64_t xc_sh, bool write_unused, cudaStream_t s) {
  const int64_t M = r.rc * r.hkv;
  if (M == 0) return;
  if (r.kind == PhiKind::mean) {
    // 16-byte runs where every row of x and xc starts on 16 bytes, else one column per thread.
    const bool runs = r.D % 8 == 0 && on16(x.data) && on16(xc) && x.stride[0] % 8 == 0 && x.stride[1] % 8 == 0 &&
                      xc_st % 8 == 0 && xc_sh % 8 == 0;
    const E* xp = static_cast<const E*>(x.data);
    E* out = static_cast<E*>(xc);
    if (runs)
      mean_kernel<E, 8><<<capped_blocks(M * r.D / 8), 256, 0, s>>>(xp, x.stride[0], x.stride[1], r.first_token, r.rc,
                                                                   r.hkv, r.D, r.l, out, xc_st, xc_sh, write_unused);
    else
      mean_kernel<E, 1><<<capped_blocks(M * r.D), 256, 0, s>>>(xp, x.stride[0], x.stride[1], r.first_token, r.rc, r.hkv,
                                                               r.D, r.l, out, xc_st, xc_sh, write_unused);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const Job jobs[2] = {Job{phi, x, work, xc, xc_st, xc_sh}, Job{}};
  products<E>(r, jobs, 1, write_unused, s);
}

template <typename E>
void forward_pair(const Rows& r0, const Job& j0, const Rows& r1, const Job& j1, bool write_unused, bool paired,
                  cudaStream_t s) {
  const bool same = paired && r0.kind == r1.kind && r0.kind != PhiKind::mean && r0.first_token == r1.first_token &&
                    r0.rc == r1.rc && r0.hkv == r1.hkv && r0.D == r1.D && r0.l == r1.l && r0.d == r1.d &&
                    r0.F == r1.F && j0.work != j1.work &&
                    direct_products<E>(r0, j0.phi, j0.x) == direct_products<E>(r1, j1.phi, j1.x);
  if (!same || r0.rc * r0.hkv == 0) {
    forward<E>(r0, j0.phi, j0.x, j0.work, j0.xc, j0.xc_st, j0.xc_sh, write_unused, s);
    forward<E>(r1, j1.phi, j1.x, j1.work, j1.xc, j1.xc_st, j1.xc_sh, write_unused, s);
    return;
  }
  const Job jobs[2] = {j0, j1};
  products<E>(r0, jobs, 2, write_unused, s);
}

template <typename E>
bool backward_params(const Rows& r, const PhiParams& phi, const TensorView& x, const float* dy, float* pre,
                     const PhiParams& dphi, float* part, int splits, float* colsum, uint16_t* g16, cudaStream_t s) {
  if (r.kind == PhiKind::mean) return false;
  const int64_t M = r.rc * r.hkv;
  const int K = r.l * r.D, D = r.D;
  const bool direct = g16 != nullptr && direct_products<E>(r, phi, x);
  const E* pe = static_cast<const E*>(phi.pe.data);
  auto reduce_to = [&](int rows, int cols, const TensorView& out, const E* outer, int parts) {
    reduce_parts_kernel<E><<<blocks_for(int64_t(rows) * cols), 256, 0, s>>>(part, parts, rows, cols,
                                                                            static_cast<E*>(out.data), out.stride[0],
                                                                            colsum, outer);
    NSA_CUDA_CHECK_LAUNCH();
  };
  // dW [N, l*D] = g^T u for g [M, N] (linear: dy; mlp: dpre) with its column sums in colsum.
  auto weight_grad = [&](const float* g, int N, const TensorView& out) {
    if constexpr (std::is_same_v<E, bf16>) {
      if (direct) {  // g in bf16, then g^T x, then + colsum(g) pe in the reduction
        bf16* gb = reinterpret_cast<bf16*>(g16);
        round_bf16_kernel<<<capped_blocks(M * N), 256, 0, s>>>(g, M * N, gb);
        NSA_CUDA_CHECK_LAUNCH();
        if (blas_products<E>(r, phi, x)) {  // dW_s = g^T u_s into the columns s d D .. of one partial
          const BlasScratch bs = blas_scratch(r);
          const int64_t dD = int64_t(r.d) * r.D;
          gather_chunks(r, x, bs, s);
          for (int i = 0; i < bs.S; ++i)  // g [M, N] as stored: A^T
            blas::matmul(blas::product(N, dD, M, {gb, N, true}, {bs.xg + i * r.hkv * dD, dD}, part + i * dD, K), bs.ws,
                         s);
          reduce_to(N, K, out, pe, 1);
          return;
        }
        const XBlockBT b{{static_cast<const bf16*>(x.data)}, x_rows<bf16>(r, x)};
        gemm_direct(s, N, K, int(M), splits, 1, GradAT{{gb}, N}, b, StorePartial{part, K, int64_t(N) * K}, r.wgmma);
        reduce_to(N, K, out, pe, splits);
        return;
      }
    }
    gemm(s, N, K, int(M), splits, 1, Cols32<false>{g, N}, BlockInputT<E>{block_input<E>(r, phi, x)},
         StorePartial{part, K, int64_t(N) * K});
    reduce_to(N, K, out, nullptr, splits);
  };
  auto pe_grad = [&](int N) {  // dpe = W^T colsum
    pe_grad_kernel<E><<<unsigned((K + 31) / 32), 32 * kPeWarps, 0, s>>>(static_cast<const E*>(phi.w1.data), phi.w1.stride[0], N, K, colsum,
                                                    static_cast<E*>(dphi.pe.data));
    NSA_CUDA_CHECK_LAUNCH();
  };
  if (r.kind == PhiKind::linear) {
    // dW [D, l*D] = dy^T u; dpe = W^T (column sums of dy).
    column_sum<E>(dy, M, D, colsum, nullptr, s);
    weight_grad(dy, D, dphi.w1);
    pe_grad(D);
    return direct;
  }
  const int F = r.F;
  // db2 = column sums of dy; dW2 [D, F] = dy^T gelu(pre). Its few C tiles (D / 128 x F / 64) take
  // more row splits than the other products: one per 128 rows, up to 64, within the partial buffer
  // (splits x the largest parameter, at least F l D floats: splits l of dW2's D F).
  const int w2_splits = int(std::clamp<int64_t>(M / 128, splits, std::min<int64_t>(64, int64_t(splits) * r.l)));
  column_sum<E>(dy, M, D, colsum, static_cast<E*>(dphi.b2.data), s);
  if (direct && blas_products<E>(r, phi, x)) {  // both in fp32 on cuBLASLt, on gelu(pre) and W2 in fp32
    const BlasScratch bs = blas_scratch(r);
    gelu_and_w2_f32<E>(pre, M, phi, D, F, bs, s);
    // dW2 = dy^T gelu(pre) into one partial (dy [M, D] as stored: A^T)
    blas::matmul(blas::product_f32(D, F, M, {dy, D, true}, {bs.h, F}, part, F), bs.ws, s);
    reduce_to(D, F, dphi.w2, nullptr, 1);
    // dy W2, over gelu(pre) (read by the product above, on the same stream)
    blas::matmul(blas::product_f32(M, F, D, {dy, D}, {bs.w2, F}, bs.h, F), bs.ws, s);
    // dpre = (dy W2) gelu'(pre), in place.
    blas_store_kernel<<<capped_blocks(M * F), 256, 0, s>>>(bs.h, M, F, nullptr, r.hkv, StoreDpre{pre, F});
    NSA_CUDA_CHECK_LAUNCH();
  } else {
    gemm(s, D, F, int(M), w2_splits, 1, Cols32<false>{dy, D}, Cols32<true>{pre, F},
         StorePartial{part, F, int64_t(D) * F});
    reduce_to(D, F, dphi.w2, nullptr, w2_splits);
    // dpre = (dy W2) gelu'(pre), in place.
    gemm(s, M, F, D, 1, 1, Rows32<false>{dy, D}, Weight<E>{static_cast<const E*>(phi.w2.data), phi.w2.stride[0]},
         StoreDpre{pre, F});
  }
  // db1 = column sums of dpre; dW1 [F, l*D] = dpre^T u; dpe = W1^T db1.
  column_sum<E>(pre, M, F, colsum, static_cast<E*>(dphi.b1.data), s);
  weight_grad(pre, F, dphi.w1);
  pe_grad(F);
  return direct;
}

template <typename E>
void backward_x(const Rows& r, const PhiParams& phi, const float* dy, const float* dpre, const uint16_t* g16,
                const int32_t* slots, int64_t n_slots, const DxOut& out, cudaStream_t s) {
  if (n_slots == 0) return;
  const int S = (r.l - 1) / r.d + 1;  // blocks that can hold one token
  const int batches = r.d * r.hkv;
  const int4* sl = reinterpret_cast<const int4*>(slots);
  const DxRows rows{sl, r.hkv, r.l, r.d};
  const StoreDx<E> st{sl, r.hkv, r.D, out};
  if (r.kind == PhiKind::mean) {
    // Four columns a thread where dy's rows and dx's start on 16 (fp32) or 8 bytes, else one.
    const bool runs = r.D % 4 == 0 && on16(dy) &&
                      (out.f32 ? on16(out.p) : on8(out.p) && out.s0 % 4 == 0 && out.s1 % 4 == 0);
    if (runs) mean_dx_kernel<E, 4><<<capped_blocks(n_slots * batches * r.D / 4), 256, 0, s>>>(rows, dy, r.D, n_slots, out);
    else mean_dx_kernel<E, 1><<<capped_blocks(n_slots * batches * r.D), 256, 0, s>>>(rows, dy, r.D, n_slots, out);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const bool mlp = r.kind == PhiKind::mlp;
  const int F = mlp ? r.F : r.D;
  if constexpr (std::is_same_v<E, bf16>) {
    if (g16 != nullptr && blas_rows(r)) {
      // By chunk: dxg = sum_s (g W1_s) s Hkv rows down, then each token's row of its chunk. (The
      // rows below the first product's are chunks no block holds completely, read by no token;
      // zeroed so that the sums read no uninitialised memory.)
      const BlasScratch bs = blas_scratch(r);
      const int64_t M = r.rc * r.hkv, dD = int64_t(r.d) * r.D;
      NSA_CUDA_CHECK(cudaMemsetAsync(bs.dxg + M * dD, 0, size_t(bs.chunk_rows - M) * dD * sizeof(float), s));
      for (int i = 0; i < bs.S; ++i)  // W1_s [F, d D] as stored
        blas::matmul(blas::product(M, dD, F, {g16, F}, {static_cast<const bf16*>(phi.w1.data) + i * dD, phi.w1.stride[0]},
                                   bs.dxg + i * r.hkv * dD, dD, i == 0 ? 0.f : 1.f),
                     bs.ws, s);
      const bool runs = r.D % 4 == 0 && (out.f32 ? on16(out.p) : on8(out.p) && out.s0 % 4 == 0 && out.s1 % 4 == 0);
      const int64_t per_slot = int64_t(r.d) * r.hkv * r.D;
      if (runs)
        chunk_scatter_dx_kernel<E, 4><<<capped_blocks(n_slots * per_slot / 4), 256, 0, s>>>(
            bs.dxg, sl, n_slots, r.first_token, r.rc, bs.S, r.d, r.hkv, r.D, out);
      else
        chunk_scatter_dx_kernel<E, 1><<<capped_blocks(n_slots * per_slot), 256, 0, s>>>(
            bs.dxg, sl, n_slots, r.first_token, r.rc, bs.S, r.d, r.hkv, r.D, out);
      NSA_CUDA_CHECK_LAUNCH();
      return;
    }
    if (g16 != nullptr) {
      const DxGradA a{{reinterpret_cast<const bf16*>(g16)}, rows, F};
      const DxWeightBT b{{static_cast<const bf16*>(phi.w1.data)}, phi.w1.stride[0], F, r.hkv, r.d, r.l, r.D};
      gemm_direct(s, n_slots, r.D, S * F, 1, batches, a, b, st, r.wgmma);
      return;
    }
  }
  const DxGrad a{rows, mlp ? dpre : dy, F};
  const DxWeight<E> b{static_cast<const E*>(phi.w1.data), phi.w1.stride[0], F, r.hkv, r.d, r.l, r.D};
  gemm(s, n_slots, r.D, S * F, 1, batches, a, b, st);
}

#define NSA_PHI_INSTANTIATE(E)                                                                                    \
  template void forward<E>(const Rows&, const PhiParams&, const TensorView&, float*, void*, int64_t, int64_t, bool, \
                           cudaStream_t);                                                                         \
  template void forward_pair<E>(const Rows&, const Job&, const Rows&, const Job&, bool, bool, cudaStream_t);        \
  template bool backward_params<E>(const Rows&, const PhiParams&, const TensorView&, const float*, float*,         \
                                   const PhiParams&, float*, int, float*, uint16_t*, cudaStream_t);               \
  template void backward_x<E>(const Rows&, const PhiParams&, const float*, const float*, const uint16_t*,         \
                              const int32_t*, int64_t, const DxOut&, cudaStream_t);
NSA_PHI_INSTANTIATE(__nv_bfloat16)
NSA_PHI_INSTANTIATE(__half)
#undef NSA_PHI_INSTANTIATE

}  // namespace nsa::cuda::phi
