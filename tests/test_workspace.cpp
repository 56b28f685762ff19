// Workspaces: workspace_size() answers for the call's context (its thread count included), and
// a workspace smaller than that is an error, never an overrun.
#include <gtest/gtest.h>

#include "support.h"

namespace nsa::test {
namespace {

struct alignas(256) Chunk {
  unsigned char bytes[256];
};

TEST(Workspace, SizedForTheCallsThreadCount) {
  if (!backend_available(Backend::cpu)) GTEST_SKIP() << "no cpu backend in this build";
  Config cfg;
  cfg.cmp_block_len = 8, cfg.cmp_stride = 4, cfg.slc_block_len = 16, cfg.n_selected = 3, cfg.window = 12;
  Sizes s;
  s.seqlens = {70, 41};
  s.hq = 4, s.hkv = 2, s.dqk = s.dv = 16;
  s.dtype = DType::f32;
  LayerProblem p = make_problem(cfg, s, 3);
  std::vector<double> first;
  for (int threads : {1, 7}) {  // 7: more threads than this machine's cores
    Context ctx = context_of(Backend::cpu);
    ctx.num_threads = threads;
    const size_t bytes = workspace_size(ctx, Op::forward, cfg, problem_of(cfg, p.inputs()));
    std::vector<Chunk> ws((bytes + 255) / 256);
    p.o.poison();
    forward(ctx, cfg, p.inputs(), p.outputs(), {ws.data(), bytes});
    if (first.empty()) first = p.o.values();
    else EXPECT_EQ(max_abs_diff(first, p.o.values()), 0.0);  // same bits on any thread count
    if (bytes > 0) {
      try {
        forward(ctx, cfg, p.inputs(), p.outputs(), {ws.data(), bytes - 1});
        ADD_FAILURE() << "a workspace one byte short was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.parameter(), "workspace.bytes") << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace nsa::test
