"""A weighted mixture of dataset sources (`data.dataset = "mixture"`, `data.mixture = "3
llava.jsonl, 1 captions/"`): each source is a dataset of its own (data/jsonl.py: its own index,
rows and epochs), and the run's global rows are dealt to the sources in a fixed pattern that
gives each its weight's share.

    weights 3 : 1 (period P = 4 rows)       global row:  0  1  2  3 | 4  5  6  7 | 8 ...
    smooth weighted round robin             source:      A  A  B  A | A  A  B  A | A ...
                                            its row:     0  1  0  2 | 3  4  1  5 | 6 ...

The pattern of one period is nginx's smooth weighted round robin over the weights as whole
numbers (each source's share spread through the period, not in runs); global row r is period
slot t = r mod P, whose source s reads its own row (r div P) * k_s + (slots of s before t), so
a source's rows are read in its own order (and its own epochs: a small source is seen more often
than once per epoch of a large one, which is what a weight asks for).

Invariants: a global row's source and source row are a pure function of r and the weights
(`Schedule.row`), so the step stays the data position (data/dataset.py): a run resumes, at any
dp / cp layout with the same global batch, at the same rows. Over any P consecutive rows, source
s gets exactly k_s of them. Record numbers (`dropped`) are the sources' own, shifted by the
records of the sources before it, so they are distinct across sources. A source's windows are
indexed as its own rows reach them (`ensure`), and a checkpoint keeps each source's position.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, MutableSet, Sequence
from fractions import Fraction
from math import gcd, lcm
from typing import Any, Protocol, TypeVar

from titan_vlm.data.bad_samples import BadSampleLog
from titan_vlm.data.batch import Sample, SlotData, SlotRule
from titan_vlm.data.dataset import Dataset, Position, keep_one_slot
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.errors import ConfigError

_T = TypeVar("_T")
MAX_PERIOD = 100_000  # rows of one period of the pattern: weights finer than this are refused


def data_sources(dataset: str, mixture: str) -> list[tuple[Fraction, str]]:
    """What data.dataset reads (not "synthetic"), as (weight, source) pairs: data.mixture's
    sources for "mixture", else the one source with weight 1. ConfigError (one line) where
    data.dataset and data.mixture disagree."""
    if dataset == "mixture" and not mixture:
        raise ConfigError('data.dataset = "mixture" needs data.mixture (its sources and weights)')
    if dataset != "mixture" and mixture:
        raise ConfigError(
            f'data.mixture is set, but data.dataset={dataset!r}: set data.dataset = "mixture" '
            "to train on the mixture (or clear data.mixture)"
        )
    return parse_mixture(mixture) if dataset == "mixture" else [(Fraction(1), dataset)]


def parse_mixture(value: str) -> list[tuple[Fraction, str]]:
    """data.mixture's sources: "WEIGHT SOURCE, WEIGHT SOURCE, ..." (a source as data.dataset
    names one: a file, folder or glob pattern; a weight a positive number) as (weight, source)
    pairs, in order. ConfigError (one line) for anything else."""
    pairs: list[tuple[Fraction, str]] = []
    for entry in value.split(","):
        words = entry.strip().split(None, 1)
        if len(words) != 2:
            raise ConfigError(
                f"data.mixture: {entry.strip()!r}: expected 'WEIGHT SOURCE' (e.g. "
                "'3 llava.jsonl, 1 captions/')"
            )
        where = f"data.mixture: {entry.strip()!r}"
        try:  # a float first: Fraction would spell out an exponent such as 1e-100000000
            rough = float(Fraction(words[0]) if "/" in words[0] else words[0])
        except (ValueError, ZeroDivisionError):
            rough = float("nan")
        if rough != rough or rough in (float("inf"), float("-inf")):
            raise ConfigError(f"{where}: the weight {words[0]!r} is not a number")
        if rough <= 0:
            raise ConfigError(f"{where}: a weight must be > 0")
        if not 1 / MAX_PERIOD <= rough <= MAX_PERIOD:
            raise ConfigError(
                f"{where}: the weight {words[0]} needs a pattern of more than {MAX_PERIOD} rows: "
                "round it"
            )
        weight = Fraction(words[0])
        if weight.numerator > MAX_PERIOD or weight.denominator > MAX_PERIOD:
            raise ConfigError(
                f"data.mixture: {entry.strip()!r}: the weight {words[0]} needs a pattern of more "
                f"than {MAX_PERIOD} rows: round it"
            )
        pairs.append((weight, words[1].strip()))
    if len(pairs) < 2:
        raise ConfigError("data.mixture: name at least two sources (one source: data.dataset)")
    return pairs


class Schedule:
    """Which source each global row reads, and which of its rows (module docstring)."""

    def __init__(self, weights: Sequence[Fraction]):
        scale = lcm(*(w.denominator for w in weights))
        whole = [int(w * scale) for w in weights]
        common = gcd(*whole)
        self.shares = [k // common for k in whole]  # k_s: source s's rows a period
        self.period = sum(self.shares)
        if self.period > MAX_PERIOD:
            raise ConfigError(
                f"data.mixture: weights {':'.join(map(str, self.shares))} need a pattern of "
                f"{self.period} rows (at most {MAX_PERIOD}): round them"
            )
        self.source, self.before = array("i"), array("q")  # per period slot
        current, seen = [0] * len(self.shares), [0] * len(self.shares)
        for _ in range(self.period):  # nginx's smooth weighted round robin
            for s, k in enumerate(self.shares):
                current[s] += k
            s = max(range(len(current)), key=lambda j: (current[j], -j))  # ties: the first
            current[s] -= self.period
            self.source.append(s)
            self.before.append(seen[s])
            seen[s] += 1
        # each source's period slots, in order (`count`)
        self.slots = [array("q") for _ in self.shares]
        for t, s in enumerate(self.source):
            self.slots[s].append(t)

    def row(self, r: int) -> tuple[int, int]:
        """Global row r's (source, row of that source)."""
        cycle, t = divmod(r, self.period)
        s = self.source[t]
        return s, cycle * self.shares[s] + self.before[t]

    def count(self, s: int, rows: int) -> int:
        """Source s's rows among global rows 0 .. rows - 1 (its next row's number)."""
        cycle, t = divmod(rows, self.period)
        return cycle * self.shares[s] + bisect_left(self.slots[s], t)


