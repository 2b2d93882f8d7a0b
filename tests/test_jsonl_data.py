"""Datasets from files (data/jsonl.py): LLaVA conversations and captions in JSONL / JSON, images
decoded with Pillow, bad input counted, warned about by file:line and skipped (or an error), rows
read by global row number, videos as sampled frames, and a real training run that resumes
bit-exact on such a file."""

import json
import logging
import random
import shutil

import pytest
import torch
from PIL import Image

from titan_vlm.checkpoint import load_model_for_inference
from titan_vlm.config import ConfigError, load_config
from titan_vlm.data.bad_samples import DataError
from titan_vlm.data.batch import IGNORE_INDEX, Batch, ImageRef, Prompt
from titan_vlm.data.chat import chat_question
from titan_vlm.data.dataset import batch_rows, step_rows
from titan_vlm.data.images import load_image
from titan_vlm.data.jsonl import JsonlDataset, SampleRef
from titan_vlm.data.records import sample_frames
from titan_vlm.data.synthetic import COLORS, draw_image
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.generate import generate
from titan_vlm.resume_config import DATA_FILE, run_facts
from titan_vlm.validate import validate_job

TOK = ByteTokenizer()
SEQ = 96  # debug flavor: 32 px images of 16 tokens
BIG = 48 * 48  # data.max_image_pixels in these tests: big.png (64 x 64) is over it


def save_png(path, size=40, color="red", cell=0):
    pixels = draw_image(size, "circle", COLORS[color], [cell], random.Random(cell))
    Image.fromarray((pixels * 255).round().byte().permute(1, 2, 0).numpy()).save(path)


def conv(*turns, **images):
    speakers = ("human", "gpt")
    return {
        **images,
        "conversations": [{"from": speakers[i % 2], "value": v} for i, v in enumerate(turns)],
    }


# line -> (record, what happens to it); the JSONL file has one per line, in this order
RECORDS = [
    (conv("<image>\nWhat is this?", "A red circle.", image="red.png"), "kept"),  # 1
    ({"image": "blue.png", "text": "a blue circle."}, "kept"),  # 2
    ('{"image": "red.png", "text": "oops"', "malformed JSON"),  # 4
    ({"image": "nowhere.png", "text": "a lost image."}, "image file not found"),  # 5
    ({"image": "red.png", "text": "  "}, "empty text"),  # 6
    ({"images": ["red.png", "blue.png"], "text": "just <image> one"}, "placeholder count"),  # 7
    ({"text": "x" * 150}, "truncated"),  # 8
    ({"image": "truncated.png", "text": "a broken file."}, "decode"),  # 9
    ({"image": "junk.png", "text": "not an image."}, "decode"),  # 10
    ({"image": "big.png", "text": "too many pixels."}, "too large"),  # 11
    (
        conv("<image> and <image>?", "two.", "Sure?", "yes.", images=["red.png", "blue.png"]),
        "kept",
    ),  # 12
    (
        conv("Color?", "blue.", image="sub/green.png"),
        "kept",
    ),  # 12: no placeholder, image in a folder
    ({"text": "text only, no image."}, "kept"),  # 13
]


