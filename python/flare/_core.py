"""Framework-neutral calls into flare: arrays in, arrays of the caller's framework out.

The compiled module (flare._ext) reads any DLPack tensor but allocates nothing. This file
checks every argument (a bad one raises TypeError or ValueError whose message starts with its
name), allocates the outputs in the caller's framework (torch.empty for PyTorch, numpy.empty for
NumPy, cupy.empty for CuPy), picks the stream (the caller's current stream for PyTorch and CuPy,
or an explicit ``stream=``), and calls forward / backward. It does not import torch: PyTorch
tensors are recognised through ``sys.modules``, so NumPy-only installs work without it.

attention_forward / attention_backward are the plain (no autograd) entry points, and
block_sparse_attention_forward / _backward their block-sparse forms (with the mask patterns
local_global_block_mask and butterfly_block_mask); the flash_attn-compatible functions in
flare/interface.py and the torch custom ops in flare/_torch.py are built on the same helpers.

JAX arrays are accepted on the CPU: they are read through NumPy without a copy and the results
come back as JAX arrays. JAX arrays on a GPU are refused (JAX buffers are immutable, so flare
cannot write its outputs into them); pass torch or CuPy arrays there.
"""

import contextlib
import numbers
import sys

from . import _ext

_BACKENDS = {
    "auto": _ext.BACKEND_AUTO,
    "reference": _ext.BACKEND_REFERENCE,
    "flash": _ext.BACKEND_FLASH,
}

_UINT64 = (1 << 64) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1

# Dropout seeds are drawn below 2**62 so they survive a trip through int64 tensors unchanged.
_SEED_LIMIT = 1 << 62


# ---- argument checks: each bad argument raises TypeError (wrong kind of value) or ValueError
# (right kind, wrong value) with a message that starts with the argument's name ----------------

def describe(value):
    """A value's type for messages: "None", "list", "numpy.ndarray", "torch.Tensor"."""
    if value is None:
        return "None"
    t = type(value)
    module = t.__module__.split(".", 1)[0]
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


# Each check tests the common exact type first: an isinstance against the numbers ABCs costs
# about a microsecond, which the torch path pays on every call.

def flag(value, name):
    """A bool argument: True / False, NumPy's bool, or the integers 0 and 1."""
    if value is True or value is False:
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {describe(value)}")


def real(value, name):
    """A float argument: any real number (int, float, NumPy scalar), not a bool."""
    if type(value) is float:
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name}: expected a real number, got {describe(value)}")


def integer(value, name, low=_INT32_MIN, high=_INT32_MAX):
    """An int argument within [low, high] (by default the C ABI's int32), not a bool."""
    if type(value) is int and low <= value <= high:
        return value
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {describe(value)}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is outside [{low}, {high}]")
    return value


def backend_code(backend):
    """Maps "auto" | "reference" | "flash" (or the integer code) to the C ABI's code."""
    if isinstance(backend, str):
        try:
            return _BACKENDS[backend]
        except KeyError:
            raise ValueError(
                f"backend: {backend!r} is not one of {sorted(_BACKENDS)}") from None
    if isinstance(backend, numbers.Integral) and not isinstance(backend, bool):
        return integer(backend, "backend")  # the library names an unknown code
    raise TypeError(f"backend: expected one of {sorted(_BACKENDS)}, got {describe(backend)}")


def window_pair(window_size):
    """flash_attn's window_size=(left, right) → two ints; -1 means unbounded (the library checks
    the values; here only that they are ints that fit its int32)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected a pair (left, right), got {window_size!r}") from None
    return integer(left, "window_size[0]"), integer(right, "window_size[1]")


def scale_value(softmax_scale):
    """None → 0.0, which the library reads as 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 0.0
    scale = real(softmax_scale, "softmax_scale")
    if scale == 0.0:
        # 0 means "default" to the C ABI; a caller who wrote 0 meant something else.
        raise ValueError("softmax_scale: must be finite and > 0, got 0.0")
    return scale


