// dkv_kernel's shared-memory layouts (the padded one of the sm_80 mainloop, the swizzled one of the
// sm_90a mainloop), its query tiles' row table (RowTile) and its tensor maps: what the launcher
// (launch.cuh), the kernel (dkv_kernel.cuh) and its mainloops (dkv_mainloop_sm80.cuh,
// dkv_mainloop_sm90.cuh) agree on.
#pragma once

#include "cuda/backward/tile.cuh"
#include "cuda/backward/dq_wgmma.cuh"

namespace nsa::cuda::bwd {

enum class KeySet : int { raw = 0, cmp = 1 };

// One query tile of the key-centric kernel (one per pipeline buffer).
struct RowTile {
  const void* q[kRows];   // the row's Q and dO (nullptr: padding row, zero-filled)
  const void* dO[kRows];
  float4 st[kRows];   // (lse * log2 e, gate, scale * dg, unused) of the current branch
  int2 vis[kRows];    // visible key positions [lo, hi]; hi = -1 for a padding row
};

// What dkv_kernel's prefetch copies ahead by cp.async for the query tiles to come (the
// pipeline's stages): the selection lists' tokens four tiles ahead (tile i's in tok[i %
// kTokenSlots]), each row's lse, gate and dg of its branch two tiles ahead (tile i's in slot
// i % kMetaSlots).
constexpr int kTokenSlots = 8;
constexpr int kMetaSlots = 4;
struct TileRing {
  int32_t tok[kTokenSlots][kRows];
  float lse[kMetaSlots][kRows];
  float g[kMetaSlots][kRows];
  float dg[kMetaSlots][kRows];
};

template <typename E, int DQK, int DV>
struct DkvSmem {
  static constexpr int kK = 0;                             // [kKeys][DQK + kPad], resident
  static constexpr int kV = kK + tile_bytes<DQK>();        // [kKeys][DV + kPad]
  static constexpr int kQ = kV + tile_bytes<DV>();         // [2][kRows][DQK + kPad], double-buffered
  static constexpr int kDo = kQ + 2 * tile_bytes<DQK>();   // [2][kRows][DV + kPad]
  static constexpr int kRi = kDo + 2 * tile_bytes<DV>();   // [2] RowTile
  static constexpr int kRing = kRi + 2 * int(sizeof(RowTile));  // TileRing
  static constexpr int kPaddedEnd = kRing + int(sizeof(TileRing));
  static_assert(kRi % 16 == 0, "RowTile holds float4");
  // sm_90a (wgmma): the same tiles unpadded in the 128-byte swizzle layout (common/wgmma.h), from
  // a 1024-byte boundary of the dynamic shared memory (the host adds 1024 bytes of slack).
  // Q / dO buffers of the swizzled layout: two where two CTAs of that size still fit an SM, else
  // one (Dqk 192 / Dv 128: two make 129 KB, 134 KB with the padded layout's size that the launch
  // asked for before `b4155de`: one CTA per SM, dkv_kernel 1.8-2.25x its Dqk 128 time at 64K; one
  // makes 88 KB, two CTAs per SM). The RowTiles stay two (prefetch fills
  // the next one). kSwQdo: one Q and one dO buffer; kSwFixed: the rest (K, V, RowTiles, the tile
  // ring, mbarriers; static_assert below).
  static constexpr int kSwQdo = kRows * (DQK + DV) * 2;
  static constexpr int kSwFixed = kKeys * (DQK + DV) * 2 + 2 * int(sizeof(RowTile)) + int(sizeof(TileRing)) +
                                  2 * int(sizeof(uint64_t));
  static constexpr int kSwBufs = two_ctas_fit_sm90(1024 + size_t(2 * kSwQdo + kSwFixed)) ? 2 : 1;
  static constexpr int kSwK = 0;                                    // [kKeys][DQK], resident
  static constexpr int kSwV = kSwK + kKeys * DQK * 2;               // [kKeys][DV]
  static constexpr int kSwQ = kSwV + kKeys * DV * 2;                // [kSwBufs][kRows][DQK]
  static constexpr int kSwDo = kSwQ + kSwBufs * kRows * DQK * 2;    // [kSwBufs][kRows][DV]
  static constexpr int kSwRi = kSwDo + kSwBufs * kRows * DV * 2;    // [2] RowTile
  static constexpr int kSwRing = kSwRi + 2 * int(sizeof(RowTile));  // TileRing
  static constexpr int kSwBars = kSwRing + int(sizeof(TileRing));   // [2] mbarriers (Q / dO by TMA)
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
  // dkv_ws_kernel at G >= 8: boxes of one token x G heads (G rows, at least one 1024-byte swizzle
  // atom) for the selection's gathered query tiles, a box per token; `list` = 0 elsewhere.
  CUtensorMap q1, d_o1;
  int list;
};

}  // namespace nsa::cuda::bwd
