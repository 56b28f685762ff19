// The shared-memory tiles of phi's wgmma products (gemm_direct.cuh's WgTile), on the host (no GPU):
// for every element a k16 product reads, the address its descriptor gives that element under the
// PTX ISA's canonical 128-byte-swizzle layouts is the address the copies write it to
// (WgTile::offset). A K-major operand (A or B whose contiguous index is k) and an MN-major one (its
// contiguous index is its row or column index), each as A (a warpgroup's 64 rows from 0 and from
// 64) and as B (all 128 columns).
#include <gtest/gtest.h>

#include <cstdint>
#include <set>

#include "cuda/phi/gemm_direct.cuh"

namespace {

using nsa::cuda::phi::kWgK;
using nsa::cuda::phi::WgTile;

struct Desc {
  uint32_t start, lbo, sbo;
  int swizzle;
};
Desc decode(uint64_t d) {
  return Desc{uint32_t(d & 0x3FFF) << 4, uint32_t((d >> 16) & 0x3FFF) << 4, uint32_t((d >> 32) & 0x3FFF) << 4,
              int(d >> 62)};
}
// The 128-byte swizzle of a byte address inside 1024-byte-aligned tiles: address bits 4-6 (the
// 16-byte piece of a 128-byte row) XOR bits 7-9 (the row within 8).
uint32_t swizzled(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }
// Canonical layouts of a k16 operand, element (r, k) (r: its row of A or column of B, k < 16), 16-bit
// elements. K-major: groups of 8 rows SBO apart, a row 128 bytes, k in 16-byte pieces along it.
// MN-major: groups of 64 r LBO apart, groups of 8 k SBO apart, a k 128 bytes, r in 16-byte pieces.
uint32_t k_major(const Desc& d, int r, int k) {
  return swizzled(d.start + uint32_t(r / 8) * d.sbo + uint32_t(r % 8) * 128 + uint32_t(k / 8) * 16) + uint32_t(k % 8) * 2;
}
uint32_t mn_major(const Desc& d, int r, int k) {
  return swizzled(d.start + uint32_t(r / 64) * d.lbo + uint32_t(k / 8) * d.sbo + uint32_t(k % 8) * 128 +
                  uint32_t((r % 64) / 8) * 16) +
         uint32_t(r % 8) * 2;
}

// Every element of `count` rows from i0, over a step's four k16 products, in a tile at a 1024-byte
// boundary: where the descriptor reads it is where the copy wrote it.
template <bool kT, int kRows>
void check_tile(int i0, int count) {
  using Tile = WgTile<kT, kRows>;
  const uint32_t tile = 3 * 1024;  // any 1024-byte boundary
  std::set<uint32_t> seen;
  for (int kk = 0; kk < kWgK / 16; ++kk) {
    const Desc d = decode(Tile::desc(tile, i0, kk));
    ASSERT_EQ(d.swizzle, 1) << "128-byte swizzle";
    for (int r = 0; r < count; ++r)
      for (int k = 0; k < 16; ++k) {
        const int i = i0 + r, kt = 16 * kk + k;
        const uint32_t written = tile + (kT ? Tile::offset(i & ~7, kt) + uint32_t(i & 7) * 2
                                            : Tile::offset(i, kt & ~7) + uint32_t(kt & 7) * 2);
        const uint32_t read = kT ? mn_major(d, r, k) : k_major(d, r, k);
        ASSERT_EQ(read, written) << "index " << i << ", k " << kt << " (k16 step " << kk << ")";
        ASSERT_LT(written - tile, uint32_t(Tile::kBytes));
        seen.insert(written);
      }
  }
  EXPECT_EQ(seen.size(), size_t(count) * kWgK) << "distinct addresses";
}

TEST(CudaWgmmaLayout, KMajorTilesAreWhatTheDescriptorsRead) {
  check_tile<false, 128>(0, 64);    // A, warpgroup 0
  check_tile<false, 128>(64, 64);   // A, warpgroup 1
  check_tile<false, 128>(0, 128);   // B, n = 128
}

TEST(CudaWgmmaLayout, MnMajorTilesAreWhatTheDescriptorsRead) {
  check_tile<true, 128>(0, 64);
  check_tile<true, 128>(64, 64);
  check_tile<true, 128>(0, 128);
}

}  // namespace
