"""Your own data: LLaVA-style conversations and captions from a JSON array (`.json`) or JSON lines
(`.jsonl`) file, with images on disk (`data.dataset = "path/to/train.jsonl"`), or from a
Parquet, Arrow or WebDataset tar file (images beside it or inside it), or from several files of
one format, a folder of them, a glob pattern or a Hugging Face datasets folder (`dataset_files`:
read in name order as if they were one file, their records numbered in turn; each warning names
a record's own file and line (row, sample), and its image paths are relative to its own file's
folder unless data.image_root is set). What a record may hold is data/records.py's; how it
becomes tokens (the chat template, captions) data/chat.py's, or, with a Hugging Face model
folder's processor (`JsonlDataset(..., processor=...)`, data/hf_processor.py), the folder's chat
template and image preprocessing; where each record lies in its file, and how it is read back,
data/record_files.py's (one reader per format).

Indexed a window at a time, so that start-up does not grow with the corpus: at start-up only
where each record lies is found (its line and byte span, or row: data/record_files.py; kept
between runs by data/index_cache.py), and the first window's records are parsed and tokenized
and their images counted (images are only checked to exist, not decoded); each later window
when training reaches it (`ensure`, the step's wait). A window (data/windows.py) is
data.index_window records, whole blocks of 1024 consecutive records, the blocks in a new seeded
order every epoch (`data.shuffle`; else file order). Each process of the job does a contiguous
share of a window's records (split again over it and its forked `workers`: data/forked.py) and
all of them exchange their parts (`share`: IndexShare; the same window, warnings and errors as
one process doing them all). A window's kept samples are packed in its order (`data.packing`:
greedily, a sample that does not fit starts the next row, nothing dropped; else one sample per
row; rows never cross a window) and its rows shuffled (`data.shuffle`). The run's global rows
are epoch 0's windows' rows in turn, then epoch 1's, and the rows of a global batch are numbered
exactly as the built-in data's (data/dataset.py batch_rows):

    epoch 0:  | window 0: rows 0..R0-1 | window 1: rows R0..R0+R1-1 | ... | then epoch 1's windows

So a row is a pure function of its number, the files and the settings, and the checkpointed step
is the data position; the checkpoint also keeps where that row's window starts (`position`: its
epoch, number and first row, and the bad samples before it), so that a resumed run indexes from
there, not from row 0, and a run resumed at another dp / cp layout with the same global batch
reads the same rows. Only the byte span of each kept sample is kept; a batch reads its records
back from the file (which must not change while a run and its resumes use it) and decodes only
its own rows' images.

Bad input, each counted and reported once per process as `data: <file>:<line>: <reason> (skipped)`
(data/bad_samples.py: the first MAX_WARNINGS; the counts cover all), or with `data.on_bad_sample =
"error"` a DataError naming the file and line: a malformed JSON line, a record without the keys of
data/records.py (or with a bad "video"), an empty text, a placeholder / image (or video) count
mismatch, a conversation the chat template cannot render and a missing image (or kept video frame)
file are found by their window's pass and leave the sample out of the index (the first window's
at start-up, a later one's when training reaches it; each reported in epoch 0 only); a sample
longer than training.seq_len is cut to it (Sample.truncated, "(truncated)"); JSON nested too
deeply, text that is not valid Unicode (a lone surrogate escape such as "\\ud800") and bytes
that are not UTF-8 are bad samples too, and a UTF-8 byte order mark at the start of the file is
skipped; an image that cannot be decoded or has more than `data.max_image_pixels` pixels (read
from its header; a video's frames are images) is found when its batch is built, and its sample
is left out of that row (the same way on every read, so runs stay deterministic; a rank whose
whole batch is left out gets one untrained padding token, so it still runs the step).

Native resolution (`native`, data.native_resolution_pixels > 0): each image keeps its aspect
ratio at the size NativeResolution.fit gives its header's size, and takes that size's
image_tokens slots. So a window's pass reads every image's (and kept frame's) header (not its
pixels) to size the samples, and an image whose header Pillow cannot read or that is larger than
data.max_image_pixels is a bad sample of the pass; a batch reads the headers again (the same
sizes, the file unchanged) and decodes at those sizes.

A family's own image sizes (`rule`, an ImageRule that is not NativeResolution, e.g. Qwen2.5-VL's
QwenRule, with its folder's `processor`): the same, with the rule's `fit` (the processor's
smart_resize) in place of NativeResolution's, and the processor making each image's pixels at
that size. Where the processor reads a video whole (HFProcessor.reads_videos), a record's video
is one part (data/images.py VideoRef): all its kept frames' headers are read by the pass (frames
of different sizes are a bad sample), the frames enter at `fit(h, w, frames)` of their size and
count, the part takes `rule.size_slots(h, w, frames)` slots, and decodes to [T, 3, H, W]. The
parts are sized before the chat template is rendered (data/records.py parse_record's `sized`),
so a processor that writes text inside a video (Qwen3-VL's timestamps: one VideoRef per frame
group, FolderVision.split_videos) knows its frames; the groups of one video file are decoded in
one pass.
"""

from __future__ import annotations

import glob
import json
import logging
import time
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from titan_vlm.data.bad_samples import BadSampleLog, Report
from titan_vlm.data.batch import (
    ImageBytes,
    ImageRef,
    Part,
    Sample,
    SlotData,
    SlotRule,
    VideoFrames,
    part_slots,
)
from titan_vlm.data.dataset import Dataset, Position, keep_one_slot
from titan_vlm.data.forked import Forked, LoaderWorkerDied
from titan_vlm.data.hf_processor import HFProcessor, kept_frame_files, video_file_frames
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.data.images import (
    ImageTooLarge,
    NativeResolution,
    VideoRef,
    load_image,
    load_native_image,
    open_image,
)
from titan_vlm.data.index_cache import IndexCache, identity, index_key
from titan_vlm.data.index_cache import load as load_index
from titan_vlm.data.index_cache import save as save_index
from titan_vlm.data.json_spans import Span, Spans
from titan_vlm.data.mixture import Schedule, data_sources
from titan_vlm.data.record_files import FORMATS, RecordFile, open_records, require_pyarrow
from titan_vlm.data.records import BadSample, parse_record
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.data.video import VideoError
from titan_vlm.data.windows import BLOCK, WindowOrder, positions, window_blocks
from titan_vlm.errors import ConfigError, UserError

