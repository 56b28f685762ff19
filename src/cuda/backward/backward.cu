// The CUDA backward pass (spec §8): orchestration and the inverted selection index.
// docs/cuda_backward.md describes the design; launch.cuh (dq_kernel.cuh, dkv_kernel.cuh, slc_dq.cuh) holds the attention
// kernels, phi/phi.h phi's forward and gradients.
//
// Order of work on the stream:
//   1. sequence table on the device; compressed keys/values recomputed through phi (as the
//      forward computes them), phi's hidden pre-activation kept;
//   2. the inverted index of the selection (stable radix sort of (KV head, block) -> token);
//   3. dq_kernel: per-branch outputs recomputed from lse -> dg; dq of all branches at once;
//   4. dkv_kernel<cmp>: dkc/dvc partials per query split, reduced in a fixed order;
//   5. phi backward: parameter gradients (split-K products, fixed-order reductions), dpre; phi's
//      gradient to the raw tokens (independent K/V: into dk_cmp / dv_cmp; shared: fp32 for 6.);
//   6. dkv_kernel<raw>: window + selection dk/dv (shared_kv: plus phi's gradient, one rounding).
// Nothing uses floating-point atomics: same inputs, same bits.
#include "cuda/backward/backward.h"

#include <cub/cub.cuh>

#include <algorithm>
#include <vector>

#include "cuda/backward/launch.cuh"
#include "cuda/backward/raw_pieces.cuh"
#include "cuda/backward/selection_index.cuh"
#include "cuda/backward/workspace.h"
#include "cuda/common/check.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/launch.h"
#include "cuda/phi/phi.h"
#include "nsa/error.h"

namespace nsa::cuda::bwd {

// ---- the attention kernels: run-time dtype/head dims -> templates -------------------------
// (compiled in attention_<dtype>_hdim<Dqk>.cu)
#define NSA_BWD_EXTERN(E, DQK)                                                               \
  extern template void launch_attention<E, DQK, 64>(const BwdArgs&, cudaStream_t, BwdKernel);         \
  extern template void launch_attention<E, DQK, 128>(const BwdArgs&, cudaStream_t, BwdKernel);        \
  extern template int dkv_cmp_resident_ctas<E, DQK, 64>(const CudaKernelChoices&);                   \
  extern template int dkv_cmp_resident_ctas<E, DQK, 128>(const CudaKernelChoices&);
NSA_BWD_EXTERN(__nv_bfloat16, 64)
NSA_BWD_EXTERN(__nv_bfloat16, 128)
NSA_BWD_EXTERN(__nv_bfloat16, 192)
NSA_BWD_EXTERN(__half, 64)
NSA_BWD_EXTERN(__half, 128)
NSA_BWD_EXTERN(__half, 192)
#undef NSA_BWD_EXTERN

namespace {

using detail::Plan;
using cuda::WorkspaceCarver;

// crow_token[crow] = packed first token of compressed row crow, or -1 when no block uses it.
constexpr int kInlineCu = 64;
struct InlineCu {
  int32_t v[kInlineCu];
};
__global__ void set_cu_kernel(InlineCu c, int n, int32_t* dst) {
  const int i = threadIdx.x;
  if (i < n) dst[i] = c.v[i];
}

// cu [B+1] int32 from a device tensor with any stride.
__global__ void copy_cu_kernel(const int32_t* src, int64_t stride, int n, int32_t* dst) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i * stride];
}

