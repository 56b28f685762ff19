// Test support for decoding (nsa/cache.h): a host paged cache with shuffled pages, and the rows of
// a LayerProblem appended and attended step by step. Header-only.
#pragma once

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "support.h"

namespace nsa::test {

// A paged cache on the host: pools poisoned (NaN), each sequence's pages a random subset of the
// pool in random order.
struct HostCache {
  Config cfg;
  int64_t page_size = 0, num_pages = 0, max_pages = 0, B = 0;
  HostTensor k[3], v[3], kc, vc;
  HostTensor block_table, seq_lens, status;

  PagedCache view() {
    PagedCache c;
    for (int s = 0; s < 3; ++s) c.raw[s] = KV{k[s].view(), v[s].view()};
    c.cmp = KV{kc.view(), vc.view()};
    c.pages.block_table = block_table.view();
    c.pages.seq_lens = seq_lens.view();
    c.pages.status = status.view();
    return c;
  }
  int64_t len(int64_t b) const { return static_cast<int64_t>(seq_lens.get(b)); }
};

// Room for `capacity` tokens per sequence, `spare` pages no sequence uses.
inline HostCache make_cache(const Config& cfg, const Sizes& s, int64_t page_size, int64_t capacity, uint64_t seed,
                            int64_t spare = 3) {
  HostCache c;
  c.cfg = cfg;
  c.page_size = page_size;
  c.B = static_cast<int64_t>(s.seqlens.size());
  c.max_pages = (capacity + page_size - 1) / page_size;
  c.num_pages = c.B * c.max_pages + spare;
  const int sets = cfg.shared_kv ? 1 : 3;
  for (int i = 0; i < sets; ++i) {
    c.k[i] = HostTensor(s.dtype, {c.num_pages, page_size, s.hkv, s.dqk});
    c.v[i] = HostTensor(s.dtype, {c.num_pages, page_size, s.hkv, s.dv});
    c.k[i].poison();
    c.v[i].poison();
  }
  const int64_t slots = page_size / cfg.cmp_stride;
  c.kc = HostTensor(s.dtype, {c.num_pages, slots, s.hkv, s.dqk});
  c.vc = HostTensor(s.dtype, {c.num_pages, slots, s.hkv, s.dv});
  c.kc.poison();
  c.vc.poison();
  std::vector<int32_t> ids(static_cast<size_t>(c.num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.block_table = HostTensor(DType::i32, {c.B, c.max_pages});
  for (int64_t i = 0; i < c.B * c.max_pages; ++i) c.block_table.set(i, ids[static_cast<size_t>(i)]);
  c.seq_lens = HostTensor(DType::i32, {c.B});
  c.status = HostTensor(DType::i32, {c.B});
  return c;
}

// Rows [from_b, from_b + count_b) of each sequence b of a [T, H, D] problem tensor, packed.
inline HostTensor gather_rows(const HostTensor& t, const LayerProblem& p, const std::vector<int64_t>& from,
                              const std::vector<int64_t>& count) {
  if (!t.defined()) return HostTensor();
  std::vector<int64_t> shape = t.shape();
  const int64_t inner = std::accumulate(shape.begin() + 1, shape.end(), int64_t{1}, std::multiplies<int64_t>());
  shape[0] = std::accumulate(count.begin(), count.end(), int64_t{0});
  HostTensor out(t.dtype(), shape);
  int64_t r = 0, s0 = 0;
  for (size_t b = 0; b < count.size(); ++b) {
    for (int64_t i = 0; i < count[b]; ++i, ++r)
      for (int64_t e = 0; e < inner; ++e) out.set(r * inner + e, t.get((s0 + from[b] + i) * inner + e));
    s0 += p.sizes.seqlens[b];
  }
  return out;
}

inline HostTensor cu_of(const std::vector<int64_t>& count) {
  HostTensor cu(DType::i32, {static_cast<int64_t>(count.size()) + 1});
  int64_t acc = 0;
  cu.set(0, 0);
  for (size_t b = 0; b < count.size(); ++b) cu.set(static_cast<int64_t>(b) + 1, double(acc += count[b]));
  return cu;
}

// The rows of a decode step: q, g of the new rows, and outputs (poisoned).
struct StepRows {
  HostTensor q, g, cu, o, lse, indices, o_branch;
  HostTensor k[3], v[3];
  CacheAppend append() {
    CacheAppend a;
    for (int s = 0; s < 3; ++s) a.kv[s] = KV{k[s].view(), v[s].view()};
    a.seqs.cu_seqlens = cu.view();
    return a;
  }
  DecodeInputs queries() {
    DecodeInputs d;
    d.q = q.view();
    d.g = g.view();
    d.seqs.cu_seqlens = cu.view();
    return d;
  }
  ForwardOutputs outputs() { return ForwardOutputs{o.view(), lse.view(), indices.view(), o_branch.view()}; }
};

inline StepRows step_rows(const LayerProblem& p, const std::vector<int64_t>& from, const std::vector<int64_t>& count) {
  StepRows s;
  for (int i = 0; i < 3; ++i) {
    s.k[i] = gather_rows(p.k[i], p, from, count);
    s.v[i] = gather_rows(p.v[i], p, from, count);
  }
  s.q = gather_rows(p.q, p, from, count);
  s.g = gather_rows(p.g, p, from, count);
  s.cu = cu_of(count);
  const int64_t rows = s.q.shape()[0];
  s.o = HostTensor(p.sizes.dtype, {rows, p.sizes.hq, p.sizes.dv});
  s.lse = HostTensor(DType::f32, {rows, p.sizes.hq, 3});
  s.indices = HostTensor(DType::i32, {rows, p.sizes.hkv, p.cfg.n_selected});
  s.o_branch = HostTensor(p.sizes.dtype, {3, rows, p.sizes.hq, p.sizes.dv});
  s.o.poison();
  s.lse.poison();
  s.indices.poison();
  s.o_branch.poison();
  return s;
}

// Rows of a step's [rows, ...] tensor (or [3, rows, ...]) as one packed tensor over the problem.
inline void scatter_rows(const HostTensor& step, HostTensor& full, const std::vector<int64_t>& count,
                  const std::vector<int64_t>& done, const Sizes& sizes, bool branches = false) {
  const int nb = branches ? 3 : 1;
  const int64_t step_rows = step.shape()[branches ? 1 : 0], full_rows = full.shape()[branches ? 1 : 0];
  const int64_t inner = step.numel() / nb / std::max<int64_t>(step_rows, 1);
  int64_t r0 = 0, s0 = 0;
  for (size_t b = 0; b < count.size(); ++b) {
    for (int br = 0; br < nb; ++br)
      for (int64_t i = 0; i < count[b]; ++i)
        for (int64_t e = 0; e < inner; ++e)
          full.set((br * full_rows + s0 + done[b] + i) * inner + e, step.get((br * step_rows + r0 + i) * inner + e));
    r0 += count[b];
    s0 += sizes.seqlens[b];
  }
}

// A random schedule of steps: per step, the new tokens of each sequence (a long first chunk, then
// mostly single tokens and short bursts), until every sequence is whole.
inline std::vector<std::vector<int64_t>> random_schedule(const std::vector<int32_t>& seqlens, uint64_t seed,
                                                         int64_t first_max, int64_t burst_max) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> done(seqlens.size(), 0);
  auto finished = [&] {
    for (size_t b = 0; b < seqlens.size(); ++b)
      if (done[b] < seqlens[b]) return false;
    return true;
  };
  std::vector<std::vector<int64_t>> steps;
  for (bool first = true; !finished(); first = false) {
    std::vector<int64_t> step(seqlens.size(), 0);
    bool any = false;
    for (size_t b = 0; b < seqlens.size(); ++b) {
      const int64_t left = seqlens[b] - done[b];
      if (left == 0) continue;
      const int64_t want = first ? 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(first_max))
                                 : (rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(burst_max)));
      step[b] = std::min(left, want);
      done[b] += step[b];
      any |= step[b] > 0;
    }
    if (any) steps.push_back(step);
  }
  return steps;
}

}  // namespace nsa::test
