// Attention kernels of the CUDA backward (docs/cuda_backward.md).
//
// Every branch is softmax attention over a set of keys; the backward of one (row tile, key tile)
// pair is a few 64 x 64 x D products on the tensor cores (mma.sync m16n8k16, fp32 accumulation):
//   S = Q K^T,  P = exp(scale S - lse) (masked),  dP = dO V^T,
//   dS = g P (dP - dg),  dQ += scale dS K,  dK += scale dS^T Q,  dV += (g P)^T dO
// where g is the branch gate and dg = <dO, o_branch> (= the usual rowsum(dO_b * o_b) / g).
//
// Scores never leave registers: the C fragments of two neighbouring n8 tiles are the A fragments
// of one k16 tile (src/cuda/common/mma.h), so P and dS go from the accumulator of one product
// straight into the next as operands; K, V, Q, dO come from shared memory through ldmatrix
// (transposed where they are the k-major operand). The streamed tiles are double-buffered with
// cp.async: the copy of the next tile runs under the products of the current one.
//
// A row tile holds kRows = 64 rows: kRows / G consecutive query tokens of one sequence times the
// G query heads of one KV head, so every key row loaded serves G heads. Three kernels, none with
// floating-point atomics:
//   dq_kernel        query-centric, each warp owns 16 rows, compressed and window branches (and
//                    on sm_90a the selection of a row tile whose tokens' blocks have a small
//                    union: BwdArgs::slc_union): per row tile, (1) recompute each branch's output
//                    from lse to get dg (skipped when dg came from the saved o_branch), (2) sum
//                    the branches' dQ in registers, write dq.
//   slc_dq_kernel    (slc_dq.cuh) the selection branch's dg and dQ of the other row tiles, one
//                    warp per 16 rows with K/V from L2 into registers; adds its dQ to dq.
//   dkv_kernel       key-centric, each warp owns 16 keys (it computes S^T and dP^T, so P^T and
//                    dS^T are its A operands): per key tile, loop over the query tiles that see
//                    it; raw keys (window + selection, the latter through the inverted index) or
//                    compressed keys (split over query ranges, partial sums reduced in a fixed
//                    order later).
//
// dkv_kernel on sm_90a (wgmma, common/wgmma.h; compiled only where __CUDA_ARCH_FEAT_SM90_ALL is
// defined, like the forward's compressed kernel: sm_80 and the compute_80 PTX keep the mma.sync
// body). The CTA is one warpgroup (warp w owns keys 16w..16w+15, as before) and every product of
// a query tile is a warpgroup MMA, in the same two halves of 32 rows:
//   S^T  = K Q^T      m64n32k16 x Dqk/16, A = the resident K tile, B = the Q rows, both from
//                     shared memory through K-major descriptors (wgmma_ss);
//   dP^T = V dO^T     m64n32k16 x Dv/16, A = the V tile, B = the dO rows (wgmma_ss);
//   dV  += (g P)^T dO m64n{Dv}k16 x 2, A = P^T packed from this half's S^T accumulator (registers),
//                     B = the dO rows MN-major (wgmma_rs, transposed B);
//   dK  += dS^T Q     m64n{Dqk}k16 x 2 (Dqk = 192: one n192 product), A = dS^T from registers,
//                     B = the Q rows MN-major.
// The register A operands are packed in the iteration that uses them (never live across the loop:
// the ptxas hazard of docs/cuda.md), K and V are never in registers. The accumulators are the
// mma.sync ones (the wgmma D layout is the m16n8 C fragment layout per warp), so masking, P, dS
// and the epilogue are shared with the sm_80 body. Tiles are stored unpadded in the 128-byte
// swizzle layout from a 1024-byte boundary (DkvSmem::kSw*; the launch asks for that layout's size,
// DkvSmem::kSwLaunch, where this body runs); each thread fences its landed copies to the async proxy before the barrier that
// publishes them. Each batch is fence / issue / commit / wait 0, so the accumulation order is
// fixed and the result deterministic (it differs in rounding from the sm_80 body's).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/backward/cmp_split.h"
#include "cuda/common/check.h"
#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"
#include "cuda/common/tma.h"
#include "cuda/common/wgmma.h"
#include "cuda/forward_params.h"
#include "cuda/slc_union.cuh"
#include "nsa/api.h"
#include "nsa/blocks.h"
#include "nsa/error.h"

namespace nsa::cuda_bwd {

constexpr int kRows = 64;            // query rows per tile (tokens x heads of one group)
constexpr int kKeys = 64;            // keys per tile
constexpr int kWarps = kRows / 16;   // each warp owns 16 rows (dq) or 16 keys (dk/dv)
constexpr int kThreads = 32 * kWarps;
// dq_kernel's row tile is kRows rows, one warpgroup, 2 CTAs per SM. (Two warpgroups, 1 CTA per
// SM, measured slower, both with Q / dO fragments and from shared memory; three,
// at the 168 registers that 384 threads leave, spilled ~300 bytes in the tile loop at 128/128.)
// The warps work on 16 x 64 score blocks in two halves of 16 x 32 (kSubTiles n8 tiles): half the
// live score registers, so dK and dV (or dQ) accumulators of a 128-wide head fit without spills.
constexpr int kSub = 32;
constexpr int kSubTiles = kSub / 8;
// 16-bit elements of padding per shared row: a row starts 16 bytes further along the banks than
// the one before, so the 8 rows one ldmatrix reads hit 8 different bank groups.
constexpr int kPad = 8;
constexpr float kLog2e = 1.4426950408889634f;
// Shared memory of one sm_90 SM (H100 / H200) and what the hardware keeps per resident CTA: two
// CTAs asking for `bytes` each fit one SM when two_ctas_fit_sm90 (the sm_90a layouts' buffer
// counts, DqSmem::kSwBufs and DkvSmem::kSwBufs).
constexpr size_t kSm90SmemPerSm = 228 * 1024, kSmemPerCtaReserved = 1024;
constexpr bool two_ctas_fit_sm90(size_t bytes) { return 2 * (bytes + kSmemPerCtaReserved) <= kSm90SmemPerSm; }
static_assert(kRows == kKeys && kKeys == 2 * kSub, "a score block is two halves, both ways");

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

// The raw lists' pieces (BwdArgs::raw; the workspace's slots: backward.cu's Layout).
struct RawPieces {
  int pool = 0;             // slots (0: no pieces)
  int extra_x = 0;          // extra CTAs per KV head in front of the raw grid, ceil(pool / Hkv)
  int x = 0;                // the raw grid's own CTAs per KV head, B * n_slc_max * chunks
  float* part_k = nullptr;  // [pool][kKeys][Dqk] fp32 partials
  float* part_v = nullptr;  // [pool][kKeys][Dv]
  int2* split = nullptr;    // [Hkv * x] (first slot, pieces) of raw CTA hk * x + bx; (-1, 1): whole
  int2* slot = nullptr;     // [pool] (raw CTA, piece) of each slot; (-1, 0): unused
  int* arrived = nullptr;   // [pool] pieces arrived, by a list's first slot (zeroed by the plan)
  int piece_tiles = 0;      // testing: the cap in query tiles instead of the rule (0: the rule)
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
  bool dq_pairs = false;  // dq's column pairs (2i, 2i + 1) are aligned 32-bit words (one store each)

  Mat3 q, d_o, g, lse;       // g [T, Hq, 3], lse [T, Hq, 3] f32
  Mat3 k[3], v[3];           // raw K/V per branch (cmp entry unused here)
  Mat3 indices;              // [T, Hkv, n] int32
  const void* kc = nullptr;  // [Rc, Hkv, Dqk] 16-bit, contiguous
  const void* vc = nullptr;  // [Rc, Hkv, Dv]
  float* dg32 = nullptr;     // [T, Hq, 3] dg in fp32 (read by dkv_kernel)
  bool dg_ready = false;     // dg32 and dg already hold <dO, o_b> (from the saved o_branch)
  // slc_dq_kernel without its pass 1 (no recompute of o_slc): the forward's o is given, so the
  // selection's softmax correction comes from o = sum_b g_b o_b as
  // D_slc = g_slc <dO, o_slc> = <dO, o> - g_cmp dg_cmp - g_win dg_win (dq_kernel wrote dg_cmp and
  // dg_win to dg32), and dg_slc = <dO, o_slc> = sum_j P_j dP_j is summed in pass 2.
  bool d_from_o = false;
  Mat3 o;                    // [T, Hq, Dv] the forward's output (d_from_o)
  OutMat3 dq, dg;
  OutMat3 grad_k[3], grad_v[3];      // raw gradients (cmp entry: written only in shared mode)
  // Inverted selection index: for key (hk * B + b) * n_slc_max + j, the packed tokens that
  // selected block j of sequence b for KV head hk are sel_tokens[sel_offsets[key] .. [key+1]).
  const int32_t* sel_tokens = nullptr;
  const int32_t* sel_offsets = nullptr;
  // Compressed branch (cmp_split_of): the split holding a sequence's last query writes dkc / dvc
  // [Rc, Hkv, D] fp32 itself; each earlier split z writes partials for its first rows: split z's
  // partial holds cmp_part_rows[z] rows [Rc', Hkv, D] from dkc_part / dvc_part, one after another.
  float* dkc = nullptr;
  float* dvc = nullptr;
  float* dkc_part = nullptr;
  float* dvc_part = nullptr;
  int cmp_splits = 1;
  int64_t cmp_part_rows[kMaxCmpSplits] = {};
  // Long selection lists of the raw blocks (dkv_kernel<raw>, raw_pieces_plan_kernel). A block's
  // list is as long as the number of queries that picked it: a forced initial block's (j < n_init)
  // is the whole sequence after it, and with causal picks the other early blocks' lists are the
  // longest (about ln(blocks / j) times the mean for block j on random picks). One CTA working
  // through such a list while the others have finished is the kernel's tail. The plan kernel
  // (before the raw kernel, one CTA) cuts every list longer than `cap` query tiles (cap = all raw
  // CTAs' tiles / kRawTargetCtas, at least kRawMinPieceTiles, doubled until every piece has one of
  // the pool slots) into pieces of at most cap tiles. Piece 0 stays with the block's own CTA (with
  // its window tiles); pieces 1.. run on the extra CTAs in front of the grid (x < extra_x, one per
  // slot; a slot holding a piece 0 or no piece exits). Every piece writes its fp32 partial to its
  // slot and counts itself in; the last to arrive adds the slots in piece order, rounds once and
  // writes dk / dv (shared K/V: plus phi's gradient): the same bits whoever arrives last.
  RawPieces raw;
  // The selection's union tiles (sm_90a, l' = 64; slc_union_enabled): dq_kernel takes the
  // selection branch of a row tile whose tokens' blocks have a small union (slc_union_takes, as
  // the forward's union tiles) as a third stage of its sweeps, and slc_dq_kernel, which makes the
  // same count from the same lists, leaves those tiles. slc_cap: slc_sort_capacity(G, n).
  bool slc_union = false;
  int slc_cap = 0;
  int64_t rc = 0;  // rows of the compressed tensors, floor(T / d)
  PhiDxArgs phi_k, phi_v;
};

// ---- small device helpers ----------------------------------------------------------------

using cuda::from_float;
using cuda::to_float;

template <typename E>
__device__ __forceinline__ float load_f32(const void* base, int64_t i) {
  return to_float(static_cast<const E*>(base)[i]);
}

__device__ __forceinline__ int64_t seq_start(const int32_t* cu, int b) { return cu[b]; }

// The selection's D = g_slc <dO, o_slc> of token `tok`, head `head` from the forward's o (spec §7:
// o = sum_b g_b o_b): <dO, o> - g_cmp dg_cmp - g_win dg_win, with dg_cmp and dg_win from dg32
// (dq_kernel's pass 1 wrote them). BwdArgs::d_from_o; dq_kernel's union tiles and slc_dq_kernel.
template <typename E, typename Args>
__device__ __forceinline__ float slc_d_from_o(const Args& a, int64_t tok, int head, float dot_o_do) {
  const float* dgr = a.dg32 + (tok * a.hq + head) * 3;
  return dot_o_do - load_f32<E>(a.g.p, tok * a.g.s0 + head * a.g.s1 + kCmp) * dgr[kCmp] -
         load_f32<E>(a.g.p, tok * a.g.s0 + head * a.g.s1 + kWin) * dgr[kWin];
}

// Bytes of a shared tile of kRows (= kKeys) rows of D 16-bit elements, padded rows.
template <int D>
constexpr int tile_bytes() {
  return kRows * (D + kPad) * 2;
}

// Starts copying kRows rows of D elements into a shared tile [kRows][D + kPad]; row r comes from
// row_ptr(r) (nullptr: zeros). With `vec` (every row 16-byte aligned) the copy is cp.async and
// lands at the caller's next cp_async_wait; otherwise plain loads. Either way it is visible after
// the caller's next barrier. `any` is a valid global address: cp.async needs one even for a
// zero-filled row, whose bytes it does not read.
template <typename E, int D, typename RowPtr>
__device__ __forceinline__ void copy_rows(E* dst, RowPtr row_ptr, bool vec, const E* any) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunks = D / 8;
    for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
      const int r = e / kChunks, c = (e % kChunks) * 8;
      const E* src = row_ptr(r);
      cuda::cp_async_16(dst + r * kLd + c, src != nullptr ? src + c : any, src != nullptr);
    }
  } else {
    for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
      const int r = e / D, c = e % D;
      const E* src = row_ptr(r);
      dst[r * kLd + c] = src != nullptr ? src[c] : from_float<E>(0.f);
    }
  }
}

