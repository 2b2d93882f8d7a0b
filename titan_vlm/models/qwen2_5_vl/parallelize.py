"""The "qwen2_5_vl" family's parallelism, applied from outside (torchtitan's parallelize_*):
tensor (and sequence) parallelism on its decoder (`apply_tp`: the shared decoder's plan,
parallel/tensor_parallel.py apply_decoder_tp), then torch.compile, activation checkpointing and
FSDP of its vision blocks and decoder blocks through the shared helpers (parallel/parallelize.py,
which says why each mesh and divisor, and why in this order).

The vision tower and its merger are whole on every tp rank: each tp rank of a (dp, cp)
coordinate encodes the same images with the same weights (FSDP shards them over dp and cp
only), which is exact: the decoder's first block takes the image embeddings replicated over tp,
so their gradient reaches every tp rank complete (all-reduced by the column-wise inputs'
backward, or all-gathered from SP's sequence slices), and every tp rank computes the same
vision gradient. Why not split it too: its attention's fused qkv [3 * dim, dim] splits
column-wise into a mix of q, k and v rows, so it needs a plan of its own (a strided shard, or
separate q, k, v loaded from slices of the file's tensor); the decoder holds most of the
parameters and the activations of a long row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.parallel import parallelize as shared
from titan_vlm.parallel.tensor_parallel import TPOptions, apply_decoder_tp

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.parallel_dims import Mesh


def apply_tp(model: Qwen25VL, tp_mesh: DeviceMesh, options: TPOptions = TPOptions()) -> None:
    """Tensor (and, with options.sequence_parallel, sequence) parallelism on the decoder over
    `tp_mesh` (module docstring: the vision tower stays whole)."""
    if tp_mesh.size() > 1:
        apply_decoder_tp(model.decoder, tp_mesh, options.sequence_parallel)


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
    tp: TPOptions = TPOptions(),
    fullgraph: bool = True,
    compile_backend: str = "inductor",
) -> Qwen25VL:
    """Everything the trainer applies to the model: tensor parallelism on the decoder
    (`apply_tp`), torch.compile of each block, activation checkpointing around the compiled
    blocks, then FSDP with the vision units (each block, then
    the tower: patch embedding and merger) on cp_vision's mesh and the decoder units (each block,
    then the decoder: embeddings, final norm, head) on mesh.fsdp."""
    apply_tp(model, mesh.tp, tp)
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
        TPOptions.from_config(cfg.parallelism),
        fullgraph=cfg.compile.fullgraph,
        compile_backend=cfg.compile.backend,
    )