// dg_b = <dO, o_b> for every (token, head) and the three branches from the forward's saved
// o_branch [3, T, Hq, Dv]: one warp per (token, head), the lanes' partial sums added by a fixed
// butterfly.
template <typename E>
__global__ void dg_from_branches_kernel(Mat3 d_o, const E* ob, int64_t ob_sb, int64_t ob_st, int64_t ob_sh,
                                        int64_t rows, int hq, int dv, float* dg32, OutMat3 dg) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t t = r / hq;
  const int h = int(r % hq);
  const E* dorow = static_cast<const E*>(d_o.p) + t * d_o.s0 + h * d_o.s1;
  for (int b = 0; b < 3; ++b) {
    const E* orow = ob + b * ob_sb + t * ob_st + h * ob_sh;
    float part = 0.f;
    for (int c = lane; c < dv; c += 32) part += to_float(dorow[c]) * to_float(orow[c]);
    for (int off = 16; off > 0; off /= 2) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) {
      dg32[r * 3 + b] = part;
      static_cast<E*>(dg.p)[t * dg.s0 + h * dg.s1 + b] = from_float<E>(part);
    }
  }
}

// g32 [T, Hq, 3] = the gates g (any strides) in fp32, for dkv_kernel's 4-byte copies ahead.
template <typename E>
__global__ void gates_f32_kernel(Mat3 g, int64_t rows, int hq, float* g32) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= rows * 3) return;
  const int64_t r = e / 3, t = r / hq;
  const int h = int(r % hq), b = int(e % 3);
  g32[e] = load_f32<E>(g.p, t * g.s0 + h * g.s1 + b);
}

// The compressed dk (or dv) of elements 4c .. 4c + 3 of [Rc, Hkv, D] (D a multiple of 4, the
// buffers on 16 bytes: the workspace's): the partials of the splits before the last that see
// their block, in split order, then the last split's value already in out (cmp_split_of). Rows
// of no block (between sequences, or past the last block) stay as they are. A thread finds its
// row's sequence and splits once for four elements.
__global__ void reduce_cmp_parts_kernel(BwdArgs a, const float* part, const int32_t* crow_token, int D,
                                        float* out) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t per_row = int64_t(a.hkv) * D;
  if (c >= a.rc * per_row / 4) return;
  const int64_t e = 4 * c;
  const int64_t crow = e / per_row;
  const int32_t tok = crow_token[crow];
  if (tok < 0) return;
  const int b = seq_of_token(a, tok);
  const int64_t len = a.cu[b + 1] - a.cu[b];
  const int64_t i = crow - cmp_row_offset(a.cu[b], a.d);  // the block's index in its sequence
  const CmpSplit cs = cmp_split_of(len, a.cmp_splits);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int64_t rows_before = 0;
  for (int z = 0; z < cs.last; ++z) {
    if (i < cmp_split_rows(len, z, cs, a.l, a.d)) {
      const float4 v = *reinterpret_cast<const float4*>(part + rows_before * per_row + e);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    rows_before += a.cmp_part_rows[z];
  }
  float4& o = *reinterpret_cast<float4*>(out + e);
  const float4 last = o;
  o = make_float4(acc.x + last.x, acc.y + last.y, acc.z + last.z, acc.w + last.w);
}

// phi's rows (phi.h) for one compressed tensor: head dim D, hidden width F (mlp).
phi::Rows phi_rows(const Plan& p, const Layout& L, int64_t D, int64_t F) {
  phi::Rows r = phi::rows_of(p.cfg, p.T, p.hkv, D, F, L.crow_token, choices_of(p.ctx).phi_wgmma,
                             choices_of(p.ctx).phi_blas);
  r.blas_scratch = L.phi_blas;
  return r;
}

Mat3 mat3(const TensorView& t) { return Mat3{t.data, t.ndim > 0 ? t.stride[0] : 0, t.ndim > 1 ? t.stride[1] : 0}; }
OutMat3 out3(const TensorView& t) { return OutMat3{t.data, t.ndim > 0 ? t.stride[0] : 0, t.ndim > 1 ? t.stride[1] : 0}; }

// Whether every pair of neighbouring elements (2 i, 2 i + 1) of the last dimension of a 16-bit t is
// one aligned 32-bit word: the data 4-byte aligned, the other strides even.
bool aligned_pairs(const TensorView& t) {
  if (!t.defined()) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.stride[i] % 2 != 0) return false;
  return true;
}

