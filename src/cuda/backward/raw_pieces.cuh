// The backward's plan of the raw blocks' long selection lists (BwdArgs::raw): which lists
// dkv_kernel<raw> cuts into pieces run by extra CTAs, computed on the device by one CTA before
// that kernel. Included by backward.cu.
#pragma once

#include "cuda/backward/tile.cuh"
#include "cuda/params.h"

namespace nsa::cuda::bwd {

// ---- raw_pieces_plan_kernel: which raw blocks' lists are cut into pieces (BwdArgs::raw) --

constexpr int kPlanThreads = 1024;

// Query tiles of raw CTA x of KV head hk as dkv_kernel<raw> counts them: its window's (n0) and its
// block's list's (n1).
__device__ inline void raw_cta_tiles(const BwdArgs& a, int hk, int x, int& n0, int& n1) {
  n0 = n1 = 0;
  const int tq = kRows / a.G;
  const int chunks = (a.lp + kKeys - 1) / kKeys;
  const int per_seq = a.n_slc_max * chunks;
  const int b = x / per_seq, j = (x % per_seq) / chunks;
  const int key0 = j * a.lp + (x % chunks) * kKeys;
  const int64_t s0 = seq_start(a.cu, b);
  const int len = int(seq_start(a.cu, b + 1) - s0);
  if (key0 >= len) return;
  const int nk = min(kKeys, min((j + 1) * a.lp, len) - key0);
  if (a.w > 0) n0 = (min(len - 1, key0 + nk - 1 + a.w - 1) - key0 + tq) / tq;
  if (a.n > 0) {
    const int64_t key = (int64_t(hk) * a.B + b) * a.n_slc_max + j;
    const int first = a.sel_offsets[key], last = a.sel_offsets[key + 1];
    n1 = (last - first + tq - 1) / tq;
  }
}

// Block-wide sum (exclusive = false) or exclusive prefix sum (true) of one value per thread, in a
// fixed order (integers: exact either way). Every thread of the block calls it.
__device__ inline long long plan_block_scan(long long v, bool exclusive, long long* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const long long u = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += u;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  long long before = 0, all = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  __syncthreads();  // warp_sums may be reused
  return exclusive ? before + inc - v : all;
}

// One CTA: the cap from every raw CTA's tiles (doubled until the pieces fit the raw.pool slots),
// then the lists longer than cap in the order (j, chunk, b, hk), each in ceil(n1 / cap) pieces
// with one slot per piece. Writes raw.split for every raw CTA, raw.slot for every slot and zeroes the
// arrival counters. Depends only on the index: the same pieces, run after run.
__global__ void __launch_bounds__(kPlanThreads) raw_pieces_plan_kernel(const BwdArgs a) {
  __shared__ long long warp_sums[kPlanThreads / 32];
  const int ctas = a.hkv * a.raw.x;
  for (int s = threadIdx.x; s < a.raw.pool; s += blockDim.x) {
    a.raw.slot[s] = make_int2(-1, 0);
    a.raw.arrived[s] = 0;
  }
  long long mine = 0;
  for (int r = threadIdx.x; r < ctas; r += blockDim.x) {
    int n0, n1;
    raw_cta_tiles(a, r / a.raw.x, r % a.raw.x, n0, n1);
    mine += n0 + n1;
  }
  const long long total = plan_block_scan(mine, false, warp_sums);
  const long long rule = (total + kRawTargetCtas - 1) / kRawTargetCtas;
  // Thread t: positions [t per, (t + 1) per) of the order; position q = ((j chunks + c) B + b) Hkv + hk.
  const int chunks = (a.lp + kKeys - 1) / kKeys;
  const int per = (ctas + int(blockDim.x) - 1) / int(blockDim.x);
  const int q0 = min(ctas, int(threadIdx.x) * per), q1 = min(ctas, q0 + per);
  auto cta_of = [&](int q) {
    const int hk = q % a.hkv, rest = q / a.hkv;
    const int b = rest % a.B, jc = rest / a.B;
    return hk * a.raw.x + b * a.n_slc_max * chunks + jc;  // jc = j * chunks + c
  };
  long long cap = a.raw.piece_tiles > 0 ? a.raw.piece_tiles : rule > kRawMinPieceTiles ? rule : kRawMinPieceTiles;
  auto pieces_of = [&](int r) {
    int n0, n1;
    raw_cta_tiles(a, r / a.raw.x, r % a.raw.x, n0, n1);
    return n1 > cap ? int((n1 + cap - 1) / cap) : 1;
  };
  auto need_of = [&] {
    long long need = 0;
    for (int q = q0; q < q1; ++q) {
      const int p = pieces_of(cta_of(q));
      if (p > 1) need += p;
    }
    return need;
  };
  // Every cut list gets its slots: where they would not fit the pool, the cap doubles (the same for
  // every thread: a block-wide sum) until they do.
  long long need = need_of();
  while (plan_block_scan(need, false, warp_sums) > a.raw.pool) {
    cap *= 2;
    need = need_of();
  }
  long long base = plan_block_scan(need, true, warp_sums);
  __syncthreads();  // the slots' reset above is done
  for (int q = q0; q < q1; ++q) {
    const int r = cta_of(q);
    const int p = pieces_of(r);
    if (p > 1 && base + p <= a.raw.pool) {
      a.raw.split[r] = make_int2(int(base), p);
      for (int i = 0; i < p; ++i) a.raw.slot[base + i] = make_int2(r, i);
    } else {
      a.raw.split[r] = make_int2(-1, 1);
    }
    if (p > 1) base += p;
  }
}

}  // namespace nsa::cuda::bwd
