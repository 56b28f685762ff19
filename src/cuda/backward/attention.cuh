// Attention kernels of the CUDA backward (docs/cuda_backward.md).
//
// Every branch is softmax attention over a set of keys; the backward of one (row tile, key tile)
// pair is four small matrix products on the tensor cores (WMMA, 16x16x16, fp32 accumulation):
//   S = Q K^T,  P = exp(scale S - lse) (masked),  dP = dO V^T,
//   dS = g P (dP - dg),  dQ += scale dS K,  dK += scale dS^T Q,  dV += (g P)^T dO
// where g is the branch gate and dg = <dO, o_branch> (= the usual rowsum(dO_b * o_b) / g).
//
// A row tile holds kRows = 64 rows: kRows / G consecutive query tokens of one sequence times the
// G query heads of one KV head, so every key row loaded serves G heads. Two kernels, neither with
// floating-point atomics:
//   dq_kernel        query-centric: per row tile, (1) recompute each branch's output from lse to
//                    get dg, (2) sum the three branches' dQ in registers, write dq once.
//   dkv_kernel       key-centric: per key tile, loop over the query tiles that see it; raw keys
//                    (window + selection, the latter through the inverted index) or compressed
//                    keys (split over query ranges, partial sums reduced in a fixed order later).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "nsa/api.h"
#include "nsa/blocks.h"

namespace nsa::cuda_bwd {

constexpr int kRows = 64;            // query rows per tile (tokens x heads of one group)
constexpr int kKeys = 64;            // keys per tile
constexpr int kWarps = kRows / 16;   // each warp owns 16 rows (or 16 keys)
constexpr int kThreads = 32 * kWarps;
constexpr int kPad = 8;              // 16-bit elements of padding per shared row (16 bytes)
constexpr int kLdF = kKeys + 4;      // row pitch of the fp32 score tiles
constexpr int kLdP = kKeys + kPad;   // row pitch of the 16-bit probability tiles
constexpr float kLog2e = 1.4426950408889634f;

// A [N, H, D] tensor with a contiguous last dimension (element strides of the first two).
struct Mat3 {
  const void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
};
struct OutMat3 {
  void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
};

// phi's gradient reaching the raw keys (shared_kv fuses it into the raw dk/dv epilogue).
struct PhiDxArgs {
  int kind = 0;              // PhiKind
  const float* dy = nullptr;    // [Rc, Hkv, D] dLoss/d(phi output), fp32
  const float* dpre = nullptr;  // [Rc, Hkv, F] dLoss/d(W1 u + b1) (mlp)
  const void* w = nullptr;      // linear: W [D, l*D]; mlp: W1 [F, l*D]
  int64_t w_s0 = 0;
  int F = 0;
};

struct BwdArgs {
  int dtype = 0;  // 0 bf16, 1 f16
  int64_t T = 0, max_seqlen = 0;
  int B = 1;
  const int32_t* cu = nullptr;  // [B+1] device
  int hq = 0, hkv = 0, G = 1, dqk = 0, dv = 0;
  int l = 32, d = 16, lp = 64, n = 16, n_init = 1, n_local = 2, w = 512;
  int n_slc_max = 0;  // ceil(max_seqlen / l')
  float scale = 0.f;
  bool shared_kv = false;
  bool vec = true;    // every 16-bit tensor is 16-byte aligned with strides % 8 == 0

  Mat3 q, d_o, g, lse;       // g [T, Hq, 3], lse [T, Hq, 3] f32
  Mat3 k[3], v[3];           // raw K/V per branch (cmp entry unused here)
  Mat3 indices;              // [T, Hkv, n] int32
  const void* kc = nullptr;  // [Rc, Hkv, Dqk] 16-bit, contiguous
  const void* vc = nullptr;  // [Rc, Hkv, Dv]
  float* dg32 = nullptr;     // [T, Hq, 3] dg in fp32 (read by dkv_kernel)
  OutMat3 dq, dg;
  OutMat3 grad_k[3], grad_v[3];      // raw gradients (cmp entry: written only in shared mode)
  // Inverted selection index: for key (hk * B + b) * n_slc_max + j, the packed tokens that
  // selected block j of sequence b for KV head hk are sel_tokens[sel_offsets[key] .. [key+1]).
  const int32_t* sel_tokens = nullptr;
  const int32_t* sel_offsets = nullptr;
  // Compressed branch: partial dkc/dvc per query split, [splits][Rc, Hkv, D] fp32.
  float* dkc_part = nullptr;
  float* dvc_part = nullptr;
  int cmp_splits = 1;
  // Forced initial blocks (j < n_init) are selected by every later query: one block's list is
  // as long as the sequence, a serial tail for the one block that owns it. When the list is
  // exactly that range, its query tiles are split over slc_splits blocks (0: off) whose fp32
  // partials [slc_splits][B * n_init * lp_pad, Hkv, D] the owner adds in split order.
  float* slc_part_k = nullptr;
  float* slc_part_v = nullptr;
  int slc_splits = 0;
  int lp_pad = 64;  // l' rounded up to whole key tiles
  int64_t rc = 0;  // rows of the compressed tensors, floor(T / d)
  PhiDxArgs phi_k, phi_v;
};

// ---- small device helpers ----------------------------------------------------------------

using cuda::to_float;
using cuda::from_float;

template <typename E>
__device__ __forceinline__ float load_f32(const void* base, int64_t i) {
  return to_float(static_cast<const E*>(base)[i]);
}

__device__ __forceinline__ int64_t seq_start(const int32_t* cu, int b) { return cu[b]; }

// Copies up to kRows rows of D elements into shared [kRows][D + kPad]; row r comes from
// row_ptr(r) (nullptr: zeros).
template <typename E, int D, typename RowPtr>
__device__ __forceinline__ void load_rows(E* dst, RowPtr row_ptr, bool vec) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunks = D / 8;
    for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
      const int r = e / kChunks, c = (e % kChunks) * 8;
      const E* src = row_ptr(r);
      uint4 val = make_uint4(0, 0, 0, 0);
      if (src != nullptr) val = *reinterpret_cast<const uint4*>(src + c);
      *reinterpret_cast<uint4*>(dst + r * kLd + c) = val;
    }
  } else {
    for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
      const int r = e / D, c = e % D;
      const E* src = row_ptr(r);
      dst[r * kLd + c] = src != nullptr ? src[c] : from_float<E>(0.f);
    }
  }
}

