// The entry points of the library.
//
// Conventions (docs/api.md says more):
// - Every tensor is a TensorView; shapes are given beside each field. T is the total number of
//   packed tokens (spec §9), Hq/Hkv the query/KV heads, Dqk/Dv the head dims, n = n_selected.
// - All floating-point inputs and outputs of one call share one dtype (f32, bf16, f16; f64 on
//   the reference backend), except the log-sum-exps and selection scores, which are always f32,
//   and indices/cu_seqlens, which are int32. The last dimension of every tensor must be
//   contiguous (stride 1) for the fast backends; the reference accepts any non-negative strides.
// - Outputs are written, never read; an optional output may be left absent (ndim == 0).
// - Nothing allocates in a fast backend: ask workspace_size() and pass that many bytes, on the
//   backend's device. The reference backend is slow on purpose and uses host vectors.
// - Invalid input throws nsa::Error naming the parameter, its value and what is allowed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nsa/config.h"
#include "nsa/tensor.h"

namespace nsa {

enum class Backend : int32_t {
  automatic = 0,  // cuda for device tensors; for host tensors, reference for f64, else cpu
  reference = 1,  // plain fp64 loops: the executable specification
  cpu = 2,        // the fast CPU backend (threads + SIMD)
  cuda = 3,       // the CUDA backend
};
const char* backend_name(Backend backend);
Backend parse_backend(const char* text);  // "auto", "reference", "cpu", "cuda"
// Whether the backend was compiled in and (for cuda) a device is present.
bool backend_available(Backend backend);

// Kernel paths of the cuda backend that its own rules would not take on small inputs, forced so
// that tests reach every path and benchmarks compare them. Every choice computes the same result
// up to rounding; the defaults are the library's rules. Pass the same choices to workspace_size
// and to the call (some change the workspace's layout).
struct CudaKernelChoices {
  bool tma = true;              // false: no TMA tensor maps (cp.async copies everywhere)
  bool slc_union_tiles = true;  // false: the selection's per-token kernels (forward and backward)
  int slc_union_ctas = 0;       // > 0: at most this many CTAs of the selection's union-tile kernel
  bool slc_block_steps = true;  // false: the sm_90a selection forward walks 16 keys a step (else a whole block where l' = 64 and Dqk, Dv are 64 or 128)
  int cmp_splits = 0;           // > 0: the backward's query splits of the compressed dK/dV (<= 16)
  bool raw_pieces = true;       // false: the backward's raw selection lists are never cut
  int raw_piece_tiles = 0;      // > 0: lists longer than this many query tiles are cut (else the rule)
  bool packed_sort = true;      // false: the inverted index sorts (key, token) pairs, not packed keys
  bool dkv_warp_specialized = true;  // false: the backward's dK/dV kernel is one warpgroup per CTA everywhere
  bool phi_pairs = true;        // false: phi of k and of v in launches of their own (never one launch for both)
  bool phi_wgmma = true;        // false: phi's bf16 products on mma.sync on every GPU (sm_90a: wgmma otherwise)
  bool phi_blas = true;         // false: phi's large bf16 products on the library's own kernels, never cuBLASLt
  bool cmp_scores_by_chunk = true;  // false: the score pass's ring accumulator everywhere (else where l'/d divides 64 and l/d - 1 <= min(ring, 64))
  bool softmax_max_slack = true;  // false: the forward's online softmax max follows every chunk's (a rescale at every rise)
  bool combine_prefetch = true;      // false: the sm_90a kernel that forms the gated combine (window or selection by TMA) reads its o_cmp, o_slc / o_win and gates without prefetching them into L2 first
  bool combine_in_selection = true;  // false: the forward's gated combine in the window kernel after the selection (else, with a selection branch, in the selection kernels after the window)
  bool next_q_prefetch = true;       // false: the sm_90a window kernel does not prefetch the Q tile of the CTA one resident grid later into L2
  bool cmp_scores_pipelined = true;  // false: the sm_90a score pass in 64-row tiles multiplies a chunk only after the previous one's sums, behind a CTA barrier (else the next chunk's products run beside this chunk's sums where a tensor map of the keys can be made)
  int cmp_scores_rows = 0;  // 64 or 128: the sm_90a score pass's row tiles (0: the rule; 128 only from Dqk 128, where its shared memory fits)
  int win_chunk = 0;        // 64 or 112: keys per chunk of the sm_90a window (0: the rule; 112 only at Dqk, Dv <= 128 with tensor maps, else 64)
};

struct Context {
  Backend backend = Backend::automatic;
  void* stream = nullptr;     // cudaStream_t for the CUDA backend (nullptr: default stream)
  int num_threads = 0;        // CPU backends: 0 = OpenMP's default; results never depend on it
  const CudaKernelChoices* cuda_choices = nullptr;  // null: the cuda backend's own rules
};

struct Workspace {
  void* data = nullptr;  // on the device of the backend; at least 256-byte aligned
  size_t bytes = 0;
};

// Packed variable-length sequences (spec §9).
struct Sequences {
  TensorView cu_seqlens;   // [B+1] int32, cu_seqlens[0] = 0, non-decreasing; absent: one sequence
  int64_t max_seqlen = 0;  // >= max_b T_b; 0 = derive it from host cu_seqlens (required when
                           // cu_seqlens is on the GPU: the library never syncs to read it); a
                           // value above T counts as T (no sequence is longer)
};

// Parameters of one phi (spec §2), shared by all KV heads. D is the head dim of what phi
// compresses (Dqk for phi_k, Dv for phi_v); l = cmp_block_len; F = hidden width.
//   mean:   none (all absent)
//   linear: w1 = W [D, l*D], pe [l, D]
//   mlp:    w1 [F, l*D], b1 [F], w2 [D, F], b2 [D], pe [l, D]
// flatten(block + pe) is row-major: element (r, c) of the block sits at r*D + c.
struct PhiParams {
  TensorView w1, b1, w2, b2, pe;
};

struct KV {
  TensorView k;  // [T, Hkv, Dqk]
  TensorView v;  // [T, Hkv, Dv]
};

enum BranchIndex : int { kCmp = 0, kSlc = 1, kWin = 2 };

// The rows of a layer call. Without a query packing (seqs_q.cu_seqlens absent) every position of
// every sequence is a query and q, k, v share the packing `seqs`. With one, sequence b has
// Tk_b = cu_seqlens[b+1] - cu_seqlens[b] keys and Tq_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] <= Tk_b
// queries, its LAST Tq_b positions Tk_b - Tq_b .. Tk_b - 1 (bottom-right aligned, FlashAttention's
// varlen convention): the query-side tensors (q, g; o, lse, indices, o_branch; d_o, dq, dg) have
// Tq = sum_b Tq_b rows, the key side (every branch's k, v; dk, dv) T = sum_b Tk_b rows. A query
// attends exactly as the same position does in a call on all positions (docs/semantics.md).
// The cuda backend takes no query packing yet (nsa::Error), unless seqs_q.cu_seqlens is the very
// view seqs.cu_seqlens is (same data, shape and strides; seqs_q.max_seqlen 0 or seqs.max_seqlen),
// which is the same as none.
struct Inputs {
  TensorView q;  // [Tq, Hq, Dqk] (Tq = T without a query packing)
  KV kv[3];      // raw keys/values per branch (cmp, slc, win) [T, Hkv, D]; shared_kv: only kv[kCmp]
  TensorView g;  // [Tq, Hq, 3] gates (cmp, slc, win)
  PhiParams phi_k, phi_v;
  Sequences seqs;    // the keys' packing (spec §9)
  Sequences seqs_q;  // optional query packing: cu_seqlens [B+1] (cu_seqlens_q), max_seqlen >= max_b Tq_b
                     // or 0; absent: the queries are every position of `seqs`
};

// Query-side rows (Tq = T without a query packing; see Inputs).
struct ForwardOutputs {
  TensorView o;         // [Tq, Hq, Dv]
  TensorView lse;       // [Tq, Hq, 3] f32: each branch's log-sum-exp, -inf where a branch is empty
  TensorView indices;   // [Tq, Hkv, n] int32: selected blocks, ascending, padded with -1
  TensorView o_branch;  // optional [3, Tq, Hq, Dv]: each branch's output before gating
  TensorView o_cmp;     // optional [Tq, Hq, Dv]: the compressed branch's output before gating
  TensorView o_win;     // optional [Tq, Hq, Dv]: the window branch's output before gating
};

struct Gradients {
  TensorView dq;            // [Tq, Hq, Dqk]
  KV dkv[3];                // like Inputs::kv [T, Hkv, D]; shared_kv: the sum over branches goes to dkv[kCmp]
  TensorView dg;            // [Tq, Hq, 3]
  PhiParams dphi_k, dphi_v; // like the parameters (absent for mean)
};

// ---- Workspace sizes --------------------------------------------------------------------------

enum class Op : int32_t {
  compress_fwd,
  compress_bwd,
  compressed_attention_fwd,
  select_topn,
  selected_attention_fwd,
  window_attention_fwd,
  forward,
  backward,
  dense_attention_fwd,
  dense_attention_bwd,
  cache_append,  // nsa/cache.h
  decode,
  dense_decode,
};

// The sizes that determine a workspace.
struct Problem {
  int64_t total_tokens = 0;  // T
  int64_t batch = 1;         // B
  int64_t max_seqlen = 0;
  int64_t hq = 0, hkv = 0, dqk = 0, dv = 0;
  int64_t phi_hidden = 0;  // F (mlp), else 0
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  int64_t max_query_len = 0;  // decoding (nsa/cache.h): most new rows of one sequence
};
// Reads the sizes off the inputs (derives max_seqlen from host cu_seqlens when it is 0). The sizes
// are the keys' (total_tokens = T): a call with a query packing needs no more workspace than the
// call on all positions of the same keys.
Problem problem_of(const Config& cfg, const Inputs& in);

// Bytes of workspace `op` needs on the backend that `ctx` resolves to for `problem`. Every field
// of `problem` must lie in [0, 2^31 - 1] and no tensor it describes may exceed 2^48 elements
// (nsa::Error naming problem.<field> or problem); the size follows the tensors, not l', n or w.
size_t workspace_size(const Context& ctx, Op op, const Config& cfg, const Problem& problem);

// ---- Stages -----------------------------------------------------------------------------------

// Spec §2: xc = phi(x) per compressed block and KV head.
//   x [T, Hkv, D] -> xc [T/d, Hkv, D] (packed layout of blocks.h: sequence starting at s uses rows
//   s/d .. s/d + N_c - 1; rows past a sequence's N_c are left untouched).
void compress_fwd(const Context& ctx, const Config& cfg, const PhiParams& phi, const TensorView& x,
                  const Sequences& seqs, const TensorView& xc, Workspace ws = {});
// Gradients of compress_fwd: dxc [T/d, Hkv, D] -> dx [T, Hkv, D] (written, not accumulated) and
// dphi (written; absent for mean).
void compress_bwd(const Context& ctx, const Config& cfg, const PhiParams& phi, const TensorView& x,
                  const Sequences& seqs, const TensorView& dxc, const TensorView& dx,
                  const PhiParams& dphi, Workspace ws = {});

// Spec §2-§3: attention of q over the visible compressed blocks, and the group-summed selection
// scores S.  q [T, Hq, Dqk], kc [T/d, Hkv, Dqk], vc [T/d, Hkv, Dv] -> o [T, Hq, Dv],
// lse [T, Hq] f32, scores [T, Hkv, Ns] f32 (optional; Ns >= ceil(min(max_seqlen, T) / l');
// entries past a query's admissible blocks are 0).
void compressed_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                              const TensorView& kc, const TensorView& vc, const Sequences& seqs,
                              const TensorView& o, const TensorView& lse, const TensorView& scores,
                              Workspace ws = {});

