"""Context parallelism (CP) for a vision-language model, as seed 000 designs it.

A row holds one or more samples, each text and images in reading order (data/batch.py). On a
CP group of P ranks:

  * a sample is split or kept whole (parallelism.cp_sample_placement; "auto" asks the cost
    model, layout/placement.py): a split sample's text is padded to a multiple of 2P and cut into 2P
    chunks, and every rank keeps one head-tail pair of chunks (j, 2P-1-j) (one light and one
    heavy piece of its causal triangle; which pair goes where is dealt by cost); a whole sample
    stays on one rank, images and all. Row positions and labels go with the slots (labels are
    shifted before sharding, never after): `shard_batch`, layout.build_layout;
  * the image embeddings are NOT split: every rank holds all of them (`encode_images_over_cp`:
    a DTensor with `Replicate()` on the cp mesh dim). Where the ViT runs is `cp_vision`: on
    every rank ("replicate"), on cp rank 0 and broadcast ("broadcast"), or each rank encodes
    its share of the images and the embeddings are all-gathered ("shard", Shard(0) -> Replicate);
  * attention is exact across ranks: each local query sees the images before it in its sample
    (local) and every text key of its sample at an earlier row position, whichever rank holds
    it (ring, all-to-all or all-gather: cp_attention.py);
  * in backward, each rank's image-embedding gradient only covers its own text's use of the
    images, so it is summed over the cp group before the projector and ViT backward: an
    all-reduce (replicate), a reduce to rank 0 (broadcast) or a reduce-scatter to each image's
    encoder (shard). The vision tower then trains exactly as without CP; its parameters are
    reduced over cp only where the ranks encoded different images (see parallel/parallelize.py).

    rank:      0                  1                  (P = 2, "split": samples a and b, each's
    holds: [I][a0 a3 b1 b2]  [I][a1 a2 b0 b3]        text in chunks 0..3; I = all image
                                                     tokens; the pairs as the cost dealing
                                                     might give them)
    "auto" (a long, b short):  [Ia][a0 a3][b Ib]  [Ia][a1 a2]
                                                     (b and its image whole on rank 0: its
                                                     embeddings are used there only, so the
                                                     other ranks' gradient for them is zero)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from titan_vlm.config import Parallelism
from titan_vlm.data.batch import IGNORE_INDEX, Batch
from titan_vlm.data.image_batch import (
    Images,
    image_patches,
    image_slot_counts,
    vision_units,
    vit_work,
)
from titan_vlm.distributed import local_tensor
from titan_vlm.layout import LayoutCost, SeqLayout, build_layout
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.parallel.cp_attention import CP_ATTENTION
from titan_vlm.parallel.tensor_parallel import TPOptions, gather_image_embeds_over_tp

CP_VISION_MODES = ("replicate", "broadcast", "shard")


# The config's defaults are the library's: code that builds CPOptions itself (tests, benchmarks)
# gets what `./run_train.sh` runs unless it asks for something else.
_DEFAULTS = Parallelism()


@dataclass(frozen=True)
class CPOptions:
    """The parallelism.cp_* keys the CP code reads, with the config's defaults."""

    comm_type: str = _DEFAULTS.cp_comm_type  # attention across the group: p2p | allgather | a2a
    vision: str = _DEFAULTS.cp_vision  # where the ViT runs: replicate | broadcast | shard
    sample_placement: str = _DEFAULTS.cp_sample_placement  # split | auto
    image_tokens: str = _DEFAULTS.cp_image_tokens  # a split sample's image slots: replicate, ...
    cost: LayoutCost = field(default_factory=LayoutCost)  # what "auto" balances, cp_balance

    @classmethod
    def from_config(cls, p: Parallelism, cost: LayoutCost) -> CPOptions:
        return cls(p.cp_comm_type, p.cp_vision, p.cp_sample_placement, p.cp_image_tokens, cost)


