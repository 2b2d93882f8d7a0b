"""Apply parallelism to a VLM from the outside (the model code holds none).

FSDP2 meshes: a parameter is reduced over exactly the ranks whose gradients are different parts
of its whole gradient.
  decoder                  -> mesh.dp_shard_cp  (each CP rank's gradient comes from its own text)
  vision tower + projector -> cp_vision "shard": mesh.dp_shard_cp, summed (each CP rank encoded
                              its own images);
                              "replicate": mesh.dp_shard_cp, averaged over cp (every CP rank
                              holds the same complete gradient: the cp sum happened on the image
                              embeddings, and summing over cp again would count it CP-fold; one
                              owner per shard also keeps the copies from drifting apart where
                              GPU kernels are not bit-deterministic);
                              "broadcast": mesh.dp_shard (only cp rank 0 runs the ViT; its
                              gradients are copied to the other CP ranks)
Gradients are summed, never averaged: the loss is already divided by the global text-token count.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_vlm.models.vlm import VLM
from titan_vlm.parallel_dims import Mesh


def _shard(module: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, divide_by: int = 1) -> None:
    fully_shard(module, mesh=mesh, mp_policy=mp)
    assert isinstance(module, FSDPModule)
    # Sum over ranks, then divide by `divide_by` (1: a plain sum): sum-only comms, since gloo has
    # no PREMUL_SUM / AVG.
    module.set_gradient_divide_factor(float(divide_by))
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model: VLM, mesh: Mesh, mixed_precision: str = "fp32", cp_vision: str = "shard") -> None:
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    vision_mesh = mesh.dp_shard if cp_vision == "broadcast" else mesh.dp_shard_cp
    vision_divide = mesh.cp.size() if cp_vision == "replicate" else 1
    decoder_mesh = mesh.dp_shard_cp
    for module in [*model.vision.layers, model.vision, model.projector]:
        _shard(module, vision_mesh, mp, vision_divide)
    for block in model.decoder.layers:
        _shard(block, decoder_mesh, mp)
    _shard(model.decoder, decoder_mesh, mp)


def parallelize_vlm(model: VLM, mesh: Mesh, mixed_precision: str = "fp32", cp_vision: str = "shard") -> VLM:
    """Everything the trainer applies to the model. CP itself needs no module changes: it lives
    in the batch sharding and the SeqLayout the attention receives (context_parallel.py)."""
    apply_fsdp(model, mesh, mixed_precision, cp_vision)
    return model
