"""Bytes one rank holds: parameters, gradients and optimizer state (as the trainer's "model state
per rank" line counts them), and activations by module for each activation-checkpointing mode.

Activations are what autograd saves for backward, tensor by tensor, as titan_vlm's modules save
them (each storage once; checked against `metrics.SavedForBackward` by tests/test_plan.py):

  decoder block, per local slot (L = N + T + W: the replicated image slots, the text slots that
  travel and the slots kept whole, layout.SeqLayout; the busiest rank's), a = bytes of the
  compute dtype, d width, f MLP width, h / kv query / K/V head widths (per tp rank):
    two RMSNorms      4d + 4 + a.d each (the fp32 input, its rsqrt, the normalised input)
    their outputs     a.d each (saved by the projections that read them)
    attention         a.h (q) + 2 a.kv (k, v) + a.h (out) + 4 heads (log-sum-exp); the
                      all-gather algorithm saves its keys' K/V (N + P T + W) instead of the
                      local ones; the all-to-all one saves the output, q, k, v, out and lse of
                      the shared sequence (N + P T) for H/P heads, and q, k, v and lse of the
                      kept slots for every head (each algorithm's `keeps`: the attention op
                      saves only the inputs its backward reads)
    SwiGLU MLP        4 a.f (w1 and w3 outputs, silu output, their product)
    q / k norms       (Qwen3's qk_norm) an RMSNorm's 4 + a bytes per q and k element and 4 per
                      head (the fp32 input, the normalised output, the rsqrt)
    mixture of        (a sparse layer, in place of the SwiGLU; E experts, k picks a token, f
      experts         their width, all on every tp rank) the router's fp32 probabilities 4E,
                      the picks' indices (top-k's, the sort order, the token of each pick) 3 x 8k,
                      the picked probabilities and their sum 4k + 4, the token's statistics
                      weight 4, and per pick: the expert's input, output and weighted output
                      3 a.d, its SwiGLU's w1 and w3 outputs 2 a.f, its weight a (under expert
                      parallelism the picks a rank's experts receive: k per token when the
                      router spreads them evenly); 8E a layer (the rows per expert)
  ViT block, per patch (the tower's patches, not the decoder's slots: a Qwen-VL image has
    merge-unit x more): two norms (a LayerNorm a.dv + 8, an RMSNorm 4 dv + 4 + a.dv), their
    outputs, q, k, v, out (a.dv each, over tp), 4 bytes per head, the MLP's hidden activations
    (a GELU MLP 2 a.mlp, a SwiGLU 4 a.mlp, over tp)
  once: the pixels and the tower's tables (rotary cos / sin, position taps, window order), the
    mergers (`merger_bytes`); RoPE cos/sin (fp32, shared by all layers); token ids; the last
    hidden state, the head's input and the log-softmax of the text (fp32).

The replicated image slots are in L on every CP rank; token ids, the head and the loss run on the
text section (T + W). Activation checkpointing keeps, for each
checkpointed block, only its input ("checkpointed block inputs") and recomputes the block in
backward (a transient of one block's activations, `transient_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_vlm.models.accounting import STATE_BYTES_PER_PARAM
from titan_vlm.parallel.cp_attention import a2a_kv_heads
from titan_vlm.plan.shapes import ModelShapes, Norm, Param
from titan_vlm.plan.spec import Geometry, Layout, Workload

AC_MODES = ("none", "selective", "full")


def is_checkpointed(layer: int, mode: str) -> bool:
    """Whether parallelize.apply_ac wraps block `layer`: all ("full"), every other from 0
    ("selective")."""
    return mode == "full" or (mode == "selective" and layer % 2 == 0)


def checkpointed(n_layers: int, mode: str) -> int:
    """How many of `n_layers` blocks apply_ac wraps (`is_checkpointed`)."""
    return sum(is_checkpointed(i, mode) for i in range(n_layers))


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state


def shards(layout: Layout, group: str, expert: bool = False) -> tuple[int, int]:
    """(FSDP shard count, replicate count) of a parameter group (parallel/parallelize.py):
    the decoder over dp_shard x cp, the vision side too except with cp_vision = broadcast; a
    stacked experts' tensor (`expert`) over dp_shard x cp / ep (its ep split aside)."""
    if expert:
        return layout.expert_fsdp, layout.dp_replicate
    if group != "decoder" and layout.cp_vision == "broadcast":
        return layout.dp_shard, layout.dp_replicate
    return layout.dp_shard * layout.cp, layout.dp_replicate