class Source(Protocol):
    """What the mixture needs of a source (data/jsonl.py JsonlDataset is one): the shapes of its
    rows, its records (numbered 0 .. records - 1), its counters, and its rows by their own global
    numbers."""

    seq_len: int
    tokens_per_image: int
    slots: SlotRule
    image_size: int
    tokenizer: ByteTokenizer | HFTokenizer
    slot_data: SlotData | None
    dropped: set[int]
    bad: BadSampleLog
    records: int

    def ensure(self, rows: range) -> None: ...

    def forget(self, row: int) -> None: ...

    def plan(self, rows: Iterable[int]) -> list[Any]: ...

    def rows_of(self, plan: list[Any]) -> list[list[Sample]]: ...

    def bad_samples(self, rows: int) -> int: ...

    def truncated_samples(self, rows: int) -> int: ...

    def position(self, row: int) -> Position: ...

    def describe(self) -> str: ...


class _Dropped(MutableSet[int]):
    """The sources' dropped record numbers as one set: source k's record i is `firsts[k] + i`."""

    def __init__(self, sources: Sequence[Source], firsts: Sequence[int]):
        self.sources, self.firsts = sources, firsts

    @classmethod
    def _from_iterable(cls, ids: Iterable[_T]) -> set[_T]:  # what set operations return
        return set(ids)

    def _split(self, i: int) -> tuple[int, int]:
        k = max(j for j, first in enumerate(self.firsts) if first <= i)
        return k, i - self.firsts[k]

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int) or i < 0:
            return False
        k, own = self._split(i)
        return own in self.sources[k].dropped

    def __iter__(self) -> Iterator[int]:
        for source, first in zip(self.sources, self.firsts):
            yield from (first + i for i in sorted(source.dropped))

    def __len__(self) -> int:
        return sum(len(s.dropped) for s in self.sources)

    def add(self, i: int) -> None:
        k, own = self._split(i)
        self.sources[k].dropped.add(own)

    def discard(self, i: int) -> None:
        k, own = self._split(i)
        self.sources[k].dropped.discard(own)

    def update(self, ids: Iterable[int]) -> None:
        for i in ids:
            self.add(i)


