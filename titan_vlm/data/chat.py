"""The built-in chat template and caption layout: a record's turns or text, with its images, as
Sample parts (data/batch.py). A Hugging Face model folder's own chat template is
data/hf_processor.py's.

A conversation, with `|` between context (`Prompt` parts) and trained text:

    BOS "USER: " q1 " ASSISTANT:" | " " a1 EOS | "USER: " q2 " ASSISTANT:" | " " a2 EOS ...

Only the assistant turns carry loss (the standard LLaVA masking): the user turns are Prompts,
which no position is trained to predict; the first answer token is predicted from the ":" of
"ASSISTANT:" and each EOS from its answer. A caption is `BOS text EOS` (one image without a
placeholder, or a video's frames, first: `[image] BOS text EOS`, the built-in data's layout), all
of it trained.
A tokenizer without BOS (Qwen2's) writes none.

Each `<image>` placeholder in a text is the next image, in order; the caller (data/records.py)
has checked that the counts match. Text between images and special tokens is tokenized in one
piece, as a tokenizer sees a whole sentence, so `assemble` is the only place that tokenizes.
"""

from __future__ import annotations

from typing import Literal

from titan_vlm.data.batch import Part, Prompt
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

PLACEHOLDER = "<image>"  # where an image goes in a LLaVA record's text
USER, ASSISTANT = "USER: ", " ASSISTANT:"

TextKind = Literal["prompt", "text"]  # context, or trained text
# A record's content in reading order: text of one kind (a string, or one special token id),
# or one image. Consecutive text segments of one kind are tokenized together.
Segment = tuple[TextKind, str | int] | tuple[Literal["image"], Part]


def assemble(segments: list[Segment], tok: ByteTokenizer | HFTokenizer) -> list[Part]:
    """Segments into Sample parts: token lists (a `Prompt` for context) and images."""
    parts: list[Part] = []
    kind: TextKind | None = None
    pieces: list[str | int] = []

    def flush() -> None:
        ids: list[int] = []
        text = ""
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

    for segment in segments:
        if segment[0] == "image":
            flush()
            parts.append(segment[1])
            kind = None
            continue
        if segment[0] != kind:
            flush()
            kind = segment[0]
        pieces.append(segment[1])
    flush()
    return parts


def _with_images(kind: TextKind, text: str, images: list[Part]) -> list[Segment]:
    """`text` as segments of `kind`, each placeholder replaced by the next of `images`
    (consumed)."""
    out: list[Segment] = []
    for i, run in enumerate(text.split(PLACEHOLDER)):
        if i:
            out.append(("image", images.pop(0)))
        if run:
            out.append((kind, run))
    return out


def _bos(kind: TextKind, tok: ByteTokenizer | HFTokenizer) -> list[Segment]:
    """BOS as a segment of `kind`, or nothing for a tokenizer without one."""
    return [] if tok.BOS is None else [(kind, tok.BOS)]


def chat_segments(
    turns: list[tuple[bool, str]], images: list[Part], tok: ByteTokenizer | HFTokenizer
) -> list[Segment]:
    """The chat template: turns are (from the user?, text with placeholders), alternating from
    the user; `images` fill the placeholders in order. A last user turn (generate's question)
    ends with " ASSISTANT:", so the model's continuation is the answer."""
    images = list(images)
    out = _bos("prompt", tok)
    for from_user, text in turns:
        if from_user:
            out += [("prompt", USER), *_with_images("prompt", text, images), ("prompt", ASSISTANT)]
        else:
            out += [*_with_images("text", " " + text, images), ("text", tok.EOS)]
    return out


def chat_question(image: Part, question: str, tok: ByteTokenizer | HFTokenizer) -> list[Part]:
    """A one-turn question about one image, as a conversation record without a placeholder is
    laid out: `BOS USER: [image]\\n<question> ASSISTANT:`; what follows it is the answer."""
    return assemble(chat_segments([(True, f"{PLACEHOLDER}\n{question}")], [image], tok), tok)


def caption_segments(
    text: str, images: list[Part], tok: ByteTokenizer | HFTokenizer
) -> list[Segment]:
    """`BOS text EOS` with the images at their placeholders; the images beyond the placeholders
    (data/records.py: one image, or a video's frames, without a placeholder) go first:
    `[image] BOS text EOS`."""
    first = len(images) - text.count(PLACEHOLDER)
    leading: list[Segment] = [("image", image) for image in images[:first]]
    placed = _with_images("text", text, list(images[first:]))
    return [*leading, *_bos("text", tok), *placed, ("text", tok.EOS)]
