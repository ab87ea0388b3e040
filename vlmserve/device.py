"""Host-to-device copies that never make the host wait for the device.

A copy from pageable host memory synchronizes with the stream before it starts (CUDA runtime
API, "API synchronization behavior"), so the host would stop launching until the device had
drained everything queued, the previous step included: the small per-step tensors (token
ids, positions, slots, attention plans) would cost a stall each. `to_device` sends them
through pinned memory from PyTorch's caching host allocator, which keeps the block until the
copy has run, with a non-blocking copy.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t.to(device)`, asynchronous for a host tensor going to a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