namespace wm = nvcuda::wmma;
using FragC = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// out[16 x 64] (fp32, pitch kLdF) = A[16 x D] B[64 x D]^T for the calling warp.
template <typename E, int D>
__device__ __forceinline__ void warp_abt(const E* A, const E* Bm, float* out) {
  constexpr int kLd = D + kPad;
  FragC acc[kKeys / 16];
#pragma unroll
  for (int n = 0; n < kKeys / 16; ++n) wm::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    wm::fragment<wm::matrix_a, 16, 16, 16, E, wm::row_major> a;
    wm::load_matrix_sync(a, A + kk * 16, kLd);
#pragma unroll
    for (int n = 0; n < kKeys / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, E, wm::col_major> b;
      wm::load_matrix_sync(b, Bm + n * 16 * kLd + kk * 16, kLd);
      wm::mma_sync(acc[n], a, b, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kKeys / 16; ++n) wm::store_matrix_sync(out + n * 16, acc[n], kLdF, wm::mem_row_major);
}

// acc[D/16] += A[16 x 64] (pitch kLdP; transposed: A is stored [64][16-col slice] when kTransA)
//              times Bm[64 x D] (row-major, pitch D + kPad).
template <typename E, int D, bool kTransA>
__device__ __forceinline__ void warp_acc(const E* A, const E* Bm, FragC* acc) {
  constexpr int kLd = D + kPad;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    using Layout = std::conditional_t<kTransA, wm::col_major, wm::row_major>;
    wm::fragment<wm::matrix_a, 16, 16, 16, E, Layout> a;
    if constexpr (kTransA) wm::load_matrix_sync(a, A + kk * 16 * kLdP, kLdP);
    else wm::load_matrix_sync(a, A + kk * 16, kLdP);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, E, wm::row_major> b;
      wm::load_matrix_sync(b, Bm + kk * 16 * kLd + n * 16, kLd);
      wm::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// Per-row state of a row tile, in shared memory.
struct RowInfo {
  int tok[kRows];     // packed token (or -1: padding row)
  int head[kRows];    // query head
  int t[kRows];       // position within the sequence
  int lo[kRows];      // smallest visible key position (window), else INT_MIN
  int ok[kRows];      // row takes part for the current key set
  float lse2[kRows];  // lse * log2(e) of the current branch
  float gate[kRows];  // g of the current branch
  float dg[kRows];    // dg of the current branch (fp32)
};

// Key geometry of one key tile: key c (< nk) has "visibility position" kp0 + c * kstep: row r
// sees it when lo[r] <= pos <= t[r] (compressed keys: the last token of the block).
struct KeyTile {
  int nk;
  int kp0, kstep;
};

__device__ __forceinline__ bool visible(const RowInfo& ri, int r, const KeyTile& kt, int c) {
  if (!ri.ok[r] || c >= kt.nk) return false;
  const int pos = kt.kp0 + c * kt.kstep;
  return pos <= ri.t[r] && pos >= ri.lo[r];
}

// ---- dq_kernel ---------------------------------------------------------------------------

template <typename E, int DQK, int DV>
struct DqSmem {
  static constexpr int kK = 0;
  static constexpr int kV = kK + kRows * (DQK + kPad) * 2;
  static constexpr int kQ = kV + kRows * (DV + kPad) * 2;
  static constexpr int kDo = kQ + kRows * (DQK + kPad) * 2;
  static constexpr int kP = kDo + kRows * (DV + kPad) * 2;
  static constexpr int kS = kP + kRows * kLdP * 2;
  static constexpr int kDp = kS + kRows * kLdF * 4;
  static constexpr int kRi = kDp + kRows * kLdF * 4;
  static constexpr int kSel = kRi + int(sizeof(RowInfo));  // then [Tq][n] ints, then bitmap words
  static_assert(kRows * (DV + 4) * 4 <= 2 * kRows * kLdF * 4, "O scratch must fit the score tiles");
  static_assert(kRows * (DQK + 4) * 4 <= kS, "dQ scratch must fit below the score tiles");
};

// Fills the row info of the row tile of tokens [u0, u0 + ntok) of a sequence starting at s0.
__device__ __forceinline__ void fill_rows(RowInfo& ri, const BwdArgs& a, int hk, int64_t s0,
                                          int u0, int ntok) {
  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    const int u = r / a.G;
    const bool valid = u < ntok;
    ri.tok[r] = valid ? int(s0 + u0 + u) : -1;
    ri.head[r] = hk * a.G + r % a.G;
    ri.t[r] = valid ? u0 + u : -1;
  }
}

// Sets lse/gate/dg/lo/ok of the rows for `branch`.
__device__ __forceinline__ void set_branch_rows(RowInfo& ri, const BwdArgs& a, int branch,
                                                bool need_dg, int dtype_is_bf16) {
  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    const int tok = ri.tok[r];
    if (tok < 0) {
      ri.ok[r] = 0;
      ri.lse2[r] = 0.f;
      ri.gate[r] = 0.f;
      ri.dg[r] = 0.f;
      ri.lo[r] = 0;
      continue;
    }
    const int h = ri.head[r];
    const float lse = static_cast<const float*>(a.lse.p)[tok * a.lse.s0 + h * a.lse.s1 + branch];
    ri.lse2[r] = lse * kLog2e;
    const int64_t gi = tok * a.g.s0 + h * a.g.s1 + branch;
    ri.gate[r] = dtype_is_bf16 ? load_f32<__nv_bfloat16>(a.g.p, gi) : load_f32<__half>(a.g.p, gi);
    ri.dg[r] = need_dg ? a.dg32[(int64_t(tok) * a.hq + h) * 3 + branch] : 0.f;
    ri.lo[r] = branch == kWin ? ri.t[r] - a.w + 1 : INT32_MIN;
    ri.ok[r] = 1;
  }
}

