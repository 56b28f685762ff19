// dkv_kernel: the backward's key-centric kernel (tile.cuh has the overview): per key tile, dK and
// dV over the query tiles that see it, raw keys (window + selection through the inverted index) or
// compressed keys (split over query ranges).
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
// the ptxas hazard of docs/cuda.md, "sm_80 and sm_90a"), K and V are never in registers. The accumulators are the
// mma.sync ones (the wgmma D layout is the m16n8 C fragment layout per warp), so masking, P, dS
// and the epilogue are shared with the sm_80 body. Tiles are stored unpadded in the 128-byte
// swizzle layout from a 1024-byte boundary (DkvSmem::kSw*; the launch asks for that layout's size,
// DkvSmem::kSwLaunch, where this body runs); each thread fences its landed copies to the async proxy before the barrier that
// publishes them. Each batch is fence / issue / commit / wait 0, so the accumulation order is
// fixed and the result deterministic (it differs in rounding from the sm_80 body's).
//
// This file: the kernel's key tile and query tiles, P and dS of a query tile's scores and the
// writes; the copies, products and pipeline of each target are its mainloop
// (dkv_mainloop_sm80.cuh, dkv_mainloop_sm90.cuh; the layouts: dkv_smem.cuh).
#pragma once

#include <type_traits>

#include "cuda/backward/dkv_mainloop_sm80.cuh"
#include "cuda/backward/dkv_mainloop_sm90.cuh"
#include "cuda/backward/dkv_plan.cuh"
#include "cuda/backward/dkv_smem.cuh"

