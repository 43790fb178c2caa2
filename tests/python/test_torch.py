"""flare from PyTorch: autograd through flare's kernels, torch.compile, streams, errors.

Skipped unless torch is importable. Every test runs on the CPU (the CPU flash backend) and, where
torch sees a GPU, on CUDA; a CUDA test skips with the library's own message while flare reports
the CUDA kernels unsupported (a build without CUDA, or kernels not written yet).

Truth is PyTorch's math attention in a wider type (float64 on the CPU, float32 on CUDA: the
"fp32 upcast"); the error budget is the same attention computed naively in the input dtype
(docs/architecture.md, "Tolerance rule": max|flare − truth| ≤ 2·max|naive − truth| + floor).
"""

import contextlib
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flare  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE_PARAMS = [pytest.param(d, marks=pytest.mark.gpu) if d == "cuda" else d for d in DEVICES]


@contextlib.contextmanager
def cuda_may_be_unsupported(device):
    try:
        yield
    except NotImplementedError as e:
        if device == "cuda":
            pytest.skip(f"flare reports CUDA unsupported: {e}")
        raise


def dtypes_for(device):
    # float32 is covered against a sequential-sum naive model in test_numpy.py; against torch's
    # BLAS-summed float32 the "2 × naive" budget would measure summation order, not the kernel.
    return [torch.bfloat16, torch.float16]


def wide(device):
    return torch.float32 if device == "cuda" else torch.float64


# ---- references -------------------------------------------------------------------------------

def visible(s_q, s_k, causal, window, device):
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= pos + right
    if left >= 0:
        keep &= j >= pos - left
    return keep, (pos - j).abs()


def sdpa_reference(q, k, v, *, causal=False, window=(-1, -1), dtype=None):
    """torch's math SDPA on (b, s, h, d) tensors, with GQA by repetition and flare's
    bottom-right mask as an explicit boolean mask."""
    dtype = dtype or q.dtype
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    keep, _ = visible(q.shape[2], k.shape[2], causal, window, q.device)
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return o.transpose(1, 2)


def manual_reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                     dtype=None):
    """The definition (flare/attention.h) in torch ops: for softcap and ALiBi, which SDPA lacks."""
    dtype = dtype or q.dtype
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    keep, dist = visible(q.shape[1], k.shape[1], causal, window, q.device)
    if alibi is not None:
        s = s - alibi.to(dtype)[None, :, None, None] * dist
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def assert_within_budget(name, got, truth, naive, dtype, seed):
    got, truth, naive = (x.double() for x in (got, truth, naive))
    err = (got - truth).abs().max().item()
    naive_err = (naive - truth).abs().max().item()
    floor = torch.finfo(dtype).eps * truth.abs().max().item()
    assert err <= 2 * naive_err + floor, \
        f"{name}: max error {err:.3g} > 2·naive {naive_err:.3g} + floor {floor:.3g} (seed {seed})"


def grads_of(fn, inputs, dout):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(dout)
    return out.detach(), [x.grad for x in inputs]


def check_against(fn_flare, fn_ref, inputs, dtype, device, seed, fn_naive=None):
    """fn_ref(dtype=wide) is the truth; fn_naive (default fn_ref) in `dtype` sets the budget."""
    fn_naive = fn_naive or fn_ref
    dout = torch.randn(fn_ref(*inputs, dtype=dtype).shape, dtype=dtype, device=device)
    with cuda_may_be_unsupported(device):
        out, grads = grads_of(fn_flare, inputs, dout)
    truth, truth_grads = grads_of(lambda *x: fn_ref(*x, dtype=wide(device)), inputs, dout)
    naive, naive_grads = grads_of(lambda *x: fn_naive(*x, dtype=dtype), inputs, dout)
    assert out.dtype == dtype
    assert_within_budget("out", out, truth, naive, dtype, seed)
    for name, g, t, n in zip(("dq", "dk", "dv"), grads, truth_grads, naive_grads):
        assert g.dtype == dtype
        assert_within_budget(name, g, t, n, dtype, seed)


def rand(shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device)


# ---- forward / backward -----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 128, 128, 4, 4, 64), (1, 97, 200, 8, 1, 128),
                                   (2, 65, 65, 4, 2, 40)],
                         ids=["mha", "gqa8-sq<sk", "gqa2-d40"])
