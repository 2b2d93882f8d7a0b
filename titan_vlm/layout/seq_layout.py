"""`SeqLayout`: one CP rank's local slots and everything attention needs to know about them (every
rank's slots, the plans between them, the costs), and `LayoutHandle`, the layout as the
attention op's opaque argument. `CPAlgorithm` is what a layout carries of the attention
algorithm that makes it exact across the CP group (parallel/cp_attention.py implements it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from titan_vlm.layout.blocks import PlanCache, plan
from titan_vlm.layout.cost import LayoutCost
from titan_vlm.layout.slots import (
    Slots,
    _count_images,
    _count_samples,
    _empty_slots,
    image_token_index,
    keys_seen,
)
from titan_vlm.varlen import Block, PackedPlan, VarlenKernel, pack


class CPAlgorithm(Protocol):
    """The attention algorithm a SeqLayout carries for its CP group (parallel/cp_attention.py
    Algorithm): its cp_comm_type, and forward / backward without autograd (the custom op in
    attention.py wraps them)."""

    comm: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


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
    cp: CPAlgorithm | None = None
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
        (tests/unit/test_layout.py checks it against the block plans). A query sees the earlier
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

    def token_shares(self) -> torch.Tensor:
        """[B, L] int64 on the positions' device: of how many CP ranks' slots each local slot's
        token is one, so that weighting each slot 1/share counts every token of the rows once
        over the CP group: 1 for a slot only this rank holds (its text, sharded image slots,
        kept samples), cp for an image-prefix slot (every CP rank holds it), 0 for padding
        (weight 0). What per-token statistics summed over ranks use (the MoE router's:
        models/common/moe.py); an integer, so that no mixed-precision cast rounds 1/cp."""
        local = self.slots("local")
        shares = (local.doc >= 0).to(torch.long)
        shares[:, : self.num_image_tokens] *= len(self.texts)
        return shares.to(self.positions.device)

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
