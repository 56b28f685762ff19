// dq_kernel's mainloop on sm_80 (and in the compute_80 PTX): the key tiles double-buffered by
// cp.async in the padded layout (DqSmem::kK ..), their products on mma.sync from ldmatrix
// fragments, 32 keys (kSub) at a time, each warp on its 16 rows. The masking, P and dS are the
// kernel's (DqMask, dq_kernel.cuh); the same interface on sm_90a: dq_mainloop_sm90.cuh.
#pragma once

#include <type_traits>

#include "cuda/backward/dq_smem.cuh"

namespace nsa::cuda::bwd {

template <typename E, int DQK, int DV>
struct DqMainloopSm80 {
  using L = DqSmem<E, DQK, DV>;
  static constexpr int kLdK = DQK + kPad, kLdV = DV + kPad;
  // Elements from one K (V) buffer to the next.
  static constexpr int kKBuf = kKeys * kLdK;
  static constexpr int kVBuf = kKeys * kLdV;
  E* sK;
  E* sV;
  E* sQ;
  E* sDo;
  float* rs;  // the rows' state (DqSmem::kRowState)

  __device__ __forceinline__ explicit DqMainloopSm80(unsigned char* smem)
      : sK(reinterpret_cast<E*>(smem + L::kK)),
        sV(reinterpret_cast<E*>(smem + L::kV)),
        sQ(reinterpret_cast<E*>(smem + L::kQ)),
        sDo(reinterpret_cast<E*>(smem + L::kDo)),
        rs(reinterpret_cast<float*>(smem + L::kRowState)) {}
  __device__ __forceinline__ float* row_state() const { return rs; }

  // The tile's Q and dO rows (row pointers as copy_rows takes them), not yet committed.
  template <typename QRow, typename DoRow>
  __device__ __forceinline__ void load_q_do(const BwdArgs& a, QRow&& q_row, DoRow&& do_row, const E* qb, const E* dob) {
    copy_rows<E, DQK>(sQ, q_row, a.vec, qb);
    copy_rows<E, DV>(sDo, do_row, a.vec, dob);
  }
  // The selection's union tiles are sm_90a's (dq_mainloop_sm90.cuh): none here.
  __device__ __forceinline__ void union_tiles(const BwdArgs&, int, int, int64_t, int, int, int, int, int&,
                                              const int32_t*&, const unsigned long long*&) {}
  // Nothing to set up before the first sweep (no tensor maps), and no copy sent ahead of it.
  __device__ __forceinline__ void start(const DqMaps&) {}
  template <typename Tiles>
  __device__ __forceinline__ void prime(const BwdArgs&, const Tiles&) {}

  // dO[r][8 nt + 2 quad], the first of the pair of columns the thread's C fragment holds.
  __device__ __forceinline__ const E* do_pair(int r, int quad, int nt) const {
    return sDo + r * kLdV + 2 * quad + nt * 8;
  }

  // Copies key tile i into K/V buffer buf.
  template <typename Tiles>
  __device__ __forceinline__ void issue(const BwdArgs& a, const Tiles& tiles, int i, int buf) {
    const E* kb;
    const E* vb;
    int64_t ks, vs;
    const KeyTile kt = tiles.at(a, i, kb, ks, vb, vs);
    // (kb may point past the tensor for an empty chunk: zero-filled rows take qb as their address)
    copy_rows<E, DQK>(sK + buf * kKBuf, [&](int c) -> const E* { return c < kt.nk ? kb + c * ks : nullptr; },
                      a.vec, tiles.qb);
    copy_rows<E, DV>(sV + buf * kVBuf, [&](int c) -> const E* { return c < kt.nk ? vb + c * vs : nullptr; },
                     a.vec, tiles.qb);
  }

