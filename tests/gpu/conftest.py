import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 comparisons on the GPU: no TF32 in matmuls or convolutions."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def release_gpu():
    """What a test's engines held goes back to the GPU before the next test sizes its own."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
