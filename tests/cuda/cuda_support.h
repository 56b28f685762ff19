// GPU test support: device copies of host tensors, the skip rule, and comparisons with the
// tolerance rule of style.md.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support.h"

namespace nsa::test {

// Skips the test when no CUDA device is visible (CI compiles and runs this binary without one).
#define NSA_REQUIRE_GPU()                                                              \
  do {                                                                                 \
    if (!::nsa::backend_available(::nsa::Backend::cuda)) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// The cuda backend's kernel choices of every GPU test's Context (Context::cuda_choices): the
// defaults, except while one of the guards below lives.
inline CudaKernelChoices& kernel_choices() {
  static CudaKernelChoices choices;
  return choices;
}

// The Context of a GPU test: the cuda backend (or `backend`, for the reference it is compared
// with) with kernel_choices().
inline Context cuda_context(Backend backend = Backend::cuda) {
  Context c;
  c.backend = backend;
  c.cuda_choices = &kernel_choices();
  return c;
}

// While one lives, the kernel choice Member has the value it was given; the value before it comes
// back with the guard's end.
template <auto Member>
class ChoiceSet {
 public:
  using Value = std::remove_reference_t<decltype(std::declval<CudaKernelChoices&>().*Member)>;
  explicit ChoiceSet(Value value) : before_(kernel_choices().*Member) { kernel_choices().*Member = value; }
  ~ChoiceSet() { kernel_choices().*Member = before_; }
  ChoiceSet(const ChoiceSet&) = delete;
  ChoiceSet& operator=(const ChoiceSet&) = delete;

 private:
  Value before_;
};
// A boolean choice switched off while one lives. The guards below name the choices the tests switch.
template <bool CudaKernelChoices::*Member>
struct ChoiceOff : ChoiceSet<Member> {
  ChoiceOff() : ChoiceSet<Member>(false) {}
};

// No tensor map is made, so every kernel takes the path it takes where a map cannot be encoded.
using NoTensorMaps = ChoiceOff<&CudaKernelChoices::tma>;
// The selection runs without its union tiles: the forward's per-token kernel and the backward's
// slc_dq_kernel take every tile.
using NoSelectionUnionTiles = ChoiceOff<&CudaKernelChoices::slc_union_tiles>;
// The sm_90a selection forward walks 16 keys a step (slc_attention_tma_kernel) where it would walk
// whole blocks (slc_attention_blocks_kernel: l' = 64, Dqk and Dv 64 or 128).
using SelectionBy16KeySteps = ChoiceOff<&CudaKernelChoices::slc_block_steps>;
// The backward's dK / dV run one warpgroup per CTA (dkv_kernel) where they would run
// warp-specialised (dkv_ws_kernel: sm_90a, Dqk = Dv = 128).
using OneWarpgroupDkv = ChoiceOff<&CudaKernelChoices::dkv_warp_specialized>;
// phi of k and of v run in launches of their own, as where their shapes differ; elsewhere the
// forward's compression and the backward's recompute run them as the two batches of one launch
// per product.
using SeparatePhis = ChoiceOff<&CudaKernelChoices::phi_pairs>;
// phi's large bf16 products run on the library's own kernels (gemm_direct.cuh: wgmma on sm_90a,
// else mma.sync); elsewhere they run on cuBLASLt where l is a multiple of d.
using PhiOwnProducts = ChoiceOff<&CudaKernelChoices::phi_blas>;
// phi's own bf16 products run on mma.sync, as on sm_80; elsewhere an sm_90a build runs them on
// wgmma. (With PhiOwnProducts: the large ones too.)
using PhiOnMmaSync = ChoiceOff<&CudaKernelChoices::phi_wgmma>;
// The score pass sums S in its ring accumulator everywhere, as where l'/d does not divide its
// 64-key chunk.
using ScoresByRing = ChoiceOff<&CudaKernelChoices::cmp_scores_by_chunk>;
// The forward's online softmax moves its max at every rise, not only past the slack.
using SoftmaxMaxWithoutSlack = ChoiceOff<&CudaKernelChoices::softmax_max_slack>;
// The sm_90a kernel that forms the gated combine reads the other branches' outputs and the gates
// without their L2 prefetch.
using NoCombinePrefetch = ChoiceOff<&CudaKernelChoices::combine_prefetch>;
// The forward's gated combine in the window kernel after the selection, as without a selection
// branch (else the selection kernels form it after the window).
using CombineInWindow = ChoiceOff<&CudaKernelChoices::combine_in_selection>;
// The sm_90a window kernel does not prefetch the Q tile of the CTA one resident grid later.
using NoNextQPrefetch = ChoiceOff<&CudaKernelChoices::next_q_prefetch>;

// The sm_90a score pass in 64-row tiles multiplies each chunk behind a CTA barrier, as for the
// shapes whose head sums go through shared memory, where it would run the next chunk's products
// beside this chunk's sums (G = 16 and 4 with the paper's blocks).
using ScoresUnpipelined = ChoiceOff<&CudaKernelChoices::cmp_scores_pipelined>;

// The sm_90a score pass in row tiles of the given rows (64 or 128; 128 only where its shared
// memory fits) instead of its rule's.
using ScoresTileRows = ChoiceSet<&CudaKernelChoices::cmp_scores_rows>;

// The sm_90a window in chunks of the given keys (64, or 112 where its tensor maps can be made at
// Dqk, Dv <= 128; elsewhere 64) instead of its rule's.
using WindowChunkKeys = ChoiceSet<&CudaKernelChoices::win_chunk>;

// While alive, the backward takes paths its rules keep for long sequences: the compressed dK/dV's
// queries in `cmp_splits` parts (0: by the sequence length), with pair_sort the inverted index's
// (key, token) pair sort, and the raw blocks' selection lists in pieces of at most
// `raw_piece_tiles` query tiles (0: the rule, < 0: no pieces).
struct LongSequencePaths {
  LongSequencePaths(int cmp_splits, bool pair_sort, int raw_piece_tiles = 0) {
    CudaKernelChoices& c = kernel_choices();
    c.cmp_splits = cmp_splits;
    c.packed_sort = !pair_sort;
    c.raw_pieces = raw_piece_tiles >= 0;
    c.raw_piece_tiles = raw_piece_tiles > 0 ? raw_piece_tiles : 0;
  }
  ~LongSequencePaths() {
    CudaKernelChoices& c = kernel_choices();
    c.cmp_splits = 0;
    c.packed_sort = true;
    c.raw_pieces = true;
    c.raw_piece_tiles = 0;
  }
  LongSequencePaths(const LongSequencePaths&) = delete;
  LongSequencePaths& operator=(const LongSequencePaths&) = delete;
};

#define NSA_TEST_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// call() captured in a CUDA graph on `stream` (cudaStreamCaptureModeGlobal), then replayed there
// once after poison() (which enqueues the outputs' poisoning on `stream` and returns its first
// error), the stream synchronised. Returns what went wrong ("" when nothing did): what the call
// threw, the capture's end refused (a synchronisation, a pageable copy inside the call), or a CUDA
// error of the replay. The capture is ended and the graph destroyed either way.
template <class Call, class Poison>
std::string capture_and_replay(cudaStream_t stream, Call&& call, Poison&& poison) {
  cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  if (e != cudaSuccess) return std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(e);
  std::string failed;
  try {
    call();
  } catch (const std::exception& x) {
    failed = std::string("threw: ") + x.what();
  }
  cudaGraph_t graph = nullptr;
  e = cudaStreamEndCapture(stream, &graph);
  // step(what, error): records the first error; true while there is none.
  auto step = [&](const char* what, cudaError_t err) {
    if (failed.empty() && err != cudaSuccess) failed = std::string(what) + ": " + cudaGetErrorString(err);
    return failed.empty();
  };
  cudaGraphExec_t exec = nullptr;
  if (step("cudaStreamEndCapture", e) && step("cudaGraphInstantiate", cudaGraphInstantiate(&exec, graph, 0)) &&
      step("poisoning the outputs", poison()) && step("cudaGraphLaunch", cudaGraphLaunch(exec, stream)))
    step("cudaStreamSynchronize", cudaStreamSynchronize(stream));
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  return failed;
}

// A device workspace of `bytes` (none at 0), filled with the NaN pattern 0xff: nothing may rely on
// zeros there.
class DeviceWorkspace {
 public:
  explicit DeviceWorkspace(size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    if (cudaMalloc(&data_, bytes_) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    if (cudaMemset(data_, 0xff, bytes_) != cudaSuccess) throw std::runtime_error("cudaMemset failed");
  }
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  ~DeviceWorkspace() {
    if (data_) cudaFree(data_);
  }
  Workspace view() const { return Workspace{data_, bytes_}; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A device copy of a HostTensor (same dtype, shape, contiguous), from `shift` elements past the
// start of its allocation (0 or 1: 16 bytes of slack; 1 takes the data off 16-byte alignment).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h, int shift = 0) : host_shape_(h.shape()), dtype_(h.dtype()) {
    if (!h.defined()) return;
    bytes_ = static_cast<size_t>(h.numel()) * dtype_size(dtype_);
    if (shift < 0 || shift * dtype_size(dtype_) > 16) throw std::runtime_error("DeviceTensor: shift past the slack");
    if (cudaMalloc(&base_, bytes_ + 16) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    data_ = static_cast<char*>(base_) + shift * dtype_size(dtype_);
    if (cudaMemcpy(data_, const_cast<HostTensor&>(h).data(), bytes_, cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy failed");
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    host_shape_ = o.host_shape_;
    dtype_ = o.dtype_;
    return *this;
  }
  ~DeviceTensor() {
    if (base_) cudaFree(base_);
  }
  TensorView view() const {
    return host_shape_.empty() ? TensorView{} : contiguous_view(data_, dtype_, host_shape_, Device::cuda);
  }
  // Fills the tensor with the NaN pattern 0xff on `stream` (the outputs before a replay).
  cudaError_t poison(cudaStream_t stream) const {
    return bytes_ == 0 ? cudaSuccess : cudaMemsetAsync(data_, 0xff, bytes_, stream);
  }
  // Copies back into `h` (same shape and dtype).
  void download(HostTensor& h) const {
    if (bytes_ == 0) return;
    if (cudaMemcpy(h.data(), data_, bytes_, cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy back failed");
  }

 private:
  void* base_ = nullptr;  // the allocation
  void* data_ = nullptr;  // the tensor's first element in it
  size_t bytes_ = 0;
  std::vector<int64_t> host_shape_;
  DType dtype_ = DType::f32;
};

// An f64 copy (the values are exact: every bf16/f16 value is a double).
inline HostTensor to_f64(const HostTensor& h) {
  if (!h.defined()) return HostTensor();
  HostTensor out(DType::f64, h.shape());
  for (int64_t i = 0; i < h.numel(); ++i) out.set(i, h.get(i));
  return out;
}

// Unit roundoff of a storage type.
inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::f32: return std::ldexp(1.0, -24);
    default: return 0.0;
  }
}

// Element-wise comparison: NaN and infinities must sit in the same places with the same value;
// elsewhere |got - want| <= tol(want). `mask` (optional) picks the elements compared.
template <typename Tol>
::testing::AssertionResult close(const std::vector<double>& got, const std::vector<double>& want, Tol tol,
                                 const std::vector<bool>* mask = nullptr) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0, first = 0, checked = 0;
  double worst = 0, worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    ++checked;
    const double g = got[i], w = want[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g)) ok = std::isnan(w) && std::isnan(g);
    else if (std::isinf(w) || std::isinf(g)) ok = g == w;
    else {
      const double t = tol(w, i);
      ok = std::fabs(g - w) <= t;
      if (t > 0 && std::fabs(g - w) / t > worst_ratio) worst_ratio = std::fabs(g - w) / t;
      worst = std::max(worst, std::fabs(g - w));
    }
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess() << checked << " elements, worst |diff| " << worst;
  return ::testing::AssertionFailure() << bad << " of " << checked << " elements out of tolerance; first at " << first
                                       << ": got " << got[first] << ", want " << want[first]
                                       << " (tol " << tol(want[first], first) << "); worst |diff| " << worst;
}

// ---- packed batches: one sequence poisoned, the others unchanged --------------------------------

// The element count per index of `axis` and that axis's length (rows of a [.., T, ..] tensor).
inline void axis_layout(const HostTensor& t, int axis, int64_t& inner, int64_t& len) {
  inner = 1;
  for (size_t d = static_cast<size_t>(axis) + 1; d < t.shape().size(); ++d) inner *= t.shape()[d];
  len = t.shape()[static_cast<size_t>(axis)];
}

// Sets to NaN every element of `t` whose index along `axis` lies in [r0, r1) (no-op if undefined).
inline void poison_rows(HostTensor& t, int64_t r0, int64_t r1, int axis = 0) {
  if (!t.defined()) return;
  int64_t inner, len;
  axis_layout(t, axis, inner, len);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t r = (i / inner) % len;
    if (r >= r0 && r < r1) t.set(i, std::numeric_limits<double>::quiet_NaN());
  }
}

// Whether `got` equals `want` bit for bit on every element whose index along `axis` lies outside
// [r0, r1).
inline ::testing::AssertionResult same_outside_rows(const HostTensor& got, const HostTensor& want, int64_t r0,
                                                    int64_t r1, int axis = 0) {
  if (got.numel() != want.numel()) return ::testing::AssertionFailure() << "sizes differ";
  int64_t inner, len;
  axis_layout(want, axis, inner, len);
  int64_t checked = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const int64_t r = (i / inner) % len;
    if (r >= r0 && r < r1) continue;
    ++checked;
    const double g = got.get(i), w = want.get(i);
    if (std::memcmp(&g, &w, sizeof(double)) != 0)
      return ::testing::AssertionFailure() << "element " << i << " (row " << r << "): " << g << " instead of " << w;
  }
  return ::testing::AssertionSuccess() << checked << " elements equal";
}

}  // namespace nsa::test
