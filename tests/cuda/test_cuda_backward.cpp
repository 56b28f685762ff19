// The CUDA backward against the fp64 reference backward, and its determinism.
//
// Both backends get the same saved state: lse and indices come from the reference forward, so
// selection (a constant of the backward, spec §8) is identical and every gradient can be
// compared element by element. Inputs are random and rounded to the storage type; the reference
// runs in fp64 on exactly those values. Gradients are poisoned (NaN) before the GPU run, so an
// unwritten element fails. Shapes are awkward on purpose: lengths that are not multiples of l,
// d, l', w; packed batches with empty and one-token sequences; n larger than the block count;
// G from 1 to 16; shared and independent K/V; all three phi kinds; cu_seqlens on the device.
//
// Tolerance (style.md): a plain same-precision backward rounds P and dS to the storage type
// before each product and rounds its outputs, so each gradient element carries an error of
// about u (|x| + max|x|) (u the unit roundoff; the second term is the accumulated rounding of
// the fp32 sums, which scales with the tensor's size, not with the element, because of the
// cancellation in sums like dV = sum P^T dO). We allow twice that, plus 1e-6 absolute. For
// phi's parameters max|x| is taken over all the parameters of the same phi (see below).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "cases.h"
#include "cuda/tile_sizes.h"

using namespace nsa;
using namespace nsa::test;

