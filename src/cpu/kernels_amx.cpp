// AMX kernels (compiled with -mamx-tile -mamx-bf16; called only when the CPU has them and the OS
// has granted this process the tile data state, kernels.cpp): the bf16 matrix product on the
// tile units. Everything else is the avx512bf16 table's (AVX-512 fp32 kernels, AVX-512-BF16 conversions).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/kernels.h"

namespace nsa::cpu {

namespace {

// The tile configuration of ldtilecfg (palette 1): 8 tiles of up to 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0..3 accumulate a 32 x 32 block of C (tile 2 i + j: row tile i, column tile j, each
// 16 x 16 fp32), 4 and 5 hold the two 16 x 32 row tiles of A, 6 and 7 the two 16-pair x 16
// column tiles of B: all eight registers, 4 products per 4 loads.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;  // bf16 values per tile row (64 bytes)
static_assert(kKPad == kTileK, "the reduction is padded to whole tile rows");
static_assert(kColPad % 32 == 0, "column blocks are two 16-column tiles");

// rows0/rows1: rows of the block's first and second row tile (rows1 = 0: one row tile).
void configure(int rows0, int rows1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  auto set = [&](int tile, int rows) {
    cfg.rows[tile] = static_cast<uint8_t>(rows);
    cfg.colsb[tile] = rows > 0 ? 64 : 0;
  };
  set(0, rows0);
  set(1, rows0);
  set(2, rows1);
  set(3, rows1);
  set(4, rows0);
  set(5, rows1);
  set(6, kTileRows);
  set(7, kTileRows);
  _tile_loadconfig(&cfg);
}

template <bool kTwoRowTiles>
inline void block(int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C,
                  int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // bytes between tile rows
  if (accumulate) {
    _tile_loadd(0, C, sc);
    _tile_loadd(1, C + 16, sc);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(2, C + kTileRows * ldc, sc);
      _tile_loadd(3, C + kTileRows * ldc + 16, sc);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(4, A + k, sa);
    _tile_loadd(6, B + k * ldb, sb);       // pair-rows k/2 .. k/2 + 15, columns 0..15
    _tile_loadd(7, B + k * ldb + 32, sb);  // columns 16..31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, A + kTileRows * lda + k, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, sc);
  _tile_stored(1, C + 16, sc);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, C + kTileRows * ldc, sc);
    _tile_stored(3, C + kTileRows * ldc + 16, sc);
  }
}

void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  // The configuration is loaded at every call: another library on this thread may have changed
  // it since (loading costs less than one 16 x 16 x 32 product).
  int configured0 = -1, configured1 = -1;
  for (int64_t i = 0; i < M; i += 2 * kTileRows) {
    const int rows0 = static_cast<int>(std::min<int64_t>(kTileRows, M - i));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(M - i - kTileRows, 0, kTileRows));
    if (rows0 != configured0 || rows1 != configured1) {
      configure(rows0, rows1);
      configured0 = rows0;
      configured1 = rows1;
    }
    for (int64_t j = 0; j < N; j += 32) {
      if (rows1 > 0)
        block<true>(K, A + i * lda, lda, B + 2 * j, ldb, C + i * ldc + j, ldc, accumulate);
      else
        block<false>(K, A + i * lda, lda, B + 2 * j, ldb, C + i * ldc + j, ldc, accumulate);
    }
  }
  // The tiles go back to their initial state, so that the thread does not carry 8 KB of tile data
  // in use into every later save of its state (context switches, signal frames).
  _tile_release();
}

}  // namespace

const KernelTable* kernels_amx() {
  static const KernelTable table = [] {
    KernelTable t = *kernels_avx512bf16();  // all but the product
    t.isa = "amx";
    t.gemm_bf16 = gemm_bf16;
    return t;
  }();
  return &table;
}

}  // namespace nsa::cpu
