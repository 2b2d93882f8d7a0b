"""A window's pass over a dataset file's records, shared by the ranks of a job (data/jsonl.py
IndexShare): rank k of n parses and tokenizes the k-th of n contiguous runs of the window's
records, and an all-gather gives every rank every run, in rank order (the window's order).

    window:   |---- rank 0 ----|---- rank 1 ----|---- rank 2 ----|---- rank 3 ----|
    then:     every rank holds the whole window, as if it had read every record itself

Invariants: every rank of `group` makes the same calls in the same order (the datasets are
built, and their windows indexed as the training loop, validation and the log reach the same
rows, on every rank: Dataset.ensure); a window is the one a single process indexes
(data/jsonl.py merges the parts in order: the same samples, counters, warnings, and first
error).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from titan_vlm.data.jsonl import IndexPart


class GroupShare:
    """IndexShare over the ranks of `group`."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def part(self, n: int) -> range:
        """This rank's run of the n records."""
        return range(n * self.rank // self.size, n * (self.rank + 1) // self.size)

    def agree(self, mine: bool) -> bool:
        """Whether every rank says yes (each rank calls it at the same point)."""
        every: list[bool | None] = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        return all(every)

    def differing(self, mine: object) -> int | None:
        """The first rank whose `mine` differs from rank 0's, None where all are equal (each
        rank calls it at the same point)."""
        every: list[object] = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        return next((k for k, theirs in enumerate(every) if theirs != every[0]), None)

    def gather(self, mine: IndexPart) -> list[IndexPart]:
        """Every rank's part, in rank order."""
        parts: list[IndexPart | None] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        return [p for p in parts if p is not None]
