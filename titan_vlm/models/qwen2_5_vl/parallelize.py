"""The "qwen2_5_vl" family's parallelism, applied from outside (torchtitan's parallelize_*):
tensor (and sequence) parallelism on its vision tower, patch merger and decoder (`apply_tp`),
then torch.compile, activation checkpointing and FSDP of its vision blocks and decoder blocks
through the shared helpers (parallel/parallelize.py, which says why each mesh and divisor, and
why in this order; parallel/tensor_parallel.py says why TP splits what it splits).

The plan, over the tp mesh dim:
  vision blocks  the shared block plan (`block_plan`): q, k, v and the gated MLP's w1, w3
                 column-wise (whole heads per rank: transformers' fused qkv [3 * dim, dim] is
                 held as three projections, vision.py, since a column split of the fused tensor
                 would give a rank a mix of q, k and v rows; the HF adapter reads and writes
                 the fused tensor's thirds), proj and w2 row-wise;
  merger         fc1 column-wise, fc2 row-wise: its output is all-reduced to every tp rank, or
                 with image_embed_tp_shard reduce-scattered along the hidden dim (each rank's
                 dim/tp columns cross the CP group and are all-gathered where they join the text:
                 parallel/context_parallel.py CPContext.encode_images); its norm (ln_q), the
                 patch embedding and the block norms without SP are whole on every tp rank;
  decoder        the shared decoder's plan (`apply_decoder_tp`: blocks, vocabulary-split
                 embedding and head).

Sequence parallelism cuts both stacks' residual streams over tp: the decoder's local slots,
which the layout pads to a multiple of tp (CPContext.place), and the tower's packed patch
sequence, which the tower pads with zero rows to a multiple of tp (VisionTower.sequence_multiple:
rows in no attention block, dropped before the merger, so exact), gathered after the last block
(the merger's units are groups of consecutive rows, so it runs on the whole sequence).

Exactness: every tp rank of a (dp, cp) coordinate encodes the same images and holds the same
slots, so a replicated activation's gradient is complete on every tp rank; the partial sums are
summed by DTensor, each once (row-wise outputs in forward, column-wise inputs' gradients in
backward, SP norm weights' gradients); the image embeddings enter the decoder replicated over
tp, and the decoder's first block makes their gradient complete on each tp rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.parallel import parallelize as shared
from titan_vlm.parallel.tensor_parallel import (
    TPOptions,
    apply_decoder_tp,
    block_plan,
    sp_stack_boundaries,
)

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.parallel_dims import Mesh


def apply_tp(model: Qwen25VL, tp_mesh: DeviceMesh, options: TPOptions = TPOptions()) -> None:
    """Tensor (and, with options.sequence_parallel, sequence) parallelism on the vision tower,
    the patch merger and the decoder over `tp_mesh` (the module docstring). Parameters become
    DTensors on tp; FSDP then shards them further on its dp mesh."""
    if tp_mesh.size() == 1:
        return
    sp = options.sequence_parallel
    vision_plan = block_plan(
        "attn",
        ("attn.q", "attn.k", "attn.v"),
        "attn.proj",
        ("norm1", "norm2"),
        "mlp",
        ("mlp.w1", "mlp.w3"),
        "mlp.w2",
        n_attn_args=4,
        sp=sp,
    )  # attn(x, cos, sin, plan)
    vision = model.vision  # None off a pipeline's first stage (parallel/pipeline.py)
    if vision is not None:
        for block in vision.layers:
            parallelize_module(block, tp_mesh, vision_plan)
        if sp:
            sp_stack_boundaries(vision.layers, tp_mesh, 4, "vision")  # block(x, cos, sin, plan)
            vision.sequence_multiple = tp_mesh.size()
        merged = Shard(-1) if options.image_embed_shard else Replicate()
        parallelize_module(
            vision.merger,
            tp_mesh,
            {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(output_layouts=merged)},
        )
    apply_decoder_tp(model.decoder, tp_mesh, sp)


def block_stacks(model: Qwen25VL) -> list[nn.ModuleList]:
    """The tower's and the decoder's blocks (no tower off a pipeline's first stage)."""
    vision = [model.vision.layers] if model.vision is not None else []
    return [*vision, model.decoder.layers]


def apply_ac(model: Qwen25VL, mode: str) -> None:
    """Activation checkpointing of the vision and decoder blocks (parallel/parallelize.py
    apply_ac)."""
    shared.apply_ac(block_stacks(model), mode)


def apply_compile(model: Qwen25VL, fullgraph: bool = True, backend: str = "inductor") -> None:
    """torch.compile of each vision and decoder block (parallel/parallelize.py apply_compile)."""
    shared.apply_compile(block_stacks(model), fullgraph, backend)


def parallelize_qwen(
    model: Qwen25VL,
    mesh: Mesh,
    mixed_precision: str = "fp32",
    cp_vision: str = "shard",
    ac_mode: str = "none",
    compile_blocks: bool = False,
    tp: TPOptions = TPOptions(),
    fullgraph: bool = True,
    compile_backend: str = "inductor",
) -> Qwen25VL:
    """Everything the trainer applies to the model: tensor parallelism (`apply_tp`),
    torch.compile of each block, activation checkpointing around the compiled
    blocks, then FSDP with the vision units (each block, then
    the tower: patch embedding and merger) on cp_vision's mesh and the decoder units (each block,
    then the decoder: embeddings, final norm, head) on mesh.fsdp. Under pipeline parallelism,
    on what this rank's stages hold (parallel/pipeline.py StagePlan.prune)."""
    apply_tp(model, mesh.tp, tp)
    if compile_blocks:
        apply_compile(model, fullgraph, compile_backend)
    apply_ac(model, ac_mode)
    vision = [*model.vision.layers, model.vision] if model.vision is not None else []
    shared.apply_fsdp(vision, model.decoder, mesh, mixed_precision, cp_vision)
    return model


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> None:
    """ModelSpec.parallelize: `parallelize_qwen` with the config's choices."""
    if not isinstance(model, Qwen25VL):
        raise TypeError(
            f"the qwen2_5_vl family parallelizes its Qwen25VL, got {type(model).__name__}"
        )
    parallelize_qwen(
        model,
        mesh,
        cfg.training.mixed_precision,
        cfg.parallelism.cp_vision,
        cfg.activation_checkpoint.mode,
        cfg.compile.enable,
        TPOptions.from_config(cfg.parallelism),
        fullgraph=cfg.compile.fullgraph,
        compile_backend=cfg.compile.backend,
    )
