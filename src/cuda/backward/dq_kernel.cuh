// dq_kernel: the backward's query-centric kernel (tile.cuh has the overview): per row tile, dg and
// the summed dQ of the compressed and window branches (and on sm_90a the selection of row tiles
// whose blocks have a small union). Its sm_90a products: dq_wgmma.cuh.
#pragma once

#include "cuda/backward/tile.cuh"
#include "cuda/backward/dq_wgmma.cuh"

namespace nsa::cuda::bwd {

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

}  // namespace nsa::cuda::bwd
