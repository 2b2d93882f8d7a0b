"""Dataset files of every format (data/record_files.py): Parquet files, a Hugging Face datasets
folder (save_to_disk's Arrow files) and WebDataset tar shards, each written by the library people
write them with (datasets, webdataset), images as paths beside the data or as bytes inside it:
the same samples, rows, batches (every tensor) and bad-sample counts as the JSONL file they were
converted from, each warning naming the row or sample; and each format's own bad input as one
warning or one line."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import tarfile
from pathlib import Path

import datasets
import pytest
import torch
import webdataset
from test_jsonl_data import (  # noqa: F401
    RECORDS,
    TRAIN,
    bad,
    dataset,
    files,
    kept,
    rows,
    save_png,
    tensors,
    warnings_of,
)

from titan_vlm.config import ConfigError
from titan_vlm.data.batch import ImageRef
from titan_vlm.data.jsonl import JsonlDataset, dataset_files

# test_jsonl_data's records that are JSON objects (a table cannot hold its malformed line): the
# reference JSONL file holds them one a line, so record r is line r + 1, row r, tar sample r
OBJECTS = [r for r, _ in RECORDS if isinstance(r, dict)]
COLUMNS = ["image", "images", "text", "conversations"]
TURN = {"from": datasets.Value("string"), "value": datasets.Value("string")}


def reference(folder: Path) -> tuple[JsonlDataset, list[str]]:
    """The JSONL file of OBJECTS (objects.jsonl), built as `built` builds the others."""
    path = folder / "objects.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in OBJECTS))
    return built(path)


def table(folder: Path, embed: bool) -> datasets.Dataset:
    """OBJECTS as a datasets table: images as paths (strings), or with `embed` as its Image
    feature holding each file's bytes (a file that is not there keeps its path)."""

    def image(name: str) -> dict | str:
        if not embed:
            return name
        path = folder / name
        return (
            {"bytes": path.read_bytes(), "path": None}
            if path.exists()
            else {"bytes": None, "path": name}
        )

    columns: dict[str, list] = {c: [] for c in COLUMNS}
    for r in OBJECTS:
        columns["image"].append(image(r["image"]) if "image" in r else None)
        columns["images"].append([image(n) for n in r["images"]] if "images" in r else None)
        columns["text"].append(r.get("text"))
        columns["conversations"].append(r.get("conversations"))
    picture = datasets.Image() if embed else datasets.Value("string")
    features = datasets.Features(
        {
            "image": picture,
            "images": datasets.List(picture),
            "text": datasets.Value("string"),
            "conversations": datasets.List(TURN),
        }
    )
    return datasets.Dataset.from_dict(columns, features=features)