class MixtureDataset(Dataset):
    """`sources` (built as data.dataset's would be, in data.mixture's order) mixed by `weights`
    (module docstring). Their bad samples are reported through one BadSampleLog, `bad`, from
    their start-up on (each given it: one warning a record, one cap on warnings for the run, one
    place a loader worker records them)."""

    def __init__(self, sources: Sequence[Source], weights: Sequence[Fraction], bad: BadSampleLog):
        first = sources[0]
        self.sources = list(sources)
        self.schedule = Schedule(weights)
        self.seq_len, self.tokens_per_image = first.seq_len, first.tokens_per_image
        self.slots, self.image_size = first.slots, first.image_size
        self.tokenizer, self.slot_data = first.tokenizer, first.slot_data
        self.bad = bad
        if any(source.bad is not bad for source in self.sources):
            raise ValueError("MixtureDataset: every source reports through the mixture's `bad`")
        firsts, n = [], 0
        for source in self.sources:
            firsts.append(n)
            n += source.records
        self.dropped = _Dropped(self.sources, firsts)

    def _own(self, rows: range) -> list[range]:
        """Each source's own rows among global rows `rows`."""
        c = self.schedule.count
        return [range(c(s, rows.start), c(s, rows.stop)) for s in range(len(self.sources))]

    def ensure(self, rows: range) -> None:
        for source, own in zip(self.sources, self._own(rows)):
            source.ensure(own)

    def forget(self, row: int) -> None:
        for s, source in enumerate(self.sources):
            source.forget(self.schedule.count(s, row))

    def plan(self, rows: range) -> list[tuple[int, Any]]:
        """Each row's (source, its plan row)."""
        wanted = [self.schedule.row(r) for r in rows]
        planned = {
            s: iter(self.sources[s].plan([own for t, own in wanted if t == s]))
            for s in sorted({s for s, _ in wanted})
        }
        return [(s, next(planned[s])) for s, _ in wanted]

    def read(self, plan: list[tuple[int, Any]]) -> list[list[Sample]]:
        got: dict[int, Iterator[list[Sample]]] = {}
        for s in sorted({s for s, _ in plan}):  # each source's rows read together
            got[s] = iter(self.sources[s].rows_of([row for t, row in plan if t == s]))
        return keep_one_slot([next(got[s]) for s, _ in plan], self.tokenizer)

    def bad_samples(self, rows: int) -> int:
        c = self.schedule.count
        return sum(src.bad_samples(c(s, rows)) for s, src in enumerate(self.sources))

    def truncated_samples(self, rows: int) -> int:
        c = self.schedule.count
        return sum(src.truncated_samples(c(s, rows)) for s, src in enumerate(self.sources))

    def positions(self, row: int) -> list[Position]:
        c = self.schedule.count
        return [src.position(c(s, row)) for s, src in enumerate(self.sources)]

    def describe(self) -> str:
        shares = ":".join(map(str, self.schedule.shares))
        parts = "; ".join(f"[{k}] {s.describe()}" for k, s in enumerate(self.sources))
        return f"mixture of {len(self.sources)} sources, rows dealt {shares}: {parts}"
