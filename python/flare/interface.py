"""flash_attn 2.x's functions, with its names, arguments, shapes and return values.

    from flare import flash_attn_func          # instead of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)

q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k, nheads_k, headdim); the varlen
functions take packed (total, nheads, headdim) tensors with int32 cu_seqlens (batch + 1).
With return_attn_probs=True they return (out, softmax_lse, None): flare never materialises the
attention probabilities, so the third element, flash_attn's S_dmask, is None.

PyTorch tensors get autograd through flare's backward kernels (torch custom ops, so
torch.compile keeps the graph whole). Other DLPack arrays (NumPy, CuPy, JAX on CPU) get the
forward; their gradients come from flare.attention_backward. Beyond flash_attn's arguments each
function takes keyword-only extras, for non-torch arrays only (a torch call that passes them
raises ValueError, as they would do nothing there):
    seed     dropout seed; None (default) draws a fresh one from numpy.random on every call.
             torch tensors draw theirs from torch's default generator (torch.manual_seed).
    stream   CUDA arrays: the cudaStream_t as an integer (default: CuPy's current stream).
and, for every framework:
    backend  "auto" (default), "flash" or "reference" (CPU float64 ground truth).

block_sparse_attn_func and block_sparse_attn_varlen_func are flash_attn_func and
flash_attn_varlen_func with a block mask (docs/block-sparse.md), with the same extras.

Every bad argument raises TypeError (not a tensor, not a number, …) or ValueError (a value the
library rejects) with a message that starts with the argument's name.
"""

from . import _core, _ext


_torch_module = None


def _torch_road():
    """flare._torch, imported on the first torch call (flare itself does not import torch) and
    kept: the import statement costs a lookup on every call."""
    global _torch_module
    if _torch_module is None:
        from . import _torch
        _torch_module = _torch
    return _torch_module


def _attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, seed, backend, stream, varlen, block_mask=None):
    # Every argument is checked here, before any work, so a bad one raises TypeError /
    # ValueError naming it whichever framework the arrays come from. block_mask (a
    # _core.BlockMask) makes the call block-sparse.
    required = [("q", q), ("k", k), ("v", v)]
    if varlen:
        required += [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)]
    if block_mask is not None:
        required += [("block_mask", block_mask.mask)]
    group = _core.check_arrays(required, [("alibi_slopes", alibi_slopes)])
    return_attn_probs = _core.flag(return_attn_probs, "return_attn_probs")
    if group == "torch":
        options = _core.Options(softmax_scale=softmax_scale, causal=causal,
                                window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                                deterministic=deterministic, backend=backend)
        _core.max_seqlen_value(max_seqlen_q, "max_seqlen_q")
        _core.max_seqlen_value(max_seqlen_k, "max_seqlen_k")
        if seed is not None:
            raise ValueError("seed: applies to non-torch arrays; torch tensors draw dropout's "
                             "seed from torch's default generator (seed it with "
                             "torch.manual_seed)")
        if stream is not None:
            raise ValueError("stream: applies to non-torch arrays; torch tensors run on "
                             "torch.cuda.current_stream()")
        torch_road = _torch_road()
        if block_mask is None:
            out, lse = torch_road.attention(q, k, v, options, cu_seqlens_q=cu_seqlens_q,
                                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                            max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes)
        else:
            out, lse = torch_road.block_sparse_attention(
                q, k, v, block_mask, options, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                alibi_slopes=alibi_slopes)
    else:
        # deterministic only matters to the backward, which these arrays do not get here.
        _core.flag(deterministic, "deterministic")
        out, lse = _core._forward(
            q, k, v, block_mask, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p, seed=seed, offset=0, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            backend=backend, stream=stream, return_rng_state=False)
    return (out, lse, None) if return_attn_probs else out


