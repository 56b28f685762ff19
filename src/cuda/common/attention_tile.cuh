// The attention engine shared by the forward kernels: one CTA of kRows / 16 warps owns a tile of
// kRows query rows (kRows/G neighbouring tokens x the G heads of one KV head) and streams chunks
// of kChunk keys through shared memory with cp.async. The compressed kernel uses 64 x 64
// (kTileRows, kKeyChunk); the selection + window kernel kSlcRows x kSlcChunk (also 64 x 64, through
// a ring of buffers, slc_win_attention.cuh).
//
// Per chunk, each warp computes its 16 x 64 block of S = Q K^T with mma.m16n8k16 (Q stays in
// registers for the whole kernel), applies the caller's mask, updates the online softmax
// (running max m and sum l per row, scores kept in log2 units), and adds P V into its
// 16 x Dv fp32 accumulator. P goes from the S accumulator to the A operand in registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/dtype.h"
#include "cuda/common/mma.h"
#include "cuda/common/wgmma.h"
#include "cuda/params.h"

namespace nsa::cuda {

inline constexpr int kWarps = kTileRows / 16;  // one m16 slice of the tile per warp
inline constexpr int kThreads = kWarps * 32;
// Padding of every shared row, in elements: a row then starts 16 bytes further along the banks,
// so the 8 rows an ldmatrix reads hit 8 different 16-byte bank groups (no conflicts).
inline constexpr int kSmemPad = 8;
// The forward's online softmax (TileAttention::softmax_update, slc_softmax_step) moves a row's
// reference max only when a chunk's max exceeds it by more than kSoftmaxMaxSlack (log2 units; from
// -inf at the first visible key): P then stays below 2^kSoftmaxMaxSlack (exact in fp32, bf16 / f16
// keep their relative precision there) and o = acc / l, lse = m + log2 l are the same quotients,
// while the accumulator's rescale runs at the first chunk and where scores jump instead of at most
// chunks (whenever one row of the warp found a larger score). 0 (CudaKernelChoices::
// softmax_max_slack off): the max follows every chunk's.
inline constexpr float kSoftmaxMaxSlack = 8.f;
__host__ __device__ inline float softmax_slack(const CudaKernelChoices& c) {
  return c.softmax_max_slack ? kSoftmaxMaxSlack : 0.f;
}
// A row's reference max after a chunk whose largest scaled score is m_step: m_step where it
// exceeds the max m by more than slack, else m. (Both online softmaxes: softmax_update below and
// the selection walks' slc_softmax_step.)
__device__ __forceinline__ float next_reference_max(float m, float m_step, float slack) {
  return m_step > m + slack ? m_step : m;
}
inline constexpr float kLn2 = 0.6931471805599453f;

// The gated combine of spec §7 for one column pair, in one order wherever it is formed (the window
// kernels, the selection kernels): g_slc o_slc + g_win o_win + g_cmp o_cmp, in fp32.
__device__ __forceinline__ float2 gated_pair(float2 o_cmp, float2 o_slc, float2 o_win, float g_cmp, float g_slc,
                                             float g_win) {
  return make_float2(g_slc * o_slc.x + g_win * o_win.x + g_cmp * o_cmp.x,
                     g_slc * o_slc.y + g_win * o_win.y + g_cmp * o_cmp.y);
}
inline constexpr float kNegInf = -__builtin_huge_valf();

// 2^x on the special-function unit, subnormal results flushed to zero (p < 2^-126 adds nothing a
// float sum could keep). exp2f without fast-math adds a range fix-up around the same instruction:
// three more instructions per probability.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ void sequence_bounds(const SeqParams& s, int b, int64_t& start, int64_t& len) {
  if (s.cu_seqlens != nullptr) {
    start = s.cu_seqlens[b];
    len = s.cu_seqlens[b + 1] - start;
  } else {
    start = 0;
    len = s.total_tokens;
  }
}

