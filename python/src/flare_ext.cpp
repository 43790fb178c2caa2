// flare_ext.cpp — the compiled half of the Python package: framework tensors in, flare's C ABI out.
//
// Every framework that speaks DLPack (NumPy, CuPy, JAX, …) hands its arrays to nanobind's
// nb::ndarray, which reads pointer, dtype, device, shape and strides without copying. PyTorch
// tensors take a faster road: their pointer, dtype, device, shape and strides are read through
// their own attributes (data_ptr(), dtype, get_device(), shape, stride()), which costs about a
// microsecond where a DLPack capsule costs several — it matters on the training hot path, where
// the host must stay ahead of the GPU. Either way this file builds flare_tensor views and calls
// flare_attention_forward / _backward. Nothing here allocates tensors; the Python layer
// (flare/_core.py, flare/_torch.py) allocates outputs in the caller's framework and passes the
// caller's stream as an integer. The module never links against torch and never imports it: a
// tensor is recognised as torch's only when torch is already loaded.
//
// A failed call raises the Python exception that matches the library's status code, carrying
// flare_last_error():
//   FLARE_INVALID_ARGUMENT → ValueError        FLARE_UNSUPPORTED → NotImplementedError
//   FLARE_DEVICE_ERROR     → RuntimeError      FLARE_OUT_OF_MEMORY → MemoryError
//   FLARE_INTERNAL         → RuntimeError
// An argument that is not a tensor at all raises TypeError naming it.
// The GIL is released while the library runs, so CPU attention on one thread does not stall
// Python threads, and CUDA launches do not serialise with them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "flare/c_api.h"

namespace nb = nanobind;

namespace {

// Inputs may be read-only (a NumPy array with writeable=False, a JAX array); outputs may not.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

[[noreturn]] void raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

// "float64", "int64", "uint8", … for messages; codes flare never takes print as "dtype 7/8".
std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  using code = nb::dlpack::dtype_code;
  std::string s;
  switch (static_cast<code>(t.code)) {
    case code::Int: s = "int"; break;
    case code::UInt: s = "uint"; break;
    case code::Float: s = "float"; break;
    case code::Bfloat: s = "bfloat"; break;
    case code::Complex: s = "complex"; break;
    case code::Bool: s = "bool"; break;
    default: s = "dtype " + std::to_string(t.code) + "/"; break;
  }
  s += std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

int32_t to_flare_dtype(nb::dlpack::dtype t, const char* name) {
  using code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 32) return FLARE_FLOAT32;
    if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 16) return FLARE_FLOAT16;
    if (t.code == static_cast<uint8_t>(code::Bfloat) && t.bits == 16) return FLARE_BFLOAT16;
    if (t.code == static_cast<uint8_t>(code::Int) && t.bits == 32) return FLARE_INT32;
  }
  raise(PyExc_ValueError, std::string(name) + ": dtype " + dlpack_dtype_name(t) +
                              " is not supported; flare takes float32, float16 or bfloat16 "
                              "tensors (int32 for cu_seqlens)");
}

// Converts one DLPack view. Pinned host memory (cuda_host) is ordinary CPU memory to flare.
template <typename Array>
flare_tensor to_flare_tensor(const Array& a, const char* name) {
  flare_tensor t{};
  if (a.ndim() > 4)
    raise(PyExc_ValueError, std::string(name) + ": expected at most 4 dimensions, got " +
                                std::to_string(a.ndim()));
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      t.device = FLARE_CPU;
      t.device_index = 0;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      t.device = FLARE_CUDA;
      t.device_index = a.device_id();
      break;
    default:
      raise(PyExc_NotImplementedError,
            std::string(name) + ": DLPack device type " + std::to_string(a.device_type()) +
                " is not supported; flare runs on CPU and CUDA tensors");
  }
  t.dtype = to_flare_dtype(a.dtype(), name);
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.ndim = static_cast<int32_t>(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  return t;
}

// ---- PyTorch tensors, read through their attributes ---------------------------------------------

// torch.Tensor and the dtypes flare takes, looked up once torch is loaded (never imported here).
struct TorchTypes {
  nb::object tensor;
  nb::object float32, float16, bfloat16, int32;
};

const TorchTypes* torch_types() {
  static TorchTypes* types = nullptr;  // set once under the GIL; kept for the process's life
  if (types != nullptr) return types;
  PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());
  if (torch == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object mod = nb::steal(torch);
  types = new TorchTypes{mod.attr("Tensor"), mod.attr("float32"), mod.attr("float16"),
                         mod.attr("bfloat16"), mod.attr("int32")};
  return types;
}

