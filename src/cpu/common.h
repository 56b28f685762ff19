// Shared pieces of the CPU backend: row access to caller tensors in any storage dtype, the
// per-thread scratch carved out of the caller's workspace, and the thread/slot bookkeeping.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "common/half.h"
#include "common/plan.h"
#include "cpu/kernels.h"
#include "nsa/error.h"

namespace nsa::cpu {

using detail::Plan;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys per chunk of every flash loop: one 64-key chunk of K^T and V (fp32, D = 128) is 32 KB
// each, so the packed chunk, the score tile and the accumulators stay within L2.
inline constexpr int64_t kChunk = 64;
// Query rows per tile (tokens x heads of one GQA group): enough rows to amortise packing a
// K/V chunk, few enough that a tile's accumulators stay in L2.
inline constexpr int64_t kTileRows = 64;
// Compressed blocks (or items) per phi tile.
inline constexpr int64_t kPhiTile = 64;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Read access to a [rows, heads, D] tensor (a caller's view or an fp32 workspace buffer).
struct Rows {
  const char* base = nullptr;
  DType dtype = DType::f32;
  int64_t row_stride = 0, head_stride = 0;  // elements
  int64_t dim = 0;
  // Paged (Rows::paged): the block-table row of the sequence; null for a plain [rows, heads, D].
  const int32_t* table = nullptr;
  int64_t table_stride = 0, page_rows = 1, page_stride = 0;

  // Dimensions first, first + 1 and first + 2 of t as [rows, heads, D].
  static Rows of(const TensorView& t, int first = 0) {
    Rows r;
    r.base = static_cast<const char*>(t.data);
    r.dtype = t.dtype;
    r.row_stride = t.stride[first];
    r.head_stride = t.stride[first + 1];
    r.dim = t.shape[first + 2];
    return r;
  }
  // One sequence's rows of a paged pool [P, rows_per_page, heads, D] (nsa/cache.h): row r lives in
  // page table[(r / rows_per_page) * table_stride], slot r % rows_per_page.
  static Rows paged(const TensorView& pool, const int32_t* table, int64_t table_stride, int64_t rows_per_page) {
    Rows r = of(pool, 1);
    r.table = table;
    r.table_stride = table_stride;
    r.page_rows = rows_per_page;
    r.page_stride = pool.stride[0];
    return r;
  }
  static Rows of_f32(const float* data, int64_t heads, int64_t dim) {
    Rows r;
    r.base = reinterpret_cast<const char*>(data);
    r.dtype = DType::f32;
    r.row_stride = heads * dim;
    r.head_stride = dim;
    r.dim = dim;
    return r;
  }
  const char* ptr(int64_t row, int64_t head) const {
    int64_t off = row * row_stride + head * head_stride;
    if (table != nullptr)
      off = table[(row / page_rows) * table_stride] * page_stride + (row % page_rows) * row_stride + head * head_stride;
    return base + off * static_cast<int64_t>(dtype_size(dtype));
  }
  // dst[0..dim) = float(row), converted.
  void load(int64_t row, int64_t head, float* dst) const {
    const char* p = ptr(row, head);
    switch (dtype) {
      case DType::f32: std::memcpy(dst, p, static_cast<size_t>(dim) * 4); return;
      case DType::bf16: kernels().bf16_to_f32(reinterpret_cast<const uint16_t*>(p), dst, dim); return;
      case DType::f16: kernels().f16_to_f32(reinterpret_cast<const uint16_t*>(p), dst, dim); return;
      default: return;  // f64/i32 never reach the CPU backend (api.cpp)
    }
  }
};

// dst[0..n) = float(element offset .. offset + n) of a float view (contiguous last dimension).
inline void load_f32(const TensorView& t, int64_t offset, float* dst, int64_t n) {
  switch (t.dtype) {
    case DType::f32: std::memcpy(dst, static_cast<const float*>(t.data) + offset, static_cast<size_t>(n) * 4); return;
    case DType::bf16: kernels().bf16_to_f32(static_cast<const uint16_t*>(t.data) + offset, dst, n); return;
    case DType::f16: kernels().f16_to_f32(static_cast<const uint16_t*>(t.data) + offset, dst, n); return;
    default: return;  // f64 runs on the reference backend only (api.cpp)
  }
}

// Elements offset .. offset + n of a float view = src[0..n), rounded to its dtype.
inline void store_f32(const TensorView& t, int64_t offset, const float* src, int64_t n) {
  switch (t.dtype) {
    case DType::f32: std::memcpy(static_cast<float*>(t.data) + offset, src, static_cast<size_t>(n) * 4); return;
    case DType::bf16: kernels().f32_to_bf16(src, static_cast<uint16_t*>(t.data) + offset, n); return;
    case DType::f16: {
      uint16_t* d = static_cast<uint16_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = detail::f32_to_f16(src[i]);
      return;
    }
    default: return;
  }
}

// Writes n floats into element (row, head, 0..n) of a caller's view, rounding to its dtype.
inline void store_row(const TensorView& t, int64_t row, int64_t head, const float* src, int64_t n) {
  store_f32(t, row * t.stride[0] + head * t.stride[1], src, n);
}

// Element i of a 1-D or the (row, head, c) element of a 3-D float view, as float.
inline float load_scalar(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[offset];
    case DType::bf16: return detail::bf16_to_f32(static_cast<const uint16_t*>(t.data)[offset]);
    case DType::f16: return detail::f16_to_f32(static_cast<const uint16_t*>(t.data)[offset]);
    default: return 0.0f;
  }
}

inline void store_scalar(const TensorView& t, int64_t offset, float v) {
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[offset] = v; return;
    case DType::bf16: static_cast<uint16_t*>(t.data)[offset] = detail::f32_to_bf16(v); return;
    case DType::f16: static_cast<uint16_t*>(t.data)[offset] = detail::f32_to_f16(v); return;
    default: return;
  }
}