namespace {

using BwdCase = AttentionCase;  // cases.h

const std::vector<BwdCase>& bwd_cases() {
  static const std::vector<BwdCase> all = {
      // name, dtype, Dqk, Dv, Hq, Hkv, seqlens, l, d, l', n, n_init, n_local, w, phi, shared_kv
      {"bf16_d128_G16_paper", DType::bf16, 128, 128, 16, 1, {300}, 32, 16, 64, 6, 1, 2, 100, PhiKind::mean, false},
      {"f16_d64_G1_packed_linear", DType::f16, 64, 64, 2, 2, {37, 0, 130, 1}, 16, 8, 32, 5, 1, 1, 40, PhiKind::linear, false},
      {"bf16_d192x128_G4_mlp", DType::bf16, 192, 128, 8, 2, {257}, 32, 16, 64, 4, 1, 2, 70, PhiKind::mlp, false},
      {"f16_d128x64_G2_shared_bigN_mlp", DType::f16, 128, 64, 4, 2, {99, 200}, 8, 4, 16, 20, 2, 2, 33, PhiKind::mlp, true},
      {"bf16_d64x128_G8_w1", DType::bf16, 64, 128, 8, 1, {150}, 32, 8, 64, 3, 0, 1, 1, PhiKind::mean, false},
      {"f16_d192x64_G16_nowindow", DType::f16, 192, 64, 16, 1, {65, 64}, 32, 16, 64, 16, 1, 2, 0, PhiKind::mean, false},
      // The paper's head dims at G = 16 over many key and query tiles, packed: sm_90a's one-buffer
      // pipelines of dq_kernel and dkv_kernel at Dqk 192 (two CTAs per SM).
      {"bf16_d192x128_G16_packed_long", DType::bf16, 192, 128, 16, 1, {1100, 37}, 32, 16, 64, 8, 1, 2, 256, PhiKind::mean, false},
      {"bf16_d128_G2_noselect_linear", DType::bf16, 128, 128, 4, 2, {190}, 32, 16, 64, 0, 0, 0, 64, PhiKind::linear, false},
      {"f16_d128_G4_lp128_shared", DType::f16, 128, 128, 8, 2, {333}, 16, 16, 128, 2, 1, 1, 200, PhiKind::mean, true},
      {"bf16_d64_G1_long_splits", DType::bf16, 64, 64, 1, 1, {1500, 3}, 32, 16, 64, 4, 1, 2, 96, PhiKind::mlp, false},
      {"bf16_d64_G2_shorter_than_l", DType::bf16, 64, 64, 2, 1, {20, 1, 31}, 32, 16, 64, 2, 1, 1, 8, PhiKind::linear, true},
      // phi's products over several 128 x 128 tiles in both directions (F = 136: a partial second
      // column of tiles; 136 compressed rows x Hkv 2 = 272 rows), and F = 20, which is no multiple of 8: bf16
      // on the converting products instead of the direct ones.
      {"bf16_d128_G4_mlp_F136", DType::bf16, 128, 128, 8, 2, {2100, 77}, 32, 16, 64, 4, 1, 2, 128, PhiKind::mlp, false, 136},
      {"bf16_d64_G2_shared_mlp_F20", DType::bf16, 64, 64, 4, 2, {300, 45}, 32, 16, 64, 3, 1, 1, 64, PhiKind::mlp, true, 20},
      // l' = 24: selection blocks that end inside a 16-key step of the selection dq kernel.
      {"bf16_d64x128_G8_lp24", DType::bf16, 64, 128, 8, 1, {333, 50}, 16, 8, 24, 5, 1, 1, 50, PhiKind::mean, false},
      // G = 1, l' = 64, 102 blocks: the selection's union tiles (dq_kernel) for the row tiles of
      // the first ~4000 tokens, whose 64 tokens pick among at most 64 blocks, and the per-token
      // kernel (slc_dq_kernel) for the later ones, in one call.
      {"bf16_d64_G1_T6500_union_mixed", DType::bf16, 64, 64, 1, 1, {6500}, 32, 16, 64, 16, 1, 2, 96, PhiKind::mean, false},
  };
  return all;
}

// Rounds every random input to `dtype` once, and keeps an exact fp64 twin for the reference.
struct Twin {
  LayerProblem low;  // storage dtype (what the GPU reads)
  LayerProblem ref;  // fp64, same values
};

void copy_values(const HostTensor& from, HostTensor& to) {
  for (int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
}

Twin make_twin(const BwdCase& c, uint64_t seed) {
  const Config cfg = config_of(c);
  Twin t{make_problem(cfg, sizes_of(c, c.dtype), seed), make_problem(cfg, sizes_of(c, DType::f64), seed)};
  copy_values(t.low.q, t.ref.q);
  copy_values(t.low.g, t.ref.g);
  copy_values(t.low.d_o, t.ref.d_o);
  for (int b = 0; b < 3; ++b) {
    copy_values(t.low.k[b], t.ref.k[b]);
    copy_values(t.low.v[b], t.ref.v[b]);
  }
  for (int i = 0; i < 5; ++i) {
    copy_values(t.low.phi_k[i], t.ref.phi_k[i]);
    copy_values(t.low.phi_v[i], t.ref.phi_v[i]);
  }
  return t;
}

// make_twin, then what forward() saves for the backward (lse and indices, from the reference
// forward in fp64) in both twins.
Twin make_saved_twin(const BwdCase& c, uint64_t seed) {
  Twin t = make_twin(c, seed);
  forward(cuda_context(Backend::reference), config_of(c), t.ref.inputs(), t.ref.outputs());
  copy_values(t.ref.lse, t.low.lse);
  copy_values(t.ref.indices, t.low.indices);
  return t;
}

// Device copies of everything the backward reads and writes.
struct DeviceLayer {
  DeviceTensor q, g, d_o, lse, indices, cu;
  DeviceTensor k[3], v[3], phi_k[5], phi_v[5];
  DeviceTensor dq, dg, dk[3], dv[3], dphi_k[5], dphi_v[5];
  Inputs in;
  ForwardOutputs saved;
  Gradients grads;

  DeviceLayer(LayerProblem& p, int64_t max_seqlen)
      : q(p.q), g(p.g), d_o(p.d_o), lse(p.lse), indices(p.indices), cu(p.cu),
        dq(p.dq), dg(p.dg) {
    for (int b = 0; b < 3; ++b) {
      k[b] = DeviceTensor(p.k[b]);
      v[b] = DeviceTensor(p.v[b]);
      dk[b] = DeviceTensor(p.dk[b]);  // poisoned by make_problem
      dv[b] = DeviceTensor(p.dv[b]);
    }
    for (int i = 0; i < 5; ++i) {
      phi_k[i] = DeviceTensor(p.phi_k[i]);
      phi_v[i] = DeviceTensor(p.phi_v[i]);
      dphi_k[i] = DeviceTensor(p.dphi_k[i]);
      dphi_v[i] = DeviceTensor(p.dphi_v[i]);
    }
    in.q = q.view();
    for (int b = 0; b < 3; ++b) in.kv[b] = KV{k[b].view(), v[b].view()};
    in.g = g.view();
    in.phi_k = PhiParams{phi_k[0].view(), phi_k[1].view(), phi_k[2].view(), phi_k[3].view(), phi_k[4].view()};
    in.phi_v = PhiParams{phi_v[0].view(), phi_v[1].view(), phi_v[2].view(), phi_v[3].view(), phi_v[4].view()};
    if (p.sizes.seqlens.size() != 1) in.seqs.cu_seqlens = cu.view();
    in.seqs.max_seqlen = max_seqlen;
    saved.lse = lse.view();
    saved.indices = indices.view();
    grads.dq = dq.view();
    for (int b = 0; b < 3; ++b) grads.dkv[b] = KV{dk[b].view(), dv[b].view()};
    grads.dg = dg.view();
    grads.dphi_k = PhiParams{dphi_k[0].view(), dphi_k[1].view(), dphi_k[2].view(), dphi_k[3].view(), dphi_k[4].view()};
    grads.dphi_v = PhiParams{dphi_v[0].view(), dphi_v[1].view(), dphi_v[2].view(), dphi_v[3].view(), dphi_v[4].view()};
  }

  // Runs the CUDA backward with a fresh (poisoned) workspace.
  void run(const Config& cfg) {
    const Context ctx = cuda_context(Backend::cuda);
    const DeviceWorkspace ws(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, in)));  // NaN pattern
    backward(ctx, cfg, in, saved, d_o.view(), grads, ws.view());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  // Every gradient tensor (host copies), in a fixed order with names.
  std::vector<std::pair<std::string, HostTensor>> download(LayerProblem& shape_of) const {
    std::vector<std::pair<std::string, HostTensor>> out;
    auto add = [&](const std::string& name, const DeviceTensor& d, const HostTensor& like) {
      if (!like.defined()) return;
      HostTensor h(like.dtype(), like.shape());
      d.download(h);
      out.emplace_back(name, std::move(h));
    };
    add("dq", dq, shape_of.dq);
    add("dg", dg, shape_of.dg);
    static const char* kBranch[3] = {"cmp", "slc", "win"};
    for (int b = 0; b < 3; ++b) {
      add(std::string("dk_") + kBranch[b], dk[b], shape_of.dk[b]);
      add(std::string("dv_") + kBranch[b], dv[b], shape_of.dv[b]);
    }
    static const char* kParam[5] = {"w1", "b1", "w2", "b2", "pe"};
    for (int i = 0; i < 5; ++i) {
      add(std::string("dphi_k.") + kParam[i], dphi_k[i], shape_of.dphi_k[i]);
      add(std::string("dphi_v.") + kParam[i], dphi_v[i], shape_of.dphi_v[i]);
    }
    return out;
  }
};

// The reference's gradient tensor matching a name of DeviceLayer::download.
const HostTensor& ref_grad(LayerProblem& r, const std::string& name) {
  static const char* kBranch[3] = {"cmp", "slc", "win"};
  static const char* kParam[5] = {"w1", "b1", "w2", "b2", "pe"};
  if (name == "dq") return r.dq;
  if (name == "dg") return r.dg;
  for (int b = 0; b < 3; ++b) {
    if (name == std::string("dk_") + kBranch[b]) return r.dk[b];
    if (name == std::string("dv_") + kBranch[b]) return r.dv[b];
  }
  for (int i = 0; i < 5; ++i) {
    if (name == std::string("dphi_k.") + kParam[i]) return r.dphi_k[i];
    if (name == std::string("dphi_v.") + kParam[i]) return r.dphi_v[i];
  }
  throw std::runtime_error("unknown gradient " + name);
}

// `terms`: 1, or 2 where the backward reads a saved output rounded to the storage dtype (o_branch
// or o): the rows' D = rowsum(dO * O) then carry a rounding error of u |dO| |O|, the same order as
// the rounding of P and dS that the first term budgets.
auto grad_tol(DType dtype, double vmax, double terms = 1.0) {
  const double u = unit_roundoff(dtype);
  return [=](double want, size_t) { return 2.0 * terms * u * (std::fabs(want) + vmax) + 1e-6; };
}

class CudaBackward : public ::testing::TestWithParam<BwdCase> {};

// The twin (seed 101, lse and indices from the reference forward in both, and the forward's o and
// o_branch rounded to the storage dtype as forward() writes them) and the reference backward's
// fp64 gradients, made once per case: every check_against_reference test of a case compares with
// the same gradients, so only the device runs are per test. Nothing changes the twin afterwards:
// the device gradients start from its poisoned tensors and are downloaded into new ones.
Twin& reference_of(const BwdCase& c) {
  static std::map<std::string, std::unique_ptr<Twin>> cache;
  std::unique_ptr<Twin>& t = cache[c.name];
  if (!t) {
    t = std::make_unique<Twin>(make_saved_twin(c, 101));
    copy_values(t->ref.o, t->low.o);
    copy_values(t->ref.o_branch, t->low.o_branch);
    backward(cuda_context(Backend::reference), config_of(c), t->ref.inputs(), t->ref.outputs(), t->ref.d_o.view(),
             t->ref.gradients());
  }
  return *t;
}

// Device backward runs, one per entry of `paths`: {0, false} is the backend's own choice of
// splits, sort and pieces; see LongSequencePaths (cuda_support.h).
struct Paths {
  int cmp_splits;
  bool pair_sort;
  int raw_piece_tiles = 0;
};

// Plane b ([T, Hq, Dv]) of a device o_branch [3, T, Hq, Dv], with its strides.
TensorView plane_view(const DeviceTensor& o_branch, int b) {
  TensorView plane = o_branch.view();
  plane.data = static_cast<char*>(plane.data) + b * plane.stride[0] * int64_t(dtype_size(plane.dtype));
  plane.ndim = 3;
  for (int k = 0; k < 3; ++k) {
    plane.shape[k] = plane.shape[k + 1];
    plane.stride[k] = plane.stride[k + 1];
  }
  return plane;
}

// What the backward is given of the forward's outputs besides lse and indices (each rounded to
// the storage dtype, as forward() writes it). o_branch: the branch outputs, dg taken from them
// instead of recomputing each branch's output. o: the forward's o, the selection's D taken from it
// (BwdArgs::d_from_o). o_cmp: the compressed branch's output (o_branch's first plane, as a strided
// view), its dg taken from it (BwdArgs::dg_cmp_ready); o_win: the window branch's (the third
// plane; BwdArgs::dg_win_ready).
struct Kept {
  bool o_branch = false, o = false, o_cmp = false, o_win = false;
};

// Every gradient of the CUDA backward against the fp64 reference, given `kept`.
void check_against_reference(const BwdCase& c, Kept kept, const std::vector<Paths>& paths = {{0, false}}) {
  const Config cfg = config_of(c);
  Twin& t = reference_of(c);
  const int64_t longest = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  for (const Paths& run : paths) {
    SCOPED_TRACE("forced: compressed splits " + std::to_string(run.cmp_splits) + (run.pair_sort ? ", pair sort" : "") +
                 ", raw piece tiles " + std::to_string(run.raw_piece_tiles));
    const LongSequencePaths forced(run.cmp_splits, run.pair_sort, run.raw_piece_tiles);
    DeviceLayer dev(t.low, longest);
    DeviceTensor o_branch, o_saved;
    if (kept.o_branch || kept.o_cmp || kept.o_win) o_branch = DeviceTensor(t.low.o_branch);
    if (kept.o_branch) dev.saved.o_branch = o_branch.view();
    if (kept.o_cmp) dev.saved.o_cmp = plane_view(o_branch, kCmp);
    if (kept.o_win) dev.saved.o_win = plane_view(o_branch, kWin);
    if (kept.o) {
      o_saved = DeviceTensor(t.low.o);
      dev.saved.o = o_saved.view();
    }
    dev.run(cfg);
    const auto grads = dev.download(t.low);
    // phi's parameter gradients are all sums over the same compressed rows of dy (or dpre) times
    // O(1) activations, so a plain implementation's rounding error is the same for each parameter
    // of one phi: the largest of them sets it. Without this, b2 of phi_k (and pe of a linear
    // phi_k) would be compared with no scale at all: softmax is invariant to adding one vector to
    // every key, so the exact sum of dLoss/dkc over the compressed keys is 0.
    double phi_scale[2] = {0, 0};
    for (auto& [name, got] : grads)
      for (int which = 0; which < 2; ++which)
        if (name.rfind(which == 0 ? "dphi_k." : "dphi_v.", 0) == 0)
          phi_scale[which] = std::max(phi_scale[which], max_abs(ref_grad(t.ref, name).values()));
    for (auto& [name, got] : grads) {
      const HostTensor& want = ref_grad(t.ref, name);
      const std::vector<double> w = want.values();
      double scale = max_abs(w);
      if (name.rfind("dphi_k.", 0) == 0) scale = phi_scale[0];
      if (name.rfind("dphi_v.", 0) == 0) scale = phi_scale[1];
      const auto result = close(got.values(), w, grad_tol(c.dtype, scale, kept.o_branch || kept.o || kept.o_cmp || kept.o_win ? 2.0 : 1.0));
      EXPECT_TRUE(result) << name;
      std::printf("  %-14s max|ref| %.3g  %s\n", name.c_str(), max_abs(w), result.message());
    }
  }
}

TEST_P(CudaBackward, EveryGradientMatchesReference) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {});
}

