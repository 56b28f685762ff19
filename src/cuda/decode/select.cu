// Decode, stage 2 of 4: for one (query, KV head), every compressed split's (m, l) merged into the
// group's log-sum-exps, the selection scores S (spec §3) from the splits' partial scores, and the
// query's own top-n (spec §4, common/topn_row.cuh). Also the check of the query's sequence: its
// length, rows and every page id its length needs (the stages that read pages only guard their
// reads): the KV head 0 CTA ORs the CacheStatus bits into status[b] and writes row_ok.
//
// Grid (max(queries, B), Hkv); 8 warps. The KV head 0 CTA x < B also checks sequence x's row range,
// so a sequence that no row resolves to (its cu_seqlens entries broken) is reported too. Dense
// decoding runs only the checks (grid (max(queries, B), 1)).
#include "cuda/common/check.h"
#include "cuda/common/topn_row.cuh"
#include "cuda/decode/common.cuh"
#include "cuda/decode/decode.h"

namespace nsa::cuda::decode {

namespace {

constexpr int kSelectThreads = 256;

// Bytes before the candidate scratch (select_kernel's shared layout).
__host__ __device__ size_t select_cand_offset(const DecodeParams& p, int64_t ns_max) {
  const size_t bytes = sizeof(float) * (3 * static_cast<size_t>(p.cmp_splits) * p.group + static_cast<size_t>(ns_max)) +
                       sizeof(int32_t) * static_cast<size_t>(p.n_sel > 0 ? p.n_sel : 1);
  return (bytes + 15) / 16 * 16;
}

// Shared layout: the merge factors [cmp_splits][G], the scores row [Ns], the chosen list [n], then
// from a 16-byte boundary warp_topn's candidate scratch (kTopnCandidates keys).
__global__ void __launch_bounds__(kSelectThreads) select_kernel(const DecodeParams p, int ns_max) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int32_t bad_page;
  const int row = blockIdx.x, hk = blockIdx.y, G = p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (hk == 0 && threadIdx.x == 0 && row < p.pages.batch) {
    const int32_t bad = sequence_info(p.pages, row).bad;
    if (bad != 0) atomicOr(p.pages.status + row, bad);
  }
  if (row >= p.pages.rows) return;
  const RowInfo ri = row_info(p.pages, row);
  if (threadIdx.x == 0) bad_page = 0;
  __syncthreads();
  if (ri.ok)
    for (int64_t piece = threadIdx.x; piece < pages_of(ri.seq.len, p.pages.page_size); piece += kSelectThreads)
      if (page_of(p.pages, ri.seq.b, piece) < 0) bad_page = 1;  // benign race: every writer writes 1
  __syncthreads();
  const int32_t bad = ri.seq.bad | (bad_page ? kCacheBadPage : 0);
  if (hk == 0 && threadIdx.x == 0) {
    if (bad != 0 && ri.seq.b >= 0 && ri.seq.b < p.pages.batch) atomicOr(p.pages.status + ri.seq.b, bad);
    p.row_ok[row] = bad == 0;
  }
  if (p.dense || p.n_sel == 0) return;
  int32_t* sel = p.sel + int64_t(row) * p.sel_st + hk * p.sel_sh;
  if (bad != 0) {
    for (int k = threadIdx.x; k < p.n_sel; k += kSelectThreads) sel[k * p.sel_sn] = -1;
    return;
  }
  float* stats = reinterpret_cast<float*>(smem);         // [cmp_splits][G][2]: the splits' (m, l)
  float* factor = stats + 2 * p.cmp_splits * G;          // [cmp_splits][G]
  float* srow = factor + p.cmp_splits * G;               // [ns_max]
  int32_t* chosen = reinterpret_cast<int32_t*>(srow + ns_max);
  const int64_t t = ri.t, C = visible_cmp_blocks(t, p.l, p.d);
  const int used = static_cast<int>((C + p.cmp_chunk - 1) / p.cmp_chunk);  // splits holding keys
  const int64_t item0 = (int64_t(row) * p.hkv + hk) * p.cmp_splits;
  // The splits' (m, l) of the group's heads, staged at once; then per head its maximum and sum,
  // and exp2(m_s - M) / L per (split, head): what turns a split's partial scores into probabilities.
  for (int e = threadIdx.x; e < used * G * 2; e += kSelectThreads) stats[e] = p.cmp_ml[item0 * G * 2 + e];
  __syncthreads();
  for (int g = warp; g < G; g += kSelectThreads / 32) {  // a warp per head, its lanes over the splits
    float M = kNegInf, L = 0.f;
    for (int s = lane; s < used; s += 32) M = fmaxf(M, stats[(s * G + g) * 2]);
    M = warp_max(M);
    for (int s = lane; s < used; s += 32) {
      const float m = stats[(s * G + g) * 2];
      if (m != kNegInf) L += stats[(s * G + g) * 2 + 1] * exp2f(m - M);
    }
    L = warp_sum(L);
    for (int s = lane; s < used; s += 32) {
      const float m = stats[(s * G + g) * 2];
      factor[s * G + g] = m != kNegInf && L > 0.f ? exp2f(m - M) / L : 0.f;
    }
  }
  __syncthreads();
  // S[j] for the admissible blocks (forced ones marked taken), a thread per j: over the splits
  // whose compressed blocks overlap j in ascending order, each over the group's heads in order (a
  // contiguous row of G partial scores: independent loads, issued together).
  const int R = p.lp / p.d, L = p.l / p.d, W = p.score_width;
  const int64_t J = last_slc_block(t, p.lp);
  for (int64_t j = threadIdx.x; j <= J; j += kSelectThreads) {
    if (p.forced.contains(j, J)) {
      srow[j] = __uint_as_float(kTakenBits);
      continue;
    }
    float S = 0.f;
    const int64_t first = j * R - L + 1 > 0 ? j * R - L + 1 : 0, last = (j + 1) * R - 1 < C - 1 ? (j + 1) * R - 1 : C - 1;
    if (first <= last)
      for (int64_t s = first / p.cmp_chunk; s <= last / p.cmp_chunk; ++s) {
        const float* part = p.cmp_s + ((item0 + s) * W + j - (s * p.cmp_chunk) / R) * G;
        const float* f = factor + s * G;
        float x[kRows];
#pragma unroll
        for (int g = 0; g < kRows; ++g) x[g] = g < G ? part[g] : 0.f;
#pragma unroll
        for (int g = 0; g < kRows; ++g)
          if (g < G) S += x[g] * f[g];
      }
    srow[j] = S;
  }
  __syncthreads();
  if (warp == 0) {
    // The lane's largest key among its columns (j = lane mod 32): warp_topn's floor.
    unsigned long long best = 0;
    for (int64_t j = lane; j <= J; j += 32) {
      const unsigned long long k = rank_key(srow[j], static_cast<int>(j));
      best = k > best ? k : best;
    }
    auto* cand = reinterpret_cast<unsigned long long*>(smem + select_cand_offset(p, ns_max));
    warp_topn(srow, J, p.n_sel, p.forced, chosen, sel, p.sel_sn, lane, best, cand);
  }
}

}  // namespace

size_t select_smem(const DecodeParams& p, int64_t ns_max) {
  return select_cand_offset(p, ns_max) + kTopnCandidates * sizeof(unsigned long long);
}

void launch_select(const DecodeParams& p, int64_t ns_max, cudaStream_t stream) {
  const size_t smem = select_smem(p, ns_max);
  NSA_CUDA_CHECK(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(p.pages.rows > p.pages.batch ? p.pages.rows : p.pages.batch, p.dense ? 1 : p.hkv);
  select_kernel<<<grid, kSelectThreads, smem, stream>>>(p, static_cast<int>(ns_max));
  NSA_CUDA_CHECK_LAUNCH();
}

}  // namespace nsa::cuda::decode
