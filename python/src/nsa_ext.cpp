// The Python extension nsa._nsa: a thin layer from DLPack arrays to the C++ API.
//
// Arrays of any framework arrive through nanobind's ndarray (DLPack), on the host or a CUDA
// device, and become nsa::TensorViews without a copy. This layer checks nothing about shapes:
// src/api.cpp validates every call and its nsa::Error becomes nsa.Error (a ValueError) in Python.
// It allocates nothing either: outputs and workspaces come from the caller's framework (the
// Python package allocates them with numpy or torch). It does not link against PyTorch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>

#include <cstdint>
#include <string>
#include <vector>

#include "nsa/nsa.h"

namespace nb = nanobind;

namespace {

// DLPack device types (dlpack.h, DLDeviceType) that nsa understands.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;  // pinned host memory: a host array for nsa

// Python exception type for nsa::Error (a subclass of ValueError), created at module import.
PyObject* g_error_type = nullptr;

nsa::DType dtype_of(const nb::dlpack::dtype& t, const std::string& name) {
  using nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(dtype_code::Float) && t.bits == 32) return nsa::DType::f32;
    if (t.code == static_cast<uint8_t>(dtype_code::Float) && t.bits == 64) return nsa::DType::f64;
    if (t.code == static_cast<uint8_t>(dtype_code::Float) && t.bits == 16) return nsa::DType::f16;
    if (t.code == static_cast<uint8_t>(dtype_code::Bfloat) && t.bits == 16) return nsa::DType::bf16;
    if (t.code == static_cast<uint8_t>(dtype_code::Int) && t.bits == 32) return nsa::DType::i32;
  }
  static const char* const kCodes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const std::string kind = t.code < 7 ? kCodes[t.code] : "code " + std::to_string(t.code) + " ";
  throw nsa::Error(name + ".dtype",
                   (kind == "bool" ? kind : kind + std::to_string(t.bits)) +
                       (t.lanes != 1 ? " x " + std::to_string(t.lanes) + " lanes" : std::string()),
                   "must be a float (f32, bf16, f16, f64) or, for indices and offsets, int32");
}

// Keeps the imported arrays alive for the duration of one call and turns them into views.
class Arrays {
 public:
  // An input (read-only arrays welcome; the library only reads it). None gives an absent view.
  nsa::TensorView in(nb::handle obj, const std::string& name) {
    return hold(obj, name, "must be an array that supports DLPack (numpy, torch, ...) or None", held_inputs_);
  }

  // An output: a writable array. None gives an absent view.
  nsa::TensorView out(nb::handle obj, const std::string& name) {
    return hold(obj, name, "must be a writable array that supports DLPack (numpy, torch, ...) or None", held_outputs_);
  }

  // A flat byte buffer (any dtype) used as a workspace; None gives no workspace.
  nsa::Workspace workspace(nb::handle obj) {
    if (obj.is_none()) return {};
    nb::ndarray<> array;
    if (!nb::try_cast(obj, array))
      throw nsa::Error("workspace", std::string("an object of type ") + nb::inst_name(obj).c_str(),
                       "must be a contiguous array that supports DLPack, or None");
    nsa::Workspace ws;
    ws.data = array.data();
    ws.bytes = array.nbytes();
    held_outputs_.push_back(std::move(array));
    return ws;
  }

 private:
  // The view of obj imported as an Array and kept alive in `held`; None gives an absent view, another
  // object an error that names it and says what is `allowed`.
  template <typename Array>
  static nsa::TensorView hold(nb::handle obj, const std::string& name, const char* allowed, std::vector<Array>& held) {
    if (obj.is_none()) return {};
    Array array;
    if (!nb::try_cast(obj, array))
      throw nsa::Error(name, std::string("an object of type ") + nb::inst_name(obj).c_str(), allowed);
    const nsa::TensorView t = describe(array, name);
    held.push_back(std::move(array));
    return t;
  }

