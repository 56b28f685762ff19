// dq_kernel: the backward's query-centric kernel (tile.cuh has the overview): per row tile, dg and
// the summed dQ of the compressed and window branches (and on sm_90a the selection of row tiles
// whose blocks have a small union). This file: the kernel's key tiles (DqKeyTiles), its rows'
// masking, P and dS (the lambdas its mainloop calls), the two passes and the writes; the copies and
// products of each target are its mainloop (dq_mainloop_sm80.cuh, dq_mainloop_sm90.cuh; the sm_90a
// products: dq_wgmma.cuh; the layouts: dq_smem.cuh).
#pragma once

#include <type_traits>

#include "cuda/backward/dq_mainloop_sm80.cuh"
#include "cuda/backward/dq_mainloop_sm90.cuh"
#include "cuda/backward/dq_smem.cuh"

namespace nsa::cuda::bwd {

// ---- dq_kernel ---------------------------------------------------------------------------

// The key tiles of a row tile's compressed and window branches (and the selection's union tiles)
// as one sequence: n_cmp compressed tiles, n_slc union tiles, n_win window tiles.
template <typename E, int DQK, int DV>
struct DqKeyTiles {
  const E* qb;  // any valid address (the zero-filled rows' source)
  int64_t s0;
  int hk, len, t_last;
  int nc, n_cmp, n_slc, n_win, n_tiles, p0;
  int64_t crow0;  // the sequence's first compressed row
  const int32_t* slc_blocks;               // [n_slc] ascending
  const unsigned long long* slc_tokens;    // [n_slc] the tile's tokens that picked each

