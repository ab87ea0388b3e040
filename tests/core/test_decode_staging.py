"""The host side of decode CUDA graphs (runs on CPU): what a step's staging rows hold."""

from types import SimpleNamespace

from vlmserve.worker.cuda_graphs import _Staging

BS, SCRATCH = 4, 99


def state(tokens, computed, blocks, in_flight=0, row=-1, delta=0):
    return SimpleNamespace(token_ids=list(tokens), num_computed_tokens=computed,
                           block_ids=list(blocks), in_flight=in_flight, sample_row=row,
                           position_offset=delta)


def test_rows_ids_or_in_flight_rows_positions_slots_and_padding():
    stage = _Staging(n=8, max_blocks=5, block_size=BS, scratch_block=SCRATCH)
    a = state([5, 6, 7, 8, 9], computed=4, blocks=[3, 11], delta=-2)  # token known: id 9
    b = state([1, 2, 3], computed=3, blocks=[7], in_flight=1, row=2)  # token in flight
    stage.fill([a, b], bs=4)
    assert stage.np64[0, 0] == 9  # a's id (b's slot of the id row is not read)
    assert stage.np64[0, 2:4].tolist() == [0, 0]
    assert stage.np64[1:, :4].tolist() == [
        [4 - 2, 3, 0, 0],  # positions (+ mRoPE delta)
        [11 * BS + 0, 7 * BS + 3, SCRATCH * BS, SCRATCH * BS],  # KV slots
        [-1, 2, -1, -1],  # rows of the sampled buffer
    ]
    assert stage.np32[:4].tolist() == [5, 4, 1, 1]  # context lengths after the step
    assert stage.table[0, :2].tolist() == [3, 11] and stage.table[1, :1].tolist() == [7]


def test_table_rows_follow_owners_and_growth():
    stage = _Staging(n=4, max_blocks=6, block_size=BS, scratch_block=SCRATCH)
    a = state(range(8), computed=7, blocks=[1, 2])
    b = state(range(3), computed=2, blocks=[5])
    stage.fill([a, b], bs=2)
    a.block_ids.append(9)  # a crosses into a new block
    a.token_ids.append(0)
    a.num_computed_tokens = 8
    stage.fill([b, a], bs=2)  # rows swap owners: both rewritten
    assert stage.table[0, :1].tolist() == [5] and stage.table[1, :3].tolist() == [1, 2, 9]
    stage.fill([b], bs=2)  # row 1 becomes padding: back to the scratch block
    assert stage.table[1, :3].tolist() == [SCRATCH] * 3
    assert stage.np64[2, 1] == SCRATCH * BS and stage.np32[1] == 1


def test_every_kv_group_gets_its_slots_and_table_rows():
    stage = _Staging(n=4, max_blocks=5, block_size=BS, scratch_block=SCRATCH,
                     extra_scratch=(50,))
    a = state(range(9), computed=8, blocks=[1, 2, 3])
    a.extra_block_ids = [[50, 7, 8]]  # a sliding group: its first place passed (null)
    stage.fill([a], bs=2)
    assert stage.np64[2, :2].tolist() == [3 * BS, SCRATCH * BS]
    assert stage.np64[4, :2].tolist() == [8 * BS, 50 * BS]  # the second group's slots
    assert stage.tables[1][0, :3].tolist() == [50, 7, 8]
    a.block_ids.append(4)
    a.extra_block_ids[0].append(9)
    a.token_ids += [0] * 4
    a.num_computed_tokens = 12
    stage.fill([a], bs=2)  # the new block reaches both tables
    assert stage.tables[0][0, :4].tolist() == [1, 2, 3, 4]
    assert stage.tables[1][0, :4].tolist() == [50, 7, 8, 9]
    assert stage.np64[4, 0] == 9 * BS
    stage.fill([], bs=2)  # padding again: every group's row back to its scratch block
    assert stage.tables[1][0, :4].tolist() == [50] * 4 and stage.np64[4, 0] == 50 * BS
