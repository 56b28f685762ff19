// The CUDA decode's split plan (src/cuda/tile_sizes.h), checked on the host over many
// shapes: the splits cover every key, chunks are whole tiles within the shared-memory bound, the
// partial-score window of every compressed split holds every selection block its blocks touch,
// and the plan aims at the target CTA count without more splits than tiles.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/tile_sizes.h"
#include "nsa/blocks.h"

namespace nsa::test {
namespace {

using cuda::decode::kKeyTile;
using cuda::decode::kMaxCmpChunk;
using cuda::decode::kTargetCtas;
using cuda::decode::split_keys;
using cuda::decode::split_plan;

TEST(DecodeSplits, CoverEveryKeyInWholeTiles) {
  int checked = 0;
  for (int64_t keys : {0, 1, 63, 64, 65, 500, 4096, 8191, 65536, 1 << 20})
    for (int64_t items : {1, 4, 7, 64, 256, 528, 4096})
      for (int64_t max_chunk : {int64_t(kMaxCmpChunk), int64_t(1) << 30}) {
        const auto s = split_keys(keys, items, max_chunk);
        ASSERT_GE(s.splits, 1);
        ASSERT_EQ(s.chunk % kKeyTile, 0);
        ASSERT_LE(s.chunk, max_chunk);
        ASSERT_GE(int64_t(s.splits) * s.chunk, keys) << "keys " << keys;
        ASSERT_LT(int64_t(s.splits - 1) * s.chunk, std::max<int64_t>(keys, 1)) << "an empty split, keys " << keys;
        const int64_t tiles = std::max<int64_t>((keys + kKeyTile - 1) / kKeyTile, 1);
        ASSERT_LE(s.splits, tiles);
        // Far below the target only when every tile is already a split (or the chunk bound rules).
        if (s.chunk < max_chunk && 2 * items * s.splits < kTargetCtas) ASSERT_EQ(s.splits, tiles) << keys << " " << items;
        ++checked;
      }
  EXPECT_GT(checked, 100);
}

TEST(DecodeSplits, ScoreWindowHoldsEveryTouchedBlock) {
  int checked = 0;
  for (int64_t l : {8, 16, 32, 64})
    for (int64_t d : {4, 8, 16})
      for (int64_t lp : {16, 32, 64, 128}) {
        if (l % d || lp % d) continue;
        Config cfg;
        cfg.cmp_block_len = l;
        cfg.cmp_stride = d;
        cfg.slc_block_len = lp;
        for (int64_t len : {100, 4096, 70000})
          for (int64_t rows : {1, 64}) {
            const auto sp = split_plan(cfg, rows, 4, len, false);
            const int64_t R = lp / d, C = num_cmp_blocks(len, l, d);
            for (int64_t s = 0; s < sp.cmp.splits; ++s) {
              const int64_t i0 = s * sp.cmp.chunk, i1 = std::min<int64_t>(i0 + sp.cmp.chunk, C);
              for (int64_t i = i0; i < i1; ++i)
                for (int64_t j = i * d / lp; j <= (i * d + l - 1) / lp; ++j) {
                  if (cmp_slc_overlap(i, j, l, d, lp) == 0) continue;
                  const int64_t jj = j - i0 / R;
                  ASSERT_GE(jj, 0);
                  ASSERT_LT(jj, sp.score_width) << "l " << l << " d " << d << " l' " << lp << " block " << i;
                }
            }
            ++checked;
          }
      }
  EXPECT_GT(checked, 50);
}

TEST(DecodeSplits, DenseHasNoCompressedSplitsAndCoversTheCache) {
  Config cfg;
  for (int64_t len : {0, 1, 8192, 131072}) {
    const auto sp = split_plan(cfg, 1, 4, len, true);
    EXPECT_EQ(sp.cmp.splits, 0);
    if (len == 0) EXPECT_EQ(sp.win.splits, 0);
    else EXPECT_GE(int64_t(sp.win.splits) * sp.win.chunk, len);
  }
  cfg.window = 0;
  EXPECT_EQ(split_plan(cfg, 1, 4, 1000, false).win.splits, 0) << "no window: no window splits";
}

}  // namespace
}  // namespace nsa::test
