// What `nsa bench` on the CUDA backend shares (tools/nsa/cuda_bench.cpp, the default table, and
// the suites tools/nsa/cuda_suite_forward.cpp and cuda_suite_backward.cpp): a checked CUDA call,
// device buffers and tensors, the suites' random inputs (filled on the device, cuda_fill.cu),
// CUDA-event timing (warm-up, median of repeats), and the keys each branch attends.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "nsa/nsa.h"
#include "options.h"

// A CUDA runtime call that throws std::runtime_error (the call and CUDA's message) on failure;
// `nsa` prints it and exits with status 1.
#define NSA_CLI_CUDA(expr)                                                                             \
  do {                                                                                                 \
    const cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

namespace nsa_cli {

// The suites, run by `nsa bench --suite NAME` (cuda_bench.cpp's run_cuda_suite); `args` are the
// options after `bench` without `--suite NAME`.
int run_forward_suite(const std::vector<std::string>& args);
int run_backward_suite(const std::vector<std::string>& args);

// Device bytes of the live DeviceTensors (the library allocates nothing itself): what the backward
// suite reports as a training step's tensors.
inline size_t g_tensor_bytes = 0;

// Uniform values in [lo, hi) from a hash of the index (cuda_fill.cu), bf16, on the default stream.
void fill_uniform_bf16(void* x, int64_t n, uint32_t seed, float lo, float hi);
// Queries that change only every `period` rows of `row` elements (plus 10% noise): neighbouring
// tokens then score the blocks alike and select mostly the same ones, as in trained models;
// uniform random queries are the opposite extreme (each token picks its own random blocks).
void fill_local_bf16(void* x, int64_t n, int64_t row, int64_t period, uint32_t seed);

// Device memory, freed on destruction (no allocation for 0 bytes).
struct DeviceBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t b) : bytes(b) {
    if (b) NSA_CLI_CUDA(cudaMalloc(&data, b));
  }
  ~DeviceBuffer() {
    if (data) cudaFree(data);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A contiguous device tensor, counted in g_tensor_bytes while it lives. With a nonzero seed a bf16
// tensor is filled with fill_uniform_bf16(seed, lo, hi); otherwise its contents are undefined.
struct DeviceTensor {
  DeviceBuffer buf;
  nsa::TensorView view;
  DeviceTensor(nsa::DType dt, std::initializer_list<int64_t> shape, uint32_t seed = 0, float lo = -1.f, float hi = 1.f)
      : buf([&] {
          size_t n = 1;
          for (int64_t s : shape) n *= static_cast<size_t>(s);
          return n * nsa::dtype_size(dt);
        }()) {
    g_tensor_bytes += buf.bytes;
    view = nsa::make_view(buf.data, dt, shape, nsa::Device::cuda);
    if (seed != 0 && dt == nsa::DType::bf16) fill_uniform_bf16(buf.data, view.numel(), seed, lo, hi);
  }
  ~DeviceTensor() { g_tensor_bytes -= buf.bytes; }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  void* data() const { return buf.data; }
  size_t bytes() const { return buf.bytes; }
};

// Median milliseconds of `fn` over `repeats` timed runs after `warmup` untimed runs (CUDA events
// around each run on the default stream); a pending CUDA error afterwards throws.
inline double median_ms(int warmup, int repeats, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  NSA_CLI_CUDA(cudaEventCreate(&a));
  NSA_CLI_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    NSA_CLI_CUDA(cudaEventRecord(a));
    fn();
    NSA_CLI_CUDA(cudaEventRecord(b));
    NSA_CLI_CUDA(cudaEventSynchronize(b));
    float t = 0;
    NSA_CLI_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  NSA_CLI_CUDA(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Keys attended per query head, summed over tokens, per branch (compressed, selected, window): the
// suites' FLOP counts. The block holding t is cut at t: it counts as half a block on average.
inline void attended_keys(const nsa::Config& c, int64_t T, double keys[3]) {
  keys[0] = keys[1] = keys[2] = 0;
  for (int64_t t = 0; t < T; ++t) {
    keys[0] += static_cast<double>(nsa::visible_cmp_blocks(t, c.cmp_block_len, c.cmp_stride));
    const int64_t blocks = std::min<int64_t>(c.n_selected, nsa::last_slc_block(t, c.slc_block_len) + 1);
    keys[1] += static_cast<double>(std::min<int64_t>(t + 1, blocks * c.slc_block_len - c.slc_block_len / 2));
    keys[2] += static_cast<double>(std::min<int64_t>(t + 1, c.window));
  }
}

// A file written by a suite (its CSV), closed on destruction.
struct CsvFile {
  FILE* f = nullptr;
  explicit CsvFile(const std::string& path) : f(std::fopen(path.c_str(), "w")) {
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  }
  ~CsvFile() { std::fclose(f); }
  CsvFile(const CsvFile&) = delete;
  CsvFile& operator=(const CsvFile&) = delete;
};

// After a suite's options are parsed (so that their mistakes show on any machine): a usage error
// when no CUDA device is visible, else "device: NAME, N SMs" (device 0), the suite's first line.
inline void require_device(const std::string& suite) {
  if (!nsa::backend_available(nsa::Backend::cuda))
    throw UsageError("--suite " + suite + " times the CUDA backend, and no CUDA device is visible here");
  cudaDeviceProp prop;
  NSA_CLI_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
}

}  // namespace nsa_cli