def tar_shards(folder: Path, shards: int) -> list[Path]:
    """OBJECTS as WebDataset shards written by webdataset's TarWriter: a record's images as
    members (00003.png, or 00003.0.png, 00003.1.png), its other keys the .json member; an image
    file that is not there stays a path in the .json."""
    paths = [folder / f"shard-{k:04d}.tar" for k in range(shards)]
    per = -(-len(OBJECTS) // shards)
    for k, path in enumerate(paths):
        with webdataset.TarWriter(str(path)) as sink:
            for r, record in enumerate(OBJECTS[k * per : (k + 1) * per], start=k * per):
                names = [record["image"]] if "image" in record else record.get("images", [])
                members = {}
                if all((folder / n).exists() for n in names):
                    record = {k_: v for k_, v in record.items() if k_ not in ("image", "images")}
                    for j, n in enumerate(names):
                        ending = "png" if len(names) == 1 else f"{j}.png"
                        members[ending] = (folder / n).read_bytes()
                sink.write({"__key__": f"{r:05d}", "json": json.dumps(record), **members})
    return paths


def texts(data: JsonlDataset, i: int) -> list:
    """Sample i's parts: its text parts' tokens, and "image" for each image."""
    parts = data.sample(kept(data)[i]).parts
    return ["image" if isinstance(p, ImageRef) else list(p) for p in parts]


def same_data(data: JsonlDataset, ref: JsonlDataset) -> None:
    """The same records, samples, rows and counters, and every tensor of a whole epoch's
    batches (images decoded from the bytes or the files) equal."""
    assert data.records == ref.records == len(OBJECTS)
    assert rows(data) == rows(ref) and len(kept(data)) == len(kept(ref))
    assert [texts(data, i) for i in range(len(kept(data)))] == [
        texts(ref, i) for i in range(len(kept(ref)))
    ]
    for step in range(3):
        got, want = data.batch(step, 0, 1, 3), ref.batch(step, 0, 1, 3)
        assert len(tensors(got)) == len(tensors(want))
        for x, y in zip(tensors(got), tensors(want)):
            assert torch.equal(x, y)
    counts = (bad(data), dict(data.skipped), data.truncated, data.dropped)
    assert counts == (bad(ref), dict(ref.skipped), ref.truncated, ref.dropped)
    assert bad(ref) and ref.dropped  # the control: bad data of both kinds


def built(value, **kw) -> tuple[JsonlDataset, list[str]]:
    """The dataset of `value` (shuffled, as the reference) and every warning its start-up and
    a whole epoch of batches log."""
    logger = logging.getLogger("titan_vlm")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        data = dataset(value, shuffle=True, **kw)
        for step in range(3):
            data.batch(step, 0, 1, 3)
    finally:
        logger.removeHandler(handler)
    return data, [w for w in seen if w.startswith("data: ")]


def renamed(warnings: list[str], ref_path: Path, where) -> list[str]:
    """The reference's warnings with each "objects.jsonl:L" as `where(L - 1)` names it."""
    pattern = re.compile(rf"^data: {re.escape(str(ref_path))}:(\d+): ")
    return [pattern.sub(lambda m: f"data: {where(int(m.group(1)) - 1)}: ", w) for w in warnings]


# the records whose image is broken (test_jsonl_data's "decode" and "too large"): their samples
# are dropped when their batch is built
BROKEN = {"truncated.png": 6, "junk.png": 7, "big.png": 8}


def inside_names(warnings: list[str], folder: Path, where, inside: dict) -> list[str]:
    """The reference's warnings as a dataset whose images are inside its files says them:
    records named by `where`, a broken image file `name` as `inside[name]` (its record, and the
    name of its bytes)."""
    out = renamed(warnings, folder / "objects.jsonl", where.__getitem__)
    for name, (_, now) in inside.items():
        file = str(folder / name)
        out = [w.replace(file, now) for w in out]
    return out


def test_parquet_files_read_as_the_jsonl_they_were_converted_from(files):  # noqa: F811
    """One Parquet file in row groups of 4 rows, and the same rows cut into three files of a
    folder: images as paths beside the data."""
    ref, ref_warnings = reference(files)
    rows = table(files, embed=False)
    rows.to_parquet(str(files / "objects.parquet"), batch_size=4)
    (files / "parts").mkdir()
    for k in range(3):
        rows.shard(3, k, contiguous=True).to_parquet(str(files / "parts" / f"part-{k}.parquet"))
    data, warnings = built(files / "objects.parquet")
    same_data(data, ref)
    assert warnings == renamed(
        ref_warnings, files / "objects.jsonl", lambda r: f"{files / 'objects.parquet'} row {r}"
    )
    data, warnings = built(files / "parts", image_root=str(files))
    same_data(data, ref)
    firsts = [0, 4, 8, 12]  # datasets' contiguous shards of 12 rows
    assert warnings == renamed(
        ref_warnings,
        files / "objects.jsonl",
        lambda r: f"{files / 'parts' / f'part-{r // 4}.parquet'} row {r - firsts[r // 4]}",
    )


def test_a_saved_hugging_face_dataset_with_images_inside(files):  # noqa: F811
    """save_to_disk's folder of two Arrow shards, images as Image features holding the files'
    bytes (save_to_disk reads every file an Image names into the shards: nowhere.png is junk
    here, for the reference too, so that its sample is dropped when its batch is built)."""
    (files / "nowhere.png").write_bytes(b"\x00 not an image either")
    ref, ref_warnings = reference(files)
    table(files, embed=True).save_to_disk(str(files / "saved"), num_shards=2)
    data, warnings = built(files / "saved", image_root=str(files))
    shards = [files / "saved" / f"data-0000{k}-of-00002.arrow" for k in range(2)]
    assert data.files == shards
    same_data(data, ref)
    where = {r: f"{shards[r // 6]} row {r % 6}" for r in range(12)}  # save_to_disk's even halves
    # the start-up's warnings name the rows; a batch's the image inside its row
    broken = {**BROKEN, "nowhere.png": 2}
    inside = {name: (r, f"{where[r]} image") for name, r in broken.items()}
    assert warnings == inside_names(ref_warnings, files, where, inside)


def test_webdataset_shards_with_images_as_members(files):  # noqa: F811
    """Two tar shards from webdataset's TarWriter, named by a glob pattern: images as members
    (nowhere.png, which is not there, stays a path in the record's .json)."""
    ref, ref_warnings = reference(files)
    (files / "wds").mkdir()
    for shard in tar_shards(files, 2):
        shard.rename(files / "wds" / shard.name)
    data, warnings = built(files / "wds" / "shard-*.tar", image_root=str(files))
    same_data(data, ref)
    shard = [files / "wds" / f"shard-000{k}.tar" for k in range(2)]
    where = {r: f"{shard[r // 6]} sample {r:05d} (#{r % 6})" for r in range(12)}
    inside = {name: (r, f"{shard[r // 6]}/{r:05d}.png") for name, r in BROKEN.items()}
    assert warnings == inside_names(ref_warnings, files, where, inside)


def test_training_on_a_saved_dataset_and_on_tar_shards_equals_the_jsonl(pool, files, tmp_path):  # noqa: F811
    """Real runs (2 ranks sharing the window's pass, 2 loader workers a rank forked after
    pyarrow has read the files): the Hugging Face folder and the tar shards give the JSONL
    file's losses to the bit, and its bad-sample counts."""
    (files / "nowhere.png").write_bytes(b"\x00 not an image either")  # as save_to_disk keeps it
    reference(files)
    table(files, embed=True).save_to_disk(str(files / "saved"), num_shards=2)
    (files / "wds").mkdir()
    for shard in tar_shards(files, 2):
        shard.rename(files / "wds" / shard.name)
    runs = {}
    for name, value, workers in [
        ("jsonl", files / "objects.jsonl", 0),
        ("saved", files / "saved", 2),
        ("tar", files / "wds", 2),
    ]:
        runs[name] = pool.run(
            "train_run",
            dp_shard=2,
            cp=1,
            job__dump_folder=str(tmp_path / name),
            data__dataset=str(value),
            data__image_root=str(files),
            data__num_workers=workers,
            **TRAIN,
        )[0]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in runs["jsonl"])
    assert runs["jsonl"][-1]["data_bad_samples"] >= 3  # the control: the files were read
    for name in ("saved", "tar"):
        assert [h["loss"] for h in runs[name]] == [h["loss"] for h in runs["jsonl"]], name
        assert [h["data_bad_samples"] for h in runs[name]] == [
            h["data_bad_samples"] for h in runs["jsonl"]
        ], name


