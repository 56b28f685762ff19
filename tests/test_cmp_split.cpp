// The query splits of the CUDA backward's compressed dK/dV (src/cuda/tile_sizes.h), checked
// on the host over many shapes: the splits partition the queries, the last split sees every block,
// and every block an earlier split's queries see has a row in that split's partial (the kernel
// writes only those rows and the reduction reads only those).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/tile_sizes.h"
#include "nsa/blocks.h"

namespace nsa::test {
namespace {

using cuda::bwd::cmp_split_of;
using cuda::bwd::cmp_split_rows;
using cuda::bwd::kMaxCmpSplits;

TEST(CmpSplit, PartitionTheQueriesAndCoverWhatEachSplitSees) {
  int checked = 0;
  for (int64_t l : {1, 8, 32, 64})
    for (int64_t d : {1, 4, 16, 32}) {
      if (d > l) continue;
      for (int splits = 1; splits <= kMaxCmpSplits; ++splits)
        for (int64_t len : {int64_t(0), int64_t(1), int64_t(2), int64_t(3), l - 1, l, l + 1, int64_t(97), int64_t(1000),
                            int64_t(1023), int64_t(1024), int64_t(4099), int64_t(65536)}) {
          if (len < 0) continue;
          const auto cs = cmp_split_of(len, splits);
          const int64_t nc = num_cmp_blocks(len, l, d);
          if (len == 0) {
            EXPECT_EQ(cs.last, 0);
            continue;
          }
          ASSERT_GE(cs.S, 1);
          ASSERT_GE(cs.last, 0);
          ASSERT_LT(cs.last, splits) << "len " << len << " splits " << splits;
          // The last split holds position len - 1; every split before it is non-empty and whole.
          EXPECT_LE(int64_t(cs.last) * cs.S, len - 1);
          EXPECT_GT(int64_t(cs.last + 1) * cs.S, len - 1);
          int64_t prev_rows = 0;
          for (int z = 0; z < cs.last; ++z) {
            const int64_t q0 = z * cs.S, q1 = (z + 1) * cs.S;  // the split's queries [q0, q1)
            ASSERT_LE(q1, len);
            const int64_t rows = cmp_split_rows(len, z, cs, l, d);
            EXPECT_GE(rows, prev_rows) << "rows grow with the split";
            EXPECT_LE(rows, nc);
            prev_rows = rows;
            for (int64_t i = 0; i < nc; ++i) {
              const int64_t first_viewer = i * d + l - 1;  // the block's last token
              const bool seen = first_viewer < q1 && len > q0;  // some t in [q0, q1) has t >= first_viewer
              if (seen) EXPECT_LT(i, rows) << "block " << i << " seen by split " << z << " has no partial row";
              // a row is kept only for a block the split can see (else its partial is all zero
              // and the reduction would read a row no block wrote)
              if (i < rows) EXPECT_TRUE(seen) << "block " << i << " has a row in split " << z << " but is not seen";
            }
          }
          // The last split's queries [last S, len) end at len - 1, which sees every block.
          for (int64_t i = 0; i < nc; ++i) EXPECT_LE(i * d + l - 1, len - 1);
          ++checked;
        }
    }
  EXPECT_GT(checked, 500);
}

TEST(CmpSplit, OneSequenceOf64KKeepsAboutOneAndAHalfCopiesOfTheRows) {
  // The paper's blocks at 64K tokens and 4 splits: partial rows 1023 + 2047 + 3071 of 4095 blocks.
  const int64_t len = 65536, l = 32, d = 16;
  const auto cs = cmp_split_of(len, 4);
  EXPECT_EQ(cs.S, 16384);
  EXPECT_EQ(cs.last, 3);
  int64_t rows = 0;
  for (int z = 0; z < cs.last; ++z) rows += cmp_split_rows(len, z, cs, l, d);
  EXPECT_EQ(rows, 1023 + 2047 + 3071);
  EXPECT_EQ(num_cmp_blocks(len, l, d), 4095);
}

TEST(CmpSplit, SplitsFollowTheLongestSequenceAndTheGroup) {
  using cuda::bwd::cmp_splits_for;
  EXPECT_EQ(cmp_splits_for(0, 16), 1);
  EXPECT_EQ(cmp_splits_for(1, 16), 1);
  EXPECT_EQ(cmp_splits_for(1024, 16), 1);
  EXPECT_EQ(cmp_splits_for(1025, 16), 2);
  EXPECT_EQ(cmp_splits_for(6500, 16), 7);
  EXPECT_EQ(cmp_splits_for(65536, 16), 16);
  EXPECT_EQ(cmp_splits_for(65536, 16, 2), 8);  // packed: every earlier split keeps all rows
  EXPECT_EQ(cmp_splits_for(65536, 8), 8);
  EXPECT_EQ(cmp_splits_for(65536, 4), 4);  // the partials' bytes against q, k, v and o at small G
  EXPECT_EQ(cmp_splits_for(65536, 1), 4);
  EXPECT_EQ(cmp_splits_for(3000, 4), 3);
  for (int64_t len = 0; len < 20000; len += 97)
    for (int64_t g : {1, 2, 4, 8, 16}) {
      const int s = cmp_splits_for(len, g);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, kMaxCmpSplits);
    }
}


// The schedule model of one sequence's splits (cmp_splits_balanced), against direct counts: each
// CTA's query tiles from its tokens one by one, the schedule by a plain scan for the first place
// to free up, and the pick against every count's time.
int64_t tokens_of_cta(int64_t len, int splits, int z, int64_t x, int64_t l, int64_t d) {
  const auto cs = cmp_split_of(len, splits);
  int64_t n = 0;
  for (int64_t t = 0; t < len; ++t) {
    const int zt = int(t / cs.S);  // the split holding token t
    if (zt != z) continue;
    if (t >= x * 64 * d + l - 1) ++n;  // t sees the tile's first block
  }
  return n;
}

int64_t scan_makespan(int64_t len, int splits, int64_t group, int64_t hkv, int64_t l, int64_t d, int slots) {
  const int64_t tq = 64 / group, tiles = (num_cmp_blocks(len, l, d) + 63) / 64;
  std::vector<int64_t> at(size_t(slots), 0);
  for (int z = splits - 1; z >= 0; --z)
    for (int64_t y = 0; y < hkv; ++y)
      for (int64_t x = 0; x < tiles; ++x) {
        const int64_t tok = tokens_of_cta(len, splits, z, x, l, d);
        if (tok == 0) continue;
        size_t first = 0;
        for (size_t i = 1; i < at.size(); ++i)
          if (at[i] < at[first]) first = i;
        at[first] += (tok + tq - 1) / tq + cuda::bwd::kCmpCtaFixedTiles;
      }
  return *std::max_element(at.begin(), at.end());
}

TEST(CmpSplit, TheScheduleModelCountsEachCtaAndPlacesItOnTheFirstFreePlace) {
  using cuda::bwd::cmp_cta_query_tiles;
  using cuda::bwd::cmp_split_makespan;
  int checked = 0;
  for (int64_t len : {1, 31, 32, 100, 1024, 1500, 3000, 4097})
    for (int splits : {1, 2, 3, 7, 16})
      for (int64_t group : {1, 4, 16}) {
        const int64_t l = 32, d = 16, tq = 64 / group;
        const auto cs = cmp_split_of(len, splits);
        const int64_t tiles = (num_cmp_blocks(len, l, d) + 63) / 64;
        for (int z = 0; z < splits; ++z)
          for (int64_t x = 0; x < tiles; ++x) {
            const int64_t tok = tokens_of_cta(len, splits, z, x, l, d);
            ASSERT_EQ(cmp_cta_query_tiles(len, cs, z, x, l, d, tq), (tok + tq - 1) / tq)
                << "len " << len << " splits " << splits << " z " << z << " x " << x;
          }
        for (int slots : {1, 3, 132})
          ASSERT_EQ(cmp_split_makespan(len, splits, group, 2, l, d, slots),
                    scan_makespan(len, splits, group, 2, l, d, slots))
              << "len " << len << " splits " << splits << " G " << group << " slots " << slots;
        EXPECT_EQ(cuda::bwd::cmp_split_part_rows(len, splits, l, d), [&] {
          int64_t r = 0;
          for (int z = 0; z < cs.last; ++z) r += cmp_split_rows(len, z, cs, l, d);
          return r;
        }());
        ++checked;
      }
  EXPECT_EQ(checked, 8 * 5 * 3);
}

TEST(CmpSplit, OneSequenceTakesTheCountOfLeastModelledTime) {
  using cuda::bwd::cmp_split_makespan;
  using cuda::bwd::cmp_splits_balanced;
  using cuda::bwd::cmp_splits_cap;
  using cuda::bwd::cmp_splits_for;
  // 8K, G = 16, Hkv 4 on 132 places: 8 splits are 144 CTAs of 1024 tokens (two rounds, the second
  // of 12); 14 splits 268 CTAs of 586 tokens.
  EXPECT_EQ(cmp_splits_balanced(8192, 16, 4, 32, 16, 132), 14);
  EXPECT_LT(cmp_split_makespan(8192, 14, 16, 4, 32, 16, 132), cmp_split_makespan(8192, 8, 16, 4, 32, 16, 132) * 2 / 3);
  // Many rounds of CTAs at the cap: cmp_splits_for's count, unmodelled.
  EXPECT_EQ(cmp_splits_balanced(65536, 16, 4, 32, 16, 132), 16);
  EXPECT_EQ(cmp_splits_balanced(65536, 4, 4, 32, 16, 132), 4);
  // Places not known: cmp_splits_for.
  EXPECT_EQ(cmp_splits_balanced(8192, 16, 4, 32, 16, 0), cmp_splits_for(8192, 16));
  int modelled = 0;
  for (int64_t len : {0, 1, 100, 1025, 2048, 4096, 6000, 8192, 12000, 16384})
    for (int64_t group : {1, 2, 4, 8, 16})
      for (int64_t hkv : {1, 4, 8})
        for (int slots : {108, 132}) {
          const int s = cmp_splits_balanced(len, group, hkv, 32, 16, slots);
          const int cap = cmp_splits_cap(group);
          ASSERT_GE(s, 1);
          ASSERT_LE(s, cap);
          if (len == 0) continue;
          // Where it modelled: no count up to the cap is faster, and none fewer is as fast.
          const int64_t t = cmp_split_makespan(len, s, group, hkv, 32, 16, slots);
          bool is_pick = true;
          for (int o = 1; o <= cap; ++o) {
            const int64_t to = cmp_split_makespan(len, o, group, hkv, 32, 16, slots);
            if (to < t || (to == t && o < s)) is_pick = false;
          }
          if (is_pick) ++modelled;
          else
            EXPECT_EQ(s, cmp_splits_for(len, group)) << "len " << len << " G " << group << " Hkv " << hkv << " slots "
                                                      << slots << ": neither the pick nor the rule";
          // Asked again (the kept answers): the same.
          EXPECT_EQ(cmp_splits_balanced(len, group, hkv, 32, 16, slots), s);
        }
  EXPECT_GT(modelled, 200);
}

}  // namespace
}  // namespace nsa::test
