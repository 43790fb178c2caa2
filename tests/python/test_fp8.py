"""flare.attention_forward_fp8: torch.float8_e4m3fn q, k, v with float32 descales, forward only.

On the CPU its result is attention_forward's float32 path on the dequantized inputs (each
element times its descale, rounded once to float32) with out rounded once to out_dtype: these
tests form those inputs with torch ops and compare bit for bit, over per-tensor, per-head
(FlashAttention-3's (b, h) form), per-kv-head and per-block descales, fixed and packed batches.
Then the errors: each names its argument."""

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

import flare  # noqa: E402

FP8 = torch.float8_e4m3fn


def fp8(shape, gen, sigma=24.0):
    return (torch.randn(shape, generator=gen) * sigma).to(FP8)


def factors(shape, gen):
    return torch.exp2(torch.rand(shape, generator=gen) * 8.0 - 6.0)


def expand_rows(descale, heads, rows_of, block_rows):
    """The factor of each (sequence b, row, head) as a (b, rows, heads, 1) or (rows, heads, 1)
    multiplier: descale (b | 1, h' | 1, blocks | 1) by the stated rule."""
    b_idx, i_idx = rows_of
    d = descale if descale.dim() == 3 else descale.unsqueeze(-1)
    hb = b_idx if d.shape[0] > 1 else torch.zeros_like(b_idx)
    hr = i_idx // block_rows if d.shape[2] > 1 else torch.zeros_like(i_idx)
    h = torch.arange(heads)
    hh = h if d.shape[1] == heads else (h // (heads // d.shape[1]) if d.shape[1] > 1 else 0 * h)
    return d[hb[:, None], hh[None, :], hr[:, None]].unsqueeze(-1)  # (rows, heads, 1)


def dequantize(x, descale, block_rows, lens=None):
    if descale is None:
        return x.float()
    if lens is None:  # fixed (b, s, h, d)
        b, s, h, _ = x.shape
        rows = (torch.arange(b).repeat_interleave(s), torch.arange(s).repeat(b))
        f = expand_rows(descale, h, rows, block_rows).reshape(b, s, h, 1)
        return x.float() * f
    b_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    i_idx = torch.cat([torch.arange(n) for n in lens])
    return x.float() * expand_rows(descale, x.shape[1], (b_idx, i_idx), block_rows)


@pytest.mark.parametrize("granularity", ["none", "tensor", "head_2d", "kv_head", "block"])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_the_float32_path_on_dequantized_inputs(granularity, packed):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, block = 4, 2, 32, 16
    lens_q, lens_k = ([19, 0, 40, 7], [33, 5, 40, 1]) if packed else ([37] * 2, [45] * 2)
    b = len(lens_q)
    if packed:
        q, k, v = fp8((sum(lens_q), hq, d), gen), fp8((sum(lens_k), hkv, d), gen), \
            fp8((sum(lens_k), hkv, d), gen)
        cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        varlen = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        q, k, v = fp8((b, 37, hq, d), gen), fp8((b, 45, hkv, d), gen), fp8((b, 45, hkv, d), gen)
        varlen = {}
    blocks = lambda n: -(-n // block)
    descale = {
        "none": (None, None, None),
        "tensor": tuple(factors((1, 1, 1), gen) for _ in range(3)),
        "head_2d": (factors((b, hq), gen), factors((b, hkv), gen), factors((b, hkv), gen)),
        "kv_head": (factors((b, hkv, 1), gen), factors((1, hkv, 1), gen), factors((b, 1, 1), gen)),
        "block": (factors((b, hq, blocks(max(lens_q))), gen),
                  factors((b, hkv, blocks(max(lens_k))), gen),
                  factors((b, hkv, blocks(max(lens_k))), gen)),
    }[granularity]
    out, lse = flare.attention_forward_fp8(q, k, v, q_descale=descale[0], k_descale=descale[1],
                                           v_descale=descale[2], block_rows=block, causal=True,
                                           **varlen)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    lq, lk = (lens_q, lens_k) if packed else (None, None)
    want_o, want_lse = flare.attention_forward(
        dequantize(q, descale[0], block, lq), dequantize(k, descale[1], block, lk),
        dequantize(v, descale[2], block, lk), causal=True, **varlen)
    assert torch.equal(lse, want_lse)
    assert torch.equal(out, want_o.to(torch.bfloat16))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_out_dtype(out_dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = fp8((1, 20, 2, 16), gen), fp8((1, 30, 2, 16), gen), fp8((1, 30, 2, 16), gen)
    out, _ = flare.attention_forward_fp8(q, k, v, out_dtype=out_dtype, window_size=(9, 0))
    want, _ = flare.attention_forward(q.float(), k.float(), v.float(), window_size=(9, 0))
    assert out.dtype == out_dtype
    assert torch.equal(out, want.to(out_dtype))


def test_errors_name_their_argument():
    gen = torch.Generator().manual_seed(1)
    q, k, v = fp8((2, 8, 4, 16), gen), fp8((2, 12, 2, 16), gen), fp8((2, 12, 2, 16), gen)
    with pytest.raises(ValueError, match="^k: dtype float32 must be float8_e4m3"):
        flare.attention_forward_fp8(q, k.float(), v)
    with pytest.raises(ValueError, match="^q_descale: dtype must be float32, got float16"):
        flare.attention_forward_fp8(q, k, v, q_descale=torch.ones(2, 4, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^k_descale: shape\[1\] = 4 must be heads = 2 or 1"):
        flare.attention_forward_fp8(q, k, v, k_descale=torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="^block_rows: must be >= 1 where v_descale has 3 blocks"):
        flare.attention_forward_fp8(q, k, v, v_descale=torch.ones(2, 2, 3))
    with pytest.raises(TypeError, match="^out_dtype: expected a torch.dtype"):
        flare.attention_forward_fp8(q, k, v, out_dtype="bfloat16")
    with pytest.raises(TypeError, match="^q: attention_forward_fp8 takes torch tensors"):
        flare.attention_forward_fp8(q.float().numpy(), k.float().numpy(), v.float().numpy())
    with pytest.raises(ValueError, match="^q: float8_e4m3 is an input type of attention_forward_fp8"):
        flare.attention_forward(q, k, v)
    # Both torch roads (the C++ operators, or FLARE_TORCH_OPS=python) point to the FP8 call.
    with pytest.raises(ValueError, match="^q: .*attention_forward_fp8"):
        flare.flash_attn_func(q, k, v)
