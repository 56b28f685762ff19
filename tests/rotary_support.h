// Rotary embedding problems (api.h rotary) shared by the host and GPU tests: x with its inverse
// frequencies, offsets and positions, over a table of awkward shapes. Header-only.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support.h"

namespace nsa::test {

struct RotaryCase {
  std::string name;
  std::vector<int32_t> seqlens;  // packed sequences (one entry: no cu_seqlens)
  int64_t H = 1, D = 2;
  int64_t max_position = 0;      // > 0: explicit positions, uniform in [0, max_position]
};

// D = 2 and 6 (h = 1, 3: no 8-pair chunk), one head and odd head counts, more heads than one
// group of the CUDA kernel (8), h past the CPU's 64-pair chunk and with a remainder (65), T = 0,
// packed sequences with empty ones (first, inner) and one-token ones, explicit positions (with
// sequences given too: positions win) up to 2e5 (angles past 105615 rad, where the CUDA cosf and
// sinf leave their fast argument reduction).
inline std::vector<RotaryCase> rotary_cases() {
  return {
      {"d2_h1", {5}, 1, 2, 0},
      {"d6_h3_packed_empty_and_one_token", {4, 0, 1, 9}, 3, 6, 0},
      {"d16_h5", {37}, 5, 16, 0},
      {"d32_h17_head_groups", {40}, 17, 32, 0},
      {"d128_h8_packed", {0, 70, 1, 130}, 8, 128, 0},
      {"d130_h2_pair_remainder", {33}, 2, 130, 0},
      {"d256_h1_two_cpu_chunks", {300}, 1, 256, 0},
      {"d64_h9_positions_2e5", {50}, 9, 64, 200000},
      {"d12_h2_positions_1e5_with_sequences", {3, 0, 20}, 2, 12, 100000},
      {"empty", {0}, 2, 4, 0},
  };
}

// inv_freq[i] = theta^(-2i / D), as a model's rotary embedding has them (f32).
inline HostTensor rope_inv_freq(int64_t D, double theta = 10000.0) {
  HostTensor f(DType::f32, {D / 2});
  for (int64_t i = 0; i < D / 2; ++i) f.set(i, 1.0 / std::pow(theta, double(2 * i) / double(D)));
  return f;
}

struct RotaryProblem {
  RotaryCase c;
  int64_t T = 0;
  HostTensor x, inv_freq, cu, positions;  // cu, positions: absent when the case has none

  Sequences seqs() {
    Sequences s;
    if (c.seqlens.size() > 1) s.cu_seqlens = cu.view();
    return s;
  }
  // A poisoned output of x's shape and dtype.
  HostTensor output() const {
    HostTensor o(x.dtype(), x.shape());
    o.poison();
    return o;
  }
  // pos(t) as the operation defines it.
  int64_t position(int64_t t) const {
    if (positions.defined()) return static_cast<int64_t>(positions.get(t));
    int64_t start = 0;
    for (int32_t n : c.seqlens) {
      if (t < start + n) break;
      start += n;
    }
    return t - start;
  }
};

inline RotaryProblem make_rotary(const RotaryCase& c, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RotaryProblem p;
  p.c = c;
  for (int32_t n : c.seqlens) p.T += n;
  p.x = HostTensor(dtype, {p.T, c.H, c.D});
  p.x.fill_uniform(rng, -2, 2);
  p.inv_freq = rope_inv_freq(c.D);
  if (c.seqlens.size() > 1) {
    p.cu = HostTensor(DType::i32, {static_cast<int64_t>(c.seqlens.size()) + 1});
    int64_t acc = 0;
    p.cu.set(0, 0);
    for (size_t b = 0; b < c.seqlens.size(); ++b) p.cu.set(static_cast<int64_t>(b) + 1, double(acc += c.seqlens[b]));
  }
  if (c.max_position > 0) {
    p.positions = HostTensor(DType::i32, {p.T});
    std::uniform_int_distribution<int64_t> u(0, c.max_position);
    for (int64_t t = 0; t < p.T; ++t) p.positions.set(t, double(u(rng)));
    if (p.T > 0) p.positions.set(0, double(c.max_position));  // the largest angle, always
  }
  return p;
}

// Whether two tensors hold the same bytes.
inline bool same_bits(HostTensor& a, HostTensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

}  // namespace nsa::test