def test_a_caption_shard_a_record_naming_its_members_and_bad_samples(files, caplog):  # noqa: F811
    """Image-caption samples (00000.png + 00000.txt, no .json), a record naming its members by
    ending and by name, and the tar's own bad samples, each one warning."""
    red, blue = (files / "red.png").read_bytes(), (files / "blue.png").read_bytes()
    path = files / "mixed.tar"
    with webdataset.TarWriter(str(path)) as sink:
        sink.write({"__key__": "a", "png": red, "txt": "a red circle."})
        sink.write(
            {
                "__key__": "b",
                "0.png": red,
                "1.png": blue,
                "json": json.dumps({"images": ["1.png", "b.0.png"], "text": "<image> and <image>"}),
            }
        )
        sink.write({"__key__": "c", "json": '{"text": "oops"'})  # malformed
        sink.write({"__key__": "d", "png": red})  # no text
        sink.write({"__key__": "e", "mp4": b"\x00", "txt": "a video member"})
        sink.write(
            {"__key__": "f", "png": red, "jpg": blue, "json": '{"image": "png", "text": "x"}'}
        )
        sink.write({"__key__": "g", "json": json.dumps({"image": "red.png", "text": "beside"})})
        sink.write({"__key__": "h", "txt": b"\xff\xfe not UTF-8"})
    (files / "caption.jsonl").write_text(
        json.dumps({"image": "red.png", "text": "a red circle."})
        + "\n"
        + json.dumps({"images": ["blue.png", "red.png"], "text": "<image> and <image>"})
        + "\n"
        + json.dumps({"image": "red.png", "text": "beside"})
        + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = dataset(path)
    ref = dataset(files / "caption.jsonl")
    assert data.records == 8 and len(kept(data)) == 3
    assert [texts(data, i) for i in range(3)] == [texts(ref, i) for i in range(3)]
    for got, want in zip(tensors(data.batch(0, 0, 1, 3)), tensors(ref.batch(0, 0, 1, 3))):
        assert torch.equal(got, want)  # b's images in the order its record names them
    assert warnings_of(caplog) == [
        f"data: {path} sample c (#2): malformed JSON (Expecting ',' delimiter at column 16) "
        "(skipped)",
        f"data: {path} sample d (#3): sample d has no .json or .txt member (skipped)",
        f"data: {path} sample e (#4): a video member (e.mp4): videos are files named in the "
        "record's 'video' (skipped)",
        f"data: {path} sample f (#5): image member f.jpg is not one of the record's images "
        "(skipped)",
        f"data: {path} sample h (#7): h.txt is not UTF-8 (skipped)",
    ]


def test_a_parquet_image_struct_with_only_a_path_is_a_file(files, caplog):  # noqa: F811
    """Hugging Face's Image struct without bytes (as pyarrow writes it) names a file beside the
    data: read as a path, and checked at start-up as one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = pa.table(
        {
            "image": pa.array(
                [{"bytes": None, "path": "red.png"}, {"bytes": None, "path": "gone.png"}, None],
                type=image,
            ),
            "text": ["a red circle.", "lost.", "text only."],
        }
    )
    pq.write_table(rows, files / "paths.parquet")
    pa.ipc.new_file(files / "paths.arrow", rows.schema).close()  # an empty Arrow file
    with pa.ipc.new_file(str(files / "paths.arrow"), rows.schema) as sink:  # the file format
        sink.write_table(rows)
    (files / "paths.jsonl").write_text(
        json.dumps({"image": "red.png", "text": "a red circle."})
        + "\n"
        + json.dumps({"text": "text only."})
        + "\n"
    )
    ref = dataset(files / "paths.jsonl")
    for name in ("paths.parquet", "paths.arrow"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan_vlm"):
            data = dataset(files / name)
        assert [texts(data, i) for i in range(2)] == [texts(ref, i) for i in range(2)]
        assert data.sample(kept(data)[0]).parts[0] == ImageRef(files / "red.png")
        assert warnings_of(caplog) == [
            f"data: {files / name} row 1: image file not found: {files / 'gone.png'} (skipped)"
        ]


def test_broken_and_mixed_files_are_one_line(files, monkeypatch):  # noqa: F811
    """A truncated Parquet or tar file, bytes after a tar's end, a folder of two formats, a
    DatasetDict folder, a save_to_disk folder missing a listed file, and Parquet without pyarrow:
    each one line naming the file or folder."""
    table(files, embed=False).to_parquet(str(files / "whole.parquet"))
    raw = (files / "whole.parquet").read_bytes()
    (files / "cut.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConfigError, match=r"^data.dataset: cannot read .*cut.parquet: "):
        dataset(files / "cut.parquet")
    (shard,) = tar_shards(files, 1)
    raw = shard.read_bytes()
    (files / "cut.tar").write_bytes(raw[:1000])  # inside the first member's data
    with pytest.raises(ConfigError, match=r"^data.dataset: cannot read .*cut.tar: not an "):
        dataset(files / "cut.tar")
    (files / "tail.tar").write_bytes(raw + b"more bytes that are no tar")
    with pytest.raises(ConfigError, match=r"cannot read .*tail.tar: not a tar file after byte "):
        dataset(files / "tail.tar")
    (files / "gz.tar").write_bytes(b"\x1f\x8b" + raw[:600])  # a compressed tar named .tar
    with pytest.raises(ConfigError, match=r"cannot read .*gz.tar: not an uncompressed tar file"):
        dataset(files / "gz.tar")
    (files / "two").mkdir()
    (files / "two" / "a.jsonl").write_text('{"text": "x"}\n')
    (files / "two" / "b.parquet").write_bytes((files / "whole.parquet").read_bytes())
    with pytest.raises(ConfigError, match=r"^data.dataset: .*two holds .json and .parquet files"):
        dataset_files("data.dataset", str(files / "two"))
    datasets.DatasetDict({"train": table(files, embed=False)}).save_to_disk(str(files / "dd"))
    with pytest.raises(ConfigError, match=r"DatasetDict folder: name one split's folder"):
        dataset_files("data.dataset", str(files / "dd"))
    assert dataset_files("data.dataset", str(files / "dd" / "train"))[0].suffix == ".arrow"
    (files / "dd" / "train" / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(ConfigError, match=r"state.json lists data-00000-of-00001.arrow, which is"):
        dataset_files("data.dataset", str(files / "dd" / "train"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet fails
    with pytest.raises(ConfigError, match=r"need pyarrow: pip install 'titan_vlm\[data\]' \("):
        dataset_files("data.dataset", str(files / "whole.parquet"))


def member(
    tar: tarfile.TarFile,
    name: str,
    data: bytes = b"",
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def test_tar_samples_as_tar_writes_them(files, caplog):  # noqa: F811
    """Members as GNU tar and other writers leave them: 11 numbered images in their numbers'
    order (not the names' 0, 1, 10, 2, ...), names in other cases and folders, a key that comes
    back, links, unnumbered images, an empty record; each bad one a warning of its own."""
    colors = ["red", "blue", "green"]
    pngs = []
    for j in range(11):
        save_png(files / f"c{j}.png", color=colors[j % 3], cell=j % 4)
        pngs.append((files / f"c{j}.png").read_bytes())
    path = files / "written.tar"
    eleven = {"text": "<image>" * 11 + " eleven."}
    with tarfile.open(path, "w") as tar:
        member(tar, "a.json", json.dumps(eleven).encode())
        for j in sorted(range(11), key=str):  # 0, 1, 10, 2, ...: as TarWriter sorts them
            member(tar, f"a.{j}.png", pngs[j])
        member(tar, "dir.v2/b.JSON", json.dumps({"image": "b.PNG", "text": "upper"}).encode())
        member(tar, "dir.v2/b.PNG", pngs[1])
        member(tar, "c.json", b"{}")
        member(tar, "d.txt", b"linked")
        member(tar, "d.png", kind=tarfile.SYMTYPE, link="elsewhere.png")
        member(tar, "e.txt", b"hard")
        member(tar, "e.png", kind=tarfile.LNKTYPE, link="dir.v2/b.PNG")
        member(tar, "f.txt", b"two images, no names")
        member(tar, "f.jpg", pngs[0])
        member(tar, "f.png", pngs[1])
        member(tar, "a.json", b'{"text": "oops"')  # key a again: another sample
    (files / "written.jsonl").write_text(
        json.dumps({**eleven, "images": [f"c{j}.png" for j in range(11)]})
        + "\n"
        + json.dumps({"image": "c1.png", "text": "upper"})
        + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = dataset(path, seq_len=512)
    ref = dataset(files / "written.jsonl", seq_len=512)
    assert data.records == 7 and len(kept(data)) == 2
    for got, want in zip(tensors(data.batch(0, 0, 1, 2)), tensors(ref.batch(0, 0, 1, 2))):
        assert torch.equal(got, want)  # the eleven images in their numbers' order
    assert warnings_of(caplog) == [
        f"data: {path} sample c (#2): no 'conversations' or 'text' key (skipped)",
        f"data: {path} sample d (#3): d.png is a link: a sample's members must be files (tar "
        "--hard-dereference) (skipped)",
        f"data: {path} sample e (#4): e.png is a link: a sample's members must be files (tar "
        "--hard-dereference) (skipped)",
        f"data: {path} sample f (#5): sample f has several image members (jpg, png) that are not "
        "numbered (0.jpg, 1.jpg, ...): name them in the record's 'images' (skipped)",
        f"data: {path} sample a (#6): malformed JSON (Expecting ',' delimiter at column 16) "
        "(skipped)",
    ]


def test_a_tar_cut_anywhere_is_one_line(files):  # noqa: F811
    """A shard cut at any 512-byte boundary (where a copy or a full disk leaves it), members
    whole or not, is one line naming it: never fewer samples read without a word."""
    (shard,) = tar_shards(files, 1)
    raw = shard.read_bytes()
    data_end = len(kept(dataset(shard, image_root=str(files))))
    assert data_end > 0
    for cut in range(512, len(raw), 512):
        trailing = raw[cut:]
        if not trailing.strip(b"\0") and len(trailing) >= 512:
            continue  # the end-of-archive blocks alone are cut: the shard is whole
        (files / "cut.tar").write_bytes(raw[:cut])
        with pytest.raises(ConfigError, match=r"^data.dataset: cannot read .*cut.tar: "):
            dataset(files / "cut.tar", image_root=str(files))


def test_a_table_cell_that_is_not_utf8_is_a_bad_sample(files, caplog):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = pa.array([b"fine", b"\xff\xfe bad", b"also fine"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": text}), files / "utf8.parquet")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = dataset(files / "utf8.parquet")
    assert (
        data.records == 3 and len(kept(data)) == 2 and dict(data.skipped) == {"undecodable text": 1}
    )
    (warning,) = warnings_of(caplog)
    assert warning.startswith(f"data: {files / 'utf8.parquet'} row 1: a string cell is not UTF-8")
