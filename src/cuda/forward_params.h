// Parameter structs of the CUDA forward kernels: the contract between the launchers
// (forward.cu) and the kernels. Plain data: pointers with their shapes, strides in elements,
// sizes and the configuration. Nothing here knows about the public API's TensorView.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "nsa/tensor.h"

namespace nsa::cuda {

// Rows of the attention tile: 64 query rows = (64 / G) tokens x the G heads of one KV head, so
// every tensor-core instruction has M = 64 rows whatever G is (performance.md).
inline constexpr int kTileRows = 64;
// Keys per step of the compressed attention loop.
inline constexpr int kKeyChunk = 64;
// The selection + window kernel: a tile of 64 rows (4 warps), keys in chunks of 64 (one block at
// l' = 64) streamed through a ring of shared buffers that each warp waits on by itself
// (slc_win_attention.cuh).
inline constexpr int kSlcRows = 64;
inline constexpr int kSlcChunk = 64;

// Packed sequences: cu_seqlens [B+1] on the device, or nullptr for one sequence of T tokens.
struct SeqParams {
  const int32_t* cu_seqlens = nullptr;  // [B+1]
  int64_t total_tokens = 0;             // T
  int batch = 1;                        // B
  int64_t max_seqlen = 0;
};

// Compressed-branch attention (spec §2) and, optionally, the selection scores S (spec §3).
struct CmpAttnParams {
  SeqParams seqs;
  const void* q;  // [T, Hq, Dqk]
  int64_t q_st, q_sh;
  const void* kc;  // [T/d, Hkv, Dqk]
  int64_t kc_st, kc_sh;
  const void* vc;  // [T/d, Hkv, Dv]
  int64_t vc_st, vc_sh;
  void* o;  // [T, Hq, Dv] (storage dtype)
  int64_t o_st, o_sh;
  float* lse;  // [T, Hq] with strides (f32)
  int64_t lse_st, lse_sh;
  float* scores;  // [T, Hkv, Ns] f32, or nullptr
  int64_t s_st, s_sh;
  int64_t scores_width;      // Ns: columns of scores
  bool scores_zero_fill;     // write zeros up to scores_width (public op); else only j <= J_t
  int hkv, group, log2_group;
  float scale_log2;  // softmax scale * log2(e)
  int l, d, lp;      // cmp_block_len, cmp_stride, slc_block_len
  int score_window;  // W: selection blocks one chunk of compressed keys can touch (cmp_attention.cuh)
  int score_ring;    // columns of the ring accumulator: a power of two >= W + blocks per chunk
};

// Selection (spec §5) and sliding-window (spec §6) attention of one query tile, fused with the
// gated combine of spec §7 when `combine` is set.
struct SlcWinParams {
  SeqParams seqs;
  const void* q;  // [T, Hq, Dqk]
  int64_t q_st, q_sh;
  const void* k_slc;  // [T, Hkv, Dqk]
  int64_t ks_st, ks_sh;
  const void* v_slc;  // [T, Hkv, Dv]
  int64_t vs_st, vs_sh;
  const void* k_win;  // [T, Hkv, Dqk]
  int64_t kw_st, kw_sh;
  const void* v_win;  // [T, Hkv, Dv]
  int64_t vw_st, vw_sh;
  const int32_t* indices;  // [T, Hkv, n] ascending, -1 padded
  int64_t idx_st, idx_sh;
  // Per-branch outputs before gating (storage dtype), index 0 = slc, 1 = win; nullptr: not wanted.
  void* o_branch[2];  // [T, Hq, Dv]
  int64_t ob_st[2], ob_sh[2];
  float* lse[2];  // [T, Hq] f32 with strides; nullptr: not wanted
  int64_t lse_st[2], lse_sh[2];
  bool has_slc, has_win;
  // Gated combine: o = g0 * o_cmp + g1 * o_slc + g2 * o_win.
  bool combine;
  const void* g;  // [T, Hq, 3]
  int64_t g_st, g_sh;
  const void* o_cmp;  // [T, Hq, Dv]
  int64_t oc_st, oc_sh;
  void* o;  // [T, Hq, Dv]
  int64_t o_st, o_sh;
  int hkv, group, log2_group;
  float scale_log2;
  int lp, n_sel, window;
  int union_capacity;  // entries of the shared union-of-blocks list
  int bitmap_words;    // 32-bit words of the shared block bitmap: ceil(Ns / 32)
};

// Launchers, one explicit instantiation per (storage, Dqk, Dv) in instantiations/.
template <typename Storage, int kDqk, int kDv>
void launch_cmp_attention(const CmpAttnParams& p, cudaStream_t stream);
template <typename Storage, int kDqk, int kDv>
void launch_slc_win_attention(const SlcWinParams& p, cudaStream_t stream);

// The ring of K/V chunk buffers of the selection + window kernel: as many stages of kSlcChunk
// keys as fit in 108 KB (two CTAs per SM), at most 8: 3 at 128/128, 2 at 192/128. Up to
// stages - 1 chunks are in flight while one is multiplied; the selection branch is bound by the
// bytes in flight (L2 latency x bandwidth), so the ring takes nearly all the shared memory.
inline constexpr size_t kSlcWinStageBudget = 108 * 1024;
inline constexpr int kSlcWinMaxStages = 8;
constexpr size_t slc_win_stage_bytes(int dqk, int dv) { return size_t(kSlcChunk) * ((dqk + 8) + (dv + 8)) * 2; }
constexpr int slc_win_stages(int dqk, int dv) {
  const size_t n = kSlcWinStageBudget / slc_win_stage_bytes(dqk, dv);
  return n > size_t(kSlcWinMaxStages) ? kSlcWinMaxStages : static_cast<int>(n);
}
// Stages the Q tile (64 rows) borrows at the start: it is needed only until its fragments are in
// registers, so it sits in the last stages of the ring before their first chunks are loaded.
constexpr int slc_win_q_stages(int dqk, int dv) {
  const size_t q = size_t(kSlcRows) * (dqk + 8) * 2, stage = slc_win_stage_bytes(dqk, dv);
  return static_cast<int>((q + stage - 1) / stage);
}

// Shared-memory bytes of the kernels (used by the launchers and to check limits up front).
size_t cmp_attention_smem_bytes(int dqk, int dv, int group, int score_ring, bool with_scores);
size_t slc_win_smem_bytes(int dqk, int dv, int group, int union_capacity, int bitmap_words, int n_sel);

}  // namespace nsa::cuda
