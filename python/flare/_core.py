"""Framework-neutral calls into flare: arrays in, arrays of the caller's framework out.

The compiled module (flare._ext) reads any DLPack tensor but allocates nothing. This file
allocates the outputs in the caller's framework (torch.empty for PyTorch, numpy.empty for NumPy,
cupy.empty for CuPy), picks the stream (the caller's current stream for PyTorch and CuPy, or an
explicit ``stream=``), and calls forward / backward. It does not import torch: PyTorch tensors
are recognised through ``sys.modules``, so NumPy-only installs work without it.

attention_forward / attention_backward are the plain (no autograd) entry points; the
flash_attn-compatible functions in flare/interface.py and the torch custom ops in
flare/_torch.py are built on the same helpers.

JAX arrays are accepted on the CPU: they are read through NumPy without a copy and the results
come back as JAX arrays. JAX arrays on a GPU are refused (JAX buffers are immutable, so flare
cannot write its outputs into them); pass torch or CuPy arrays there.
"""

import contextlib
import sys

from . import _ext

_BACKENDS = {
    "auto": _ext.BACKEND_AUTO,
    "reference": _ext.BACKEND_REFERENCE,
    "flash": _ext.BACKEND_FLASH,
}

_UINT64 = (1 << 64) - 1


def backend_code(backend):
    """Maps "auto" | "reference" | "flash" (or the integer code) to the C ABI's code."""
    if isinstance(backend, str):
        try:
            return _BACKENDS[backend]
        except KeyError:
            raise ValueError(
                f"backend: {backend!r} is not one of {sorted(_BACKENDS)}") from None
    return int(backend)


def window_pair(window_size):
    """flash_attn's window_size=(left, right) → two ints; -1 means unbounded."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected a pair (left, right), got {window_size!r}") from None
    return int(left), int(right)


def scale_value(softmax_scale):
    """None → 0.0, which the library reads as 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if scale == 0.0:
        # 0 means "default" to the C ABI; a caller who wrote 0 meant something else.
        raise ValueError("softmax_scale: must be finite and > 0, got 0.0")
    return scale


def seed_pair(seed, offset):
    """Seeds are uint64 to the library; accept any Python int (negative ones wrap)."""
    return int(seed) & _UINT64, int(offset) & _UINT64


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


def _jax_to_numpy(x):
    if x is None:
        return None
    devices = {d.platform for d in x.devices()} if hasattr(x, "devices") else {"cpu"}
    if devices != {"cpu"}:
        raise NotImplementedError(
            "JAX arrays on a GPU are not supported: JAX buffers are immutable, so flare cannot "
            "write into them; pass torch or CuPy arrays, or JAX arrays on the CPU")
    return _numpy().asarray(x)


# ---- arrays ------------------------------------------------------------------------------------

class _Frame:
    """How to allocate and synchronise for one call's framework."""

    def __init__(self, like, stream):
        self.kind = ("torch" if is_torch(like) else "cupy" if _is_cupy(like)
                     else "numpy")
        if self.kind == "torch":
            import torch
            self.xp = torch
            self.device = like.device
            if stream is None:
                stream = (torch.cuda.current_stream(like.device).cuda_stream
                          if like.is_cuda else 0)
        elif self.kind == "cupy":
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
        """A view the library accepts: unit last stride, non-negative strides, no autograd."""
        if x is None:
            return None
        if self.kind == "torch":
            x = x.detach()
            if x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
                x = x.contiguous()
            return x
        if self.kind == "numpy" and not isinstance(x, self.xp.ndarray):
            x = self.xp.from_dlpack(x) if hasattr(x, "__dlpack__") else self.xp.asarray(x)
        itemsize = x.dtype.itemsize
        strides = x.strides
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
    if given is not None:
        return int(given)
    if cu_seqlens is None:
        return 0
    if (is_torch(cu_seqlens) and cu_seqlens.is_cuda) or _is_cupy(cu_seqlens):
        raise ValueError(f"{name}: required with CUDA cu_seqlens (reading them would synchronise)")
    np = _numpy()
    c = cu_seqlens.detach().numpy() if is_torch(cu_seqlens) else np.asarray(cu_seqlens)
    return int(np.max(np.diff(c))) if c.size > 1 else 0


