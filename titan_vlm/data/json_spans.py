"""Where the records of a dataset file lie: the byte span and line of each, found once at
start-up so that a batch reads back only its own records (data/jsonl.py).

    .jsonl   {"text": ...}\\n{"image": ...}\\n\\n{...}      one record per non-blank line
    .json    [ {"text": ...}, {"image": ...}, ... ]        the elements of one JSON array

Invariants: `raw[span.start:span.end]` is exactly one record's JSON text (a .jsonl line without
its line break; an array element without the commas and white space around it), spans are in
file order, and `span.line` is the 1-based line the record starts on, which every warning
names. A UTF-8 byte order mark at the start of the file is skipped. A .jsonl line is not parsed
here (a malformed one is a bad sample of its own); a .json file must parse whole, since a broken
array cannot be resynchronised: that is a ConfigError naming the file and line.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, overload

from titan_vlm.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Buffer

BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, skipped at the start of a file


CHUNK = 1 << 26  # a .jsonl file is scanned 64 MiB at a time (more for a longer line)


class Span(NamedTuple):
    """One record: the line it starts on, and its bytes `[start, end)`."""

    line: int
    start: int
    end: int


class Spans(Sequence[Span]):
    """Spans in file order, held as three int64 arrays (24 bytes a record, not a tuple each)."""

    def __init__(self) -> None:
        self.lines, self.starts, self.ends = array("q"), array("q"), array("q")

    def append(self, span: Span) -> None:
        self.lines.append(span.line)
        self.starts.append(span.start)
        self.ends.append(span.end)

    def __len__(self) -> int:
        return len(self.lines)

    @overload
    def __getitem__(self, i: int) -> Span: ...

    @overload
    def __getitem__(self, i: slice) -> Spans: ...

    def __getitem__(self, i: int | slice) -> Span | Spans:
        if isinstance(i, slice):
            out = Spans()
            out.lines, out.starts, out.ends = self.lines[i], self.starts[i], self.ends[i]
            return out
        return Span(self.lines[i], self.starts[i], self.ends[i])


def record_spans(raw: Buffer, path: Path, name: str) -> Spans:
    """The records of dataset file `path` (its bytes `raw`: bytes, or the file memory-mapped),
    by its ending; `name` is the file as the user wrote it, for the errors."""
    if path.suffix == ".json":
        return json_array_spans(bytes(raw), name)
    if path.suffix == ".jsonl":
        return jsonl_spans(raw)
    raise ConfigError(f"data.dataset: {name}: expected 'synthetic' or a .json / .jsonl file")


def jsonl_spans(raw: Buffer) -> Spans:
    """Every non-blank line, without its line break (lines as bytes.splitlines cuts them: at
    "\n", "\r\n" or "\r"). The file is read a chunk at a time, each chunk cut after its last
    "\n" (so that no "\r\n" is split), so the whole file is never copied at once."""
    with memoryview(raw) as view:  # released however this ends: the mmap can then close
        return _chunked_spans(view)


def _chunked_spans(view: memoryview) -> Spans:
    spans, at, line = Spans(), 0, 0
    while at < len(view):
        size = CHUNK
        while True:  # a chunk that ends after a "\n", or at the end of the file
            chunk = bytes(view[at : at + size])
            cut = chunk.rfind(b"\n") + 1
            if at + size >= len(view) or cut:
                break
            size *= 2
        if at + len(chunk) < len(view):  # not the file's end: cut after its last "\n"
            chunk = chunk[:cut]
        offset = at
        for text in chunk.splitlines(keepends=True):
            line += 1
            skip = len(BOM) if line == 1 and text.startswith(BOM) else 0
            if text[skip:].strip():
                spans.append(Span(line, offset + skip, offset + len(text.rstrip(b"\r\n"))))
            offset += len(text)
        at += len(chunk)
    return spans


def json_array_spans(raw: bytes, name: str) -> Spans:
    """Every element of a JSON array, which must parse whole."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.dataset: {name}: not UTF-8 ({e})") from None
    decoder = json.JSONDecoder()
    spans = Spans()
    line, byte, char = 1, 0, 0  # the line and byte offset of character `char`

    def advance(to: int) -> None:
        nonlocal line, byte, char
        chunk = text[char:to]
        line += chunk.count("\n")
        byte += len(chunk.encode("utf-8"))
        char = to

    def skip_space(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def fail(i: int, why: str) -> ConfigError:
        advance(min(i, len(text)))
        return ConfigError(
            f"data.dataset: {name}:{line}: {why} (a .json file must be one JSON array of "
            "records; a .jsonl file holds one record per line)"
        )

    if text.startswith("\ufeff"):  # the byte order mark, as a character
        advance(1)
    i = skip_space(char)
    if i >= len(text) or text[i] != "[":
        raise fail(i, "expected '['")
    i = skip_space(i + 1)
    if i < len(text) and text[i] == "]":
        return spans
    while True:
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise fail(e.pos, f"invalid JSON: {e.msg}") from None
        except RecursionError:
            raise fail(i, "invalid JSON: nested too deeply") from None
        advance(i)
        start_line, start_byte = line, byte
        advance(end)
        spans.append(Span(start_line, start_byte, byte))
        i = skip_space(end)
        if i < len(text) and text[i] == ",":
            i = skip_space(i + 1)
        elif i < len(text) and text[i] == "]":
            if skip_space(i + 1) != len(text):
                raise fail(skip_space(i + 1), "text after the array")
            return spans
        else:
            raise fail(i, "expected ',' or ']'")
