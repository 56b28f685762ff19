// The options of `nsa bench` and the pieces its parsers share (tools/nsa/main.cpp for the CPU
// backends and the CUDA backend's default table, cuda_suite_*.cpp for the suites). Header-only,
// so that the CUDA benchmark files compile it without another library target.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "nsa/nsa.h"

namespace nsa_cli {

// A command-line mistake: `nsa` prints "nsa: <message>" and exits with status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `nsa bench` without --suite: sizes, run and NSA configuration (see the help in main.cpp).
struct BenchOptions {
  nsa::Config cfg;
  std::vector<int64_t> seqlens = {8192};
  int64_t hq = 16, hkv = 1, dqk = 128, dv = 128, phi_hidden = 128;
  nsa::DType dtype = nsa::DType::bf16;
  int threads = 0;
  nsa::Backend backend = nsa::Backend::automatic;
  int repeats = 1;
  int warmup = 1;
  int64_t check_tokens = 256;
  bool backward = true;
  bool dense = true;
};

inline int64_t parse_int(const std::string& opt, const std::string& text) {
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return v;
  } catch (const std::exception&) {
    throw UsageError(opt + " expects an integer, got \"" + text + "\"");
  }
}

inline double parse_double(const std::string& opt, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return v;
  } catch (const std::exception&) {
    throw UsageError(opt + " expects a number, got \"" + text + "\"");
  }
}

inline std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items(1);
  for (char ch : list) {
    if (ch == ',') items.emplace_back();
    else items.back() += ch;
  }
  return items;
}

inline int64_t positive(const std::string& opt, int64_t v) {
  if (v < 1) throw UsageError(opt + " must be >= 1, got " + std::to_string(v));
  return v;
}

// "--lengths 8192,65536": positive integers separated by commas.
inline std::vector<int64_t> parse_lengths(const std::string& opt, const std::string& list) {
  std::vector<int64_t> out;
  for (const std::string& item : split_commas(list)) out.push_back(positive(opt, parse_int(opt, item)));
  return out;
}

inline nsa::DType parse_dtype(const std::string& text) {
  if (text == "bf16") return nsa::DType::bf16;
  if (text == "f16") return nsa::DType::f16;
  if (text == "f32") return nsa::DType::f32;
  throw UsageError("--dtype must be bf16, f16 or f32, got \"" + text + "\"");
}

// The options after `bench` (argv[2..]); UsageError or nsa::Error (a configuration rule) on a mistake.
inline BenchOptions parse_bench(int argc, char** argv) {
  BenchOptions o;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    auto at_least = [&](int64_t lo, const char* what) {
      const int64_t v = parse_int(a, value());
      if (v < lo) throw UsageError(a + " must be >= " + std::to_string(lo) + what + ", got " + std::to_string(v));
      return v;
    };
    if (a == "--seqlens") o.seqlens = parse_lengths(a, value());
    else if (a == "--hq") o.hq = at_least(1, "");
    else if (a == "--hkv") o.hkv = at_least(1, "");
    else if (a == "--dqk") o.dqk = at_least(1, "");
    else if (a == "--dv") o.dv = at_least(1, "");
    else if (a == "--phi-hidden") o.phi_hidden = at_least(1, "");
    else if (a == "--dtype") o.dtype = parse_dtype(value());
    else if (a == "--threads") o.threads = static_cast<int>(at_least(0, " (0: OpenMP default)"));
    else if (a == "--backend") o.backend = nsa::parse_backend(value().c_str());
    else if (a == "--repeats") o.repeats = static_cast<int>(at_least(1, ""));
    else if (a == "--warmup") o.warmup = static_cast<int>(at_least(0, ""));
    else if (a == "--check-tokens") o.check_tokens = at_least(0, "");
    else if (a == "--no-backward") o.backward = false;
    else if (a == "--no-dense") o.dense = false;
    else if (a == "--cmp-block-len") o.cfg.cmp_block_len = parse_int(a, value());
    else if (a == "--cmp-stride") o.cfg.cmp_stride = parse_int(a, value());
    else if (a == "--slc-block-len") o.cfg.slc_block_len = parse_int(a, value());
    else if (a == "--n-selected") o.cfg.n_selected = parse_int(a, value());
    else if (a == "--n-init") o.cfg.n_init = parse_int(a, value());
    else if (a == "--n-local") o.cfg.n_local = parse_int(a, value());
    else if (a == "--backbone") {
      std::vector<int64_t> offs;
      for (const std::string& x : split_commas(value())) offs.push_back(parse_int(a, x));
      o.cfg.set_backbone(offs);
    } else if (a == "--window") o.cfg.window = parse_int(a, value());
    else if (a == "--scale") o.cfg.scale = parse_double(a, value());
    else if (a == "--phi") o.cfg.phi = nsa::parse_phi_kind(value(), "--phi");
    else if (a == "--shared-kv") o.cfg.shared_kv = true;
    else throw UsageError("unknown option " + a + " (see nsa --help)");
  }
  if (o.hq % o.hkv != 0)
    throw UsageError("--hq (" + std::to_string(o.hq) + ") must be a multiple of --hkv (" + std::to_string(o.hkv) + ")");
  o.cfg.validate();  // nsa::Error names the field and the rule
  return o;
}

// What every suite (`nsa bench --suite NAME`) takes: --out FILE, --quick (T = 8192 only) and
// --lengths LIST. parse_suite starts from `defaults` and hands every other option to
// `own(option, value)`, which takes it (returns true) or not (a UsageError listing `help`).
struct SuiteOptions {
  std::string out;
  std::vector<int64_t> lengths;
};
using SuiteOption = std::function<bool(const std::string& option, const std::function<std::string()>& value)>;
inline SuiteOptions parse_suite(const std::string& suite, const std::vector<std::string>& args, SuiteOptions defaults,
                                const std::string& help, const SuiteOption& own) {
  SuiteOptions o = std::move(defaults);
  bool quick = false;
  std::vector<int64_t> chosen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const std::function<std::string()> value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw UsageError(a + " needs a value");
      return args[++i];
    };
    if (a == "--out") o.out = value();
    else if (a == "--quick") quick = true;
    else if (a == "--lengths") chosen = parse_lengths(a, value());
    else if (!own(a, value))
      throw UsageError("--suite " + suite + ": unknown option " + a + " (its options: " + help + "; see nsa --help)");
  }
  if (quick) o.lengths = {8192};
  if (!chosen.empty()) o.lengths = chosen;
  return o;
}

}  // namespace nsa_cli
