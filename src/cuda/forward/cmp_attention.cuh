// Compressed-branch attention (spec §2) fused with the selection scores S (spec §3).
//
// Pass 1 is flash attention over the visible compressed blocks (keys i < C_t) and yields o_cmp
// and the per-row log-sum-exp. Pass 2 (only when S is wanted) recomputes Q K^T chunk by chunk
// with the final log-sum-exp, so p_cmp is exact, and turns it into S without ever storing p_cmp.
// A warp's 16 rows are whole tokens (G divides 16), so pass 2 is warp-local after the K chunk
// is in shared memory: one CTA barrier per chunk (the K double buffer), the rest __syncwarp.
// Per chunk each warp
//   1. sums p over the G heads of each token with a reduce-scatter over the lanes that hold the
//      token's heads (log2 min(G, 8) shuffle rounds, each exchanging half of the values still
//      held: 14 shuffles per lane at G = 16 where a full butterfly took 96) -> pg[token][i];
//   2. adds ov(i, j) * pg[token][i] into a ring accumulator acc[token][j mod ring] for the W
//      selection blocks this chunk can touch;
//   3. writes the blocks below the next chunk's first j (they are final) and zeroes their slots.
// Where R = l'/d divides the chunk and the carry below fits (L - 1 <= min(ring, 64): score_by_chunk,
// backend.cpp; the paper's l = 32, d = 16, l' = 64 and most others), steps 2-3 are one: a chunk's keys i0 .. i0 + 63 start R-aligned, so blocks i0/R .. (i0 + 64)/R - 1
// have all their keys (i = jR - L + 1 .. jR + R - 1, L = l/d) in this chunk or among the previous
// chunk's last L - 1, which the warp keeps (the carry); each lane sums its blocks from pg and the
// carry and writes them, with no ring and no second pass over it. At G = 16 with L = 2 and R = 4
// (the paper's l = 32, d = 16, l' = 64) the head sums stay in registers: a lane holds keys 2 lane
// and 2 lane + 1, so a block's five keys are three neighbouring lanes' (three shuffles a lane and
// chunk: the next lane's keys, the previous lane's, lane 31's for the next chunk's carry); at G = 4
// likewise, a lane holding two neighbouring keys of four of its token's tiles (nine shuffles).
// p_cmp is never rounded (fp32 all the way), and the order of additions is fixed (deterministic).
#pragma once

#include <type_traits>

#include "cuda/common/attention_tile.cuh"
#include "cuda/common/kv_loops.cuh"
#include "cuda/common/check.h"
#include "cuda/common/launch.h"
#include "cuda/common/tma.h"
#include "nsa/blocks.h"

namespace nsa::cuda {

// Sums the probabilities p (one warp's 16 x kKeyChunk accumulator block) over the G heads of
// each token. The heads of a token are the lanes whose group index differs in its low kSteps bits
// (kSteps = log2 min(G, 8)), and, when kPairRows (G = 16), also the two rows (group, group + 8) of
// each thread.
// Reduce-scatter: in each round a lane keeps half of the values it still holds, sends the other
// half to its partner and adds the partner's copy of its half, so the values held halve every
// round. A value held at the end is a complete head sum; lane (group_id, quad) then holds, in
// v[0 .. kHeld), the entries orig = (group_id & (2^kSteps - 1)) * kHeld + k of the initial list, in
// pairs of neighbouring columns (at G = 16: keys 2 lane and 2 lane + 1 of the chunk).
template <bool kPairRows>
inline constexpr int kHeadSumValues = kPairRows ? 2 * (kKeyChunk / 8) : 4 * (kKeyChunk / 8);  // before the rounds

template <int kSteps, bool kPairRows>
__device__ __forceinline__ void head_sums(const float (&p)[kKeyChunk / 8][4], float (&v)[kHeadSumValues<kPairRows>]) {
  constexpr int kTiles = kKeyChunk / 8;
  constexpr int kInitial = kHeadSumValues<kPairRows>;
  const int lane = threadIdx.x % 32, group_id = lane / 4;
  // v[orig]: orig = i * 2 + c (kPairRows) or h * 2 * kTiles + i * 2 + c, column i * 8 + 2 * quad + c.
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if constexpr (kPairRows) {
        v[i * 2 + c] = p[i][c] + p[i][2 + c];
      } else {
        v[i * 2 + c] = p[i][c];
        v[2 * kTiles + i * 2 + c] = p[i][2 + c];
      }
    }
#pragma unroll
  for (int round = 0; round < kSteps; ++round) {
    const int bit = kSteps - 1 - round;  // high group bits first: the mapping above
    const int half = kInitial >> (round + 1);
    const bool upper = (group_id >> bit) & 1;
    // A constant trip count with a guard: the inner loop unrolls before the outer one, and a
    // bound that depends on `round` would leave v dynamically indexed (local memory).
#pragma unroll
    for (int k = 0; k < kInitial / 2; ++k) {
      if (k >= half) break;
      const float send = upper ? v[k] : v[k + half];
      const float keep = upper ? v[k + half] : v[k];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 4 << bit);
    }
  }
}

