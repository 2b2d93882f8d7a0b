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

The CP split (`build_layout`): every CP rank holds ALL image slots of its rows (replicated, the
seed's design), and each sample's text is padded to a multiple of 2P and cut into 2P chunks;
each rank gets one head-tail pair of chunks (j, 2P-1-j) of every sample: a light and a heavy
piece of its causal triangle. Which pair goes to which rank is dealt by cost (a text slot costs
its position in the sample + 1 keys), so images inside the text and the padding of short samples
do not pile up on one rank. Local slots on rank r: `[image slots, text slots]`.

Blocks, not masks: the slots of any sequence of metadata (a rank's local slots, another rank's
text, everything gathered) fall into *pieces*: maximal runs of one sample and one image (or
text) at consecutive row positions. Chunk and image boundaries cut every such sequence in the
same places, so between a query piece and a key piece of the same sample visibility is all,
nothing, or the causal diagonal (the same piece). Attention is then a list of dense and causal
blocks (`plan`): no kernel needs an arbitrary mask, and no masked-out pair is computed.
"""

from __future__ import annotations

from collections.abc import Callable
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
    if q.image >= 0 and q.image == k.image and same_range:
        return "dense" if bidirectional_images else "causal"
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


@dataclass
class SeqLayout:
    """The local slots of one CP rank's batch and everything attention needs to know about them.

    positions [B, N + T]: RoPE position (within its sample) of each local slot.
    images [B, N]: the rows' image slots, whole on every CP rank. texts[s] [B, T]: CP rank s's
    text slots (every rank knows every rank's, so it can plan blocks against any of them).
    image_counts: images per row, to place the batch's image embeddings.
    cp: None (the whole row is local) or the algorithm that makes attention exact across the CP
    group (parallel/cp_attention.py).
    """

    positions: torch.Tensor
    images: Slots
    texts: list[Slots]
    rank: int
    image_counts: list[int]
    row_positions: torch.Tensor  # [B, S] every row slot's position within its sample
    bidirectional_images: bool = False
    cp: Algorithm | None = None
    _plans: PlanCache = field(default_factory=PlanCache, repr=False)

    def __post_init__(self) -> None:
        # not a dataclass field: FSDP's input casting rebuilds dataclasses from their fields
        # (dataclasses.replace), and the rebuilt layout gets its own handle here
        self.handle = LayoutHandle(self)

    @property
    def comm(self) -> str:
        """The attention algorithm: "local" or the CP algorithm's cp_comm_type."""
        return "local" if self.cp is None else self.cp.comm

    @property
    def num_image_tokens(self) -> int:
        return len(self.images)

    def slots(self, name: str | int, rank: int | None = None) -> Slots:
        """ "local": a rank's `[images, its text]`; "images"; "all": `[images, every rank's text]`
        (rank-major, as an all-gather or all-to-all delivers it); an int s: rank s's text."""
        rank = self.rank if rank is None else rank
        if name == "local":
            return Slots.cat([self.images, self.texts[rank]])
        if name == "images":
            return self.images
        if name == "all":
            return Slots.cat([self.images, *self.texts])
        if isinstance(name, str):
            raise ValueError(f"slots: unknown name {name!r} (local, images, all or a CP rank)")
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
        """Query-key pairs each CP rank's queries (all image slots + its text) compute against
        the whole row under the mask rule: what the ring and all-gather algorithms run on each
        rank (tests/test_layout.py checks it against the block plans). A query sees the earlier
        slots of its sample and itself, `position in sample + 1` keys, and with bidirectional
        images also the rest of its image: no plan is needed, so every step can afford it."""
        images = self._keys_seen(self.images)
        return [images + self._keys_seen(t) for t in self.texts]

    def whole_work(self) -> int:
        """Query-key pairs of the whole rows, as one device computes them: the image slots once
        and every CP rank's text (the model FLOPs count this; the same as `rank_work()[0]` of
        the rows' layout at cp=1)."""
        return self._keys_seen(self.images) + sum(self._keys_seen(t) for t in self.texts)

    def _keys_seen(self, s: Slots) -> int:
        """The keys the queries of `s` see under the mask rule, summed (`rank_work`)."""
        real = s.doc >= 0
        pos = self.row_positions.gather(1, s.order.clamp(min=0))
        seen = (pos + 1).masked_fill(~real, 0)
        if self.bidirectional_images and s.image.numel():
            ids = s.image.clamp(min=0)
            last = torch.zeros(s.image.shape[0], int(ids.max()) + 1, dtype=torch.long)
            last.scatter_reduce_(1, ids, s.order.masked_fill(s.image < 0, -1), "amax")
            later = (last.gather(1, ids) - s.order).masked_fill(s.image < 0, 0)
            seen = seen + later.masked_fill(~real, 0)
        return int(seen.sum())

    def balance(self) -> float:
        """max/mean of `rank_work` over the CP ranks (1.0 is perfect)."""
        w = self.rank_work()
        return max(w) / max(sum(w) / len(w), 1)

    def place_images(self, embeds: torch.Tensor) -> torch.Tensor:
        """The batch's image embeddings [n_images, tokens_per_image, D] (rows in order) into the
        rows' image slots: [B, N, D], zeros in padding slots. Differentiable."""
        per_row = embeds.flatten(0, 1).split([c * embeds.shape[1] for c in self.image_counts])
        n = self.num_image_tokens
        return torch.stack([torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[0])) for x in per_row])


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
    loads = [0] * cp_size
    deal: list[list[int]] = [[] for _ in costs]
    for s in sorted(range(len(costs)), key=lambda s: -sum(costs[s])):
        pairs = sorted(range(cp_size), key=lambda j: -costs[s][j])
        ranks = sorted(range(cp_size), key=lambda r: loads[r])
        deal[s] = [0] * cp_size
        for j, r in zip(pairs, ranks):
            deal[s][r] = j
            loads[r] += costs[s][j]
    return deal