@pytest.fixture
def files(tmp_path):
    save_png(tmp_path / "red.png", color="red")
    save_png(tmp_path / "blue.png", color="blue", cell=1)
    (tmp_path / "sub").mkdir()
    save_png(tmp_path / "sub" / "green.png", color="green", cell=2)
    save_png(tmp_path / "big.png", size=64)
    good = (tmp_path / "red.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(
        good[: len(good) // 2]
    )  # a valid header, half the pixels
    (tmp_path / "junk.png").write_bytes(b"\x00 no image here" * 20)
    lines = [r if isinstance(r, str) else json.dumps(r) for r, _ in RECORDS]
    (tmp_path / "train.jsonl").write_text(
        "\n".join(lines) + "\n\n"
    )  # a blank line at the end is no record
    return tmp_path


def dataset(path, **kw) -> JsonlDataset:
    kw = {"packing": False, "shuffle": False, "max_image_pixels": BIG, **kw}
    return JsonlDataset(str(path), kw.pop("tok", TOK), 32, 16, kw.pop("seq_len", SEQ), 0, **kw)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of the batch, its family's per-slot data included."""
    images = [batch.images] if isinstance(batch.images, torch.Tensor) else batch.images.tensors
    return [batch.tokens, batch.labels, batch.doc, batch.image, *images, *batch.slot_data.values()]


def text_of(ids) -> str:
    return TOK.decode([i for i in ids if i < 256])


# What a dataset's first window holds (these files are one window: all their records)
def kept(data: JsonlDataset) -> list[SampleRef]:
    """The window's kept samples, in its order (file order: one block)."""
    index = data.windows[0].index
    return [index.sample(i) for i in range(len(index.records))]


def lines(data: JsonlDataset) -> list[int]:
    return [ref.line for ref in kept(data)]


def rows(data: JsonlDataset) -> list[list[int]]:
    """The window's rows in the order they are read, each its samples' places in `kept`."""
    place = {ref: i for i, ref in enumerate(kept(data))}
    return [[place[ref] for ref in row] for row in data.windows[0].rows]


def bad(data: JsonlDataset) -> int:
    """The samples its windows left out."""
    return sum(data.skipped.values())


def test_startup_keeps_counts_and_names_file_and_line(files, caplog):
    path = files / "train.jsonl"
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = dataset(path)
    kept_lines = [
        i + 1
        for i, (_, what) in enumerate(RECORDS)
        if what in ("kept", "truncated", "decode", "too large")
    ]
    assert lines(data) == kept_lines and rows(data) == [[i] for i in range(len(kept_lines))]
    assert data.records == 13 and bad(data) == 4 and data.truncated == 1
    assert data.bad_samples(1) == 4 and data.truncated_samples(1) == 1  # window 0: row 0 on
    assert dict(data.skipped) == {
        "malformed JSON": 1,
        "missing image file": 1,
        "empty text": 1,
        "placeholder count": 1,
    }
    assert warnings_of(caplog) == [
        f"data: {path}:3: malformed JSON (Expecting ',' delimiter at column "
        f"{len(RECORDS[2][0]) + 1}) (skipped)",
        f"data: {path}:4: image file not found: {files / 'nowhere.png'} (skipped)",
        f"data: {path}:5: empty text (skipped)",
        f"data: {path}:6: 1 <image> placeholder(s) for 2 image(s) (skipped)",
        f"data: {path}:7: sample of 152 slots is longer than training.seq_len=96 (truncated)",
    ]
    assert "13 record(s) (in file order)" in data.describe()
    assert "all of them: 9 samples with 8 image(s) in 9 rows" in data.describe()
    assert (
        "skipped 4 (1 empty text, 1 malformed JSON, 1 missing image file, 1 placeholder count), "
        "truncated 1" in data.describe()
    )


def test_bad_images_are_dropped_from_their_rows_when_read(files, caplog):
    path = files / "train.jsonl"
    data = dataset(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        batch = data.batch(0, 0, 1, 9)
    assert len(data.dropped) == 3
    assert warnings_of(caplog) == [
        f"data: {path}:8: image cannot be decoded: {files / 'truncated.png'} "
        "(OSError: image file is truncated) (skipped)",
        f"data: {path}:9: image cannot be decoded: {files / 'junk.png'} "
        f"(UnidentifiedImageError: cannot identify image file '{files / 'junk.png'}') (skipped)",
        f"data: {path}:10: image too large: {files / 'big.png'} "
        "(image of 64x64 pixels is larger than "
        "data.max_image_pixels=2304) (skipped)",
    ]
    empty = [r for r in range(batch.num_rows) if (batch.doc[r] < 0).all()]
    assert [lines(data)[r] for r in empty] == [8, 9, 10]  # their samples are gone, nothing else
    assert batch.images.shape == (5, 3, 32, 32)  # red, blue, red + blue, green
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data.batch(1, 0, 1, 9)  # the next epoch: dropped again, counted and warned once
    assert len(data.dropped) == 3 and warnings_of(caplog) == []  # the same 3: not counted again


def test_a_batch_whose_samples_are_all_dropped_keeps_one_untrained_slot(files):
    data = dataset(files / "train.jsonl")
    row = lines(data).index(8)
    batch = data.batch(row, 0, 1, 1)  # one row: the broken image's sample
    assert data.dropped == {7}  # its record's number (line 8)
    assert batch.tokens[0, 0] == TOK.PAD and batch.doc[0].tolist() == [0] + [-1] * (SEQ - 1)
    assert (batch.labels == IGNORE_INDEX).all() and batch.images.shape[0] == 0


def test_labels_only_on_assistant_turns(files):
    data = dataset(files / "train.jsonl")
    batch = data.batch(0, 0, 1, 9)
    expect = {  # line: (the row's tokens as text, image slots in order, the trained targets)
        1: ("USER: |\nWhat is this? ASSISTANT: A red circle.", [" A red circle.", TOK.EOS]),
        2: ("|a blue circle.", ["a blue circle.", TOK.EOS]),
        11: (
            "USER: | and |? ASSISTANT: two.USER: Sure? ASSISTANT: yes.",
            [" two.", TOK.EOS, " yes.", TOK.EOS],
        ),
        12: ("USER: |\nColor? ASSISTANT: blue.", [" blue.", TOK.EOS]),
        13: ("text only, no image.", ["text only, no image.", TOK.EOS]),
    }
    for r, line in enumerate(lines(data)):
        if line not in expect:
            continue
        tokens, labels, image = batch.tokens[r], batch.labels[r], batch.image[r]
        used = batch.doc[r] >= 0
        # the row as text, an image's slots as "|": where each image sits
        shown = "".join(
            "|"
            if image[s] >= 0 and (s == 0 or image[s - 1] != image[s])
            else chr(int(tokens[s]))
            if int(tokens[s]) < 128
            else ""
            for s in range(int(used.sum()))
        )
        text, targets = expect[line]
        assert shown == text, line
        want = []
        for t in targets:
            want += list(t.encode()) if isinstance(t, str) else [t]
        assert labels[labels != IGNORE_INDEX].tolist() == want, line
        assert tokens[0] == TOK.BOS or image[0] >= 0  # BOS opens the sample, or the image does
        assert (tokens[image >= 0] == TOK.IMAGE).all()  # image slots hold the image id


def test_generate_asks_in_the_training_format(files):
    """generate's chat prompt is the training sample of the same one-image question up to its
    answer."""
    data = dataset(files / "train.jsonl")
    trained = data.sample(kept(data)[lines(data).index(12)]).parts  # {"image": ...: Color? / blue.}
    asked = chat_question(trained[1], "Color?", TOK)
    assert asked == trained[:3] and [type(p) for p in asked] == [type(p) for p in trained[:3]]


def test_dp_ranks_read_disjoint_rows_and_the_rows_do_not_depend_on_the_layout(files):
    data = dataset(files / "train.jsonl", shuffle=True)
    n = len(rows(data))  # 9: steps 0..2 at dp=3 x 1 row read exactly one epoch

    def planned(data, step, rank, dp, size):
        data.ensure(step_rows(step, dp, size))
        return data.plan(batch_rows(step, rank, dp, size))

    seen = [
        [row for step in range(3) for row in planned(data, step, rank, 3, 1)] for rank in (0, 1, 2)
    ]
    assert all(not set(a) & set(b) for a in seen for b in seen if a is not b)
    assert sorted(sum(seen, [])) == sorted(data.windows[0].rows)
    first, second = planned(data, 0, 0, 1, n), planned(data, 1, 0, 1, n)
    assert sorted(first) == sorted(second) and first != second  # reshuffled per epoch
    again = dataset(files / "train.jsonl", shuffle=True)
    assert planned(again, 1, 0, 1, n) == second  # seeded
    # step 1 at dp=2 x 2 rows is step 1 at dp=1 x 4 rows: the same rows, images and tokens
    whole = data.batch(1, 0, 1, 4)
    parts = [data.batch(1, rank, 2, 2) for rank in range(2)]
    assert torch.equal(torch.cat([p.tokens for p in parts]), whole.tokens)
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    assert torch.equal(torch.cat([p.images for p in parts]), whole.images)


def test_packing_keeps_file_order_and_every_sample(files):
    data = dataset(files / "train.jsonl", packing=True)
    packed = rows(data)
    assert [i for row in packed for i in row] == list(range(9))  # file order, none dropped
    sizes = [data.sample(ref).num_slots(16) for ref in kept(data)]
    for row, nxt in zip(packed, packed[1:]):
        used = sum(sizes[i] for i in row)
        assert (
            used <= SEQ and used + sizes[nxt[0]] > SEQ
        )  # the next row starts only when the sample does not fit
    batch = data.batch(0, 0, 1, len(packed))
    assert int(batch.doc.max()) >= 1  # some row holds two samples


SHARDS = (5, 4, 4)  # train.jsonl's 13 records cut into shards of these many lines


def cut_into_shards(files, folder, pattern: str) -> list:
    """train.jsonl's lines cut into len(SHARDS) files `pattern.format(k)` in `folder`."""
    lines = (files / "train.jsonl").read_text().splitlines()[: sum(SHARDS)]
    paths, first = [], 0
    for k, n in enumerate(SHARDS):
        paths.append(folder / pattern.format(k))
        paths[-1].write_text("\n".join(lines[first : first + n]) + "\n")
        first += n
    return paths


def in_shards(warning: str, whole: str, shards: list) -> str:
    """A warning about train.jsonl's line L as it names L's shard and its line there."""
    line = int(warning.split(f"{whole}:")[1].split(":")[0])
    k = next(k for k in range(len(SHARDS)) if line <= sum(SHARDS[: k + 1]))
    return warning.replace(f"{whole}:{line}:", f"{shards[k]}:{line - sum(SHARDS[:k])}:")


def test_shards_read_as_the_file_they_were_cut_from(files, caplog):
    """train.jsonl cut into three shards, named as a folder (data.image_root set: the images are
    elsewhere) and as a glob pattern (each shard's images beside it): the same samples in the
    same order, rows, batches (every tensor) and counters; each warning names the shard and its
    own line there."""
    whole_path = files / "train.jsonl"
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        whole = dataset(whole_path, shuffle=True)
        expected_batches = [whole.batch(k, 0, 1, 3) for k in range(3)]
    expected = warnings_of(caplog)
    (files / "shards").mkdir()
    in_folder = cut_into_shards(files, files / "shards", "part-{}.jsonl")
    by_pattern = cut_into_shards(files, files, "train-{:05d}.jsonl")
    for value, shards, kw in [
        (files / "shards", in_folder, {"image_root": str(files)}),
        (files / "train-*.jsonl", by_pattern, {}),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan_vlm"):
            data = dataset(value, shuffle=True, **kw)
            batches = [data.batch(k, 0, 1, 3) for k in range(3)]
        assert data.records == 13 and rows(data) == rows(whole)
        assert [shape_of(data, i) for i in range(9)] == [shape_of(whole, i) for i in range(9)]
        for got, want in zip(batches, expected_batches):
            assert len(tensors(got)) == len(tensors(want))
            for x, y in zip(tensors(got), tensors(want)):
                assert torch.equal(x, y)
        assert (bad(data), dict(data.skipped), data.truncated, data.dropped) == (
            bad(whole),
            dict(whole.skipped),
            whole.truncated,
            whole.dropped,
        )
        assert warnings_of(caplog) == [in_shards(w, whole_path, shards) for w in expected]
        assert f"{value} (3 files): 13 record(s)" in data.describe()
        assert "all of them: 9 samples" in data.describe()


def test_a_file_whose_name_looks_like_a_pattern_and_a_folder_of_one_file(files):
    """A file named "[2024] train?.jsonl" is that file, named as written; a folder holding one
    file (and a hidden one, left out) names the file in its warnings."""
    odd = files / "[2024] train?.jsonl"
    odd.write_bytes((files / "train.jsonl").read_bytes())
    data = dataset(odd)
    assert data.records == 13 and data.names == [str(odd)]
    assert data.describe().startswith(f"{odd}: 13 record(s)")
    (files / "one").mkdir()
    only = files / "one" / "train.jsonl"
    only.write_bytes((files / "train.jsonl").read_bytes())
    (files / "one" / "._train.jsonl").write_bytes(b"\x00\x05 AppleDouble")
    data = dataset(files / "one", image_root=str(files))
    assert data.files == [only] and data.names == [str(only)]
    assert data.describe().startswith(f"{files / 'one'} (1 file): 13 record(s)")


def test_shards_that_are_not_there_are_one_line(files):
    (files / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^data.dataset: .*empty is a folder without "):
        dataset(files / "empty")
    with pytest.raises(ConfigError, match=r"no .jsonl / .json / .parquet / .arrow / .tar file "):
        dataset(files / "nothing-*.jsonl")
    cfg = load_config(["--data.dataset", str(files / "nothing-*.jsonl")])
    with pytest.raises(ConfigError, match=r"^data.dataset=.*: no .jsonl / .json / .parquet "):
        validate_job(cfg, 1)


def test_error_mode_stops_at_the_first_bad_line(files):
    path = files / "train.jsonl"
    with pytest.raises(
        DataError, match=rf"data.on_bad_sample='error': {path}:3: malformed JSON"
    ) as e:
        dataset(path, on_bad_sample="error")
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)
    good = files / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r, _ in [RECORDS[1], RECORDS[7]]) + "\n")
    data = dataset(good, on_bad_sample="error")  # the broken image is only found when it is read
    with pytest.raises(DataError, match=rf"{good}:2: image cannot be decoded: .*truncated.png"):
        data.batch(0, 0, 1, 2)


def test_json_array_files(files):
    records = [r for r, what in RECORDS if not isinstance(r, str)]
    path = files / "train.json"
    path.write_text(json.dumps(records, indent=1))
    starts = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if line == " {"]
    data = dataset(path)
    assert bad(data) == 3 and len(rows(data)) == 9  # no malformed line in a valid array
    assert lines(data) == [
        starts[i] for i in (0, 1, 5, 6, 7, 8, 9, 10, 11)
    ]  # each record's first line
    one = dataset(files / "train.jsonl").batch(0, 0, 1, 2)
    assert torch.equal(data.batch(0, 0, 1, 2).tokens, one.tokens)
    broken = files / "broken.json"
    broken.write_text('[\n {"text": "a"},\n {"text": "b"\n]\n')
    with pytest.raises(ConfigError, match=rf"data.dataset: {broken}:4: invalid JSON"):
        dataset(broken)


