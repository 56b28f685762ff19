#include <gtest/gtest.h>

#include "support.h"

using namespace nsa;
using namespace nsa::test;

TEST(Smoke, ForwardBackwardWriteEverything) {
  Config cfg;
  cfg.cmp_block_len = 8; cfg.cmp_stride = 4; cfg.slc_block_len = 16; cfg.n_selected = 3;
  cfg.n_init = 1; cfg.n_local = 1; cfg.window = 12;
  Sizes s; s.seqlens = {37, 0, 50};
  LayerProblem p = make_problem(cfg, s, 1);
  Context ctx; ctx.backend = Backend::reference;
  forward(ctx, cfg, p.inputs(), p.outputs());
  backward(ctx, cfg, p.inputs(), p.outputs(), p.d_o.view(), p.gradients());
  for (double x : p.o.values()) ASSERT_FALSE(std::isnan(x));
  for (double x : p.dq.values()) ASSERT_FALSE(std::isnan(x));
  for (double x : p.dphi_k[0].values()) ASSERT_FALSE(std::isnan(x));
}
