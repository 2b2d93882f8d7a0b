"""The order a dataset file's records are indexed in (data/windows.py): windows of whole blocks,
every record once an epoch, a new order every epoch, the same order wherever it is computed."""

import pytest

from titan_vlm.data.windows import BLOCK, WindowOrder, positions, window_blocks


def records_of_epoch(order: WindowOrder, epoch: int) -> list[int]:
    return [i for w in range(order.windows) for run in order.records_of(epoch, w) for i in run]


@pytest.mark.parametrize("records", [1, BLOCK - 1, BLOCK, 5 * BLOCK + 17])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epochs_windows_hold_every_record_once(records, shuffle):
    order = WindowOrder(records, window_blocks=2, seed=3, shuffle=shuffle)
    for epoch in range(3):
        seen = records_of_epoch(order, epoch)
        assert sorted(seen) == list(range(records))
        if not shuffle:
            assert seen == list(range(records))  # file order


def test_blocks_move_whole_in_a_new_order_every_epoch():
    order = WindowOrder(8 * BLOCK, window_blocks=2, seed=0, shuffle=True)
    epochs = [records_of_epoch(order, e) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # the control: the order changes
    for seen in epochs:
        starts = seen[::BLOCK]
        assert all(s % BLOCK == 0 for s in starts)  # each block whole, in file order within
        blocks = [seen[k : k + BLOCK] for k in range(0, len(seen), BLOCK)]
        assert all(block == list(range(s, s + BLOCK)) for block, s in zip(blocks, starts))
    again = WindowOrder(8 * BLOCK, window_blocks=2, seed=0, shuffle=True)
    assert records_of_epoch(again, 1) == epochs[1]  # a pure function of its arguments
    other = WindowOrder(8 * BLOCK, window_blocks=2, seed=1, shuffle=True)
    assert records_of_epoch(other, 1) != epochs[1]


def test_a_window_is_whole_blocks_and_neighbours_are_one_run():
    order = WindowOrder(10 * BLOCK + 5, window_blocks=4, seed=0, shuffle=False)
    assert (order.blocks, order.windows, order.window_records) == (11, 3, 4 * BLOCK)
    assert order.records_of(0, 0) == [range(0, 4 * BLOCK)]
    assert order.records_of(0, 2) == [range(8 * BLOCK, 10 * BLOCK + 5)]
    with pytest.raises(IndexError):
        order.records_of(0, 3)
    shuffled = WindowOrder(10 * BLOCK + 5, window_blocks=4, seed=0, shuffle=True)
    runs = shuffled.records_of(0, 0)
    assert sum(len(r) for r in runs) <= 4 * BLOCK and len(runs) <= 4


def test_window_blocks_round_up_to_whole_blocks():
    assert [window_blocks(n) for n in (1, BLOCK, BLOCK + 1, 16384)] == [1, 1, 2, 16]


def test_rows_are_shuffled_per_window_and_epoch():
    order = WindowOrder(4 * BLOCK, window_blocks=1, seed=0, shuffle=True)
    a, b, c = order.row_order(0, 0, 50), order.row_order(0, 1, 50), order.row_order(1, 0, 50)
    assert sorted(a) == list(range(50)) and a != b and a != c
    assert WindowOrder(4 * BLOCK, 1, 0, shuffle=False).row_order(0, 0, 5) == [0, 1, 2, 3, 4]


def test_positions_map_a_part_of_a_window_to_record_runs():
    runs = [range(2048, 3072), range(0, 1024)]
    assert positions(runs, range(1000, 1100)) == [range(3048, 3072), range(0, 76)]
    assert positions(runs, range(0, 0)) == []
    assert [i for r in positions(runs, range(0, 2048)) for i in r] == [i for r in runs for i in r]
