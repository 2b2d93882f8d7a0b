"""Where each token of a batch row sits, how the row is split over a CP group, and which
query-key blocks the attention computes.

A row is one or more samples packed back to back; a sample is text and images in reading order
(an image is `tokens_per_image` consecutive slots). Each slot of the row carries:

    doc    the sample it belongs to (-1: padding, which attends to nothing and is seen by nothing)
    order  its row position (the causal order)
    image  the image it belongs to within the row (-1: text)

The decoder's one mask rule: a query q sees a key k iff

    doc(q) == doc(k) >= 0  and  (order(k) <= order(q)
                                 or image(q) == image(k) >= 0
                                    with model.image_attention = "bidirectional")

so attention never crosses a sample boundary, text sees an image only if the image comes before
it, and the tokens of one image see each other causally or all at once.

The CP split (`build_layout`), per sample, one of two:

  split   its text is padded to a multiple of 2P and cut into 2P chunks; each rank gets one
          head-tail pair of chunks (j, 2P-1-j): a light and a heavy piece of its causal
          triangle, dealt by cost so images inside the text and padding do not pile up on one
          rank; its image slots are held by EVERY rank (replicated, the seed's design), or,
          with parallelism.cp_image_tokens = "shard", cut head-tail with the text (the chunks
          are of all its slots, so an image may be split between ranks). Only this text (and
          sharded image slots) crosses the CP group.
  whole   the sample, text and images, is kept on one rank: no padding, nothing sent, no copy.

parallelism.cp_sample_placement = "split" splits every sample (pairs dealt over the whole
batch); "auto" decides per row (shard_batch joins a batch's rows into one first, so no rank pads
every row to the longest): the cost model (`LayoutCost`: linear work per slot, attention pairs,
ViT images) prices each rank's load, short samples are dealt whole to the least-loaded rank,
largest first, and the samples whose split lowers the busiest rank are split (`_place_row`).

    samples a (long, image I), b, c, d (short; c with image J), P = 2, "auto":
    rank 0: | I | a0 a3 | b  c(J inline) |      [images | texts[0] | kept[0]]
    rank 1: | I | a1 a2 | d              |      [images | texts[1] | kept[1]]

    the same with cp_image_tokens = "shard" (a's chunks 0..3 now cut from text and I alike):
    rank 0: | a0 a3(I1) | b  c(J inline) |      I1, I2: I's slots in chunks 3 and 1
    rank 1: | a1(I2) a2 | d              |

Local slots on rank r: `[images, texts[r], kept[r]]` (SeqLayout): the split samples' replicated
image slots (the same on every rank), r's share of the split samples' text (sharded image slots
among it), and the samples r keeps whole (their image slots among their text).

Blocks, not masks: the slots of any sequence of metadata (a rank's local slots, another rank's
text, everything gathered) fall into *pieces*: maximal runs of one sample and one image (or
text) at consecutive row positions. Chunk and image boundaries cut every such sequence in the
same places, so between a query piece and a key piece of the same sample visibility is all,
nothing, or the causal diagonal (the same piece); with bidirectional images, pieces of one image
see each other all, wherever they are (a sharded image's later pieces too). Attention is then a
list of dense and causal blocks (`plan`): no kernel needs an arbitrary mask, and no masked-out
pair is computed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from titan_vlm.varlen import Block, PackedPlan, pack

if TYPE_CHECKING:
    from titan_vlm.parallel.cp_attention import Algorithm

ALL_ROWS = slice(None)
# parallelism.cp_sample_placement and parallelism.cp_image_tokens (their config Literals)
SAMPLE_PLACEMENTS = ("split", "auto")
IMAGE_TOKEN_MODES = ("replicate", "shard", "auto")


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


def _relation(q: Piece, k: Piece, bidirectional_images: bool) -> str | None:
    """How the query piece sees the key piece of the same sample: "dense", "causal" or None."""
    q_end, k_end = q.order + q.stop - q.start, k.order + k.stop - k.start
    same_range = (q.order, q_end) == (k.order, k_end)
    if q.image >= 0 and q.image == k.image:
        if bidirectional_images:  # the whole image, also its pieces after q (a sharded image)
            return "dense"
        if same_range:
            return "causal"
    if k_end <= q.order:
        return "dense"
    if k.order >= q_end:
        return None
    if same_range:
        return "causal"
    raise RuntimeError(
        f"pieces overlap partially (query rows {q.order}..{q_end}, key rows {k.order}..{k_end}): "
        "the slots were not cut at the same boundaries"
    )


def _merge_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _plan_row(
    qp: list[Piece], kp: list[Piece], rows: slice, bidirectional_images: bool
) -> list[Block]:
    by_doc: dict[int, list[Piece]] = {}
    for p in kp:
        by_doc.setdefault(p.doc, []).append(p)
    causal: list[Block] = []
    dense: dict[tuple[int, int], list[tuple[int, int]]] = {}  # query piece -> key ranges
    for q in qp:
        for k in by_doc.get(q.doc, ()):
            rel = _relation(q, k, bidirectional_images)
            if rel == "causal":
                causal.append((rows, slice(q.start, q.stop), slice(k.start, k.stop), True))
            elif rel == "dense":
                dense.setdefault((q.start, q.stop), []).append((k.start, k.stop))
    # Fewer, larger kernel calls: neighbouring key pieces of one query piece become one block,
    # then neighbouring query pieces with the same key blocks.
    by_keys: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
    for q_range, k_ranges in dense.items():
        by_keys.setdefault(tuple(_merge_runs(k_ranges)), []).append(q_range)
    blocks = causal
    for k_runs, q_ranges in by_keys.items():
        for qa, qb in _merge_runs(q_ranges):
            blocks.extend((rows, slice(qa, qb), slice(ka, kb), False) for ka, kb in k_runs)
    return blocks


def plan(q: Slots, k: Slots, bidirectional_images: bool) -> list[Block]:
    """The dense and causal blocks that compute attention of the query slots over the key
    slots exactly under the mask rule. Rows with the same metadata share one plan."""
    if q.same_for_all_rows() and k.same_for_all_rows():
        return _plan_row(pieces(q, 0), pieces(k, 0), ALL_ROWS, bidirectional_images)
    out: list[Block] = []
    for b in range(q.doc.shape[0]):
        out.extend(_plan_row(pieces(q, b), pieces(k, b), slice(b, b + 1), bidirectional_images))
    return out


class PlanCache:
    """The plans of one batch by key, made once. A plain object, not a dict, so that every copy
    of the layout shares it: FSDP's mixed-precision input casting rebuilds dataclasses (and
    dicts) field by field for every block it wraps, which would start each copy empty."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key: tuple, make: Callable[[], object]) -> Any:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def clear(self) -> None:
        self._made.clear()


