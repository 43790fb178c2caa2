// flare_ext.cpp — the compiled half of the Python package: framework tensors in, flare's C ABI out.
//
// Every framework that speaks DLPack (NumPy, CuPy, JAX, …) hands its arrays to nanobind's
// nb::ndarray, which reads pointer, dtype, device, shape and strides without copying. PyTorch
// tensors take a faster road: their pointer, dtype, device, shape and strides are read through
// their own attributes (data_ptr(), dtype, get_device(), shape, stride()), which costs about a
// microsecond where a DLPack capsule costs several — it matters on the training hot path, where
// the host must stay ahead of the GPU. Either way this file builds flare_tensor views and calls
// flare_attention_forward / _backward (and the KV-cache and block-sparse entry points, with the
// pattern helpers of the latter). Nothing here allocates tensors; the Python layer
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
//
// Context parallelism (flare/dist.py): Comm and Plan own a communicator and a plan of the C ABI;
// their collective calls release the GIL, since in-process ranks are threads of one interpreter.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "c_api_table.h"
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

// What the dtype errors list: the library's rules per argument give the exact one.
constexpr const char* kDtypesTaken =
    "flare takes float32, float16 or bfloat16 tensors (int32 for cu_seqlens, uint8 or int32 for "
    "block masks, torch.float8_e4m3fn for attention_forward_fp8's q, k and v)";

int32_t to_flare_dtype(nb::dlpack::dtype t, const char* name) {
  using code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 32) return FLARE_FLOAT32;
    if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 16) return FLARE_FLOAT16;
    if (t.code == static_cast<uint8_t>(code::Bfloat) && t.bits == 16) return FLARE_BFLOAT16;
    if (t.code == static_cast<uint8_t>(code::Int) && t.bits == 32) return FLARE_INT32;
    if (t.code == static_cast<uint8_t>(code::UInt) && t.bits == 8) return FLARE_UINT8;
  }
  raise(PyExc_ValueError, std::string(name) + ": dtype " + dlpack_dtype_name(t) +
                              " is not supported; " + kDtypesTaken);
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
  nb::object float32, float16, bfloat16, int32, uint8;
  nb::object float8_e4m3fn;  // None where this torch has no such dtype
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
  types = new TorchTypes{mod.attr("Tensor"),   mod.attr("float32"), mod.attr("float16"),
                         mod.attr("bfloat16"), mod.attr("int32"),   mod.attr("uint8"),
                         nb::getattr(mod, "float8_e4m3fn", nb::none())};
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
  if (dtype.is(t->uint8)) return FLARE_UINT8;
  if (!t->float8_e4m3fn.is_none() && dtype.is(t->float8_e4m3fn)) return FLARE_FLOAT8_E4M3;
  std::string label = nb::cast<std::string>(nb::str(dtype));  // "torch.float64" → "float64"
  if (label.rfind("torch.", 0) == 0) label.erase(0, 6);
  raise(PyExc_ValueError, std::string(name) + ": dtype " + label + " is not supported; " +
                              kDtypesTaken);
}

// The torch.Tensor attributes torch_view reads, as interned strings made once: a lookup by C
// string builds a new Python string every time, and a method called through its name skips the
// bound method object (PyObject_CallMethodNoArgs). Five tensors per call, six reads each.
struct TorchNames {
  PyObject *is_cuda, *is_cpu, *get_device, *dtype, *shape, *stride, *data_ptr;
};

const TorchNames& torch_names() {
  static const TorchNames names{
      PyUnicode_InternFromString("is_cuda"), PyUnicode_InternFromString("is_cpu"),
      PyUnicode_InternFromString("get_device"), PyUnicode_InternFromString("dtype"),
      PyUnicode_InternFromString("shape"), PyUnicode_InternFromString("stride"),
      PyUnicode_InternFromString("data_ptr")};
  return names;
}

nb::object get(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

nb::object call(nb::handle obj, PyObject* method) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), method);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