def test_against_sdpa_math(device, causal, shape, seed):
    b, s_q, s_k, h, h_kv, d = shape
    for dtype in dtypes_for(device):
        torch.manual_seed(seed)
        inputs = [rand((b, s_q, h, d), dtype, device), rand((b, s_k, h_kv, d), dtype, device),
                  rand((b, s_k, h_kv, d), dtype, device)]
        # The naive budget comes from the written-out reference: SDPA's math backend may
        # upcast reduced precision internally, which would hide the error of a bf16 kernel.
        check_against(lambda q, k, v: flare.flash_attn_func(q, k, v, causal=causal),
                      lambda q, k, v, dtype: sdpa_reference(q, k, v, causal=causal, dtype=dtype),
                      inputs, dtype, device, seed,
                      lambda q, k, v, dtype: manual_reference(q, k, v, causal=causal,
                                                              dtype=dtype))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("feature", ["window", "softcap", "alibi"])
def test_features(device, feature, seed):
    dtype = dtypes_for(device)[0]
    torch.manual_seed(seed)
    b, s, h, d = 2, 96, 4, 64
    inputs = [rand((b, s, h, d), dtype, device) for _ in range(3)]
    kw = {}
    if feature == "window":
        kw = dict(window=(24, 8))
    elif feature == "softcap":
        kw = dict(softcap=4.0, causal=True)
    else:
        kw = dict(alibi=torch.rand(h, device=device) * 0.3 + 0.05, causal=True)
    flare_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                    softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"))
    check_against(lambda q, k, v: flare.flash_attn_func(q, k, v, **flare_kw),
                  lambda q, k, v, dtype: manual_reference(q, k, v, dtype=dtype, **kw),
                  inputs, dtype, device, seed)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_varlen_autograd(device, seed):
    dtype = dtypes_for(device)[0]
    torch.manual_seed(seed)
    lens_q, lens_k = [3, 0, 50, 17], [9, 4, 50, 30]
    h, h_kv, d = 4, 2, 64
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                        device=device)
    inputs = [rand((sum(lens_q), h, d), dtype, device), rand((sum(lens_k), h_kv, d), dtype, device),
              rand((sum(lens_k), h_kv, d), dtype, device)]

    def per_sequence(q, k, v, dtype):
        outs = []
        for i in range(len(lens_q)):
            sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            if lens_q[i]:
                outs.append(manual_reference(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                             dtype=dtype)[0])
        return torch.cat(outs)

    check_against(lambda q, k, v: flare.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True), per_sequence, inputs, dtype,
        device, seed)
    with cuda_may_be_unsupported(device):
        out, lse, probs = flare.flash_attn_varlen_func(*inputs, cu_q, cu_k, max(lens_q),
                                                       max(lens_k), return_attn_probs=True)
    assert probs is None and lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_packed_functions_match_unpacked(device):
    dtype = dtypes_for(device)[0]
    torch.manual_seed(0)
    b, s, h, d = 2, 40, 4, 32
    qkv = rand((b, s, 3, h, d), dtype, device).requires_grad_()
    with cuda_may_be_unsupported(device):
        out = flare.flash_attn_qkvpacked_func(qkv, causal=True)
        out.sum().backward()
        q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
        out2 = flare.flash_attn_func(q, k, v, causal=True)
        out2.sum().backward()
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2), rtol=0, atol=0)


# ---- torch.compile and the custom op ----------------------------------------------------------

class TinyAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads)
        y = flare.flash_attn_qkvpacked_func(qkv, causal=True)
        return self.proj(y.reshape(b, s, dim))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_compile_fullgraph(device):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TinyAttention(128, 4).to(device)
    x = torch.randn(2, 64, 128, device=device)
    with cuda_may_be_unsupported(device):
        eager = model(x)
        eager.sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        # Inductor on CUDA; on the CPU the compile itself is the point (register_fake and
        # register_autograd under AOTAutograd), so aot_eager keeps a 2-core run short.
        backend = "inductor" if device == "cuda" else "aot_eager"
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        out = compiled(x)
        out.sum().backward()
    # The same kernels run in both; only the compiled projections may sum in another order.
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_opcheck(device):
    torch.manual_seed(0)
    # The CUDA kernels take fp16/bf16 (as FlashAttention does); the CPU backend takes fp32 too.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # The operators are the graph-level steps; autograd is flash_attn_func's (the autograd.Function
    # that torch.compile traces into them), so they are checked without gradients.
    q = torch.randn(1, 16, 2, 32, device=device, dtype=dtype)
    k = torch.randn(1, 24, 1, 32, device=device, dtype=dtype)
    v = torch.randn(1, 24, 1, 32, device=device, dtype=dtype)
    options = (None, None, 0, 0, 0.0, 0.0, True, -1, -1, 0.0, None, False, None, 0)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16, device=device)
    with cuda_may_be_unsupported(device):
        torch.library.opcheck(torch.ops.flare.fwd.default, (q, k, v, out, lse) + options)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        torch.library.opcheck(torch.ops.flare.bwd.default,
                              (torch.randn_like(out), q, k, v, out, lse) + grads + options)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_operator_kernels_match_the_direct_calls(device):
    """torch.ops.flare.fwd / bwd (C++ kernels where flare/_torch_ops.so was built, else Python)
    against the extension called directly: bitwise equal with GQA, a causal window, dropout
    seeded through rng_state and packed sequences, on a side stream where CUDA runs; a refused
    dtype raises ValueError naming the argument on both roads."""
    from flare import _torch as ft
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    total, h, h_kv, d = 45, 4, 2, 32
    q = torch.randn(total, h, d, device=device, dtype=dtype)
    k, v = (torch.randn(total, h_kv, d, device=device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, 17, 17, 45], dtype=torch.int32, device=device)
    rng_state = torch.tensor([123, -5], dtype=torch.int64)
    options = (cu, cu, 28, 28, 0.2, 0.17, True, 9, 0, 0.0, None, False, rng_state, 0)
    side_stream = (torch.cuda.stream(torch.cuda.Stream()) if device == "cuda"
                   else contextlib.nullcontext())
    with cuda_may_be_unsupported(device), side_stream:
        results = []
        for fwd, bwd in ((torch.ops.flare.fwd, torch.ops.flare.bwd),
                         (ft.run_forward, ft.run_backward)):
            out, lse = ft.forward_outputs(q, True)
            fwd(q, k, v, out, lse, *options)
            dout = torch.randn(out.shape, generator=torch.Generator(device).manual_seed(1),
                               device=device, dtype=dtype)
            dq, dk, dv = ft.backward_outputs(q, k, v)
            bwd(dout, q, k, v, out, lse, dq, dk, dv, *options)
            results.append((out, lse, dq, dk, dv))
        for a, b in zip(*results):
            assert torch.equal(a, b)
        for fwd in (torch.ops.flare.fwd, ft.run_forward):
            out, lse = ft.forward_outputs(q, True)
            with pytest.raises(ValueError, match="^q: dtype float64 is not supported"):
                fwd(q.double(), k, v, out, lse, *options)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", ["gqa_window_dropout_packed", "softcap_alibi", "expanded_grad"])