// With no tensor maps (CudaKernelChoices::tma = false) dq_kernel copies its K/V tiles by
// cp.async, as it does where a map cannot be encoded.
TEST_P(CudaBackward, EveryGradientWithoutTmaMatchesReference) {
  NSA_REQUIRE_GPU();
  const NoTensorMaps no_tma;
  check_against_reference(GetParam(), {});
}

// With the selection's union tiles off (CudaKernelChoices::slc_union_tiles = false) every row
// tile's selection dq goes through slc_dq_kernel; with them on (the other tests), the tiles whose
// union is small (at the tests' lengths: most tiles of l' = 64) go through dq_kernel.
TEST_P(CudaBackward, EveryGradientWithPerTokenSelectionMatchesReference) {
  NSA_REQUIRE_GPU();
  const NoSelectionUnionTiles per_token;
  check_against_reference(GetParam(), {});
}

// dK / dV: at Dqk = Dv = 128 on sm_90a the other tests run the warp-specialised dkv_ws_kernel; here
// the one-warpgroup dkv_kernel that every other shape and target runs. With the forward's o, o_cmp
// and o_win, as the torch layer calls it, and raw lists in pieces (pieces of 3 tiles), so that
// both bodies' piece sums run.
TEST_P(CudaBackward, EveryGradientWithOneWarpgroupDkvMatchesReference) {
  NSA_REQUIRE_GPU();
  const OneWarpgroupDkv one_warpgroup;
  check_against_reference(GetParam(), {});
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true}, {{0, false, 3}});
}