  // The view of an imported array (the caller keeps the array alive).
  template <typename Array>
  static nsa::TensorView describe(const Array& array, const std::string& name) {
    nsa::TensorView t;
    if (array.ndim() < 1 || array.ndim() > static_cast<size_t>(nsa::kMaxDims))
      throw nsa::Error(name + ".ndim", std::to_string(array.ndim()),
                       "must be 1 to " + std::to_string(nsa::kMaxDims));
    // TensorView takes `void*` for inputs and outputs alike; the library never writes an input.
    t.data = const_cast<void*>(static_cast<const void*>(array.data()));
    t.dtype = dtype_of(array.dtype(), name);
    t.ndim = static_cast<int>(array.ndim());
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = static_cast<int64_t>(array.shape(static_cast<size_t>(d)));
      t.stride[d] = array.stride(static_cast<size_t>(d));  // DLPack strides are in elements
    }
    if (array.size() == 0) {
      // Exporters give empty arrays arbitrary strides (numpy: 0). Nothing is read or written,
      // so describe them as row-major, which every check accepts.
      int64_t stride = 1;
      for (int d = t.ndim - 1; d >= 0; --d) {
        t.stride[d] = stride;
        stride *= t.shape[d] > 0 ? t.shape[d] : 1;
      }
    }
    switch (array.device_type()) {
      case kDLCPU:
      case kDLCUDAHost: t.device = nsa::Device::cpu; break;
      case kDLCUDA: t.device = nsa::Device::cuda; break;
      default:
        throw nsa::Error(name + ".device", "DLPack device type " + std::to_string(array.device_type()),
                         "must be the host (cpu) or a CUDA device");
    }
    t.device_index = t.device == nsa::Device::cuda ? array.device_id() : 0;
    return t;
  }

  std::vector<nb::ndarray<nb::ro>> held_inputs_;
  std::vector<nb::ndarray<>> held_outputs_;
};

// A sequence argument (kv, pools, phi parameters): None or another object is a named error.
nb::sequence as_sequence(nb::handle obj, const std::string& name, const std::string& allowed) {
  if (obj.is_none() || !PySequence_Check(obj.ptr()) || nb::isinstance<nb::str>(obj))
    throw nsa::Error(name, obj.is_none() ? std::string("None") : std::string("an object of type ") + nb::inst_name(obj).c_str(),
                     allowed);
  return nb::borrow<nb::sequence>(obj);
}

// output: the arrays are written (gradients), else read.
nsa::PhiParams phi_views(Arrays& arrays, nb::handle params, const std::string& name, bool output = false) {
  // params: None (mean) or a sequence (w1, b1, w2, b2, pe) whose entries may be None.
  nsa::PhiParams p;
  if (params.is_none()) return p;
  nb::sequence seq = as_sequence(params, name, "must be None or (w1, b1, w2, b2, pe)");
  if (nb::len(seq) != 5)
    throw nsa::Error(name, "a sequence of " + std::to_string(nb::len(seq)) + " entries",
                     "must be None or (w1, b1, w2, b2, pe)");
  auto view = [&](nb::handle h, const std::string& n) { return output ? arrays.out(h, n) : arrays.in(h, n); };
  p.w1 = view(seq[0], name + ".w1");
  p.b1 = view(seq[1], name + ".b1");
  p.w2 = view(seq[2], name + ".w2");
  p.b2 = view(seq[3], name + ".b2");
  p.pe = view(seq[4], name + ".pe");
  return p;
}

nsa::Sequences sequences(Arrays& arrays, nb::handle cu_seqlens, int64_t max_seqlen) {
  nsa::Sequences s;
  s.cu_seqlens = arrays.in(cu_seqlens, "cu_seqlens");
  s.max_seqlen = max_seqlen;
  return s;
}

// The six raw K/V arrays (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win); None where absent.
void kv_views(Arrays& arrays, nb::handle kv, nsa::KV out[3], const char* const names[6], bool output = false) {
  nb::sequence seq = as_sequence(kv, "kv", "must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), None where absent");
  if (nb::len(seq) != 6)
    throw nsa::Error("kv", "a sequence of " + std::to_string(nb::len(seq)) + " entries",
                     "must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), None where absent");
  for (int b = 0; b < 3; ++b) {
    out[b].k = output ? arrays.out(seq[2 * b], names[2 * b]) : arrays.in(seq[2 * b], names[2 * b]);
    out[b].v = output ? arrays.out(seq[2 * b + 1], names[2 * b + 1]) : arrays.in(seq[2 * b + 1], names[2 * b + 1]);
  }
}

