"""Gated DeltaNet (layers/gated_deltanet.py) against transformers' own Qwen3.5 layer (its torch
path): a whole prompt from fresh states, a prompt cut into chunks carrying its states, and one
call mixing fresh and continued prefill chunks with decodes at scattered state slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmserve.layers.gated_deltanet import GatedDeltaNet
from vlmserve.layers.linear_metadata import build_linear_metadata, conv_rows

HIDDEN, KH, VH, KD, VD, KERNEL = 32, 2, 4, 8, 8, 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def layers():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_key_heads=KH,
                            linear_num_value_heads=VH, linear_key_head_dim=KD,
                            linear_value_head_dim=VD, linear_conv_kernel_dim=KERNEL,
                            num_hidden_layers=2)
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ours = GatedDeltaNet(HIDDEN, KH, VH, KD, VD, KERNEL, cfg.rms_norm_eps)
    assert ours.load_weights(list(hf.state_dict().items())) == {
        n for n, _ in ours.named_parameters()}
    return hf, ours


def pools(layer, slots: int = 6):
    conv, ssm = layer.state_shapes()
    return torch.zeros(slots, *conv), torch.zeros(slots, *ssm)


@torch.no_grad()
def hf_out(hf, x: torch.Tensor) -> torch.Tensor:
    """transformers over the whole sequence ``x [L, hidden]`` from nothing."""
    return hf(x[None])[0]


@torch.no_grad()
@pytest.mark.parametrize("length", [1, 3, 64, 150])
def test_a_whole_prompt_equals_transformers(layers, length):
    hf, ours = layers
    x = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(length))
    conv, ssm = pools(ours)
    out = ours(x, conv, ssm, build_linear_metadata([length], [2], [False], KERNEL, CPU))
    torch.testing.assert_close(out, hf_out(hf, x), rtol=1e-4, atol=1e-4)
    assert conv[[0, 1, 3, 4, 5]].abs().sum() == 0 and ssm[[0, 1, 3, 4, 5]].abs().sum() == 0


@torch.no_grad()
def test_a_prompt_in_chunks_carries_its_states(layers):
    """Chunks of 37, 1, 1, 61, 1 and 49 tokens (cutting through the 64-token chunks of the
    chunked form and through the convolution's window) equal the prompt at once."""
    hf, ours = layers
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(7))
    conv, ssm = pools(ours)
    whole = ours(x, conv, ssm, build_linear_metadata([150], [0], [False], KERNEL, CPU))
    final = conv[0].clone(), ssm[0].clone()
    cuts, outs = [0, 37, 38, 39, 100, 101, 150], []
    for a, b in zip(cuts, cuts[1:]):
        meta = build_linear_metadata([b - a], [3], [a > 0], KERNEL, CPU)
        outs.append(ours(x[a:b], conv, ssm, meta))
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), hf_out(hf, x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv[3], final[0])
    torch.testing.assert_close(ssm[3], final[1], rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("length", [1, 20])
def test_a_slots_leftovers_never_reach_a_fresh_sequence(layers, length):
    """A fresh sequence (one token: the decode path; or a chunk) in a slot whose last request
    left NaN and inf answers as from zeros."""
    _, ours = layers
    x = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(5))
    meta = build_linear_metadata([length], [1], [False], KERNEL, CPU)
    clean = ours(x, *pools(ours), meta)
    conv, ssm = pools(ours)
    conv[1], ssm[1] = float("nan"), float("inf")
    torch.testing.assert_close(ours(x, conv, ssm, meta), clean)


@torch.no_grad()
def test_one_call_mixes_prefill_chunks_and_decodes(layers):
    """Four sequences at slots 4, 1, 5, 0 in one call: a fresh 70-token prompt, a prompt's
    second chunk (20 done, 30 new), a decode after 40 tokens, a decode after 2 (fewer than
    the convolution's window); each equals transformers over that sequence's whole tokens.
    Slots 2 and 3 (nobody's this step) keep their contents."""
    hf, ours = layers
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n, HIDDEN, generator=gen) for n in (70, 50, 41, 3)]
    done = [0, 20, 40, 2]
    slots = [4, 1, 5, 0]
    conv, ssm = pools(ours)
    conv[2:4].fill_(5.0)
    ssm[2:4].fill_(-3.0)
    for x, d, s in zip(seqs, done, slots):  # the earlier steps of each sequence
        if d:
            ours(x[:d], conv, ssm, build_linear_metadata([d], [s], [False], KERNEL, CPU))
    step = torch.cat([x[d:] for x, d in zip(seqs, done)])
    lens = [len(x) - d for x, d in zip(seqs, done)]
    meta = build_linear_metadata(lens, slots, [d > 0 for d in done], KERNEL, CPU)
    out = ours(step, conv, ssm, meta)
    want = torch.cat([hf_out(hf, x)[d:] for x, d in zip(seqs, done)])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert (conv[2:4] == 5.0).all() and (ssm[2:4] == -3.0).all()


