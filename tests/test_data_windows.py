"""A dataset file indexed a window at a time (data/jsonl.py, data/windows.py): start-up parses the
first window only, whatever the corpus's size; an epoch reads every kept sample once, each row
from one window's records; a window's rows are what a one-window dataset of its records packs;
a dataset built at a run's position reads the rows the run reads, with the same counters; a
later window's bad record stops the run when training reaches it; the ranks share each window's
pass; and real runs on several windows are bit-identical at any number of loader workers and
resume mid-epoch to the bit."""

from __future__ import annotations

import json
import random
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_jsonl_data import TRAIN, files, index_of, interrupted_run, save_png  # noqa: F401

import titan_vlm.data.record_files as record_files
from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.dataset import Position
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.data.loader import BatchLoader
from titan_vlm.data.tokenizer import ByteTokenizer
from titan_vlm.data.windows import BLOCK

TOK = ByteTokenizer()
SEQ = 96


def corpus(
    folder: Path,
    records: int,
    bad_every: int = 97,
    name: str = "corpus.jsonl",
    longest: int = 60,
    long_every: int = 61,
) -> Path:
    """`records` captions of 5 to `longest` characters, one in `bad_every` a malformed line, one
    in 50 an image (red.png, beside the file), one in `long_every` longer than SEQ (truncated;
    0: none)."""
    rng = random.Random(records)
    if not (folder / "red.png").exists():
        save_png(folder / "red.png")
    lines = []
    for i in range(records):
        if bad_every and i % bad_every == 5:
            lines.append("{not json")
        elif long_every and i % long_every == 7:
            lines.append(json.dumps({"text": f"long {i} " + "y" * 150}))
        elif i % 50 == 3:
            lines.append(json.dumps({"image": "red.png", "text": f"red {i}"}))
        else:
            lines.append(json.dumps({"text": f"record {i} " + "x" * rng.randint(5, longest)}))
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def dataset(path: Path, **kw) -> JsonlDataset:
    kw = {"packing": True, "shuffle": True, "window": BLOCK, **kw}
    return JsonlDataset(str(path), TOK, 32, 16, SEQ, 0, **kw)


def parsed():
    """Within: each record decoded is appended to the list this yields."""
    seen: list[bytes] = []
    real = record_files.decode_record

    def counting(raw, *args, **kwargs):
        seen.append(bytes(raw))
        return real(raw, *args, **kwargs)

    return seen, mock.patch.object(record_files, "decode_record", counting)


def epoch_rows(data: JsonlDataset, epoch: int = 0) -> list:
    """Every row of `epoch`, in order, with its window (rows made readable as a run would)."""
    out, r = [], 0
    while True:
        data.ensure(range(r, r + 1))
        window = next(w for w in data.windows if w.first <= r < w.stop)
        if window.epoch > epoch:
            return out
        if window.epoch == epoch:
            out.append((window, data.plan([r])[0]))
        r += 1


def test_start_up_parses_the_first_window_only(files):  # noqa: F811
    """A corpus of 2 windows and one of 12: start-up decodes one window's records in both (the
    control: reading on decodes the rest)."""
    small, large = corpus(files, 2 * BLOCK, name="small.jsonl"), corpus(files, 12 * BLOCK)
    for path in (small, large):
        seen, counting = parsed()
        with counting:
            data = dataset(path)
        assert len(seen) == BLOCK and len(data.windows) == 1
        assert data.windows[0].number == 0 and data.records in (2 * BLOCK, 12 * BLOCK)
    assert "window 1 of 12 of epoch 0: " in data.describe()
    with counting:
        epoch_rows(data)
    assert len(seen) == 12 * BLOCK + BLOCK  # every window once, and epoch 1's first window


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_reads_every_kept_sample_once_each_row_from_one_window(files, shuffle):  # noqa: F811
    path = corpus(files, 5 * BLOCK + 300)
    data = dataset(path, shuffle=shuffle, window=2 * BLOCK)
    rows = epoch_rows(data)
    samples = [ref.record for _, row in rows for ref in row]
    bad = [i for i in range(data.records) if i % 97 == 5]
    assert sorted(samples) == [i for i in range(data.records) if i not in bad]
    assert data.order.windows == 3 and {w.number for w, _ in rows} == {0, 1, 2}
    for window, row in rows:
        mine = {i for run in data.order.records_of(0, window.number) for i in run}
        assert {ref.record for ref in row} <= mine
        assert sum(ref.size for ref in row) <= SEQ
    if not shuffle:
        assert samples == sorted(samples)  # file order
    else:
        assert samples != sorted(samples)  # the control: another order
        second = [ref.record for _, row in epoch_rows(data, epoch=1) for ref in row]
        assert sorted(second) == sorted(samples) and second != samples  # a new order