// The same for one warp and kSub rows (count of them from src + r * stride, the rest zeros).
template <typename E, int D>
__device__ __forceinline__ void warp_copy_rows(E* dst, const E* src, int64_t stride, int count, bool vec,
                                               const E* any) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  if (vec) {
    constexpr int kChunks = D / 8;
    for (int e = lane; e < kSub * kChunks; e += 32) {
      const int r = e / kChunks, c = (e % kChunks) * 8;
      const bool valid = r < count;
      cuda::cp_async_16(dst + r * kLd + c, valid ? src + r * stride + c : any, valid);
    }
  } else {
    for (int e = lane; e < kSub * D; e += 32) {
      const int r = e / D, c = e % D;
      dst[r * kLd + c] = r < count ? src[r * stride + c] : from_float<E>(0.f);
    }
  }
}

template <typename E>
constexpr bool kIsBf16 = cuda::StorageTraits<E>::is_bf16;

// acc = A B^T for the 16 rows of A starting at sA and the NT * 8 rows of B starting at sB (shared
// tiles of depth D): the C fragments of NT n8 tiles, columns = B's rows.
template <typename E, int D, int NT>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const E* sA, const E* sB) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  const E* arow = sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
  const E* brow = sB + ((lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[4];
    cuda::ldmatrix_x4(af, arow + kk * 16);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      cuda::ldmatrix_x4(b, brow + np * 16 * kLd + kk * 16);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * np], af, b[0], b[1]);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * np + 1], af, b[2], b[3]);
    }
  }
}

