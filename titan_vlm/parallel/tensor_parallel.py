"""Tensor parallelism (TP) and sequence parallelism (SP) on the tp mesh dim, applied from outside:
the plan of one transformer block (`block_plan`), a stack's sequence-parallel boundaries
(`sp_stack_boundaries`) and the shared decoder's whole plan (`apply_decoder_tp`), which a family's
apply_tp (models/<family>/parallelize.py) applies to its own modules, as below for LLaVA's.

TP (Megatron style, with DTensor `parallelize_module`): in every ViT and decoder block the input
projections (q, k, v; fc1 / w1, w3) are split column-wise, so each tp rank computes whole
attention heads (the model's views use -1 heads: the local count) and a slice of the MLP; the
output projections (proj / wo; fc2 / w2) are split row-wise and their partial sums are reduced.
Between blocks every tp rank holds the same activations (SP off) or a 1/tp slice of the sequence
(SP on: norms and residual adds run on the slice; the all-gather before attention / MLP and the
reduce-scatter after them replace the all-reduce). Where the sequence is cut:

    decoder input [image tokens, local text]  (CP already cut the text: this is the CP rank's part)
        -> layers[0]: Replicate -> Shard(1)   local slice, no communication
        -> blocks on [B, L/tp, dim] slices
        -> layers[-1] output: Shard(1) -> Replicate   all-gather (the decoder then drops the image
           tokens and applies the final norm and head to the text: a row-position slice that a
           sequence-sharded tensor cannot take, so these run replicated)

so the CP rank's local length L = image slots + local text slots must divide by tp: the layout
pads the text with slots that attention skips (layout.build_layout, pad_to_multiple), and the
first block checks it. The ViT is cut the same way along its patches: a packed sequence of
images of different sizes is padded with zero rows no image attends to (LLaVA's native
resolution, Qwen2.5-VL's tower), a batch of one size must divide (checked at start-up, the
family's ModelSpec.validate).

Exactness and gradient reductions: every tp rank of a (dp, cp) coordinate holds the same tokens
and computes the same replicated loss, so gradients of activations that are replicated over tp
arrive complete on every tp rank; sharded parameters get their own shard's gradient; only
partial sums are summed over tp, each once, by DTensor: row-wise outputs in forward, column-wise
inputs' gradients in backward, and the SP norm weights' gradients (each rank's covers its slice
of the sequence: Partial on tp until FSDP redistributes them to the weights' Replicate before its
own reduction; without FSDP, clip_grad_norm_ refuses a Partial gradient). The loss normaliser is
summed over dp and cp, never tp.

Embedding and head: `tok_embeddings` is row-wise (vocab rows split; each token's vector comes from
exactly one rank and the others add exact zeros, so the all-reduce is exact) with a replicated
output, because the image embeddings are concatenated in front of the text after it. `output` is
column-wise (vocab columns split) with its logits all-gathered (Replicate): the loss then runs
unchanged on every tp rank; a vocab-parallel loss would save the gather but is more code for a
small vocabulary. Tied embeddings (DecoderArgs.tie_embeddings): both split the one [vocab, dim]
weight Shard(0), so the head takes the embedding's DTensor back after the plan (one Parameter,
both uses' gradients summed in it).

Q/K norms (Qwen3): one [head_dim] weight shared by all heads, applied to this rank's heads; its
gradient is a partial sum over tp, reduced like the SP norms' (SequenceParallel on the heads dim).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_vlm.config import Parallelism
from titan_vlm.models.common.decoder import holds_parameters

if TYPE_CHECKING:
    from titan_vlm.models.common.decoder import Decoder

_DEFAULTS = Parallelism()  # the config's defaults are the library's


@dataclass(frozen=True)
class TPOptions:
    """The parallelism keys tensor parallelism reads, with the config's defaults."""

    sequence_parallel: bool = _DEFAULTS.enable_sequence_parallel
    image_embed_shard: bool = _DEFAULTS.image_embed_tp_shard

    @classmethod
    def from_config(cls, p: Parallelism) -> TPOptions:
        return cls(p.enable_sequence_parallel, p.image_embed_tp_shard)


def _check_divisible_seq(name: str, tp: int) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook on the first block of a sequence-parallel stack: the local sequence must
    split evenly over tp (DTensor's Shard(1) slices here assume it)."""

    def hook(module: nn.Module, args: tuple) -> None:
        length = args[0].shape[1]
        if length % tp:
            raise ValueError(
                f"sequence parallel: the {name} sequence on this rank has {length} tokens, "
                f"not divisible by tensor_parallel_degree={tp}"
            )

    return hook


def sp_stack_boundaries(layers: nn.ModuleList, tp_mesh: DeviceMesh, n_args: int, name: str) -> None:
    """Cut the sequence at the first block's input, gather it at the last block's output."""
    first_in = (Replicate(),) + (None,) * (n_args - 1)
    first_want = (Shard(1),) + (None,) * (n_args - 1)
    layers[0].register_forward_pre_hook(_check_divisible_seq(name, tp_mesh.size()))
    parallelize_module(
        layers[0],
        tp_mesh,
        PrepareModuleInput(
            input_layouts=first_in, desired_input_layouts=first_want, use_local_output=True
        ),
    )
    # A separate call: with one block, layers[0] is also layers[-1] and gets both hooks.
    parallelize_module(
        layers[-1],
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        ),
    )


# The leaf modules the families' TP plans split (block_plan and apply_decoder_tp here, the
# projector's and mergers' own plans: llava, qwen2_5_vl, qwen3_vl parallelize.py) column-wise,
# row-wise and by vocabulary rows: what the planner prices (plan/shapes.py tp_params).
TP_COLWISE = ("q", "k", "v", "fc1", "wq", "wk", "wv", "w1", "w3", "output")
TP_ROWWISE = ("proj", "fc2", "wo", "w2")
TP_EMBEDDING = ("tok_embeddings",)


