"""What the trainer reads: a dataset of rows numbered globally, the built-in one
(data/synthetic.py) or a file's (data/jsonl.py).

    global row:   0    1  |  2    3  |  4    5  |  6    7      (batch_size 2, dp_size 2)
    step 0:       dp 0    |  dp 1    |
    step 1:                             dp 0    |  dp 1

Invariants: the rows of dp rank d's batch at step s are global rows
`(s * dp_size + d) * batch_size + j` (`batch_rows`), and a row's samples are a pure function of
its number (and the dataset's seed and file), so the step is the data position: a run resumed
at step s, at any dp / cp / tp layout with the same global batch, reads the same rows, and the
cp and tp ranks that share a dp rank read the same batch. (A dataset file's checkpoint also
keeps where that row's window starts, `positions`, so that a resumed run indexes from there,
not from row 0: data/jsonl.py.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set
from typing import Any, NamedTuple

from titan_vlm.data.bad_samples import BadSampleLog
from titan_vlm.data.batch import Batch, Prompt, Sample, SlotData, SlotRule, collate
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer


class Position(NamedTuple):
    """Where a run's data stands in a dataset file (data/jsonl.py, kept in the trainer's
    checkpoint): the window (`epoch`, `number`: data/windows.py) that holds the next global row
    to train on, the first row of that window, and the bad and cut samples of epoch 0's windows
    before it."""

    epoch: int
    number: int
    first: int
    bad: int
    truncated: int


def batch_rows(step: int, dp_rank: int, dp_size: int, batch_size: int) -> range:
    """The global row numbers of dp rank `dp_rank`'s batch at `step`."""
    first = (step * dp_size + dp_rank) * batch_size
    return range(first, first + batch_size)


def keep_one_slot(
    rows: list[list[Sample]], tokenizer: ByteTokenizer | HFTokenizer
) -> list[list[Sample]]:
    """A batch's rows, where at least one sample is left; else (every sample of the batch was
    dropped) one padding token that trains nothing in its first row: a rank with no slots at all
    cannot run the step its peers run."""
    if not any(rows):
        rows[0] = [Sample([Prompt([tokenizer.PAD])])]
    return rows


class Dataset(ABC):
    """Rows of `seq_len` slots, read a batch at a time: `ensure(rows)` (every process of the job,
    with the same rows: a dataset file indexes the windows that hold them, data/jsonl.py), then
    `plan(rows)` (what a loader worker needs to read them: data/loader.py) and `read(plan)`, or
    `batch(...)` for all three; `forget(row)` once rows before `row` are done with. Counters the
    trainer's metrics report: `bad_samples(rows)` and `truncated_samples(rows)` (samples left out
    or cut to seq_len where the first `rows` global rows reach), `dropped` (the sample numbers
    this process left out of its batches). `slots`: how many slots each image takes
    (data/batch.py SlotRule: `tokens_per_image`, or the family's ImageRule that sizes each image);
    `slot_data`: the family's per-slot data of a sample, if it has any."""

    seq_len: int
    tokens_per_image: int
    slots: SlotRule
    image_size: int
    tokenizer: ByteTokenizer | HFTokenizer
    dropped: Set[int]
    slot_data: SlotData | None = None  # a family's per-slot data of each sample (collate)
    bad: BadSampleLog | None = None  # how a file's bad samples are reported (None: it has none)

    def ensure(self, rows: range) -> None:
        """Make global rows `rows` (and the row at `rows.stop`, whose `position` a checkpoint
        keeps) readable. Every process of the job calls it with the same rows (a dataset file's
        index is built a window at a time, its pass shared by them). The default: nothing to do
        (rows a pure function of their numbers)."""
        del rows

    def forget(self, row: int) -> None:
        """Rows before `row` will not be read again (the training loop's): what is kept of them
        may go. The default: nothing kept."""
        del row

    def plan(self, rows: range) -> Any:
        """What reading global rows `rows` takes (picklable: a loader worker builds the batch
        from it). The default: the rows themselves (a dataset whose rows are a pure function of
        their numbers)."""
        return rows

    @abstractmethod
    def read(self, plan: Any) -> list[list[Sample]]:
        """The samples of `plan`'s rows, each row's in order (they fit in seq_len slots)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the training log: what the rows hold."""

    def bad_samples(self, rows: int) -> int:
        """Samples left out before training where global rows 0 .. rows - 1 reach."""
        del rows
        return 0

    def truncated_samples(self, rows: int) -> int:
        """Samples cut to seq_len where global rows 0 .. rows - 1 reach."""
        del rows
        return 0

    def positions(self, row: int) -> list[Position]:
        """Where global row `row` lies in each dataset file (row ensured): what a run resumed
        there builds its data from (build_dataset's `positions`); none for rows that are a pure
        function of their numbers."""
        del row
        return []

    def collated(self, plan: Any) -> Batch:
        """`plan`'s rows as one Batch."""
        return collate(
            self.read(plan),
            self.seq_len,
            self.slots,
            self.image_size,
            self.tokenizer.PAD,
            self.tokenizer.IMAGE,
            self.slot_data,
        )

    def batch(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> Batch:
        """Dp rank `dp_rank`'s batch at `step`: rows `batch_rows(...)`, collated (every process
        of the job calls it at the same step: `ensure`)."""
        self.ensure(step_rows(step, dp_size, batch_size))
        return self.collated(self.plan(batch_rows(step, dp_rank, dp_size, batch_size)))


def step_rows(step: int, dp_size: int, batch_size: int, steps: int = 1) -> range:
    """The global rows of `steps` steps from `step` on, every dp rank's."""
    return range(step * dp_size * batch_size, (step + steps) * dp_size * batch_size)