// phi of k and of v recomputed in launches of their own (SeparatePhis) where the other tests run
// them as one launch per product.
TEST_P(CudaBackward, EveryGradientWithSeparatePhisMatchesReference) {
  NSA_REQUIRE_GPU();
  const SeparatePhis one_at_a_time;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}

// phi's bf16 products (the recompute, the parameters' and x's gradients) on mma.sync
// (PhiOnMmaSync, PhiOwnProducts) where the default runs the large ones on cuBLASLt and the others
// on wgmma (sm_90a).
TEST_P(CudaBackward, EveryGradientWithPhiOnMmaSyncMatchesReference) {
  NSA_REQUIRE_GPU();
  const PhiOwnProducts own;
  const PhiOnMmaSync mma_sync;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}

// phi's large bf16 products on the library's own kernels (PhiOwnProducts: wgmma on sm_90a) where
// the default runs them on cuBLASLt.
TEST_P(CudaBackward, EveryGradientWithPhiOnOwnProductsMatchesReference) {
  NSA_REQUIRE_GPU();
  const PhiOwnProducts own;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}

TEST_P(CudaBackward, SavedBranchOutputsGiveTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o_branch = true});
}

// With the forward's o (no o_branch) the selection's output is not recomputed: its D from <dO, o>
// minus the other branches' gated dg, dg_slc summed in pass 2 (dq_kernel for the union tiles,
// slc_dq_kernel for the others). Then with the union tiles off, so that every row tile goes
// through slc_dq_kernel.
TEST_P(CudaBackward, SavedOutputGivesTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true});
}
TEST_P(CudaBackward, SavedOutputGivesTheSameGradientsPerToken) {
  NSA_REQUIRE_GPU();
  const NoSelectionUnionTiles per_token;
  check_against_reference(GetParam(), {.o = true});
}

// With the forward's o and o_cmp the compressed branch's dg comes from o_cmp and dq_kernel's first
// pass recomputes the window's output alone; then with the union tiles off, and with o_cmp alone
// (the selection's output recomputed as without o).
TEST_P(CudaBackward, SavedCompressedOutputGivesTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true, .o_cmp = true});
}
TEST_P(CudaBackward, SavedCompressedOutputGivesTheSameGradientsPerToken) {
  NSA_REQUIRE_GPU();
  const NoSelectionUnionTiles per_token;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true});
}
TEST_P(CudaBackward, SavedCompressedOutputWithoutOGivesTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o_cmp = true});
}

// With the forward's o, o_cmp and o_win (the torch layer's default on CUDA) dq_kernel's first pass
// takes no tile: every branch's dg or D comes from a saved output. Then with the union tiles off,
// without tensor maps (the cp.async sweep), and with o_win alone (the compressed and selection
// outputs recomputed, the window's dg from o_win).
TEST_P(CudaBackward, SavedCompressedAndWindowOutputsGiveTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}
TEST_P(CudaBackward, SavedCompressedAndWindowOutputsGiveTheSameGradientsPerToken) {
  NSA_REQUIRE_GPU();
  const NoSelectionUnionTiles per_token;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}
TEST_P(CudaBackward, SavedCompressedAndWindowOutputsWithoutTmaGiveTheSameGradients) {
  NSA_REQUIRE_GPU();
  const NoTensorMaps no_tma;
  check_against_reference(GetParam(), {.o = true, .o_cmp = true, .o_win = true});
}
TEST_P(CudaBackward, SavedWindowOutputAloneGivesTheSameGradients) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o_win = true});
}

// Paths the backward's rules keep for sequences longer than these cases, forced
// (LongSequencePaths), with the forward's o as the torch layer calls it. Each has its break patch
// in one round (cmp_parts_first_eight, pair_sort_tokens_left, raw_pieces_first_two).
//
// 16 compressed splits, the most there are, and 11: the rule gives 16 from ~15K tokens at G >= 16
// (and 8 from ~7K at G >= 8), so without this the tests reach only the splits of their own lengths
// (4 at most). Here most splits hold a few tokens, many see no compressed block (no partial rows),
// the packed cases run splits that keep every row, and 11 puts the split boundaries elsewhere.
TEST_P(CudaBackward, CompressedSplitsUpToSixteenMatchReference) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true}, {{16, false}, {11, false}});
}
// The raw blocks' selection lists in pieces (dkv_kernel<raw>, raw_pieces_plan_kernel): the rule
// cuts lists longer than 1/1024 of all raw CTAs' query tiles (at least 32), the cap doubled until
// the pieces fit the workspace's slots, which at the cases' lengths cuts a few lists at most (the
// forced initial blocks' lists, the whole sequence after the block, first among them). Caps
// from 1, 3 and 5 tiles (doubled as far as the slots need: other lists cut into other pieces) and
// no pieces at all (each list whole, as before pieces existed), with independent and shared K/V
// (the cases).
TEST_P(CudaBackward, RawListPiecesMatchReference) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true}, {{0, false, 1}, {0, false, 3}, {0, false, 5}, {0, false, -1}});
}
// The inverted selection index sorted as (key, token) pairs, which the rule does only where key
// and token bits exceed 32 (~256K tokens at Hkv = 4).
TEST_P(CudaBackward, PairSortMatchesReference) {
  NSA_REQUIRE_GPU();
  check_against_reference(GetParam(), {.o = true}, {{0, true}});
}

// Whether two tensors of one shape and dtype hold the same bytes.
bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return std::memcmp(const_cast<HostTensor&>(a).data(), const_cast<HostTensor&>(b).data(),
                     size_t(a.numel()) * dtype_size(a.dtype())) == 0;
}