// head_sums, stored to pg [tokens of the tile][kKeyChunk].
template <int kSteps, bool kPairRows>
__device__ __forceinline__ void store_head_sums(const float (&p)[kKeyChunk / 8][4], float* pg, int warp,
                                                int log2_group) {
  constexpr int kTiles = kKeyChunk / 8;
  constexpr int kHeld = kHeadSumValues<kPairRows> >> kSteps;
  static_assert(kHeld >= 2, "every lane keeps at least one pair of neighbouring columns");
  const int lane = threadIdx.x % 32, group_id = lane / 4, quad = lane % 4;
  float v[kHeadSumValues<kPairRows>];
  head_sums<kSteps, kPairRows>(p, v);
  const int base = (group_id & ((1 << kSteps) - 1)) * kHeld;
#pragma unroll
  for (int k = 0; k < kHeld; k += 2) {
    const int orig = base + k;
    const int h = kPairRows ? 0 : orig / (2 * kTiles);
    const int i = (orig / 2) % kTiles;
    const int token = (warp * 16 + group_id + 8 * h) >> log2_group;
    *reinterpret_cast<float2*>(pg + token * kKeyChunk + i * 8 + 2 * quad) = make_float2(v[k], v[k + 1]);
  }
}

// What a CTA knows about its tile: kRows rows = tokens_per_tile tokens x G heads of KV head hk,
// and this thread's two rows (group, group + 8 of its warp's m16 slice).
template <int kRows, int kChunk = kKeyChunk>
struct CmpTileInfo : SeqRowTile {
  int row[2], tok[2];
  int64_t t_row[2], visible[2];  // keys i < visible[h] are seen by row h (0 for rows past the sequence)
  int64_t num_keys;              // C of the tile's last token: the keys streamed
  int num_chunks;

  // False when the tile lies past its sequence (the CTA has nothing to do).
  __device__ __forceinline__ bool init(const CmpAttnParams& p) {
    if (!SeqRowTile::init(p.seqs, p.log2_group, kRows)) return false;
    const int warp = threadIdx.x / 32, group_id = threadIdx.x % 32 / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = warp * 16 + group_id + 8 * h;
      tok[h] = row[h] >> p.log2_group;
      t_row[h] = t0 + tok[h];
      visible[h] = tok[h] < tokens_valid ? visible_cmp_blocks(t_row[h], p.l, p.d) : 0;
    }
    num_keys = visible_cmp_blocks(t0 + tokens_valid - 1, p.l, p.d);
    num_chunks = static_cast<int>((num_keys + kChunk - 1) / kChunk);
    return true;
  }
  // Chunk c's key range of row h: [0, hi) (visible keys only).
  __device__ __forceinline__ void chunk_limits(int c, int (&lo)[2], int (&hi)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lo[h] = 0;
      hi[h] = static_cast<int>(max64(0, min64(kChunk, visible[h] - int64_t(c) * kChunk)));
    }
  }
};