namespace nsa::cuda::bwd {

// ---- dkv_kernel --------------------------------------------------------------------------

template <typename E, int DQK, int DV, KeySet kSet>
__global__ void __launch_bounds__(kThreads) dkv_kernel(const BwdArgs a, const __grid_constant__ DkvMaps maps) {
  // The copies, products and pipeline of this target (sm_90a: the four products on wgmma, tiles
  // in the swizzle layout; else mma.sync, padded tiles).
  using Mainloop = std::conditional_t<cuda::kWgmmaCompiled, DkvMainloopSm90<E, DQK, DV, kSet>,
                                      DkvMainloopSm80<E, DQK, DV, kSet>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using L = DkvSmem<E, DQK, DV>;
  Mainloop ml(smem_raw);
  unsigned char* const smem = ml.smem;
  DkvPlan<kSet> p;
  if (!p.init(a)) return;
  const int hk = p.hk, nk = p.nk, n0 = p.n0, n1 = p.n1, piece = p.piece;
  const int64_t s0 = p.s0;
  const KeyTile kt = p.kt;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int key_w = warp * 16;  // the warp's first key of the tile
  const E* qb = static_cast<const E*>(a.q.p);
  const E* dob = static_cast<const E*>(a.d_o.p);
  const float scale_log2 = a.scale * kLog2e;
  // This thread's two keys of the warp's 16: group (h = 0) and group + 8 (h = 1).
  int kpos[2];
  bool kin[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = key_w + group + 8 * h;
    kin[h] = c < nk;
    kpos[h] = kt.kp0 + c * kt.kstep;
  }
  // Starts copying the key tile of `phase` (raw: window or selection keys; else the only one).
  auto load_kv = [&](int phase) {
    p.template key_rows<E, DQK, DV>(a, phase, [&](const E* kb, int64_t ks, const E* vb, int64_t vs) {
      ml.load_kv(a, kb, ks, vb, vs, nk, qb);
    });
  };

  // Fills RowTile `buf` for query tile i of the sequence and starts copying its Q and dO rows into
  // buffer `buf`. Nothing reads this buffer before the pipeline's next barrier. Bit `buf` of
  // `whole` says whether every row of the tile sees every key of the key tile (padding rows count
  // as seeing them: their zero Q and dO rows and zero gate give P = dS = 0 anyway); then compute()
  // skips the per-key mask.
  int whole = 0;
  ml.start(maps);  // sm_90a with tensor maps: the Q / dO buffers' mbarriers
  using QueryTile = typename DkvPlan<kSet>::QueryTile;
  auto query_tile = [&](int i) { return p.query_tile(i); };
  // Copied ahead by cp.async into the tile ring (dkv_smem.cuh), in the pipeline's group of tile
  // i's copies when prefetch(i) issues them: the pipeline waits for that group and passes a barrier
  // before it calls prefetch(i + 2). So prefetch(i) copies tile i + 4's list tokens and, with the
  // ring's tokens of tile i + 2 (copied by prefetch(i - 2)), that tile's lse, gate and dg: a row
  // table waits for no global load. Tiles 0 .. 3 have their tokens read from the index, tiles 0
  // and 1 their row statistics from global memory.
  auto branch_of = [&](const QueryTile& q) { return p.branch_of(q); };
  auto tokens_of = [&](int i, const QueryTile& q) -> const int32_t* {
    return i >= 4 ? ml.ring->tok[i % kTokenSlots] : a.sel_tokens + q.i0;
  };
  auto row_token = [&](const QueryTile& q, const int32_t* tokens, int r) { return p.row_token(q, tokens, r, a.G); };
  const float* lse_p = static_cast<const float*>(a.lse.p);
  auto stage_ahead = [&](int i) {
    if (i + 4 < n0 + n1) {
      const QueryTile q = query_tile(i + 4);
      int32_t* slot = ml.ring->tok[(i + 4) % kTokenSlots];
      if (q.list)
        for (int u = threadIdx.x; u < q.ntok; u += kThreads) cuda::cp_async_4(slot + u, a.sel_tokens + q.i0 + u);
    }
    if (i + 2 < n0 + n1) {
      const QueryTile q = query_tile(i + 2);
      const int branch = branch_of(q), m = (i + 2) % kMetaSlots;
      const int32_t* tokens = tokens_of(i + 2, q);
      for (int r = threadIdx.x; r < kRows; r += kThreads) {
        const int tok = row_token(q, tokens, r);
        if (tok < 0) continue;
        const int h = hk * a.G + r % a.G;
        const int64_t e = (int64_t(tok) * a.hq + h) * 3 + branch;
        cuda::cp_async_4(&ml.ring->lse[m][r], lse_p + tok * a.lse.s0 + h * a.lse.s1 + branch);
        cuda::cp_async_4(&ml.ring->g[m][r], a.g32 + e);
        cuda::cp_async_4(&ml.ring->dg[m][r], a.dg32 + e);
      }
    }
  };
  auto prefetch = [&](int i, int buf) {
    RowTile& R = ml.ri[buf];
    stage_ahead(i);
    const QueryTile q = query_tile(i);
    const bool list = q.list;
    const int branch = branch_of(q), m = i % kMetaSlots;
    const int t0 = q.t0, ntok = q.ntok;
    const int32_t* tokens = tokens_of(i, q);
    bool sees_all = true;
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      const int tok = row_token(q, tokens, r);
      const int h = hk * a.G + r % a.G;
      if (tok < 0) {
        R.q[r] = R.dO[r] = nullptr;
        R.st[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        R.vis[r] = make_int2(0, -1);
        continue;
      }
      R.q[r] = qb + int64_t(tok) * a.q.s0 + int64_t(h) * a.q.s1;
      R.dO[r] = dob + int64_t(tok) * a.d_o.s0 + int64_t(h) * a.d_o.s1;
      const int64_t e = (int64_t(tok) * a.hq + h) * 3 + branch;
      const float lse = i >= 2 ? ml.ring->lse[m][r] : lse_p[tok * a.lse.s0 + h * a.lse.s1 + branch];
      const float g = i >= 2 ? ml.ring->g[m][r] : a.g32[e];
      const float dg = i >= 2 ? ml.ring->dg[m][r] : a.dg32[e];
      p.row_stats(a, branch, tok, lse, g, dg, R.st[r], R.vis[r], sees_all);
    }
    // the row pointers are in place for the copies; every thread learns the tile's flag
    const int all = __syncthreads_and(sees_all);
    whole = (whole & ~(1 << buf)) | (all ? 1 << buf : 0);
    ml.load_rows(a, R, buf, list, t0, ntok, s0, hk, qb, dob);
  };

  float acc_k[DQK / 8][4], acc_v[DV / 8][4];
  zero(acc_k);
  zero(acc_v);

  // P and dS of one half of query tile `buf` (dkv_grads), without the mask where bit `buf` of `whole` is set.
  auto grads = [&](float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], const RowTile& R, int buf, int r0) {
    dkv_grads(s, dp, R, whole >> buf & 1, kpos, kin, a.scale, scale_log2, r0);
  };
  // One query tile (buffer `buf`) against the resident key tile.
  auto compute = [&](int buf) { ml.compute(acc_k, acc_v, key_w, buf, grads); };

