// NSA's forward on a small problem through the public API, compiled as C++17 (what nsa::nsa
// promises its consumers). Prints "nsa consumer: ok" when the output of the first token, which
// sees only itself, equals its value row.
#include <nsa/nsa.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  const int64_t T = 64, Hq = 2, Hkv = 1, D = 16;
  nsa::Config cfg;
  cfg.cmp_block_len = 8;
  cfg.cmp_stride = 4;
  cfg.slc_block_len = 16;
  cfg.n_selected = 4;  // n_init = 1 and n_local = 2 of them forced
  cfg.window = 16;
  cfg.phi = nsa::PhiKind::mean;
  cfg.shared_kv = true;
  std::vector<float> q(T * Hq * D), k(T * Hkv * D), v(T * Hkv * D), g(T * Hq * 3);
  for (size_t i = 0; i < q.size(); ++i) q[i] = float((i * 37) % 11) / 11 - 0.5f;
  for (size_t i = 0; i < k.size(); ++i) k[i] = float((i * 53) % 13) / 13 - 0.5f;
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 7) / 7;
  // Gates (compression, selection, window) = (0, 1/2, 1/2): token 0 has no compressed block yet.
  for (size_t i = 0; i < g.size(); ++i) g[i] = i % 3 == 0 ? 0.0f : 0.5f;
  std::vector<float> o(T * Hq * D), lse(T * Hq * 3);
  std::vector<int32_t> idx(T * Hkv * cfg.n_selected);

  nsa::Inputs in;
  in.q = nsa::make_view(q.data(), nsa::DType::f32, {T, Hq, D});
  in.kv[nsa::kCmp].k = nsa::make_view(k.data(), nsa::DType::f32, {T, Hkv, D});
  in.kv[nsa::kCmp].v = nsa::make_view(v.data(), nsa::DType::f32, {T, Hkv, D});
  in.g = nsa::make_view(g.data(), nsa::DType::f32, {T, Hq, 3});
  nsa::ForwardOutputs out;
  out.o = nsa::make_view(o.data(), nsa::DType::f32, {T, Hq, D});
  out.lse = nsa::make_view(lse.data(), nsa::DType::f32, {T, Hq, 3});
  out.indices = nsa::make_view(idx.data(), nsa::DType::i32, {T, Hkv, cfg.n_selected});

  nsa::Context ctx;
  try {
    const size_t bytes = nsa::workspace_size(ctx, nsa::Op::forward, cfg, nsa::problem_of(cfg, in));
    std::vector<double> workspace(bytes / sizeof(double) + 64);  // + 256-byte alignment
    void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 255) / 256 * 256);
    nsa::forward(ctx, cfg, in, out, {aligned, bytes});
  } catch (const nsa::Error& e) {
    std::fprintf(stderr, "nsa consumer: %s\n", e.what());
    return 1;
  }
  // Token 0 attends only to itself in the selection and the window, so o[0, h] = v[0].
  double err = 0;
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t c = 0; c < D; ++c) err = std::fmax(err, std::fabs(o[h * D + c] - v[c]));
  std::printf("nsa consumer: o[0] against v[0]: max error %.2e\n", err);
  if (err > 1e-5) return 1;
  std::printf("nsa consumer: ok\n");
  return 0;
}