flare_tensor torch_view(nb::handle obj, const char* name) {
  const TorchNames& n = torch_names();
  flare_tensor t{};
  if (nb::cast<bool>(get(obj, n.is_cuda))) {
    t.device = FLARE_CUDA;
    t.device_index = nb::cast<int32_t>(call(obj, n.get_device));
  } else if (nb::cast<bool>(get(obj, n.is_cpu))) {
    t.device = FLARE_CPU;
  } else {
    raise(PyExc_NotImplementedError,
          std::string(name) + ": device '" + nb::cast<std::string>(nb::str(obj.attr("device"))) +
              "' is not supported; flare runs on CPU and CUDA tensors");
  }
  t.dtype = torch_dtype(get(obj, n.dtype), name);
  const nb::tuple shape = nb::borrow<nb::tuple>(get(obj, n.shape));
  if (shape.size() > 4)
    raise(PyExc_ValueError, std::string(name) + ": expected at most 4 dimensions, got " +
                                std::to_string(shape.size()));
  nb::object strides;
  try {
    strides = call(obj, n.stride);
  } catch (const nb::python_error& e) {  // sparse and other layouts without strides
    raise(PyExc_ValueError, std::string(name) + ": flare takes strided (dense) tensors: " + e.what());
  }
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = nb::cast<int64_t>(shape[i]);
    t.stride[i] = nb::cast<int64_t>(nb::borrow<nb::tuple>(strides)[i]);
  }
  t.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(call(obj, n.data_ptr)));
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

