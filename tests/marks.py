"""Test marks shared by several test modules."""

import pytest
import torch

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# A `device` parameter value that runs on a GPU: marked `gpu`, skipped without a device.
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, _NEEDS_CUDA], id="cuda")


def gpu(test):
    """A CUDA test: marked `gpu` (`pytest -m gpu`) and skipped with a reason without a device."""
    return pytest.mark.gpu(_NEEDS_CUDA(test))