def _unpack(packed, n, name, axis):
    """Views of qkv (…, 3, h, d) or kv (…, 2, h, d) along `axis`."""
    if _core.array_group(packed) is None:
        raise TypeError(f"{name}: expected a tensor or array (torch, NumPy, CuPy, JAX or any "
                        f"DLPack object), got {_core.describe(packed)}")
    if packed.ndim <= axis or packed.shape[axis] != n:
        raise ValueError(f"{name}: expected dimension {axis} of size {n}, got shape "
                         f"{tuple(packed.shape)}")
    index = (slice(None),) * axis
    return tuple(packed[index + (i,)] for i in range(n))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, seed=None, backend="auto", stream=None):
    """Attention over q (b, s_q, h, d), k / v (b, s_k, h_kv, d); returns out like q."""
    return _attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, dropout_p=dropout_p, softmax_scale=softmax_scale,
                      causal=causal, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs, seed=seed, backend=backend,
                      stream=stream, varlen=False)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, seed=None,
                              backend="auto", stream=None):
    """qkv (b, s, 3, h, d)."""
    q, k, v = _unpack(qkv, 3, "qkv", 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, seed=seed,
                           backend=backend, stream=stream)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, seed=None,
                             backend="auto", stream=None):
    """q (b, s_q, h, d), kv (b, s_k, 2, h_kv, d)."""
    _core.check_arrays([("q", q), ("kv", kv)])  # under the names the caller wrote
    k, v = _unpack(kv, 2, "kv", 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, seed=seed,
                           backend=backend, stream=stream)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           seed=None, backend="auto", stream=None):
    """Packed q (total_q, h, d), k / v (total_k, h_kv, d); cu_seqlens int32 (batch + 1).
    softmax_lse is (h, total_q)."""
    if block_table is not None:
        raise NotImplementedError("block_table: paged KV is supported by flash_attn_with_kvcache (decoding), "
                                  "not yet by flash_attn_varlen_func")
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs, seed=seed, backend=backend,
                      stream=stream, varlen=True)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, seed=None, backend="auto",
                                     stream=None):
    """qkv (total, 3, h, d)."""
    q, k, v = _unpack(qkv, 3, "qkv", 1)
    # cu_seqlens and max_seqlen serve as both the _q and the _k arguments: check them under
    # the names this function's caller wrote.
    _core.check_arrays([("qkv", qkv), ("cu_seqlens", cu_seqlens)])
    _core.max_seqlen_value(max_seqlen, "max_seqlen")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, seed=seed,
                                  backend=backend, stream=stream)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, seed=None, backend="auto",
                                    stream=None):
    """q (total_q, h, d), kv (total_k, 2, h_kv, d)."""
    _core.check_arrays([("q", q), ("kv", kv)])
    k, v = _unpack(kv, 2, "kv", 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  seed=seed, backend=backend, stream=stream)


# ---- block-sparse attention ----------------------------------------------------------------------

def block_sparse_attn_func(q, k, v, block_mask, block_size_q=128, block_size_k=128,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, *, seed=None, backend="auto", stream=None):
    """flash_attn_func in which only the blocks of the score matrix that block_mask turns on are
    computed (an off block costs nothing: its keys are never read). Returns out like q.

    q (b, s_q, h, d), k / v (b, s_k, h_kv, d). block_mask: bool, uint8 or int32 (nonzero = on),
    shape (b or 1, h or 1, ceil(s_q / block_size_q), ceil(s_k / block_size_k)), an extent-1
    batch or head dimension broadcasting; block (r, c) covers query rows
    [r·block_size_q, (r+1)·block_size_q) and keys [c·block_size_k, (c+1)·block_size_k), the last
    ones ragged. A key is visible to a row iff its block is on AND causal / window_size keep it
    (both aligned bottom-right); softcap, ALiBi and dropout apply as in flash_attn_func. A row
    that sees no key gets out = 0 (softmax_lse = -inf). Under GQA the mask is per query head.
    flare.local_global_block_mask and flare.butterfly_block_mask make the FlashAttention paper's
    patterns. torch tensors get autograd (the mask gets no gradient). CPU only for now: CUDA
    tensors raise NotImplementedError. The library names the mask `mask` in its errors.
    """
    return _attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, dropout_p=dropout_p, softmax_scale=softmax_scale,
                      causal=causal, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs, seed=seed, backend=backend,
                      stream=stream, varlen=False,
                      block_mask=_core.BlockMask(block_mask, block_size_q, block_size_k))