void forward_fp8(nb::handle q, nb::handle k, nb::handle v, nb::handle o, nb::handle lse,
                 nb::handle q_descale, nb::handle k_descale, nb::handle v_descale,
                 int block_rows, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                 int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal,
                 int window_left, int window_right, float softcap, nb::handle alibi_slopes,
                 int backend, uintptr_t stream) {
  const flare_tensor tq = to_flare_tensor(q, "q"), tk = to_flare_tensor(k, "k"),
                     tv = to_flare_tensor(v, "v"), to = to_flare_tensor(o, "o", true),
                     tl = to_flare_tensor(lse, "lse", true);
  flare_fp8_descale ds{};
  ds.q_descale = to_flare_tensor(q_descale, "q_descale", false, true);
  ds.k_descale = to_flare_tensor(k_descale, "k_descale", false, true);
  ds.v_descale = to_flare_tensor(v_descale, "v_descale", false, true);
  ds.block_rows = block_rows;
  const CallArgs a = make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, 0.0f, 0, 0, false, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_attention_forward_fp8(&tq, &tk, &tv, &to, &tl, &ds, &a.options,
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

// ---- context parallelism (flare/dist.h through the C ABI) ----------------------------------------
// A communicator and a plan are Python objects that own their C handles. Every collective call
// releases the GIL: the ranks of an in-process group are Python threads of this interpreter, and
// each waits inside the call for the others.

// One rank's communicator. A plan made on it holds a reference to it, so it outlives its plans;
// close() refuses while any plan is open.
struct Comm {
  flare_comm* handle = nullptr;
  int open_plans = 0;

  explicit Comm(flare_comm* h) : handle(h) {}
  ~Comm() { flare_comm_destroy(handle); }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  flare_comm* get() const {
    if (handle == nullptr) raise(PyExc_ValueError, "comm: the communicator is closed");
    return handle;
  }
  void close() {
    if (open_plans > 0)
      raise(PyExc_RuntimeError, "comm: " + std::to_string(open_plans) +
                                    " context-parallel plan(s) still use this communicator; "
                                    "close them first");
    flare_comm_destroy(handle);
    handle = nullptr;
  }
  nb::dict info() const {
    flare_comm_info i;
    check(flare_comm_get_info(get(), &i));
    nb::dict d;
    d["rank"] = i.rank;
    d["size"] = i.size;
    d["device"] = i.device == FLARE_CUDA ? "cuda" : "cpu";
    d["device_index"] = i.device_index;
    d["timeout_ms"] = i.timeout_ms;
    d["kind"] = std::string(i.kind);
    return d;
  }
  void barrier() {
    flare_comm* c = get();
    int code;
    {
      nb::gil_scoped_release release;
      code = flare_comm_barrier(c);
    }
    check(code);
  }
  void health() { check(flare_comm_health(get())); }
};

nb::list make_in_process_group(int size, int timeout_ms) {
  if (size < 1) raise(PyExc_ValueError, "world_size: " + std::to_string(size) + " must be >= 1");
  std::vector<flare_comm*> handles(static_cast<size_t>(size), nullptr);
  check(flare_comm_create_in_process_group(size, timeout_ms, handles.data()));
  nb::list out;
  for (flare_comm* h : handles) out.append(nb::cast(new Comm(h), nb::rv_policy::take_ownership));
  return out;
}

nb::bytes make_nccl_unique_id() {
  flare_nccl_id id;
  check(flare_nccl_unique_id(&id));
  return nb::bytes(reinterpret_cast<const char*>(id.bytes), sizeof id.bytes);
}

Comm* make_nccl_comm(nb::bytes id, int rank, int size, int device, int timeout_ms) {
  if (id.size() != sizeof(flare_nccl_id::bytes))
    raise(PyExc_ValueError, "nccl_id: expected " + std::to_string(sizeof(flare_nccl_id::bytes)) +
                                " bytes, got " + std::to_string(id.size()));
  flare_nccl_id nid;
  std::memcpy(nid.bytes, id.c_str(), sizeof nid.bytes);
  flare_comm* h = nullptr;
  int code;
  {
    nb::gil_scoped_release release;  // collective: waits for every rank to join
    code = flare_comm_create_nccl(&nid, rank, size, device, timeout_ms, &h);
  }
  check(code);
  return new Comm(h);
}

nb::dict launch_dict(const flare_launch_info& i) {
  nb::dict d;
  d["rank"] = i.rank;
  d["size"] = i.size;
  d["local_rank"] = i.local_rank;
  d["master_addr"] = std::string(i.master_addr);
  d["master_port"] = i.master_port;
  d["source"] = std::string(i.source);
  return d;
}

nb::tuple make_nccl_comm_from_env(int timeout_ms) {
  flare_comm* h = nullptr;
  flare_launch_info info{};
  int code;
  {
    nb::gil_scoped_release release;  // rendezvous and creation wait for every rank
    code = flare_comm_create_nccl_from_env(timeout_ms, &h, &info);
  }
  check(code);
  return nb::make_tuple(nb::cast(new Comm(h), nb::rv_policy::take_ownership), launch_dict(info));
}

Comm* adopt_nccl_comm(uintptr_t nccl_comm, bool take_ownership, int timeout_ms) {
  flare_comm* h = nullptr;
  check(flare_comm_adopt_nccl(reinterpret_cast<void*>(nccl_comm), take_ownership ? 1 : 0,
                              timeout_ms, &h));
  return new Comm(h);
}

nb::dict launch_info_from_env() {
  flare_launch_info info{};
  check(flare_launch_info_from_env(&info));
  return launch_dict(info);
}

nb::list shard_chunks(const flare_sequence_shard& s) {
  nb::list chunks;
  for (int i = 0; i < s.count; ++i)
    chunks.append(nb::make_tuple(s.chunk[i].global_begin, s.chunk[i].local_begin,
                                 s.chunk[i].length));
  return chunks;
}

// The rows rank `rank` holds: a list of (global_begin, local_begin, length) in local order.
nb::list sequence_shard(int strategy, int64_t seqlen, int size, int rank) {
  flare_sequence_shard s;
  check(flare_get_sequence_shard(strategy, seqlen, size, rank, &s));
  return shard_chunks(s);
}

// A context-parallel plan on one rank's communicator.
struct Plan {
  flare_cp* handle = nullptr;
  nb::object comm;       // keeps the communicator alive
  Comm* owner = nullptr;  // the same object, whose open_plans counts this plan

  Plan(flare_cp* h, nb::object c) : handle(h), comm(std::move(c)), owner(&nb::cast<Comm&>(comm)) {
    owner->open_plans += 1;
  }
  ~Plan() { close(); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  flare_cp* get() const {
    if (handle == nullptr) raise(PyExc_ValueError, "plan: the context-parallel plan is closed");
    return handle;
  }
  void close() {
    if (handle == nullptr) return;
    flare_cp_destroy(handle);
    handle = nullptr;
    owner->open_plans -= 1;
  }
  nb::list shard() const {
    flare_sequence_shard s;
    check(flare_cp_get_shard(get(), &s));
    return shard_chunks(s);
  }
  void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle o, nb::handle lse,
               uintptr_t stream) {
    const flare_tensor tq = to_flare_tensor(q, "q"), tk = to_flare_tensor(k, "k"),
                       tv = to_flare_tensor(v, "v"), to = to_flare_tensor(o, "o", true),
                       tl = to_flare_tensor(lse, "lse", true);
    flare_cp* cp = get();
    int code;
    {
      nb::gil_scoped_release release;
      code = flare_cp_forward(cp, &tq, &tk, &tv, &to, &tl, reinterpret_cast<void*>(stream));
    }
    check(code);
  }
  void backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle o,
                nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv, uintptr_t stream) {
    const flare_tensor tdo = to_flare_tensor(dout, "dout"), tq = to_flare_tensor(q, "q"),
                       tk = to_flare_tensor(k, "k"), tv = to_flare_tensor(v, "v"),
                       to = to_flare_tensor(o, "o"), tl = to_flare_tensor(lse, "lse"),
                       tdq = to_flare_tensor(dq, "dq", true),
                       tdk = to_flare_tensor(dk, "dk", true),
                       tdv = to_flare_tensor(dv, "dv", true);
    flare_cp* cp = get();
    int code;
    {
      nb::gil_scoped_release release;
      code = flare_cp_backward(cp, &tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv,
                               reinterpret_cast<void*>(stream));
    }
    check(code);
  }
  void set_timing(bool on) { check(flare_cp_set_timing(get(), on ? 1 : 0)); }
  nb::dict take_timing() {
    flare_cp_timing t;
    flare_cp* cp = get();
    int code;
    {
      nb::gil_scoped_release release;  // waits for the recorded events on a CUDA device
      code = flare_cp_take_timing(cp, &t);
    }
    check(code);
    nb::dict d;
    d["calls"] = t.calls;
    d["exchanges"] = t.exchanges;
    d["bytes_sent"] = t.bytes_sent;
    d["comm_ms"] = t.comm_ms;
    d["compute_ms"] = t.compute_ms;
    return d;
  }
};

Plan* make_plan(nb::object comm, int strategy, int batch, int64_t seqlen, int heads_q,
                int heads_kv, int head_dim, int dtype, float softmax_scale, bool causal,
                int window_left, int window_right, float softcap, bool deterministic,
                int backend, const std::vector<int32_t>& cu_seqlens) {
  flare_cp_config c = flare_default_cp_config();
  c.strategy = strategy;
  c.batch = batch;
  c.seqlen = seqlen;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.head_dim = head_dim;
  c.dtype = dtype;
  c.attention.softmax_scale = softmax_scale;
  c.attention.causal = causal ? 1 : 0;
  c.attention.window_left = window_left;
  c.attention.window_right = window_right;
  c.attention.softcap = softcap;
  c.attention.deterministic = deterministic ? 1 : 0;
  c.attention.backend = backend;
  // A packed batch: the global pack's offsets, copied by flare_cp_create (empty: fixed length).
  c.cu_seqlens = cu_seqlens.empty() ? nullptr : cu_seqlens.data();
  c.num_cu_seqlens = static_cast<int32_t>(cu_seqlens.size());
  flare_comm* h = nb::cast<Comm&>(comm).get();
  flare_cp* cp = nullptr;
  int code;
  {
    nb::gil_scoped_release release;  // collective: gathers every rank's config
    code = flare_cp_create(h, &c, &cp);
  }
  check(code);
  return new Plan(cp, std::move(comm));
}

// KV-cache decoding (flare_attention_with_kvcache): the caches are written in place when k_new
// is given, so they are taken as writable outputs; lse may be None.
void kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle k_new,
             nb::handle v_new, nb::handle block_table, nb::handle cache_seqlens,
             int cache_seqlen, nb::handle cache_batch_idx, nb::handle rotary_cos,
             nb::handle rotary_sin, bool rotary_interleaved, int num_splits, nb::handle o,
             nb::handle lse, float softmax_scale, bool causal, int window_left,
             int window_right, float softcap, nb::handle alibi_slopes, int backend,
             uintptr_t stream) {
  const flare_tensor tq = to_flare_tensor(q, "q"), to = to_flare_tensor(o, "o", true),
                     tl = to_flare_tensor(lse, "lse", true, true);
  flare_kvcache_args c{};
  const bool appends = !k_new.is_none();
  c.k_cache = to_flare_tensor(k_cache, "k_cache", appends);
  c.v_cache = to_flare_tensor(v_cache, "v_cache", appends);
  c.k_new = to_flare_tensor(k_new, "k", false, true);
  c.v_new = to_flare_tensor(v_new, "v", false, true);
  c.block_table = to_flare_tensor(block_table, "block_table", false, true);
  c.cache_seqlens = to_flare_tensor(cache_seqlens, "cache_seqlens", false, true);
  c.cache_seqlen = cache_seqlen;
  c.cache_batch_idx = to_flare_tensor(cache_batch_idx, "cache_batch_idx", false, true);
  c.rotary_cos = to_flare_tensor(rotary_cos, "rotary_cos", false, true);
  c.rotary_sin = to_flare_tensor(rotary_sin, "rotary_sin", false, true);
  c.rotary_interleaved = rotary_interleaved ? 1 : 0;
  c.num_splits = num_splits;
  const CallArgs a = make_args(nb::none(), nb::none(), 0, 0, softmax_scale, causal, window_left,
                               window_right, softcap, alibi_slopes, 0.0f, 0, 0, false, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_attention_with_kvcache(&tq, &c, &to, lse.is_none() ? nullptr : &tl, &a.options,
                                        reinterpret_cast<void*>(stream));
  }
  check(code);
}

