// Parameter structs of every CUDA kernel: the contract between the launchers and the kernels, one
// section per room (forward: nsa::cuda; backward: nsa::cuda::bwd, read by the kernels of
// backward/; decode: nsa::cuda::decode, read by the kernels of decode/; rotary embeddings:
// nsa::cuda::rotary, read by rotary/rotary.cu); the rules that size them
// are in tile_sizes.h. Plain data: pointers with their shapes, strides in elements,
// sizes and the configuration. Nothing here knows about the public API's TensorView.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/constants.h"
#include "cuda/tile_sizes.h"
#include "nsa/api.h"
#include "nsa/blocks.h"
#include "nsa/tensor.h"

namespace nsa::cuda {

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
  int64_t kc_rows;  // rows of kc (the bounds of the S pass's TMA tensor map)
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
  bool score_by_chunk;  // l'/d divides kKeyChunk, l/d - 1 <= min(score_ring, kKeyChunk): each chunk writes its blocks, no ring (cmp_attention.cuh)
  CudaKernelChoices choices;  // Context::cuda_choices (tma)
};

// Selection (spec §5, slc_attention.cuh) and sliding-window attention (spec §6,
// win_attention.cuh), the one launched with `combine` set fused with the gated combine of spec §7:
// the window, reading o_slc back, or (the forward with a selection branch, on by default:
// CudaKernelChoices::combine_in_selection) the selection after the window, reading o_win back.
// Each kernel reads the fields of its branch.
struct BranchParams {
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
  const int32_t* indices;  // [T, Hkv, n]: a set of blocks per row, -1 padded
  int64_t idx_st, idx_sh;
  // Per-branch outputs before gating (storage dtype), index 0 = slc, 1 = win; nullptr: not wanted.
  void* o_branch[2];  // [T, Hq, Dv]
  int64_t ob_st[2], ob_sh[2];
  float* lse[2];  // [T, Hq] f32 with strides; nullptr: not wanted
  int64_t lse_st[2], lse_sh[2];
  // Gated combine (by the kernel launched with it set): o = g0 * o_cmp + g1 * o_slc + g2 * o_win.
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
  // The selection kernel (slc_attention.cuh): entries of a warp's sort of (block, token) pairs, a
  // power of two >= (16 / G) * n.
  int sort_capacity;
  // o_slc for the window kernel's combine, written by the selection kernel (nullptr: no
  // selection branch, o_slc = 0).
  const void* o_slc;
  int64_t os_st, os_sh;
  // o_win for the selection kernels' combine, written by the window kernel (nullptr: no window
  // branch, o_win = 0).
  const void* o_win;
  int64_t ow_st, ow_sh;
  // The selection's union tiles (slc_attention.cuh): when set, the per-token kernel leaves every
  // tile whose union of blocks is small (slc_union_takes) and appends it to slc_union_list (entry
  // 0: their count, zeroed before the launch; then the tiles, blockIdx.y * gridDim.x +
  // blockIdx.x, in no particular order), which slc_union_tile_kernel then runs.
  bool slc_union_tiles;
  CudaKernelChoices choices;  // Context::cuda_choices (tma, slc_union_tiles, slc_union_ctas)
  int32_t* slc_union_list;  // slc_union_list_ints(...) ints of the workspace; nullptr: no union tiles
};

// Launchers, one explicit instantiation per (storage, Dqk, Dv) in instantiations/.
template <typename Storage, int kDqk, int kDv>
void launch_cmp_attention(const CmpAttnParams& p, cudaStream_t stream);
template <typename Storage, int kDqk, int kDv>
void launch_win_attention(const BranchParams& p, cudaStream_t stream);
template <typename Storage, int kDqk, int kDv>
void launch_slc_attention(const BranchParams& p, cudaStream_t stream);

}  // namespace nsa::cuda

// ---- backward (backward/) ----------------------------------------------------------------------