// The ascending list of selected blocks of the row tile: a bitmap over blocks (shared memory).
__device__ __forceinline__ void build_union(const BwdArgs& a, int hk, int64_t s0, int u0, int ntok,
                                            int* sel, unsigned* bitmap, int words) {
  for (int i = threadIdx.x; i < words; i += kThreads) bitmap[i] = 0u;
  __syncthreads();
  const int tq = kRows / a.G;
  for (int e = threadIdx.x; e < tq * a.n; e += kThreads) {
    const int u = e / a.n, k = e % a.n;
    int j = -1;
    if (u < ntok) {
      const int t = u0 + u;
      j = static_cast<const int32_t*>(a.indices.p)[(s0 + t) * a.indices.s0 + hk * a.indices.s1 + k];
      if (j < 0 || int64_t(j) * a.lp > t) j = -1;  // padding (or a block that has not started)
    }
    sel[e] = j;
    if (j >= 0) atomicOr(&bitmap[j >> 5], 1u << (j & 31));  // integer: order-independent
  }
  __syncthreads();
}

template <typename E, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) dq_kernel(const BwdArgs a) {
  using L = DqSmem<E, DQK, DV>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* sK = reinterpret_cast<E*>(smem + L::kK);
  E* sV = reinterpret_cast<E*>(smem + L::kV);
  E* sQ = reinterpret_cast<E*>(smem + L::kQ);
  E* sDo = reinterpret_cast<E*>(smem + L::kDo);
  E* sP = reinterpret_cast<E*>(smem + L::kP);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  float* sDp = reinterpret_cast<float*>(smem + L::kDp);
  RowInfo& ri = *reinterpret_cast<RowInfo*>(smem + L::kRi);
  int* sel = reinterpret_cast<int*>(smem + L::kSel);
  const int tq = kRows / a.G;
  unsigned* bitmap = reinterpret_cast<unsigned*>(sel + tq * a.n);
  const int words = (a.n_slc_max + 31) / 32;

  const int tiles_per_seq = int((a.max_seqlen + tq - 1) / tq);
  const int b = blockIdx.x / tiles_per_seq;
  const int u0 = (blockIdx.x % tiles_per_seq) * tq;
  const int hk = blockIdx.y;
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  if (u0 >= len) return;
  const int ntok = min(tq, len - u0);
  const int t_first = u0, t_last = u0 + ntok - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = warp * 16;
  const bool bf = a.dtype == 0;

  fill_rows(ri, a, hk, s0, u0, ntok);
  if (a.n > 0) build_union(a, hk, s0, u0, ntok, sel, bitmap, words);
  __syncthreads();
  const E* qb = static_cast<const E*>(a.q.p);
  const E* dob = static_cast<const E*>(a.d_o.p);
  load_rows<E, DQK>(sQ, [&](int r) -> const E* { return ri.tok[r] < 0 ? nullptr : qb + ri.tok[r] * a.q.s0 + ri.head[r] * a.q.s1; }, a.vec);
  load_rows<E, DV>(sDo, [&](int r) -> const E* { return ri.tok[r] < 0 ? nullptr : dob + ri.tok[r] * a.d_o.s0 + ri.head[r] * a.d_o.s1; }, a.vec);

  // Visits every key tile of `branch` for this row tile: fn(kbase, kstride, vbase, vstride, KeyTile)
  // with key c's rows at kbase + c * kstride. Selection also sets ri.ok per block.
  auto for_each_tile = [&](int branch, auto&& fn) {
    if (branch == kCmp) {
      const int nc = int(visible_cmp_blocks(t_last, a.l, a.d));
      const int64_t crow0 = cmp_row_offset(s0, a.d);
      const E* kb = static_cast<const E*>(a.kc) + (crow0 * a.hkv + hk) * DQK;
      const E* vb = static_cast<const E*>(a.vc) + (crow0 * a.hkv + hk) * DV;
      for (int i0 = 0; i0 < nc; i0 += kKeys)
        fn(kb + int64_t(i0) * a.hkv * DQK, int64_t(a.hkv) * DQK, vb + int64_t(i0) * a.hkv * DV,
           int64_t(a.hkv) * DV, KeyTile{min(kKeys, nc - i0), i0 * a.d + a.l - 1, a.d});
    } else if (branch == kWin) {
      if (a.w == 0) return;
      const int p0 = int(window_start(t_first, a.w));
      const Mat3& K = a.k[kWin];
      const Mat3& V = a.v[kWin];
      for (int pos = p0; pos <= t_last; pos += kKeys)
        fn(static_cast<const E*>(K.p) + (s0 + pos) * K.s0 + hk * K.s1, K.s0,
           static_cast<const E*>(V.p) + (s0 + pos) * V.s0 + hk * V.s1, V.s0,
           KeyTile{min(kKeys, t_last - pos + 1), pos, 1});
    } else {
      if (a.n == 0) return;
      const Mat3& K = a.k[kSlc];
      const Mat3& V = a.v[kSlc];
      for (int wi = 0; wi < words; ++wi) {
        unsigned word = bitmap[wi];
        while (word != 0u) {
          const int j = wi * 32 + __ffs(word) - 1;
          word &= word - 1u;
          __syncthreads();  // the previous tile's readers of ri.ok are done
          for (int r = threadIdx.x; r < kRows; r += kThreads) {
            int hit = 0;
            if (ri.tok[r] >= 0) {
              const int u = r / a.G;
              for (int k = 0; k < a.n; ++k) hit |= sel[u * a.n + k] == j;
            }
            ri.ok[r] = hit;
          }
          const int end = min((j + 1) * a.lp, t_last + 1);
          for (int pos = j * a.lp; pos < end; pos += kKeys)
            fn(static_cast<const E*>(K.p) + (s0 + pos) * K.s0 + hk * K.s1, K.s0,
               static_cast<const E*>(V.p) + (s0 + pos) * V.s0 + hk * V.s1, V.s0,
               KeyTile{min(kKeys, end - pos), pos, 1});
        }
      }
    }
  };

  auto load_kv = [&](const E* kb, int64_t ks, const E* vb, int64_t vs, const KeyTile& kt) {
    __syncthreads();  // previous tile fully consumed, row info visible
    load_rows<E, DQK>(sK, [&](int c) -> const E* { return c < kt.nk ? kb + c * ks : nullptr; }, a.vec);
    load_rows<E, DV>(sV, [&](int c) -> const E* { return c < kt.nk ? vb + c * vs : nullptr; }, a.vec);
    __syncthreads();
  };

  // ---- pass 1: each branch's output o_b = P V from the saved lse, then dg_b = <dO, o_b>
  for (int branch = 0; branch < 3; ++branch) {
    __syncthreads();
    set_branch_rows(ri, a, branch, /*need_dg=*/false, bf);
    FragC acc_o[DV / 16];
#pragma unroll
    for (int n = 0; n < DV / 16; ++n) wm::fill_fragment(acc_o[n], 0.f);
    for_each_tile(branch, [&](const E* kb, int64_t ks, const E* vb, int64_t vs, const KeyTile& kt) {
      load_kv(kb, ks, vb, vs, kt);
      warp_abt<E, DQK>(sQ + row0 * (DQK + kPad), sK, sS + row0 * kLdF);
      __syncwarp();
      for (int e = lane; e < 16 * kKeys; e += 32) {
        const int r = row0 + e / kKeys, c = e % kKeys;
        const float p = visible(ri, r, kt, c) ? exp2f(sS[r * kLdF + c] * (a.scale * kLog2e) - ri.lse2[r]) : 0.f;
        sP[r * kLdP + c] = from_float<E>(p);
      }
      __syncwarp();
      warp_acc<E, DV, false>(sP + row0 * kLdP, sV, acc_o);
    });
    // o_b of this warp's rows to the score tiles (fp32), then dg = <dO, o_b> per row.
    float* sO = sS;  // [kRows][DV + 4], spans sS and sDp
    __syncthreads();
#pragma unroll
    for (int n = 0; n < DV / 16; ++n)
      wm::store_matrix_sync(sO + row0 * (DV + 4) + n * 16, acc_o[n], DV + 4, wm::mem_row_major);
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
      const int r = row0 + rr;
      float part = 0.f;
      for (int c = lane; c < DV; c += 32) part += to_float(sDo[r * (DV + kPad) + c]) * sO[r * (DV + 4) + c];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
      if (lane == 0 && ri.tok[r] >= 0) {
        const int64_t tok = ri.tok[r];
        const int h = ri.head[r];
        a.dg32[(tok * a.hq + h) * 3 + branch] = part;
        static_cast<E*>(a.dg.p)[tok * a.dg.s0 + h * a.dg.s1 + branch] = from_float<E>(part);
      }
    }
  }
  __syncthreads();  // dg32 of this tile's rows is written (read back below by the same block)

  // ---- pass 2: dQ = scale * sum_b dS_b K_b, summed in registers over the three branches
  FragC acc_q[DQK / 16];
