// The backward attention kernels' launchers, explicitly instantiated once per dtype and Dqk in
// instantiations/.
#pragma once

#include "cuda/backward/dkv_kernel.cuh"
#include "cuda/backward/dkv_ws_kernel.cuh"
#include "cuda/backward/dq_kernel.cuh"
#include "cuda/backward/slc_dq.cuh"

namespace nsa::cuda::bwd {

// Explicitly instantiated once per dtype and Dqk (attention_<dtype>_hdim<Dqk>.cu).

// Two ~105 KB blocks per SM (Dqk, Dv <= 128) need the largest shared-memory carve-out.
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes) {
  cuda::allow_smem(kernel, bytes, /*max_carveout=*/true);
}

// A [rows, Hkv, D] map (boxes of 64 rows x 64 columns) of the tensor at p with strides st, sh (elements).
template <typename E, int D>
bool dq_rows_map(CUtensorMap* map, const void* p, int64_t rows, int64_t st, int64_t sh, int hkv) {
  if (p == nullptr || rows <= 0) return false;
  return cuda::make_rows_tensor_map(map, kIsBf16<E>, p, D, uint64_t(hkv), uint64_t(rows), st, sh, kKeys);
}
// Whether kKernel runs its sm_90a body (cuda::runs_wgmma_body), asked once per kernel.
template <auto kKernel>
bool runs_sm90() {
  static const bool sm90 = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, kKernel) == cudaSuccess && cuda::runs_wgmma_body(attr);
  }();
  return sm90;
}

// dq_kernel's maps, for the branches that have keys; false where one cannot be made or the
// kernel runs the sm_80 body (no TMA there).
template <typename E, int DQK, int DV>
bool dq_tensor_maps(DqMaps& m, const BwdArgs& a) {
  if (!runs_sm90<dq_kernel<E, DQK, DV>>() || !a.vec || !a.choices.tma) return false;
  const bool cmp = a.rc > 0, win = a.w > 0, slc = a.slc_union;
  if (!cmp && !win && !slc) return false;
  if (slc && !(dq_rows_map<E, DQK>(&m.ks, a.k[kSlc].p, a.T, a.k[kSlc].s0, a.k[kSlc].s1, a.hkv) &&
               dq_rows_map<E, DV>(&m.vs, a.v[kSlc].p, a.T, a.v[kSlc].s0, a.v[kSlc].s1, a.hkv)))
    return false;
  if (cmp && !(dq_rows_map<E, DQK>(&m.kc, a.kc, a.rc, int64_t(a.hkv) * DQK, DQK, a.hkv) &&
               dq_rows_map<E, DV>(&m.vc, a.vc, a.rc, int64_t(a.hkv) * DV, DV, a.hkv)))
    return false;
  if (win && !(dq_rows_map<E, DQK>(&m.kw, a.k[kWin].p, a.T, a.k[kWin].s0, a.k[kWin].s1, a.hkv) &&
               dq_rows_map<E, DV>(&m.vw, a.v[kWin].p, a.T, a.v[kWin].s0, a.v[kWin].s1, a.hkv)))
    return false;
  return true;
}

// Maps of q and dO as [T, Hq, D] views, boxes of `tokens` tokens x G heads; false where one
// cannot be made.
template <typename E, int DQK, int DV>
bool q_do_tensor_maps(CUtensorMap* q, CUtensorMap* d_o, const BwdArgs& a, uint32_t tokens) {
  const uint32_t g = uint32_t(a.G);
  return cuda::make_rows_tensor_map(q, kIsBf16<E>, a.q.p, DQK, uint64_t(a.hq), uint64_t(a.T), a.q.s0, a.q.s1, tokens,
                                    g) &&
         cuda::make_rows_tensor_map(d_o, kIsBf16<E>, a.d_o.p, DV, uint64_t(a.hq), uint64_t(a.T), a.d_o.s0, a.d_o.s1,
                                    tokens, g);
}

// dkv_kernel<cmp> / <raw>'s maps of q and dO: boxes of a query tile's kRows / G tokens; false
// where one cannot be made or the kernel runs the sm_80 body (no TMA there).
template <typename E, int DQK, int DV>
bool dkv_tensor_maps(DkvMaps& m, const BwdArgs& a) {
  if (!runs_sm90<dkv_kernel<E, DQK, DV, KeySet::cmp>>() || !a.vec || a.T <= 0 || !a.choices.tma) return false;
  return q_do_tensor_maps<E, DQK, DV>(&m.q, &m.d_o, a, uint32_t(kRows / a.G));
}