class LayoutHandle(OpaqueBase):
    """The layout as the attention op's opaque argument (a torch.library reference type):
    torch.compile passes it to the op as a graph input without looking inside, so a new batch's
    layout neither breaks the graph nor recompiles it. It also keeps what a kernel's backward
    needs from its forward besides tensors (its "aux": RNG state, padded lengths), under a token
    the op returns; nothing here holds activations."""

    def __init__(self, layout: SeqLayout):
        self.layout = layout
        self._kept: dict[int, object] = {}
        self._next = 0

    def keep(self, aux: object) -> torch.Tensor:
        """Keep `aux` until `take`; the token is a 0-dim int64 tensor."""
        self._next += 1
        self._kept[self._next] = aux
        return torch.tensor(self._next)

    def take(self, token: torch.Tensor) -> object:
        """The aux kept under `token`. Kept, not popped: a backward may run again on the same
        forward (retain_graph); the handle dies with its batch's layout."""
        return self._kept[int(token)]


register_opaque_type(LayoutHandle, typ="reference")


@dataclass(frozen=True)
class LayoutCost:
    """What a CP rank's share of a step costs, in one unit (model FLOPs of forward and backward,
    or any multiple of them): `slot` per decoder slot the rank holds (the linear layers, norms
    and residuals run on every local slot, padding included), `pair` per attention query-key
    pair its queries compute, `image` per image its ViT encodes (cp_vision). The one cost model
    the auto placement balances and `cp_balance` reports. The default counts attention pairs
    only; the trainer takes the model family's (ModelSpec.layout_cost)."""

    slot: float = 0.0
    pair: float = 1.0
    image: float = 0.0


