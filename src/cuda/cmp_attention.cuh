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
// p_cmp is never rounded (fp32 all the way), and the order of additions is fixed (deterministic).
#pragma once

#include "cuda/attention_tile.cuh"
#include "cuda/common/check.h"
#include "nsa/blocks.h"

namespace nsa::cuda {

// Sums the probabilities p (one warp's 16 x kKeyChunk accumulator block) over the G heads of
// each token and stores them to pg [tokens of the tile][kKeyChunk]. The heads of a token are the
// lanes whose group index differs in its low kSteps bits (kSteps = log2 min(G, 8)), and, when
// kPairRows (G = 16), also the two rows (group, group + 8) of each thread.
// Reduce-scatter: in each round a lane keeps half of the values it still holds, sends the other
// half to its partner and adds the partner's copy of its half, so the values held halve every
// round. A value held at the end is a complete head sum; lane (group_id, quad) then holds the
// entries orig = (group_id & (2^kSteps - 1)) * kHeld + k of the initial list, in pairs of
// neighbouring columns.
template <int kSteps, bool kPairRows>
__device__ __forceinline__ void store_head_sums(const float (&p)[kKeyChunk / 8][4], float* pg, int warp,
                                                int log2_group) {
  constexpr int kTiles = kKeyChunk / 8;
  constexpr int kInitial = kPairRows ? 2 * kTiles : 4 * kTiles;  // values per lane before the rounds
  constexpr int kHeld = kInitial >> kSteps;
  static_assert(kHeld >= 2, "every lane keeps at least one pair of neighbouring columns");
  const int lane = threadIdx.x % 32, group_id = lane / 4, quad = lane % 4;
  // v[orig]: orig = i * 2 + c (kPairRows) or h * 2 * kTiles + i * 2 + c, column i * 8 + 2 * quad + c.
  float v[kInitial];
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

template <typename Storage, int kDqk, int kDv>
__global__ void __launch_bounds__(kThreads) cmp_attention_kernel(const CmpAttnParams p) {
  using Tile = TileAttention<Storage, kDqk, kDv>;
  // sm_90a: Q K^T and P V with wgmma, K/V chunks in the 128-byte swizzle layout (unpadded, from a
  // 1024-byte boundary: the padding saved pays for the alignment, cmp_attention_smem_bytes still
  // bounds it). Elsewhere mma.sync on padded rows.
  constexpr bool kWgmma = kWgmmaCompiled;
  static_assert(Tile::kQBytes % 1024 == 0, "the K tile after Q starts on a 1024-byte boundary");
  constexpr int kKTile = kWgmma ? Tile::kKSwTile : kKeyChunk * Tile::kKStride;  // elements of a K buffer
  constexpr int kVTile = kWgmma ? Tile::kVSwTile : kKeyChunk * Tile::kVStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw;
  if constexpr (kWgmma) smem += (1024u - (smem_address(smem_raw) & 1023u)) & 1023u;
  Storage* sq = reinterpret_cast<Storage*>(smem);
  Storage* sk = reinterpret_cast<Storage*>(smem + Tile::kQBytes);
  Storage* sv = sk + 2 * kKTile;
  // Pass 2 needs no V: its score buffers reuse the V tiles' space.
  float* s_pg = reinterpret_cast<float*>(sv);  // [tokens][kKeyChunk]

  const int tokens_per_tile = kTileRows >> p.log2_group;
  const int64_t tiles_per_seq = (p.seqs.max_seqlen + tokens_per_tile - 1) / tokens_per_tile;
  const int b = static_cast<int>(blockIdx.x / tiles_per_seq);
  // Later tiles have more keys: start them first so the tail of the grid is short.
  const int64_t tile = tiles_per_seq - 1 - blockIdx.x % tiles_per_seq;
  const int hk = blockIdx.y;
  int64_t s0, len;
  sequence_bounds(p.seqs, b, s0, len);
  const int64_t t0 = tile * tokens_per_tile;
  if (t0 >= len) return;
  const int tokens_valid = static_cast<int>(min64(tokens_per_tile, len - t0));
  float* s_acc = s_pg + tokens_per_tile * kKeyChunk;  // [tokens][score_ring]

  const Storage* q = static_cast<const Storage*>(p.q);
  const Storage* kbase = static_cast<const Storage*>(p.kc) + cmp_row_offset(s0, p.d) * p.kc_st + hk * p.kc_sh;
  const Storage* vbase = static_cast<const Storage*>(p.vc) + cmp_row_offset(s0, p.d) * p.vc_st + hk * p.vc_sh;

  load_q_tile<Storage, kDqk>(sq, q, p.q_st, p.q_sh, s0 + t0, tokens_valid, hk * p.group, p.log2_group);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_id = lane / 4, quad = lane % 4;
  int row[2], tok[2];
  int64_t t_row[2], visible[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + group_id + 8 * h;
    tok[h] = row[h] >> p.log2_group;
    t_row[h] = t0 + tok[h];
    visible[h] = tok[h] < tokens_valid ? visible_cmp_blocks(t_row[h], p.l, p.d) : 0;
  }
  const int64_t num_keys = visible_cmp_blocks(t0 + tokens_valid - 1, p.l, p.d);  // C of the last token
  const int num_chunks = static_cast<int>((num_keys + kKeyChunk - 1) / kKeyChunk);

  Tile tile_state;
  tile_state.reset();
  auto load_chunk = [&](int c, int buf, bool with_v) {
    const int64_t first = int64_t(c) * kKeyChunk;
    const int count = static_cast<int>(min64(kKeyChunk, num_keys - first));
    if constexpr (kWgmma) {
      Tile::template load_rows_sw128<kDqk>(sk + buf * kKTile, kbase + first * p.kc_st, p.kc_st, count);
      if (with_v) Tile::template load_rows_sw128<kDv>(sv + buf * kVTile, vbase + first * p.vc_st, p.vc_st, count);
    } else {
      Tile::template load_rows<kDqk>(sk + buf * kKTile, kbase + first * p.kc_st, p.kc_st, count);
      if (with_v) Tile::template load_rows<kDv>(sv + buf * kVTile, vbase + first * p.vc_st, p.vc_st, count);
    }
    cp_async_commit();
  };
  // This thread's copies have landed; with wgmma they are also made visible to the async proxy
  // (the CTA barrier that follows publishes them).
  auto wait_chunk = [] {
    cp_async_wait<0>();
    if constexpr (kWgmma) fence_proxy_async();
  };
  // Masked raw scores Q K^T of chunk c (-inf past a row's visible blocks).
  auto masked_scores = [&](float (&s)[Tile::kSTiles][4], int c, int buf) {
    if constexpr (kWgmma)
      tile_state.scores_wgmma(s, sk + buf * kKTile);
    else
      tile_state.scores(s, sk + buf * kKTile);
    const int lo[2] = {0, 0};
    int hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) hi[h] = static_cast<int>(max64(0, min64(kKeyChunk, visible[h] - int64_t(c) * kKeyChunk)));
    tile_state.mask(s, lo, hi);
  };

  // ---- Pass 1: o_cmp and lse ----
  // One barrier per chunk: after it chunk c has landed for everyone and every warp is done with
  // chunk c - 1, whose buffer then receives chunk c + 1 while chunk c is multiplied.
  if (num_chunks > 0) load_chunk(0, 0, true);
  wait_chunk();
  __syncthreads();
  tile_state.load_q_fragments(sq);
  for (int c = 0; c < num_chunks; ++c) {
    wait_chunk();
    __syncthreads();
    if (c + 1 < num_chunks) load_chunk(c + 1, (c + 1) & 1, true);
    float s[Tile::kSTiles][4];
    masked_scores(s, c, c & 1);
    tile_state.softmax_update(s, p.scale_log2);
    if constexpr (kWgmma)
      tile_state.accumulate_pv_wgmma(s, sv + (c & 1) * kVTile);
    else
      tile_state.accumulate_pv(s, sv + (c & 1) * kVTile);
  }
  float lse2[2];
  Storage* o = static_cast<Storage*>(p.o);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float inv;
    tile_state.finish_row(h, lse2[h], inv);
    if (tok[h] >= tokens_valid) continue;
    const int head = hk * p.group + (row[h] & (p.group - 1));
    const int64_t t = s0 + t_row[h];
    if (quad == 0) p.lse[t * p.lse_st + head * p.lse_sh] = lse2[h] == kNegInf ? kNegInf : lse2[h] * kLn2;
    Storage* orow = o + t * p.o_st + head * p.o_sh;
#pragma unroll
    for (int i = 0; i < Tile::kOTiles; ++i) {
      const uint32_t packed = StorageTraits<Storage>::pack(tile_state.acc[i][2 * h] * inv, tile_state.acc[i][2 * h + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + i * 8 + 2 * quad) = packed;
    }
  }
  if (p.scores == nullptr) return;

  // ---- Pass 2: selection scores S ----
  // p_cmp = exp2(s * scale_log2 - lse2); a row without visible keys (lse2 = -inf) has only masked
  // scores, and exp2(-inf - 0) = 0 gives it zeros.
  const float lse_use[2] = {lse2[0] == kNegInf ? 0.f : lse2[0], lse2[1] == kNegInf ? 0.f : lse2[1]};
  __syncthreads();  // every warp is done with pass 1's K/V buffers (pg and acc reuse V's space)
  const int R = p.lp / p.d;  // stride pieces per selection block
  const int L = p.l / p.d;   // stride pieces per compressed block
  const int W = p.score_window;
  const int ring = p.score_ring, ring_mask = ring - 1;
  for (int e = threadIdx.x; e < tokens_per_tile * ring; e += kThreads) s_acc[e] = 0.f;
  // This warp's tokens: its 16 rows are tokens_per_warp whole tokens (G divides 16).
  const int tokens_per_warp = 16 >> p.log2_group;
  const int warp_token0 = warp * tokens_per_warp;
  // Columns a token writes: all of them for the public op, else the admissible ones (top-n reads those).
  auto column_limit = [&](int token) -> int64_t {
    const int64_t t = t0 + token;
    return p.scores_zero_fill ? p.scores_width : min64(p.scores_width, last_slc_block(t, p.lp) + 1);
  };
  auto score_row = [&](int token) { return p.scores + (s0 + t0 + token) * p.s_st + hk * p.s_sh; };
  int64_t jbase = 0;
  if (num_chunks > 0) load_chunk(0, 0, false);
  for (int c = 0; c < num_chunks; ++c) {
    wait_chunk();
    __syncthreads();  // chunk c has landed; every warp is done with chunk c - 1's K buffer
    if (c + 1 < num_chunks) load_chunk(c + 1, (c + 1) & 1, false);
    float s[Tile::kSTiles][4];
    masked_scores(s, c, c & 1);
#pragma unroll
    for (int i = 0; i < Tile::kSTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = fast_exp2(fmaf(s[i][e], p.scale_log2, -lse_use[e >> 1]));
    switch (p.log2_group) {
      case 0: store_head_sums<0, false>(s, s_pg, warp, p.log2_group); break;
      case 1: store_head_sums<1, false>(s, s_pg, warp, p.log2_group); break;
      case 2: store_head_sums<2, false>(s, s_pg, warp, p.log2_group); break;
      case 3: store_head_sums<3, false>(s, s_pg, warp, p.log2_group); break;
      default: store_head_sums<3, true>(s, s_pg, warp, p.log2_group); break;  // G = 16
    }
    __syncwarp();  // this warp's pg rows are complete
    // S[token][j] += sum_i ov(i, j) * pg[token][i] over the chunk's compressed blocks i.
    const int i0 = c * kKeyChunk;
    const int jb = static_cast<int>(jbase);
    for (int e = lane; e < tokens_per_warp * W; e += 32) {
      const int token = warp_token0 + e / W;
      const int j = jb + e % W;
      const int ilo = max(i0, j * R - L + 1), ihi = min(i0 + kKeyChunk - 1, (j + 1) * R - 1);
      float sum = 0.f;
      for (int i = ilo; i <= ihi; ++i) {
        const int ov = min(i + L - 1, (j + 1) * R - 1) - max(i, j * R) + 1;
        sum += static_cast<float>(ov) * s_pg[token * kKeyChunk + (i - i0)];
      }
      s_acc[token * ring + (j & ring_mask)] += sum;
    }
    __syncwarp();  // the sums are in acc; pg may be overwritten by the next chunk
    // Blocks below the next chunk's first block are final: write them and free their slots.
    const int jnext = (i0 + kKeyChunk) / R;
    const int shift = jnext - jb;
    for (int e = lane; e < tokens_per_warp * shift; e += 32) {
      const int token = warp_token0 + e / shift;
      const int j = jb + e % shift;
      float* slot = s_acc + token * ring + (j & ring_mask);
      if (token < tokens_valid && j < column_limit(token)) score_row(token)[j] = *slot;
      *slot = 0.f;
    }
    __syncwarp();
    jbase = jnext;
  }
  __syncthreads();
  // The rest of each row: the accumulator's last W blocks, then zeros.
  for (int token = 0; token < tokens_valid; ++token) {
    float* srow = score_row(token);
    const int64_t limit = column_limit(token);
    for (int64_t j = jbase + threadIdx.x; j < limit; j += kThreads)
      srow[j] = j - jbase < W ? s_acc[token * ring + (j & ring_mask)] : 0.f;
  }
}

template <typename Storage, int kDqk, int kDv>
void launch_cmp_attention(const CmpAttnParams& p, cudaStream_t stream) {
  using Tile = TileAttention<Storage, kDqk, kDv>;
  const size_t smem = cmp_attention_smem_bytes(kDqk, kDv, p.group, p.score_ring, p.scores != nullptr);
  const auto kernel = cmp_attention_kernel<Storage, kDqk, kDv>;
  allow_smem(kernel, smem, /*max_carveout=*/true);  // two CTAs per SM need the whole array
  const dim3 grid = row_tile_grid(p.seqs.max_seqlen, p.seqs.batch, kTileRows / p.group, p.hkv);
  if (grid.x == 0) return;
  kernel<<<grid, kThreads, smem, stream>>>(p);
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda
