// What both bodies of the key-centric backward share (dkv_kernel.cuh: one warpgroup per CTA, every
// target; dkv_ws_kernel.cuh: warp-specialised, sm_90a): which key tile a CTA owns and which query
// tiles see it (DkvPlan), P and dS of one half's scores (dkv_grads) and where the tile's dK / dV
// rows go (DkvPlan::finish_raw, cmp_parts).
#pragma once

#include <climits>

#include "cuda/backward/dkv_smem.cuh"

namespace nsa::cuda::bwd {

// dkv_kernel<cmp>'s query split: the last split first (blockIdx.z = 0). CTAs start roughly in
// blockIdx order (x, then y, then z). A later split has more whole key tiles (tiles every one of
// its queries sees: 8z of them at 64K with 8 splits) and each split a few tiles on the diagonal
// whose work shrinks to nothing (8 at 64K), so starting from the last split puts the whole tiles
// first and leaves the diagonal's small CTAs and the early exits for the tail, where in split
// order the last split's whole tiles came last. Which CTA does what does not change, only when
// it starts: the results are the same bits.
__device__ __forceinline__ int cmp_split_index() { return int(gridDim.z - 1 - blockIdx.z); }

// One CTA's key tile and its query tiles, as one sequence: phase 0 (raw: window; cmp: one query
// split) then phase 1 (raw only: the selection list, or this piece of it).
template <KeySet kSet>
struct DkvPlan {
  int hk = 0;
  int bx = 0, piece = 0;
  int2 split = make_int2(-1, 1);  // (first slot, pieces) of this CTA's list
  int b = 0, key0 = 0, nk = 0, j = 0, len = 0;
  int64_t s0 = 0, crow0 = 0;  // the sequence's first token and first compressed row
  KeyTile kt{};
  int n0 = 0, n1 = 0, t_end = 0, first = 0, last = 0, ti0 = 0;
  int cmp_q0 = 0, cmp_q1 = 0;  // compressed: this split's query positions [cmp_q0, cmp_q1)
  int nk_emit = 0;             // keys of the tile whose dK / dV rows this block writes
  int tq = 0;                  // tokens per query tile

