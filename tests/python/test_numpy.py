"""flare from NumPy on the CPU: every feature against the float64 reference in attention_ref.py,
the flash_attn-compatible functions, bad inputs (the message names the argument), strided and
read-only inputs, float16, dropout against the library's reference backend.

No torch needed. Backends: "auto" (the CPU flash backend) is what users get; "reference" (the
library's float64 ground truth) is checked too, so a mismatch points at the binding or at the
kernel.
"""

import inspect

import numpy as np
import pytest

import attention_ref as ref
import bad_args
import flare
from flare import _ext

BACKENDS = ["auto", "reference"]


def make(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def make_cu_seqlens(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def check_forward(seed, q, k, v, out, lse, **kw):
    dtype = q.dtype
    truth_o, truth_lse, mags = ref.attention(q, k, v, magnitudes=True, **kw)
    naive_o, naive_lse = ref.attention(q, k, v, compute=np.float32, round_to=dtype, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == truth_lse.shape
    ref.check_close("o", out, truth_o, naive_o, dtype, seed, mags["o"])
    ref.check_close("lse", lse, truth_lse, naive_lse, np.float32, seed, mags["lse"])


def check_backward(seed, q, k, v, dout, grads, **kw):
    dtype = q.dtype
    _, _, truth, mags = ref.attention(q, k, v, dout, magnitudes=True, **kw)
    _, _, naive = ref.attention(q, k, v, dout, compute=np.float32, round_to=dtype, **kw)
    for name, got, t, n, x in zip(("dq", "dk", "dv"), grads, truth, naive, (q, k, v)):
        assert got.dtype == dtype and got.shape == x.shape, name
        ref.check_close(name, got, t, n, dtype, seed, mags[name])


# ---- forward and backward against the reference ------------------------------------------------

CASES = [
    # (b, s_q, s_k, h, h_kv, d, options)
    (2, 33, 33, 4, 4, 32, dict()),
    (1, 1, 1, 2, 2, 40, dict()),
    (2, 97, 61, 4, 2, 59, dict(causal=True)),   # s_q > s_k: the first rows see no key
    (2, 17, 97, 8, 1, 40, dict(causal=True)),   # GQA 8:1, bottom-right causal
    (1, 64, 80, 2, 2, 64, dict(window=(16, 4))),
    (1, 50, 50, 2, 1, 16, dict(window=(7, -1))),
    (2, 40, 40, 4, 2, 32, dict(softcap=5.0)),
    (1, 45, 70, 4, 4, 24, dict(causal=True, alibi=True)),
    (2, 30, 30, 3, 3, 16, dict(alibi=True, alibi_batch=True, softmax_scale=0.3)),
    (1, 48, 48, 2, 2, 111, dict(causal=True, softcap=3.0, window=(20, 0), alibi=True)),
]


def case_options(rng, b, h, opts):
    opts = dict(opts)
    kw = dict(causal=opts.pop("causal", False), window=opts.pop("window", (-1, -1)),
              softcap=opts.pop("softcap", 0.0), softmax_scale=opts.pop("softmax_scale", None))
    if opts.pop("alibi", False):
        shape = (b, h) if opts.pop("alibi_batch", False) else (h,)
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    assert not opts, opts
    return kw


def flare_kwargs(kw):
    return dict(causal=kw["causal"], window_size=kw["window"], softcap=kw["softcap"],
                alibi_slopes=kw.get("alibi_slopes"), softmax_scale=kw["softmax_scale"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}"
                         f"-hkv{c[4]}-d{c[5]}-" + "-".join(sorted(c[6])) if c[6] else None)
def test_forward_backward(case, backend, rng, seed):
    b, s_q, s_k, h, h_kv, d, opts = case
    kw = case_options(rng, b, h, opts)
    q, k, v = make(rng, (b, s_q, h, d)), make(rng, (b, s_k, h_kv, d)), make(rng, (b, s_k, h_kv, d))
    out, lse = flare.attention_forward(q, k, v, backend=backend, **flare_kwargs(kw))
    check_forward(seed, q, k, v, out, lse, **kw)
    dout = make(rng, out.shape)
    grads = flare.attention_backward(dout, q, k, v, out, lse, backend=backend,
                                     **flare_kwargs(kw))
    check_backward(seed, q, k, v, dout, grads, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(backend, causal, rng, seed):
    # An empty sequence, a 1-token one, s_q != s_k per sequence, GQA 4:2.
    lens_q = [5, 0, 1, 37, 20]
    lens_k = [9, 3, 1, 30, 41]
    h, h_kv, d = 4, 2, 24
    cu_q, cu_k = make_cu_seqlens(lens_q), make_cu_seqlens(lens_k)
    q = make(rng, (cu_q[-1], h, d))
    k, v = make(rng, (cu_k[-1], h_kv, d)), make(rng, (cu_k[-1], h_kv, d))
    slopes = rng.uniform(0.05, 0.5, (h,)).astype(np.float32)
    kw = dict(causal=causal, alibi_slopes=slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = flare.attention_forward(q, k, v, backend=backend, max_seqlen_q=max(lens_q),
                                       max_seqlen_k=max(lens_k), **{
                                           n: kw[n] for n in ("causal", "alibi_slopes",
                                                              "cu_seqlens_q", "cu_seqlens_k")})
    assert lse.shape == (h, cu_q[-1])
    check_forward(seed, q, k, v, out, lse, **kw)
    dout = make(rng, out.shape)
    # max_seqlen omitted: the Python layer reads it off CPU cu_seqlens.
    grads = flare.attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
    check_backward(seed, q, k, v, dout, grads, **kw)


def test_large_magnitude(rng, seed):
    # Scores of magnitude ~1e3·1e3·scale: the online softmax must not overflow.
    q, k, v = (make(rng, (1, 40, 2, 16), scale=1e3) for _ in range(3))
    out, lse = flare.attention_forward(q, k, v, causal=True)
    check_forward(seed, q, k, v, out, lse, causal=True)


def test_float16(rng, seed):
    q = make(rng, (2, 50, 4, 32), np.float16)
    k = make(rng, (2, 70, 2, 32), np.float16)
    v = make(rng, (2, 70, 2, 32), np.float16)
    out, lse = flare.attention_forward(q, k, v, causal=True)
    assert out.dtype == np.float16
    check_forward(seed, q, k, v, out, lse, causal=True)
    dout = make(rng, out.shape, np.float16)
    grads = flare.attention_backward(dout, q, k, v, out, lse, causal=True)
    check_backward(seed, q, k, v, dout, grads, causal=True)


def test_strided_inputs(rng, seed):
    # q: a (b, h, s, d) array seen as (b, s, h, d); k: a head_dim slice of a wider buffer;
    # v: reversed along the sequence (negative stride; the Python layer copies it);
    # dout: every other element of head_dim (non-unit last stride; copied too).
    b, s, h, d = 2, 29, 3, 16
    q = make(rng, (b, h, s, d)).transpose(0, 2, 1, 3)
    k = make(rng, (b, s, h, 2 * d))[..., :d]
    v = make(rng, (b, s, h, d))[:, ::-1]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out, lse = flare.attention_forward(q, k, v, causal=True)
    check_forward(seed, q, k, v, out, lse, causal=True)
    dout = make(rng, (b, s, h, 2 * d))[..., ::2]
    grads = flare.attention_backward(dout, q, k, v, out, lse, causal=True)
    check_backward(seed, q, k, v, np.ascontiguousarray(dout), grads, causal=True)


def test_read_only_inputs(rng, seed):
    q, k, v = (make(rng, (1, 12, 2, 8)) for _ in range(3))
    for x in (q, k, v):
        x.flags.writeable = False
    out, lse = flare.attention_forward(q, k, v)
    check_forward(seed, q, k, v, out, lse)


# ---- the C ABI contract, seen through the extension --------------------------------------------

def ext_call_args(**over):
    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softmax_scale=0.0, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, seed=0, offset=0, deterministic=False,
                backend=0, stream=0)
    args.update(over)
    return args


def test_every_output_element_written(rng, seed):
    q, k, v = (make(rng, (2, 19, 2, 8)) for _ in range(3))
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((2, 2, 19), np.nan, np.float32)
    _ext.forward(q, k, v, out, lse, **ext_call_args(causal=True))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    check_forward(seed, q, k, v, out, lse, causal=True)


def test_rejected_call_writes_nothing(rng):
    q, k, v = (make(rng, (1, 8, 2, 8)) for _ in range(3))
    out = np.full(q.shape, 7.0, np.float32)
    lse = np.full((1, 2, 8), 7.0, np.float32)
    with pytest.raises(ValueError, match="window_left"):
        _ext.forward(q, k, v, out, lse, **ext_call_args(window_left=-5))
    assert (out == 7.0).all() and (lse == 7.0).all()


# ---- flash_attn-compatible functions ----------------------------------------------------------

def test_flash_attn_functions_agree(rng):
    b, s, h, h_kv, d = 2, 21, 4, 2, 16
    q = make(rng, (b, s, h, d))
    kv = make(rng, (b, s, 2, h_kv, d))
    qkv = make(rng, (b, s, 3, h, d))
    k, v = kv[:, :, 0], kv[:, :, 1]

    out = flare.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    np.testing.assert_array_equal(flare.flash_attn_kvpacked_func(q, kv, causal=True), out)

    o3, lse3, probs = flare.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    assert probs is None and lse3.shape == (b, h, s)
    o3_ref = flare.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    np.testing.assert_array_equal(o3, o3_ref)

    # The varlen forms over the same tokens, packed.
    cu = make_cu_seqlens([s] * b)
    packed = lambda x: x.reshape((b * s,) + x.shape[2:])  # noqa: E731
    ov = flare.flash_attn_varlen_func(packed(q), packed(k), packed(v), cu, cu, s, s, causal=True)
    np.testing.assert_allclose(ov.reshape(out.shape), out, rtol=0, atol=1e-6)
    ov, lse_v, _ = flare.flash_attn_varlen_kvpacked_func(packed(q), packed(kv), cu, cu, s, s,
                                                         causal=True, return_attn_probs=True)
    assert lse_v.shape == (h, b * s)
    np.testing.assert_allclose(ov.reshape(out.shape), out, rtol=0, atol=1e-6)
    ov = flare.flash_attn_varlen_qkvpacked_func(packed(qkv), cu, s, causal=True)
    np.testing.assert_allclose(ov.reshape(o3.shape), o3, rtol=0, atol=1e-6)


def test_softmax_scale_and_window_semantics(rng, seed):
    q, k, v = (make(rng, (1, 30, 2, 8)) for _ in range(3))
    out = flare.flash_attn_func(q, k, v, softmax_scale=0.7, window_size=(5, 2))
    truth, _ = ref.attention(q, k, v, softmax_scale=0.7, window=(5, 2))
    naive, _ = ref.attention(q, k, v, softmax_scale=0.7, window=(5, 2), compute=np.float32,
                             round_to=np.float32)
    ref.check_close("o", out, truth, naive, np.float32, seed)


# ---- dropout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("varlen", [False, True])
def test_dropout_matches_reference_backend(varlen, rng, seed):
    b, s, h, d = 2, 37, 2, 16
    q, k, v = (make(rng, (b, s, h, d)) for _ in range(3))
    kw = dict(dropout_p=0.3, seed=seed, offset=12345, causal=True)
    if varlen:
        cu = make_cu_seqlens([s] * b)
        q, k, v = (x.reshape(b * s, h, d) for x in (q, k, v))
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    out, lse = flare.attention_forward(q, k, v, **kw)
    out_ref, lse_ref = flare.attention_forward(q, k, v, backend="reference", **kw)
    # The reference rounds float64 results to float32; the flash backend accumulates in float32.
    # Their distance is bounded like any fp32 kernel against the truth (no dropout-free
    # NumPy model exists for the Philox mask, so the library's reference is the truth here).
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")
    dout = make(rng, out.shape)
    grads = flare.attention_backward(dout, q, k, v, out, lse, **kw)
    grads_ref = flare.attention_backward(dout, q, k, v, out_ref, lse_ref, backend="reference",
                                         **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=f"{name}, seed {seed}")

    # The mask is a pure function of (seed, offset): same pair, same output; new seed, new mask.
    again, _ = flare.attention_forward(q, k, v, **kw)
    np.testing.assert_array_equal(again, out)
    other, _ = flare.attention_forward(q, k, v, **dict(kw, seed=seed + 1))
    assert not np.array_equal(other, out)
    no_drop, _ = flare.attention_forward(q, k, v, **dict(kw, dropout_p=0.0))
    assert not np.array_equal(no_drop, out)


def test_dropout_seed_argument(rng):
    q, k, v = (make(rng, (1, 16, 2, 8)) for _ in range(3))
    a = flare.flash_attn_func(q, k, v, dropout_p=0.5, seed=3)
    b = flare.flash_attn_func(q, k, v, dropout_p=0.5, seed=3)
    np.testing.assert_array_equal(a, b)
    np.random.seed(11)
    c = flare.flash_attn_func(q, k, v, dropout_p=0.5)
    np.random.seed(11)
    d = flare.flash_attn_func(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(c, d)


# ---- bad inputs: the exception type and a message that names the argument ---------------------

def _qkv(rng, b=1, s=8, h=4, h_kv=4, d=16, dtype=np.float32):
    return make(rng, (b, s, h, d), dtype), make(rng, (b, s, h_kv, d), dtype), \
        make(rng, (b, s, h_kv, d), dtype)


BAD_FIXED = [
    # (what to change, expected exception, regex the message must match)
    ("k_heads_3", ValueError, r"^k: heads = 3 must divide q's heads = 4"),
    ("k_head_dim", ValueError, r"^k: head_dim = 8 must equal q's head_dim = 16"),
    ("q_3d", ValueError, r"^q: expected 4 dimensions"),
    ("q_5d", ValueError, r"^q: expected at most 4 dimensions"),
    ("q_float64", ValueError, r"^q: dtype float64 is not supported"),
    ("k_float16", ValueError, r"^k: dtype float16 differs from q's dtype float32"),
    ("v_int32", ValueError, r"^v: dtype int32"),
    ("v_seqlen", ValueError, r"^v: shape"),
    ("k_batch", ValueError, r"^k: "),
    ("head_dim_300", ValueError, r"^q: head_dim = 300"),
    ("window_left", ValueError, r"^window_left: must be >= -1"),
    ("window_right", ValueError, r"^window_right: must be >= -1"),
    ("window_size_scalar", ValueError, r"^window_size: expected a pair"),
    ("softcap", ValueError, r"^softcap: "),
    ("softmax_scale_nan", ValueError, r"^softmax_scale: "),
    ("softmax_scale_zero", ValueError, r"^softmax_scale: "),
    ("dropout_p", ValueError, r"^dropout_p: must be in \[0, 1\)"),
    ("alibi_shape", ValueError, r"^alibi_slopes: shape"),
    ("alibi_dtype", ValueError, r"^alibi_slopes: dtype"),
    ("backend", ValueError, r"^backend: "),
]


@pytest.mark.parametrize("bad,exc,pattern", BAD_FIXED, ids=[b[0] for b in BAD_FIXED])
def test_bad_inputs(bad, exc, pattern, rng):
    q, k, v = _qkv(rng)
    kw = {}
    if bad == "k_heads_3":
        k, v = _qkv(rng, h_kv=3)[1:]
    elif bad == "k_head_dim":
        k, v = _qkv(rng, d=8)[1:]
    elif bad == "q_3d":
        q = q[0]
    elif bad == "q_5d":
        q = q[None]
    elif bad == "q_float64":
        q = q.astype(np.float64)
    elif bad == "k_float16":
        k = k.astype(np.float16)
    elif bad == "v_int32":
        v = v.astype(np.int32)
    elif bad == "v_seqlen":
        v = make(rng, (1, 9, 4, 16))
    elif bad == "k_batch":
        k, v = _qkv(rng, b=2)[1:]
    elif bad == "head_dim_300":
        q, k, v = _qkv(rng, d=300)
    elif bad == "window_left":
        kw["window_size"] = (-2, 0)
    elif bad == "window_right":
        kw["window_size"] = (0, -7)
    elif bad == "window_size_scalar":
        kw["window_size"] = 3
    elif bad == "softcap":
        kw["softcap"] = -1.0
    elif bad == "softmax_scale_nan":
        kw["softmax_scale"] = float("nan")
    elif bad == "softmax_scale_zero":
        kw["softmax_scale"] = 0.0
    elif bad == "dropout_p":
        kw["dropout_p"] = 1.0
    elif bad == "alibi_shape":
        kw["alibi_slopes"] = np.ones(3, np.float32)
    elif bad == "alibi_dtype":
        kw["alibi_slopes"] = np.ones(4, np.float64)
    elif bad == "backend":
        kw["backend"] = "fastest"
    with pytest.raises(exc, match=pattern):
        flare.flash_attn_func(q, k, v, **kw)


BAD_VARLEN = [
    ("cu_dtype", r"^cu_seqlens_q: dtype"),
    ("cu_float", r"^cu_seqlens_q: dtype"),
    ("cu_decreasing", r"^cu_seqlens_k: must be non-decreasing"),
    ("cu_total", r"^cu_seqlens_q\[batch\] = 7 must equal the packed token count 8"),
    ("cu_length", r"^cu_seqlens_k: length 2 must be batch \+ 1 = 3"),
    ("max_seqlen_small", r"^max_seqlen_q: 2 is smaller than sequence"),
    ("q_4d", r"^q: expected 3 dimensions"),
]


@pytest.mark.parametrize("bad,pattern", BAD_VARLEN, ids=[b[0] for b in BAD_VARLEN])
def test_bad_varlen_inputs(bad, pattern, rng):
    q, k, v = (make(rng, (8, 2, 8)) for _ in range(3))
    cu_q = np.array([0, 3, 8], np.int32)
    cu_k = np.array([0, 4, 8], np.int32)
    max_q, max_k = 5, 5
    if bad == "cu_dtype":
        cu_q = cu_q.astype(np.int64)
    elif bad == "cu_float":
        cu_q = cu_q.astype(np.float32)
    elif bad == "cu_decreasing":
        cu_k = np.array([0, 9, 8], np.int32)
        max_k = 10
    elif bad == "cu_total":
        cu_q = np.array([0, 3, 7], np.int32)
    elif bad == "cu_length":
        cu_k = np.array([0, 8], np.int32)
    elif bad == "max_seqlen_small":
        max_q = 2
    elif bad == "q_4d":
        q = q[None]
    with pytest.raises(ValueError, match=pattern):
        flare.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)


def test_bad_packed_shapes(rng):
    with pytest.raises(ValueError, match=r"^qkv: expected dimension 2 of size 3"):
        flare.flash_attn_qkvpacked_func(make(rng, (1, 8, 2, 4, 16)))
    with pytest.raises(ValueError, match=r"^kv: expected dimension 1 of size 2"):
        flare.flash_attn_varlen_kvpacked_func(make(rng, (8, 4, 16)), make(rng, (8, 3, 4, 16)),
                                              np.array([0, 8], np.int32),
                                              np.array([0, 8], np.int32), 8, 8)


def test_bad_backward_inputs(rng):
    q, k, v = _qkv(rng)
    out, lse = flare.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"^dout: shape"):
        flare.attention_backward(out[:, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"^lse: shape"):
        flare.attention_backward(out, q, k, v, out, lse[:, :2])
    with pytest.raises(ValueError, match=r"^lse: dtype must be float32"):
        flare.attention_backward(out, q, k, v, out, lse.astype(np.float16))


def test_exception_types_follow_status_codes():
    # Status codes map onto Python exceptions; NotImplementedError is a RuntimeError, so a
    # caller catching RuntimeError sees unsupported requests and device errors alike.
    assert issubclass(NotImplementedError, RuntimeError)
    assert flare.__version__ == _ext.version()
    assert isinstance(flare.cuda_built(), bool)


def test_jax_cpu_arrays(rng, seed):
    jax = pytest.importorskip("jax")
    q, k, v = (make(rng, (1, 16, 2, 8)) for _ in range(3))
    # Where JAX also has a GPU its default device is that GPU; this test is about CPU arrays.
    cpu = jax.devices("cpu")[0]
    out, lse = flare.attention_forward(*(jax.device_put(x, cpu) for x in (q, k, v)), causal=True)
    assert type(out).__module__.startswith("jax")
    check_forward(seed, q, k, v, np.asarray(out), np.asarray(lse), causal=True)


# ---- every bad argument of every public function ----------------------------------------------

def numpy_call(fn):
    """A valid call of `fn` on small NumPy arrays (as keyword arguments) and, per tensor
    argument, an array of the same shape in a dtype flare rejects."""
    rng = np.random.default_rng(0)
    x = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    cu = np.array([0, 3, 8], np.int32)
    name = fn.__name__
    if name in ("attention_forward", "flash_attn_func"):
        good = dict(q=x(1, 8, 2, 16), k=x(1, 8, 2, 16), v=x(1, 8, 2, 16))
    elif name == "attention_backward":
        q, k, v = x(1, 8, 2, 16), x(1, 8, 2, 16), x(1, 8, 2, 16)
        out, lse = flare.attention_forward(q, k, v)
        good = dict(dout=x(1, 8, 2, 16), q=q, k=k, v=v, out=out, softmax_lse=lse)
    elif name == "flash_attn_qkvpacked_func":
        good = dict(qkv=x(1, 8, 3, 2, 16))
    elif name == "flash_attn_kvpacked_func":
        good = dict(q=x(1, 8, 2, 16), kv=x(1, 8, 2, 2, 16))
    elif name == "flash_attn_varlen_func":
        good = dict(q=x(8, 2, 16), k=x(8, 2, 16), v=x(8, 2, 16), cu_seqlens_q=cu,
                    cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    elif name == "flash_attn_varlen_qkvpacked_func":
        good = dict(qkv=x(8, 3, 2, 16), cu_seqlens=cu, max_seqlen=5)
    else:
        assert name == "flash_attn_varlen_kvpacked_func"
        good = dict(q=x(8, 2, 16), kv=x(8, 2, 2, 16), cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=5, max_seqlen_k=5)

    def wrong_dtype(arg):
        if arg == "alibi_slopes":
            return np.full(2, 0.5, np.float64)
        value = good.get(arg)
        if not isinstance(value, np.ndarray):
            return None
        return value.astype(np.float32 if value.dtype == np.int32 else np.float64)

    return good, wrong_dtype


BAD_ARGS = bad_args.cases(numpy_call)


def test_every_parameter_has_a_kind():
    for fn in bad_args.PUBLIC_FUNCTIONS:
        for name in inspect.signature(fn).parameters:
            assert name in bad_args.KINDS, f"{fn.__name__}({name}): add it to bad_args.KINDS"


@pytest.mark.parametrize("fn", bad_args.PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_the_valid_calls_run(fn):
    # The bad-argument cases change one argument of these calls: each must run as it is.
    good, _ = numpy_call(fn)
    fn(**good)


@pytest.mark.parametrize("fn,name,label,value,exc", BAD_ARGS,
                         ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in BAD_ARGS])
def test_every_bad_argument_is_named(fn, name, label, value, exc):
    good, _ = numpy_call(fn)
    with pytest.raises(exc, match=bad_args.message_pattern(name)):
        fn(**dict(good, **{name: value}))


def test_mixed_frameworks_are_refused():
    cupy_like = type("ndarray", (), {"__module__": "cupy", "__dlpack__": lambda self: None})()
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match=r"^k: cupy\.ndarray is not a NumPy .* like q"):
        flare.flash_attn_func(q, cupy_like, q)


def test_block_table_is_not_supported(rng):
    q, k, v = (make(rng, (8, 2, 16)) for _ in range(3))
    cu = np.array([0, 8], np.int32)
    with pytest.raises(NotImplementedError, match="^block_table: "):
        flare.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, block_table=np.zeros((1, 1), np.int32))


# ---- empty tensors ----------------------------------------------------------------------------

EMPTY_CASES = [
    # (b, s_q, s_k): NumPy 2 gives every one of these arrays the strides (0, 0, 0, 0)
    (2, 0, 5), (2, 5, 0), (0, 5, 5), (2, 0, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", EMPTY_CASES, ids=lambda s: f"b{s[0]}-sq{s[1]}-sk{s[2]}")
def test_empty_tensors(shape, causal, backend, rng, seed):
    b, s_q, s_k = shape
    h, h_kv, d = 4, 2, 16
    q, k, v = make(rng, (b, s_q, h, d)), make(rng, (b, s_k, h_kv, d)), make(rng, (b, s_k, h_kv, d))
    out, lse = flare.attention_forward(q, k, v, causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, s_q) and lse.dtype == np.float32
    # A query that sees no key: O = 0, LSE = -inf (the library's convention).
    if s_k == 0:
        assert (out == 0).all() and (lse == -np.inf).all()
    elif out.size:
        check_forward(seed, q, k, v, out, lse, causal=causal)
    dout = make(rng, out.shape)
    dq, dk, dv = flare.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                          backend=backend)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # No query (s_q = 0) gives every key a zero gradient; no key gives every query one.
    if s_q == 0:
        assert (dk == 0).all() and (dv == 0).all()
    if s_k == 0:
        assert (dq == 0).all()


def test_empty_outputs_are_written(rng):
    # With s_k = 0 every row sees no key: o and lse are still written (0 and -inf), and with
    # s_q = 0 dk and dv are zero. Poisoned outputs show an element left unwritten.
    q = make(rng, (2, 3, 2, 8))
    k = np.zeros((2, 0, 2, 8), np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((2, 2, 3), np.nan, np.float32)
    _ext.forward(q, k, k, out, lse, **ext_call_args())
    assert (out == 0).all() and (lse == -np.inf).all()
    q0 = np.zeros((2, 0, 2, 8), np.float32)
    k = make(rng, (2, 3, 2, 8))
    dk, dv = (np.full(k.shape, np.nan, np.float32) for _ in range(2))
    dq = np.zeros_like(q0)
    _ext.backward(q0, q0, k, k, q0, np.zeros((2, 2, 0), np.float32), dq, dk, dv,
                  **ext_call_args())
    assert (dk == 0).all() and (dv == 0).all()


def test_empty_strided_and_sliced_views(rng, seed):
    # Empty views of larger buffers keep those buffers' strides; negative ones too.
    q = make(rng, (2, 6, 4, 16))
    k = make(rng, (2, 6, 4, 32))[:, :0, :, :16]
    v = make(rng, (2, 6, 4, 16))[:, 6:0:-1][:, :0]
    out, lse = flare.attention_forward(q, k, v)
    assert (out == 0).all() and (lse == -np.inf).all()
    out = flare.flash_attn_func(q[:, :0], make(rng, (2, 6, 4, 16)), make(rng, (2, 6, 4, 16)))
    assert out.shape == (2, 0, 4, 16)


@pytest.mark.parametrize("lens", [[0, 0], [], [3, 0]], ids=["all_empty", "batch0", "k_empty"])
def test_empty_varlen(lens, rng):
    h, d = 2, 8
    lens_k = [0] * len(lens) if lens == [3, 0] else lens
    cu_q, cu_k = make_cu_seqlens(lens), make_cu_seqlens(lens_k)
    q = make(rng, (int(cu_q[-1]), h, d))
    k, v = make(rng, (int(cu_k[-1]), h, d)), make(rng, (int(cu_k[-1]), h, d))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = flare.attention_forward(q, k, v, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert (out == 0).all() and (lse == -np.inf).all()
    dq, dk, dv = flare.attention_backward(make(rng, out.shape), q, k, v, out, lse, **kw)
    assert dq.shape == q.shape and (dq == 0).all() and dk.shape == k.shape


def test_zero_heads_or_head_dim_are_rejected(rng):
    # No heads or an empty head_dim is not an empty batch but a malformed one: the library
    # names it.
    with pytest.raises(ValueError, match=r"^q: heads = 0 must be >= 1"):
        flare.flash_attn_func(*(np.zeros((1, 4, 0, 8), np.float32) for _ in range(3)))
    with pytest.raises(ValueError, match=r"^q: head_dim = 0"):
        flare.flash_attn_func(*(np.zeros((1, 4, 2, 0), np.float32) for _ in range(3)))


# ---- dropout seeds: drawn when not given, returned for the backward ----------------------------

def test_dropout_draws_a_fresh_seed_per_call(rng):
    q, k, v = (make(rng, (1, 32, 2, 16)) for _ in range(3))
    a, _, state_a = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    b, _, state_b = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    assert state_a != state_b and not np.array_equal(a, b)
    assert all(isinstance(x, int) for x in state_a) and state_a[1] == 0
    assert not np.array_equal(flare.flash_attn_func(q, k, v, dropout_p=0.5),
                              flare.flash_attn_func(q, k, v, dropout_p=0.5))


def test_drawn_seed_reproduces_forward_and_backward(rng, seed):
    q, k, v = (make(rng, (2, 24, 2, 16)) for _ in range(3))
    kw = dict(dropout_p=0.3, causal=True)
    out, lse, (drawn, offset) = flare.attention_forward(q, k, v, return_rng_state=True, **kw)
    again, lse_again = flare.attention_forward(q, k, v, seed=drawn, offset=offset, **kw)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(lse_again, lse)
    # The backward regenerates the forward's mask from the returned pair: its gradients are the
    # reference backend's for the same pair (another seed would give another mask).
    dout = make(rng, out.shape)
    grads = flare.attention_backward(dout, q, k, v, out, lse, seed=drawn, offset=offset, **kw)
    out_ref, lse_ref = flare.attention_forward(q, k, v, seed=drawn, offset=offset,
                                               backend="reference", **kw)
    grads_ref = flare.attention_backward(dout, q, k, v, out_ref, lse_ref, seed=drawn,
                                         offset=offset, backend="reference", **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=f"{name}, seed {seed}")
    other = flare.attention_backward(dout, q, k, v, out, lse, seed=drawn + 1, offset=offset, **kw)
    assert not np.array_equal(other[2], grads[2])


def test_drawn_seed_follows_numpy_random_seed(rng):
    q, k, v = (make(rng, (1, 16, 2, 8)) for _ in range(3))
    np.random.seed(7)
    a, _, state_a = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    np.random.seed(7)
    b, _, state_b = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    assert state_a == state_b
    np.testing.assert_array_equal(a, b)


def test_no_dropout_draws_nothing(rng):
    q, k, v = (make(rng, (1, 16, 2, 8)) for _ in range(3))
    before = np.random.get_state()[1].copy()
    _, _, state = flare.attention_forward(q, k, v, return_rng_state=True)
    assert state == (0, 0)
    np.testing.assert_array_equal(np.random.get_state()[1], before)


def test_backward_with_dropout_needs_the_seed(rng):
    q, k, v = (make(rng, (1, 16, 2, 8)) for _ in range(3))
    out, lse = flare.attention_forward(q, k, v, dropout_p=0.2, seed=5)
    with pytest.raises(ValueError, match=r"^seed: required when dropout_p > 0"):
        flare.attention_backward(out, q, k, v, out, lse, dropout_p=0.2)
    flare.attention_backward(out, q, k, v, out, lse, dropout_p=0.2, seed=5)
