// Backward attention kernels for f16, Dqk = 128 (Dv = 64 and 128): one instantiation per file
// so that builds run in parallel.
#include "cuda/backward/attention.cuh"

namespace nsa::cuda_bwd {
template void launch_attention<__half, 128, 64>(const BwdArgs&, cudaStream_t, int);
template void launch_attention<__half, 128, 128>(const BwdArgs&, cudaStream_t, int);
}  // namespace nsa::cuda_bwd