bool aligned16(const TensorView& t) {
  if (!t.defined()) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.stride[i] % 8 != 0) return false;
  return true;
}


// One of the attention kernels for the call's head dims (cuda::dispatch_dims).
struct LaunchAttention {
  const BwdArgs& a;
  cudaStream_t s;
  BwdKernel kernel;
  template <typename E, int DQK, int DV>
  void operator()() const {
    launch_attention<E, DQK, DV>(a, s, kernel);
  }
};
template <typename E>
void dispatch_dims(const BwdArgs& a, cudaStream_t s, BwdKernel kernel) {
  cuda::dispatch_dims<E>(a.dqk, a.dv, LaunchAttention{a, s, kernel});
}
// dkv_kernel<cmp>'s resident CTAs for the call's head dims.
struct CmpResident {
  const CudaKernelChoices& c;
  int& ctas;
  template <typename E, int DQK, int DV>
  void operator()() const {
    ctas = dkv_cmp_resident_ctas<E, DQK, DV>(c);
  }
};

// The sequence table cu [B+1] on the device, from a device tensor, or from the host table.
void upload_cu(const Plan& p, int32_t* dst, cudaStream_t s) {
  if (p.cu_seqlens.defined() && p.cu_seqlens.device == Device::cuda) {
    copy_cu_kernel<<<blocks_for(p.B + 1), 256, 0, s>>>(static_cast<const int32_t*>(p.cu_seqlens.data),
                                                      p.cu_seqlens.stride[0], int(p.B + 1), dst);
    NSA_CUDA_CHECK_LAUNCH();
  } else if (p.cu.size() <= size_t(kInlineCu)) {
    // Absent (one sequence: {0, T}) or a short host table: the offsets travel as a kernel
    // argument, so the call neither copies from host memory nor waits for the stream.
    InlineCu c{};
    for (size_t i = 0; i < p.cu.size(); ++i) c.v[i] = int32_t(p.cu[i]);
    set_cu_kernel<<<1, kInlineCu, 0, s>>>(c, int(p.cu.size()), dst);
    NSA_CUDA_CHECK_LAUNCH();
  } else {
    std::vector<int32_t> cu(p.cu.begin(), p.cu.end());
    NSA_CUDA_CHECK(cudaMemcpyAsync(dst, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    NSA_CUDA_CHECK(cudaStreamSynchronize(s));  // `cu` is a local: it must outlive the copy
  }
}

template <typename E>
void run_backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
                  const Gradients& grads, Workspace ws) {
  cudaStream_t s = cuda::stream_of(p);
  if (p.cfg.n_selected > 0) {  // the selection dq kernel's per-warp union scratch must fit
    const size_t smem = slc_dq_smem_bytes(int(p.dqk), int(p.dv), slc_dq_capacity(int(p.group), int(p.cfg.n_selected)));
    if (smem > cuda::kMaxSmem)
      throw Error("n_selected (n)", std::to_string(p.cfg.n_selected),
                  "needs more shared memory (" + std::to_string(smem) + " bytes) than the cuda backward's selection "
                  "kernel has at G = " + std::to_string(p.group));
  }

  const Problem prob = problem_of(p);
  Sizes sizes = sizes_of(p.ctx, p.cfg, prob, p.cfg.phi == PhiKind::mlp ? prob.phi_hidden : 0);
  if (p.B == 1 && p.T > 0) {  // one sequence: the compressed keys' splits by the device's schedule
    cuda::dispatch_dims<E>(p.dqk, p.dv, CmpResident{sizes.choices, sizes.cmp_slots});
  }
  const Layout L = carve(sizes, ws.data, s);
  if (p.T == 0) return;
  const int64_t rc = cmp_rows(p.T, p.cfg.cmp_stride);

  // 1. Sequence table on the device.
  upload_cu(p, L.cu, s);

  BwdArgs a;
  a.choices = choices_of(p.ctx);
  a.T = p.T;
  a.max_seqlen = p.max_seqlen;
  a.B = int(p.B);
  a.cu = L.cu;
  a.hq = int(p.hq);
  a.hkv = int(p.hkv);
  a.G = int(p.group);
  a.dqk = int(p.dqk);
  a.dv = int(p.dv);
  a.l = int(p.cfg.cmp_block_len);
  a.d = int(p.cfg.cmp_stride);
  a.lp = int(p.cfg.slc_block_len);
  a.n = int(p.cfg.n_selected);
  a.w = int(p.cfg.window);
  a.n_slc_max = int(p.n_slc_max);
  a.scale = float(p.scale);
  a.shared_kv = p.cfg.shared_kv;
  a.q = mat3(in.q);
  a.d_o = mat3(d_o);
  a.g = mat3(in.g);
  a.lse = mat3(saved.lse);
  a.indices = mat3(saved.indices);
  bool vec = aligned16(in.q) && aligned16(d_o);
  for (int b = 0; b < 3; ++b) {
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    a.k[b] = mat3(kv.k);
    a.v[b] = mat3(kv.v);
    vec = vec && aligned16(kv.k) && aligned16(kv.v);
    if (!p.cfg.shared_kv || b == kCmp) {
      a.grad_k[b] = out3(grads.dkv[b].k);
      a.grad_v[b] = out3(grads.dkv[b].v);
    }
  }
  a.vec = vec;
  a.kc = L.kc;
  a.vc = L.vc;
  a.dg32 = L.dg32;
  a.g32 = L.g32;
  a.dq = out3(grads.dq);
  a.dq_pairs = aligned_pairs(grads.dq);
  a.dg = out3(grads.dg);
  a.sel_tokens = L.tokens[0];
  a.sel_offsets = L.offsets;
  a.dkc = L.dkc;
  a.dvc = L.dvc;
  a.dkc_part = L.dkc_part;
  a.dvc_part = L.dvc_part;
  a.cmp_splits = L.cmp_splits;
  for (int z = 0; z < kMaxCmpSplits; ++z) a.cmp_part_rows[z] = L.cmp_part_rows[z];
  a.raw = L.raw;
  a.raw.piece_tiles = a.choices.raw_piece_tiles;
  a.rc = rc;

  // 1b. Compressed keys/values through phi (as the forward computes them).
  const phi::Rows rows_k = phi_rows(p, L, a.dqk, p.phi_hidden_k), rows_v = phi_rows(p, L, a.dv, p.phi_hidden_v);
  if (rc > 0) {
    phi::row_table(L.cu, a.B, p.T, a.l, a.d, L.crow_token, s);
    phi::forward_pair<E>(rows_k, phi::Job{in.phi_k, in.kv[kCmp].k, L.pre_k, L.kc, p.hkv * a.dqk, a.dqk}, rows_v,
                         phi::Job{in.phi_v, in.kv[kCmp].v, L.pre_v, L.vc, p.hkv * a.dv, a.dv}, true,
                         a.choices.phi_pairs, s);
  }

  // 2. Inverted selection index (selection_index.cuh).
  const int64_t pairs = p.T * p.hkv * p.cfg.n_selected;
  if (pairs > 0) a.sel_tokens = build_selection_index(p, a, L, s);

  // 3. dq and dg (dg from the saved branch outputs when the caller kept them: o_branch's three by
  //    a kernel first, o_cmp's and o_win's by dq_kernel's pass 1; dq_kernel then skips its
  //    recompute of those branches' outputs). dq_kernel does the compressed and window branches;
  //    slc_dq_kernel then adds the selection's dq (and writes its dg).
  if (saved.o_branch.defined() && p.T > 0) {
    const TensorView& ob = saved.o_branch;
    dg_from_branches_kernel<E><<<blocks_for(p.T * p.hq * 32), 256, 0, s>>>(
        a.d_o, static_cast<const E*>(ob.data), ob.stride[0], ob.stride[1], ob.stride[2], p.T * p.hq, int(p.hq),
        int(p.dv), a.dg32, a.dg);
    NSA_CUDA_CHECK_LAUNCH();
    a.dg_ready = true;
  } else if (p.T > 0) {  // the compressed and window branches' dg: dq_kernel's pass 1
    if (saved.o_cmp.defined()) {
      a.o_cmp = mat3(saved.o_cmp);
      a.dg_cmp_ready = true;
    }
    if (saved.o_win.defined()) {
      a.o_win = mat3(saved.o_win);
      a.dg_win_ready = true;
    }
  }
  // Without o_branch but with the forward's o: slc_dq_kernel takes the selection's D from o and
  // the other branches' dg (which dq_kernel writes first) instead of recomputing o_slc.
  a.o = mat3(saved.o);
  a.d_from_o = !a.dg_ready && saved.o.defined() && p.T > 0;
  dispatch_dims<E>(a, s, BwdKernel::dq);
  if (a.n > 0) dispatch_dims<E>(a, s, BwdKernel::slc_dq);

  // 3b. The gates in fp32, which dkv_kernel's row tables copy ahead 4 bytes at a time.
  if (p.T > 0) {
    gates_f32_kernel<E><<<blocks_for(p.T * p.hq * 3), 256, 0, s>>>(a.g, p.T * p.hq, int(p.hq), a.g32);
    NSA_CUDA_CHECK_LAUNCH();
  }

  // 4. Compressed branch dk/dv (fp32): the last query split of each sequence writes dkc / dvc,
  //    the earlier ones partials, added in split order (cmp_split_of). Rows of no block stay 0.
  if (rc > 0) {
    NSA_CUDA_CHECK(cudaMemsetAsync(L.dkc, 0, sizeof(float) * size_t(rc * p.hkv * p.dqk), s));
    NSA_CUDA_CHECK(cudaMemsetAsync(L.dvc, 0, sizeof(float) * size_t(rc * p.hkv * p.dv), s));
    dispatch_dims<E>(a, s, BwdKernel::dkv_cmp);
    if (L.cmp_splits > 1) {
      reduce_cmp_parts_kernel<<<blocks_for(rc * p.hkv * p.dqk / 4), 256, 0, s>>>(a, L.dkc_part, L.crow_token,
                                                                                int(p.dqk), L.dkc);
      NSA_CUDA_CHECK_LAUNCH();
      reduce_cmp_parts_kernel<<<blocks_for(rc * p.hkv * p.dv / 4), 256, 0, s>>>(a, L.dvc_part, L.crow_token,
                                                                               int(p.dv), L.dvc);
      NSA_CUDA_CHECK_LAUNCH();
    }
  }
  // 5. phi's parameter gradients (and dpre), then its gradient to the raw tokens, of k then of v
  //    (one bf16 copy of dpre / dy): independent K/V straight into dk_cmp / dv_cmp; shared K/V in fp32 for
  //    the raw dk/dv epilogue to add before its one rounding.
  phi::slot_table(L.cu, a.B, p.T, a.d, L.slots, s);
  const int64_t n_slots = phi::slot_count(p.T, p.B, a.d);
  auto phi_grads = [&](const phi::Rows& rows, const PhiParams& prm, const TensorView& x, float* dy, float* pre,
                       const PhiParams& dphi, const OutMat3& out, float* dx32) {
    bool filled = false;
    if (rc > 0)
      filled = phi::backward_params<E>(rows, prm, x, dy, pre, dphi, L.gemm_part, L.row_splits, L.colsum, L.g16, s);
    const uint16_t* g16 = filled ? L.g16 : nullptr;
    if (!p.cfg.shared_kv) {
      phi::backward_x<E>(rows, prm, dy, pre, g16, L.slots, n_slots, phi::DxOut{out.p, out.s0, out.s1, false}, s);
    } else if (rc > 0) {
      phi::backward_x<E>(rows, prm, dy, pre, g16, L.slots, n_slots, phi::DxOut{dx32, 0, 0, true}, s);
    }
  };
  phi_grads(rows_k, in.phi_k, in.kv[kCmp].k, L.dkc, L.pre_k, grads.dphi_k, a.grad_k[kCmp], L.dx_k32);
  phi_grads(rows_v, in.phi_v, in.kv[kCmp].v, L.dvc, L.pre_v, grads.dphi_v, a.grad_v[kCmp], L.dx_v32);
  if (p.cfg.shared_kv && rc > 0) {
    a.phi_dk32 = L.dx_k32;
    a.phi_dv32 = L.dx_v32;
  }
  if (rc == 0) {
    // No compressed block anywhere: phi's parameters get no gradient.
    auto zero = [&](const TensorView& t) {
      if (!t.defined()) return;
      for (int64_t r = 0; r < (t.ndim == 1 ? 1 : t.shape[0]); ++r)
        NSA_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t.data) + r * t.stride[0] * 2, 0,
                                       size_t(t.shape[t.ndim - 1]) * 2, s));
    };
    for (const PhiParams* d : {&grads.dphi_k, &grads.dphi_v}) {
      zero(d->w1); zero(d->b1); zero(d->w2); zero(d->b2); zero(d->pe);
    }
  }

  // 6. Window + selection dk/dv (shared K/V: plus phi's gradient).
  if (a.raw.pool > 0) {  // the long lists' pieces, from the index
    raw_pieces_plan_kernel<<<1, kPlanThreads, 0, s>>>(a);
    NSA_CUDA_CHECK_LAUNCH();
  }
  dispatch_dims<E>(a, s, BwdKernel::dkv_raw);
}