  // The tiles a sweep takes when it leaves out the compressed ones (skip_cmp), the selection's
  // (skip_slc) and the window's (skip_win): runs() of them, the j-th being tile run_tile(j)
  // (buffers alternate with j; the window's tiles are the last, so leaving them out shortens the run).
  __device__ __forceinline__ int runs(bool skip_cmp, bool skip_slc, bool skip_win) const {
    return n_tiles - (skip_cmp ? n_cmp : 0) - (skip_slc ? n_slc : 0) - (skip_win ? n_win : 0);
  }
  __device__ __forceinline__ int run_tile(int j, bool skip_cmp, bool skip_slc) const {
    const int i = skip_cmp ? j + n_cmp : j;
    return skip_slc && i >= n_cmp ? i + n_slc : i;
  }
  // Branch of tile i (kCmp = 0, kSlc = 1, kWin = 2).
  __device__ __forceinline__ int branch_of(int i) const {
    return i < n_cmp ? int(kCmp) : i < n_cmp + n_slc ? int(kSlc) : int(kWin);
  }
  // Tile i: its keys' geometry and the rows of its first key (key c at kb + c * ks, vb + c * vs).
  __device__ __forceinline__ KeyTile at(const BwdArgs& a, int i, const E*& kb, int64_t& ks, const E*& vb,
                                        int64_t& vs) const {
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
  }
};

template <typename E, int DQK, int DV>
__global__ void __launch_bounds__(kThreads) dq_kernel(const BwdArgs a, const __grid_constant__ DqMaps maps) {
  extern __shared__ __align__(128) unsigned char smem[];
  // The copies and products of this target (sm_90a: wgmma, K/V tiles swizzled from a 1024-byte
  // boundary; else mma.sync, padded tiles).
  using Mainloop = std::conditional_t<kDqWgmma, DqMainloopSm90<E, DQK, DV>, DqMainloopSm80<E, DQK, DV>>;
  Mainloop ml(smem);
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
  ml.load_q_do(a, q_row, do_row, qb, dob);
  cuda::cp_async_commit();  // completes with the first key tile's group (without TMA)
  // The rows' state per branch (lse, gate; dg where the forward gave every branch's) from global
  // memory into shared memory (ml.row_state(): field f, branch b, row r at (3 f + b) kRows + r),
  // where the stage switches read it: its loads go out here, all at once, under the Q / dO copies
  // and the union's work, instead of one wait at each switch of each pass. Entry e of the 3 kRows
  // (branch e / kRows, row e % kRows) is thread e % kThreads's.
  constexpr int kStateEntries = 3 * kRows, kStatePer = (kStateEntries + kThreads - 1) / kThreads;
  float* const rs = ml.row_state();
  float st_lse[kStatePer], st_gate[kStatePer], st_dg[kStatePer];
#pragma unroll
  for (int k = 0; k < kStatePer; ++k) {
    const int e = int(threadIdx.x) + k * kThreads, r = e % kRows, branch = e / kRows;
    const int64_t tok = e < kStateEntries ? row_token(r) : -1;
    st_lse[k] = st_gate[k] = st_dg[k] = 0.f;
    if (tok < 0) continue;  // a padding row: never read
    const int64_t head = row_head(r);
    st_lse[k] = static_cast<const float*>(a.lse.p)[tok * a.lse.s0 + head * a.lse.s1 + branch];
    st_gate[k] = load_f32<E>(a.g.p, tok * a.g.s0 + head * a.g.s1 + branch);
    if (a.dg_ready) st_dg[k] = a.dg32[(tok * a.hq + head) * 3 + branch];
  }
  // sm_90a: the selection's union tiles (a.slc_union; DqMainloopSm90::union_tiles), else none:
  // this kernel has no selection tiles.
  int n_slc = 0;
  const int32_t* slc_blocks = nullptr;                // [n_slc] ascending
  const unsigned long long* slc_tokens = nullptr;     // [n_slc] the tile's tokens that picked each
  ml.union_tiles(a, u0, len, s0, hk, ntok, warp, lane, n_slc, slc_blocks, slc_tokens);
#pragma unroll
  for (int k = 0; k < kStatePer; ++k) {
    const int e = int(threadIdx.x) + k * kThreads;
    if (e >= kStateEntries) continue;
    rs[e] = st_lse[k] * kLog2e;
    rs[kStateEntries + e] = st_gate[k];
    rs[2 * kStateEntries + e] = st_dg[k];
  }
  __syncthreads();  // the rows' state, for every thread's stage switches
  ml.start(maps);  // sm_90a with TMA: the K/V tiles' mbarriers; Q and dO landed

  // The key tiles of the compressed and window branches as one sequence. The selection branch
  // is slc_dq_kernel's (slc_dq.cuh): here it is a stage without tiles, whose dg (pass 1) is 0
  // until that kernel writes it.
  const int nc = int(visible_cmp_blocks(t_last, a.l, a.d));
  const int n_cmp = (nc + kKeys - 1) / kKeys;
  const int p0 = int(window_start(t_first, a.w));
  const int n_win = a.w > 0 ? (t_last - p0 + kKeys) / kKeys : 0;
  const int n_tiles = n_cmp + n_slc + n_win;
  const int64_t crow0 = cmp_row_offset(s0, a.d);  // (a 64-bit division: once, not per tile)
  const DqKeyTiles<E, DQK, DV> tiles{qb, s0, hk, len, t_last, nc, n_cmp, n_slc, n_win, n_tiles, p0, crow0,
                                     slc_blocks, slc_tokens};
  // Stages of a sweep: the branches in index order (kCmp = 0, kSlc = 1, kWin = 2).
  auto branch_at = [&](int stage) { return stage; };

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
  // Per-branch state of the two rows: lse in log2 units, sg = scale gate and sd = scale D with
  // D = gate dg (pass 2's dS = scale P (gate dP - D) = P (sg dP - sd): one FFMA and one FMUL per
  // score), visible positions [lo, hi]. From the rows' state in shared memory (rs, above; dg there
  // is pass 1's, or the forward's with a.dg_ready).
  float lse2[2], sg[2], sd[2];
  int lo[2], hi[2];
  int cur_branch = kCmp;  // the branch of set_branch's state
  auto set_branch = [&](int branch, bool with_dg) {
    cur_branch = branch;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lse2[h] = sg[h] = sd[h] = 0.f;
      lo[h] = 0;
      hi[h] = -1;  // a padding row sees nothing
      if (rtok[h] < 0) continue;
      const int e = branch * kRows + row0 + group + 8 * h;
      lse2[h] = rs[e];
      const float gate = rs[kStateEntries + e];
      sg[h] = a.scale * gate;
      if (with_dg) sd[h] = a.scale * (gate * rs[2 * kStateEntries + e]);
      lo[h] = branch == kWin ? rt[h] - a.w + 1 : INT32_MIN;
      hi[h] = rt[h];
    }
  };
  // Which of the thread's rows see keys of tile kt (chose), and whether any does: a warp with
  // nothing to do (a window tile before its rows' windows, a compressed tile after them) skips
  // the tile (mma.sync).
  bool chose[2];
  auto choose = [&](const KeyTile& kt) {
    const int first = kt.kp0, last = kt.kp0 + (kt.nk - 1) * kt.kstep;
    bool any = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      chose[h] = kt.nk > 0 && rtok[h] >= 0 && hi[h] >= first && lo[h] <= last && ((kt.tokens >> rbit[h]) & 1ull);
      any |= chose[h];
    }
    return any;
  };
  // wgmma: whether any row of the CTA sees keys of tile kt (the warpgroup multiplies together):
  // its rows are every head of tokens t_first..t_last, so some row sees a key at position p when
  // p <= t_last and (window) p >= t_first - w + 1; from the tile's first and last key, no barrier.
  auto cta_sees = [&](const KeyTile& kt) {
    const int first = kt.kp0, last = kt.kp0 + (kt.nk - 1) * kt.kstep;
    return kt.nk > 0 && first <= t_last && (cur_branch != kWin || last >= t_first - a.w + 1);
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
  // <dO, x> of the thread's row h, summed over the quad: x2(nt) gives the thread's column pair
  // 8 nt + 2 quad, + 1 of x; dO from the tile in shared memory.
  auto row_dot_do = [&](int h, auto&& x2) {
    const int r = row0 + group + 8 * h;
    float part = 0.f;
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt) {
      const E* d = ml.do_pair(r, quad, nt);  // dO[r][8 nt + 2 quad .. + 1]
      const float2 x = x2(nt);
      part += x.x * to_float(d[0]) + x.y * to_float(d[1]);
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);
    return part;
  };
  // <dO, m[row]> of the thread's row h from a [T, Hq, Dv] output m (0 for a padding row).
  auto row_dot_output = [&](int h, const Mat3& m) {
    const bool row = rtok[h] >= 0;
    const E* orow = static_cast<const E*>(m.p) + int64_t(row ? rtok[h] : 0) * m.s0 + int64_t(rhead[h]) * m.s1 + 2 * quad;
    return row_dot_do(h, [&](int nt) {
      return row ? make_float2(to_float(orow[8 * nt]), to_float(orow[8 * nt + 1])) : make_float2(0.f, 0.f);
    });
  };
  // dg of the thread's row h (the quad's sum) into dg32, dg and the rows' state (pass 2's D).
  auto write_dg = [&](int h, int branch, float part) {
    if (quad == 0 && rtok[h] >= 0) {
      const int64_t tok = rtok[h];
      a.dg32[(tok * a.hq + rhead[h]) * 3 + branch] = part;
      static_cast<E*>(a.dg.p)[tok * a.dg.s0 + rhead[h] * a.dg.s1 + branch] = from_float<E>(part);
      rs[2 * kStateEntries + branch * kRows + row0 + group + 8 * h] = part;
    }
  };

  // ---- pass 1: each branch's output o_b = P V from the saved lse, then dg_b = <dO, o_b>
  // (skipped when the forward's o_branch gave dg already: a.dg_ready is the same for every block;
  // with the forward's o_cmp (a.dg_cmp_ready) the compressed branch's dg is <dO, o_cmp>, written
  // on entering the first stage (dO has landed there), and its tiles are left out, and likewise
  // the window's with o_win (a.dg_win_ready); with a.d_from_o without the selection's union
  // tiles, whose D pass 2 takes from o. With all three the sweep takes no tile.)
  // Where pass 1 takes no tile, pass 2's first tile is sent now (sm_90a with TMA: ml.prime), under
  // pass 1's dot products with the saved outputs.
  if (a.dg_ready || tiles.runs(a.dg_cmp_ready, a.d_from_o, a.dg_win_ready) == 0) ml.prime(a, tiles);
  float acc_o[DV / 8][4];
  zero(acc_o);
  if (!a.dg_ready) ml.sweep(
      a, tiles, /*skip_cmp=*/a.dg_cmp_ready, /*skip_slc=*/a.d_from_o, /*skip_win=*/a.dg_win_ready, choose,
      cta_sees, [&](int prev, int next) {
        if (prev < 0 && (a.dg_cmp_ready || a.dg_win_ready)) {
          // Both saved outputs' dot products before any store: their loads go out together.
          float dot_cmp[2], dot_win[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            dot_cmp[h] = a.dg_cmp_ready ? row_dot_output(h, a.o_cmp) : 0.f;
            dot_win[h] = a.dg_win_ready ? row_dot_output(h, a.o_win) : 0.f;
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (a.dg_cmp_ready) write_dg(h, kCmp, dot_cmp[h]);
            if (a.dg_win_ready) write_dg(h, kWin, dot_win[h]);
          }
        }
        if (prev >= 0 && !(prev == kCmp && a.dg_cmp_ready) && !(prev == kWin && a.dg_win_ready)) {
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
        ml.output_products(acc_o, row0, tk, tv, kt, c0, probabilities, probabilities_wg);
      });
  __syncthreads();  // dg of this tile's rows is written (the rows' state, read back by pass 2's switches)

  // ---- pass 2: dQ = scale * sum_b dS_b K_b, summed in registers over the three branches
  float acc_q[DQK / 8][4];
  zero(acc_q);
  // With a.d_from_o, the union tiles' selection stage (skipped by pass 1): D = g_slc <dO, o_slc> =
  // <dO, o> - g_cmp dg_cmp - g_win dg_win (pass 1 wrote those two), and dg_slc = sum_j P_j dP_j
  // summed here (dg_acc), as slc_dq_kernel does for the other tiles.
  const bool slc_from_o = a.d_from_o && n_slc > 0;
  float dg_acc[2] = {0.f, 0.f};
  // P (in s) and dP -> dS = P (sg dP - sd) = scale P (gate dP - D), in s; acc_dg (the union
  // tiles' selection stage with a.d_from_o): dg_slc = sum_j P_j dP_j into dg_acc as well. acc_dg
  // is a std::bool_constant: as a run-time flag the sums were made on every tile and dropped by a
  // select (32 FFMAs a tile and thread).
  auto dscores = [&](auto& s, const auto& dp, auto acc_dg) {
    constexpr int kN = int(std::extent_v<std::remove_reference_t<decltype(s)>>);
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (decltype(acc_dg)::value) dg_acc[e >> 1] += s[nt][e] * dp[nt][e];
        s[nt][e] *= fmaf(sg[e >> 1], dp[nt][e], -sd[e >> 1]);
      }
  };
  ml.template sweep</*kOverlap=*/true>(a, tiles, /*skip_cmp=*/false, /*skip_slc=*/false, /*skip_win=*/false, choose, cta_sees,
           [&](int prev, int next) {
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
              const float dot = row_dot_output(h, a.o);
              if (rtok[h] >= 0) sd[h] = a.scale * slc_d_from_o<E>(a, rtok[h], rhead[h], dot);
            }
        },
        [&](const E* tk, const E* tv, const KeyTile& kt, int c0) {
          ml.dq_products(acc_q, row0, tk, tv, kt, c0, probabilities, probabilities_wg, dscores,
                         slc_from_o && cur_branch == kSlc);
        });
  ml.drain(acc_q);
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

}  // namespace nsa::cuda::bwd
