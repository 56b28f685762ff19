// The row kernels of the attention engine (softmax of a score row, the backward's P and dS,
// bf16 conversions and packing), written once with GCC vector extensions and compiled by each
// kernels_<isa>.cpp with its own instruction-set flags; kernels_impl.h (the fp32 matrix kernels)
// includes it. Include it inside a namespace that is unique to the TU.
//
// Before including, define:
//   NSA_VEC_BYTES   vector width in bytes (16 SSE2, 32 AVX2, 64 AVX-512)
//   NSA_CVT_BF16    (optional) a vector of floats -> the vector of their bf16 bits (vh), rounded
//                   to nearest even: one instruction where the CPU has one (AVX-512-BF16). The
//                   default does the same rounding in integer arithmetic.
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "cpu/kernels.h"

typedef float vf __attribute__((vector_size(NSA_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(NSA_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(NSA_VEC_BYTES)));
typedef uint16_t vh __attribute__((vector_size(NSA_VEC_BYTES / 2)));
typedef float vf4 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));

constexpr int kW = NSA_VEC_BYTES / 4;  // floats per vector
static_assert(nsa::cpu::kColPad % kW == 0, "rows are whole vectors");

__attribute__((always_inline)) inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) inline vf splat(float x) { return vf{} + x; }
template <typename To, typename From>
__attribute__((always_inline)) inline To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}

// Lane indices 0 .. kW-1.
__attribute__((always_inline)) inline vi iota() {
  vi v;
  for (int i = 0; i < kW; ++i) v[i] = i;
  return v;
}

// exp by range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial for e^r
// (the Cephes expf coefficients, ~1 ulp); 2^n is built in the exponent bits. Arguments below
// -87 (e^x under FLT_MIN), -inf included, give exactly 0.
__attribute__((always_inline)) inline vf vexp(vf v) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln2 split so that n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kUnderflow = -87.0f;
  const vi dead = v < kUnderflow;
  const vf xc = dead ? splat(kUnderflow) : v;
  const vf t = xc * kLog2e;
  const vf nf = (t + kRoundMagic) - kRoundMagic;
  vf r = xc - nf * kLn2Hi;
  r = r - nf * kLn2Lo;
  vf p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  const vi e = (__builtin_convertvector(nf, vi) + 127) << 23;
  const vf out = p * bits_as<vf>(e);
  return bits_as<vf>(bits_as<vi>(out) & ~dead);
}

// A horizontal max or sum as a tree of halvings (depth log2 kW, not a chain of kW steps).
template <typename Op>
__attribute__((always_inline)) inline float fold(vf v, Op op) {
#if NSA_VEC_BYTES == 64
  const vf8 a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#elif NSA_VEC_BYTES == 32
  const vf8 a = v;
#endif
#if NSA_VEC_BYTES >= 32
  const vf4 b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#else
  const vf4 b = v;
#endif
  const vf4 c = op(b, __builtin_shufflevector(b, b, 2, 3, 0, 1));
  const vf4 e = op(c, __builtin_shufflevector(c, c, 1, 0, 3, 2));
  return e[0];
}
inline constexpr auto kMaxOp = [](auto x, auto y) { return x > y ? x : y; };
inline constexpr auto kSumOp = [](auto x, auto y) { return x + y; };

// bf16 bits of each lane, rounded to nearest even (a NaN stays a quiet NaN), as
// nsa::detail::f32_to_bf16.
__attribute__((always_inline)) inline vh to_bf16(vf x) {
#ifdef NSA_CVT_BF16
  return NSA_CVT_BF16(x);
#else
  const vu u = bits_as<vu>(x);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vi nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu out = nan ? ((u >> 16) | 0x40u) : rounded;
  return __builtin_convertvector(out, vh);
#endif
}
__attribute__((always_inline)) inline void store_bf16(uint16_t* p, vf x) {
  const vh h = to_bf16(x);
  std::memcpy(p, &h, sizeof h);
}
__attribute__((always_inline)) inline vf from_bf16(vh h) {
  return bits_as<vf>(__builtin_convertvector(h, vu) << 16);
}

// Which lanes of the vector at column j0 lie in [a, b].
__attribute__((always_inline)) inline vi inside(int64_t j0, int64_t a, int64_t b) {
  const vi col = iota() + static_cast<int32_t>(j0);
  return (col >= static_cast<int32_t>(a)) & (col <= static_cast<int32_t>(b));
}

float softmax_row(float* s, int64_t n, int64_t a, int64_t b, float scale, float* m, float* l, uint16_t* pb) {
  if (a > b) {  // nothing visible: zero probabilities, the state unchanged
    for (int64_t j = 0; j < n; j += kW) store(s + j, vf{});
    if (pb) std::memset(pb, 0, static_cast<size_t>(n) * 2);
    return 1.0f;
  }
  const vf neg_inf = splat(-__builtin_inff());
  vf vmax = neg_inf;
  for (int64_t j = 0; j < n; j += kW) {
    const vf v = inside(j, a, b) ? load(s + j) * scale : neg_inf;
    store(s + j, v);
    vmax = kMaxOp(vmax, v);
  }
  const float row = fold(vmax, kMaxOp);
  const float mx = *m > row ? *m : row;
  const float corr = vexp(splat(*m - mx))[0];  // 0 when m was -inf
  vf vsum = vf{};
  for (int64_t j = 0; j < n; j += kW) {
    const vf p = vexp(load(s + j) - mx);
    vsum += p;
    store(s + j, p);
    if (pb) store_bf16(pb + j, p);
  }
  *l = *l * corr + fold(vsum, kSumOp);
  *m = mx;
  return corr;
}

