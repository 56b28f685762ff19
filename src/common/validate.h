// Argument validation shared by the API layer's entry points (src/api.cpp, src/cache_api.cpp):
// the tensor checker, backend resolution, sequence tables, phi shapes and workspaces. Every
// failure is an nsa::Error naming the parameter, its value and what is allowed.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/plan.h"
#include "nsa/error.h"

namespace nsa::detail {

std::string str(int64_t v);
std::string shape_str(const TensorView& t);
std::string where(Device d, int index);
bool is_float(DType t);

// Expected extent of one dimension: a value, or kAny.
constexpr int64_t kAny = -1;

// Checks the properties every tensor argument shares with the call's reference tensor.
class Checker {
 public:
  Checker(DType dtype, Device device, int device_index)
      : dtype_(dtype), device_(device), device_index_(device_index) {}

  // `dims` names the dimensions for messages, e.g. "[T, Hq, Dqk]".
  void tensor(const std::string& name, const TensorView& t, const char* dims,
              std::initializer_list<int64_t> shape, DType dtype) const {
    if (!t.defined()) throw Error(name, "absent", std::string("required, shape ") + dims);
    if (t.ndim != static_cast<int>(shape.size()))
      throw Error(name + ".ndim", str(t.ndim),
                  "must be " + str(static_cast<int64_t>(shape.size())) + " (shape " + dims + ")");
    int i = 0;
    for (int64_t want : shape) {
      if (t.shape[i] < 0) throw Error(name + ".shape[" + str(i) + "]", str(t.shape[i]), "must be >= 0");
      if (want != kAny && t.shape[i] != want)
        throw Error(name + ".shape[" + str(i) + "]", str(t.shape[i]),
                    "must be " + str(want) + " (shape " + dims + ", got " + shape_str(t) + ")");
      ++i;
    }
    if (t.dtype != dtype)
      throw Error(name + ".dtype", dtype_name(t.dtype), std::string("must be ") + dtype_name(dtype));
    if (t.device != device_ || (device_ == Device::cuda && t.device_index != device_index_))
      throw Error(name + ".device", where(t.device, t.device_index),
                  "must be " + where(device_, device_index_) + " like the other tensors of the call");
    for (int d = 0; d < t.ndim; ++d)
      if (t.stride[d] < 0)
        throw Error(name + ".stride[" + str(d) + "]", str(t.stride[d]), "must be >= 0");
    if (t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1)
      throw Error(name + ".stride[" + str(t.ndim - 1) + "]", str(t.stride[t.ndim - 1]),
                  "must be 1 (the last dimension contiguous)");
    if (t.data == nullptr && t.numel() > 0)
      throw Error(name + ".data", "null", "must point to " + str(t.numel()) + " elements");
  }
  void floats(const std::string& name, const TensorView& t, const char* dims,
              std::initializer_list<int64_t> shape) const {
    tensor(name, t, dims, shape, dtype_);
  }
  void optional_floats(const std::string& name, const TensorView& t, const char* dims,
                       std::initializer_list<int64_t> shape) const {
    if (t.defined()) floats(name, t, dims, shape);
  }
  DType dtype() const { return dtype_; }

 private:
  DType dtype_;
  Device device_;
  int device_index_;
};

void require_absent(const std::string& name, const TensorView& t, const std::string& why);

// Resolves ctx.backend (automatic -> a real one) for a call whose main tensor is `main`.
const BackendOps& resolve_backend(Context& ctx, const TensorView& main, const char* main_name);

// Host offsets `cu` [B+1] (int32, checked by the caller): 0 first, non-decreasing, `total` last;
// errors name `<name>[b]` (`total_what` says what `total` counts). Returns them as int64, and the
// largest difference (the longest sequence) in `longest`.
std::vector<int64_t> read_host_offsets(const TensorView& cu, const std::string& name, int64_t total,
                                       const char* total_what, int64_t& longest);

// Reads/validates the sequence table. T is the number of packed tokens of the call.
void fill_sequences(Plan& p, const Sequences& seqs, int64_t T, const Checker& chk);

// Reads/validates a layer call's query packing (Inputs::seqs_q) against the keys' sequences of p
// (fill_sequences first). Tq is the number of query rows of the call. Absent: p.cu_q stays empty.
void fill_query_sequences(Plan& p, const Sequences& seqs_q, int64_t Tq, const Checker& chk);

// Shapes of phi's parameters for head dim D; returns F (0 unless mlp).
int64_t check_phi(const Config& cfg, const Checker& chk, const std::string& name, const PhiParams& phi, int64_t D);

// Fills head counts and dims from q and the first branch's k/v.
void fill_heads(Plan& p, const TensorView& q, const TensorView& k, const TensorView& v);

// Validates cfg, resolves the backend from `main` and starts the call's plan.
Plan start_plan(const Context& ctx, const Config& cfg, const TensorView& main, const char* main_name,
                const BackendOps*& ops);

template <typename Fn>
Fn require_op(const BackendOps& ops, Fn fn, const char* op) {
  if (fn == nullptr) throw Error("ctx.backend", ops.name, std::string("does not implement ") + op + " yet");
  return fn;
}

void check_workspace(const BackendOps& ops, const Plan& p, Op op, const Problem& prob, Workspace ws);

// The largest tensor a Problem may describe, in elements: 2^48 (a PiB of fp32, more than any
// machine holds). With every Problem field at most kMaxLength and every tensor at most this many
// elements, each size a backend derives (a few small factors more) fits int64 and size_t.
inline constexpr int64_t kMaxElements = int64_t{1} << 48;

// The Problem workspace_size() is asked with, checked and normalised in one place: every field in
// [0, kMaxLength] (named problem.<field>), no tensor it describes above kMaxElements (named
// problem), and for the prefill operations max_seqlen at most total_tokens (as fill_sequences
// bounds it for a call).
Problem checked_problem(Op op, const Config& cfg, const Problem& problem);

// a * b for non-negative a, b, saturated at INT64_MAX.
int64_t mul_sat(int64_t a, int64_t b);

}  // namespace nsa::detail
