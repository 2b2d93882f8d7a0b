"""Context parallelism (CP) for a vision-language model, as seed 000 designs it.

A row is `[image tokens (N), text tokens (T)]`. On a CP group of P ranks:

  * the text is padded to a multiple of 2P, cut into 2P chunks, and rank r keeps chunks r and
    2P-1-r (head-tail balancing: one light and one heavy chunk of the causal triangle each),
    with their row positions and labels (labels are shifted before sharding, never after);
  * the image embeddings are NOT split: every rank holds all N of them (`encode_images_over_cp`:
    a DTensor with `Replicate()` on the cp mesh dim). Where the ViT runs is `cp_vision`: on
    every rank ("replicate"), on cp rank 0 and broadcast ("broadcast"), or each rank encodes
    its share of the images and the embeddings are all-gathered ("shard", Shard(0) -> Replicate);
  * attention is exact across ranks: each local text query sees the whole image prefix (local)
    and every text key at an earlier row position, whichever rank holds it (ring, all-to-all
    or all-gather: cp_attention.py);
  * in backward, each rank's image-embedding gradient only covers its own text's use of the
    images, so it is summed over the cp group before the projector and ViT backward: an
    all-reduce (replicate), a reduce to rank 0 (broadcast) or a reduce-scatter to each image's
    encoder (shard). The vision tower then trains exactly as without CP; its parameters are
    reduced over cp only where the ranks encoded different images (see parallel/parallelize.py).

    rank:      0          1          (P = 2, chunks c0..c3 of the text)
    holds: [I][c0 c3]  [I][c1 c2]    I = all image tokens, on every rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_vlm.attention import SeqLayout
from titan_vlm.data.synthetic import IGNORE_INDEX
from titan_vlm.parallel.cp_attention import CP_ATTENTION

CP_VISION_MODES = ("replicate", "broadcast", "shard")


@dataclass(frozen=True)
class CPOptions:
    comm_type: str = "p2p"  # attention across the group: "p2p" | "allgather" | "a2a"
    vision: str = "shard"  # where the ViT runs: "replicate" | "broadcast" | "shard"


def replicate_image_embeddings(embeds: torch.Tensor, cp_mesh: DeviceMesh, sum_grad: bool = True) -> torch.Tensor:
    """Mark the image embeddings as whole on every CP rank and sum their gradient over cp.

    Forward: identity. Every CP rank encoded the same images, so `embeds` is the local view of a
    DTensor with placement `Replicate()` on the cp dim.
    Backward: rank r's gradient is partial (it only comes from rank r's text). Declaring the
    local gradient `Partial()` makes DTensor redistribute it to `Replicate()`: an all-reduce sum
    over cp, which finishes before the projector and ViT backward start.

    `sum_grad=False` exists only for the negative-control test (it must break parity).
    """
    if cp_mesh.size() == 1 or not sum_grad:
        return embeds
    replicated = DTensor.from_local(embeds, cp_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


def image_shard_sizes(num_images: int, cp_size: int) -> list[int]:
    """Images each CP rank encodes in "shard" mode: torch.chunk's split (DTensor's Shard(0)),
    which gives no rank more than ceil(n/P) images; all images have the same patch count, so
    this is also the split balanced by patches. Trailing ranks may get none."""
    sizes = [len(c) for c in torch.arange(num_images).chunk(cp_size)]
    return sizes + [0] * (cp_size - len(sizes))


class _BroadcastFromSource(torch.autograd.Function):
    """Forward: the source rank's tensor on every rank. Backward: the gradients summed onto the
    source rank (the others pass nothing on)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, src: int, sum_grad: bool) -> torch.Tensor:
        ctx.group, ctx.src, ctx.sum_grad = group, src, sum_grad
        out = x.detach().clone()
        dist.broadcast(out, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if ctx.sum_grad:
            dist.reduce(grad, dst=ctx.src, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None, None, None


def encode_images_over_cp(model: torch.nn.Module, images: torch.Tensor, cp_mesh: DeviceMesh, mode: str,
                          sum_grad: bool = True, embed_width: int | None = None) -> torch.Tensor:
    """Image embeddings [n, tokens_per_image, D] of all n images, whole on every CP rank, their
    gradient summed over cp before it reaches the projector and ViT. `mode` is where the ViT
    runs (CPOptions.vision). `sum_grad=False` only for the negative-control test. `embed_width`:
    the projector's local output width D when it is not the decoder's (image_embed_tp_shard: D/tp)."""
    cp_size = cp_mesh.size()
    if cp_size == 1:
        return model.encode_images(images)
    # The cp sums below run in fp32 whatever the compute dtype (the decoder casts back).
    if mode == "replicate":
        return replicate_image_embeddings(model.encode_images(images).float(), cp_mesh, sum_grad)
    rank = cp_mesh.get_local_rank()
    if mode == "broadcast":
        group = cp_mesh.get_group()
        src = dist.get_global_rank(group, 0)
        if rank == 0:
            local = model.encode_images(images).float()  # travels in fp32 (the receivers' dtype)
        else:  # a leaf that wants a gradient, so this rank joins the backward reduce
            args = model.args
            local = images.new_zeros((images.shape[0], args.tokens_per_image, embed_width or args.decoder.dim),
                                     dtype=torch.float32).requires_grad_()
        return _BroadcastFromSource.apply(local, group, src, sum_grad)
    if mode == "shard":
        sizes = image_shard_sizes(images.shape[0], cp_size)
        start = sum(sizes[:rank])
        local = model.encode_images(images[start:start + sizes[rank]]).float()  # may be empty: still runs
        shape = torch.Size((images.shape[0], *local.shape[1:]))
        sharded = DTensor.from_local(local, cp_mesh, [Shard(0)], run_check=False, shape=shape,
                                     stride=torch.empty(shape, device="meta").stride())
        full = sharded.redistribute(cp_mesh, [Replicate()])  # all-gather; backward: reduce-scatter
        return full.to_local(grad_placements=[Partial()] if sum_grad else None)
    raise ValueError(f"unknown cp_vision mode {mode!r} (expected one of {', '.join(CP_VISION_MODES)})")


@torch.no_grad()
def sync_broadcast_vision_grads(model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
    """"broadcast" mode: only cp rank 0 ran the ViT and holds its (complete) gradients; hand them
    to the other cp ranks so every replica takes the same optimizer step."""
    if cp_mesh.size() == 1:
        return
    group = cp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for module in (model.vision, model.projector):
        for p in module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.broadcast(local, src=src, group=group)


def padded_text_len(text_len: int, cp_size: int) -> int:
    chunks = 2 * cp_size
    return -(-text_len // chunks) * chunks


def head_tail_indices(padded_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Text indices rank `cp_rank` keeps: chunks r and 2P-1-r of 2P equal chunks."""
    chunk = padded_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def shard_text(tokens: torch.Tensor, labels: torch.Tensor, num_image_tokens: int, cp_mesh: DeviceMesh,
               cp_comm_type: str = "p2p") -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
    """This CP rank's share of the text of rows `[image tokens, text]`, and its SeqLayout.

    tokens/labels [B, T] are the whole text (labels already shifted). Text whose length is not a
    multiple of 2P is padded at the end with token 0 / IGNORE_INDEX: padding comes after every
    real token, so the causal mask hides it from them and it carries no loss (so its id is moot).
    `cp_comm_type` picks the exact attention across the group (cp_attention.py).
    """
    n, text_len = num_image_tokens, tokens.shape[1]
    cp_size = cp_mesh.size()
    if cp_size == 1:
        return tokens, labels, SeqLayout.unsharded(n + text_len, n, tokens.device)
    padded = padded_text_len(text_len, cp_size)
    if padded != text_len:
        extra = padded - text_len
        tokens = torch.nn.functional.pad(tokens, (0, extra), value=0)
        labels = torch.nn.functional.pad(labels, (0, extra), value=IGNORE_INDEX)
    idx = head_tail_indices(padded, cp_size, cp_mesh.get_local_rank()).to(tokens.device)
    layout = SeqLayout(positions=torch.cat([torch.arange(n, device=tokens.device), n + idx]).unsqueeze(0),
                       num_image_tokens=n, cp=CP_ATTENTION[cp_comm_type](cp_mesh))
    return tokens[:, idx], labels[:, idx], layout


def attention_work(q_positions: torch.Tensor, k_positions: torch.Tensor) -> int:
    """Unmasked query-key pairs of one row under the causal rule (key position <= query position)."""
    keys = k_positions.flatten().sort().values
    return int(torch.searchsorted(keys, q_positions.flatten(), right=True).sum())
