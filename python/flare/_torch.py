"""PyTorch integration: flare's forward and backward with autograd, eager and under torch.compile.

Two roads lead to the same two kernels, forward and backward:

- Eager calls are the hot path of a training step, and the host must stay ahead of the GPU
  there: on an H100 host a forward with autograd through a torch.library.custom_op cost 384 µs of
  host time and a forward + backward 681 µs (the op's generated autograd wrapper, argument
  defaulting and aliasing checks, all in Python), against 136 µs and 540 µs of GPU time at GPT-3
  2.7B's attention shape (bench/host_overhead.py). Where flare/_torch_ops.so was built they go
  through torch.ops.flare.attention, whose autograd is a C++ torch::autograd::Function: its
  backward runs in the autograd engine with no Python, as SDPA's does (the Python Function cost
  an H200 host 3-60 µs per forward + backward more than SDPA, 78fecd6). Elsewhere they go through
  Attention, a torch.autograd.Function whose forward and backward call the extension directly.
- Under torch.compile, the same autograd.Function allocates its outputs and calls the operators
  torch.ops.flare.fwd and torch.ops.flare.bwd, defined here with torch.library (a schema that
  writes into the given outputs, a fake kernel, and CPU and CUDA kernels: C++ from
  flare/_torch_ops.so where the build found torch, which the dispatcher calls unboxed, else the
  Python functions below). Dynamo traces the
  Function, so attention stays in the graph (fullgraph=True works), AOTAutograd places bwd in the
  backward graph, inductor allocates the outputs itself (C++, no Python torch.empty per output)
  and the compiled code reaches the kernels through the dispatcher with no Python autograd
  wrapper around them. The operators have no autograd kernel of their own: differentiate through
  flash_attn_func.

Outputs are allocated contiguous on both roads, so the strides the compiler plans for are the
strides it gets. Work is queued on the current stream of the tensors' device and nothing
synchronises: outputs come from torch's caching allocator, the backward's fp32 dQ accumulator
from CUDA's stream-ordered allocator (allocated and freed in the call's stream), and the persistent
forward's tile counter is the stream's own, zeroed once (a capture gets one of its own). A CUDA
graph capture accepts all of them, so calls can be captured (test_torch_hotpath.py).

Block-sparse attention (flare.block_sparse_attn_func) takes the same two roads through its own
Function and operators, block_sparse_fwd / block_sparse_bwd (the end of this file).

Dropout: rng_state is an int64 CPU tensor [seed, offset] drawn from torch's default generator
(torch.manual_seed reproduces it) and saved for the backward, which regenerates the same mask from
it. Without dropout rng_state is None.
"""

import ctypes
import os
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

def run_forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                deterministic, rng_state, backend):
    """flare's forward into the caller's out and lse. q, k and v have a unit last stride
    (attention() makes them so; the library rejects others)."""
    seed, offset = _seeds(rng_state)
    _ext.forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                 dropout_p, seed, offset, deterministic, backend, _stream(q))


def run_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                 softcap, alibi_slopes, deterministic, rng_state, backend):
    """flare's backward into the caller's dq, dk and dv. q, k, v are the forward's (unit last
    stride) and out is its own output; dout has a unit last stride (see backward())."""
    seed, offset = _seeds(rng_state)
    _ext.backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, seed, offset, deterministic, backend, _stream(q))


