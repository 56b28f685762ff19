// Storage types of the CUDA backend: bf16 and fp16, converted to/from fp32 on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace nsa::cuda {

template <typename T>
struct StorageTraits;

template <>
struct StorageTraits<__nv_bfloat16> {
  using pair = __nv_bfloat162;
  static constexpr bool is_bf16 = true;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  // Two floats packed into one 32-bit register, low half first (mma operand order).
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  // pack's inverse: the two values of a 32-bit register, low half first.
  static __device__ __forceinline__ float2 unpack(uint32_t packed) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  }
};

template <>
struct StorageTraits<__half> {
  using pair = __half2;
  static constexpr bool is_bf16 = false;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t packed) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  }
};

template <typename T>
__device__ __forceinline__ float to_float(T x) { return StorageTraits<T>::to_float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x) { return StorageTraits<T>::from_float(x); }

}  // namespace nsa::cuda