template <typename Storage, int kDqk, int kDv, int kRows = kTileRows, int kChunk = kKeyChunk>
struct TileAttention {
  using Traits = StorageTraits<Storage>;
  static constexpr int kCtaThreads = kRows / 16 * 32;  // one warp per m16 slice of the tile
  static constexpr bool kBf16 = Traits::is_bf16;
  static constexpr int kKStride = kDqk + kSmemPad;  // shared row stride of Q and K tiles
  static constexpr int kVStride = kDv + kSmemPad;
  static constexpr int kSTiles = kChunk / 8;  // n8 tiles of a warp's S block
  static constexpr int kOTiles = kDv / 8;        // n8 tiles of a warp's O block
  static_assert(kDqk % 16 == 0 && kDv % 16 == 0, "head dims must be multiples of 16");

  static_assert(kRows % 16 == 0 && kChunk % 16 == 0, "tiles are made of m16 rows and k16 keys");

  // Shared bytes of the Q tile and of double-buffered K and V tiles.
  static constexpr size_t kQBytes = size_t(kRows) * kKStride * sizeof(Storage);
  static constexpr size_t kKBytes = size_t(2) * kChunk * kKStride * sizeof(Storage);
  static constexpr size_t kVBytes = size_t(2) * kChunk * kVStride * sizeof(Storage);

  uint32_t qf[kDqk / 16][4];  // this warp's 16 query rows as A fragments
  float acc[kOTiles][4];      // unnormalised O of rows (group, group + 8)
  float m[2], lsum[2];        // running (reference) max (log2 units) and this thread's partial row sums
  float max_slack;            // softmax_update's slack (softmax_slack)

  __device__ __forceinline__ void reset(float slack) {
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    m[0] = m[1] = kNegInf;
    lsum[0] = lsum[1] = 0.f;
    max_slack = slack;
  }

  // Copies `count` rows (the rest of the kChunk zero-filled) of kD columns into a padded tile.
  // Row i of the source starts at base + i * row_stride.
  template <int kD>
  static __device__ __forceinline__ void load_rows(Storage* tile, const Storage* base, int64_t row_stride,
                                                   int count) {
    constexpr int kPieces = kD / 8;  // 16-byte pieces per row
    for (int e = threadIdx.x; e < kChunk * kPieces; e += kCtaThreads) {
      const int row = e / kPieces, piece = e % kPieces;
      const bool valid = row < count;
      const Storage* src = valid ? base + row * row_stride + piece * 8 : base;
      cp_async_16(tile + row * (kD + kSmemPad) + piece * 8, src, valid);
    }
  }

  // Loads this warp's Q fragments from the shared Q tile.
  __device__ __forceinline__ void load_q_fragments(const Storage* sq) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Storage* row = sq + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kKStride + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) ldmatrix_x4(qf[kk], row + kk * 16);
  }

  // s = Q K^T for this warp's 16 rows and the kChunk keys of the chunk in `sk`.
  __device__ __forceinline__ void scores(float (&s)[kSTiles][4], const Storage* sk) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kSTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    const Storage* row = sk + ((lane & 7) + (lane >> 4) * 8) * kKStride + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kSTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, row + np * 16 * kKStride + kk * 16);
        mma_16816<kBf16>(s[2 * np], qf[kk], b[0], b[1]);
        mma_16816<kBf16>(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
  }

  // Masks the chunk's raw scores: row h (of this thread's two) keeps the keys lo[h] <= col < hi[h]
  // of the chunk, the rest become -inf. When every row of the warp keeps the whole chunk (most
  // chunks), nothing is done at all.
  __device__ __forceinline__ void mask(float (&s)[kSTiles][4], const int (&lo)[2], const int (&hi)[2]) const {
    const int quad = threadIdx.x % 4;
    const bool whole = lo[0] <= 0 && lo[1] <= 0 && hi[0] >= kChunk && hi[1] >= kChunk;
    if (__all_sync(0xffffffffu, whole)) return;
#pragma unroll
    for (int i = 0; i < kSTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = i * 8 + 2 * quad + (e & 1), h = e >> 1;
        if (col < lo[h] || col >= hi[h]) s[i][e] = kNegInf;
      }
  }

  // Online softmax over one chunk: `s` holds raw scores Q K^T (-inf where masked), the running
  // max is kept in log2 units (scale_log2 = softmax scale * log2 e > 0, so max(s) * scale is the
  // max of the scaled scores) and moves only past max_slack (kSoftmaxMaxSlack above). On return s
  // holds exp2(s * scale_log2 - m), one FFMA and one ex2 per score; acc is rescaled (skipped when
  // no row of the warp moved its max: then every factor is exactly 1).
  // The row maxima as trees (depth log2 of the row's values, both rows side by side, then the
  // quad's shuffles of both): a max is exact in any order, so these are the bits a running max
  // gives (the final fmaxf with -inf too: a row of NaN scores gives -inf, as a running max from
  // -inf does), with a shorter chain of dependent instructions before the exponentials.
  __device__ __forceinline__ void softmax_update(float (&s)[kSTiles][4], float scale_log2) {
    float alpha[2], mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row group, h = 1: row group + 8
      float t[kSTiles];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i) t[i] = fmaxf(s[i][2 * h], s[i][2 * h + 1]);
