"""PyTorch integration: flare's forward and backward as torch custom ops with autograd.

torch.ops.flare.fwd and torch.ops.flare.bwd are registered with torch.library.custom_op, each
with a fake (shape-only) implementation, and fwd's backward is bwd through register_autograd.
torch.compile therefore traces flash_attn_func into one graph (fullgraph=True works) and
AOTAutograd places flare's backward in the backward graph.

Both ops allocate contiguous outputs with torch.empty, in the fake and the real implementation
alike, so the strides the compiler plans for are the strides it gets. CUDA work is queued on the
current stream of the tensors' device; nothing synchronises.

Dropout: the op takes rng_state, an int64 CPU tensor [seed, offset] drawn from torch's default
generator by the caller (torch.manual_seed reproduces it) and saved for the backward, which
regenerates the same mask from it. Without dropout rng_state is None.
"""

import contextlib
from typing import Optional, Tuple

import torch

from . import _core, _ext


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _prepare(t):
    if t is None:
        return None
    t = t.detach()
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _lse_shape(q, is_varlen):
    return _core.lse_shape(q, is_varlen)


def _seeds(rng_state):
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return _core.seed_pair(seed, offset)


def _device_guard(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def draw_rng_state(dropout_p):
    """[seed, offset] from torch's default CPU generator, or None without dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


@torch.library.custom_op("flare::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
        causal: bool, window_left: int, window_right: int, softcap: float,
        alibi_slopes: Optional[torch.Tensor], deterministic: bool,
        rng_state: Optional[torch.Tensor], backend: int) -> Tuple[torch.Tensor, torch.Tensor]:
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, is_varlen), dtype=torch.float32, device=q.device)
    seed, offset = _seeds(rng_state)
    with _device_guard(q):
        _ext.forward(q, k, v, out, lse, _prepare(cu_seqlens_q), _prepare(cu_seqlens_k),
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                     window_right, softcap, _prepare(alibi_slopes), dropout_p, seed, offset,
                     deterministic, backend, _stream(q))
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              deterministic, rng_state, backend):
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, is_varlen), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flare::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
        cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
        dropout_p: float, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
        deterministic: bool, rng_state: Optional[torch.Tensor],
        backend: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout, q, k, v, out, lse = (_prepare(t) for t in (dout, q, k, v, out, lse))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    seed, offset = _seeds(rng_state)
    with _device_guard(q):
        _ext.backward(dout, q, k, v, out, lse, dq, dk, dv, _prepare(cu_seqlens_q),
                      _prepare(cu_seqlens_k), max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_left, window_right, softcap, _prepare(alibi_slopes), dropout_p,
                      seed, offset, deterministic, backend, _stream(q))
    return dq, dk, dv


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              deterministic, rng_state, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# fwd's argument count: its backward returns one gradient (or None) per argument.
_N_FWD_INPUTS = 17


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
     causal, window_left, window_right, softcap, alibi_slopes, deterministic, rng_state,
     backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                          rng_state)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                   window_right, softcap, deterministic, backend)


def _fwd_backward(ctx, dout, dlse):
    # dlse is ignored, as in flash_attn: the LSE output is not differentiable.
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
     softcap, deterministic, backend) = ctx.scalars
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, alibi_slopes, deterministic, rng_state, backend)
    return (dq, dk, dv) + (None,) * (_N_FWD_INPUTS - 3)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


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
    return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
               dropout_p, _core.scale_value(softmax_scale), bool(causal), window_left,
               window_right, float(softcap), alibi_slopes, bool(deterministic),
               draw_rng_state(dropout_p), _core.backend_code(backend))