// A bump allocator over one region of the caller's workspace. Every piece is 64-byte aligned.
class Arena {
 public:
  Arena() = default;
  Arena(void* base, size_t bytes) : base_(static_cast<char*>(base)), bytes_(bytes) {}
  template <typename T>
  T* take(int64_t count) {
    const size_t need = round_bytes(static_cast<size_t>(count) * sizeof(T));
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += need;
    if (used_ > bytes_) overflow();
    return p;
  }
  size_t used() const { return used_; }
  static size_t round_bytes(size_t b) { return (b + 63) / 64 * 64; }

 private:
  [[noreturn]] void overflow() const {
    // A sizing bug, never a user error: workspace_size() and the carving below disagree.
    throw Error("workspace (cpu backend internal)", std::to_string(used_) + " bytes carved",
                "exceeds the " + std::to_string(bytes_) + " bytes sized for it");
  }
  char* base_ = nullptr;
  size_t bytes_ = 0;
  size_t used_ = 0;
};

// Counts bytes the way Arena carves them (used by workspace_size).
struct Sizer {
  size_t bytes = 0;
  template <typename T>
  T* take(int64_t count) {
    bytes += Arena::round_bytes(static_cast<size_t>(std::max<int64_t>(count, 0)) * sizeof(T));
    return nullptr;
  }
};

// The threads a call runs on: Context::num_threads, or OpenMP's default.
inline int call_threads(const Plan& p) {
  return p.ctx.num_threads > 0 ? p.ctx.num_threads : omp_get_max_threads();
}

// Threads that workspace_size() plans scratch for when the call does not say.
inline int default_slots() { return std::max(omp_get_max_threads(), omp_get_num_procs()); }

// Splits the workspace into a shared part and one scratch slot per thread. The number of
// threads is the call's; the caller's workspace must hold a slot for each of them.
struct Slots {
  char* base = nullptr;
  size_t slot_bytes = 0;
  int count = 0;
  Arena slot(int i) const { return Arena(base + static_cast<size_t>(i) * slot_bytes, slot_bytes); }
};

inline Slots carve_slots(const Plan& p, Workspace ws, size_t shared_bytes, size_t slot_bytes) {
  const int threads = call_threads(p);
  const size_t need = Arena::round_bytes(shared_bytes) + slot_bytes * static_cast<size_t>(threads);
  if (ws.bytes < need || (need > 0 && ws.data == nullptr)) {
    const size_t shared = Arena::round_bytes(shared_bytes);
    const size_t fit = ws.bytes > shared && slot_bytes > 0 ? (ws.bytes - shared) / slot_bytes : 0;
    throw Error("ctx.num_threads", std::to_string(threads),
                "needs a workspace of " + std::to_string(need) + " bytes on the cpu backend (" +
                    std::to_string(slot_bytes) + " per thread), but it has " + std::to_string(ws.bytes) +
                    " bytes, enough for " + std::to_string(fit) +
                    " threads: use fewer threads or a larger workspace (see cpu::workspace_bytes)");
  }
  Slots s;
  s.base = static_cast<char*>(ws.data) + Arena::round_bytes(shared_bytes);
  s.slot_bytes = slot_bytes;
  s.count = threads;
  return s;
}

// Workspace bytes of `op` for a given number of threads (workspace_size uses default_slots()).
size_t workspace_bytes(Op op, const Config& cfg, const Problem& problem, int threads);

}  // namespace nsa::cpu
