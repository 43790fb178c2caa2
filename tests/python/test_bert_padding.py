"""flare.bert_padding: flash_attn.bert_padding's helpers (same names, arguments and results), the
round trip padded ↔ packed, gradients, the varlen attention of a padded batch, bad arguments.

Skipped unless torch is importable.
"""

import inspect

import pytest

torch = pytest.importorskip("torch")

import flare  # noqa: E402
from flare.bert_padding import (  # noqa: E402
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def random_mask(batch, seqlen, gen):
    """Padding masks with holes anywhere, one row empty and one full (when batch allows)."""
    mask = torch.rand(batch, seqlen, generator=gen) < 0.6
    mask[0] = False
    if batch > 1:
        mask[1] = True
    return mask


def test_signatures_match_flash_attn():
    # A model switches by changing its import: the parameters must be flash_attn's, in order.
    expected = {
        unpad_input: ["hidden_states", "attention_mask", "unused_mask"],
        pad_input: ["hidden_states", "indices", "batch", "seqlen"],
        index_first_axis: ["input", "indices"],
        index_put_first_axis: ["values", "indices", "first_axis_dim"],
        unpad_input_for_concatenated_sequences: ["hidden_states", "attention_mask_in_length"],
    }
    for fn, names in expected.items():
        assert list(inspect.signature(fn).parameters) == names, fn.__name__


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32])
def test_unpad_and_pad_round_trip(mask_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, h, d = 4, 11, 3, 5
    x = torch.randn(batch, seqlen, h, d, generator=gen)
    mask = random_mask(batch, seqlen, gen)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask.to(mask_dtype))

    lengths = mask.sum(-1)
    assert torch.equal(packed, x[mask])  # batch-major, then position
    assert indices.dtype == torch.int64
    assert torch.equal(indices, mask.flatten().nonzero().flatten())
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist()
    assert isinstance(max_seqlen, int) and max_seqlen == int(lengths.max())
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths.tolist()

    back = pad_input(packed, indices, batch, seqlen)
    assert back.shape == x.shape
    assert torch.equal(back, torch.where(mask[..., None, None], x, torch.zeros_like(x)))


def test_unused_mask_counts_in_cu_seqlens_not_in_seqused(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen = 3, 8
    x = torch.randn(batch, seqlen, 4, generator=gen)
    used = torch.zeros(batch, seqlen, dtype=torch.bool)
    unused = torch.zeros(batch, seqlen, dtype=torch.bool)
    for b, (n_used, n_unused) in enumerate([(3, 2), (0, 4), (8, 0)]):
        used[b, :n_used] = True
        unused[b, n_used:n_used + n_unused] = True
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, used, unused)
    assert cu_seqlens.tolist() == [0, 5, 9, 17]
    assert seqused.tolist() == [3, 0, 8]
    assert max_seqlen == 8
    assert torch.equal(packed, x[used | unused])


def test_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 6, 1)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(packed[:, 0], x.flatten()[indices])


def test_empty_batch_and_empty_rows():
    x = torch.randn(0, 5, 2)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(
        x, torch.zeros(0, 5, dtype=torch.bool))
    assert packed.shape == (0, 2) and cu_seqlens.tolist() == [0] and max_seqlen == 0
    assert pad_input(packed, indices, 0, 5).shape == (0, 5, 2)
    x = torch.randn(2, 5, 2)
    packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, torch.zeros(2, 5, dtype=torch.bool))
    assert packed.shape == (0, 2) and cu_seqlens.tolist() == [0, 0, 0] and max_seqlen == 0
    assert torch.equal(pad_input(packed, indices, 2, 5), torch.zeros(2, 5, 2))


def test_gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.tensor([5, 0, 3])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))
    values = torch.randn(3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, 7), (values,))
    # Through the round trip, the gradient of a padded position is zero.
    batch, seqlen = 2, 6
    h = torch.randn(batch, seqlen, 4, generator=gen, requires_grad=True)
    mask = random_mask(batch, seqlen, gen)
    packed, idx, *_ = unpad_input(h, mask)
    pad_input(packed * 2, idx, batch, seqlen).sum().backward()
    assert torch.equal(h.grad, 2 * mask[..., None].expand_as(h).to(h.dtype))


