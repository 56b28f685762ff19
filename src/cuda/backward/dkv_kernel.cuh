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
#pragma once

#include "cuda/backward/dq_wgmma.cuh"
#include "cuda/backward/tile.cuh"

namespace nsa::cuda::bwd {

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

}  // namespace nsa::cuda::bwd
