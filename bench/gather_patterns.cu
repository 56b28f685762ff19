// How fast can an SM gather the selection branch's K/V blocks, by access pattern? A
// microbenchmark for the question docs/cuda.md ("... what bounds the selection") leaves open: the
// selection kernel (slc_attention.cuh) loads K straight into mma fragments, 8 rows x 64 bytes per
// warp load, and Nsight Compute shows L1/TEX at 96% of its peak while L2 is at 62%. Is the
// per-row-segment pattern what bounds it, and would a per-warp shared-memory ring filled by
// cp.async in whole 128-byte lines (then ldmatrix) move the same bytes faster?
//
// Every pattern reads the same bytes: for each (token, KV head), n_sel = 16 blocks of 64 keys x
// (K 128 + V 128) bf16 columns, block 0 and the token's two local blocks forced, the rest random
// (the forward's access pattern on random data: 137 GB at 64K tokens, 4 KV heads). One warp per
// token and KV head, 4 warps per CTA (consecutive tokens), as in slc_attention_kernel. Each lane
// XORs what it read; the warp's XOR (over lanes) must agree between patterns (every byte read
// once), which the program checks. Occupancy is pinned with dynamic shared memory (--ctas-per-sm,
// default 3: slc_attention_kernel's 12 warps per SM).
//
//   nsa_gather_bench [--tokens T] [--ctas-per-sm N] [--reps R]
//
// Patterns:
//   frag      LDG.128 into registers in the selection kernel's layouts (load_rows_a / load_rows_b):
//             K 8 rows x 64 bytes per warp load, V 4 rows x 128 bytes;
//   line      LDG.128 in whole lines: 2 rows x 256 bytes per warp load, K and V;
//   ring_ca   cp.async.ca (L1-allocating) in whole lines into a 2-stage ring of 16-key steps per
//             warp, then ldmatrix.x4 (K and V: 16 per step);
//   ring_cg   the same with cp.async.cg (L2 only);
//   frag_mma  frag, and S = Q K^T of each step on the tensor cores (mma.m16n8k16, constant Q
//             fragments) from its K fragments;
//   lines_mma K in whole lines that still end in the mma layout: in each warp load, lanes 8a .. 8a + 7
//             read one 128-byte line of one key (groups 2a and 2a + 1 half each), then one shuffle
//             per word between the two groups gives each group its own key's pieces
//             (load_rows_a_lines / exchange_rows_a_lines, as prepared for the selection kernel);
//             V and the mma as frag_mma. Its S must equal frag_mma's bit for bit.
//   ring_tma  a 2-stage ring of 16-key steps per warp filled by TMA (sm_90: lane 0 issues four
//             boxes of 16 rows x 128 bytes per step, K and V, in the 128-byte swizzle, completing
//             on the stage's mbarrier), read back by ldmatrix.x4 as ring_ca: the copies bypass the
//             LSU / L1 path that bounds the others (skipped where TMA is not available).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/common/tma.h"

