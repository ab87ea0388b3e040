"""The host side of a step's attention metadata: block tables and slot mapping."""

from __future__ import annotations

import random

import torch

from vlmserve.layers.attention import block_table_tensor, build_attention_metadata


def test_block_table_rows_padded_with_zero() -> None:
    rng = random.Random(0)
    ids = [[rng.randrange(1, 10_000) for _ in range(rng.randrange(0, 40))] for _ in range(50)]
    ids[7] = list(range(1, 90))  # the widest row sets the width
    table = block_table_tensor(ids)
    assert table.dtype == torch.int64 and table.shape == (50, 89)
    assert table.tolist() == [b + [0] * (89 - len(b)) for b in ids]
    assert block_table_tensor([[3], [1, 2]], width=4).tolist() == [[3, 0, 0, 0], [1, 2, 0, 0]]


def test_slots_follow_each_request_blocks() -> None:
    """Token t of a request at context position p goes to slot block_ids[p // bs] * bs +
    p % bs: a 5-token chunk after 14 cached tokens, and two decodes."""
    bs = 4
    ids = [[7, 3, 9, 2, 5], [11, 12], [20]]
    meta = build_attention_metadata([5, 1, 1], [19, 6, 1], ids, bs, torch.device("cpu"))
    want = [ids[0][p // bs] * bs + p % bs for p in range(14, 19)]
    want += [ids[1][5 // bs] * bs + 5 % bs, ids[2][0] * bs]
    assert meta.slot_mapping.tolist() == want
    assert meta.query_start_loc.tolist() == [0, 5, 6, 7]
    assert meta.block_tables.tolist() == [ids[0], [11, 12, 0, 0, 0], [20, 0, 0, 0, 0]]