void exp_row(float* s, int64_t n, int64_t a, int64_t b, float scale, float shift) {
  for (int64_t j = 0; j < n; j += kW) {
    const vf p = vexp(load(s + j) * scale - shift);
    store(s + j, bits_as<vf>(bits_as<vi>(p) & inside(j, a, b)));
  }
}

void ds_row(float* p, const float* dp, int64_t n, float gate, float delta, float factor, uint16_t* pb) {
  for (int64_t j = 0; j < n; j += kW) {
    const vf ds = load(p + j) * (load(dp + j) * gate - delta) * factor;
    store(p + j, ds);
    if (pb) store_bf16(pb + j, ds);
  }
}

void scale_row(float* x, int64_t n, float f) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) store(x + j, load(x + j) * f);
  for (; j < n; ++j) x[j] *= f;
}

void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) store_bf16(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = nsa::detail::f32_to_bf16(src[i]);
}

// Row n of the source holds the pair (k, k + 1) of column n of B next to each other: converted
// a vector at a time, its bf16 pairs are 32-bit words that go to pair-rows k/2, k/2 + 1, ...
void pack_bt_bf16(const float* src, int64_t lds, int64_t N, int64_t K, uint16_t* dst, int64_t Kp, int64_t ldb,
                  bool lo) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // [Kp/2][ldb] words
  for (int64_t n = 0; n < N; ++n) {
    const float* row = src + n * lds;
    int64_t k = 0;
    for (; k + kW <= K; k += kW) {
      const vf x = load(row + k);
      vh h = to_bf16(x);
      if (lo) h = to_bf16(x - from_bf16(h));
      uint32_t w[kW / 2];
      std::memcpy(w, &h, sizeof h);
      for (int i = 0; i < kW / 2; ++i) out[(k / 2 + i) * ldb + n] = w[i];
    }
    for (; k < Kp; k += 2) {
      uint16_t pair[2] = {0, 0};
      for (int h = 0; h < 2; ++h)
        if (k + h < K) {
          const float x = row[k + h];
          const uint16_t hi = nsa::detail::f32_to_bf16(x);
          pair[h] = lo ? nsa::detail::f32_to_bf16(x - nsa::detail::bf16_to_f32(hi)) : hi;
        }
      uint32_t w;
      std::memcpy(&w, pair, 4);
      out[(k / 2) * ldb + n] = w;
    }
  }
  for (int64_t k2 = 0; k2 < Kp / 2; ++k2) std::memset(out + k2 * ldb + N, 0, static_cast<size_t>(ldb - N) * 4);
}

// Rows r, r + 1 of the source, converted a vector at a time, give the 32-bit words
// (bf16(src[r][c]), bf16(src[r + 1][c])) of output row c: one word store per pair.
void transpose_bf16(const float* src, int64_t M, int64_t n, int64_t lds, uint16_t* dst, int64_t ldt, uint16_t* lo) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // [n][ldt/2] words
  uint32_t* out_lo = reinterpret_cast<uint32_t*>(lo);
  const int64_t ldw = ldt / 2;
  for (int64_t r = 0; r < ldt; r += 2) {
    const float* r0 = src + r * lds;
    const float* r1 = r0 + lds;
    for (int64_t c = 0; c < n; c += kW) {
      const vf a = r < M ? load(r0 + c) : vf{};
      const vf b = r + 1 < M ? load(r1 + c) : vf{};
      const vh ha = to_bf16(a), hb = to_bf16(b);
      const vu w = __builtin_convertvector(ha, vu) | (__builtin_convertvector(hb, vu) << 16);
      for (int i = 0; i < kW; ++i) out[(c + i) * ldw + r / 2] = w[i];
      if (lo) {
        const vh la = to_bf16(a - from_bf16(ha)), lb = to_bf16(b - from_bf16(hb));
        const vu wl = __builtin_convertvector(la, vu) | (__builtin_convertvector(lb, vu) << 16);
        for (int i = 0; i < kW; ++i) out_lo[(c + i) * ldw + r / 2] = wl[i];
      }
    }
  }
}

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vh h;
    std::memcpy(&h, src + i, sizeof h);
    store(dst + i, from_bf16(h));
  }
  for (; i < n; ++i) dst[i] = nsa::detail::bf16_to_f32(src[i]);
}

// The row kernels' entries of a KernelTable initializer (designated, after .f32_to_bf16).
#define NSA_ROW_KERNELS                                                                           \
  .softmax_row = softmax_row, .exp_row = exp_row, .ds_row = ds_row, .scale_row = scale_row,      \
  .pack_bt_bf16 = pack_bt_bf16, .transpose_bf16 = transpose_bf16
