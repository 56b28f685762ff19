// Selection attention (spec §5): one warp per 16 query rows, K and V straight from L2 into
// registers, no shared-memory staging and no barriers.
//
// Why: a token picks its own n blocks, and with scores that differ from token to token
// (random inputs, and real ones away from the forced blocks) neighbouring tokens share few of
// them. A CTA that streams the union of its tokens' blocks through shared memory (the design
// before this one, measured in docs/cuda.md) then waits on ~3.4x more chunks than each warp
// multiplies (55 union blocks for 4 tokens x 16 at G = 16), and issues a cp.async per 16 bytes.
// Here each warp owns 16 rows = 16/G tokens x the G heads of one KV head and walks only the
// union of ITS tokens' blocks (one token at G = 16: exactly its n blocks), 16 keys per step.
//
// Operands without shared memory. mma.m16n8k16 wants, per lane (group g = lane/4, quad q):
//   S = Q K^T: B = K^T, lane holds K[key g][d pairs 2q, 2q+8 of the k16 step]. The reduction
//     index d may be permuted freely if Q's A fragments use the same permutation: k16 steps
//     2p and 2p+1 read d in [32p, 32p+32), lane (g, q) holding d 32p + 8q .. +7 (one 16-byte
//     load per key and 32 columns; four lanes read a key's 64 contiguous bytes).
//   O += P V: B = V, lane holds V[keys 2q, 2q+1 | 2q+8, 2q+9][column n = g]. The output column
//     index may be permuted as well (undone when O is written): column n of n8 tile 8v + e is
//     dv = 64v + 8n + e, so lane g loads V[key][64v + 8g .. +7] (16 bytes) for its four keys, and
//     two byte permutes (prmt) turn two rows' words into the key pairs of two n8 tiles.
// P comes from the S accumulator in registers as in TileAttention (keys are not permuted).
//
// Registers: O (Dv/2 fp32), Q fragments (Dqk/4), one step of K (Dqk/4) and V (Dv/4) in flight,
// the step's scores. K of step i+1 is loaded while step i's softmax and P V run, V of step i
// while its Q K^T runs; the other warps of the SM cover the rest of the L2 latency.
//
// The union of the warp's tokens' blocks, with the mask of tokens that picked each: slc_union.cuh.
#pragma once

#include <algorithm>

#include "cuda/common/attention_tile.cuh"
#include "cuda/common/kv_loops.cuh"
#include "cuda/common/check.h"
#include "cuda/common/tma.h"
#include "cuda/common/slc_union.cuh"