  // Fills the plan of this CTA; false: it has nothing to do (the same answer for every thread).
  __device__ __forceinline__ bool init(const BwdArgs& a) {
    tq = kRows / a.G;
    hk = int(blockIdx.y);
    // Raw keys with pieces (BwdArgs::raw): an extra CTA in front of the grid runs piece
    // `piece` of raw CTA (hk, bx)'s list; the block's own CTAs come after them.
    bx = int(blockIdx.x);
    if constexpr (kSet == KeySet::raw) {
      if (a.raw.pool > 0) {
        if (bx < a.raw.extra_x) {
          const int slot = int(blockIdx.y) * a.raw.extra_x + bx;
          if (slot >= a.raw.pool) return false;
          const int2 e = a.raw.slot[slot];
          if (e.x < 0 || e.y == 0) return false;  // unused, or a piece 0 (its block's own CTA runs it)
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
    if constexpr (kSet != KeySet::cmp) {
      const int chunks = (a.lp + kKeys - 1) / kKeys;
      const int per_seq = a.n_slc_max * chunks;
      b = bx / per_seq;
      j = (bx % per_seq) / chunks;
      key0 = j * a.lp + (bx % chunks) * kKeys;  // first key position
    } else {
      const int per_seq = int((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys);
      b = int(blockIdx.x) / per_seq;
      key0 = (int(blockIdx.x) % per_seq) * kKeys;  // first compressed block
    }
    s0 = seq_start(a.cu, b);
    len = int(seq_start(a.cu, b + 1) - s0);
    crow0 = cmp_row_offset(s0, a.d);
    if constexpr (kSet != KeySet::cmp) {
      if (key0 >= len) return false;
      nk = min(kKeys, min((j + 1) * a.lp, len) - key0);
    } else {
      const int nc = int(num_cmp_blocks(len, a.l, a.d));
      if (key0 >= nc) return false;
      nk = min(kKeys, nc - key0);
    }
    kt = kSet != KeySet::cmp ? KeyTile{nk, key0, 1} : KeyTile{nk, key0 * a.d + a.l - 1, a.d};
    nk_emit = nk;
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
      // (the schedule model counts the same range: cmp_cta_query_tiles, tile_sizes.h)
      const CmpSplit cs = cmp_split_of(len, a.cmp_splits);
      const int z = cmp_split_index();
      const CmpQueries r = cmp_split_queries(len, cs, z, int64_t(key0) * a.d + a.l - 1);
      if (r.q0 >= r.q1) return false;
      cmp_q0 = int(r.q0);
      cmp_q1 = int(r.q1);
      n0 = (cmp_q1 - cmp_q0 + tq - 1) / tq;
      if (z < cs.last) nk_emit = int(min(int64_t(nk), cmp_split_rows(len, z, cs, a.l, a.d) - key0));
    }
    return true;
  }
  __device__ __forceinline__ int n_tiles() const { return n0 + n1; }

  // Query tile i's tokens: a selection list's (list: entries i0 .. i0 + ntok - 1 of the inverted
  // index) or consecutive ones from t0 (window, compressed).
  struct QueryTile {
    bool list;
    int t0, i0, ntok;
  };
  __device__ __forceinline__ QueryTile query_tile(int i) const {
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
  }
  __device__ __forceinline__ int branch_of(const QueryTile& q) const {
    return kSet == KeySet::cmp ? kCmp : q.list ? kSlc : kWin;
  }
  // Token of row r of query tile q (tokens: its list's, when it is one), -1 for a padding row.
  __device__ __forceinline__ int row_token(const QueryTile& q, const int32_t* tokens, int r, int G) const {
    const int u = r / G;
    return u >= q.ntok ? -1 : q.list ? tokens[u] : int(s0 + q.t0 + u);
  }
  // The row statistics of a real row (token tok, head h): (lse * log2 e, gate, scale * dg) and its
  // visible key positions [lo, t]; `whole` stays true while the row sees the whole key tile.
  __device__ __forceinline__ void row_stats(const BwdArgs& a, int branch, int tok, float lse, float g, float dg,
                                            float4& st, int2& vis, bool& whole) const {
    const int t = int(tok - s0);
    st = make_float4(lse * kLog2e, g, a.scale * dg, 0.f);
    const int lo = branch == kWin ? t - a.w + 1 : INT32_MIN;
    vis = make_int2(lo, t);
    whole = whole && lo <= kt.kp0 && t >= kt.kp0 + (nk - 1) * kt.kstep;
  }

  // Starts copying the key tile of `phase` (raw: window or selection keys; else the only one)
  // through load(kb, ks, vb, vs): key c at kb + c * ks, vb + c * vs.
  template <typename E, int DQK, int DV, typename Load>
  __device__ __forceinline__ void key_rows(const BwdArgs& a, int phase, Load&& load) const {
    if constexpr (kSet == KeySet::cmp) {
      const int64_t crow = crow0 + key0;
      load(static_cast<const E*>(a.kc) + (crow * a.hkv + hk) * DQK, int64_t(a.hkv) * DQK,
           static_cast<const E*>(a.vc) + (crow * a.hkv + hk) * DV, int64_t(a.hkv) * DV);
    } else {
      const int br = kSet == KeySet::raw && phase == 0 ? kWin : kSlc;
      const Mat3& K = a.k[br];
      const Mat3& V = a.v[br];
      load(static_cast<const E*>(K.p) + (s0 + key0) * K.s0 + hk * K.s1, K.s0,
           static_cast<const E*>(V.p) + (s0 + key0) * V.s0 + hk * V.s1, V.s0);
    }
  }

  // Element (c, col) of the tile's dK (which = 0) or dV rows, from its fp32 sum: shared K/V add
  // phi's gradient (add_phi), then it is rounded once into out.
  template <typename E>
  __device__ __forceinline__ void finish_raw(const BwdArgs& a, int which, int D, int c, int col, float val,
                                             OutMat3 out, bool add_phi) const {
    if (add_phi) {  // phi's gradient to this token (phi::backward_x, fp32 [T, Hkv, D]; none: no block)
      const float* dx = which == 0 ? a.phi_dk32 : a.phi_dv32;
      if (dx != nullptr) val += dx[((s0 + key0 + c) * a.hkv + hk) * D + col];
    }
    static_cast<E*>(out.p)[(s0 + key0 + c) * out.s0 + hk * out.s1 + col] = from_float<E>(val);
  }
  // Element (c, col) of the tile's sum `val` of dK (which = 0) or dV, D columns: raw keys round it
  // into `out` (finish_raw) or, as a piece of a split list, store it to the piece's fp32 slot
  // rows `part` ([kKeys][D]); compressed keys store the fp32 partial at `part` ([Rc, Hkv, D]).
  template <typename E>
  __device__ __forceinline__ void emit_element(const BwdArgs& a, int which, int D, int c, int col, float val,
                                               OutMat3 out, bool add_phi, float* part) const {
    if constexpr (kSet == KeySet::raw) {
      if (part != nullptr) {
        part[c * D + col] = val;
        return;
      }
      finish_raw<E>(a, which, D, c, col, val, out, add_phi);
    } else {
      part[((crow0 + key0 + c) * a.hkv + hk) * D + col] = val;
    }
  }
  // The last piece of a split list to arrive (the caller's count) sums the pieces' slots in piece
  // order and writes the block's dK / dV rows, with `threads` threads (tid: this one's index).
  template <typename E, int DQK, int DV>
  __device__ __forceinline__ void finish_pieces(const BwdArgs& a, int tid, int threads) const {
    const OutMat3 outs[2] = {a.shared_kv ? a.grad_k[kCmp] : a.grad_k[kSlc], a.shared_kv ? a.grad_v[kCmp] : a.grad_v[kSlc]};
#pragma unroll 1
    for (int which = 0; which < 2; ++which) {
      const int D = which == 0 ? DQK : DV;
      const float* slots = (which == 0 ? a.raw.part_k : a.raw.part_v) + int64_t(split.x) * kKeys * D;
      for (int e = tid; e < nk * D; e += threads) {
        const int c = e / D, col = e % D;
        float val = 0.f;
        for (int p = 0; p < split.y; ++p) val += __ldcg(slots + (int64_t(p) * kKeys + c) * D + col);
        finish_raw<E>(a, which, D, c, col, val, outs[which], a.shared_kv);
      }
    }
  }
  // The block's writes after its last query tile. Raw keys: the window's dK / dV where the block
  // had no list (independent K/V), then the list's; a piece of a split list writes its fp32
  // partial to its slot and counts itself in (the stores first, device-wide), and the last piece
  // to arrive sums the slots in piece order (finish_pieces). Compressed keys: the split's rows
  // (cmp_parts). epilogue(dk_out, dv_out, add_phi, part_k, part_v) writes and clears the
  // accumulators; barrier() syncs the `threads` threads that run this (tid: this one's index).
  template <typename E, int DQK, int DV, typename Epilogue, typename Barrier>
  __device__ __forceinline__ void final_writes(const BwdArgs& a, Epilogue&& epilogue, Barrier&& barrier, int tid,
                                               int threads) const {
    if constexpr (kSet == KeySet::raw) {
      if (!a.shared_kv && n0 > 0 && n1 == 0) epilogue(a.grad_k[kWin], a.grad_v[kWin], false, nullptr, nullptr);
      if (split.y > 1) {
        const int64_t slot = split.x + piece;
        epilogue(OutMat3{}, OutMat3{}, false, a.raw.part_k + slot * kKeys * DQK, a.raw.part_v + slot * kKeys * DV);
        __threadfence();
        barrier();
        __shared__ int last_in;
        if (tid == 0) last_in = atomicAdd(a.raw.arrived + split.x, 1) == split.y - 1;
        barrier();
        if (!last_in) return;
        __threadfence();
        finish_pieces<E, DQK, DV>(a, tid, threads);
      } else if (a.shared_kv) {
        epilogue(a.grad_k[kCmp], a.grad_v[kCmp], true, nullptr, nullptr);
      } else {
        epilogue(a.grad_k[kSlc], a.grad_v[kSlc], false, nullptr, nullptr);
      }
    } else {
      float* part_k;
      float* part_v;
      cmp_parts<DQK, DV>(a, part_k, part_v);
      epilogue(OutMat3{}, OutMat3{}, false, part_k, part_v);
    }
  }
  // Compressed keys: where this split's dK / dV go. The last split writes dkc / dvc; split z < last
  // its partial (rows before it: earlier splits').
  template <int DQK, int DV>
  __device__ __forceinline__ void cmp_parts(const BwdArgs& a, float*& part_k, float*& part_v) const {
    part_k = a.dkc;
    part_v = a.dvc;
    const int z = cmp_split_index();
    if (z < cmp_split_of(len, a.cmp_splits).last) {
      int64_t rows_before = 0;
      for (int y = 0; y < z; ++y) rows_before += a.cmp_part_rows[y];
      part_k = a.dkc_part + rows_before * a.hkv * DQK;
      part_v = a.dvc_part + rows_before * a.hkv * DV;
    }
  }
};

// Stores columns col0 .. col0 + kSub - 1 of this warp's dK or dV accumulator (the C fragments of
// its 16 keys from key_w: kTiles n8 tiles of columns; group = lane / 4, quad = lane % 4) into rows
// [kKeys][kLdS] of an fp32 scratch and clears them: the epilogues' first step, before a barrier and
// the writes.
template <int kLdS, int kTiles>
__device__ __forceinline__ void acc_columns_to_scratch(float (&acc)[kTiles][4], float* scratch, int col0, int key_w,
                                                       int group, int quad) {
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
}

// g P = g exp2(scale S log2 e - lse log2 e) and dS = scale g P (dP - dg) = g P (scale dP - scale
// dg) (one FFMA and one FMUL) of one half (rows r0 .. r0 + 31 of RowTile R's query tile) from S^T
// in s and dP^T in dp (both overwritten); P uses ex2.approx (dq_exp2: probabilities below 2^-126
// flush to 0). whole: every row of the tile sees every key (no mask); else key h of this thread
// (kpos[h], kin[h]: inside the tile) is masked by the row's visible range. Keys past the tile's nk
// (zero rows) need no mask: their dK / dV rows are never written.
__device__ __forceinline__ void dkv_grads(float (&s)[kSubTiles][4], float (&dp)[kSubTiles][4], const RowTile& R,
                                          bool whole, const int (&kpos)[2], const bool (&kin)[2], float scale,
                                          float scale_log2, int r0) {
  const int quad = threadIdx.x % 4;
  if (whole) {
#pragma unroll
    for (int nt = 0; nt < kSubTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float4 st = R.st[r0 + nt * 8 + 2 * quad + i];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = s[nt][2 * h + i];
          x = st.y * dq_exp2(fmaf(x, scale_log2, -st.x));
          dp[nt][2 * h + i] = x * fmaf(scale, dp[nt][2 * h + i], -st.z);
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
          dp[nt][2 * h + i] = x * fmaf(scale, dp[nt][2 * h + i], -st.z);
        }
      }
    }
  }
}

}  // namespace nsa::cuda::bwd
