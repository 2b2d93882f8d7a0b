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

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from typing_extensions import TypeIs

from titan_vlm.data.images import NativeResolution

IGNORE_INDEX = -100


class Prompt(list[int]):
    """Token ids that are context only: no position is trained to predict them (a user turn)."""


@dataclass(frozen=True)
class ImageRef:
    """An image part before decoding: its file (a dataset file's record, data/records.py), and
    with data.native_resolution_pixels > 0 the (height, width) it will enter the ViT at, from its
    header (NativeResolution.size_of); None: the model's native square size."""

    path: Path
    size: tuple[int, int] | None = None


class ImageSet(ABC):
    """A batch's images when they are not one [n, C, S, S] tensor of the model's native square
    size: images of their own sizes (`ImageList`), or a family's own preprocessed form (e.g.
    Qwen2.5-VL's flattened patches with their grids). Core code (CP, the batch checks, the
    metrics) reads only these; the family's encode_images reads the rest. In batch order
    (rows in order, each in reading order)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: slice) -> Images:
        """The images `index` selects (a contiguous range), in order."""

    @abstractmethod
    def to(self, device: torch.device | str) -> ImageSet: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) in pixels of each image as it enters the encoder (a batch's
        fingerprint: step.check_same_batch)."""

    @abstractmethod
    def slots(self) -> list[int]:
        """Each image's embeddings: the slots it takes in a row (encode_images' rows)."""

    @abstractmethod
    def patches(self) -> list[int]:
        """Each image's encoder patches: what cp_vision = "shard" balances."""

    @abstractmethod
    def work(self) -> list[float]:
        """Each image's encoder work in units of one native-size image (LayoutCost.image
        prices one)."""