bool is_torch_tensor(nb::handle obj) {
  const TorchTypes* t = torch_types();
  return t != nullptr && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(t->tensor.ptr()));
}

int32_t torch_dtype(nb::handle dtype, const char* name) {
  const TorchTypes* t = torch_types();
  if (dtype.is(t->float32)) return FLARE_FLOAT32;
  if (dtype.is(t->float16)) return FLARE_FLOAT16;
  if (dtype.is(t->bfloat16)) return FLARE_BFLOAT16;
  if (dtype.is(t->int32)) return FLARE_INT32;
  std::string label = nb::cast<std::string>(nb::str(dtype));  // "torch.float64" → "float64"
  if (label.rfind("torch.", 0) == 0) label.erase(0, 6);
  raise(PyExc_ValueError, std::string(name) + ": dtype " + label +
                              " is not supported; flare takes float32, float16 or bfloat16 "
                              "tensors (int32 for cu_seqlens)");
}

flare_tensor torch_view(nb::handle obj, const char* name) {
  flare_tensor t{};
  if (nb::cast<bool>(obj.attr("is_cuda"))) {
    t.device = FLARE_CUDA;
    t.device_index = nb::cast<int32_t>(obj.attr("get_device")());
  } else if (nb::cast<bool>(obj.attr("is_cpu"))) {
    t.device = FLARE_CPU;
  } else {
    raise(PyExc_NotImplementedError,
          std::string(name) + ": device '" + nb::cast<std::string>(nb::str(obj.attr("device"))) +
              "' is not supported; flare runs on CPU and CUDA tensors");
  }
  t.dtype = torch_dtype(obj.attr("dtype"), name);
  const nb::tuple shape = nb::borrow<nb::tuple>(obj.attr("shape"));
  if (shape.size() > 4)
    raise(PyExc_ValueError, std::string(name) + ": expected at most 4 dimensions, got " +
                                std::to_string(shape.size()));
  nb::object strides;
  try {
    strides = obj.attr("stride")();
  } catch (const nb::python_error& e) {  // sparse and other layouts without strides
    raise(PyExc_ValueError, std::string(name) + ": flare takes strided (dense) tensors: " + e.what());
  }
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = nb::cast<int64_t>(shape[i]);
    t.stride[i] = nb::cast<int64_t>(nb::borrow<nb::tuple>(strides)[i]);
  }
  t.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(obj.attr("data_ptr")()));
  return t;
}

// ---- any argument ------------------------------------------------------------------------------

std::string python_type_name(nb::handle obj) {
  return nb::cast<std::string>(nb::str(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))));
}

// A tensor argument as a flare view: torch tensors by their attributes, anything else through
// DLPack. Inputs may be read-only arrays (a NumPy array with writeable=False, a JAX array);
// outputs may not. None gives an undefined view where `optional`, else a TypeError.
flare_tensor to_flare_tensor(nb::handle obj, const char* name, bool output = false,
                             bool optional = false) {
  if (obj.is_none()) {
    if (optional) return flare_tensor{};
    raise(PyExc_TypeError, std::string(name) + ": expected a tensor, got None");
  }
  if (is_torch_tensor(obj)) return torch_view(obj, name);
  if (output) {
    OutArray a;
    if (nb::try_cast(obj, a, false)) return to_flare_tensor(a, name);
  } else {
    InArray a;
    if (nb::try_cast(obj, a, false)) return to_flare_tensor(a, name);
  }
  raise(PyExc_TypeError, std::string(name) + ": expected a " +
                             (output ? "writable " : "") +
                             "tensor or array (PyTorch, or any DLPack producer), got " +
                             python_type_name(obj));
}

void check(int code) {
  if (code == FLARE_OK) return;
  const std::string message = flare_last_error();
  switch (code) {
    case FLARE_INVALID_ARGUMENT: raise(PyExc_ValueError, message);
    case FLARE_UNSUPPORTED: raise(PyExc_NotImplementedError, message);
    case FLARE_OUT_OF_MEMORY: raise(PyExc_MemoryError, message);
    case FLARE_DEVICE_ERROR: raise(PyExc_RuntimeError, message);
    default: raise(PyExc_RuntimeError, "flare internal error: " + message);
  }
}

// The options and varlen description shared by forward and backward.
struct CallArgs {
  flare_attention_options options;
  flare_varlen varlen;
  bool is_varlen;
};