def forward_outputs(q, is_varlen):
    """out (like q, contiguous) and lse (float32), allocated for a forward."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(_core.lse_shape(q, is_varlen), dtype=torch.float32)


def backward_outputs(q, k, v):
    """dq, dk, dv (like q, k, v, contiguous), allocated for a backward."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    """Allocates out and lse and runs flare's forward (arguments as run_forward's, without out
    and lse). Returns (out, lse)."""
    out, lse = forward_outputs(q, cu_seqlens_q is not None or cu_seqlens_k is not None)
    run_forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *args)
    return out, lse


def backward(dout, q, k, v, out, lse, *args):
    """Allocates dq, dk, dv and runs flare's backward (arguments as run_backward's, without dq,
    dk and dv). autograd may hand dout over in any layout (an expanded gradient has stride 0), so
    it alone is made unit-stride here. Returns (dq, dk, dv)."""
    dout = _unit_last_stride(dout)
    dq, dk, dv = backward_outputs(q, k, v)
    run_backward(dout, q, k, v, out, lse, dq, dk, dv, *args)
    return dq, dk, dv


# ---- the operators (torch.compile's road) -------------------------------------------------------
# They write into outputs the compiled graph allocates (schema `Tensor(a!)`), so the allocation is
# inductor's own C++ call rather than a Python torch.empty per output inside the operator: the
# operator's Python kernel does no more than the extension call.

def _load_cpp_kernels():
    """Loads flare/_torch_ops.so (flare_torch_ops.cpp: the operators' C++ kernels, built where
    torch's headers were found) and binds it to the extension's copy of flare. False where it
    was not built, or with FLARE_TORCH_OPS=python in the environment (the Python kernels, kept
    for comparison)."""
    path = os.path.join(os.path.dirname(__file__), "_torch_ops.so")
    if os.environ.get("FLARE_TORCH_OPS") == "python" or not os.path.exists(path):
        return False
    torch.ops.load_library(path)
    ctypes.CDLL(path).flare_torch_ops_bind(ctypes.c_void_p(_ext.c_api_table()))
    return True


_lib = torch.library.Library("flare", "DEF")
_OPTIONS = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
            "float dropout_p, float softmax_scale, bool causal, int window_left, int window_right, "
            "float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state, "
            "int backend")
_lib.define("fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, " + _OPTIONS +
            ") -> ()")
_lib.define("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, " + _OPTIONS + ") -> ()")
# The eager road with autograd in C++ (flare_torch_ops.cpp): (out, lse) with a backward the
# autograd engine runs without Python. Only where the C++ kernels were built.
_lib.define("attention(Tensor q, Tensor k, Tensor v, " + _OPTIONS + ") -> (Tensor, Tensor)")
_attention_op = torch.ops.flare.attention.default  # looked up once: the eager call is hot
# The kernels: C++ where flare/_torch_ops.so was built (the dispatcher then calls them unboxed,
# with no Python between the compiled graph and the library), else these Python functions.
CPP_KERNELS = _load_cpp_kernels()
if not CPP_KERNELS:
    for _key in ("CPU", "CUDA"):
        _lib.impl("fwd", run_forward, _key)
        _lib.impl("bwd", run_backward, _key)


@torch.library.register_fake("flare::fwd")
def _fwd_fake(*args):
    return None


@torch.library.register_fake("flare::bwd")
def _bwd_fake(*args):
    return None


def _compiled_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    out, lse = forward_outputs(q, cu_seqlens_q is not None or cu_seqlens_k is not None)
    torch.ops.flare.fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *args)
    return out, lse


def _compiled_backward(dout, q, k, v, out, lse, *args):
    dout = _unit_last_stride(dout)
    dq, dk, dv = backward_outputs(q, k, v)
    torch.ops.flare.bwd(dout, q, k, v, out, lse, dq, dk, dv, *args)
    return dq, dk, dv


# fwd's argument count: a backward returns one gradient (or None) per argument.
_N_FWD_INPUTS = 17


def _save_for_backward(ctx, inputs, output):
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


class Attention(torch.autograd.Function):
    """Attention with autograd. Eagerly, forward() and backward() run directly: nothing stands
    between the caller and the extension. While torch.compile traces it, the same steps go
    through the operators, which it places in the forward and backward graphs; the compiled code
    then calls them through the dispatcher (the ops carry no autograd kernel of their own, so no
    Python wrapper runs at that level)."""

    @staticmethod
    def forward(ctx, *inputs):
        run = _compiled_forward if torch.compiler.is_compiling() else forward
        out, lse = run(*inputs)
        _save_for_backward(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        # lse never has a gradient: materialising one would cost a zero-filled tensor and a
        # kernel launch per backward (measured on an H100 host, the largest item after the
        # kernels' own launches).
        if not torch.compiler.is_compiling():
            ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # dlse is ignored, as in flash_attn: the LSE output is not differentiable.
        if dout is None:  # out did not reach the loss either
            return (None,) * _N_FWD_INPUTS
        run = _compiled_backward if torch.compiler.is_compiling() else backward
        dq, dk, dv = run(dout, *_backward_args(ctx))
        return (dq, dk, dv) + (None,) * (_N_FWD_INPUTS - 3)


def _max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """max_seqlen_q / max_seqlen_k as ints: required for a varlen batch, 0 otherwise."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("max_seqlen_q / max_seqlen_k: required for a varlen batch")
        return int(max_seqlen_q), int(max_seqlen_k)
    return 0, 0


def attention(q, k, v, options, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              alibi_slopes):
    """The differentiable call behind every flash_attn_* function for torch tensors; `options`
    is a checked _core.Options."""
    max_seqlen_q, max_seqlen_k = _max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k)
    o = options
    rest = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, o.dropout_p, o.softmax_scale,
            o.causal, o.window_left, o.window_right, o.softcap, alibi_slopes, o.deterministic,
            draw_rng_state(o.dropout_p), o.backend)
    compiling = torch.compiler.is_compiling()
    if CPP_KERNELS and not compiling:  # the operator gives q, k and v a unit last stride itself
        return _attention_op(q, k, v, *rest)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return Attention.apply(q, k, v, *rest)
    return (_compiled_forward if compiling else forward)(q, k, v, *rest)


# ---- block-sparse attention ----------------------------------------------------------------------
# flare.block_sparse_attn_func takes the same two roads: BlockSparseAttention calls the extension
# eagerly and, while torch.compile traces it, the operators torch.ops.flare.block_sparse_fwd /
# block_sparse_bwd (fwd / bwd's schema with the mask and its block sizes after the outputs, as in
# the C ABI). The mask is an input without a gradient; a bool mask arrives as its uint8 view.

