// A seeded fuzzer of the C++ API (include/nsa/api.h, nsa/cache.h) on the host backends.
//
// Each case draws a small problem (configuration, packed sequences, heads, head dims, dtype,
// layout), an operation (the layer's forward and backward, every stage, dense attention, the
// paged cache's append/decode/dense decode, workspace sizes) and a backend (reference or cpu),
// then either leaves it valid (awkward on purpose: empty and one-token sequences, n above the
// block count, l' = 2^31 - 1, a window of 2^31 - 1, a declared max_seqlen far above the longest
// sequence, caller indices with repeats, -1 and blocks past the query, padded strides) or breaks
// exactly one thing (a configuration integer, a tensor's shape, dtype, device, stride or data, the
// sequence table, the page table, the context, the workspace) and knows which parameter it broke.
// Every case must end in one of two ways:
//   - success, with results that match the reference backend (style.md's tolerance: twice the
//     error of the fp64 result rounded to the storage dtype, tests/test_cpu_support.h), or
//   - an nsa::Error whose parameter() is the one the case broke (and whose message names it).
// Anything else fails the run: a crash (the signal handler prints the case), a hang (a watchdog
// thread stops the run after --case-timeout seconds and prints the case), an exception other
// than nsa::Error, an accepted invalid input, an error naming another parameter, or a result
// that does not match.
//
// Usage: nsa_fuzz [--seed S] [--cases N] [--first K] [--case-timeout SEC] [--verbose]
// Case i of seed S is the same on every run and machine (its own generator, seeded from S and i):
// `--first i --cases 1` replays it.
#include <cinttypes>
#include <map>
#include <thread>

#include "fuzz/fuzz_run.h"

namespace nsa::fuzz {
namespace {

// ---- The driver --------------------------------------------------------------------------------

void run_case(Case& c, uint64_t seed) {
  Rng r(case_seed(seed, c.index));
  c.op = r.pick<Op>({Op::forward, Op::forward, Op::backward, Op::backward, Op::compress_fwd, Op::compress_bwd,
                     Op::compressed_attention_fwd, Op::select_topn, Op::selected_attention_fwd,
                     Op::selected_attention_fwd, Op::window_attention_fwd, Op::dense_attention_fwd,
                     Op::dense_attention_bwd, Op::decode, Op::decode, Op::dense_decode, Op::workspace_size});
  const bool cache = c.op == Op::decode || c.op == Op::dense_decode;
  Draw d = draw_problem(r, cache);
  g_dtype = d.sizes.dtype;
  g_matrix_rule = d.backend == Backend::cpu && d.sizes.dtype == DType::bf16 && cpu::kernels().gemm_bf16 != nullptr;
  g_matrix_widen = c.op == Op::backward || c.op == Op::compress_bwd || c.op == Op::dense_attention_bwd ? 32.0 : 8.0;
  c.text = "case " + std::to_string(c.index) + " (seed " + std::to_string(seed) + "): " + op_name(c.op) + " " + describe(d);
  g_current = &c;
  note_case();
  switch (c.op) {
    case Op::forward: case_forward(r, c, d, false); break;
    case Op::backward: case_forward(r, c, d, true); break;
    case Op::decode:
    case Op::dense_decode: case_decode(r, c, d); break;
    case Op::workspace_size: case_workspace_sizes(r, c, d); break;
    default: case_stage(r, c, d); break;
  }
}

int main_impl(int argc, char** argv) {
  uint64_t seed = 1, cases = 300, first = 0;
  double case_timeout = 60.0;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nsa_fuzz: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seed") seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--cases") cases = std::strtoull(next(), nullptr, 10);
    else if (a == "--first") first = std::strtoull(next(), nullptr, 10);
    else if (a == "--case-timeout") case_timeout = std::strtod(next(), nullptr);
    else if (a == "--verbose") verbose = true;
    else {
      std::fprintf(stderr, "usage: nsa_fuzz [--seed S] [--cases N] [--first K] [--case-timeout SEC] [--verbose]\n");
      return 2;
    }
  }
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_fatal_signal);
#ifdef NSA_FUZZ_SANITIZER
  __sanitizer_set_death_callback(on_sanitizer_death);
#endif
  // The watchdog: a case that runs past the limit is a hang; the run stops and names it.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int64_t start = g_case_start_ms.load();
      if (start >= 0 && now_ms() - start > static_cast<int64_t>(case_timeout * 1000)) {
        print_current_case("HANG (case timeout)");
        std::_Exit(3);
      }
    }
  });

  const auto t0 = std::chrono::steady_clock::now();
  std::map<std::string, int> matched, rejected;
  std::vector<std::string> failures;
  for (uint64_t i = first; i < first + cases; ++i) {
    Case c;
    c.index = i;
    g_case_start_ms.store(now_ms());
    try {
      run_case(c, seed);
      (c.expect.empty() ? matched : rejected)[op_name(c.op)]++;
    } catch (const Defect& e) {
      failures.push_back(c.text + "\n    mutation: " + c.mutation + "\n    expected: " +
                         (c.expect.empty() ? std::string("success matching the reference") : "an error naming " + c.expect) +
                         "\n    got: " + e.what);
    } catch (const std::exception& e) {
      failures.push_back(c.text + "\n    mutation: " + c.mutation + "\n    harness exception: " + e.what());
    }
    const int64_t took = now_ms() - g_case_start_ms.exchange(-1);
    if (verbose)
      std::printf("%s | %s | %s | %" PRId64 " ms\n", c.text.c_str(), c.mutation.c_str(),
                  c.expect.empty() ? "success" : c.expect.c_str(), took);
  }
  done = true;
  watchdog.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int n_ok = 0, n_err = 0;
  std::printf("nsa_fuzz: seed %" PRIu64 ", cases %" PRIu64 "..%" PRIu64 " in %.1f s\n", seed, first, first + cases - 1, secs);
  std::printf("  %-26s %8s %8s\n", "operation", "matched", "named");
  std::map<std::string, int> ops;
  for (auto& [k, v] : matched) ops[k] += 0;
  for (auto& [k, v] : rejected) ops[k] += 0;
  for (auto& [k, v] : ops) {
    std::printf("  %-26s %8d %8d\n", k.c_str(), matched[k], rejected[k]);
    n_ok += matched[k];
    n_err += rejected[k];
  }
  std::printf("  %d matched the reference, %d named errors, %zu failures (crashes and hangs stop the run)\n", n_ok, n_err,
              failures.size());
  for (const std::string& f : failures) std::printf("FAIL %s\n", f.c_str());
  return failures.empty() ? 0 : 1;
}


}  // namespace
}  // namespace nsa::fuzz

int main(int argc, char** argv) { return nsa::fuzz::main_impl(argc, argv); }