// Pass 2: the selection scores S of the tile from the final log-sum-exps lse2 (log2 units).
// With kc_map (sm_90a, common/tma.h) one thread copies each K chunk by TMA, its 64-column blocks
// as boxes in the 128-byte swizzle, completing on the buffer's mbarrier; rows past the tile's keys
// then hold whatever kc holds there (other sequences' rows, or zeros past its end), which the mask
// replaces by -inf before anything reads them. Without it every thread copies its pieces by
// cp.async (rows past the keys zero-filled). With wgmma the score products read Q from the
// swizzled Q tile, which must stay in shared memory ("Q on sm_90a" at the kernel below).
// Without kPipelined (kStages = 2): K double-buffered, one chunk in flight, a CTA barrier per chunk
// before its buffer is refilled. kPipelined (sm_90a with kc_map, kRows = 64: one warpgroup; G = 16
// and 4 with the paper's blocks, scores_pipelined_shape): kStages K buffers (kScoresPipelinedStages),
// and in whole groups of kScoresPipelinedGroup chunks the score products of chunk c + 1 are issued
// before the warp works on chunk c's scores (two accumulators); thread 0 refills chunk c's buffer
// with chunk c + kStages as soon as its own wait says chunk c's products are complete (one
// warpgroup's wgmma-group: every read of the buffer is done), so there is no CTA barrier in the
// loop. Nothing is in flight between groups, and the chunks after the last whole group run one by
// one (see the loop for why).
// s_pg: [tokens][kKeyChunk] + [tokens][score_ring] floats + [tokens] ints of shared memory, then
// kStages mbarriers (cmp_smem_bytes; cmp_scores_pipelined_smem_bytes).
//
// The bookkeeping per chunk (the ring update and the write-out of final blocks) walks (token,
// block) pairs with the warp's lanes. It has no integer division in the loop: each lane's first
// pair and the step of 32 pairs are divided out once per tile (or once per change of the number of
// blocks a chunk completes), the column limit of every token is computed once per tile, and the
// pairs advance by adding the step with a carry. (With a division per pair and per chunk the
// bookkeeping was ~40% of the S pass's instructions: H200 ncu source counters.) The chunks before
// the first one that some row of the warp does not see whole need no mask: their count is taken
// once per tile.
template <typename Storage, int kDqk, int kDv, int kRows, int kStages = 2, bool kPipelined = false>
__device__ __forceinline__ void cmp_scores_pass(const CmpAttnParams& p, const CmpTileInfo<kRows>& ti,
                                                TileAttention<Storage, kDqk, kDv, kRows>& tile_state,
                                                const AttnSmem<Storage, kDqk, kDv, kRows>& sm, float* s_pg,
                                                const float (&lse2)[2], const CUtensorMap* kc_map) {
  using Tile = TileAttention<Storage, kDqk, kDv, kRows>;
  using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;
  static_assert(kStages >= 2 && (!kPipelined || (kRows == 64 && Smem::kWgmma)) && (kPipelined || kStages == 2),
                "the pipelined form: one warpgroup on sm_90a");
  constexpr int kCta = kRows / 16 * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // p_cmp = exp2(s * scale_log2 - lse2); a row without visible keys (lse2 = -inf) has only masked
  // scores, and exp2(-inf - 0) = 0 gives it zeros.
  const float lse_use[2] = {lse2[0] == kNegInf ? 0.f : lse2[0], lse2[1] == kNegInf ? 0.f : lse2[1]};
  const int tokens_per_tile = ti.tokens_per_tile, tokens_valid = ti.tokens_valid;
  const int R = p.lp / p.d;  // stride pieces per selection block
  const int L = p.l / p.d;   // stride pieces per compressed block
  const int W = p.score_window;
  const int ring = p.score_ring, ring_mask = ring - 1;
  // score_by_chunk: B blocks a chunk (a power of two), the carry in acc's first L - 1 slots.
  const int B = kKeyChunk / R, log2_B = __ffs(B) - 1;
  float* s_acc = s_pg + tokens_per_tile * kKeyChunk;                 // [tokens][score_ring]
  int* s_limit = reinterpret_cast<int*>(s_acc + tokens_per_tile * ring);  // [tokens]
  // kStages mbarriers after the limits, on 8 bytes (cmp_smem_bytes counts them): buffer b's copies.
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(s_limit + tokens_per_tile) + 7) & ~uintptr_t(7));
  const int64_t t0 = ti.t0, s0 = ti.s0;
  // Columns a token writes: all of them for the public op, else the admissible ones (top-n reads
  // those); 0 for a token past the sequence.
  for (int e = threadIdx.x; e < tokens_per_tile * ring; e += kCta) s_acc[e] = 0.f;
  for (int token = threadIdx.x; token < tokens_per_tile; token += kCta)
    s_limit[token] = token >= tokens_valid ? 0
                     : p.scores_zero_fill
                         ? static_cast<int>(p.scores_width)
                         : static_cast<int>(min64(p.scores_width, last_slc_block(t0 + token, p.lp) + 1));
  // (Both are read after the CTA barrier that opens every chunk, or the one before the loop.)
  // This warp's tokens: its 16 rows are tokens_per_warp whole tokens (G divides 16).
  const int tokens_per_warp = 16 >> p.log2_group;
  const int warp_token0 = warp * tokens_per_warp;
  float* const srow0 = p.scores + (s0 + t0) * p.s_st + ti.hk * p.s_sh;  // token 0's row
  float* const wrow0 = srow0 + warp_token0 * p.s_st;                    // this warp's first token's row
  const Storage* kbase = static_cast<const Storage*>(p.kc) + cmp_row_offset(s0, p.d) * p.kc_st + ti.hk * p.kc_sh;
  // (Warp-uniform to ptxas too: a chunk count it cannot prove uniform makes every branch of the
  // pipelined loop divergent, and it serialises the products in flight across them, C7518.)
  const int num_chunks = __shfl_sync(0xffffffffu, ti.num_chunks, 0);
  const int kc_row0 = static_cast<int>(cmp_row_offset(s0, p.d));
  // Chunks c < whole_chunks are seen whole by every row of the warp (no mask).
  int whole_chunks;
  {
    const int64_t v = min64(ti.visible[0], ti.visible[1]);
    whole_chunks = __reduce_min_sync(0xffffffffu, static_cast<int>(min64(v, int64_t(1) << 30))) / kKeyChunk;
  }
  auto load_chunk = [&](int c) {
    const int64_t first = int64_t(c) * kKeyChunk;
    const int stage = c % kStages;
    Storage* dst = sm.sk + stage * Smem::kKTile;
    if (kPipelined || kc_map != nullptr) {
      // Thread 0 copies, as predicated instructions: no branch where products may be in flight.
      const bool issuer = threadIdx.x == 0;
      const int row = kc_row0 + static_cast<int>(first);
      mbarrier_expect_tx_if(issuer, bars + stage, kKeyChunk * kDqk * sizeof(Storage));
#pragma unroll
      for (int b = 0; b < kDqk / 64; ++b) tma_load_3d_if(issuer, dst + b * kKeyChunk * 64, kc_map, 64 * b, ti.hk, row, bars + stage);
    } else {
      Smem::load_k(dst, kbase + first * p.kc_st, p.kc_st, static_cast<int>(min64(kKeyChunk, ti.num_keys - first)));
      cp_async_commit();
    }
  };
  if (kPipelined || kc_map != nullptr) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int b = 0; b < kStages; ++b) mbarrier_init(bars + b, 1);
      fence_mbarrier_init();
    }
    __syncthreads();  // the mbarriers, before the first copy and the first wait
  }
  // The ring update's (token, block) pairs: pair e = token * W + jj for e = lane, lane + 32, ...
  const int acc_pairs = tokens_per_warp * W;
  const int acc_tok0 = lane / W, acc_jj0 = lane % W, acc_tok_step = 32 / W, acc_jj_step = 32 % W;
  // The write-out's pairs: token * shift + jj, shift = blocks the chunk completes (constant when R
  // divides kKeyChunk); divided out again only when shift changes.
  int shift_prev = -1, out_tok0 = 0, out_jj0 = 0, out_tok_step = 0, out_jj_step = 0;
  int jbase = 0;
  // By chunk at G = 16 with the paper's R = 4, L = 2: a lane's two head sums are two neighbouring
  // keys (head_sums), so a block's five keys lie in three neighbouring lanes and it is summed in
  // registers; the carry (the chunk's last key) is a register of every lane.
  const bool by_lanes = p.score_by_chunk && p.log2_group == 4 && R == 4 && L == 2;
  // The same at G = 4: after head_sums<2, false> lane (group g, quad q) holds head sums of token
  // (g >> 2) + 2 ((g >> 1) & 1) of the warp, for the four tiles i = 4 (g & 1) + t (t = 0 .. 3):
  // keys 8 i + 2 q and 8 i + 2 q + 1 in v[2 t], v[2 t + 1]. Block 2 i + q / 2 (even q) is then
  // the lane's two keys, the next quad's two and the key before (quad q - 1's second; at q = 0 quad
  // 3's of the tile before: the same group's register t - 1, or at t = 0 the group before (odd g) or
  // the carry, which for even g is key 63 of the previous chunk: lane (g + 1, 3)'s v[7]).
  const bool by_lanes4 = p.score_by_chunk && p.log2_group == 2 && R == 4 && L == 2;
  float lane_carry = 0.f;
  // The other shapes (the scores exponentiated): head sums through shared memory, then by chunk or
  // through the ring.
  auto consume_generic = [&](float (&s)[Tile::kSTiles][4], int c) {
    switch (p.log2_group) {
      case 0: store_head_sums<0, false>(s, s_pg, warp, p.log2_group); break;
      case 1: store_head_sums<1, false>(s, s_pg, warp, p.log2_group); break;
      case 2: store_head_sums<2, false>(s, s_pg, warp, p.log2_group); break;
      case 3: store_head_sums<3, false>(s, s_pg, warp, p.log2_group); break;
      default: store_head_sums<3, true>(s, s_pg, warp, p.log2_group); break;  // G = 16
    }
    __syncwarp();  // this warp's pg rows are complete
    const int i0 = c * kKeyChunk;
    if (p.score_by_chunk) {  // (uniform) blocks j0 .. j0 + B - 1 are final: sum and write them
      const int j0 = i0 / R;
      for (int e = lane; e < tokens_per_warp * B; e += 32) {
        const int token = warp_token0 + (e >> log2_B);
        const int j = j0 + (e & (B - 1));
        const float* pg = s_pg + token * kKeyChunk;  // key i >= i0 at i - i0
        const float* carry = s_acc + token * ring;     // key i0 - L < i < i0 at i - i0 + L - 1
        float sum = 0.f;
        for (int i = j * R - L + 1; i < (j + 1) * R; ++i) {
          const int ov = piece_overlap(i, j, L, R);
          sum += static_cast<float>(ov) * (i >= i0 ? pg[i - i0] : carry[i - i0 + L - 1]);
        }
        if (j < s_limit[token]) srow0[token * p.s_st + j] = sum;
      }
      __syncwarp();  // every lane is done with the carry
      for (int e = lane; e < tokens_per_warp * (L - 1); e += 32) {
        const int token = warp_token0 + e / (L - 1), m = e % (L - 1);
        s_acc[token * ring + m] = s_pg[token * kKeyChunk + kKeyChunk - (L - 1) + m];
      }
      __syncwarp();  // the carry is written; pg may be overwritten by the next chunk
      jbase = j0 + B;
      return;
    }
    // S[token][j] += sum_i ov(i, j) * pg[token][i] over the chunk's compressed blocks i.
    for (int e = lane, tk = acc_tok0, jj = acc_jj0; e < acc_pairs; e += 32) {
      const int token = warp_token0 + tk;
      const int j = jbase + jj;
      const int ilo = max(i0, j * R - L + 1), ihi = min(i0 + kKeyChunk - 1, (j + 1) * R - 1);
      float sum = 0.f;
      for (int i = ilo; i <= ihi; ++i) {
        const int ov = piece_overlap(i, j, L, R);
        sum += static_cast<float>(ov) * s_pg[token * kKeyChunk + (i - i0)];
      }
      s_acc[token * ring + (j & ring_mask)] += sum;
      tk += acc_tok_step;
      jj += acc_jj_step;
      if (jj >= W) jj -= W, ++tk;
    }
    __syncwarp();  // the sums are in acc; pg may be overwritten by the next chunk
    // Blocks below the next chunk's first block are final: write them and free their slots.
    const int jnext = (i0 + kKeyChunk) / R;
    const int shift = jnext - jbase;
    if (shift != shift_prev) {  // warp-uniform
      shift_prev = shift;
      if (shift > 0) out_tok0 = lane / shift, out_jj0 = lane % shift, out_tok_step = 32 / shift, out_jj_step = 32 % shift;
    }
    for (int e = lane, tk = out_tok0, jj = out_jj0; e < tokens_per_warp * shift; e += 32) {
      const int token = warp_token0 + tk;
      const int j = jbase + jj;
      float* slot = s_acc + token * ring + (j & ring_mask);
      if (j < s_limit[token]) srow0[token * p.s_st + j] = *slot;
      *slot = 0.f;
      tk += out_tok_step;
      jj += out_jj_step;
      if (jj >= shift) jj -= shift, ++tk;
    }
    __syncwarp();
    jbase = jnext;
  };
  // Chunk c's raw scores s (this warp's 16 rows x kKeyChunk keys, complete) -> S.
  // (s is read, not written: in the pipelined pass it is a product's accumulator, which only wgmma
  // may define, or ptxas serialises the products, C7515.)
  auto consume = [&](const float (&raw)[Tile::kSTiles][4], int c) {
    float s[Tile::kSTiles][4];
#pragma unroll
    for (int i = 0; i < Tile::kSTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = raw[i][e];
    if (c >= whole_chunks) {  // (uniform)
      int lo[2], hi[2];
      ti.chunk_limits(c, lo, hi);
      tile_state.mask(s, lo, hi);
    }
#pragma unroll
    for (int i = 0; i < Tile::kSTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = fast_exp2(fmaf(s[i][e], p.scale_log2, -lse_use[e >> 1]));
    if (by_lanes) {  // (uniform) G = 16, R = 4, L = 2: no shared memory, one block per even lane
      float v[kHeadSumValues<true>];
      head_sums<3, true>(s, v);
      // Lane 2b holds keys 4b, 4b + 1 (weight 2 each in block b), lane 2b + 1 keys 4b + 2 (2) and
      // 4b + 3 (1), and lane 2b - 1's second key is 4b - 1 (1; lane 0 takes it from the carry).
      const float x = (lane & 1) ? 2.f * v[0] + v[1] : 2.f * (v[0] + v[1]);
      const float next = __shfl_down_sync(0xffffffffu, x, 1);
      const float up = __shfl_up_sync(0xffffffffu, v[1], 1);
      const float prev = lane == 0 ? lane_carry : up;
      lane_carry = __shfl_sync(0xffffffffu, v[1], 31);
      const int j = c * (kKeyChunk / 4) + lane / 2;
      if ((lane & 1) == 0 && j < s_limit[warp_token0]) wrow0[j] = x + next + prev;
      jbase = (c + 1) * (kKeyChunk / 4);
      return;
    }
    if (by_lanes4) {  // (uniform) G = 4, R = 4, L = 2: no shared memory, four blocks per even quad
      float v[kHeadSumValues<false>];
      head_sums<2, false>(s, v);
      const int g = lane / 4, q = lane % 4;
      const int token = warp_token0 + (g >> 2) + 2 * ((g >> 1) & 1);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float x = (q & 1) ? 2.f * v[2 * t] + v[2 * t + 1] : 2.f * (v[2 * t] + v[2 * t + 1]);
        const float next = __shfl_down_sync(0xffffffffu, x, 1);
        const float send = q == 3 ? v[2 * ((t + 3) % 4) + 1] : v[2 * t + 1];
        const float up = __shfl_sync(0xffffffffu, send, q == 0 && t > 0 ? lane + 3 : (lane + 31) % 32);
        const float prev = q == 0 && t == 0 && (g & 1) == 0 ? lane_carry : up;
        const int j = c * (kKeyChunk / 4) + 2 * (4 * (g & 1) + t) + q / 2;
        if ((q & 1) == 0 && j < s_limit[token]) srow0[token * p.s_st + j] = x + next + prev;
      }
      lane_carry = __shfl_sync(0xffffffffu, v[7], lane | 7);
      jbase = (c + 1) * (kKeyChunk / 4);
      return;
    }
    if constexpr (!kPipelined) consume_generic(s, c);
  };
  if constexpr (kPipelined) {
    if (!by_lanes && !by_lanes4) __trap();  // launched only where scores_pipelined_shape holds
    // Chunk c's products into acc (issued, not waited for), once its copy has landed.
    auto issue = [&](float (&acc)[Tile::kSTiles][4], int c) {
      const int stage = c % kStages;
      mbarrier_wait_parity_asm(bars + stage, (c / kStages) & 1);
      tile_state.scores_wgmma_issue(acc, sm.sq, sm.sk + stage * Smem::kKTile);
    };
    // Chunk c's products are complete (this thread waited for them): its buffer takes c + kStages.
    auto refill = [&](int c) {
      if (c + kStages < num_chunks) load_chunk(c + kStages);  // (uniform)
    };
    for (int c = 0; c < kStages && c < num_chunks; ++c) load_chunk(c);
    float sa[Tile::kSTiles][4], sb[Tile::kSTiles][4];
    // Whole groups of kScoresPipelinedGroup chunks, nothing in flight between groups: inside a
    // group chunk c + 1's products run beside chunk c's sums. The group has no branch (ptxas 13.0
    // serialises every product where one is in flight across a branch on the chunk count, or
    // across the loop's back edge: C7514), so the last num_chunks % group chunks run one by one.
    const int grouped = num_chunks - num_chunks % kScoresPipelinedGroup;
    for (int c0 = 0; c0 < grouped; c0 += kScoresPipelinedGroup) {
      issue(sa, c0);
#pragma unroll
      for (int j = 0; j < kScoresPipelinedGroup; ++j) {
        float(&cur)[Tile::kSTiles][4] = j % 2 == 0 ? sa : sb;
        float(&next)[Tile::kSTiles][4] = j % 2 == 0 ? sb : sa;
        if (j + 1 < kScoresPipelinedGroup) {
          issue(next, c0 + j + 1);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        wgmma_fence_operands(cur);
        refill(c0 + j);
        consume(cur, c0 + j);
      }
    }
    for (int c = grouped; c < num_chunks; ++c) {
      issue(sa, c);
      wgmma_wait<0>();
      wgmma_fence_operands(sa);
      refill(c);
      consume(sa, c);
    }
  } else {
    if (num_chunks > 0) load_chunk(0);
    for (int c = 0; c < num_chunks; ++c) {
      // Chunk c has landed for everyone; every warp is done with chunk c - 1 (its buffer takes c + 1).
      if (kc_map != nullptr) {
        __syncthreads();
        if (c + 1 < num_chunks) load_chunk(c + 1);
        mbarrier_wait_parity(bars + (c & 1), (c >> 1) & 1);  // buffer c & 1's (c >> 1)-th fill
      } else {
        Smem::template wait_copies<0>();
        __syncthreads();
        if (c + 1 < num_chunks) load_chunk(c + 1);
      }
      float s[Tile::kSTiles][4];
      sm.scores(tile_state, s, sm.sk + (c & 1) * Smem::kKTile);
      consume(s, c);
    }
  }
  // The tail's carry (none without chunks: the slot keeps the zero another thread wrote, with no
  // barrier between where the loop had none).
  if (by_lanes && lane == 0 && num_chunks > 0) s_acc[warp_token0 * ring] = lane_carry;
  if (by_lanes4 && lane % 8 == 0 && num_chunks > 0)  // quad 0 of the even groups: a token's carry each
    s_acc[(warp_token0 + (lane >> 4) + 2 * ((lane >> 3) & 1)) * ring] = lane_carry;
  __syncthreads();
  if (p.score_by_chunk) {
    // The rest of each row: blocks from jbase = i_end / R on hold only keys of the last chunk's
    // carry (i_end - L < i < i_end), then zeros.
    const int iend = jbase * R;
    for (int token = 0; token < tokens_valid; ++token) {
      float* srow = srow0 + token * p.s_st;
      const float* carry = s_acc + token * ring;  // key iend - L < i < iend at i - iend + L - 1
      const int limit = s_limit[token];
      for (int j = jbase + threadIdx.x; j < limit; j += kCta) {
        float sum = 0.f;
        for (int i = max(j * R - L + 1, iend - L + 1); i < min((j + 1) * R, iend); ++i)
          sum += static_cast<float>(piece_overlap(i, j, L, R)) * carry[i - iend + L - 1];
        srow[j] = sum;
      }
    }
    return;
  }
  // The rest of each row: the accumulator's last W blocks, then zeros.
  for (int token = 0; token < tokens_valid; ++token) {
    float* srow = srow0 + token * p.s_st;
    const int limit = s_limit[token];
    for (int j = jbase + threadIdx.x; j < limit; j += kCta)
      srow[j] = j - jbase < W ? s_acc[token * ring + (j & ring_mask)] : 0.f;
  }
}

// The end of pass 1 for this thread's two rows: lse (natural log) and the normalised o_cmp;
// lse2 (log2 units) is left for the S pass of the fused kernel.
template <typename Storage, typename TileInfo, typename Tile>
__device__ __forceinline__ void cmp_pass1_epilogue(const CmpAttnParams& p, const TileInfo& ti, const Tile& tile_state,
                                                   float (&lse2)[2]) {
  const int quad = threadIdx.x % 4;
  Storage* o = static_cast<Storage*>(p.o);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float inv;
    tile_state.finish_row(h, lse2[h], inv);
    if (ti.tok[h] >= ti.tokens_valid) continue;
    const int head = ti.hk * p.group + (ti.row[h] & (p.group - 1));
    const int64_t t = ti.s0 + ti.t_row[h];
    if (quad == 0) p.lse[t * p.lse_st + head * p.lse_sh] = lse2[h] == kNegInf ? kNegInf : lse2[h] * kLn2;
    Storage* orow = o + t * p.o_st + head * p.o_sh;
#pragma unroll
    for (int i = 0; i < Tile::kOTiles; ++i) {
      const uint32_t packed =
          StorageTraits<Storage>::pack(tile_state.acc[i][2 * h] * inv, tile_state.acc[i][2 * h + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * quad) = packed;
    }
  }
}

// Q on sm_90a: the score wgmma takes A (Q) from the swizzled Q tile in shared memory
// (scores_wgmma_sq), not from fragment registers: no registers held for Q and no ldmatrix per
// chunk. (Held in registers across the chunk loop, ptxas 13.0 gave the fragments' registers to
// other values inside the loop where the loop was their last use, and every chunk after the
// first multiplied garbage; reloading them per chunk was the workaround before Q moved to shared
// memory.)
// Pass 1 (o_cmp and lse) of a tile of kRows rows, K/V chunks double-buffered (one chunk in
// flight); with kFusedScores also pass 2 in the same CTA, else cmp_scores_kernel does it
// afterwards. Which runs where (launch_cmp_attention): on sm_90a the split kernels, this one (in
// kWgRows = 192-row tiles, three warpgroups sharing every K/V chunk, copied by cp.async) only where
// no tensor map of kc / vc can be made, else cmp_pass1_wide_kernel; elsewhere the fused 64-row
// kernel. The body of the variant a target never runs is not compiled for it.
template <typename Storage, int kDqk, int kDv, int kRows, bool kFusedScores>
__global__ void __launch_bounds__(kRows / 16 * 32)
    cmp_attention_kernel(const CmpAttnParams p) {
  if constexpr (kFusedScores == kWgmmaCompiled) {
    __trap();  // not launched on this target
  } else {
    using Tile = TileAttention<Storage, kDqk, kDv, kRows>;
    using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm(smem_raw);
    CmpTileInfo<kRows> ti;
    if (!ti.init(p)) return;

    const Storage* q = static_cast<const Storage*>(p.q);
    const Storage* kbase = static_cast<const Storage*>(p.kc) + cmp_row_offset(ti.s0, p.d) * p.kc_st + ti.hk * p.kc_sh;
    const Storage* vbase = static_cast<const Storage*>(p.vc) + cmp_row_offset(ti.s0, p.d) * p.vc_st + ti.hk * p.vc_sh;
    sm.load_q(q, p.q_st, p.q_sh, ti.s0 + ti.t0, ti.tokens_valid, ti.hk * p.group, p.log2_group);
    cp_async_commit();

    const int num_chunks = ti.num_chunks;
    Tile tile_state;
    tile_state.reset(softmax_slack(p.choices));
    auto load_chunk = [&](int c, int buf) {
      const int64_t first = int64_t(c) * kKeyChunk;
      const int count = static_cast<int>(min64(kKeyChunk, ti.num_keys - first));
      Smem::load_k(sm.sk + buf * Smem::kKTile, kbase + first * p.kc_st, p.kc_st, count);
      Smem::load_v(sm.sv + buf * Smem::kVTile, vbase + first * p.vc_st, p.vc_st, count);
      cp_async_commit();
    };

    cp_async_chunk_loop(sm, tile_state, num_chunks, p.scale_log2, load_chunk,
                        [&](int c, int (&lo)[2], int (&hi)[2]) { ti.chunk_limits(c, lo, hi); });
    float lse2[2];
    cmp_pass1_epilogue<Storage>(p, ti, tile_state, lse2);
    if constexpr (kFusedScores) {
      if (p.scores == nullptr) return;
      __syncthreads();  // every warp is done with pass 1's buffers (pass 2's scores reuse V's space)
      cmp_scores_pass<Storage, kDqk, kDv, kRows>(p, ti, tile_state, sm, reinterpret_cast<float*>(sm.sv), lse2, nullptr);
    }
  }
}

// sm_90a pass 1 in the shape of FlashAttention-3's forward: tiles of cmp_wide_rows = 192 rows
// (three warpgroups taking turns on the tensor cores; 128, two warpgroups, where 192 rows do not fit:
// Dqk 192 with Dv 128) and chunks of kCmpWideChunk = 128 keys, so the score product of a warpgroup is
// one m64n128k16 per 16 head dims (half the Q reads from shared memory per key of m64n64, half the
// waits, row maxima and sums per key), through a 2-stage TMA ring (tma_ring_attention; two 64 KB
// stages at 128/128). One CTA per SM (168 registers at 192 rows, 384 threads). Launched where the
// tensor maps of kc and vc with 128-row boxes can be made; else the 192-row cp.async kernel.
template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(cmp_wide_rows(kDqk, kDv) / 16 * 32, 1)
    cmp_pass1_wide_kernel(const CmpAttnParams p, const __grid_constant__ CUtensorMap kc_map,
                          const __grid_constant__ CUtensorMap vc_map) {
  if constexpr (!kWgmmaCompiled) {
    __trap();  // launched only where the wgmma body runs (sm_90a)
  } else {
    constexpr int kRows = cmp_wide_rows(kDqk, kDv), kChunk = kCmpWideChunk, kStages = kCmpWideStages;
    using Tile = TileAttention<Storage, kDqk, kDv, kRows, kChunk>;
    using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;  // (the Q tile and where the ring starts)
    static_assert(Smem::Tile::kQBytes == Tile::kQBytes, "the same Q tile");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm(smem_raw);
    CmpTileInfo<kRows, kChunk> ti;
    if (!ti.init(p)) return;
    sm.load_q(static_cast<const Storage*>(p.q), p.q_st, p.q_sh, ti.s0 + ti.t0, ti.tokens_valid, ti.hk * p.group,
              p.log2_group);
    cp_async_commit();
    Tile tile_state;
    tile_state.reset(softmax_slack(p.choices));
    const int num_chunks = ti.num_chunks;
    uint64_t* bars = reinterpret_cast<uint64_t*>(sm.sk + kStages * (Tile::kKSwTile + Tile::kVSwTile));
    const int count_last = static_cast<int>(ti.num_keys - int64_t(num_chunks - 1) * kChunk);
    tma_ring_attention<Storage, kDqk, kDv, kRows, kChunk, kStages, /*kPingPong=*/true>(
        tile_state, sm.sq, sm.sk, bars, &kc_map, &vc_map, ti.hk, static_cast<int>(cmp_row_offset(ti.s0, p.d)),
        num_chunks, count_last, p.scale_log2, [&](int c, float (&s)[Tile::kSTiles][4]) {
          int lo[2], hi[2];
          ti.chunk_limits(c, lo, hi);
          tile_state.mask(s, lo, hi);
        });
    float lse2[2];
    cmp_pass1_epilogue<Storage>(p, ti, tile_state, lse2);
  }
}

// Pass 2 on its own, after cmp_attention_kernel<..., false> on the same stream: reads that
// kernel's lse back (natural log -> log2 units) and recomputes Q K^T. Without the 16 x Dv
// accumulator it needs far fewer registers, so kMinCtas CTAs of kRows rows share an SM.
// kPipelined: the pipelined pass with kStages K buffers (cmp_scores_pass), launched only with a
// tensor map of kc and where scores_pipelined_shape holds.
template <typename Storage, int kDqk, int kDv, int kRows, int kMinCtas, int kStages = 2, bool kPipelined = false>
__global__ void __launch_bounds__(kRows / 16 * 32, kMinCtas)
    cmp_scores_kernel(const CmpAttnParams p, const __grid_constant__ CUtensorMap kc_map, int kc_tma) {
  if constexpr (!kWgmmaCompiled) {
    __trap();  // launched only where the wgmma body runs (sm_90a)
  } else {
    using Tile = TileAttention<Storage, kDqk, kDv, kRows>;
    using Smem = AttnSmem<Storage, kDqk, kDv, kRows>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm(smem_raw);
    CmpTileInfo<kRows> ti;
    if (!ti.init(p)) return;
    sm.load_q(static_cast<const Storage*>(p.q), p.q_st, p.q_sh, ti.s0 + ti.t0, ti.tokens_valid, ti.hk * p.group,
              p.log2_group);
    cp_async_commit();
    float lse2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lse2[h] = kNegInf;
      if (ti.tok[h] < ti.tokens_valid) {
        const int head = ti.hk * p.group + (ti.row[h] & (p.group - 1));
        lse2[h] = p.lse[(ti.s0 + ti.t_row[h]) * p.lse_st + head * p.lse_sh] * kLog2e;
      }
    }
    Tile tile_state;
    Smem::template wait_copies<0>();
    __syncthreads();  // the Q tile (read by every score product: this kernel runs only with wgmma)
    cmp_scores_pass<Storage, kDqk, kDv, kRows, kStages, kPipelined>(p, ti, tile_state, sm,
                                                        reinterpret_cast<float*>(sm.sk + kStages * Smem::kKTile), lse2,
                                                        kc_tma ? &kc_map : nullptr);
  }
}

