"""The "qwen3_vl" family's parallelism, applied from outside: torch.compile, activation
checkpointing and FSDP of its vision blocks and decoder blocks through the shared helpers
(parallel/parallelize.py), as Qwen2.5-VL's. Tensor parallelism is not planned for this family
yet: validate.py refuses tensor_parallel_degree > 1 in one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from titan_vlm.models.qwen3_vl.model import Qwen3VL
from titan_vlm.parallel import parallelize as shared

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.parallel_dims import Mesh


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> None:
    """ModelSpec.parallelize: compile each block, checkpoint activations around them, then FSDP
    with the vision units (each block, then the tower: patch and position embeddings, mergers)
    on cp_vision's mesh and the decoder units (each block, then the decoder) on mesh.fsdp."""
    if not isinstance(model, Qwen3VL):
        raise TypeError(f"the qwen3_vl family parallelizes its Qwen3VL, got {type(model).__name__}")
    stacks = [model.vision.layers, model.decoder.layers]
    if cfg.compile.enable:
        shared.apply_compile(stacks, cfg.compile.fullgraph, cfg.compile.backend)
    shared.apply_ac(stacks, cfg.activation_checkpoint.mode)
    shared.apply_fsdp(
        [*model.vision.layers, model.vision],
        [*model.decoder.layers, model.decoder],
        mesh,
        cfg.training.mixed_precision,
        cfg.parallelism.cp_vision,
    )
