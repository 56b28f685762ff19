// The problem case of the forward and backward GPU suites (storage dtype, head dims, heads, packed
// lengths, NSA configuration) with its Config and Sizes, and drawn cases for the parametrized
// suites (forward, backward, decode): seeded draws over everything the cuda backend compiles
// (bf16 and f16, every head dim pair, G = 1..16, the three phi kinds, shared and independent
// K/V) with awkward configurations and packed batches (empty and one-token sequences, lengths
// that are multiples of nothing, n above the block count, a window of 1 or of none, l' = d).
// They join each suite as the instantiation `Random`, next to its fixed cases, and run every
// test of the suite.
//
// NSA_CUDA_RANDOM_CASES (default 2) sets how many a suite draws, NSA_CUDA_RANDOM_SEED (default 1)
// the seed: scripts/gpu_check.sh's fuzz step runs many of them under compute-sanitizer. Case i of
// seed s is the same on every machine (its own generator, seeded from s, i and the suite); its
// name says what it drew, so a failure names the case to replay.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "support.h"

namespace nsa::test {

struct AttentionCase {
  std::string name;
  DType dtype;
  int64_t dqk, dv, hq, hkv;
  std::vector<int32_t> seqlens;
  int64_t l, d, lp, n, n_init, n_local, w;
  PhiKind phi;
  bool shared_kv;
  int64_t phi_hidden = 24;  // mlp's F
};

// gtest prints a parameter with this (instead of its raw bytes).
inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

inline Config config_of(const AttentionCase& c) {
  return make_config(c.l, c.d, c.lp, c.n, c.n_init, c.n_local, c.w, c.phi, c.shared_kv);
}

// The case's sizes in `dtype`.
inline Sizes sizes_of(const AttentionCase& c, DType dtype) {
  Sizes s = make_sizes(c.seqlens, c.hq, c.hkv, c.dqk, c.dv, c.phi_hidden);
  s.dtype = dtype;
  return s;
}
inline Sizes sizes_of(const AttentionCase& c) { return sizes_of(c, c.dtype); }

inline int64_t max_seqlen(const AttentionCase& c) { return *std::max_element(c.seqlens.begin(), c.seqlens.end()); }

// A drawn case, with what the decode suite also draws.
struct RandomDraw {
  AttentionCase c;
  int64_t page_size;              // decode: a multiple of l'
  int64_t first_max;              // decode: most tokens of a sequence's first append
  std::vector<int64_t> backbone = {};  // decode: spec §11's offsets
};
inline void PrintTo(const RandomDraw& r, std::ostream* os) { *os << r.c.name; }

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoll(v, nullptr, 10) : fallback;
}

// `suite` salts the generator so that the suites draw different cases from one seed.
inline std::vector<RandomDraw> random_draws(uint64_t suite, int64_t max_tokens = 2600) {
  const int64_t count = env_int("NSA_CUDA_RANDOM_CASES", 2);
  const uint64_t seed = static_cast<uint64_t>(env_int("NSA_CUDA_RANDOM_SEED", 1));
  std::vector<RandomDraw> out;
  for (int64_t i = 0; i < count; ++i) {
    std::mt19937_64 g(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 1000003ull + suite);
    auto range = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
    auto pick = [&](std::initializer_list<int64_t> xs) { return *(xs.begin() + range(0, int64_t(xs.size()) - 1)); };
    RandomDraw r;
    AttentionCase& c = r.c;
    c.dtype = range(0, 1) ? DType::bf16 : DType::f16;
    c.dqk = pick({64, 128, 192});
    c.dv = pick({64, 128});
    const int64_t G = pick({1, 2, 4, 8, 16});
    c.hkv = std::min<int64_t>(range(1, 3), std::max<int64_t>(1, 16 / G));  // Hq <= 16: the fp64 reference's time
    c.hq = c.hkv * G;
    c.d = pick({4, 8, 16});
    c.l = c.d * pick({1, 2, 2, 4});
    c.lp = c.d * pick({1, 2, 3, 4, 8});
    if (range(0, 3) == 0) c.lp = std::max<int64_t>(64, c.d);
    c.n = pick({0, 1, 3, 6, 16, 40});
    c.n_init = c.n > 0 ? range(0, std::min<int64_t>(c.n, 2)) : 0;
    c.n_local = c.n > 0 ? range(0, std::min<int64_t>(c.n - c.n_init, 2)) : 0;
    c.w = pick({0, 1, 17, 64, 256, 512});
    c.phi = static_cast<PhiKind>(range(0, 2));
    c.shared_kv = range(0, 3) == 0;
    const int64_t B = range(1, 3);
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t len = pick({0, 1, 2, range(3, 200), range(200, 1200), range(1200, max_tokens)});
      len = std::min(len, std::max<int64_t>(max_tokens - total, 0));
      c.seqlens.push_back(static_cast<int32_t>(len));
      total += len;
    }
    if (total == 0) c.seqlens.back() = static_cast<int32_t>(range(1, 300));
    while (total * c.hq > 12 * max_tokens) {  // the same bound on tokens x heads
      auto longest = std::max_element(c.seqlens.begin(), c.seqlens.end());
      total -= *longest / 2;
      *longest -= *longest / 2;
    }
    r.page_size = c.lp * pick({1, 2, 4});
    r.first_max = range(1, 900);
    const int64_t room = std::min<int64_t>(c.n - c.n_init - c.n_local, 3);
    for (int64_t k = 0, nb = room > 0 && range(0, 2) == 0 ? range(1, room) : 0; k < nb; ++k)
      r.backbone.push_back(int64_t{1} << (2 * k));
    c.name = "s" + std::to_string(seed) + "_" + std::to_string(i) + "_" + (c.dtype == DType::bf16 ? "bf16" : "f16") +
             "_d" + std::to_string(c.dqk) + "x" + std::to_string(c.dv) + "_G" + std::to_string(c.hq / c.hkv) +
             "_hkv" + std::to_string(c.hkv) + "_l" + std::to_string(c.l) + "d" + std::to_string(c.d) + "lp" +
             std::to_string(c.lp) + "_n" + std::to_string(c.n) + "_w" + std::to_string(c.w) + "_" +
             phi_kind_name(c.phi) + (c.shared_kv ? "_shared" : "") + "_T";
    for (size_t b = 0; b < c.seqlens.size(); ++b) c.name += (b ? "x" : "") + std::to_string(c.seqlens[b]);
    out.push_back(std::move(r));
  }
  return out;
}

// The drawn cases of the forward (suite 1) and backward (suite 2) suites.
inline std::vector<AttentionCase> random_attention_cases(uint64_t suite) {
  std::vector<AttentionCase> out;
  for (const RandomDraw& r : random_draws(suite)) out.push_back(r.c);
  return out;
}

}  // namespace nsa::test