// Spec §4: top-n blocks per (token, KV head). scores [T, Hkv, Ns] f32 -> indices [T, Hkv, n] int32.
void select_topn(const Context& ctx, const Config& cfg, const TensorView& scores,
                 const Sequences& seqs, const TensorView& indices, Workspace ws = {});

// Spec §5: attention over the selected blocks. q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv],
// indices [T, Hkv, n] -> o [T, Hq, Dv], lse [T, Hq] f32 (optional). Each row of indices is a set
// of blocks in any order: -1 entries and repeats add nothing, and only the tokens at or before
// the query are attended (a block past the query contributes nothing).
void selected_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                            const TensorView& k, const TensorView& v, const TensorView& indices,
                            const Sequences& seqs, const TensorView& o, const TensorView& lse,
                            Workspace ws = {});

// Spec §6: sliding-window attention. Shapes as selected_attention_fwd without indices.
void window_attention_fwd(const Context& ctx, const Config& cfg, const TensorView& q,
                          const TensorView& k, const TensorView& v, const Sequences& seqs,
                          const TensorView& o, const TensorView& lse, Workspace ws = {});

// ---- Whole layer ------------------------------------------------------------------------------

// Spec §2-§7: every branch, the gates, the per-branch log-sum-exps and the selected indices.
void forward(const Context& ctx, const Config& cfg, const Inputs& in, const ForwardOutputs& out,
             Workspace ws = {});

