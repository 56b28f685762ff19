// dq of the selection branch (and its dg when the forward's o_branch was not kept): one warp per
// 16 query rows, no CTA barrier.
//
// dq_kernel (dq_kernel.cuh) runs first and writes dq of the compressed and window branches (and,
// with BwdArgs::slc_union, the whole dq and dg of the row tiles whose union of selected blocks is
// small: this kernel recounts those unions and leaves their tiles); this kernel then adds the
// selection's part:
//   pass 1 (skipped when a.dg_ready or a.d_from_o): o_slc = sum_j P_j V_j with
//           P = exp(scale s - lse_slc), and dg_slc = <dO, o_slc>, written to dg32 / dg (dq_kernel
//           wrote 0 there). K and V go straight into registers, as in the forward's selection
//           kernel (slc_attention.cuh).
//           With a.d_from_o (the forward's o given) instead: D = g dg_slc from the gated sum,
//           <dO, o> - g_cmp dg_cmp - g_win dg_win (one read of o's row, no gather), and pass 2 sums
//           dg_slc = sum_j P_j dP_j on the way. D then carries o's rounding to the storage type, as
//           FlashAttention's D = rowsum(dO o) does; dg_slc does not.
//   pass 2: dS = scale P (g dP - D) with dP = dO V^T, D = g dg_slc, and dq += dS K, each warp in
//           16-key steps. On sm_90a (SlcDqMaps::on, Dqk <= 128) both K and V come by TMA into the
//           warp's own three-stage ring (below): K read twice (Q K^T by ldmatrix, dS K by
//           ldmatrix.trans), V once (dO V^T), Q's and dO's A fragments in the natural order.
//           Elsewhere (sm_80, no tensor maps, Dqk 192) each warp streams K through a two-stage
//           ring of cp.async copies in whole lines, and V, read once, goes straight into registers
//           (one step ahead), as in pass 1, up to Dqk 128 (at Dqk 192 through the ring as well: in
//           registers it would spill), dO's fragments in the permuted order of V's register rows.
// Measured at 64K (H200): K and V on the ring made pass 2 faster than both in registers (backward
// with saved o_branch 103.9 -> 99.6 ms) and pass 1, like the forward, slower (the forward's
// selection kernel on it: 17.6 -> 22.2 ms): a row read once gains nothing from shared memory, whose
// bandwidth the ring's copies and reads share. With TMA the copies cost no instructions and skip
// the SM's load path: the kernel 23.73 -> 21.59 ms. Deterministic: every sum in a fixed order, no
// atomics.
#pragma once

#include "cuda/backward/dq_wgmma.cuh"
#include "cuda/backward/tile.cuh"
#include "cuda/params.h"
#include "cuda/common/slc_union.cuh"