// The outputs of forward and decode: o, and the optional lse, indices and o_branch.
nsa::ForwardOutputs forward_outputs(Arrays& a, nb::handle o, nb::handle lse, nb::handle indices, nb::handle o_branch) {
  nsa::ForwardOutputs out;
  out.o = a.out(o, "o");
  out.lse = a.out(lse, "lse");
  out.indices = a.out(indices, "indices");
  out.o_branch = a.out(o_branch, "o_branch");
  return out;
}

// The layer's inputs (nsa::forward and nsa::backward take the same ones); cu_seqlens_q None: no
// query packing.
nsa::Inputs layer_inputs(Arrays& arrays, nb::handle q, nb::handle kv, nb::handle g, nb::handle phi_k,
                         nb::handle phi_v, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle cu_seqlens_q,
                         int64_t max_seqlen_q) {
  static const char* const kKvNames[6] = {"k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"};
  nsa::Inputs in;
  in.q = arrays.in(q, "q");
  kv_views(arrays, kv, in.kv, kKvNames);
  in.g = arrays.in(g, "g");
  in.phi_k = phi_views(arrays, phi_k, "phi_k");
  in.phi_v = phi_views(arrays, phi_v, "phi_v");
  in.seqs = sequences(arrays, cu_seqlens, max_seqlen);
  in.seqs_q.cu_seqlens = arrays.in(cu_seqlens_q, "cu_seqlens_q");
  in.seqs_q.max_seqlen = max_seqlen_q;
  return in;
}

// A paged cache (nsa/cache.h): pools = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc), None
// where absent; the pools are written when `write`, status always.
nsa::PagedCache cache_views(Arrays& arrays, nb::handle pools, nb::handle block_table, nb::handle seq_lens,
                            nb::handle status, int64_t max_seqlen, bool write) {
  static const char* const kNames[8] = {"cache.k_cmp", "cache.v_cmp", "cache.k_slc", "cache.v_slc",
                                        "cache.k_win", "cache.v_win", "cache.kc", "cache.vc"};
  nb::sequence seq = as_sequence(pools, "pools", "must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc), None where absent");
  if (nb::len(seq) != 8)
    throw nsa::Error("pools", "a sequence of " + std::to_string(nb::len(seq)) + " entries",
                     "must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc), None where absent");
  nsa::TensorView v[8];
  for (int i = 0; i < 8; ++i) v[i] = write ? arrays.out(seq[i], kNames[i]) : arrays.in(seq[i], kNames[i]);
  nsa::PagedCache c;
  for (int b = 0; b < 3; ++b) c.raw[b] = nsa::KV{v[2 * b], v[2 * b + 1]};
  c.cmp = nsa::KV{v[6], v[7]};
  c.pages.block_table = arrays.in(block_table, "pages.block_table");
  c.pages.seq_lens = arrays.in(seq_lens, "pages.seq_lens");
  c.pages.status = arrays.out(status, "pages.status");
  c.pages.max_seqlen = max_seqlen;
  return c;
}

nsa::Op parse_op(const std::string& name) {
  // Each operation under the name of its enumerator.
#define NSA_OP(op) {#op, nsa::Op::op}
  static const std::pair<const char*, nsa::Op> kOps[] = {
      NSA_OP(compress_fwd), NSA_OP(compress_bwd), NSA_OP(compressed_attention_fwd), NSA_OP(select_topn),
      NSA_OP(selected_attention_fwd), NSA_OP(window_attention_fwd), NSA_OP(forward), NSA_OP(backward),
      NSA_OP(dense_attention_fwd), NSA_OP(dense_attention_bwd), NSA_OP(cache_append), NSA_OP(decode),
      NSA_OP(dense_decode),
  };
#undef NSA_OP
  for (const auto& [text, op] : kOps)
    if (name == text) return op;
  throw nsa::Error("op", "\"" + name + "\"", "must name an operation of nsa::Op, e.g. \"forward\"");
}