def seed_pair(seed, offset):
    """Seeds are uint64 to the library; accept any Python int (negative ones wrap)."""
    for value, name in ((seed, "seed"), (offset, "offset")):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int, got {describe(value)}")
    return int(seed) & _UINT64, int(offset) & _UINT64


def max_seqlen_value(value, name):
    """max_seqlen_q / max_seqlen_k: None (read off CPU cu_seqlens) or an int in [0, 2**31)."""
    return None if value is None else integer(value, name, 0, _INT32_MAX)


def stream_value(stream):
    """None (the framework's current stream) or a cudaStream_t as an integer."""
    if stream is None:
        return None
    return integer(stream, "stream", 0, _UINT64)


class Options:
    """The scalar options every entry point shares, checked and converted once: the values the
    C ABI takes (softmax_scale 0.0 for the default, the backend's code)."""

    __slots__ = ("softmax_scale", "causal", "window_left", "window_right", "softcap",
                 "dropout_p", "deterministic", "backend")

    def __init__(self, *, softmax_scale, causal, window_size, softcap, dropout_p, deterministic,
                 backend):
        # Plain Python values take the inline tests; anything else goes through the checks.
        # Both give the same result: the split only keeps the common call cheap.
        self.softmax_scale = (0.0 if softmax_scale is None else
                              softmax_scale if type(softmax_scale) is float and softmax_scale > 0
                              else scale_value(softmax_scale))
        self.causal = causal if causal is True or causal is False else flag(causal, "causal")
        if (type(window_size) is tuple and len(window_size) == 2
                and type(window_size[0]) is int and type(window_size[1]) is int
                and _INT32_MIN <= window_size[0] <= _INT32_MAX
                and _INT32_MIN <= window_size[1] <= _INT32_MAX):
            self.window_left, self.window_right = window_size
        else:
            self.window_left, self.window_right = window_pair(window_size)
        self.softcap = softcap if type(softcap) is float else real(softcap, "softcap")
        self.dropout_p = dropout_p if type(dropout_p) is float else real(dropout_p, "dropout_p")
        self.deterministic = (deterministic if deterministic is True or deterministic is False
                              else flag(deterministic, "deterministic"))
        self.backend = _BACKENDS.get(backend) if type(backend) is str else None
        if self.backend is None:
            self.backend = backend_code(backend)


class BlockMask:
    """A block-sparse call's mask with its block sizes (ints >= 1; the library checks the mask
    itself: dtype, rank, shape against the block sizes, device)."""

    __slots__ = ("mask", "block_m", "block_n")

    def __init__(self, mask, block_size_q, block_size_k):
        self.mask = mask
        self.block_m = integer(block_size_q, "block_size_q", 1)
        self.block_n = integer(block_size_k, "block_size_k", 1)


def block_mask_view(mask):
    """The mask as the library reads it: a bool mask becomes a uint8 view of the same bytes (0 / 1,
    no copy); uint8 and int32 masks pass unchanged, any other dtype is the library's to name."""
    if is_torch(mask):
        torch = sys.modules["torch"]
        return mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    return mask.view("uint8") if mask.dtype.kind == "b" else mask


# ---- framework detection -----------------------------------------------------------------------

def is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _module_of(x):
    return type(x).__module__.split(".", 1)[0]


def _is_cupy(x):
    return _module_of(x) == "cupy"


def _is_jax(x):
    return _module_of(x) in ("jax", "jaxlib")


def _numpy():
    import numpy
    return numpy


def array_group(x):
    """Which framework a call with this array runs in: "torch", "cupy", or "numpy" (NumPy
    arrays, JAX arrays on the CPU and any other DLPack object, all read through NumPy); None for
    what is not an array (None, lists, Python scalars)."""
    if is_torch(x):
        return "torch"
    if _is_cupy(x):
        return "cupy"
    if isinstance(x, _numpy().ndarray) or hasattr(x, "__dlpack__"):
        return "numpy"
    return None


_GROUP_NAMES = {"torch": "a torch tensor", "cupy": "a CuPy array",
                "numpy": "a NumPy (or CPU DLPack) array"}


