"""flare: FlashAttention in C++/CUDA, from Python (distribution name flare-attention).

Drop-in for flash_attn 2.x's functions (flare/interface.py) over any DLPack framework, with
autograd for PyTorch; attention_forward / attention_backward are the plain calls for
frameworks without autograd (NumPy); attention_forward_fp8 is the FP8 (torch.float8_e4m3fn)
forward with descales, as FlashAttention-3 has it. block_sparse_attn_func (and _varlen_func) is block-sparse
attention over a block mask, with block_sparse_attention_forward / _backward as its plain calls
and local_global_block_mask / butterfly_block_mask making the usual patterns. flare.bert_padding holds flash_attn.bert_padding's helpers
(torch only; import it explicitly). flare.dist is context parallelism — one sequence split
across GPUs (ring_flash_attn_func, communicators from torch.distributed groups or the launch
environment; import it explicitly). A bad argument raises TypeError (wrong kind of value: None,
a list, an array of another framework) or ValueError (invalid value); errors from the library
are raised as ValueError (invalid argument), NotImplementedError (valid but unsupported by this
build or device), MemoryError or RuntimeError (device errors). Every message starts with the
argument's name.
"""

import os as _os

from . import _ext
from ._core import (
    attention_backward,
    attention_forward,
    attention_forward_fp8,
    block_sparse_attention_backward,
    block_sparse_attention_forward,
    butterfly_block_mask,
    local_global_block_mask,
)
from .interface import (
    block_sparse_attn_func,
    block_sparse_attn_varlen_func,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = _ext.version()

# Register the torch custom ops (torch.ops.flare.fwd / bwd) at import when torch is installed,
# so torch.compile never meets a first-time import inside a traced function. FLARE_NO_TORCH=1
# skips it (NumPy-only use on a machine that has torch).
if _os.environ.get("FLARE_NO_TORCH", "") in ("", "0"):
    try:
        import torch as _torch_module  # noqa: F401
    except (ImportError, OSError):  # not installed, or its shared libraries fail to load
        pass
    else:
        from . import _torch  # noqa: F401


def cuda_built():
    """True when this build of flare carries the CUDA kernels."""
    return _ext.cuda_built()


__all__ = [
    "attention_backward",
    "attention_forward",
    "attention_forward_fp8",
    "block_sparse_attention_backward",
    "block_sparse_attention_forward",
    "block_sparse_attn_func",
    "block_sparse_attn_varlen_func",
    "butterfly_block_mask",
    "cuda_built",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "local_global_block_mask",
]