  // One sweep over the key tiles (DqKeyTiles), two-stage: tile j + 1's copy goes out before tile
  // j is computed. enter(prev, next) runs (block-uniformly) between stages (prev = -1 first, next
  // = 3 last; the stages are the branches in index order); half(tk, tv, kt, c0) does keys c0 ..
  // c0 + 31 of a tile in K/V buffers tk, tv, in a warp with a row that sees the tile. skip_cmp,
  // skip_slc, skip_win: the sweep leaves out the compressed tiles (pass 1 with a.dg_cmp_ready),
  // the selection's (pass 1 with a.d_from_o), the window's (pass 1 with a.dg_win_ready); j counts
  // the tiles it takes (buffers alternate with j), real(j) is the tile.
  // (kOverlap: sm_90a's; here every tile's products complete inside it.)
  template <bool kOverlap = false, typename Tiles, typename Choose, typename CtaSees, typename Enter, typename Half>
  __device__ __forceinline__ void sweep(const BwdArgs& a, const Tiles& tiles, bool skip_cmp, bool skip_slc,
                                        bool skip_win, Choose&& choose, CtaSees&&, Enter&& enter, Half&& half) {
    int cur = -1;
    const int n_run = tiles.runs(skip_cmp, skip_slc, skip_win);
    auto real = [&](int j) { return tiles.run_tile(j, skip_cmp, skip_slc); };
    if (n_run > 0) issue(a, tiles, real(0), 0);
    cuda::cp_async_commit();
    for (int j = 0; j < n_run; ++j) {
      const int i = real(j);
      const E* kb;
      const E* vb;
      int64_t ks, vs;
      const KeyTile kt = tiles.at(a, i, kb, ks, vb, vs);
      if (j + 1 < n_run) issue(a, tiles, real(j + 1), (j + 1) & 1);  // its buffer's last reader (tile j-1) is done
      cuda::cp_async_commit();
      cuda::cp_async_wait<1>();
      __syncthreads();
      const int stage = tiles.branch_of(i);
      for (; cur < stage; ++cur) enter(cur, cur + 1);
      // A warp none of whose rows sees a key of the tile skips it.
      if (__any_sync(0xffffffffu, choose(kt))) {
#pragma unroll 1
        for (int c0 = 0; c0 < kKeys; c0 += kSub) half(sK + (j & 1) * kKBuf, sV + (j & 1) * kVBuf, kt, c0);
      }
      __syncthreads();
    }
    cuda::cp_async_wait<0>();
    __syncthreads();
    for (; cur < 2; ++cur) enter(cur, cur + 1);
    enter(2, 3);
  }

  // (sm_90a's overlapped sweep leaves a product in flight; here none is.)
  template <int N>
  __device__ __forceinline__ void drain(float (&)[N][4]) {}

  // Pass 1, keys c0 .. c0 + 31: S = Q K^T, P, then O += P V.
  template <typename P, typename PWg>
  __device__ __forceinline__ void output_products(float (&acc_o)[DV / 8][4], int row0, const E* tk, const E* tv,
                                                  const KeyTile& kt, int c0, P&& probabilities, PWg&&) {
    float s[kSubTiles][4];
    mma_abt<E, DQK, kSubTiles>(s, sQ + row0 * kLdK, tk + c0 * kLdK);
    probabilities(s, kt, c0);
    uint32_t pf[kSubTiles / 2][4];
    to_operand<E, kSubTiles>(s, pf);
    mma_ab<E, DV, kSubTiles / 2>(acc_o, pf, tv + c0 * kLdV);
  }
  // Pass 2, keys c0 .. c0 + 31: S = Q K^T, dP = dO V^T, dS (dscores), then dQ += dS K. (acc_dg,
  // the union tiles' dg, is sm_90a's.)
  template <typename P, typename PWg, typename DScores>
  __device__ __forceinline__ void dq_products(float (&acc_q)[DQK / 8][4], int row0, const E* tk, const E* tv,
                                              const KeyTile& kt, int c0, P&& probabilities, PWg&&, DScores&& dscores,
                                              bool) {
    float s[kSubTiles][4], dp[kSubTiles][4];
    mma_abt<E, DQK, kSubTiles>(s, sQ + row0 * kLdK, tk + c0 * kLdK);
    mma_abt<E, DV, kSubTiles>(dp, sDo + row0 * kLdV, tv + c0 * kLdV);
    probabilities(s, kt, c0);
    dscores(s, dp, std::false_type{});
    uint32_t df[kSubTiles / 2][4];
    to_operand<E, kSubTiles>(s, df);
    mma_ab<E, DQK, kSubTiles / 2>(acc_q, df, tk + c0 * kLdK);
  }
};

}  // namespace nsa::cuda::bwd
