// One explicit instantiation of the forward attention kernels: f16, Dqk = 192, Dv = 64.
#include "cuda/forward/cmp_attention.cuh"
#include "cuda/forward/slc_launch.cuh"
#include "cuda/forward/win_attention.cuh"

namespace nsa::cuda {
template void launch_cmp_attention<__half, 192, 64>(const CmpAttnParams&, cudaStream_t);
template void launch_win_attention<__half, 192, 64>(const BranchParams&, cudaStream_t);
template void launch_slc_attention<__half, 192, 64>(const BranchParams&, cudaStream_t);
}  // namespace nsa::cuda