def test_varlen_attention_of_a_padded_batch(seed):
    # The flash_attn recipe: unpad q/k/v with the padding mask, run the varlen function, pad the
    # output back. Each sequence's valid tokens must get the attention of those tokens alone.
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, h, d = 3, 13, 2, 16
    q, k, v = (torch.randn(batch, seqlen, h, d, generator=gen) for _ in range(3))
    mask = random_mask(batch, seqlen, gen)
    q_u, indices, cu, max_s, _ = unpad_input(q, mask)
    k_u, _, _, _, _ = unpad_input(k, mask)
    v_u, _, _, _, _ = unpad_input(v, mask)
    out = pad_input(flare.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s,
                                                 causal=True), indices, batch, seqlen)
    for b in range(batch):
        valid = mask[b]
        if not valid.any():
            assert (out[b] == 0).all()
            continue
        alone = flare.flash_attn_func(q[b:b + 1, valid], k[b:b + 1, valid], v[b:b + 1, valid],
                                      causal=True)[0]
        torch.testing.assert_close(out[b, valid], alone, rtol=0, atol=1e-6)
        assert (out[b, ~valid] == 0).all()


def test_compiles_into_one_graph():
    torch._dynamo.reset()

    def repack(x, indices):
        return pad_input(index_first_axis(x.reshape(-1, x.shape[-1]), indices) * 2, indices,
                         x.shape[0], x.shape[1])

    x = torch.randn(2, 5, 3)
    indices = torch.tensor([0, 2, 3, 7, 9])
    compiled = torch.compile(repack, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, indices), repack(x, indices), rtol=0, atol=0)


BAD = [
    # (call, exception, message pattern)
    (lambda x, m, i: unpad_input(None, m), TypeError, r"^hidden_states: expected a torch"),
    (lambda x, m, i: unpad_input(x.numpy(), m), TypeError, r"^hidden_states: "),
    (lambda x, m, i: unpad_input(x[0, 0], m), ValueError, r"^hidden_states: expected at least"),
    (lambda x, m, i: unpad_input(x, [[1, 0]]), TypeError, r"^attention_mask: "),
    (lambda x, m, i: unpad_input(x, m.float()), ValueError, r"^attention_mask: expected a bool"),
    (lambda x, m, i: unpad_input(x, m[:1]), ValueError, r"^attention_mask: shape"),
    (lambda x, m, i: unpad_input(x, m[0]), ValueError, r"^attention_mask: expected \(batch"),
    (lambda x, m, i: unpad_input(x, m, m[:, :2]), ValueError, r"^unused_mask: shape"),
    (lambda x, m, i: unpad_input(x, m, 1), TypeError, r"^unused_mask: "),
    (lambda x, m, i: pad_input(None, i, 2, 4), TypeError, r"^hidden_states: "),
    (lambda x, m, i: pad_input(x[m], i.float(), 2, 4), ValueError, r"^indices: expected a 1-D"),
    (lambda x, m, i: pad_input(x[m], i.tolist(), 2, 4), TypeError, r"^indices: "),
    (lambda x, m, i: pad_input(x[m], i, 2.0, 4), TypeError, r"^batch: expected an int"),
    (lambda x, m, i: pad_input(x[m], i, 2, None), TypeError, r"^seqlen: expected an int"),
    (lambda x, m, i: pad_input(x[m], i, -1, 4), ValueError, r"^batch: "),
    (lambda x, m, i: pad_input(x[m][:1], i, 2, 4), ValueError, r"^values: "),
    (lambda x, m, i: index_first_axis(x.reshape(8, 3), None), TypeError, r"^indices: "),
    (lambda x, m, i: index_first_axis(3.0, i), TypeError, r"^input: "),
    (lambda x, m, i: index_first_axis(torch.tensor(1.0), i), ValueError, r"^input: "),
    (lambda x, m, i: index_put_first_axis(x[m], i, "8"), TypeError, r"^first_axis_dim: "),
    (lambda x, m, i: index_put_first_axis([1.0], i, 8), TypeError, r"^values: "),
    (lambda x, m, i: unpad_input_for_concatenated_sequences(x, None), TypeError,
     r"^attention_mask_in_length: "),
]


@pytest.mark.parametrize("call,exc,pattern", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_are_named(call, exc, pattern):
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    indices = mask.flatten().nonzero().flatten()
    with pytest.raises(exc, match=pattern):
        call(x, mask, indices)
