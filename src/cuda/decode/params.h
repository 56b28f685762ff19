// Parameters of the CUDA decode kernels (nsa/cache.h): one struct for the attend path, one for
// appending, filled by decode/launch.cu. Pointers are device memory; strides are in elements.
#pragma once

#include <cstdint>

#include "nsa/blocks.h"

namespace nsa::cuda::decode {

// One pool [P, rows_per_page, Hkv, D] (raw tokens: rows_per_page = page_size; compressed: page_size/d).
struct Pool {
  const void* data = nullptr;
  int64_t page_st = 0, row_st = 0, head_st = 0;
};

// The page table and the call's rows (appended tokens or queries), read on the device.
struct Pages {
  const int32_t* block_table = nullptr;  // [B, max_pages]
  int64_t bt_st0 = 0, bt_st1 = 0;
  const int32_t* seq_lens = nullptr;     // [B]: tokens, the call's new rows included
  int32_t* status = nullptr;             // [B]: CacheStatus bits (OR-ed)
  const int32_t* cu = nullptr;           // [B+1] rows per sequence; null: rows / B each
  int batch = 0;
  int rows = 0;                          // rows of the call
  int max_rows = 0;                      // declared most rows of one sequence
  int num_pages = 0, page_size = 0, max_pages = 0;
  int max_len = 0;                       // declared bound on seq_lens
};

// Everything the four attend kernels read and write (decode/*.cuh).
struct DecodeParams {
  Pages pages;
  const void* q = nullptr;  // [Tq, Hq, Dqk]
  int64_t q_st = 0, q_sh = 0;
  const void* g = nullptr;  // [Tq, Hq, 3]
  int64_t g_st = 0, g_sh = 0, g_sb = 0;
  Pool kc, vc;              // compressed pools
  Pool k_slc, v_slc, k_win, v_win;
  int hkv = 1, group = 1, dv = 0;
  int l = 0, d = 0, lp = 0, n_sel = 0, window = 0;
  ForcedBlocks forced;      // n_init, n_local, the backbone's offsets
  float scale_log2 = 0.f;   // softmax scale * log2(e): scores live in the log2 domain
  bool dense = false;       // dense_decode: no compressed or selection branch, the window is everything

  // Outputs (o required; the others null when not wanted).
  void* o = nullptr;        // [Tq, Hq, Dv]
  int64_t o_st = 0, o_sh = 0;
  float* lse = nullptr;     // [Tq, Hq, 3] (dense: [Tq, Hq])
  int64_t lse_st = 0, lse_sh = 0, lse_sb = 0;
  void* o_branch = nullptr; // [3, Tq, Hq, Dv]
  int64_t ob_sb = 0, ob_st = 0, ob_sh = 0;

  // The split plan (decode/tile_sizes.h) and its workspace (decode/launch.cu).
  int cmp_splits = 0, cmp_chunk = 0, score_width = 0;
  int slc_per_cta = 0, slc_ctas = 0;  // selected blocks per CTA, CTAs of the selection
  int win_splits = 0, win_chunk = 0;
  float* cmp_ml = nullptr;  // [Tq, Hkv, cmp_splits, G, 2] running max (log2 domain) and sum
  float* cmp_o = nullptr;   // [Tq, Hkv, cmp_splits, G, Dv] unnormalised output
  float* cmp_s = nullptr;   // [Tq, Hkv, cmp_splits, score_width, G] partial selection scores
  int32_t* sel = nullptr;   // [Tq, Hkv, n] the selected blocks (the indices output when given)
  int64_t sel_st = 0, sel_sh = 0, sel_sn = 1;
  int32_t* row_ok = nullptr;  // [Tq] 1 where the row's sequence passed every check
  float* sw_ml = nullptr;   // [Tq, Hkv, slc_ctas + win_splits, G, 2]
  float* sw_o = nullptr;    // [Tq, Hkv, slc_ctas + win_splits, G, Dv]
};

// phi of one side (k or v) for appending: the pools it reads and writes and its parameters.
struct PhiSide {
  Pool raw;         // the raw cmp pool (tokens)
  Pool cmp;         // the compressed pool (written)
  int dim = 0;      // D of this side
  const void *w1 = nullptr, *b1 = nullptr, *w2 = nullptr, *b2 = nullptr, *pe = nullptr;  // contiguous
  int hidden = 0;   // F (mlp)
  float* hidden_buf = nullptr;  // [slots, Hkv, F] f32 workspace (mlp)
};

struct AppendParams {
  Pages pages;
  // New tokens [Tn, Hkv, D] and the pools they go to, per array (k_cmp, v_cmp, k_slc, ...).
  int arrays = 0;   // 2 (shared K/V) or 6
  const void* src[6] = {};
  int64_t src_st[6] = {}, src_sh[6] = {};
  Pool dst[6];
  int dim[6] = {};
  int hkv = 1;
  int l = 0, d = 0;
  int kind = 0;     // PhiKind
  int blocks_per_seq = 0;  // slots per sequence: the most compressed blocks one call completes
  int heads_per_cta = 1;   // heads a phi CTA stages at once
  PhiSide side[2];  // k, v
};

}  // namespace nsa::cuda::decode