template <typename Kernel>
inline bool cmp_runs_wgmma(Kernel kernel) {
  cudaFuncAttributes a{};
  NSA_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
  return runs_wgmma_body(a);
}

template <typename Kernel, typename... Extra>
inline void cmp_launch(Kernel kernel, int rows, size_t smem, const CmpAttnParams& p, cudaStream_t stream,
                       const Extra&... extra) {
  allow_smem(kernel, smem, /*max_carveout=*/true);  // several CTAs per SM need the whole array
  const dim3 grid = row_tile_grid(p.seqs.max_seqlen, p.seqs.batch, rows / p.group, p.hkv);
  if (grid.x == 0) return;
  kernel<<<grid, rows / 16 * 32, smem, stream>>>(p, extra...);
  NSA_CUDA_CHECK_LAUNCH();
}

// sm_90a: pass 1 in 192-row (or 128-row) tiles and 128-key chunks by TMA (cmp_pass1_wide_kernel; the 192-row
// cp.async kernel where no tensor map can be made), then the S pass as its own kernel: at Dqk = 192,
// and at Dqk = 128 with G <= 4, in kScoresRows = 128-row tiles (two warpgroups share every K chunk)
// at 2 CTAs per SM, except where such a tile's score rings do not fit in shared memory (G = 1 with
// long rings); otherwise in 64-row tiles at 4 CTAs per SM (3 at Dqk = 192, where 4 measured
// slower), pipelined where scores_pipelined_shape holds (Dqk <= 128, a tensor map of kc, and
// CudaKernelChoices::cmp_scores_pipelined). See scores_rows.
// Elsewhere (sm_80 and the compute_80 PTX): the fused 64-row kernel. H200, 64K, Hq 64 / Hkv 4,
// D 128 (docs/cuda.md): cmp + S 27.7 ms split, 32.7 fused (tree of `95428a5`).
template <typename Storage, int kDqk, int kDv>
void launch_cmp_attention(const CmpAttnParams& p, cudaStream_t stream) {
  constexpr int kScoresCtas64 = kDqk <= 128 ? 4 : 3;
  const auto pass1 = cmp_attention_kernel<Storage, kDqk, kDv, kWgRows, false>;
  if (!cmp_runs_wgmma(pass1)) {
    cmp_launch(cmp_attention_kernel<Storage, kDqk, kDv, kTileRows, true>, kTileRows,
               cmp_smem_bytes(kTileRows, kDqk, kDv, p.group, p.score_ring, true, p.scores != nullptr), p, stream);
    return;
  }
  CUtensorMap kc_wide{}, vc_wide{};
  const uint32_t wide = kCmpWideChunk;
  if (kv_rows_tensor_map<Storage, kDqk>(&kc_wide, p.choices, p.kc, p.hkv, p.kc_rows, p.kc_st, p.kc_sh, wide) &&
      kv_rows_tensor_map<Storage, kDv>(&vc_wide, p.choices, p.vc, p.hkv, p.kc_rows, p.vc_st, p.vc_sh, wide)) {
    static_assert(cmp_wide_smem_bytes(kDqk, kDv) <= kMaxSmem, "the pass 1 tile and ring fit in shared memory");
    cmp_launch(cmp_pass1_wide_kernel<Storage, kDqk, kDv>, cmp_wide_rows(kDqk, kDv), cmp_wide_smem_bytes(kDqk, kDv), p,
               stream, kc_wide, vc_wide);
  } else {  // no tensor map: the 192-row kernel's cp.async copies
    cmp_launch(pass1, kWgRows, cmp_smem_bytes(kWgRows, kDqk, kDv, p.group, p.score_ring, true, false), p, stream);
  }
  if (p.scores == nullptr) return;
  CUtensorMap kc_map{};  // the S pass's (64-row boxes)
  const int kc_tma =
      kv_rows_tensor_map<Storage, kDqk>(&kc_map, p.choices, p.kc, p.hkv, p.kc_rows, p.kc_st, p.kc_sh) ? 1 : 0;
  if constexpr (scores_wide_compiled(kDqk)) {  // else the 128-row S kernel is not instantiated
    if (scores_rows(kDqk, kDv, p.group, p.score_ring, kMaxSmem, p.choices.cmp_scores_rows) == kScoresRows) {
      cmp_launch(cmp_scores_kernel<Storage, kDqk, kDv, kScoresRows, 2>, kScoresRows,
                 cmp_smem_bytes(kScoresRows, kDqk, kDv, p.group, p.score_ring, false, true), p, stream, kc_map, kc_tma);
      return;
    }
  }
  if constexpr (kDqk <= 128) {
    const size_t pipelined_smem = cmp_scores_pipelined_smem_bytes(kDqk, p.group, p.score_ring);
    if (kc_tma && p.choices.cmp_scores_pipelined && pipelined_smem <= kMaxSmem &&
        scores_pipelined_shape(p.group, p.l / p.d, p.lp / p.d, p.score_by_chunk)) {
      cmp_launch(cmp_scores_kernel<Storage, kDqk, kDv, kTileRows, kScoresPipelinedCtas, kScoresPipelinedStages, true>,
                 kTileRows, pipelined_smem, p, stream, kc_map, kc_tma);
      return;
    }
  }
  cmp_launch(cmp_scores_kernel<Storage, kDqk, kDv, kTileRows, kScoresCtas64>, kTileRows,
             cmp_smem_bytes(kTileRows, kDqk, kDv, p.group, p.score_ring, false, true), p, stream, kc_map, kc_tma);
}

}  // namespace nsa::cuda