if TYPE_CHECKING:
    from titan_vlm.config import Data


logger = logging.getLogger("titan_vlm")

# the fewest records a process of a window's pass takes (JsonlDataset `workers`): fewer are not
# worth a fork (about 0.2 s of parsing)
PASS_RECORDS = 4096
GLOB = "*?["  # a dataset value holding one of these is a glob pattern
ENDINGS = " / ".join(FORMATS)  # for messages: ".jsonl / .json / .parquet / .arrow / .tar"


def _files(n: int) -> str:
    return f"{n} file{'' if n == 1 else 's'}"


def dataset_files(key: str, value: str) -> list[Path]:
    """A dataset key's files (not "synthetic"), in the order their records are numbered: the
    dataset file `value` (an ending of data/record_files.py's FORMATS), or a folder's dataset
    files (not its subfolders'), or a glob pattern's (a value naming an existing file or folder
    is that file or folder, whatever characters it holds), sorted by name, hidden files (".name")
    left out, all of one format (.json and .jsonl count as one); or a Hugging Face datasets
    folder (save_to_disk: its state.json lists its .arrow files, in their order). ConfigError
    (one line) for none, for several formats, and for Parquet or Arrow without pyarrow."""
    if any(c in value for c in GLOB) and not Path(value).exists():
        files = sorted(Path(p) for p in glob.glob(value) if Path(p).suffix in FORMATS)
        files = [f for f in files if f.is_file()]
        if not files:
            raise ConfigError(f"{key}={value!r}: no {ENDINGS} file matches the pattern")
        return _one_format(key, value, files)
    path = Path(value)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            try:
                splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            except (OSError, ValueError, KeyError, TypeError):
                splits = []
            named = ", ".join(str(path / split) for split in splits) or "a split's folder"
            raise ConfigError(
                f"{key}: {value} is a Hugging Face DatasetDict folder: name one split's folder "
                f"({named})"
            )
        if (path / "state.json").is_file():
            return _one_format(key, value, _saved_dataset(key, path))
        files = sorted(
            p
            for p in path.iterdir()
            if p.suffix in FORMATS and p.is_file() and not p.name.startswith(".")
        )
        if not files:
            raise ConfigError(f"{key}: {value} is a folder without {ENDINGS} files")
        return _one_format(key, value, files)
    if path.suffix not in FORMATS:
        raise ConfigError(
            f"{key}={value!r}: expected 'synthetic' or a {ENDINGS} file (or a folder or glob "
            "pattern of them, or a Hugging Face datasets folder)"
        )
    if not path.is_file():
        raise ConfigError(f"{key}: file not found: {value}")
    return _one_format(key, value, [path])


def _saved_dataset(key: str, folder: Path) -> list[Path]:
    """The data files of a folder Hugging Face datasets' save_to_disk wrote, as its state.json
    lists them."""
    state = folder / "state.json"
    try:
        listed = json.loads(state.read_text())["_data_files"]
        files = [folder / entry["filename"] for entry in listed]
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {state}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{key}: {state} is not a Hugging Face datasets state file (no _data_files: "
            f"{type(e).__name__}: {e})"
        ) from None
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{key}: {state} lists {f.name}, which is not in {folder}")
    if not files:
        raise ConfigError(f"{key}: {state} lists no data files")
    return files


def _one_format(key: str, value: str, files: list[Path]) -> list[Path]:
    """`files`, checked to be of one format that can be read here."""
    kinds = sorted({".json" if f.suffix == ".jsonl" else f.suffix for f in files})
    if len(kinds) > 1:
        raise ConfigError(
            f"{key}: {value} holds {' and '.join(kinds)} files: one format a source (name a "
            "glob pattern to choose)"
        )
    if kinds[0] in (".parquet", ".arrow"):
        try:
            require_pyarrow()
        except ConfigError as e:
            raise ConfigError(f"{key}={value!r}: {e}") from None
    return files


def validate_data_config(data: Data) -> None:
    """The data.* keys (the loader's, and a dataset file's), before any process group exists
    (the file itself is parsed when the dataset is built). data.on_bad_sample, a choice key, is
    checked with the others by config.check_choices (validate.validate_job runs it first)."""
    if data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {data.num_workers}")
    if data.prefetch < 1:
        raise ConfigError(f"data.prefetch must be >= 1, got {data.prefetch}")
    if data.max_image_pixels < 1:
        raise ConfigError(f"data.max_image_pixels must be >= 1, got {data.max_image_pixels}")
    _check_max_frames(data.max_frames)
    _check_window(data.index_window)
    if data.native_resolution_pixels < 0:
        raise ConfigError(
            f"data.native_resolution_pixels must be >= 0, got {data.native_resolution_pixels}"
        )
    if data.dataset == "synthetic" and not data.mixture:
        if data.native_resolution_pixels:
            raise ConfigError(
                "data.native_resolution_pixels is for a dataset file's images: the synthetic "
                "data draws every image at the model's size (set it to 0)"
            )
        return
    sources = data_sources(data.dataset, data.mixture)
    if data.mixture:
        Schedule([w for w, _ in sources])  # weights too fine for a pattern: one line, now
    for _, source in sources:
        dataset_files("data.mixture" if data.mixture else "data.dataset", source)
    if data.image_root and not Path(data.image_root).is_dir():
        raise ConfigError(f"data.image_root: folder not found: {data.image_root}")


_NATIVE_WITH_PROCESSOR = (
    "data.native_resolution_pixels > 0 does not combine with model.hf_path: the folder's image "
    "processor fixes every image's size (set it to 0)"
)