def test_cpp_autograd_matches_the_python_function(device, case):
    """flash_attn_func's eager road where flare/_torch_ops.so was built (torch.ops.flare.attention,
    autograd in C++) against the Python autograd.Function that torch.compile traces: outputs and
    gradients bitwise equal, the gradient arriving as autograd hands it over (an expanded one has
    stride 0); under inference_mode the forward alone; the graph node is C++ there."""
    from flare import _core, _torch as ft
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h, h_kv, d = 4, 2, 32
    cu = None
    if case == "gqa_window_dropout_packed":
        total = 45
        q = torch.randn(total, h, d, device=device, dtype=dtype)
        k, v = (torch.randn(total, h_kv, d, device=device, dtype=dtype) for _ in range(2))
        cu = torch.tensor([0, 17, 17, 45], dtype=torch.int32, device=device)
        options = _core.Options(softmax_scale=None, causal=True, window_size=(9, 0), softcap=0.0,
                                dropout_p=0.2, deterministic=False, backend="auto")
        seqlens, slopes = (28, 28), None
    else:
        q = torch.randn(2, 19, h, d, device=device, dtype=dtype)
        k, v = (torch.randn(2, 23, h_kv, d, device=device, dtype=dtype) for _ in range(2))
        options = _core.Options(softmax_scale=0.2, causal=case == "softcap_alibi",
                                window_size=(-1, -1), softcap=5.0 if case == "softcap_alibi" else 0.0,
                                dropout_p=0.0, deterministic=True, backend="auto")
        seqlens = (0, 0)
        slopes = (torch.rand(2, h, device=device) if case == "softcap_alibi" else None)
    for t in (q, k, v):
        t.requires_grad_()
    o = options
    rng_state = torch.tensor([123, 9], dtype=torch.int64) if o.dropout_p > 0 else None
    args = (q, k, v, cu, cu) + seqlens + (o.dropout_p, o.softmax_scale, o.causal, o.window_left,
                                          o.window_right, o.softcap, slopes, o.deterministic,
                                          rng_state, o.backend)
    with cuda_may_be_unsupported(device):
        results = []
        for road in (torch.ops.flare.attention, ft.Attention.apply) if ft.CPP_KERNELS else ():
            out, lse = road(*args)
            seeded = torch.Generator(device).manual_seed(1)
            grad = (torch.randn(out.shape[-1], generator=seeded, device=device,
                                dtype=dtype).expand(out.shape) if case == "expanded_grad"
                    else torch.randn(out.shape, generator=seeded, device=device, dtype=dtype))
            results.append((out, lse) + torch.autograd.grad(out, (q, k, v), grad))
            if road is torch.ops.flare.attention:
                assert "Cpp" in type(out.grad_fn).__name__
                assert not lse.requires_grad
        for a, b in zip(*results):
            assert torch.equal(a, b)
        if ft.CPP_KERNELS:
            with torch.inference_mode():
                out, lse = torch.ops.flare.attention(*((q.detach(), k.detach(), v.detach())
                                                       + args[3:]))
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_operator_kernels_are_cpp_where_built():
    from flare import _torch as ft
    built = os.path.exists(os.path.join(os.path.dirname(ft.__file__), "_torch_ops.so"))
    assert ft.CPP_KERNELS == (built and os.environ.get("FLARE_TORCH_OPS") != "python")


# ---- dropout, streams, errors -----------------------------------------------------------------

