"""Your own data: LLaVA-style conversations and captions from a JSON array (`.json`) or JSON lines
(`.jsonl`) file, with images on disk (`data.dataset = "path/to/train.jsonl"`).

Records (one per line of a .jsonl, or the elements of a .json array):

    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                         {"from": "gpt", "value": "A red circle."}, ...]}
    {"images": ["a.png", "b.png"], "text": "<image> then <image>: two circles."}
    {"image": "a.png", "text": "A red circle."}

`image` / `images` (a path or a list; none: a text-only sample) are relative to `data.image_root`
(default: the data file's folder). Each `<image>` placeholder marks where an image goes, in order;
their count must match the images, except that one image without a placeholder goes first (a
conversation: `<image>\\n` before the first user turn, LLaVA's convention; a caption: before the
text). Speakers: "human" or "user", then "gpt" or "assistant", alternating.

The chat template (conversations), with `|` between context and trained text:

    BOS "USER: " q1 " ASSISTANT:" | " " a1 EOS | "USER: " q2 " ASSISTANT:" | " " a2 EOS ...

Only the assistant turns carry loss (the standard LLaVA masking): the user turns are `Prompt`s
(data/batch.py), which no position is trained to predict; the first answer token is predicted
from the ":" of "ASSISTANT:" and each EOS from its answer. A caption is `BOS text EOS` (the image
first: `[image] BOS text EOS`, the built-in data's layout), all of it trained (without BOS for a
tokenizer that has none, as Qwen2's).

With a Hugging Face model folder's processor (`JsonlDataset(..., processor=...)`,
data/hf_processor.py) conversations use the folder's chat template instead, with the loss on
the assistant turns (and the end tokens the template writes after them), and images are
preprocessed as the folder's image processor does; a conversation the template cannot render
(its raise_exception, an image in an assistant turn) is a bad sample ("chat template").

Deterministic and resumable without any state of its own: at start-up every rank reads the file
once, parses and tokenizes every record and counts its images (images are only checked to
exist, not decoded) and builds a fixed packing index, a list of rows of sample numbers
(`data.packing`: greedily in file order, a sample that does not fit starts the next row, nothing
dropped; else one sample per row). Global row r of the training run is index row
`order_e[r mod R]` of epoch e = r div R (R rows; `order_e` a permutation seeded by
training.seed and e with `data.shuffle`, else the file order), and the rows of a global batch are
numbered exactly as the built-in data's: `(step * dp_size + dp_rank) * local_batch_size + j`.
So the checkpointed step IS the data position, and a run resumed at another dp / cp layout with
the same global batch reads the same rows. Only the byte span of each record is kept; a batch
reads its records back from the file (which must not change while a run and its resumes use
it) and decodes only its own rows' images.

Bad input, each counted and reported once per process as `data: <file>:<line>: <reason> (skipped)`
(the first MAX_WARNINGS; the counts cover all), or with `data.on_bad_sample = "error"` a
DataError naming the file and line: a malformed JSON line, a record without the keys above, an
empty text, a placeholder / image count mismatch and a missing image file are found at start-up
and leave the sample out of the index; a sample longer than training.seq_len is cut to it
(Sample.truncated, "(truncated)"); JSON nested too deeply, text that is not valid Unicode
(a lone surrogate escape such as "\\ud800") and bytes that are not UTF-8 are bad samples too, and
a UTF-8 byte order mark at the start of the file is skipped; an image that cannot be decoded
or has more than `data.max_image_pixels` pixels (read from its header) is found when its batch
is built, and its sample is left out of that row (the same way on every read, so runs stay
deterministic; a rank whose whole batch is left out gets one untrained padding token, so it still
runs the step).
"""

from __future__ import annotations

import json
import logging
import random
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_vlm.config import ConfigError, Data
from titan_vlm.data.batch import Batch, Part, Prompt, Sample, collate, is_image
from titan_vlm.data.hf_processor import ChatError, HFProcessor
from titan_vlm.data.images import ImageTooLarge, load_image
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

logger = logging.getLogger("titan_vlm")

PLACEHOLDER = "<image>"
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, skipped at the start of a file
USER, ASSISTANT = "USER: ", " ASSISTANT:"
USER_NAMES, ASSISTANT_NAMES = ("human", "user"), ("gpt", "assistant")
BAD_SAMPLE_MODES = ("skip", "error")
MAX_WARNINGS = 100  # per process; a broken dataset should not bury the training log