def vision_images_per_rank(images: Images, cp_size: int, mode: str) -> list[float]:
    """Each CP rank's ViT work under cp_vision `mode`, in native-image units (data/batch.py
    vit_work: an image's patches / a native-size image's; so LayoutCost.image, the cost of one
    native image, prices it): the layout's ViT cost. A batch of native-size images counts its
    images, as floats. Priced over the pieces "shard" deals (data/image_batch.py vision_units),
    as `encode_images_over_cp` deals them."""
    units = vision_units(images)
    return vit_shares(vit_work(units), image_patches(units), cp_size, mode)


def vit_shares(work: list[float], patches: list[int], cp_size: int, mode: str) -> list[float]:
    """Each CP rank's share of the images' ViT `work` (batch order) under cp_vision `mode`:
    every image on every rank ("replicate"), all on rank 0 ("broadcast"), or the contiguous
    ranges `image_shard_sizes` balances by `patches` ("shard"). The planner prices its
    native-size images through this too."""
    if mode == "replicate":
        return [sum(work)] * cp_size
    if mode == "broadcast":
        return [sum(work)] + [0.0] * (cp_size - 1)
    if mode == "shard":
        out, start = [], 0
        for size in image_shard_sizes(patches, cp_size):
            out.append(sum(work[start : start + size]))
            start += size
        return out
    raise ValueError(
        f"unknown cp_vision mode {mode!r} (expected one of {', '.join(CP_VISION_MODES)})"
    )


def image_grad_placement() -> Placement:
    """What each CP rank's gradient of the image embeddings is: `Partial()` over cp, since it
    comes only from that rank's text; so the backward sums it over cp (all-reduce, reduce to the
    source, or reduce-scatter, by cp_vision) before the projector and ViT backward. The one
    place the three modes take it from: the negative-control parity tests patch it to
    `Replicate()` (no sum) and must see parity break."""
    return Partial()


def replicate_image_embeddings(embeds: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Mark the image embeddings as whole on every CP rank and sum their gradient over cp.

    Forward: identity. Every CP rank encoded the same images, so `embeds` is the local view of a
    DTensor with placement `Replicate()` on the cp dim.
    Backward: rank r's gradient is partial (it only comes from rank r's text). Declaring the
    local gradient `Partial()` makes DTensor redistribute it to `Replicate()`: an all-reduce sum
    over cp, which finishes before the projector and ViT backward start.
    """
    if cp_mesh.size() == 1:
        return embeds
    replicated = DTensor.from_local(embeds, cp_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[image_grad_placement()])


def image_shard_sizes(patches: list[int], cp_size: int) -> list[int]:
    """How many images each CP rank encodes in "shard" mode: contiguous ranges of the images in
    batch order (rank 0 the first), balanced by patches, given each image's patch count.

    The rule: B is the least patch budget with which filling the ranks in order, each taking
    images while its patches stay <= B, places every image (the contiguous split whose busiest
    rank has the fewest patches); the ranks are filled that way. Trailing ranks may get none.
    With equal patch counts (every fixed-size batch) this is torch.chunk's split, DTensor
    Shard(0)'s: no rank more than ceil(n/P) images, the first ranks full."""
    if not patches:
        return [0] * cp_size

    def fill(budget: int) -> list[int] | None:
        sizes, used = [0], 0
        for p in patches:
            if used + p > budget:
                if len(sizes) == cp_size:
                    return None
                sizes.append(0)
                used = 0
            sizes[-1] += 1
            used += p
        return sizes + [0] * (cp_size - len(sizes))

    low, high = max(patches), sum(patches)  # fill(high) always places everything
    while low < high:
        mid = (low + high) // 2
        if fill(mid) is None:
            low = mid + 1
        else:
            high = mid
    sizes = fill(low)
    assert sizes is not None
    return sizes


