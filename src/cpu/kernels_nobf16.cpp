// Builds whose compiler lacks AVX-512-BF16 or AMX: no bf16 matrix tables.
#include "cpu/kernels.h"

namespace nsa::cpu {
#ifndef NSA_CPU_AVX512BF16
const KernelTable* kernels_avx512bf16() { return nullptr; }
#endif
#ifndef NSA_CPU_AMX
const KernelTable* kernels_amx() { return nullptr; }
#endif
}  // namespace nsa::cpu
