"""flare's block-sparse attention from Python: block_sparse_attn_func (and _varlen_func) with
autograd for torch, block_sparse_attention_forward / _backward for NumPy, the pattern helpers.

The truth is attention_ref.py (float64) with the keys of the blocks that are off dropped as well
as those causal / window drop: one (sequence, query head) at a time, its visibility rule ANDed
with that head's expanded block mask. The naive float32 model of the same masked problem sets
the budget (the tolerance rule of docs/architecture.md). torch results must equal the NumPy
plain calls' bytes (one kernel behind both), and every bad argument raises TypeError or
ValueError whose message starts with its name (the library names the mask `mask`).
"""

import contextlib
import inspect
import itertools
from unittest import mock

import numpy as np
import pytest

import attention_ref as ref
import bad_args
import flare
from cuda_skip import requires_cuda

BACKENDS = ["auto", "reference"]


def make(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def cdiv(a, b):
    return -(-a // b)


def random_mask(rng, shape, density, dtype=np.uint8):
    on = rng.random(shape) < density
    return on if dtype == np.bool_ else (on * (7 if dtype == np.int32 else 1)).astype(dtype)


# ---- the masked reference ----------------------------------------------------------------------

@contextlib.contextmanager
def blocks_dropped(keep_blocks):
    """attention_ref with a second visibility rule: keep_blocks (s_q, s_k) ANDed into its own."""
    visible = ref._visible

    def masked(s_q, s_k, causal, window):
        keep, dist = visible(s_q, s_k, causal, window)
        return keep & keep_blocks, dist

    with mock.patch.object(ref, "_visible", masked):
        yield


def masked_reference(q, k, v, dout, mask, bq, bk, *, compute=np.float64, round_to=None,
                     causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                     softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """attention_ref.attention with the keys of off blocks dropped. q (b, s_q, h, d), or packed
    (total_q, h, d) with cu_seqlens; mask (b | 1, h | 1, rows, cols), nonzero = on. Returns
    (o, lse, grads or None, magnitudes) laid out as attention_ref returns them. Each (sequence,
    head) is its own single-head problem, so dk / dv sum the group's heads, and their magnitude
    is the sum of the group's (an upper bound of the per-element sum attention_ref takes)."""
    packed = cu_seqlens_q is not None
    if packed:
        seqs = [(slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i],
                                                                    cu_seqlens_k[i + 1]))
                for i in range(len(cu_seqlens_q) - 1)]
        rows_of = lambda x, i, s: x[s]  # noqa: E731
    else:
        seqs = [(slice(None), slice(None))] * q.shape[0]
        rows_of = lambda x, i, s: x[i]  # noqa: E731
    h, h_kv = q.shape[-2], k.shape[-2]
    group = h // h_kv
    o = np.zeros(q.shape, compute)
    lse = np.full((h, q.shape[0]) if packed else (q.shape[0], h, q.shape[1]), -np.inf, compute)
    grads = tuple(np.zeros(x.shape, compute) for x in (q, k, v))
    mags = {n: 0.0 for n in ("o", "lse", "dq", "dk", "dv")}
    for i, (sq, sk) in enumerate(seqs):
        for kv_head in range(h_kv):
            group_mags = {"dk": 0.0, "dv": 0.0}
            for head in range(kv_head * group, (kv_head + 1) * group):
                one = lambda x, hh, s: rows_of(x, i, s)[None, :, hh:hh + 1]  # noqa: E731
                qh = one(q, head, sq)
                kh, vh = one(k, kv_head, sk), one(v, kv_head, sk)
                s_q, s_k = qh.shape[1], kh.shape[1]
                if s_q == 0 or s_k == 0:  # as initialised: o = 0, lse = -inf, no gradient
                    continue
                m = mask[i if mask.shape[0] > 1 else 0, head if mask.shape[1] > 1 else 0] != 0
                keep = np.repeat(np.repeat(m, bq, 0), bk, 1)[:s_q, :s_k]
                slopes = None
                if alibi_slopes is not None:
                    slopes = (alibi_slopes[head:head + 1] if alibi_slopes.ndim == 1
                              else alibi_slopes[i, head:head + 1])
                with blocks_dropped(keep):
                    r = ref.attention(qh, kh, vh, None if dout is None else one(dout, head, sq),
                                      softmax_scale=softmax_scale, causal=causal, window=window,
                                      softcap=softcap, alibi_slopes=slopes, compute=compute,
                                      round_to=round_to, magnitudes=True)
                o_r, lse_r, mag = r[0], r[1], r[-1]
                if packed:
                    o[sq, head], lse[head, sq] = o_r[0, :, 0], lse_r[0, 0]
                else:
                    o[i, :, head], lse[i, head] = o_r[0, :, 0], lse_r[0, 0]
                if dout is not None:
                    dq, dk, dv = (g[0, :, 0] for g in r[2])
                    rows = (sq, sk, sk) if packed else (i, i, i)
                    grads[0][rows[0]][..., head, :] = dq
                    grads[1][rows[1]][..., kv_head, :] += dk
                    grads[2][rows[2]][..., kv_head, :] += dv
                for n in ("o", "lse", "dq"):
                    mags[n] = max(mags[n], mag[n])
                for n in group_mags:
                    group_mags[n] += mag[n]
            for n, value in group_mags.items():
                mags[n] = max(mags[n], value)
    return o, lse, (grads if dout is not None else None), mags


def check(seed, q, k, v, dout, mask, bq, bk, out, lse, grads=None, **kw):
    """out, lse (and grads) against the masked reference under the tolerance rule."""
    dtype = q.dtype
    truth_o, truth_lse, truth_g, mags = masked_reference(q, k, v, dout, mask, bq, bk, **kw)
    naive_o, naive_lse, naive_g, _ = masked_reference(q, k, v, dout, mask, bq, bk,
                                                      compute=np.float32, round_to=dtype, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    ref.check_close("o", out, truth_o, naive_o, dtype, seed, mags["o"])
    ref.check_close("lse", lse, truth_lse, naive_lse, np.float32, seed, mags["lse"])
    if grads is None:
        return
    for name, got, t, n, x in zip(("dq", "dk", "dv"), grads, truth_g, naive_g, (q, k, v)):
        assert got.dtype == dtype and got.shape == x.shape, name
        ref.check_close(name, got, t, n, dtype, seed, mags[name])


def flare_options(kw):
    return dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
                softmax_scale=kw.get("softmax_scale"))


# ---- NumPy: forward and backward against the reference ------------------------------------------

CASES = [
    # (b, s_q, s_k, h, h_kv, d, block_q, block_k, density, mask batch/head extents, options)
    (2, 40, 50, 2, 2, 16, 16, 16, 0.5, "bh", dict()),
    (1, 33, 45, 2, 2, 24, 7, 9, 0.4, "bh", dict()),           # blocks that do not divide
    (2, 37, 61, 4, 2, 32, 8, 16, 0.6, "bh", dict(causal=True)),   # GQA, bottom-right causal
    (1, 48, 48, 4, 1, 16, 16, 8, 0.5, "1h", dict(window=(12, 3))),  # MQA, mask per head
    (2, 30, 30, 2, 2, 16, 10, 10, 0.5, "b1", dict(softcap=4.0, softmax_scale=0.3)),
    (1, 45, 70, 2, 2, 40, 16, 32, 0.7, "11", dict(alibi=True, causal=True)),
    (1, 20, 20, 2, 2, 16, 1, 1, 0.3, "bh", dict()),           # one element per block
    (1, 20, 30, 2, 2, 16, 1000, 1000, 1.0, "bh", dict()),     # one block over everything
]


def mask_extents(code, b, h):
    return (b if code[0] == "b" else 1), (h if code[1] == "h" else 1)


def case_options(rng, b, h, opts):
    opts = dict(opts)
    kw = {n: opts.pop(n) for n in ("causal", "window", "softcap", "softmax_scale") if n in opts}
    if opts.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (h,)).astype(np.float32)
    assert not opts, opts
    return kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", [np.uint8, np.int32, np.bool_],
                         ids=["uint8", "int32", "bool"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}"
                         f"-hkv{c[4]}-d{c[5]}-blk{c[6]}x{c[7]}-m{c[9]}-" + "-".join(sorted(c[10])))
