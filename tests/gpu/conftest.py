import pytest
import torch


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 comparisons on the GPU: no TF32 in matmuls or convolutions."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