// The gradients of `got` have the bits of the same gradients in `want` (as DeviceLayer::download
// names them); `what` says which run `got` is.
void expect_same_bits(const std::vector<std::pair<std::string, HostTensor>>& want,
                      const std::vector<std::pair<std::string, HostTensor>>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(same_bytes(want[i].second, got[i].second)) << want[i].first << " of " << what;
}

TEST_P(CudaBackward, BitwiseDeterministic) {
  NSA_REQUIRE_GPU();
  const BwdCase& c = GetParam();
  const Config cfg = config_of(c);
  Twin t = make_saved_twin(c, 202);
  const int64_t longest = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  DeviceLayer dev(t.low, longest);
  dev.run(cfg);
  const auto first = dev.download(t.low);
  for (int rep = 0; rep < 3; ++rep) {
    dev.run(cfg);
    expect_same_bits(first, dev.download(t.low), "repetition " + std::to_string(rep));
  }
}

// The backward captured in a CUDA graph on the caller's stream (after one eager call there, which
// makes phi's cuBLASLt handle and plans), as a captured training step has it, given what the torch
// layer keeps (o, o_cmp, o_win), and replayed with every gradient poisoned first, gives the eager
// call's bits. A host synchronisation, a pageable copy or a host read of device data inside the call
// would fail the capture.
TEST_P(CudaBackward, ReplayOfACapturedBackwardGivesTheEagerBits) {
  NSA_REQUIRE_GPU();
  const BwdCase& c = GetParam();
  const Config cfg = config_of(c);
  Twin t = make_saved_twin(c, 109);
  copy_values(t.ref.o, t.low.o);
  copy_values(t.ref.o_branch, t.low.o_branch);
  DeviceLayer dev(t.low, *std::max_element(c.seqlens.begin(), c.seqlens.end()));
  DeviceTensor o_branch(t.low.o_branch), o(t.low.o);
  dev.saved.o = o.view();
  dev.saved.o_cmp = plane_view(o_branch, kCmp);
  dev.saved.o_win = plane_view(o_branch, kWin);
  cudaStream_t stream;
  NSA_TEST_CUDA(cudaStreamCreate(&stream));
  Context ctx = cuda_context(Backend::cuda);
  ctx.stream = stream;
  const DeviceWorkspace ws(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, dev.in)));
  backward(ctx, cfg, dev.in, dev.saved, dev.d_o.view(), dev.grads, ws.view());
  NSA_TEST_CUDA(cudaStreamSynchronize(stream));
  const auto eager = dev.download(t.low);

  auto poison_gradients = [&] {  // dq, dg, every dK / dV and phi gradient
    std::vector<const DeviceTensor*> grads = {&dev.dq, &dev.dg};
    for (int b = 0; b < 3; ++b) grads.insert(grads.end(), {&dev.dk[b], &dev.dv[b]});
    for (int i = 0; i < 5; ++i) grads.insert(grads.end(), {&dev.dphi_k[i], &dev.dphi_v[i]});
    for (const DeviceTensor* d : grads)
      if (const cudaError_t e = d->poison(stream); e != cudaSuccess) return e;
    return cudaSuccess;
  };
  const std::string failed = capture_and_replay(
      stream, [&] { backward(ctx, cfg, dev.in, dev.saved, dev.d_o.view(), dev.grads, ws.view()); }, poison_gradients);
  ASSERT_TRUE(failed.empty()) << "the backward's capture and replay: " << failed;
  expect_same_bits(eager, dev.download(t.low), "the replay");
  cudaStreamDestroy(stream);
}