def test_numpy_forward_backward(case, mask_dtype, backend, rng, seed):
    b, s_q, s_k, h, h_kv, d, bq, bk, density, extents, opts = case
    kw = case_options(rng, b, h, opts)
    q, k, v = make(rng, (b, s_q, h, d)), make(rng, (b, s_k, h_kv, d)), make(rng, (b, s_k, h_kv, d))
    mask = random_mask(rng, mask_extents(extents, b, h) + (cdiv(s_q, bq), cdiv(s_k, bk)),
                       density, mask_dtype)
    sizes = dict(block_size_q=bq, block_size_k=bk)
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, backend=backend, **sizes,
                                                    **flare_options(kw))
    dout = make(rng, out.shape)
    grads = flare.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, backend=backend,
                                                  **sizes, **flare_options(kw))
    check(seed, q, k, v, dout, mask, bq, bk, out, lse, grads, **kw)


def test_numpy_float16(rng, seed):
    b, s, h, d, bq, bk = 1, 50, 2, 32, 16, 8
    q, k, v = (make(rng, (b, s, h, d), np.float16) for _ in range(3))
    mask = random_mask(rng, (b, h, cdiv(s, bq), cdiv(s, bk)), 0.5)
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, block_size_q=bq,
                                                    block_size_k=bk, causal=True)
    dout = make(rng, out.shape, np.float16)
    grads = flare.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, block_size_q=bq,
                                                  block_size_k=bk, causal=True)
    check(seed, q, k, v, dout, mask, bq, bk, out, lse, grads, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_varlen_with_empty_sequences(backend, rng, seed):
    lens_q, lens_k = [37, 0, 20, 5], [30, 12, 41, 0]
    h, h_kv, d, bq, bk = 4, 2, 16, 8, 16
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = make(rng, (cu_q[-1], h, d))
    k, v = make(rng, (cu_k[-1], h_kv, d)), make(rng, (cu_k[-1], h_kv, d))
    mask = random_mask(rng, (len(lens_q), h, cdiv(max(lens_q), bq), cdiv(max(lens_k), bk)), 0.6)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args = dict(block_size_q=bq, block_size_k=bk, backend=backend, max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k), **kw)
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, **args)
    assert lse.shape == (h, cu_q[-1])
    dout = make(rng, out.shape)
    grads = flare.block_sparse_attention_backward(dout, q, k, v, out, lse, mask, **args)
    check(seed, q, k, v, dout, mask, bq, bk, out, lse, grads, **kw)
    # The flash_attn-style call: the same bytes, out only (no autograd for NumPy).
    same = flare.block_sparse_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               mask, bq, bk, causal=True, backend=backend)
    np.testing.assert_array_equal(same, out)


