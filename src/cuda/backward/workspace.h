// The CUDA backward's workspace: one description of its layout (Layout, carve) for
// backward_workspace_size and backward(), so that the size asked for and the pieces used agree.
// Included by backward.cu.
#pragma once

#include <cub/cub.cuh>

#include <algorithm>

#include "common/plan.h"
#include "cuda/common/check.h"
#include "cuda/common/launch.h"
#include "cuda/params.h"
#include "cuda/phi/phi.h"
#include "nsa/error.h"

namespace nsa::cuda::bwd {

using Plan = nsa::detail::Plan;
using nsa::cuda::WorkspaceCarver;

constexpr int kRowsPerSplit = 512;  // rows per partial sum of a reduction over compressed rows
constexpr int kMaxSplits = 8;
constexpr int64_t kMaxPartialBytes = int64_t(32) << 20;  // keeps mlp's dW1 partials at 32 MB
constexpr int64_t kMaxRawPool = 256;       // slots for the pieces of the raw blocks' long lists

// ---- workspace layout (one description for workspace_size and backward) ----------------------

struct Layout {
  int32_t* cu = nullptr;
  int32_t* crow_token = nullptr;
  void* kc = nullptr;
  void* vc = nullptr;
  float* pre_k = nullptr;  // phi::forward's work (mlp: [Rc*Hkv, F] pre-activation first, then dpre in place)
  float* pre_v = nullptr;
  uint16_t* g16 = nullptr;  // phi's bf16 copy of dpre / dy (phi::grad_bf16_elems), of k then of v
  void* phi_blas = nullptr;  // phi's products on cuBLASLt (phi::blas_bytes; bf16 only; nullptr: none)
  float* dkc = nullptr;    // [Rc*Hkv, Dqk]
  float* dvc = nullptr;
  float* dkc_part = nullptr;  // the splits' partials (cmp_part_rows[z] rows each) [.., Hkv, Dqk]
  float* dvc_part = nullptr;
  int64_t cmp_part_rows[kMaxCmpSplits] = {};
  bool packed_sort = false;   // the index sort on 32-bit (key, token) keys (sort_bits of them)
  int key_shift = 0;          // bits of the token in a packed key
  int sort_bits = 0;
  float* dg32 = nullptr;      // [T, Hq, 3]
  float* g32 = nullptr;       // [T, Hq, 3] the gates in fp32
  uint32_t* keys[2] = {};     // radix-sort double buffers [T*Hkv*n] (packed: keys[1] only)
  int32_t* tokens[2] = {};
  int32_t* offsets = nullptr; // [Hkv*B*n_slc_max + 1]
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  int32_t* slots = nullptr;   // phi::slot_table [slot_count * 4]
  float* dx_k32 = nullptr;    // shared K/V: phi's gradient to the raw tokens [T, Hkv, Dqk]
  float* dx_v32 = nullptr;    // [T, Hkv, Dv]
  float* gemm_part = nullptr; // [splits][max phi parameter size]
  float* colsum = nullptr;    // [max(F, D)]
  RawPieces raw;                // the raw lists' pieces' slots (pool, part_k / part_v, split, slot, arrived)
  int cmp_splits = 1;
  int row_splits = 1;
  size_t bytes = 0;
};

struct Sizes {
  int64_t T, B, max_seqlen, hq, hkv, dqk, dv, F, l, d, lp, n;
  bool has_params;  // phi = linear or mlp
  bool shared_kv;
  bool bf16;  // the storage dtype (phi's products on cuBLASLt take bf16 only)
  CudaKernelChoices choices;  // Context::cuda_choices (cmp_splits, packed_sort, raw pieces)
  int cmp_slots = 0;          // one sequence: dkv_kernel<cmp>'s resident CTAs (0: not asked, cmp_splits_for)
  PhiKind phi() const { return F > 0 ? PhiKind::mlp : has_params ? PhiKind::linear : PhiKind::mean; }
};

// Split-K partials of phi's parameter gradients (linear / mlp), capped in bytes.
inline void carve_phi_partials(const Sizes& z, int64_t rows, WorkspaceCarver& c, Layout& L) {
  const int64_t D = std::max(z.dqk, z.dv);
  const int64_t param = std::max({z.F * z.l * D, D * z.F, D * z.l * D});
  const int64_t by_rows = (rows + kRowsPerSplit - 1) / kRowsPerSplit;
  const int64_t by_bytes = kMaxPartialBytes / (param * int64_t(sizeof(float)));
  L.row_splits = int(std::clamp<int64_t>(std::min(by_rows, by_bytes), 1, kMaxSplits));
  L.gemm_part = c.take<float>(size_t(L.row_splits * param));
}

inline Layout carve(const Sizes& z, void* base, cudaStream_t stream) {
  WorkspaceCarver w(base);
  Layout L;
  const int64_t rc = cmp_rows(z.T, z.d);
  const int64_t rows = rc * z.hkv;
  const int64_t n_slc_max = num_slc_blocks(z.max_seqlen, z.lp);
  L.cu = w.take<int32_t>(size_t(z.B + 1));
  L.crow_token = w.take<int32_t>(size_t(std::max<int64_t>(rc, 1)));
  L.kc = w.take<uint16_t>(size_t(rows * z.dqk));
  L.vc = w.take<uint16_t>(size_t(rows * z.dv));
  if (z.has_params) {
    L.pre_k = w.take<float>(size_t(phi::work_floats(z.phi(), rows, z.F, z.dqk)));
    L.pre_v = w.take<float>(size_t(phi::work_floats(z.phi(), rows, z.F, z.dv)));
    L.g16 = w.take<uint16_t>(size_t(phi::grad_bf16_elems(z.phi(), rows, z.F, std::max(z.dqk, z.dv))));
    const int64_t blas = z.bf16 ? phi::blas_bytes(z.phi(), rc, z.hkv, std::max(z.dqk, z.dv), z.F, z.l, z.d) : 0;
    if (blas > 0) L.phi_blas = w.take<char>(size_t(blas));
  }
  L.dkc = w.take<float>(size_t(rows * z.dqk));
  L.dvc = w.take<float>(size_t(rows * z.dv));
  L.slots = w.take<int32_t>(size_t(4 * (z.T / z.d + z.B)));
  if (z.shared_kv && rc > 0) {
    L.dx_k32 = w.take<float>(size_t(z.T * z.hkv * z.dqk));
    L.dx_v32 = w.take<float>(size_t(z.T * z.hkv * z.dv));
  }
  // The compressed keys' query splits: forced, else for one sequence the count of least modelled
  // time on the device's resident CTAs (cmp_splits_balanced), else cmp_splits_for.
  const int test_splits = std::min(z.choices.cmp_splits, kMaxCmpSplits);  // forced (0: the rule)
  const int rule_splits = cmp_splits_for(z.max_seqlen, z.hq / z.hkv, z.B);
  L.cmp_splits = test_splits > 0                  ? test_splits
                 : z.B == 1 && z.cmp_slots > 0 ? cmp_splits_balanced(z.T, z.hq / z.hkv, z.hkv, z.l, z.d, z.cmp_slots)
                                                  : rule_splits;
  // Rows of each split's partial: with one sequence the blocks its queries see; with several (whose
  // lengths the host does not know) every row, indexed as dkc.
  int64_t part_rows = 0;
  for (int zz = 0; zz + 1 < L.cmp_splits; ++zz) {
    if (z.B == 1) {
      const CmpSplit cs = cmp_split_of(z.T, L.cmp_splits);
      L.cmp_part_rows[zz] = zz < cs.last ? cmp_split_rows(z.T, zz, cs, z.l, z.d) : 0;
    } else {
      L.cmp_part_rows[zz] = rc;
    }
    part_rows += L.cmp_part_rows[zz];
  }
  // The partials' room and the raw pieces' budget do not depend on the device (the workspace query
  // does not know its CTAs): for one sequence, the room is the most any count up to the cap needs,
  // and the budget counts cmp_splits_for's partials.
  int64_t part_room = part_rows, part_rule = part_rows;
  if (test_splits <= 0 && z.B == 1) {
    part_rule = cmp_split_part_rows(z.T, rule_splits, z.l, z.d);
    for (int s = 1; s <= cmp_splits_cap(z.hq / z.hkv); ++s)
      part_room = std::max(part_room, cmp_split_part_rows(z.T, s, z.l, z.d));
  }
  L.dg32 = w.take<float>(size_t(z.T * z.hq * 3));
  L.g32 = w.take<float>(size_t(z.T * z.hq * 3));
  const int64_t pairs = z.T * z.hkv * z.n;
  if (pairs > 0) L.tokens[0] = w.take<int32_t>(size_t(pairs));  // the inverted index's token lists
  L.offsets = w.take<int32_t>(size_t(z.hkv * z.B * n_slc_max + 1));
  const int64_t D = std::max(z.dqk, z.dv);
  L.colsum = w.take<float>(size_t(std::max<int64_t>(z.F, D)));

  // One scratch region for the pieces of phases that never overlap on the stream; each phase
  // carves its own from the region's start (run_backward's step numbers):
  //   2. the index sort: both key buffers, the tokens' second buffer and CUB's scratch (the
  //      sorted tokens end in tokens[0], copied there when the sort leaves them in tokens[1]);
  //   4. the compressed branch's per-split partials (reduced into dkc / dvc);
  //   5. phi's split-K parameter partials;
  //   6. the raw lists' pieces (the forced initial blocks' lists among them; read by
  //      dkv_kernel<raw>), in a budget of max(the other phases' bytes, 1/32 of q, k, v and o).
  auto carve_scratch = [&](unsigned char* region) {
    size_t most = 0;
    {  // 2.
      WorkspaceCarver c(region);
      if (pairs > 0) {
        // Key bits (keys 0..nkeys, nkeys the sentinel) and token bits (0..T-1): when both fit in 32,
        // the sort runs on packed keys, key << token bits | token, one buffer of its two being the
        // persistent tokens[0]; else on (key, token) pairs.
        const int64_t nkeys = z.hkv * z.B * n_slc_max;
        int kbits = 1, tbits = 0;
        while ((int64_t(1) << kbits) <= nkeys) ++kbits;
        while ((int64_t(1) << tbits) < z.T) ++tbits;
        L.packed_sort = kbits + tbits <= 32 && z.choices.packed_sort;
        if (L.packed_sort) {
          L.key_shift = tbits;
          L.sort_bits = kbits + tbits;
          L.keys[1] = c.take<uint32_t>(size_t(pairs));
          cub::DoubleBuffer<uint32_t> kb(reinterpret_cast<uint32_t*>(L.tokens[0]), L.keys[1]);
          NSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, L.sort_temp_bytes, kb, int(pairs), 0, L.sort_bits,
                                                        stream));
        } else {
          L.sort_bits = kbits;
          L.keys[0] = c.take<uint32_t>(size_t(pairs));
          L.keys[1] = c.take<uint32_t>(size_t(pairs));
          L.tokens[1] = c.take<int32_t>(size_t(pairs));
          cub::DoubleBuffer<uint32_t> kb(L.keys[0], L.keys[1]);
          cub::DoubleBuffer<int32_t> vb(L.tokens[0], L.tokens[1]);
          NSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, L.sort_temp_bytes, kb, vb, int(pairs), 0,
                                                         L.sort_bits, stream));
        }
        L.sort_temp = c.take<unsigned char>(L.sort_temp_bytes);
      }
      most = std::max(most, c.bytes());
    }
    size_t budget_base = most;  // what the raw pieces' budget counts of phase 4: the same on every device
    {  // 4.
      WorkspaceCarver c(region);
      L.dkc_part = c.take<float>(size_t(part_room * z.hkv * z.dqk));
      L.dvc_part = c.take<float>(size_t(part_room * z.hkv * z.dv));
      most = std::max(most, c.bytes());
      WorkspaceCarver rule(nullptr);
      rule.take<float>(size_t(part_rule * z.hkv * z.dqk));
      rule.take<float>(size_t(part_rule * z.hkv * z.dv));
      budget_base = std::max(budget_base, rule.bytes());
    }
    if (z.has_params) {  // 5. split-K partials of phi's parameter gradients, capped in bytes
      WorkspaceCarver c(region);
      carve_phi_partials(z, rows, c, L);
      most = std::max(most, c.bytes());
      budget_base = std::max(budget_base, c.bytes());
    }
    if (z.n > 0) {  // 6.
      WorkspaceCarver c(region);
      const int64_t qkvo = z.T * (z.hq + z.hkv) * (z.dqk + z.dv) * 2;  // (one K/V: the least there is)
      const int64_t budget = std::max<int64_t>(int64_t(budget_base), qkvo / 32);
      const int64_t chunks = (z.lp + kKeys - 1) / kKeys;
      const int64_t slot_bytes = kKeys * (z.dqk + z.dv) * 4 + 12;
      const int64_t raw_ctas = z.hkv * z.B * n_slc_max * chunks;
      const int64_t left = budget - int64_t(c.bytes()) - raw_ctas * 8;
      // (GPU tests that set the cap also get at least 64 slots, so that many lists are cut at their
      // short lengths, where the budget gives a few.)
      const int64_t want = z.choices.raw_piece_tiles > 0 ? std::max<int64_t>(left / slot_bytes, 64) : left / slot_bytes;
      const int64_t pool = z.choices.raw_pieces ? std::min<int64_t>(want, kMaxRawPool) : 0;
      if (pool >= 2) {
        L.raw.pool = int(pool);
        L.raw.x = int(z.B * n_slc_max * chunks);
        L.raw.extra_x = int((pool + z.hkv - 1) / z.hkv);
        L.raw.part_k = c.take<float>(size_t(pool * kKeys * z.dqk));
        L.raw.part_v = c.take<float>(size_t(pool * kKeys * z.dv));
        L.raw.split = c.take<int2>(size_t(raw_ctas));
        L.raw.slot = c.take<int2>(size_t(pool));
        L.raw.arrived = c.take<int>(size_t(pool));
      }
      most = std::max(most, c.bytes());
    }
    return most;
  };
  const size_t scratch_bytes = carve_scratch(nullptr);  // the sizes
  if (unsigned char* region = w.take<unsigned char>(scratch_bytes)) carve_scratch(region);
  L.bytes = w.bytes();
  return L;
}


inline Sizes sizes_of(const Context& ctx, const Config& cfg, const Problem& p, int64_t F) {
  return Sizes{p.total_tokens, p.batch, p.max_seqlen, p.hq, p.hkv, p.dqk, p.dv, F,
               cfg.cmp_block_len, cfg.cmp_stride, cfg.slc_block_len, cfg.n_selected,
               cfg.phi != PhiKind::mean, cfg.shared_kv, p.dtype == DType::bf16, choices_of(ctx)};
}

}  // namespace nsa::cuda::bwd