namespace nsa::cuda {

inline constexpr int kSlcWarpThreads = kSlcWarps * 32;

// The CTA's tile, the same in the per-token kernel and the union kernel (which must agree on it):
// 64 rows = tokens_per_cta consecutive tokens of sequence b from t0, x the G heads of KV head hk.
struct SlcTile {
  int tokens_per_warp, tokens_per_cta, b, hk;
  int64_t tile, s0, len, t0;
  // The tile of CTA (x, y) of the per-token kernel's grid (row_tile_grid).
  __device__ __forceinline__ SlcTile(const BranchParams& p, unsigned x, unsigned y) {
    tokens_per_warp = 16 >> p.log2_group;
    tokens_per_cta = tokens_per_warp * kSlcWarps;
    const int64_t tiles_per_seq = (p.seqs.max_seqlen + tokens_per_cta - 1) / tokens_per_cta;
    b = static_cast<int>(x / tiles_per_seq);
    tile = x % tiles_per_seq;
    hk = static_cast<int>(y);
    sequence_bounds(p.seqs, b, s0, len);
    t0 = tile * tokens_per_cta;
  }
  // The tile's tokens inside its sequence (0 past its end).
  __device__ __forceinline__ int tokens() const {
    return static_cast<int>(max64(0, min64(tokens_per_cta, len - t0)));
  }
};

// The end of row h of the per-token walks (m, lsum: its running max and sum in log2 units, lsum
// over the quad's lanes): its lse (natural log) to p.lse[0] where the row has a token (t_row, in
// the sequence from s0; -1: none), and the 1 / l that normalises its output (0: it saw no key).
__device__ __forceinline__ float slc_finish_row(const BranchParams& p, float m, float lsum, int64_t s0, int64_t t_row,
                                                int head, int quad) {
  float l = lsum;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  const float lse2 = l > 0.f ? m + __log2f(l) : kNegInf;
  if (t_row >= 0 && quad == 0 && p.lse[0] != nullptr)
    p.lse[0][(s0 + t_row) * p.lse_st[0] + head * p.lse_sh[0]] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
  return l > 0.f ? 1.f / l : 0.f;
}

// With BranchParams::slc_union_tiles, after each warp built its union (num_blocks entries; the
// warps' block lists `stride` ints apart from `lists`; meta: 8 ints): whether the CTA's tile goes to
// slc_union_tile_kernel (launched next, which makes the same count from the same lists), listed
// then; its warps leave. (Both per-token kernels.)
__device__ __forceinline__ bool slc_tile_handed_over(const BranchParams& p, const SlcTile& tl, const int32_t* lists,
                                                     int stride, int* meta, int num_blocks) {
  if (threadIdx.x % 32 == 0) meta[threadIdx.x / 32] = num_blocks;
  const int u = cta_union_size(lists, stride, meta, meta + kSlcWarps);
  const int tile_tokens = tl.tokens();
  if (tile_tokens > 0 && slc_union_takes(u, tile_tokens, p.n_sel)) {
    if (threadIdx.x == 0) p.slc_union_list[1 + atomicAdd(p.slc_union_list, 1)] = blockIdx.y * gridDim.x + blockIdx.x;
    return true;
  }
  return false;
}

// One warp's 16 rows of o_slc out of shared memory (`so`: rows of kDv + 8 columns, the warp's
// first row first) in 16-byte pieces, two whole rows per warp store: row r is token t0 + r / G
// (only those before tokens_valid) and head hk G + r % G; to `out` (o_branch[0]; nullptr: not
// wanted) and, with p.combine, the same rows' o = g_slc o_slc + g_win o_win + g_cmp o_cmp to p.o
// (gated_pair; o_cmp and o_win as the other kernels stored them, o_slc as staged: each branch
// rounded to the storage type once, as the window's combine reads o_slc back). A lane's loads of
// o_cmp, o_win and the gates all go out before its stores. (Every selection kernel's epilogue.)
template <typename Storage, int kDv>
__device__ __forceinline__ void store_warp_rows(const BranchParams& p, Storage* out, const Storage* so, int64_t t0,
                                                int tokens_valid, int hk, int lane) {
  constexpr int kRowPieces = kDv / 8, kOStride = kDv + 8;
  if (!p.combine) {
    for (int e = lane; e < 16 * kRowPieces; e += 32) {
      const int row = e / kRowPieces, piece = e % kRowPieces;
      const int rtok = row >> p.log2_group;
      if (rtok >= tokens_valid) continue;
      const int rhead = hk * p.group + (row & (p.group - 1));
      *reinterpret_cast<uint4*>(out + (t0 + rtok) * p.ob_st[0] + int64_t(rhead) * p.ob_sh[0] + 8 * piece) =
          *reinterpret_cast<const uint4*>(so + row * kOStride + 8 * piece);
    }
    return;
  }
  using Traits = StorageTraits<Storage>;
  constexpr int kIters = 16 * kRowPieces / 32;
  static_assert(16 * kRowPieces % 32 == 0, "whole rounds of pieces");
  uint4 oc[kIters], ow[kIters];
  float gate[kIters][3];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int e = lane + 32 * k, row = e / kRowPieces, piece = e % kRowPieces;
    const int rtok = row >> p.log2_group;
    oc[k] = ow[k] = make_uint4(0u, 0u, 0u, 0u);  // no window branch: o_win = 0
    gate[k][0] = gate[k][1] = gate[k][2] = 0.f;
    if (rtok >= tokens_valid) continue;
    const int64_t t = t0 + rtok, rhead = hk * p.group + (row & (p.group - 1));
    oc[k] = *reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.o_cmp) + t * p.oc_st + rhead * p.oc_sh +
                                            8 * piece);
    if (p.o_win != nullptr)
      ow[k] = *reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.o_win) + t * p.ow_st + rhead * p.ow_sh +
                                              8 * piece);
    const Storage* g = static_cast<const Storage*>(p.g) + t * p.g_st + rhead * p.g_sh;
