// The suites' random inputs, filled on the device (declared in cuda_timing.h): values from a hash
// of the element's index, so every run and every launch shape gives the same tensors.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_timing.h"

namespace {

// A hash of h, uniform in [0, 1).
__device__ float hash01(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return (h >> 8) * (1.0f / 16777216.0f);
}

// Uniform values in [lo, hi) from a hash of the index.
__global__ void fill_uniform(__nv_bfloat16* x, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    // (written out, not through hash01: the product's rounding before the sum is part of the values)
    x[i] = __float2bfloat16(lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f));
  }
}

// Rows of `row` elements alike over `period` rows: 90% a hash of the period's first row, 10% noise.
__global__ void fill_local(__nv_bfloat16* x, int64_t n, int64_t row, int64_t period, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (i / row) / period * row + i % row;
    const float smooth = hash01(static_cast<uint32_t>(base) * 2654435761u ^ seed);
    const float noise = hash01(static_cast<uint32_t>(i) * 2246822519u ^ seed);
    x[i] = __float2bfloat16(2.f * (0.9f * smooth + 0.1f * noise) - 1.f);
  }
}

}  // namespace

namespace nsa_cli {

void fill_uniform_bf16(void* x, int64_t n, uint32_t seed, float lo, float hi) {
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), n, seed, lo, hi);
}

void fill_local_bf16(void* x, int64_t n, int64_t row, int64_t period, uint32_t seed) {
  fill_local<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), n, row, period, seed);
}

}  // namespace nsa_cli