@dataclass(frozen=True)
class ImageList(ImageSet):
    """A batch's images when they are not all at the model's native square size
    (data.native_resolution_pixels > 0): `tensors`, each [C, h, w] (h, w multiples of the patch
    size), in batch order (rows in order, each in reading order). Never empty: an empty
    selection is the empty [0, C, S, S] tensor of the fixed-size path (`__getitem__`).
    `native`: the geometry they were fitted by; its native patch count is the unit of
    `work`."""

    tensors: tuple[torch.Tensor, ...]
    native: NativeResolution

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("ImageList: no images (an empty batch is a [0, C, S, S] tensor)")

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index: slice) -> Images:
        """The images `index` selects, in order; none: an empty [0, C, S, S] tensor (S the
        native size) on their device."""
        picked = self.tensors[index]
        if picked:
            return ImageList(picked, self.native)
        first, s = self.tensors[0], self.native.image_size
        return first.new_zeros((0, first.shape[0], s, s))

    def to(self, device: torch.device | str) -> ImageList:
        return ImageList(tuple(t.to(device) for t in self.tensors), self.native)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) of each image, in order."""
        return [(t.shape[1], t.shape[2]) for t in self.tensors]

    def slots(self) -> list[int]:
        return [self.native.image_tokens(h, w) for h, w in self.sizes()]

    def patches(self) -> list[int]:
        return [self.native.patches(h, w) for h, w in self.sizes()]

    def work(self) -> list[float]:
        return [n / self.native.native_patches for n in self.patches()]


# A batch's images in batch order: one [n, C, S, S] tensor when every image has the model's
# native size S (always with data.native_resolution_pixels = 0; n may be 0), else an ImageSet.
Images = torch.Tensor | ImageSet


def num_images(images: Images) -> int:
    return images.shape[0] if isinstance(images, torch.Tensor) else len(images)


def image_sizes(images: Images) -> list[tuple[int, int]]:
    """(height, width) of each image of a batch, in batch order."""
    if isinstance(images, torch.Tensor):
        return [(images.shape[2], images.shape[3])] * images.shape[0]
    return images.sizes()


def image_slot_counts(images: Images, tokens_per_image: int) -> list[int]:
    """The slots (embeddings) of each image of a batch: `tokens_per_image` each for a tensor
    batch (the model's native size), else the ImageSet's own."""
    if isinstance(images, torch.Tensor):
        return [tokens_per_image] * images.shape[0]
    return images.slots()


def image_patches(images: Images) -> list[int]:
    """Each image's encoder patches (what cp_vision = "shard" balances); a native-size tensor
    batch counts 1 each (its images all have the same patches, so only the count matters)."""
    if isinstance(images, torch.Tensor):
        return [1] * images.shape[0]
    return images.patches()


def vit_work(images: Images) -> list[float]:
    """Each image's ViT work in native-image units: its patches / the patches of an image at the
    model's native size (1.0 for every image of a tensor batch, whose images have that size)."""
    if isinstance(images, torch.Tensor):
        return [1.0] * images.shape[0]
    return images.work()


# How many slots an image takes: an int, the same for every image (each at the model's native
# size), or the native-resolution geometry, whose `image_tokens` of the size the image enters the
# ViT at (a decoded image's shape, an ImageRef's size) is the count.
SlotRule = int | NativeResolution


# Token ids (a plain list is trained text, a Prompt is context), or one image: a [3, H, W] tensor
# in [-1, 1], or before decoding its file (ImageRef).
Part = list[int] | torch.Tensor | ImageRef


def is_image(part: Part) -> TypeIs[torch.Tensor | ImageRef]:
    return not isinstance(part, list)


def image_slots(part: torch.Tensor | ImageRef, rule: SlotRule) -> int:
    """The slots one image part takes under `rule` (SlotRule)."""
    if isinstance(rule, int):
        return rule
    if isinstance(part, torch.Tensor):
        return rule.image_tokens(part.shape[1], part.shape[2])
    if part.size is None:
        raise ValueError(f"{part.path}: an image whose size was not read (native resolution)")
    return rule.image_tokens(*part.size)


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

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.images.to(device),
            self.tokens.to(device),
            self.labels.to(device),
            self.doc.to(device),
            self.image.to(device),
            {k: v.to(device) for k, v in self.slot_data.items()},
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
) -> Batch:
    """Rows of samples (each row's samples must fit in seq_len slots) into one Batch; each image
    takes the slots `tokens_per_image` (a SlotRule) gives it. Image slots hold `image_id`
    (default: the pad id); the decoder never reads it (the image embeddings take those slots),
    it only makes dumps readable, as LLaVA's <image> token does. The images are one
    [n, 3, S, S] tensor when all have the native size S = `image_size` (always under an int
    rule), else an ImageList (the rule is then a NativeResolution)."""
    n = len(rows)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    context = torch.zeros((n, seq_len), dtype=torch.bool)  # Prompt slots: never a target
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    doc = torch.full((n, seq_len), -1, dtype=torch.long)
    image = torch.full((n, seq_len), -1, dtype=torch.long)
    images: list[torch.Tensor] = []
    for b, samples in enumerate(rows):
        at = 0
        for d, sample in enumerate(samples):
            size = sample.num_slots(tokens_per_image)
            if at + size > seq_len:
                raise ValueError(f"row {b}: samples take more than seq_len={seq_len} slots")
            doc[b, at : at + size] = d
            for part in sample.parts:
                if isinstance(part, torch.Tensor):
                    slots = image_slots(part, tokens_per_image)
                    image[b, at : at + slots] = len(images)
                    if image_id is not None:
                        tokens[b, at : at + slots] = image_id
                    images.append(part)
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
    native = all(p.shape[1:] == (image_size, image_size) for p in images)
    if native or isinstance(tokens_per_image, int):
        stacked = torch.stack(images) if images else torch.zeros(0, 3, image_size, image_size)
        return Batch(stacked, tokens, labels, doc, image)
    return Batch(ImageList(tuple(images), tokens_per_image), tokens, labels, doc, image)


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
