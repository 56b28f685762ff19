// Tensor views: how every entry point of the library receives memory.
//
// A TensorView is a non-owning description of a strided array: the caller keeps its own
// layout and allocator. Strides are in elements (not bytes), like PyTorch and DLPack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace nsa {

enum class DType : int32_t { f32 = 0, f16 = 1, bf16 = 2, f64 = 3, i32 = 4 };
enum class Device : int32_t { cpu = 0, cuda = 1 };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);
const char* device_name(Device device);

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;  // 0 means "absent" (an optional tensor that was not given)
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements
  Device device = Device::cpu;
  int device_index = 0;

  bool defined() const { return ndim > 0; }
  int64_t numel() const;
  // Row-major with no gaps.
  bool is_contiguous() const;
};

// A contiguous (row-major) view.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device::cpu, int device_index = 0);
// A view with explicit strides (elements).
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride, Device device = Device::cpu,
                     int device_index = 0);

}  // namespace nsa
