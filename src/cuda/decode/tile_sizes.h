// The decode kernels' split plan: pure functions of the call's declared sizes (never of device
// data, so a CUDA graph captured once replays with the same launches), host-tested in
// tests/test_decode_tiles.cpp.
//
// Decoding attends few queries over many keys: one CTA per (query, KV head) would leave most of
// the GPU idle (batch 1: four CTAs), so each branch's keys are split over several CTAs whose
// partial results a later kernel merges in a fixed order (flash-decoding; deterministic).
#pragma once

#include <algorithm>
#include <cstdint>

#include "nsa/blocks.h"
#include "nsa/config.h"

namespace nsa::cuda::decode {

// Keys per tile of every decode loop (the MMA's 16 query rows times 64 keys).
inline constexpr int kKeyTile = 64;
// Query rows of a tile: the heads of one GQA group, padded (G <= 16).
inline constexpr int kRows = 16;
// A compressed split keeps its logits in shared memory (its exact probabilities feed the
// selection scores): 16 rows x 256 keys x (4 + 2) bytes, with two 64-key tiles of K or V, keeps a
// CTA near 64 KB, three to an SM.
inline constexpr int kMaxCmpChunk = 256;
// CTAs a split plan aims for: four per SM of an H100/H200 (132 SMs) keeps the copy engines
// busy; fewer splits when the batch alone gives that many (fewer partials to merge).
inline constexpr int64_t kTargetCtas = 528;

struct Split {
  int splits = 0, chunk = 0;  // CTAs per (query, KV head) and keys per CTA (a multiple of kKeyTile)
};

// Splits `keys` keys (0 allowed) so that items * splits approaches kTargetCtas, chunks at most max_chunk.
inline Split split_keys(int64_t keys, int64_t items, int64_t max_chunk) {
  const int64_t tiles = std::max<int64_t>((keys + kKeyTile - 1) / kKeyTile, 1);
  const int64_t want = std::clamp<int64_t>((kTargetCtas + items - 1) / std::max<int64_t>(items, 1), 1, tiles);
  const int64_t chunk = std::min<int64_t>((tiles + want - 1) / want * kKeyTile, max_chunk);
  Split s;
  s.chunk = static_cast<int>(chunk);
  s.splits = static_cast<int>(std::max<int64_t>((keys + chunk - 1) / chunk, 1));
  return s;
}

struct SplitPlan {
  Split cmp;            // compressed keys (none for dense decoding)
  int score_width = 0;  // selection blocks one compressed split touches
  int slc_per_cta = 0;  // selected blocks per CTA (a large batch gives each CTA several, pipelined)
  int slc_ctas = 0;     // CTAs of the selection per (query, KV head)
  Split win;            // window keys (dense decoding: every key); splits = 0 without a window
};

// rows: queries of the call; max_len: the declared bound on sequence lengths.
inline SplitPlan split_plan(const Config& cfg, int64_t rows, int64_t hkv, int64_t max_len, bool dense) {
  SplitPlan p;
  const int64_t items = std::max<int64_t>(rows * hkv, 1);
  if (!dense) {
    p.cmp = split_keys(num_cmp_blocks(max_len, cfg.cmp_block_len, cfg.cmp_stride), items, kMaxCmpChunk);
    // A split of compressed blocks [i0, i0 + chunk) touches selection blocks floor(i0 / r) ..
    // floor((i0 + chunk + L - 2) / r), r = l'/d stride pieces per selection block, L = l/d per
    // compressed block.
    const int64_t r = cfg.slc_block_len / cfg.cmp_stride, L = cfg.cmp_block_len / cfg.cmp_stride;
    p.score_width = static_cast<int>((p.cmp.chunk + L - 2 + r - 1) / r + 1);
    if (cfg.n_selected > 0) {
      p.slc_per_cta = static_cast<int>(std::clamp<int64_t>((items * cfg.n_selected + kTargetCtas - 1) / kTargetCtas, 1,
                                                           cfg.n_selected));
      p.slc_ctas = static_cast<int>((cfg.n_selected + p.slc_per_cta - 1) / p.slc_per_cta);
    }
  }
  const int64_t win_keys = dense ? max_len : std::min<int64_t>(cfg.window, max_len);
  if (win_keys > 0) p.win = split_keys(win_keys, items, INT32_MAX / 2);
  return p;
}

}  // namespace nsa::cuda::decode
