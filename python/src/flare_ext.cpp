// flare_ext.cpp — the compiled half of the Python package: DLPack tensors in, flare's C ABI out.
//
// Every framework that speaks DLPack (PyTorch, NumPy, CuPy, JAX, …) hands its arrays to
// nanobind's nb::ndarray, which reads pointer, dtype, device, shape and strides without copying;
// this file turns them into flare_tensor views and calls flare_attention_forward / _backward.
// Nothing here allocates tensors or knows any framework: the Python layer (flare/_core.py)
// allocates outputs in the caller's framework and passes the caller's stream as an integer.
// The module never links against torch.
//
// A failed call raises the Python exception that matches the library's status code, carrying
// flare_last_error():
//   FLARE_INVALID_ARGUMENT → ValueError        FLARE_UNSUPPORTED → NotImplementedError
//   FLARE_DEVICE_ERROR     → RuntimeError      FLARE_OUT_OF_MEMORY → MemoryError
//   FLARE_INTERNAL         → RuntimeError
// The GIL is released while the library runs, so CPU attention on one thread does not stall
// Python threads, and CUDA launches do not serialise with them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
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

template <typename Array>
flare_tensor to_flare_tensor(const std::optional<Array>& a, const char* name) {
  return a ? to_flare_tensor(*a, name) : flare_tensor{};
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

CallArgs make_args(const std::optional<InArray>& cu_seqlens_q,
                   const std::optional<InArray>& cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
                   float softmax_scale, bool causal, int window_left, int window_right,
                   float softcap, const std::optional<InArray>& alibi_slopes, float dropout_p,
                   uint64_t seed, uint64_t offset, bool deterministic, int backend) {
  CallArgs a;
  a.options = flare_default_options();
  a.options.softmax_scale = softmax_scale;
  a.options.causal = causal ? 1 : 0;
  a.options.window_left = window_left;
  a.options.window_right = window_right;
  a.options.softcap = softcap;
  a.options.alibi_slopes = to_flare_tensor(alibi_slopes, "alibi_slopes");
  a.options.dropout_p = dropout_p;
  a.options.dropout_seed = seed;
  a.options.dropout_offset = offset;
  a.options.deterministic = deterministic ? 1 : 0;
  a.options.backend = backend;
  a.varlen = flare_varlen{};
  a.varlen.cu_seqlens_q = to_flare_tensor(cu_seqlens_q, "cu_seqlens_q");
  a.varlen.cu_seqlens_k = to_flare_tensor(cu_seqlens_k, "cu_seqlens_k");
  a.varlen.max_seqlen_q = max_seqlen_q;
  a.varlen.max_seqlen_k = max_seqlen_k;
  a.is_varlen = cu_seqlens_q.has_value() || cu_seqlens_k.has_value();
  return a;
}

void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& o,
             const OutArray& lse, const std::optional<InArray>& cu_seqlens_q,
             const std::optional<InArray>& cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
             float softmax_scale, bool causal, int window_left, int window_right, float softcap,
             const std::optional<InArray>& alibi_slopes, float dropout_p, uint64_t seed,
             uint64_t offset, bool deterministic, int backend, uintptr_t stream) {
  const flare_tensor tq = to_flare_tensor(q, "q"), tk = to_flare_tensor(k, "k"),
                     tv = to_flare_tensor(v, "v"), to = to_flare_tensor(o, "o"),
                     tl = to_flare_tensor(lse, "lse");
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

void backward(const InArray& dout, const InArray& q, const InArray& k, const InArray& v,
              const InArray& o, const InArray& lse, const OutArray& dq, const OutArray& dk,
              const OutArray& dv, const std::optional<InArray>& cu_seqlens_q,
              const std::optional<InArray>& cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
              float softmax_scale, bool causal, int window_left, int window_right, float softcap,
              const std::optional<InArray>& alibi_slopes, float dropout_p, uint64_t seed,
              uint64_t offset, bool deterministic, int backend, uintptr_t stream) {
  const flare_tensor tdo = to_flare_tensor(dout, "dout"), tq = to_flare_tensor(q, "q"),
                     tk = to_flare_tensor(k, "k"), tv = to_flare_tensor(v, "v"),
                     to = to_flare_tensor(o, "o"), tl = to_flare_tensor(lse, "lse"),
                     tdq = to_flare_tensor(dq, "dq"), tdk = to_flare_tensor(dk, "dk"),
                     tdv = to_flare_tensor(dv, "dv");
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
  m.doc() = "flare's C ABI over DLPack tensors (see flare/_core.py for the Python interface)";

  m.def("forward", &forward, nb::arg("q").noconvert(), nb::arg("k").noconvert(),
        nb::arg("v").noconvert(), nb::arg("o").noconvert(), nb::arg("lse").noconvert(),
        nb::arg("cu_seqlens_q").noconvert().none(), nb::arg("cu_seqlens_k").noconvert().none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").noconvert().none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "Writes o and lse. Raises ValueError / NotImplementedError / RuntimeError / MemoryError "
        "with the library's message on failure; nothing is written then.");

  m.def("backward", &backward, nb::arg("dout").noconvert(), nb::arg("q").noconvert(),
        nb::arg("k").noconvert(), nb::arg("v").noconvert(), nb::arg("o").noconvert(),
        nb::arg("lse").noconvert(), nb::arg("dq").noconvert(), nb::arg("dk").noconvert(),
        nb::arg("dv").noconvert(), nb::arg("cu_seqlens_q").noconvert().none(),
        nb::arg("cu_seqlens_k").noconvert().none(), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").noconvert().none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "Writes dq, dk and dv. Errors as for forward().");

  m.def("version", [] { return std::string(flare_version()); });
  m.def("cuda_built", [] { return flare_cuda_built() != 0; });

  m.attr("BACKEND_AUTO") = static_cast<int>(FLARE_BACKEND_AUTO);
  m.attr("BACKEND_REFERENCE") = static_cast<int>(FLARE_BACKEND_REFERENCE);
  m.attr("BACKEND_FLASH") = static_cast<int>(FLARE_BACKEND_FLASH);
}
