"""How a dataset file's bad samples are reported (data/jsonl.py): with
`data.on_bad_sample = "skip"` each one is a warning `data: <file>:<line>: <reason> (<action>)`
and the sample is skipped (or truncated, or dropped from its row); with "error" the first one is
a DataError naming the file and line.

Invariants: a line is warned about at most once per process, whatever its reasons and however
often its batch is read again, and only the first MAX_WARNINGS are logged (the trainer's metrics
count them all), so a broken dataset does not bury the training log; a process logs only the
kinds of warning its caller lets it (`log`), so that the ranks of a job do not repeat each
other. A loader worker (data/loader.py) and each process's share of a shared window pass
keep their reports instead (`recorded`): the process that logs reports them, in file order, so
that they are warned about and counted as when one process does everything.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from titan_vlm.errors import ConfigError

logger = logging.getLogger("titan_vlm")

BAD_SAMPLE_MODES = ("skip", "error")
MAX_WARNINGS = 100  # per process

# BadSampleLog.report's arguments: (where, reason, log, action)
Report = tuple[str, str, bool, str]


class DataError(ConfigError):
    """A bad sample with data.on_bad_sample = "error"; one line naming the file and line."""


def check_on_bad_sample(mode: str) -> None:
    if mode not in BAD_SAMPLE_MODES:
        raise ConfigError(
            f"data.on_bad_sample must be one of {', '.join(BAD_SAMPLE_MODES)}, got {mode!r}"
        )


class BadSampleLog:
    """The bad samples of dataset `name` (as the user wrote it: a file, or a folder or pattern of
    files), reported as `on_bad_sample` says; each one at `where`, its file and line."""

    def __init__(self, name: str, on_bad_sample: str):
        check_on_bad_sample(on_bad_sample)
        self.name, self.on_bad_sample = name, on_bad_sample
        self._warned: set[str] = set()
        self._recorded: list[Report] | None = None

    @contextmanager
    def recorded(self) -> Iterator[list[Report]]:
        """Within: each report is kept in the list this yields instead of warned about (a loader
        worker's batch, a process's share of a window's pass); whoever reports them where
        they should be warned about calls `report(*r)` for each, in order. "error" still
        raises at the first."""
        outer, self._recorded = self._recorded, []
        try:
            yield self._recorded
        finally:
            self._recorded = outer

    def report(self, where: str, reason: str, log: bool, action: str = "skipped") -> None:
        """One bad sample at `where` ("file:line"): raise with on_bad_sample = "error", else
        warn (if `log`) once, or keep it (`recorded`)."""
        if self.on_bad_sample == "error":
            raise DataError(f"data.on_bad_sample='error': {where}: {reason}")
        if self._recorded is not None:
            self._recorded.append((where, reason, log, action))
            return
        if not log or where in self._warned:
            return
        self._warned.add(where)
        if len(self._warned) <= MAX_WARNINGS:
            logger.warning("data: %s: %s (%s)", where, reason, action)
        if len(self._warned) == MAX_WARNINGS:
            logger.warning(
                "data: %s: further bad samples are counted in the metrics, not logged", self.name
            )
