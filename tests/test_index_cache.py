"""The start-up index kept between runs (data/index_cache.py): a second start maps it instead of
parsing a record, and holds the same index, counters, warnings and batches; anything that
decides the index (a file's size or time, seq_len, the model's settings) makes a new key; a
damaged or unwritable cache is a warning and a rebuild, never a different index; ranks that
disagree on seeing it all build it; and a real run resumes on it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_jsonl_data import (  # noqa: F401
    RECORDS,
    dataset,
    files,
    index_of,
    save_png,
    tensors,
    warnings_of,
)

from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.index_cache import IndexCache
from titan_vlm.data.jsonl import JsonlDataset

SETTINGS = {"model": "debug"}  # what the trainer adds to the key (its code, the model family)


def cached(path: Path, folder: Path, settings=SETTINGS, **kw) -> JsonlDataset:
    return dataset(path, shuffle=True, cache=IndexCache(folder, dict(settings)), **kw)


@pytest.fixture
def no_pass(monkeypatch):
    """Within: building an index with the start-up pass fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the start-up pass ran")

    return lambda: monkeypatch.setattr(JsonlDataset, "_start_up_pass", refuse)


def test_a_second_start_maps_the_index_the_first_built(files, tmp_path, caplog, no_pass):  # noqa: F811
    """The first start builds and writes it; the second reads no record at start-up and holds
    the same index, rows, counters, description, start-up warnings and batches (every tensor,
    its broken images dropped as before)."""
    path = files / "train.jsonl"
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        first = cached(path, tmp_path / "cache")
    built_warnings = warnings_of(caplog)
    assert len(built_warnings) == 5  # the start-up's bad samples
    (key,) = [p.name for p in (tmp_path / "cache").iterdir()]
    caplog.clear()
    no_pass()
    with caplog.at_level(logging.INFO, logger="titan_vlm"):
        second = cached(path, tmp_path / "cache")
    assert f"index read from {tmp_path / 'cache' / key}" in caplog.text
    assert warnings_of(caplog) == built_warnings
    assert index_of(second) == index_of(first) and second.describe() == first.describe()
    assert (second.records, second.bad_at_startup, dict(second.skipped), second.truncated) == (
        first.records,
        first.bad_at_startup,
        dict(first.skipped),
        first.truncated,
    )
    assert isinstance(second.starts, memoryview)  # mapped, not a copy
    for step in range(4):
        for x, y in zip(tensors(second.batch(step, 0, 1, 3)), tensors(first.batch(step, 0, 1, 3))):
            assert torch.equal(x, y)
    assert second.dropped == first.dropped and len(second.dropped) == 3


def test_what_decides_the_index_makes_a_new_key(files, tmp_path, no_pass):  # noqa: F811
    path = files / "train.jsonl"
    folder = tmp_path / "cache"
    cached(path, folder)
    keys = {p.name for p in folder.iterdir()}
    for change in [
        lambda: cached(path, folder, seq_len=80),
        lambda: cached(path, folder, settings={"model": "another"}),
        lambda: cached(path, folder, max_frames=4),
        lambda: cached(path, folder, image_root=str(files / "sub")),
    ]:
        change()
        now = {p.name for p in folder.iterdir()}
        assert len(now) == len(keys) + 1
        keys = now
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"red circle", b"RED circle"))  # same size, new time
    cached(path, folder)
    assert len({p.name for p in folder.iterdir()}) == len(keys) + 1
    no_pass()  # the control: an unchanged dataset is read from its cache
    cached(path, folder)


