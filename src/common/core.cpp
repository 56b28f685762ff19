// Small pieces of the public API that every backend shares: errors, tensor views, config rules.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "nsa/config.h"
#include "nsa/error.h"
#include "nsa/tensor.h"

namespace nsa {

namespace {
std::string format_message(const std::string& parameter, const std::string& value,
                           const std::string& allowed) {
  return "nsa: invalid " + parameter + " = " + value + ": " + allowed;
}
std::string str(int64_t v) { return std::to_string(v); }
// printf's %g (what an ostream prints) without iostreams: where the toolchain links libstdc++
// statically into the Python extension, the process holds two copies of the locale machinery, and
// an ostream's number formatting then called into the wrong facet and crashed.
std::string str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

Error::Error(std::string parameter, std::string value, std::string allowed)
    : std::runtime_error(format_message(parameter, value, allowed)),
      parameter_(std::move(parameter)),
      value_(std::move(value)),
      allowed_(std::move(allowed)) {}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
  }
  return 0;
}

const char* device_name(Device device) {
  switch (device) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
  }
  return "unknown";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return ndim > 0 ? n : 0;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device,
                     int device_index) {
  if (shape.size() < 1 || shape.size() > static_cast<size_t>(kMaxDims))
    throw Error("shape.size()", str(static_cast<int64_t>(shape.size())), "must be 1 to 4");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  t.device = device;
  t.device_index = device_index;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride, Device device, int device_index) {
  if (stride.size() != shape.size())
    throw Error("stride.size()", str(static_cast<int64_t>(stride.size())),
                "must equal shape.size() (" + str(static_cast<int64_t>(shape.size())) + ")");
  TensorView t = make_view(data, dtype, shape, device, device_index);
  int i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

const char* phi_kind_name(PhiKind kind) {
  switch (kind) {
    case PhiKind::mean: return "mean";
    case PhiKind::linear: return "linear";
    case PhiKind::mlp: return "mlp";
  }
  return "unknown";
}

PhiKind parse_phi_kind(const std::string& text, const char* parameter) {
  if (text == "mean") return PhiKind::mean;
  if (text == "linear") return PhiKind::linear;
  if (text == "mlp") return PhiKind::mlp;
  throw Error(parameter, "\"" + text + "\"", "must be one of mean, linear, mlp");
}

void Config::validate() const {
  // Upper bounds first: the rules below add and multiply these fields.
  const std::pair<const char*, int64_t> bounded[] = {
      {"cmp_block_len (l)", cmp_block_len}, {"cmp_stride (d)", cmp_stride}, {"slc_block_len (l')", slc_block_len},
      {"n_selected (n)", n_selected},       {"n_init", n_init},             {"n_local", n_local},
      {"window (w)", window}};
  for (const auto& [name, value] : bounded)
    if (value > kMaxLength) throw Error(name, str(value), "must be <= 2^31 - 1 = " + str(kMaxLength));
  if (cmp_block_len < 1) throw Error("cmp_block_len (l)", str(cmp_block_len), "must be >= 1");
  if (cmp_stride < 1) throw Error("cmp_stride (d)", str(cmp_stride), "must be >= 1");
  if (slc_block_len < 1) throw Error("slc_block_len (l')", str(slc_block_len), "must be >= 1");
  if (cmp_block_len % cmp_stride != 0)
    throw Error("cmp_stride (d)", str(cmp_stride),
                "must divide cmp_block_len (l = " + str(cmp_block_len) + ")");
  if (slc_block_len % cmp_stride != 0)
    throw Error("cmp_stride (d)", str(cmp_stride),
                "must divide slc_block_len (l' = " + str(slc_block_len) + ")");
  if (n_selected < 0) throw Error("n_selected (n)", str(n_selected), "must be >= 0 (0 turns selection off)");
  if (n_init < 0) throw Error("n_init", str(n_init), "must be >= 0");
  if (n_local < 0) throw Error("n_local", str(n_local), "must be >= 0");
  if (num_backbone < 0 || num_backbone > kMaxBackbone)
    throw Error("num_backbone", str(num_backbone), "must be in [0, " + str(int64_t{kMaxBackbone}) + "] (backbone offsets)");
  for (int64_t k = 0; k < num_backbone; ++k) {
    const int64_t o = backbone_offsets[k];
    if (o < 1 || o > kMaxLength)
      throw Error("backbone_offsets[" + str(k) + "]", str(o),
                  "must be in [1, 2^31 - 1] (a block offset back from the query's block)");
    for (int64_t i = 0; i < k; ++i)
      if (backbone_offsets[i] == o)
        throw Error("backbone_offsets[" + str(k) + "]", str(o), "must differ from the other offsets (equals offset " + str(i) + ")");
  }
  if (n_selected > 0 && (n_init > n_selected || n_local > n_selected || n_init + n_local + num_backbone > n_selected))
    throw Error(num_backbone > 0 ? "n_init + n_local + num_backbone" : "n_init + n_local",
                num_backbone > 0 ? str(n_init) + " + " + str(n_local) + " + " + str(num_backbone) : str(n_init + n_local),
                "must be <= n_selected (n = " + str(n_selected) + ")");
  if (window < 0) throw Error("window (w)", str(window), "must be >= 0 (0 turns the window off)");
  if (!(scale >= 0.0 && scale <= kMaxScale))
    throw Error("scale", str(scale), "must be in (0, 3.4e38] (fp32's range), or 0 for 1/sqrt(Dqk)");
  if (phi != PhiKind::mean && phi != PhiKind::linear && phi != PhiKind::mlp)
    throw Error("phi", str(static_cast<int64_t>(phi)), "must be mean (0), linear (1) or mlp (2)");
}

void Config::set_backbone(const std::vector<int64_t>& offsets) {
  if (offsets.size() > static_cast<size_t>(kMaxBackbone))
    throw Error("backbone_offsets", str(static_cast<int64_t>(offsets.size())) + " offsets",
                "must hold at most " + str(int64_t{kMaxBackbone}));
  num_backbone = static_cast<int64_t>(offsets.size());
  for (int k = 0; k < kMaxBackbone; ++k) backbone_offsets[k] = k < num_backbone ? offsets[static_cast<size_t>(k)] : 0;
}

std::vector<int64_t> backbone_schedule(int64_t layer, int64_t max_seqlen, int64_t slc_block_len, int64_t per_layer) {
  if (layer < 0) throw Error("layer", str(layer), "must be >= 0");
  if (max_seqlen < 1 || max_seqlen > kMaxLength) throw Error("max_seqlen", str(max_seqlen), "must be in [1, 2^31 - 1]");
  if (slc_block_len < 1 || slc_block_len > kMaxLength)
    throw Error("slc_block_len (l')", str(slc_block_len), "must be in [1, 2^31 - 1]");
  if (per_layer < 1 || per_layer > kMaxBackbone)
    throw Error("per_layer", str(per_layer), "must be in [1, " + str(int64_t{kMaxBackbone}) + "]");
  // Base k + 1: layer i moves information by d * (k+1)^(i mod P), d = 1..k, or leaves it (the
  // residual stream), so P consecutive layers spell any distance below (k+1)^P >= N_s in base k + 1.
  // k = 1 is spec §11's 2^(i mod P).
  const int64_t Ns = (max_seqlen + slc_block_len - 1) / slc_block_len, base = per_layer + 1;
  int64_t P = 0, power = 1;  // P = ceil(log_base(Ns))
  while (power < Ns) {
    power *= base;
    ++P;
  }
  std::vector<int64_t> offsets;
  if (P == 0) return offsets;
  int64_t unit = 1;
  for (int64_t e = 0; e < layer % P; ++e) unit *= base;
  for (int64_t d = 1; d <= per_layer && d * unit < Ns; ++d) offsets.push_back(d * unit);
  return offsets;
}

double Config::softmax_scale(int64_t dqk) const {
  return scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(dqk));
}

}  // namespace nsa
