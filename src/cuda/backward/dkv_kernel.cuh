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
#include "cuda/backward/dkv_smem.cuh"

namespace nsa::cuda::bwd {

// ---- dkv_kernel --------------------------------------------------------------------------

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
  // The copies, products and pipeline of this target (sm_90a: the four products on wgmma, tiles
  // in the swizzle layout; else mma.sync, padded tiles).
  using Mainloop = std::conditional_t<cuda::kWgmmaCompiled, DkvMainloopSm90<E, DQK, DV, kSet>,
                                      DkvMainloopSm80<E, DQK, DV, kSet>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using L = DkvSmem<E, DQK, DV>;
  Mainloop ml(smem_raw);
  unsigned char* const smem = ml.smem;
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
    ml.load_kv(a, kb, ks, vb, vs, nk, qb);
  };

  // Fills RowTile `buf` for query tile i of the sequence and starts copying its Q and dO rows into
  // buffer `buf`. Nothing reads this buffer before the pipeline's next barrier. Bit `buf` of
  // `whole` says whether every row of the tile sees every key of the key tile (padding rows count
  // as seeing them: their zero Q and dO rows and zero gate give P = dS = 0 anyway); then compute()
  // skips the per-key mask.
  const int first_pos = kt.kp0, last_pos = kt.kp0 + (nk - 1) * kt.kstep;
  int whole = 0;
  ml.start(maps);  // sm_90a with tensor maps: the Q / dO buffers' mbarriers
  // Query tile i's tokens: a selection list's (list: entries i0 .. i0 + ntok - 1 of the inverted
  // index) or consecutive ones from t0 (window, compressed).
  struct QueryTile {
    bool list;
    int t0, i0, ntok;
  };
  auto query_tile = [&](int i) {
    QueryTile q{kSet == KeySet::raw && i >= n0, 0, 0, 0};
    if (q.list) {  // tokens from the inverted index
      q.i0 = first + (ti0 + i - n0) * tq;
      q.ntok = min(tq, last - q.i0);
    } else if (kSet == KeySet::raw) {  // window: consecutive tokens from key0
      q.t0 = key0 + i * tq;
      q.ntok = min(tq, t_end - q.t0 + 1);
    } else {  // compressed: consecutive tokens of this split's range
      q.t0 = cmp_q0 + i * tq;
      q.ntok = min(tq, cmp_q1 - q.t0);
    }
    return q;
  };
  // Copied ahead by cp.async into the tile ring (dkv_smem.cuh), in the pipeline's group of tile
  // i's copies when prefetch(i) issues them: the pipeline waits for that group and passes a barrier
  // before it calls prefetch(i + 2). So prefetch(i) copies tile i + 4's list tokens and, with the
  // ring's tokens of tile i + 2 (copied by prefetch(i - 2)), that tile's lse, gate and dg: a row
  // table waits for no global load. Tiles 0 .. 3 have their tokens read from the index, tiles 0
  // and 1 their row statistics from global memory.
  auto branch_of = [&](const QueryTile& q) { return kSet == KeySet::cmp ? kCmp : q.list ? kSlc : kWin; };
  auto tokens_of = [&](int i, const QueryTile& q) -> const int32_t* {
    return i >= 4 ? ml.ring->tok[i % kTokenSlots] : a.sel_tokens + q.i0;
  };
  // Token of row r of query tile q (tokens: its list's, when it is one), -1 for a padding row.
  auto row_token = [&](const QueryTile& q, const int32_t* tokens, int r) {
    const int u = r / a.G;
    return u >= q.ntok ? -1 : q.list ? tokens[u] : int(s0 + q.t0 + u);
  };
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
      const int t = int(tok - s0);
      const int64_t e = (int64_t(tok) * a.hq + h) * 3 + branch;
      const float lse = i >= 2 ? ml.ring->lse[m][r] : lse_p[tok * a.lse.s0 + h * a.lse.s1 + branch];
      const float g = i >= 2 ? ml.ring->g[m][r] : a.g32[e];
      const float dg = i >= 2 ? ml.ring->dg[m][r] : a.dg32[e];
      R.st[r] = make_float4(lse * kLog2e, g, a.scale * dg, 0.f);
      const int lo = branch == kWin ? t - a.w + 1 : INT32_MIN;
      R.vis[r] = make_int2(lo, t);
      sees_all = sees_all && lo <= first_pos && t >= last_pos;
    }
    // the row pointers are in place for the copies; every thread learns the tile's flag
    const int all = __syncthreads_and(sees_all);
    whole = (whole & ~(1 << buf)) | (all ? 1 << buf : 0);
    ml.load_rows(a, R, buf, list, t0, ntok, s0, hk, qb, dob);
  };

  float acc_k[DQK / 8][4], acc_v[DV / 8][4];
  zero(acc_k);
  zero(acc_v);

  // g P = g exp2(scale S log2 e - lse log2 e) and dS = scale g P (dP - dg) = g P (scale dP - scale
  // dg) (one FFMA and one FMUL) of one half (rows r0 .. r0 + 31 of RowTile R's query tile) from S^T
  // in s and dP^T in dp (both overwritten); P uses ex2.approx (dq_exp2: probabilities below 2^-126
  // flush to 0). Keys past the tile's nk (zero rows) need no mask: their dK / dV rows are never
  // written.
  auto grads = [&](float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], const RowTile& R, int buf, int r0) {
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
            dp[nt][2 * h + i] = x * fmaf(a.scale, dp[nt][2 * h + i], -st.z);
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
            dp[nt][2 * h + i] = x * fmaf(a.scale, dp[nt][2 * h + i], -st.z);
          }
        }
      }
    }
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
  // Element (c, col) of the tile's dK (which = 0) or dV rows, from its fp32 sum: shared K/V add
  // phi's gradient (add_phi), then it is rounded once into out.
  auto finish_raw = [&](int which, int D, int c, int col, float val, OutMat3 out, bool add_phi) {
    if (add_phi) {  // phi's gradient to this token (phi::backward_x, fp32 [T, Hkv, D]; none: no block)
      const float* dx = which == 0 ? a.phi_dk32 : a.phi_dv32;
      if (dx != nullptr) val += dx[((s0 + key0 + c) * a.hkv + hk) * D + col];
    }
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

}  // namespace nsa::cuda::bwd