// slc_dq_kernel's maps of the selection's k and v ([T, Hkv, D], boxes of 16 rows x 64 columns):
// false where the kernel runs the sm_80 body, a map cannot be made, TMA is switched off
// (CudaKernelChoices::tma) or the TMA layout does not hold two CTAs per SM at this capacity.
template <typename E, int DQK, int DV>
bool slc_dq_tensor_maps(SlcDqMaps& m, const BwdArgs& a, int cap) {
  if (!runs_sm90<slc_dq_kernel<E, DQK, DV>>() || !a.vec || a.T <= 0 || !a.choices.tma ||
      !slc_dq_tma_fits(DQK, DV, cap))
    return false;
  const Mat3& k = a.k[kSlc];
  const Mat3& v = a.v[kSlc];
  return cuda::make_rows_tensor_map(&m.k, kIsBf16<E>, k.p, DQK, uint64_t(a.hkv), uint64_t(a.T), k.s0, k.s1, 16) &&
         cuda::make_rows_tensor_map(&m.v, kIsBf16<E>, v.p, DV, uint64_t(a.hkv), uint64_t(a.T), v.s0, v.s1, 16);
}

// Whether the selection's union tiles run (BwdArgs::slc_union): sm_90a's dq_kernel (wgmma), l' = one
// key tile, a selection branch, the warps' sorts fitting dq_kernel's K/V buffers, and not switched
// off (CudaKernelChoices::slc_union_tiles, shared with the forward). dq_kernel and slc_dq_kernel
// must agree on it: both launches ask here.
template <typename E, int DQK, int DV>
bool slc_union_enabled(const BwdArgs& a) {
  return runs_sm90<dq_kernel<E, DQK, DV>>() && a.n > 0 && a.lp == kKeys && a.choices.slc_union_tiles &&
         DqSmem<E, DQK, DV>::slc_union_sorts_fit(a.slc_cap);
}

// Whether dK / dV run warp-specialised (dkv_ws_kernel.cuh): its sm_90a body (Dqk = Dv = 128), rows
// 16-byte aligned (its copies are cp.async and TMA only) and not switched off
// (CudaKernelChoices::dkv_warp_specialized).
template <typename E, int DQK, int DV>
bool dkv_ws_enabled(const BwdArgs& a) {
  return DQK == 128 && DV == 128 && a.vec && a.choices.dkv_warp_specialized &&
         runs_sm90<dkv_ws_kernel<E, DQK, DV, KeySet::cmp>>();
}

// How many dkv_kernel<cmp> CTAs (the warp-specialised one where it runs) the device holds at once:
// the places cmp_splits_balanced schedules the compressed keys' splits on.
template <typename E, int DQK, int DV>
int dkv_cmp_resident_ctas(const CudaKernelChoices& c) {
  static_assert(kKeys == kCmpKeyTile && kRows == kTileRows, "the split model's tiles are the kernel's");
  if constexpr (DQK == 128 && DV == 128) {
    if (c.dkv_warp_specialized && runs_sm90<dkv_ws_kernel<E, DQK, DV, KeySet::cmp>>()) {
      allow_smem(dkv_ws_kernel<E, DQK, DV, KeySet::cmp>, DkvWsSmem<E, DQK, DV>::kLaunch);
      return resident_ctas(dkv_ws_kernel<E, DQK, DV, KeySet::cmp>, kWsThreads, DkvWsSmem<E, DQK, DV>::kLaunch);
    }
  }
  using Lk = DkvSmem<E, DQK, DV>;
  const size_t smem = runs_sm90<dkv_kernel<E, DQK, DV, KeySet::cmp>>() ? Lk::kSwLaunch : Lk::kEnd;
  allow_smem(dkv_kernel<E, DQK, DV, KeySet::cmp>, smem);
  return resident_ctas(dkv_kernel<E, DQK, DV, KeySet::cmp>, kThreads, smem);
}

// The backward's attention kernels, in the order backward() launches them.
enum class BwdKernel : int {
  dq,       // dq_kernel: dq and dg of the compressed and window branches (and the union tiles' selection)
  slc_dq,   // slc_dq_kernel: the selection branch's dq and dg of the other row tiles
  dkv_cmp,  // dkv_kernel<cmp>: the compressed keys' dk / dv (fp32, per query split)
  dkv_raw,  // dkv_kernel<raw>: the raw keys' dk / dv (window + selection)
};

