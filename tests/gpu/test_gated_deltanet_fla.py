"""The fla linear-attention backend (flash-linear-attention's kernels, CUDA) against the torch
reference on one Gated DeltaNet layer: a step mixing a fresh prompt, a continued chunk with
snapshots inside it and decodes, then a decode-only step (the fused recurrence), outputs and
every state slot alike (float32)."""

from __future__ import annotations

import pytest
import torch

from vlmserve.layers.gated_deltanet import (
    GatedDeltaNet,
    fla_available,
    gated_delta_rule_fla,
    gated_delta_rule_torch,
)
from vlmserve.layers.linear_metadata import build_linear_metadata

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(CUDA),
                                reason="needs CUDA and flash-linear-attention")


@torch.no_grad()
def test_fla_equals_the_torch_reference():
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 4, 8, 64, 64, 4, 1e-6).to(CUDA)
    for p in layer.parameters():
        p.copy_(torch.randn_like(p) * 0.1)
    conv, ssm = layer.state_shapes()
    pools = {}
    outs = {}
    for name, fn in (("torch", gated_delta_rule_torch), ("fla", gated_delta_rule_fla)):
        layer.rule_fn = fn
        gen = torch.Generator(device=CUDA).manual_seed(1)
        c = torch.zeros(8, *conv, device=CUDA)
        s = torch.zeros(8, *ssm, device=CUDA)
        lens = [300, 1, 130, 1]
        ours = layer(torch.randn(20, 256, device=CUDA, generator=gen), c, s,
                     build_linear_metadata([20], [2], [False], 4, CUDA))
        x = torch.randn(sum(lens), 256, device=CUDA, generator=gen)
        meta = build_linear_metadata(lens, [0, 1, 2, 3], [False, False, True, False], 4, CUDA,
                                     snapshots=[(0, 128, 5), (2, 64, 6)])
        step = layer(x, c, s, meta)
        decode = layer(torch.randn(4, 256, device=CUDA, generator=gen), c, s,
                       build_linear_metadata([1] * 4, [0, 1, 2, 3], [True] * 4, 4, CUDA))
        outs[name] = torch.cat([ours, step, decode])
        pools[name] = (c, s)
    torch.testing.assert_close(outs["fla"], outs["torch"], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(pools["fla"][0], pools["torch"][0])
    torch.testing.assert_close(pools["fla"][1], pools["torch"][1], rtol=2e-3, atol=2e-3)
