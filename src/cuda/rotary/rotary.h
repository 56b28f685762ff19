// Rotary position embeddings on the GPU (api.h rotary): one memory-bound kernel, rotary.cu; its
// launch shape is the pure rule of tile_sizes.h (rotary::shape_of), its parameters params.h's
// rotary::Params.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.h"

namespace nsa::cuda::rotary {

// Launches the rotation on `stream` (T = p.seqs.total_tokens > 0). S: __nv_bfloat16 or __half. The
// vector path (16-byte loads and stores) runs when h is a multiple of kVecPairs and every row of
// x and out starts on 16 bytes; otherwise the scalar path, with the same arithmetic.
template <typename S>
void launch(const Params& p, cudaStream_t stream);

}  // namespace nsa::cuda::rotary