// The A fragments of a 16 x (NT * 8) operand from the C fragments of its NT n8 tiles, rounded to E.
template <typename E, int NT>
__device__ __forceinline__ void to_operand(const float (&c)[NT][4], uint32_t (&af)[NT / 2][4]) {
  using T = cuda::StorageTraits<E>;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    af[kk][0] = T::pack(c[2 * kk][0], c[2 * kk][1]);
    af[kk][1] = T::pack(c[2 * kk][2], c[2 * kk][3]);
    af[kk][2] = T::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    af[kk][3] = T::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// acc += A B for A 16 x (KT * 16) (operand fragments) and B the (KT * 16) x D rows of the shared
// tile at sB (row-major, so it is read with ldmatrix.trans).
template <typename E, int D, int KT>
__device__ __forceinline__ void mma_ab(float (&acc)[D / 8][4], const uint32_t (&af)[KT][4], const E* sB) {
  constexpr int kLd = D + kPad;
  const int lane = threadIdx.x % 32;
  const E* row = sB + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      cuda::ldmatrix_x4_trans(b, row + kk * 16 * kLd + dp * 16);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * dp], af[kk], b[0], b[1]);
      cuda::mma_16816<kIsBf16<E>>(acc[2 * dp + 1], af[kk], b[2], b[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Key geometry of one key tile: key c (< nk) has "visibility position" kp0 + c * kstep: a row at
// position t with window start lo sees it when lo <= pos <= t (compressed keys: the last token of
// the block).
struct KeyTile {
  int nk;
  int kp0, kstep;
  // The row tile's tokens that may see the tile (bit: token index in the tile; the selection's
  // union tiles in dq_kernel: the tokens that picked the block), all for the other branches.
  unsigned long long tokens = ~0ull;
};

}  // namespace nsa::cuda_bwd

#include "cuda/backward/dq_wgmma.cuh"

namespace nsa::cuda_bwd {

// ---- dq_kernel ---------------------------------------------------------------------------

template <typename E, int DQK, int DV>
struct DqSmem {
  static constexpr int kK = 0;                             // [2][kKeys][DQK + kPad], double-buffered
  static constexpr int kV = kK + 2 * tile_bytes<DQK>();    // [2][kKeys][DV + kPad]
  static constexpr int kQ = kV + 2 * tile_bytes<DV>();     // [kRows][DQK + kPad]
  static constexpr int kDo = kQ + tile_bytes<DQK>();       // [kRows][DV + kPad]
  static constexpr size_t kEnd = size_t(kDo) + tile_bytes<DV>();
  // sm_90a (dq_wgmma.cuh): from the first 1024-byte boundary, K [kSwBufs][kKeys][DQK], V
  // [kSwBufs][kKeys][DV], Q [kRows][DQK] and dO [kRows][DV], all 128-byte swizzled without padding
  // (Q and dO are the A operands of S and dP in shared memory). The padding saved pays for the
  // alignment, so kEnd also holds this layout; where the sm_90a body runs the host asks only for
  // kSwLaunch.
  // K / V buffers of the swizzled layout: two (the next tile's copy under this tile's products)
  // where two CTAs of that size still fit an SM, else one. At Dqk 192 / Dv 128 two buffers make
  // 125 KB (129 KB, the padded layout's size, asked for before `b4155de`), one CTA per SM with
  // nothing to run under its waits (dq_kernel 66.5 ms at 64K, 2x its Dqk 128 time), so there one
  // buffer: 84 KB, two CTAs per SM (255 registers x 128 threads allow two), each waiting while
  // the other computes. kSwKv: one K and one V buffer;
  // kSwTail: the layout past them (Q, dO, the mbarriers, the union lists; static_assert below).
  static constexpr int kSwKv = sw_tile_bytes<DQK>() + sw_tile_bytes<DV>();
  static constexpr int kSwTail = kSwKv + 2 * int(sizeof(uint64_t)) + 8 * int(sizeof(int)) +
                                 cuda::kSlcUnionMax * int(2 * sizeof(int32_t) + sizeof(unsigned long long));
  static constexpr int kSwBufs = two_ctas_fit_sm90(1024 + size_t(2 * kSwKv + kSwTail)) ? 2 : 1;
  static constexpr int kSwV = kSwBufs * sw_tile_bytes<DQK>();
  static constexpr int kSwQ = kSwV + kSwBufs * sw_tile_bytes<DV>();
  static constexpr int kSwDo = kSwQ + sw_tile_bytes<DQK>();
  // With TMA (DqMaps::on) the two K/V buffers' mbarriers follow dO.
  static constexpr int kSwBars = kSwDo + sw_tile_bytes<DV>();
  // The selection's union tiles (BwdArgs::slc_union): 8 ints (the warps' union sizes, a counter, a
  // slot), the union's blocks and their scratch (kSlcUnionMax ints each), then per block the mask
  // of the tile's tokens that picked it. The warps' sorts (3 ints per entry each) use the K/V
  // buffers before the first key tile is copied (slc_union_sorts_fit).
  static constexpr int kSwUnion = kSwBars + 2 * int(sizeof(uint64_t));
  static constexpr int kSwUnionList = kSwUnion + 8 * int(sizeof(int));
  static constexpr int kSwUnionMember = kSwUnionList + 2 * cuda::kSlcUnionMax * int(sizeof(int32_t));
  static constexpr int kSwUnionEnd = kSwUnionMember + cuda::kSlcUnionMax * int(sizeof(unsigned long long));
  static_assert(kSwUnionMember % 8 == 0, "the token masks are 8-byte words");
  static_assert(1023 + size_t(kSwUnionEnd) <= kEnd, "the swizzled layout fits after alignment");
  static_assert(kSwUnionEnd == kSwBufs * kSwKv + kSwTail, "kSwTail is the layout past the K / V buffers");
  // What the launch asks for where the sm_90a body runs (runs_sm90): the swizzled layout and its
  // alignment slack only.
  static constexpr size_t kSwLaunch = 1024 + size_t(kSwUnionEnd);
  static constexpr bool slc_union_sorts_fit(int cap) { return size_t(kWarps) * 3 * cap * sizeof(int32_t) <= size_t(kSwQ); }
};

// dq_kernel's K/V tiles by TMA on sm_90a: tensor maps of kc, vc ([rc, Hkv, D]) and of the window's
// k, v ([T, Hkv, D]), boxes of 64 rows x 64 columns in the 128-byte swizzle (common/tma.h); `on`
// = 0 where one could not be made (the kernel then copies by cp.async).
struct DqMaps {
  CUtensorMap kc, vc, kw, vw, ks, vs;  // ks, vs: the selection's k, v (union tiles)
  int on;
};

template <typename E, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) dq_kernel(const BwdArgs a, const __grid_constant__ DqMaps maps) {
  using L = DqSmem<E, DQK, DV>;
  constexpr int kLdK = DQK + kPad, kLdV = DV + kPad;
  extern __shared__ __align__(128) unsigned char smem[];
  // sm_90a: the wgmma body (dq_wgmma.cuh), K/V tiles swizzled from a 1024-byte boundary.
  constexpr bool kWg = kDqWgmma;
  unsigned char* base = smem;
  if constexpr (kWg) base += (1024u - (cuda::smem_address(smem) & 1023u)) & 1023u;
  E* sK = reinterpret_cast<E*>(base + (kWg ? 0 : L::kK));
  E* sV = reinterpret_cast<E*>(base + (kWg ? L::kSwV : L::kV));
  E* sQ = reinterpret_cast<E*>(base + (kWg ? L::kSwQ : L::kQ));
  E* sDo = reinterpret_cast<E*>(base + (kWg ? L::kSwDo : L::kDo));
  // Elements from one K (V) buffer to the next; 0 where the swizzled layout has one buffer.
  constexpr bool kOneBuf = kWg && L::kSwBufs == 1;
  constexpr int kKBuf = kOneBuf ? 0 : kWg ? kKeys * DQK : kKeys * kLdK;
  constexpr int kVBuf = kOneBuf ? 0 : kWg ? kKeys * DV : kKeys * kLdV;
  const int tq = kRows / a.G;

  const int tiles_per_seq = int((a.max_seqlen + tq - 1) / tq);
  const int b = blockIdx.x / tiles_per_seq;
  // The sequence's last tile first: a tile's compressed keys grow with its position, so the
  // heaviest CTAs start first and the light early tiles fill the tail (as the forward's tiles,
  // SeqRowTile). Same CTAs, same bits.
  const int u0 = (tiles_per_seq - 1 - blockIdx.x % tiles_per_seq) * tq;
  const int hk = blockIdx.y;
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  if (u0 >= len) return;
  const int ntok = min(tq, len - u0);
  const int t_first = u0, t_last = u0 + ntok - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int row0 = warp * 16;
  const float scale_log2 = a.scale * kLog2e;

  // Row r of the tile: token u0 + r / G of the sequence, head hk * G + r % G.
  auto row_token = [&](int r) { return r / a.G < ntok ? int(s0 + u0 + r / a.G) : -1; };
  auto row_head = [&](int r) { return hk * a.G + r % a.G; };

  const E* qb = static_cast<const E*>(a.q.p);
  const E* dob = static_cast<const E*>(a.d_o.p);
  auto q_row = [&](int r) -> const E* {
    const int tok = row_token(r);
    return tok < 0 ? nullptr : qb + tok * a.q.s0 + row_head(r) * a.q.s1;
  };
  auto do_row = [&](int r) -> const E* {
    const int tok = row_token(r);
    return tok < 0 ? nullptr : dob + tok * a.d_o.s0 + row_head(r) * a.d_o.s1;
  };
  if constexpr (kWg) {
    copy_rows_sw128<E, DQK>(sQ, q_row, a.vec, qb);
    copy_rows_sw128<E, DV>(sDo, do_row, a.vec, dob);
  } else {
    copy_rows<E, DQK>(sQ, q_row, a.vec, qb);
    copy_rows<E, DV>(sDo, do_row, a.vec, dob);
  }
  // sm_90a: this warpgroup's 64 rows of the swizzled Q and dO tiles (the A operands of S and dP).
  const uint32_t q_wg = cuda::smem_address(sQ) + (threadIdx.x / 128) * (64 * 128);
  const uint32_t do_wg = cuda::smem_address(sDo) + (threadIdx.x / 128) * (64 * 128);
  cuda::cp_async_commit();  // completes with the first key tile's group (without TMA)
  // The selection's union tile (sm_90a, a.slc_union): the union of the tile's tokens' blocks,
  // each warp's 16 / G tokens' as slc_dq_kernel's warps make it, then the CTA's. If it is small
  // (slc_union_takes, the forward's rule), its blocks become the key tiles of a selection stage
  // here, each row masked to the blocks its token picked; slc_dq_kernel makes the same count
  // from the same lists and leaves the tile. Otherwise this kernel has no selection tiles, as
  // before. The sorts use the K/V buffers, before anything is copied there.
  int n_slc = 0;
  const int32_t* slc_blocks = nullptr;                // [n_slc] ascending
  const unsigned long long* slc_tokens = nullptr;     // [n_slc] the tile's tokens that picked each
  if constexpr (kWg) {
    if (a.slc_union) {
      int32_t* const sorts = reinterpret_cast<int32_t*>(base);  // warp w: keys, blocks, masks at 3 cap w
      int* const meta = reinterpret_cast<int*>(base + L::kSwUnion);
      int32_t* const ulist = reinterpret_cast<int32_t*>(base + L::kSwUnionList);
      unsigned long long* const member = reinterpret_cast<unsigned long long*>(base + L::kSwUnionMember);
      const int cap = a.slc_cap, tpw = 16 / a.G;
      const int tw0 = u0 + warp * tpw;
      const int tw_valid = max(0, min(tpw, len - tw0));
      int32_t* const keys = sorts + warp * 3 * cap;
      const int32_t* idx = static_cast<const int32_t*>(a.indices.p) + (s0 + min(tw0, len - 1)) * a.indices.s0 +
                           int64_t(hk) * a.indices.s1;
      const int nb = cuda::warp_block_union(idx, a.indices.s0, a.n, a.lp, tw0, tw_valid, cap, keys, keys + cap,
                                            keys + 2 * cap);
      if (lane == 0) meta[warp] = nb;
      const int u = cuda::cta_union_size(sorts + cap, 3 * cap, meta, meta + kWarps);
      if (cuda::slc_union_takes(u, ntok, a.n)) {
        cuda::cta_union_list<cuda::kSlcUnionMax>(sorts + cap, sorts + 2 * cap, 3 * cap, meta, tpw, u,
                                                 ulist + cuda::kSlcUnionMax, meta + kWarps + 1, ulist, member);
        n_slc = u;
        slc_blocks = ulist;
        slc_tokens = member;
      }
    }
  }
  // sm_90a with TMA: one thread copies each K/V tile (kDqk/64 + kDv/64 boxes), completing on the
  // buffer's mbarrier; no per-thread copies. Q and dO (cp.async) land before the first sweep.
  const bool tma = kWg && maps.on != 0;
  uint64_t* const bars = reinterpret_cast<uint64_t*>(base + L::kSwBars);
  uint32_t bar_phase = 0;  // bit b: the parity of buffer b's next fill
  if constexpr (kWg) {
    if (tma) {
      if (threadIdx.x == 0) {
        cuda::mbarrier_init(bars, 1);
        cuda::mbarrier_init(bars + 1, 1);
        cuda::fence_mbarrier_init();
      }
      cuda::cp_async_wait<0>();
      cuda::fence_proxy_async();  // Q and dO, for wgmma
      __syncthreads();
    }
  }

  // The key tiles of the compressed and window branches as one sequence. The selection branch
  // is slc_dq_kernel's (slc_dq.cuh): here it is a stage without tiles, whose dg (pass 1) is 0
  // until that kernel writes it.
  const int nc = int(visible_cmp_blocks(t_last, a.l, a.d));
  const int n_cmp = (nc + kKeys - 1) / kKeys;
  const int p0 = int(window_start(t_first, a.w));
  const int n_win = a.w > 0 ? (t_last - p0 + kKeys) / kKeys : 0;
  const int n_tiles = n_cmp + n_slc + n_win;
  // Stages of a sweep: the branches in index order (kCmp = 0, kSlc = 1, kWin = 2).
  auto branch_of = [&](int i) { return i < n_cmp ? int(kCmp) : i < n_cmp + n_slc ? int(kSlc) : int(kWin); };
  auto branch_at = [&](int stage) { return stage; };
  auto stage_of = [&](int branch) { return branch; };
  // Tile i: its keys' geometry and the rows of its first key (key c at kb + c * ks, vb + c * vs).
  const int64_t crow0 = cmp_row_offset(s0, a.d);  // (a 64-bit division: once, not per tile)
  auto tile_at = [&](int i, const E*& kb, int64_t& ks, const E*& vb, int64_t& vs) -> KeyTile {
    // Raw keys of branch b from sequence position pos on.
    auto raw_rows = [&](int b, int pos) {
      const Mat3& K = a.k[b];
      const Mat3& V = a.v[b];
      ks = K.s0;
      vs = V.s0;
      kb = static_cast<const E*>(K.p) + (s0 + pos) * K.s0 + hk * K.s1;
      vb = static_cast<const E*>(V.p) + (s0 + pos) * V.s0 + hk * V.s1;
    };
    if (i < n_cmp) {
      const int i0 = i * kKeys;
      const int64_t crow = crow0 + i0;
      ks = int64_t(a.hkv) * DQK;
      vs = int64_t(a.hkv) * DV;
      kb = static_cast<const E*>(a.kc) + (crow * a.hkv + hk) * DQK;
      vb = static_cast<const E*>(a.vc) + (crow * a.hkv + hk) * DV;
      return KeyTile{min(kKeys, nc - i0), i0 * a.d + a.l - 1, a.d};
    }
    if (i < n_cmp + n_slc) {  // a union block (l' = kKeys): its keys up to the sequence's end
      const int pos = slc_blocks[i - n_cmp] * kKeys;
      raw_rows(kSlc, pos);
      return KeyTile{min(kKeys, len - pos), pos, 1, slc_tokens[i - n_cmp]};
    }
    const int pos = p0 + (i - n_cmp - n_slc) * kKeys, end = t_last + 1;
    raw_rows(kWin, pos);
    return KeyTile{max(0, min(kKeys, end - pos)), pos, 1};
  };
  // TMA (one thread): tile i into buffer buf. Rows past the tile's keys arrive as whatever the
  // tensors hold there (later rows, the compressed row no sequence uses, TMA's zeros past the
  // end); sweep zeroes them before the tile is used.
  auto issue_tma = [&](int i, int buf) {
    uint64_t* bar = bars + buf;
    cuda::mbarrier_expect_tx(bar, kKeys * (DQK + DV) * sizeof(E));
    const bool cmp = i < n_cmp, slc = !cmp && i < n_cmp + n_slc;
    const CUtensorMap* km = cmp ? &maps.kc : slc ? &maps.ks : &maps.kw;
    const CUtensorMap* vm = cmp ? &maps.vc : slc ? &maps.vs : &maps.vw;
    const int row = cmp ? int(crow0) + i * kKeys
                        : slc ? int(s0) + slc_blocks[i - n_cmp] * kKeys : int(s0) + p0 + (i - n_cmp - n_slc) * kKeys;
#pragma unroll
    for (int blk = 0; blk < DQK / 64; ++blk) cuda::tma_load_3d(sK + buf * kKBuf + blk * kKeys * 64, km, 64 * blk, hk, row, bar);
#pragma unroll
    for (int blk = 0; blk < DV / 64; ++blk) cuda::tma_load_3d(sV + buf * kVBuf + blk * kKeys * 64, vm, 64 * blk, hk, row, bar);
  };
  auto issue = [&](int i, int buf) {
    const E* kb;
    const E* vb;
    int64_t ks, vs;
    const KeyTile kt = tile_at(i, kb, ks, vb, vs);
    // (kb may point past the tensor for an empty chunk: zero-filled rows take qb as their address)
    if constexpr (kWg) {
      copy_rows_sw128<E, DQK>(sK + buf * kKBuf, [&](int c) -> const E* { return c < kt.nk ? kb + c * ks : nullptr; },
                              a.vec, qb);
      copy_rows_sw128<E, DV>(sV + buf * kVBuf, [&](int c) -> const E* { return c < kt.nk ? vb + c * vs : nullptr; },
                             a.vec, qb);
    } else {
      copy_rows<E, DQK>(sK + buf * kKBuf, [&](int c) -> const E* { return c < kt.nk ? kb + c * ks : nullptr; },
                        a.vec, qb);
      copy_rows<E, DV>(sV + buf * kVBuf, [&](int c) -> const E* { return c < kt.nk ? vb + c * vs : nullptr; },
                       a.vec, qb);
    }
  };

  // This thread's two rows of the warp's 16: group (h = 0) and group + 8 (h = 1).
  int rtok[2], rhead[2], rt[2], rbit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + group + 8 * h;
    rbit[h] = r / a.G;  // the row's token in the tile (KeyTile::tokens)
    rtok[h] = row_token(r);
    rhead[h] = row_head(r);
    rt[h] = rtok[h] >= 0 ? int(rtok[h] - s0) : -1;
  }
  // Per-branch state of the two rows: lse in log2 units, gate, D = gate dg (pass 2's dS = scale P
  // (gate dP - D)), visible positions [lo, hi].
  float lse2[2], gate[2], dsub[2];
  int lo[2], hi[2];
  int cur_branch = kCmp;  // the branch of set_branch's state
  auto set_branch = [&](int branch, bool with_dg) {
    cur_branch = branch;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lse2[h] = gate[h] = dsub[h] = 0.f;
      lo[h] = 0;
      hi[h] = -1;  // a padding row sees nothing
      if (rtok[h] < 0) continue;
      const int64_t tok = rtok[h];
      lse2[h] = static_cast<const float*>(a.lse.p)[tok * a.lse.s0 + rhead[h] * a.lse.s1 + branch] * kLog2e;
      gate[h] = load_f32<E>(a.g.p, tok * a.g.s0 + rhead[h] * a.g.s1 + branch);
      if (with_dg) dsub[h] = gate[h] * a.dg32[(tok * a.hq + rhead[h]) * 3 + branch];
      lo[h] = branch == kWin ? rt[h] - a.w + 1 : INT32_MIN;
      hi[h] = rt[h];
    }
  };
  // Which of the thread's rows see keys of tile kt, and whether any row of the warp does: a warp
  // with nothing to do (a window tile before its rows' windows, a compressed tile after them)
  // skips the tile. wgmma: whether any row of the CTA does (the warpgroup multiplies together):
  // its rows are every head of tokens t_first..t_last, so some row sees a key at position p when
  // p <= t_last and (window) p >= t_first - w + 1; from the tile's first and last key, no barrier.
  bool chose[2];
  auto warp_takes = [&](const KeyTile& kt) {
    const int first = kt.kp0, last = kt.kp0 + (kt.nk - 1) * kt.kstep;
    bool any = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      chose[h] = kt.nk > 0 && rtok[h] >= 0 && hi[h] >= first && lo[h] <= last && ((kt.tokens >> rbit[h]) & 1ull);
      any |= chose[h];
    }
    if constexpr (kWg)
      return kt.nk > 0 && first <= t_last && (cur_branch != kWin || last >= t_first - a.w + 1);
    else
      return __any_sync(0xffffffffu, any);
  };
  // s (scores of the warp's rows x keys c0 .. c0 + 31) -> P = exp(scale s - lse), 0 where masked.
  auto probabilities = [&](float (&s)[kSubTiles][4], const KeyTile& kt, int c0) {
#pragma unroll
    for (int nt = 0; nt < kSubTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, c = c0 + nt * 8 + 2 * quad + (e & 1);
        const int pos = kt.kp0 + c * kt.kstep;
        const bool vis = chose[h] && c < kt.nk && pos >= lo[h] && pos <= hi[h];
        s[nt][e] = vis ? exp2f(s[nt][e] * scale_log2 - lse2[h]) : 0.f;
      }
    }
  };
  // wgmma: the same for the whole tile (keys 0 .. 63), with ex2.approx; when every key of the tile
  // is visible to every row of the warp (most tiles), without the per-key mask.
  auto probabilities_wg = [&](float (&s)[kKeys / 8][4], const KeyTile& kt) {
    bool whole = kt.nk == kKeys;
#pragma unroll
    for (int h = 0; h < 2; ++h) whole = whole && chose[h] && lo[h] <= kt.kp0 && hi[h] >= kt.kp0 + (kKeys - 1) * kt.kstep;
    if (__all_sync(0xffffffffu, whole)) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dq_exp2(fmaf(s[nt][e], scale_log2, -lse2[e >> 1]));
      return;
    }
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, c = nt * 8 + 2 * quad + (e & 1);
        const int pos = kt.kp0 + c * kt.kstep;
        const bool vis = chose[h] && c < kt.nk && pos >= lo[h] && pos <= hi[h];
        s[nt][e] = vis ? dq_exp2(fmaf(s[nt][e], scale_log2, -lse2[h])) : 0.f;
      }
    }
  };

  // One sweep over all key tiles, two-stage: tile i + 1's copy goes out before tile i is computed
  // (kOneBuf: after, into the same buffer; the SM's other CTA computes meanwhile).
  // enter(prev, next) runs (block-uniformly) between stages (prev = -1 first, next = 3 last);
  // half(tk, tv, kt, c0) does keys c0 .. c0 + 31 of a tile in K/V buffers tk, tv.
  // skip_slc: the sweep leaves out the selection's tiles (pass 1 with a.d_from_o); j counts the
  // tiles it takes (buffers alternate with j), real(j) is the tile.
  auto sweep = [&](auto&& enter, auto&& half, bool skip_slc) {
    int cur = -1;
    const int n_run = skip_slc ? n_tiles - n_slc : n_tiles;
    auto real = [&](int j) { return skip_slc && j >= n_cmp ? j + n_slc : j; };
    if (tma) {
      if (threadIdx.x == 0 && n_run > 0) issue_tma(real(0), 0);
    } else {
      if (n_run > 0) issue(real(0), 0);
      cuda::cp_async_commit();
    }
    for (int j = 0; j < n_run; ++j) {
      const int i = real(j);
      const E* kb;
      const E* vb;
      int64_t ks, vs;
      const KeyTile kt = tile_at(i, kb, ks, vb, vs);
      if (tma) {
        // Tile j + 1's buffer: its last reader (tile j - 1) passed the barrier that ends its tile.
        if (!kOneBuf && threadIdx.x == 0 && j + 1 < n_run) issue_tma(real(j + 1), (j + 1) & 1);
        const int buf = j & 1;
        cuda::mbarrier_wait_parity(bars + buf, (bar_phase >> buf) & 1u);
        bar_phase ^= 1u << buf;
        if (kt.nk < kKeys) {
          // The rows past the tile's keys become zeros (a NaN there would survive 0 * k).
          cuda::zero_sw128_rows<kKeys, kThreads>(sK + buf * kKBuf, DQK / 64, kt.nk);
          cuda::zero_sw128_rows<kKeys, kThreads>(sV + buf * kVBuf, DV / 64, kt.nk);
          cuda::fence_proxy_async();  // the zeros, for wgmma
          __syncthreads();
        }
      } else {
        if (!kOneBuf && j + 1 < n_run) issue(real(j + 1), (j + 1) & 1);  // its buffer's last reader (tile j-1) is done
        cuda::cp_async_commit();
        if constexpr (kOneBuf)
          cuda::cp_async_wait<0>();
        else
          cuda::cp_async_wait<1>();
        if constexpr (kWg) cuda::fence_proxy_async();  // the landed K/V copies, for wgmma
        __syncthreads();
      }
      const int stage = stage_of(branch_of(i));
      for (; cur < stage; ++cur) enter(cur, cur + 1);
      if (warp_takes(kt)) {
        constexpr int kStep = kWg ? kKeys : kSub;  // wgmma: the whole tile at once
#pragma unroll 1
        for (int c0 = 0; c0 < kKeys; c0 += kStep) half(sK + (j & 1) * kKBuf, sV + (j & 1) * kVBuf, kt, c0);
      }
      __syncthreads();
      if constexpr (kOneBuf) {  // the one buffer's readers are done: tile j + 1 into it
        if (j + 1 < n_run) {
          if (tma) {
            if (threadIdx.x == 0) issue_tma(real(j + 1), (j + 1) & 1);
          } else {
            issue(real(j + 1), 0);
          }
        }
      }
    }
    cuda::cp_async_wait<0>();
    __syncthreads();
    for (; cur < 2; ++cur) enter(cur, cur + 1);
    enter(2, 3);
  };

  // <dO, x> of the thread's row h, summed over the quad: x2(nt) gives the thread's column pair
  // 8 nt + 2 quad, + 1 of x; dO from the tile in shared memory.
  auto row_dot_do = [&](int h, auto&& x2) {
    const int r = row0 + group + 8 * h;
    const E* dorow = sDo + r * kLdV + 2 * quad;  // (padded layout)
    const unsigned char* dosw = reinterpret_cast<const unsigned char*>(sDo) + 4 * quad;  // (swizzled)
    float part = 0.f;
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt) {
      // dO[r][8 nt + 2 quad .. + 1]: in the swizzled tile the pair lies in the 16-byte piece of
      // columns 8 nt .. 8 nt + 7 of row r.
      const E* d = kWg ? reinterpret_cast<const E*>(dosw + cuda::sw128_offset(kRows, r, nt * 8)) : dorow + nt * 8;
      const float2 x = x2(nt);
      part += x.x * to_float(d[0]) + x.y * to_float(d[1]);
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);
    return part;
  };
  auto write_dg = [&](int h, int branch, float part) {
    if (quad == 0 && rtok[h] >= 0) {
      const int64_t tok = rtok[h];
      a.dg32[(tok * a.hq + rhead[h]) * 3 + branch] = part;
      static_cast<E*>(a.dg.p)[tok * a.dg.s0 + rhead[h] * a.dg.s1 + branch] = from_float<E>(part);
    }
  };

  // ---- pass 1: each branch's output o_b = P V from the saved lse, then dg_b = <dO, o_b>
  // (skipped when the forward's o_branch gave dg already: a.dg_ready is the same for every block;
  // with a.d_from_o without the selection's union tiles, whose D pass 2 takes from o)
  float acc_o[DV / 8][4];
  zero(acc_o);
  if (!a.dg_ready) sweep(
      [&](int prev, int next) {
        if (prev >= 0) {
          const int branch = branch_at(prev);
          // dg of the thread's rows: its columns of o_b times dO, then the quad's partial sums.
#pragma unroll
          for (int h = 0; h < 2; ++h)
            write_dg(h, branch, row_dot_do(h, [&](int nt) { return make_float2(acc_o[nt][2 * h], acc_o[nt][2 * h + 1]); }));
          zero(acc_o);
        }
        if (next < 3) set_branch(branch_at(next), false);
      },
      [&](const E* tk, const E* tv, const KeyTile& kt, int c0) {
        if constexpr (kWg) {  // S = Q K^T, then O += P V, 64 keys
          float s[kKeys / 8][4];  // (overwritten: the first product has scale_d 0)
          cuda::wgmma_batch([&] { cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DQK, kRows, true>(s, q_wg, cuda::smem_address(tk)); }, s);
          probabilities_wg(s, kt);
          uint32_t pf[kKeys / 16][4];
          to_operand<E, kKeys / 8>(s, pf);
          cuda::wgmma_batch([&] { wgmma_ab_issue<E, DV>(acc_o, pf, cuda::smem_address(tv)); }, acc_o);
        } else {
          float s[kSubTiles][4];
          mma_abt<E, DQK, kSubTiles>(s, sQ + row0 * kLdK, tk + c0 * kLdK);
          probabilities(s, kt, c0);
          uint32_t pf[kSubTiles / 2][4];
          to_operand<E, kSubTiles>(s, pf);
          mma_ab<E, DV, kSubTiles / 2>(acc_o, pf, tv + c0 * kLdV);
        }
      },
      /*skip_slc=*/a.d_from_o);
  __syncthreads();  // dg32 of this tile's rows is written (read back below by the same block)

  // ---- pass 2: dQ = scale * sum_b dS_b K_b, summed in registers over the three branches
  float acc_q[DQK / 8][4];
  zero(acc_q);
  // With a.d_from_o, the union tiles' selection stage (skipped by pass 1): D = g_slc <dO, o_slc> =
  // <dO, o> - g_cmp dg_cmp - g_win dg_win (pass 1 wrote those two), and dg_slc = sum_j P_j dP_j
  // summed here (dg_acc), as slc_dq_kernel does for the other tiles.
  const bool slc_from_o = a.d_from_o && n_slc > 0;
  float dg_acc[2] = {0.f, 0.f};
  sweep([&](int prev, int next) {
          if (slc_from_o && prev == kSlc)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float part = dg_acc[h];
              part += __shfl_xor_sync(0xffffffffu, part, 1);
              part += __shfl_xor_sync(0xffffffffu, part, 2);
              write_dg(h, kSlc, part);
            }
          if (next < 3) set_branch(branch_at(next), true);
          if (slc_from_o && next == kSlc)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const bool row = rtok[h] >= 0;
              const E* orow = static_cast<const E*>(a.o.p) + int64_t(row ? rtok[h] : 0) * a.o.s0 + int64_t(rhead[h]) * a.o.s1 + 2 * quad;
              const float dot = row_dot_do(h, [&](int nt) {
                return row ? make_float2(to_float(orow[8 * nt]), to_float(orow[8 * nt + 1])) : make_float2(0.f, 0.f);
              });
              if (row) dsub[h] = slc_d_from_o<E>(a, rtok[h], rhead[h], dot);
            }
        },
        [&](const E* tk, const E* tv, const KeyTile& kt, int c0) {
          if constexpr (kWg) {  // S = Q K^T, dP = dO V^T, then dQ += dS K, 64 keys
            float s[kKeys / 8][4], dp[kKeys / 8][4];  // (overwritten: the first products have scale_d 0)
            // S and dP in one batch, both operands from shared memory (no A fragments in registers).
            cuda::wgmma_batch([&] {
              cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DQK, kRows, true>(s, q_wg, cuda::smem_address(tk));
              cuda::wgmma_abt_ss_sw128<kKeys, kIsBf16<E>, DV, kRows, true>(dp, do_wg, cuda::smem_address(tv));
            }, s, dp);
            probabilities_wg(s, kt);
            const bool acc_dg = slc_from_o && cur_branch == kSlc;
#pragma unroll
            for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (acc_dg) dg_acc[e >> 1] += s[nt][e] * dp[nt][e];
                s[nt][e] = a.scale * s[nt][e] * (gate[e >> 1] * dp[nt][e] - dsub[e >> 1]);
              }
            uint32_t df[kKeys / 16][4];
            to_operand<E, kKeys / 8>(s, df);
            cuda::wgmma_batch([&] { wgmma_ab_issue<E, DQK>(acc_q, df, cuda::smem_address(tk)); }, acc_q);
          } else {
            float s[kSubTiles][4], dp[kSubTiles][4];
            mma_abt<E, DQK, kSubTiles>(s, sQ + row0 * kLdK, tk + c0 * kLdK);
            mma_abt<E, DV, kSubTiles>(dp, sDo + row0 * kLdV, tv + c0 * kLdV);
            probabilities(s, kt, c0);
#pragma unroll
            for (int nt = 0; nt < kSubTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                s[nt][e] = a.scale * s[nt][e] * (gate[e >> 1] * dp[nt][e] - dsub[e >> 1]);
            uint32_t df[kSubTiles / 2][4];
            to_operand<E, kSubTiles>(s, df);
            mma_ab<E, DQK, kSubTiles / 2>(acc_q, df, tk + c0 * kLdK);
          }
        },
        /*skip_slc=*/false);
  E* dqb = static_cast<E*>(a.dq.p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rtok[h] < 0) continue;
    E* out = dqb + int64_t(rtok[h]) * a.dq.s0 + int64_t(rhead[h]) * a.dq.s1 + 2 * quad;
    if (a.dq_pairs) {  // one 32-bit store per column pair (two 16-bit ones fill a sector half as well)
#pragma unroll
      for (int nt = 0; nt < DQK / 8; ++nt)
        *reinterpret_cast<uint32_t*>(out + nt * 8) =
            cuda::StorageTraits<E>::pack(acc_q[nt][2 * h], acc_q[nt][2 * h + 1]);
      continue;
    }
