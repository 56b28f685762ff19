// Appending to a paged cache on the GPU (spec §10): the new tokens into the raw pools, then phi
// of every compressed block whose last token arrived.
//
// Slots: sequence b's k-th slot (k < blocks_per_seq, the most blocks one call can complete) is its
// compressed block N_c(old) + k, old = seq_lens[b] - (its new tokens); a slot past N_c(seq_lens[b])
// has nothing to do, so the launch shapes depend on the declared sizes only and a decode step
// without a completed block costs a few empty CTAs.
// phi is a stack of matrix-vector products, one output row per warp at a time: W's rows are read
// once per slot and head group (16-byte loads, the block's tokens staged in shared memory), and
// each output element is one warp's fp32 sum in a fixed order (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/decode/common.cuh"
#include "cuda/decode/decode.h"

namespace nsa::cuda::decode {

namespace {

constexpr int kScatterWarps = 4;
constexpr int kPhiThreads = 256;
constexpr int kPhiRowsPerCta = 32;  // output rows (of W) per CTA: 8 warps x 4
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi), GELU's tanh form
constexpr float kGeluA = 0.044715f;

// Reports bits for sequence b (once per warp or thread that found them).
__device__ __forceinline__ void report(const Pages& p, int b, int32_t bits) {
  if (bits != 0 && b >= 0 && b < p.batch) atomicOr(p.status + b, bits);
}

// One warp per (new token, array): the token's Hkv x D row into its page. Warp x < B of array 0
// also checks sequence x (reported even when no row resolves to it).
template <typename S>
__global__ void __launch_bounds__(kScatterWarps * 32) scatter_kernel(const AppendParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kScatterWarps + warp, a = blockIdx.y;
  if (row < p.pages.batch && a == 0 && lane == 0) report(p.pages, row, sequence_info(p.pages, row).bad);
  if (row >= p.pages.rows) return;
  const RowInfo ri = row_info(p.pages, row);
  if (!ri.ok) {
    if (lane == 0 && a == 0) report(p.pages, ri.seq.b, ri.seq.bad);
    return;
  }
  const int64_t page = page_of(p.pages, ri.seq.b, ri.t / p.pages.page_size);
  if (page < 0) {
    if (lane == 0 && a == 0) report(p.pages, ri.seq.b, kCacheBadPage);
    return;
  }
  const int pieces = p.dim[a] * static_cast<int>(sizeof(S)) / 16;
  const S* src = static_cast<const S*>(p.src[a]) + int64_t(row) * p.src_st[a];
  S* dst = static_cast<S*>(const_cast<void*>(p.dst[a].data)) + page * p.dst[a].page_st + (ri.t % p.pages.page_size) * p.dst[a].row_st;
  for (int e = lane; e < p.hkv * pieces; e += 32) {
    const int h = e / pieces, piece = e % pieces;
    reinterpret_cast<uint4*>(dst + h * p.dst[a].head_st)[piece] = reinterpret_cast<const uint4*>(src + h * p.src_sh[a])[piece];
  }
}

// Slot `slot`: its sequence, compressed block and the pages of its tokens; false when there is no
// block there or the sequence is bad (reported by the scatter kernel, or here for a page).
struct Slot {
  int b = 0;
  int64_t block = 0;
  int64_t out_page = -1;
};

__device__ __forceinline__ bool slot_of(const AppendParams& p, int slot, Slot& s, bool report_pages) {
  s.b = slot / p.blocks_per_seq;
  const SeqInfo q = sequence_info(p.pages, s.b);
  if (q.bad != 0) return false;
  const int64_t old = q.len - q.m;
  s.block = num_cmp_blocks(old, p.l, p.d) + slot % p.blocks_per_seq;
  if (s.block >= num_cmp_blocks(q.len, p.l, p.d)) return false;
  const int ps = p.pages.page_size;
  for (int64_t piece = s.block * p.d / ps; piece <= (s.block * p.d + p.l - 1) / ps; ++piece)
    if (page_of(p.pages, s.b, piece) < 0) {
      if (report_pages) report(p.pages, s.b, kCacheBadPage);
      return false;
    }
  s.out_page = page_of(p.pages, s.b, s.block * p.d / ps);
  return true;
}

template <typename S>
__device__ __forceinline__ S* cmp_row(const AppendParams& p, const PhiSide& side, const Slot& s, int h) {
  return static_cast<S*>(const_cast<void*>(side.cmp.data)) + s.out_page * side.cmp.page_st +
         cmp_block_slot(s.block, p.d, p.pages.page_size) * side.cmp.row_st + h * side.cmp.head_st;
}

// The slot's l token rows (head 0) of a raw pool into shared memory: every later load of a token
// is then independent of the page table's.
template <typename S>
__device__ __forceinline__ void stage_token_rows(const AppendParams& p, const Pool& pool, const Slot& s, const S** rows) {
  for (int r = threadIdx.x; r < p.l; r += blockDim.x)
    rows[r] = pool_row<S>(p.pages, pool, s.b, s.block * p.d + r, p.pages.page_size, 0);  // valid: slot_of checked
  __syncthreads();
}

// phi = mean: one CTA per (slot, side), one thread per (head, column).
template <typename S>
__global__ void __launch_bounds__(kPhiThreads) phi_mean_kernel(const AppendParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  Slot s;
  if (!slot_of(p, blockIdx.x, s, blockIdx.y == 0 && threadIdx.x == 0)) return;
  const PhiSide& side = p.side[blockIdx.y];
  const S** rows = reinterpret_cast<const S**>(smem);
  stage_token_rows<S>(p, side.raw, s, rows);
  for (int e = threadIdx.x; e < p.hkv * side.dim; e += kPhiThreads) {
    const int h = e / side.dim, c = e % side.dim;
    const int64_t at = h * side.raw.head_st + c;
    float sum = 0.f;
#pragma unroll 8
    for (int r = 0; r < p.l; ++r) sum += to_float(rows[r][at]);
    cmp_row<S>(p, side, s, h)[c] = from_float<S>(sum / static_cast<float>(p.l));
  }
}

enum class Layer { linear, mlp_hidden, mlp_out };

// acc[h] += W[k0 .. k0+8) . u[h][k0 .. k0+8) for the group's heads (8 weights in one 16-byte load).
template <typename S>
__device__ __forceinline__ void dot8(const S* w, const float* u, int K, int heads, int k0, float (&acc)[kMaxHeadsPerCta]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(w + k0);
  const S* w8 = reinterpret_cast<const S*>(&raw);
  float wf[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) wf[i] = to_float(w8[i]);
#pragma unroll
  for (int h = 0; h < kMaxHeadsPerCta; ++h) {
    if (h >= heads) break;
    const float4 a = *reinterpret_cast<const float4*>(u + h * K + k0);
    const float4 b = *reinterpret_cast<const float4*>(u + h * K + k0 + 4);
    acc[h] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y + wf[6] * b.z + wf[7] * b.w;
  }
}

// One layer of phi for a slot, a side and a group of heads: rows [32 y, 32 y + 32) of W times each
// head's input (flatten(block + pe), or the hidden layer), then the layer's bias and activation.
template <typename S, Layer kLayer>
__global__ void __launch_bounds__(kPhiThreads) phi_layer_kernel(const AppendParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int side_id = blockIdx.z % 2, h0 = (blockIdx.z / 2) * p.heads_per_cta;
  const PhiSide& side = p.side[side_id];
  const int D = side.dim, F = side.hidden;
  const int K = kLayer == Layer::mlp_out ? F : p.l * D;
  const int N = kLayer == Layer::mlp_hidden ? F : D;
  const int heads = p.hkv - h0 < p.heads_per_cta ? p.hkv - h0 : p.heads_per_cta;
  if (blockIdx.y * kPhiRowsPerCta >= N || heads <= 0) return;
  Slot s;
  if (!slot_of(p, blockIdx.x, s, side_id == 0 && blockIdx.y == 0 && h0 == 0 && threadIdx.x == 0)) return;
  // Inputs of the group's heads, [heads][K] fp32 (u = x + pe, or the hidden layer); K is padded to
  // a multiple of 4 floats so that every head's row starts on 16 bytes.
  const int Kp = (K + 3) / 4 * 4;
  float* u = reinterpret_cast<float*>(smem);
  if constexpr (kLayer == Layer::mlp_out) {
    for (int e = threadIdx.x; e < heads * K; e += kPhiThreads)
      u[(e / K) * Kp + e % K] = side.hidden_buf[(int64_t(blockIdx.x) * p.hkv + h0 + e / K) * F + e % K];
  } else {
    const S** rows = reinterpret_cast<const S**>(u + heads * Kp);
    stage_token_rows<S>(p, side.raw, s, rows);
    const S* pe = static_cast<const S*>(side.pe);
#pragma unroll 4
    for (int e = threadIdx.x; e < heads * K; e += kPhiThreads) {
      const int h = e / K, k = e % K, r = k / D, c = k % D;
      u[h * Kp + k] = to_float(rows[r][(h0 + h) * side.raw.head_st + c]) + to_float(pe[k]);
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const S* w = static_cast<const S*>(kLayer == Layer::mlp_out ? side.w2 : side.w1);
  // 16-byte loads of W where its rows allow (K a multiple of 8 and W on 16 bytes).
  const bool vec = K % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  for (int i = 0; i < kPhiRowsPerCta / (kPhiThreads / 32); ++i) {
    const int n = blockIdx.y * kPhiRowsPerCta + warp * (kPhiRowsPerCta / (kPhiThreads / 32)) + i;
    if (n >= N) break;
    const S* wrow = w + int64_t(n) * K;
    float acc[kMaxHeadsPerCta] = {};
    if (vec) {
#pragma unroll 2
      for (int k0 = lane * 8; k0 < K; k0 += 256) dot8<S>(wrow, u, Kp, heads, k0, acc);
    } else {
      for (int k = lane; k < K; k += 32) {
        const float wk = to_float(wrow[k]);
#pragma unroll
        for (int h = 0; h < kMaxHeadsPerCta; ++h)
          if (h < heads) acc[h] += wk * u[h * Kp + k];
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxHeadsPerCta; ++h) {
      if (h >= heads) break;
      float y = warp_sum(acc[h]);
      if (lane != 0) continue;
      if constexpr (kLayer == Layer::mlp_hidden) {
        y += to_float(static_cast<const S*>(side.b1)[n]);
        side.hidden_buf[(int64_t(blockIdx.x) * p.hkv + h0 + h) * F + n] = 0.5f * y * (1.f + tanhf(kGeluC * (y + kGeluA * y * y * y)));
      } else {
        if constexpr (kLayer == Layer::mlp_out) y += to_float(static_cast<const S*>(side.b2)[n]);
        cmp_row<S>(p, side, s, h0 + h)[n] = from_float<S>(y);
      }
    }
  }
}

template <typename S, Layer kLayer>
void launch_layer(const AppendParams& p, int slots, int rows, size_t smem, cudaStream_t stream) {
  NSA_CUDA_CHECK(cudaFuncSetAttribute(phi_layer_kernel<S, kLayer>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  const int groups = (p.hkv + p.heads_per_cta - 1) / p.heads_per_cta;
  const dim3 grid(slots, (rows + kPhiRowsPerCta - 1) / kPhiRowsPerCta, 2 * groups);
  phi_layer_kernel<S, kLayer><<<grid, kPhiThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t phi_layer_smem(int heads_per_cta, int64_t k) {
  return sizeof(float) * static_cast<size_t>(heads_per_cta * ((k + 3) / 4 * 4)) + sizeof(void*) * kMaxBlockTokens;
}

template <typename S>
void launch_append(const AppendParams& p, cudaStream_t stream) {
  const int scatter_rows = p.pages.rows > p.pages.batch ? p.pages.rows : p.pages.batch;
  if (scatter_rows > 0) {
    const dim3 grid((scatter_rows + kScatterWarps - 1) / kScatterWarps, p.arrays);
    scatter_kernel<S><<<grid, kScatterWarps * 32, 0, stream>>>(p);
    NSA_CUDA_CHECK_LAUNCH();
  }
  const int slots = p.pages.batch * p.blocks_per_seq;
  if (slots == 0) return;
  const int dmax = p.side[0].dim > p.side[1].dim ? p.side[0].dim : p.side[1].dim;
  const int fmax = p.side[0].hidden > p.side[1].hidden ? p.side[0].hidden : p.side[1].hidden;
  switch (static_cast<PhiKind>(p.kind)) {
    case PhiKind::mean:
      phi_mean_kernel<S><<<dim3(slots, 2), kPhiThreads, sizeof(void*) * p.l, stream>>>(p);
      NSA_CUDA_CHECK_LAUNCH();
      return;
    case PhiKind::linear:
      launch_layer<S, Layer::linear>(p, slots, dmax, phi_layer_smem(p.heads_per_cta, int64_t(p.l) * dmax), stream);
      return;
    case PhiKind::mlp:
      launch_layer<S, Layer::mlp_hidden>(p, slots, fmax, phi_layer_smem(p.heads_per_cta, int64_t(p.l) * dmax), stream);
      launch_layer<S, Layer::mlp_out>(p, slots, dmax, phi_layer_smem(p.heads_per_cta, fmax), stream);
      return;
  }
}

template void launch_append<__nv_bfloat16>(const AppendParams&, cudaStream_t);
template void launch_append<__half>(const AppendParams&, cudaStream_t);

}  // namespace nsa::cuda::decode
