// Decode, stage 4 of 4: for one (query, query head), each branch's partials merged in split order
// (max, then the rescaled sums and outputs), the gated sum of spec §7, and the outputs the caller
// asked for (o; lse per branch; o_branch). A query whose sequence failed the checks of select.cu
// (row_ok = 0) gets zeros and lse = -inf. Dense decoding: o is the window branch, which covers
// every token.
//
// Grid (queries, Hq); one thread per output column.
#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/decode/common.cuh"
#include "cuda/decode/decode.h"

namespace nsa::cuda::decode {

namespace {

constexpr int kCombineThreads = 128;

// Merges splits [0, count) of one head: out[c] for this thread's columns, and the lse (natural log).
struct Merged {
  float M = kNegInf, L = 0.f;
};

__device__ __forceinline__ Merged merge_stats(const float* ml, int stride, int count) {
  Merged r;
  for (int s = 0; s < count; ++s) r.M = fmaxf(r.M, ml[s * stride]);
  if (r.M == kNegInf) return r;
  for (int s = 0; s < count; ++s) {
    const float m = ml[s * stride];
    if (m != kNegInf) r.L += ml[s * stride + 1] * exp2f(m - r.M);
  }
  return r;
}

__device__ __forceinline__ float merge_column(const Merged& st, const float* ml, int ml_stride, const float* o,
                                              int64_t o_stride, int count, int c) {
  if (st.M == kNegInf || !(st.L > 0.f)) return 0.f;
  float acc = 0.f;
  for (int s = 0; s < count; ++s) {
    const float m = ml[s * ml_stride];
    if (m != kNegInf) acc += exp2f(m - st.M) * o[s * o_stride + c];
  }
  return acc / st.L;
}

__device__ __forceinline__ float lse_of(const Merged& st) {
  return st.M == kNegInf || !(st.L > 0.f) ? kNegInf : (st.M + log2f(st.L)) * kLn2;
}

template <typename S>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const DecodeParams p) {
  const int row = blockIdx.x, h = blockIdx.y, G = p.group, hk = h / G, g = h % G, Dv = p.dv;
  const bool ok = p.row_ok[row] != 0;
  S* o = static_cast<S*>(p.o) + int64_t(row) * p.o_st + int64_t(h) * p.o_sh;
  // The branches: (ml, o partial, splits) of cmp, slc, win.
  const int n_sel = p.dense ? 0 : p.n_sel, sw = n_sel + p.win_splits;
  const float* ml[3] = {p.cmp_ml + ((int64_t(row) * p.hkv + hk) * p.cmp_splits * G + g) * 2,
                        p.sw_ml + ((int64_t(row) * p.hkv + hk) * sw * G + g) * 2,
                        p.sw_ml + (((int64_t(row) * p.hkv + hk) * sw + n_sel) * G + g) * 2};
  const float* op[3] = {p.cmp_o + ((int64_t(row) * p.hkv + hk) * p.cmp_splits * G + g) * Dv,
                        p.sw_o + ((int64_t(row) * p.hkv + hk) * sw * G + g) * Dv,
                        p.sw_o + (((int64_t(row) * p.hkv + hk) * sw + n_sel) * G + g) * Dv};
  const int count[3] = {p.dense ? 0 : p.cmp_splits, n_sel, p.win_splits};
  Merged st[3];
  if (ok)
    for (int br = 0; br < 3; ++br) st[br] = merge_stats(ml[br], 2 * G, count[br]);
  float gate[3] = {0.f, 0.f, 1.f};
  if (!p.dense)
    for (int br = 0; br < 3; ++br)
      gate[br] = to_float(static_cast<const S*>(p.g)[int64_t(row) * p.g_st + int64_t(h) * p.g_sh + br * p.g_sb]);
  for (int c = threadIdx.x; c < Dv; c += kCombineThreads) {
    float sum = 0.f;
    for (int br = 0; br < 3; ++br) {
      const float ob = ok ? merge_column(st[br], ml[br], 2 * G, op[br], int64_t(G) * Dv, count[br], c) : 0.f;
      sum += gate[br] * ob;
      if (p.o_branch != nullptr)
        static_cast<S*>(p.o_branch)[br * p.ob_sb + int64_t(row) * p.ob_st + int64_t(h) * p.ob_sh + c] = from_float<S>(ob);
    }
    o[c] = from_float<S>(sum);
  }
  if (p.lse != nullptr && threadIdx.x == 0) {
    float* l = p.lse + int64_t(row) * p.lse_st + int64_t(h) * p.lse_sh;
    if (p.dense) l[0] = lse_of(st[2]);
    else
      for (int br = 0; br < 3; ++br) l[br * p.lse_sb] = lse_of(st[br]);
  }
}

}  // namespace

template <typename S>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.pages.rows, p.hkv * p.group);
  combine_kernel<S><<<grid, kCombineThreads, 0, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

template void launch_combine<__nv_bfloat16>(const DecodeParams&, cudaStream_t);
template void launch_combine<__half>(const DecodeParams&, cudaStream_t);

}  // namespace nsa::cuda::decode