#pragma unroll
      for (int w = 1; w < kSTiles; w *= 2)
#pragma unroll
        for (int i = 0; i + w < kSTiles; i += 2 * w) t[i] = fmaxf(t[i], t[i + w]);
      mx[h] = fmaxf(kNegInf, t[0]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = next_reference_max(m[h], mx[h] * scale_log2, max_slack);
      // A row with no key so far keeps m = -inf; exponents then use 0 so that exp2(-inf) = 0.
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      alpha[h] = fast_exp2(m[h] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kSTiles; ++i) {
        s[i][2 * h] = fast_exp2(fmaf(s[i][2 * h], scale_log2, -m_use));
        s[i][2 * h + 1] = fast_exp2(fmaf(s[i][2 * h + 1], scale_log2, -m_use));
        sum += s[i][2 * h] + s[i][2 * h + 1];
      }
      lsum[h] = lsum[h] * alpha[h] + sum;
      m[h] = m_new;
    }
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int i = 0; i < kOTiles; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }
  }

  // acc += P V for the chunk's V tile in `sv`.
  __device__ __forceinline__ void accumulate_pv(const float (&p)[kSTiles][4], const Storage* sv) {
    const int lane = threadIdx.x % 32;
    const Storage* row = sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * kVStride + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t a[4];
      a[0] = Traits::pack(p[2 * kk][0], p[2 * kk][1]);
      a[1] = Traits::pack(p[2 * kk][2], p[2 * kk][3]);
      a[2] = Traits::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
      a[3] = Traits::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kOTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, row + kk * 16 * kVStride + dp * 16);
        mma_16816<kBf16>(acc[2 * dp], a, b[0], b[1]);
        mma_16816<kBf16>(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // ---- sm_90a: the same products with wgmma (common/wgmma.h); each warpgroup (64 rows) on its own ----
  // K and V chunks are stored in the 128-byte swizzle layout (no padding), double-buffered.
  static constexpr int kKSwTile = kChunk * kDqk;  // elements of one K buffer
  static constexpr int kVSwTile = kChunk * kDv;
  static constexpr size_t kKSwBytes = size_t(2) * kKSwTile * sizeof(Storage);
  static constexpr size_t kVSwBytes = size_t(2) * kVSwTile * sizeof(Storage);

  // load_rows into a 128-byte-swizzled tile of kChunk rows (1024-byte aligned).
  template <int kD>
  static __device__ __forceinline__ void load_rows_sw128(Storage* tile, const Storage* base, int64_t row_stride,
                                                         int count) {
    static_assert(kD % 64 == 0, "swizzled tiles are made of 64-column blocks");
    constexpr int kPieces = kD / 8;
    unsigned char* bytes = reinterpret_cast<unsigned char*>(tile);
    constexpr int kCopy = sw128_copy_threads(kCtaThreads, kPieces, kChunk);
    if constexpr (kCopy > 0) {
      // Each thread copies one fixed 16-byte piece of rows r0, r0 + kStep, ...: rows 8 apart share
      // the swizzle pattern, so the destination is one address plus a constant per row (as the
      // backward's copy_rows_sw128). D = 192 with 4 warps (24 pieces) takes the general loop below.
      // A whole chunk is copied unrolled at immediate offsets (no bounds test, no source-size
      // operand: 2-3 instructions per piece instead of ~13); a sequence's last, partial
      // chunk by the rolled loop, whose running source and destination kept the S pass's kernel
      // (128 registers at 4 CTAs per SM) from spilling when the bounds-tested copy was unrolled.
      constexpr int kStep = kCopy / kPieces;
      if (kCopy < kCtaThreads && threadIdx.x >= kCopy) return;
      const int piece = threadIdx.x % kPieces, r0 = threadIdx.x / kPieces;
      unsigned char* dst = bytes + sw128_offset(kChunk, r0, piece * 8);
      const Storage* src = base + r0 * row_stride + piece * 8;
      const int64_t src_step = kStep * row_stride;
      if (count >= kChunk) {
        // A whole chunk (every chunk but a sequence's last): no bounds test, the destinations
        // are immediates off one address.
#pragma unroll
        for (int k = 0; k < kChunk / kStep; ++k, src += src_step) cp_async_16_full(dst + k * kStep * 128, src);
        return;
      }
#pragma unroll 1
      for (int r = r0; r < kChunk; r += kStep, dst += kStep * 128, src += src_step) {
        const bool valid = r < count;
        cp_async_16(dst, valid ? src : base, valid);
      }
    } else {
      for (int e = threadIdx.x; e < kChunk * kPieces; e += kCtaThreads) {
        const int row = e / kPieces, piece = e % kPieces;
        const bool valid = row < count;
        const Storage* src = valid ? base + row * row_stride + piece * 8 : base;
        cp_async_16(bytes + sw128_offset(kChunk, row, piece * 8), src, valid);
      }
    }
  }

  // The score products of scores_wgmma_sq and scores_wgmma_issue: this warpgroup's 64 rows of the
  // Q tile (its index warp-uniform, 0 for a 64-row tile) against the K chunk, issued only.
  __device__ __forceinline__ void score_products(float (&s)[kSTiles][4], const Storage* sq, const Storage* sk) const {
    wgmma_abt_ss_sw128<kChunk, kBf16, kDqk, kRows, true>(
        s, smem_address(sq) + (kRows == 64 ? 0u : warpgroup_index()) * (64 * 128), smem_address(sk));
  }

  // scores() on sm_90a: one m64n{kChunk}k16 wgmma per 16 head dims with both operands in shared memory:
  // A = this warpgroup's 64 rows of the Q tile `sq` (kRows rows in the 128-byte swizzle layout,
  // load_q_tile<..., true>), B = the swizzled K chunk in `sk`, both K-major. No Q fragments in
  // registers (32 of them at Dqk = 128) and no ldmatrix per chunk. Every thread of the warpgroup
  // must call it.
  // after(): run once the products are issued, before they are waited for (wgmma_batch_then).
  template <typename After = NoHook>
  __device__ __forceinline__ void scores_wgmma_sq(float (&s)[kSTiles][4], const Storage* sq, const Storage* sk,
                                                  After&& after = After{}) const {
    static_assert(kRows % 64 == 0 && (kChunk == 64 || kChunk == 112 || kChunk == 128),
                  "whole warpgroups, one n64, n112 or n128 product per k16 step");
    // (s is overwritten: the first product has scale_d 0.)
    wgmma_batch_then([&] {
      score_products(s, sq, sk);
    }, after, s);
  }

  // scores_wgmma_sq's products issued and committed as one wgmma-group, not waited for: the caller
  // waits (wgmma_wait<N>) and fences s (wgmma_fence_operands) before it reads s, so that another
  // group's products can run beside its work on an earlier s.
  __device__ __forceinline__ void scores_wgmma_issue(float (&s)[kSTiles][4], const Storage* sq, const Storage* sk) const {
    static_assert(kRows % 64 == 0 && (kChunk == 64 || kChunk == 112 || kChunk == 128),
                  "whole warpgroups, one n64, n112 or n128 product per k16 step");
    wgmma_fence_operands(s);
    wgmma_fence();
    score_products(s, sq, sk);
    wgmma_commit();
  }

  // accumulate_pv() with one m64n{Dv}k16 wgmma per 16 keys: A = P packed from registers, B = the
  // swizzled V chunk in `sv` (MN-major, transposed operand).
  // before(): run once P is packed and the accumulator and the row sums are final (fenced: ptxas
  // may not move their instructions past it), before the products are issued; the ping-pong loop
  // waits for its turn there, so that the turn is spent issuing, not finishing the softmax.
  template <typename After = NoHook, typename Before = NoHook>
  __device__ __forceinline__ void accumulate_pv_wgmma(const float (&p)[kSTiles][4], const Storage* sv,
                                                      After&& after = After{}, Before&& before = Before{}) {
    static_assert(kRows % 64 == 0 && (kDv == 64 || kDv == 128), "whole warpgroups, N = Dv in one product");
    uint32_t a[kChunk / 16][4];
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      a[kk][0] = Traits::pack(p[2 * kk][0], p[2 * kk][1]);
      a[kk][1] = Traits::pack(p[2 * kk][2], p[2 * kk][3]);
      a[kk][2] = Traits::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
      a[kk][3] = Traits::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
    if constexpr (!std::is_same_v<std::decay_t<Before>, NoHook>) {
      wgmma_fence_operands(a);
      wgmma_fence_operands(acc);
#pragma unroll
      for (int h = 0; h < 2; ++h) asm volatile("" : "+f"(lsum[h])::"memory");
      before();
    }
    wgmma_batch_then([&] {
      const uint32_t base = smem_address(sv);
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk)
        wgmma_rs<kDv, kBf16, 1>(acc, a[kk], wgmma_desc_sw128(base, kk * 16 * 128, kChunk * 128, 1024), 1);
    }, after, acc);
  }

  // Row sums over the quad; returns the log-sum-exp in log2 units (-inf for an empty row) and
  // the factor that normalises acc (0 for an empty row: the branch outputs zeros).
  __device__ __forceinline__ void finish_row(int h, float& lse2, float& inv) const {
    float l = lsum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    lse2 = l > 0.f ? m[h] + __log2f(l) : kNegInf;
    inv = l > 0.f ? 1.f / l : 0.f;
  }
};