namespace nsa::cuda::bwd {

constexpr int kSlcDqWarps = 4;

// Shared bytes: per warp the union blocks and masks (2 ints per entry, rounded up to 16 bytes),
// then a ring of two stages of 16 keys of K (and of V at Dqk 192) in rows padded by 8 columns.
// The union's sort keys (1 int per entry) are dead once the union is built, before the ring's
// first copy: they share the ring's bytes, which keeps n = 256 at G = 1 within shared memory.
constexpr size_t slc_dq_union_bytes(int cap) { return (size_t(cap) * 8 + 15) / 16 * 16; }
// Pass 2 keeps V's rows in registers up to Dqk 128; at Dqk 192 (Q's fragments and dq's
// accumulators take 144 registers) they would spill, and V goes through the ring with K.
constexpr bool slc_dq_v_in_registers(int dqk) { return dqk <= 128; }
constexpr size_t slc_dq_stage_elems(int dqk, int dv) {
  return size_t(16) * ((dqk + 8) + (slc_dq_v_in_registers(dqk) ? 0 : dv + 8));
}
constexpr size_t slc_dq_ring_bytes(int dqk, int dv, int cap) {
  const size_t ring = 2 * slc_dq_stage_elems(dqk, dv) * 2, keys = size_t(cap) * 4;
  return ring > keys ? ring : keys;
}
constexpr size_t slc_dq_warp_bytes(int dqk, int dv, int cap) {
  return slc_dq_union_bytes(cap) + slc_dq_ring_bytes(dqk, dv, cap);
}
// Then 8 ints: the warps' union sizes and a counter (BwdArgs::slc_union).
constexpr size_t slc_dq_smem_bytes(int dqk, int dv, int cap) {
  return size_t(kSlcDqWarps) * slc_dq_warp_bytes(dqk, dv, cap) + 8 * sizeof(int);
}
// Entries of a warp's union lists: the forward's (16 / G) x n rounded up to a power of two.
inline int slc_dq_capacity(int group, int n) { return cuda::slc_sort_capacity(group, n); }

// sm_90a with tensor maps of the selection's k and v (SlcDqMaps::on): pass 2's steps come by TMA,
// one 16-row box per 64 columns of K and of V, into a ring of kSlcDqTmaStages stages per warp
// (two steps in flight while the third is computed), each completing on its own mbarrier; K and V
// are read from the stage by ldmatrix in the 128-byte swizzle. One lane issues a step's four
// boxes: no copy instructions, no V rows in registers. From a 1024-byte boundary: the warps'
// rings, their mbarriers, their union lists (the sort keys in the warp's ring, before its first
// box), 8 ints (slc_dq_smem_bytes).
constexpr int kSlcDqTmaStages = 3;
constexpr size_t slc_dq_tma_stage_bytes(int dqk, int dv) { return size_t(16) * 128 * (dqk / 64 + dv / 64); }
constexpr size_t slc_dq_tma_ring_bytes(int dqk, int dv) {
  return size_t(kSlcDqTmaStages) * slc_dq_tma_stage_bytes(dqk, dv);
}
constexpr size_t slc_dq_tma_lists_offset(int dqk, int dv) {
  return size_t(kSlcDqWarps) * (slc_dq_tma_ring_bytes(dqk, dv) + size_t(kSlcDqTmaStages) * 8);
}
constexpr size_t slc_dq_tma_smem_bytes(int dqk, int dv, int cap) {
  return 1024 + slc_dq_tma_lists_offset(dqk, dv) + size_t(kSlcDqWarps) * slc_dq_union_bytes(cap) + 8 * sizeof(int);
}
// Whether the TMA layout holds `cap` (the sort keys in a ring) with two CTAs per SM. Not at Dqk 192,
// which keeps the ring of copies: there the TMA walk's registers raised the spills from 8 to 64 bytes.
constexpr bool slc_dq_tma_fits(int dqk, int dv, int cap) {
  return dqk <= 128 && size_t(cap) * 4 <= slc_dq_tma_ring_bytes(dqk, dv) &&
         two_ctas_fit_sm90(slc_dq_tma_smem_bytes(dqk, dv, cap));
}
struct SlcDqMaps {
  CUtensorMap k, v;  // the selection's k, v as [T, Hkv, D], boxes of 16 rows x 64 columns
  int on;
};

template <typename E, int DQK, int DV>
__global__ void __launch_bounds__(kSlcDqWarps * 32, 2)
    slc_dq_kernel(const BwdArgs a, int cap, const __grid_constant__ SlcDqMaps maps) {
  constexpr bool kBf16 = cuda::StorageTraits<E>::is_bf16;
  constexpr int kKStride = DQK + 8, kVStride = DV + 8;
  constexpr int kStage = int(slc_dq_stage_elems(DQK, DV));
  constexpr bool kVRegs = slc_dq_v_in_registers(DQK);
  constexpr int kTmaStages = kSlcDqTmaStages;
  constexpr int kTmaKBytes = cuda::kSwStageBlockBytes * (DQK / 64);
  constexpr int kTmaStageBytes = int(slc_dq_tma_stage_bytes(DQK, DV));
  extern __shared__ __align__(128) unsigned char smem[];  // 128: as dq_kernel's declaration of the same array (dq_kernel.cuh)
  const bool tma = cuda::kWgmmaCompiled && slc_dq_tma_fits(DQK, DV, 0) && maps.on != 0;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, quad = lane % 4;
  const int tpw = 16 / a.G;  // tokens per warp
  const int tokens_per_cta = tpw * kSlcDqWarps;
  const int64_t tiles_per_seq = (a.max_seqlen + tokens_per_cta - 1) / tokens_per_cta;
  const int b = int(blockIdx.x / tiles_per_seq);
  const int64_t tile = blockIdx.x % tiles_per_seq;
  const int hk = blockIdx.y;
  const int64_t s0 = seq_start(a.cu, b);
  const int64_t len = seq_start(a.cu, b + 1) - s0;
  const int64_t t0 = tile * tokens_per_cta + int64_t(warp) * tpw;
  if (!a.slc_union && t0 >= len) return;  // no CTA barrier then: a warp may leave alone
  const int tokens_valid = t0 < len ? int(min(int64_t(tpw), len - t0)) : 0;
  const int64_t t_max = t0 + tokens_valid - 1;

  // The warps' union lists start `lists` (list_stride ints apart), the 8 ints at `meta`.
  unsigned char* lists;
  int list_stride;
  int* meta;
  unsigned char* tma_ring = nullptr;  // TMA: this warp's stages, then (bars) their mbarriers
  uint64_t* bars = nullptr;
  E* ring = nullptr;                  // else: the warp's two-stage ring [2][kStage]
  int32_t* keys;                      // the union's sort, done before the ring's first copy
  if (tma) {
    unsigned char* base = smem + ((1024u - (cuda::smem_address(smem) & 1023u)) & 1023u);
    tma_ring = base + warp * kTmaStages * kTmaStageBytes;
    bars = reinterpret_cast<uint64_t*>(base + kSlcDqWarps * kTmaStages * kTmaStageBytes) + warp * kTmaStages;
    lists = base + slc_dq_tma_lists_offset(DQK, DV);
    list_stride = int(slc_dq_union_bytes(cap) / sizeof(int32_t));
    meta = reinterpret_cast<int*>(lists + kSlcDqWarps * slc_dq_union_bytes(cap));
    keys = reinterpret_cast<int32_t*>(tma_ring);
  } else {
    lists = smem;
    list_stride = int(slc_dq_warp_bytes(DQK, DV, cap) / sizeof(int32_t));
    meta = reinterpret_cast<int*>(smem + slc_dq_smem_bytes(DQK, DV, cap) - 8 * sizeof(int));
    ring = reinterpret_cast<E*>(smem + warp * slc_dq_warp_bytes(DQK, DV, cap) + slc_dq_union_bytes(cap));
    keys = reinterpret_cast<int32_t*>(ring);
  }
  int32_t* ublk = reinterpret_cast<int32_t*>(lists) + warp * list_stride;
  int32_t* umask = ublk + cap;

  const int32_t* idx =
      static_cast<const int32_t*>(a.indices.p) + (s0 + min(t0, len - 1)) * a.indices.s0 + int64_t(hk) * a.indices.s1;
  const int num_blocks = cuda::warp_block_union(idx, a.indices.s0, a.n, a.lp, t0, tokens_valid, cap, keys, ublk, umask);
  if (a.slc_union) {
    // dq_kernel took this tile's selection if the union of its warps' blocks is small: the same
    // count (cta_union_size over the same lists) and the same rule.
    if (lane == 0) meta[warp] = num_blocks;
    const int u = cuda::cta_union_size(reinterpret_cast<const int32_t*>(lists), list_stride, meta, meta + kSlcDqWarps);
    const int tile_tokens = int(max(int64_t(0), min(int64_t(tokens_per_cta), len - tile * tokens_per_cta)));
    if (tile_tokens > 0 && cuda::slc_union_takes(u, tile_tokens, a.n)) return;
    if (tokens_valid == 0) return;
  }

  // This lane's rows g and g + 8: token, head, lse of the selection branch (log2 units), gate.
  int tok[2], head[2];
  int64_t t_row[2];
  float lse2[2], gate[2], dg[2] = {0.f, 0.f};
  const E* qrow[2];
  const E* dorow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    tok[h] = row / a.G;
    head[h] = hk * a.G + row % a.G;
    t_row[h] = tok[h] < tokens_valid ? t0 + tok[h] : -1;
    lse2[h] = gate[h] = 0.f;
    qrow[h] = dorow[h] = nullptr;
    if (t_row[h] < 0) continue;
    const int64_t t = s0 + t_row[h];
    lse2[h] = static_cast<const float*>(a.lse.p)[t * a.lse.s0 + head[h] * a.lse.s1 + kSlc] * kLog2e;
    gate[h] = load_f32<E>(a.g.p, t * a.g.s0 + head[h] * a.g.s1 + kSlc);
    qrow[h] = static_cast<const E*>(a.q.p) + t * a.q.s0 + int64_t(head[h]) * a.q.s1;
    dorow[h] = static_cast<const E*>(a.d_o.p) + t * a.d_o.s0 + int64_t(head[h]) * a.d_o.s1;
    if (a.dg_ready) dg[h] = a.dg32[(t * a.hq + head[h]) * 3 + kSlc];
  }
  // D = g dg_slc of each row for pass 2 (dsub); with d_from_o from o and the other two branches.
  float dsub[2];
  if (a.d_from_o) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part = 0.f;
      if (t_row[h] >= 0) {  // the quad's lanes take column pairs 2 quad + 8 c
        const int64_t t = s0 + t_row[h];
        const E* orow = static_cast<const E*>(a.o.p) + t * a.o.s0 + int64_t(head[h]) * a.o.s1;
#pragma unroll 4
        for (int c = 2 * quad; c < DV; c += 8)
          part += to_float(orow[c]) * to_float(dorow[h][c]) + to_float(orow[c + 1]) * to_float(dorow[h][c + 1]);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      dsub[h] = t_row[h] >= 0 ? slc_d_from_o<E>(a, s0 + t_row[h], head[h], part) : 0.f;
    }
  }

  const E* kbase = static_cast<const E*>(a.k[kSlc].p) + s0 * a.k[kSlc].s0 + int64_t(hk) * a.k[kSlc].s1;
  const E* vbase = static_cast<const E*>(a.v[kSlc].p) + s0 * a.v[kSlc].s0 + int64_t(hk) * a.v[kSlc].s1;
  const int64_t kst = a.k[kSlc].s0, vst = a.v[kSlc].s0;
  const cuda::SlcWalk walk{ublk, umask, a.lp, (a.lp + 15) / 16, t_max};
  const int steps = num_blocks * walk.per_block;
  const float scale_log2 = a.scale * kLog2e;
  // Step i's 16 rows of a K or V tensor (base, rows st apart) into registers r in the "A" layout
  // (load_rows_a), zeros past the step's end.
  auto load_step_a = [&](auto& r, const E* base, int64_t st, int i) {
    int64_t first, end;
    int u;
    walk.step(i, first, end, u);
    cuda::load_rows_a<E>(r, base, st, first, end);
  };
  // s (raw scores of a step) -> P = exp2(s scale_log2 - lse2), 0 where row h may not see the key.
  auto probabilities = [&](float (&s)[2][4], int u, int64_t first) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int hi = walk.visible(u, first, t_row[h], tok[h]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = nt * 8 + 2 * quad + c;
          s[nt][2 * h + c] = col < hi ? exp2f(s[nt][2 * h + c] * scale_log2 - lse2[h]) : 0.f;
        }
    }
  };
  // ---- pass 1: o_slc and dg_slc = <dO, o_slc> ----
  // Two products per step, like the forward's selection kernel, whose loads it takes: K and V
  // straight into registers (load_rows_a / load_rows_b: for two products per step the ring's
  // extra shared-memory traffic cost more than its whole-line copies saved, 17.6 -> 22.2 ms in
  // the forward), Q's fragments in the permuted reduction order in registers, o_slc's columns
  // permuted (column n of n8 tile 8v + j is dv = 64v + 8n + j).
  if (!a.dg_ready && !a.d_from_o) {
    constexpr int kQPieces = DQK / 32, kVPieces = DV / 64, kOTiles = DV / 8;
    uint32_t qp[DQK / 16][4];
    cuda::load_permuted_fragments<E, DQK>(qp, qrow[0], qrow[1]);
    float acc_o[kOTiles][4];
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) acc_o[t][0] = acc_o[t][1] = acc_o[t][2] = acc_o[t][3] = 0.f;
    uint4 kr[2][kQPieces], vr[4][kVPieces];
    if (steps > 0) load_step_a(kr, kbase, kst, 0);
    for (int i = 0; i < steps; ++i) {
      int64_t first, end;
      int u;
      walk.step(i, first, end, u);
      cuda::load_rows_b<E, kVPieces>(vr, vbase, vst, first, end);
      float s[2][4];
      cuda::mma_regs_rows_a<E, kQPieces>(s, qp, kr);
      if (i + 1 < steps) load_step_a(kr, kbase, kst, i + 1);
      probabilities(s, u, first);
      cuda::mma_p_rows_b<E, kVPieces>(acc_o, s, vr);
    }
    // acc_o[8v + j][2h + c] is row g + 8h, column 64v + 16 quad + 8c + j.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part = 0.f;
      if (dorow[h] != nullptr) {
#pragma unroll
        for (int v = 0; v < kVPieces; ++v)
#pragma unroll
          for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int j = 0; j < 8; ++j) part += acc_o[8 * v + j][2 * h + c] * to_float(dorow[h][64 * v + 16 * quad + 8 * c + j]);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      dg[h] = part;
      if (quad == 0 && t_row[h] >= 0) {
        const int64_t t = s0 + t_row[h];
        a.dg32[(t * a.hq + head[h]) * 3 + kSlc] = part;
        static_cast<E*>(a.dg.p)[t * a.dg.s0 + head[h] * a.dg.s1 + kSlc] = from_float<E>(part);
      }
    }
  }

  if (!a.d_from_o) dsub[0] = gate[0] * dg[0], dsub[1] = gate[1] * dg[1];
  // Pass 2's dS = scale P (g dP - D) = P (sg dP - sd): one FFMA and one FMUL per score.
  const float sg[2] = {a.scale * gate[0], a.scale * gate[1]}, sd[2] = {a.scale * dsub[0], a.scale * dsub[1]};
  // From here dg sums dg_slc = sum_j P_j dP_j of the lane's columns (written with d_from_o).
  dg[0] = dg[1] = 0.f;

  // ---- pass 2: dq += scale P (g dP - D) K, D = g dg ----
  // Three products per step, two of them reading K: K through the warp's ring (whole-line copies,
  // ldmatrix), V in registers (kVRegs; else through the ring too); Q's fragments in the natural
  // order, dO's permuted as V's register rows (else natural).
  uint32_t qf[DQK / 16][4], df[DV / 16][4];
  cuda::load_a_fragments<E, DQK>(qf, qrow[0], qrow[1]);
  if (kVRegs && !tma) cuda::load_permuted_fragments<E, DV>(df, dorow[0], dorow[1]);
  else cuda::load_a_fragments<E, DV>(df, dorow[0], dorow[1]);
  float acc_q[DQK / 8][4];