def test_strided_and_bool_masks_read_like_contiguous_uint8(rng):
    b, s, h, d, bq, bk = 2, 40, 2, 16, 8, 8
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    wide = random_mask(rng, (b, h, cdiv(s, bq), 2 * cdiv(s, bk)), 0.5, np.bool_)
    strided = wide[..., ::2]  # every other column: a non-unit last stride
    dense = np.ascontiguousarray(strided).astype(np.uint8)
    expected = flare.block_sparse_attn_func(q, k, v, dense, bq, bk)
    for mask in (strided, strided.astype(np.uint8), dense.astype(np.int32)):
        np.testing.assert_array_equal(flare.block_sparse_attn_func(q, k, v, mask, bq, bk),
                                      expected)
    read_only = dense.copy()
    read_only.flags.writeable = False
    np.testing.assert_array_equal(flare.block_sparse_attn_func(q, k, v, read_only, bq, bk),
                                  expected)


def test_off_blocks_are_never_read(rng):
    # NaN in the keys and values of key block 1, which is off for every row and head.
    b, s, h, d, bq, bk = 1, 48, 2, 16, 16, 16
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    k[:, 16:32], v[:, 16:32] = np.nan, np.nan
    mask = np.ones((1, 1, 3, 3), np.uint8)
    mask[..., 1] = 0
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, block_size_q=bq,
                                                    block_size_k=bk)
    dq, dk, dv = flare.block_sparse_attention_backward(np.ones_like(out), q, k, v, out, lse, mask,
                                                       block_size_q=bq, block_size_k=bk)
    for x in (out, lse, dq, dk[:, :16], dk[:, 32:], dv[:, :16], dv[:, 32:]):
        assert np.isfinite(x).all()
    assert not dk[:, 16:32].any() and not dv[:, 16:32].any()


def test_rows_that_see_no_key(rng, seed):
    b, s, h, d = 1, 32, 2, 16
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    mask = np.ones((1, h, 4, 4), np.uint8)
    mask[0, 0, 1] = 0  # rows 8..15 of head 0 see nothing
    out, lse, probs = flare.block_sparse_attn_func(q, k, v, mask, 8, 8, return_attn_probs=True)
    assert probs is None
    assert (lse[0, 0, 8:16] == -np.inf).all() and np.isfinite(lse[0, 1]).all()
    assert not out[0, 8:16, 0].any()


def test_all_blocks_on_is_dense_attention(rng):
    # The library's float64 reference backend reads the mask and nothing else differs, so a mask
    # with every block on must give dense attention's bytes — dropout's (seed, offset) included.
    b, s, h, d = 2, 33, 2, 16
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    kw = dict(causal=True, dropout_p=0.3, seed=1234, offset=56, backend="reference")
    dense_out, dense_lse = flare.attention_forward(q, k, v, **kw)
    ones = np.ones((1, 1, 3, 2), np.uint8)
    out, lse = flare.block_sparse_attention_forward(q, k, v, ones, block_size_q=16,
                                                    block_size_k=32, **kw)
    np.testing.assert_array_equal(out, dense_out)
    np.testing.assert_array_equal(lse, dense_lse)
    dout = make(rng, out.shape)
    dense_grads = flare.attention_backward(dout, q, k, v, out, lse, **kw)
    grads = flare.block_sparse_attention_backward(dout, q, k, v, out, lse, ones, block_size_q=16,
                                                  block_size_k=32, **kw)
    for g, dg in zip(grads, dense_grads):
        np.testing.assert_array_equal(g, dg)


