"""Where a dataset file's records lie (data/json_spans.py): each span is exactly one record's
bytes and names the line the record starts on, in both formats."""

import json
import re
from pathlib import Path

import pytest

from titan_vlm.data.json_spans import BOM, Span, record_spans
from titan_vlm.errors import ConfigError

RECORDS = [{"text": "a"}, {"text": "ünïcödé, 两个"}, {"text": "c", "image": "x.png"}]


def records_of(raw: bytes, spans: list[Span]) -> list[object]:
    return [json.loads(raw[s.start : s.end]) for s in spans]


def test_jsonl_a_record_per_non_blank_line():
    lines = [json.dumps(r, ensure_ascii=False) for r in RECORDS]
    raw = BOM + f"{lines[0]}\r\n\n   \n{lines[1]}\n{lines[2]}".encode()
    spans = record_spans(raw, Path("d.jsonl"), "d.jsonl")
    assert [s.line for s in spans] == [1, 4, 5]
    assert records_of(raw, spans) == RECORDS


def test_json_array_elements_by_bytes_not_characters():
    text = "[\n" + ",\n\n".join(json.dumps(r, ensure_ascii=False, indent=1) for r in RECORDS) + "]"
    raw = BOM + text.encode()
    spans = record_spans(raw, Path("d.json"), "d.json")
    assert [s.line for s in spans] == [2, 6, 10]
    assert records_of(raw, spans) == RECORDS


@pytest.mark.parametrize(
    "text, line, why",
    [
        ('{"text": "a"}', 1, "expected '['"),
        ('[\n{"text": "a"}\n{"text": "b"}]', 3, "expected ',' or ']'"),
        ('[\n{"text": "a"},\n{"text": }]', 3, "invalid JSON"),
        ('[{"text": "a"}]\n[]', 2, "text after the array"),
    ],
)
def test_a_broken_json_array_is_a_file_error_naming_the_line(text, line, why):
    with pytest.raises(ConfigError, match=rf"^data.dataset: d.json:{line}: {re.escape(why)}"):
        record_spans(text.encode(), Path("d.json"), "d.json")


def test_other_endings_are_refused():
    with pytest.raises(ConfigError, match="expected 'synthetic' or a .json / .jsonl file"):
        record_spans(b"", Path("d.csv"), "d.csv")


def splitlines_spans(raw: bytes) -> list[Span]:
    """The reference: the whole file cut by bytes.splitlines at once."""
    spans, at = [], 0
    for line, text in enumerate(raw.splitlines(keepends=True), 1):
        skip = len(BOM) if line == 1 and text.startswith(BOM) else 0
        if text[skip:].strip():
            spans.append(Span(line, at + skip, at + len(text.rstrip(b"\r\n"))))
        at += len(text)
    return spans


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, 64])
def test_jsonl_read_a_chunk_at_a_time_cuts_the_lines_splitlines_cuts(monkeypatch, chunk):
    """Chunks of a few bytes (the 64 MiB chunks in small), cut across "\\r\\n", lone "\\r" line
    breaks, blank lines, a line longer than a chunk, a byte order mark, no final line break."""
    import titan_vlm.data.json_spans as json_spans

    monkeypatch.setattr(json_spans, "CHUNK", chunk)
    raw = BOM + b'{"a": 1}\r\n\r\n  \n{"b": "' + b"x" * 40 + b'"}\r{"c": 3}\n\n{"d": 4}'
    spans = record_spans(raw, Path("d.jsonl"), "d.jsonl")
    assert list(spans) == splitlines_spans(raw)
    assert [s.line for s in spans] == [1, 4, 5, 7] and records_of(raw, spans)[-1] == {"d": 4}
    assert list(record_spans(memoryview(raw), Path("d.jsonl"), "d.jsonl")) == list(spans)
