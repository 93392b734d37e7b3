"""Test marks shared by several test modules."""

import pytest
import torch


def gpu(test):
    """A CUDA test: marked `gpu` (`pytest -m gpu`) and skipped with a reason without a device."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(needs_cuda(test))
