"""PyTorch integration: flare's forward and backward with autograd, eager and under torch.compile.

Two roads lead to the same two functions, forward() and backward() below:

- Eager calls go through Attention, a torch.autograd.Function whose forward and backward call the
  compiled module directly. That is the hot path of a training step, and the host must stay
  ahead of the GPU there: on an H100 host a forward with autograd through a
  torch.library.custom_op cost 384 µs of host time and a forward + backward 681 µs (the op's
  generated autograd wrapper, argument defaulting and aliasing checks, all in Python), against
  136 µs and 540 µs of GPU time at GPT-3 2.7B's attention shape (bench/host_overhead.py).
- Under torch.compile, flash_attn_func calls the operators torch.ops.flare.fwd and
  torch.ops.flare.bwd, defined here with torch.library: a schema, one kernel for CPU and CUDA,
  a fake (shape-only) kernel, and fwd's autograd formula (bwd). Dynamo keeps attention in the
  graph (fullgraph=True works), AOTAutograd places bwd in the backward graph, and the compiled
  code reaches the kernel through the dispatcher without the eager wrappers.

Outputs are allocated contiguous with torch.empty on both roads, in the fake kernels too, so the
strides the compiler plans for are the strides it gets. Work is queued on the current stream of
the tensors' device and nothing synchronises or allocates through anything but torch's caching
allocator, so calls can be captured in a CUDA graph.

Dropout: rng_state is an int64 CPU tensor [seed, offset] drawn from torch's default generator
(torch.manual_seed reproduces it) and saved for the backward, which regenerates the same mask from
it. Without dropout rng_state is None.
"""

from typing import Optional, Tuple

import torch

from . import _core, _ext

# The raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t):
    if not t.is_cuda:
        return 0
    if _current_raw_stream is not None:
        return _current_raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _unit_last_stride(t):
    """flare reads rows with a unit head_dim stride; other layouts are copied, as flash_attn does."""
    if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def _seeds(rng_state):
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return _core.seed_pair(seed, offset)


def draw_rng_state(dropout_p):
    """[seed, offset] from torch's default CPU generator, or None without dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


# ---- the two calls every road ends in ----------------------------------------------------------

def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
            deterministic, rng_state, backend):
    """Allocates out (like q) and lse (float32) and runs flare's forward. Returns (out, lse)."""
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_core.lse_shape(q, is_varlen), dtype=torch.float32, device=q.device)
    seed, offset = _seeds(rng_state)
    _ext.forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                 dropout_p, seed, offset, deterministic, backend, _stream(q))
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
             deterministic, rng_state, backend):
    """Allocates dq, dk, dv (like q, k, v) and runs flare's backward. Returns (dq, dk, dv)."""
    dout, q, k, v, out = (_unit_last_stride(t) for t in (dout, q, k, v, out))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    seed, offset = _seeds(rng_state)
    _ext.backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, seed, offset, deterministic, backend, _stream(q))
    return dq, dk, dv


# ---- the operators (torch.compile's road) -------------------------------------------------------

_lib = torch.library.Library("flare", "DEF")
_lib.define(
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
    "Tensor? rng_state, int backend) -> (Tensor, Tensor)")
_lib.define(
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
    "float dropout_p, float softmax_scale, bool causal, int window_left, int window_right, "
    "float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state, int backend) "
    "-> (Tensor, Tensor, Tensor)")
for _key in ("CPU", "CUDA"):
    _lib.impl("fwd", forward, _key)
    _lib.impl("bwd", backward, _key)


@torch.library.register_fake("flare::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    return q.new_empty(q.shape), q.new_empty(_core.lse_shape(q, is_varlen), dtype=torch.float32)


@torch.library.register_fake("flare::bwd")
def _bwd_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# fwd's arguments after q, k, v, in schema order; its backward returns one gradient per argument.
_N_FWD_INPUTS = 17


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k = inputs[:5]
    alibi_slopes, rng_state = inputs[13], inputs[15]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    ctx.scalars = inputs[5:13] + (inputs[14], inputs[16])


def _backward_args(ctx):
    """bwd's arguments after dout, from what the forward saved."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
     softcap, deterministic, backend) = ctx.scalars
    return (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
            deterministic, rng_state, backend)


def _fwd_backward(ctx, dout, dlse):
    # dlse is ignored, as in flash_attn: the LSE output is not differentiable.
    dq, dk, dv = torch.ops.flare.bwd(dout, *_backward_args(ctx))
    return (dq, dk, dv) + (None,) * (_N_FWD_INPUTS - 3)


torch.library.register_autograd("flare::fwd", _fwd_backward, setup_context=_fwd_setup_context)


# ---- the eager road -----------------------------------------------------------------------------

class Attention(torch.autograd.Function):
    """forward() and backward() with autograd and nothing else between them and the caller."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = forward(*inputs)
        _fwd_setup_context(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv = backward(dout, *_backward_args(ctx))
        return (dq, dk, dv) + (None,) * (_N_FWD_INPUTS - 3)


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              backend="auto"):
    """The differentiable call behind every flash_attn_* function for torch tensors."""
    window_left, window_right = _core.window_pair(window_size)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("max_seqlen_q / max_seqlen_k: required for a varlen batch")
    else:
        max_seqlen_q = max_seqlen_k = 0
    dropout_p = float(dropout_p)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
            _core.scale_value(softmax_scale), bool(causal), window_left, window_right,
            float(softcap), alibi_slopes, bool(deterministic), draw_rng_state(dropout_p),
            _core.backend_code(backend))
    if torch.compiler.is_compiling():
        return torch.ops.flare.fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return Attention.apply(*args)
    return forward(*args)