def test_a_windows_rows_are_a_one_window_datasets_of_its_records(files):  # noqa: F811
    """Unshuffled, window 1 (records 1024-2047) holds the rows a dataset of just those records
    packs, record for record (an independent pass over a file of its own)."""
    path = corpus(files, 3 * BLOCK)
    data = dataset(path, shuffle=False)
    rows = [(w, row) for w, row in epoch_rows(data) if w.number == 1]
    lines = path.read_text().splitlines()
    alone_path = files / "window1.jsonl"
    alone_path.write_text("\n".join(lines[BLOCK : 2 * BLOCK]) + "\n")
    alone = dataset(alone_path, shuffle=False)
    want = [[ref.record + BLOCK for ref in row] for _, row in epoch_rows(alone)]
    assert [[ref.record for ref in row] for _, row in rows] == want
    assert [[ref.size for ref in row] for _, row in rows] == [
        [ref.size for ref in row] for _, row in epoch_rows(alone)
    ]


def test_a_dataset_built_at_a_position_reads_what_the_run_reads(files):  # noqa: F811
    """From the middle of window 1 on, across windows and into epoch 1: the same rows (their
    samples, read back: every tensor) and the same counters, at several rows."""
    path = corpus(files, 3 * BLOCK + 100)
    run = dataset(path)
    rows = len(epoch_rows(run))
    run = dataset(path)
    run.ensure(range(0, rows + 40))
    middle = next(w for w in run.windows if w.number == 1)
    row = (middle.first + middle.stop) // 2
    position = run.position(row)
    assert (position.epoch, position.number, position.first) == (0, 1, middle.first)
    resumed = dataset(path, position=position)
    assert resumed.windows[0].number == 1 and len(resumed.windows) == 1  # nothing before it
    resumed.ensure(range(row, rows + 40))
    assert resumed.plan(range(row, rows + 40)) == run.plan(range(row, rows + 40))
    for k in (row + 1, middle.stop + 1, rows, rows + 40):
        assert resumed.bad_samples(k) == run.bad_samples(k), k
        assert resumed.truncated_samples(k) == run.truncated_samples(k), k
    got = resumed.collated(resumed.plan(range(rows - 2, rows + 2)))
    want = run.collated(run.plan(range(rows - 2, rows + 2)))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.images, want.images)


def test_a_position_off_by_a_window_reads_other_rows(files):  # noqa: F811
    """The control of the positions: a dataset built at the position of another window (its
    first row said to be the run's) reads other samples at the same rows."""
    path = corpus(files, 3 * BLOCK)
    run = dataset(path)
    run.ensure(range(0, 2000))
    w1, w2 = (next(w for w in run.windows if w.number == k) for k in (1, 2))
    wrong = Position(0, 2, w1.first, 0, 0)  # window 2's samples numbered from window 1's row
    shifted = dataset(path, position=wrong)
    shifted.ensure(range(w1.first, w1.first + 5))
    assert shifted.plan(range(w1.first, w1.first + 5)) != run.plan(range(w1.first, w1.first + 5))
    assert shifted.plan(range(w1.first, w1.first + 5)) == w2.rows[:5]


def test_loader_workers_across_windows_and_a_restart_before_them(files):  # noqa: F811
    """BatchLoader with 2 workers over 3 windows: every step's batch is the training process's
    (the workers' plans made after each window's pass); asked for step 0 again once the
    windows before the current one were forgotten, the dataset indexes again from row 0's
    window and gives step 0's batch."""
    path = corpus(files, 3 * BLOCK)
    steps, rows = 12, 64  # 768 rows: windows 0 to 2
    alone = dataset(path)
    want = [alone.batch(k, 0, 1, rows) for k in range(steps)]
    data = dataset(path)
    batches = BatchLoader(data, 0, 1, rows, 2, 2, steps, torch.device("cpu"))
    try:
        for k in range(steps):
            got = batches.batch(k)[0]
            assert torch.equal(got.tokens, want[k].tokens) and torch.equal(got.doc, want[k].doc)
        assert data.windows[0].number >= 1  # those before were forgotten
        assert torch.equal(batches.batch(0)[0].tokens, want[0].tokens)
    finally:
        batches.close()


def test_bad_samples_count_once_when_training_reaches_their_window(files):  # noqa: F811
    """bad_samples(rows) counts the windows rows 0..rows-1 reach, however far the index was
    read ahead, and epoch 1 (the same records again) adds nothing."""
    path = corpus(files, 4 * BLOCK)
    ahead, behind = dataset(path), dataset(path)
    rows = len(epoch_rows(ahead))
    ahead.ensure(range(0, rows + 500))  # into epoch 1
    for k in range(1, rows + 400, 97):
        behind.ensure(range(k - 1, k))
        assert ahead.bad_samples(k) == behind.bad_samples(k), k
    total = sum(1 for i in range(ahead.records) if i % 97 == 5)
    assert ahead.bad_samples(1) < total == ahead.bad_samples(rows) == ahead.bad_samples(rows + 400)
    assert sum(ahead.skipped.values()) == total  # epoch 1's pass counted nothing again