def block_sparse_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, block_mask, block_size_q=128, block_size_k=128,
                                  dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                  deterministic=False, return_attn_probs=False, *, seed=None,
                                  backend="auto", stream=None):
    """block_sparse_attn_func over packed q (total_q, h, d), k / v (total_k, h_kv, d) with int32
    cu_seqlens (batch + 1): block_mask is (batch or 1, h or 1, ceil(max_seqlen_q / block_size_q),
    ceil(max_seqlen_k / block_size_k)) and its blocks count from each sequence's start."""
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs, seed=seed, backend=backend,
                      stream=stream, varlen=True,
                      block_mask=_core.BlockMask(block_mask, block_size_q, block_size_k))


# ---- KV-cache decoding ---------------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, backend="auto", stream=None):
    """Decoding over a KV cache, as flash_attn.flash_attn_with_kvcache (no autograd).

    q (b, s_q, h, d); k_cache / v_cache (b_cache, s_cache, h_kv, d), or paged
    (num_blocks, block_size, h_kv, d) with block_table int32 (b, max_blocks). cache_seqlens: an
    int or an int32 array (b) of tokens already cached; None means the whole capacity. k / v
    (b, s_new, h_kv, d), if given, are written into the caches IN PLACE at cache_seqlens (rotated
    by rotary_cos / rotary_sin (s_rot, d_rot / 2) when given, as is q) and attended to. causal
    and window_size align the query rows to the end of each sequence. cache_batch_idx int32 (b)
    picks each sequence's row of a contiguous cache. num_splits is a GPU launch hint.
    Returns out (like q), or (out, softmax_lse (b, h, s_q) float32) with return_softmax_lse.

    The caches must be writable arrays of the caller (a NumPy array or torch tensor, not a
    JAX array): flare writes k and v into them. CPU and CUDA tensors (float16 / bfloat16 on
    CUDA, where the integer tensors' values are checked by the kernels: a sequence that breaks
    a rule gets NaN in its rows of out and softmax_lse, and nothing is appended to its cache).
    """
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad: left-padded caches are not supported yet")
    scalar_seqlen = cache_seqlens is None or _core.array_group(cache_seqlens) is None
    group = _core.check_arrays(
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)),
        (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
         ("cache_seqlens", None if scalar_seqlen else cache_seqlens),
         ("cache_batch_idx", cache_batch_idx), ("block_table", block_table),
         ("alibi_slopes", alibi_slopes)))
    options = _core.Options(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            softcap=softcap, dropout_p=0.0, deterministic=False, backend=backend)
    rotary_interleaved = _core.flag(rotary_interleaved, "rotary_interleaved")
    num_splits = _core.integer(num_splits, "num_splits")
    return_softmax_lse = _core.flag(return_softmax_lse, "return_softmax_lse")
    if scalar_seqlen:
        if cache_seqlens is None:  # flash_attn: the whole cache is in use
            shape = tuple(k_cache.shape)
            rows = shape[1] if len(shape) == 4 else 0
            pages = tuple(block_table.shape)[1] if block_table is not None else 1
            cache_seqlens = rows * pages
        cache_seqlen, cache_seqlens = _core.integer(cache_seqlens, "cache_seqlens"), None
    else:
        cache_seqlen = 0
    if _core._is_jax(q):
        raise NotImplementedError("q: flash_attn_with_kvcache writes the caches in place, which "
                                  "JAX arrays do not allow; pass torch or NumPy arrays")
    frame = _core._Frame(group, q, _core.stream_value(stream))
    # The caches are written in place: they are handed over as they are (a copy would take the
    # new keys), and torch tensors only lose their autograd history.
    if group == "torch":
        k_cache, v_cache = k_cache.detach(), v_cache.detach()
    q, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table, alibi_slopes = (
        frame.prepare(t) for t in (q, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, block_table, alibi_slopes))
    out = frame.empty(q.shape, q.dtype)
    lse = frame.empty(_core.lse_shape(q, False), frame.float32())
    with frame.device_guard():
        _ext.kvcache(q, k_cache, v_cache, k, v, block_table, cache_seqlens, cache_seqlen,
                           cache_batch_idx, rotary_cos, rotary_sin, rotary_interleaved,
                           num_splits, out, lse, options.softmax_scale, options.causal,
                           options.window_left, options.window_right, options.softcap,
                           alibi_slopes, options.backend, frame.stream)
    return (out, lse) if return_softmax_lse else out
