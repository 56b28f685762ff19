// Non-x86 builds: no AVX tables.
#include "cpu/kernels.h"

namespace nsa::cpu {
const KernelTable* kernels_avx2() { return nullptr; }
const KernelTable* kernels_avx512() { return nullptr; }
}  // namespace nsa::cpu
