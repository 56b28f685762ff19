// The fast CPU backend's table of operations and its workspace sizes.
#include <string>

#include "cpu/ops.h"

namespace nsa::cpu {

size_t workspace_bytes(Op op, const Config& call_cfg, const Problem& problem, int threads) {
  // Dense attention has no NSA configuration (the API plans it with a default Config), so its
  // size must not depend on the one the caller happens to pass.
  const bool dense = op == Op::dense_attention_fwd || op == Op::dense_attention_bwd || op == Op::dense_decode;
  const Config cfg = dense ? Config{} : call_cfg;
  const bool decoding = op == Op::cache_append || op == Op::decode || op == Op::dense_decode;
  const WsSizes w = decoding ? decode_sizes(op, cfg, problem)
                    : (op == Op::backward || op == Op::dense_attention_bwd || op == Op::compress_fwd ||
                       op == Op::compress_bwd)
                        ? backward_sizes(op, cfg, problem)
                        : forward_sizes(op, cfg, problem);
  if (w.shared == 0 && w.slot == 0) return 0;
  // Sizes of a checked Problem fit comfortably; only a huge thread count can overflow here.
  size_t slots = 0, total = 0;
  if (__builtin_mul_overflow(w.slot, static_cast<size_t>(std::max(threads, 1)), &slots) ||
      __builtin_add_overflow(Arena::round_bytes(w.shared), slots, &total) || total > (size_t{1} << 62))
    throw Error("ctx.num_threads", std::to_string(threads),
                "gives a workspace of more than 2^62 bytes (" + std::to_string(w.slot) + " per thread)");
  return total;
}

namespace {

// Sized for the call's threads: Context::num_threads, or when 0 OpenMP's default thread count
// (or the core count, when larger).
size_t workspace_size(const Context& ctx, Op op, const Config& cfg, const Problem& problem) {
  return workspace_bytes(op, cfg, problem, ctx.num_threads > 0 ? ctx.num_threads : default_slots());
}

const detail::BackendOps kOps = {
    "cpu",
    workspace_size,
    compress_fwd,
    compress_bwd,
    compressed_attention_fwd,
    select_topn,
    selected_attention_fwd,
    window_attention_fwd,
    forward,
    backward,
    dense_attention_fwd,
    dense_attention_bwd,
    cache_append,
    decode,
    dense_decode,
    rotary,
};

}  // namespace

}  // namespace nsa::cpu

namespace nsa::detail {
const BackendOps* cpu_backend() { return &nsa::cpu::kOps; }
}  // namespace nsa::detail