def _stack_padded(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    return (
        torch.stack([torch.nn.functional.pad(r, (0, length - len(r)), value=-1) for r in rows])
        if rows
        else torch.zeros(0, length, dtype=torch.long)
    )


def build_layout(
    doc: torch.Tensor,
    image: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    bidirectional_images: bool = False,
    pad_to_multiple: int = 1,
) -> tuple[torch.Tensor, SeqLayout]:
    """Split rows with slot metadata doc/image [B, S] for CP rank `cp_rank` of `cp_size`.

    Returns the row positions of this rank's text slots [B, T] (-1: padding) and its SeqLayout.
    With cp_size 1 the text is the whole row's text, in row order. The local slot count N + T is
    padded (with padding text slots, which cost no attention) to a multiple of `pad_to_multiple`.
    """
    rows, seq = doc.shape
    doc, image = doc.cpu(), image.cpu()
    positions = torch.arange(seq)
    image_index, rope, image_counts = [], [], []
    samples = []  # (row, head-tail pairs, cost of each pair)
    for b in range(rows):
        d, i = doc[b], image[b]
        image_index.append(positions[i >= 0])
        image_counts.append(len(torch.unique(i[i >= 0])))
        start = torch.zeros(seq, dtype=torch.long)  # first row position of each slot's sample
        for sample in torch.unique_consecutive(d[d >= 0]).tolist():
            where = positions[d == sample]
            start[where] = where[0]
            pairs = head_tail_pairs(where[i[where] < 0], cp_size)
            # a text query sees every earlier slot of its sample and itself: position + 1 keys
            costs = [int((p[p >= 0] - where[0] + 1).sum()) for p in pairs]
            samples.append((b, pairs, costs))
        rope.append(positions - start)
    deal = _deal_pairs([c for _, _, c in samples], cp_size)
    dealt_pairs: list[list[list[torch.Tensor]]] = [
        [[] for _ in range(rows)] for _ in range(cp_size)
    ]
    for (b, pairs, _), dealt in zip(samples, deal):
        for r in range(cp_size):
            dealt_pairs[r][b].append(pairs[dealt[r]])
    text_index = [
        [torch.cat(x) if x else torch.zeros(0, dtype=torch.long) for x in per_rank]
        for per_rank in dealt_pairs
    ]
    n = max((len(x) for x in image_index), default=0)
    t = max((len(x) for per_rank in text_index for x in per_rank), default=0)
    t += -(n + t) % pad_to_multiple
    images = Slots.gather(doc, image, _stack_padded(image_index, n))
    texts = [Slots.gather(doc, image, _stack_padded(text_index[r], t)) for r in range(cp_size)]
    local = torch.cat([images.order, texts[cp_rank].order], dim=1)
    row_positions = torch.stack(rope)
    rope_pos = row_positions.gather(1, local.clamp(min=0)).masked_fill(local < 0, 0)
    layout = SeqLayout(
        rope_pos, images, texts, cp_rank, image_counts, row_positions, bidirectional_images
    )
    return texts[cp_rank].order, layout