// Loads the Q tile: row r is token t0 + r/G, head hk*G + r%G; rows past the sequence are zero.
// kSw128: in the 128-byte swizzle layout (sm_90a: the A operand of scores_wgmma_sq; sq 1024-byte
// aligned), else padded rows for ldmatrix.
template <typename Storage, int kDqk, int kRows = kTileRows, bool kSw128 = false>
__device__ __forceinline__ void load_q_tile(Storage* sq, const Storage* q, int64_t q_st, int64_t q_sh,
                                            int64_t first_token, int tokens_valid, int head0, int log2_group) {
  constexpr int kPieces = kDqk / 8;
  constexpr int kCtaThreads = kRows / 16 * 32;
  const int group_mask = (1 << log2_group) - 1;
  for (int e = threadIdx.x; e < kRows * kPieces; e += kCtaThreads) {
    const int row = e / kPieces, piece = e % kPieces;
    const int token = row >> log2_group;
    const bool valid = token < tokens_valid;
    const Storage* src =
        valid ? q + (first_token + token) * q_st + int64_t(head0 + (row & group_mask)) * q_sh + piece * 8 : q;
    if constexpr (kSw128)
      cp_async_16(reinterpret_cast<unsigned char*>(sq) + sw128_offset(kRows, row, piece * 8), src, valid);
    else
      cp_async_16(sq + row * (kDqk + kSmemPad) + piece * 8, src, valid);
  }
}

