"""Apply parallelism to a VLM from the outside (the model code holds none): the helpers every
family's parallelize (models/<family>/parallelize.py, its ModelSpec.parallelize) calls with its own
modules. Nothing here names a family's modules.

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

The order every family applies them in: its own tensor parallelism, torch.compile of each block,
activation checkpointing around the compiled blocks, then FSDP. Compile before AC (torchtitan
checkpoints first and compiles the wrapper): on torch 2.13 a block compiled with its checkpoint
inside and TP DTensors in it fails at its first forward (AOT autograd saves the DTensors'
DeviceMesh among the tensors for backward: torch/_functorch/_aot_autograd/runtime_wrappers.py,
_AutogradSavedState.save_from_forward, "expected all tensors_saved_with_vc_check to be
Tensors"). Wrapped after compiling, the non-reentrant checkpoint drops what the compiled forward
saves and reruns it in backward (its collectives included, in the same order on every rank), for
every layout. CP itself needs no module changes: it lives in the batch sharding and the SeqLayout
the attention receives (context_parallel.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from titan_vlm.models.common.decoder import Decoder, holds_parameters
from titan_vlm.models.common.moe import Experts, MoE

if TYPE_CHECKING:
    from titan_vlm.parallel_dims import Mesh

AC_MODES = ("none", "full", "selective")


def _shard(
    module: nn.Module,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    divide_by: int = 1,
    reshard: bool | None = None,
) -> None:
    if reshard is None:
        fully_shard(module, mesh=mesh, mp_policy=mp)  # torch's choice: roots stay unsharded
    else:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    assert isinstance(module, FSDPModule)
    # Sum over ranks, then divide by `divide_by` (1: a plain sum): sum-only comms, since gloo has
    # no PREMUL_SUM / AVG.
    module.set_gradient_divide_factor(float(divide_by))
    module.set_force_sum_reduction_for_comms(True)


def decoder_units(decoder: Decoder, mesh: Mesh) -> list[nn.Module]:
    """The FSDP units of a family's `decoder`, innermost first: each decoder layer, then the
    decoder (its embeddings, final norm and head). Under pipeline parallelism (parallel/
    pipeline.py: the stages call the decoder's parts, never its own forward, so it cannot be a
    unit itself) each layer this rank's stages hold, then each other part they run: the token
    embeddings on the first stage, the final norm and the head on the last (whose tied weight
    the embeddings there only name: StagePlan.prune)."""
    if mesh.pp.size() == 1:
        return [*decoder.layers, decoder]
    units = [m for m in decoder.layers if holds_parameters(m)]
    embeddings = (
        decoder.tok_embeddings if isinstance(decoder.tok_embeddings, nn.Embedding) else None
    )
    return units + [m for m in (embeddings, decoder.norm, decoder.output) if m is not None]


def apply_fsdp(
    vision: list[nn.Module],
    decoder: Decoder,
    mesh: Mesh,
    mixed_precision: str = "fp32",
    cp_vision: str = "shard",
) -> None:
    """FSDP2 on a family's units, innermost first (its blocks, then the modules holding them):
    `vision`, the modules encode_images runs (vision tower and projector; none off a pipeline's
    first stage), on the mesh and with the divisor the module docstring gives for cp_vision;
    the `decoder`'s (`decoder_units`) on mesh.fsdp, summed. With expert parallelism, the
    decoder's experts (models/common/moe.py Experts) are first split over mesh.ep
    (parallel/expert_parallel.py apply_ep) and made FSDP units of their own on
    mesh.expert_fsdp, summed (the ranks there hold the same experts for other tokens).
    Under pipeline parallelism every unit's parameters are freed after its forward (each unit
    is a root of its own there, which torch would otherwise keep whole from a microbatch's
    forward to its backward), and there is no FSDP without dp or cp ranks to shard over (a
    zero-bubble schedule's split backward needs the parameters themselves:
    parallel/pipeline.py) but for bf16 mixed precision, which FSDP's policy applies, and tensor
    parallelism (FSDP on one rank makes every parameter a DTensor, as the optimizer's fused
    step needs where TP made some)."""
    reshard: bool | None = None  # torch's choice: roots stay unsharded after the forward
    if mesh.pp.size() > 1:
        if mesh.fsdp.size() == 1 and mesh.tp.size() == 1 and mixed_precision == "fp32":
            return
        reshard = True
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    vision_mesh = mesh.fsdp_no_cp if cp_vision == "broadcast" else mesh.fsdp
    vision_divide = mesh.cp.size() if cp_vision == "replicate" else 1
    for module in vision:
        _shard(module, vision_mesh, mp, vision_divide, reshard)
    units = decoder_units(decoder, mesh)
    if mesh.ep is not None:  # the experts first: split over ep, their own FSDP units
        assert mesh.expert_fsdp is not None
        experts = list(
            dict.fromkeys(m for d in units for m in d.modules() if isinstance(m, Experts))
        )
        apply_ep(experts, mesh.ep)
        for module in experts:
            _shard(module, mesh.expert_fsdp, mp)
    for module in units:
        _shard(module, mesh.fsdp, mp, reshard=reshard)
    # a pipeline's last stage: the head's weight is now FSDP's, the embeddings' name for it too
    decoder.tie_weights()


def apply_ep(experts: list[Experts], ep: DeviceMesh) -> None:
    """Expert parallelism on `experts` (models/common/moe.py Experts modules): their stacked
    weights become DTensors sharded along dim 0 (the expert) over `ep`, and their forward sends
    each row to its expert's rank (parallel/expert_parallel.py ep_experts). Before FSDP, which
    shards them further over mesh.expert_fsdp (apply_fsdp)."""
    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep.size():
                raise ValueError(f"{param.shape[0]} experts do not split over ep={ep.size()}")
            sharded = distribute_tensor(param.data, ep, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        module.ep_group = str(ep.get_group().group_name)


def apply_ac(stacks: list[nn.ModuleList], mode: str) -> None:
    """Activation checkpointing of the blocks of each stack (a ViT's, a decoder's): "full"
    recomputes every block in backward, "selective" every other block (half the activation
    memory saved for half the recomputation). The recomputed forward reruns the CP attention,
    collectives included, in the same order on every rank."""
    if mode == "none":
        return
    every = 1 if mode == "full" else 2
    for layers in stacks:
        for i in range(0, len(layers), every):
            if holds_parameters(layers[i]):  # not another pipeline stage's placeholder
                layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)


_first_symbol_proxy_installed = False


def keep_first_symbol_proxy() -> None:
    """Make torch's make_fx tracer keep the FIRST proxy it registers for each bare size symbol
    (s27), as it already does for each SymInt; without it a compiled TP block dies with a
    RecursionError in proxy_tensor._compute_proxy at its first recompile, when dynamo makes the
    batch's sizes dynamic (automatic_dynamic_shapes) and AOT autograd traces the block again.

    The torch 2.13 behaviour (torch/fx/experimental/proxy_tensor.py): `set_proxy_slot` never
    clobbers a SymInt's proxy in `tracer.symnode_tracker`, but for a SymInt whose expression is a
    bare symbol it also writes `tracer.sympy_expr_tracker[symbol]` unconditionally.
    `get_proxy_slot` falls back to that map for a SymInt the tracer never saw: with DTensors in
    the graph those are common (AOT autograd does not pass a subclass's outer sizes to make_fx,
    and DTensor's sharding propagation mints its own; the map exists for exactly these, see the
    comment in set_proxy_slot). In the joint trace of the block's backward, C++ stride code calls
    `sym_max(s27, 1)` on such an untracked s27 (the DTensor linear's ViewBackward0, where the
    dynamic dim is the sequence: dim 1), the result simplifies to the bare symbol s27 and is
    registered with a lazy proxy that computes sym_max(<proxy of its argument>, 1), overwriting
    the placeholder's entry for s27. Forcing that lazy proxy looks its argument up, finds it
    untracked, falls back to the map, gets itself, and recurses until Python gives up
    (_compute_proxy -> Thunk.force -> _compute_proxy ...). Plain tensors (no TP) leave no size
    untracked, and in the runs checked neither the TP ViT (its dynamic dim is the image count,
    dim 0) nor TP with SP hit it; the decoder under TP without SP did (aot_eager and inductor).

    The fix restores the entry that was there first (the graph input's, as the symnode tracker's
    first-one-wins policy would): every proxy registered for a bare symbol computes the same
    value, so only which node the graph refers to changes, and the first is the primal. The
    patch wraps torch's own function and changes nothing else; it is installed once per process
    by apply_compile. Checked by tests/test_compile.py::test_compiled_tp_recompiles_match_eager
    (fails without it)."""
    global _first_symbol_proxy_installed
    if _first_symbol_proxy_installed:
        return
    from torch.fx.experimental import proxy_tensor

    original = proxy_tensor.set_proxy_slot

    def set_proxy_slot(obj: Any, tracer: Any, proxy: Any) -> None:
        exprs: dict[Any, Any] | None = getattr(tracer, "sympy_expr_tracker", None)
        first = None
        if exprs is not None and isinstance(obj, proxy_tensor.py_sym_types):
            expr = getattr(obj.node, "expr", None)
            if getattr(expr, "is_Symbol", False):  # a bare sympy.Symbol
                first = exprs.get(expr)
        original(obj, tracer, proxy)
        if exprs is not None and first is not None:
            exprs[expr] = first

    # make_fx's own callers (_sym_register among them) look the name up in the module.
    setattr(proxy_tensor, "set_proxy_slot", set_proxy_slot)  # noqa: B010 - an overloaded def
    _first_symbol_proxy_installed = True


def apply_compile(
    stacks: list[nn.ModuleList],
    fullgraph: bool = True,
    backend: str = "inductor",
    expert_parallel: bool = False,
) -> None:
    """torch.compile each block of each stack in place (the blocks of a stack share one compiled
    graph). The decoder's attention, local or context-parallel, is one opaque custom op
    (titan_vlm::attention, attention.py), so with `fullgraph` each block is a single graph and a
    graph break is an error. Runs before apply_ac: the checkpoint wrapper goes around the
    compiled block (why: the module docstring). Sizes stay torch's default: static at first,
    dynamic once a batch has changed them (automatic_dynamic_shapes), so a few graphs per block
    cover every batch (docs/parallelism.md, Compile); with TP those recompiles need
    keep_first_symbol_proxy. `expert_parallel`: a block with a mixture of experts compiles its
    other children instead (below)."""
    keep_first_symbol_proxy()
    # A block past dynamo's recompile limit would otherwise run eager from then on, silently:
    # an error instead (raise torch._dynamo.config.recompile_limit if a run needs more graphs).
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for layers in stacks:
        for block in layers:
            if not holds_parameters(block):  # another pipeline stage's placeholder
                continue
            if expert_parallel and any(isinstance(m, MoE) for m in block.modules()):
                # its experts become an FSDP unit of their own (apply_fsdp: their mesh is not
                # the block's), whose hooks no compiled graph can hold: the block's other
                # children are compiled, each one graph; the routing and the experts' exchange
                # run eager
                for child in block.children():
                    if not isinstance(child, MoE):
                        child.compile(fullgraph=fullgraph, backend=backend)
            else:
                block.compile(fullgraph=fullgraph, backend=backend)