// ---- block-sparse attention (flare_block_sparse_attention_*) -----------------------------------
// forward()'s and backward()'s arguments plus the block mask and its block sizes, which follow the
// outputs as in the C ABI. The mask is an input (uint8 or int32; flare/_core.py views bool masks
// as uint8).

flare_block_mask make_block_mask(nb::handle mask, int block_m, int block_n) {
  flare_block_mask m{};
  m.mask = to_flare_tensor(mask, "block_mask");
  m.block_m = block_m;
  m.block_n = block_n;
  return m;
}

void block_sparse_forward(nb::handle q, nb::handle k, nb::handle v, nb::handle o, nb::handle lse,
                          nb::handle mask, int block_m, int block_n, nb::handle cu_seqlens_q,
                          nb::handle cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
                          float softmax_scale, bool causal, int window_left, int window_right,
                          float softcap, nb::handle alibi_slopes, float dropout_p, uint64_t seed,
                          uint64_t offset, bool deterministic, int backend, uintptr_t stream) {
  const flare_tensor tq = to_flare_tensor(q, "q"), tk = to_flare_tensor(k, "k"),
                     tv = to_flare_tensor(v, "v"), to = to_flare_tensor(o, "o", true),
                     tl = to_flare_tensor(lse, "lse", true);
  const flare_block_mask m = make_block_mask(mask, block_m, block_n);
  const CallArgs a = make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, seed, offset, deterministic, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_block_sparse_attention_forward(&tq, &tk, &tv, &to, &tl, &m, &a.options,
                                                a.is_varlen ? &a.varlen : nullptr,
                                                reinterpret_cast<void*>(stream));
  }
  check(code);
}