def check_arrays(required, optional=()):
    """Checks the array arguments of one call: each (name, value) in `required` is an array,
    each in `optional` an array or None, and all come from the first one's framework. Returns
    that framework's group (array_group)."""
    first_name, first = required[0]
    group = array_group(first)
    if group is None:
        _not_an_array(first_name, first, False)
    for name, value in required[1:]:
        if type(value) is not type(first) and array_group(value) != group:
            _wrong_array(name, value, group, first_name)
    for name, value in optional:
        if value is not None and type(value) is not type(first) and array_group(value) != group:
            _wrong_array(name, value, group, first_name, optional=True)
    return group


def _not_an_array(name, value, optional):
    wanted = "a tensor or array" + (", or None" if optional else "")
    raise TypeError(f"{name}: expected {wanted} (torch, NumPy, CuPy, JAX or any DLPack object), "
                    f"got {describe(value)}")


def _wrong_array(name, value, group, first_name, optional=False):
    if array_group(value) is None:
        _not_an_array(name, value, optional)
    raise TypeError(f"{name}: {describe(value)} is not {_GROUP_NAMES[group]} like {first_name}; "
                    f"pass all arrays of a call from one framework")


def _jax_to_numpy(x):
    devices = {d.platform for d in x.devices()} if hasattr(x, "devices") else {"cpu"}
    if devices != {"cpu"}:
        raise NotImplementedError(
            "JAX arrays on a GPU are not supported: JAX buffers are immutable, so flare cannot "
            "write into them; pass torch or CuPy arrays, or JAX arrays on the CPU")
    return _numpy().asarray(x)


def _from_jax(arrays):
    """NumPy views of the JAX (CPU) arrays among `arrays`, without copies; other values pass."""
    return [_jax_to_numpy(a) if _is_jax(a) else a for a in arrays]


def _to_jax(arrays):
    import jax.numpy as jnp
    return tuple(jnp.asarray(a) for a in arrays)


def draw_seed(group):
    """A fresh dropout seed from the caller's framework's default generator: torch's
    (torch.manual_seed reproduces it) for torch tensors, NumPy's global one (numpy.random.seed
    reproduces it; seeded from the OS otherwise) for everything else."""
    if group == "torch":
        import torch
        return int(torch.randint(0, _SEED_LIMIT, (1,), dtype=torch.int64))
    np = _numpy()
    return int(np.random.randint(0, _SEED_LIMIT, dtype=np.int64))


# ---- arrays ------------------------------------------------------------------------------------

class _Frame:
    """How to allocate and synchronise for one call's framework."""

    def __init__(self, group, like, stream):
        self.kind = group
        if group == "torch":
            import torch
            self.xp = torch
            self.device = like.device
            if stream is None:
                stream = (torch.cuda.current_stream(like.device).cuda_stream
                          if like.is_cuda else 0)
        elif group == "cupy":
            import cupy
            self.xp = cupy
            self.device = like.device
            if stream is None:
                stream = cupy.cuda.get_current_stream().ptr
        else:
            self.xp = _numpy()
            self.device = None
            stream = 0 if stream is None else stream
        self.stream = int(stream)

    def empty(self, shape, dtype):
        if self.kind == "torch":
            return self.xp.empty(tuple(shape), dtype=dtype, device=self.device)
        if self.kind == "cupy":
            with self.device:
                return self.xp.empty(tuple(shape), dtype=dtype)
        return self.xp.empty(tuple(shape), dtype=dtype)

    def float32(self):
        return self.xp.float32

    def device_guard(self):
        """CUDA launches go to the current device: make it the arrays' device."""
        if self.kind == "torch" and self.device.type == "cuda":
            return self.xp.cuda.device(self.device)
        if self.kind == "cupy":
            return self.device
        return contextlib.nullcontext()

    def prepare(self, x):
        """A view the library accepts: unit last stride, non-negative strides, no autograd.
        An empty array needs only non-negative strides: no element is addressed, so the
        library takes any others (NumPy 2 gives empty arrays all-zero strides)."""
        if x is None:
            return None
        if self.kind == "torch":  # torch strides are never negative
            x = x.detach()
            if x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1 and x.numel() > 0:
                x = x.contiguous()
            return x
        if self.kind == "numpy" and not isinstance(x, self.xp.ndarray):
            x = self.xp.from_dlpack(x)
        itemsize = x.dtype.itemsize
        strides = x.strides
        if x.size == 0:
            # ascontiguousarray keeps an empty view as it is (NumPy flags it contiguous), so a
            # negative stride needs a fresh empty array: there is no data to copy.
            return x if all(s >= 0 for s in strides) else self.empty(x.shape, x.dtype)
        if x.ndim > 0 and ((x.shape[-1] > 1 and strides[-1] != itemsize)
                           or any(s < 0 or s % itemsize for s in strides)):
            x = self.xp.ascontiguousarray(x)
        return x