namespace {

constexpr int kHkv = 4, kD = 128, kBlock = 64, kNSel = 16, kWarps = 4, kStep = 16;
constexpr int kRowBytes = kD * 2;                   // 256
constexpr int kPadRow = kRowBytes + 16;             // ring rows padded: ldmatrix without bank conflicts
constexpr int kStageBytes = 2 * kStep * kPadRow;    // K and V of one 16-key step
constexpr int kRingStages = 2;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

struct Args {
  const uint4* k;      // [tokens][kHkv][kD] bf16 as 16-byte pieces
  const uint4* v;
  const int* idx;      // [tokens][kHkv][kNSel]
  uint32_t* out;       // [tokens][kHkv]: the warp's XOR
  int tokens;
};

__device__ __forceinline__ uint32_t xor4(uint4 a) { return a.x ^ a.y ^ a.z ^ a.w; }
__device__ __forceinline__ const uint4* row_ptr(const uint4* base, int64_t key, int hk) {
  return base + (key * kHkv + hk) * (kRowBytes / 16);
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// A warp's result: acc combined over the lanes (a fixed order), stored as 32 bits: the XOR of the
// bytes read, or (the mma patterns) the sum of the scores.
template <typename Acc, typename Combine>
__device__ __forceinline__ void finish(const Args& a, int token, int hk, Acc acc, Combine combine) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc = combine(acc, __shfl_xor_sync(0xffffffffu, acc, o));
  if (threadIdx.x % 32 == 0) {
    uint32_t bits;
    std::memcpy(&bits, &acc, 4);
    a.out[int64_t(token) * kHkv + hk] = bits;
  }
}
// One warp per (token, KV head): acc = combine(acc, step(first key, hk)) over the warp's 16-key steps.
template <typename Acc, typename Step, typename Combine>
__device__ __forceinline__ void walk_steps(const Args& a, Acc acc, Step step, Combine combine) {
  const int token = blockIdx.x * kWarps + threadIdx.x / 32, hk = blockIdx.y;
  if (token >= a.tokens) return;
  const int* idx = a.idx + (int64_t(token) * kHkv + hk) * kNSel;
  for (int b = 0; b < kNSel; ++b) {
    const int64_t key0 = int64_t(idx[b]) * kBlock;
#pragma unroll 2
    for (int s = 0; s < kBlock / kStep; ++s) acc = combine(acc, step(key0 + s * kStep, hk));
  }
  finish(a, token, hk, acc, combine);
}
__device__ __forceinline__ uint32_t xor_of(uint32_t x, uint32_t y) { return x ^ y; }
__device__ __forceinline__ float sum_of(float x, float y) { return x + y; }
template <typename Step>
__device__ __forceinline__ void walk_steps_xor(const Args& a, Step step) {
  walk_steps(a, 0u, step, xor_of);
}

// The selection kernel's register layouts (slc_union.cuh, load_rows_a / load_rows_b).
// The XOR of a step's V loaded in load_rows_b's layout (lane (g, q): keys 2q, 2q + 1, 2q + 8,
// 2q + 9, pieces 8 vv + g: 4 rows x 128 bytes per warp load).
__device__ __forceinline__ uint32_t v_frag_xor(const Args& a, int64_t first, int hk) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  uint32_t x = 0;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr)
#pragma unroll
    for (int vv = 0; vv < 2; ++vv) x ^= xor4(row_ptr(a.v, first + 2 * q + (rr & 1) + 8 * (rr >> 1), hk)[8 * vv + g]);
  return x;
}

__global__ void __launch_bounds__(kWarps * 32) gather_frag(Args a) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  walk_steps_xor(a, [&](int64_t first, int hk) {
    uint32_t x = v_frag_xor(a, first, hk);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) x ^= xor4(row_ptr(a.k, first + 8 * nt + g, hk)[4 * pp + q]);
    return x;
  });
}

// Whole lines: lane l reads piece l % 16 of row 2 i + l / 16 (two 256-byte rows per warp load).
__global__ void __launch_bounds__(kWarps * 32) gather_line(Args a) {
  const int lane = threadIdx.x % 32;
  walk_steps_xor(a, [&](int64_t first, int hk) {
    uint4 kr[8], vr[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      kr[i] = row_ptr(a.k, first + 2 * i + lane / 16, hk)[lane % 16];
      vr[i] = row_ptr(a.v, first + 2 * i + lane / 16, hk)[lane % 16];
    }
    uint32_t x = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) x ^= xor4(kr[i]) ^ xor4(vr[i]);
    return x;
  });
}