#pragma unroll
    for (int b = 0; b < 3; ++b) gate[k][b] = to_float(g[b]);
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int e = lane + 32 * k, row = e / kRowPieces, piece = e % kRowPieces;
    const int rtok = row >> p.log2_group;
    if (rtok >= tokens_valid) continue;
    const int64_t t = t0 + rtok, rhead = hk * p.group + (row & (p.group - 1));
    const uint4 os = *reinterpret_cast<const uint4*>(so + row * kOStride + 8 * piece);
    if (out != nullptr)
      *reinterpret_cast<uint4*>(out + t * p.ob_st[0] + rhead * p.ob_sh[0] + 8 * piece) = os;
    const uint32_t ocw[4] = {oc[k].x, oc[k].y, oc[k].z, oc[k].w}, osw[4] = {os.x, os.y, os.z, os.w},
                   oww[4] = {ow[k].x, ow[k].y, ow[k].z, ow[k].w};
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 v = gated_pair(Traits::unpack(ocw[q]), Traits::unpack(osw[q]), Traits::unpack(oww[q]), gate[k][0],
                                  gate[k][1], gate[k][2]);
      o[q] = Traits::pack(v.x, v.y);
    }
    *reinterpret_cast<uint4*>(static_cast<Storage*>(p.o) + t * p.o_st + rhead * p.o_sh + 8 * piece) =
        make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// The combine's reads of a warp's 16 rows (o_cmp, o_win and the gates), prefetched into L2 some
// steps before the walk ends (CudaKernelChoices::combine_prefetch): lane l takes row l % 16 of
// o_cmp (l < 16, with the row's gates) or of o_win, one prefetch per 128-byte line.
template <typename Storage, int kDv>
__device__ __forceinline__ void slc_prefetch_combine(const BranchParams& p, int64_t t0, int tokens_valid, int hk,
                                                     int lane) {
  const int row = lane % 16, rtok = row >> p.log2_group;
  if (rtok >= tokens_valid) return;
  prefetch_combine_row<Storage, kDv>(p, t0 + rtok, hk * p.group + (row & (p.group - 1)), lane < 16, p.o_win, p.ow_st,
                                     p.ow_sh);
}

// The online softmax of a step of kPieces 16-key pieces (the per-token walks: one piece a step, a
// whole block in slc_attention_blocks_kernel): s (the step's raw scores of rows g and g + 8, masked
// keys -inf) becomes P, and the running max m, sum lsum (log2 units) and the output accumulator acc
// (kOTiles n8 tiles) are rescaled, as TileAttention::softmax_update (rescale skipped when no max
// moved), the reference max moving only past `slack` (kSoftmaxMaxSlack, attention_tile.cuh): with
// 16-key steps the rescale (the accumulator's kOTiles x 4 products) would otherwise run at most
// steps.
template <int kOTiles, int kPieces>
__device__ __forceinline__ void slc_softmax_block(float (&s)[kPieces][2][4], float (&m)[2], float (&lsum)[2],
                                                  float (&acc)[kOTiles][4], float scale_log2, float slack) {
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = fmaxf(fmaxf(s[0][0][2 * h], s[0][0][2 * h + 1]), fmaxf(s[0][1][2 * h], s[0][1][2 * h + 1]));
#pragma unroll
    for (int k = 1; k < kPieces; ++k)
      mx = fmaxf(mx, fmaxf(fmaxf(s[k][0][2 * h], s[k][0][2 * h + 1]), fmaxf(s[k][1][2 * h], s[k][1][2 * h + 1])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = next_reference_max(m[h], mx * scale_log2, slack);
    const float m_use = m_new == kNegInf ? 0.f : m_new;
    alpha[h] = fast_exp2(m[h] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kPieces; ++k)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[k][nt][2 * h] = fast_exp2(fmaf(s[k][nt][2 * h], scale_log2, -m_use));
        s[k][nt][2 * h + 1] = fast_exp2(fmaf(s[k][nt][2 * h + 1], scale_log2, -m_use));
        sum += s[k][nt][2 * h] + s[k][nt][2 * h + 1];
      }
    lsum[h] = lsum[h] * alpha[h] + sum;
    m[h] = m_new;
  }
  if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) {
      acc[t][0] *= alpha[0];
      acc[t][1] *= alpha[0];
      acc[t][2] *= alpha[1];
      acc[t][3] *= alpha[1];
    }
  }
}
template <int kOTiles>
__device__ __forceinline__ void slc_softmax_step(float (&s)[2][4], float (&m)[2], float (&lsum)[2],
                                                 float (&acc)[kOTiles][4], float scale_log2, float slack) {
  slc_softmax_block<kOTiles, 1>(reinterpret_cast<float(&)[1][2][4]>(s), m, lsum, acc, scale_log2, slack);
}