def lse_shape(q, is_varlen):
    """(b, h, s_q) or (h, total_q); a dummy shape when q's rank is wrong (the library then
    reports q's rank, which it checks before lse)."""
    shape = tuple(q.shape)
    if is_varlen:
        return (shape[1], shape[0]) if len(shape) == 3 else (1,)
    return (shape[0], shape[2], shape[1]) if len(shape) == 4 else (1,)


def _max_seqlen(cu_seqlens, given, name):
    given = max_seqlen_value(given, name)
    if given is not None:
        return given
    if cu_seqlens is None:
        return 0
    if (is_torch(cu_seqlens) and cu_seqlens.is_cuda) or _is_cupy(cu_seqlens):
        raise ValueError(f"{name}: required with CUDA cu_seqlens (reading them would synchronise)")
    np = _numpy()
    c = cu_seqlens.detach().numpy() if is_torch(cu_seqlens) else np.asarray(cu_seqlens)
    return int(np.max(np.diff(c))) if c.ndim == 1 and c.size > 1 else 0


class _Call:
    """The arguments forward and backward share, normalised once. seed and offset are the
    (uint64) pair the library gets; drawing or requiring a seed is the caller's business."""

    def __init__(self, *, options, alibi_slopes, seed, offset, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, block_mask=None):
        self.options = options
        self.block_mask = block_mask  # a BlockMask: the call is block-sparse
        self.alibi_slopes = alibi_slopes
        self.seed, self.offset = seed_pair(seed, offset)
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k
        self.is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self.max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        self.max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")

    def kwargs(self, frame):
        o = self.options
        return dict(
            cu_seqlens_q=frame.prepare(self.cu_seqlens_q),
            cu_seqlens_k=frame.prepare(self.cu_seqlens_k),
            max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            softmax_scale=o.softmax_scale, causal=o.causal,
            window_left=o.window_left, window_right=o.window_right,
            softcap=o.softcap, alibi_slopes=frame.prepare(self.alibi_slopes),
            dropout_p=o.dropout_p, seed=self.seed, offset=self.offset,
            deterministic=o.deterministic, backend=o.backend, stream=frame.stream)

    def block_mask_args(self, frame):
        """The mask and its block sizes, as the extension's block-sparse calls take them."""
        m = self.block_mask
        return block_mask_view(frame.prepare(m.mask)), m.block_m, m.block_n


def forward_into(frame, call, q, k, v):
    """Allocates o and lse in `frame`'s framework and runs the forward. Returns (o, lse)."""
    q, k, v = frame.prepare(q), frame.prepare(k), frame.prepare(v)
    o = frame.empty(q.shape, q.dtype)
    lse = frame.empty(lse_shape(q, call.is_varlen), frame.float32())
    with frame.device_guard():
        if call.block_mask is None:
            _ext.forward(q, k, v, o, lse, **call.kwargs(frame))
        else:
            _ext.block_sparse_forward(q, k, v, o, lse, *call.block_mask_args(frame),
                                      **call.kwargs(frame))
    return o, lse