# ---- pattern helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows,cols", [(5, 5), (3, 8), (8, 3), (0, 4)])
def test_patterns_follow_their_definitions(rows, cols):
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    for band, global_blocks in [(0, 0), (1, 0), (2, 1), (3, 2)]:
        local = (c - r >= -(band // 2)) & (c - r < band - band // 2)
        expected = local | (r < global_blocks) | (c < global_blocks)
        got = flare.local_global_block_mask(rows, cols, band, global_blocks)
        assert got.dtype == np.uint8 and got.shape == (1, 1, rows, cols)
        np.testing.assert_array_equal(got[0, 0], expected.astype(np.uint8))
    x = r ^ c
    got = flare.butterfly_block_mask(rows, cols)
    np.testing.assert_array_equal(got[0, 0], ((x & (x - 1)) == 0).astype(np.uint8))
    got[...] = 1  # a writable array of the caller's


def test_a_pattern_is_a_block_mask(rng, seed):
    b, s, h, d, block = 1, 64, 2, 16, 8
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    mask = flare.local_global_block_mask(s // block, s // block, 3, 1)
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, block_size_q=block,
                                                    block_size_k=block)
    check(seed, q, k, v, None, mask, block, block, out, lse)


def test_pattern_bad_arguments_are_named():
    cases = [
        (lambda: flare.local_global_block_mask(-1, 4, 1, 0), ValueError, "row_blocks"),
        (lambda: flare.local_global_block_mask(4, -1, 1, 0), ValueError, "col_blocks"),
        (lambda: flare.local_global_block_mask(4, 4, -1, 0), ValueError, "band"),
        (lambda: flare.local_global_block_mask(4, 4, 1, -2), ValueError, "global_blocks"),
        (lambda: flare.local_global_block_mask(4.0, 4, 1, 0), TypeError, "row_blocks"),
        (lambda: flare.local_global_block_mask(4, 4, None, 0), TypeError, "band"),
        (lambda: flare.butterfly_block_mask(4, "4"), TypeError, "col_blocks"),
        (lambda: flare.butterfly_block_mask(True, 4), TypeError, "row_blocks"),
        (lambda: flare.butterfly_block_mask(1 << 20, 1 << 20), ValueError, r"row_blocks × col"),
    ]
    for call, exc, name in cases:
        with pytest.raises(exc, match=rf"^{name}"):
            call()


# ---- bad arguments: the exception type and a message that starts with the argument's name ----

FUNCTIONS = [flare.block_sparse_attn_func, flare.block_sparse_attn_varlen_func,
             flare.block_sparse_attention_forward, flare.block_sparse_attention_backward]

KINDS = dict(bad_args.KINDS, block_mask="block_mask", block_size_q="block_size",
             block_size_k="block_size")
ALIASES = dict(bad_args.ALIASES, block_mask=("block_mask", "mask"))

BAD_VALUES = {
    "block_mask": [("None", None, TypeError), ("list", [[1, 0]], TypeError),
                   ("int", 1, TypeError), ("wrong_dtype", None, ValueError),
                   ("wrong_shape", None, ValueError), ("wrong_rank", None, ValueError)],
    "block_size": [("None", None, TypeError), ("float", 16.0, TypeError),
                   ("str", "16", TypeError), ("bool", True, TypeError),
                   ("zero", 0, ValueError), ("negative", -16, ValueError),
                   ("huge", 1 << 40, ValueError)],
}


def kind_of(fn, name):
    kind = KINDS[name]
    if kind == "cu_seqlens":
        return "tensor" if "varlen" in fn.__name__ else "optional_cu_seqlens"
    return kind


def message_pattern(name):
    return r"^(" + "|".join(ALIASES.get(name, (name,))) + r")(\[\d\])?: "


def valid_call(fn, xp):
    """A valid call of `fn` on small CPU arrays of framework `xp` (numpy or torch), with blocks
    of 4 x 4, and per argument a value of a dtype flare rejects (None where there is none)."""
    gen = np.random.default_rng(0)
    x = lambda *shape: xp.asarray(gen.standard_normal(shape).astype(np.float32))  # noqa: E731
    cu = xp.asarray(np.array([0, 3, 8], np.int32))
    mask = xp.asarray(np.ones((1, 2, 2, 2), np.uint8))
    name = fn.__name__
    if "varlen" in name:
        good = dict(q=x(8, 2, 16), k=x(8, 2, 16), v=x(8, 2, 16), cu_seqlens_q=cu,
                    cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    elif name == "block_sparse_attention_backward":
        q, k, v = x(1, 8, 2, 16), x(1, 8, 2, 16), x(1, 8, 2, 16)
        out, lse = flare.block_sparse_attention_forward(q, k, v, mask, block_size_q=4,
                                                        block_size_k=4)
        good = dict(dout=x(1, 8, 2, 16), q=q, k=k, v=v, out=out, softmax_lse=lse)
    else:
        good = dict(q=x(1, 8, 2, 16), k=x(1, 8, 2, 16), v=x(1, 8, 2, 16))
    good.update(block_mask=mask, block_size_q=4, block_size_k=4)

    def wrong(arg, label):
        if arg == "block_mask":
            return xp.asarray({"wrong_dtype": np.ones((1, 2, 2, 2), np.float64),
                               "wrong_shape": np.ones((1, 2, 3, 2), np.uint8),
                               "wrong_rank": np.ones((2, 2, 2), np.uint8)}[label])
        if arg == "alibi_slopes":
            return xp.asarray(np.full(2, 0.5, np.float64))
        value = good.get(arg)
        if value is None or isinstance(value, (int, float)):
            return None
        as_numpy = np.asarray(value)
        return xp.asarray(as_numpy.astype(np.float32 if as_numpy.dtype == np.int32
                                          else np.float64))

    return good, wrong


def bad_cases(xp):
    out = []
    for fn in FUNCTIONS:
        good, wrong = valid_call(fn, xp)
        for name in inspect.signature(fn).parameters:
            kind = kind_of(fn, name)
            for label, value, exc in BAD_VALUES.get(kind) or bad_args.bad_values(kind):
                if label.startswith("wrong_"):
                    value = wrong(name, label)
                    if value is None:
                        continue
                out.append((fn, name, label, value, exc))
    return out


def test_every_parameter_has_a_kind():
    for fn in FUNCTIONS:
        for name in inspect.signature(fn).parameters:
            assert name in KINDS, f"{fn.__name__}({name}): add it to KINDS"


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_the_valid_calls_run(fn):
    good, _ = valid_call(fn, np)
    fn(**good)


NUMPY_BAD = bad_cases(np)


@pytest.mark.parametrize("fn,name,label,value,exc", NUMPY_BAD,
                         ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in NUMPY_BAD])
def test_every_bad_argument_is_named(fn, name, label, value, exc):
    good, _ = valid_call(fn, np)
    with pytest.raises(exc, match=message_pattern(name)):
        fn(**dict(good, **{name: value}))


def test_a_mask_of_the_wrong_shape_is_explained(rng):
    # The library spells out the shape it expected, and the caller's mask is left as it was.
    q, k, v = (make(rng, (1, 8, 2, 16)) for _ in range(3))
    mask = np.ones((1, 2, 3, 2), np.uint8)
    before = mask.copy()
    with pytest.raises(ValueError, match=r"^mask: shape \(1, 2, 3, 2\) must be .*"
                                         r"ceil\(seqlen_q / block_m\) = ceil\(8 / 4\) = 2"):
        flare.block_sparse_attn_func(q, k, v, mask, 4, 4)
    np.testing.assert_array_equal(mask, before)


# ---- torch -------------------------------------------------------------------------------------

try:
    import torch
except ImportError:  # the NumPy half above runs without it
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def as_numpy(t):
    return t.detach().cpu().numpy()


@needs_torch
@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_against_reference(dtype_name, causal, rng, seed):
    b, s_q, s_k, h, h_kv, d, bq, bk = 2, 37, 45, 4, 2, 32, 16, 8
    dtype, np_dtype = getattr(torch, dtype_name), getattr(np, dtype_name)
    q, k, v = (torch.from_numpy(make(rng, shape, np_dtype)).requires_grad_()
               for shape in ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d)))
    mask = torch.from_numpy(random_mask(rng, (b, h, cdiv(s_q, bq), cdiv(s_k, bk)), 0.5,
                                        np.bool_))
    out = flare.block_sparse_attn_func(q, k, v, mask, bq, bk, causal=causal)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    dout = torch.from_numpy(make(rng, out.shape, np_dtype))
    out.backward(dout)
    # The plain NumPy calls run the same kernels: the same bytes.
    arrays = [as_numpy(x) for x in (q, k, v, dout, mask)]
    np_out, np_lse = flare.block_sparse_attention_forward(
        *arrays[:3], arrays[4], block_size_q=bq, block_size_k=bk, causal=causal)
    np_grads = flare.block_sparse_attention_backward(
        arrays[3], *arrays[:3], np_out, np_lse, arrays[4], block_size_q=bq, block_size_k=bk,
        causal=causal)
    np.testing.assert_array_equal(as_numpy(out), np_out)
    for g, x in zip(np_grads, (q, k, v)):
        np.testing.assert_array_equal(as_numpy(x.grad), g)
    check(seed, *arrays[:4], arrays[4], bq, bk, np_out, np_lse, np_grads, causal=causal)


