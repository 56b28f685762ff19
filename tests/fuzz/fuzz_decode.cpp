// The API fuzzer: the paged cache (cache_append, decode, dense_decode) and workspace sizes.
#include "fuzz/fuzz_run.h"

namespace nsa::fuzz {
namespace {

// ---- Decoding: cache_append, decode, dense_decode ----------------------------------------------

HostCache cache_f64(const HostCache& c) {
  HostCache e = c;
  for (int i = 0; i < 3; ++i) {
    e.k[i] = test::convert(c.k[i], DType::f64);
    e.v[i] = test::convert(c.v[i], DType::f64);
  }
  e.kc = test::convert(c.kc, DType::f64);
  e.vc = test::convert(c.vc, DType::f64);
  return e;
}

// Breaks the page table or the pools of a cache whose sequences hold `lens` tokens with `rows`
// new rows each; returns the parameter to be named.
Mutation mutate_cache(Rng& r, HostCache& h, Config& cfg, const std::vector<int64_t>& lens,
                      const std::vector<int64_t>& rows, PageTable& pt) {
  const int64_t B = h.B;
  for (;;) {
    switch (r.range(0, 7)) {
      case 0: {  // a page a sequence uses is outside the pools; the first such page is named
        std::vector<int64_t> used;
        for (int64_t b = 0; b < B; ++b)
          if (lens[static_cast<size_t>(b)] > 0) used.push_back(b);
        if (used.empty()) break;
        const int64_t b = r.pick(used);
        const int64_t pg = r.range(0, pages_of(lens[static_cast<size_t>(b)], h.page_size) - 1);
        const int64_t id = r.pick<int64_t>({-1, h.num_pages, kI32Max, kI32Min});
        h.block_table.set(b * h.max_pages + pg, static_cast<double>(id));
        return {"block_table[" + i64(b) + "][" + i64(pg) + "] = " + i64(id),
                "pages.block_table[" + i64(b) + "][" + i64(pg) + "]"};
      }
      case 1: {  // a page past a sequence's length: unused, valid
        for (int64_t b = 0; b < B; ++b) {
          const int64_t used = pages_of(lens[static_cast<size_t>(b)], h.page_size);
          if (used < h.max_pages) {
            h.block_table.set(b * h.max_pages + used, static_cast<double>(kI32Max));
            return {"an unused page id out of range", ""};
          }
        }
        break;
      }
      case 2: {  // a length beyond the capacity
        const int64_t b = r.range(0, B - 1);
        const int64_t len = r.pick<int64_t>({h.max_pages * h.page_size + 1, kI32Max, -1, kI32Min});
        h.seq_lens.set(b, static_cast<double>(len));
        return {"seq_lens[" + i64(b) + "] = " + i64(len), "pages.seq_lens[" + i64(b) + "]"};
      }
      case 3: {  // fewer tokens than the call's new rows (m > length)
        std::vector<int64_t> cand;
        for (int64_t b = 0; b < B; ++b)
          if (rows[static_cast<size_t>(b)] > 0) cand.push_back(b);
        if (cand.empty()) break;
        const int64_t b = r.pick(cand);
        h.seq_lens.set(b, static_cast<double>(r.range(0, rows[static_cast<size_t>(b)] - 1)));
        return {"seq_lens[" + i64(b) + "] below its new rows", "pages.seq_lens[" + i64(b) + "]"};
      }
      case 4: {  // a page size that is not a multiple of l'
        cfg.slc_block_len = h.page_size * 2;  // still a multiple of d: only the page size is wrong
        return {"l' = 2 x page_size", "cache.k_cmp.shape[1] (page_size)"};
      }
      case 5:
        pt.max_seqlen = r.pick<int64_t>({-1, h.max_pages * h.page_size + 1, kI64Max, kI64Min});
        return {"pages.max_seqlen = " + i64(pt.max_seqlen), "pages.max_seqlen"};
      case 6: {
        const int64_t below = *std::max_element(lens.begin(), lens.end());
        if (below < 2) break;
        pt.max_seqlen = r.range(1, below - 1);
        int64_t first = 0;
        while (lens[static_cast<size_t>(first)] <= pt.max_seqlen) ++first;
        return {"pages.max_seqlen below a length", "pages.seq_lens[" + i64(first) + "]"};
      }
      case 7:
        h.status = HostTensor(DType::i32, {B + 1});
        pt.status = h.status.view();
        return {"status [B+1]", "pages.status.shape[0]"};
    }
  }
}

}  // namespace

void case_decode(Rng& r, Case& c, Draw& d) {
  // Page sizes a multiple of l' (kept small for the cache).
  Config cfg = d.cfg;
  Sizes s = d.sizes;
  if (cfg.slc_block_len > 64) cfg.slc_block_len = cfg.cmp_stride * 2;
  const int64_t page = cfg.slc_block_len * r.pick<int64_t>({1, 2, 3});
  LayerProblem p = test::make_problem(cfg, s, r.g());
  const DType dt = s.dtype;
  const int64_t B = static_cast<int64_t>(s.seqlens.size());
  const int64_t capacity = longest(s) + r.range(0, 9);
  HostCache cache = test::make_cache(cfg, s, page, std::max<int64_t>(capacity, 1), r.g(), r.range(0, 3));
  HostCache ref_cache = cache;  // appended by the reference, for the pools' check
  const Context ctx = test::context_of(d.backend, d.threads), ref = test::context_of(Backend::reference);
  // Two steps: a first chunk of each sequence, then the rest.
  std::vector<int64_t> first(static_cast<size_t>(B)), rest(static_cast<size_t>(B)), none(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    first[static_cast<size_t>(b)] = r.range(0, s.seqlens[static_cast<size_t>(b)]);
    rest[static_cast<size_t>(b)] = s.seqlens[static_cast<size_t>(b)] - first[static_cast<size_t>(b)];
  }
  const bool dense = c.op == Op::dense_decode;
  std::vector<int64_t> done = none;
  for (int step = 0; step < 2; ++step) {
    const std::vector<int64_t>& count = step == 0 ? first : rest;
    std::vector<int64_t> lens(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      lens[static_cast<size_t>(b)] = done[static_cast<size_t>(b)] + count[static_cast<size_t>(b)];
      cache.seq_lens.set(b, static_cast<double>(lens[static_cast<size_t>(b)]));
      ref_cache.seq_lens.set(b, static_cast<double>(lens[static_cast<size_t>(b)]));
    }
    test::StepRows rows = test::step_rows(p, done, count);
    const bool last = step == 1;
    Target t;
    t.ctx = ctx;
    t.cfg = cfg;
    PagedCache view = cache.view();
    CacheAppend app = rows.append();
    app.phi_k = LayerProblem::params(p.phi_k);
    app.phi_v = LayerProblem::params(p.phi_v);
    DecodeInputs q = rows.queries();
    ForwardOutputs out = rows.outputs();
    if (last && !dense) {
      // The mutation of the case, on the last step's append and decode.
      const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
      Mutation m{"none", ""};
      if (u < 0.45) {
        if (r.chance(0.2)) {  // declared bounds above what is used: valid
          view.pages.max_seqlen = r.range(std::max<int64_t>(*std::max_element(lens.begin(), lens.end()), 1),
                                          cache.max_pages * page);
          m = {"pages.max_seqlen declared", ""};
        }
      } else if (u < 0.6) {
        m = mutate_config(r, t.cfg, false);
      } else if (u < 0.85) {
        m = mutate_cache(r, cache, t.cfg, lens, count, view.pages);
        PageTable keep = view.pages;
        view = cache.view();
        view.pages.max_seqlen = keep.max_seqlen;
        if (keep.status.defined()) view.pages.status = cache.status.view();
      } else {
        // The rows: cu_seqlens broken or absent, max_seqlen (new rows) too small.
        const int64_t most = *std::max_element(count.begin(), count.end());
        switch (r.range(0, 3)) {
          case 0: {
            const int64_t Tn = rows.q.shape()[0];
            rows.cu.set(B, static_cast<double>(Tn + 1));
            m = {"seqs.cu_seqlens[B] = rows + 1", "seqs.cu_seqlens[" + i64(B) + "]"};
            break;
          }
          case 1:
            rows.cu.set(0, 1);
            m = {"seqs.cu_seqlens[0] = 1", "seqs.cu_seqlens[0]"};
            break;
          case 2:
            if (most < 2) break;
            app.seqs.max_seqlen = q.seqs.max_seqlen = r.range(1, most - 1);
            m = {"seqs.max_seqlen below the new rows", "seqs.max_seqlen"};
            break;
          case 3: {
            const int64_t Tn = rows.q.shape()[0];
            if (B > 0 && Tn % B != 0) {
              app.seqs.cu_seqlens = q.seqs.cu_seqlens = TensorView();
              m = {"seqs.cu_seqlens absent with uneven rows", "seqs.cu_seqlens"};
            }
            break;
          }
        }
      }
      c.mutation = m.text;
      c.expect = m.expect;
    }
    const Config call_cfg = t.cfg;
    const HostCache before = cache;
    if (!dense) {
      // cache_append
      Problem pa;
      Outcome sa = attempt([&] { pa = problem_of(call_cfg, view, app); });
      CaseWorkspace wa;
      if (sa.ok) wa = case_workspace(ctx, nsa::Op::cache_append, call_cfg, pa);
      else { wa.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20); wa.ws = wa.owned->ws; }
      const Outcome oa = attempt([&] { cache_append(ctx, call_cfg, view, app, wa.ws); });
      if (!c.expect.empty() || !oa.ok) {
        settle(c, oa);
        // A rejected call touches nothing.
        for (int i = 0; i < 3; ++i)
          if (cache.k[i].defined()) expect_equal("cache pool after a rejected append", cache.k[i].values(), before.k[i].values());
      }
      Outcome od;
      Problem pd;
      Outcome sd = attempt([&] { pd = problem_of(call_cfg, view, q); });
      CaseWorkspace wd;
      if (sd.ok) wd = case_workspace(ctx, nsa::Op::decode, call_cfg, pd);
      else { wd.owned = std::make_unique<OwnedWorkspace>(size_t{1} << 20); wd.ws = wd.owned->ws; }
      od = attempt([&] { decode(ctx, call_cfg, view, q, out, wd.ws); });
      if (!settle(c, od)) return;
      // The reference appends the same rows to its own cache: raw pools equal, compressed ones
      // within a unit of the storage type.
      {
        PagedCache rv = ref_cache.view();
        CacheAppend ra = app;
        cache_append(ref, call_cfg, rv, ra);
        for (int i = 0; i < 3; ++i)
          if (cache.k[i].defined()) {
            expect_equal("raw k pool", cache.k[i].values(), ref_cache.k[i].values());
            expect_equal("raw v pool", cache.v[i].values(), ref_cache.v[i].values());
          }
        const double unit = dt == DType::f64 || dt == DType::f32 ? 2e-5 : dt == DType::bf16 ? 0x1p-6 : 0x1p-9;
        for (const auto& [a, b] : {std::pair{&cache.kc, &ref_cache.kc}, std::pair{&cache.vc, &ref_cache.vc}}) {
          const std::vector<double> x = a->values(), y = b->values();
          for (size_t i = 0; i < x.size(); ++i) {
            if (std::isnan(x[i]) != std::isnan(y[i])) throw Defect{"compressed pool slot written by one backend only"};
            if (!std::isnan(x[i]) && std::fabs(x[i] - y[i]) > unit * (4.0 + std::fabs(y[i])))
              throw Defect{"compressed pool differs from the reference's: " + std::to_string(x[i]) + " vs " + std::to_string(y[i])};
          }
        }
      }
      // Decode against the reference's decode of the same cache in fp64.
      HostCache exact = cache_f64(cache);
      test::StepRows tr = rows;
      const int64_t Tq = rows.q.shape()[0];
      tr.q = to_f64(rows.q);
      tr.g = to_f64(rows.g);
      tr.o = HostTensor(DType::f64, {Tq, s.hq, s.dv});
      tr.o_branch = HostTensor(DType::f64, {3, Tq, s.hq, s.dv});
      tr.lse = HostTensor(DType::f32, {Tq, s.hq, 3});
      tr.indices = HostTensor(DType::i32, {Tq, s.hkv, cfg.n_selected});
      PagedCache ev = exact.view();
      ev.pages.max_seqlen = view.pages.max_seqlen;
      DecodeInputs tq = tr.queries();
      tq.seqs = q.seqs;
      tq.q = tr.q.view();
      tq.g = tr.g.view();
      decode(ref, call_cfg, ev, tq, tr.outputs());
      const int64_t hq = s.hq, hkv = s.hkv, n = call_cfg.n_selected, dv = s.dv;
      const test::Rowset agree = test::compare_indices(rows.indices, tr.indices, Tq, hkv, n);
      if (d.backend == Backend::reference) expect_equal("decode indices", rows.indices.values(), tr.indices.values());
      if (d.extreme_scale) return;  // scores within an fp32 ulp of each other: the selection may differ
      if (agree.disagree > std::max<int64_t>(1, Tq * hkv / 100)) throw Defect{"decoded rows select other blocks"};
      const test::Rowset all{std::vector<char>(static_cast<size_t>(Tq * hkv), 1), 0};
      const std::vector<double> ob_r = rounded_to(tr.o_branch, dt), o_r = rounded_to(tr.o, dt);
      HostTensor obr(DType::f64, {3, Tq, hq, dv}), orr(DType::f64, {Tq, hq, dv});
      for (size_t i = 0; i < ob_r.size(); ++i) obr.set(static_cast<int64_t>(i), ob_r[i]);
      for (size_t i = 0; i < o_r.size(); ++i) orr.set(static_cast<int64_t>(i), o_r[i]);
      for (int br : {kCmp, kWin})
        expect_close("decode o_branch[" + std::to_string(br) + "]", test::on_rows(rows.o_branch, all, Tq, hq, hkv, dv, br),
                     test::on_rows(tr.o_branch, all, Tq, hq, hkv, dv, br), test::on_rows(obr, all, Tq, hq, hkv, dv, br));
      expect_close("decode o", test::on_rows(rows.o, agree, Tq, hq, hkv, dv), test::on_rows(tr.o, agree, Tq, hq, hkv, dv),
                   test::on_rows(orr, agree, Tq, hq, hkv, dv));
      expect_close_f32("decode lse", test::on_rows(rows.lse, agree, Tq, hq, hkv, 3), test::on_rows(tr.lse, agree, Tq, hq, hkv, 3));
    } else {
      // dense_decode reads the raw pools of branch slc (or the shared ones): filled by the reference.
      cache_append(ref, cfg, view, app);
      if (!last) {
        for (int64_t b = 0; b < B; ++b) done[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
        continue;
      }
      const int kb = cfg.shared_kv ? 0 : 1;
      KV pools{cache.k[kb].view(), cache.v[kb].view()};
      PageTable table = view.pages;
      TensorView qv = rows.q.view();
      Sequences seqs = q.seqs;
      const int64_t Tq = rows.q.shape()[0];
      HostTensor o(dt, {Tq, s.hq, s.dv}), lse(DType::f32, {Tq, s.hq});
      o.poison();
      lse.poison();
      TensorView ov = o.view(), lv = lse.view();
      t.cfg = Config{};
      t.cfg.scale = cfg.scale;
      t.dense_only = true;
      t.main = &qv;
      t.args = {{"pages_v", &pools.v, {1, 1, 1, 0}}, {"pages.block_table", &table.block_table, {0, 0}, true, true},
                {"pages.seq_lens", &table.seq_lens, {1}, true, true}};
      t.outputs = {{"o", &ov, {1, 1, 1}}, {"lse", &lv, {1, 1}, false, true}};
      choose_mutation(r, c, t, dt);
      if (c.expect.empty() && r.chance(0.3)) {
        Config dummy = cfg;
        const Mutation m = mutate_cache(r, cache, dummy, lens, count, table);
        if (m.expect != "cache.k_cmp.shape[1] (page_size)") {
          c.mutation = m.text;
          c.expect = m.expect;
          const PageTable keep = table;
          table = cache.view().pages;
          table.max_seqlen = keep.max_seqlen;
          if (m.expect == "pages.status.shape[0]") table.status = cache.status.view();
        }
      }
      const Config dcfg = t.cfg;
      Problem pr;
      Outcome sz = attempt([&] { pr = problem_of(pools, table, qv, seqs); });
      if (!sz.ok) pr = stage_problem(d, Tq, s.hq, s.hkv, s.dqk, s.dv, 0, seqs);
      pr.max_query_len = std::max<int64_t>(pr.max_query_len, 1);
      const Outcome od = run_call(r, c, t, nsa::Op::dense_decode, pr, true, [&](Workspace ws) {
        dense_decode(t.ctx, dcfg.scale, pools, table, qv, seqs, ov, lv, ws);
      });
      if (!settle(c, od)) return;
      HostCache exact = cache_f64(cache);
      HostTensor q64 = to_f64(rows.q), o64(DType::f64, {Tq, s.hq, s.dv}), orr(dt, {Tq, s.hq, s.dv}),
          l64(DType::f32, {Tq, s.hq});
      dense_decode(ref, dcfg.scale, KV{exact.k[kb].view(), exact.v[kb].view()}, table, q64.view(), seqs, o64.view(),
                   l64.view());
      dense_decode(ref, dcfg.scale, KV{cache.k[kb].view(), cache.v[kb].view()}, table, rows.q.view(), seqs, orr.view(),
                   TensorView());
      if (d.extreme_scale) return;
      expect_close("dense_decode o", o.values(), o64.values(), orr.values());
      if (lv.defined()) expect_close_f32("dense_decode lse", lse.values(), l64.values());
      return;
    }
    for (int64_t b = 0; b < B; ++b) done[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
  }
}

// ---- Workspace sizes ---------------------------------------------------------------------------

// workspace_size on valid configurations with extreme integers (l' and n and w up to 2^31 - 1, a
// declared max_seqlen up to 2^31 - 1) and small tensors: a size that grows with the tensors, never
// with a configuration integer; and Problems with bad fields: a named error.
void case_workspace_sizes(Rng& r, Case& c, Draw& d) {
  Config cfg = d.cfg;
  Problem pr;
  pr.total_tokens = r.range(0, 300);
  pr.batch = r.range(1, 4);
  pr.max_seqlen = r.chance(0.5) ? pr.total_tokens : r.pick<int64_t>({pr.total_tokens, kMaxLength, int64_t{1} << 20});
  pr.hq = d.sizes.hq;
  pr.hkv = d.sizes.hkv;
  pr.dqk = d.sizes.dqk;
  pr.dv = d.sizes.dv;
  pr.phi_hidden = cfg.phi == PhiKind::mlp ? d.sizes.phi_hidden : 0;
  pr.dtype = d.sizes.dtype;
  pr.max_query_len = r.range(0, 8);
  const nsa::Op op = static_cast<nsa::Op>(r.range(0, static_cast<int64_t>(nsa::Op::dense_decode)));
  const bool decoding = op == nsa::Op::cache_append || op == nsa::Op::decode || op == nsa::Op::dense_decode;
  if (decoding) {
    pr.max_seqlen = std::min<int64_t>(pr.max_seqlen, 4096);  // the cache's capacity: its pools are tensors
    cfg.slc_block_len = std::min<int64_t>(cfg.slc_block_len, 64);
    if (cfg.slc_block_len % cfg.cmp_stride != 0) cfg.slc_block_len = cfg.cmp_stride;
  }
  switch (r.range(0, 5)) {
    case 0: cfg.slc_block_len = kMaxLength, cfg.cmp_stride = 1, cfg.cmp_block_len = 1; break;
    case 1: cfg.n_selected = r.pick<int64_t>({kMaxLength, int64_t{1} << 20}); break;
    case 2: cfg.window = kMaxLength; break;
    default: break;
  }
  if (decoding && cfg.slc_block_len > 64) cfg.slc_block_len = 64, cfg.cmp_stride = 1;
  if (cfg.n_init + cfg.n_local + cfg.num_backbone > cfg.n_selected && cfg.n_selected > 0) cfg.n_local = cfg.n_init = 0, cfg.set_backbone({});
  Context ctx = test::context_of(d.backend, d.threads);
  const double u = std::uniform_real_distribution<double>(0, 1)(r.g);
  if (u < 0.4) {
    static const char* kFields[] = {"problem.total_tokens", "problem.batch", "problem.max_seqlen", "problem.hq",
                                    "problem.hkv", "problem.dqk", "problem.dv", "problem.phi_hidden",
                                    "problem.max_query_len"};
    int64_t* fields[] = {&pr.total_tokens, &pr.batch, &pr.max_seqlen, &pr.hq, &pr.hkv, &pr.dqk, &pr.dv,
                         &pr.phi_hidden, &pr.max_query_len};
    const int k = static_cast<int>(r.range(0, 8));
    *fields[k] = r.pick<int64_t>({-1, kI64Min, int64_t{1} << 31, int64_t{1} << 62, kI64Max});
    c.mutation = std::string(kFields[k]) + " = " + i64(*fields[k]);
    c.expect = kFields[k];
  }
  c.text += " op=" + std::to_string(static_cast<int>(op)) + " T=" + i64(pr.total_tokens) + " max_seqlen=" + i64(pr.max_seqlen) +
            " l'=" + i64(cfg.slc_block_len) + " n=" + i64(cfg.n_selected) + " w=" + i64(cfg.window);
  size_t bytes = 0;
  const Outcome o = attempt([&] { bytes = workspace_size(ctx, op, cfg, pr); });
  if (!settle(c, o)) return;
  // A few hundred tokens: the scratch is at most a few MB per thread whatever the configuration.
  const size_t threads = static_cast<size_t>(std::max(d.threads, 1)) + 64;
  if (bytes > (size_t{64} << 20) * threads)
    throw Defect{"workspace_size is " + std::to_string(bytes) + " bytes for a problem of " + i64(pr.total_tokens) +
                 " tokens (grows with a configuration integer)"};
}

}  // namespace nsa::fuzz