#pragma unroll
    for (int nt = 0; nt < DQK / 8; ++nt) {
      out[nt * 8] = from_float<E>(acc_q[nt][2 * h]);
      out[nt * 8 + 1] = from_float<E>(acc_q[nt][2 * h + 1]);
    }
  }
}

// ---- dkv_kernel --------------------------------------------------------------------------

enum class KeySet : int { raw = 0, cmp = 1 };

// One query tile of the key-centric kernel (one per pipeline buffer).
struct RowTile {
  const void* q[kRows];   // the row's Q and dO (nullptr: padding row, zero-filled)
  const void* dO[kRows];
  float4 st[kRows];   // (lse * log2 e, gate, dg, unused) of the current branch
  int2 vis[kRows];    // visible key positions [lo, hi]; hi = -1 for a padding row
};

template <typename E, int DQK, int DV>
struct DkvSmem {
  static constexpr int kK = 0;                             // [kKeys][DQK + kPad], resident
  static constexpr int kV = kK + tile_bytes<DQK>();        // [kKeys][DV + kPad]
  static constexpr int kQ = kV + tile_bytes<DV>();         // [2][kRows][DQK + kPad], double-buffered
  static constexpr int kDo = kQ + 2 * tile_bytes<DQK>();   // [2][kRows][DV + kPad]
  static constexpr int kRi = kDo + 2 * tile_bytes<DV>();   // [2] RowTile
  static constexpr int kPaddedEnd = kRi + 2 * int(sizeof(RowTile));
  static_assert(kRi % 16 == 0, "RowTile holds float4");
  // sm_90a (wgmma): the same tiles unpadded in the 128-byte swizzle layout (common/wgmma.h), from
  // a 1024-byte boundary of the dynamic shared memory (the host adds 1024 bytes of slack).
  // Q / dO buffers of the swizzled layout: two where two CTAs of that size still fit an SM, else
  // one (Dqk 192 / Dv 128: two make 129 KB, 134 KB with the padded layout's size that the launch
  // asked for before `b4155de`: one CTA per SM, dkv_kernel 1.8-2.25x its Dqk 128 time at 64K; one
  // makes 88 KB, two CTAs per SM). The RowTiles stay two (prefetch fills
  // the next one). kSwQdo: one Q and one dO buffer; kSwFixed: the rest (K, V, RowTiles, mbarriers;
  // static_assert below).
  static constexpr int kSwQdo = kRows * (DQK + DV) * 2;
  static constexpr int kSwFixed = kKeys * (DQK + DV) * 2 + 2 * int(sizeof(RowTile)) + 2 * int(sizeof(uint64_t));
  static constexpr int kSwBufs = two_ctas_fit_sm90(1024 + size_t(2 * kSwQdo + kSwFixed)) ? 2 : 1;
  static constexpr int kSwK = 0;                                    // [kKeys][DQK], resident
  static constexpr int kSwV = kSwK + kKeys * DQK * 2;               // [kKeys][DV]
  static constexpr int kSwQ = kSwV + kKeys * DV * 2;                // [kSwBufs][kRows][DQK]
  static constexpr int kSwDo = kSwQ + kSwBufs * kRows * DQK * 2;    // [kSwBufs][kRows][DV]
  static constexpr int kSwRi = kSwDo + kSwBufs * kRows * DV * 2;    // [2] RowTile
  static constexpr int kSwBars = kSwRi + 2 * int(sizeof(RowTile));  // [2] mbarriers (Q / dO by TMA)
  static constexpr int kSwEnd = kSwBars + 2 * int(sizeof(uint64_t));
  static_assert(kSwBars % 8 == 0, "mbarriers on 8 bytes");
  static_assert(DQK % 64 == 0 && DV % 64 == 0, "swizzled tiles are whole 64-column blocks");
  static_assert(kSwEnd == kSwBufs * kSwQdo + kSwFixed, "kSwFixed is the layout but the Q / dO buffers");
  // Bytes the launch asks for: enough for either layout (the device picks one per target).
  static constexpr int kEnd = kPaddedEnd > kSwEnd + 1024 ? kPaddedEnd : kSwEnd + 1024;
  // Where the sm_90a body runs (runs_sm90): the swizzled layout and its alignment slack only.
  static constexpr int kSwLaunch = kSwEnd + 1024;
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

// The tensor maps of q and dO for dkv_kernel<cmp> and <raw> on sm_90a ([T, Hq, D] views, boxes of
// kRows / G tokens x G heads x 64 columns: one query tile's 64 rows); `on` = 0 elsewhere.
struct DkvMaps {
  CUtensorMap q, d_o;
  int on;
};

// dkv_kernel<cmp>'s query split: the last split first (blockIdx.z = 0). CTAs start roughly in
// blockIdx order (x, then y, then z). A later split has more whole key tiles (tiles every one of
// its queries sees: 8z of them at 64K with 8 splits) and each split a few tiles on the diagonal
// whose work shrinks to nothing (8 at 64K), so starting from the last split puts the whole tiles
// first and leaves the diagonal's small CTAs and the early exits for the tail, where in split
// order the last split's whole tiles came last. Which CTA does what does not change, only when
// it starts: the results are the same bits.
__device__ __forceinline__ int cmp_split_index() { return int(gridDim.z - 1 - blockIdx.z); }

template <typename E, int DQK, int DV, KeySet kSet>
__global__ void __launch_bounds__(kThreads) dkv_kernel(const BwdArgs a, const __grid_constant__ DkvMaps maps) {
  using L = DkvSmem<E, DQK, DV>;
  constexpr int kLdK = DQK + kPad, kLdV = DV + kPad;
  // sm_90a: the four products on wgmma, tiles in the swizzle layout (compute below).
  constexpr bool kWg = cuda::kWgmmaCompiled;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw;
  if constexpr (kWg) smem += (1024u - (cuda::smem_address(smem_raw) & 1023u)) & 1023u;
  E* sK = reinterpret_cast<E*>(smem + (kWg ? L::kSwK : L::kK));
  E* sV = reinterpret_cast<E*>(smem + (kWg ? L::kSwV : L::kV));
  E* sQ = reinterpret_cast<E*>(smem + (kWg ? L::kSwQ : L::kQ));
  E* sDo = reinterpret_cast<E*>(smem + (kWg ? L::kSwDo : L::kDo));
  RowTile* ri = reinterpret_cast<RowTile*>(smem + (kWg ? L::kSwRi : L::kRi));
  // Elements from one Q (dO) buffer to the next; 0 where the swizzled layout has one buffer.
  constexpr bool kOneBuf = kWg && L::kSwBufs == 1;
  constexpr int kQBuf = kOneBuf ? 0 : kWg ? kRows * DQK : kRows * kLdK;
  constexpr int kDoBuf = kOneBuf ? 0 : kWg ? kRows * DV : kRows * kLdV;
  // copy_rows into the layout of this target (copy_rows_sw128: dq_wgmma.cuh, kKeys = kRows rows).
  auto copy_tile = [&](auto dim, E* dst, auto row_ptr, const E* any) {
    constexpr int D = decltype(dim)::value;
    if constexpr (kWg)
      copy_rows_sw128<E, D>(dst, row_ptr, a.vec, any);
    else
      copy_rows<E, D>(dst, row_ptr, a.vec, any);
  };
  using DimK = std::integral_constant<int, DQK>;
  using DimV = std::integral_constant<int, DV>;
  const int tq = kRows / a.G;
  int hk = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int key_w = warp * 16;  // the warp's first key of the tile
  const E* qb = static_cast<const E*>(a.q.p);
  const E* dob = static_cast<const E*>(a.d_o.p);
  const float scale_log2 = a.scale * kLog2e;

  // Raw keys with pieces (BwdArgs::raw): an extra CTA in front of the grid runs piece
  // `piece` of raw CTA (hk, bx)'s list; the block's own CTAs come after them.
  int bx = int(blockIdx.x);
  int piece = 0;
  int2 split = make_int2(-1, 1);  // (first slot, pieces) of this CTA's list
  if constexpr (kSet == KeySet::raw) {
    if (a.raw.pool > 0) {
      if (bx < a.raw.extra_x) {
        const int slot = int(blockIdx.y) * a.raw.extra_x + bx;
        if (slot >= a.raw.pool) return;
        const int2 e = a.raw.slot[slot];
        if (e.x < 0 || e.y == 0) return;  // unused, or a piece 0 (its block's own CTA runs it)
        hk = e.x / a.raw.x;
        bx = e.x % a.raw.x;
        piece = e.y;
      } else {
        bx -= a.raw.extra_x;
      }
      split = a.raw.split[hk * a.raw.x + bx];
    }
  }

  // Which key tile this block owns.
  int b, key0, nk, j = 0;
  if constexpr (kSet != KeySet::cmp) {
    const int chunks = (a.lp + kKeys - 1) / kKeys;
    const int per_seq = a.n_slc_max * chunks;
    b = bx / per_seq;
    j = (bx % per_seq) / chunks;
    key0 = j * a.lp + (bx % chunks) * kKeys;  // first key position
  } else {
    const int per_seq = int((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys);
    b = blockIdx.x / per_seq;
    key0 = (blockIdx.x % per_seq) * kKeys;  // first compressed block
  }
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  const int64_t crow0 = cmp_row_offset(s0, a.d);  // first compressed row of the sequence
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
  // This thread's two keys of the warp's 16: group (h = 0) and group + 8 (h = 1).
  int kpos[2];
  bool kin[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = key_w + group + 8 * h;
    kin[h] = c < nk;
    kpos[h] = kt.kp0 + c * kt.kstep;
  }

  // The query tiles of this block, as one sequence: phase 0 (raw: window; cmp: one query split)
  // then phase 1 (raw only: the selection list, or this piece of it).
  int n0 = 0, n1 = 0, t_end = 0, first = 0, last = 0, ti0 = 0;
  int cmp_q0 = 0, cmp_q1 = 0;  // compressed: this split's query positions [cmp_q0, cmp_q1)
  int nk_emit = nk;            // keys of the tile whose dK / dV rows this block writes
  if constexpr (kSet == KeySet::raw) {
    // (raw_pieces_plan_kernel counts the same tiles by raw_cta_tiles, backward.cu: keep them in step)
    if (a.w > 0) {
      t_end = min(len - 1, key0 + nk - 1 + a.w - 1);  // window queries: [key0, t_end]
      n0 = (t_end - key0 + tq) / tq;
    }
    if (a.n > 0) {
      const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
      first = a.sel_offsets[key];
      last = a.sel_offsets[key + 1];
      n1 = (last - first + tq - 1) / tq;
    }
    if (split.y > 1) {  // piece `piece` of the list: its tiles [ti0, ti0 + n1); the window stays with piece 0
      const int per = (n1 + split.y - 1) / split.y;
      ti0 = piece * per;
      n1 = max(0, min(n1, ti0 + per) - ti0);
      if (piece > 0) n0 = 0;
    }
  } else {
    // Compressed keys: the queries t >= key0 * d + l - 1 of split z (cmp_split_of, cmp_split_index).
    // A split before `last` that sees none of the tile's blocks has nothing to write.
    const CmpSplit cs = cmp_split_of(len, a.cmp_splits);
    const int z = cmp_split_index();
    if (z > cs.last) return;
    const int t_first = key0 * a.d + a.l - 1;
    cmp_q0 = max(t_first, int(z * cs.S));
    cmp_q1 = z == cs.last ? len : int(min(int64_t(len), (z + 1) * cs.S));
    if (cmp_q0 >= cmp_q1) return;
    n0 = (cmp_q1 - cmp_q0 + tq - 1) / tq;
    if (z < cs.last) nk_emit = int(min(int64_t(nk), cmp_split_rows(len, z, cs, a.l, a.d) - key0));
  }

  // Starts copying the key tile of `phase` (raw: window or selection keys; else the only one).
  auto load_kv = [&](int phase) {
    const E* kb;
    const E* vb;
    int64_t ks, vs;
    if constexpr (kSet == KeySet::cmp) {
      const int64_t crow = crow0 + key0;
      kb = static_cast<const E*>(a.kc) + (crow * a.hkv + hk) * DQK;
      vb = static_cast<const E*>(a.vc) + (crow * a.hkv + hk) * DV;
      ks = int64_t(a.hkv) * DQK;
      vs = int64_t(a.hkv) * DV;
    } else {
      const int br = kSet == KeySet::raw && phase == 0 ? kWin : kSlc;
      const Mat3& K = a.k[br];
      const Mat3& V = a.v[br];
      kb = static_cast<const E*>(K.p) + (s0 + key0) * K.s0 + hk * K.s1;
      vb = static_cast<const E*>(V.p) + (s0 + key0) * V.s0 + hk * V.s1;
      ks = K.s0;
      vs = V.s0;
    }
    copy_tile(DimK{}, sK, [&](int c) -> const E* { return c < nk ? kb + c * ks : nullptr; }, qb);
    copy_tile(DimV{}, sV, [&](int c) -> const E* { return c < nk ? vb + c * vs : nullptr; }, qb);
  };

  // Fills RowTile `buf` for query tile i of the sequence and starts copying its Q and dO rows into
  // buffer `buf`. Nothing reads this buffer before the pipeline's next barrier. Bit `buf` of
  // `whole` says whether every row of the tile sees every key of the key tile (padding rows count
  // as seeing them: their zero Q and dO rows and zero gate give P = dS = 0 anyway); then compute()
  // skips the per-key mask.
  const int first_pos = kt.kp0, last_pos = kt.kp0 + (nk - 1) * kt.kstep;
  int whole = 0;
  // sm_90a, tensor maps made: thread 0 copies each query tile of consecutive tokens (the compressed
  // keys' tiles, the raw keys' window tiles; not the selection's gathered ones) by TMA (DQK / 64 +
  // DV / 64 boxes of tq tokens x G heads), completing on the buffer's mbarrier. A box reads whole
  // tokens past the tile's (the next sequence's or split's, or TMA's zeros past the end); those
  // rows are zeroed after the wait (tile_rows), as the copies' zero fill did. tile_rows < 0: the
  // buffer's tile came by cp.async.
  // (<raw> at Dqk 192 keeps its copies: there the TMA path's registers raised its spills from 22 to
  // 70 bytes.)
  constexpr bool kTmaSet = kWg && (kSet == KeySet::cmp || (kSet == KeySet::raw && DQK <= 128));
  const bool tma = kTmaSet && maps.on != 0;
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + L::kSwBars);
  uint32_t bar_phase = 0;  // bit b: the parity of buffer b's next fill
  int tile_rows0 = -1, tile_rows1 = -1;  // rows of real queries in buffers 0 / 1 (TMA: the rest zeroed)
  if constexpr (kTmaSet) {
    if (tma && threadIdx.x == 0) {
      cuda::mbarrier_init(bars, 1);
      cuda::mbarrier_init(bars + 1, 1);
      cuda::fence_mbarrier_init();
    }
    // (every thread waits on them only after the prefetch's __syncthreads_and)
  }
  auto prefetch = [&](int i, int buf) {
    RowTile& R = ri[buf];
    const bool list = kSet == KeySet::raw && i >= n0;
    const int branch = kSet == KeySet::cmp ? kCmp : list ? kSlc : kWin;
    int t0 = 0, i0 = 0, ntok;
    if (list) {  // tokens from the inverted index
      i0 = first + (ti0 + i - n0) * tq;
      ntok = min(tq, last - i0);
    } else if (kSet == KeySet::raw) {  // window: consecutive tokens from key0
      t0 = key0 + i * tq;
      ntok = min(tq, t_end - t0 + 1);
    } else {  // compressed: consecutive tokens of this split's range
      t0 = cmp_q0 + i * tq;
      ntok = min(tq, cmp_q1 - t0);
    }
    bool sees_all = true;
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      const int u = r / a.G;
      const int tok = u >= ntok ? -1 : list ? a.sel_tokens[i0 + u] : int(s0 + t0 + u);
      const int h = hk * a.G + r % a.G;
      if (tok < 0) {
        R.q[r] = R.dO[r] = nullptr;
        R.st[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        R.vis[r] = make_int2(0, -1);
        continue;
      }
      R.q[r] = qb + int64_t(tok) * a.q.s0 + int64_t(h) * a.q.s1;
      R.dO[r] = dob + int64_t(tok) * a.d_o.s0 + int64_t(h) * a.d_o.s1;
      const int t = int(tok - s0);
      const float lse = static_cast<const float*>(a.lse.p)[tok * a.lse.s0 + h * a.lse.s1 + branch];
      const float g = load_f32<E>(a.g.p, tok * a.g.s0 + h * a.g.s1 + branch);
      const float dg = a.dg32[(int64_t(tok) * a.hq + h) * 3 + branch];
      R.st[r] = make_float4(lse * kLog2e, g, dg, 0.f);
      const int lo = branch == kWin ? t - a.w + 1 : INT32_MIN;
      R.vis[r] = make_int2(lo, t);
      sees_all = sees_all && lo <= first_pos && t >= last_pos;
    }
    // the row pointers are in place for the copies; every thread learns the tile's flag
    const int all = __syncthreads_and(sees_all);
    whole = (whole & ~(1 << buf)) | (all ? 1 << buf : 0);
    if constexpr (kTmaSet) {
      (buf ? tile_rows1 : tile_rows0) = tma && !list ? ntok * a.G : -1;
      if (tma && !list) {
        if (threadIdx.x == 0) {
          uint64_t* bar = bars + buf;
          cuda::mbarrier_expect_tx(bar, kRows * (DQK + DV) * sizeof(E));
          const int tok = int(s0) + t0, h0 = hk * a.G;
#pragma unroll
          for (int blk = 0; blk < DQK / 64; ++blk)
            cuda::tma_load_3d(sQ + buf * kQBuf + blk * kRows * 64, &maps.q, 64 * blk, h0, tok, bar);
#pragma unroll
          for (int blk = 0; blk < DV / 64; ++blk)
            cuda::tma_load_3d(sDo + buf * kDoBuf + blk * kRows * 64, &maps.d_o, 64 * blk, h0, tok, bar);
        }
        return;
      }
    }
    copy_tile(DimK{}, sQ + buf * kQBuf, [&](int r) { return static_cast<const E*>(R.q[r]); }, qb);
    copy_tile(DimV{}, sDo + buf * kDoBuf, [&](int r) { return static_cast<const E*>(R.dO[r]); }, dob);
  };
  // TMA: waits for buffer buf's Q and dO, then zeroes its rows past the tile's queries (a NaN
  // there would survive P = 0) and makes the zeros visible to wgmma.
  auto land_tma = [&](int buf) {
    if constexpr (kTmaSet) {
      const int r0 = buf ? tile_rows1 : tile_rows0;
      if (r0 < 0) return;  // copied by cp.async
      cuda::mbarrier_wait_parity(bars + buf, (bar_phase >> buf) & 1u);
      bar_phase ^= 1u << buf;
      if (r0 < kRows) {
        cuda::zero_sw128_rows<kRows, kThreads>(sQ + buf * kQBuf, DQK / 64, r0);
        cuda::zero_sw128_rows<kRows, kThreads>(sDo + buf * kDoBuf, DV / 64, r0);
        cuda::fence_proxy_async();  // the zeros, for wgmma
        __syncthreads();
      }
    }
  };

  float acc_k[DQK / 8][4], acc_v[DV / 8][4];
  zero(acc_k);
  zero(acc_v);

  // sm_90a: the products of one half (rows r0 .. r0 + 31 of query buffer `buf`) as warpgroup MMAs.
  // The K and V tiles are A operands read from shared memory (K-major descriptors, never held in
  // registers); P^T and dS^T are register A operands packed from this half's accumulators.
  constexpr int kSwBlock = kRows * 128;  // bytes of one 64-column block of a 64-row swizzled tile
  auto sw_desc = [](uint32_t base, uint32_t off, uint32_t lbo) { return cuda::wgmma_desc_sw128(base, off, lbo, 1024); };
  // S^T = K Q^T and dP^T = V dO^T (64 keys x 32 rows each): m64n32k16, A and B both K-major.
  auto wg_scores = [&](float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], int buf, int r0) {
    const uint32_t k_base = cuda::smem_address(sK), v_base = cuda::smem_address(sV);
    const uint32_t q_base = cuda::smem_address(sQ + buf * kQBuf) + r0 * 128;
    const uint32_t do_base = cuda::smem_address(sDo + buf * kDoBuf) + r0 * 128;
    // (s and dp are overwritten: each one's first product has scale_d 0.)
    cuda::wgmma_batch([&] {
#pragma unroll
      for (int kk = 0; kk < DQK / 16; ++kk) {
        const uint32_t off = (kk >> 2) * kSwBlock + (kk & 3) * 32;
        cuda::wgmma_ss<kSub, kIsBf16<E>, 0>(s, sw_desc(k_base, off, 16), sw_desc(q_base, off, 16), kk == 0 ? 0 : 1);
      }
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk) {
        const uint32_t off = (kk >> 2) * kSwBlock + (kk & 3) * 32;
        cuda::wgmma_ss<kSub, kIsBf16<E>, 0>(dp, sw_desc(v_base, off, 16), sw_desc(do_base, off, 16), kk == 0 ? 0 : 1);
      }
    }, s, dp);
  };
  // dV += (g P)^T dO and dK += scale dS^T Q: m64n{Dv}k16 and m64n{Dqk}k16, two k16 steps (the
  // half's 32 rows) each, B = the same Q / dO buffers read MN-major (LBO: the next 64 columns).
  auto wg_accumulate = [&](const uint32_t (&pf)[kSubTiles / 2][4], const uint32_t (&df)[kSubTiles / 2][4], int buf,
                           int r0) {
    const uint32_t q_base = cuda::smem_address(sQ + buf * kQBuf) + r0 * 128;
    const uint32_t do_base = cuda::smem_address(sDo + buf * kDoBuf) + r0 * 128;
    cuda::wgmma_batch([&] {
#pragma unroll
      for (int kk = 0; kk < kSubTiles / 2; ++kk)
        cuda::wgmma_rs<DV, kIsBf16<E>, 1>(acc_v, pf[kk], sw_desc(do_base, kk * 16 * 128, kSwBlock), 1);
#pragma unroll
      for (int kk = 0; kk < kSubTiles / 2; ++kk)
        cuda::wgmma_rs<DQK, kIsBf16<E>, 1>(acc_k, df[kk], sw_desc(q_base, kk * 16 * 128, kSwBlock), 1);
    }, acc_v, acc_k);
  };

  // One query tile (buffer `buf`) against the resident key tile: this warp's 16 keys, the tile's
  // rows in two halves of 32.
  auto compute = [&](int buf) {
    const RowTile& R = ri[buf];
#pragma unroll 1
    for (int r0 = 0; r0 < kRows; r0 += kSub) {
      float s[kSubTiles][4], dp[kSubTiles][4];
      if constexpr (kWg) {
        wg_scores(s, dp, buf, r0);
      } else {
        const E* q = sQ + (buf * kRows + r0) * kLdK;
        const E* dO = sDo + (buf * kRows + r0) * kLdV;
        mma_abt<E, DQK, kSubTiles>(s, sK + key_w * kLdK, q);   // S^T: keys x rows
        mma_abt<E, DV, kSubTiles>(dp, sV + key_w * kLdV, dO);  // dP^T
      }
      // g P = g exp2(scale S log2 e - lse log2 e) and dS = scale g P (dP - dg); P uses ex2.approx
      // (dq_exp2: probabilities below 2^-126 flush to 0). Keys past the tile's nk (zero rows) need
      // no mask: their dK / dV rows are never written.
      if (whole >> buf & 1) {
#pragma unroll
        for (int nt = 0; nt < kSubTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float4 st = R.st[r0 + nt * 8 + 2 * quad + i];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float& x = s[nt][2 * h + i];
              x = st.y * dq_exp2(fmaf(x, scale_log2, -st.x));
              dp[nt][2 * h + i] = a.scale * x * (dp[nt][2 * h + i] - st.z);
            }
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kSubTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int r = r0 + nt * 8 + 2 * quad + i;
            const float4 st = R.st[r];
            const int2 vis = R.vis[r];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const bool v = kin[h] && kpos[h] >= vis.x && kpos[h] <= vis.y;
              float& x = s[nt][2 * h + i];
              x = v ? st.y * dq_exp2(fmaf(x, scale_log2, -st.x)) : 0.f;
              dp[nt][2 * h + i] = a.scale * x * (dp[nt][2 * h + i] - st.z);
            }
          }
        }
      }
      uint32_t pf[kSubTiles / 2][4], df[kSubTiles / 2][4];
      to_operand<E, kSubTiles>(s, pf);
      to_operand<E, kSubTiles>(dp, df);
      if constexpr (kWg) {
        wg_accumulate(pf, df, buf, r0);
      } else {
        const E* q = sQ + (buf * kRows + r0) * kLdK;
        const E* dO = sDo + (buf * kRows + r0) * kLdV;
        mma_ab<E, DV, kSubTiles / 2>(acc_v, pf, dO);  // dV += (g P)^T dO
        mma_ab<E, DQK, kSubTiles / 2>(acc_k, df, q);  // dK += scale dS^T Q
      }
    }
  };

  // Writes the accumulated dK (which = 0) or dV rows through an fp32 scratch over the key tile's
  // shared memory (free: the caller has passed a barrier after the last compute and reloads K/V
  // before the next), 32 columns at a time so that it fits for every head dim; then clears them.
  // Per element: raw keys add phi's gradient (shared K/V) and round once (finish_raw), or, as a
  // piece of a split list, store their fp32 partial; compressed keys store fp32 partials.
  float* scratch = reinterpret_cast<float*>(smem + L::kK);
  constexpr int kLdS = kSub + 4;
  static_assert(kKeys * kLdS * 4 <= tile_bytes<64>(), "the scratch fits the K tile");
  static_assert(kKeys * kLdS * 4 <= L::kSwQ, "swizzled: the scratch fits the K and V tiles (both reloaded after)");
  // Element (c, col) of the tile's dK (which = 0) or dV rows, from its fp32 sum: shared K/V add
  // phi's gradient (add_phi), then it is rounded once into out.
  auto finish_raw = [&](int which, int D, int c, int col, float val, OutMat3 out, bool add_phi) {
    if (add_phi) val += phi_dx<E>(which == 0 ? a.phi_k : a.phi_v, a, D, s0, len, key0 + c, hk, col);
    static_cast<E*>(out.p)[(s0 + key0 + c) * out.s0 + hk * out.s1 + col] = from_float<E>(val);
  };
  auto emit_column_block = [&](int which, int D, int col0, OutMat3 out, bool add_phi, float* part) {
    __syncthreads();
    for (int e = threadIdx.x; e < nk_emit * kSub; e += kThreads) {
      const int c = e / kSub, col = col0 + e % kSub;
      float val = scratch[c * kLdS + e % kSub];
      if constexpr (kSet == KeySet::raw) {
        if (part != nullptr) {  // a piece of a split list: its fp32 partial, slot rows [kKeys][D]
          part[c * D + col] = val;
          continue;
        }
        finish_raw(which, D, c, col, val, out, add_phi);
      } else {
        part[((crow0 + key0 + c) * a.hkv + hk) * D + col] = val;
      }
    }
    __syncthreads();
  };
  auto emit = [&](auto& acc, int which, OutMat3 out, bool add_phi, float* part) {
    constexpr int kTiles = int(std::extent_v<std::remove_reference_t<decltype(acc)>>);
#pragma unroll 1
    for (int col0 = 0; col0 < kTiles * 8; col0 += kSub) {
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        if (nt / kSubTiles != col0 / kSub) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = key_w + group + 8 * (e >> 1), col = (nt % kSubTiles) * 8 + 2 * quad + (e & 1);
          scratch[c * kLdS + col] = acc[nt][e];
          acc[nt][e] = 0.f;
        }
      }
      emit_column_block(which, kTiles * 8, col0, out, add_phi, part);
    }
  };
  auto epilogue = [&](OutMat3 dk_out, OutMat3 dv_out, bool add_phi, float* part_k, float* part_v) {
    emit(acc_k, 0, dk_out, add_phi, part_k);
    emit(acc_v, 1, dv_out, add_phi, part_v);
  };

  // The two-stage pipeline: query tile i + 1's rows and copies go out before tile i is computed
  // (kOneBuf: after, into the same Q / dO buffer; the SM's other CTA computes meanwhile).
  const int n_tiles = n0 + n1;
  if (kSet == KeySet::raw && !a.shared_kv && n0 == 0 && piece == 0)
    epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);  // no window: zeros
  if (n_tiles > 0) {
    load_kv(n0 > 0 ? 0 : 1);
    prefetch(0, 0);
  }
  cuda::cp_async_commit();
  for (int i = 0; i < n_tiles; ++i) {
    if (!kOneBuf && i + 1 < n_tiles) prefetch(i + 1, (i + 1) & 1);  // its buffer's last reader (tile i-1) is done
    cuda::cp_async_commit();
    if constexpr (kOneBuf)
      cuda::cp_async_wait<0>();
    else
      cuda::cp_async_wait<1>();
    if constexpr (kWg) cuda::fence_proxy_async();  // landed copies (and plain stores) -> wgmma
    __syncthreads();
    if (kSet == KeySet::raw && i == n0 && i > 0) {
      // Window done, selection next: independent K/V write the window's gradient now; the
      // selection's keys replace the window's (tile i + 1's copies may stay in flight).
      if (!a.shared_kv) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);
      __syncthreads();
      load_kv(1);
      cuda::cp_async_commit();
      cuda::cp_async_wait<0>();
      if constexpr (kWg) cuda::fence_proxy_async();
      __syncthreads();
    }
    if (tma) land_tma(i & 1);
    compute(i & 1);
    __syncthreads();
    if constexpr (kOneBuf)
      if (i + 1 < n_tiles) prefetch(i + 1, (i + 1) & 1);  // the one buffer's readers are done
  }
  cuda::cp_async_wait<0>();
  __syncthreads();

  if constexpr (kSet == KeySet::raw) {
    if (!a.shared_kv && n0 > 0 && n1 == 0) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);
    if (split.y > 1) {
      // A piece: its partial to its slot, then count it in (the stores first, device-wide); the
      // last piece to arrive sums the slots in piece order and writes the block's dK / dV rows.
      const int64_t slot = split.x + piece;
      epilogue(OutMat3{}, OutMat3{}, false, a.raw.part_k + slot * kKeys * DQK, a.raw.part_v + slot * kKeys * DV);
      __threadfence();
      __syncthreads();
      __shared__ int last_in;
      if (threadIdx.x == 0) last_in = atomicAdd(a.raw.arrived + split.x, 1) == split.y - 1;
      __syncthreads();
      if (!last_in) return;
      __threadfence();
      const OutMat3 outs[2] = {a.shared_kv ? a.grad_k[kCmp] : a.grad_k[kSlc], a.shared_kv ? a.grad_v[kCmp] : a.grad_v[kSlc]};
#pragma unroll 1
      for (int which = 0; which < 2; ++which) {
        const int D = which == 0 ? DQK : DV;
        const float* slots = (which == 0 ? a.raw.part_k : a.raw.part_v) + int64_t(split.x) * kKeys * D;
        for (int e = threadIdx.x; e < nk * D; e += kThreads) {
          const int c = e / D, col = e % D;
          float val = 0.f;
          for (int p = 0; p < split.y; ++p) val += __ldcg(slots + (int64_t(p) * kKeys + c) * D + col);
          finish_raw(which, D, c, col, val, outs[which], a.shared_kv);
        }
      }
    } else if (a.shared_kv) {
      epilogue(a.grad_k[kCmp], a.grad_v[kCmp], true, nullptr, nullptr);
    } else {
      epilogue(a.grad_k[kSlc], a.grad_v[kSlc], false, nullptr, nullptr);
    }
  } else {
    // The last split writes dkc / dvc; split z < last its partial (rows before it: earlier splits).
    float* part_k = a.dkc;
    float* part_v = a.dvc;
    const int split = cmp_split_index();
    if (split < cmp_split_of(len, a.cmp_splits).last) {
      int64_t rows_before = 0;
      for (int z = 0; z < split; ++z) rows_before += a.cmp_part_rows[z];
      part_k = a.dkc_part + rows_before * a.hkv * DQK;
      part_v = a.dvc_part + rows_before * a.hkv * DV;
    }
    epilogue(OutMat3{}, OutMat3{}, false, part_k, part_v);
  }
}