// A lane's two rows of a TMA walk (slc_attention_tma_kernel, slc_attention_blocks_kernel): rows g
// and g + 8 of the warp's 16 are token tok[h] of the warp's (from t0, in the sequence from s0) and
// head head[h]; trow[h] the token's position (-1: a padding row, which sees no key); qrow[h] its
// row of q (nullptr for a padding row).
template <typename Storage>
__device__ __forceinline__ void slc_walk_rows(const BranchParams& p, int hk, int64_t s0, int64_t t0, int tokens_valid,
                                              int g, int (&tok)[2], int (&head)[2], int (&trow)[2],
                                              const Storage* (&qrow)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    tok[h] = row >> p.log2_group;
    head[h] = hk * p.group + (row & (p.group - 1));
    trow[h] = tok[h] < tokens_valid ? static_cast<int>(t0) + tok[h] : -1;
    qrow[h] = trow[h] >= 0 ? static_cast<const Storage*>(p.q) + (s0 + trow[h]) * p.q_st + int64_t(head[h]) * p.q_sh
                           : nullptr;
  }
}

// The end of a walk by TMA (slc_attention_tma_kernel, slc_attention_blocks_kernel): each row's lse
// and 1 / l (slc_finish_row), o_slc's 16 rows through `so` (the warp's ring, every box landed and
// read; rows of Dv + 8 columns: a store's 8 rows x 4 quads on distinct banks), then out in 16-byte
// pieces (store_warp_rows, with the gated combine). acc: O in natural column order.
template <typename Storage, int kDv>
__device__ __forceinline__ void slc_finish_walk(const BranchParams& p, const float (&acc)[kDv / 8][4],
                                                const float (&m)[2], const float (&lsum)[2], Storage* so, int64_t s0,
                                                int64_t t0, int tokens_valid, int hk, const int (&trow)[2],
                                                const int (&head)[2]) {
  constexpr int kOStride = kDv + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, quad = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = slc_finish_row(p, m[h], lsum[h], s0, trow[h], head[h], quad);
    Storage* orow = so + (g + 8 * h) * kOStride;
#pragma unroll
    for (int t = 0; t < kDv / 8; ++t)
      *reinterpret_cast<uint32_t*>(orow + 8 * t + 2 * quad) =
          StorageTraits<Storage>::pack(acc[t][2 * h] * inv, acc[t][2 * h + 1] * inv);
  }
  __syncwarp();
  Storage* out = static_cast<Storage*>(p.o_branch[0]);  // nullptr: o_slc not wanted
  if (out != nullptr || p.combine) store_warp_rows<Storage, kDv>(p, out, so, s0 + t0, tokens_valid, hk, lane);
}

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kSlcWarpThreads, slc_min_ctas(kDqk)) slc_attention_kernel(const BranchParams p) {
  constexpr int kQPieces = kDqk / 32;  // 16-byte pieces of a Q/K row per lane
  constexpr int kVPieces = kDv / 64;   // 16-byte pieces of a V row per lane
  constexpr int kOTiles = kDv / 8;
  static_assert(kDqk % 32 == 0 && kDv % 64 == 0, "head dims of the selection kernel");
  extern __shared__ __align__(16) unsigned char smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, quad = lane % 4;
  const SlcTile tl(p, blockIdx.x, blockIdx.y);
  const int tokens_per_warp = tl.tokens_per_warp, hk = tl.hk;
  const int64_t s0 = tl.s0, len = tl.len;
  const int64_t t0 = tl.t0 + warp * tokens_per_warp;  // the warp's first token
  if (!p.slc_union_tiles && t0 >= len) return;  // warps never wait for each other: a warp may leave alone
  const int tokens_valid = t0 < len ? static_cast<int>(min64(tokens_per_warp, len - t0)) : 0;
  const int64_t t_max = t0 + tokens_valid - 1;

  const int cap = p.sort_capacity;
  int32_t* keys = reinterpret_cast<int32_t*>(smem + warp * slc_warp_smem_bytes(kDv, cap));
  int32_t* ublk = keys + cap;
  int32_t* umask = ublk + cap;

  // ---- The union of the warp's tokens' blocks (slc_union.cuh) ----
  const int num_blocks = warp_block_union(p.indices + (s0 + min64(t0, len - 1)) * p.idx_st + int64_t(hk) * p.idx_sh,
                                          p.idx_st, p.n_sel, p.lp, t0, tokens_valid, cap, keys, ublk, umask);
  if (p.slc_union_tiles) {
    int* meta = reinterpret_cast<int*>(smem + slc_smem_bytes(kDqk, kDv, cap) - 8 * sizeof(int));
    if (slc_tile_handed_over(p, tl, reinterpret_cast<const int32_t*>(smem) + cap,
                             static_cast<int>(slc_warp_smem_bytes(kDv, cap) / sizeof(int32_t)), meta, num_blocks))
      return;
    if (tokens_valid == 0) return;
  }

  // ---- This lane's rows (g and g + 8) and its Q fragments ----
  int tok[2], head[2];
  int64_t t_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    tok[h] = row >> p.log2_group;
    head[h] = hk * p.group + (row & (p.group - 1));
    t_row[h] = tok[h] < tokens_valid ? t0 + tok[h] : -1;  // -1: a padding row sees no key
  }
  // Q's A fragments, in this warp's shared region in lane order (conflict-free 16-byte reads):
  // held in registers they would cost Dqk / 4 more per thread and one CTA per SM.
  uint4* qs = reinterpret_cast<uint4*>(smem + kSlcWarps * slc_warp_smem_bytes(kDv, cap)) + warp * (kDqk / 16) * 32;
  {
    const Storage* q = static_cast<const Storage*>(p.q);
    const Storage* qrow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      qrow[h] = t_row[h] >= 0 ? q + (s0 + t_row[h]) * p.q_st + int64_t(head[h]) * p.q_sh : nullptr;
    store_permuted_fragments<Storage, kDqk>(qs, qrow[0], qrow[1]);
    __syncwarp();
  }

  const Storage* ks = static_cast<const Storage*>(p.k_slc) + s0 * p.ks_st + int64_t(hk) * p.ks_sh;
  const Storage* vs = static_cast<const Storage*>(p.v_slc) + s0 * p.vs_st + int64_t(hk) * p.vs_sh;
  const SlcWalk walk{ublk, umask, p.lp, (p.lp + 15) / 16, t_max};
  const int steps = num_blocks * walk.per_block;
  uint4 kr[2][kQPieces];  // K of a step, A layout (slc_union.cuh)
  uint4 vr[4][kVPieces];  // V of a step, B layout
  auto load_k = [&](int i) {
    int64_t first, end;
    int u;
    walk.step(i, first, end, u);
    load_rows_a<Storage, kQPieces>(kr, ks, p.ks_st, first, end);
  };

  float acc[kOTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, lsum[2] = {0.f, 0.f};

  if (steps > 0) load_k(0);
  for (int i = 0; i < steps; ++i) {
    int64_t first, end;
    int u;
    walk.step(i, first, end, u);
    load_rows_b<Storage, kVPieces>(vr, vs, p.vs_st, first, end);
    float s[2][4];
    mma_frags_rows_a<Storage, kQPieces>(s, qs, kr);
    if (i + 1 < steps) load_k(i + 1);

    // Row h keeps keys [first, first + hi[h]): picked by its token, in the block, not after it.
    int hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) hi[h] = walk.visible(u, first, t_row[h], tok[h]);
    if (!__all_sync(0xffffffffu, hi[0] >= 16 && hi[1] >= 16)) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (nt * 8 + 2 * quad + (e & 1) >= hi[e >> 1]) s[nt][e] = kNegInf;
    }

    slc_softmax_step<kOTiles>(s, m, lsum, acc, p.scale_log2, softmax_slack(p.choices));
    mma_p_rows_b<Storage, kVPieces>(acc, s, vr);  // O += P V
  }

  // ---- Epilogue: normalise, undo the column permutation, write rows through shared memory ----
  // Column n of n8 tile 8v + j is dv = 64 v + 8 n + j, and a lane holds n = 2 quad + e (e = 0, 1):
  // its values acc[8v + j][2h + e], j = 0..7, are row g + 8h, columns 64 v + 16 quad + 8 e + j,
  // one run of 8 consecutive columns per (h, v, e): one 16-byte store each. With rows of Dv + 8
  // columns (68 words at Dv = 128, 36 at 64) the 8 lanes of a store phase (two rows g, quad 0..3)
  // fall on 8 disjoint groups of 4 banks.
  // (With 2-byte stores into unpadded rows the 8 rows of a store hit one bank: ncu counted 8x
  // the ideal shared wavefronts there, ~18% of the kernel's shared-memory traffic.)
  constexpr int kOStride = kDv + 8;
  __syncwarp();  // every lane is done with the union lists: the region now holds the output
  Storage* so = reinterpret_cast<Storage*>(keys);  // [16][kOStride]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = slc_finish_row(p, m[h], lsum[h], s0, t_row[h], head[h], quad);
    Storage* orow = so + (g + 8 * h) * kOStride;
    using Traits = StorageTraits<Storage>;