void check_supported(const Config& cfg, const Problem& p) {
  cuda::require_storage_dtype(p.dtype);
  cuda::require_supported_dims(p.dqk, p.dv);
  cuda::require_supported_group(p.hq / std::max<int64_t>(p.hkv, 1));
  if (p.max_seqlen > INT32_MAX / 2)
    throw Error("max_seqlen", std::to_string(p.max_seqlen), "must be < 2^30 for the cuda backward");
  if (p.total_tokens > INT32_MAX / 2)  // packed token indices are int32 in the kernels
    throw Error("T (total tokens)", std::to_string(p.total_tokens), "must be < 2^30 for the cuda backward");
  (void)cfg;
}

}  // namespace

size_t backward_workspace_size(const Context& ctx, const Config& cfg, const Problem& problem) {
  check_supported(cfg, problem);
  const int64_t F = cfg.phi == PhiKind::mlp ? problem.phi_hidden : 0;
  return carve(sizes_of(ctx, cfg, problem, F), nullptr, nullptr).bytes;
}

void backward(const Plan& p, const Inputs& in, const ForwardOutputs& saved, const TensorView& d_o,
              const Gradients& grads, Workspace ws) {
  const Problem prob = problem_of(p);
  check_supported(p.cfg, prob);
  // As in the forward: rows move in 16-byte pieces (slc_dq_kernel's K, V, Q and dO loads, the
  // tensor maps, the copies and the dq / dk / dv stores), so every row starts on 16 bytes. Without
  // this check an unaligned view failed inside a kernel with a misaligned-address error.
  cuda::require_rows_aligned("q", in.q);
  cuda::require_rows_aligned("d_o", d_o);
  cuda::require_rows_aligned("o_branch", saved.o_branch);
  cuda::require_rows_aligned("o_cmp", saved.o_cmp);
  cuda::require_rows_aligned("o_win", saved.o_win);
  cuda::require_rows_aligned("o", saved.o);
  cuda::require_rows_aligned("dq", grads.dq);
  for (int b = 0; b < 3; ++b) {
    const std::string i = "[" + std::to_string(b) + "]";
    const KV& kv = detail::branch_kv(p.cfg, in, b);
    cuda::require_rows_aligned("kv" + i + ".k", kv.k);
    cuda::require_rows_aligned("kv" + i + ".v", kv.v);
    cuda::require_rows_aligned("dkv" + i + ".k", grads.dkv[b].k);
    cuda::require_rows_aligned("dkv" + i + ".v", grads.dkv[b].v);
  }
  if (p.cfg.phi != PhiKind::mean && (in.phi_k.pe.stride[0] != p.dqk || in.phi_v.pe.stride[0] != p.dv ||
                                      grads.dphi_k.pe.stride[0] != p.dqk || grads.dphi_v.pe.stride[0] != p.dv))
    throw Error("phi.pe / dphi.pe", "strided", "must be contiguous [l, D] for the cuda backward");
  if (p.dtype == DType::bf16) run_backward<__nv_bfloat16>(p, in, saved, d_o, grads, ws);
  else run_backward<__half>(p, in, saved, d_o, grads, ws);
}