// raw_pieces_plan_kernel (backward.cu) fills raw.split / raw.slot before dkv_kernel<raw> runs.
constexpr int kRawTargetCtas = 1024;   // cap = all raw CTAs' query tiles / this (~8 per CTA slot of an H200: a piece is a small part of a slot's work)
constexpr int kRawMinPieceTiles = 32;  // no piece shorter than this many query tiles

}  // namespace nsa::cuda_bwd

#include "cuda/backward/slc_dq.cuh"

namespace nsa::cuda_bwd {

// ---- launch: phase 0 = dq_kernel, 1 = dkv_kernel<cmp>, 2 = <raw>, 4 = slc_dq ------------------
// Explicitly instantiated once per dtype and Dqk (attention_<dtype>_hdim<Dqk>.cu).

// Two ~105 KB blocks per SM (Dqk, Dv <= 128) need the largest shared-memory carve-out.
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes) {
  cuda::allow_smem(kernel, bytes, /*max_carveout=*/true);
}

// A [rows, Hkv, D] map (boxes of 64 rows x 64 columns) of the tensor at p with strides st, sh (elements).
template <typename E, int D>
bool dq_rows_map(CUtensorMap* map, const void* p, int64_t rows, int64_t st, int64_t sh, int hkv) {
  if (p == nullptr || rows <= 0) return false;
  return cuda::make_rows_tensor_map(map, kIsBf16<E>, p, D, uint64_t(hkv), uint64_t(rows), st, sh, kKeys);
}
// Whether kKernel runs its sm_90a body (cuda::runs_wgmma_body), asked once per kernel.
template <auto kKernel>
bool runs_sm90() {
  static const bool sm90 = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, kKernel) == cudaSuccess && cuda::runs_wgmma_body(attr);
  }();
  return sm90;
}