  // Writes the accumulated dK (which = 0) or dV rows through an fp32 scratch over the key tile's
  // shared memory (free: the caller has passed a barrier after the last compute and reloads K/V
  // before the next), 32 columns at a time so that it fits for every head dim; then clears them.
  // Per element: raw keys add phi's gradient (shared K/V) and round once (finish_raw), or, as a
  // piece of a split list, store their fp32 partial; compressed keys store fp32 partials.
  float* scratch = reinterpret_cast<float*>(smem + L::kK);
  constexpr int kLdS = kSub + 4;
  static_assert(kKeys * kLdS * 4 <= tile_bytes<64>(), "the scratch fits the K tile");
  static_assert(kKeys * kLdS * 4 <= L::kSwQ, "swizzled: the scratch fits the K and V tiles (both reloaded after)");
  auto emit_column_block = [&](int which, int D, int col0, OutMat3 out, bool add_phi, float* part) {
    __syncthreads();
    for (int e = threadIdx.x; e < p.nk_emit * kSub; e += kThreads) {
      const int c = e / kSub, col = col0 + e % kSub;
      p.template emit_element<E>(a, which, D, c, col, scratch[c * kLdS + e % kSub], out, add_phi, part);
    }
    __syncthreads();
  };
  auto emit = [&](auto& acc, int which, OutMat3 out, bool add_phi, float* part) {
    constexpr int kTiles = int(std::extent_v<std::remove_reference_t<decltype(acc)>>);
#pragma unroll 1
    for (int col0 = 0; col0 < kTiles * 8; col0 += kSub) {
      acc_columns_to_scratch<kLdS>(acc, scratch, col0, key_w, group, quad);
      emit_column_block(which, kTiles * 8, col0, out, add_phi, part);
    }
  };
  auto epilogue = [&](OutMat3 dk_out, OutMat3 dv_out, bool add_phi, float* part_k, float* part_v) {
    emit(acc_k, 0, dk_out, add_phi, part_k);
    emit(acc_v, 1, dv_out, add_phi, part_v);
  };

  // The query tiles through the mainloop's two-stage pipeline (ml.run), the key tile and the first
  // query tile's copies started here.
  const int n_tiles = n0 + n1;
  if (kSet == KeySet::raw && !a.shared_kv && n0 == 0 && piece == 0)
    epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);  // no window: zeros
  if (n_tiles > 0) {
    load_kv(n0 > 0 ? 0 : 1);
    prefetch(0, 0);
  }
  cuda::cp_async_commit();
  ml.run(
      n_tiles, n0, prefetch,
      [&] {
        // Window done, selection next: independent K/V write the window's gradient now; the
        // selection's keys replace the window's (tile n0 + 1's copies may stay in flight).
        if (!a.shared_kv) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);
        __syncthreads();
        load_kv(1);
        ml.wait_kv();
      },
      compute);

  p.template final_writes<E, DQK, DV>(a, epilogue, [] { __syncthreads(); }, int(threadIdx.x), kThreads);
}

// raw_pieces_plan_kernel (backward.cu) fills raw.split / raw.slot before dkv_kernel<raw> runs.
constexpr int kRawTargetCtas = 1024;   // cap = all raw CTAs' query tiles / this (~8 per CTA slot of an H200: a piece is a small part of a slot's work)
constexpr int kRawMinPieceTiles = 32;  // no piece shorter than this many query tiles

}  // namespace nsa::cuda::bwd