def test_image_root_and_the_config_keys(files, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "train.jsonl").write_text(json.dumps(RECORDS[1][0]) + "\n")
    with pytest.raises(ConfigError, match="no usable samples"):  # blue.png is not next to this file
        dataset(elsewhere / "train.jsonl")
    assert len(rows(dataset(elsewhere / "train.jsonl", image_root=str(files)))) == 1
    path = files / "train.jsonl"
    cfg = load_config(
        [f"--data.dataset={path}", "--data.on_bad_sample=error", f"--data.image_root={files}"]
    )
    validate_job(cfg, 1)
    for overrides, words in [
        ([f"--data.dataset={files / 'none.jsonl'}"], "data.dataset: file not found"),
        (
            [f"--data.dataset={files / 'red.png'}"],
            "data.dataset=.* expected 'synthetic' or a .jsonl / .json / .parquet / .arrow / .tar ",
        ),
        (
            [f"--data.dataset={path}", "--data.on_bad_sample=ignore"],
            "data.on_bad_sample must be one of skip",
        ),
        (
            [f"--data.dataset={path}", "--data.max_image_pixels=0"],
            "data.max_image_pixels must be >= 1",
        ),
        (
            [f"--data.dataset={path}", f"--data.image_root={files / 'nope'}"],
            "data.image_root: folder not found",
        ),
    ]:
        with pytest.raises(ConfigError, match=words):  # a choice fails as it is read
            cfg = load_config(overrides)
            validate_job(cfg, 1)