// dq_kernel's maps, for the branches that have keys; false where one cannot be made or the
// kernel runs the sm_80 body (no TMA there).
template <typename E, int DQK, int DV>
bool dq_tensor_maps(DqMaps& m, const BwdArgs& a) {
  if (!runs_sm90<dq_kernel<E, DQK, DV>>() || !a.vec) return false;
  const bool cmp = a.rc > 0, win = a.w > 0, slc = a.slc_union;
  if (!cmp && !win && !slc) return false;
  if (slc && !(dq_rows_map<E, DQK>(&m.ks, a.k[kSlc].p, a.T, a.k[kSlc].s0, a.k[kSlc].s1, a.hkv) &&
               dq_rows_map<E, DV>(&m.vs, a.v[kSlc].p, a.T, a.v[kSlc].s0, a.v[kSlc].s1, a.hkv)))
    return false;
  if (cmp && !(dq_rows_map<E, DQK>(&m.kc, a.kc, a.rc, int64_t(a.hkv) * DQK, DQK, a.hkv) &&
               dq_rows_map<E, DV>(&m.vc, a.vc, a.rc, int64_t(a.hkv) * DV, DV, a.hkv)))
    return false;
  if (win && !(dq_rows_map<E, DQK>(&m.kw, a.k[kWin].p, a.T, a.k[kWin].s0, a.k[kWin].s1, a.hkv) &&
               dq_rows_map<E, DV>(&m.vw, a.v[kWin].p, a.T, a.v[kWin].s0, a.v[kWin].s1, a.hkv)))
    return false;
  return true;
}