@needs_torch
def test_torch_varlen_autograd(rng, seed):
    lens_q, lens_k = [3, 0, 40, 17], [9, 4, 33, 30]
    h, h_kv, d, bq, bk = 4, 2, 16, 8, 8
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = torch.from_numpy(make(rng, (cu_q[-1], h, d))).requires_grad_()
    k = torch.from_numpy(make(rng, (cu_k[-1], h_kv, d))).requires_grad_()
    v = torch.from_numpy(make(rng, (cu_k[-1], h_kv, d))).requires_grad_()
    mask = random_mask(rng, (1, h, cdiv(max(lens_q), bq), cdiv(max(lens_k), bk)), 0.6)
    out, lse, _ = flare.block_sparse_attn_varlen_func(
        q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), max(lens_q), max(lens_k),
        torch.from_numpy(mask), bq, bk, causal=True, return_attn_probs=True)
    assert lse.shape == (h, cu_q[-1]) and lse.dtype == torch.float32
    dout = torch.from_numpy(make(rng, out.shape))
    out.backward(dout)
    check(seed, *(as_numpy(x) for x in (q, k, v, dout)), mask, bq, bk, as_numpy(out),
          as_numpy(lse), [as_numpy(x.grad) for x in (q, k, v)], causal=True,
          cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@needs_torch
def test_torch_bfloat16_matches_the_plain_calls(rng):
    # NumPy has no bfloat16 for the reference; the kernel is the one checked above in float16.
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = torch.from_numpy(random_mask(rng, (1, 1, 5, 3), 0.6))
    out = flare.block_sparse_attn_func(q, k, v, mask, 8, 16)
    out.backward(torch.ones_like(out))
    plain_out, lse = flare.block_sparse_attention_forward(q, k, v, mask, block_size_q=8,
                                                          block_size_k=16)
    grads = flare.block_sparse_attention_backward(torch.ones_like(out), q, k, v, plain_out, lse,
                                                  mask, block_size_q=8, block_size_k=16)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


@needs_torch
def test_torch_dropout_draws_from_torch_generator(rng):
    q, k, v = (torch.randn(1, 33, 2, 16, requires_grad=True) for _ in range(3))
    mask = torch.from_numpy(random_mask(rng, (1, 2, 3, 3), 0.7))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = flare.block_sparse_attn_func(q, k, v, mask, 16, 16, dropout_p=0.3, causal=True)
        runs.append((out,) + torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The pair drawn is (seed, offset) from torch's default generator, as for flash_attn_func:
    # the plain calls with it reproduce the forward and the backward.
    torch.manual_seed(7)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    kw = dict(block_size_q=16, block_size_k=16, dropout_p=0.3, causal=True, seed=seed,
              offset=offset)
    out, lse = flare.block_sparse_attention_forward(q, k, v, mask, **kw)
    torch.testing.assert_close(out, runs[0][0], rtol=0, atol=0)
    grads = flare.block_sparse_attention_backward(torch.ones_like(out), q, k, v, out, lse, mask,
                                                  **kw)
    for g, r in zip(grads, runs[0][1:]):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@needs_torch
def test_torch_without_grad_and_non_contiguous_inputs(rng):
    base = torch.randn(1, 24, 2, 32)
    q = base[..., ::2]  # head_dim stride 2: copied to a unit stride, as flash_attn does
    k = v = torch.randn(1, 24, 2, 16)
    mask = torch.from_numpy(random_mask(rng, (1, 1, 3, 3), 0.6))
    with torch.no_grad():
        out = flare.block_sparse_attn_func(q, k, v, mask, 8, 8)
    expected = flare.block_sparse_attn_func(q.contiguous(), k, v, mask, 8, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@needs_torch
def test_torch_compile_fullgraph(rng):
    torch._dynamo.reset()
    mask = torch.from_numpy(random_mask(rng, (1, 2, 4, 4), 0.6))

    def step(q, k, v):
        return flare.block_sparse_attn_func(q * 2, k, v, mask, 16, 16, causal=True).sum()

    inputs = [torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(3)]
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    # aot_eager: the compile itself is the point (the fake kernels and the traced Function).
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    grads = torch.autograd.grad(out, inputs)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@needs_torch
def test_torch_opcheck():
    torch.manual_seed(0)
    q = torch.randn(1, 16, 2, 32)
    k, v = torch.randn(1, 24, 1, 32), torch.randn(1, 24, 1, 32)
    mask = torch.ones(1, 2, 2, 3, dtype=torch.uint8)
    mask_args = (mask, 8, 8)
    options = (None, None, 0, 0, 0.0, 0.0, True, -1, -1, 0.0, None, False, None, 0)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16)
    torch.library.opcheck(torch.ops.flare.block_sparse_fwd.default,
                          (q, k, v, out, lse) + mask_args + options)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    torch.library.opcheck(torch.ops.flare.block_sparse_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse) + grads + mask_args +
                          options)


@needs_torch
def test_torch_operators_match_the_direct_calls(rng):
    """block_sparse_fwd / bwd (C++ kernels where flare/_torch_ops.so was built, else Python)
    against the extension called directly: bitwise equal, with GQA, causal, dropout through
    rng_state and a random mask."""
    from flare import _torch as ft
    torch.manual_seed(0)
    q = torch.randn(2, 40, 4, 32)
    k, v = torch.randn(2, 56, 2, 32), torch.randn(2, 56, 2, 32)
    mask = torch.from_numpy(random_mask(rng, (2, 4, 3, 4), 0.6))
    args = (mask, 16, 16, None, None, 0, 0, 0.1, 0.2, True, -1, -1, 0.0, None, False,
            torch.tensor([7, 11], dtype=torch.int64), 0)
    results = []
    for fwd, bwd in ((torch.ops.flare.block_sparse_fwd, torch.ops.flare.block_sparse_bwd),
                     (ft.run_block_sparse_forward, ft.run_block_sparse_backward)):
        out, lse = ft.forward_outputs(q, False)
        fwd(q, k, v, out, lse, *args)
        dq, dk, dv = ft.backward_outputs(q, k, v)
        bwd(torch.ones_like(out), q, k, v, out, lse, dq, dk, dv, *args)
        results.append((out, lse, dq, dk, dv))
    for a, b in zip(*results):
        assert torch.equal(a, b)


TORCH_BAD = bad_cases(torch) if torch is not None else []


@pytest.mark.parametrize("fn,name,label,value,exc", TORCH_BAD,
                         ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in TORCH_BAD])