def local_shape(p: Param, layout: Layout) -> tuple[int, ...]:
    """The shape rank 0 holds: tp's split (ep's of a stacked experts' tensor), then FSDP's dim-0
    chunk (torch.chunk sizes: rank 0 gets the first, largest chunk)."""
    shape = list(p.shape)
    if p.tp_dim is not None and layout.tp > 1:
        shape[p.tp_dim] //= layout.tp
    if p.expert:
        shape[0] //= layout.ep
    s, _ = shards(layout, p.group, p.expert)
    if shape:
        shape[0] = min(shape[0], math.ceil(shape[0] / s))
    return tuple(shape)


def padded_shard_numel(p: Param, layout: Layout) -> int:
    """Elements of one rank's FSDP shard as it travels (padded to the largest chunk)."""
    return math.prod(local_shape(p, layout))


def local_params(shapes: ModelShapes, layout: Layout) -> dict[str, int]:
    out = dict.fromkeys(("vision", "projector", "decoder"), 0)
    for p in shapes.params:
        out[p.group] += math.prod(local_shape(p, layout))
    return out


@dataclass(frozen=True)
class StateBytes:
    params: int  # fp32 sharded parameters
    grads: int  # fp32 sharded gradients
    optimizer: int  # AdamW's two fp32 moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(shapes: ModelShapes, layout: Layout) -> StateBytes:
    """`STATE_BYTES_PER_PARAM` (16) bytes per local parameter element, split 4 / 4 / 8: what the
    trainer logs as "model state per rank" (rank 0, the largest shard)."""
    n = sum(local_params(shapes, layout).values())
    assert STATE_BYTES_PER_PARAM == 16
    return StateBytes(4 * n, 4 * n, 8 * n)


# ---------------------------------------------------------------------------------------------
# Activations


def vision_images_on_rank(layout: Layout, num_images: int) -> int:
    """Images the busiest CP rank encodes (context_parallel.image_shard_sizes for "shard")."""
    if layout.cp == 1 or layout.cp_vision != "shard":
        return num_images
    return math.ceil(num_images / layout.cp)