template <typename E, int DQK, int DV>
void launch_attention(const BwdArgs& a_in, cudaStream_t s, BwdKernel kernel_kind) {
  BwdArgs a = a_in;
  a.slc_cap = slc_dq_capacity(a.G, a.n);
  a.slc_union = slc_union_enabled<E, DQK, DV>(a);
  if (kernel_kind == BwdKernel::slc_dq) {  // after dq_kernel ran without the selection
    const int cap = a.slc_cap;
    const dim3 grid = cuda::row_tile_grid(a.max_seqlen, a.B, (16 / a.G) * kSlcDqWarps, a.hkv);
    if (grid.x == 0) return;
    SlcDqMaps maps{};
    maps.on = slc_dq_tensor_maps<E, DQK, DV>(maps, a, cap) ? 1 : 0;
    const size_t smem = maps.on ? slc_dq_tma_smem_bytes(DQK, DV, cap) : slc_dq_smem_bytes(DQK, DV, cap);
    cuda::allow_smem(slc_dq_kernel<E, DQK, DV>, smem, /*max_carveout=*/true);  // the warps' rings
    slc_dq_kernel<E, DQK, DV><<<grid, kSlcDqWarps * 32, smem, s>>>(a, cap, maps);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  if (kernel_kind == BwdKernel::dq) {
    const size_t smem = runs_sm90<dq_kernel<E, DQK, DV>>() ? DqSmem<E, DQK, DV>::kSwLaunch : DqSmem<E, DQK, DV>::kEnd;
    allow_smem(dq_kernel<E, DQK, DV>, smem);
    const dim3 grid = cuda::row_tile_grid(a.max_seqlen, a.B, kRows / a.G, a.hkv);
    if (grid.x == 0) return;
    DqMaps maps{};
    maps.on = dq_tensor_maps<E, DQK, DV>(maps, a) ? 1 : 0;
    dq_kernel<E, DQK, DV><<<grid, kThreads, smem, s>>>(a, maps);
    NSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const bool cmp = kernel_kind == BwdKernel::dkv_cmp;
  const int64_t tiles = cmp ? a.B * ((num_cmp_blocks(a.max_seqlen, a.l, a.d) + kKeys - 1) / kKeys)
                            : a.B * int64_t(a.n_slc_max) * ((a.lp + kKeys - 1) / kKeys);
  if (tiles == 0) return;
  DkvMaps maps{};
  // (raw: the window's query tiles alone are consecutive tokens)
  maps.on = (cmp || a.w > 0) && dkv_tensor_maps<E, DQK, DV>(maps, a) ? 1 : 0;
  // (raw.pool > 0: the extra CTAs of the long lists' pieces in front, backward.cu planned them)
  const dim3 grid = cmp ? dim3(unsigned(tiles), unsigned(a.hkv), unsigned(a.cmp_splits))
                        : dim3(unsigned(tiles + a.raw.extra_x), unsigned(a.hkv));
  auto run = [&](auto* kernel, int threads, size_t smem) {
    allow_smem(kernel, smem);
    kernel<<<grid, threads, smem, s>>>(a, maps);
    NSA_CUDA_CHECK_LAUNCH();
  };
  if constexpr (DQK == 128 && DV == 128) {
    if (dkv_ws_enabled<E, DQK, DV>(a)) {
      // (a selection tile's gathered rows: a box of one token x G heads per token)
      if (!cmp && a.n > 0 && a.G >= 8 && a.vec && a.choices.tma)
        maps.list = q_do_tensor_maps<E, DQK, DV>(&maps.q1, &maps.d_o1, a, 1) ? 1 : 0;
      if (cmp)
        run(dkv_ws_kernel<E, DQK, DV, KeySet::cmp>, kWsThreads, DkvWsSmem<E, DQK, DV>::kLaunch);
      else
        run(dkv_ws_kernel<E, DQK, DV, KeySet::raw>, kWsThreads, DkvWsSmem<E, DQK, DV>::kLaunch);
      return;
    }
  }
  using Lk = DkvSmem<E, DQK, DV>;
  const size_t smem = runs_sm90<dkv_kernel<E, DQK, DV, KeySet::cmp>>() ? Lk::kSwLaunch : Lk::kEnd;
  if (cmp)
    run(dkv_kernel<E, DQK, DV, KeySet::cmp>, kThreads, smem);
  else
    run(dkv_kernel<E, DQK, DV, KeySet::raw>, kThreads, smem);
}

}  // namespace nsa::cuda::bwd
