// Switches for the GPU tests: host code, header only, no CUDA headers (the tests include it from
// C++). Each is one value per program: Switch<Tag, ...>::value()'s static is shared by every
// translation unit that uses it.
#pragma once

#include <atomic>

namespace nsa::cuda::testing {

template <typename Tag, typename T, T kDefault>
struct Switch {
  static std::atomic<T>& value() {
    static std::atomic<T> v{kDefault};
    return v;
  }
  static void set(T x) { value().store(x); }
  static T get() { return value().load(std::memory_order_relaxed); }
};

using TmaEnabled = Switch<struct TmaEnabledTag, bool, true>;

// While false, make_tensor_map_3d (common/tma.h) fails, so every kernel that copies by TMA takes
// the path it takes where a tensor map cannot be encoded (cp.async copies). The GPU tests run those
// paths with it: the backend's 16-byte row alignment means they are otherwise not reached on
// sm_90a. True by default; not to be changed while a call is running.
inline void set_tma_enabled(bool on) { TmaEnabled::set(on); }
inline bool tma_enabled() { return TmaEnabled::get(); }

using SlcUnionTiles = Switch<struct SlcUnionTilesTag, bool, true>;

// While false, the selection runs its per-token kernel on every tile (slc_attention.cuh), and the
// backward its slc_dq_kernel (backward/slc_dq.cuh) instead of dq_kernel's union tiles, so the GPU
// tests check both paths on the same inputs: with the small sequences of the tests every tile's
// union fits the union tiles. True by default.
inline void set_slc_union_tiles_enabled(bool on) { SlcUnionTiles::set(on); }
inline bool slc_union_tiles_enabled() { return SlcUnionTiles::get(); }

using SlcUnionCtas = Switch<struct SlcUnionCtasTag, int, 0>;

// The persistent grid of the selection's union-tile kernel: at most `ctas` CTAs (0: as many as
// fit on the GPU at once, the default). With 1, one CTA runs every listed tile in turn, so the
// tests reach the path that sets a CTA's ring up again for its next tile.
inline void set_slc_union_ctas(int ctas) { SlcUnionCtas::set(ctas); }
inline int slc_union_ctas() { return SlcUnionCtas::get(); }

using CmpSplits = Switch<struct CmpSplitsTag, int, 0>;

// The backward's query splits of the compressed dK/dV (backward/cmp_split.h): `splits` (at most
// kMaxCmpSplits = 16) instead of cmp_splits_for's rule (0, the default). The rule gives 8 or 16
// splits only from 7K or 15K tokens at G >= 8, longer than the GPU tests' sequences; with this the
// tests run 16 splits on short ones (a few tokens per split, many splits that see no compressed
// block), also for packed batches, whose earlier splits keep every row. It sets the workspace size
// and the call alike: not to be changed between the two.
inline void set_cmp_splits(int splits) { CmpSplits::set(splits); }
inline int cmp_splits() { return CmpSplits::get(); }

using RawPieces = Switch<struct RawPiecesTag, bool, true>;
using RawPieceTiles = Switch<struct RawPieceTilesTag, int, 0>;

// The backward's pieces of the raw blocks' long selection lists (dkv_kernel<raw>, BwdArgs::raw):
// off with set_raw_pieces_enabled(false) (no slots in the workspace: every list whole, as before
// pieces existed), and with set_raw_piece_tiles(n) > 0 every list longer than n query tiles is cut
// into pieces of at most n tiles (the rule: all raw CTAs' tiles / kRawTargetCtas, at least 32), n doubled
// until the pieces fit the workspace's slots; with n set the workspace has at least 64 slots (at
// the tests' lengths the budget gives a few). Like set_cmp_splits, both set the workspace size and
// the call alike.
inline void set_raw_pieces_enabled(bool on) { RawPieces::set(on); }
inline bool raw_pieces_enabled() { return RawPieces::get(); }
inline void set_raw_piece_tiles(int tiles) { RawPieceTiles::set(tiles); }
inline int raw_piece_tiles() { return RawPieceTiles::get(); }

using PackedSort = Switch<struct PackedSortTag, bool, true>;

// While false, the backward's inverted selection index sorts (key, token) pairs, the path it takes
// where the key and token bits do not fit in 32 (from ~256K tokens at Hkv = 4), instead of packed
// 32-bit keys. True by default; like set_cmp_splits, it sets the workspace size and the call alike.
inline void set_packed_sort_enabled(bool on) { PackedSort::set(on); }
inline bool packed_sort_enabled() { return PackedSort::get(); }

}  // namespace nsa::cuda::testing
