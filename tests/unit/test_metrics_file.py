"""metrics.jsonl of a resumed run: a torn last line (a crash in the middle of a write) is dropped
with a warning; the file is replaced by write-then-rename, never rewritten in place."""

import json
import logging
import os

import pytest

from titan_vlm.errors import UserError
from titan_vlm.metrics import MetricsLogger

RECORD = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0, "peak_memory_gib": 0}


def write_lines(path, steps, torn=""):
    path.write_text("".join(json.dumps({"step": s, **RECORD}) + "\n" for s in steps) + torn)


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [1, 2, 3, 4], torn='{"step": 5, "loss": 0.9')
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        m = MetricsLogger(str(tmp_path), enable_tensorboard=False, enabled=True, resume_after=3)
    m.log(4, RECORD, echo=False)
    m.close()
    assert steps_in(path) == [1, 2, 3, 4]
    assert any("metrics.jsonl:5: dropped a torn last line" in r.message for r in caplog.records)


def test_the_file_is_replaced_not_rewritten_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [1, 2, 3])
    os.link(path, tmp_path / "before.jsonl")  # the old file's inode, as a reader would hold it
    MetricsLogger(str(tmp_path), enable_tensorboard=False, enabled=True, resume_after=2).close()
    assert steps_in(path) == [1, 2]
    assert steps_in(tmp_path / "before.jsonl") == [1, 2, 3]  # untouched: a new file replaced it
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_damaged_line_inside_the_file_is_one_line_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a metrics record \('garbage'\)"):
        MetricsLogger(str(tmp_path), enable_tensorboard=False, enabled=True, resume_after=3)
