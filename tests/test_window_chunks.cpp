// The sm_90a window's chunk rule (src/cuda/tile_sizes.h: win_chunk_keys), checked on the host: the
// chunk it picks has the lower modelled cost (chunks x (keys + kWinChunkCostKeys) over a whole
// tile's span, 64 on a tie), a forced 64 or 112 wins where the long chunk is compiled, and 64 is
// kept where it is not (Dqk or Dv above 128), without a window, and for forced values it does not
// know.
#include <gtest/gtest.h>

#include "cuda/tile_sizes.h"

namespace nsa::test {
namespace {

using cuda::kWgRows;
using cuda::kWinChunk;
using cuda::kWinChunkCostKeys;
using cuda::kWinLongChunk;
using cuda::win_chunk_keys;

// A tile's cost in chunks of `chunk` keys, counted one chunk at a time.
int cost_by_walking(int span, int chunk) {
  int cost = 0;
  for (int first = 0; first < span; first += chunk) cost += chunk + kWinChunkCostKeys;
  return cost;
}

TEST(WindowChunks, TheRulePicksTheCheaperChunk) {
  int long_picks = 0, checked = 0;
  for (int group : {1, 2, 4, 8, 16})
    for (int w = 1; w <= 2048; ++w) {
      const int span = w - 1 + kWgRows / group;
      const int c64 = cost_by_walking(span, kWinChunk), c112 = cost_by_walking(span, kWinLongChunk);
      const int want = c112 < c64 ? kWinLongChunk : kWinChunk;
      ASSERT_EQ(win_chunk_keys(w, group, 128, 128), want) << "w " << w << " G " << group;
      long_picks += want == kWinLongChunk;
      ++checked;
    }
  EXPECT_GT(long_picks, 0);
  EXPECT_LT(long_picks, checked);
  // The paper's window: five 112-key chunks a tile at G = 16 (523 keys), where 64-key chunks take nine.
  EXPECT_EQ(win_chunk_keys(512, 16, 128, 128), kWinLongChunk);
  EXPECT_EQ(win_chunk_keys(512, 1, 128, 128), kWinChunk);
}

TEST(WindowChunks, ForcedWhereCompiledElse64) {
  for (int dqk : {64, 128, 192})
    for (int dv : {64, 128}) {
      const bool compiled = dqk <= 128 && dv <= 128;
      for (int forced : {kWinChunk, kWinLongChunk}) {
        EXPECT_EQ(win_chunk_keys(512, 1, dqk, dv, forced), compiled ? forced : kWinChunk);
        EXPECT_EQ(win_chunk_keys(512, 16, dqk, dv, forced), compiled ? forced : kWinChunk);
      }
      if (!compiled) EXPECT_EQ(win_chunk_keys(512, 16, dqk, dv), kWinChunk) << "Dqk " << dqk << " Dv " << dv;
    }
  EXPECT_EQ(win_chunk_keys(0, 16, 128, 128, kWinLongChunk), kWinChunk) << "no window";
  for (int unknown : {1, 96, 128, -5})  // not a chunk the kernel has: the rule's
    EXPECT_EQ(win_chunk_keys(512, 16, 128, 128, unknown), win_chunk_keys(512, 16, 128, 128));
}

}  // namespace
}  // namespace nsa::test