def test_hf_tokenizer_image_token(tmp_path):
    from test_tokenizer import write_tokenizer

    with_image = HFTokenizer(
        write_tokenizer(tmp_path / "a.json", specials=("<pad>", "<s>", "</s>", "<image>"))
    )
    assert with_image.IMAGE == 3 and with_image.decode([1, 3, 2]) == ""
    assert (
        HFTokenizer(write_tokenizer(tmp_path / "b.json")).IMAGE == 0
    )  # none: image slots hold the pad id


def test_load_image_resizes_and_bounds_the_pixels(files):
    image = load_image(files / "big.png", 32)
    assert image.shape == (3, 32, 32) and image.min() >= -1 and image.max() <= 1
    from titan_vlm.data.images import ImageTooLarge

    with pytest.raises(ImageTooLarge, match="64x64 pixels"):
        load_image(files / "big.png", 32, max_pixels=BIG)


# -- videos: "video": [frame paths], each kept frame one image of the sample -----------------

FRAMES = [f"clip/{i:02d}.png" for i in range(20)]


@pytest.fixture
def clip(files):
    """The `files` folder with a 20-frame video under clip/ (frame i: a circle in cell i % 4)."""
    (files / "clip").mkdir()
    for i, frame in enumerate(FRAMES):
        save_png(files / frame, size=32, color="green", cell=i % 4)
    return files