template <bool kCa>
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  if constexpr (kCa)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// A ring of kRingStages 16-key steps per warp, filled in whole lines by cp.async, read back with
// ldmatrix.x4 (each lane gets 4 words of 4 rows' 16-byte pieces; all pieces read once).
template <bool kCa>
__global__ void __launch_bounds__(kWarps * 32) gather_ring(Args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int token = blockIdx.x * kWarps + warp, hk = blockIdx.y;
  if (token >= a.tokens) return;
  const int* idx = a.idx + (int64_t(token) * kHkv + hk) * kNSel;
  unsigned char* ring = smem + warp * kRingStages * kStageBytes;
  constexpr int kSteps = kNSel * kBlock / kStep;
  auto issue = [&](int step) {
    const int64_t first = int64_t(idx[step / (kBlock / kStep)]) * kBlock + (step % (kBlock / kStep)) * kStep;
    unsigned char* st = ring + (step % kRingStages) * kStageBytes;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + lane / 16, c = lane % 16;
      cp16<kCa>(smem_u32(st + r * kPadRow + c * 16), row_ptr(a.k, first + r, hk) + c);
      cp16<kCa>(smem_u32(st + (kStep + r) * kPadRow + c * 16), row_ptr(a.v, first + r, hk) + c);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  uint32_t acc = 0;
  issue(0);
  for (int s = 0; s < kSteps; ++s) {
    if (s + 1 < kSteps) {
      issue(s + 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncwarp();
    const unsigned char* st = ring + (s % kRingStages) * kStageBytes;
    // 32 rows (16 K, 16 V) x 16 pieces: each ldmatrix.x4 reads four 8 x 16-byte matrices, lanes
    // 8m .. 8m + 7 giving the row addresses of matrix m: rows 8 j .. 8 j + 7, piece 4 p + m.
#pragma unroll
    for (int j = 0; j < 4; ++j)     // row groups of 8
#pragma unroll
      for (int p = 0; p < 4; ++p) {  // 4 pieces per ldmatrix.x4: pieces 4p .. 4p + 3
        const int row = 8 * j + lane % 8, piece = 4 * p + lane / 8;
        uint32_t r0, r1, r2, r3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(smem_u32(st + row * kPadRow + piece * 16)));
        acc ^= r0 ^ r1 ^ r2 ^ r3;
      }
    __syncwarp();  // the stage is read before the next issue overwrites it
  }
  finish(a, token, hk, acc, xor_of);
}

// TMA ring: per warp kTmaStages stages of K (two boxes: columns 0..63, 64..127) and V (the same),
// each box kStep rows x 128 bytes, 1024-byte aligned.
constexpr int kTmaStages = 2;
constexpr int kBoxBytes = kStep * 128;
constexpr int kTmaStageBytes = 4 * kBoxBytes;
constexpr size_t kTmaSmem = 1024 + size_t(kWarps) * kTmaStages * kTmaStageBytes + kWarps * kTmaStages * 8;

__global__ void __launch_bounds__(kWarps * 32)
    gather_ring_tma(Args a, const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* base = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int token = blockIdx.x * kWarps + warp, hk = blockIdx.y;
  if (token >= a.tokens) return;  // (whole warps)
  const int* idx = a.idx + (int64_t(token) * kHkv + hk) * kNSel;
  unsigned char* ring = base + warp * kTmaStages * kTmaStageBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + kWarps * kTmaStages * kTmaStageBytes) + warp * kTmaStages;
  constexpr int kSteps = kNSel * kBlock / kStep;
  auto issue = [&](int step) {  // lane 0
    const int first = idx[step / (kBlock / kStep)] * kBlock + (step % (kBlock / kStep)) * kStep;
    unsigned char* st = ring + (step % kTmaStages) * kTmaStageBytes;
    uint64_t* bar = bars + step % kTmaStages;
    nsa::cuda::mbarrier_expect_tx(bar, kTmaStageBytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      nsa::cuda::tma_load_3d(st + h * kBoxBytes, &kmap, 64 * h, hk, first, bar);
      nsa::cuda::tma_load_3d(st + (2 + h) * kBoxBytes, &vmap, 64 * h, hk, first, bar);
    }
  };
  if (lane == 0) {
    for (int st = 0; st < kTmaStages; ++st) nsa::cuda::mbarrier_init(bars + st, 1);
    nsa::cuda::fence_mbarrier_init();
    for (int st = 0; st < kTmaStages; ++st) issue(st);
  }
  __syncwarp();
  uint32_t acc = 0;
  for (int s = 0; s < kSteps; ++s) {
    nsa::cuda::mbarrier_wait_parity(bars + s % kTmaStages, (s / kTmaStages) & 1);
    const unsigned char* st = ring + (s % kTmaStages) * kTmaStageBytes;
    // 4 boxes x 16 rows x 8 pieces, each read once: ldmatrix j, lane L -> piece P = 32 j + L of the
    // stage (box P / 128, row P % 128 / 8, piece P % 8 at its swizzled place).
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int P = 32 * j + lane, box = P / 128, r = P % 128 / 8, c = P % 8;
      uint32_t r0, r1, r2, r3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                   : "r"(smem_u32(st + box * kBoxBytes + r * 128 + ((c ^ (r & 7)) * 16))));
      acc ^= r0 ^ r1 ^ r2 ^ r3;
    }
    __syncwarp();  // every lane has read the stage before lane 0 refills it
    if (lane == 0 && s + kTmaStages < kSteps) issue(s + kTmaStages);
  }
  finish(a, token, hk, acc, xor_of);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t word_of(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}