def test_a_damaged_cache_is_built_again(files, tmp_path, caplog):  # noqa: F811
    """A flipped byte of the arrays, a truncated meta.json, a missing arrays file: each one
    warning, the index built again (the same one) and written again."""
    path = files / "train.jsonl"
    folder = tmp_path / "cache"
    want = index_of(cached(path, folder))
    (key,) = list(folder.iterdir())
    damages = [
        lambda: (key / "arrays.bin").write_bytes(
            bytes([255]) + (key / "arrays.bin").read_bytes()[1:]
        ),
        lambda: (key / "meta.json").write_text((key / "meta.json").read_text()[:40]),
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


def test_error_mode_on_a_cached_index_is_the_passs_line(files, tmp_path):  # noqa: F811
    path = files / "train.jsonl"
    cached(path, tmp_path / "cache")
    with pytest.raises(DataError) as cached_error:
        cached(path, tmp_path / "cache", on_bad_sample="error")
    with pytest.raises(DataError) as built_error:
        dataset(path, on_bad_sample="error")
    assert str(cached_error.value) == str(built_error.value)


def test_ranks_that_disagree_on_the_cache_all_build_it(pool, files, tmp_path):  # noqa: F811
    """Rank 0 sees a cache, rank 1 (another folder) does not: both build the index (no rank
    waits in the other's all-gather), and each holds one process's index."""
    path = files / "train.jsonl"
    alone = cached(path, tmp_path / "rank0")
    folders = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    out = pool.run("shared_index", path=str(path), dp_shard=2, cache_folders=folders)
    assert [o["index"] for o in out] == [index_of(alone)] * 2
    assert sum(o["parsed"] for o in out) == 13  # the pass ran, shared
    out = pool.run("shared_index", path=str(path), dp_shard=2, cache_folders=[folders[0]] * 2)
    assert [o["index"] for o in out] == [index_of(alone)] * 2
    assert [o["parsed"] for o in out] == [0, 0]  # both read the cache


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


def test_an_image_file_that_changes_makes_the_cache_stale(files, tmp_path, caplog):  # noqa: F811
    """The pass decides by the image files too (there or not; their headers): one that appears,
    or is written again, since the cache was built makes it stale, and the index is built
    again, as a fresh pass builds it (the record once skipped for its missing file is kept)."""
    path = files / "later.jsonl"
    path.write_text(
        '{"image": "later.png", "text": "not there yet"}\n{"image": "red.png", "text": "there"}\n'
    )
    folder = tmp_path / "cache"
    assert len(cached(path, folder).starts) == 1
    save_png(files / "later.png", color="blue")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        now = cached(path, folder)
    assert len(now.starts) == 2 and now.bad_at_startup == 0
    assert f"its records name changed since it was built ({files / 'later.png'})" in caplog.text
    assert index_of(now) == index_of(dataset(path, shuffle=True))
    save_png(files / "red.png", size=48, color="green")  # rewritten: another size and time
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        cached(path, folder)
    assert f"({files / 'red.png'})" in caplog.text


def test_the_key_knows_the_tokenizer_by_what_it_does(tmp_path):
    """The same tokenizer.json in another folder (a checkpoint's copy) is the same tokenizer;
    another vocabulary or other special tokens are another (inputs_digest, in the key)."""
    from test_tokenizer import write_tokenizer

    from titan_vlm.data.index_cache import inputs_digest
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

    (tmp_path / "copy").mkdir()
    a = HFTokenizer(write_tokenizer(tmp_path / "a.json"))
    copy = HFTokenizer(write_tokenizer(tmp_path / "copy" / "a.json"))
    other = HFTokenizer(
        write_tokenizer(tmp_path / "b.json", specials=("<pad>", "<s>", "</s>", "<image>"))
    )
    assert inputs_digest(a, None) == inputs_digest(copy, None)
    assert (
        len(
            {
                inputs_digest(a, None),
                inputs_digest(other, None),
                inputs_digest(ByteTokenizer(), None),
            }
        )
        == 3
    )


def test_an_image_that_appears_while_the_pass_runs_is_seen_next_time(files, tmp_path, monkeypatch):  # noqa: F811
    """A file's size and time are the ones the pass found (not the ones when the cache is
    written): an image written between the two makes the next start build again."""
    import titan_vlm.data.jsonl as jsonl

    path = files / "later.jsonl"
    path.write_text('{"image": "later.png", "text": "not there yet"}\n')
    real = jsonl.save_index

    def late(folder, key, index):
        save_png(files / "later.png", color="blue")  # after the pass, before the save
        real(folder, key, index)

    monkeypatch.setattr(jsonl, "save_index", late)
    with pytest.raises(Exception, match="no usable samples"):
        cached(path, tmp_path / "cache")
    monkeypatch.undo()
    assert len(cached(path, tmp_path / "cache").starts) == 1  # built again: the image is there