@needs_torch
def test_every_bad_torch_argument_is_named(fn, name, label, value, exc):
    good, _ = valid_call(fn, torch)
    if name in ("seed", "stream") and fn.__name__.startswith("block_sparse_attn"):
        exc = ValueError  # any value: these extras are for non-torch arrays
    with pytest.raises(exc, match=message_pattern(name)):
        fn(**dict(good, **{name: value}))


@needs_torch
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_a_numpy_mask_with_torch_tensors_is_named(fn):
    good, _ = valid_call(fn, torch)
    with pytest.raises(TypeError, match=r"^block_mask: numpy\.ndarray is not a torch tensor"):
        fn(**dict(good, block_mask=good["block_mask"].numpy()))


# ---- CUDA ----------------------------------------------------------------------------------------
# The kernels skip whole tiles, so mask blocks are multiples of 128 there. Each case runs torch
# CUDA tensors (float16, which NumPy has for the reference's rounding) through autograd and checks
# them against the masked float64 reference under the tolerance rule. Head dims pick the kernels
# an H100 runs: d 128 / 256 the sm90 ones, d 64 and the score modifiers the sm80 ones, d 80 the
# sm90 forward and the sm80 backward.

CUDA_CASES = [
    # (b, s_q, s_k, h, h_kv, d, block_q, block_k, density, options)
    (2, 300, 400, 4, 2, 128, 128, 128, 0.5, dict()),
    (1, 520, 520, 4, 4, 64, 128, 128, 0.5, dict(causal=True)),
    (1, 384, 640, 2, 1, 80, 256, 128, 0.6, dict(window=(100, 20))),
    (1, 256, 300, 2, 2, 256, 128, 256, 0.7, dict()),
    (2, 200, 260, 2, 2, 32, 128, 128, 0.5, dict(softcap=4.0, alibi=True)),
    (1, 700, 700, 4, 1, 128, 128, 128, 0.3, dict(causal=True)),
]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}"
                         f"-hkv{c[4]}-d{c[5]}-blk{c[6]}x{c[7]}-" + "-".join(sorted(c[9])))
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_against_reference(case, deterministic, rng, seed):
    b, s_q, s_k, h, h_kv, d, bq, bk, density, opts = case
    kw = case_options(rng, b, h, opts)
    arrays = [make(rng, shape, np.float16) for shape in
              ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d), (b, s_q, h, d))]
    mask = random_mask(rng, (b, h, cdiv(s_q, bq), cdiv(s_k, bk)), density)
    mask[:, :, 0, :] = 0  # the first query block sees no key: O = 0, LSE = -inf, dQ = 0
    q, k, v = (torch.from_numpy(x).cuda().requires_grad_() for x in arrays[:3])
    alibi = kw.get("alibi_slopes")
    out, lse, _ = flare.block_sparse_attn_func(
        q, k, v, torch.from_numpy(mask).cuda(), bq, bk, deterministic=deterministic,
        return_attn_probs=True, **dict(flare_options(kw), alibi_slopes=None if alibi is None
                                       else torch.from_numpy(alibi).cuda()))
    out.backward(torch.from_numpy(arrays[3]).cuda())
    check(seed, *arrays, mask, bq, bk, as_numpy(out), as_numpy(lse),
          [as_numpy(x.grad) for x in (q, k, v)], **kw)


