// NSA configuration (spec §1). The paper's symbols are given beside each field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nsa {

// The compression function phi (spec §2).
enum class PhiKind : int32_t {
  mean = 0,    // average of the l rows; no parameters
  linear = 1,  // W . flatten(block + pe)
  mlp = 2,     // W2 . gelu_tanh(W1 . flatten(block + pe) + b1) + b2   (the paper's)
};

const char* phi_kind_name(PhiKind kind);
// Parses "mean", "linear" or "mlp"; throws nsa::Error naming `parameter` otherwise.
PhiKind parse_phi_kind(const std::string& text, const char* parameter = "phi");

// The largest length the library accepts, for every configuration integer (block lengths, stride,
// counts, window, backbone offsets) and every sequence length or packed token count: 2^31 - 1, so
// that positions fit int32 (cu_seqlens) and every product of two of them fits int64.
inline constexpr int64_t kMaxLength = 2147483647;
// The largest softmax scale: fp32's largest finite value (the fast backends keep it in fp32).
inline constexpr double kMaxScale = 3.4028234663852886e38;

// Most reach-backbone offsets a configuration holds (spec §11).
inline constexpr int kMaxBackbone = 8;

struct Config {
  int64_t cmp_block_len = 32;  // l:  compression block length, l >= 1
  int64_t cmp_stride = 16;     // d:  compression stride, divides l and l'
  int64_t slc_block_len = 64;  // l': selection block length
  int64_t n_selected = 16;     // n:  selected blocks per query (forced ones included); 0 = branch off
  int64_t n_init = 1;          //     forced initial blocks
  int64_t n_local = 2;         //     forced local blocks; n_init + n_local <= n when n > 0
  int64_t window = 512;        // w:  sliding window incl. the query's own token; 0 = branch off
  double scale = 0.0;          //     softmax scale; 0 means 1/sqrt(Dqk)
  PhiKind phi = PhiKind::mlp;  //     compression function
  bool shared_kv = false;      //     one K/V for all three branches (kv[0] of the inputs)
  // Reach backbone (spec §11; off by default): query t also forces block J_t - o for each of the
  // first num_backbone offsets o (distinct, >= 1); n_init + n_local + num_backbone <= n when n > 0.
  int64_t backbone_offsets[kMaxBackbone] = {};
  int64_t num_backbone = 0;

  // Throws nsa::Error naming the first field that breaks a rule of spec §1.
  void validate() const;
  // The scale actually used for a head dimension dqk.
  double softmax_scale(int64_t dqk) const;
  // Sets the backbone offsets (at most kMaxBackbone; validate() checks them).
  void set_backbone(const std::vector<int64_t>& offsets);
};

// The reach backbone's schedule (spec §11): the offsets of layer `layer` (0-based) of a model whose
// sequences hold up to `max_seqlen` tokens (N_s = ceil(max_seqlen / slc_block_len) selection
// blocks), k = `per_layer` offsets a layer: {d * (k+1)^(layer mod P) : d = 1..k, below N_s} with
// P = ceil(log_(k+1)(N_s)). Every block then reaches every later block within any P consecutive
// layers. k = 1 is the spec's {2^(layer mod P)}; for k > 1 the spec's {2^((layer k + r) mod P)}
// cannot keep its bound of ceil(P/k) layers (one hop a layer: docs/semantics.md says why), while
// base k + 1 reaches ceil(log_(k+1) N_s), the least any k offsets a layer allow. Ascending; empty
// when N_s <= 1. Throws nsa::Error for bad arguments.
std::vector<int64_t> backbone_schedule(int64_t layer, int64_t max_seqlen, int64_t slc_block_len, int64_t per_layer = 1);

}  // namespace nsa