// dkv_kernel<cmp> / <raw>'s maps of q and dO: [T, Hq, D] views, boxes of kRows / G tokens x G heads;
// false where one cannot be made or the kernel runs the sm_80 body (no TMA there).
template <typename E, int DQK, int DV>
bool dkv_tensor_maps(DkvMaps& m, const BwdArgs& a) {
  if (!runs_sm90<dkv_kernel<E, DQK, DV, KeySet::cmp>>() || !a.vec || a.T <= 0) return false;
  const uint32_t tq = uint32_t(kRows / a.G), g = uint32_t(a.G);
  return cuda::make_rows_tensor_map(&m.q, kIsBf16<E>, a.q.p, DQK, uint64_t(a.hq), uint64_t(a.T), a.q.s0, a.q.s1, tq,
                                    g) &&
         cuda::make_rows_tensor_map(&m.d_o, kIsBf16<E>, a.d_o.p, DV, uint64_t(a.hq), uint64_t(a.T), a.d_o.s0,
                                    a.d_o.s1, tq, g);
}

// Whether the selection's union tiles run (BwdArgs::slc_union): sm_90a's dq_kernel (wgmma), l' = one
// key tile, a selection branch, the warps' sorts fitting dq_kernel's K/V buffers, and not switched
// off (testing::set_slc_union_tiles_enabled, shared with the forward). dq_kernel and slc_dq_kernel
// must agree on it: both phases ask here.
template <typename E, int DQK, int DV>
bool slc_union_enabled(const BwdArgs& a) {
  return runs_sm90<dq_kernel<E, DQK, DV>>() && a.n > 0 && a.lp == kKeys && cuda::testing::slc_union_tiles_enabled() &&
         DqSmem<E, DQK, DV>::slc_union_sorts_fit(a.slc_cap);
}