#pragma unroll
  for (int t = 0; t < DQK / 8; ++t) acc_q[t][0] = acc_q[t][1] = acc_q[t][2] = acc_q[t][3] = 0.f;
  // dS of a step from its P (s) and dP, with dg_slc = sum_j P_j dP_j on the way (written with d_from_o).
  auto ds_of = [&](float (&s)[2][4], const float (&dp)[2][4]) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dg[e >> 1] += s[nt][e] * dp[nt][e];
        s[nt][e] *= fmaf(sg[e >> 1], dp[nt][e], -sd[e >> 1]);
      }
  };
  if (tma) {
    // The walk by TMA (SlcTmaWalk, slc_union.cuh): a block's 16-key steps up to the warp's last
    // token (steps wholly after it would add exact zeros), the rows of a step from its end on
    // zeroed once landed; per block each row's visible keys (lim), so that a step every row sees
    // in full takes no mask.
    const cuda::SlcTmaWalk tw{ublk, umask, a.lp, int(t_max)};
    const int n_steps = tw.steps(num_blocks);
    // The sort's keys (ordinary stores) share the ring's bytes: fenced for the async proxy first.
    cuda::fence_proxy_async();
    if (lane == 0) {
      for (int st = 0; st < kTmaStages; ++st) cuda::mbarrier_init(bars + st, 1);
      cuda::fence_mbarrier_init();
    }
    __syncwarp();
    int iu = 0, ioff = 0;  // lane 0: the next step to issue (block, key offset)
    auto issue = [&](int st) {  // that step into stage st
      if (lane == 0) {
        cuda::slc_issue_step<DQK, DV>(tma_ring + st * kTmaStageBytes, bars + st, &maps.k, &maps.v, hk,
                                      int(s0) + ublk[iu] * a.lp + ioff);
        ioff += 16;
        if (ioff >= tw.keys(iu)) ++iu, ioff = 0;
      }
    };
    const int trow[2] = {int(t_row[0]), int(t_row[1])};
    int u = 0, off = 0, nkeys = 0, lim[2] = {0, 0};
    if (num_blocks > 0) nkeys = tw.enter(0, trow, tok, lim);
    for (int i = 0; i < kTmaStages - 1 && i < n_steps; ++i) issue(i);
    int st = 0;
    uint32_t phase = 0;
    for (int i = 0; i < n_steps; ++i) {
      if (i + kTmaStages - 1 < n_steps) issue(st == 0 ? kTmaStages - 1 : st - 1);  // the stage step i - 1 left
      cuda::mbarrier_wait_parity(bars + st, phase);
      unsigned char* stage = tma_ring + st * kTmaStageBytes;
      const int nv = min(16, nkeys - off);
      if (nv < 16) cuda::slc_zero_stage_tail<DQK / 64 + DV / 64>(stage, nv, lane);
      const uint32_t sk = cuda::smem_address(stage);
      float s[2][4], dp[2][4];
      cuda::mma_frags_stage_sw<kBf16, DQK>(s, qf, sk);               // S = Q K^T
      cuda::mma_frags_stage_sw<kBf16, DV>(dp, df, sk + kTmaKBytes);  // dP = dO V^T
      const int hi0 = lim[0] - off, hi1 = lim[1] - off;
      if (__all_sync(0xffffffffu, hi0 >= 16 && hi1 >= 16)) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = dq_exp2(s[nt][e] * scale_log2 - lse2[e >> 1]);
      } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[nt][e] = nt * 8 + 2 * quad + (e & 1) < (e >> 1 ? hi1 : hi0)
                           ? dq_exp2(s[nt][e] * scale_log2 - lse2[e >> 1])
                           : 0.f;
      }
      ds_of(s, dp);
      cuda::mma_p_stage_sw<E, DQK>(acc_q, s, sk);  // dq += dS K
      __syncwarp();  // every lane is done with the stage
      off += 16;
      if (off >= nkeys && u + 1 < num_blocks) off = 0, nkeys = tw.enter(++u, trow, tok, lim);
      st = st + 1 == kTmaStages ? 0 : st + 1;
      phase ^= st == 0 ? 1u : 0u;
    }
  }
  constexpr int kVPiecesA = DV / 32;
  uint4 vr[2][kVPiecesA];  // kVRegs: the step's V rows in the "A" layout (load_rows_a)
  // Step i + 1's copies go into the stage step i - 1 used (every lane left it at that step's end).
  auto issue = [&](int i) {
    int64_t first, end;
    int u;
    walk.step(i, first, end, u);
    E* stage = ring + (i & 1) * kStage;
    cuda::slc_copy_step<E, DQK>(stage, kbase, kst, first, end);
    if constexpr (!kVRegs) cuda::slc_copy_step<E, DV>(stage + 16 * kKStride, vbase, vst, first, end);
    cuda::cp_async_commit();
  };
  if (!tma && steps > 0) {
    issue(0);
    if constexpr (kVRegs) load_step_a(vr, vbase, vst, 0);
  }
  for (int i = 0; i < (tma ? 0 : steps); ++i) {
    if (i + 1 < steps) {
      issue(i + 1);
      cuda::cp_async_wait<1>();
    } else {
      cuda::cp_async_wait<0>();
    }
    __syncwarp();  // step i's stage has landed for every lane
    const E* sk = ring + (i & 1) * kStage;
    int64_t first, end;
    int u;
    walk.step(i, first, end, u);
    float s[2][4], dp[2][4];
    cuda::mma_frags_stage<kBf16, DQK, kKStride>(s, qf, sk);   // S = Q K^T
    if constexpr (kVRegs) {
      cuda::mma_regs_rows_a<E, kVPiecesA>(dp, df, vr);  // dP = dO V^T
      if (i + 1 < steps) load_step_a(vr, vbase, vst, i + 1);  // lands during dS, dS K and the next S
    } else {
      cuda::mma_frags_stage<kBf16, DV, kVStride>(dp, df, sk + 16 * kKStride);  // dP = dO V^T
    }
    probabilities(s, u, first);
    ds_of(s, dp);
    cuda::mma_p_stage<kBf16, DQK, kKStride>(acc_q, s, sk);    // dq += dS K
    __syncwarp();  // every lane is done with the stage
  }
  if (a.d_from_o) {  // dg_slc, summed in a fixed order: the lane's columns by step, then the quad
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part = dg[h];
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      if (quad == 0 && t_row[h] >= 0) {
        const int64_t t = s0 + t_row[h];
        a.dg32[(t * a.hq + head[h]) * 3 + kSlc] = part;
        static_cast<E*>(a.dg.p)[t * a.dg.s0 + head[h] * a.dg.s1 + kSlc] = from_float<E>(part);
      }
    }
  }
  // dq (written by dq_kernel with the other branches) += this branch's part, rounded once more.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (t_row[h] < 0) continue;
    E* out = static_cast<E*>(a.dq.p) + (s0 + t_row[h]) * a.dq.s0 + int64_t(head[h]) * a.dq.s1;
    if (a.dq_pairs) {  // one 32-bit load and store per column pair
#pragma unroll
      for (int t = 0; t < DQK / 8; ++t) {
        uint32_t* w = reinterpret_cast<uint32_t*>(out + 8 * t + 2 * quad);
        const uint32_t old = *w;
        const E* e = reinterpret_cast<const E*>(&old);
        *w = cuda::StorageTraits<E>::pack(to_float(e[0]) + acc_q[t][2 * h], to_float(e[1]) + acc_q[t][2 * h + 1]);
      }
      continue;
    }
#pragma unroll
    for (int t = 0; t < DQK / 8; ++t)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        E& x = out[8 * t + 2 * quad + c];
        x = from_float<E>(to_float(x) + acc_q[t][2 * h + c]);
      }
  }
}

}  // namespace nsa::cuda::bwd
