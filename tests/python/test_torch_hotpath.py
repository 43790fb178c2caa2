"""The training hot path through PyTorch: no host synchronisation, CUDA graphs, both autograd roads.

flash_attn_func reaches flare's kernels by two roads (flare/_torch.py): a torch.autograd.Function
in eager mode and the torch.library operators under torch.compile. Both must give the same
numbers, and nothing on either may synchronise the host with the GPU: a CUDA graph capture fails
on any synchronising call (cudaMalloc, cudaFree, a blocking copy, a stream synchronise), so a
captured forward + backward that replays to the eager results is the test of that.
"""
import pytest

torch = pytest.importorskip("torch")
import flare  # noqa: E402

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flare.cuda_built()),
                          reason="needs a CUDA device and a CUDA build of flare")

DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def _inputs(device, dtype, b=2, s_q=70, s_k=90, h=4, h_kv=2, d=64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).to(device, dtype)
    k = torch.randn(b, s_k, h_kv, d, generator=g).to(device, dtype)
    v = torch.randn(b, s_k, h_kv, d, generator=g).to(device, dtype)
    dout = torch.randn(b, s_q, h, d, generator=g).to(device, dtype)
    return q, k, v, dout


def _fwd_bwd(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


@pytest.mark.parametrize("device", DEVICES)
def test_eager_road_equals_compiled_road(device):
    # The autograd.Function run eagerly and traced by torch.compile into the operators (aot_eager:
    # the graphs run as traced, no code generation) run the same kernels: bitwise equal results.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, dout = _inputs(device, dtype)

    def eager(q, k, v):
        return flare.flash_attn_func(q, k, v, causal=True, window_size=(32, 0))

    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")

    for a, b in zip(_fwd_bwd(eager, q, k, v, dout), _fwd_bwd(compiled, q, k, v, dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_without_grad_take_no_autograd(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, _ = _inputs(device, dtype)
    out = flare.flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is None and not out.requires_grad
    # Only k needs a gradient: q's and v's are not formed into autograd leaves.
    k.requires_grad_(True)
    out = flare.flash_attn_func(q, k, v, causal=True)
    (dk,) = torch.autograd.grad(out.float().sum(), (k,))
    assert dk.shape == k.shape and torch.isfinite(dk.float()).all()


@cuda
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_cuda_graph_captures_forward_and_backward(dropout_p):
    # Capture one training-style step (forward + backward into static buffers), replay it on new
    # inputs copied into the captured ones, and compare with eager calls on those inputs. A call
    # that synchronised, or allocated outside torch's allocator and CUDA's stream-ordered one
    # (cudaMalloc), would fail the capture.
    q, k, v, dout = _inputs("cuda", torch.bfloat16, b=2, s_q=300, s_k=300, h=4, h_kv=4, d=128)
    static = [t.clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    sq, sk, sv, sdout = static

    def step():
        torch.manual_seed(1234)  # dropout's [seed, offset] is drawn on the host at capture
        out = flare.flash_attn_func(sq, sk, sv, dropout_p=dropout_p, causal=True)
        return (out,) + torch.autograd.grad(out, (sq, sk, sv), sdout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up outside the capture, as torch.cuda.graphs asks
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for seed in (1, 2):
        nq, nk, nv, ndout = _inputs("cuda", torch.bfloat16, b=2, s_q=300, s_k=300, h=4, h_kv=4,
                                    d=128, seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, (nq, nk, nv, ndout)):
                dst.copy_(src)
        graph.replay()
        torch.manual_seed(1234)
        want = _fwd_bwd(lambda a, b, c: flare.flash_attn_func(a, b, c, dropout_p=dropout_p,
                                                              causal=True), nq, nk, nv, ndout)
        torch.cuda.synchronize()
        for name, got, ref in zip(("out", "dq", "dk", "dv"), captured, want):
            # Same kernels and the same dropout mask: bitwise, except dq, whose fp32 partial sums
            # may be added in another order before the one rounding to bf16 — at most one bf16
            # step (2^-7 relative) at the largest magnitude.
            if name == "dq":
                assert (got - ref).abs().max() <= 2.0**-7 * ref.abs().max(), name
            else:
                assert torch.equal(got, ref), name


@cuda
def test_no_synchronisation_in_eager_calls():
    # torch's sync debug mode raises on any synchronising call torch makes on our behalf (a .item(),
    # a blocking copy, a CUDA tensor read on the host).
    q, k, v, dout = _inputs("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(lambda a, b, c: flare.flash_attn_func(a, b, c, causal=True), q, k, v, dout)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_allocates_only_the_gradients(device):
    # The eager backward's tensor work is flare's own: three gradient allocations and the
    # extension call. The LSE output has no gradient, and none is materialised for it (a
    # zero-filled tensor and a fill kernel per call, measured on an H100 host).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(device, dtype)))
    out, lse, _ = flare.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    with Recorder() as rec:
        torch.autograd.grad(out, (q, k, v), dout)
    assert not [op for op in rec.ops if "zero" in op or "fill" in op], rec.ops
    assert rec.ops.count("aten.empty_like") == 3, rec.ops


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_without_unit_last_stride_are_copied_once(device):
    # q, k, v with a strided head_dim (every second element) are made contiguous on entry, the
    # backward reuses those copies, and the gradients flow back to the strided originals.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, dout = _inputs(device, dtype)
    wide = [torch.stack((t, torch.full_like(t, float("nan"))), dim=-1).flatten(-2)
            for t in (q, k, v)]
    strided = [w[..., ::2] for w in wide]
    assert all(t.stride(-1) == 2 for t in strided)

    def fn(q, k, v):
        return flare.flash_attn_func(q, k, v, causal=True)

    for a, b in zip(_fwd_bwd(fn, *strided, dout), _fwd_bwd(fn, q, k, v, dout)):
        assert torch.equal(a, b)