def video_data(folder, *records, **kw) -> JsonlDataset:
    path = folder / "video.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dataset(path, **{"seq_len": 512, **kw})


def shape_of(data: JsonlDataset, i: int) -> list:
    """Sample i's parts as: an image's file (relative to the image root), or its text (a context
    part after "prompt: ")."""
    out: list = []
    ref = kept(data)[i]
    for part in data.sample(ref).parts:
        if isinstance(part, ImageRef):
            out.append(part.path.relative_to(data.roots[ref.file]).as_posix())
        else:
            out.append(("prompt: " if isinstance(part, Prompt) else "") + text_of(part))
    return out


def test_frames_are_sampled_evenly_first_and_last_kept(clip):
    assert sample_frames(20, 8) == [0, 3, 5, 8, 11, 14, 16, 19]  # round(i * 19 / 7), half up
    assert sample_frames(9, 5) == [0, 2, 4, 6, 8] and sample_frames(10, 2) == [0, 9]
    assert sample_frames(5, 1) == [0] and sample_frames(3, 8) == [0, 1, 2]
    video = {"video": FRAMES, "text": "a green circle moves."}
    data = video_data(clip, video, max_frames=8)  # no placeholder: the video goes first
    assert shape_of(data, 0) == [
        *(FRAMES[i] for i in (0, 3, 5, 8, 11, 14, 16, 19)),
        "a green circle moves.",
    ]
    assert data.num_images == 8 and data.sample(kept(data)[0]).num_slots(16) == 8 * 16 + 23
    every = video_data(clip, video, max_frames=30)  # more than the frames: all of them
    assert shape_of(every, 0)[:20] == FRAMES and every.num_images == 20
    # the frames not kept are not read: a missing one costs nothing
    (clip / FRAMES[1]).unlink()
    assert bad(video_data(clip, video, max_frames=8)) == 0


def test_video_placeholder_mid_text_and_with_images_in_reading_order(clip):
    three = FRAMES[:3]
    records = [
        {"video": three, "text": "look: <video> it moves."},
        conv("<image> then <video>?", "yes.", image="red.png", video=three),
        conv("<video> and <image> and <image>", "ok.", images=["red.png", "blue.png"], video=three),
        conv("What moves?", "a circle.", video=three),  # no placeholder: opens the first turn
        conv("<image> what moves?", "a circle.", image="red.png", video=three),  # video first
    ]
    data = video_data(clip, *records, max_frames=8)
    assert bad(data) == 0
    assert [shape_of(data, i) for i in range(5)] == [
        ["look: ", *three, " it moves."],
        ["prompt: USER: ", "red.png", "prompt:  then ", *three, "prompt: ? ASSISTANT:", " yes."],
        [
            "prompt: USER: ",
            *three,
            "prompt:  and ",
            "red.png",
            "prompt:  and ",
            "blue.png",
            "prompt:  ASSISTANT:",
            " ok.",
        ],
        ["prompt: USER: ", *three, "prompt: \nWhat moves? ASSISTANT:", " a circle."],
        [
            "prompt: USER: ",
            *three,
            "prompt: \n",
            "red.png",
            "prompt:  what moves? ASSISTANT:",
            " a circle.",
        ],
    ]
    # decoded, each frame is an image of 16 slots, in order
    batch = data.batch(0, 0, 1, 2)
    assert batch.images.shape[0] == 3 + 4
    assert torch.equal(batch.images[0], load_image(clip / three[0], 32))
    assert torch.equal(batch.images[4], load_image(clip / three[0], 32))  # row 2: red, frames
    assert int((batch.image[0] >= 0).sum()) == 3 * 16


