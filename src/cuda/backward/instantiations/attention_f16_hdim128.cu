// Backward attention kernels for f16, Dqk = 128 (Dv = 64 and 128): one instantiation per file
// so that builds run in parallel.
#include "cuda/backward/launch.cuh"

namespace nsa::cuda::bwd {
template void launch_attention<__half, 128, 64>(const BwdArgs&, cudaStream_t, BwdKernel);
template void launch_attention<__half, 128, 128>(const BwdArgs&, cudaStream_t, BwdKernel);
}  // namespace nsa::cuda::bwd
