// NSA configuration (spec §1). The paper's symbols are given beside each field.
#pragma once

#include <cstdint>
#include <string>

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

  // Throws nsa::Error naming the first field that breaks a rule of spec §1.
  void validate() const;
  // The scale actually used for a head dimension dqk.
  double softmax_scale(int64_t dqk) const;
};

}  // namespace nsa