@dataclass
class SeqLayout:
    """The local slots of one CP rank's batch and everything attention needs to know about them.

    A sample of the batch is either split over the CP group (its text head-tail, its images on
    every rank) or kept whole on one rank (`build_layout`, parallelism.cp_sample_placement).
    Local slots on rank r, in this order:

        [images | texts[r] | kept[r]]
         N        T          W_r

    images [B, N]: the split samples' replicated image slots, the same on every rank (the
    decoder's image prefix). texts[s] [B, T]: rank s's share of the split samples' text, with
    their image slots where cp_image_tokens shards them, the only slots that cross the CP group
    (the same T on every rank). kept[s] [B, W_s]: the samples rank s keeps
    whole, text and images in row order (per row, then padding: they never travel). Every rank
    knows every rank's slots, so it can plan blocks against any of them and price them.

    positions [B, L]: RoPE position (within its sample) of each local slot; a family whose
    rotary positions are not that (M-RoPE's three per slot) carries its own in `slot_data`,
    while the causal order stays each slot's row position (Slots.order): two different things.
    image_index [B, L]: each local image slot's index into the batch's image tokens
    (`place_images`; -1: text or padding). image_counts: images per row. cost / encoded: the
    cost model and each rank's ViT work, in images of the model's own size (`rank_cost`;
    encoded None: ViT not priced). cp: None (the whole row is local) or the algorithm that makes
    attention exact across the CP group (parallel/cp_attention.py).
    """

    positions: torch.Tensor
    images: Slots
    texts: list[Slots]
    rank: int
    image_counts: list[int]
    row_positions: torch.Tensor  # [B, S] every row slot's position within its sample
    bidirectional_images: bool = False
    cp: Algorithm | None = None
    kept: list[Slots] = field(default_factory=list)  # []: no rank keeps a sample whole
    image_index: torch.Tensor | None = None  # None: made from the slots
    cost: LayoutCost = field(default_factory=LayoutCost)
    encoded: Sequence[float] | None = None
    slot_data: dict[str, torch.Tensor] = field(default_factory=dict)
    _plans: PlanCache = field(default_factory=PlanCache, repr=False)

    def __post_init__(self) -> None:
        # not a dataclass field: FSDP's input casting rebuilds dataclasses from their fields
        # (dataclasses.replace), and the rebuilt layout gets its own handle here
        self.handle = LayoutHandle(self)
        if not self.kept:
            self.kept = [_empty_slots(self.images.doc.shape[0])] * len(self.texts)
        if self.image_index is None:
            self.image_index = image_token_index(self.slots("local"), self.row_image_ids())

    @property
    def comm(self) -> str:
        """The attention algorithm: "local" or the CP algorithm's cp_comm_type."""
        return "local" if self.cp is None else self.cp.comm

    @property
    def num_image_tokens(self) -> int:
        """N: the split samples' image slots, the local slots' prefix on every rank."""
        return len(self.images)

    @property
    def travel(self) -> int:
        """T: the text slots of each rank that cross the CP group."""
        return len(self.texts[0])

    @property
    def inline_images(self) -> bool:
        """Whether this rank's text section holds image slots (the decoder places their
        embeddings among the text): its kept samples' images, its share of sharded images."""
        return bool((self.kept[self.rank].image >= 0).any()) or bool(
            (self.texts[self.rank].image >= 0).any()
        )

    def gather_slot_data(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-slot tensors of the rows, each [..., B, S], at this rank's local slots
        `[images, texts[rank], kept[rank]]`: [..., B, L], 0 at padding slots. The rows are the
        ones the layout was built on (shard_batch joins them first under "auto")."""
        order = self.slots("local").order
        out = {}
        for key, value in data.items():
            index = order.to(value.device)
            pad = index < 0
            lead = value.shape[:-2]
            picked = value.gather(-1, index.clamp(min=0).expand(*lead, *index.shape))
            out[key] = picked.masked_fill(pad.expand(*lead, *index.shape), 0)
        return out

    def row_image_ids(self) -> torch.Tensor:
        """[B, S]: the rows' image ids at their image slots, -1 elsewhere (from the slots the
        layout places)."""
        everything = Slots.cat([self.images, *self.texts, *self.kept])
        out = torch.full_like(self.row_positions, -1)
        real = everything.image >= 0
        rows = torch.arange(out.shape[0])[:, None].expand_as(real)
        out[rows[real], everything.order[real]] = everything.image[real]
        return out

    def slots(self, name: str | int, rank: int | None = None) -> Slots:
        """ "local": a rank's slots in order (class docstring); "images": the split samples'
        image slots; "all": every slot a rank's queries may see, `[images, every rank's text
        (rank-major, as an all-gather delivers it), kept]`; "shared": the split samples' slots,
        `[images, every rank's text]` (what the all-to-all carries); "kept": the rank's kept
        slots; an int s: rank s's text."""
        r = self.rank if rank is None else rank
        if name == "local":
            return Slots.cat([self.images, self.texts[r], self.kept[r]])
        if name == "images":
            return self.images
        if name == "all":
            return Slots.cat([self.images, *self.texts, self.kept[r]])
        if name == "shared":
            return Slots.cat([self.images, *self.texts])
        if name == "kept":
            return self.kept[r]
        if isinstance(name, str):
            raise ValueError(
                f"slots: unknown name {name!r} (local, images, all, shared, kept or a CP rank)"
            )
        return self.texts[name]

    def blocks(self, queries: str, keys: str | int, rank: int | None = None) -> list[Block]:
        """The block plan of `queries` over `keys` (names as in `slots`), made once per batch and
        reused by every layer and by backward."""
        key = (queries, keys, self.rank if rank is None else rank)
        return self._plans.get(
            key,
            lambda: plan(
                self.slots(queries, rank), self.slots(keys, rank), self.bidirectional_images
            ),
        )

    def packed(self, queries: str, keys: str | int, rank: int | None = None) -> PackedPlan:
        """`blocks(queries, keys, rank)` packed into varlen calls (varlen.pack), made once per
        batch."""
        key = ("packed", queries, keys, self.rank if rank is None else rank)
        return self._plans.get(
            key,
            lambda: pack(
                self.blocks(queries, keys, rank),
                self.slots(queries, rank).order,
                self.slots(keys, rank).order,
            ),
        )

    def rank_work(self) -> list[int]:
        """Query-key pairs each CP rank's queries (its local slots) compute against the whole
        row under the mask rule: what the ring and all-gather algorithms run on each rank
        (tests/test_layout.py checks it against the block plans). A query sees the earlier
        slots of its sample and itself, `position in sample + 1` keys, and with bidirectional
        images also the rest of its image: no plan is needed, so every step can afford it."""
        images = self._keys_seen(self.images)
        return [
            images + self._keys_seen(self.texts[r]) + self._keys_seen(self.kept[r])
            for r in self._ranks()
        ]

    def kept_work(self) -> list[int]:
        """Query-key pairs of the samples each CP rank keeps whole (part of `rank_work`; the
        all-to-all algorithm computes them on every head of their rank)."""
        return [self._keys_seen(self.kept[r]) for r in self._ranks()]

    def whole_work(self) -> int:
        """Query-key pairs of the whole rows, as one device computes them: the split samples'
        image slots once, every rank's text and kept slots (the model FLOPs count this; the
        same as `rank_work()[0]` of the rows' layout at cp=1)."""
        own = sum(self._keys_seen(s) for s in (*self.texts, *self.kept))
        return self._keys_seen(self.images) + own

    def rank_slots(self) -> list[int]:
        """Local slots (padding included) of each CP rank's batch: B x (N + T + W_r)."""
        rows = self.images.doc.shape[0]
        return [rows * (len(self.images) + self.travel + len(self.kept[r])) for r in self._ranks()]

    def rank_cost(self) -> list[float]:
        """Each CP rank's modelled cost (LayoutCost): its slots, its attention pairs and the
        images its ViT encodes."""
        c, encoded = self.cost, self.encoded or [0] * len(self.texts)
        return [
            c.slot * slots + c.pair * pairs + c.image * images
            for slots, pairs, images in zip(self.rank_slots(), self.rank_work(), encoded)
        ]

    def balance(self) -> float:
        """cp_balance: max/mean of `rank_cost` over the CP ranks (1.0 is perfect)."""
        w = self.rank_cost()
        return max(w) / (sum(w) / len(w)) if sum(w) > 0 else 1.0

    def padding(self) -> float:
        """cp_padding: the padding fraction of the busiest rank's local slots (of the ranks with
        the most slots, the largest): the split's padding (samples cut into 2P chunks, rows of
        different lengths, sequence parallelism's multiple, the 2-slot floors of "auto"); the
        rows' own unused slots are never placed."""
        slots = self.rank_slots()
        out = 0.0
        for r in self._ranks():
            if slots[r] != max(slots):
                continue
            held = Slots.cat([self.images, self.texts[r], self.kept[r]]).doc
            if held.numel():
                out = max(out, float((held < 0).sum()) / held.numel())
        return out

    def kept_samples(self) -> list[int]:
        """Samples each CP rank keeps whole (over all rows)."""
        return [_count_samples([k]) for k in self.kept]

    def split_samples(self) -> int:
        """Samples split over the CP group (over all rows)."""
        return _count_samples([self.images, *self.texts])

    def replicated_images(self) -> int:
        """Images of split samples whose slots every rank holds (cp_image_tokens)."""
        return _count_images([self.images])

    def sharded_images(self) -> int:
        """Images of split samples whose slots are cut over the CP group with their text."""
        return _count_images(self.texts)

    def _ranks(self) -> range:
        return range(len(self.texts))

    def _keys_seen(self, s: Slots) -> int:
        """The keys the queries of `s` see under the mask rule, summed (`rank_work`)."""
        row_image = self._plans.get(("row_image",), self.row_image_ids)
        return int(keys_seen(s, self.row_positions, row_image, self.bidirectional_images).sum())

    def place_images(self, embeds: torch.Tensor) -> torch.Tensor:
        """The batch's image embeddings [n_images, tokens_per_image, D] (batch order) into the
        image prefix of this rank's local slots: [B, N, D], zeros in padding slots.
        Differentiable."""
        return _pick(embeds, self._image_index()[:, : self.num_image_tokens])

    def inline_embeds(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """The embeddings [M, D] of the image slots among this rank's text section (its kept
        samples' images), at `inline_slots`; None: there are none."""
        if not self.inline_images:
            return None
        index = self._image_index()[:, self.num_image_tokens :]
        return _pick(embeds, index[index >= 0])

    def inline_slots(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of `inline_embeds`' slots within the text section [B, T + W]."""
        index = self._image_index()[:, self.num_image_tokens :]
        rows, cols = (index >= 0).nonzero(as_tuple=True)
        return rows.to(device), cols.to(device)

    def _image_index(self) -> torch.Tensor:
        assert self.image_index is not None  # set in __post_init__
        return self.image_index


def _pick(embeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """embeds [n, tokens, D] flattened to image tokens, at `index` (any shape; -1: zeros).
    Always connected to `embeds` in autograd, also when there is no image."""
    flat = embeds.reshape(-1, embeds.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
    index = index.to(flat.device)
    return padded[index.masked_fill(index < 0, flat.shape[0])]


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


def head_tail_pairs(index: torch.Tensor, cp_size: int) -> list[torch.Tensor]:
    """One sample's text positions, padded with -1 to a multiple of 2P and cut into 2P chunks;
    pair j is chunks j and 2P-1-j (one light and one heavy piece of the causal triangle)."""
    if cp_size == 1:
        return [index]
    chunks = 2 * cp_size
    padded = torch.nn.functional.pad(index, (0, -len(index) % chunks), value=-1).view(chunks, -1)
    return [torch.cat([padded[j], padded[chunks - 1 - j]]) for j in range(cp_size)]


def _deal_pairs(costs: list[list[int]], cp_size: int) -> list[list[int]]:
    """Which pair of each sample each rank gets: samples in order of decreasing cost, each
    dealing its pairs, dearest first, to the ranks with the least work so far (longest
    processing time first). Every rank gets one pair of every sample, so the slot counts stay
    equal; the costs even out what images and padding unbalance."""
    loads = [0.0] * cp_size
    deal: list[list[int]] = [[] for _ in costs]
    for s in sorted(range(len(costs)), key=lambda s: -sum(costs[s])):
        deal[s] = _deal_pairs_onto(0.0, [float(x) for x in costs[s]], loads)
    return deal


@dataclass
class _Sample:
    """One sample of a row, priced every way it can be placed (`_place_row`)."""

    text: torch.Tensor  # its text slots' row positions
    images: torch.Tensor  # its image slots' row positions
    # the head-tail pairs (head_tail_pairs) of its text, or, with `shard`, of all its slots
    pairs: list[torch.Tensor]
    pair_work: list[int]  # attention pairs of each head-tail pair's queries
    image_work: int  # attention pairs of its image queries
    # split with its image slots cut head-tail with its text (cp_image_tokens = "shard"), else
    # its image slots on every rank
    shard: bool = False
    # where it goes: -1 split (pair deal[r] to rank r), else the rank that keeps it whole
    rank: int = -1
    deal: list[int] = field(default_factory=list)

    def whole_cost(self, c: LayoutCost) -> float:
        slots = len(self.text) + len(self.images)
        image_work = 0 if self.shard else self.image_work  # sharded: counted in pair_work
        return c.slot * slots + c.pair * (sum(self.pair_work) + image_work)

    def split_costs(self, c: LayoutCost) -> tuple[float, list[float]]:
        """What splitting it costs every rank (its image slots, where replicated) and each
        pair."""
        on_every = 0.0 if self.shard else c.slot * len(self.images) + c.pair * self.image_work
        return on_every, [c.slot * len(p) + c.pair * w for p, w in zip(self.pairs, self.pair_work)]

    def replicated_images(self) -> torch.Tensor:
        """Its image slots every rank holds when it is split (none if sharded)."""
        return self.images[:0] if self.shard else self.images


# cp_sample_placement = "auto" considers splitting only the costliest samples: at most this many,
# and none below 1/SPLIT_FRACTION of a rank's mean load (dealt whole, such samples leave the
# ranks at most that far apart; the search stays O(MAX_SPLIT_CANDIDATES^2) placements per row).
MAX_SPLIT_CANDIDATES = 16
SPLIT_FRACTION = 8
# A further split (or sharding a split sample's images, cp_image_tokens = "auto") is taken only
# when it lowers the busiest rank's modelled cost by at least this fraction: the cost model
# prices compute, not communication, and every split sends its slots around the group, so a
# split that buys a fraction of a percent of balance is not worth its traffic (on the SFT mix of
# benchmarks/cp_layouts.py at cp = 8, splitting every sample balances to 1.004 but sends 120x
# the bytes of splitting the two that bring the busiest rank within 1%).
MIN_SPLIT_GAIN = 0.01


def _place_row(samples: list[_Sample], cp_size: int, c: LayoutCost, base: list[float]) -> None:
    """cp_sample_placement = "auto" for one row: which samples to split head-tail (their pairs dealt
    dearest first to the least-loaded ranks, their images on every rank) and which to deal
    whole, costliest first, to the least-loaded rank (longest processing time first), so that
    the busiest rank costs least. The split set: the k costliest samples for the best k (or
    every sample), then, one at a time, whichever further sample's split lowers the busiest rank
    most (a sample with images costs its image slots on every rank when split, so the costliest
    is not always the one to split); ties keep fewer splits (less traffic). Only the costliest
    samples are candidates (MAX_SPLIT_CANDIDATES, SPLIT_FRACTION). Loads start at `base` (each
    rank's ViT share). Sets each sample's `rank` and `deal`."""
    whole = [s.whole_cost(c) for s in samples]
    by_cost = sorted(range(len(samples)), key=lambda i: (-whole[i], i))
    mean_load = (sum(whole) + sum(base)) / cp_size
    candidates = [i for i in by_cost if whole[i] * SPLIT_FRACTION >= mean_load]
    candidates = candidates[:MAX_SPLIT_CANDIDATES]
    split_costs: dict[int, tuple[float, list[float]]] = {}

    def place(split: list[int]) -> tuple[float, list[list[int]], list[int]]:
        loads = list(base)
        deals = []
        for i in split:
            if i not in split_costs:
                split_costs[i] = samples[i].split_costs(c)
            deals.append(_deal_pairs_onto(*split_costs[i], loads))
        chosen = set(split)
        heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
        owners = []
        for i in by_cost:
            if i in chosen:
                continue
            load, r = heapq.heappop(heap)  # the least-loaded rank (lowest index on a tie)
            owners.append(r)
            heapq.heappush(heap, (load + whole[i], r))
        return max(load for load, _ in heap), deals, owners

    def better(a: float, b: float) -> bool:
        return a < b * (1 - MIN_SPLIT_GAIN)

    split: list[int] = []
    busiest = place(split)[0]
    # the k costliest candidates, and every sample ("split"'s choice, dealt as auto deals)
    for option in [candidates[:k] for k in range(1, len(candidates) + 1)] + [by_cost]:
        cost = place(option)[0]
        if better(cost, busiest):
            split, busiest = option, cost
    while True:
        trials = [(place(split + [i])[0], i) for i in candidates if i not in split]
        if not trials:
            break
        cost, i = min(trials)
        if not better(cost, busiest):
            break
        split, busiest = split + [i], cost
    split = sorted(split, key=by_cost.index)  # dealt costliest first
    _, deals, owners = place(split)
    for i, deal in zip(split, deals):
        samples[i].rank, samples[i].deal = -1, deal
    for i, r in zip([i for i in by_cost if i not in split], owners):
        samples[i].rank = r


def _deal_pairs_onto(on_every: float, pair_costs: list[float], loads: list[float]) -> list[int]:
    """Deal one split sample's pairs onto `loads` (updated): dearest pair to the least-loaded
    rank; every rank also pays `on_every` (its replicated image slots). Which pair each rank
    gets."""
    pairs = sorted(range(len(loads)), key=lambda j: -pair_costs[j])
    ranks = sorted(range(len(loads)), key=lambda r: (loads[r], r))
    deal = [0] * len(loads)
    for j, r in zip(pairs, ranks):
        deal[r] = j
        loads[r] += on_every + pair_costs[j]
    return deal


def _sample_runs(doc: torch.Tensor, row: int) -> list[tuple[int, int]]:
    """[start, stop) of each sample of one row's `doc` [S], in row order. A sample's slots are
    consecutive (data/batch.py packs samples back to back): anything else is an error."""
    ids, counts = torch.unique_consecutive(doc, return_counts=True)
    stops = counts.cumsum(0)
    runs = [(int(z - n), int(z)) for d, n, z in zip(ids.tolist(), counts, stops) if d >= 0]
    real = ids[ids >= 0].tolist()
    if len(set(real)) != len(real):
        twice = sorted({d for d in real if real.count(d) > 1})[:5]
        raise ValueError(f"row {row}: the slots of sample(s) {twice} are not consecutive")
    return runs


def _stack_padded(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    return (
        torch.stack([torch.nn.functional.pad(r, (0, length - len(r)), value=-1) for r in rows])
        if rows
        else torch.zeros(0, length, dtype=torch.long)
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def build_layout(
    doc: torch.Tensor,
    image: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    bidirectional_images: bool = False,
    pad_to_multiple: int = 1,
    placement: str = "split",
    cost: LayoutCost | None = None,
    encoded: Sequence[float] | None = None,
    image_tokens: str = "replicate",
) -> tuple[torch.Tensor, SeqLayout]:
    """Split rows with slot metadata doc/image [B, S] for CP rank `cp_rank` of `cp_size`.

    Returns the row positions of this rank's text section `[texts[r], kept[r]]` [B, T + W] (-1:
    padding; kept samples' image slots among them) and its SeqLayout. `placement`
    (parallelism.cp_sample_placement): "split" splits every sample (its text head-tail, its
    images on every rank; the pairs dealt by cost over the whole batch); "auto" decides per row
    which samples to keep whole on one rank (`_place_row`, by `cost`, with `encoded` images on
    each rank's ViT; shard_batch joins a batch's rows into one first). With cp_size 1 the text
    is the whole row's text, in row order. Each rank's local slot count is padded (with kept
    padding slots, which cost no attention and never travel) to a multiple of `pad_to_multiple`.

    `image_tokens` (parallelism.cp_image_tokens): a split sample's image slots are "replicate"d
    on every rank (the images prefix) or "shard"ed: cut head-tail with its text, each rank
    holding its share among its text (they travel like text); "auto" builds both and keeps the
    one whose busiest rank the cost model prices lower (`rank_cost`; a tie keeps replicate,
    which sends less).
    """
    if placement not in SAMPLE_PLACEMENTS:
        raise ValueError(
            f"parallelism.cp_sample_placement must be one of {SAMPLE_PLACEMENTS}, got {placement!r}"
        )
    if image_tokens not in IMAGE_TOKEN_MODES:
        raise ValueError(
            f"parallelism.cp_image_tokens must be one of {IMAGE_TOKEN_MODES}, got {image_tokens!r}"
        )
    if image_tokens == "auto" and (cp_size == 1 or not bool((image >= 0).any())):
        image_tokens = "replicate"  # no image to shard: the two layouts are the same
    if image_tokens == "auto":
        built = [
            build_layout(
                doc,
                image,
                cp_size,
                cp_rank,
                bidirectional_images,
                pad_to_multiple,
                placement,
                cost,
                encoded,
                mode,
            )
            for mode in ("replicate", "shard")
        ]
        replicated, sharded = (max(lay.rank_cost()) for _, lay in built)
        return built[1] if sharded < replicated * (1 - MIN_SPLIT_GAIN) else built[0]
    cost = cost or LayoutCost()
    rows, seq = doc.shape
    doc, image = doc.cpu(), image.cpu()
    positions = torch.arange(seq)
    rope = []
    samples: list[_Sample] = []
    by_row: list[list[_Sample]] = [[] for _ in range(rows)]
    runs = [_sample_runs(doc[b], b) for b in range(rows)]
    for b in range(rows):
        start = torch.zeros(seq, dtype=torch.long)  # first row position of each slot's sample
        for a, z in runs[b]:
            start[a:z] = a
        rope.append(positions - start)
    row_positions = torch.stack(rope)
    row = Slots(doc, positions.expand(rows, seq), image)
    seen = keys_seen(row, row_positions, image, bidirectional_images)  # [B, S]
    for b in range(rows):
        for a, z in runs[b]:
            where = positions[a:z]
            is_image = image[b, a:z] >= 0
            text, pictures = where[~is_image], where[is_image]
            shard = image_tokens == "shard" and cp_size > 1 and len(pictures) > 0
            pairs = head_tail_pairs(where if shard else text, cp_size)
            work = [int(seen[b, p[p >= 0]].sum()) for p in pairs]
            priced = _Sample(text, pictures, pairs, work, int(seen[b, pictures].sum()), shard)
            samples.append(priced)
            by_row[b].append(priced)
    if placement == "auto" and cp_size > 1:
        # each rank's ViT share, spread evenly over the rows (the ViT runs on the batch)
        vit = [cost.image * e / max(rows, 1) for e in (encoded or [0] * cp_size)]
        for b in range(rows):
            _place_row(by_row[b], cp_size, cost, vit)
    else:
        for s, deal in zip(samples, _deal_pairs([s.pair_work for s in samples], cp_size)):
            s.deal = deal
    shared_images = [
        _cat([s.replicated_images() for s in by_row[b] if s.rank < 0]) for b in range(rows)
    ]
    texts_at: list[list[torch.Tensor]] = [[] for _ in range(cp_size)]
    kept_at: list[list[torch.Tensor]] = [[] for _ in range(cp_size)]
    for r in range(cp_size):
        for b in range(rows):
            split = [s for s in by_row[b] if s.rank < 0]
            whole = [s for s in by_row[b] if s.rank == r]
            texts_at[r].append(_cat([s.pairs[s.deal[r]] for s in split]))
            kept_at[r].append(_cat([x for s in whole for x in (s.images, s.text)]).sort().values)

    def longest(xs: list[torch.Tensor]) -> int:
        return max((len(x) for x in xs), default=0)

    n = longest(shared_images)
    t = max(longest(x) for x in texts_at)
    if placement == "auto" and cp_size > 1:
        # Under "auto" a batch often splits no sample, or no image: N or T would be 0 (or 1),
        # sizes torch.compile specialises on, so each would cost the attention op's blocks a
        # recompile (with selective AC, two) until dynamo's limit. Two padding slots instead.
        n, t = max(n, 2), max(t, 2)
    images = Slots.gather(doc, image, _stack_padded(shared_images, n))
    texts = [Slots.gather(doc, image, _stack_padded(x, t)) for x in texts_at]
    kept: list[Slots] = []
    for r in range(cp_size):
        # at least one slot: a rank that holds nothing (a batch of one short sample) still runs
        # the model on a padding slot, which attends to nothing and carries no label
        w = max(longest(kept_at[r]), int(n + t == 0))
        w += -(n + t + w) % pad_to_multiple
        kept.append(Slots.gather(doc, image, _stack_padded(kept_at[r], w)))
    local = Slots.cat([images, texts[cp_rank], kept[cp_rank]])
    order = local.order
    rope_pos = row_positions.gather(1, order.clamp(min=0)).masked_fill(order < 0, 0)
    image_counts = [len(torch.unique(i[i >= 0])) for i in image]
    layout = SeqLayout(
        rope_pos,
        images,
        texts,
        cp_rank,
        image_counts,
        row_positions,
        bidirectional_images,
        kept=kept,
        image_index=image_token_index(local, image),
        cost=cost,
        encoded=encoded,
    )
    return order[:, n:], layout