#pragma unroll
  for (int n = 0; n < DQK / 16; ++n) wm::fill_fragment(acc_q[n], 0.f);
  for (int branch = 0; branch < 3; ++branch) {
    __syncthreads();
    set_branch_rows(ri, a, branch, /*need_dg=*/true, bf);
    for_each_tile(branch, [&](const E* kb, int64_t ks, const E* vb, int64_t vs, const KeyTile& kt) {
      load_kv(kb, ks, vb, vs, kt);
      warp_abt<E, DQK>(sQ + row0 * (DQK + kPad), sK, sS + row0 * kLdF);
      warp_abt<E, DV>(sDo + row0 * (DV + kPad), sV, sDp + row0 * kLdF);
      __syncwarp();
      for (int e = lane; e < 16 * kKeys; e += 32) {
        const int r = row0 + e / kKeys, c = e % kKeys;
        float ds = 0.f;
        if (visible(ri, r, kt, c)) {
          const float p = exp2f(sS[r * kLdF + c] * (a.scale * kLog2e) - ri.lse2[r]);
          ds = a.scale * ri.gate[r] * p * (sDp[r * kLdF + c] - ri.dg[r]);
        }
        sP[r * kLdP + c] = from_float<E>(ds);
      }
      __syncwarp();
      warp_acc<E, DQK, false>(sP + row0 * kLdP, sK, acc_q);
    });
  }
  __syncthreads();
  float* sOut = reinterpret_cast<float*>(smem);  // [kRows][DQK + 4]: K/V/Q tiles are free now
