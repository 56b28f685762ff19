// Backward attention kernels for bf16, Dqk = 64 (Dv = 64 and 128): one instantiation per file
// so that builds run in parallel.
#include "cuda/backward/launch.cuh"

namespace nsa::cuda::bwd {
template void launch_attention<__nv_bfloat16, 64, 64>(const BwdArgs&, cudaStream_t, BwdKernel);
template int dkv_cmp_resident_ctas<__nv_bfloat16, 64, 64>(const CudaKernelChoices&);
template void launch_attention<__nv_bfloat16, 64, 128>(const BwdArgs&, cudaStream_t, BwdKernel);
template int dkv_cmp_resident_ctas<__nv_bfloat16, 64, 128>(const CudaKernelChoices&);
}  // namespace nsa::cuda::bwd