def run_block_sparse_forward(q, k, v, out, lse, block_mask, block_m, block_n, cu_seqlens_q,
                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                             causal, window_left, window_right, softcap, alibi_slopes,
                             deterministic, rng_state, backend):
    """run_forward with a block mask at block_m x block_n."""
    seed, offset = _seeds(rng_state)
    _ext.block_sparse_forward(q, k, v, out, lse, block_mask, block_m, block_n, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                              offset, deterministic, backend, _stream(q))


def run_block_sparse_backward(dout, q, k, v, out, lse, dq, dk, dv, block_mask, block_m, block_n,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, causal, window_left, window_right, softcap,
                              alibi_slopes, deterministic, rng_state, backend):
    """run_backward with the forward's block mask."""
    seed, offset = _seeds(rng_state)
    _ext.block_sparse_backward(dout, q, k, v, out, lse, dq, dk, dv, block_mask, block_m, block_n,
                               cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, seed, offset, deterministic, backend,
                               _stream(q))


_BLOCK_MASK = "Tensor block_mask, int block_m, int block_n, "
_lib.define("block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, " +
            _BLOCK_MASK + _OPTIONS + ") -> ()")
_lib.define("block_sparse_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, " + _BLOCK_MASK + _OPTIONS + ") -> ()")
if not CPP_KERNELS:  # else flare/_torch_ops.so's
    for _key in ("CPU", "CUDA"):
        _lib.impl("block_sparse_fwd", run_block_sparse_forward, _key)
        _lib.impl("block_sparse_bwd", run_block_sparse_backward, _key)


@torch.library.register_fake("flare::block_sparse_fwd")
def _block_sparse_fwd_fake(*args):
    return None


@torch.library.register_fake("flare::block_sparse_bwd")
def _block_sparse_bwd_fake(*args):
    return None


def block_sparse_forward(q, k, v, block_mask, block_m, block_n, cu_seqlens_q, cu_seqlens_k,
                         *args):
    """Allocates out and lse and runs the block-sparse forward: eagerly through the extension,
    under torch.compile through the operator. Returns (out, lse)."""
    out, lse = forward_outputs(q, cu_seqlens_q is not None or cu_seqlens_k is not None)
    run = (torch.ops.flare.block_sparse_fwd if torch.compiler.is_compiling()
           else run_block_sparse_forward)
    run(q, k, v, out, lse, block_mask, block_m, block_n, cu_seqlens_q, cu_seqlens_k, *args)
    return out, lse


def block_sparse_backward(dout, q, k, v, out, lse, block_mask, block_m, block_n, *args):
    """Allocates dq, dk, dv and runs the block-sparse backward (dout made unit-stride, as in
    backward()). Returns (dq, dk, dv)."""
    dout = _unit_last_stride(dout)
    dq, dk, dv = backward_outputs(q, k, v)
    run = (torch.ops.flare.block_sparse_bwd if torch.compiler.is_compiling()
           else run_block_sparse_backward)
    run(dout, q, k, v, out, lse, dq, dk, dv, block_mask, block_m, block_n, *args)
    return dq, dk, dv


class BlockSparseAttention(torch.autograd.Function):
    """Block-sparse attention with autograd, as Attention is for dense attention."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask, block_m, block_n, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                window_right, softcap, alibi_slopes, deterministic, rng_state, backend):
        scalars = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                   window_right, softcap)
        out, lse = block_sparse_forward(q, k, v, block_mask, block_m, block_n, cu_seqlens_q,
                                        cu_seqlens_k, *scalars, alibi_slopes, deterministic,
                                        rng_state, backend)
        ctx.save_for_backward(q, k, v, out, lse, block_mask, cu_seqlens_q, cu_seqlens_k,
                              alibi_slopes, rng_state)
        ctx.scalars = (block_m, block_n, scalars, deterministic, backend)
        ctx.mark_non_differentiable(lse)
        if not torch.compiler.is_compiling():  # as in Attention: no zero-filled dlse
            ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        inputs = 20  # forward's arguments after ctx: one gradient (or None) each
        if dout is None:
            return (None,) * inputs
        (q, k, v, out, lse, block_mask, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
         rng_state) = ctx.saved_tensors
        block_m, block_n, scalars, deterministic, backend = ctx.scalars
        dq, dk, dv = block_sparse_backward(dout, q, k, v, out, lse, block_mask, block_m, block_n,
                                           cu_seqlens_q, cu_seqlens_k, *scalars, alibi_slopes,
                                           deterministic, rng_state, backend)
        return (dq, dk, dv) + (None,) * (inputs - 3)


def block_sparse_attention(q, k, v, block_mask, options, *, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, alibi_slopes):
    """attention() with a checked _core.BlockMask: the call behind block_sparse_attn_func and
    block_sparse_attn_varlen_func for torch tensors."""
    max_seqlen_q, max_seqlen_k = _max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    o = options
    args = (q, k, v, _core.block_mask_view(block_mask.mask.detach()), block_mask.block_m,
            block_mask.block_n, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            o.dropout_p, o.softmax_scale, o.causal, o.window_left, o.window_right, o.softcap,
            alibi_slopes, o.deterministic, draw_rng_state(o.dropout_p), o.backend)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return BlockSparseAttention.apply(*args)
    return block_sparse_forward(*args)