#pragma unroll
  for (int n = 0; n < DQK / 16; ++n)
    wm::store_matrix_sync(sOut + row0 * (DQK + 4) + n * 16, acc_q[n], DQK + 4, wm::mem_row_major);
  __syncthreads();
  E* dqb = static_cast<E*>(a.dq.p);
  for (int e = threadIdx.x; e < kRows * DQK; e += kThreads) {
    const int r = e / DQK, c = e % DQK;
    if (ri.tok[r] < 0) continue;
    dqb[int64_t(ri.tok[r]) * a.dq.s0 + int64_t(ri.head[r]) * a.dq.s1 + c] = from_float<E>(sOut[r * (DQK + 4) + c]);
  }
}

// ---- dkv_kernel --------------------------------------------------------------------------

enum class KeySet : int { raw = 0, cmp = 1, slc_forced = 2 };

// Whether the selection list of block j (< n_init) of a sequence is the whole range of queries
// t >= j * l' (what the spec's forced initial blocks give): then slc_forced blocks own it.
__device__ __forceinline__ bool forced_split(const BwdArgs& a, int j, int len, int first, int last) {
  return a.slc_splits > 0 && j < a.n_init && last - first == len - j * a.lp;
}

template <typename E, int DQK, int DV>
struct DkvSmem {
  static constexpr int kK = 0;
  static constexpr int kV = kK + kRows * (DQK + kPad) * 2;
  static constexpr int kQ = kV + kRows * (DV + kPad) * 2;
  static constexpr int kDo = kQ + kRows * (DQK + kPad) * 2;
  static constexpr int kP = kDo + kRows * (DV + kPad) * 2;
  static constexpr int kDs = kP + kRows * kLdP * 2;
  static constexpr int kS = kDs + kRows * kLdP * 2;
  static constexpr int kDp = kS + kRows * kLdF * 4;
  static constexpr int kRi = kDp + kRows * kLdF * 4;
  static constexpr int kEnd = kRi + int(sizeof(RowInfo));
  static constexpr int kMaxD = DQK > DV ? DQK : DV;
  static_assert(kRows * (kMaxD + 4) * 4 <= kRi, "epilogue scratch must fit below the row info");
};

template <typename E>
__device__ __forceinline__ float phi_dx(const PhiDxArgs& P, const BwdArgs& a, int D, int64_t s0,
                                        int len, int p, int hk, int c) {
  const int nc = int(num_cmp_blocks(len, a.l, a.d));
  if (nc == 0) return 0.f;
  const int i_lo = p >= a.l - 1 ? (p - a.l + 1 + a.d - 1) / a.d : 0;
  const int i_hi = min(p / a.d, nc - 1);
  float acc = 0.f;
  for (int i = i_lo; i <= i_hi; ++i) {
    const int64_t m = (cmp_row_offset(s0, a.d) + i) * a.hkv + hk;
    const int r = p - i * a.d;
    if (P.kind == 0) {
      acc += P.dy[m * D + c] / float(a.l);
    } else if (P.kind == 1) {
      const E* w = static_cast<const E*>(P.w);
      for (int cc = 0; cc < D; ++cc) acc += to_float(w[cc * P.w_s0 + r * D + c]) * P.dy[m * D + cc];
    } else {
      const E* w = static_cast<const E*>(P.w);
      for (int f = 0; f < P.F; ++f) acc += to_float(w[f * P.w_s0 + r * D + c]) * P.dpre[m * P.F + f];
    }
  }
  return acc;
}