class _Call:
    """The arguments forward and backward share, normalised once."""

    def __init__(self, *, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                 seed, offset, deterministic, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k):
        self.softmax_scale = scale_value(softmax_scale)
        self.causal = bool(causal)
        self.window_left, self.window_right = window_pair(window_size)
        self.softcap = float(softcap)
        self.alibi_slopes = alibi_slopes
        self.dropout_p = float(dropout_p)
        self.seed, self.offset = seed_pair(seed, offset)
        self.deterministic = bool(deterministic)
        self.backend = backend_code(backend)
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k
        self.is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self.max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        self.max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")

    def kwargs(self, frame):
        return dict(
            cu_seqlens_q=frame.prepare(self.cu_seqlens_q),
            cu_seqlens_k=frame.prepare(self.cu_seqlens_k),
            max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            softmax_scale=self.softmax_scale, causal=self.causal,
            window_left=self.window_left, window_right=self.window_right,
            softcap=self.softcap, alibi_slopes=frame.prepare(self.alibi_slopes),
            dropout_p=self.dropout_p, seed=self.seed, offset=self.offset,
            deterministic=self.deterministic, backend=self.backend, stream=frame.stream)


def forward_into(frame, call, q, k, v):
    """Allocates o and lse in `frame`'s framework and runs the forward. Returns (o, lse)."""
    q, k, v = frame.prepare(q), frame.prepare(k), frame.prepare(v)
    o = frame.empty(q.shape, q.dtype)
    lse = frame.empty(lse_shape(q, call.is_varlen), frame.float32())
    with frame.device_guard():
        _ext.forward(q, k, v, o, lse, **call.kwargs(frame))
    return o, lse


def backward_into(frame, call, dout, q, k, v, o, lse):
    """Allocates dq, dk, dv like q, k, v and runs the backward. Returns (dq, dk, dv)."""
    dout, q, k, v, o, lse = (frame.prepare(t) for t in (dout, q, k, v, o, lse))
    dq = frame.empty(q.shape, q.dtype)
    dk = frame.empty(k.shape, k.dtype)
    dv = frame.empty(v.shape, v.dtype)
    with frame.device_guard():
        _ext.backward(dout, q, k, v, o, lse, dq, dk, dv, **call.kwargs(frame))
    return dq, dk, dv


def _jax_wrap(args, fn):
    """Runs fn on NumPy views of JAX (CPU) arrays and returns JAX arrays."""
    import jax.numpy as jnp
    outs = fn(*[_jax_to_numpy(a) if _is_jax(a) else a for a in args])
    return tuple(jnp.asarray(o) for o in outs)


# ---- public, no-autograd entry points ----------------------------------------------------------

def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0, offset=0,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, backend="auto", stream=None):
    """Exact attention forward: returns (out, softmax_lse).

    q (b, s_q, h, d), k / v (b, s_k, h_kv, d); or packed (total, h, d) with int32 cu_seqlens_q /
    cu_seqlens_k (batch + 1). out is like q (in q's framework); softmax_lse is float32
    (b, h, s_q), or (h, total_q) when packed. Dropout with probability dropout_p uses the
    counter-based mask keyed by (seed, offset); pass the same pair to attention_backward.
    For CUDA arrays the work is queued on `stream` (an integer cudaStream_t), by default the
    framework's current stream (torch, CuPy). No autograd: see flash_attn_func for that.
    """
    call = _Call(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                 offset=offset, deterministic=False, backend=backend,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if _is_jax(q):
        return _jax_wrap((q, k, v), lambda q_, k_, v_: attention_forward(
            q_, k_, v_, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=_jax_to_numpy(alibi_slopes) if _is_jax(alibi_slopes)
            else alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
            cu_seqlens_q=_jax_to_numpy(cu_seqlens_q) if _is_jax(cu_seqlens_q) else cu_seqlens_q,
            cu_seqlens_k=_jax_to_numpy(cu_seqlens_k) if _is_jax(cu_seqlens_k) else cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend))
    return forward_into(_Frame(q, stream), call, q, k, v)


def attention_backward(dout, q, k, v, out, softmax_lse, *, softmax_scale=None, causal=False,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                       seed=0, offset=0, deterministic=False, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       backend="auto", stream=None):
    """Gradients of attention_forward: returns (dq, dk, dv), shaped and typed like q, k, v.

    out and softmax_lse are attention_forward's results for the same inputs and options
    (including seed and offset when dropout_p > 0).
    """
    call = _Call(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                 offset=offset, deterministic=deterministic, backend=backend,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if _is_jax(q):
        return _jax_wrap((dout, q, k, v, out, softmax_lse), lambda *a: attention_backward(
            *a, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=_jax_to_numpy(alibi_slopes) if _is_jax(alibi_slopes)
            else alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
            deterministic=deterministic,
            cu_seqlens_q=_jax_to_numpy(cu_seqlens_q) if _is_jax(cu_seqlens_q) else cu_seqlens_q,
            cu_seqlens_k=_jax_to_numpy(cu_seqlens_k) if _is_jax(cu_seqlens_k) else cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend))
    return backward_into(_Frame(q, stream), call, dout, q, k, v, out, softmax_lse)

