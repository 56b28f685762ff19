// dq_kernel's shared-memory layouts (the padded one of the sm_80 mainloop, the swizzled one of the
// sm_90a mainloop) and its tensor maps: what the launcher (launch.cuh), the kernel (dq_kernel.cuh)
// and its mainloops (dq_mainloop_sm80.cuh, dq_mainloop_sm90.cuh) agree on.
#pragma once

#include "cuda/backward/tile.cuh"
#include "cuda/backward/dq_wgmma.cuh"

namespace nsa::cuda::bwd {

template <typename E, int DQK, int DV>
struct DqSmem {
  static constexpr int kK = 0;                             // [2][kKeys][DQK + kPad], double-buffered
  static constexpr int kV = kK + 2 * tile_bytes<DQK>();    // [2][kKeys][DV + kPad]
  static constexpr int kQ = kV + 2 * tile_bytes<DV>();     // [kRows][DQK + kPad]
  static constexpr int kDo = kQ + tile_bytes<DQK>();       // [kRows][DV + kPad]
  // The rows' state per branch (both layouts): lse in log2 units, the gate and dg, each
  // [3 branches][kRows] floats (DqRowState, dq_kernel.cuh).
  static constexpr int kRowStateBytes = 3 * 3 * kRows * int(sizeof(float));
  static constexpr int kRowState = kDo + tile_bytes<DV>();
  static constexpr size_t kEnd = size_t(kRowState) + kRowStateBytes;
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
                                 cuda::kSlcUnionMax * int(2 * sizeof(int32_t) + sizeof(unsigned long long)) +
                                 kRowStateBytes;
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
  // Then the rows' state (kRowStateBytes).
  static constexpr int kSwRowState = kSwUnionEnd;
  static constexpr int kSwEnd = kSwRowState + kRowStateBytes;
  static_assert(kSwUnionMember % 8 == 0, "the token masks are 8-byte words");
  static_assert(1023 + size_t(kSwEnd) <= kEnd, "the swizzled layout fits after alignment");
  static_assert(kSwEnd == kSwBufs * kSwKv + kSwTail, "kSwTail is the layout past the K / V buffers");
  // What the launch asks for where the sm_90a body runs (runs_sm90): the swizzled layout and its
  // alignment slack only.
  static constexpr size_t kSwLaunch = 1024 + size_t(kSwEnd);
  static constexpr bool slc_union_sorts_fit(int cap) { return size_t(kWarps) * 3 * cap * sizeof(int32_t) <= size_t(kSwQ); }
};

// dq_kernel's K/V tiles by TMA on sm_90a: tensor maps of kc, vc ([rc, Hkv, D]) and of the window's
// k, v ([T, Hkv, D]), boxes of 64 rows x 64 columns in the 128-byte swizzle (common/tma.h); `on`
// = 0 where one could not be made (the kernel then copies by cp.async).
struct DqMaps {
  CUtensorMap kc, vc, kw, vw, ks, vs;  // ks, vs: the selection's k, v (union tiles)
  int on;
};

}  // namespace nsa::cuda::bwd
