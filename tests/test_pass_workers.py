"""A rank's share of a window's pass split over it and its loader workers (JsonlDataset
`workers`, data.num_workers; data/forked.py): the index, counters, description, warnings and
first error of one process doing it all; the work really done in other processes; a worker that
dies or fails is one line, not a hang."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from unittest import mock

import pytest
from test_jsonl_data import RECORDS, dataset, files, index_of, warnings_of  # noqa: F401

import titan_vlm.data.record_files as record_files
from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.forked import LoaderWorkerDied
from titan_vlm.data.jsonl import PASS_RECORDS

COPIES = 3 * PASS_RECORDS // len(RECORDS) + 1  # RECORDS this often: 3 processes' worth


def corpus(folder: Path, bad_at: int | None = None) -> Path:
    """test_jsonl_data's RECORDS (4 bad at start-up, one truncated), COPIES times over; `bad_at`:
    only good records (the first two of RECORDS in turn), but a malformed line there."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r, _ in RECORDS]
    if bad_at is not None:
        lines = [lines[i % 2] for i in range(len(RECORDS) * COPIES)]
        lines[bad_at] = "{not json"
    path = folder / ("big.jsonl" if bad_at is None else f"bad_at_{bad_at}.jsonl")
    path.write_text("\n".join(lines * (COPIES if bad_at is None else 1)) + "\n")
    return path


def parsed_by_pid(folder: Path):
    """Within: each record the pass decodes appends its process's pid to `folder`/pids (the
    workers are other processes: a file, not a list, sees them)."""
    real, log = record_files.decode_record, folder / "pids"

    def decode(raw, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(raw, *args, **kwargs)

    return mock.patch.object(record_files, "decode_record", decode)


def test_two_workers_build_the_index_one_process_builds(files, caplog):  # noqa: F811
    """13 x COPIES records over this process and 2 workers, a third each: the same kept samples,
    spans, rows, counters, description and warnings (in the window's order, the first 100) as
    workers=0; control: three processes decoded the records, each about a third."""
    path = corpus(files)
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        alone = dataset(path, shuffle=True, packing=True)
    alone_warnings = warnings_of(caplog)
    caplog.clear()
    with parsed_by_pid(files), caplog.at_level(logging.WARNING, logger="titan_vlm"):
        split = dataset(path, shuffle=True, packing=True, workers=2)
    assert index_of(split) == index_of(alone)
    assert split.describe() == alone.describe()
    assert (split.records, split.truncated, split.num_images) == (
        alone.records,
        alone.truncated,
        alone.num_images,
    )
    assert dict(split.skipped) == dict(alone.skipped) and split.bad_samples(1) == 4 * COPIES
    assert warnings_of(caplog) == alone_warnings and len(alone_warnings) == 101  # + "further"
    pids = (files / "pids").read_text().split()
    counts = sorted(pids.count(p) for p in set(pids))
    assert len(counts) == 3 and sum(counts) == len(RECORDS) * COPIES  # each record decoded once
    assert counts[0] >= sum(counts) // 3 - 1
    assert str(os.getpid()) in pids


def test_fewer_records_than_a_workers_share_stay_in_this_process(files):  # noqa: F811
    with parsed_by_pid(files):
        data = dataset(files / "train.jsonl", workers=4)
    assert set((files / "pids").read_text().split()) == {str(os.getpid())}
    assert data.records == len(RECORDS)


@pytest.mark.parametrize("where", ["this process's share", "the last worker's share"])
def test_the_first_bad_record_stops_the_pass_as_one_process_would(files, where):  # noqa: F811
    """data.on_bad_sample = "error": the first bad line in file order is the error, whichever
    process's share it lies in."""
    n = len(RECORDS) * COPIES
    bad_at = 7 if where == "this process's share" else n - 5
    path = corpus(files, bad_at)
    with pytest.raises(DataError) as alone:
        dataset(path, on_bad_sample="error")
    with pytest.raises(DataError) as split:
        dataset(path, on_bad_sample="error", workers=2)
    assert str(split.value) == str(alone.value)
    assert f"{path}:{bad_at + 1}: malformed JSON" in str(split.value)


def test_a_worker_killed_mid_pass_is_one_line_not_a_hang(files):  # noqa: F811
    """A worker SIGKILLed while it parses (as the OOM killer would): LoaderWorkerDied naming it
    and its signal, at once; its sibling is not left running."""
    parent, real = os.getpid(), record_files.decode_record

    def dying(raw, *args, **kwargs):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(raw, *args, **kwargs)

    before = children()  # the test session's own (a pool's processes)
    with mock.patch.object(record_files, "decode_record", dying):
        with pytest.raises(LoaderWorkerDied) as died:
            dataset(corpus(files), workers=2)
    line = str(died.value)
    assert "\n" not in line and "the pass over a window: worker 1 (pid " in line
    assert line.endswith("died of SIGKILL (out of host memory, or killed)"), line
    assert children() == before


def children() -> set[str]:
    """This process's child processes (zombies too: a child not reaped is one)."""
    return {
        pid
        for task in Path(f"/proc/{os.getpid()}/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_a_workers_bug_is_one_line(files):  # noqa: F811
    parent, real = os.getpid(), record_files.decode_record

    def buggy(raw, *args, **kwargs):
        if os.getpid() != parent:
            raise ValueError("a bug")
        return real(raw, *args, **kwargs)

    before = children()
    with mock.patch.object(record_files, "decode_record", buggy):
        with pytest.raises(
            RuntimeError, match=r"failed on rank 0 of 1: worker 1: ValueError: a bug$"
        ):
            dataset(corpus(files), workers=2)
    assert children() == before
