"""Why a test that needs flare's CUDA kernels cannot run here (None when it can), and the pytest
mark that skips it with that reason."""
import pytest

import flare


def cuda_missing():
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not flare.cuda_built():
        return "this flare build has no CUDA kernels"
    return None


requires_cuda = pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing()))
