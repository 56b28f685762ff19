// Decode, stage 4 of 4: for one (query, query head), each branch's partials merged in split order
// (their (m, l) staged in shared memory, one warp per branch for the maximum and the sum, then
// every column's rescaled sum over the splits in order), the gated sum of spec §7, and the outputs the caller
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

template <typename S>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const DecodeParams p) {
  extern __shared__ float smem[];  // the splits' m, then their factors exp2(m_s - M) / L (0: empty)
  __shared__ float s_lse[3];
  const int row = blockIdx.x, h = blockIdx.y, G = p.group, hk = h / G, g = h % G, Dv = p.dv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool ok = p.row_ok[row] != 0;
  // The branches: (ml, o partial, splits) of cmp, slc, win, their splits one after the other.
  const int slc = p.dense ? 0 : p.slc_ctas, sw = slc + p.win_splits;  // selection pieces, all pieces
  const int64_t cmp_item = (int64_t(row) * p.hkv + hk) * p.cmp_splits, sw_item = (int64_t(row) * p.hkv + hk) * sw;
  const float* ml[3] = {p.cmp_ml + (cmp_item * G + g) * 2, p.sw_ml + (sw_item * G + g) * 2,
                        p.sw_ml + ((sw_item + slc) * G + g) * 2};
  const float* op[3] = {p.cmp_o + (cmp_item * G + g) * Dv, p.sw_o + (sw_item * G + g) * Dv,
                        p.sw_o + ((sw_item + slc) * G + g) * Dv};
  const int count[3] = {p.dense ? 0 : p.cmp_splits, slc, p.win_splits};
  const int first[3] = {0, count[0], count[0] + count[1]}, total = first[2] + count[2];
  float* sm = smem;           // [total] m of every split
  float* sl = smem + total;   // [total] its l, then its factor
  if (ok)
    for (int i = threadIdx.x; i < total; i += kCombineThreads) {
      const int br = i < first[1] ? 0 : i < first[2] ? 1 : 2, s = i - first[br];
      sm[i] = ml[br][int64_t(s) * 2 * G];
      sl[i] = ml[br][int64_t(s) * 2 * G + 1];
    }
  __syncthreads();
  // One warp per branch: its maximum and sum over the splits (fixed shuffle order), then factors.
  if (warp < 3) {
    float lse = kNegInf;
    if (ok && count[warp] > 0) {
      const int f0 = first[warp], n = count[warp];
      float M = kNegInf;
      for (int s = lane; s < n; s += 32) M = fmaxf(M, sm[f0 + s]);
      M = warp_max(M);
      float L = 0.f;
      if (M != kNegInf)
        for (int s = lane; s < n; s += 32)
          if (sm[f0 + s] != kNegInf) L += sl[f0 + s] * exp2f(sm[f0 + s] - M);
      L = warp_sum(L);
      __syncwarp();
      for (int s = lane; s < n; s += 32)
        sl[f0 + s] = M != kNegInf && L > 0.f && sm[f0 + s] != kNegInf ? exp2f(sm[f0 + s] - M) / L : 0.f;
      if (M != kNegInf && L > 0.f) lse = (M + log2f(L)) * kLn2;
    }
    if (lane == 0) s_lse[warp] = lse;
  }
  __syncthreads();
  float gate[3] = {0.f, 0.f, 1.f};
  if (!p.dense)
    for (int br = 0; br < 3; ++br)
      gate[br] = to_float(static_cast<const S*>(p.g)[int64_t(row) * p.g_st + int64_t(h) * p.g_sh + br * p.g_sb]);
  S* o = static_cast<S*>(p.o) + int64_t(row) * p.o_st + int64_t(h) * p.o_sh;
  const int64_t o_stride = int64_t(G) * Dv;
  for (int c = threadIdx.x; c < Dv; c += kCombineThreads) {
    float sum = 0.f;
    for (int br = 0; br < 3; ++br) {
      float ob = 0.f;
      if (ok) {
        const float* f = sl + first[br];
        const float* part = op[br] + c;
        // Eight splits' values loaded at once (the workspace is allocated memory; an empty split's
        // garbage is loaded but not used), then added in split order.
        for (int s0 = 0; s0 < count[br]; s0 += 8) {
          float x[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) x[i] = s0 + i < count[br] ? part[(s0 + i) * o_stride] : 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (s0 + i < count[br] && f[s0 + i] != 0.f) ob += f[s0 + i] * x[i];
        }
      }
      sum += gate[br] * ob;
      if (p.o_branch != nullptr)
        static_cast<S*>(p.o_branch)[br * p.ob_sb + int64_t(row) * p.ob_st + int64_t(h) * p.ob_sh + c] = from_float<S>(ob);
    }
    o[c] = from_float<S>(sum);
  }
  if (p.lse != nullptr && threadIdx.x == 0) {
    float* l = p.lse + int64_t(row) * p.lse_st + int64_t(h) * p.lse_sh;
    if (p.dense) l[0] = s_lse[2];
    else
      for (int br = 0; br < 3; ++br) l[br * p.lse_sb] = s_lse[br];
  }
}

}  // namespace

template <typename S>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.pages.rows, p.hkv * p.group);
  const size_t smem = 2 * sizeof(float) * static_cast<size_t>((p.dense ? 0 : p.cmp_splits + p.slc_ctas) + p.win_splits);
  NSA_CUDA_CHECK(cudaFuncSetAttribute(combine_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  combine_kernel<S><<<grid, kCombineThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

template void launch_combine<__nv_bfloat16>(const DecodeParams&, cudaStream_t);
template void launch_combine<__half>(const DecodeParams&, cudaStream_t);

}  // namespace nsa::cuda::decode