def test_bad_videos_are_bad_samples_with_their_reasons(clip, caplog):
    records = [
        {"video": "clip.mp4", "text": "a video file."},  # 1
        {"video": None, "text": "null."},  # 2
        {"video": ["clip/00.png", ""], "text": "an empty path."},  # 3
        {"video": [FRAMES[:2], FRAMES[2:4]], "text": "<video> and <video>"},  # 4
        {"video": [], "text": "no frames."},  # 5
        {"video": ["clip/00.png", 3], "text": "not a path."},  # 6
        {"video": FRAMES[:2], "text": "<video> twice <video>"},  # 7
        {"text": "<video> without a video."},  # 8
        {"image": "red.png", "video": FRAMES[:2], "text": "no placeholders."},  # 9
        {"video": ["clip/00.png", "clip/gone.png"], "text": "a lost frame."},  # 10
        {"video": FRAMES[:2], "text": "<video>"},  # 11
        {"video": FRAMES[:2], "text": "a good one."},  # 12
    ]
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = video_data(clip, *records)
    path = clip / "video.jsonl"
    assert lines(data) == [12]
    assert [w.removeprefix(f"data: {path}:") for w in warnings_of(caplog)] == [
        "1: 'video' is a file (clip.mp4): video files are decoded where the model folder's "
        "processor reads videos whole (Qwen2.5-VL); give this model a list of frame files "
        "(skipped)",
        "2: 'video' must be a list of frame paths (skipped)",
        "3: 'video' must be a list of frame paths (skipped)",
        "4: 'video' is a list of lists: one video a record (a list of frame paths) (skipped)",
        "5: 'video' has no frames (skipped)",
        "6: 'video' must be a list of frame paths (skipped)",
        "7: 2 <video> placeholder(s) for 1 video(s) (skipped)",
        "8: 1 <video> placeholder(s) for 0 video(s) (skipped)",
        "9: an image and a video without placeholders: mark each place with <image> and "
        "<video> (skipped)",
        f"10: frame file not found: {clip / 'clip' / 'gone.png'} (skipped)",
        "11: empty text (skipped)",
    ]
    assert dict(data.skipped) == {
        "bad record": 6,
        "placeholder count": 3,
        "missing image file": 1,
        "empty text": 1,
    }


def test_max_frames_must_be_positive(files):
    path = files / "train.jsonl"
    cfg = load_config([f"--data.dataset={path}", "--data.max_frames=0"])
    with pytest.raises(ConfigError, match=r"^data.max_frames must be >= 1, got 0$"):
        validate_job(cfg, 1)
    with pytest.raises(ConfigError, match=r"^data.max_frames must be >= 1, got 0$"):
        dataset(path, max_frames=0)


# One real training run on the file (2 ranks: dp_shard=2, one row each, so a rank's whole batch
# is sometimes a dropped sample), interrupted and resumed.
def index_of(data: JsonlDataset) -> list:
    """The windows a dataset holds: each one's place and rows (their samples' records, files,
    lines, spans and slots), as plain lists."""
    return [
        [w.epoch, w.number, w.first, [[list(ref) for ref in row] for row in w.rows]]
        for w in data.windows
    ]


def test_the_shared_pass_crosses_shard_boundaries(pool, files, caplog):
    """Three shards of 5, 4 and 4 records on 2 ranks (records 0-5 and 6-12: rank 0's run ends
    in the second shard): every rank holds the index one process builds of them, and rank 0
    logs the same warnings, naming each shard."""
    cut_into_shards(files, files, "train-{:05d}.jsonl")
    pattern = str(files / "train-*.jsonl")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        alone = dataset(pattern, shuffle=True)
    out = pool.run("shared_index", path=pattern, dp_shard=2)
    assert [o["parsed"] for o in out] == [6, 7]
    for rank, o in enumerate(out):
        assert o["index"] == index_of(alone) and o["describe"] == alone.describe()
        assert o["warnings"] == ([] if rank else warnings_of(caplog))
    assert {ref.file for ref in kept(alone)} == {0, 1, 2}


