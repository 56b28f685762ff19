// Portable kernels (SSE2 on x86-64, whatever the compiler vectorises elsewhere).
// The impl is included inside a per-ISA namespace; its headers must be seen first, outside it.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"
#include "cpu/kernels_blocking.h"

#define NSA_VEC_BYTES 16
#define NSA_MR 6
#define NSA_ISA "generic"
namespace nsa::cpu::isa_generic {
#include "cpu/kernels_impl.h"
}  // namespace nsa::cpu::isa_generic

namespace nsa::cpu {
const KernelTable* kernels_generic() { return &isa_generic::kTable; }
}  // namespace nsa::cpu