#pragma unroll
    for (int v = 0; v < kOTiles / 8; ++v)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float(&a)[kOTiles][4] = acc;
        const int c = 2 * h + e;
        *reinterpret_cast<uint4*>(orow + 64 * v + 16 * quad + 8 * e) =
            make_uint4(Traits::pack(a[8 * v][c] * inv, a[8 * v + 1][c] * inv),
                       Traits::pack(a[8 * v + 2][c] * inv, a[8 * v + 3][c] * inv),
                       Traits::pack(a[8 * v + 4][c] * inv, a[8 * v + 5][c] * inv),
                       Traits::pack(a[8 * v + 6][c] * inv, a[8 * v + 7][c] * inv));
      }
  }
  __syncwarp();
  Storage* out = static_cast<Storage*>(p.o_branch[0]);  // nullptr: o_slc not wanted
  if (out != nullptr || p.combine) store_warp_rows<Storage, kDv>(p, out, so, s0 + t0, tokens_valid, hk, lane);
}

// sm_90a: the selection of one per-token CTA's 64 rows (64/G tokens x the G heads of a KV head) as
// one tile, when their tokens' blocks have a small union (slc_union_takes; l' = 64): the
// union's blocks, ascending, are the chunks of a TMA ring shared by the four warps (one warpgroup;
// tma_ring_attention_rows, with the block's first key as the chunk's row), S = Q K^T and O += P V
// as warpgroup MMAs with Q from the swizzled Q tile, and each row masked to the blocks its token
// picked, up to the token. Each block is read once per tile instead of once per token: with
// neighbouring tokens that select alike (real scores) a tile of 4 tokens at G = 16 reads ~16
// blocks instead of 64. The per-token kernel runs first, counts each tile's union and hands the
// small ones over in BranchParams::slc_union_list; this kernel's CTAs (persistent: as many as fit
// on the GPU at once) take the listed tiles in turn. Tiles with a larger union (random scores: ~55
// blocks at G = 16) never reach it, so on such data it costs one launch of CTAs that find nothing.
// A tile's result does not depend on which CTA runs it or in which order (the same bits).
// The warps' sorts (warp_block_union, as the per-token kernel) live in the ring until it starts.
template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kSlcWarpThreads)
    slc_union_tile_kernel(const BranchParams p, const unsigned tiles_x, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map) {
  if constexpr (!kWgmmaCompiled) {
    __trap();  // launched only where the wgmma body runs (sm_90a)
  } else {
    constexpr int kRows = kSlcWarps * 16;
    constexpr int kStages = kSlcUnionStages, kVStages = slc_union_v_stages(kDqk, kDv);
    constexpr int kBars = slc_union_bars(kVStages);
    using Tile = TileAttention<Storage, kDqk, kDv, kRows>;
    using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;
    static_assert(kRows == 64 && Smem::kWgmma, "one warpgroup, swizzled tiles");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm(smem_raw);
    unsigned char* const ring_end =
        reinterpret_cast<unsigned char*>(sm.sk + kStages * Tile::kKSwTile + kVStages * Tile::kVSwTile);
    uint64_t* const bars = reinterpret_cast<uint64_t*>(ring_end);
    int* const meta = reinterpret_cast<int*>(ring_end + tma_ring_bar_bytes(kBars));
    int32_t* const ulist = meta + 8;              // [kSlcUnionMax]
    int32_t* const cand = ulist + kSlcUnionMax;   // [kSlcUnionMax]
    unsigned long long* const member =
        reinterpret_cast<unsigned long long*>((reinterpret_cast<uintptr_t>(cand + kSlcUnionMax) + 7) & ~uintptr_t(7));

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int listed = p.slc_union_list[0];  // written by the per-token kernel, which has finished
    for (int entry = blockIdx.x; entry < listed; entry += gridDim.x) {
      const unsigned id = static_cast<unsigned>(p.slc_union_list[1 + entry]);
      if (entry != static_cast<int>(blockIdx.x)) {
        // The previous tile's ring, lists and masks are read by everyone (its every copy waited on)
        // before this tile's sorts overwrite the ring and its mbarriers are set up again.
        __syncthreads();
        if (threadIdx.x == 0)
          for (int st = 0; st < kBars; ++st) mbarrier_inval(bars + st);
      }
      const SlcTile tl(p, id % tiles_x, id / tiles_x);
      const int tokens_per_warp = tl.tokens_per_warp, hk = tl.hk;
      const int64_t s0 = tl.s0, len = tl.len, t0 = tl.t0;  // t0: the tile's first token
      const int tokens_valid = tl.tokens();               // > 0: listed tiles have tokens

      // ---- The union of the tile: each warp's (as the per-token kernel), then the CTA's ----
      const int cap = p.sort_capacity;
      int32_t* const sorts = reinterpret_cast<int32_t*>(sm.sk);  // warp w: keys, ublk, umask at 3 cap w
      const int64_t tw0 = t0 + warp * tokens_per_warp;
      const int tw_valid = tw0 < len ? static_cast<int>(min64(tokens_per_warp, len - tw0)) : 0;
      int32_t* const keys = sorts + warp * 3 * cap;
      const int nb = warp_block_union(p.indices + (s0 + min64(tw0, len - 1)) * p.idx_st + int64_t(hk) * p.idx_sh,
                                      p.idx_st, p.n_sel, p.lp, tw0, tw_valid, cap, keys, keys + cap, keys + 2 * cap);
      if (lane == 0) meta[warp] = nb;
      const int u = cta_union_size(sorts + cap, 3 * cap, meta, meta + kSlcWarps);
      if (u > kSlcUnionMax) __trap();  // the per-token kernel's count, from the same lists, listed it
      sm.load_q(static_cast<const Storage*>(p.q), p.q_st, p.q_sh, s0 + t0, tokens_valid, hk * p.group, p.log2_group);
      cp_async_commit();  // (copied while the list is built)
      cta_union_list<kSlcUnionMax>(sorts + cap, sorts + 2 * cap, 3 * cap, meta, tokens_per_warp, u, cand,
                                   meta + kSlcWarps + 1, ulist, member);

      // ---- This thread's rows: g and g + 8 of its warp's 16 ----
      int tok[2], head[2];
      int64_t t_row[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + g + 8 * h;
        tok[h] = row >> p.log2_group;
        head[h] = hk * p.group + (row & (p.group - 1));
        t_row[h] = tok[h] < tokens_valid ? t0 + tok[h] : -1;  // -1: a padding row sees no key
      }
      Tile st;
      st.reset(softmax_slack(p.choices));
      const int count_last =
          u > 0 ? static_cast<int>(min64(kKeyChunk, len - int64_t(ulist[u - 1]) * p.lp)) : kKeyChunk;
      // (The sorts in the ring are dead: the ring's first copy follows its own CTA barrier.)
      // (cta_union_list ends with a CTA barrier: the ring's first copies may start before Q lands.)
      tma_ring_attention_rows<Storage, kDqk, kDv, kRows, kKeyChunk, kStages, kVStages, /*kIssueEarly=*/true>(
          st, sm.sq, sm.sk, bars, &k_map, &v_map, hk,
          [&](int c) { return static_cast<int>(s0 + int64_t(ulist[c]) * p.lp); }, u, count_last, p.scale_log2,
          [&](int c, float (&s)[Tile::kSTiles][4]) {
            const int64_t k0 = int64_t(ulist[c]) * p.lp;
            const unsigned long long picked = member[c];
            int lo[2] = {0, 0}, hi[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
              hi[h] = t_row[h] >= k0 && (picked >> tok[h] & 1ull) ? static_cast<int>(min64(kKeyChunk, t_row[h] - k0 + 1)) : 0;
            st.mask(s, lo, hi);
          });

      // ---- Epilogue: lse and o_slc of the two rows ----
      // o_slc goes through shared memory (the ring, once every warp is done with it: rows of Dv + 8
      // columns, a store's 8 rows x 4 quads on distinct banks), then out in 16-byte pieces, two
      // whole rows per warp store: written straight from the accumulator layout, each 4-byte store
      // half-filled its sectors (ncu: 34% excess global sectors).
      const int quad = lane % 4;
      Storage* const out = static_cast<Storage*>(p.o_branch[0]);
      const bool rows_out = out != nullptr || p.combine;  // o_slc and / or the combine's o
      constexpr int kOStride = kDv + 8;
      static_assert(size_t(kRows) * kOStride <= size_t(kStages) * Tile::kKSwTile + size_t(kVStages) * Tile::kVSwTile,
                    "the output rows fit in the ring");
      Storage* const so = sm.sk;  // [kRows][kOStride]
      if (rows_out) __syncthreads();  // every warp's last products have read the ring
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float lse2, inv;
        st.finish_row(h, lse2, inv);
        if (t_row[h] >= 0 && quad == 0 && p.lse[0] != nullptr)
          p.lse[0][(s0 + t_row[h]) * p.lse_st[0] + head[h] * p.lse_sh[0]] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
        if (!rows_out) continue;
        Storage* orow = so + (warp * 16 + g + 8 * h) * kOStride;
#pragma unroll
        for (int i = 0; i < Tile::kOTiles; ++i)
          *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * quad) =
              StorageTraits<Storage>::pack(st.acc[i][2 * h] * inv, st.acc[i][2 * h + 1] * inv);
      }
      if (rows_out) {
        __syncwarp();  // a warp writes out its own 16 rows: tokens_per_warp tokens from its first
        store_warp_rows<Storage, kDv>(p, out, so + warp * 16 * kOStride, s0 + t0 + warp * tokens_per_warp,
                                      tokens_valid - warp * tokens_per_warp, hk, lane);
      }
    }
  }
}

}  // namespace nsa::cuda