// Spec §8: gradients of a loss with respect to every input, given d_o = dLoss/do [Tq, Hq, Dv] and
// what forward() saved: lse and indices are read. o, o_branch, o_cmp and o_win are optional (the
// other backends ignore them; o_branch or any of o_cmp and o_win): with o_branch (as forward() wrote it)
// the cuda backend takes dg_b = <d_o, o_b> from it instead of recomputing every branch's output
// (two of the nine products per query and key); without o_branch but with o (as forward() wrote
// it) it recomputes the compressed and window outputs only and takes the selection's from
// o = sum_b g_b o_b (one gather pass over the selected blocks less; D = g_slc <d_o, o_slc> then
// carries o's rounding, as dense attention's D = <d_o, o> does); with o_cmp as well it takes the
// compressed branch's dg from o_cmp, and with o_win the window branch's from o_win, and recomputes
// only the branch outputs it was not given (o, o_cmp and o_win: no recompute at all, as with
// o_branch, for two o-sized tensors besides o, the layer's output, where o_branch holds three).
// Selection is a constant. Every gradient is written (not accumulated).
void backward(const Context& ctx, const Config& cfg, const Inputs& in, const ForwardOutputs& saved,
              const TensorView& d_o, const Gradients& grads, Workspace ws = {});

// Dense causal softmax attention with GQA (the baseline NSA is compared with), per sequence.
// q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv] -> o [T, Hq, Dv], lse [T, Hq] f32 (optional).
void dense_attention_fwd(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Sequences& seqs, const TensorView& o,
                         const TensorView& lse, Workspace ws = {});