template <typename E, int DQK, int DV, KeySet kSet>
__global__ void __launch_bounds__(kThreads) dkv_kernel(const BwdArgs a) {
  using L = DkvSmem<E, DQK, DV>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* sK = reinterpret_cast<E*>(smem + L::kK);
  E* sV = reinterpret_cast<E*>(smem + L::kV);
  E* sQ = reinterpret_cast<E*>(smem + L::kQ);
  E* sDo = reinterpret_cast<E*>(smem + L::kDo);
  E* sP = reinterpret_cast<E*>(smem + L::kP);
  E* sDs = reinterpret_cast<E*>(smem + L::kDs);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  float* sDp = reinterpret_cast<float*>(smem + L::kDp);
  RowInfo& ri = *reinterpret_cast<RowInfo*>(smem + L::kRi);
  const int tq = kRows / a.G;
  const int hk = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = warp * 16;
  const bool bf = a.dtype == 0;
  const E* qb = static_cast<const E*>(a.q.p);
  const E* dob = static_cast<const E*>(a.d_o.p);

  // Which key tile this block owns.
  int b, key0, nk, j = 0;
  if constexpr (kSet != KeySet::cmp) {
    const int chunks = (a.lp + kKeys - 1) / kKeys;
    const int per_seq = (kSet == KeySet::raw ? a.n_slc_max : a.n_init) * chunks;
    b = blockIdx.x / per_seq;
    j = (blockIdx.x % per_seq) / chunks;
    key0 = j * a.lp + (blockIdx.x % chunks) * kKeys;  // first key position
  } else {
    const int per_seq = int((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys);
    b = blockIdx.x / per_seq;
    key0 = (blockIdx.x % per_seq) * kKeys;  // first compressed block
  }
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  if constexpr (kSet != KeySet::cmp) {
    if (key0 >= len) return;
    nk = min(kKeys, min((j + 1) * a.lp, len) - key0);
  } else {
    const int nc = int(num_cmp_blocks(len, a.l, a.d));
    if (key0 >= nc) return;
    nk = min(kKeys, nc - key0);
  }
  const KeyTile kt = kSet != KeySet::cmp ? KeyTile{nk, key0, 1}
                                         : KeyTile{nk, key0 * a.d + a.l - 1, a.d};

  FragC acc_k[DQK / 16], acc_v[DV / 16];
  auto zero_acc = [&]() {
#pragma unroll
    for (int n = 0; n < DQK / 16; ++n) wm::fill_fragment(acc_k[n], 0.f);
#pragma unroll
    for (int n = 0; n < DV / 16; ++n) wm::fill_fragment(acc_v[n], 0.f);
  };
  zero_acc();

  auto load_kv = [&](const E* kb, int64_t ks, const E* vb, int64_t vs) {
    __syncthreads();
    load_rows<E, DQK>(sK, [&](int c) -> const E* { return c < nk ? kb + c * ks : nullptr; }, a.vec);
    load_rows<E, DV>(sV, [&](int c) -> const E* { return c < nk ? vb + c * vs : nullptr; }, a.vec);
  };

  // One query tile against the resident key tile; the row info must be filled (ok, t, lo, ...).
  auto tile_step = [&]() {
    __syncthreads();
    load_rows<E, DQK>(sQ, [&](int r) -> const E* { return ri.tok[r] < 0 ? nullptr : qb + ri.tok[r] * a.q.s0 + ri.head[r] * a.q.s1; }, a.vec);
    load_rows<E, DV>(sDo, [&](int r) -> const E* { return ri.tok[r] < 0 ? nullptr : dob + ri.tok[r] * a.d_o.s0 + ri.head[r] * a.d_o.s1; }, a.vec);
    __syncthreads();
    warp_abt<E, DQK>(sQ + row0 * (DQK + kPad), sK, sS + row0 * kLdF);
    warp_abt<E, DV>(sDo + row0 * (DV + kPad), sV, sDp + row0 * kLdF);
    __syncwarp();
    for (int e = lane; e < 16 * kKeys; e += 32) {
      const int r = row0 + e / kKeys, c = e % kKeys;
      float pg = 0.f, ds = 0.f;
      if (visible(ri, r, kt, c)) {
        pg = ri.gate[r] * exp2f(sS[r * kLdF + c] * (a.scale * kLog2e) - ri.lse2[r]);
        ds = a.scale * pg * (sDp[r * kLdF + c] - ri.dg[r]);
      }
      sP[r * kLdP + c] = from_float<E>(pg);
      sDs[r * kLdP + c] = from_float<E>(ds);
    }
    __syncthreads();  // dK/dV of a warp's keys read every row
    warp_acc<E, DV, true>(sP + row0, sDo, acc_v);    // (g P)^T dO for keys row0..row0+15
    warp_acc<E, DQK, true>(sDs + row0, sQ, acc_k);   // scale dS^T Q
  };

  // Row info for query tokens given as consecutive positions [t0, t0 + ntok) or a token list.
  auto set_rows = [&](int branch, auto&& token_of, int ntok) {
    __syncthreads();
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      const int u = r / a.G;
      const int tok = u < ntok ? token_of(u) : -1;
      ri.tok[r] = tok;
      ri.head[r] = hk * a.G + r % a.G;
      ri.t[r] = tok >= 0 ? int(tok - s0) : -1;
    }
    __syncthreads();
    set_branch_rows(ri, a, branch, /*need_dg=*/true, bf);
  };

  // Writes the accumulated dK/dV rows (plus phi's gradient in shared mode) and clears them.
  // Forced-block partial slot of key c of this tile: ((b * n_init + j) * lp_pad + key0 - j l' + c).
  auto forced_row = [&](int c) -> int64_t {
    return (int64_t(b) * a.n_init + j) * a.lp_pad + (key0 - j * a.lp) + c;
  };
  auto epilogue = [&](OutMat3 dk_out, OutMat3 dv_out, bool add_phi, bool add_forced, float* part_k,
                      float* part_v) {
    float* sOut = reinterpret_cast<float*>(smem);
    for (int which = 0; which < 2; ++which) {
      const int D = which == 0 ? DQK : DV;
      __syncthreads();
      if (which == 0) {
#pragma unroll
        for (int n = 0; n < DQK / 16; ++n)
          wm::store_matrix_sync(sOut + row0 * (DQK + 4) + n * 16, acc_k[n], DQK + 4, wm::mem_row_major);
      } else {
#pragma unroll
        for (int n = 0; n < DV / 16; ++n)
          wm::store_matrix_sync(sOut + row0 * (DV + 4) + n * 16, acc_v[n], DV + 4, wm::mem_row_major);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < nk * D; e += kThreads) {
        const int c = e / D, col = e % D;
        float val = sOut[c * (D + 4) + col];
        if constexpr (kSet == KeySet::raw) {
          if (add_forced) {
            const float* part = which == 0 ? a.slc_part_k : a.slc_part_v;
            const int64_t plane = int64_t(a.B) * a.n_init * a.lp_pad * a.hkv * D;
            for (int z = 0; z < a.slc_splits; ++z) val += part[z * plane + (forced_row(c) * a.hkv + hk) * D + col];
          }
          if (add_phi) val += phi_dx<E>(which == 0 ? a.phi_k : a.phi_v, a, D, s0, len, key0 + c, hk, col);
          const OutMat3& o = which == 0 ? dk_out : dv_out;
          static_cast<E*>(o.p)[(s0 + key0 + c) * o.s0 + hk * o.s1 + col] = from_float<E>(val);
        } else if constexpr (kSet == KeySet::cmp) {
          float* part = which == 0 ? part_k : part_v;
          part[((cmp_row_offset(s0, a.d) + key0 + c) * a.hkv + hk) * D + col] = val;
        } else {
          float* part = which == 0 ? part_k : part_v;
          part[(forced_row(c) * a.hkv + hk) * D + col] = val;
        }
      }
    }
    zero_acc();
  };

  if constexpr (kSet == KeySet::raw) {
    // Window: queries t in [key0, key0 + nk - 1 + w - 1].
    const Mat3& Kw = a.k[kWin];
    const Mat3& Vw = a.v[kWin];
    if (a.w > 0) {
      load_kv(static_cast<const E*>(Kw.p) + (s0 + key0) * Kw.s0 + hk * Kw.s1, Kw.s0,
              static_cast<const E*>(Vw.p) + (s0 + key0) * Vw.s0 + hk * Vw.s1, Vw.s0);
      const int t_end = min(len - 1, key0 + nk - 1 + a.w - 1);
      for (int t0 = key0; t0 <= t_end; t0 += tq) {
        const int ntok = min(tq, t_end - t0 + 1);
        set_rows(kWin, [&](int u) { return int(s0 + t0 + u); }, ntok);
        tile_step();
      }
    }
    if (!a.shared_kv) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, false, nullptr, nullptr);
    // Selection: the queries that selected block j (inverted index), ascending; a forced initial
    // block whose list is the whole range was done by the slc_forced blocks.
    bool forced = false;
    if (a.n > 0) {
      const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
      forced = forced_split(a, j, len, a.sel_offsets[key], a.sel_offsets[key + 1]);
    }
    if (a.n > 0 && !forced) {
      const Mat3& Ks = a.k[kSlc];
      const Mat3& Vs = a.v[kSlc];
      load_kv(static_cast<const E*>(Ks.p) + (s0 + key0) * Ks.s0 + hk * Ks.s1, Ks.s0,
              static_cast<const E*>(Vs.p) + (s0 + key0) * Vs.s0 + hk * Vs.s1, Vs.s0);
      const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
      const int first = a.sel_offsets[key], last = a.sel_offsets[key + 1];
      for (int i0 = first; i0 < last; i0 += tq) {
        const int ntok = min(tq, last - i0);
        set_rows(kSlc, [&](int u) { return a.sel_tokens[i0 + u]; }, ntok);
        tile_step();
      }
    }
    if (a.shared_kv) epilogue(a.grad_k[kCmp], a.grad_v[kCmp], true, forced, nullptr, nullptr);
    else epilogue(a.grad_k[kSlc], a.grad_v[kSlc], false, forced, nullptr, nullptr);
  } else if constexpr (kSet == KeySet::slc_forced) {
    // One split (blockIdx.z) of the list of a forced initial block: fp32 partials.
    const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
    const int first = a.sel_offsets[key], last = a.sel_offsets[key + 1];
    if (!forced_split(a, j, len, first, last)) return;  // the raw blocks handle this list
    const Mat3& Ks = a.k[kSlc];
    const Mat3& Vs = a.v[kSlc];
    load_kv(static_cast<const E*>(Ks.p) + (s0 + key0) * Ks.s0 + hk * Ks.s1, Ks.s0,
            static_cast<const E*>(Vs.p) + (s0 + key0) * Vs.s0 + hk * Vs.s1, Vs.s0);
    const int ntiles = (last - first + tq - 1) / tq;
    const int per_split = (ntiles + a.slc_splits - 1) / a.slc_splits;
    const int z = blockIdx.z;
    for (int ti = z * per_split; ti < min(ntiles, (z + 1) * per_split); ++ti) {
      const int i0 = first + ti * tq;
      set_rows(kSlc, [&](int u) { return a.sel_tokens[i0 + u]; }, min(tq, last - i0));
      tile_step();
    }
    const int64_t plane_k = int64_t(a.B) * a.n_init * a.lp_pad * a.hkv * DQK;
    const int64_t plane_v = int64_t(a.B) * a.n_init * a.lp_pad * a.hkv * DV;
    epilogue(OutMat3{}, OutMat3{}, false, false, a.slc_part_k + z * plane_k, a.slc_part_v + z * plane_v);
  } else {
    // Compressed keys: queries t >= key0 * d + l - 1, split in a.cmp_splits ranges (blockIdx.z).
    load_kv(static_cast<const E*>(a.kc) + (cmp_row_offset(s0, a.d) + key0) * a.hkv * DQK + hk * DQK,
            int64_t(a.hkv) * DQK,
            static_cast<const E*>(a.vc) + (cmp_row_offset(s0, a.d) + key0) * a.hkv * DV + hk * DV,
            int64_t(a.hkv) * DV);
    const int t_begin = key0 * a.d + a.l - 1;
    const int ntiles = (len - t_begin + tq - 1) / tq;
    const int per_split = (ntiles + a.cmp_splits - 1) / a.cmp_splits;
    const int z = blockIdx.z;
    for (int ti = z * per_split; ti < min(ntiles, (z + 1) * per_split); ++ti) {
      const int t0 = t_begin + ti * tq;
      const int ntok = min(tq, len - t0);
      set_rows(kCmp, [&](int u) { return int(s0 + t0 + u); }, ntok);
      tile_step();
    }
    const int64_t part_elems_k = a.rc * a.hkv * DQK, part_elems_v = a.rc * a.hkv * DV;
    epilogue(OutMat3{}, OutMat3{}, false, false, a.dkc_part + z * part_elems_k, a.dvc_part + z * part_elems_v);
  }
}

