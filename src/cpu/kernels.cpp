// Run-time choice of the kernel table: what the CPU reports (cpuid), what the OS saves on a
// context switch (XCR0) and, for AMX, the tile-data permission Linux grants per process.
#include <atomic>
#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

#if defined(__x86_64__)
// cpuid leaf 7: sub-leaf 0 EDX bit 22 AMX-BF16, bit 24 AMX-TILE; sub-leaf 1 EAX bit 5 AVX512_BF16.
bool cpuid7(unsigned sub, unsigned* eax, unsigned* edx) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, sub, &a, &b, &c, &d)) return false;
  *eax = a;
  *edx = d;
  return true;
}

uint64_t xcr0() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  unsigned eax = 0, edx = 0;
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         cpuid7(1, &eax, &edx) && (eax & (1u << 5));
#else
  return false;
#endif
}

// An AMD CPU of family 26 (Zen 5) or later: there `vdpbf16ps` beats AVX-512's fp32 FMAs.
bool cpu_prefers_avx512bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned family = ((a >> 8) & 0xfu) + (((a >> 8) & 0xfu) == 0xfu ? (a >> 20) & 0xffu : 0u);
  return family >= 0x1a && cpu_has_avx512bf16();
#else
  return false;
#endif
}

// AMX needs the CPU's tiles, XCR0's XTILECFG/XTILEDATA bits (17, 18), and on Linux a once per
// process request for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM): without it the first
// tile instruction kills the process with SIGILL.
bool cpu_has_amx() {
#if defined(__linux__) && defined(__x86_64__)
  unsigned eax = 0, edx = 0;
  if (!cpu_has_avx512bf16() || !cpuid7(0, &eax, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  constexpr uint64_t kTileState = (1ull << 17) | (1ull << 18);
  if ((xcr0() & kTileState) != kTileState) return false;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

// The table of an ISA name, or nullptr when the compiler, the CPU or the OS lacks it.
const KernelTable* table_of(const std::string& isa) {
  if (isa == "generic") return kernels_generic();
  if (isa == "avx2") return cpu_has_avx2() ? kernels_avx2() : nullptr;
  if (isa == "avx512") return cpu_has_avx512() ? kernels_avx512() : nullptr;
  if (isa == "avx512bf16") return cpu_has_avx512bf16() ? kernels_avx512bf16() : nullptr;
  if (isa == "amx") return cpu_has_amx() ? kernels_amx() : nullptr;
  return nullptr;
}

constexpr const char* kIsas[] = {"amx", "avx512bf16", "avx512", "avx2", "generic"};  // every value
// The automatic choice, best first; automatic() puts avx512bf16 before avx512 only on the CPUs
// where it was measured faster than avx512's fp32 FMAs (docs/benchmarks/cpu.md): on a Zen 5 the
// bf16 NSA forward at T = 16K takes 674 ms with it against 1017 ms; on the Sapphire Rapids,
// without its AMX, 575 ms against 295 ms at T = 4K, so elsewhere it is used only when forced.
constexpr const char* kAutoOrder[] = {"amx", "avx512", "avx2", "generic"};

const KernelTable& resolve(const std::string& want) {
  if (const KernelTable* t = table_of(want)) return *t;
  std::string allowed;
  for (const char* isa : kIsas)
    if (table_of(isa)) allowed = allowed.empty() ? std::string(isa) : allowed + ", " + isa;
  throw Error("NSA_CPU_ISA", "\"" + want + "\"", "must be one of " + allowed + " on this CPU");
}

const KernelTable& automatic() {
  for (const std::string isa : kAutoOrder) {
    if (isa == "avx512" && cpu_prefers_avx512bf16())  // before avx512 where it is faster
      if (const KernelTable* t = table_of("avx512bf16")) return *t;
    if (const KernelTable* t = table_of(isa)) return *t;
  }
  return *kernels_generic();
}

const KernelTable& choose() {
  const char* forced = std::getenv("NSA_CPU_ISA");
  if (forced != nullptr && *forced != '\0') return resolve(forced);
  return automatic();
}

std::atomic<const KernelTable*> g_override{nullptr};

}  // namespace

const KernelTable& kernels() {
  if (const KernelTable* t = g_override.load(std::memory_order_acquire)) return *t;
  static const KernelTable& table = choose();
  return table;
}

void use_isa(const char* isa) { g_override.store(&resolve(isa), std::memory_order_release); }

bool isa_available(const char* isa) { return table_of(isa) != nullptr; }

const char* auto_isa() { return automatic().isa; }

}  // namespace nsa::cpu
