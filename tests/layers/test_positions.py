"""Position schemes: a step's positions from token indices and the processor's prompt rows."""

import torch

from vlmserve.layers.positions import MRopePositions, TokenPositions


def test_token_positions_are_the_indices_and_a_view_for_decode():
    scheme = TokenPositions()
    assert scheme.build([3, 4, 5, 9], []).tolist() == [3, 4, 5, 9]
    buf = torch.arange(4)
    assert scheme.for_tokens(buf).data_ptr() == buf.data_ptr()


def test_mrope_prompt_spans_overwrite_equal_rows():
    scheme = MRopePositions()
    prompt = torch.tensor([[0, 1, 1, 1], [0, 1, 2, 1], [0, 1, 1, 2]])  # [3, 4] prompt rows
    # request A: prompt tokens 2..3 then a token past it (offset -1); request B: a decode at 7
    pos = scheme.build([2, 3, 3, 7], [(0, prompt[:, 2:4])])
    assert pos.tolist() == [[1, 1, 3, 7], [2, 1, 3, 7], [1, 2, 3, 7]]
    buf = torch.tensor([5, 6])
    view = scheme.for_tokens(buf)  # decode graphs: three equal rows over one buffer row
    assert view.shape == (3, 2) and view.data_ptr() == buf.data_ptr()
    buf[0] = 8
    assert view[:, 0].tolist() == [8, 8, 8]