def test_a_later_windows_bad_record_stops_the_run_when_training_reaches_it(files):  # noqa: F811
    """on_bad_sample="error": the dataset builds (window 0 is clean), and the row that reaches
    the bad record's window raises its line."""
    path = corpus(files, 3 * BLOCK, bad_every=0, long_every=0)
    lines = path.read_text().splitlines()
    lines[2 * BLOCK + 10] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    data = dataset(path, shuffle=False, on_bad_sample="error")
    with pytest.raises(DataError, match=rf"{path}:{2 * BLOCK + 11}: malformed JSON"):
        epoch_rows(data)


def test_the_ranks_share_each_windows_pass(pool, files):  # noqa: F811
    """2 ranks, 4 windows read through into epoch 1: every rank holds the windows one process
    indexes, having parsed about half of each."""
    path = corpus(files, 4 * BLOCK)
    alone = JsonlDataset(str(path), TOK, 32, 16, SEQ, 0, max_image_pixels=48 * 48, window=BLOCK)
    rows = len(epoch_rows(alone)) + 10
    alone.ensure(range(0, rows))
    out = pool.run("shared_index", path=str(path), dp_shard=2, window=BLOCK, rows=rows)
    assert [o["index"] for o in out] == [index_of(alone)] * 2
    assert sum(o["parsed"] for o in out) == 5 * BLOCK  # 4 windows, then epoch 1's first
    assert max(o["parsed"] for o in out) <= 5 * BLOCK // 2 + 5


def windowed_run(path: Path, **keys) -> dict:
    """train_run's keys for a packed run on `path` in windows of one block."""
    return dict(TRAIN, data__dataset=str(path), data__packing=True, data__index_window=BLOCK) | keys


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load of one key here
def test_training_across_windows_resumes_bit_exact_at_any_workers(pool, files, tmp_path):  # noqa: F811
    """Windows of 1024 records (about 300 packed rows each) and 128 rows a step (2 microbatches
    of 32 rows on each of 2 dp ranks): 10 steps cross windows; uninterrupted with no loader
    workers, and killed after step 7 (2 workers a rank, checkpoint at 6, its data position past
    window 0) and resumed with 1 worker: the same losses and bad-sample counts to the bit."""
    path = corpus(files, 4 * BLOCK, bad_every=53, longest=20)
    alone = dataset(path)
    stops = [w.stop for w, _ in epoch_rows(alone)]
    assert 6 * 128 < stops[-1]  # 6 steps end inside the epoch
    run = windowed_run(path, steps=10, training__local_batch_size=32)
    run["training__global_batch_size"] = 128
    whole, _ = interrupted_run(pool, tmp_path, run, stop_after=7, interval=6)
    counts = [h["data_bad_samples"] for h in whole]
    assert counts[0] < counts[-1]  # the control: later windows' bad samples came in
    # the checkpoint the run resumed from keeps where row 6 x 128 lies: the window a fresh
    # dataset built there starts at (not row 0's), with the bad samples before it
    saved = {"trainer": {"data_positions": []}}
    dcp.load(saved, checkpoint_id=str(tmp_path / "ckpt/copy0/checkpoint/step-6"), no_dist=True)
    ((epoch, number, first, bad, _),) = saved["trainer"]["data_positions"]
    alone.ensure(range(0, 6 * 128 + 1))
    assert tuple(alone.position(6 * 128))[:3] == (epoch, number, first) and number >= 1
    assert bad == alone.bad_samples(first) > 0


def test_a_resume_that_changes_the_windows_reads_from_row_0s_window(pool, files, tmp_path):  # noqa: F811
    """checkpoint.allow_config_change with another data.index_window: the checkpoint's data
    position names other windows, so it is not used (a warning) and the run goes on from row
    0's window; without the flag the resume is refused (data.index_window must match)."""
    path = corpus(files, 3 * BLOCK, longest=20)
    run = windowed_run(path, steps=4, training__local_batch_size=64)
    run |= dict(
        checkpoint__enable=True,
        checkpoint__interval=2,
        job__dump_folder=str(tmp_path),
    )
    pool.run("train_run", dp_shard=2, cp=1, stop_after=3, **run)
    with pytest.raises(RuntimeError, match="data.index_window 1024 -> 2048 changed"):
        pool.run("train_run", dp_shard=2, cp=1, **{**run, "data__index_window": 2048})
    out = pool.run(
        "train_run_warnings",
        dp_shard=2,
        cp=1,
        **{**run, "data__index_window": 2048, "checkpoint__allow_config_change": True},
    )
    assert [h["step"] for h in out[0]["history"]] == [3, 4]
    assert any("the data's position in the checkpoint is not used" in w for w in out[0]["warnings"])
