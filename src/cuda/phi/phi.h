// phi on the GPU (spec §2): the one implementation of the compression function and its
// gradients that the forward, the backward and the compress stage ops all call. phi.cu holds it;
// gemm.cuh the tensor-core product under it. (The decode path's append, which compresses one
// block at a time as tokens arrive, has its own per-block code in decode/append.cu.)
//
// Rows: compressed row r of the packed layout (nsa/blocks.h: sequence b's blocks start at row
// cu[b] / d) and KV head h make matrix row m = r * Hkv + h. Every kernel finds a row's block
// through one table, first_token[r] (row_table): the block's first packed token, or -1 when no
// sequence uses the row.
//   mean:   xc = mean of the block's l rows (fp32 sum).
//   linear: xc = u W^T, u = flatten(block + pe) gathered straight from x: [M, l*D] x [l*D, D].
//   mlp:    pre = u W1^T + b1 (fp32, kept: the backward's dpre goes in its place), then
//           xc = gelu(pre) W2^T + b2.
// Backward, from dy = dLoss/dxc (fp32 [M, D]):
//   parameters: dW2 = dy^T gelu(pre), db2 = colsum(dy), dpre = (dy W2) gelu'(pre),
//               dW1 = dpre^T u, db1 = colsum(dpre), dpe = W1^T colsum(dpre) (linear: dW = dy^T u,
//               dpe = W^T colsum(dy)); split-K partials added in a fixed order.
//   x:          dx[token] = sum over the blocks holding it of the row of dpre W1 (linear: dy W)
//               that belongs to the token. A token at position p = q d + rr of its sequence lies
//               in blocks q - s, s = 0 .. ceil(l / d) - 1 (those that exist and reach it), at row
//               rr + s d of each: for a fixed rr that is one product over "slots" q,
//               [slots, S*F] x [S*F, D], A's row q holding dpre of blocks q, q-1, .. and B
//               W1's columns of rows rr, rr + d, ..; batched over (rr, head). No atomics, no
//               [M, l*D] intermediate.
// Products run on tensor cores with fp32 accumulation. With bf16 storage (and x's and W1's rows in
// 16-byte pieces, F a multiple of 8) the products with l*D = 4096-long operands (u W1^T, dW1, x's
// gradient) copy their bf16 operands as stored (gemm_direct.cuh): u without pe, pe folded into the
// bias (u W1^T + b1 = x W1^T + (pe W1^T + b1); dW1 = dpre^T x + colsum(dpre) pe^T), and dpre (linear:
// dy) rounded once to bf16 (the precision of the attention kernels' P and dS operands and of a bf16
// autograd's own dpre). The others, and fp16 storage, convert their elements on the way to shared
// memory (gemm.cuh, fp32 operands as bf16 high and low parts). Every output is one thread's fixed-order sum:
// the same inputs give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "nsa/api.h"
#include "nsa/blocks.h"

