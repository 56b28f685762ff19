// The rotary kernel (rotary.h). Each thread owns one chunk of kVec channel pairs of one token and
// a group of heads: it computes the chunk's angles, cos and sin once, then rotates the chunk of
// every head of its group. One thread per token looks its position up (positions[t], or a binary
// search of cu_seqlens), shared through shared memory.
//
// The arithmetic is the operation's definition (api.h), as torch computes it in fp32: the angle
// float(pos) * inv_freq[i] rounded to fp32, the accurate cosf and sinf (never __cosf/__sinf; the
// library is not built with fast math), two products and one difference or sum each rounded on
// its own (__fmul_rn, __fsub_rn, __fadd_rn: never contracted into an FMA), then one rounding to
// the storage dtype.
#include "cuda/rotary/rotary.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/tile_sizes.h"

namespace nsa::cuda::rotary {

namespace {

// kVec consecutive elements, aligned to their size: one 16-byte access for kVec = kVecPairs.
template <typename S, int kVec>
struct alignas(kVec * sizeof(S)) Pack {
  S e[kVec];
};

// Position of token t (as the operation reads it: positions[t], else t - cu_seqlens[b]).
__device__ __forceinline__ int64_t position_of(const Params& p, int64_t t) {
  if (p.positions != nullptr) return p.positions[t];
  const int32_t* cu = p.seqs.cu_seqlens;
  if (cu == nullptr) return t;
  // The last sequence b < B with cu[b] <= t (cu[0] = 0 <= t): an empty sequence before t's own
  // starts at the same offset and is passed over. Reads stay within cu[0 .. B - 1].
  int lo = 0, hi = p.seqs.batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(cu + mid) <= t) lo = mid;
    else hi = mid;
  }
  return t - __ldg(cu + lo);
}

template <typename S, int kVec>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const Params p, const int64_t heads_per_group) {
  __shared__ float token_pos[kThreads];  // float(position) of each of the CTA's tokens
  const int64_t T = p.seqs.total_tokens;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (threadIdx.x == 0 && t < T) token_pos[threadIdx.y] = static_cast<float>(position_of(p, t));
  __syncthreads();
  if (t >= T) return;
  const float pos = token_pos[threadIdx.y];
  const int64_t head0 = int64_t(blockIdx.y) * heads_per_group;
  const int64_t head1 = head0 + heads_per_group < p.H ? head0 + heads_per_group : p.H;
  const S* x = static_cast<const S*>(p.x) + t * p.x_st;
  S* out = static_cast<S*>(p.out) + t * p.o_st;
  const int64_t chunks = p.h / kVec;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int64_t i0 = c * kVec;
    float cs[kVec], sn[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const float angle = __fmul_rn(pos, __ldg(p.inv_freq + i0 + v));
      // cosf and sinf as torch calls them (not sincosf, so that the bits are the same functions').
      cs[v] = cosf(angle);
      sn[v] = p.inverse ? -sinf(angle) : sinf(angle);
    }
    for (int64_t head = head0; head < head1; head += kHeadBatch) {
      // Every load of the batch before any store: out may be x itself, and the batch's elements
      // are this thread's alone.
      Pack<S, kVec> a[kHeadBatch], b[kHeadBatch];
#pragma unroll
      for (int j = 0; j < kHeadBatch; ++j) {
        if (head + j >= head1) break;
        const S* src = x + (head + j) * p.x_sh + i0;
        a[j] = *reinterpret_cast<const Pack<S, kVec>*>(src);
        b[j] = *reinterpret_cast<const Pack<S, kVec>*>(src + p.h);
      }
#pragma unroll
      for (int j = 0; j < kHeadBatch; ++j) {
        if (head + j >= head1) break;
        Pack<S, kVec> o1, o2;
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          const float x1 = to_float(a[j].e[v]), x2 = to_float(b[j].e[v]);
          o1.e[v] = from_float<S>(__fsub_rn(__fmul_rn(x1, cs[v]), __fmul_rn(x2, sn[v])));
          o2.e[v] = from_float<S>(__fadd_rn(__fmul_rn(x2, cs[v]), __fmul_rn(x1, sn[v])));
        }
        S* dst = out + (head + j) * p.o_sh + i0;
        *reinterpret_cast<Pack<S, kVec>*>(dst) = o1;
        *reinterpret_cast<Pack<S, kVec>*>(dst + p.h) = o2;
      }
    }
  }
}

// Whether every access of the vector path is a 16-byte aligned one: h a multiple of kVecPairs
// (the second half starts on a chunk too) and every row (token, head) of x and out starting on
// 16 bytes (the stride of a dimension of extent 1 is never applied).
template <typename S>
bool vector_path(const Params& p) {
  constexpr int64_t kElems = 16 / sizeof(S);
  static_assert(kElems == kVecPairs, "a chunk's half is one 16-byte access");
  const bool tokens = p.seqs.total_tokens <= 1 || (p.x_st % kElems == 0 && p.o_st % kElems == 0);
  const bool heads = p.H <= 1 || (p.x_sh % kElems == 0 && p.o_sh % kElems == 0);
  return p.h % kVecPairs == 0 && tokens && heads && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
}

}  // namespace

template <typename S>
void launch(const Params& p, cudaStream_t stream) {
  const bool vec = vector_path<S>(p);
  const Shape s = shape_of(p.seqs.total_tokens, p.H, vec ? p.h / kVecPairs : p.h);
  const dim3 grid(static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y));
  const dim3 block(static_cast<unsigned>(s.lanes), static_cast<unsigned>(s.tokens));
  if (vec) rotary_kernel<S, kVecPairs><<<grid, block, 0, stream>>>(p, s.heads_per_group);
  else rotary_kernel<S, 1><<<grid, block, 0, stream>>>(p, s.heads_per_group);
  NSA_CUDA_CHECK_LAUNCH();
}

template void launch<__nv_bfloat16>(const Params&, cudaStream_t);
template void launch<__half>(const Params&, cudaStream_t);

}  // namespace nsa::cuda::rotary