template <typename E, int DQK, int DV>
void launch_attention(const BwdArgs& a_in, cudaStream_t s, int phase) {
  BwdArgs a = a_in;
  a.slc_cap = slc_dq_capacity(a.G, a.n);
  a.slc_union = slc_union_enabled<E, DQK, DV>(a);
  if (phase == 4) {  // the selection branch's dq (and dg), after dq_kernel ran without it
    const int cap = a.slc_cap;
    const size_t smem = slc_dq_smem_bytes(DQK, DV, cap);
    cuda::allow_smem(slc_dq_kernel<E, DQK, DV>, smem, /*max_carveout=*/true);  // the warps' rings
    const dim3 grid = cuda::row_tile_grid(a.max_seqlen, a.B, (16 / a.G) * kSlcDqWarps, a.hkv);
    if (grid.x == 0) return;
    slc_dq_kernel<E, DQK, DV><<<grid, kSlcDqWarps * 32, smem, s>>>(a, cap);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  if (phase == 0) {  // the compressed and window branches (the selection's is phase 4)
    const size_t smem = runs_sm90<dq_kernel<E, DQK, DV>>() ? DqSmem<E, DQK, DV>::kSwLaunch : DqSmem<E, DQK, DV>::kEnd;
    allow_smem(dq_kernel<E, DQK, DV>, smem);
    const dim3 grid = cuda::row_tile_grid(a.max_seqlen, a.B, kRows / a.G, a.hkv);
    if (grid.x == 0) return;
    DqMaps maps{};
    maps.on = dq_tensor_maps<E, DQK, DV>(maps, a) ? 1 : 0;
    dq_kernel<E, DQK, DV><<<grid, kThreads, smem, s>>>(a, maps);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  using Lk = DkvSmem<E, DQK, DV>;
  const size_t smem = runs_sm90<dkv_kernel<E, DQK, DV, KeySet::cmp>>() ? Lk::kSwLaunch : Lk::kEnd;
  if (phase == 1) {
    auto* kernel = dkv_kernel<E, DQK, DV, KeySet::cmp>;
    allow_smem(kernel, smem);
    const int64_t tiles = a.B * ((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys);
    if (tiles == 0) return;
    DkvMaps maps{};
    maps.on = dkv_tensor_maps<E, DQK, DV>(maps, a) ? 1 : 0;
    kernel<<<dim3(unsigned(tiles), unsigned(a.hkv), unsigned(a.cmp_splits)), kThreads, smem, s>>>(a, maps);
  } else {
    auto* kernel = dkv_kernel<E, DQK, DV, KeySet::raw>;
    allow_smem(kernel, smem);
    const int64_t tiles = a.B * int64_t(a.n_slc_max) * ((a.lp + kKeys - 1) / kKeys);
    if (tiles == 0) return;
    DkvMaps maps{};
    maps.on = a.w > 0 && dkv_tensor_maps<E, DQK, DV>(maps, a) ? 1 : 0;  // the window's query tiles
    // (raw.pool > 0: the extra CTAs of the long lists' pieces in front, backward.cu planned them)
    kernel<<<dim3(unsigned(tiles + a.raw.extra_x), unsigned(a.hkv)), kThreads, smem, s>>>(a, maps);
  }
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda_bwd
