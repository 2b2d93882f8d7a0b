"""The CP split of a batch's rows (`build_layout`): which samples are split head-tail over the
group and which are kept whole on one rank (parallelism.cp_sample_placement, by the cost model),
where a split sample's image slots go (parallelism.cp_image_tokens), and each rank's SeqLayout."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from titan_vlm.layout.cost import LayoutCost
from titan_vlm.layout.seq_layout import SeqLayout
from titan_vlm.layout.slots import Slots, image_token_index, keys_seen

# parallelism.cp_sample_placement and parallelism.cp_image_tokens (their config Literals)
SAMPLE_PLACEMENTS = ("split", "auto")
IMAGE_TOKEN_MODES = ("replicate", "shard", "auto")


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