def _check_max_frames(max_frames: int) -> None:
    if max_frames < 1:
        raise ConfigError(f"data.max_frames must be >= 1, got {max_frames}")


def _check_window(window: int) -> None:
    if window < 1:
        raise ConfigError(f"data.index_window must be >= 1, got {window}")


class IndexShare(Protocol):
    """How the processes of a job share a window's pass over its records: this process indexes
    positions `part(n)` (a contiguous run of the window's n), and `gather(mine)` returns every
    process's part in process order, which is the window's order; `agree(mine)`, whether every
    process says yes; `differing(mine)`, the first process whose value is not the first's (the
    trainer's: data/shared_pass.py)."""

    rank: int  # this process's part in the gathered list

    def part(self, n: int) -> range: ...

    def agree(self, mine: bool) -> bool: ...

    def differing(self, mine: object) -> int | None: ...

    def gather(self, mine: IndexPart) -> list[IndexPart]: ...


class SampleRef(NamedTuple):
    """A kept sample as a window's pass found it: its record's number (the dataset's records of
    every file numbered in turn), file, line, byte span (or row) and slots (after truncation).
    What a loader worker needs to read it back (data/loader.py: a step's plan)."""

    record: int
    file: int
    line: int
    start: int
    end: int
    size: int


@dataclass
class IndexPart:
    """The pass over a run of a window's records: its kept samples (record, file, line, byte
    span, slots), its counters, the reports of its bad samples (BadSampleLog.report's
    arguments, in the window's order), the video files whose headers it read
    (JsonlDataset._video_files), and the UserError that stopped it (data.on_bad_sample =
    "error"; `failure`: any other exception, in one line), if one did."""

    records: array = field(default_factory=lambda: array("q"))
    files: array = field(default_factory=lambda: array("q"))
    lines: array = field(default_factory=lambda: array("q"))
    starts: array = field(default_factory=lambda: array("q"))
    ends: array = field(default_factory=lambda: array("q"))
    sizes: array = field(default_factory=lambda: array("q"))
    skipped: Counter[str] = field(default_factory=Counter)
    truncated: int = 0
    num_images: int = 0
    num_videos: int = 0
    reports: list[Report] = field(default_factory=list)
    videos: dict[Path, VideoRef] = field(default_factory=dict)
    error: UserError | None = None
    failure: str | None = None

    def then(self, later: IndexPart) -> None:
        """`later`, the run of records right after this one's, added to it, as if one pass had
        gone over both: nothing of it where this one stopped (an error, a failure)."""
        if self.error is not None or self.failure is not None:
            return
        for name in ("records", "files", "lines", "starts", "ends", "sizes"):
            getattr(self, name).extend(getattr(later, name))
        self.skipped.update(later.skipped)
        self.truncated += later.truncated
        self.num_images += later.num_images
        self.num_videos += later.num_videos
        self.reports.extend(later.reports)
        self.videos.update(later.videos)
        self.error, self.failure = later.error, later.failure

    def sample(self, i: int) -> SampleRef:
        return SampleRef(
            self.records[i],
            self.files[i],
            self.lines[i],
            self.starts[i],
            self.ends[i],
            self.sizes[i],
        )


@dataclass
class Window:
    """Window `number` of epoch `epoch` as its pass indexed it (data/windows.py): its rows, in
    the order they are read (each row its samples in packing order), the first of them global
    row `first`; what it held and left out (samples, images, videos, bad and cut samples)."""

    epoch: int
    number: int
    first: int
    rows: list[tuple[SampleRef, ...]]
    index: IndexPart

    @property
    def stop(self) -> int:
        return self.first + len(self.rows)

    @property
    def bad(self) -> int:
        return sum(self.index.skipped.values())


class OpenFiles:
    """The dataset files a batch reads its records from (`files`, named `names`), each opened
    once, on first use, and closed with the batch."""

    def __init__(self, files: list[Path], names: list[str]):
        self.files, self.names = files, names
        self.opened: dict[int, RecordFile] = {}

    def file(self, k: int) -> RecordFile:
        if k not in self.opened:
            self.opened[k] = open_records(self.files[k], self.names[k])
        return self.opened[k]

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.opened.values():
            f.close()


Plan = list[tuple[SampleRef, ...]]  # a step's rows, each its samples: what a worker reads