def test_dropout_uses_torch_generator_and_backend_agrees():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 33, 2, 16, requires_grad=True) for _ in range(3))
    results = []
    for backend in ("auto", "auto", "reference"):
        torch.manual_seed(123)
        out = flare.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, backend=backend)
        (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, dq, dk, dv))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(results[0], results[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.manual_seed(124)
    other = flare.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    assert not torch.equal(other, results[0][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_on_current_stream():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with cuda_may_be_unsupported("cuda"):
        expected = flare.flash_attn_func(q, k, v, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = flare.flash_attn_func(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_without_kernels_raises_not_implemented():
    if flare.cuda_built():
        pytest.skip("this flare build carries the CUDA kernels")
    q = torch.randn(1, 8, 2, 16, device="cuda")
    with pytest.raises(NotImplementedError, match="CUDA"):
        flare.flash_attn_func(q, q, q)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_errors_name_the_argument(device):
    q = torch.randn(1, 8, 4, 16, device=device)
    k = torch.randn(1, 8, 3, 16, device=device)
    with pytest.raises(ValueError, match=r"^k: heads = 3 must divide q's heads = 4"):
        flare.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match=r"^dropout_p: "):
        flare.flash_attn_func(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"^q: dtype float64 is not supported"):
        flare.flash_attn_func(q.double(), q.double(), q.double())


def test_numpy_style_entry_points_take_torch_tensors():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    out, lse = flare.attention_forward(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and lse.shape == (1, 2, 20)
    dq, dk, dv = flare.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    flare.flash_attn_func(qg, kg, vg, causal=True).sum().backward()
    torch.testing.assert_close(dq, qg.grad, rtol=0, atol=0)
    torch.testing.assert_close(dk, kg.grad, rtol=0, atol=0)


# ---- empty tensors ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 0, 5), (2, 5, 0), (0, 5, 5), (2, 0, 0)],
                         ids=lambda s: f"b{s[0]}-sq{s[1]}-sk{s[2]}")
def test_empty_tensors_forward_backward(device, causal, shape):
    # torch gives empty tensors odd strides (and an expanded zero-stride gradient for an empty
    # output's sum): the package must pass them, and its own empty lse, to the library.
    b, s_q, s_k = shape
    dtype = dtypes_for(device)[0]
    q = torch.randn(b, s_q, 4, 16, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, s_k, 2, 16, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, s_k, 2, 16, dtype=dtype, device=device, requires_grad=True)
    with cuda_may_be_unsupported(device):
        out, lse, _ = flare.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (b, 4, s_q)
        if s_k == 0:
            assert (out == 0).all() and (lse == float("-inf")).all()
        out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    if s_q == 0:
        assert (k.grad == 0).all() and (v.grad == 0).all()
    if s_k == 0:
        assert (q.grad == 0).all()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_empty_varlen_batch(device):
    dtype = dtypes_for(device)[0]
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    q, k, v = (torch.randn(0, 2, 16, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    with cuda_may_be_unsupported(device):
        out = flare.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0)
        out.sum().backward()
    assert out.shape == (0, 2, 16) and q.grad.shape == q.shape


def test_attention_forward_takes_empty_torch_tensors():
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 0, 2, 8)
    out, lse = flare.attention_forward(q, k, k)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = flare.attention_backward(torch.ones_like(out), q, k, k, out, lse)
    assert (dq == 0).all() and dk.shape == k.shape


# ---- dropout seeds through the plain calls ------------------------------------------------------

def test_attention_forward_draws_seeds_from_torch_generator():
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    torch.manual_seed(5)
    a, _, state_a = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    b, _, state_b = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    assert state_a != state_b and not torch.equal(a, b)
    torch.manual_seed(5)
    c, lse, state_c = flare.attention_forward(q, k, v, dropout_p=0.5, return_rng_state=True)
    assert state_c == state_a and torch.equal(c, a)
    seed, offset = state_c
    dq, dk, dv = flare.attention_backward(torch.ones_like(c), q, k, v, c, lse, dropout_p=0.5,
                                          seed=seed, offset=offset)
    dq2, dk2, dv2 = flare.attention_backward(torch.ones_like(c), q, k, v, c, lse, dropout_p=0.5,
                                             seed=seed + 1, offset=offset)
    assert not torch.equal(dv, dv2)


def test_seed_and_stream_are_refused_for_torch_tensors():
    # They would do nothing (torch's generator and current stream are used): say so.
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"^seed: applies to non-torch arrays"):
        flare.flash_attn_func(q, q, q, dropout_p=0.1, seed=3)
    with pytest.raises(ValueError, match=r"^stream: applies to non-torch arrays"):
        flare.flash_attn_func(q, q, q, stream=0)


# ---- every bad argument of every public function, with torch tensors --------------------------

import bad_args  # noqa: E402


def torch_call(fn):
    """A valid call of `fn` on small CPU tensors and, per tensor argument, the same shape in a
    dtype flare rejects."""
    gen = torch.Generator().manual_seed(0)
    x = lambda *shape: torch.randn(shape, generator=gen)  # noqa: E731
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
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
            return torch.full((2,), 0.5, dtype=torch.float64)
        value = good.get(arg)
        if not isinstance(value, torch.Tensor):
            return None
        return value.to(torch.float32 if value.dtype == torch.int32 else torch.float64)

    return good, wrong_dtype


TORCH_BAD_ARGS = bad_args.cases(torch_call)


@pytest.mark.parametrize("fn", bad_args.PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_the_valid_torch_calls_run(fn):
    good, _ = torch_call(fn)
    fn(**good)


@pytest.mark.parametrize("fn,name,label,value,exc", TORCH_BAD_ARGS,
                         ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in TORCH_BAD_ARGS])
def test_every_bad_torch_argument_is_named(fn, name, label, value, exc):
    good, _ = torch_call(fn)
    if name in ("seed", "stream") and fn.__name__.startswith("flash_attn"):
        exc = ValueError  # any value: these extras are for non-torch arrays
    with pytest.raises(exc, match=bad_args.message_pattern(name)):
        fn(**dict(good, **{name: value}))


@pytest.mark.parametrize("fn", bad_args.PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_arrays_of_another_framework_are_named(fn):
    # A NumPy array among torch tensors: a TypeError naming it, not an AttributeError inside.
    good, _ = torch_call(fn)
    for name, value in good.items():
        if isinstance(value, torch.Tensor) and name != next(iter(good)):
            with pytest.raises(TypeError, match=rf"^{name}: numpy\.ndarray is not a torch tensor"):
                fn(**dict(good, **{name: value.numpy()}))
