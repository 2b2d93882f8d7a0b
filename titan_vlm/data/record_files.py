"""The files a dataset's records come from: one reader per format, chosen by the file's ending
(`READERS`), so that the window passes, the index, the loader and the bad-sample policy
(data/jsonl.py) are the same for every format.

    ending     format                                a record is        warnings name it
    .jsonl     JSON lines                            a non-blank line   train.jsonl:12
    .json      one JSON array                        an element         train.json:12 (its line)
    .parquet   Parquet (pyarrow)                     a row              part-0.parquet row 11
    .arrow     Arrow IPC, file or stream: the data   a row              data-0.arrow row 11
               files of a Hugging Face datasets
               folder (save_to_disk)
    .tar       WebDataset: members grouped by key    a key's members    shard-0.tar sample 00012
               (00012.json, 00012.jpg, 00012.txt)                          (#12)

A reader lists every record as a `Span(line, start, end)`: `line` is the record's number in its
file (a JSON file's 1-based line, a table's 0-based row, a tar's 0-based sample, which warnings
name beside its key), `[start, end)`
where the record lies (bytes of a JSON file or a tar, rows of a table). `record(span)` reads one
back as the dict data/records.py parses (BadSample where it cannot be: malformed JSON, a tar
sample without text). Records hold the same keys in every format.

Tables (Parquet, Arrow): every column is a key and a null cell a missing one (a text-only row
of a table with an "image" column is a row whose image is null). An "image" / "images" cell is
an image's bytes (`ImageBytes`, decoded as a file would be), a path (as in a JSON record), or
Hugging Face's Image struct {"bytes", "path"}: its bytes where they are set, else its path.

WebDataset samples (consecutive members whose names share the part before the basename's first
dot, webdataset's rule; members without a dot, and folders, belong to none): the record is the
`.json` member, with the `.txt` member as its "text" where it has neither "text" nor
"conversations" (image-caption shards: 00012.jpg + 00012.txt). Image members (`IMAGE_ENDINGS`)
are the record's images where the record names none (one; or several numbered "0.png", "1.png",
..., in their numbers' order); where it names some, each name that is a member's ending ("jpg",
"0.jpg") or name ("00012.jpg", with or without its folder; case aside) is that member, any other
a file beside the shard (as in a JSON record), and an image member no name takes is a bad
sample, as are a link member and a video member (videos are files named in "video"). A tar must
be uncompressed and whole (its end-of-archive blocks there): records are read back by offset.

Invariants: spans are in file order and `record` is a pure function of the file and the span
(reading it again gives the same record); a file that cannot be read as its format is a
ConfigError naming it (one line): a broken array or tar cannot be resynchronised.
"""

from __future__ import annotations

import bisect
import io
import mmap
import os
import re
import tarfile
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from titan_vlm.data.batch import ImageBytes
from titan_vlm.data.json_spans import Span, Spans, record_spans
from titan_vlm.data.records import BadSample, Json, decode_record
from titan_vlm.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

IMAGE_ENDINGS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_ENDINGS = ("mp4", "webm", "mkv", "avi", "mov")
BLOCK = tarfile.BLOCKSIZE  # a tar's member data is padded to a whole block
NO_PYARROW = "Parquet and Arrow files need pyarrow: pip install 'titan_vlm[data]'"


class RecordFile(ABC):
    """One dataset file of records (module docstring), open until `close`. `name`: the file as
    warnings name it."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    @abstractmethod
    def spans(self) -> Spans:
        """Every record's span, in file order."""

    @abstractmethod
    def record(self, span: Span) -> Json:
        """The record at `span` (one of `spans()`), or BadSample saying why it cannot be one."""

    def where(self, span: Span) -> str:
        """The record as warnings name it."""
        return f"{self.name} row {span.line}"

    def records(self, spans: Spans) -> Iterator[tuple[Span, Json | BadSample]]:
        """`record` of each of `spans` (in file order), a BadSample in its place where one
        cannot be a record: a window pass's reading."""
        for span in spans:
            try:
                yield span, self.record(span)
            except BadSample as bad:
                yield span, bad

    @abstractmethod
    def close(self) -> None:
        """Let go of the file."""

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cannot(self, why: object) -> ConfigError:
        return ConfigError(f"data.dataset: cannot read {self.name}: {why}")


