// The query splits of the CUDA backward's compressed dK/dV (src/cuda/tile_sizes.h), checked
// on the host over many shapes: the splits partition the queries, the last split sees every block,
// and every block an earlier split's queries see has a row in that split's partial (the kernel
// writes only those rows and the reduction reads only those).
#include <gtest/gtest.h>

#include <cstdint>

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

}  // namespace
}  // namespace nsa::test
