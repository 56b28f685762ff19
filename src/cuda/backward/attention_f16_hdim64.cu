// Backward attention kernels for f16, Dqk = 64 (Dv = 64 and 128): one instantiation per file
// so that builds run in parallel.
#include "cuda/backward/attention.cuh"

namespace nsa::cuda_bwd {
template void launch_attention<__half, 64, 64>(const BwdArgs&, cudaStream_t, int);
template void launch_attention<__half, 64, 128>(const BwdArgs&, cudaStream_t, int);
}  // namespace nsa::cuda_bwd