void block_sparse_backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v,
                           nb::handle o, nb::handle lse, nb::handle dq, nb::handle dk,
                           nb::handle dv, nb::handle mask, int block_m, int block_n,
                           nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int max_seqlen_q,
                           int max_seqlen_k, float softmax_scale, bool causal, int window_left,
                           int window_right, float softcap, nb::handle alibi_slopes,
                           float dropout_p, uint64_t seed, uint64_t offset, bool deterministic,
                           int backend, uintptr_t stream) {
  const flare_tensor tdo = to_flare_tensor(dout, "dout"), tq = to_flare_tensor(q, "q"),
                     tk = to_flare_tensor(k, "k"), tv = to_flare_tensor(v, "v"),
                     to = to_flare_tensor(o, "o"), tl = to_flare_tensor(lse, "lse"),
                     tdq = to_flare_tensor(dq, "dq", true), tdk = to_flare_tensor(dk, "dk", true),
                     tdv = to_flare_tensor(dv, "dv", true);
  const flare_block_mask m = make_block_mask(mask, block_m, block_n);
  const CallArgs a = make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, seed, offset, deterministic, backend);
  int code;
  {
    nb::gil_scoped_release release;
    code = flare_block_sparse_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv,
                                                 &m, &a.options,
                                                 a.is_varlen ? &a.varlen : nullptr,
                                                 reinterpret_cast<void*>(stream));
  }
  check(code);
}