// A bf16 pair in (-1, 1) from a hash: finite values, so that the mma patterns' sums compare.
__host__ __device__ __forceinline__ uint32_t bf16_pair(uint32_t x) {
  x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
  const uint32_t lo = (x & 0x807fu) | (0x3c00u + ((x >> 8) & 0x0180u));  // sign, exponent 120..123, mantissa
  const uint32_t hi = ((x >> 16) & 0x807fu) | (0x3c00u + ((x >> 24) & 0x0180u));
  return lo | (hi << 16);
}
// S = Q K^T of one step from K in the "A" layout (lane (g, q): keys 8 nt + g, pieces 4 pp + q), Q's
// fragments constant; returns the sum of the lane's 8 scores.
__device__ __forceinline__ float step_scores(const uint32_t (&qf)[8][4], const uint4 (&kr)[2][4]) {
  float s[2][4] = {};
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int pp = kk / 2, w = 2 * (kk % 2);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) mma_bf16(s[nt], qf[kk], word_of(kr[nt][pp], w), word_of(kr[nt][pp], w + 1));
  }
  return ((s[0][0] + s[0][1]) + (s[0][2] + s[0][3])) + ((s[1][0] + s[1][1]) + (s[1][2] + s[1][3]));
}
__device__ __forceinline__ void q_fragments(uint32_t (&qf)[8][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) qf[kk][i] = bf16_pair(uint32_t(lane * 97 + kk * 13 + i * 7 + 1));
}
template <typename Step>
__device__ __forceinline__ void walk_steps_sum(const Args& a, Step step) {
  walk_steps(a, 0.f, step, sum_of);
}
// V in frag's layout, folded into the score sum so that its loads stay.
__device__ __forceinline__ float v_term(const Args& a, int64_t first, int hk) { return float(v_frag_xor(a, first, hk) & 1u); }

