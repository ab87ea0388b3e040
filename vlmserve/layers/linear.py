"""Linear layers of the language model: computed through the model's fused ops (a GEMV for
one token on CUDA), optionally several checkpoint tensors stacked along the output dim."""

import torch
from torch import nn

from vlmserve.layers.fused import EAGER_OPS


class Linear(nn.Linear):
    """`nn.Linear` whose product is `self.ops.linear` (set with the model's fused ops)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several projections (q/k/v, gate/up). `load_shard(i, w)` copies the
    checkpoint's i-th projection into its rows."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)

    def _rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    @torch.no_grad()
    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool) -> None:
        target = (self.bias if is_bias else self.weight)[self._rows(shard)]
        assert target.shape == tensor.shape, (target.shape, tensor.shape)
        target.copy_(tensor)