def block_plan(
    attn: str,
    qkv: tuple[str, ...],
    out: str,
    norms: tuple[str, str],
    mlp: str | None,
    mlp_in: tuple[str, ...],
    mlp_out: str,
    n_attn_args: int,
    sp: bool,
) -> dict[str, ParallelStyle]:
    """One transformer block. `mlp` is the MLP submodule when there is one (the decoder's
    feed_forward), else None (the ViT's fc1/fc2 sit on the block)."""
    between = Shard(1) if sp else Replicate()  # the residual stream's layout between the TP regions
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in qkv}
    plan[out] = RowwiseParallel(output_layouts=between)
    plan.update({name: ColwiseParallel() for name in mlp_in})
    plan[mlp_out] = RowwiseParallel(output_layouts=between)
    if sp:
        for norm in norms:
            plan[norm] = SequenceParallel()
        # all-gather the normed slice before attention; DTensor output (not local) so the backward
        # turns the column-wise inputs' partial gradients into one reduce-scatter
        plan[attn] = PrepareModuleInput(
            input_layouts=(Shard(1),) + (None,) * (n_attn_args - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (n_attn_args - 1),
        )
        if mlp is not None:
            plan[mlp] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        else:
            plan[mlp_in[0]] = ColwiseParallel(
                input_layouts=Shard(1)
            )  # one consumer: it gathers itself
    return plan


def apply_decoder_tp(decoder: Decoder, tp_mesh: DeviceMesh, sp: bool) -> None:
    """The shared Llama-shaped decoder (models/common/decoder.py) of any family, over `tp_mesh`:
    every block's plan (`block_plan`; q/k norms reduced as SP norms are), with `sp` the
    sequence cut at the first block and gathered after the last, and the embedding rows and
    head columns split over the vocabulary, both with replicated outputs (why: the module
    docstring); tied embeddings then share the embedding's DTensor."""
    plan = block_plan(
        "attention",
        ("attention.wq", "attention.wk", "attention.wv"),
        "attention.wo",
        ("attention_norm", "ffn_norm"),
        "feed_forward",
        ("feed_forward.w1", "feed_forward.w3"),
        "feed_forward.w2",
        n_attn_args=4,
        sp=sp,
    )  # attention(x, cos, sin, layout)
    if decoder.args.qk_norm:
        # q/k norms (Qwen3) run on [B, L, heads, head_dim] with this rank's heads: their shared
        # weight's gradient is a partial sum over tp, reduced as the SP norms' are (heads = dim 2)
        for norm in ("attention.q_norm", "attention.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    # a mixture-of-experts layer: attention as above; its router and experts whole on every tp
    # rank (each computes them on the same tokens: the gradients are complete and equal, as a
    # replicated norm's), not under SP (validate: the experts would need the whole sequence)
    sparse_plan = {k: v for k, v in plan.items() if not k.startswith(("feed_forward", "ffn_norm"))}
    # under pipeline parallelism only this rank's stages' blocks (the others are parameter-free
    # placeholders), each stage's run of consecutive blocks a stack of its own (the sequence
    # cut at its first block, gathered after its last, so the hidden states cross stages whole)
    held = [i for i, block in enumerate(decoder.layers) if holds_parameters(block)]
    for i in held:
        parallelize_module(
            decoder.layers[i], tp_mesh, sparse_plan if i in decoder.args.sparse else plan
        )
    if sp:
        for run in consecutive_runs(held):  # block(x, cos, sin, layout)
            sp_stack_boundaries(
                nn.ModuleList(decoder.layers[i] for i in run), tp_mesh, 4, "decoder"
            )
    # the embedding rows and head columns, where this rank's stages hold them (a pipeline's
    # last stage names its tied head's weight with an empty module: StagePlan.prune)
    styles = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    parts = {"tok_embeddings": decoder.tok_embeddings, "output": decoder.output}
    held_parts = {
        k: v for k, v in styles.items() if isinstance(parts[k], (nn.Embedding, nn.Linear))
    }
    if held_parts:
        parallelize_module(decoder, tp_mesh, held_parts)
    # Tied embeddings: each style distributed its own copy of the one weight; both are [vocab,
    # dim] split Shard(0) over tp, so the head can take the embedding's DTensor back, exactly.
    decoder.tie_weights()


def consecutive_runs(indices: list[int]) -> list[list[int]]:
    """`indices` (ascending) in runs of consecutive values: [0, 1, 4, 5] -> [[0, 1], [4, 5]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def gather_image_embeds_over_tp(embeds: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """image_embed_tp_shard: this tp rank's slice of the image embeddings' hidden dim
    [n, tokens, dim/tp] (DTensor Shard(-1) on tp) -> the whole embeddings [n, tokens, dim],
    all-gathered where they join the text.

    Backward: every tp rank runs the same decoder on the same tokens, so the gradient of the
    whole embeddings is complete and identical on each; the exact gradient of the slice is its
    own columns of it (Replicate -> Shard(-1): a local slice, no sum, which would count it
    tp-fold)."""
    if tp_mesh.size() == 1:
        return embeds
    shape = torch.Size((*embeds.shape[:-1], embeds.shape[-1] * tp_mesh.size()))
    sharded = DTensor.from_local(
        embeds,
        tp_mesh,
        [Shard(embeds.ndim - 1)],
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )
    return sharded.redistribute(tp_mesh, [Replicate()]).to_local()
