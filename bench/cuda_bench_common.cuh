// What the CUDA benchmarks share: a checked CUDA call that exits, random bf16 fill, event timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define BENCH_CHECK(expr)                                                                               \
  do {                                                                                                  \
    const cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

namespace {  // each benchmark is one translation unit

// Uniform values in [lo, hi) from a hash of the index (no curand dependency).
__global__ void fill_uniform(__nv_bfloat16* x, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    x[i] = __float2bfloat16(lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f));
  }
}

// Queries that change only every `period` tokens (plus 10% noise): neighbouring tokens then score
// the blocks alike and select mostly the same ones, as in trained models; uniform random queries
// are the opposite extreme (each token picks its own random blocks).
__global__ void fill_local(__nv_bfloat16* x, int64_t n, int64_t row, int64_t period, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (i / row) / period * row + i % row;
    auto hash = [](uint32_t h) {
      h ^= h >> 16;
      h *= 0x7feb352du;
      h ^= h >> 15;
      h *= 0x846ca68bu;
      h ^= h >> 16;
      return (h >> 8) * (1.0f / 16777216.0f);
    };
    const float smooth = hash(static_cast<uint32_t>(base) * 2654435761u ^ seed);
    const float noise = hash(static_cast<uint32_t>(i) * 2246822519u ^ seed);
    x[i] = __float2bfloat16(2.f * (0.9f * smooth + 0.1f * noise) - 1.f);
  }
}

// Median milliseconds of `fn` over `reps` timed runs after `warmup` runs (CUDA events).
double time_ms(const std::function<void()>& fn, int warmup, int reps) {
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(a));
    fn();
    BENCH_CHECK(cudaEventRecord(b));
    BENCH_CHECK(cudaEventSynchronize(b));
    float t;
    BENCH_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  BENCH_CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms[ms.size() / 2];
}

}  // namespace