namespace {

// ---- compress_bwd: phi's backward as a stage op ---------------------------------------------
// The layer backward's phi pieces on their own: dxc (storage type) -> dy in fp32 (rows of no
// block: 0, as the layer backward's dkc there), phi's forward again for mlp's hidden layer, the
// parameter gradients (split-K partials added in a fixed order), then dx for every raw token.

// dy [Rc * Hkv, D] fp32 from dxc [Rc, Hkv, D] (any strides); rows of no compressed block are 0.
template <typename E>
__global__ void dy_from_dxc_kernel(const E* dxc, int64_t s0, int64_t s1, int64_t s2, int64_t rc, int hkv, int D,
                                   const int32_t* crow_token, float* dy) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rc * hkv * D) return;
  const int c = int(i % D);
  const int hk = int((i / D) % hkv);
  const int64_t crow = i / (int64_t(D) * hkv);
  dy[i] = crow_token[crow] < 0 ? 0.f : to_float(dxc[crow * s0 + hk * s1 + c * s2]);
}

Layout carve_compress(const Sizes& z, void* base) {
  WorkspaceCarver w(base);
  Layout L;
  const int64_t rc = cmp_rows(z.T, z.d), rows = rc * z.hkv;
  L.cu = w.take<int32_t>(size_t(z.B + 1));
  L.crow_token = w.take<int32_t>(size_t(std::max<int64_t>(rc, 1)));
  L.dkc = w.take<float>(size_t(rows * z.dqk));  // dy
  if (z.F > 0) {  // mlp: phi's forward again for the hidden layer (its output unused)
    L.kc = w.take<uint16_t>(size_t(rows * z.dqk));
    L.pre_k = w.take<float>(size_t(phi::work_floats(PhiKind::mlp, rows, z.F, z.dqk)));
  }
  if (z.has_params) L.g16 = w.take<uint16_t>(size_t(phi::grad_bf16_elems(z.phi(), rows, z.F, z.dqk)));
  const int64_t blas = z.has_params && z.bf16 ? phi::blas_bytes(z.phi(), rc, z.hkv, z.dqk, z.F, z.l, z.d) : 0;
  if (blas > 0) L.phi_blas = w.take<char>(size_t(blas));
  L.colsum = w.take<float>(size_t(std::max(z.F, z.dqk)));
  L.slots = w.take<int32_t>(size_t(4 * (z.T / z.d + z.B)));
  if (z.has_params) carve_phi_partials(z, rows, w, L);
  L.bytes = w.bytes();
  return L;
}