namespace nsa::cuda::bwd {

// A [N, H, D] tensor with a contiguous last dimension (element strides of the first two).
struct Mat3 {
  const void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
};
struct OutMat3 {
  void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
};

// The raw lists' pieces (BwdArgs::raw; the workspace's slots: backward.cu's Layout).
struct RawPieces {
  int pool = 0;             // slots (0: no pieces)
  int extra_x = 0;          // extra CTAs per KV head in front of the raw grid, ceil(pool / Hkv)
  int x = 0;                // the raw grid's own CTAs per KV head, B * n_slc_max * chunks
  float* part_k = nullptr;  // [pool][kKeys][Dqk] fp32 partials
  float* part_v = nullptr;  // [pool][kKeys][Dv]
  int2* split = nullptr;    // [Hkv * x] (first slot, pieces) of raw CTA hk * x + bx; (-1, 1): whole
  int2* slot = nullptr;     // [pool] (raw CTA, piece) of each slot; (-1, 0): unused
  int* arrived = nullptr;   // [pool] pieces arrived, by a list's first slot (zeroed by the plan)
  int piece_tiles = 0;      // CudaKernelChoices::raw_piece_tiles: the cap in query tiles (0: the rule)
};

struct BwdArgs {
  int64_t T = 0, max_seqlen = 0;
  int B = 1;
  const int32_t* cu = nullptr;  // [B+1] device
  int hq = 0, hkv = 0, G = 1, dqk = 0, dv = 0;
  int l = 32, d = 16, lp = 64, n = 16, w = 512;
  int n_slc_max = 0;  // ceil(max_seqlen / l')
  float scale = 0.f;
  bool shared_kv = false;
  bool vec = true;    // every 16-bit tensor is 16-byte aligned with strides % 8 == 0
  bool dq_pairs = false;  // dq's column pairs (2i, 2i + 1) are aligned 32-bit words (one store each)

