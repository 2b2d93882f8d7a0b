"""The "qwen3_vl" family's parallelism, applied from outside: tensor parallelism on its vision
tower, mergers and decoder (`apply_tp`), then torch.compile, activation checkpointing and FSDP of
its vision blocks and decoder blocks through the shared helpers (parallel/parallelize.py, which
says why each mesh and divisor, and why in this order), as Qwen2.5-VL's.

The plan, over the tp mesh dim (no sequence parallelism yet: validate.py):
  vision blocks  the shared block plan (`block_plan`): q, k, v and the MLP's fc1 column-wise
                 (whole heads per rank; the fused qkv of the files is held as three), proj and
                 fc2 row-wise, their outputs all-reduced; LayerNorms, the patch embedding and
                 the learned positions whole on every tp rank
  mergers        the main one and each DeepStack one: fc1 column-wise, fc2 row-wise, the
                 output all-reduced, so an image slot's row (its embedding and features) is
                 whole on every tp rank, as the decoder's DeepStack additions need
  decoder        the shared decoder's plan (`apply_decoder_tp`)

Exactness: as Qwen2.5-VL's (its parallelize.py): every tp rank of a (dp, cp) coordinate encodes
the same images and holds the same slots; DTensor sums each partial once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_vlm.models.qwen3_vl.model import Qwen3VL
from titan_vlm.parallel import parallelize as shared
from titan_vlm.parallel.tensor_parallel import TPOptions, apply_decoder_tp, block_plan

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.parallel_dims import Mesh


def apply_tp(model: Qwen3VL, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism on the tower, its mergers and the decoder over `tp_mesh` (module
    docstring). Parameters become DTensors on tp; FSDP then shards them further."""
    if tp_mesh.size() == 1:
        return
    vision_plan = block_plan(
        "attn",
        ("attn.q", "attn.k", "attn.v"),
        "attn.proj",
        ("norm1", "norm2"),
        "mlp",
        ("mlp.fc1",),
        "mlp.fc2",
        n_attn_args=4,
        sp=False,
    )  # attn(x, cos, sin, plan)
    vision = model.vision  # None off a pipeline's first stage (parallel/pipeline.py)
    if vision is not None:
        for block in vision.layers:
            parallelize_module(block, tp_mesh, vision_plan)
        merger_plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        for merger in [vision.merger, *vision.deepstack_mergers]:
            parallelize_module(merger, tp_mesh, merger_plan)
    apply_decoder_tp(model.decoder, tp_mesh, sp=False)


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> None:
    """ModelSpec.parallelize: tensor parallelism, compile each block, checkpoint activations
    around them, then FSDP with the vision units (each block, then the tower: patch and position
    embeddings, mergers) on cp_vision's mesh and the decoder units (each block, then the decoder)
    on mesh.fsdp."""
    if not isinstance(model, Qwen3VL):
        raise TypeError(f"the qwen3_vl family parallelizes its Qwen3VL, got {type(model).__name__}")
    assert not TPOptions.from_config(cfg.parallelism).sequence_parallel  # validate.py
    apply_tp(model, mesh.tp)
    vision = model.vision  # None off a pipeline's first stage (parallel/pipeline.py)
    stacks = [*([vision.layers] if vision is not None else []), model.decoder.layers]
    if cfg.compile.enable:
        shared.apply_compile(
            stacks, cfg.compile.fullgraph, cfg.compile.backend, mesh.ep is not None
        )
    shared.apply_ac(stacks, cfg.activation_checkpoint.mode)
    shared.apply_fsdp(
        [*vision.layers, vision] if vision is not None else [],
        model.decoder,
        mesh,
        cfg.training.mixed_precision,
        cfg.parallelism.cp_vision,
    )