def backward_into(frame, call, dout, q, k, v, o, lse):
    """Allocates dq, dk, dv like q, k, v and runs the backward. Returns (dq, dk, dv)."""
    dout, q, k, v, o, lse = (frame.prepare(t) for t in (dout, q, k, v, o, lse))
    dq = frame.empty(q.shape, q.dtype)
    dk = frame.empty(k.shape, k.dtype)
    dv = frame.empty(v.shape, v.dtype)
    with frame.device_guard():
        if call.block_mask is None:
            _ext.backward(dout, q, k, v, o, lse, dq, dk, dv, **call.kwargs(frame))
        else:
            _ext.block_sparse_backward(dout, q, k, v, o, lse, dq, dk, dv,
                                       *call.block_mask_args(frame), **call.kwargs(frame))
    return dq, dk, dv


# ---- public, no-autograd entry points ----------------------------------------------------------

def _forward(q, k, v, block_mask, *, softmax_scale, causal, window_size, softcap, alibi_slopes,
             dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             backend, stream, return_rng_state):
    """attention_forward, block-sparse where block_mask (a BlockMask) is given."""
    required = (("q", q), ("k", k), ("v", v))
    if block_mask is not None:
        required += (("block_mask", block_mask.mask),)
    group = check_arrays(required,
                         (("alibi_slopes", alibi_slopes), ("cu_seqlens_q", cu_seqlens_q),
                          ("cu_seqlens_k", cu_seqlens_k)))
    options = Options(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, deterministic=False,
                      backend=backend)
    return_rng_state = flag(return_rng_state, "return_rng_state")
    if seed is None:
        seed = draw_seed(group) if options.dropout_p > 0.0 else 0
    jax = _is_jax(q)
    q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k = _from_jax(
        (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k))
    if block_mask is not None:
        block_mask.mask = _from_jax((block_mask.mask,))[0]
    call = _Call(options=options, alibi_slopes=alibi_slopes, seed=seed, offset=offset,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_mask=block_mask)
    out, lse = forward_into(_Frame(group, q, stream_value(stream)), call, q, k, v)
    if jax:
        out, lse = _to_jax((out, lse))
    return (out, lse, (call.seed, call.offset)) if return_rng_state else (out, lse)


def _backward(dout, q, k, v, out, softmax_lse, block_mask, *, softmax_scale, causal,
              window_size, softcap, alibi_slopes, dropout_p, seed, offset, deterministic,
              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend, stream):
    """attention_backward, block-sparse where block_mask (a BlockMask) is given."""
    required = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                ("softmax_lse", softmax_lse))
    if block_mask is not None:
        required += (("block_mask", block_mask.mask),)
    group = check_arrays(required,
                         (("alibi_slopes", alibi_slopes), ("cu_seqlens_q", cu_seqlens_q),
                          ("cu_seqlens_k", cu_seqlens_k)))
    options = Options(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, deterministic=deterministic,
                      backend=backend)
    if seed is None:
        if options.dropout_p > 0.0:
            raise ValueError(
                "seed: required when dropout_p > 0: pass the seed and offset the forward used "
                "(attention_forward(..., return_rng_state=True) returns them)")
        seed = 0
    jax = _is_jax(q)
    dout, q, k, v, out, softmax_lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k = _from_jax(
        (dout, q, k, v, out, softmax_lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k))
    if block_mask is not None:
        block_mask.mask = _from_jax((block_mask.mask,))[0]
    call = _Call(options=options, alibi_slopes=alibi_slopes, seed=seed, offset=offset,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_mask=block_mask)
    grads = backward_into(_Frame(group, q, stream_value(stream)), call, dout, q, k, v, out,
                          softmax_lse)
    return _to_jax(grads) if jax else grads


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, backend="auto", stream=None, return_rng_state=False):
    """Exact attention forward: returns (out, softmax_lse), or (out, softmax_lse, rng_state)
    with return_rng_state=True.

    q (b, s_q, h, d), k / v (b, s_k, h_kv, d); or packed (total, h, d) with int32 cu_seqlens_q /
    cu_seqlens_k (batch + 1). out is like q (in q's framework); softmax_lse is float32
    (b, h, s_q), or (h, total_q) when packed.

    Dropout with probability dropout_p uses the counter-based mask keyed by (seed, offset).
    seed=None draws a fresh seed on every call (as flash_attn does): from torch's default
    generator for torch tensors (torch.manual_seed reproduces it), from numpy.random's global
    generator otherwise (numpy.random.seed reproduces it). rng_state is the pair (seed, offset)
    the call used, as Python ints: pass them to attention_backward to regenerate the mask.

    For CUDA arrays the work is queued on `stream` (an integer cudaStream_t), by default the
    framework's current stream (torch, CuPy). No autograd: see flash_attn_func for that.
    """
    return _forward(q, k, v, None, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, backend=backend, stream=stream,
                    return_rng_state=return_rng_state)