def test_conv_rows_index_states_then_tokens():
    """Rows are [states of B sequences (kernel - 1 each) | tokens]: a 2-token sequence and a
    1-token one with kernel 3 (states of 2 rows each, tokens from row 4)."""
    index, state = conv_rows([2, 1], 3)
    assert index.tolist() == [[0, 1, 4], [1, 4, 5], [2, 3, 6]]
    assert state.tolist() == [[4, 5], [3, 6]]
    assert isinstance(index, np.ndarray)


def test_the_convolution_gathered_at_once_equals_tap_by_tap(monkeypatch):
    """Short steps gather every token's window at once, long ones go tap by tap: the same
    outputs and the same states written (a step of fresh and continued sequences, bias)."""
    from vlmserve.layers import gated_deltanet as gdn

    gen = torch.Generator().manual_seed(3)
    x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((9, 12), (12, KERNEL),
                                                                          (12,)))
    start = torch.randn(5, KERNEL - 1, 12, generator=gen)
    meta = build_linear_metadata([4, 1, 3, 1], [4, 0, 2, 1], [True, True, False, True],
                                 KERNEL, CPU, [(0, 2, 3)])
    results = []
    for limit in (9, 8):  # this step's 9 tokens at once, then tap by tap
        monkeypatch.setattr(gdn, "GATHER_TOKENS", limit)
        state = start.clone()
        results.append((gdn.depthwise_conv(x, weight, state, meta, bias), state))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][1], results[1][1])


@torch.no_grad()
def test_snapshots_inside_a_chunk_hold_the_states_there(layers):
    """A 100-token chunk asking for its states after 16 and 64 tokens (slots 4 and 5), a
    40-token one after 20 (slot 7), beside a decode: the outputs are the chunks' as if asked
    nothing, each snapshot equals the states of a run of only that many tokens, and a
    sequence resumed from a snapshot continues as transformers over the whole tokens."""
    hf, ours = layers
    gen = torch.Generator().manual_seed(11)
    x, other = torch.randn(100, HIDDEN, generator=gen), torch.randn(6, HIDDEN, generator=gen)
    y = torch.randn(40, HIDDEN, generator=gen)
    conv, ssm = pools(ours, 8)
    ours(other[:5], conv, ssm, build_linear_metadata([5], [1], [False], KERNEL, CPU))
    meta = build_linear_metadata([100, 1, 40], [0, 1, 2], [False, True, False], KERNEL, CPU,
                                 snapshots=[(0, 64, 5), (2, 20, 7), (0, 16, 4)])
    out = ours(torch.cat([x, other[5:], y]), conv, ssm, meta)
    torch.testing.assert_close(out[:100], hf_out(hf, x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[100:101], hf_out(hf, other)[5:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[101:], hf_out(hf, y), rtol=1e-4, atol=1e-4)
    for seq, n, slot in ((x, 16, 4), (x, 64, 5), (y, 20, 7)):
        c, s = pools(ours)
        ours(seq[:n], c, s, build_linear_metadata([n], [2], [False], KERNEL, CPU))
        torch.testing.assert_close(conv[slot], c[2])
        torch.testing.assert_close(ssm[slot], s[2], rtol=1e-4, atol=1e-5)
    conv[3], ssm[3] = conv[4], ssm[4]  # resume at 16 from the snapshot
    rest = ours(x[16:], conv, ssm, build_linear_metadata([84], [3], [True], KERNEL, CPU))
    torch.testing.assert_close(rest, hf_out(hf, x)[16:], rtol=1e-4, atol=1e-4)


def test_a_step_builds_its_host_indices_once():
    """What the layers would otherwise read back from the device is built with the step's
    metadata: fla's chunk indices (each CHUNK tokens of each sequence), the starts on the
    host, the single-token sequences' rows, and the passes of a step holding snapshots (the
    chunk of 100 cut at 16 and 64: three passes, the decode and the 40 tokens in the first)."""
    meta = build_linear_metadata([1, 130, 64, 65, 1], [0, 1, 2, 3, 4], [True] * 5, KERNEL, CPU)
    assert meta.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0],
                                           [3, 1], [4, 0]]
    assert meta.query_start_loc_cpu.tolist() == [0, 1, 131, 195, 260, 261]
    assert meta.single_rows.tolist() == [0, 260] and meta.single_seqs.tolist() == [0, 4]
    assert build_linear_metadata([1, 1], [0, 1], [True] * 2, KERNEL, CPU).chunk_indices is None
    meta = build_linear_metadata([100, 1, 40], [0, 1, 2], [False, True, False], KERNEL, CPU,
                                 snapshots=[(0, 64, 5), (2, 20, 7), (0, 16, 4)])
    passes = [(p.meta.query_lens_cpu, p.meta.state_slots_cpu, p.meta.has_initial_state_cpu,
               None if p.copies is None else [c.tolist() for c in p.copies])
              for p in meta.passes]
    assert passes == [([16, 1, 20], [0, 1, 2], [False, True, False], [[2, 0], [7, 4]]),
                      ([48, 20], [0, 2], [True, True], [[0], [5]]),
                      ([36], [0], [True], None)]
    assert meta.passes[0].rows.tolist() == [*range(16), 100, *range(101, 121)]
