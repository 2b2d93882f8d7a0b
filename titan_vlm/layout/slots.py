"""Slot metadata and the mask rule (the package docstring): `Slots` (doc, order, image of each
slot of a sequence), `visible` (the rule as a dense mask, for checks), `pieces` (maximal runs of
one sample and one image at consecutive row positions, what block plans are made of),
`keys_seen` (how many keys each query sees: the closed form the cost model prices) and
`image_token_index` (each image slot's index into the batch's image tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slots:
    """Metadata of a sequence of token slots, [B, L] each (see the module docstring)."""

    doc: torch.Tensor
    order: torch.Tensor
    image: torch.Tensor

    def __len__(self) -> int:
        return self.doc.shape[1]

    @staticmethod
    def cat(parts: list[Slots]) -> Slots:
        return Slots(
            *(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("doc", "order", "image"))
        )

    @staticmethod
    def gather(doc: torch.Tensor, image: torch.Tensor, index: torch.Tensor) -> Slots:
        """The slots at row positions `index` [B, L] (-1: a padding slot)."""
        safe = index.clamp(min=0)
        pad = index < 0
        return Slots(
            doc.gather(1, safe).masked_fill(pad, -1),
            index.clone(),
            image.gather(1, safe).masked_fill(pad, -1),
        )

    def same_for_all_rows(self) -> bool:
        """Whether every row has the same metadata, image ids counted from the row's first image
        (ids number the batch's images, so identical rows still differ in them)."""
        if self.image.numel() == 0:
            return True
        first = torch.where(self.image >= 0, self.image, self.image.max() + 1).amin(1, keepdim=True)
        image = torch.where(self.image >= 0, self.image - first, -1)
        return all(bool((t == t[:1]).all()) for t in (self.doc, self.order, image))


def visible(q: Slots, k: Slots, bidirectional_images: bool) -> torch.Tensor:
    """The mask rule as a dense [B, Lq, Lk] bool tensor (for checks and small workloads)."""
    same_doc = (q.doc[:, :, None] == k.doc[:, None, :]) & (q.doc[:, :, None] >= 0)
    seen = k.order[:, None, :] <= q.order[:, :, None]
    if bidirectional_images:
        seen = seen | ((q.image[:, :, None] == k.image[:, None, :]) & (q.image[:, :, None] >= 0))
    return same_doc & seen


@dataclass(frozen=True)
class Piece:
    start: int  # local slot index
    stop: int
    doc: int
    image: int
    order: int  # row position of the first slot


def pieces(s: Slots, row: int) -> list[Piece]:
    """Maximal runs of one sample and one image (or text) at consecutive row positions."""
    doc, order, image = s.doc[row], s.order[row], s.image[row]
    length = doc.shape[0]
    if length == 0:
        return []
    cut = torch.ones(length, dtype=torch.bool)
    cut[1:] = (doc[1:] != doc[:-1]) | (image[1:] != image[:-1]) | (order[1:] != order[:-1] + 1)
    starts = cut.nonzero().flatten().tolist() + [length]
    d, o, i = doc.tolist(), order.tolist(), image.tolist()
    return [Piece(a, b, d[a], i[a], o[a]) for a, b in zip(starts[:-1], starts[1:]) if d[a] >= 0]


def keys_seen(
    s: Slots, row_positions: torch.Tensor, row_image: torch.Tensor, bidirectional_images: bool
) -> torch.Tensor:
    """[B, L]: how many keys each query slot of `s` sees under the mask rule (0 for padding):
    its position in its sample + 1, plus, with bidirectional images, the later slots of its
    image (wherever they are held: `row_image` [B, S] is the rows' image ids, -1 elsewhere, so
    a query slot of an image sharded over the CP group counts its image's slots on every
    rank)."""
    real = s.doc >= 0
    pos = row_positions.gather(1, s.order.clamp(min=0))
    seen = (pos + 1).masked_fill(~real, 0)
    if bidirectional_images and s.image.numel() and bool((s.image >= 0).any()):
        where = row_image >= 0
        at = torch.arange(row_image.shape[1]).expand_as(row_image)
        last = torch.full((int(row_image.max()) + 1,), -1, dtype=torch.long)
        last.scatter_reduce_(0, row_image[where], at[where], "amax")  # each image's last slot
        later = (last[s.image.clamp(min=0)] - s.order).masked_fill(s.image < 0, 0)
        seen = seen + later.masked_fill(~real, 0)
    return seen


def _count_samples(parts: list[Slots]) -> int:
    """Distinct (row, sample) among the slots of `parts`."""
    held = Slots.cat(parts).doc
    return sum(len(torch.unique(d[d >= 0])) for d in held)


def _count_images(parts: list[Slots]) -> int:
    """Distinct images among the slots of `parts` (image ids number the batch's images)."""
    ids = Slots.cat(parts).image
    return len(torch.unique(ids[ids >= 0]))


def _empty_slots(rows: int) -> Slots:
    none = torch.zeros(rows, 0, dtype=torch.long)
    return Slots(none, none, none)


def image_token_index(images: Slots, row_image: torch.Tensor) -> torch.Tensor:
    """[B, N]: for each image slot of `images`, its index into the batch's image tokens: the
    images in batch order (their ids), each taking as many tokens as it has slots, in row
    order (`SeqLayout.place_images`); -1 for padding. `row_image` [B, S]: the rows' image ids
    (-1 elsewhere), which give each image's size and first slot."""
    ids = images.image
    real = ids >= 0
    if not bool(real.any()):
        return torch.full_like(ids, -1)
    rows, seq = row_image.shape
    where = row_image >= 0
    n = int(row_image.max()) + 1
    counts = torch.bincount(row_image[where], minlength=n)
    first = torch.full((n,), seq, dtype=torch.long)
    pos = torch.arange(seq).expand(rows, seq)
    first.scatter_reduce_(0, row_image[where], pos[where], "amin")
    offset = torch.cumsum(counts, 0) - counts
    safe = ids.clamp(min=0)
    return torch.where(real, offset[safe] + images.order - first[safe], -1)
