"""Where the records lie, kept between runs (data/index_cache.py): a second start maps the spans
instead of scanning the files, and holds the same windows, counters, warnings and batches; a
file's size or time, or titan_vlm's code, makes a new key (what a record becomes does not: the
spans are the same); a damaged or unwritable cache is a warning and a scan, never other spans;
ranks that disagree on seeing it all scan; and the data's digest is hashed once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_jsonl_data import (  # noqa: F401
    dataset,
    files,
    index_of,
    tensors,
    warnings_of,
)

import titan_vlm.data.record_files as record_files
from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.index_cache import IndexCache
from titan_vlm.data.jsonl import JsonlDataset

SETTINGS = {"code": "this"}  # what the trainer adds to the key (titan_vlm's code)


def cached(path: Path, folder: Path, settings=SETTINGS, **kw) -> JsonlDataset:
    return dataset(path, shuffle=True, cache=IndexCache(folder, dict(settings)), **kw)


@pytest.fixture
def no_scan(monkeypatch):
    """Within: scanning a JSONL file for its records' spans fails the test."""

    def refuse(self):
        raise AssertionError(f"{self.path} was scanned")

    return lambda: monkeypatch.setattr(record_files.JsonRecords, "spans", refuse)


def test_a_second_start_maps_the_spans_the_first_found(files, tmp_path, caplog, no_scan):  # noqa: F811
    """The first start scans and writes them; the second scans nothing and holds the same
    windows, counters, description, warnings (its window's pass runs) and batches (every tensor,
    its broken images dropped as before)."""
    path = files / "train.jsonl"
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        first = cached(path, tmp_path / "cache")
    built_warnings = warnings_of(caplog)
    assert len(built_warnings) == 5  # the first window's bad samples
    caplog.clear()
    no_scan()
    with caplog.at_level(logging.INFO, logger="titan_vlm"):
        second = cached(path, tmp_path / "cache")
    assert f"the records' spans read from {tmp_path / 'cache'}" in caplog.text
    assert warnings_of(caplog) == built_warnings
    assert index_of(second) == index_of(first) and second.describe() == first.describe()
    assert (second.records, dict(second.skipped), second.truncated) == (
        first.records,
        dict(first.skipped),
        first.truncated,
    )
    assert isinstance(second.spans[0].starts, memoryview)  # mapped, not a copy
    for step in range(4):
        for x, y in zip(tensors(second.batch(step, 0, 1, 3)), tensors(first.batch(step, 0, 1, 3))):
            assert torch.equal(x, y)
    assert second.dropped == first.dropped and len(second.dropped) == 3


def test_what_decides_the_spans_makes_a_new_key(files, tmp_path, no_scan):  # noqa: F811
    path = files / "train.jsonl"
    folder = tmp_path / "cache"
    cached(path, folder)
    keys = {p.name for p in folder.iterdir()}
    cached(path, folder, settings={"code": "another"})
    assert len({p.name for p in folder.iterdir()}) == len(keys) + 1
    keys = {p.name for p in folder.iterdir()}
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"red circle", b"RED circle"))  # same size, new time
    cached(path, folder)
    assert len({p.name for p in folder.iterdir()}) == len(keys) + 1
    no_scan()  # the control: unchanged files are read from their cache, whatever else changes
    cached(path, folder)
    cached(path, folder, seq_len=80, max_frames=4, packing=True)


def test_a_damaged_cache_is_scanned_again(files, tmp_path, caplog):  # noqa: F811
    """A flipped byte of the arrays, a truncated meta.json, a missing arrays file: each one
    warning, the files scanned again (the same spans) and written again."""
    path = files / "train.jsonl"
    folder = tmp_path / "cache"
    want = index_of(cached(path, folder))
    (key,) = list(folder.iterdir())
    damages = [
        lambda: (key / "arrays.bin").write_bytes(
            bytes([255]) + (key / "arrays.bin").read_bytes()[1:]
        ),
        lambda: (key / "meta.json").write_text((key / "meta.json").read_text()[:20]),
        lambda: (key / "arrays.bin").unlink(),
    ]
    for damage in damages:
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan_vlm"):
            assert index_of(cached(path, folder)) == want
        assert [w for w in warnings_of(caplog) if "index cache" in w] == [
            next(w for w in warnings_of(caplog) if "index cache" in w)
        ]
        assert "unusable" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan_vlm"):
            assert index_of(cached(path, folder)) == want  # written again: no warning now
        assert "index cache" not in caplog.text


def test_an_unwritable_cache_is_a_warning(files, tmp_path, caplog):  # noqa: F811
    (tmp_path / "cache").write_text("a file where the folder goes")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = cached(files / "train.jsonl", tmp_path / "cache")
    assert data.records == 13 and "not written" in caplog.text


def test_error_mode_on_cached_spans_is_the_passs_line(files, tmp_path):  # noqa: F811
    path = files / "train.jsonl"
    cached(path, tmp_path / "cache")
    with pytest.raises(DataError) as cached_error:
        cached(path, tmp_path / "cache", on_bad_sample="error")
    with pytest.raises(DataError) as built_error:
        dataset(path, on_bad_sample="error")
    assert str(cached_error.value) == str(built_error.value)


def test_ranks_that_disagree_on_the_cache_all_scan(pool, files, tmp_path):  # noqa: F811
    """Rank 0 sees a cache, rank 1 (another folder) does not: both scan the file (no rank waits
    in the other's all-gather) and hold one process's windows; with one folder, neither scans."""
    path = files / "train.jsonl"
    alone = cached(path, tmp_path / "rank0")  # the settings shared_index gives the cache
    folders = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    out = pool.run("shared_index", path=str(path), dp_shard=2, cache_folders=folders)
    assert [o["index"] for o in out] == [index_of(alone)] * 2
    assert [o["scans"] for o in out] == [1, 1]
    out = pool.run("shared_index", path=str(path), dp_shard=2, cache_folders=[folders[0]] * 2)
    assert [o["index"] for o in out] == [index_of(alone)] * 2
    assert [o["scans"] for o in out] == [0, 0]  # both read the cache
    assert sum(o["parsed"] for o in out) == 13  # the window's pass ran, shared


def test_the_data_files_digest_is_hashed_once_while_they_keep_their_times(files, monkeypatch):  # noqa: F811
    """A resume's fact of the data's contents (resume_config.run_facts) is kept beside the index:
    the second start does not hash the files again; a file written again (a new time) is hashed
    again; without data.cache_index every start hashes."""
    import titan_vlm.resume_config as resume_config
    from titan_vlm.config import load_config
    from titan_vlm.resume_config import DATA_FILE, run_facts

    path = files / "train.jsonl"
    argv = [f"--data.dataset={path}", f"--job.dump_folder={files / 'out'}"]
    first = run_facts(load_config(argv), 4)[DATA_FILE]
    real = resume_config.data_digest
    hashed = []
    monkeypatch.setattr(resume_config, "data_digest", lambda f: hashed.append(f) or real(f))
    assert run_facts(load_config(argv), 4)[DATA_FILE] == first and hashed == []
    path.write_bytes(path.read_bytes().replace(b"red circle", b"RED circle"))
    changed = run_facts(load_config(argv), 4)[DATA_FILE]
    assert changed != first and len(hashed) == 1
    run_facts(load_config([*argv, "--data.cache_index=false"]), 4)
    assert len(hashed) == 2  # the control: without the cache, every start hashes
