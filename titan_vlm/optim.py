"""AdamW, warmup + cosine schedule, and a global-norm clip that knows each parameter's mesh."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_vlm.config import Training
from titan_vlm.distributed import dist_sum, local_tensor


def top_level_module(name: str) -> str:
    """A parameter's top-level module ("vision.layers.0.q.weight" -> "vision")."""
    return name.split(".")[0]


def accumulation_steps(t: Training, dp: int) -> int:
    """Microbatches per optimizer step: training.global_batch_size / (local_batch_size x dp),
    1 where global_batch_size is 0 (validate.py checks that it divides)."""
    return t.global_batch_size // (t.local_batch_size * dp) if t.global_batch_size else 1


def frozen_groups(t: Training) -> set[str]:
    """The parameter groups training.freeze names (validate.py checks the names)."""
    return {g.strip() for g in t.freeze.split(",") if g.strip()}


def freeze(model: nn.Module, group_of: Callable[[str], str], groups: set[str]) -> int:
    """Stop the parameters of `groups` (by `group_of` their name: ModelSpec.group_of) from
    training: requires_grad False, so autograd computes no gradient for them, FSDP reduces none
    and build_optimizer leaves them out. Returns how many parameters (elements) it froze."""
    frozen = 0
    for name, p in model.named_parameters():
        if group_of(name) in groups:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def _decays(name: str, p: torch.Tensor) -> bool:
    """Matrices decay; norms, biases and position embeddings do not."""
    return p.ndim >= 2 and "pos_embed" not in name


def param_group_keys(
    model: nn.Module, group_of: Callable[[str], str] = top_level_module
) -> list[tuple[str, bool]]:
    """The (parameter group, decays) of build_optimizer's param groups, in their order."""
    keys = [(group_of(n), _decays(n, p)) for n, p in model.named_parameters() if p.requires_grad]
    return list(dict.fromkeys(keys))


def build_optimizer(
    model: nn.Module,
    t: Training,
    group_of: Callable[[str], str] = top_level_module,
    keys: list[tuple[str, bool]] | None = None,
) -> torch.optim.Optimizer:
    """One param group per (parameter group, weight decay), over the parameters that train
    (`freeze` left the others out: no optimizer state). `group_of` names a parameter's group
    (ModelSpec.group_of: vision, projector, decoder); the vision and projector groups take
    training.vision_lr / projector_lr where set, else training.lr, all under one schedule. Each
    group's parameters live on one mesh (foreach kernels cannot mix DTensor meshes), and the
    groups are the same whatever the parallel layout, so optimizer state saved at one layout
    loads at another. Each param group carries "lr_name", the metric its rate is logged as
    ("lr", or "lr_vision" / "lr_projector" where that group has its own rate).
    Matrices decay; norms, biases and position embeddings do not. The fused implementation (one
    kernel per group and step, on CPU and CUDA alike) costs a third of the per-parameter loop's
    time on the debug model (docs/performance.md, "The optimizer"). `keys`: the groups to make,
    in order, empty where `model` holds none of them (a pipeline stage's part of the model: the
    whole model's groups, param_group_keys, so that every stage and layout has the same)."""
    own = {"vision": t.vision_lr, "projector": t.projector_lr}
    groups: dict[tuple[str, bool], list[nn.Parameter]] = {key: [] for key in keys or []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((group_of(name), _decays(name, p)), []).append(p)
    param_groups = [
        {
            "params": ps,
            "weight_decay": t.weight_decay if decay else 0.0,
            "lr": own.get(group) or t.lr,
            "lr_name": f"lr_{group}" if own.get(group) else "lr",
        }
        for (group, decay), ps in groups.items()
    ]
    return torch.optim.AdamW(param_groups, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def current_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Each param group's current rate under its "lr_name" (build_optimizer): "lr" (training.lr's
    groups, else the first group's rate, so the metric is always there) and "lr_vision" /
    "lr_projector" where those groups have their own."""
    out: dict[str, float] = {}
    for group in optimizer.param_groups:
        out.setdefault(group.get("lr_name", "lr"), float(group["lr"]))
    out.setdefault("lr", float(optimizer.param_groups[0]["lr"]))
    return out


def build_scheduler(opt: torch.optim.Optimizer, t: Training) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.Tensor],
    max_norm: float,
    stages: dist.ProcessGroup | None = None,
    copies: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Global L2 norm of all gradients (as one unsharded model would have), clipped to max_norm.

    Each FSDP (and TP) mesh dim that shards a parameter holds disjoint pieces of it, so the squared
    norm is the sum of the local shards' squares all-reduced over those dims; dims that replicate
    it (HSDP's dp_replicate, tp for norms) and ranks outside a mesh's reduction (e.g. CP ranks for
    the vision tower) hold identical copies and are not added again. `stages`: the pipeline's
    group (parallel/pipeline.py), whose ranks hold disjoint parameters: their squares are summed
    over it too (every rank joins, whatever gradients it holds). `copies`: parameters of
    `params` whose gradient another pipeline rank holds and counts too (a tied embedding's
    last-stage copy: Pipeline.copies), clipped but not counted here.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    clipped_only = [p.grad for p in copies if p.grad is not None]
    for p in params:
        if p.grad is None or any(p is c for c in copies):
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (None, ())
        groups.setdefault(key, []).append(g)
    total_sq = None
    for (mesh, placements), grads in groups.items():
        local = [local_tensor(g) for g in grads]
        sq = torch.stack([x.float().pow(2).sum() for x in local]).sum()
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                raise RuntimeError(
                    f"clip_grad_norm_: a gradient is still Partial on mesh dim {dim} (unreduced)"
                )
            # Shard, or FSDP's _StridedShard over a TP-sharded dim (not a Shard subclass, so not
            # is_shard()): disjoint pieces, summed. Replicate: identical copies, counted once.
            if not placement.is_replicate() and mesh.size(dim) > 1:
                dist_sum(sq, mesh.get_group(dim))
        total_sq = sq if total_sq is None else total_sq + sq
    if stages is not None:
        if total_sq is None:  # no gradient here: this rank's share is 0
            total_sq = torch.zeros((), device=params[0].device if params else "cpu")
        total_sq = dist_sum(total_sq, stages)
    if total_sq is None:
        return torch.tensor(0.0)
    norm = total_sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grads in [*groups.values(), clipped_only]:
            for g in grads:
                local_tensor(g).mul_(coef.to(g.device))
    return norm