def test_a_resume_sees_any_shard_change(files):
    """The facts a resume must match (resume_config.run_facts) cover every shard: one byte of
    one shard, or a shard's name, changes them; a single file keeps its old form."""
    shards = cut_into_shards(files, files, "train-{:05d}.jsonl")
    pattern = str(files / "train-*.jsonl")

    def facts(value: str) -> str:
        return run_facts(load_config(["--data.dataset", value]), 4)[DATA_FILE]

    before = facts(pattern)
    assert before.startswith(f"3 files, {sum(p.stat().st_size for p in shards)} bytes, ")
    shards[1].write_text(shards[1].read_text().replace("blue", "Blue", 1))
    changed = facts(pattern)
    shards[2].rename(files / "train-00009.jsonl")
    assert len({before, changed, facts(pattern)}) == 3
    single = facts(str(files / "train.jsonl"))
    assert single.startswith(f"{(files / 'train.jsonl').stat().st_size} bytes, ")


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_share_the_windows_pass_and_hold_one_processs_index(pool, files, ranks, caplog):
    """Each of 2 (4) ranks parses its contiguous run of the 13 records (7 and 6; 4, 3, 3, 3) and
    every rank ends with the index one process builds alone: the same kept samples, spans,
    packing rows, counters and description; rank 0 logs every start-up warning, in file order,
    the others none (control: no rank parsed them all)."""
    path = files / "train.jsonl"
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        alone = dataset(path, shuffle=True)
    out = pool.run("shared_index", path=str(path), dp_shard=ranks)
    parsed = [o["parsed"] for o in out]
    assert sum(parsed) == alone.records == 13 and max(parsed) <= -(-13 // ranks)
    for rank, o in enumerate(out):
        assert o["index"] == index_of(alone)
        assert o["counts"] == [13, 4, dict(alone.skipped), 1]
        assert o["describe"] == alone.describe()
        assert o["warnings"] == ([] if rank else warnings_of(caplog))
    lines = [int(w.split(".jsonl:")[1].split(":")[0]) for w in out[0]["warnings"]]
    assert lines == [3, 4, 5, 6, 7], out[0]["warnings"]  # every start-up bad sample, in order


def test_a_bad_sample_in_one_ranks_share_stops_every_rank_with_the_first(pool, files):
    """data.on_bad_sample = "error": the first bad record in file order (line 3, in rank 0's
    share) stops both ranks with its line, although rank 1's share has bad records of its own;
    with only rank 1's share bad, rank 0 raises rank 1's line (no rank waits for another)."""
    out = pool.run(
        "shared_index", path=str(files / "train.jsonl"), dp_shard=2, on_bad_sample="error"
    )
    assert [o["error"] for o in out] == [
        f"data.on_bad_sample='error': {files / 'train.jsonl'}:3: malformed JSON (Expecting ',' "
        f"delimiter at column {len(RECORDS[2][0]) + 1})"
    ] * 2
    good = json.dumps(RECORDS[0][0])
    late = files / "late.jsonl"
    late.write_text("\n".join([good] * 3 + ['{"text": "  "}']) + "\n")
    out = pool.run("shared_index", path=str(late), dp_shard=2, on_bad_sample="error")
    assert [o["error"] for o in out] == [f"data.on_bad_sample='error': {late}:4: empty text"] * 2


def test_ranks_that_see_other_files_stop_with_one_line(pool, files):
    """Rank 1's folder holds a shard of another size than rank 0's (a shard written while the
    job starts, another node's copy): both ranks stop with one line before the shared pass,
    which would otherwise number their records apart; the control: the same files pass."""
    for name in ("a", "b"):  # the same shard names: only a size tells them apart
        (files / name).mkdir()
        cut_into_shards(files, files / name, "part-{}.jsonl")
    shard = files / "b" / "part-1.jsonl"
    shard.write_text(shard.read_text() + '{"text": "one more"}\n')
    folders = [str(files / "a"), str(files / "b")]
    out = pool.run("shared_index", path="", dp_shard=2, rank_paths=folders)
    assert [o["error"] for o in out] == [
        f"data.dataset: {folders[0]}: rank 1 sees other files than rank 0 (their names or "
        "sizes differ: a shard written while the job starts, or another copy of the data on "
        "another node)",
        f"data.dataset: {folders[1]}: rank 1 sees other files than rank 0 (their names or "
        "sizes differ: a shard written while the job starts, or another copy of the data on "
        "another node)",
    ]
    out = pool.run("shared_index", path=folders[0], dp_shard=2)
    assert all("error" not in o for o in out)
    # a rank that cannot list them (the data missing on its node): its line, and the others'
    out = pool.run("shared_index", path="", dp_shard=2, rank_paths=[folders[0], "nowhere.jsonl"])
    assert out[1]["error"] == "data.dataset: file not found: nowhere.jsonl"
    assert out[0]["error"].endswith(
        "rank 1 sees other files than rank 0 (their names or sizes "
        "differ: a shard written while the job starts, or another "
        "copy of the data on another node)"
    )


def test_an_exception_in_one_ranks_share_reaches_every_rank(pool, files):
    """Not a bad sample but a bug (rank 1's parsing raises ValueError): rank 1 raises it as it
    came, rank 0 a RuntimeError naming rank 1 and the line, and neither waits for the other."""
    out = pool.run("shared_index", path=str(files / "train.jsonl"), dp_shard=2, fail_on_rank=1)
    assert out[1]["error"] == "ValueError: a bug"
    assert out[0]["error"] == (
        f"RuntimeError: data.dataset: {files / 'train.jsonl'}: the pass over a window failed on "
        "rank 1 of 2: ValueError: a bug"
    )


TRAIN = dict(
    steps=4,
    training__seq_len=SEQ,
    training__local_batch_size=1,
    training__warmup_steps=2,
    data__max_image_pixels=BIG,
    metrics__enable_tensorboard=False,
)


def interrupted_run(
    pool, tmp_path, run: dict, before_resume=lambda: None, stop_after: int = 3, interval: int = 2
) -> tuple:
    """`run` (train_run's keys) on 2 ranks uninterrupted, every batch built in the training
    process (data.num_workers=0), in tmp_path/whole; and in tmp_path/ckpt the run that dies after
    step `stop_after` (saved at `interval`) with 2 loader workers a rank, resumed with 1
    (`before_resume` called between): both histories, checked equal to the bit where they
    overlap, with the same bad-sample counts."""
    whole = pool.run(
        "train_run",
        dp_shard=2,
        cp=1,
        job__dump_folder=str(tmp_path / "whole"),
        data__num_workers=0,
        **run,
    )[0]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in whole)
    ckpt = dict(
        checkpoint__enable=True,
        checkpoint__interval=interval,
        job__dump_folder=str(tmp_path / "ckpt"),
        **run,
    )
    pool.run("train_run", dp_shard=2, cp=1, stop_after=stop_after, data__num_workers=2, **ckpt)
    before_resume()
    resumed = pool.run("train_run", dp_shard=2, cp=1, data__num_workers=1, **ckpt)[0]
    assert [h["step"] for h in resumed] == list(range(interval + 1, run["steps"] + 1))
    for h in resumed:
        assert h["loss"] == whole[h["step"] - 1]["loss"], h["step"]
        assert h["data_bad_samples"] == whole[h["step"] - 1]["data_bad_samples"], h["step"]
    return whole, resumed


