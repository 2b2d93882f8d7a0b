"""The start-up pass over a dataset file's records, shared by the ranks of a job (data/jsonl.py
IndexShare): rank k of n parses and tokenizes the k-th of n contiguous runs of the records, and
an all-gather gives every rank every run, in rank order (which is file order).

    records:  |---- rank 0 ----|---- rank 1 ----|---- rank 2 ----|---- rank 3 ----|
    then:     every rank holds the whole index, as if it had read every record itself

Invariants: every rank of `group` calls `gather` once per dataset it builds, in the same order
(the trainer builds the training data, then the validation data, on every rank); the index is the
one a single process builds (data/jsonl.py merges the parts in file order: the same samples,
counters, warnings, and first error).
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