class JsonlDataset(Dataset):
    """A dataset file (or files) of LLaVA conversations or captions (see the module docstring),
    read as every Dataset is (data/dataset.py): `ensure(rows)` on every process, then
    `plan(rows)` and `read(plan)`, or `batch(step, dp_rank, dp_size, batch_size) -> Batch`.

    Counters: `skipped` (by kind) and `truncated`, the samples epoch 0's windows indexed so far
    left out or cut to seq_len (`bad_samples(rows)` / `truncated_samples(rows)`: those of the
    windows that rows 0..rows-1 reach, what the metrics report); `dropped` (the record numbers
    this process left out of its batches: an image that cannot be decoded or is too large; a
    sample read again is not counted again). `log_startup` / `log_batches`: whether this process
    logs the pass's / batch-time warnings (the trainer lets one rank log each kind once: the
    pass's on rank 0, batch-time on each dp rank's first cp and tp rank).

    `processor`: a Hugging Face model folder's (data/hf_processor.py): conversations in its chat
    template, images preprocessed by its image processor (its image size, where it fixes one,
    must be `image_size`); `tokenizer` must then be `processor.tokenizer`. `max_frames`: a
    record's video is sampled to at most this many frames (data.max_frames), each one image of
    the sample (or, where the processor reads videos whole, one video part).
    `native`: data.native_resolution_pixels > 0 (module docstring); None: every image is resized
    to image_size x image_size and takes `tokens_per_image` slots. `rule`: instead, a family's
    ImageRule that sizes images itself (module docstring; it needs a `processor` whose images
    keep their own sizes); `slot_data`: the family's per-slot data of each sample (collate).
    `window`: records a window's pass indexes (data.index_window; whole blocks of
    data/windows.py BLOCK). `share`: how the processes of a job split each window's pass
    (IndexShare; None: this process does it all). `cache`: where the records' spans are kept
    between runs (data/index_cache.py; None: the files are scanned every time). `bad`: the log
    its bad samples are reported through (a mixture's, data/mixture.py; None: its own, by
    data.on_bad_sample). `workers`: this process's share of a window's pass is split over it and
    up to this many processes forked from it (data.num_workers; each takes at least
    PASS_RECORDS records): the same index, warnings and first error as this process alone,
    sooner where the cores are there. `position`: where a resumed run's data stands (Position,
    from its checkpoint; None: row 0)."""

    bad: BadSampleLog

    def __init__(
        self,
        path: str,
        tokenizer: ByteTokenizer | HFTokenizer,
        image_size: int,
        tokens_per_image: int,
        seq_len: int,
        seed: int,
        packing: bool = False,
        shuffle: bool = True,
        image_root: str = "",
        on_bad_sample: str = "skip",
        max_image_pixels: int = 4096 * 4096,
        log_startup: bool = True,
        log_batches: bool = True,
        processor: HFProcessor | None = None,
        max_frames: int = 8,
        native: NativeResolution | None = None,
        rule: ImageRule | None = None,
        slot_data: SlotData | None = None,
        window: int = 16384,
        share: IndexShare | None = None,
        cache: IndexCache | None = None,
        bad: BadSampleLog | None = None,
        workers: int = 0,
        position: Position | None = None,
    ):
        _check_max_frames(max_frames)
        _check_window(window)
        if native is not None and rule is not None and rule is not native:
            raise ValueError("JsonlDataset: `native` or `rule`, not both")
        rule = native if native is not None else rule
        native = rule if isinstance(rule, NativeResolution) else None
        if native is not None and processor is not None:
            raise ConfigError(_NATIVE_WITH_PROCESSOR)
        if processor is not None and tokenizer is not processor.tokenizer:
            raise ValueError("JsonlDataset: with a processor, the tokenizer is processor.tokenizer")
        if processor is not None and processor.image_size is None and rule is None:
            raise ValueError("JsonlDataset: a processor whose images keep their sizes needs a rule")
        if processor is not None and processor.image_size not in (None, image_size):
            raise ConfigError(
                f"model.hf_path: {processor.folder}: images of {processor.image_size} pixels, "
                f"the model takes {image_size}"
            )
        if processor is not None and processor.image_size is not None and rule is not None:
            raise ValueError("JsonlDataset: a processor of fixed-size images takes no rule")
        self.processor = processor
        self.name = str(path)  # as the user wrote it
        listing: ConfigError | None = None  # this process's, shared below (no rank waits)
        try:
            self.files = dataset_files("data.dataset", self.name)
        except ConfigError as e:
            if share is None:
                raise
            self.files, listing = [], e
        # each file as the warnings name it: a file named itself as the user wrote it
        self.single = Path(self.name).is_file()
        self.names = [self.name] if self.single else [str(f) for f in self.files]
        self.bad = bad if bad is not None else BadSampleLog(self.name, on_bad_sample)
        self.tokenizer = tokenizer
        self.image_size, self.tokens_per_image, self.seq_len = image_size, tokens_per_image, seq_len
        self.native, self.rule, self.slot_data = native, rule, slot_data
        self.slots: SlotRule = rule if rule is not None else tokens_per_image
        self.seed, self.packing, self.shuffle = seed, packing, shuffle
        # the folder each file's image paths are relative to: data.image_root, else its own
        self.roots = [Path(image_root) if image_root else f.parent for f in self.files]
        self.max_image_pixels, self.max_frames = max_image_pixels, max_frames
        self.log_startup, self.log_batches = log_startup, log_batches
        self.share, self.workers = share, workers
        self.dropped: set[int] = set()
        # a video file's sized VideoRef, read once (its header: a Matroska file's packets are
        # counted, a scan of the file) and reused each time its record is read back
        self._video_files: dict[Path, VideoRef] = {}
        if share is not None:  # every process must number the same records
            self._check_same_files(share, listing)
        self.spans = self._spans(share, cache)
        self.firsts = [0]  # file k's records are numbers firsts[k] .. firsts[k + 1] - 1
        for sp in self.spans:
            self.firsts.append(self.firsts[-1] + len(sp))
        self.records = self.firsts[-1]
        if not self.records:
            raise ConfigError(f"data.dataset: {self.name}: no records")
        self.order = WindowOrder(self.records, window_blocks(window), seed, shuffle)
        # What the passes found: epoch 0's windows' counters (a later epoch's pass finds the
        # same records again), and each such window's first row and bad and cut samples.
        self.skipped: Counter[str] = Counter()
        self.truncated = self.num_images = self.num_videos = 0
        self._counted: dict[int, tuple[int, int, int]] = {}  # number: (first, bad, truncated)
        start = position if position is not None else Position(0, 0, 0, 0, 0)
        if not (0 <= start.number < self.order.windows and start.epoch >= 0 and start.first >= 0):
            raise ConfigError(
                f"data.dataset: {self.name}: the checkpoint's data position {tuple(start)} is "
                f"not one of these {self.order.windows} windows (the data changed?)"
            )
        self._start = self._before = start  # the counts of epoch 0's windows before it
        self._next = (start.epoch, start.number, start.first)  # the next window to index
        self.windows: list[Window] = []  # those indexed that rows still to come may read
        self.ensure(range(start.first, start.first))  # the first window, now

    def _check_same_files(self, share: IndexShare, listing: ConfigError | None) -> None:
        """ConfigError, on every process, where one lists other files (or sizes) than the first:
        a shard added or removed while they start, or another copy of the data on another
        node. Its records would be numbered otherwise, and the shared pass would mix them.
        `listing`: this process's error listing them (raised here, once every process knows)."""
        mine: object = (
            str(listing) if listing else [(f.name, identity(str(f))[0]) for f in self.files]
        )
        k = share.differing(mine)
        if listing is not None:
            raise listing
        if k is not None:
            raise ConfigError(
                f"data.dataset: {self.name}: rank {k} sees other files than rank 0 (their names "
                "or sizes differ: a shard written while the job starts, or another copy of the "
                "data on another node)"
            )

    def _spans(self, share: IndexShare | None, cache: IndexCache | None) -> list[Spans]:
        """Each file's record spans (data/record_files.py: a JSONL file memory-mapped and its
        lines found, a tar's member headers read, a table's rows counted): read from the cache
        of an earlier run of the same files (every process, or none: data/index_cache.py), else
        found, and kept there by the first process."""
        key = spans = None
        if cache is not None:
            key = index_key({**cache.settings, "dataset": self.name}, self.files)
            spans = load_index(cache.folder, key)
            if share is not None and not share.agree(spans is not None):
                spans = None  # some process cannot read them: all of them find them
        if spans is not None:
            if self.log_startup and cache is not None:
                logger.info("data: %s: the records' spans read from %s", self.name, cache.folder)
            return spans
        spans = []
        for k in range(len(self.files)):
            with open_records(self.files[k], self.names[k]) as source:
                spans.append(source.spans())
        if cache is not None and key is not None and (share is None or share.rank == 0):
            save_index(cache.folder, key, spans)
        return spans

    # ---- the windows: indexed as training reaches them ----

    def ensure(self, rows: range) -> None:
        """Index the windows up to the one holding row `rows.stop` (each window's pass shared by
        the processes of `share`: every one of them calls this with the same rows); rows before
        the first window kept (`forget`) are indexed again from this run's first window."""
        if self.windows and rows.start < self.windows[0].first:  # back (a loader restarted)
            if rows.start < self._start.first:
                raise IndexError(f"{self.name}: row {rows.start} is before this run's first")
            self.windows = []
            self._next = (self._start.epoch, self._start.number, self._start.first)
        while not self.windows or self.windows[-1].stop <= rows.stop:
            self.windows.append(self._index_next())

    def forget(self, row: int) -> None:
        """Drop the windows wholly before `row` (the last one indexed stays)."""
        while len(self.windows) > 1 and self.windows[0].stop <= row:
            self.windows.pop(0)

    def _index_next(self) -> Window:
        """The next window of the epochs, indexed (its pass's warnings reported in its order,
        its first error raised): its samples packed in its order (`data.packing`: greedily, a
        sample that does not fit starts the next row, nothing dropped; else one a row), then
        its rows put in their order."""
        epoch, number, first = self._next
        begin = time.perf_counter()
        index = self._pass(self.order.records_of(epoch, number), log=epoch == 0)
        packed: list[list[int]] = []
        used = 0
        for i, size in enumerate(index.sizes):
            if not packed or not self.packing or used + size > self.seq_len:
                packed.append([])
                used = 0
            packed[-1].append(i)
            used += size
        rows = [
            tuple(index.sample(i) for i in packed[r])
            for r in self.order.row_order(epoch, number, len(packed))
        ]
        window = Window(epoch, number, first, rows, index)
        if epoch == 0 and number not in self._counted:  # indexed again: counted once
            self.skipped.update(index.skipped)
            self.truncated += index.truncated
            self.num_images += index.num_images
            self.num_videos += index.num_videos
            self._counted[number] = (first, window.bad, index.truncated)
        last = number + 1 == self.order.windows
        if last and epoch == 0 and window.stop == 0:
            raise ConfigError(
                f"data.dataset: {self.name}: no usable samples in {self.records} record(s)"
            )
        self._next = (epoch + 1, 0, window.stop) if last else (epoch, number + 1, window.stop)
        if self.log_startup and self.order.windows > 1 and self.windows:  # (describe: the first)
            logger.info(
                "data: %s: window %d of %d of epoch %d indexed: %s, %.1f s",
                self.name,
                number + 1,
                self.order.windows,
                epoch,
                self._counts(window, bad=epoch == 0),
                time.perf_counter() - begin,
            )
        return window

    def _pass(self, runs: list[range], log: bool) -> IndexPart:
        """The pass over a window's records (`runs` of record numbers, in its order: parse,
        tokenize, read image headers), split over the processes `share` names, each a
        contiguous run of its positions (and each process's run split again over it and its
        `workers`), and merged in the window's order: every process holds the whole window's
        index. The first error in that order is raised on every process (after the bad samples
        before it are reported); the reports of a pass that ends are reported here (`log`:
        whether this process may log them; a later epoch's pass reports nothing: its records
        were reported in epoch 0)."""
        n = sum(len(run) for run in runs)
        part = self.share.part(n) if self.share is not None else range(n)
        # this process's run, split over it and up to `workers` forked ones (data/forked.py)
        k = max(min(self.workers + 1, len(part) // PASS_RECORDS), 1)
        subs = [part[len(part) * j // k : len(part) * (j + 1) // k] for j in range(k)]
        log = log and self.log_startup

        def index_run(j: int) -> tuple[IndexPart, Exception | None]:
            mine, failure = IndexPart(), None
            with OpenFiles(self.files, self.names) as files:  # each opened once a pass
                for run in positions(runs, subs[j]):
                    if mine.error is None and failure is None:
                        failure = self._index_records(files, run, log, mine)
            return mine, failure

        what = f"data.dataset: {self.name}: the pass over a window"
        with Forked(lambda j: index_run(j)[0], k, what) as workers:
            mine, failure = index_run(0)  # its own exception, raised below as it came
            stopped = mine.error is not None or mine.failure is not None
            try:
                for j, later in enumerate(() if stopped else workers.results(), start=1):
                    if later.failure is not None:
                        later.failure = f"worker {j}: {later.failure}"
                    mine.then(later)
                    if mine.error is not None or mine.failure is not None:
                        break  # the rest are not needed: killed on leaving the block
            except Exception as e:  # noqa: BLE001 - every process must learn of it (no hang)
                line = str(e) if isinstance(e, LoaderWorkerDied) else f"{what}: {e}"
                mine.failure, failure = line.splitlines()[0], e
        parts = self.share.gather(mine) if self.share is not None else [mine]
        index = IndexPart()
        for rank, got in enumerate(parts):  # the window's order, as one process would have gone
            if got.error is not None or got.failure is not None:
                for where, reason, _, action in index.reports + got.reports:  # then the error
                    self.bad.report(where, reason, log, action)
            if got.error is not None:  # the first error in the window stops every process
                raise got.error
            if got.failure is not None:
                if rank == (self.share.rank if self.share is not None else 0) and failure:
                    raise failure  # this process's own: raised as it came
                raise RuntimeError(
                    f"data.dataset: {self.name}: the pass over a window failed on rank {rank} "
                    f"of {len(parts)}: {got.failure}"
                )
            index.then(got)
        for where, reason, _, action in index.reports:  # logged where this process logs
            self.bad.report(where, reason, log, action)
        self._video_files.update(index.videos)
        return index

    def _index_records(
        self, files: OpenFiles, run: range, log: bool, out: IndexPart
    ) -> Exception | None:
        """The pass over records `run` (consecutive record numbers, of one file or several,
        opened into `files`)."""
        for k in range(len(self.files)):
            lo = max(run.start, self.firsts[k]) - self.firsts[k]
            hi = min(run.stop, self.firsts[k + 1]) - self.firsts[k]
            if lo < hi:
                try:
                    source = files.file(k)
                    failure = self._index_part(k, source, lo, self.spans[k][lo:hi], log, out)
                except UserError as e:  # a file that cannot be read as one now: every rank's
                    out.error = e
                except Exception as e:  # noqa: BLE001 - every process must learn of it
                    out.failure, failure = f"{type(e).__name__}: {e}".splitlines()[0], e
                if failure is not None or out.error is not None:
                    return failure
        return None

    def _index_part(
        self, k: int, source: RecordFile, lo: int, spans: Spans, log: bool, out: IndexPart
    ) -> Exception | None:
        """The pass over `spans` (file k's records lo, lo + 1, ..., read from `source`) into
        `out`: each record parsed, its parts sized and its slots counted (truncated to seq_len);
        its bad samples' reports kept for the caller to report in order (`log`: whether this
        process would log them), a UserError (data.on_bad_sample = "error") kept in `out`, not
        raised, so that every process of a shared pass raises it; any other exception is
        returned (raised again here, its one line sent to the others in `out`)."""
        failure, root = None, self.roots[k]
        known = set(self._video_files)  # sent only the video headers this part reads
        with self.bad.recorded() as reports:
            try:
                for j, (span, record) in enumerate(source.records(spans)):
                    try:
                        if isinstance(record, BadSample):
                            raise record
                        parts = parse_record(
                            record,
                            self.tokenizer,
                            root,
                            check_files=True,
                            processor=self.processor,
                            max_frames=self.max_frames,
                            sized=self._sized,
                        )
                    except BadSample as bad:
                        self.bad.report(source.where(span), str(bad), log)
                        out.skipped[bad.kind] += 1
                        continue
                    sample = Sample(parts)
                    size = self._num_slots(sample)
                    if size > self.seq_len:
                        self.bad.report(
                            source.where(span),
                            f"sample of {size} slots is longer than training.seq_len="
                            f"{self.seq_len}",
                            log,
                            action="truncated",
                        )
                        out.truncated += 1
                        sample = self._truncated(sample)
                        size = self._num_slots(sample)
                    out.records.append(self.firsts[k] + lo + j)
                    out.files.append(k)
                    out.lines.append(span.line)
                    out.starts.append(span.start)
                    out.ends.append(span.end)
                    out.sizes.append(size)
                    # a record holds at most one video, in one part or one per frame group
                    video_parts = sum(isinstance(p, VideoRef) for p in sample.parts)
                    out.num_images += sample.num_images() - video_parts
                    out.num_videos += video_parts > 0
            except UserError as e:
                out.error = e
            except Exception as e:  # noqa: BLE001 - every process must learn of it (no hang)
                out.failure, failure = f"{type(e).__name__}: {e}".splitlines()[0], e
        out.reports.extend(reports)
        out.videos.update((p, v) for p, v in self._video_files.items() if p not in known)
        return failure

    def _sized(self, parts: list[Part]) -> list[Part]:
        """`parts` with each ImageRef's size (the one it enters the encoder at: the rule's `fit`
        of its header's size; a VideoRef's frame_size, all its frames' headers read) under a
        rule that sizes images (native resolution, a family's own), else as they are.
        BadSample if a header cannot be read or says the image is larger than
        data.max_image_pixels, a video's frames differ in size, or the rule refuses the size."""
        if self.rule is None:
            return parts
        out: list[Part] = []
        for part in parts:
            if isinstance(part, VideoRef) and part.is_file:
                part = self._video_file(part)
            elif isinstance(part, VideoRef):
                assert self.processor is not None  # records.py: a video part needs one
                try:  # the folder's frame sampling, as transformers samples frames it is given
                    part = kept_frame_files(self.processor, part.frames)
                except ValueError as e:
                    raise BadSample("video frames", f"{part.path}: {e}") from None
                sizes = {self._header(path) for path in part.frames}
                if len(sizes) > 1:
                    raise BadSample(
                        "video frames of different sizes",
                        f"a video's frames must share one size: {part.path} and others differ "
                        f"({', '.join(f'{w}x{h}' for h, w in sorted(sizes))})",
                    )
                (size,) = sizes
                part = replace(part, frame_size=self._fit(part.path, size, len(part.frames)))
            elif isinstance(part, ImageRef):
                part = ImageRef(part.path, self._fit(part.path, self._header(part.path), 0))
            out.append(part)
        return out

    def _video_file(self, ref: VideoRef) -> VideoRef:
        """A video file's VideoRef with what its header says (hf_processor.video_file_frames:
        the kept frames, their rate, the frames' size and the size they enter the encoder at),
        or BadSample saying why not. Without PyAV, the ConfigError saying how to install it stops
        the run (the job's problem, not the record's: skipping would drop every video)."""
        assert self.processor is not None  # records.py: a video file needs one
        if ref.path in self._video_files:
            return self._video_files[ref.path]
        try:
            kept, size = video_file_frames(self.processor, ref.path, self.max_image_pixels)
        except ConfigError:  # a ValueError too, but no bad sample
            raise
        except VideoError as e:
            raise BadSample("video cannot be decoded", f"video cannot be decoded: {e}") from None
        except ImageTooLarge as e:
            raise BadSample("image too large", f"image too large: {ref.path} ({e})") from None
        except ValueError as e:
            raise BadSample("video frames", f"{ref.path}: {e}") from None
        sized = replace(kept, frame_size=self._fit(ref.path, size, kept.num_frames))
        self._video_files[ref.path] = sized
        return sized

    def _header(self, path: Path | ImageBytes) -> tuple[int, int]:
        """(height, width) from an image file's header, or BadSample saying why not."""
        try:
            with open_image(path, self.max_image_pixels) as img:
                width, height = img.size
            return height, width
        except ImageTooLarge as e:
            raise BadSample("image too large", f"image too large: {path} ({e})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:  # what Pillow raises
            raise BadSample(
                "image cannot be decoded",
                f"image cannot be decoded: {path} ({type(e).__name__}: {e})",
            ) from None

    def _fit(self, path: Path | ImageBytes, size: tuple[int, int], frames: int) -> tuple[int, int]:
        """The rule's fit of a header's size (`frames` > 0: a video's frames, that many), or
        BadSample where the rule refuses it."""
        assert self.rule is not None
        try:
            return self.rule.fit(*size, frames=frames)
        except ValueError as e:
            raise BadSample("image size", f"image size not usable: {path} ({e})") from None

    def _part_slots(self, part: Part) -> int:
        """Slots of one part: a VideoRef's from its frames' size and count (module docstring),
        the rest as data/batch.py counts them."""
        if isinstance(part, VideoRef):
            if part.frame_size is None or isinstance(self.slots, int):
                raise ValueError(f"{part.path}: a video part whose size was not read")
            return self.slots.size_slots(*part.frame_size, part.num_frames)
        return part_slots(part, self.slots)

    def _num_slots(self, sample: Sample) -> int:
        return sum(self._part_slots(p) for p in sample.parts)

    def _truncated(self, sample: Sample) -> Sample:
        """The first seq_len slots, as Sample.truncated cuts them (text cut; an image or video
        that no longer fits dropped with everything after it), VideoRefs counted as
        `_part_slots` counts them."""
        parts: list[Part] = []
        left = self.seq_len
        for p in sample.parts:
            size = self._part_slots(p)
            if size <= left:
                parts.append(p)
                left -= size
            else:
                if isinstance(p, list) and left > 0:
                    parts.append(type(p)(p[:left]))  # a cut Prompt stays a Prompt
                break
        return Sample(parts)

    def _counts(self, window: Window, bad: bool = True) -> str:
        """What a window holds, for the log; `bad`: with the samples it left out or cut (epoch
        0's: a later epoch finds the same ones again)."""
        index = window.index
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(index.skipped.items()))
        videos = f" and {index.num_videos} video(s)" if index.num_videos else ""
        held = (
            f"{len(index.records)} samples with {index.num_images} image(s){videos} in "
            f"{len(window.rows)} rows"
        )
        if not bad:
            return held
        return (
            f"{held}, skipped {window.bad}{f' ({kinds})' if kinds else ''}, "
            f"truncated {index.truncated}"
        )

    def describe(self) -> str:
        native = (
            f", images at native resolution up to {self.native.max_pixels} pixels"
            if self.native is not None
            else f", images at their own sizes ({type(self.rule).__name__})"
            if self.rule is not None
            else ""
        )
        order = self.order
        how = (
            "in file order"
            if not self.shuffle
            else "rows shuffled every epoch"
            if order.blocks == 1
            else f"blocks of {BLOCK} records reordered and rows shuffled every epoch"
        )
        if order.windows > 1:
            how += f", indexed {order.window_records} at a time as training reaches them"
        first = self.windows[0]
        which = (
            "all of them"
            if order.windows == 1
            else f"window {first.number + 1} of {order.windows} of epoch {first.epoch}"
        )
        return (
            f"{self.name}{'' if self.single else f' ({_files(len(self.files))})'}: "
            f"{self.records} record(s) ({how}), rows of {self.seq_len} slots "
            f"({'packed' if self.packing else 'one sample per row'}{native}); "
            f"{which}: {self._counts(first)}"
        )

    def plan(self, rows: Iterable[int]) -> Plan:
        """Global rows `rows`' samples (their windows indexed: `ensure`)."""
        out: Plan = []
        for r in rows:
            window = self._window_of(r)
            out.append(window.rows[r - window.first])
        return out

    def _window_of(self, row: int) -> Window:
        """The indexed window that holds global row `row` (IndexError: none does)."""
        window = next((w for w in self.windows if w.first <= row < w.stop), None)
        if window is None:
            held = f"{self.windows[0].first}..{self.windows[-1].stop - 1}"
            raise IndexError(f"{self.name}: row {row} is not indexed (rows {held} are)")
        return window

    def position(self, row: int) -> Position:
        """Where global row `row` lies (its window indexed: `ensure`), for a run resumed there
        to index from: JsonlDataset(position=...) then numbers rows and counts bad samples as
        this run does."""
        window = self._window_of(row)
        before = [c for n, c in self._counted.items() if (0, n) < (window.epoch, window.number)]
        return Position(
            window.epoch,
            window.number,
            window.first,
            self._before.bad + sum(c[1] for c in before),
            self._before.truncated + sum(c[2] for c in before),
        )

    def positions(self, row: int) -> list[Position]:
        return [self.position(row)]

    def bad_samples(self, rows: int) -> int:
        return self._before.bad + sum(c[1] for c in self._counted.values() if c[0] < rows)

    def truncated_samples(self, rows: int) -> int:
        return self._before.truncated + sum(c[2] for c in self._counted.values() if c[0] < rows)

    def sample(self, ref: SampleRef) -> Sample:
        """A kept sample with its images as ImageRef (read back from the file; under native
        resolution, or a family's rule, sized from their headers; a video read whole as one
        VideoRef, whose slots `rule.size_slots(*frame_size, len(frames))` counts)."""
        with OpenFiles(self.files, self.names) as files:
            sample = self._read(files, ref)
            if sample is None:
                where = self._where(files, ref)
                raise ConfigError(f"data.dataset: {where}: an image header cannot be read")
        return sample

    def _where(self, files: OpenFiles, ref: SampleRef) -> str:
        """A kept sample's file and record (its line, row or key), as warnings name them."""
        return files.file(ref.file).where(Span(ref.line, ref.start, ref.end))

    def _read(self, files: OpenFiles, ref: SampleRef) -> Sample | None:
        """A kept sample as read back from its file (opened into `files` once, for the rest of
        its batch), truncated as its pass did; None (reported, the sample counted as dropped)
        if, under native resolution, an image header can no longer be read."""
        unusable: list[BadSample] = []  # a header that can no longer be read, not a new record

        def sized(parts: list[Part]) -> list[Part]:
            try:
                return self._sized(parts)
            except BadSample as bad:
                unusable.append(bad)
                raise

        try:
            parts = parse_record(
                files.file(ref.file).record(Span(ref.line, ref.start, ref.end)),
                self.tokenizer,
                self.roots[ref.file],
                check_files=False,
                processor=self.processor,
                max_frames=self.max_frames,
                sized=sized,
            )
        except BadSample as bad:
            if unusable:
                self.bad.report(self._where(files, ref), str(bad), self.log_batches)
                self.dropped.add(ref.record)
                return None
            raise ConfigError(
                f"data.dataset: {self._where(files, ref)} changed since it was indexed (batches "
                "read their records back from the file)"
            ) from None
        return self._truncated(Sample(parts))

    def _decoded(self, files: OpenFiles, ref: SampleRef, sample: Sample | None) -> Sample | None:
        """The sample with its images decoded, or None (reported) if one cannot be used."""
        if sample is None:
            return None
        whole = self._whole_files(files, ref, sample)
        if whole is None:
            return None
        parts: list[Part] = []
        for part in sample.parts:
            if isinstance(part, VideoRef) and part.path in whole:  # a frame group of a file
                video, place = whole[part.path]
                at = [place[j] for j in part.indices]
                part = VideoFrames(video.frames[at], video.fps, tuple(video.times[j] for j in at))
            elif isinstance(part, ImageRef):
                image = self._image(files, ref, part)
                if image is None:
                    return None
                part = image
            parts.append(part)
        return Sample(parts)

    def _whole_files(
        self, files: OpenFiles, ref: SampleRef, sample: Sample
    ) -> dict[Path, tuple[VideoFrames, dict[int, int]]] | None:
        """Each video file the sample holds in several parts (its frame groups: a processor that
        splits videos) decoded once, all their frames, with each decoded index's place among
        them; None (reported) if one cannot be used."""
        refs: dict[Path, list[VideoRef]] = {}
        for part in sample.parts:
            if isinstance(part, VideoRef) and part.is_file:
                refs.setdefault(part.path, []).append(part)
        whole: dict[Path, tuple[VideoFrames, dict[int, int]]] = {}
        for path, groups in refs.items():
            if len(groups) < 2:
                continue
            kept = sorted({j for g in groups for j in g.indices})
            video = self._image(files, ref, replace(groups[0], indices=tuple(kept)))
            if video is None:
                return None
            assert isinstance(video, VideoFrames)
            whole[path] = (video, {j: n for n, j in enumerate(kept)})
        return whole

    def _image(
        self, files: OpenFiles, sample: SampleRef, ref: ImageRef
    ) -> torch.Tensor | VideoFrames | None:
        """Sample i's image `ref` decoded, or None (reported, and the sample counted as dropped)
        if it cannot be decoded or is too large."""
        try:
            if isinstance(ref, VideoRef) and self.processor is not None:
                return self.processor.preprocess_video_ref(ref, self.max_image_pixels)
            if self.processor is not None:
                return self.processor.preprocess_image(ref.path, self.max_image_pixels, ref.size)
            if self.native is not None:
                return load_native_image(ref.path, self.native, self.max_image_pixels)
            return load_image(ref.path, self.image_size, self.max_image_pixels)
        except ImageTooLarge as e:
            reason = f"image too large: {ref.path} ({e})"
        except VideoError as e:  # a file that changed since its header was read
            reason = f"video cannot be decoded: {e}"
        except (OSError, SyntaxError, ValueError, EOFError) as e:  # what Pillow raises
            reason = f"image cannot be decoded: {ref.path} ({type(e).__name__}: {e})"
        self.bad.report(self._where(files, sample), reason, self.log_batches)
        self.dropped.add(sample.record)
        return None

    def read(self, plan: Plan) -> list[list[Sample]]:
        return keep_one_slot(self.rows_of(plan), self.tokenizer)

    def rows_of(self, plan: Plan) -> list[list[Sample]]:
        """The rows of `plan` (`plan(rows)`), their images decoded; a sample whose image cannot
        be used is left out of its row (which may be left empty)."""
        out: list[list[Sample]] = []
        with OpenFiles(self.files, self.names) as files:  # each file a batch reads, opened once
            for row in plan:
                decoded = (self._decoded(files, ref, self._read(files, ref)) for ref in row)
                out.append([s for s in decoded if s is not None])
        return out
