"""The "qwen2_5_vl" family's parallelism, applied from outside (torchtitan's parallelize_*):
torch.compile, activation checkpointing and FSDP of its vision blocks and decoder blocks through
the shared helpers (parallel/parallelize.py, which says why each mesh and divisor, and why in
this order). No tensor parallelism: validate.py refuses tensor_parallel_degree > 1 (the vision
attention's fused qkv needs a plan of its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from titan_vlm.errors import ConfigError
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.parallel import parallelize as shared

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.parallel_dims import Mesh


def apply_ac(model: Qwen25VL, mode: str) -> None:
    """Activation checkpointing of the vision and decoder blocks (parallel/parallelize.py
    apply_ac)."""
    shared.apply_ac([model.vision.layers, model.decoder.layers], mode)


def apply_compile(model: Qwen25VL, fullgraph: bool = True, backend: str = "inductor") -> None:
    """torch.compile of each vision and decoder block (parallel/parallelize.py apply_compile)."""
    shared.apply_compile([model.vision.layers, model.decoder.layers], fullgraph, backend)


def parallelize_qwen(
    model: Qwen25VL,
    mesh: Mesh,
    mixed_precision: str = "fp32",
    cp_vision: str = "shard",
    ac_mode: str = "none",
    compile_blocks: bool = False,
    fullgraph: bool = True,
    compile_backend: str = "inductor",
) -> Qwen25VL:
    """Everything the trainer applies to the model: torch.compile of each block, activation
    checkpointing around the compiled blocks, then FSDP with the vision units (each block, then
    the tower: patch embedding and merger) on cp_vision's mesh and the decoder units (each block,
    then the decoder: embeddings, final norm, head) on mesh.fsdp."""
    if mesh.tp.size() > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={mesh.tp.size()} is not yet for qwen2_5_vl"
        )
    if compile_blocks:
        apply_compile(model, fullgraph, compile_backend)
    apply_ac(model, ac_mode)
    shared.apply_fsdp(
        [*model.vision.layers, model.vision],
        [*model.decoder.layers, model.decoder],
        mesh,
        mixed_precision,
        cp_vision,
    )
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
        fullgraph=cfg.compile.fullgraph,
        compile_backend=cfg.compile.backend,
    )