namespace nsa::cuda::phi {

struct Rows {
  PhiKind kind = PhiKind::mean;
  const int32_t* first_token = nullptr;  // [rc] (row_table)
  int64_t rc = 0;                        // compressed rows, floor(T / d)
  int hkv = 0, D = 0, l = 0, d = 0;
  int F = 0;  // mlp: hidden width
  bool wgmma = true;  // the direct products on wgmma where the GPU runs it (CudaKernelChoices::phi_wgmma)
  bool blas = true;   // the large products on cuBLASLt where they can (CudaKernelChoices::phi_blas)
  // Their scratch (blas_bytes, 256-byte aligned), the caller's; nullptr: the library's own kernels.
  void* blas_scratch = nullptr;
};

// The rows of one compressed tensor of T tokens: hkv heads of dim D, hidden width F (mlp only).
inline Rows rows_of(const Config& cfg, int64_t T, int64_t hkv, int64_t D, int64_t F, const int32_t* first_token,
                    bool wgmma, bool blas) {
  Rows r;
  r.kind = cfg.phi;
  r.first_token = first_token;
  r.rc = cmp_rows(T, cfg.cmp_stride);
  r.hkv = static_cast<int>(hkv);
  r.D = static_cast<int>(D);
  r.l = static_cast<int>(cfg.cmp_block_len);
  r.d = static_cast<int>(cfg.cmp_stride);
  r.F = cfg.phi == PhiKind::mlp ? static_cast<int>(F) : 0;
  r.wgmma = wgmma;
  r.blas = blas;
  return r;
}

// Bytes of the scratch of phi's products on cuBLASLt (blas.h) for rc compressed rows of hkv heads
// of dim D (the larger of the two phis'), hidden width F (mlp): 0 where they never run there (phi
// = mean, or l not a multiple of d). Holds cuBLASLt's workspace, then one of: the blocks' chunks
// of x (bf16 [(rc + l/d - 1) * hkv, d * D]) with linear's fp32 product [rc * hkv, D]; x's gradient
// by chunk (fp32, the chunks' shape); mlp's second layer in fp32 (gelu(pre) or dpre's product
// [rc * hkv, F], W2 [D, F], the output [rc * hkv, D]).
int64_t blas_bytes(PhiKind kind, int64_t rc, int64_t hkv, int64_t D, int64_t F, int64_t l, int64_t d);

// first_token[r] for r < floor(T / d); cu: device offsets [B + 1], or nullptr for one sequence of T.
void row_table(const int32_t* cu, int B, int64_t T, int l, int d, int32_t* first_token, cudaStream_t s);

// Slots of x's gradient: slot j is (sequence b, q) with j = cu[b] / d + b + q, q < ceil(len_b / d);
// 4 ints each: first token q d of the sequence's (packed), its compressed row cu[b] / d + q, the
// sequence's end, unused (-1 first: no slot). The count covers every sequence's slots: exactly
// ceil(T / d) for one sequence (where 128 d divides T, T / d + 1 would add to x's gradient
// product a 128-row tile of one empty slot), T / d + B for several, whose lengths the host does not know.
inline int64_t slot_count(int64_t T, int64_t B, int64_t d) { return B == 1 ? (T + d - 1) / d : T / d + B; }
void slot_table(const int32_t* cu, int B, int64_t T, int d, int32_t* slots, cudaStream_t s);

// Floats of forward's work area for `rows` = rc * Hkv matrix rows: mlp's pre [rows, F], then the
// folded bias (F for mlp, D for linear).
int64_t work_floats(PhiKind kind, int64_t rows, int64_t F, int64_t D);
// bf16 elements of the copy of dpre (linear: dy) that backward_params rounds for the direct products.
int64_t grad_bf16_elems(PhiKind kind, int64_t rows, int64_t F, int64_t D);

// xc [rc, Hkv, D] (strides xc_st, xc_sh) = phi(x); work: work_floats (mlp's pre [rc * Hkv, F] fp32
// first). write_unused = false leaves rows of no block untouched (the forward's contract); true
// writes them from a zero block (the backward's workspace).
template <typename E>
void forward(const Rows& r, const PhiParams& phi, const TensorView& x, float* work, void* xc, int64_t xc_st,
             int64_t xc_sh, bool write_unused, cudaStream_t s);

// One phi of forward_pair: its parameters, input, work area (work_floats) and output xc [rc, Hkv,
// D] at strides xc_st, xc_sh.
struct Job {
  PhiParams phi;
  TensorView x;
  float* work = nullptr;
  void* xc = nullptr;
  int64_t xc_st = 0, xc_sh = 0;
};
// forward of two phis (of k and of v) with write_unused as forward's. Where both have the same
// rows, D, F and product path (phi = linear or mlp) and `paired` (CudaKernelChoices::phi_pairs),
// each product runs once for both, the two as the batches of one launch (at short lengths one
// phi's grid leaves SMs idle); else one after the other. The outputs are forward's, bit for bit.
// The work areas must not overlap (the same one for both: one after the other).
template <typename E>
void forward_pair(const Rows& r0, const Job& j0, const Rows& r1, const Job& j1, bool write_unused, bool paired,
                  cudaStream_t s);

// Parameter gradients into dphi (storage dtype, rows of stride stride[0]) from dy [rc * Hkv, D]
// fp32 (rows of no block: 0); mlp: pre (from forward) becomes dpre in place. part: splits
// partial planes of the largest parameter; colsum: max(F, D) floats; g16: grad_bf16_elems, or
// nullptr. Returns whether it filled g16 (the direct products ran), for backward_x.
template <typename E>
bool backward_params(const Rows& r, const PhiParams& phi, const TensorView& x, const float* dy, float* pre,
                     const PhiParams& dphi, float* part, int splits, float* colsum, uint16_t* g16, cudaStream_t s);

// x's gradient: every token of x (tokens of no block: 0). f32: contiguous [T, Hkv, D] floats at
// p; else the storage dtype with strides s0, s1.
struct DxOut {
  void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  bool f32 = false;
};
// g16: the copy backward_params filled (its return value), else nullptr.
template <typename E>
void backward_x(const Rows& r, const PhiParams& phi, const float* dy, const float* dpre, const uint16_t* g16,
                const int32_t* slots, int64_t n_slots, const DxOut& out, cudaStream_t s);

}  // namespace nsa::cuda::phi
