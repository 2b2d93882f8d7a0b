"""The records of a dataset file (data/jsonl.py): their schema, and one record into Sample parts.

    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                         {"from": "gpt", "value": "A red circle."}, ...]}
    {"images": ["a.png", "b.png"], "text": "<image> then <image>: two circles."}
    {"image": "a.png", "text": "A red circle."}

`image` / `images` (a path or a list; none: a text-only sample) are relative to `data.image_root`
(default: the data file's folder; an absolute path stays as it is). Each `<image>` placeholder
marks where an image goes, in order; their count must match the images, except that one image
without a placeholder goes first (a conversation: `<image>\\n` before the first user turn,
LLaVA's convention; a caption: before the text). Speakers: "human" or "user", then "gpt" or
"assistant", alternating. Conversations are laid out in the built-in chat template
(data/chat.py), or in a Hugging Face folder's (data/hf_processor.py) where the dataset has its
processor; captions always as data/chat.py says.

Invariants: `parse_record` is a pure function of the record, the tokenizer, the processor and
the image root (with `check_files`, of which image files exist too), so reading a record again
gives the same parts; its images are `ImageRef`s (files, not decoded); a record it cannot use
raises `BadSample`, whose `kind` groups the start-up summary and whose message names the
reason in one line (the dataset adds file and line).
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_vlm.data.batch import ImageRef, Part
from titan_vlm.data.chat import PLACEHOLDER, assemble, caption_segments, chat_segments
from titan_vlm.data.hf_processor import ChatError, HFProcessor
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

USER_NAMES, ASSISTANT_NAMES = ("human", "user"), ("gpt", "assistant")

# A record as json.loads gives it: anything, checked here.
Json = dict[str, "Json"] | list["Json"] | str | int | float | bool | None


class BadSample(Exception):
    """Why one record cannot be used. `kind` groups the start-up summary."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


def decode_record(raw: bytes) -> Json:
    """One record's bytes as JSON, or BadSample ("malformed JSON") saying why not."""
    try:
        value: Json = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadSample("malformed JSON", "malformed JSON (not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise BadSample("malformed JSON", f"malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise BadSample("malformed JSON", "malformed JSON (nested too deeply)") from None
    return value


def parse_record(
    record: Json,
    tok: ByteTokenizer | HFTokenizer,
    image_root: Path,
    check_files: bool,
    processor: HFProcessor | None = None,
) -> list[Part]:
    """One record into Sample parts (images as ImageRef), or BadSample saying why not.
    `check_files`: an image file that does not exist is a bad sample. `processor`:
    conversations in its chat template (else the built-in one)."""
    if not isinstance(record, dict):
        raise BadSample("bad record", f"expected a JSON object, got {type(record).__name__}")
    paths = _paths(record)
    turns: list[tuple[bool, str]] = []
    if "conversations" in record:
        turns = _turns(record["conversations"])
        texts = [text for _, text in turns]
    elif "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise BadSample("bad record", "'text' must be a string")
        if _blank(text):
            raise BadSample("empty text", "empty text")
        texts = [text]
    else:
        raise BadSample("bad record", "no 'conversations' or 'text' key")
    _check_unicode([*texts, *paths])
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    if placeholders != len(paths) and not (placeholders == 0 and len(paths) == 1):
        raise BadSample(
            "placeholder count",
            f"{placeholders} {PLACEHOLDER} placeholder(s) for {len(paths)} image(s)",
        )
    refs = [ImageRef(image_root / p) for p in paths]  # an absolute p stays as is
    if check_files:
        for ref in refs:
            if not ref.path.is_file():
                raise BadSample("missing image file", f"image file not found: {ref.path}")
    images: list[Part] = list(refs)
    if not turns:
        return assemble(caption_segments(texts[0], images, tok), tok)
    if placeholders == 0 and images:  # LLaVA's convention: the image opens the first user turn
        turns[0] = (True, PLACEHOLDER + "\n" + turns[0][1])
    if processor is None:
        return assemble(chat_segments(turns, images, tok), tok)
    try:
        return processor.conversation_parts(turns, images)
    except ChatError as e:
        raise BadSample("chat template", str(e)) from None


def _turns(conversations: Json) -> list[tuple[bool, str]]:
    """A record's "conversations" as (from the user?, text) turns: at least one user and one
    assistant turn, alternating from the user, none empty (a lone placeholder is not empty)."""
    if not isinstance(conversations, list) or not conversations:
        raise BadSample("bad record", _NOT_TURNS)
    said: list[tuple[str, str]] = []  # (speaker, text): every turn's shape is checked first
    for turn in conversations:
        if not isinstance(turn, dict):
            raise BadSample("bad record", _NOT_TURNS)
        speaker, text = turn.get("from"), turn.get("value")
        if not isinstance(speaker, str) or not isinstance(text, str):
            raise BadSample("bad record", _NOT_TURNS)
        said.append((speaker, text))
    for i, (speaker, text) in enumerate(said):
        if speaker.lower() not in (USER_NAMES if i % 2 == 0 else ASSISTANT_NAMES):
            raise BadSample(
                "bad record",
                f"turn {i + 1} is from {speaker!r}: turns must alternate "
                "human (or user) and gpt (or assistant), starting with human",
            )
        if _blank(text) and PLACEHOLDER not in text:
            raise BadSample("empty text", f"empty text in turn {i + 1}")
    if len(said) < 2:
        raise BadSample("empty text", "no gpt turn: nothing to train on")
    return [(i % 2 == 0, text) for i, (_, text) in enumerate(said)]


_NOT_TURNS = '\'conversations\' must be a list of {"from": ..., "value": ...}'
_NOT_PATHS = "'image' / 'images' must be a path or a list of paths"


def _paths(record: dict[str, Json]) -> list[str]:
    """The record's image paths, in order (none: a text-only sample)."""
    if "image" in record and "images" in record:
        raise BadSample("bad record", "has both 'image' and 'images'")
    value = record.get("image", record.get("images", []))
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list):
        raise BadSample("bad record", _NOT_PATHS)
    paths: list[str] = []
    for path in listed:
        if not isinstance(path, str) or not path:
            raise BadSample("bad record", _NOT_PATHS)
        paths.append(path)
    return paths


def _blank(text: str) -> bool:
    return not text.replace(PLACEHOLDER, "").strip()


def _check_unicode(strings: list[str]) -> None:
    """JSON's \\uXXXX escapes can spell a lone surrogate, which is no character: such text
    cannot be encoded (tokenized, or used as a path) and makes the sample bad."""
    for text in strings:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadSample(
                "undecodable text", f"text is not valid Unicode ({e.reason} at character {e.start})"
            ) from None
