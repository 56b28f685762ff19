// The decode attend kernels for f16, Dqk 128, Dv 64 and 128 (decode/decode.h).
#include "cuda/common/check.h"
#include "cuda/decode/cmp_partial.cuh"
#include "cuda/decode/decode.h"
#include "cuda/decode/sparse_partial.cuh"

namespace nsa::cuda::decode {
NSA_DECODE_INSTANTIATE(__half, 128, 64)
NSA_DECODE_INSTANTIATE(__half, 128, 128)
}  // namespace nsa::cuda::decode