class _GatherUneven(torch.autograd.Function):
    """Forward: each rank's [n_r, D] rows, all-gathered into [sum n_r, D] in rank order on every
    rank (`counts`: every rank's n_r; padded to the largest for one all_gather_into_tensor).
    Backward: the gradient of rank r's rows summed over the group (a reduce-scatter) onto rank
    r, when `image_grad_placement()` is Partial (each rank's gradient covers only its own
    text's use of the embeddings); under Replicate (the negative control) each rank keeps its own
    rows' gradient unsummed, as DTensor's Replicate -> Shard(0) would."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, local: torch.Tensor, group: dist.ProcessGroup, counts: list[int]
    ) -> torch.Tensor:
        rank, most = dist.get_rank(group), max(counts)
        ctx.group, ctx.counts, ctx.rank = group, counts, rank  # type: ignore[attr-defined]
        padded = local.new_zeros((most, local.shape[1]))
        padded[: counts[rank]] = local.detach()
        gathered = local.new_empty((len(counts) * most, local.shape[1]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(counts)])

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, counts, rank = ctx.group, ctx.counts, ctx.rank  # type: ignore[attr-defined]
        offsets = [sum(counts[:r]) for r in range(len(counts))]
        mine = slice(offsets[rank], offsets[rank] + counts[rank])
        if not image_grad_placement().is_partial():
            return grad[mine].contiguous(), None, None
        most = max(counts)
        padded = grad.new_zeros((len(counts) * most, grad.shape[1]))
        for r, (a, n) in enumerate(zip(offsets, counts)):
            padded[r * most : r * most + n] = grad[a : a + n]
        out = grad.new_empty((most, grad.shape[1]))
        dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM, group=group)
        return out[: counts[rank]].contiguous(), None, None


class _BroadcastFromSource(torch.autograd.Function):
    """Forward: the source rank's tensor on every rank. Backward: the gradients summed onto the
    source rank (the others pass nothing on)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup, src: int
    ) -> torch.Tensor:
        ctx.group, ctx.src = group, src  # type: ignore[attr-defined]  # autograd's context
        out = x.detach().clone()
        dist.broadcast(out, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        if image_grad_placement().is_partial():
            group, src = ctx.group, ctx.src  # type: ignore[attr-defined]  # set in forward
            dist.reduce(grad, dst=src, op=dist.ReduceOp.SUM, group=group)
        return grad, None, None


def encode_images_never_empty(model: VisionLanguageModel, images: Images) -> torch.Tensor:
    """`model.encode_images(images)`, except that an empty batch [0, C, H, W] is encoded as one
    all-zero image whose embeddings are then dropped ([:0]): the result has the empty batch's
    shape, and the dummy's gradient is exactly zero (nothing downstream uses it). (Only a tensor
    batch is padded so: an ImageSet reaches encode_images as it is, empty or not.)

    Why: under tensor parallelism torch 2.13's DTensor view rule mis-reads a reshape whose leading
    dim is 0 (torch/distributed/tensor/_ops/_view_ops.py view_groups: [0, T, D] -> [0, D] becomes
    a flatten of (T, D)), so the gradient of every row-wise weight (ViT attention and MLP output
    projections, the projector's fc2) gets a `_StridedShard` placement; eager DTensor tolerates
    it, but a compiled block cannot rebuild such a DTensor (DTensor.__tensor_unflatten__:
    "DTensorSpec doesn't allow specify shard_order when use_strided_shard_as_shard_order is
    True"). Every tp
    rank of a (dp, cp) coordinate holds the same images, so the tp ranks all take this branch or
    none: they enter the same TP collectives, in the same order, as with any one-image batch."""
    if not isinstance(images, torch.Tensor) or images.shape[0] > 0:
        return model.encode_images(images)
    return model.encode_images(images.new_zeros((1, *images.shape[1:])))[:0]


def encode_images_over_cp(
    model: VisionLanguageModel,
    images: Images,
    cp_mesh: DeviceMesh,
    mode: str,
    embed_width: int | None = None,
    tp_vision: bool = False,
) -> torch.Tensor:
    """Image embeddings of all the images, whole on every CP rank, their gradient summed over cp
    before it reaches the projector and ViT: [n, tokens_per_image, D] for a tensor batch (native
    size), [sum of image_tokens, D] for an ImageList (VisionLanguageModel.encode_images; batch
    order either way). `mode` is where the ViT runs (CPOptions.vision); under "shard" each rank
    encodes a contiguous range of the images balanced by patches (`image_shard_sizes`), or of
    their independently encoded pieces (ImageSet.units: a video's frame groups), so one long
    video may be encoded by several ranks, none holding all its frames' activations.
    `embed_width`: the projector's local output width D when it is not the decoder's
    (image_embed_tp_shard: D/tp). `tp_vision`: the ViT and projector are tensor-parallel
    (tensor_parallel_degree > 1), so a rank never encodes an empty batch
    (encode_images_never_empty)."""

    def encode(batch: Images) -> torch.Tensor:
        if tp_vision:
            return encode_images_never_empty(model, batch)
        return model.encode_images(batch)

    cp_size = cp_mesh.size()
    if cp_size == 1:
        return encode(images)
    width = embed_width or model.embed_dim
    tokens = image_slot_counts(images, model.tokens_per_image)
    # The cp sums below run in fp32 whatever the compute dtype (the decoder casts back).
    if mode == "replicate":
        return replicate_image_embeddings(encode(images).float(), cp_mesh)
    rank = cp_mesh.get_local_rank()
    if mode == "broadcast":
        group = cp_mesh.get_group()
        src = dist.get_global_rank(group, 0)
        if rank == 0:
            local = encode(images).float()  # travels in fp32 (the receivers' dtype)
        else:  # a leaf that wants a gradient where rank 0's embeddings do (something before
            # them trains: training.freeze), so this rank joins the backward reduce just when
            # rank 0 does
            zeros = (
                (images.shape[0], model.tokens_per_image, width)
                if isinstance(images, torch.Tensor)
                else (sum(tokens), width)
            )
            local = torch.zeros(zeros, dtype=torch.float32, device=images.device)
            local.requires_grad_(vision_trains(model))
        out: torch.Tensor = _BroadcastFromSource.apply(local, group, src)
        return out
    if mode == "shard":
        # the pieces the encoder encodes independently (a video's frame groups): one long video
        # may be spread over ranks, its rows gathered back in order
        units = vision_units(images)
        sizes = image_shard_sizes(image_patches(units), cp_size)
        start = sum(sizes[:rank])
        local = encode(units[start : start + sizes[rank]]).float()  # may be empty: still runs
        if not isinstance(units, torch.Tensor):  # uneven shares: rows of tokens, by hand
            unit_tokens = image_slot_counts(units, model.tokens_per_image)
            firsts = [sum(sizes[:r]) for r in range(cp_size)]
            counts = [sum(unit_tokens[a : a + n]) for a, n in zip(firsts, sizes)]
            gathered: torch.Tensor = _GatherUneven.apply(
                local.reshape(-1, local.shape[-1]), cp_mesh.get_group(), counts
            )
            return gathered
        shape = torch.Size((units.shape[0], *local.shape[1:]))
        sharded = DTensor.from_local(
            local,
            cp_mesh,
            [Shard(0)],
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )
        full = sharded.redistribute(cp_mesh, [Replicate()])  # all-gather; backward: reduce-scatter
        return full.to_local(grad_placements=[image_grad_placement()])
    raise ValueError(
        f"unknown cp_vision mode {mode!r} (expected one of {', '.join(CP_VISION_MODES)})"
    )


def vision_trains(model: VisionLanguageModel) -> bool:
    """Whether any parameter of the modules that make the image embeddings trains (none does
    when training.freeze names them all): then the embeddings want a gradient, summed over cp."""
    return any(p.requires_grad for m in model.vision_modules() for p in m.parameters())


@torch.no_grad()
def sync_broadcast_vision_grads(model: VisionLanguageModel, cp_mesh: DeviceMesh) -> None:
    """ "broadcast" mode: only cp rank 0 ran the ViT and holds its (complete) gradients; hand them
    to the other cp ranks so every replica takes the same optimizer step (frozen parameters
    have none)."""
    if cp_mesh.size() == 1:
        return
    group = cp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for module in model.vision_modules():
        for p in module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.broadcast(local_tensor(p.grad), src=src, group=group)


def shard_batch(
    batch: Batch,
    cp_mesh: DeviceMesh | None,
    cp: CPOptions = CPOptions(),
    bidirectional_images: bool = False,
    pad_to_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
    """This CP rank's text tokens and labels [B, T + W] and its SeqLayout (layout.build_layout:
    each sample split head-tail over the group with its image slots on every rank or, with
    cp.image_tokens = "shard", cut head-tail with its text; or, with cp.sample_placement =
    "auto", kept whole on one rank where the cost model says so). The tokens at image slots of
    the text section are placeholders the decoder replaces with the image embeddings.
    `cp_mesh=None` or a group of one: the whole rows, unsharded. Padding slots get token 0 and
    no label; they attend to nothing and nothing attends to them, so their id is moot.
    `pad_to_multiple`: the local slot count is padded to a multiple of it (sequence parallelism
    splits it over tp)."""
    group = cp_mesh if cp_mesh is not None and cp_mesh.size() > 1 else None
    cp_size = group.size() if group is not None else 1
    rank = group.get_local_rank() if group is not None else 0
    if cp.sample_placement == "auto" and cp_size > 1:
        # placed as one row: no rank pads every row to the longest row's share
        batch = batch.as_one_row()
    index, layout = build_layout(
        batch.doc,
        batch.image,
        cp_size,
        rank,
        bidirectional_images,
        pad_to_multiple,
        cp.sample_placement,
        cp.cost,
        vision_images_per_rank(batch.images, cp_size, cp.vision),
        cp.image_tokens,
    )
    device = batch.tokens.device
    index = index.to(device)
    pad = index < 0
    tokens = batch.tokens.gather(1, index.clamp(min=0)).masked_fill(pad, 0)
    labels = batch.labels.gather(1, index.clamp(min=0)).masked_fill(pad, IGNORE_INDEX)
    layout.positions = layout.positions.to(device)
    layout.slot_data = layout.gather_slot_data(batch.slot_data)
    if group is not None:
        layout.cp = CP_ATTENTION[cp.comm_type](group)
    return tokens, labels, layout


@dataclass(frozen=True)
class CPContext:
    """This rank's CP and TP groups and choices, handed to a model's forward_local
    (models/spec.py BatchContext): who encodes which images and who holds which slots.
    `cp_mesh` None: one process, the whole rows, every image encoded here."""

    cp_mesh: DeviceMesh | None = None
    options: CPOptions = CPOptions()
    tp_mesh: DeviceMesh | None = None
    tp: TPOptions = TPOptions()

    def _tp_size(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    def encode_images(self, model: VisionLanguageModel, images: Images) -> torch.Tensor:
        """Every image's embeddings, whole on every CP rank (Replicate on cp); in backward their
        gradient is summed over cp before the projector and ViT (`encode_images_over_cp`, where
        options.vision says). This runs even for a batch without images, so every rank enters
        the same collectives. With tp.image_embed_shard they cross the CP group as [.., dim/tp]
        slices and are all-gathered over tp where they join the text."""
        tp_size = self._tp_size()
        if self.cp_mesh is None:
            embeds = (
                encode_images_never_empty(model, images)
                if tp_size > 1
                else model.encode_images(images)
            )
        else:
            width = model.embed_dim // tp_size if self.tp.image_embed_shard else None
            embeds = encode_images_over_cp(
                model,
                images,
                self.cp_mesh,
                self.options.vision,
                embed_width=width,
                tp_vision=tp_size > 1,
            )
        if self.tp.image_embed_shard and self.tp_mesh is not None:
            embeds = gather_image_embeds_over_tp(embeds, self.tp_mesh)
        return embeds

    def place(
        self, batch: Batch, bidirectional_images: bool
    ) -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
        """This rank's text tokens, labels and SeqLayout (`shard_batch`): each sample split
        head-tail or kept whole (options.sample_placement), its slots padded to a multiple of tp
        under sequence parallelism."""
        multiple = self._tp_size() if self.tp.sequence_parallel else 1
        return shard_batch(batch, self.cp_mesh, self.options, bidirectional_images, multiple)
