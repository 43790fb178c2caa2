"""Padding helpers for variable-length batches, with flash_attn.bert_padding's names, arguments
and return values, so a model written for flash_attn switches by changing its imports:

    from flare.bert_padding import index_first_axis, pad_input, unpad_input
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flare.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                             max_seqlen, max_seqlen, causal=True)
    out = pad_input(out_unpad, indices, batch, seqlen)

A padded batch (batch, seqlen, ...) with a mask (batch, seqlen) of valid tokens becomes the packed
(total_tokens, ...) layout of the varlen functions and back. Tokens keep their order: batch-major,
then position, as `mask.flatten().nonzero()` lists them.

PyTorch only (these are tensor reshuffles around the attention call, differentiable through
torch's own index_select / index_copy, which torch.compile traces). Each bad argument raises
TypeError or ValueError naming it.

unpad_input reads the longest sequence back to the host (an int, as the varlen functions take
it), which waits for the mask on a CUDA device, as flash_attn's does.
"""

import torch

from ._core import describe, integer

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]

_INT64_MAX = (1 << 63) - 1


# ---- argument checks ---------------------------------------------------------------------------

def _tensor(value, name, min_ndim=0):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(value)}")
    if value.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape "
                         f"{tuple(value.shape)}")
    return value


def _indices(indices, name="indices"):
    _tensor(indices, name)
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected a 1-D int64 (or int32) tensor, got "
                         f"{indices.dtype} of shape {tuple(indices.shape)}")
    return indices


def _mask(mask, name, hidden_states=None):
    _tensor(mask, name)
    if mask.dim() != 2:
        raise ValueError(f"{name}: expected (batch, seqlen), got shape {tuple(mask.shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"{name}: expected a bool or integer tensor, got {mask.dtype}")
    if hidden_states is not None and tuple(hidden_states.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"{name}: shape {tuple(mask.shape)} must equal hidden_states' leading "
                         f"(batch, seqlen) = {tuple(hidden_states.shape[:2])}")
    return mask


def _packed_lengths(seqlens):
    """(cu_seqlens int32 (batch + 1), the longest length as an int) of per-sequence lengths."""
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return cu_seqlens, max_seqlen


# ---- gather and scatter along the token axis ---------------------------------------------------

def index_first_axis(input, indices):  # noqa: A002 (flash_attn's argument name)
    """input[indices] along the first axis: (n, ...) → (len(indices), ...). Its gradient
    scatters back into zeros shaped like input."""
    _tensor(input, "input", 1)
    return torch.index_select(input, 0, _indices(indices))


def index_put_first_axis(values, indices, first_axis_dim):
    """The inverse of index_first_axis: zeros (first_axis_dim, ...) with row indices[i] =
    values[i]. Its gradient gathers the rows back."""
    _tensor(values, "values", 1)
    _indices(indices)
    first_axis_dim = integer(first_axis_dim, "first_axis_dim", 0, _INT64_MAX)
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"values: {values.shape[0]} rows but indices has {indices.shape[0]}")
    zeros = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return zeros.index_copy(0, indices, values)


# ---- padded (batch, seqlen, ...) ↔ packed (total_tokens, ...) ----------------------------------

def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the valid tokens of a padded batch.

    hidden_states (batch, seqlen, ...); attention_mask (batch, seqlen), bool or int, nonzero
    where a token is valid; unused_mask (optional, same shape): tokens that are allocated but
    unused, packed too (they count in cu_seqlens but not in seqused).
    Returns (hidden_states (total, ...), indices int64 (total) into the flattened batch,
    cu_seqlens int32 (batch + 1), max_seqlen_in_batch int, seqused int32 (batch)): the valid
    tokens per sequence, excluding unused ones.
    """
    _tensor(hidden_states, "hidden_states", 2)
    _mask(attention_mask, "attention_mask", hidden_states)
    selected = attention_mask
    if unused_mask is not None:
        _mask(unused_mask, "unused_mask", hidden_states)
        selected = (attention_mask != 0) | (unused_mask != 0)
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    cu_seqlens, max_seqlen = _packed_lengths(seqlens)
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packs rows that each hold several sequences back to back.

    attention_mask_in_length (batch, seqlen), int: row b lists the lengths of the sequences
    concatenated at the start of hidden_states[b] (zeros after them), e.g. [2, 3, 0, 0, 0, 0] for
    a 2-token and a 3-token sequence followed by one padding token. Every listed sequence
    becomes a sequence of its own in the packed batch.
    Returns (hidden_states (total, ...), indices, cu_seqlens int32 (sequences + 1),
    max_seqlen_in_batch int).
    """
    _tensor(hidden_states, "hidden_states", 2)
    _mask(attention_mask_in_length, "attention_mask_in_length", hidden_states)
    lengths = attention_mask_in_length
    seqlen = lengths.shape[1]
    row_length = lengths.sum(dim=-1)
    positions = torch.arange(seqlen, device=lengths.device, dtype=row_length.dtype)
    valid = positions[None, :] < row_length[:, None]
    seqlens = lengths.flatten()
    seqlens = seqlens[seqlens != 0].to(torch.int32)
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    cu_seqlens, max_seqlen = _packed_lengths(seqlens)
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """Unpacks: hidden_states (total, ...) → (batch, seqlen, ...), zeros where no token is.
    indices are unpad_input's."""
    _tensor(hidden_states, "hidden_states", 1)
    batch = integer(batch, "batch", 0, _INT64_MAX)
    seqlen = integer(seqlen, "seqlen", 0, _INT64_MAX)
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