@requires_cuda
@pytest.mark.gpu
def test_cuda_varlen_against_reference(rng, seed):
    lens_q, lens_k = [130, 0, 300, 17], [200, 40, 260, 300]
    h, h_kv, d, block = 4, 2, 128, 128
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    arrays = [make(rng, shape, np.float16) for shape in
              ((cu_q[-1], h, d), (cu_k[-1], h_kv, d), (cu_k[-1], h_kv, d), (cu_q[-1], h, d))]
    mask = random_mask(rng, (len(lens_q), h, cdiv(max(lens_q), block), cdiv(max(lens_k), block)),
                       0.6)
    q, k, v = (torch.from_numpy(x).cuda().requires_grad_() for x in arrays[:3])
    out, lse, _ = flare.block_sparse_attn_varlen_func(
        q, k, v, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), max(lens_q),
        max(lens_k), torch.from_numpy(mask).cuda(), block, block, causal=True,
        return_attn_probs=True)
    out.backward(torch.from_numpy(arrays[3]).cuda())
    check(seed, *arrays, mask, block, block, as_numpy(out), as_numpy(lse),
          [as_numpy(x.grad) for x in (q, k, v)], causal=True, cu_seqlens_q=cu_q,
          cu_seqlens_k=cu_k)


@requires_cuda
@pytest.mark.gpu
def test_cuda_all_on_mask_is_dense_attention_and_off_blocks_are_never_read(rng):
    b, s, h, d, block = 1, 640, 4, 128, 128
    q, k, v, dout = (torch.from_numpy(make(rng, (b, s, h, d), np.float16)).cuda()
                     for _ in range(4))

    def run(k, v, mask):  # deterministic: dQ's sums in a fixed order, comparable bit for bit
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = (flare.flash_attn_func(qq, kk, vv, causal=True, deterministic=True) if mask is None
               else flare.block_sparse_attn_func(qq, kk, vv, mask, block, block, causal=True,
                                                 deterministic=True))
        out.backward(dout)
        return [x.detach().cpu() for x in (out, qq.grad, kk.grad, vv.grad)]

    ones = torch.ones(1, 1, s // block, s // block, dtype=torch.uint8, device="cuda")
    for got, want in zip(run(k, v, ones), run(k, v, None)):
        assert torch.equal(got, want)  # the same kernels, every step on
    mask = torch.from_numpy(random_mask(rng, (1, h, s // block, s // block), 0.5)).cuda()
    mask[:, :, :, 2] = 0  # key block 2 is off for every row: NaN there must not arrive
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, 2 * block:3 * block] = float("nan")
    poisoned_v[:, 2 * block:3 * block] = float("inf")
    clean, dirty = run(k, v, mask), run(poisoned_k, poisoned_v, mask)
    for i, (got, want) in enumerate(zip(dirty, clean)):
        if i == 0 or i == 1:  # out, dq: equal bytes
            assert torch.equal(got, want)
        else:  # dk, dv: the off block's rows are 0, the others equal
            assert torch.equal(got[:, 2 * block:3 * block], torch.zeros_like(got[:, :block]))
            assert torch.equal(torch.cat([got[:, :2 * block], got[:, 3 * block:]], 1),
                               torch.cat([want[:, :2 * block], want[:, 3 * block:]], 1))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bq,bk,name", [(64, 128, "block_m"), (128, 192, "block_n")])
def test_cuda_blocks_finer_than_tiles_are_refused_by_name(bq, bk, name):
    q = torch.randn(1, 256, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1, cdiv(256, bq), cdiv(256, bk), dtype=torch.uint8, device="cuda")
    with pytest.raises(NotImplementedError, match=f"^{name}: .*multiple of 128"):
        flare.block_sparse_attn_func(q, q, q, mask, bq, bk)


@needs_torch
def test_every_combination_of_mask_extents_is_accepted(rng):
    # (b | 1, h | 1): all four broadcast forms give the same output as the full mask they stand
    # for.
    b, s, h, d, block = 2, 32, 2, 16, 8
    q, k, v = (torch.from_numpy(make(rng, (b, s, h, d))) for _ in range(3))
    small = random_mask(rng, (1, 1, 4, 4), 0.5)
    for mb, mh in itertools.product((1, b), (1, h)):
        mask = torch.from_numpy(np.broadcast_to(small, (mb, mh, 4, 4)).copy())
        out = flare.block_sparse_attn_func(q, k, v, mask, block, block)
        torch.testing.assert_close(out, flare.block_sparse_attn_func(
            q, k, v, torch.from_numpy(small), block, block), rtol=0, atol=0)