nsa::DType parse_dtype(const std::string& name) {
  for (nsa::DType t : {nsa::DType::f32, nsa::DType::f16, nsa::DType::bf16, nsa::DType::f64, nsa::DType::i32})
    if (name == nsa::dtype_name(t)) return t;
  throw nsa::Error("dtype", "\"" + name + "\"", "must be one of f32, f16, bf16, f64, i32");
}

nsa::Device parse_device(const std::string& name) {
  if (name == "cpu") return nsa::Device::cpu;
  if (name == "cuda") return nsa::Device::cuda;
  throw nsa::Error("device", "\"" + name + "\"", "must be cpu or cuda");
}

nsa::Context make_context(const std::string& backend, uintptr_t stream, int num_threads) {
  nsa::Context ctx;
  ctx.backend = nsa::parse_backend(backend.c_str());
  ctx.stream = reinterpret_cast<void*>(stream);
  ctx.num_threads = num_threads;
  return ctx;
}

// The context arguments every entry point takes first.
#define NSA_CONTEXT_ARGS                                                                   \
  nb::arg("backend"), nb::arg("stream"), nb::arg("num_threads")

// An attention over (q, k, v) that writes o and lse: window_attention_fwd, whose Param is the
// Config, and dense_attention_fwd, whose Param is the softmax scale.
template <typename Param>
using QkvAttentionFwd = void (*)(const nsa::Context&, Param, const nsa::TensorView&, const nsa::TensorView&,
                                 const nsa::TensorView&, const nsa::Sequences&, const nsa::TensorView&,
                                 const nsa::TensorView&, nsa::Workspace);