// ---- launch: phase 0 = dq_kernel, 1 = dkv_kernel<cmp>, 2 = <raw>, 3 = <slc_forced> ----------
// Explicitly instantiated once per dtype and Dqk (attention_<dtype>_hdim<Dqk>.cu).

template <typename E, int DQK, int DV>
void launch_attention(const BwdArgs& a, cudaStream_t s, int phase) {
  const int tq = kRows / a.G;
  if (phase == 0) {
    using Lq = DqSmem<E, DQK, DV>;
    const size_t smem = size_t(Lq::kSel) + size_t(tq) * a.n * 4 + size_t((a.n_slc_max + 31) / 32) * 4;
    NSA_CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<E, DQK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t tiles = a.B * ((a.max_seqlen + tq - 1) / tq);
    if (tiles == 0) return;
    dq_kernel<E, DQK, DV><<<dim3(unsigned(tiles), unsigned(a.hkv)), kThreads, smem, s>>>(a);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  using Lk = DkvSmem<E, DQK, DV>;
  const size_t smem = Lk::kEnd;
  if (phase == 1) {
    auto* kernel = dkv_kernel<E, DQK, DV, KeySet::cmp>;
    NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t tiles = a.B * ((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys);
    if (tiles == 0) return;
    kernel<<<dim3(unsigned(tiles), unsigned(a.hkv), unsigned(a.cmp_splits)), kThreads, smem, s>>>(a);
  } else if (phase == 3) {
    auto* kernel = dkv_kernel<E, DQK, DV, KeySet::slc_forced>;
    NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t tiles = a.B * int64_t(a.n_init) * ((a.lp + kKeys - 1) / kKeys);
    if (tiles == 0 || a.slc_splits == 0) return;
    kernel<<<dim3(unsigned(tiles), unsigned(a.hkv), unsigned(a.slc_splits)), kThreads, smem, s>>>(a);
  } else {
    auto* kernel = dkv_kernel<E, DQK, DV, KeySet::raw>;
    NSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t tiles = a.B * int64_t(a.n_slc_max) * ((a.lp + kKeys - 1) / kKeys);
    if (tiles == 0) return;
    kernel<<<dim3(unsigned(tiles), unsigned(a.hkv)), kThreads, smem, s>>>(a);
  }
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda_bwd