def validate_data_config(data: Data) -> None:
    """The data.* keys of a dataset file, before any process group exists (the file itself is
    parsed when the dataset is built)."""
    if data.on_bad_sample not in BAD_SAMPLE_MODES:
        raise ConfigError(
            f"data.on_bad_sample must be one of {', '.join(BAD_SAMPLE_MODES)}, "
            f"got {data.on_bad_sample!r}"
        )
    if data.max_image_pixels < 1:
        raise ConfigError(f"data.max_image_pixels must be >= 1, got {data.max_image_pixels}")
    if data.dataset == "synthetic":
        return
    path = Path(data.dataset)
    if path.suffix not in (".json", ".jsonl"):
        raise ConfigError(
            f"data.dataset={data.dataset!r}: expected 'synthetic' or a .json / .jsonl file"
        )
    if not path.is_file():
        raise ConfigError(f"data.dataset: file not found: {data.dataset}")
    if data.image_root and not Path(data.image_root).is_dir():
        raise ConfigError(f"data.image_root: folder not found: {data.image_root}")


class DataError(ConfigError):
    """A bad sample with data.on_bad_sample = "error"; one line naming the file and line."""


class BadSample(Exception):
    """Internal: why one record cannot be used. `kind` groups the start-up summary."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class ImageRef:
    """An image part before decoding: its file."""

    path: Path


# A record's content in reading order: ("prompt" | "text", a string or one token id) or
# ("image", the image part). Consecutive pieces of one kind are tokenized together.
Segment = tuple[str, Any]


def assemble(segments: list[Segment], tok: ByteTokenizer | HFTokenizer) -> list[Part]:
    """Segments into Sample parts: token lists (a `Prompt` for context) and images."""
    parts: list[Part] = []
    kind, pieces = None, []

    def flush() -> None:
        ids, text = [], ""
        for piece in pieces:
            if isinstance(piece, str):
                text += piece
            else:  # a special token id: the text before it is tokenized on its own
                ids += tok.encode(text, bos=False, eos=False) if text else []
                ids.append(piece)
                text = ""
        ids += tok.encode(text, bos=False, eos=False) if text else []
        if ids:
            parts.append(Prompt(ids) if kind == "prompt" else ids)
        pieces.clear()

    for seg_kind, value in segments:
        if seg_kind == "image":
            flush()
            parts.append(value)
            kind = None
            continue
        if seg_kind != kind:
            flush()
            kind = seg_kind
        pieces.append(value)
    flush()
    return parts


def _with_images(kind: str, text: str, images: list[Part]) -> list[Segment]:
    """`text` as segments of `kind`, each placeholder replaced by the next of `images`
    (consumed)."""
    out: list[Segment] = []
    for i, run in enumerate(text.split(PLACEHOLDER)):
        if i:
            out.append(("image", images.pop(0)))
        if run:
            out.append((kind, run))
    return out


def chat_segments(
    turns: list[tuple[bool, str]], images: list[Part], tok: ByteTokenizer | HFTokenizer
) -> list[Segment]:
    """The chat template: turns are (from the user?, text with placeholders), alternating from
    the user; `images` fill the placeholders in order. A last user turn (generate's question)
    ends with " ASSISTANT:", so the model's continuation is the answer."""
    images = list(images)
    out: list[Segment] = [("prompt", tok.BOS)]
    for from_user, text in turns:
        if from_user:
            out += [("prompt", USER), *_with_images("prompt", text, images), ("prompt", ASSISTANT)]
        else:
            out += [*_with_images("text", " " + text, images), ("text", tok.EOS)]
    return out


def chat_question(image: Part, question: str, tok: ByteTokenizer | HFTokenizer) -> list[Part]:
    """A one-turn question about one image, as a conversation record without a placeholder is
    laid out: `BOS USER: [image]\n<question> ASSISTANT:`; what follows it is the answer."""
    return assemble(chat_segments([(True, f"{PLACEHOLDER}\n{question}")], [image], tok), tok)


def caption_segments(
    text: str, images: list[Part], tok: ByteTokenizer | HFTokenizer
) -> list[Segment]:
    """`BOS text EOS` with the images at their placeholders, or one image without a placeholder
    first: `[image] BOS text EOS`."""
    images = list(images)
    bos: list[Segment] = [] if tok.BOS is None else [("text", tok.BOS)]
    if PLACEHOLDER not in text and len(images) == 1:
        return [("image", images[0]), *bos, ("text", text), ("text", tok.EOS)]
    return [*bos, *_with_images("text", text, images), ("text", tok.EOS)]


def _paths(record: dict) -> list[str]:
    if "image" in record and "images" in record:
        raise BadSample("bad record", "has both 'image' and 'images'")
    value = record.get("image", record.get("images", []))
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise BadSample("bad record", "'image' / 'images' must be a path or a list of paths")
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


def parse_record(
    record: Any,
    tok: ByteTokenizer | HFTokenizer,
    image_root: Path,
    check_files: bool,
    processor: HFProcessor | None = None,
) -> list[Part]:
    """One record into Sample parts (images as ImageRef), or BadSample saying why not.
    `processor`: conversations in its chat template (else the built-in one)."""
    if not isinstance(record, dict):
        raise BadSample("bad record", f"expected a JSON object, got {type(record).__name__}")
    paths = _paths(record)
    if "conversations" in record:
        conv = record["conversations"]
        if (
            not isinstance(conv, list)
            or not conv
            or not all(
                isinstance(t, dict)
                and isinstance(t.get("from"), str)
                and isinstance(t.get("value"), str)
                for t in conv
            )
        ):
            raise BadSample(
                "bad record", '\'conversations\' must be a list of {"from": ..., "value": ...}'
            )
        turns = []
        for i, t in enumerate(conv):
            speaker = t["from"].lower()
            if speaker not in (USER_NAMES if i % 2 == 0 else ASSISTANT_NAMES):
                raise BadSample(
                    "bad record",
                    f"turn {i + 1} is from {t['from']!r}: turns must alternate "
                    "human (or user) and gpt (or assistant), starting with human",
                )
            if _blank(t["value"]) and PLACEHOLDER not in t["value"]:
                raise BadSample("empty text", f"empty text in turn {i + 1}")
            turns.append((i % 2 == 0, t["value"]))
        if len(turns) < 2:
            raise BadSample("empty text", "no gpt turn: nothing to train on")
        texts = [text for _, text in turns]
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise BadSample("bad record", "'text' must be a string")
        if _blank(record["text"]):
            raise BadSample("empty text", "empty text")
        texts = [record["text"]]
    else:
        raise BadSample("bad record", "no 'conversations' or 'text' key")
    _check_unicode([*texts, *paths])
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    if placeholders != len(paths) and not (placeholders == 0 and len(paths) == 1):
        raise BadSample(
            "placeholder count",
            f"{placeholders} {PLACEHOLDER} placeholder(s) for {len(paths)} image(s)",
        )
    refs: list[Part] = [ImageRef(image_root / p) for p in paths]  # an absolute p stays as is
    if check_files:
        for ref in refs:
            if not ref.path.is_file():
                raise BadSample("missing image file", f"image file not found: {ref.path}")
    if "conversations" in record:
        if placeholders == 0 and refs:  # LLaVA's convention: the image opens the first user turn
            turns[0] = (True, PLACEHOLDER + "\n" + turns[0][1])
        if processor is not None:
            try:
                return processor.conversation_parts(turns, refs)
            except ChatError as e:
                raise BadSample("chat template", str(e)) from None
        return assemble(chat_segments(turns, refs, tok), tok)
    return assemble(caption_segments(record["text"], refs, tok), tok)


def _jsonl_spans(raw: bytes) -> list[tuple[int, int, int]]:
    """(line, start byte, end byte) of every non-blank line, without its line break."""
    spans, at = [], 0
    for line, text in enumerate(raw.splitlines(keepends=True), 1):
        skip = len(BOM) if line == 1 and text.startswith(BOM) else 0
        if text[skip:].strip():
            spans.append((line, at + skip, at + len(text.rstrip(b"\r\n"))))
        at += len(text)
    return spans


def _json_array_spans(raw: bytes, where: str) -> list[tuple[int, int, int]]:
    """(line, start byte, end byte) of every element of a JSON array, which must parse whole
    (a broken array cannot be resynchronised, so it is a file error, not a bad sample)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.dataset: {where}: not UTF-8 ({e})") from None
    decoder = json.JSONDecoder()
    spans = []
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
            f"data.dataset: {where}:{line}: {why} (a .json file must be one JSON array of "
            "records; a .jsonl file holds one record per line)"
        )

    if text.startswith("\ufeff"):  # a UTF-8 byte order mark
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
        spans.append((start_line, start_byte, byte))
        i = skip_space(end)
        if i < len(text) and text[i] == ",":
            i = skip_space(i + 1)
        elif i < len(text) and text[i] == "]":
            if skip_space(i + 1) != len(text):
                raise fail(skip_space(i + 1), "text after the array")
            return spans
        else:
            raise fail(i, "expected ',' or ']'")


class JsonlDataset:
    """A JSON / JSONL file of LLaVA conversations or captions (see the module docstring), with
    the built-in data's interface: `batch(step, dp_rank, dp_size, batch_size) -> Batch`.

    Counters: `bad_at_startup` (samples left out of the index), `truncated` (samples cut to
    seq_len), `dropped` (the sample numbers this process left out of its batches: an image
    that cannot be decoded or is too large; a sample read again is not counted again).
    `log_startup` / `log_batches`: whether this process logs the start-up / batch-time warnings
    (the trainer lets one rank log each kind once: start-up on rank 0, batch-time on each dp
    rank's first cp and tp rank).

    `processor`: a Hugging Face model folder's (data/hf_processor.py): conversations in its chat
    template, images preprocessed by its image processor (its image size must be
    `image_size`); `tokenizer` must then be `processor.tokenizer`."""

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
    ):
        if processor is not None and tokenizer is not processor.tokenizer:
            raise ValueError("JsonlDataset: with a processor, the tokenizer is processor.tokenizer")
        if processor is not None and processor.image_size != image_size:
            raise ConfigError(
                f"model.hf_path: {processor.folder}: images of {processor.image_size} pixels, "
                f"the model takes {image_size}"
            )
        self.processor = processor
        if on_bad_sample not in BAD_SAMPLE_MODES:
            raise ConfigError(
                f"data.on_bad_sample must be one of {', '.join(BAD_SAMPLE_MODES)}, "
                f"got {on_bad_sample!r}"
            )
        self.path = Path(path)
        self.name = str(path)  # as the user wrote it, for the warnings
        self.tokenizer = tokenizer
        self.image_size, self.tokens_per_image, self.seq_len = image_size, tokens_per_image, seq_len
        self.seed, self.packing, self.shuffle = seed, packing, shuffle
        self.image_root = Path(image_root) if image_root else self.path.parent
        self.on_bad_sample, self.max_image_pixels = on_bad_sample, max_image_pixels
        self.log_batches = log_batches
        self._warned: set[int] = set()
        self._warnings = 0
        self.skipped: Counter[str] = Counter()  # start-up reasons, by kind
        self.dropped: set[int] = set()
        self._orders: dict[int, list[int]] = {}

        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise ConfigError(f"data.dataset: cannot read {self.name}: {e.strerror}") from None
        if self.path.suffix == ".json":
            spans = _json_array_spans(raw, self.name)
        elif self.path.suffix == ".jsonl":
            spans = _jsonl_spans(raw)
        else:
            raise ConfigError(
                f"data.dataset: {self.name}: expected 'synthetic' or a .json / .jsonl file"
            )
        # Kept samples: where each record is, and its size in slots (after truncation).
        self.lines, self.starts, self.ends = array("q"), array("q"), array("q")
        sizes: list[int] = []
        self.truncated = self.num_images = 0
        for line, start, end in spans:
            try:
                record = self._decode_json(raw[start:end])
                parts = parse_record(
                    record, tokenizer, self.image_root, check_files=True, processor=processor
                )
            except BadSample as bad:
                self._bad(line, str(bad), log_startup)
                self.skipped[bad.kind] += 1
                continue
            sample = Sample(parts)
            size = sample.num_slots(tokens_per_image)
            if size > seq_len:
                self._bad(
                    line,
                    f"sample of {size} slots is longer than training.seq_len={seq_len}",
                    log_startup,
                    action="truncated",
                )
                self.truncated += 1
                sample = sample.truncated(seq_len, tokens_per_image)
                size = sample.num_slots(tokens_per_image)
            self.lines.append(line)
            self.starts.append(start)
            self.ends.append(end)
            sizes.append(size)
            self.num_images += sample.num_images()
        self.records = len(spans)
        self.bad_at_startup = sum(self.skipped.values())
        self.rows = self._pack(sizes)
        if not self.rows:
            raise ConfigError(
                f"data.dataset: {self.name}: no usable samples in {self.records} record(s)"
            )

    @staticmethod
    def _decode_json(raw: bytes) -> Any:
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadSample("malformed JSON", "malformed JSON (not UTF-8)") from None
        except json.JSONDecodeError as e:
            raise BadSample(
                "malformed JSON", f"malformed JSON ({e.msg} at column {e.colno})"
            ) from None
        except RecursionError:
            raise BadSample("malformed JSON", "malformed JSON (nested too deeply)") from None

    def _pack(self, sizes: list[int]) -> list[list[int]]:
        """The packing index: rows of sample numbers in file order, none dropped."""
        rows: list[list[int]] = []
        used = self.seq_len  # forces a new row for the first sample
        for i, size in enumerate(sizes):
            if not rows or not self.packing or used + size > self.seq_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += size
        return rows

    def _bad(self, line: int, reason: str, log: bool, action: str = "skipped") -> None:
        """Report one bad sample: raise with on_bad_sample = "error", else warn once."""
        where = f"{self.name}:{line}"
        if self.on_bad_sample == "error":
            raise DataError(f"data.on_bad_sample='error': {where}: {reason}")
        if not log or line in self._warned:
            return
        self._warned.add(line)
        self._warnings += 1
        if self._warnings <= MAX_WARNINGS:
            logger.warning("data: %s: %s (%s)", where, reason, action)
        if self._warnings == MAX_WARNINGS:
            logger.warning(
                "data: %s: further bad samples are counted in the metrics, not logged", self.name
            )

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.skipped.items()))
        return (
            f"{self.name}: {self.records} record(s) -> {len(self.starts)} samples with "
            f"{self.num_images} "
            f"image(s) in {len(self.rows)} rows of {self.seq_len} slots "
            f"({'packed' if self.packing else 'one sample per row'}"
            f"{', rows shuffled per epoch' if self.shuffle else ''}); "
            f"skipped {self.bad_at_startup}{f' ({kinds})' if kinds else ''}, "
            f"truncated {self.truncated}"
        )

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}/rows/{epoch}").shuffle(order)
            if len(self._orders) >= 2:  # the epochs in use: usually one, two where a batch crosses
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return self._orders[epoch]

    def row_ids(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> list[int]:
        """Which rows of the packing index this rank reads at `step` (global row numbering)."""
        first = (step * dp_size + dp_rank) * batch_size
        return [
            self._order(r // len(self.rows))[r % len(self.rows)]
            for r in range(first, first + batch_size)
        ]

    def sample(self, i: int) -> Sample:
        """Kept sample i with its images as ImageRef (read back from the file)."""
        with open(self.path, "rb") as f:
            return self._read(f, i)

    def _read(self, f, i: int) -> Sample:
        f.seek(self.starts[i])
        try:
            parts = parse_record(
                self._decode_json(f.read(self.ends[i] - self.starts[i])),
                self.tokenizer,
                self.image_root,
                check_files=False,
                processor=self.processor,
            )
        except BadSample:
            raise ConfigError(
                f"data.dataset: {self.name}:{self.lines[i]} changed since start-up (batches read "
                "their records back from the file)"
            ) from None
        return Sample(parts).truncated(self.seq_len, self.tokens_per_image)

    def _decoded(self, i: int, sample: Sample) -> Sample | None:
        """The sample with its images decoded, or None (reported) if one cannot be used."""
        parts = []
        for part in sample.parts:
            if is_image(part):
                try:
                    if self.processor is not None:
                        part = self.processor.preprocess_image(part.path, self.max_image_pixels)
                    else:
                        part = load_image(part.path, self.image_size, self.max_image_pixels)
                except ImageTooLarge as e:
                    return self._drop(i, f"image too large: {part.path} ({e})")
                except (
                    OSError,
                    SyntaxError,
                    ValueError,
                    EOFError,
                ) as e:  # what Pillow raises for broken files
                    return self._drop(
                        i, f"image cannot be decoded: {part.path} ({type(e).__name__}: {e})"
                    )
            parts.append(part)
        return Sample(parts)

    def _drop(self, i: int, reason: str) -> None:  # None: the sample is left out of its row
        self._bad(self.lines[i], reason, self.log_batches)
        self.dropped.add(i)
        return None

    def batch(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> Batch:
        rows = []
        with open(self.path, "rb") as f:
            for r in self.row_ids(step, dp_rank, dp_size, batch_size):
                decoded = (self._decoded(i, self._read(f, i)) for i in self.rows[r])
                rows.append([s for s in decoded if s is not None])
        if not any(rows):
            # Every sample of this rank's batch was dropped. A rank with no slots at all cannot
            # run the step its peers run, so it gets one padding token that trains nothing.
            rows[0] = [Sample([Prompt([self.tokenizer.PAD])])]
        return collate(
            rows,
            self.seq_len,
            self.tokens_per_image,
            self.image_size,
            self.tokenizer.PAD,
            self.tokenizer.IMAGE,
        )
