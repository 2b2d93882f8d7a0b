"""Loader workers (data/loader.py): batches built ahead of the step in worker processes are the
batches the training process builds (every tensor, bit for bit), their bad samples are warned
about and counted as without workers, a DataError in a worker is the same one line, and a worker
killed mid-run is one line, not a hang. The training runs with workers, and a resume at another
number of them, are in test_jsonl_data.py (test_training_on_a_jsonl_file_resumes_bit_exact) and
test_restart.py (a loader worker killed under torchrun)."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import torch
from test_jsonl_data import RECORDS, dataset, files, tensors, warnings_of  # noqa: F401

from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.forked import LoaderWorkerDied
from titan_vlm.data.loader import BatchLoader
from titan_vlm.errors import UserError
from titan_vlm.launch import children

CPU = torch.device("cpu")
STEPS = 6  # 9 one-sample rows, 2 a batch: the second epoch starts in step 4


def loader(data, workers: int, prefetch: int = 2) -> BatchLoader:
    return BatchLoader(data, 0, 1, 2, workers, prefetch, STEPS, CPU)


def test_workers_build_the_batches_the_training_process_builds(files, caplog):  # noqa: F811
    """Both epochs of the file (shuffled) with 0 and 2 workers: every tensor of every step
    equal, the same warnings (the three broken images, once each), the same dropped samples."""
    path = files / "train.jsonl"
    runs = {}
    for workers in (0, 2):
        data = dataset(path, shuffle=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan_vlm"):
            batches = loader(data, workers)
            steps = [batches.batch(k)[0] for k in range(STEPS)]
            batches.close()
        runs[workers] = steps, warnings_of(caplog), set(data.dropped)
    (inline, warned, dropped), (ahead, warned_ahead, dropped_ahead) = runs[0], runs[2]
    for k, (a, b) in enumerate(zip(inline, ahead)):
        assert len(tensors(a)) == len(tensors(b)), k
        for x, y in zip(tensors(a), tensors(b)):
            assert x.dtype == y.dtype and torch.equal(x, y), k
    assert len(warned) == 3 and all("image" in w for w in warned)
    assert warned_ahead == warned and dropped_ahead == dropped and len(dropped) == 3
    # the control: a step's batch is not another step's
    assert not torch.equal(inline[0].tokens, ahead[1].tokens)


def test_prefetch_and_a_restart_at_another_step(files):  # noqa: F811
    """One worker, 3 batches ahead; asking for a step out of turn (a resume, a rollback) starts
    the workers again there, with the same batch as in the training process."""
    data = dataset(files / "train.jsonl", shuffle=True)
    batches = loader(data, 1, prefetch=3)
    first = batches.batch(0)[0]
    later = batches.batch(4)[0]
    batches.close()
    for x, y in zip(tensors(later), tensors(data.batch(4, 0, 1, 2))):
        assert torch.equal(x, y)
    assert torch.equal(first.tokens, data.batch(0, 0, 1, 2).tokens)
    with pytest.raises(ValueError, match="past the last"):
        batches.batch(STEPS)


def test_a_bad_sample_under_error_is_the_same_line_from_a_worker(files):  # noqa: F811
    """A broken image is found when its batch is built: in a worker, the training process
    raises the DataError it would have raised itself."""
    path = files / "broken.jsonl"
    good, broken = RECORDS[0][0], {"image": "truncated.png", "text": "a broken file."}
    path.write_text(f"{json.dumps(good)}\n{json.dumps(broken)}\n")
    with pytest.raises(DataError) as inline:
        dataset(path, on_bad_sample="error").batch(0, 0, 1, 2)
    batches = BatchLoader(dataset(path, on_bad_sample="error"), 0, 1, 2, 2, 1, 2, CPU)
    with pytest.raises(DataError) as ahead:
        batches.batch(0)
    batches.close()
    assert str(ahead.value) == str(inline.value)
    assert "broken.jsonl:2: image cannot be decoded" in str(ahead.value)
    assert "\n" not in str(ahead.value)


def test_a_killed_worker_is_one_line_not_a_hang(files):  # noqa: F811
    """SIGKILL one of two workers (as the kernel's OOM killer would) while they build batches
    ahead: the batch it owed raises this one line where the rank asks for it (a step boundary,
    within torch's 5 s status interval), naming the worker and its signal; not a UserError:
    torchrun restarts the job (test_restart.py). No SIGCHLD handler raises elsewhere meanwhile
    (the loop sleeps between batches, where torch's would have raised)."""
    data = dataset(files / "train.jsonl", shuffle=True)
    batches = BatchLoader(data, 0, 1, 2, 2, 2, 100, CPU)
    before = set(children(os.getpid()))  # the test pool's processes, if any
    batches.start(0)
    batches.batch(0)
    workers = sorted(set(children(os.getpid())) - before)
    assert len(workers) == 2
    try:
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(LoaderWorkerDied) as died:
            for k in range(1, 100):
                time.sleep(0.01)
                batches.batch(k)
    finally:
        batches.close()
    line = str(died.value)
    assert line == (
        f"data.num_workers=2: a loader worker is gone (pid {workers[0]} died of SIGKILL (out of "
        "host memory, or killed)); data.num_workers=0 builds the batches in the training process"
    )
    assert not isinstance(died.value, UserError)  # the control: not the user's to fix
