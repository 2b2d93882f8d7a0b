"""Bytes each collective sends per rank per step, and which link carries it.

Counted as benchmarks/cp_scaling.py counts them (a ring all-gather sends P-1 pieces, a
reduce-scatter or all-to-all (P-1)/P of its input, a point-to-point send its tensor):

  cp attention (per decoder layer; kv = this rank's travelling K and V, 2 x rows x K/V heads x T
  x head dim elements, per tp rank: the split samples' share, never the slots kept whole)
    p2p         forward (P-1) kv sends, backward (P-1) kv sends + (P-1) fp32 dK/dV sends (the
                local plan's accumulators stay home)
    allgather   forward all-gather of kv, backward reduce-scatter of fp32 dK/dV of the whole text
    a2a         q, k, v out and back (forward) and their gradients (backward), (P-1)/P each (K/V:
                the heads each rank uses, cp_attention.a2a_kv_heads, replicas counted), plus
                the image queries' output heads all-gathered (and reduce-scattered back)
    with activation checkpointing the recomputed forward of a checkpointed block sends again.
  image embeddings over cp (fp32, context_parallel.encode_images_over_cp)
    shard       all-gather of ceil(n/P) images per rank, reduce-scatter of the gradient
    replicate   all-reduce of the gradient (2 (P-1)/P)
    broadcast   broadcast and reduce of all of them, then the vision gradients broadcast
  fsdp          all-gather of each rank's padded shard in the compute dtype in forward and again
                in backward (the root modules stay gathered), reduce-scatter of fp32 gradients;
                with dp_replicate > 1 the shards' all-reduce over the replicas (HSDP); under
                expert parallelism the experts' own units over efsdp (dp_shard x cp / ep)
  ep            (mixture-of-experts layers, expert parallelism) each pick's row (dim, compute
                dtype) to its expert's rank and back in forward, their gradients both ways in
                backward, and the rows per expert (E int64) in forward: `ep_layer_bytes`, the
                picks spread evenly over the experts' ranks (a router's real spread moves it);
                a checkpointed sparse layer's forward again
  tp            Megatron's count: two all-reduces of a block's activations in forward and two
                in backward (sequence parallelism moves the same bytes as all-gather +
                reduce-scatter), the embedding's all-reduce and the logits' all-gather.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from titan_vlm.parallel.cp_attention import a2a_kv_heads
from titan_vlm.plan.memory import (
    checkpointed,
    is_checkpointed,
    padded_shard_numel,
    shards,
    vision_images_on_rank,
)
from titan_vlm.plan.shapes import ModelShapes
from titan_vlm.plan.spec import Layout, Workload


@dataclass(frozen=True)
class Collective:
    name: str
    group: str  # the mesh dim(s) it runs over: "cp", "tp", "fsdp", "dp_replicate"
    group_size: int
    sent_bytes: int  # per rank per step
    overlapped: bool  # runs under compute (ring p2p, FSDP prefetch) rather than blocking it


def cp_attention_bytes(shapes: ModelShapes, layout: Layout, work: Workload) -> int:
    """Bytes one rank sends per step for the CP attention (all decoder layers)."""
    p = layout.cp
    if p == 1:
        return 0
    d = shapes.decoder
    a, t = layout.act_bytes, layout.tp
    g = work.placed(layout)
    B, T, N = g.rows, g.text_slots, g.image_slots
    heads, kv_heads = d.n_heads // t, d.n_kv_heads // t
    kv = 2 * B * kv_heads * T * d.head_dim  # elements
    if layout.cp_comm_type == "p2p":
        forward, backward = (p - 1) * kv * a, (p - 1) * kv * a + (p - 1) * kv * 4
    elif layout.cp_comm_type == "allgather":
        forward, backward = (p - 1) * kv * a, (p * kv * 4) * (p - 1) // p
    else:
        k_heads = p * len(a2a_kv_heads(heads, kv_heads, p)[0])  # each rank's, replicas counted
        text = B * T * d.head_dim * a  # one head's text on this rank

        def moved(nbytes: int) -> int:
            return nbytes * (p - 1) // p

        # q, k, v and out are separate all-to-alls; the image heads one all-gather (forward)
        # and one reduce-scatter (backward)
        image_out = B * N * heads // p * d.head_dim * a
        forward = (
            moved(text * heads) * 2 + moved(text * k_heads) * 2 + ((p - 1) * image_out if N else 0)
        )
        backward = (
            moved(text * heads) * 2 + moved(text * k_heads) * 2 + (moved(image_out * p) if N else 0)
        )
    recomputed = checkpointed(d.n_layers, layout.ac_mode)
    return d.n_layers * (forward + backward) + recomputed * forward


def image_embedding_bytes(shapes: ModelShapes, layout: Layout, work: Workload) -> int:
    p, n = layout.cp, work.num_images
    if p == 1 or n == 0:
        return 0
    # a slot's row: the embedding and any DeepStack features (each the decoder's width)
    width = shapes.vision.embed_width * shapes.decoder.dim
    width //= layout.tp if layout.image_embed_tp_shard else 1
    one = shapes.tokens_per_image * width * 4  # fp32 on the wire
    if layout.cp_vision == "shard":
        return 2 * (p - 1) * math.ceil(n / p) * one
    if layout.cp_vision == "replicate":
        return 2 * (p - 1) * n * one // p
    vision_grads = 4 * sum(
        padded_shard_numel(q, layout) for q in shapes.params if q.group != "decoder"
    )
    return 2 * n * one + vision_grads


def ep_layer_bytes(
    picks: int, dim: int, act_bytes: int, ep: int, num_experts: int, recomputed: bool = False
) -> int:
    """Bytes one rank sends in one sparse layer's forward + backward under expert parallelism
    (parallel/expert_parallel.py), its `picks` (tokens x top_k) spread evenly over the `ep`
    ranks' experts: (ep - 1) / ep of the rows leave, and as many come in to be sent back, in
    the forward (the rows, the outputs) and the backward (their gradients), and the forward's
    rows per expert; `recomputed`: the forward once more (activation checkpointing)."""
    if ep == 1:
        return 0
    rows = picks * (ep - 1) // ep * dim * act_bytes  # one exchange of one direction's rows
    counts = num_experts * 8 * (ep - 1) // ep
    forward = 2 * rows + counts
    return forward * (1 + recomputed) + 2 * rows


def ep_bytes(shapes: ModelShapes, layout: Layout, work: Workload) -> int:
    """Bytes one rank (the busiest) sends per step in the experts' all-to-alls: every sparse
    layer's `ep_layer_bytes` over its local slots."""
    d = shapes.decoder
    if d.moe is None:
        return 0
    g = work.placed(layout)
    picks = d.moe.top_k * g.rows * g.local_slots
    return sum(
        ep_layer_bytes(
            picks,
            d.dim,
            layout.act_bytes,
            layout.ep,
            d.moe.num_experts,
            is_checkpointed(i, layout.ac_mode),
        )
        for i in d.moe.layers
    )