// Binds `fn` as the entry point `name`; `param` is the Python name of its Param argument.
template <typename Param>
void def_qkv_attention_fwd(nb::module_& m, const char* name, QkvAttentionFwd<Param> fn, const char* param) {
  m.def(
      name,
      [fn](const std::string& backend, uintptr_t stream, int threads, Param p, nb::handle q, nb::handle k,
           nb::handle v, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle o, nb::handle lse,
           nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vq = a.in(q, "q"), vk = a.in(k, "k"), vv = a.in(v, "v");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.out(o, "o"), vl = a.out(lse, "lse");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        fn(ctx, p, vq, vk, vv, s, vo, vl, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg(param), nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(),
      nb::arg("workspace").none());
}

}  // namespace

#ifndef NSA_VERSION
#error "NSA_VERSION (the project version) is set by python/CMakeLists.txt"
#endif

NB_MODULE(_nsa, m) {
  m.doc() = "Native Sparse Attention: bindings of the C++ library (see the nsa package).";
  m.attr("__version__") = NSA_VERSION;

  g_error_type = PyErr_NewExceptionWithDoc(
      "nsa._nsa.Error",
      "Invalid input to nsa; the message names the parameter, its value and what is allowed.\n"
      "Attributes: parameter, value, allowed.",
      PyExc_ValueError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const nsa::Error& e) {
      nb::object error = nb::handle(g_error_type)(e.what());
      error.attr("parameter") = e.parameter();
      error.attr("value") = e.value();
      error.attr("allowed") = e.allowed();
      PyErr_SetObject(g_error_type, error.ptr());
    }
  });

  nb::enum_<nsa::PhiKind>(m, "PhiKind")
      .value("mean", nsa::PhiKind::mean)
      .value("linear", nsa::PhiKind::linear)
      .value("mlp", nsa::PhiKind::mlp);

  nb::class_<nsa::Config>(m, "Config", "nsa::Config: the paper's symbols l, d, l', n, w (spec §1).")
      .def(nb::init<>())
      .def_rw("cmp_block_len", &nsa::Config::cmp_block_len)
      .def_rw("cmp_stride", &nsa::Config::cmp_stride)
      .def_rw("slc_block_len", &nsa::Config::slc_block_len)
      .def_rw("n_selected", &nsa::Config::n_selected)
      .def_rw("n_init", &nsa::Config::n_init)
      .def_rw("n_local", &nsa::Config::n_local)
      .def_rw("window", &nsa::Config::window)
      .def_rw("scale", &nsa::Config::scale)
      .def_rw("phi", &nsa::Config::phi)
      .def_rw("shared_kv", &nsa::Config::shared_kv)
      .def_prop_rw(
          "backbone_offsets",
          [](const nsa::Config& c) {
            return std::vector<int64_t>(c.backbone_offsets, c.backbone_offsets + std::clamp<int64_t>(c.num_backbone, 0, nsa::kMaxBackbone));
          },
          [](nsa::Config& c, const std::vector<int64_t>& v) { c.set_backbone(v); })
      .def("validate", &nsa::Config::validate)
      .def("softmax_scale", &nsa::Config::softmax_scale, nb::arg("dqk"));

  m.def("backbone_schedule", &nsa::backbone_schedule, nb::arg("layer"), nb::arg("max_seqlen"),
        nb::arg("slc_block_len"), nb::arg("per_layer") = 1,
        "The reach backbone's offsets of one layer (nsa::backbone_schedule, spec §11).");
  m.def("parse_phi_kind", [](const std::string& text) { return nsa::parse_phi_kind(text, "phi"); },
        nb::arg("text"));
  m.def("backend_available",
        [](const std::string& backend) { return nsa::backend_available(nsa::parse_backend(backend.c_str())); },
        nb::arg("backend"), "Whether the backend is compiled in and (cuda) a device is visible.");

  m.def(
      "workspace_size",
      [](const std::string& op, const std::string& backend, int num_threads, const nsa::Config& cfg,
         int64_t total_tokens, int64_t batch, int64_t max_seqlen, int64_t hq, int64_t hkv,
         int64_t dqk, int64_t dv, int64_t phi_hidden, const std::string& dtype,
         const std::string& device, int64_t max_query_len) {
        nsa::Problem pr;
        pr.max_query_len = max_query_len;
        pr.total_tokens = total_tokens;
        pr.batch = batch;
        pr.max_seqlen = max_seqlen;
        pr.hq = hq;
        pr.hkv = hkv;
        pr.dqk = dqk;
        pr.dv = dv;
        pr.phi_hidden = phi_hidden;
        pr.dtype = parse_dtype(dtype);
        pr.device = parse_device(device);
        return nsa::workspace_size(make_context(backend, 0, num_threads), parse_op(op), cfg, pr);
      },
      nb::arg("op"), nb::arg("backend"), nb::arg("num_threads"), nb::arg("cfg"),
      nb::arg("total_tokens"), nb::arg("batch"), nb::arg("max_seqlen"), nb::arg("hq"),
      nb::arg("hkv"), nb::arg("dqk"), nb::arg("dv"), nb::arg("phi_hidden"), nb::arg("dtype"),
      nb::arg("device"), nb::arg("max_query_len") = 0,
      "Bytes of workspace nsa::Op `op` needs (nsa::workspace_size).");

  // Every entry point below takes (backend, stream, num_threads) as its context (NSA_CONTEXT_ARGS),
  // then the arguments of the C++ function in the same order. The GIL is released while the
  // library runs; the arrays stay alive through `arrays`.

  m.def(
      "compress_fwd",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle phi, nb::handle x, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle xc,
         nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::PhiParams p = phi_views(a, phi, "phi");
        const nsa::TensorView vx = a.in(x, "x"), vxc = a.out(xc, "xc");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::compress_fwd(ctx, cfg, p, vx, s, vxc, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("phi").none(), nb::arg("x").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("xc").none(), nb::arg("workspace").none());

  m.def(
      "compress_bwd",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle phi, nb::handle x, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle dxc,
         nb::handle dx, nb::handle dphi, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::PhiParams p = phi_views(a, phi, "phi"), dp = phi_views(a, dphi, "dphi", /*output=*/true);
        const nsa::TensorView vx = a.in(x, "x"), vdxc = a.in(dxc, "dxc"), vdx = a.out(dx, "dx");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::compress_bwd(ctx, cfg, p, vx, s, vdxc, vdx, dp, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("phi").none(), nb::arg("x").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("dxc").none(), nb::arg("dx").none(),
      nb::arg("dphi").none(), nb::arg("workspace").none());

  m.def(
      "compressed_attention_fwd",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle q, nb::handle kc, nb::handle vc, nb::handle cu_seqlens, int64_t max_seqlen,
         nb::handle o, nb::handle lse, nb::handle scores, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vq = a.in(q, "q"), vkc = a.in(kc, "kc"), vvc = a.in(vc, "vc");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.out(o, "o"), vl = a.out(lse, "lse"), vs = a.out(scores, "scores");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::compressed_attention_fwd(ctx, cfg, vq, vkc, vvc, s, vo, vl, vs, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("q").none(), nb::arg("kc").none(), nb::arg("vc").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(),
      nb::arg("scores").none(), nb::arg("workspace").none());

  m.def(
      "select_topn",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle scores, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle indices,
         nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vs = a.in(scores, "scores"), vi = a.out(indices, "indices");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::select_topn(ctx, cfg, vs, s, vi, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("scores").none(), nb::arg("cu_seqlens").none(),
      nb::arg("max_seqlen"), nb::arg("indices").none(), nb::arg("workspace").none());

  m.def(
      "selected_attention_fwd",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle q, nb::handle k, nb::handle v, nb::handle indices, nb::handle cu_seqlens,
         int64_t max_seqlen, nb::handle o, nb::handle lse, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vq = a.in(q, "q"), vk = a.in(k, "k"), vv = a.in(v, "v");
        const nsa::TensorView vi = a.in(indices, "indices");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.out(o, "o"), vl = a.out(lse, "lse");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::selected_attention_fwd(ctx, cfg, vq, vk, vv, vi, s, vo, vl, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
      nb::arg("indices").none(), nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("o").none(),
      nb::arg("lse").none(), nb::arg("workspace").none());

  def_qkv_attention_fwd(m, "window_attention_fwd", nsa::window_attention_fwd, "cfg");

  static const char* const kDkvNames[6] = {"dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win"};

  m.def(
      "forward",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle q, nb::handle kv, nb::handle g, nb::handle phi_k, nb::handle phi_v,
         nb::handle cu_seqlens, int64_t max_seqlen, nb::handle o, nb::handle lse,
         nb::handle indices, nb::handle o_branch, nb::handle workspace, nb::handle cu_seqlens_q, int64_t max_seqlen_q,
         nb::handle o_cmp, nb::handle o_win) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::Inputs in = layer_inputs(a, q, kv, g, phi_k, phi_v, cu_seqlens, max_seqlen, cu_seqlens_q, max_seqlen_q);
        nsa::ForwardOutputs out = forward_outputs(a, o, lse, indices, o_branch);
        out.o_cmp = a.out(o_cmp, "o_cmp");
        out.o_win = a.out(o_win, "o_win");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::forward(ctx, cfg, in, out, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("q").none(), nb::arg("kv").none(), nb::arg("g").none(),
      nb::arg("phi_k").none(), nb::arg("phi_v").none(), nb::arg("cu_seqlens").none(),
      nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(), nb::arg("indices").none(),
      nb::arg("o_branch").none(), nb::arg("workspace").none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("max_seqlen_q") = 0, nb::arg("o_cmp").none() = nb::none(), nb::arg("o_win").none() = nb::none());

  m.def(
      "backward",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle q, nb::handle kv, nb::handle g, nb::handle phi_k, nb::handle phi_v,
         nb::handle cu_seqlens, int64_t max_seqlen, nb::handle o, nb::handle lse,
         nb::handle indices, nb::handle o_branch, nb::handle d_o, nb::handle dq, nb::handle dkv, nb::handle dg,
         nb::handle dphi_k, nb::handle dphi_v, nb::handle workspace, nb::handle cu_seqlens_q, int64_t max_seqlen_q,
         nb::handle o_cmp, nb::handle o_win) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::Inputs in = layer_inputs(a, q, kv, g, phi_k, phi_v, cu_seqlens, max_seqlen, cu_seqlens_q, max_seqlen_q);
        nsa::ForwardOutputs saved;
        saved.o = a.in(o, "o");
        saved.lse = a.in(lse, "lse");
        saved.indices = a.in(indices, "indices");
        saved.o_branch = a.in(o_branch, "o_branch");
        saved.o_cmp = a.in(o_cmp, "o_cmp");
        saved.o_win = a.in(o_win, "o_win");
        const nsa::TensorView vdo = a.in(d_o, "d_o");
        nsa::Gradients grads;
        grads.dq = a.out(dq, "dq");
        kv_views(a, dkv, grads.dkv, kDkvNames, /*output=*/true);
        grads.dg = a.out(dg, "dg");
        grads.dphi_k = phi_views(a, dphi_k, "dphi_k", /*output=*/true);
        grads.dphi_v = phi_views(a, dphi_v, "dphi_v", /*output=*/true);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::backward(ctx, cfg, in, saved, vdo, grads, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), nb::arg("q").none(), nb::arg("kv").none(), nb::arg("g").none(),
      nb::arg("phi_k").none(), nb::arg("phi_v").none(), nb::arg("cu_seqlens").none(),
      nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(), nb::arg("indices").none(),
      nb::arg("o_branch").none(), nb::arg("d_o").none(), nb::arg("dq").none(), nb::arg("dkv").none(), nb::arg("dg").none(), nb::arg("dphi_k").none(),
      nb::arg("dphi_v").none(), nb::arg("workspace").none(), nb::arg("cu_seqlens_q").none() = nb::none(),
      nb::arg("max_seqlen_q") = 0, nb::arg("o_cmp").none() = nb::none(), nb::arg("o_win").none() = nb::none());

  def_qkv_attention_fwd(m, "dense_attention_fwd", nsa::dense_attention_fwd, "scale");

  m.def(
      "dense_attention_bwd",
      [](const std::string& backend, uintptr_t stream, int threads, double scale,
         nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens, int64_t max_seqlen,
         nb::handle o, nb::handle lse, nb::handle d_o, nb::handle dq, nb::handle dk,
         nb::handle dv, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vq = a.in(q, "q"), vk = a.in(k, "k"), vv = a.in(v, "v");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.in(o, "o"), vl = a.in(lse, "lse"), vdo = a.in(d_o, "d_o");
        const nsa::TensorView vdq = a.out(dq, "dq"), vdk = a.out(dk, "dk"), vdv = a.out(dv, "dv");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::dense_attention_bwd(ctx, scale, vq, vk, vv, s, vo, vl, vdo, vdq, vdk, vdv, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("scale"), nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(),
      nb::arg("d_o").none(), nb::arg("dq").none(), nb::arg("dk").none(), nb::arg("dv").none(), nb::arg("workspace").none());
  m.def(
      "rotary",
      [](const std::string& backend, uintptr_t stream, int threads, nb::handle x, nb::handle inv_freq,
         nb::handle cu_seqlens, int64_t max_seqlen, nb::handle positions, nb::handle out, bool inverse) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::TensorView vx = a.in(x, "x"), vf = a.in(inv_freq, "inv_freq"), vp = a.in(positions, "positions");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.out(out, "out");  // may be x itself (in place)
        nb::gil_scoped_release release;
        nsa::rotary(ctx, vx, vf, s, vp, vo, inverse);
      },
      NSA_CONTEXT_ARGS, nb::arg("x").none(), nb::arg("inv_freq").none(), nb::arg("cu_seqlens").none(),
      nb::arg("max_seqlen"), nb::arg("positions").none(), nb::arg("out").none(), nb::arg("inverse"));

  // Decoding (nsa/cache.h). The cache arrives as (pools, block_table, seq_lens, status, max_cache_len).
#define NSA_CACHE_ARGS                                                                         \
  nb::arg("pools").none(), nb::arg("block_table").none(), nb::arg("seq_lens").none(), nb::arg("status").none(), \
      nb::arg("max_cache_len")

  m.def(
      "cache_append",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle pools, nb::handle block_table, nb::handle seq_lens, nb::handle status, int64_t max_cache_len,
         nb::handle kv, nb::handle phi_k, nb::handle phi_v, nb::handle cu_seqlens, int64_t max_seqlen,
         nb::handle workspace) {
        static const char* const kKvNames[6] = {"k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"};
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::PagedCache cache = cache_views(a, pools, block_table, seq_lens, status, max_cache_len, true);
        nsa::CacheAppend in;
        kv_views(a, kv, in.kv, kKvNames);
        in.phi_k = phi_views(a, phi_k, "phi_k");
        in.phi_v = phi_views(a, phi_v, "phi_v");
        in.seqs = sequences(a, cu_seqlens, max_seqlen);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::cache_append(ctx, cfg, cache, in, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), NSA_CACHE_ARGS, nb::arg("kv").none(), nb::arg("phi_k").none(),
      nb::arg("phi_v").none(), nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("workspace").none());

  m.def(
      "decode",
      [](const std::string& backend, uintptr_t stream, int threads, const nsa::Config& cfg,
         nb::handle pools, nb::handle block_table, nb::handle seq_lens, nb::handle status, int64_t max_cache_len,
         nb::handle q, nb::handle g, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle o, nb::handle lse,
         nb::handle indices, nb::handle o_branch, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::PagedCache cache = cache_views(a, pools, block_table, seq_lens, status, max_cache_len, false);
        nsa::DecodeInputs in;
        in.q = a.in(q, "q");
        in.g = a.in(g, "g");
        in.seqs = sequences(a, cu_seqlens, max_seqlen);
        const nsa::ForwardOutputs out = forward_outputs(a, o, lse, indices, o_branch);
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::decode(ctx, cfg, cache, in, out, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("cfg"), NSA_CACHE_ARGS, nb::arg("q").none(), nb::arg("g").none(), nb::arg("cu_seqlens").none(),
      nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(), nb::arg("indices").none(),
      nb::arg("o_branch").none(), nb::arg("workspace").none());

  m.def(
      "dense_decode",
      [](const std::string& backend, uintptr_t stream, int threads, double scale, nb::handle k_pages,
         nb::handle v_pages, nb::handle block_table, nb::handle seq_lens, nb::handle status, int64_t max_cache_len,
         nb::handle q, nb::handle cu_seqlens, int64_t max_seqlen, nb::handle o, nb::handle lse, nb::handle workspace) {
        Arrays a;
        const nsa::Context ctx = make_context(backend, stream, threads);
        const nsa::KV pages{a.in(k_pages, "pages_k"), a.in(v_pages, "pages_v")};
        nsa::PageTable table;
        table.block_table = a.in(block_table, "pages.block_table");
        table.seq_lens = a.in(seq_lens, "pages.seq_lens");
        table.status = a.out(status, "pages.status");
        table.max_seqlen = max_cache_len;
        const nsa::TensorView vq = a.in(q, "q");
        const nsa::Sequences s = sequences(a, cu_seqlens, max_seqlen);
        const nsa::TensorView vo = a.out(o, "o"), vl = a.out(lse, "lse");
        const nsa::Workspace ws = a.workspace(workspace);
        nb::gil_scoped_release release;
        nsa::dense_decode(ctx, scale, pages, table, vq, s, vo, vl, ws);
      },
      NSA_CONTEXT_ARGS, nb::arg("scale"), nb::arg("k_pages").none(), nb::arg("v_pages").none(), nb::arg("block_table").none(),
      nb::arg("seq_lens").none(), nb::arg("status").none(), nb::arg("max_cache_len"), nb::arg("q").none(),
      nb::arg("cu_seqlens").none(), nb::arg("max_seqlen"), nb::arg("o").none(), nb::arg("lse").none(),
      nb::arg("workspace").none());
#undef NSA_CACHE_ARGS
#undef NSA_CONTEXT_ARGS
}