// S = Q K^T per step from K loaded in the fragment layout (kLines false: frag's loads) or in whole
// lines exchanged into it (kLines true): for each nt and line h, load 0 takes key 8 nt + 2a
// (a = g / 2) and load 1 key 8 nt + 2a + 1, both at piece 8h + 4 (g & 1) + q, so that the 8 lanes
// 8a .. 8a + 7 of each load cover one whole line. The even group keeps load 0 (its key's piece
// 8h + q) and gets the odd group's load 0 (piece 8h + 4 + q); the odd group keeps load 1 and gets
// the even group's load 1. Either way kr ends as frag's.
template <bool kLines>
__global__ void __launch_bounds__(kWarps * 32) gather_mma(Args a) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4, pair = g / 2;
  const bool odd = g & 1;
  uint32_t qf[8][4];
  q_fragments(qf);
  walk_steps_sum(a, [&](int64_t first, int hk) {
    uint4 kr[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int pp = 0; pp < 4; ++pp)
        kr[nt][pp] = kLines ? row_ptr(a.k, first + 8 * nt + 2 * pair + pp % 2, hk)[8 * (pp / 2) + 4 * odd + q]
                            : row_ptr(a.k, first + 8 * nt + g, hk)[4 * pp + q];
    if constexpr (kLines) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            uint32_t& w0 = (&kr[nt][2 * h].x)[w];
            uint32_t& w1 = (&kr[nt][2 * h + 1].x)[w];
            const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 4);
            if (odd)
              w0 = recv;
            else
              w1 = recv;
          }
    }
    return step_scores(qf, kr) + v_term(a, first, hk);
  });
}