def fsdp_collectives(shapes: ModelShapes, layout: Layout) -> list[Collective]:
    out = []
    split = layout.ep > 1  # the experts are FSDP units of their own, over efsdp
    sides = (
        ("decoder", lambda q: q.group == "decoder" and not (split and q.expert), "fsdp"),
        ("experts", lambda q: split and q.expert, "efsdp"),
        ("vision", lambda q: q.group in ("vision", "projector"), "fsdp"),
    )
    for side, member, group in sides:
        params = [q for q in shapes.params if member(q)]
        if not params:
            continue
        s, r = shards(layout, params[0].group, params[0].expert)
        shard = sum(padded_shard_numel(q, layout) for q in params)
        in_blocks = sum(padded_shard_numel(q, layout) for q in params if ".layers." in q.name)
        if s > 1:
            # forward, and again in backward what is freed after the forward: the blocks, or
            # under pipeline parallelism every unit (each its own root)
            again = shard if layout.pp > 1 else in_blocks
            gathers = (shard + again) * layout.act_bytes * (s - 1)
            out.append(Collective(f"fsdp all-gather ({side})", group, s, gathers, True))
            out.append(
                Collective(f"fsdp reduce-scatter ({side})", group, s, shard * 4 * (s - 1), True)
            )
        if r > 1:
            out.append(
                Collective(
                    f"hsdp all-reduce ({side})",
                    "dp_replicate",
                    r,
                    2 * shard * 4 * (r - 1) // r,
                    True,
                )
            )
    return out


def tp_bytes(shapes: ModelShapes, layout: Layout, work: Workload) -> int:
    t = layout.tp
    if t == 1:
        return 0
    d, v = shapes.decoder, shapes.vision
    a = layout.act_bytes
    g = work.placed(layout)
    B, L, T = g.rows, g.local_slots, g.section_slots
    n_vis = vision_images_on_rank(layout, work.num_images)

    def all_reduce(nbytes: int) -> int:
        return 2 * nbytes * (t - 1) // t

    blocks = d.n_layers * 4 * all_reduce(B * L * d.dim * a)
    blocks += v.n_layers * 4 * all_reduce(n_vis * v.patches * v.dim * a)
    # each merger (the projector; DeepStack's too): fc2's row-wise output in forward, fc1's
    # input gradient in backward
    mergers = v.embed_width * 2 * all_reduce(n_vis * v.tokens * d.dim * a)
    edges = 2 * all_reduce(B * T * d.dim * a) + B * T * d.vocab_size // t * a * (t - 1)
    return blocks + mergers + edges


def collectives(shapes: ModelShapes, layout: Layout, work: Workload) -> list[Collective]:
    """Every collective of a rank holding `shapes.params` (a pipeline rank: its stages'; the
    image embeddings' only where it holds the tower) and `shapes.decoder.n_layers` layers."""
    out = []
    tower = any(p.group != "decoder" for p in shapes.params)
    if layout.cp > 1:
        out.append(
            Collective(
                f"cp attention ({layout.cp_comm_type})",
                "cp",
                layout.cp,
                cp_attention_bytes(shapes, layout, work),
                layout.cp_comm_type == "p2p",
            )
        )
    if layout.cp > 1 and tower:
        out.append(
            Collective(
                f"image embeddings ({layout.cp_vision})",
                "cp",
                layout.cp,
                image_embedding_bytes(shapes, layout, work),
                False,
            )
        )
    if layout.tp > 1:
        out.append(
            Collective("tp activations", "tp", layout.tp, tp_bytes(shapes, layout, work), False)
        )
    if layout.ep > 1 and shapes.decoder.moe is not None:
        sent = ep_bytes(shapes, layout, work)
        out.append(Collective("experts all-to-all", "ep", layout.ep, sent, False))
    # under pipeline parallelism each stage's units are FSDP roots, resharded after each
    # microbatch's forward: gathered, and their gradients reduced, once a microbatch
    times = work.rows // layout.pp_microbatch_size if layout.pp > 1 else 1
    out.extend(
        dataclasses.replace(c, sent_bytes=c.sent_bytes * times)
        for c in fsdp_collectives(shapes, layout)
    )
    return out