def attention_backward(dout, q, k, v, out, softmax_lse, *, softmax_scale=None, causal=False,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                       seed=None, offset=0, deterministic=False, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       backend="auto", stream=None):
    """Gradients of attention_forward: returns (dq, dk, dv), shaped and typed like q, k, v.

    out and softmax_lse are attention_forward's results for the same inputs and options. With
    dropout_p > 0, seed (required) and offset are the pair the forward used: its rng_state.
    """
    return _backward(dout, q, k, v, out, softmax_lse, None, softmax_scale=softmax_scale,
                     causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                     deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, backend=backend, stream=stream)


def attention_forward_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None,
                          block_rows=0, out_dtype=None, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, backend="auto", stream=None):
    """FP8 attention forward, as FlashAttention-3 offers it (forward only, no autograd): returns
    (out, softmax_lse).

    q, k, v are torch.float8_e4m3fn tensors, shaped as for attention_forward. Each element stands
    for its value times a float32 descale: q_descale, k_descale, v_descale of shape
    (b | 1, h | 1, blocks | 1) (a dimension of size 1 broadcasts; h is q's heads for q_descale,
    or k's, shared by a GQA group, and k's for the other two), so per tensor, per head or per
    block of `block_rows` rows, blocks = ceil(seqlen / block_rows) (packed: of max_seqlen).
    FlashAttention-3's (b, h) descales are taken as (b, h, 1); None is 1. out is out_dtype
    (torch.bfloat16 by default; float16 or float32), softmax_lse float32. CPU tensors run it
    (dequantized to float32 first); CUDA tensors raise NotImplementedError until the FP8 kernel
    exists.
    """
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    group = check_arrays((("q", q), ("k", k), ("v", v)),
                         descales + (("alibi_slopes", alibi_slopes),
                                     ("cu_seqlens_q", cu_seqlens_q),
                                     ("cu_seqlens_k", cu_seqlens_k)))
    if group != "torch":
        raise TypeError(f"q: attention_forward_fp8 takes torch tensors (torch.float8_e4m3fn), "
                        f"got {describe(q)}")
    torch = sys.modules["torch"]
    options = Options(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, dropout_p=0.0, deterministic=False, backend=backend)
    block_rows = integer(block_rows, "block_rows")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype: expected a torch.dtype, got {describe(out_dtype)}")
    q_descale, k_descale, v_descale = (
        x.unsqueeze(-1) if x is not None and x.dim() == 2 else x for _, x in descales)
    call = _Call(options=options, alibi_slopes=alibi_slopes, seed=0, offset=0,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    frame = _Frame(group, q, stream_value(stream))
    q, k, v = frame.prepare(q), frame.prepare(k), frame.prepare(v)
    out = frame.empty(q.shape, out_dtype)
    lse = frame.empty(lse_shape(q, call.is_varlen), frame.float32())
    kwargs = call.kwargs(frame)
    for name in ("dropout_p", "seed", "offset", "deterministic"):
        del kwargs[name]
    with frame.device_guard():
        _ext.forward_fp8(q, k, v, out, lse, frame.prepare(q_descale), frame.prepare(k_descale),
                         frame.prepare(v_descale), block_rows, **kwargs)
    return out, lse


# ---- block-sparse attention (docs/block-sparse.md) ----------------------------------------------

def block_sparse_attention_forward(q, k, v, block_mask, *, block_size_q=128, block_size_k=128,
                                   softmax_scale=None, causal=False, window_size=(-1, -1),
                                   softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None,
                                   offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
                                   max_seqlen_q=None, max_seqlen_k=None, backend="auto",
                                   stream=None, return_rng_state=False):
    """attention_forward in which only the blocks of the score matrix that block_mask turns on
    are computed: returns (out, softmax_lse), or (out, softmax_lse, rng_state).

    block_mask: bool, uint8 or int32 (nonzero = on), shape (b or 1, h or 1,
    ceil(s_q / block_size_q), ceil(s_k / block_size_k)); an extent-1 batch or head dimension
    broadcasts. Block (r, c) covers query rows [r·block_size_q, (r+1)·block_size_q) and keys
    [c·block_size_k, (c+1)·block_size_k), the last ones ragged. A key is visible to a row iff its
    block is on AND causal / window_size keep it; a row that sees no key gets out = 0 and
    softmax_lse = -inf. Varlen: b is the number of sequences, s_q / s_k are max_seqlen_q /
    max_seqlen_k, and blocks count from each sequence's start. Under GQA the mask is per query
    head. Errors about the mask itself come from the library, which calls it `mask` (and the
    block sizes block_m / block_n). CPU arrays only for now: CUDA arrays raise
    NotImplementedError.
    """
    return _forward(q, k, v, BlockMask(block_mask, block_size_q, block_size_k),
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                    offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend,
                    stream=stream, return_rng_state=return_rng_state)


def block_sparse_attention_backward(dout, q, k, v, out, softmax_lse, block_mask, *,
                                    block_size_q=128, block_size_k=128, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                                    deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                                    max_seqlen_q=None, max_seqlen_k=None, backend="auto",
                                    stream=None):
    """Gradients of block_sparse_attention_forward with the same mask, block sizes and options:
    returns (dq, dk, dv). Keys no row sees get dk = dv = 0; rows that see no key get dq = 0."""
    return _backward(dout, q, k, v, out, softmax_lse,
                     BlockMask(block_mask, block_size_q, block_size_k),
                     softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                     offset=offset, deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, backend=backend, stream=stream)


_INT64_MAX = (1 << 63) - 1


def _pattern(data, row_blocks, col_blocks):
    np = _numpy()
    return np.frombuffer(data, dtype=np.uint8).reshape(1, 1, row_blocks, col_blocks).copy()


def local_global_block_mask(row_blocks, col_blocks, band, global_blocks):
    """The FlashAttention paper's local + global pattern as a NumPy uint8 block mask of shape
    (1, 1, row_blocks, col_blocks), ready to pass as block_mask (shared by every batch and head):
    block (r, c) is on when c - r lies in [-(band // 2), band - band // 2 - 1] (band 1: the
    diagonal; 3: it and one block either side), or r < global_blocks (those rows see every key),
    or c < global_blocks (every row sees those keys). All four are ints >= 0, at most 2**31
    blocks in all."""
    rows = integer(row_blocks, "row_blocks", 0, _INT64_MAX)
    cols = integer(col_blocks, "col_blocks", 0, _INT64_MAX)
    band = integer(band, "band", 0, _INT64_MAX)
    global_blocks = integer(global_blocks, "global_blocks", 0, _INT64_MAX)
    return _pattern(_ext.local_global_block_mask(rows, cols, band, global_blocks), rows, cols)


def butterfly_block_mask(row_blocks, col_blocks):
    """The butterfly pattern as a NumPy uint8 block mask of shape (1, 1, row_blocks, col_blocks):
    block (r, c) is on when r and c differ in at most one bit (log2(n) + 1 blocks per row of n)."""
    rows = integer(row_blocks, "row_blocks", 0, _INT64_MAX)
    cols = integer(col_blocks, "col_blocks", 0, _INT64_MAX)
    return _pattern(_ext.butterfly_block_mask(rows, cols), rows, cols)
