"""The records of a dataset file (data/jsonl.py): their schema, and one record into Sample parts.

    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                                         {"from": "gpt", "value": "A red circle."}, ...]}
    {"images": ["a.png", "b.png"], "text": "<image> then <image>: two circles."}
    {"image": "a.png", "text": "A red circle."}
    {"video": ["f0.png", "f1.png", "f2.png"], "text": "A circle <video> moving right."}

`image` / `images` (a path or a list; none: a text-only sample) are relative to `data.image_root`
(default: the data file's folder; an absolute path stays as it is); a table or tar reader
(data/record_files.py) may give an image as its bytes instead (ImageBytes), decoded as a file.
Each `<image>` placeholder marks where an image goes, in order; their count must match the
images, except that one image without a placeholder goes first (a conversation: `<image>\\n`
before the first user turn, LLaVA's convention; a caption: before the text).

`video` (a list of frame paths, relative as images are, or one video file's path: mp4, webm,
...; at most one video a record, so a list of lists is a bad sample) is `<video>`'s: its
frames, sampled to at most `max_frames` (`sample_frames`), become that many images of the
sample at the placeholder, in order, as if the text said `<image>` once per kept frame there;
frames not kept are not read. Its placeholder count must match too (one `<video>`, or none:
then the video goes first, as one image does). A record may hold images and a video: each
placeholder takes its own in reading order (`<image>` the next image, `<video>` the frames);
one image and a video that both lack a placeholder is a bad sample (which goes first is not
said). Where the dataset's folder processor reads a video whole (HFProcessor.reads_videos:
Qwen2.5-VL's), the kept frames are instead ONE part, a `VideoRef`, at the placeholder: a
conversation's `<video>` stays one placeholder (the chat template's {"type": "video"} item;
none: `<video>\\n` opens the first user turn), a caption's takes the video's place as one image's
would. A video FILE is only for such a processor (a bad sample otherwise): one VideoRef whose
frames the processor's own sampling picks when its header is read (data/jsonl.py,
data/video.py); max_frames is for frame lists. Speakers: "human" or "user", then "gpt" or
"assistant", alternating. Conversations are laid out in the built-in chat template
(data/chat.py), or in a Hugging Face folder's (data/hf_processor.py) where the dataset has its
processor; captions always as data/chat.py says.

Invariants: `parse_record` is a pure function of the record, the tokenizer, the processor, the
image root and max_frames (with `check_files`, of which image files exist too), so reading a
record again gives the same parts; its images are `ImageRef`s (files, not decoded); a record it
cannot use raises `BadSample`, whose `kind` groups the start-up summary and whose message names
the reason in one line (the dataset adds file and line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from titan_vlm.data.batch import ImageBytes, ImageRef, Part
from titan_vlm.data.chat import PLACEHOLDER, assemble, caption_segments, chat_segments
from titan_vlm.data.hf_processor import VIDEO, ChatError, HFProcessor
from titan_vlm.data.images import VideoRef
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

_PLACEHOLDERS = re.compile(f"({re.escape(PLACEHOLDER)}|{re.escape(VIDEO)})")
USER_NAMES, ASSISTANT_NAMES = ("human", "user"), ("gpt", "assistant")

# A record as json.loads gives it (or a table or tar reader, data/record_files.py, whose images
# may be the file's own bytes): anything, checked here.
Json = dict[str, "Json"] | list["Json"] | str | int | float | bool | None | ImageBytes


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


def sample_frames(n: int, max_frames: int) -> list[int]:
    """Which of a video's `n` frames are kept (indices, increasing) when at most `max_frames`
    are: all of them when n <= max_frames; else k = max_frames indices spread evenly from the
    first to the last, i * (n - 1) / (k - 1) rounded half up for i = 0 .. k - 1 (the first and
    the last frame are kept, and no frame twice since the step is at least 1); k = 1: the
    first frame."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    k = min(n, max_frames)
    if k == n:
        return list(range(n))
    if k == 1:
        return [0]
    return [(2 * i * (n - 1) + k - 1) // (2 * (k - 1)) for i in range(k)]


def parse_record(
    record: Json,
    tok: ByteTokenizer | HFTokenizer,
    image_root: Path,
    check_files: bool,
    processor: HFProcessor | None = None,
    max_frames: int = 8,
    sized: Callable[[list[Part]], list[Part]] | None = None,
) -> list[Part]:
    """One record into Sample parts (images, and a video's kept frames, as ImageRef; the video
    as one VideoRef where `processor` reads videos whole), or BadSample saying why not.
    `check_files`: an image (or kept frame) file that does not exist is a bad sample.
    `processor`: conversations in its chat template (else the built-in one). `max_frames`: a
    video's frames are sampled to at most this many (data.max_frames). `sized`: the refs with
    the sizes they enter the encoder at (data/jsonl.py; BadSample where a header says no), made
    before the text is assembled: a processor that writes text inside a video
    (FolderVision.splits_videos) needs its frames."""
    if not isinstance(record, dict):
        raise BadSample("bad record", f"expected a JSON object, got {type(record).__name__}")
    paths = _paths(record)
    video = _video(record, max_frames)  # None: no video; a str: a video file
    whole = processor is not None and processor.reads_videos  # a video is one part
    video_file = isinstance(video, str)
    if video_file and not whole:
        raise BadSample(
            "bad record",
            f"'video' is a file ({video}): video files are decoded where the model folder's "
            "processor reads videos whole (Qwen2.5-VL); give this model a list of frame files",
        )
    frames = [video] if isinstance(video, str) else video
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
    _check_unicode([*texts, *(p for p in paths if isinstance(p, str)), *(frames or [])])
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    if placeholders != len(paths) and not (placeholders == 0 and len(paths) == 1):
        raise BadSample(
            "placeholder count",
            f"{placeholders} {PLACEHOLDER} placeholder(s) for {len(paths)} image(s)",
        )
    videos, has_video = sum(text.count(VIDEO) for text in texts), frames is not None
    if videos > has_video:  # one <video> for the video, or none: it goes first
        raise BadSample(
            "placeholder count", f"{videos} {VIDEO} placeholder(s) for {int(has_video)} video(s)"
        )
    image_first, video_first = placeholders == 0 and len(paths) == 1, videos == 0 and has_video
    if image_first and video_first:
        raise BadSample(
            "placeholder count",
            f"an image and a video without placeholders: mark each place with {PLACEHOLDER} "
            f"and {VIDEO}",
        )
    # What lacks a placeholder goes first; then each placeholder takes its own, in reading order.
    first: list[tuple[list[str | ImageBytes], str]] = [([paths[0]], "image")] if image_first else []
    if video_first:
        first = [([*(frames or [])], "video")] if whole else [([f], "frame") for f in frames or []]
    placed, texts = _placed(texts, paths, frames or [], whole)
    files = [*first, *placed]
    refs: list[ImageRef] = []
    for names, kind in files:
        # an absolute path stays as is; an image the dataset file holds is its bytes
        found = [name if isinstance(name, ImageBytes) else image_root / name for name in names]
        if check_files:
            for path in found:
                if isinstance(path, Path) and not path.is_file():
                    what = "frame" if kind == "video" else kind
                    what = "video" if video_file and kind == "video" else what
                    raise BadSample("missing image file", f"{what} file not found: {path}")
        if kind == "video":  # a file: its frames are chosen when its header is read (jsonl.py)
            paths_ = [p for p in found if isinstance(p, Path)]  # a video's are always paths
            refs.append(VideoRef(paths_[0], frames=() if video_file else tuple(paths_)))
        else:
            refs.append(ImageRef(found[0]))
    images: list[Part] = list(refs) if sized is None else sized(list(refs))
    splits = processor is not None and processor.vision.splits_videos
    if splits and not turns and frames is not None:
        raise BadSample(
            "bad record",
            "a video in a caption ('text'): this model folder's processor writes the video's "
            "frame timestamps into a chat template's text; give it as 'conversations'",
        )
    if not turns:
        caption = texts[0].replace(VIDEO, PLACEHOLDER)  # a whole video takes one image's place
        return assemble(caption_segments(caption, images, tok), tok)
    turns = [(from_user, text) for (from_user, _), text in zip(turns, texts)]
    if first:  # LLaVA's convention: the image (or the video's frames) opens the first user turn
        mark = VIDEO if first[0][1] == "video" else PLACEHOLDER
        turns[0] = (True, mark * len(first) + "\n" + turns[0][1])
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
        if _blank(text) and not _PLACEHOLDERS.search(text):
            raise BadSample("empty text", f"empty text in turn {i + 1}")
    if len(said) < 2:
        raise BadSample("empty text", "no gpt turn: nothing to train on")
    return [(i % 2 == 0, text) for i, (_, text) in enumerate(said)]


_NOT_TURNS = '\'conversations\' must be a list of {"from": ..., "value": ...}'


_NOT_PATHS = "'image' / 'images' must be a path or a list of paths"
_NOT_FRAMES = "'video' must be a list of frame paths"  # or a video file's path


def _paths(record: dict[str, Json]) -> list[str | ImageBytes]:
    """The record's image paths (or image bytes, from a table or tar: data/record_files.py), in
    order (none: a text-only sample)."""
    if "image" in record and "images" in record:
        raise BadSample("bad record", "has both 'image' and 'images'")
    value = record.get("image", record.get("images", []))
    listed = [value] if isinstance(value, (str, ImageBytes)) else value
    if not isinstance(listed, list):
        raise BadSample("bad record", _NOT_PATHS)
    paths: list[str | ImageBytes] = []
    for path in listed:
        if not isinstance(path, (str, ImageBytes)) or not path:
            raise BadSample("bad record", _NOT_PATHS)
        paths.append(path)
    return paths


def _video(record: dict[str, Json], max_frames: int) -> list[str] | str | None:
    """The record's video: a video file's path (a str), or its kept frame paths in order
    (`sample_frames`); None: no video."""
    if "video" not in record:
        return None
    value = record["video"]
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        raise BadSample(
            "bad record", "'video' is a list of lists: one video a record (a list of frame paths)"
        )
    if isinstance(value, str):
        if not value:
            raise BadSample("bad record", f"{_NOT_FRAMES}, or a video file's path")
        return value
    if not isinstance(value, list):
        raise BadSample("bad record", _NOT_FRAMES)
    if not value:
        raise BadSample("bad record", "'video' has no frames")
    frames: list[str] = []
    for path in value:
        if not isinstance(path, str) or not path:
            raise BadSample("bad record", _NOT_FRAMES)
        frames.append(path)
    return [frames[i] for i in sample_frames(len(frames), max_frames)]


def _placed(
    texts: list[str], paths: list[str | ImageBytes], frames: list[str], whole: bool
) -> tuple[list[tuple[list[str | ImageBytes], str]], list[str]]:
    """The files the placeholders of `texts` take in reading order, each as (paths, "image",
    "frame" or "video"): each `<image>` the next of `paths`, each `<video>` all `frames` (one
    "video" entry where `whole`, else one "frame" entry each); and the texts with each `<video>`
    written as one `<image>` per frame (kept as it is where `whole`). The caller has checked the
    counts."""
    images = iter(paths)
    placed: list[tuple[list[str | ImageBytes], str]] = []
    written: list[str] = []
    for text in texts:
        pieces = _PLACEHOLDERS.split(text)  # text, placeholder, text, ...
        for j in range(1, len(pieces), 2):
            if pieces[j] == PLACEHOLDER:
                placed.append(([next(images)], "image"))
            elif whole:
                placed.append(([*frames], "video"))
            else:
                placed += [([f], "frame") for f in frames]
                pieces[j] = PLACEHOLDER * len(frames)
        written.append("".join(pieces))
    return placed, written


def _blank(text: str) -> bool:
    return not _PLACEHOLDERS.sub("", text).strip()


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
