"""The "llava" family's parallelism, applied from outside (torchtitan's parallelize_*): its tensor
parallel plan by module name (`apply_tp`), then compile, activation checkpointing and FSDP of its
ViT and decoder blocks through the shared helpers (parallel/parallelize.py). Why each mesh and
divisor: parallel/parallelize.py; why TP splits what it splits: parallel/tensor_parallel.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from titan_vlm.models.llava.model import VLM
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


def apply_tp(model: VLM, tp_mesh: DeviceMesh, options: TPOptions = TPOptions()) -> None:
    """Tensor (and, with options.sequence_parallel, sequence) parallelism on the ViT, projector and
    decoder over `tp_mesh`. Parameters become DTensors on tp; FSDP then shards them further on
    the dp mesh (2-D). Parameters left alone (patch embedding, position embedding, final norms,
    block norms without SP) are replicated: each tp rank computes their complete gradient."""
    if tp_mesh.size() == 1:
        return
    sp = options.sequence_parallel
    vit_plan = block_plan(
        "attn",
        ("attn.q", "attn.k", "attn.v"),
        "attn.proj",
        ("norm1", "norm2"),
        None,
        ("fc1",),
        "fc2",
        n_attn_args=2,
        sp=sp,
    )  # attn(x, plan)
    apply_decoder_tp(model.decoder, tp_mesh, sp)
    if model.vision is None:  # off a pipeline's first stage (parallel/pipeline.py)
        return
    for block in model.vision.layers:
        parallelize_module(block, tp_mesh, vit_plan)
    if sp:
        sp_stack_boundaries(model.vision.layers, tp_mesh, 2, "ViT")  # block(x, plan)
        # images of different sizes: their packed sequence padded to whole tp slices
        model.vision.sequence_multiple = tp_mesh.size()
    # Projector: column- then row-wise. With image_embed_tp_shard its partial sums are
    # reduce-scattered along the hidden dim instead of all-reduced: the embeddings stay sharded
    # (and travel the CP group at 1/tp size) until gather_image_embeds_over_tp.
    parallelize_module(
        model.projector,
        tp_mesh,
        {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(
                output_layouts=Shard(-1) if options.image_embed_shard else Replicate()
            ),
        },
    )


def block_stacks(model: VLM) -> list[nn.ModuleList]:
    """The ViT's and the decoder's blocks (no ViT off a pipeline's first stage)."""
    vision = [model.vision.layers] if model.vision is not None else []
    return [*vision, model.decoder.layers]


def apply_ac(model: VLM, mode: str) -> None:
    """Activation checkpointing of the ViT and decoder blocks (parallel/parallelize.py apply_ac)."""
    shared.apply_ac(block_stacks(model), mode)


def apply_compile(
    model: VLM, fullgraph: bool = True, backend: str = "inductor", expert_parallel: bool = False
) -> None:
    """torch.compile of each ViT and decoder block (parallel/parallelize.py apply_compile)."""
    shared.apply_compile(block_stacks(model), fullgraph, backend, expert_parallel)


def parallelize_vlm(
    model: VLM,
    mesh: Mesh,
    mixed_precision: str = "fp32",
    cp_vision: str = "shard",
    ac_mode: str = "none",
    compile_blocks: bool = False,
    tp: TPOptions = TPOptions(),
    fullgraph: bool = True,
    compile_backend: str = "inductor",
) -> VLM:
    """Everything the trainer applies to the model: tensor parallelism (`apply_tp`), then
    torch.compile of each block, activation checkpointing around the compiled blocks and FSDP
    (why in this order: parallel/parallelize.py). Under pipeline parallelism the model is this
    rank's stages (parallel/pipeline.py StagePlan.prune: the rest removed): each applies to what
    they hold (shared.decoder_units)."""
    apply_tp(model, mesh.tp, tp)
    if compile_blocks:
        apply_compile(model, fullgraph, compile_backend, mesh.ep is not None)
    apply_ac(model, ac_mode)
    vision = [*model.vision.layers, model.vision, model.projector] if model.vision else []
    shared.apply_fsdp(vision, model.decoder, mesh, mixed_precision, cp_vision)
    return model


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> None:
    """ModelSpec.parallelize: `parallelize_vlm` with the config's choices."""
    if not isinstance(model, VLM):
        raise TypeError(f"the llava family parallelizes its VLM, got {type(model).__name__}")
    p = cfg.parallelism
    tp = TPOptions.from_config(p)
    parallelize_vlm(
        model,
        mesh,
        cfg.training.mixed_precision,
        p.cp_vision,
        cfg.activation_checkpoint.mode,
        cfg.compile.enable,
        tp,
        fullgraph=cfg.compile.fullgraph,
        compile_backend=cfg.compile.backend,
    )