class JsonRecords(RecordFile):
    """A .jsonl / .json file, memory-mapped (its pages are the page cache's, shared by the ranks
    of a node; data/json_spans.py says where its records lie)."""

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        try:
            self.file = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise self._cannot(e.strerror) from None
        try:
            size = os.fstat(self.file.fileno()).st_size
            self.raw: mmap.mmap | bytes = (
                mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            )
        except OSError as e:
            self.file.close()
            raise self._cannot(e.strerror) from None

    def spans(self) -> Spans:
        return record_spans(self.raw, self.path, self.name)

    def record(self, span: Span) -> Json:
        return decode_record(self.raw[span.start : span.end])

    def where(self, span: Span) -> str:
        return f"{self.name}:{span.line}"

    def close(self) -> None:
        if isinstance(self.raw, mmap.mmap):
            self.raw.close()
        self.file.close()


def require_pyarrow() -> Any:
    """pyarrow (with its Parquet reader), or ConfigError saying how to install it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - a build without it cannot read Parquet
    except ImportError as e:
        raise ConfigError(f"{NO_PYARROW} ({e})") from None
    return pyarrow


def row_spans(n: int) -> Spans:
    """Rows 0 .. n - 1 of a table, each its own span."""
    spans = Spans()
    spans.lines = array("q", range(n))
    spans.starts = array("q", range(n))
    spans.ends = array("q", range(1, n + 1))
    return spans


class TableRecords(RecordFile):
    """A table's rows in pieces (a Parquet file's row groups, an Arrow file's record batches),
    the last piece read kept: a packed row's consecutive records cost one piece. A record read
    alone (a batch's) converts its row; a window's pass (`records`) a piece at a time."""

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        self.pa = require_pyarrow()
        self.firsts: list[int] = []  # each piece's first row; then the number of rows
        self.cached: tuple[int, pa.Table | pa.RecordBatch] | None = None

    @abstractmethod
    def piece(self, k: int) -> pa.Table | pa.RecordBatch:
        """Piece k of the table."""

    def spans(self) -> Spans:
        return row_spans(self.firsts[-1])

    def _piece_of(self, row: int) -> tuple[int, pa.Table | pa.RecordBatch]:
        """The piece that holds `row`, and its first row."""
        k = bisect.bisect_right(self.firsts, row) - 1
        if self.cached is None or self.cached[0] != k:
            try:
                self.cached = (k, self.piece(k))
            except (OSError, self.pa.ArrowException) as e:
                raise self._cannot(e) from None
        return self.firsts[k], self.cached[1]

    def _rows(self, piece: pa.Table | pa.RecordBatch) -> list[dict[str, Any] | BadSample]:
        """The piece's rows as Python values; a row whose strings are not UTF-8 a BadSample."""
        try:
            return cast(list[dict[str, Any] | BadSample], piece.to_pylist())
        except UnicodeDecodeError:  # the rows one at a time, to find which
            return [self._row(piece, i) for i in range(piece.num_rows)]

    def _row(self, piece: pa.Table | pa.RecordBatch, i: int) -> dict[str, Any] | BadSample:
        try:
            return cast(dict[str, Any], piece.slice(i, 1).to_pylist()[0])
        except UnicodeDecodeError as e:
            return BadSample("undecodable text", f"a string cell is not UTF-8 ({e.reason})")

    def record(self, span: Span) -> Json:
        first, piece = self._piece_of(span.start)
        row = self._row(piece, span.start - first)
        if isinstance(row, BadSample):
            raise row
        return table_record(row, self.where(span))

    def records(self, spans: Spans) -> Iterator[tuple[Span, Json | BadSample]]:
        rows: list[dict[str, Any] | BadSample] = []
        first = -1
        for span in spans:
            if not first <= span.start < first + len(rows):
                first, piece = self._piece_of(span.start)
                rows = self._rows(piece)
            row = rows[span.start - first]
            yield span, row if isinstance(row, BadSample) else table_record(row, self.where(span))


class ParquetRecords(TableRecords):
    """A Parquet file, read a row group at a time."""

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except (OSError, self.pa.ArrowException) as e:
            raise self._cannot(e) from None
        meta = self.file.metadata
        self.firsts = [0]
        for g in range(meta.num_row_groups):
            self.firsts.append(self.firsts[-1] + meta.row_group(g).num_rows)

    def piece(self, k: int) -> pa.Table:
        return self.file.read_row_group(k)

    def close(self) -> None:
        self.file.close()


class ArrowRecords(TableRecords):
    """An Arrow IPC file (file or stream format: Hugging Face datasets writes streams),
    memory-mapped: its record batches are views of the mapping, nothing is copied until a row
    is read."""

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        pa = self.pa
        try:
            self.source = pa.memory_map(str(path))
            is_file = self.source.read(6) == b"ARROW1"  # the file format's magic; a stream lacks it
            self.source.seek(0)
            reader = pa.ipc.open_file(self.source) if is_file else pa.ipc.open_stream(self.source)
            if is_file:
                self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            else:
                self.batches = list(reader)
        except (OSError, pa.ArrowException) as e:
            raise self._cannot(f"not an Arrow IPC file ({e})") from None
        self.firsts = [0]
        for batch in self.batches:
            self.firsts.append(self.firsts[-1] + batch.num_rows)

    def piece(self, k: int) -> pa.RecordBatch:
        return self.batches[k]

    def close(self) -> None:
        self.batches = []
        self.source.close()


def table_record(row: dict[str, Any], where: str) -> Json:
    """A table's row as a record: null cells left out, image cells as ImageBytes or paths."""
    record = {key: value for key, value in row.items() if value is not None}
    for key in ("image", "images"):
        value = record.get(key)
        if isinstance(value, list):
            record[key] = [_image_cell(v, f"{where} {key}[{j}]") for j, v in enumerate(value)]
        elif value is not None:
            record[key] = _image_cell(value, f"{where} {key}")
    return record


def _image_cell(value: Any, name: str) -> Any:
    """An image cell: bytes, or Hugging Face's {"bytes", "path"} (bytes first), as ImageBytes;
    anything else as it is (a path, or what data/records.py refuses)."""
    if isinstance(value, dict) and set(value) == {"bytes", "path"}:
        value = value["bytes"] if value["bytes"] is not None else value["path"]
    if isinstance(value, (bytes, bytearray)):
        return ImageBytes(bytes(value), name)
    return value


# webdataset's split of a member name into the sample's key and the member's ending: the key is
# the name up to the first dot of its last part ("dir.v2/00012.1.png": "dir.v2/00012", "1.png")
_KEY_ENDING = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_NUMBERED = re.compile(r"^(\d+)\.[^.]+$")  # an ending "12.png": the 12th image of several


class TarRecords(RecordFile):
    """A WebDataset tar shard (module docstring): a sample's span is the bytes from its first
    member's header to its last member's end (padding included)."""

    def __init__(self, path: Path, name: str):
        super().__init__(path, name)
        self.last: tuple[int, str] | None = None  # the last record read: its start, its key
        try:
            self.file = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise self._cannot(e.strerror) from None

    def close(self) -> None:
        self.file.close()

    def spans(self) -> Spans:
        spans, key, size = Spans(), None, os.fstat(self.file.fileno()).st_size
        self.file.seek(0)
        try:
            tar = tarfile.open(fileobj=self.file, mode="r:")  # noqa: SIM115 - the file is ours
            while (member := tar.next()) is not None:
                # tarfile keeps every member it has read (not typed): not a corpus's worth
                cast(Any, tar).members.clear()
                match = _KEY_ENDING.match(member.name)
                if member.isdir() or match is None:  # not in a sample (links are: record())
                    continue
                end = member.offset_data + -(-member.size // BLOCK) * BLOCK  # with its padding
                if match.group(1) == key:
                    spans.ends[-1] = end
                else:
                    key = match.group(1)
                    spans.append(Span(len(spans), member.offset, end))
            tail = tar.offset
        except (tarfile.TarError, OSError) as e:
            raise self._cannot(f"not an uncompressed tar file ({e})") from None
        self._check_end(tail, size)
        return spans

    def _check_end(self, tail: int, size: int) -> None:
        """After the last member (at `tail`) a tar has its end: zero blocks to the file's end.
        A file cut at a member's end has none; one with other bytes there is not all tar."""
        if tail + BLOCK > size:
            raise self._cannot(
                f"no end-of-archive block after byte {tail} (a truncated shard: a copy or a "
                "write that did not finish)"
            )
        self.file.seek(tail)
        while chunk := self.file.read(1 << 20):
            if chunk.strip(b"\0"):
                raise self._cannot(
                    f"not a tar file after byte {tail} (a truncated or corrupt shard)"
                )

    def members(self, span: Span) -> list[tuple[str, bytes | None]]:
        """The (name, bytes) of the sample's members, in order; a link's bytes None."""
        self.file.seek(span.start)
        blob = io.BytesIO(self.file.read(span.end - span.start))
        out: list[tuple[str, bytes | None]] = []
        try:
            with tarfile.open(fileobj=blob, mode="r:") as tar:
                for member in tar:
                    if member.isdir() or not _KEY_ENDING.match(member.name):
                        continue
                    data = tar.extractfile(member) if member.isfile() else None
                    out.append((member.name, data.read() if data is not None else None))
        except (tarfile.TarError, OSError) as e:
            raise self._cannot(f"changed since it was scanned ({e})") from None
        return out

    def where(self, span: Span) -> str:
        if self.last is None or self.last[0] != span.start:  # not the record just read
            self.file.seek(span.start)
            blob = io.BytesIO(self.file.read(min(span.end - span.start, 1 << 16)))
            try:  # the first member's header (pax headers included) is enough
                first = tarfile.open(fileobj=blob, mode="r:").next()
            except (tarfile.TarError, OSError):
                first = None
            match = _KEY_ENDING.match(first.name) if first is not None else None
            self.last = (span.start, match.group(1) if match else "?")
        # a key may come back later in a shard (another sample, as webdataset reads it): the
        # sample's number tells them apart
        return f"{self.name} sample {self.last[1]} (#{span.line})"

    def record(self, span: Span) -> Json:
        members = self.members(span)
        keys = {_ending(name)[0] for name, _ in members}
        if len(keys) != 1:
            raise self._cannot(f"changed since it was scanned (no sample at byte {span.start})")
        (key,) = keys
        self.last = (span.start, key)
        by_ending: dict[str, tuple[str, bytes]] = {}
        for name, data in members:
            if data is None:
                raise BadSample(
                    "bad record",
                    f"{name} is a link: a sample's members must be files (tar --hard-dereference)",
                )
            ending = _ending(name)[1]
            if ending in by_ending:
                raise BadSample("bad record", f"two members named {name}")
            by_ending[ending] = (name, data)
        record: dict[str, Json] = {}
        if "json" in by_ending:
            value = decode_record(by_ending["json"][1])
            if not isinstance(value, dict):
                raise BadSample(
                    "bad record", f"{key}.json: expected a JSON object, got {type(value).__name__}"
                )
            record = value
        if "txt" in by_ending and "text" not in record and "conversations" not in record:
            try:
                record["text"] = by_ending["txt"][1].decode("utf-8")
            except UnicodeDecodeError:
                raise BadSample("undecodable text", f"{key}.txt is not UTF-8") from None
        if "json" not in by_ending and "txt" not in by_ending:
            raise BadSample("bad record", f"sample {key} has no .json or .txt member")
        images = {e: m for e, m in by_ending.items() if e.rsplit(".", 1)[-1] in IMAGE_ENDINGS}
        videos = [m[0] for e, m in by_ending.items() if e.rsplit(".", 1)[-1] in VIDEO_ENDINGS]
        if videos:
            raise BadSample(
                "bad record",
                f"a video member ({videos[0]}): videos are files named in the record's 'video'",
            )
        if "image" not in record and "images" not in record:
            _unnamed_images(record, images, key, self.name)
            return record
        _named_images(record, images, key, self.name)
        return record


def _unnamed_images(
    record: dict[str, Json], images: dict[str, tuple[str, bytes]], key: str, shard: str
) -> None:
    """A record that names no image takes its sample's image members: one as "image"; several,
    numbered ("0.png", "1.png", ..., "10.png"), as "images" in their numbers' order."""
    found = {e: ImageBytes(data, f"{shard}/{name}") for e, (name, data) in images.items()}
    if len(found) == 1:
        (record["image"],) = found.values()
    elif found:
        numbers = {e: _NUMBERED.match(e) for e in found}
        if not all(numbers.values()):
            raise BadSample(
                "bad record",
                f"sample {key} has several image members ({', '.join(sorted(found))}) that are "
                "not numbered (0.jpg, 1.jpg, ...): name them in the record's 'images'",
            )
        order = sorted(found, key=lambda e: int(numbers[e].group(1)))  # type: ignore[union-attr]
        record["images"] = [found[e] for e in order]


def _named_images(
    record: dict[str, Json], images: dict[str, tuple[str, bytes]], key: str, shard: str
) -> None:
    """The record's image names that are its sample's members as their bytes: a member is named
    by its ending ("jpg", "1.png") or its name, with or without its folder (case aside); any
    other name stays a path; an image member no name takes is a bad sample."""
    aliases: dict[str, str] = {}  # a name, lowercased -> the member's ending
    for ending, (name, _) in images.items():
        for alias in (ending, name, name.rsplit("/", 1)[-1], name.removeprefix("./")):
            aliases[alias.lower()] = ending
    key_name = "image" if "image" in record else "images"
    named = record[key_name]
    listed = named if isinstance(named, list) else [named]
    taken: set[str] = set()
    out: list[Json] = []
    for value in listed:
        member = aliases.get(value.lower()) if isinstance(value, str) else None
        if member is None:
            out.append(value)  # a path beside the shard (or what data/records.py refuses)
            continue
        name, data = images[member]
        taken.add(member)
        out.append(ImageBytes(data, f"{shard}/{name}"))
    left = [images[e][0] for e in images if e not in taken]
    if left:
        raise BadSample("bad record", f"image member {left[0]} is not one of the record's images")
    record[key_name] = out if isinstance(named, list) else out[0]


def _ending(name: str) -> tuple[str, str]:
    """A member's (key, ending), the ending lowercased."""
    match = _KEY_ENDING.match(name)
    assert match is not None  # members() keeps only names that match
    return match.group(1), match.group(2).lower()


# Each format's reader, by the file's ending: the one registry of dataset file formats.
READERS: dict[str, type[RecordFile]] = {
    ".jsonl": JsonRecords,
    ".json": JsonRecords,
    ".parquet": ParquetRecords,
    ".arrow": ArrowRecords,
    ".tar": TarRecords,
}
FORMATS = tuple(READERS)


def open_records(path: Path, name: str) -> RecordFile:
    """The reader of dataset file `path` (`name`: as the user wrote it, for messages)."""
    if path.suffix not in READERS:
        raise ConfigError(f"data.dataset: {name}: expected one of {', '.join(FORMATS)}")
    return READERS[path.suffix](path, name)
