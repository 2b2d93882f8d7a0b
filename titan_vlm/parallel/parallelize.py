"""Apply parallelism to a VLM from the outside (the model code holds none).

Tensor (and sequence) parallelism first (parallel/tensor_parallel.py): parameters become
DTensors on the tp mesh dim; FSDP below then shards each further over its dp mesh (2-D
DTensors, as torchtitan), and the tp sums happen inside DTensor, so no gradient is reduced over
tp twice. Parameters that TP leaves whole are identical on the tp ranks and so are their
(complete) gradients: FSDP's meshes never include tp.

FSDP2 meshes: a parameter is reduced over exactly the ranks whose gradients are different parts
of its whole gradient.
  decoder                  -> mesh.fsdp (dp_shard x cp), summed (each CP rank's gradient comes
                              from its own text)
  vision tower + projector -> cp_vision "shard": mesh.fsdp, summed (each CP rank encoded its own
                              images);
                              "replicate": mesh.fsdp, averaged over cp (every CP rank
                              holds the same complete gradient: the cp sum happened on the image
                              embeddings, and summing over cp again would count it CP-fold; one
                              owner per shard also keeps the copies from drifting apart where
                              GPU kernels are not bit-deterministic);
                              "broadcast": mesh.fsdp_no_cp (only cp rank 0 runs the ViT; its
                              gradients are copied to the other CP ranks)
With dp_replicate > 1 both meshes are HSDP: the gradient is also all-reduced (summed) over
dp_replicate, whose ranks read different rows.
Gradients are summed, never averaged: the loss is already divided by the global text-token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_vlm.models.vlm import VLM
from titan_vlm.parallel.tensor_parallel import TPOptions, apply_tp

if TYPE_CHECKING:
    from titan_vlm.parallel_dims import Mesh

AC_MODES = ("none", "full", "selective")


def _shard(
    module: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, divide_by: int = 1
) -> None:
    fully_shard(module, mesh=mesh, mp_policy=mp)
    assert isinstance(module, FSDPModule)
    # Sum over ranks, then divide by `divide_by` (1: a plain sum): sum-only comms, since gloo has
    # no PREMUL_SUM / AVG.
    module.set_gradient_divide_factor(float(divide_by))
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: VLM, mesh: Mesh, mixed_precision: str = "fp32", cp_vision: str = "shard"
) -> None:
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    vision_mesh = mesh.fsdp_no_cp if cp_vision == "broadcast" else mesh.fsdp
    vision_divide = mesh.cp.size() if cp_vision == "replicate" else 1
    decoder_mesh = mesh.fsdp
    for module in [*model.vision.layers, model.vision, model.projector]:
        _shard(module, vision_mesh, mp, vision_divide)
    for block in model.decoder.layers:
        _shard(block, decoder_mesh, mp)
    _shard(model.decoder, decoder_mesh, mp)


def apply_ac(model: VLM, mode: str) -> None:
    """Activation checkpointing of the ViT and decoder blocks: "full" recomputes every block in
    backward, "selective" every other block (half the activation memory saved for half the
    recomputation). The recomputed forward reruns the CP attention, collectives included, in the
    same order on every rank."""
    if mode == "none":
        return
    every = 1 if mode == "full" else 2
    for layers in (model.vision.layers, model.decoder.layers):
        for i in range(0, len(layers), every):
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)


def apply_compile(model: VLM, fullgraph: bool = True, backend: str = "inductor") -> None:
    """torch.compile each ViT and decoder block in place (the blocks share one compiled graph).
    The decoder's attention, local or context-parallel, is one opaque custom op
    (titan_vlm::attention, attention.py), so with `fullgraph` each block is a single graph and a
    graph break is an error. Runs before apply_ac: the checkpoint wrapper goes around the
    compiled block (why: parallelize_vlm)."""
    for layers in (model.vision.layers, model.decoder.layers):
        for block in layers:
            block.compile(fullgraph=fullgraph, backend=backend)


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
    """Everything the trainer applies to the model: tensor parallelism, torch.compile of each
    block, activation checkpointing around the compiled blocks, then FSDP. CP itself needs no
    module changes: it lives in the batch sharding and the SeqLayout the attention receives
    (context_parallel.py).

    Compile before AC (torchtitan checkpoints first and compiles the wrapper): on torch 2.13 a
    block compiled with its checkpoint inside and TP DTensors in it fails at its first forward
    (AOT autograd saves the DTensors' DeviceMesh among the tensors for backward:
    torch/_functorch/_aot_autograd/runtime_wrappers.py, _AutogradSavedState.save_from_forward,
    "expected all tensors_saved_with_vc_check to be Tensors"). Wrapped after compiling, the
    non-reentrant checkpoint drops what the compiled forward saves and reruns it in backward
    (its collectives included, in the same order on every rank), for every layout."""
    apply_tp(model, mesh.tp, tp)
    if compile_blocks:
        apply_compile(model, fullgraph, compile_backend)
    apply_ac(model, ac_mode)
    apply_fsdp(model, mesh, mixed_precision, cp_vision)
    return model
