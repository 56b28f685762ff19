// Random cases for the parametrized GPU suites (forward, backward, decode): seeded draws over
// everything the cuda backend compiles (bf16 and f16, every head dim pair, G = 1..16, the three
// phi kinds, shared and independent K/V) with awkward configurations and packed batches (empty
// and one-token sequences, lengths that are multiples of nothing, n above the block count, a
// window of 1 or of none, l' = d). They join each suite as the instantiation `Random`, next to
// its fixed cases, and run every test of the suite.
//
// NSA_CUDA_RANDOM_CASES (default 2) sets how many a suite draws, NSA_CUDA_RANDOM_SEED (default 1)
// the seed: scripts/gpu_check.sh's fuzz step runs many of them under compute-sanitizer. Case i of
// seed s is the same on every machine (its own generator, seeded from s, i and the suite); its
// name says what it drew, so a failure names the case to replay.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "nsa/config.h"
#include "nsa/tensor.h"

namespace nsa::test {

struct RandomDraw {
  std::string name;
  DType dtype;
  int64_t dqk, dv, hq, hkv;
  std::vector<int32_t> seqlens;
  int64_t l, d, lp, n, n_init, n_local, w;
  PhiKind phi;
  bool shared_kv;
  int64_t page_size;                 // decode: a multiple of l'
  int64_t first_max;                 // decode: most tokens of a sequence's first append
  std::vector<int64_t> backbone;     // decode: spec §11's offsets
};

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
    r.dtype = range(0, 1) ? DType::bf16 : DType::f16;
    r.dqk = pick({64, 128, 192});
    r.dv = pick({64, 128});
    const int64_t G = pick({1, 2, 4, 8, 16});
    r.hkv = std::min<int64_t>(range(1, 3), std::max<int64_t>(1, 16 / G));  // Hq <= 16: the fp64 reference's time
    r.hq = r.hkv * G;
    r.d = pick({4, 8, 16});
    r.l = r.d * pick({1, 2, 2, 4});
    r.lp = r.d * pick({1, 2, 3, 4, 8});
    if (range(0, 3) == 0) r.lp = std::max<int64_t>(64, r.d);
    r.n = pick({0, 1, 3, 6, 16, 40});
    r.n_init = r.n > 0 ? range(0, std::min<int64_t>(r.n, 2)) : 0;
    r.n_local = r.n > 0 ? range(0, std::min<int64_t>(r.n - r.n_init, 2)) : 0;
    r.w = pick({0, 1, 17, 64, 256, 512});
    r.phi = static_cast<PhiKind>(range(0, 2));
    r.shared_kv = range(0, 3) == 0;
    const int64_t B = range(1, 3);
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t len = pick({0, 1, 2, range(3, 200), range(200, 1200), range(1200, max_tokens)});
      len = std::min(len, std::max<int64_t>(max_tokens - total, 0));
      r.seqlens.push_back(static_cast<int32_t>(len));
      total += len;
    }
    if (total == 0) r.seqlens.back() = static_cast<int32_t>(range(1, 300));
    while (total * r.hq > 12 * max_tokens) {  // the same bound on tokens x heads
      auto longest = std::max_element(r.seqlens.begin(), r.seqlens.end());
      total -= *longest / 2;
      *longest -= *longest / 2;
    }
    r.page_size = r.lp * pick({1, 2, 4});
    r.first_max = range(1, 900);
    const int64_t room = std::min<int64_t>(r.n - r.n_init - r.n_local, 3);
    for (int64_t k = 0, nb = room > 0 && range(0, 2) == 0 ? range(1, room) : 0; k < nb; ++k)
      r.backbone.push_back(int64_t{1} << (2 * k));
    r.name = "s" + std::to_string(seed) + "_" + std::to_string(i) + "_" + (r.dtype == DType::bf16 ? "bf16" : "f16") +
             "_d" + std::to_string(r.dqk) + "x" + std::to_string(r.dv) + "_G" + std::to_string(r.hq / r.hkv) + "_hkv" +
             std::to_string(r.hkv) + "_l" + std::to_string(r.l) + "d" + std::to_string(r.d) + "lp" +
             std::to_string(r.lp) + "_n" + std::to_string(r.n) + "_w" + std::to_string(r.w) + "_" +
             phi_kind_name(r.phi) + (r.shared_kv ? "_shared" : "") + "_T";
    for (size_t b = 0; b < r.seqlens.size(); ++b) r.name += (b ? "x" : "") + std::to_string(r.seqlens[b]);
    out.push_back(std::move(r));
  }
  return out;
}

// The draws as a suite's case struct C, whose fields are RandomDraw's from name to shared_kv.
template <typename C>
std::vector<C> random_attention_cases(uint64_t suite) {
  std::vector<C> out;
  for (const RandomDraw& r : random_draws(suite))
    out.push_back({r.name, r.dtype, r.dqk, r.dv, r.hq, r.hkv, r.seqlens, r.l, r.d, r.lp, r.n, r.n_init, r.n_local, r.w,
                   r.phi, r.shared_kv});
  return out;
}

}  // namespace nsa::test
