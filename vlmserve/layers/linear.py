"""Linear layers of the language model: computed through the model's fused ops (a GEMV for
one token on CUDA), optionally several checkpoint tensors stacked along the output dim, and
optionally holding an FP8 checkpoint's weight as it is (`layers/fp8.py`)."""

import torch
from torch import nn

from vlmserve.layers.fp8 import HoldsFp8
from vlmserve.layers.fused import EAGER_OPS


class Linear(HoldsFp8, nn.Linear):
    """`nn.Linear` whose product is `self.ops.linear` (set with the model's fused ops)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.w, self.bias)


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
    def load_shard(self, shard: int, tensor: torch.Tensor, name: str = "weight") -> None:
        """The checkpoint's ``name`` (weight, bias, or an FP8 weight's weight_scale_inv) of
        projection ``shard``, into its rows (a scale's: its rows' blocks)."""
        rows = self._rows(shard)
        if name == "weight_scale_inv":  # every projection starts on a block (`fp8_rows_ok`)
            br = self.fp8_block[0]
            rows = slice(rows.start // br, -(-rows.stop // br))
        target = getattr(self, name)[rows]
        assert target.shape == tensor.shape, (target.shape, tensor.shape)
        target.copy_(tensor)

    def fp8_rows_ok(self, block_rows: int) -> bool:
        """Whether each projection's rows start on a block (its scales are whole rows of
        the stacked scale)."""
        return all(sum(self.out_sizes[:i]) % block_rows == 0
                   for i in range(1, len(self.out_sizes)))