__global__ void fill(uint4* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    p[i] = make_uint4(bf16_pair(x), bf16_pair(x * 3u + 1u), bf16_pair(x * 5u + 7u), bf16_pair(x ^ 0xa5a5a5a5u));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 65536, ctas_per_sm = 3, reps = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (f == "--tokens") tokens = v;
    else if (f == "--ctas-per-sm") ctas_per_sm = v;
    else if (f == "--reps") reps = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (tokens < kBlock * 3 || tokens % (kBlock * kWarps) != 0 || ctas_per_sm < 1 || reps < 1) {
    std::fprintf(stderr, "--tokens: a multiple of %d, at least %d; --ctas-per-sm, --reps >= 1\n", kBlock * kWarps,
                 kBlock * 3);
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = tokens / kBlock;
  // Indices as the forward picks on random data: block 0, the two local blocks, 13 random others.
  std::vector<int> idx(size_t(tokens) * kHkv * kNSel);
  std::mt19937 rng(1234);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < kHkv; ++h) {
      int* row = &idx[(size_t(t) * kHkv + h) * kNSel];
      const int jt = t / kBlock;
      std::vector<int> pick = {0, jt, std::max(jt - 1, 0)};
      while (int(pick.size()) < kNSel) pick.push_back(int(rng() % uint32_t(std::max(jt + 1, 1))));
      std::copy(pick.begin(), pick.end(), row);  // repeats allowed: the same bytes for every pattern
    }
  const int64_t pieces = int64_t(blocks) * kBlock * kHkv * kRowBytes / 16;
  uint4 *k, *v;
  int* didx;
  constexpr int kPatterns = 7;
  uint32_t* out[kPatterns];
  CHECK(cudaMalloc(&k, pieces * 16));
  CHECK(cudaMalloc(&v, pieces * 16));
  CHECK(cudaMalloc(&didx, idx.size() * sizeof(int)));
  for (auto& o : out) CHECK(cudaMalloc(&o, size_t(tokens) * kHkv * sizeof(uint32_t)));
  fill<<<1024, 256>>>(k, pieces, 1u);
  fill<<<1024, 256>>>(v, pieces, 2u);
  CHECK(cudaMemcpy(didx, idx.data(), idx.size() * sizeof(int), cudaMemcpyHostToDevice));

  // Pin the occupancy: each CTA takes this much shared memory (at least the ring's).
  const size_t ring = size_t(kWarps) * kRingStages * kStageBytes;
  const size_t per_sm = prop.sharedMemPerMultiprocessor;
  size_t smem = per_sm / ctas_per_sm > 1024 ? per_sm / ctas_per_sm - 1024 : 0;
  smem = std::min(std::max(smem, ring), size_t(prop.sharedMemPerBlockOptin));
  smem = std::min(std::max(smem, kTmaSmem), size_t(prop.sharedMemPerBlockOptin));
  using Kernel = void (*)(Args);
  const Kernel kernels[kPatterns - 1] = {gather_frag,        gather_line,       gather_ring<true>,
                                         gather_ring<false>, gather_mma<false>, gather_mma<true>};
  const char* names[kPatterns] = {"frag", "line", "ring_ca", "ring_cg", "frag_mma", "lines_mma", "ring_tma"};
  for (Kernel kern : kernels) {
    CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  }
  CHECK(cudaFuncSetAttribute(gather_ring_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CHECK(cudaFuncSetAttribute(gather_ring_tma, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  // ring_tma: tensor maps of k and v ([tokens][kHkv][kD]), boxes of kStep rows x 64 columns; only on
  // sm_90 (the binary's sm_90a code), where the encoder accepts them.
  CUtensorMap kmap{}, vmap{};
  const bool tma = prop.major == 9 &&
                   nsa::cuda::make_tensor_map_3d(&kmap, true, k, kD, kHkv, uint64_t(tokens), kRowBytes,
                                                 uint64_t(kHkv) * kRowBytes, kStep) &&
                   nsa::cuda::make_tensor_map_3d(&vmap, true, v, kD, kHkv, uint64_t(tokens), kRowBytes,
                                                 uint64_t(kHkv) * kRowBytes, kStep);
  const double bytes = double(tokens) * kHkv * kNSel * kBlock * 2 * kRowBytes;
  std::printf("device: %s, %d SMs; tokens %d, KV heads %d, %d blocks of %d keys per token and head, D %d;"
              " %.1f GB per pass; %zu bytes of shared memory per CTA (%d CTAs of %d warps per SM asked)\n",
              prop.name, prop.multiProcessorCount, tokens, kHkv, kNSel, kBlock, kD, bytes / 1e9, smem, ctas_per_sm,
              kWarps);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const dim3 grid(tokens / kWarps, kHkv);
  std::printf("pattern,ms,TB/s,ctas_per_sm_occupancy\n");
  for (int i = 0; i < kPatterns; ++i) {
    const bool is_tma = i == kPatterns - 1;
    if (is_tma && !tma) {
      std::printf("%s,skipped (no TMA on this device or no tensor map)\n", names[i]);
      continue;
    }
    int occ = 0;
    if (is_tma)
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, gather_ring_tma, kWarps * 32, smem));
    else
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernels[i], kWarps * 32, smem));
    Args a{k, v, didx, out[i], tokens};
    std::vector<float> ms;
    for (int r = 0; r < reps + 1; ++r) {
      CHECK(cudaEventRecord(e0));
      if (is_tma)
        gather_ring_tma<<<grid, kWarps * 32, smem>>>(a, kmap, vmap);
      else
        kernels[i]<<<grid, kWarps * 32, smem>>>(a);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (r > 0) ms.push_back(t);  // the first run warms up
    }
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("%s,%.3f,%.2f,%d\n", names[i], med, bytes / (med * 1e-3) / 1e12, occ);
  }
  // Every byte-reading pattern reads every byte once: the warps' XORs agree. The two mma patterns
  // compute the same scores from the same fragments: their sums agree bit for bit.
  auto same_as = [&](int i, int j) {
    std::vector<uint32_t> hi(size_t(tokens) * kHkv), hj(size_t(tokens) * kHkv);
    CHECK(cudaMemcpy(hi.data(), out[i], hi.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hj.data(), out[j], hj.size() * 4, cudaMemcpyDeviceToHost));
    if (std::memcmp(hi.data(), hj.data(), hi.size() * 4) == 0) return true;
    std::printf("checksum of %s differs from %s's\n", names[j], names[i]);
    return false;
  };
  bool same = true;
  for (int i = 1; i < 4; ++i) same = same_as(0, i) && same;
  if (tma) same = same_as(0, kPatterns - 1) && same;
  same = same_as(4, 5) && same;
  std::printf("checksums: %s\n", same ? "all patterns read the same bytes; lines_mma's scores equal frag_mma's" : "MISMATCH");
  return same ? 0 : 1;
}
