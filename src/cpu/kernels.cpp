// Run-time choice of the kernel table.
#include <cstdlib>
#include <string>

#include "cpu/kernels.h"
#include "nsa/error.h"

namespace nsa::cpu {

namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && cpu_has_avx2();
#else
  return false;
#endif
}

const KernelTable& choose() {
  const KernelTable* avx512 = cpu_has_avx512() ? kernels_avx512() : nullptr;
  const KernelTable* avx2 = cpu_has_avx2() ? kernels_avx2() : nullptr;
  const char* forced = std::getenv("NSA_CPU_ISA");
  if (forced != nullptr && *forced != '\0') {
    const std::string want = forced;
    if (want == "generic") return *kernels_generic();
    if (want == "avx2" && avx2) return *avx2;
    if (want == "avx512" && avx512) return *avx512;
    throw Error("NSA_CPU_ISA", "\"" + want + "\"",
                std::string("must be generic") + (avx2 ? ", avx2" : "") + (avx512 ? ", avx512" : "") +
                    " on this CPU");
  }
  if (avx512) return *avx512;
  if (avx2) return *avx2;
  return *kernels_generic();
}

}  // namespace

const KernelTable& kernels() {
  static const KernelTable& table = choose();
  return table;
}

}  // namespace nsa::cpu