CallArgs make_args(nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int max_seqlen_q,
                   int max_seqlen_k, float softmax_scale, bool causal, int window_left,
                   int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
                   uint64_t seed, uint64_t offset, bool deterministic, int backend) {
  CallArgs a;
  a.options = flare_default_options();
  a.options.softmax_scale = softmax_scale;
  a.options.causal = causal ? 1 : 0;
  a.options.window_left = window_left;
  a.options.window_right = window_right;
  a.options.softcap = softcap;
  a.options.alibi_slopes = to_flare_tensor(alibi_slopes, "alibi_slopes", false, true);
  a.options.dropout_p = dropout_p;
  a.options.dropout_seed = seed;
  a.options.dropout_offset = offset;
  a.options.deterministic = deterministic ? 1 : 0;
  a.options.backend = backend;
  a.varlen = flare_varlen{};
  a.varlen.cu_seqlens_q = to_flare_tensor(cu_seqlens_q, "cu_seqlens_q", false, true);
  a.varlen.cu_seqlens_k = to_flare_tensor(cu_seqlens_k, "cu_seqlens_k", false, true);
  a.varlen.max_seqlen_q = max_seqlen_q;
  a.varlen.max_seqlen_k = max_seqlen_k;
  a.is_varlen = !cu_seqlens_q.is_none() || !cu_seqlens_k.is_none();
  return a;
}

void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle o, nb::handle lse,
             nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int max_seqlen_q,
             int max_seqlen_k, float softmax_scale, bool causal, int window_left,
             int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
             uint64_t seed, uint64_t offset, bool deterministic, int backend, uintptr_t stream) {
  const flare_tensor tq = to_flare_tensor(q, "q"), tk = to_flare_tensor(k, "k"),
                     tv = to_flare_tensor(v, "v"), to = to_flare_tensor(o, "o", true),
                     tl = to_flare_tensor(lse, "lse", true);
  const CallArgs a = make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, seed, offset, deterministic, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_attention_forward(&tq, &tk, &tv, &to, &tl, &a.options,
                                   a.is_varlen ? &a.varlen : nullptr,
                                   reinterpret_cast<void*>(stream));
  }
  check(code);
}

void backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle o,
              nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv,
              nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int max_seqlen_q,
              int max_seqlen_k, float softmax_scale, bool causal, int window_left,
              int window_right, float softcap, nb::handle alibi_slopes, float dropout_p,
              uint64_t seed, uint64_t offset, bool deterministic, int backend, uintptr_t stream) {
  const flare_tensor tdo = to_flare_tensor(dout, "dout"), tq = to_flare_tensor(q, "q"),
                     tk = to_flare_tensor(k, "k"), tv = to_flare_tensor(v, "v"),
                     to = to_flare_tensor(o, "o"), tl = to_flare_tensor(lse, "lse"),
                     tdq = to_flare_tensor(dq, "dq", true), tdk = to_flare_tensor(dk, "dk", true),
                     tdv = to_flare_tensor(dv, "dv", true);
  const CallArgs a = make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, seed, offset, deterministic, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &a.options,
                                    a.is_varlen ? &a.varlen : nullptr,
                                    reinterpret_cast<void*>(stream));
  }
  check(code);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flare's C ABI over PyTorch tensors and DLPack arrays (see flare/_core.py for the Python interface)";

  m.def("forward", &forward, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "Writes o and lse. Raises ValueError / NotImplementedError / RuntimeError / MemoryError "
        "with the library's message on failure; nothing is written then.");

  m.def("backward", &backward, nb::arg("dout").none(), nb::arg("q").none(),
        nb::arg("k").none(), nb::arg("v").none(), nb::arg("o").none(),
        nb::arg("lse").none(), nb::arg("dq").none(), nb::arg("dk").none(),
        nb::arg("dv").none(), nb::arg("cu_seqlens_q").none(),
        nb::arg("cu_seqlens_k").none(), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "Writes dq, dk and dv. Errors as for forward().");

  m.def("version", [] { return std::string(flare_version()); });
  m.def("cuda_built", [] { return flare_cuda_built() != 0; });

  m.attr("BACKEND_AUTO") = static_cast<int>(FLARE_BACKEND_AUTO);
  m.attr("BACKEND_REFERENCE") = static_cast<int>(FLARE_BACKEND_REFERENCE);
  m.attr("BACKEND_FLASH") = static_cast<int>(FLARE_BACKEND_FLASH);
}
