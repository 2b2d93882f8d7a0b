"""Samples, packing, and the batch the trainer consumes.

A `Sample` is text and images in reading order. Rows of `seq_len` slots hold one sample
(`data.packing = false`) or several packed back to back (`true`); an image takes consecutive
slots, as many as the slot rule says (`SlotRule`: `tokens_per_image` for every image, or with
data.native_resolution_pixels > 0 VLMArgs.image_tokens of the size it enters the ViT at). A
`Batch` describes every slot of its rows (see
layout/ for what the metadata means to attention):

    slot:    [img 0 .. img 0][BOS t h r e e ...][BOS l o o k :][img 1 .. img 1][ t w o ...]......
    doc:      0 ......................... 0     1 ........................................  -1 -1
    image:    0 .... 0      -1 ......... -1    -1 ........ -1   1 ....... 1   -1 ......... -1 -1

Labels are shifted here, before any CP sharding: a text slot's label is the next slot's token
when that slot is text of the same sample, else IGNORE_INDEX (image slots, the last token of a
sample, padding). So the loss is on text predicting text, and nothing predicts an image. Text
given as a `Prompt` (a chat's user turns, data/chat.py) is context only: no slot is trained to
predict a prompt token, so the loss is on the answers alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from typing_extensions import TypeIs

from titan_vlm.data.image_batch import ImageRule, Images

IGNORE_INDEX = -100


class Prompt(list[int]):
    """Token ids that are context only: no position is trained to predict them (a user turn)."""


@dataclass(frozen=True)
class ImageBytes:
    """An image held inside a dataset file (a table's cell, a tar member: data/record_files.py),
    not beside it: its encoded bytes, decoded as a file holding them would be, and `name`, where
    it is (what messages say of it)."""

    data: bytes = field(repr=False)
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ImageRef:
    """An image part before decoding: its file, or its bytes where the dataset file holds them
    (a dataset file's record, data/records.py), and with data.native_resolution_pixels > 0 the
    (height, width) it will enter the ViT at, from its header (NativeResolution.size_of); None:
    the model's native square size."""

    path: Path | ImageBytes
    size: tuple[int, int] | None = None


@dataclass(frozen=True)
class VideoFrames:
    """A decoded video file, read whole by a family's processor: its kept frames' pixels
    [T, C, H, W] and the rate they were sampled at (kept frames / the stream's frames x its
    frames per second), which a family's positions may read (Qwen2.5-VL's M-RoPE). In a batch
    its pixels are one image of the ImageRule's (`frames`), like a video given as frame files.
    `times`: each kept frame's time in seconds (its index / the stream's rate: Qwen3-VL writes
    them into the prompt)."""

    frames: torch.Tensor
    fps: float
    times: tuple[float, ...] = ()


# How many slots an image takes: an int, the same for every image (each at the model's native
# size), or an ImageRule (data/image_batch.py) that counts each image's own.
SlotRule = int | ImageRule


# Token ids (a plain list is trained text, a Prompt is context), or one image: a [3, H, W] tensor
# in [-1, 1] (a video read whole: [T, 3, H, W], or VideoFrames from a file), or before decoding
# its file (ImageRef).
Part = list[int] | torch.Tensor | VideoFrames | ImageRef


def is_image(part: Part) -> TypeIs[torch.Tensor | VideoFrames | ImageRef]:
    return not isinstance(part, list)


def pixels(part: torch.Tensor | VideoFrames) -> torch.Tensor:
    """A decoded image part's pixels (a VideoFrames' frames)."""
    return part.frames if isinstance(part, VideoFrames) else part


def image_slots(part: torch.Tensor | VideoFrames | ImageRef, rule: SlotRule) -> int:
    """The slots one image part takes under `rule` (SlotRule)."""
    if isinstance(rule, int):
        return rule
    if isinstance(part, (torch.Tensor, VideoFrames)):
        return rule.slots(pixels(part))
    if part.size is None:
        raise ValueError(f"{part.path}: an image whose size was not read (native resolution)")
    return rule.size_slots(*part.size)


# A family's per-slot data of one sample (Batch.slot_data): each tensor [..., the sample's slots]
SlotData = Callable[["Sample"], dict[str, torch.Tensor]]


def part_slots(part: Part, rule: SlotRule) -> int:
    return image_slots(part, rule) if is_image(part) else len(part)


@dataclass
class Sample:
    """One sample in reading order."""

    parts: list[Part]

    def num_slots(self, rule: SlotRule) -> int:
        """Slots the sample takes, its images' under `rule` (SlotRule)."""
        return sum(part_slots(p, rule) for p in self.parts)

    def num_images(self) -> int:
        return sum(is_image(p) for p in self.parts)

    def truncated(self, max_slots: int, rule: SlotRule) -> Sample:
        """The first `max_slots` slots: text is cut, an image that no longer fits is dropped with
        everything after it (an image is never cut)."""
        parts, left = [], max_slots
        for p in self.parts:
            size = part_slots(p, rule)
            if size <= left:
                parts.append(p)
                left -= size
            else:
                if not is_image(p) and left > 0:
                    parts.append(type(p)(p[:left]))  # a cut Prompt stays a Prompt
                break
        return Sample(parts)


def join_rows(doc: torch.Tensor) -> torch.Tensor:
    """Rows of sample ids doc [B, S] back to back as one row [1, B x S], the ids renumbered so
    that samples of different rows stay apart (-1 padding stays -1)."""
    stride = int(doc.max()) + 1 if doc.numel() else 1
    rows = torch.arange(doc.shape[0], device=doc.device)[:, None]
    return torch.where(doc >= 0, doc + rows * stride, doc).reshape(1, -1)


@dataclass
class Batch:
    images: Images  # every image of the batch, rows in order, each in reading order
    tokens: torch.Tensor  # [B, S] input ids (image slots hold the image id, padding the pad id)
    labels: torch.Tensor  # [B, S] next-token targets, IGNORE_INDEX where there is no loss
    doc: torch.Tensor  # [B, S] sample index within the row, -1 for padding
    image: torch.Tensor  # [B, S] index into `images` for image slots, -1 for text and padding
    # A family's own per-slot tensors, each [..., B, S] (e.g. Qwen2.5-VL's M-RoPE positions
    # [3, B, S]): data that goes wherever its slot goes. The CP layout gathers each at a rank's
    # local slots (SeqLayout.slot_data, [..., B, L]); core code never reads a key.
    slot_data: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """On `device`; `non_blocking`: the copies from pinned host memory do not wait."""

        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            self.images.to(device, non_blocking=non_blocking),
            to(self.tokens),
            to(self.labels),
            to(self.doc),
            to(self.image),
            {k: to(v) for k, v in self.slot_data.items()},
        )

    def pin_memory(self) -> Batch:
        """In pinned (page-locked) host memory, for a non-blocking copy to the GPU."""
        return Batch(
            self.images.pin_memory(),
            self.tokens.pin_memory(),
            self.labels.pin_memory(),
            self.doc.pin_memory(),
            self.image.pin_memory(),
            {k: v.pin_memory() for k, v in self.slot_data.items()},
        )

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def as_one_row(self) -> Batch:
        """The rows back to back as one row of B x S slots, each sample keeping its slots (doc
        ids renumbered so that samples of different rows stay apart). Attention, labels and
        RoPE positions are per sample, so a model computes the same on it; a CP layout of it
        places samples without padding every row to the longest (cp_sample_placement="auto")."""
        if self.num_rows <= 1:
            return self
        return Batch(
            self.images,
            self.tokens.reshape(1, -1),
            self.labels.reshape(1, -1),
            join_rows(self.doc),
            self.image.reshape(1, -1),
            {k: v.flatten(-2).unsqueeze(-2) for k, v in self.slot_data.items()},
        )

    def rows(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as a batch of their own (images renumbered)."""
        image = self.image[start:stop]
        used = image[image >= 0]
        first = int(used.min()) if len(used) else 0
        count = int(used.max()) + 1 - first if len(used) else 0
        return Batch(
            self.images[first : first + count],
            self.tokens[start:stop],
            self.labels[start:stop],
            self.doc[start:stop],
            torch.where(image >= 0, image - first, image),
            {k: v[..., start:stop, :] for k, v in self.slot_data.items()},
        )


def collate(
    rows: list[list[Sample]],
    seq_len: int,
    tokens_per_image: SlotRule,
    image_size: int,
    pad_id: int,
    image_id: int | None = None,
    slot_data: SlotData | None = None,
) -> Batch:
    """Rows of samples (each row's samples must fit in seq_len slots) into one Batch; each image
    takes the slots `tokens_per_image` (a SlotRule) gives it. Image slots hold `image_id`
    (default: the pad id); the decoder never reads it (the image embeddings take those slots),
    it only makes dumps readable, as LLaVA's <image> token does. The images are one
    [n, 3, S, S] tensor of the native size S = `image_size` under an int rule, else what the
    ImageRule batches them as (ImageRule.batch). `slot_data`: a family's per-slot data of each
    sample (SlotData), written at the sample's slots of Batch.slot_data (0 at padding)."""
    n = len(rows)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    context = torch.zeros((n, seq_len), dtype=torch.bool)  # Prompt slots: never a target
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    doc = torch.full((n, seq_len), -1, dtype=torch.long)
    image = torch.full((n, seq_len), -1, dtype=torch.long)
    images: list[torch.Tensor] = []
    extra: dict[str, torch.Tensor] = {}
    for b, samples in enumerate(rows):
        at = 0
        for d, sample in enumerate(samples):
            size = sample.num_slots(tokens_per_image)
            if at + size > seq_len:
                raise ValueError(f"row {b}: samples take more than seq_len={seq_len} slots")
            doc[b, at : at + size] = d
            for key, value in (slot_data(sample) if slot_data is not None else {}).items():
                if value.shape[-1] != size:
                    raise ValueError(f"slot data {key!r} of {value.shape[-1]} slots for {size}")
                if key not in extra:
                    extra[key] = value.new_zeros((*value.shape[:-1], n, seq_len))
                extra[key][..., b, at : at + size] = value
            for part in sample.parts:
                if isinstance(part, (torch.Tensor, VideoFrames)):
                    slots = image_slots(part, tokens_per_image)
                    image[b, at : at + slots] = len(images)
                    if image_id is not None:
                        tokens[b, at : at + slots] = image_id
                    images.append(pixels(part))
                    at += slots
                elif isinstance(part, list):
                    tokens[b, at : at + len(part)] = torch.tensor(part, dtype=torch.long)
                    context[b, at : at + len(part)] = isinstance(part, Prompt)
                    at += len(part)
                else:
                    raise TypeError(f"row {b}: an image that was not decoded ({part!r})")
    is_text = (doc >= 0) & (image < 0)
    follows = is_text[:, :-1] & is_text[:, 1:] & (doc[:, :-1] == doc[:, 1:]) & ~context[:, 1:]
    labels[:, :-1] = torch.where(follows, tokens[:, 1:], IGNORE_INDEX)
    if isinstance(tokens_per_image, int):
        stacked = torch.stack(images) if images else torch.zeros(0, 3, image_size, image_size)
        return Batch(stacked, tokens, labels, doc, image, extra)
    return Batch(tokens_per_image.batch(images), tokens, labels, doc, image, extra)


def pack(
    samples: Iterable[Sample], seq_len: int, tokens_per_image: SlotRule, max_skips: int = 8
) -> list[Sample]:
    """One row's samples from a stream: take them in order while they fit; one that does not
    fit is skipped (up to `max_skips` times, so shorter ones can fill the gap). A first sample
    longer than the row is truncated to it."""
    row: list[Sample] = []
    used, skips = 0, 0
    for sample in samples:
        size = sample.num_slots(tokens_per_image)
        if not row and size > seq_len:
            return [sample.truncated(seq_len, tokens_per_image)]
        if used + size <= seq_len:
            row.append(sample)
            used += size
        else:
            skips += 1
        if used == seq_len or skips > max_skips:
            break
    return row
