// The decode attend kernels for bf16, Dqk 192, Dv 64 and 128 (decode/decode.h).
#include "cuda/common/check.h"
#include "cuda/decode/cmp_partial.cuh"
#include "cuda/decode/decode.h"
#include "cuda/decode/sparse_partial.cuh"

namespace nsa::cuda::decode {
NSA_DECODE_INSTANTIATE(__nv_bfloat16, 192, 64)
NSA_DECODE_INSTANTIATE(__nv_bfloat16, 192, 128)
}  // namespace nsa::cuda::decode