// Its gradients, given o and lse of the forward: writes dq, dk, dv.
void dense_attention_bwd(const Context& ctx, double scale, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Sequences& seqs, const TensorView& o,
                         const TensorView& lse, const TensorView& d_o, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, Workspace ws = {});

// ---- Rotary position embeddings ---------------------------------------------------------------

// Rotary position embeddings, GPT-NeoX layout: x [T, H, D] (D even) -> out [T, H, D]; out may be x
// itself (same data and strides: in place), else the address ranges of the two (first to last
// element) must not meet. With h = D/2 and i < h:
// angle = float(pos(t)) * inv_freq[i] (an fp32 product), c = cos(angle), s = sin(angle)
// (inverse: s = -sin(angle), the transpose of the rotation, which is its gradient);
//   out[t, :, i]     = x1 * c - x2 * s,   out[t, :, i + h] = x2 * c + x1 * s,
// x1 = x[t, :, i], x2 = x[t, :, i + h] read as fp32 (f64 tensors: everything in f64, the angle
// double(pos) * double(inv_freq[i])), the products and the difference/sum in that precision,
// rounded once to the dtype. pos(t) = positions[t] (int32 [T], >= 0) when positions is given (seqs
// is then only checked), else the token's position within its own sequence of seqs (t - cu_seqlens[b];
// t without cu_seqlens). inv_freq: f32 [h]. seqs.max_seqlen is not needed (0 is fine with device
// cu_seqlens too). Host positions are checked (>= 0); device positions are not read before the
// launch (no sync): there a negative position rotates by its negative angle. No workspace. The
// cuda backend takes bf16 and f16 (as every other operation of it), the reference also f64.
void rotary(const Context& ctx, const TensorView& x, const TensorView& inv_freq, const Sequences& seqs,
            const TensorView& positions, const TensorView& out, bool inverse = false);

}  // namespace nsa