def decoder_block_bytes(shapes: ModelShapes, layout: Layout, g: Geometry, sparse: bool) -> int:
    """One decoder block's saved bytes (module docstring); `sparse`: a mixture-of-experts
    layer's."""
    d = shapes.decoder
    a, t, p = layout.act_bytes, layout.tp, layout.cp
    L, W = g.local_slots, g.kept
    h, kv = d.n_heads // t * d.head_dim, d.n_kv_heads // t * d.head_dim
    heads = d.n_heads // t
    norm_tokens = L // t if layout.sequence_parallel else L
    norms = 2 * norm_tokens * (4 * d.dim + 4 + a * d.dim) + 2 * L * a * d.dim
    if layout.cp_comm_type == "a2a" and p > 1:
        whole = g.image_slots + p * g.text_slots
        kv_heads = len(a2a_kv_heads(heads, d.n_kv_heads // t, p)[0])  # per rank
        shared = whole * (2 * a * h // p + 2 * a * kv_heads * d.head_dim + 4 * heads // p)
        # the output over L; the kept slots' q, k, v and log-sum-exp on every head
        attn = shared + L * a * h + W * (a * h + 2 * a * kv + 4 * heads)
    elif layout.cp_comm_type == "allgather" and p > 1:
        # q, out and lse over L; K/V of its keys (every rank's text, its own among them)
        attn = L * (2 * a * h + 4 * heads) + (g.image_slots + p * g.text_slots + W) * 2 * a * kv
    else:
        attn = L * (2 * a * h + 4 * heads) + L * 2 * a * kv
    if d.qk_norm:
        norms += L * ((4 + a) * (h + kv) + 4 * (heads + d.n_kv_heads // t))
    if not sparse:
        return g.rows * (norms + attn + 4 * a * (d.ffn_dim // t) * L)
    assert d.moe is not None
    e, k, f = d.moe.num_experts, d.moe.top_k, d.moe.ffn_dim
    per_pick = 3 * a * d.dim + 2 * a * f + a
    moe = L * (4 * e + 3 * 8 * k + 4 * k + 4 + 4 + k * per_pick)
    return g.rows * (norms + attn + moe) + 8 * e  # the rows per expert: one for the batch


def decoder_blocks_bytes(
    shapes: ModelShapes, layout: Layout, g: Geometry, mode: str, layers: range
) -> int:
    """The saved bytes of the decoder blocks of `layers` that AC `mode` does not checkpoint."""
    d = shapes.decoder
    dense = decoder_block_bytes(shapes, layout, g, False)
    sparse = decoder_block_bytes(shapes, layout, g, True) if d.moe is not None else 0
    return sum(sparse if d.is_sparse(i) else dense for i in layers if not is_checkpointed(i, mode))


def largest_decoder_block(shapes: ModelShapes, layout: Layout, g: Geometry) -> int:
    """The saved bytes of the largest decoder block (a sparse one where it is larger)."""
    d = shapes.decoder
    return max(decoder_block_bytes(shapes, layout, g, d.is_sparse(i)) for i in range(d.n_layers))


def norm_bytes(kind: Norm, width: int, a: int) -> int:
    """What one norm saves per row of `width` (a: the compute dtype's bytes), its output aside:
    a LayerNorm its input and fp32 mean and rstd; an RMSNorm its fp32 input, rsqrt and the
    normalised input."""
    return a * width + 8 if kind == "layernorm" else 4 * width + 4 + a * width


def vision_block_bytes(shapes: ModelShapes, layout: Layout, images: int) -> int:
    """One tower block's saved bytes for `images` images: per patch two norms (`norm_bytes`, cut
    by sequence parallelism) and their outputs; q, k, v and out, 4 bytes per head; the MLP's
    hidden activations (GELU: its input and output; SwiGLU: w1's and w3's outputs, the
    activation and the product), over tp."""
    v = shapes.vision
    a, t = layout.act_bytes, layout.tp
    norms = 2 * norm_bytes(v.norm, v.dim, a) // (t if layout.sequence_parallel else 1)
    norms += 2 * a * v.dim
    mlp = (4 if v.mlp == "swiglu" else 2) * a * v.mlp_dim // t
    per_patch = norms + 4 * a * v.dim // t + 4 * v.n_heads // t + mlp
    return images * v.patches * per_patch


def merger_bytes(shapes: ModelShapes, layout: Layout, images: int) -> int:
    """The mergers' (projector's) saved bytes for `images` images: per patch its norm
    (`norm_bytes`) and the norm's output, and fc1's output and the GELU's (per unit of
    `unit` patches, over tp); each DeepStack merger its LayerNorm's statistics per unit (its
    input is a block's output, kept by the next block or the main merger), its output and its
    own fc1 and GELU outputs."""
    v, m = shapes.vision, shapes.vision.merger
    a, t = layout.act_bytes, layout.tp
    hidden = 2 * a * m.hidden // (m.unit * t)  # fc1's and GELU's outputs, per patch
    main = norm_bytes(m.norm, v.dim, a) + a * v.dim + hidden
    deepstack = m.deepstack * (8 // m.unit + a * v.dim + hidden)
    return images * v.patches * (main + deepstack)


@dataclass(frozen=True)
class StageShare:
    """What of the model a pipeline stage runs (parallel/pipeline.py): its decoder `layers`;
    `first`: the tower, projector and token embeddings; `last`: the final norm, head and loss.
    The whole model is one stage of every layer, first and last."""

    layers: range
    first: bool = True
    last: bool = True


def activation_bytes(
    shapes: ModelShapes,
    layout: Layout,
    work: Workload,
    mode: str,
    stage: StageShare | None = None,
) -> dict[str, int]:
    """Saved-for-backward bytes of one rank (the busiest) by module under AC `mode`, for the
    modules of `stage` (None: the whole model)."""
    d, v = shapes.decoder, shapes.vision
    stage = stage or StageShare(range(d.n_layers))
    a, t = layout.act_bytes, layout.tp
    g = work.placed(layout)
    B, L, T = g.rows, g.local_slots, g.section_slots
    n_vis = vision_images_on_rank(layout, work.num_images) if stage.first else 0
    vit_block = vision_block_bytes(shapes, layout, n_vis)
    dec_ckpt = sum(is_checkpointed(i, mode) for i in stage.layers)
    vit_ckpt = checkpointed(v.n_layers, mode)
    block_in = L // t if layout.sequence_parallel else L
    last_hidden = 4 * L * d.dim if a == 4 else 4 * T * d.dim  # fp32: the norm keeps h itself
    first = {
        "vision blocks": (v.n_layers - vit_ckpt) * vit_block,
        "vision pixels and tables": n_vis * (v.pixels * a + v.patches * v.tables),
        "projector": merger_bytes(shapes, layout, n_vis),
    }
    return {
        **(first if stage.first else {}),
        "decoder blocks": decoder_blocks_bytes(shapes, layout, g, mode, stage.layers),
        "rope tables": B * L * 2 * 4 * d.head_dim,
        **({"token ids": B * T * 8} if stage.first else {}),
        **(
            {"head and loss": B * (last_hidden + T * (4 + 2 * a * d.dim + 4 * d.vocab_size + 8))}
            if stage.last
            else {}
        ),
        "checkpointed block inputs": dec_ckpt * B * block_in * a * d.dim
        + vit_ckpt * n_vis * v.patches * a * v.dim,
    }


@dataclass(frozen=True)
class PeakMemory:
    state: int  # fp32 params, grads, AdamW moments (sharded)
    unsharded_params: int  # FSDP's all-gathered params in use: the roots and two blocks
    activations: int  # saved for backward (and checkpointed inputs)
    transient: int  # the largest short-lived buffer of backward (logits or one block)

    @property
    def total(self) -> int:
        return self.state + self.unsharded_params + self.activations + self.transient


def unit_sizes(shapes: ModelShapes, layout: Layout) -> tuple[int, list[int]]:
    """Elements FSDP gathers of `shapes.params` (the tp / ep rank's): of the root modules (what
    is not in a block), and of each block."""
    t = layout.tp

    def full(p: Param) -> int:  # unsharded by FSDP: the tp (ep) rank's
        n = math.prod(p.shape)
        return n // t if p.tp_dim is not None else n // layout.ep if p.expert else n

    roots = sum(full(p) for p in shapes.params if ".layers." not in p.name)
    blocks: dict[str, int] = {}
    for p in shapes.params:
        if ".layers." in p.name:
            prefix, rest = p.name.split(".layers.", 1)
            key = f"{prefix}.{rest.split('.')[0]}"
            blocks[key] = blocks.get(key, 0) + full(p)
    return roots, list(blocks.values())


def gathered_bytes(shapes: ModelShapes, layout: Layout) -> int:
    """FSDP's all-gathered parameters in use at once (in the compute dtype): the root modules,
    which stay gathered through the step, and the two largest blocks (the one computing and the
    one prefetched) with their unsharded fp32 gradients; of `shapes.params`."""
    a = layout.act_bytes
    roots, blocks = unit_sizes(shapes, layout)
    return roots * a + 2 * max(blocks, default=0) * (a + 4)


def transient_bytes(
    shapes: ModelShapes,
    layout: Layout,
    work: Workload,
    mode: str,
    stage: StageShare | None = None,
) -> int:
    """The larger of the loss's logits buffers (logits, their fp32 copy and gradient: on the
    last stage) and a block's activation gradients plus its recomputation (the tower's on the
    first)."""
    stage = stage or StageShare(range(shapes.decoder.n_layers))
    g = work.placed(layout)
    logits = g.rows * g.section_slots * shapes.decoder.vocab_size * (layout.act_bytes + 4 + 4)
    n_vis = vision_images_on_rank(layout, work.num_images) if stage.first else 0
    one_block = max(
        largest_decoder_block(shapes, layout, g), vision_block_bytes(shapes, layout, n_vis)
    )
    recompute = one_block if mode != "none" else 0  # the block recomputed under AC
    return max(logits if stage.last else 0, one_block + recompute)


def peak_memory(shapes: ModelShapes, layout: Layout, work: Workload, mode: str) -> PeakMemory:
    """An estimate: state + unsharded parameters (`gathered_bytes`) + activations + the
    transient of backward (`transient_bytes`)."""
    return PeakMemory(
        state=state_bytes(shapes, layout).total,
        unsharded_params=gathered_bytes(shapes, layout),
        activations=sum(activation_bytes(shapes, layout, work, mode).values()),
        transient=transient_bytes(shapes, layout, work, mode),
    )