void check_compress_supported(const Problem& p) {
  cuda::require_storage_dtype(p.dtype);
  if (p.dqk != 64 && p.dqk != 128 && p.dqk != 192)  // the key head dims of the layer backward
    throw Error("D", std::to_string(p.dqk), "is not supported by the cuda compress_bwd (supported: 64, 128, 192)");
  if (p.total_tokens > INT32_MAX / 2)
    throw Error("T (total tokens)", std::to_string(p.total_tokens), "must be < 2^30 for the cuda compress_bwd");
}

template <typename E>
void run_compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                      const TensorView& dx, const PhiParams& dphi, Workspace ws) {
  cudaStream_t s = cuda::stream_of(p);
  Problem prob = problem_of(p);  // (a compress plan: one phi, x [T, Hkv, D])
  prob.hq = p.hkv;
  prob.dv = p.dqk;
  const int64_t F = p.cfg.phi == PhiKind::mlp ? p.phi_hidden_k : 0;
  const Layout L = carve_compress(sizes_of(p.ctx, p.cfg, prob, F), ws.data);
  if (p.T == 0) return;
  const int64_t rc = cmp_rows(p.T, p.cfg.cmp_stride);
  const int D = int(p.dqk);
  upload_cu(p, L.cu, s);
  const phi::Rows rows = phi_rows(p, L, D, F);
  bool filled = false;  // phi's bf16 copy of dpre / dy
  if (rc > 0) {
    phi::row_table(L.cu, int(p.B), p.T, int(p.cfg.cmp_block_len), int(p.cfg.cmp_stride), L.crow_token, s);
    dy_from_dxc_kernel<E><<<blocks_for(rc * p.hkv * D), 256, 0, s>>>(
        static_cast<const E*>(dxc.data), dxc.stride[0], dxc.stride[1], dxc.stride[2], rc, int(p.hkv), D,
        L.crow_token, L.dkc);
    NSA_CUDA_CHECK_LAUNCH();
    if (p.cfg.phi == PhiKind::mlp) phi::forward<E>(rows, phi, x, L.pre_k, L.kc, p.hkv * D, D, true, s);
    filled = phi::backward_params<E>(rows, phi, x, L.dkc, L.pre_k, dphi, L.gemm_part, L.row_splits, L.colsum,
                                     L.g16, s);
  } else {
    // No compressed block: phi's parameters get no gradient.
    for (const TensorView* t : {&dphi.w1, &dphi.b1, &dphi.w2, &dphi.b2, &dphi.pe}) {
      if (!t->defined()) continue;
      for (int64_t r = 0; r < (t->ndim == 1 ? 1 : t->shape[0]); ++r)
        NSA_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t->data) + r * t->stride[0] * 2, 0,
                                       size_t(t->shape[t->ndim - 1]) * 2, s));
    }
  }
  phi::slot_table(L.cu, int(p.B), p.T, int(p.cfg.cmp_stride), L.slots, s);
  phi::backward_x<E>(rows, phi, L.dkc, L.pre_k, filled ? L.g16 : nullptr, L.slots,
                     phi::slot_count(p.T, p.B, p.cfg.cmp_stride), phi::DxOut{dx.data, dx.stride[0], dx.stride[1], false},
                     s);
}

}  // namespace

size_t compress_bwd_workspace_size(const Context& ctx, const Config& cfg, const Problem& problem) {
  check_compress_supported(problem);
  const int64_t F = cfg.phi == PhiKind::mlp ? problem.phi_hidden : 0;
  return carve_compress(sizes_of(ctx, cfg, problem, F), nullptr).bytes;
}

void compress_bwd(const Plan& p, const PhiParams& phi, const TensorView& x, const TensorView& dxc,
                  const TensorView& dx, const PhiParams& dphi, Workspace ws) {
  check_compress_supported(problem_of(p));
  if (p.cfg.phi != PhiKind::mean && (phi.pe.stride[0] != p.dqk || dphi.pe.stride[0] != p.dqk))
    throw Error("phi.pe / dphi.pe", "strided", "must be contiguous [l, D] for the cuda compress_bwd");
  if (p.dtype == DType::bf16) run_compress_bwd<__nv_bfloat16>(p, phi, x, dxc, dx, dphi, ws);
  else run_compress_bwd<__half>(p, phi, x, dxc, dx, dphi, ws);
}

}  // namespace nsa::cuda::bwd