// A pattern helper's row-major (row_blocks, col_blocks) mask as bytes. Only sizes the library
// can be asked for (at most 2^31 blocks) get a buffer; others get none, and the library's
// message says what is wrong with them.
template <typename Pattern>
nb::bytes pattern_mask(int64_t row_blocks, int64_t col_blocks, Pattern pattern) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 31;
  const bool sized = row_blocks >= 0 && col_blocks >= 0 &&
                     (col_blocks == 0 || row_blocks <= kMaxBlocks / col_blocks);
  std::string mask(sized ? static_cast<size_t>(row_blocks * col_blocks) : 0, '\0');
  check(pattern(reinterpret_cast<uint8_t*>(mask.data()), static_cast<int64_t>(mask.size())));
  return nb::bytes(mask.data(), mask.size());
}

// flare's dtype code of a tensor argument (float32, float16, bfloat16, int32).
int dtype_code(nb::handle x, const char* name) { return to_flare_tensor(x, name).dtype; }

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flare's C ABI over PyTorch tensors and DLPack arrays (see flare/_core.py for the Python interface)";

  // The address of the C ABI table that the torch operators library (flare_torch_ops.cpp) is
  // bound to: it calls this module's copy of flare.
  m.def("c_api_table", [] {
    static const flare_c_api_table table{&flare_default_options,
                                         &flare_attention_forward,
                                         &flare_attention_backward,
                                         &flare_block_sparse_attention_forward,
                                         &flare_block_sparse_attention_backward,
                                         &flare_last_error};
    return reinterpret_cast<uintptr_t>(&table);
  });

  m.def("forward", &forward, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "Writes o and lse. Raises ValueError / NotImplementedError / RuntimeError / MemoryError "
        "with the library's message on failure; nothing is written then.");

  m.def("forward_fp8", &forward_fp8, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(),
        nb::arg("q_descale").none(), nb::arg("k_descale").none(), nb::arg("v_descale").none(),
        nb::arg("block_rows"), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("backend"), nb::arg("stream"),
        "float8_e4m3 q, k, v with descales (attention_forward_fp8): writes o and lse. Errors as "
        "for forward().");

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

  m.def("kvcache", &kvcache, nb::arg("q").none(), nb::arg("k_cache").none(),
        nb::arg("v_cache").none(), nb::arg("k_new").none(), nb::arg("v_new").none(),
        nb::arg("block_table").none(), nb::arg("cache_seqlens").none(), nb::arg("cache_seqlen"),
        nb::arg("cache_batch_idx").none(), nb::arg("rotary_cos").none(),
        nb::arg("rotary_sin").none(), nb::arg("rotary_interleaved"), nb::arg("num_splits"),
        nb::arg("o").none(), nb::arg("lse").none(), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("backend"), nb::arg("stream"),
        "Appends k / v to the cache (if given) and writes o and lse (if not None). Errors as for "
        "forward(); nothing is written then.");

  m.def("block_sparse_forward", &block_sparse_forward, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(),
        nb::arg("block_mask").none(), nb::arg("block_m"), nb::arg("block_n"),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "forward() with a block mask at block_m x block_n. Errors as for forward().");

  m.def("block_sparse_backward", &block_sparse_backward, nb::arg("dout").none(),
        nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(), nb::arg("o").none(),
        nb::arg("lse").none(), nb::arg("dq").none(), nb::arg("dk").none(),
        nb::arg("dv").none(), nb::arg("block_mask").none(), nb::arg("block_m"),
        nb::arg("block_n"), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("dropout_p"), nb::arg("seed"),
        nb::arg("offset"), nb::arg("deterministic"), nb::arg("backend"), nb::arg("stream"),
        "backward() with the forward's block mask. Errors as for forward().");

  m.def(
      "local_global_block_mask",
      [](int64_t row_blocks, int64_t col_blocks, int64_t band, int64_t global) {
        return pattern_mask(row_blocks, col_blocks, [&](uint8_t* mask, int64_t capacity) {
          return flare_local_global_block_mask(row_blocks, col_blocks, band, global, mask,
                                               capacity);
        });
      },
      nb::arg("row_blocks"), nb::arg("col_blocks"), nb::arg("band"), nb::arg("global_blocks"),
      "The local + global pattern, row-major uint8 bytes.");
  m.def(
      "butterfly_block_mask",
      [](int64_t row_blocks, int64_t col_blocks) {
        return pattern_mask(row_blocks, col_blocks, [&](uint8_t* mask, int64_t capacity) {
          return flare_butterfly_block_mask(row_blocks, col_blocks, mask, capacity);
        });
      },
      nb::arg("row_blocks"), nb::arg("col_blocks"), "The butterfly pattern, row-major uint8 bytes.");

  m.def("version", [] { return std::string(flare_version()); });
  m.def("cuda_built", [] { return flare_cuda_built() != 0; });

  m.def("dtype_code", [](nb::handle x, const std::string& name) { return dtype_code(x, name.c_str()); },
        nb::arg("x").none(), nb::arg("name"));
  m.attr("FLOAT32") = static_cast<int>(FLARE_FLOAT32);
  m.attr("FLOAT16") = static_cast<int>(FLARE_FLOAT16);
  m.attr("BFLOAT16") = static_cast<int>(FLARE_BFLOAT16);

  // Context parallelism (flare/dist.py is the Python interface).
  m.def("nccl_built", [] { return flare_nccl_built() != 0; });
  m.def("nccl_unique_id", &make_nccl_unique_id);
  m.def("launch_info_from_env", &launch_info_from_env);
  m.def("sequence_shard", &sequence_shard, nb::arg("strategy"), nb::arg("seqlen"),
        nb::arg("size"), nb::arg("rank"));
  nb::class_<Comm>(m, "Comm")
      .def("info", &Comm::info)
      .def("barrier", &Comm::barrier)
      .def("health", &Comm::health)
      .def("close", &Comm::close)
      .def_prop_ro("closed", [](const Comm& c) { return c.handle == nullptr; });
  m.def("in_process_group", &make_in_process_group, nb::arg("size"), nb::arg("timeout_ms"));
  m.def("nccl_comm", &make_nccl_comm, nb::arg("nccl_id"), nb::arg("rank"), nb::arg("size"),
        nb::arg("device"), nb::arg("timeout_ms"), nb::rv_policy::take_ownership);
  m.def("nccl_comm_from_env", &make_nccl_comm_from_env, nb::arg("timeout_ms"));
  m.def("adopt_nccl_comm", &adopt_nccl_comm, nb::arg("nccl_comm"), nb::arg("take_ownership"),
        nb::arg("timeout_ms"), nb::rv_policy::take_ownership);
  nb::class_<Plan>(m, "Plan")
      .def("shard", &Plan::shard)
      .def("forward", &Plan::forward, nb::arg("q").none(), nb::arg("k").none(),
           nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(), nb::arg("stream"))
      .def("backward", &Plan::backward, nb::arg("dout").none(), nb::arg("q").none(),
           nb::arg("k").none(), nb::arg("v").none(), nb::arg("o").none(), nb::arg("lse").none(),
           nb::arg("dq").none(), nb::arg("dk").none(), nb::arg("dv").none(), nb::arg("stream"))
      .def("set_timing", &Plan::set_timing)
      .def("take_timing", &Plan::take_timing)
      .def("close", &Plan::close)
      .def_prop_ro("closed", [](const Plan& p) { return p.handle == nullptr; });
  m.def("plan", &make_plan, nb::arg("comm"), nb::arg("strategy"), nb::arg("batch"),
        nb::arg("seqlen"), nb::arg("heads_q"), nb::arg("heads_kv"), nb::arg("head_dim"),
        nb::arg("dtype"), nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("deterministic"),
        nb::arg("backend"), nb::arg("cu_seqlens"), nb::rv_policy::take_ownership);

  m.attr("BACKEND_AUTO") = static_cast<int>(FLARE_BACKEND_AUTO);
  m.attr("BACKEND_REFERENCE") = static_cast<int>(FLARE_BACKEND_REFERENCE);
  m.attr("BACKEND_FLASH") = static_cast<int>(FLARE_BACKEND_FLASH);
}