// The sequences of a packed batch do not see each other: with every input row of one sequence
// NaN (q, the gates, dO, k and v of every branch; the saved state from the clean inputs), every
// per-token gradient row of the others (dq, dg, dk and dv of each branch) is bit for bit what it
// was. The kernels read whole tiles of keys or queries (TMA boxes), so rows of the next sequence
// land in shared memory past a tile's; they must be zeroed or masked, since a zero dS times NaN
// is NaN. (The compressed row no sequence uses is written by the backward's phi, so it is never
// the danger here. phi's parameter gradients sum over every sequence, so NaN reaches them by
// definition.)
TEST_P(CudaBackward, SequencesAreIsolated) {
  NSA_REQUIRE_GPU();
  const BwdCase& c = GetParam();
  if (c.seqlens.size() < 2) GTEST_SKIP() << "one sequence";
  const Config cfg = config_of(c);
  const int64_t longest = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  Twin saved = make_twin(c, 404);
  forward(cuda_context(Backend::reference), cfg, saved.ref.inputs(), saved.ref.outputs());
  // The backward of the inputs of make_twin(c, 404) with rows [r0, r1) poisoned (none: r0 == r1);
  // with_o: given the clean forward's o, every row tile per token (slc_dq_kernel's walk with D from
  // o, the sequences' end tiles included), else without it (the selection's output recomputed).
  auto gradients = [&](int64_t r0, int64_t r1, bool with_o) {
    Twin t = make_twin(c, 404);
    copy_values(saved.ref.lse, t.low.lse);
    copy_values(saved.ref.indices, t.low.indices);
    copy_values(saved.ref.o, t.low.o);
    for (HostTensor* x : {&t.low.q, &t.low.g, &t.low.d_o}) poison_rows(*x, r0, r1);
    for (int b = 0; b < 3; ++b) {
      poison_rows(t.low.k[b], r0, r1);
      poison_rows(t.low.v[b], r0, r1);
    }
    DeviceLayer dev(t.low, longest);
    DeviceTensor o(t.low.o);
    std::optional<NoSelectionUnionTiles> per_token;
    if (with_o) {
      dev.saved.o = o.view();
      per_token.emplace();
    }
    dev.run(cfg);
    return dev.download(t.low);
  };
  for (const bool with_o : {false, true}) {
    SCOPED_TRACE(with_o ? "given o, per token" : "without o");
    const auto clean = gradients(0, 0, with_o);
    int64_t r0 = 0;
    for (int32_t len : c.seqlens) {
      const int64_t r1 = r0 + len;
      if (len > 0) {
        const auto got = gradients(r0, r1, with_o);
        ASSERT_EQ(got.size(), clean.size());
        for (size_t i = 0; i < got.size(); ++i) {
          if (got[i].first.rfind("dphi", 0) == 0) continue;
          EXPECT_TRUE(same_outside_rows(got[i].second, clean[i].second, r0, r1))
              << got[i].first << ", sequence at rows " << r0 << ".." << r1;
        }
      }
      r0 = r1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackward, ::testing::ValuesIn(bwd_cases()),
                         [](const ::testing::TestParamInfo<BwdCase>& info) { return info.param.name; });

// Drawn cases (cases.h), through every test of the suite.
INSTANTIATE_TEST_SUITE_P(Random, CudaBackward, ::testing::ValuesIn(random_attention_cases(2)),
                         [](const ::testing::TestParamInfo<BwdCase>& info) { return info.param.name; });

// compress_bwd on the GPU (the stage op: phi's backward alone) against the fp64 reference: dx and
// phi's parameter gradients from a random dxc, outputs poisoned, workspace poisoned, over the
// backward cases (their phi kinds, dtypes, head dims and packed batches), phi of the keys.
TEST_P(CudaBackward, CompressBackwardMatchesReference) {
  NSA_REQUIRE_GPU();
  const BwdCase& c = GetParam();
  const Config cfg = config_of(c);
  Twin t = make_twin(c, 303);
  const int64_t T = t.low.T, H = c.hkv, D = c.dqk, rows = T / c.d;
  std::mt19937_64 rng(17);
  HostTensor dxc(c.dtype, {rows, H, D}), dxc64(DType::f64, {rows, H, D});
  dxc.fill_uniform(rng, -1, 1);
  copy_values(dxc, dxc64);
  HostTensor dx_ref(DType::f64, {T, H, D}), dx(c.dtype, {T, H, D});
  dx.poison();
  const Sequences seqs_ref = t.ref.inputs().seqs;
  compress_bwd(cuda_context(Backend::reference), cfg, LayerProblem::params(t.ref.phi_k), t.ref.k[kCmp].view(), seqs_ref,
               dxc64.view(), dx_ref.view(), LayerProblem::params(t.ref.dphi_k));

  DeviceTensor x(t.low.k[kCmp]), d_xc(dxc), d_dx(dx), cu(t.low.cu), phi[5], dphi[5];
  for (int i = 0; i < 5; ++i) {
    phi[i] = DeviceTensor(t.low.phi_k[i]);
    dphi[i] = DeviceTensor(t.low.dphi_k[i]);  // poisoned by make_problem
  }
  auto params = [](DeviceTensor* d) { return PhiParams{d[0].view(), d[1].view(), d[2].view(), d[3].view(), d[4].view()}; };
  Sequences seqs;
  if (c.seqlens.size() != 1) seqs.cu_seqlens = cu.view();
  seqs.max_seqlen = *std::max_element(c.seqlens.begin(), c.seqlens.end());
  const Context ctx = cuda_context(Backend::cuda);
  Problem pr = problem_of(cfg, t.low.inputs());  // sizes from the host twin; the tensors run on the GPU
  pr.device = Device::cuda;
  pr.hq = pr.hkv;
  pr.dv = pr.dqk;
  {
    const DeviceWorkspace ws(workspace_size(ctx, Op::compress_bwd, cfg, pr));  // NaN pattern
    compress_bwd(ctx, cfg, params(phi), x.view(), seqs, d_xc.view(), d_dx.view(), params(dphi), ws.view());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  HostTensor got_dx(c.dtype, {T, H, D});
  d_dx.download(got_dx);
  const auto rdx = close(got_dx.values(), dx_ref.values(), grad_tol(c.dtype, max_abs(dx_ref.values())));
  EXPECT_TRUE(rdx) << "dx";
  std::printf("  compress dx     %s\n", rdx.message());
  double scale = 0;  // one scale for all of phi's parameters (check_against_reference says why)
  for (int i = 0; i < 5; ++i)
    if (t.ref.dphi_k[i].defined()) scale = std::max(scale, max_abs(t.ref.dphi_k[i].values()));
  static const char* kParam[5] = {"w1", "b1", "w2", "b2", "pe"};
  for (int i = 0; i < 5; ++i) {
    if (!t.low.dphi_k[i].defined()) continue;
    HostTensor got(t.low.dphi_k[i].dtype(), t.low.dphi_k[i].shape());
    dphi[i].download(got);
    const auto r = close(got.values(), t.ref.dphi_k[i].values(), grad_tol(c.dtype, scale));
    EXPECT_TRUE(r) << "dphi." << kParam[i];
    std::printf("  compress dphi.%s %s\n", kParam[i], r.message());
  }
}

// phi = mean's kernels take runs of 8 columns of x (4 of dx) per thread where every row starts on
// 16 (8) bytes, else one column: compress_fwd (mean_kernel) at head dims 6, 12 and 16, compress_bwd
// (mean_dx_kernel; D 64, the smallest it takes), with x (forward) or dx (backward) contiguous and as
// a view of rows padded by one element (strides no multiple of 8), packed sequences with an empty
// one, against the reference.
void check_compress_mean(bool backward) {
  Config cfg;
  cfg.phi = PhiKind::mean;
  const int64_t T = 261, H = 2;
  HostTensor cu_h(DType::i32, {4});
  const int32_t cu_vals[4] = {0, 70, 70, 261};
  for (int i = 0; i < 4; ++i) cu_h.set(i, cu_vals[i]);
  const int64_t rows = cmp_rows(T, cfg.cmp_stride);
  const Context ref = cuda_context(Backend::reference), ctx = cuda_context(Backend::cuda);
  for (int64_t D : backward ? std::vector<int64_t>{64} : std::vector<int64_t>{6, 12, 16}) {
    for (int64_t pad : {0, 1}) {
      SCOPED_TRACE("D " + std::to_string(D) + ", rows padded by " + std::to_string(pad));
      const int64_t Dp = D + pad;
      std::mt19937_64 rng(uint64_t(D * 10 + pad));
      HostTensor xp(DType::bf16, {T, H, Dp}), x64(DType::f64, {T, H, D});
      xp.fill_uniform(rng, -1, 1);
      for (int64_t i = 0; i < T * H; ++i)
        for (int64_t c = 0; c < D; ++c) x64.set(i * D + c, xp.get(i * Dp + c));
      auto first_columns = [&](TensorView v) {  // the first D columns of each padded row
        v.shape[2] = D;
        return v;
      };
      Sequences seqs_ref;
      seqs_ref.cu_seqlens = cu_h.view();
      DeviceTensor d_xp(xp), d_cu(cu_h);
      Sequences seqs;
      seqs.cu_seqlens = d_cu.view();
      seqs.max_seqlen = 191;
      Problem pr;
      pr.total_tokens = T;
      pr.batch = 3;
      pr.hkv = pr.hq = H;
      pr.dqk = pr.dv = D;
      pr.dtype = DType::bf16;
      pr.device = Device::cuda;
      pr.max_seqlen = 191;
      if (!backward) {
        HostTensor xc(DType::bf16, {rows, H, D});
        xc.poison();
        HostTensor xc_ref = to_f64(xc);
        compress_fwd(ref, cfg, PhiParams{}, x64.view(), seqs_ref, xc_ref.view());
        DeviceTensor d_xc(xc);
        const DeviceWorkspace ws(workspace_size(ctx, Op::compress_fwd, cfg, pr));
        compress_fwd(ctx, cfg, PhiParams{}, first_columns(d_xp.view()), seqs, d_xc.view(), ws.view());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        d_xc.download(xc);
        const double u = unit_roundoff(DType::bf16);
        EXPECT_TRUE(close(xc.values(), xc_ref.values(), [&](double w, size_t) { return 2 * u * std::fabs(w) + 1e-5; }));
      } else {
        HostTensor dxc(DType::bf16, {rows, H, D}), dxp(DType::bf16, {T, H, Dp});
        dxc.fill_uniform(rng, -1, 1);
        dxp.poison();
        HostTensor dx_ref(DType::f64, {T, H, D}), dxc64 = to_f64(dxc);
        compress_bwd(ref, cfg, PhiParams{}, x64.view(), seqs_ref, dxc64.view(), dx_ref.view(), PhiParams{});
        DeviceTensor d_dxc(dxc), d_dxp(dxp);
        const DeviceWorkspace ws(workspace_size(ctx, Op::compress_bwd, cfg, pr));
        compress_bwd(ctx, cfg, PhiParams{}, first_columns(d_xp.view()), seqs, d_dxc.view(), first_columns(d_dxp.view()),
                     PhiParams{}, ws.view());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        d_dxp.download(dxp);
        HostTensor dx(DType::f64, {T, H, D});
        for (int64_t i = 0; i < T * H; ++i)
          for (int64_t c = 0; c < D; ++c) dx.set(i * D + c, dxp.get(i * Dp + c));
        EXPECT_TRUE(close(dx.values(), dx_ref.values(), grad_tol(DType::bf16, max_abs(dx_ref.values()))));
        if (pad > 0) {  // the padding columns stay as they were
          for (int64_t i = 0; i < T * H; ++i)
            if (!std::isnan(dxp.get(i * Dp + D))) ADD_FAILURE() << "padding column of row " << i << " written";
        }
      }
    }
  }
}
TEST(CudaCompressMean, ForwardOddHeadDimsAndStridesMatchReference) {
  NSA_REQUIRE_GPU();
  check_compress_mean(false);
}
TEST(CudaCompressMean, BackwardOddHeadDimsAndStridesMatchReference) {
  NSA_REQUIRE_GPU();
  check_compress_mean(true);
}

// The saved state of `dev` (lse, indices) from the CUDA forward, for lengths where the fp64
// reference would take minutes.
::testing::AssertionResult save_cuda_forward(const Config& cfg, const Twin& t, DeviceLayer& dev) {
  DeviceTensor o(t.low.o);
  ForwardOutputs fwd = dev.saved;
  fwd.o = o.view();
  const Context ctx = cuda_context(Backend::cuda);
  const DeviceWorkspace ws(workspace_size(ctx, Op::forward, cfg, problem_of(cfg, dev.in)));
  forward(ctx, cfg, dev.in, fwd, ws.view());
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return ::testing::AssertionFailure() << "the CUDA forward: " << cudaGetErrorString(e);
  return ::testing::AssertionSuccess();
}

// Long sequences, where a dK / dV CTA runs hundreds of query tiles (its pipeline stages wrap
// around many times; at the cases' lengths a few dozen): G = 16, 9000 + 3000 tokens, a window of
// 512, 16 blocks of 64. The warp-specialised dkv_ws_kernel (sm_90a, Dqk = Dv = 128) against the
// one-warpgroup dkv_kernel on the same inputs and the same saved forward (the CUDA forward's: the
// fp64 reference would take minutes here): every other gradient bit for bit, dK and dV up to
// their summation order (two consumers' sums added at the end, against one running sum).
TEST(CudaBackwardLong, WarpSpecializedDkvMatchesOneWarpgroup) {
  NSA_REQUIRE_GPU();
  const BwdCase c{"bf16_d128_G16_long", DType::bf16, 128, 128, 16, 1, {9000, 3000}, 32, 16, 64, 16, 1, 2, 512,
                  PhiKind::mean, false};
  const Config cfg = config_of(c);
  Twin t = make_twin(c, 606);
  DeviceLayer dev(t.low, 9000);
  ASSERT_TRUE(save_cuda_forward(cfg, t, dev));
  dev.run(cfg);
  const auto ws_grads = dev.download(t.low);
  {
    const OneWarpgroupDkv one_warpgroup;
    dev.run(cfg);
  }
  const auto one_grads = dev.download(t.low);
  ASSERT_EQ(ws_grads.size(), one_grads.size());
  for (size_t i = 0; i < ws_grads.size(); ++i) {
    const std::string& name = ws_grads[i].first;
    const std::vector<double> got = ws_grads[i].second.values(), want = one_grads[i].second.values();
    if (name.rfind("dk_", 0) == 0 || name.rfind("dv_", 0) == 0) {
      // Both round one fp32 sum of the same products once: a few units of the last place apart.
      const auto result = close(got, want, grad_tol(c.dtype, max_abs(want), 2.0));
      EXPECT_TRUE(result) << name;
      std::printf("  %-8s max|one warpgroup| %.3g  %s\n", name.c_str(), max_abs(want), result.message());
    } else {
      EXPECT_TRUE(same_bytes(ws_grads[i].second, one_grads[i].second))
          << name << " does not come from dK / dV: it must not change";
    }
  }
}

// One sequence takes the compressed keys' split count of least modelled time on the device's
// resident CTAs (cmp_splits_balanced): at 8K, G = 16, Hkv = 4 that is 14 on 132 SMs (and on 264
// places, dkv_kernel's two CTAs an SM) where the packed batches' rule gives 8. The call without a
// forced count has the bits of the call forced to the model's count (for the one or two CTAs an
// SM of the kernel that runs), and not those of the rule's count.
TEST(CudaBackwardLong, OneSequenceTakesTheModelledSplitCount) {
  NSA_REQUIRE_GPU();
  const BwdCase c{"bf16_d128_G16_8k", DType::bf16, 128, 128, 64, 4, {8192}, 32, 16, 64, 16, 1, 2, 512, PhiKind::mean,
                  false};
  const Config cfg = config_of(c);
  Twin t = make_twin(c, 808);
  DeviceLayer dev(t.low, 8192);
  ASSERT_TRUE(save_cuda_forward(cfg, t, dev));
  int device = 0, sms = 0;
  NSA_TEST_CUDA(cudaGetDevice(&device));
  NSA_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int rule = cuda::bwd::cmp_splits_for(8192, 16);
  std::vector<int> modelled;
  for (int per_sm : {1, 2}) modelled.push_back(cuda::bwd::cmp_splits_balanced(8192, 16, 4, 32, 16, sms * per_sm));
  std::printf("  %d SMs: modelled %d / %d splits, the rule %d\n", sms, modelled[0], modelled[1], rule);
  for (int m : modelled) ASSERT_NE(m, rule) << "this shape no longer tells the model from the rule";

  dev.run(cfg);
  const auto chosen = dev.download(t.low);
  auto same_bits = [&](const std::vector<std::pair<std::string, HostTensor>>& got) {
    for (size_t i = 0; i < got.size(); ++i)
      if (!same_bytes(chosen[i].second, got[i].second)) return false;
    return true;
  };
  int matches = 0;
  for (int splits : {modelled[0], modelled[1], rule}) {
    const LongSequencePaths forced(splits, false);
    dev.run(cfg);
    const bool same = same_bits(dev.download(t.low));
    std::printf("  forced to %d splits: %s\n", splits, same ? "the same bits" : "other bits");
    if (splits == rule) EXPECT_FALSE(same) << "the call took the rule's count";
    else matches += same ? 1 : 0;
  }
  EXPECT_GE(matches, 1) << "the call took neither modelled count";
}

TEST(CudaBackwardErrors, UnsupportedHeadDimNamesTheValue) {
  NSA_REQUIRE_GPU();
  BwdCase c{"x", DType::bf16, 32, 64, 2, 1, {40}, 32, 16, 64, 2, 1, 1, 16, PhiKind::mean, false};
  const Config cfg = config_of(c);
  Twin t = make_saved_twin(c, 1);
  DeviceLayer dev(t.low, 40);
  try {
    backward(cuda_context(Backend::cuda), cfg, dev.in, dev.saved, dev.d_o.view(), dev.grads);
    FAIL() << "expected nsa::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("32"), std::string::npos) << e.what();
  }
}

// The selection dq kernel sorts each warp's (16 / G) x n picks in shared memory (12 bytes per
// entry, rounded up to a power of two, four warps; the sort keys share the warp's ring): an n that
// does not fit is an nsa::Error naming it, not a failed launch. G = 1 and n = 400:
// 4 x 8192 x (8 + 4) B = 384 KB.
TEST(CudaBackwardErrors, SelectionTablesTooLargeNameN) {
  NSA_REQUIRE_GPU();
  BwdCase c{"x", DType::bf16, 64, 64, 1, 1, {40}, 32, 16, 64, 400, 1, 1, 16, PhiKind::mean, false};
  const Config cfg = config_of(c);
  Twin t = make_saved_twin(c, 1);
  DeviceLayer dev(t.low, 40);
  // With a workspace of the size asked for (the check under test comes after the workspace
  // check); the size query itself may already name n.
  const Context ctx = cuda_context(Backend::cuda);
  void* ws = nullptr;
  try {
    const size_t bytes = workspace_size(ctx, Op::backward, cfg, problem_of(cfg, dev.in));
    if (bytes) ASSERT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
    backward(ctx, cfg, dev.in, dev.saved, dev.d_o.view(), dev.grads, Workspace{ws, bytes});
    ADD_FAILURE() << "expected nsa::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_selected"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("400"), std::string::npos) << e.what();
  }
  if (ws) cudaFree(ws);
}

// The backward moves rows in 16-byte pieces, as the forward does: a view whose rows do not start
// on 16 bytes is an nsa::Error naming the tensor (rather than a kernel failing with a misaligned
// address). Each view is its tensor shifted by one element (the
// device buffers have 16 bytes of slack).
TEST(CudaBackwardErrors, UnalignedRowsNameTheTensor) {
  NSA_REQUIRE_GPU();
  BwdCase c{"x", DType::bf16, 64, 64, 4, 1, {40}, 32, 16, 64, 2, 1, 1, 16, PhiKind::mean, false};
  const Config cfg = config_of(c);
  Twin t = make_saved_twin(c, 1);
  const Context ctx = cuda_context(Backend::cuda);
  auto shifted = [](TensorView v) {
    v.data = static_cast<char*>(v.data) + dtype_size(v.dtype);
    return v;
  };
  for (const std::string which : {"q", "d_o", "dq", "kv[2].k", "dkv[1].v"}) {
    DeviceLayer dev(t.low, 40);
    TensorView d_o = dev.d_o.view();
    if (which == "q") dev.in.q = shifted(dev.in.q);
    if (which == "d_o") d_o = shifted(d_o);
    if (which == "dq") dev.grads.dq = shifted(dev.grads.dq);
    if (which == "kv[2].k") dev.in.kv[2].k = shifted(dev.in.kv[2].k);
    if (which == "dkv[1].v") dev.grads.dkv[1].v = shifted(dev.grads.dkv[1].v);
    const DeviceWorkspace ws(workspace_size(ctx, Op::backward, cfg, problem_of(cfg, dev.in)));
    try {
      backward(ctx, cfg, dev.in, dev.saved, d_o, dev.grads, ws.view());
      ADD_FAILURE() << which << ": expected nsa::Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.parameter(), which + ".data") << e.what();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << which << ": no kernel ran";
  }
}

}  // namespace
