"""The order a dataset file's records are indexed, packed and read in: a window at a time, so
that no process parses the whole corpus before the first step (data/jsonl.py).

    records:  | b0 | b1 | b2 | b3 | b4 | b5 | b6 |        blocks of BLOCK consecutive records
    epoch e:    b4 b1 b6 | b0 b3 b5 | b2               the blocks in a seeded order (data.shuffle;
                window 0   window 1   window 2          else file order), window_blocks a window
    window 0:   b4's records, then b1's, then b6's     indexed as one pass, packed in this order
                (rows never cross a window), its rows then shuffled
    rows:       epoch 0's windows' rows in turn, then epoch 1's, ... (global row numbers)

Invariants: the windows of an epoch hold every record exactly once; a window's records, and the
order of its rows, are pure functions of (records, window_blocks, seed, shuffle, epoch, window),
so every process of a job, at any layout and after any resume, sees the same windows; a window
reads its records from at most window_blocks runs of consecutive records (a table's row group,
a tar's members are read a run at a time, not one record here and one there).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

BLOCK = 1024  # records a block: what an epoch's order moves as a whole


def window_blocks(window_records: int) -> int:
    """Blocks a window of data.index_window records holds (rounded up to whole blocks)."""
    return max(-(-window_records // BLOCK), 1)


@dataclass(frozen=True)
class WindowOrder:
    """The windows of `records` records (module docstring); `seed` and `shuffle` as the dataset's
    (training.seed, data.shuffle)."""

    records: int
    window_blocks: int
    seed: int
    shuffle: bool
    _orders: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def blocks(self) -> int:
        return -(-self.records // BLOCK)

    @property
    def windows(self) -> int:
        """Windows an epoch has."""
        return -(-self.blocks // self.window_blocks)

    @property
    def window_records(self) -> int:
        """Records a whole window holds (the last of an epoch may hold fewer)."""
        return min(self.window_blocks * BLOCK, self.records)

    def block_order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s blocks in the order its windows read them."""
        if epoch not in self._orders:
            order = list(range(self.blocks))
            if self.shuffle:
                random.Random(f"{self.seed}/blocks/{epoch}").shuffle(order)
            if len(self._orders) >= 2:  # the epochs in use: one, two where a step crosses
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return self._orders[epoch]

    def records_of(self, epoch: int, window: int) -> list[range]:
        """Window `window` of epoch `epoch`'s record numbers, in its order: runs of consecutive
        records (one a block, neighbouring blocks joined)."""
        if not 0 <= window < self.windows:
            raise IndexError(f"window {window} of {self.windows}")
        runs: list[range] = []
        blocks = self.block_order(epoch)[window * self.window_blocks :][: self.window_blocks]
        for b in blocks:
            run = range(b * BLOCK, min((b + 1) * BLOCK, self.records))
            if runs and runs[-1].stop == run.start:
                runs[-1] = range(runs[-1].start, run.stop)
            else:
                runs.append(run)
        return runs

    def row_order(self, epoch: int, window: int, rows: int) -> list[int]:
        """The order a window's `rows` packed rows are read in."""
        order = list(range(rows))
        if self.shuffle:
            random.Random(f"{self.seed}/rows/{epoch}/{window}").shuffle(order)
        return order


def positions(runs: list[range], part: range) -> list[range]:
    """Positions `part` (a run of a window's positions: 0 is its first record) of the window
    whose records are `runs`, as runs of record numbers."""
    out: list[range] = []
    at = 0
    for run in runs:
        lo, hi = max(part.start - at, 0), min(part.stop - at, len(run))
        if lo < hi:
            out.append(run[lo:hi])
        at += len(run)
    return out
