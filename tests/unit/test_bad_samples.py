"""How bad samples are reported (data/bad_samples.py): a warning per line, once, the first
MAX_WARNINGS of them; or, with data.on_bad_sample = "error", a DataError at the first."""

import logging

import pytest

from titan_vlm.data.bad_samples import MAX_WARNINGS, BadSampleLog, DataError
from titan_vlm.errors import ConfigError


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_each_line_is_warned_about_once(caplog):
    log = BadSampleLog("d.jsonl", "skip")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        log.report("d.jsonl:3", "empty text", log=True)
        log.report("d.jsonl:3", "image cannot be decoded", log=True)  # read again: not again
        log.report("d.jsonl:4", "sample of 9 slots", log=True, action="truncated")
        log.report("d.jsonl:5", "empty text", log=False)  # another rank logs these
    assert warnings_of(caplog) == [
        "data: d.jsonl:3: empty text (skipped)",
        "data: d.jsonl:4: sample of 9 slots (truncated)",
    ]


def test_the_log_stops_after_max_warnings(caplog):
    log = BadSampleLog("d.jsonl", "skip")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        for line in range(1, MAX_WARNINGS + 11):
            log.report(f"d.jsonl:{line}", "empty text", log=True)
    warned = warnings_of(caplog)
    assert len(warned) == MAX_WARNINGS + 1
    assert warned[-1] == "data: d.jsonl: further bad samples are counted in the metrics, not logged"


def test_error_mode_raises_at_the_first_bad_sample():
    with pytest.raises(DataError, match=r"^data.on_bad_sample='error': d.jsonl:7: empty text$"):
        BadSampleLog("d.jsonl", "error").report("d.jsonl:7", "empty text", log=False)
    with pytest.raises(ConfigError, match="data.on_bad_sample must be one of skip, error"):
        BadSampleLog("d.jsonl", "warn")
