// How the gemm kernels (kernels_impl.h in fp32, kernels_avx512bf16.cpp in bf16) walk C: panels of
// NR columns, each in blocks of MR rows, then one block of the rows left over. The micro-kernel
// is a template on its row count; the walk hands it that count as std::integral_constant, so
// every call is resolved at compile time.
#pragma once

#include <cstdint>
#include <type_traits>

namespace nsa::cpu {

// kernel(std::integral_constant<int, R>{}, r, j) for the block of `rows` (1 <= rows <= R) rows
// that starts at row r of the panel at column j.
template <int R, typename Kernel>
inline void last_rows(int rows, int64_t r, int64_t j, Kernel& kernel) {
  if constexpr (R > 0) {
    if (rows == R) return kernel(std::integral_constant<int, R>{}, r, j);
    return last_rows<R - 1>(rows, r, j, kernel);
  }
}

// Column panels outside: one K x NR panel of B stays in L1 while every row block uses it.
template <int MR, int NR, typename Kernel>
__attribute__((always_inline)) inline void gemm_blocks(int64_t M, int64_t N, Kernel kernel) {
  for (int64_t j = 0; j < N; j += NR) {
    int64_t r = 0;
    for (; r + MR <= M; r += MR) kernel(std::integral_constant<int, MR>{}, r, j);
    if (r < M) last_rows<MR - 1>(static_cast<int>(M - r), r, j, kernel);
  }
}

}  // namespace nsa::cpu
