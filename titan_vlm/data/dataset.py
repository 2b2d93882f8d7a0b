"""What the trainer reads: a dataset of rows numbered globally, the built-in one
(data/synthetic.py) or a file's (data/jsonl.py).

    global row:   0    1  |  2    3  |  4    5  |  6    7      (batch_size 2, dp_size 2)
    step 0:       dp 0    |  dp 1    |
    step 1:                             dp 0    |  dp 1

Invariants: the rows of dp rank d's batch at step s are global rows
`(s * dp_size + d) * batch_size + j` (`batch_rows`), and a row's samples are a pure function of
its number (and the dataset's seed and file), so the step is the data position: a run resumed
at step s, at any dp / cp / tp layout with the same global batch, reads the same rows, and the
cp and tp ranks that share a dp rank read the same batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set

from titan_vlm.data.bad_samples import BadSampleLog
from titan_vlm.data.batch import Batch, Prompt, Sample, SlotData, SlotRule, collate
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer


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
    """Rows of `seq_len` slots, read a batch at a time. Counters the trainer's metrics report:
    `bad_at_startup` (samples left out before training), `truncated` (samples cut to seq_len),
    `dropped` (the sample numbers this process left out of its batches). `slots`: how many slots
    each image takes (data/batch.py SlotRule: `tokens_per_image`, or the family's ImageRule that
    sizes each image); `slot_data`: the family's per-slot data of a sample, if it has any."""

    seq_len: int
    tokens_per_image: int
    slots: SlotRule
    image_size: int
    tokenizer: ByteTokenizer | HFTokenizer
    bad_at_startup: int
    truncated: int
    dropped: Set[int]
    slot_data: SlotData | None = None  # a family's per-slot data of each sample (collate)
    bad: BadSampleLog | None = None  # how a file's bad samples are reported (None: it has none)

    @abstractmethod
    def read(self, rows: range) -> list[list[Sample]]:
        """The samples of global rows `rows`, each row's in order (they fit in seq_len slots)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the training log: what the rows hold."""

    def batch(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> Batch:
        """Dp rank `dp_rank`'s batch at `step`: rows `batch_rows(...)`, collated."""
        return collate(
            self.read(batch_rows(step, dp_rank, dp_size, batch_size)),
            self.seq_len,
            self.slots,
            self.image_size,
            self.tokenizer.PAD,
            self.tokenizer.IMAGE,
            self.slot_data,
        )