def test_training_on_a_jsonl_file_resumes_bit_exact(pool, files, tmp_path):
    """Uninterrupted with every batch built in the training process (data.num_workers=0); the
    run that dies after step 3 with 2 loader workers a rank, resumed with 1: the same losses to
    the bit and the same bad-sample counts (workers change when a batch is built, not what)."""
    path = str(files / "train.jsonl")
    run = dict(data__dataset=path, **TRAIN)
    # to resume once more below, at cp=2
    keep = lambda: shutil.copytree(tmp_path / "ckpt", tmp_path / "first")  # noqa: E731
    whole, _ = interrupted_run(pool, tmp_path, run, keep)
    ckpt = dict(
        checkpoint__enable=True,
        checkpoint__interval=2,
        job__dump_folder=str(tmp_path / "ckpt"),
        **run,
    )
    # the counters: the window's bad samples plus the distinct samples any dp rank dropped, from
    # an independent read
    data = dataset(path, shuffle=True, seq_len=SEQ)
    expect = []
    for step in range(4):
        for rank in range(2):
            data.batch(step, rank, 2, 1)
        expect.append(data.bad_samples((step + 1) * 2) + len(data.dropped))
    assert expect[-1] > expect[0] >= 4  # broken images were read
    metrics = [
        json.loads(line)
        for line in (tmp_path / "ckpt" / "copy0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert (
        [m["data_bad_samples"] for m in metrics] == [h["data_bad_samples"] for h in whole] == expect
    )
    assert all(m["data_truncated"] == 1 for m in metrics)
    # the same global batch at another layout (cp=2, both rows on one dp rank) reads the same rows
    shutil.copytree(tmp_path / "first", tmp_path / "other")
    other = pool.run(
        "train_run",
        dp_shard=1,
        cp=2,
        **{**ckpt, "training__local_batch_size": 2, "job__dump_folder": str(tmp_path / "other")},
    )[0]
    assert [h["step"] for h in other] == [3, 4]
    for h in other:
        assert h["loss"] == pytest.approx(whole[h["step"] - 1]["loss"], rel=1e-5), h["step"]
    # and ask the trained model about an image, in the chat template its data used
    model, cfg = load_model_for_inference(tmp_path / "ckpt" / "copy0" / "checkpoint")
    assert cfg.data.dataset == path
    answer = generate(
        model, load_image(files / "red.png", 32), "What is this?", max_new_tokens=4, chat=True
    )
    assert isinstance(answer, str) and len(answer) <= 4


def test_training_on_videos_and_images(pool, clip, tmp_path):
    """A few real steps (cp=2) on a file of videos, images and both: every sample kept, frames
    decoded as images, a finite loss."""
    records = [
        conv("What moves?\n<video>", "a green circle.", video=FRAMES),
        {"image": "red.png", "video": FRAMES[::2], "text": "<image> then <video> circles."},
        conv("<image>\nWhat is this?", "A red circle.", image="red.png"),
        {"video": FRAMES[5:9], "text": "one green circle."},
    ]
    path = clip / "video.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dataset(path, seq_len=128, max_frames=4).num_images == 4 + (1 + 4) + 1 + 4
    history = pool.run(
        "train_run",
        dp_shard=1,
        cp=2,
        steps=2,
        data__dataset=str(path),
        data__max_frames=4,
        data__shuffle=False,
        training__seq_len=128,
        training__local_batch_size=2,
        training__warmup_steps=1,
        metrics__enable_tensorboard=False,
        job__dump_folder=str(tmp_path),
    )[0]
    assert [h["step"] for h in history] == [1, 2]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert all(h["data_bad_samples"] == 0 and h["data_truncated"] == 0 for h in history)