  Mat3 q, d_o, g, lse;       // g [T, Hq, 3], lse [T, Hq, 3] f32
  Mat3 k[3], v[3];           // raw K/V per branch (cmp entry unused here)
  Mat3 indices;              // [T, Hkv, n] int32
  const void* kc = nullptr;  // [Rc, Hkv, Dqk] 16-bit, contiguous
  const void* vc = nullptr;  // [Rc, Hkv, Dv]
  float* dg32 = nullptr;     // [T, Hq, 3] dg in fp32 (read by dkv_kernel)
  float* g32 = nullptr;      // [T, Hq, 3] the gates in fp32 (dkv_kernel copies them ahead by cp.async)
  bool dg_ready = false;     // dg32 and dg already hold <dO, o_b> (from the saved o_branch)
  // The compressed branch's dg from the forward's saved o_cmp: dq_kernel's pass 1 writes
  // <dO, o_cmp> of its rows to dg32 and dg (before any compressed tile's dS needs it) and skips
  // the compressed tiles.
  bool dg_cmp_ready = false;
  Mat3 o_cmp;                // [T, Hq, Dv] the forward's compressed output (dg_cmp_ready)
  bool dg_win_ready = false; // the same for the window branch from the forward's saved o_win
  Mat3 o_win;                // [T, Hq, Dv] the forward's window output (dg_win_ready)
  // slc_dq_kernel without its pass 1 (no recompute of o_slc): the forward's o is given, so the
  // selection's softmax correction comes from o = sum_b g_b o_b as
  // D_slc = g_slc <dO, o_slc> = <dO, o> - g_cmp dg_cmp - g_win dg_win (dq_kernel wrote dg_cmp and
  // dg_win to dg32), and dg_slc = <dO, o_slc> = sum_j P_j dP_j is summed in pass 2.
  bool d_from_o = false;
  Mat3 o;                    // [T, Hq, Dv] the forward's output (d_from_o)
  OutMat3 dq, dg;
  OutMat3 grad_k[3], grad_v[3];      // raw gradients (cmp entry: written only in shared mode)
  // Inverted selection index: for key (hk * B + b) * n_slc_max + j, the packed tokens that
  // selected block j of sequence b for KV head hk are sel_tokens[sel_offsets[key] .. [key+1]).
  const int32_t* sel_tokens = nullptr;
  const int32_t* sel_offsets = nullptr;
  // Compressed branch (cmp_split_of): the split holding a sequence's last query writes dkc / dvc
  // [Rc, Hkv, D] fp32 itself; each earlier split z writes partials for its first rows: split z's
  // partial holds cmp_part_rows[z] rows [Rc', Hkv, D] from dkc_part / dvc_part, one after another.
  float* dkc = nullptr;
  float* dvc = nullptr;
  float* dkc_part = nullptr;
  float* dvc_part = nullptr;
  int cmp_splits = 1;
  int64_t cmp_part_rows[kMaxCmpSplits] = {};
  // Long selection lists of the raw blocks (dkv_kernel<raw>, raw_pieces_plan_kernel). A block's
  // list is as long as the number of queries that picked it: a forced initial block's (j < n_init)
  // is the whole sequence after it, and with causal picks the other early blocks' lists are the
  // longest (about ln(blocks / j) times the mean for block j on random picks). One CTA working
  // through such a list while the others have finished is the kernel's tail. The plan kernel
  // (before the raw kernel, one CTA) cuts every list longer than `cap` query tiles (cap = all raw
  // CTAs' tiles / kRawTargetCtas, at least kRawMinPieceTiles, doubled until every piece has one of
  // the pool slots) into pieces of at most cap tiles. Piece 0 stays with the block's own CTA (with
  // its window tiles); pieces 1.. run on the extra CTAs in front of the grid (x < extra_x, one per
  // slot; a slot holding a piece 0 or no piece exits). Every piece writes its fp32 partial to its
  // slot and counts itself in; the last to arrive adds the slots in piece order, rounds once and
  // writes dk / dv (shared K/V: plus phi's gradient): the same bits whoever arrives last.
  RawPieces raw;
  // The selection's union tiles (sm_90a, l' = 64; slc_union_enabled): dq_kernel takes the
  // selection branch of a row tile whose tokens' blocks have a small union (slc_union_takes, as
  // the forward's union tiles) as a third stage of its sweeps, and slc_dq_kernel, which makes the
  // same count from the same lists, leaves those tiles. slc_cap: slc_sort_capacity(G, n).
  bool slc_union = false;
  int slc_cap = 0;
  int64_t rc = 0;  // rows of the compressed tensors, floor(T / d)
  // Shared K/V: phi's gradient to every raw token, fp32 [T, Hkv, Dqk] / [T, Hkv, Dv], added by the
  // raw dk/dv epilogue before its one rounding (nullptr: no compressed block, nothing to add).
  const float* phi_dk32 = nullptr;
  const float* phi_dv32 = nullptr;
  CudaKernelChoices choices;  // Context::cuda_choices (tma, slc_union_tiles)
};

}  // namespace nsa::cuda::bwd

// ---- decode (decode/, nsa/cache.h): one struct for the attend path, one for appending ------------

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

  // The split plan (tile_sizes.h) and its workspace (decode/backend.cpp).
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

namespace nsa::cuda::rotary {

// Rotary embeddings (api.h rotary): out = rotation of x by each token's angles.
struct Params {
  SeqParams seqs;                      // positions within each sequence when `positions` is null
  const void* x = nullptr;             // [T, H, D] storage dtype, last dimension contiguous
  int64_t x_st = 0, x_sh = 0;
  void* out = nullptr;                 // [T, H, D]; x itself (same strides) or apart from it
  int64_t o_st = 0, o_sh = 0;
  const float* inv_freq = nullptr;     // [h] f32, contiguous
  const int32_t* positions = nullptr;  // [T] int32, contiguous; null: from seqs
  int64_t H = 0, h = 0;                // heads, half the head dim
  bool inverse = false;                // rotate by -angle (the transpose: the gradient)
};

}  // namespace nsa::cuda::rotary