// The tile of `rows` query rows this CTA owns: rows / G neighbouring tokens of sequence b x the G
// heads of KV head hk = blockIdx.y. Later tiles (more keys) get the lower block indices, so they
// start first and the tail of the grid is short.
struct SeqRowTile {
  int b, hk, tokens_per_tile, tokens_valid;
  int64_t s0, len, t0;
  // False when the tile lies past its sequence (the CTA has nothing to do).
  __device__ __forceinline__ bool init(const SeqParams& seqs, int log2_group, int rows) {
    return init_at(seqs, log2_group, rows, blockIdx.x, blockIdx.y);
  }
  // The tile of block (bx, by) of the same grid.
  __device__ __forceinline__ bool init_at(const SeqParams& seqs, int log2_group, int rows, unsigned bx, unsigned by) {
    tokens_per_tile = rows >> log2_group;
    const int64_t tiles_per_seq = (seqs.max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
    b = static_cast<int>(bx / tiles_per_seq);
    const int64_t tile = tiles_per_seq - 1 - bx % tiles_per_seq;
    hk = static_cast<int>(by);
    sequence_bounds(seqs, b, s0, len);
    t0 = tile * tokens_per_tile;
    if (t0 >= len) return false;
    tokens_valid = static_cast<int>(min64(tokens_per_tile, len - t0));
    return true;
  }
};

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// One row's reads of the gated combine into L2 (the combining kernel's prefetch, CudaKernelChoices::
// combine_prefetch), one prefetch per 128-byte line: with `cmp` the row's o_cmp and gates, else the
// other branch's output `other` read back (o_slc in the window, o_win in the selection; nullptr: none).
template <typename Storage, int kDv>
__device__ __forceinline__ void prefetch_combine_row(const BranchParams& p, int64_t t, int64_t head, bool cmp,
                                                     const void* other, int64_t other_st, int64_t other_sh) {
  const Storage* src;
  if (cmp) {
    prefetch_l2(static_cast<const Storage*>(p.g) + t * p.g_st + head * p.g_sh);
    src = static_cast<const Storage*>(p.o_cmp) + t * p.oc_st + head * p.oc_sh;
  } else {
    if (other == nullptr) return;
    src = static_cast<const Storage*>(other) + t * other_st + head * other_sh;
  }
#pragma unroll
  for (int b = 0; b < int(kDv * sizeof(Storage)); b += 128) prefetch_l2(reinterpret_cast<const char*>(src) + b);
}

// The Q tile of the block `ahead` places later in launch order of the same row-tile grid, into L2
// (CudaKernelChoices::next_q_prefetch), by a CTA of 2 x kRows threads: thread i takes the 128-byte
// lines i / kRows, + 2, ... of row i % kRows. With `ahead` the CTAs resident at once
// (resident_ctas), that block starts about when this one ends, on this SM or another: for kernels
// whose CTA has its SM (or a half) to itself and would otherwise wait on its Q tile from memory
// before its first product. Prefetches change no value.
template <typename Storage, int kRows, int kDqk>
__device__ __forceinline__ void prefetch_q_tile_ahead(const void* q, int64_t q_st, int64_t q_sh, const SeqParams& seqs,
                                                      int log2_group, int ahead) {
  static_assert(kRows / 16 * 32 == 2 * kRows, "two threads a row");
  const uint64_t next = uint64_t(blockIdx.y) * gridDim.x + blockIdx.x + ahead;
  if (ahead <= 0 || next >= uint64_t(gridDim.x) * gridDim.y) return;
  SeqRowTile nt;
  if (!nt.init_at(seqs, log2_group, kRows, unsigned(next % gridDim.x), unsigned(next / gridDim.x))) return;
  const int row = threadIdx.x % kRows, tok = row >> log2_group;
  if (tok >= nt.tokens_valid) return;
  const Storage* src = static_cast<const Storage*>(q) + (nt.s0 + nt.t0 + tok) * q_st +
                       ((nt.hk << log2_group) + (row & ((1 << log2_group) - 1))) * q_sh;
  for (int b = threadIdx.x / kRows * 128; b < int(kDqk * sizeof(Storage)); b += 256)
    prefetch_l2(reinterpret_cast<const char*>(src) + b);
}

}  // namespace nsa::cuda
