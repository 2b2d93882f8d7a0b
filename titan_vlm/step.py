"""One training step on this rank: `forward_backward` and `train_step`.

Read `forward_backward` for where context parallelism happens: the model's forward_local is
handed the rank's CPContext, which replicates the image embeddings over cp (gradient summed
there) and shards only the text; the loss is the mean over the global batch's text tokens.

    model.forward_local(batch, CPContext(...)):
      images --ctx.encode_images--> embeds, whole on every cp rank (Replicate on cp)
      batch  --ctx.place----------> this cp rank's text slots, labels, SeqLayout
      model.decode(tokens, embeds, layout) -> logits
    -> summed loss / global text tokens
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from titan_vlm.data.batch import IGNORE_INDEX, Batch
from titan_vlm.data.image_batch import image_sizes
from titan_vlm.distributed import dist_sum
from titan_vlm.layout import SeqLayout
from titan_vlm.models.common.moe import aux_loss
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.optim import clip_grad_norm_, current_lrs
from titan_vlm.parallel.context_parallel import CPContext, CPOptions, sync_broadcast_vision_grads
from titan_vlm.parallel.tensor_parallel import TPOptions
from titan_vlm.parallel_dims import Mesh

if TYPE_CHECKING:
    from titan_vlm.parallel.pipeline import Pipeline

# FSDP2 warns when a wrapped module returns a view (nn.Linear on 3-D input does); it matters only
# for in-place ops on that output, which titan_vlm never does.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
# The HSDP mesh is sliced from the root by a flattened dim, torchtitan-style; torch says that
# spelling will change, which is for a later torch pin to follow.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def loss_tokens(batches: list[Batch], mesh: Mesh) -> torch.Tensor:
    """The loss normaliser of one optimizer step: the text tokens that carry a loss in every
    microbatch of the global batch. Counted on the whole rows a rank reads (before CP cuts them:
    a rank's CP share holds each of its rows' labels once) and summed over dp (the CP and TP
    ranks of a dp rank read the same rows), so it is known before any forward."""
    local = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    device = batches[0].labels.device
    return dist_sum(torch.tensor(local, dtype=torch.long, device=device), mesh.dp.get_group())


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of logits [B, T, vocab] against labels [B, T], summed over the tokens
    that carry a loss (fp32 logits)."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass(frozen=True)
class ExpertLoad:
    """A mixture-of-experts decoder's routing in one forward, over the whole job: the router's
    load-balancing loss (unweighted) and the top-k picks of each expert [sparse layers, E]."""

    aux_loss: float
    counts: torch.Tensor

    def stats(self) -> dict[str, float]:
        """What a step logs: moe_aux_loss; moe_load_max, the busiest expert's picks over the
        mean expert's in its layer (1: balanced; E / top_k: one expert takes every token)."""
        mean = self.counts.mean(dim=1, keepdim=True).clamp(min=1e-9)
        return {"moe_aux_loss": self.aux_loss, "moe_load_max": float((self.counts / mean).max())}


class Forward(NamedTuple):
    """What `forward_backward` returns (its docstring)."""

    loss: torch.Tensor
    ntokens: torch.Tensor
    layout: SeqLayout
    experts: ExpertLoad | None


def forward_backward(
    model: VisionLanguageModel,
    batch: Batch,
    mesh: Mesh,
    cp: CPOptions = CPOptions(),
    tp: TPOptions = TPOptions(),
    ntokens: torch.Tensor | None = None,
    accumulating: bool = False,
    microbatches: int = 1,
) -> Forward:
    """Forward and backward of one batch (or microbatch) on this rank (`Forward`): its share of
    the global loss (its loss tokens' summed loss over `ntokens`, the step's loss tokens:
    `loss_tokens`; None: this batch's own), summed over the job (identical on all ranks), the
    normaliser, this rank's layout, and a mixture-of-experts decoder's load. `accumulating`:
    another microbatch of this step follows, so cp_vision = "broadcast"'s copy of the vision
    gradients waits for the last.

    A decoder with experts adds its router's load-balancing loss (models/common/moe.py
    aux_loss: over this microbatch's tokens on every dp x cp rank, once each), weighted by
    its coefficient and divided by `microbatches`: with gradient accumulation the step's router
    loss is the mean of its microbatches', each over the whole job (the one term accumulation
    does not compute as the whole batch at once would; the language-model loss it does)."""
    # 1-3. The model's forward on this rank (VisionLanguageModel.forward_local): the image
    # embeddings of every image of the batch, whole on every CP rank (Replicate on cp; in backward
    # their gradient is summed over cp before the projector and ViT); the text CP-sharded
    # (head-tail per split sample; with cp_sample_placement = "auto" a short sample stays whole
    # on one rank, images and all), with positions and shifted labels; then the decoder.
    if ntokens is None:
        ntokens = loss_tokens([batch], mesh)
    ctx = CPContext(mesh.cp, cp, mesh.tp, tp)
    logits, labels, layout = model.forward_local(batch, ctx)
    # 4. Summed over this rank's text tokens, over the step's tokens (dp and cp; not tp: its ranks
    # hold the same tokens).
    loss = summed_loss(logits, labels) / ntokens.clamp(min=1)
    router = model.router_stats()
    load = None
    if router is not None:  # the same tokens on every tp rank: summed over dp x cp only
        share, aux, counts = aux_loss(router, mesh.job.get_group())
        loss = loss + share / microbatches
        load = ExpertLoad(float(aux), counts)
    loss.backward()
    if cp.vision == "broadcast" and not accumulating:
        sync_broadcast_vision_grads(model, mesh.cp)
    return Forward(dist_sum(loss.detach(), mesh.job.get_group()), ntokens, layout, load)


def train_step(
    model: VisionLanguageModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: Batch,
    mesh: Mesh,
    max_norm: float,
    cp: CPOptions = CPOptions(),
    tp: TPOptions = TPOptions(),
    microbatches: int = 1,
    pipeline: Pipeline | None = None,
) -> tuple[dict[str, float], list[SeqLayout]]:
    """One optimizer step over `batch`, in `microbatches` equal groups of its rows (gradient
    accumulation: training.global_batch_size; with a `pipeline`, its microbatches, run by its
    schedule over the stages: parallel/pipeline.py): each microbatch's loss over the whole
    step's loss tokens, FSDP's gradient reduction once, after the last (with a pipeline, after
    each microbatch's backward: the same sums), so the step is the one the whole batch would
    take at once. Returns its stats and this rank's layout of each microbatch
    (the CP stats are the last one's). A non-finite loss or gradient norm (the same on every
    rank: both are reduced over the job) updates nothing: the optimizer does not step and
    "nonfinite" is 1; the caller stops or goes on (training.on_nonfinite). The lr schedule
    advances either way."""
    rows = batch.num_rows // microbatches
    if rows * microbatches != batch.num_rows:
        raise ValueError(f"{batch.num_rows} rows do not split into {microbatches} microbatches")
    parts = [batch.rows(k * rows, (k + 1) * rows) for k in range(microbatches)]
    optimizer.zero_grad(set_to_none=True)
    ntokens = loss_tokens(parts, mesh)
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    loss = torch.zeros((), device=batch.tokens.device)
    layouts: list[SeqLayout] = []
    loads: list[ExpertLoad] = []
    if pipeline is not None:  # the stages' schedule runs every microbatch
        loss = dist_sum(pipeline.step(parts, ntokens), mesh.job.get_group())
        layouts = pipeline.layouts
        loads = [ExpertLoad(float(aux), counts) for aux, counts in pipeline.loads]
    else:
        for k, part in enumerate(parts):
            last = k == microbatches - 1
            for module in fsdp:  # reduce-scatter the summed gradients once, after the last
                module.set_requires_gradient_sync(last, recurse=False)
            out = forward_backward(
                model, part, mesh, cp, tp, ntokens, accumulating=not last, microbatches=microbatches
            )
            loss = loss + out.loss
            layouts.append(out.layout)
            if out.experts is not None:
                loads.append(out.experts)
    stages = mesh.pp.get_group() if pipeline is not None else None  # disjoint parameters
    copies = pipeline.copies() if pipeline is not None else []  # a tied embedding's
    grad_norm = clip_grad_norm_(list(model.parameters()), max_norm, stages, copies)
    lrs = current_lrs(optimizer)  # this step's rates, before the schedule advances
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    layout = layouts[-1]
    stats = {
        "loss": loss.item(),
        "grad_norm": grad_norm.item(),
        "ntokens": int(ntokens),
        **lrs,
        "cp_balance": layout.balance(),
        "cp_padding": layout.padding(),
        "cp_split_samples": layout.split_samples(),
        "cp_whole_samples": sum(layout.kept_samples()),
        "cp_replicated_images": layout.replicated_images(),
        "cp_sharded_images": layout.sharded_images(),
        "nonfinite": int(not finite),
    }
    if loads:  # the microbatches' mean load balance and their busiest expert
        per_part = [load.stats() for load in loads]
        stats["moe_aux_loss"] = sum(p["moe_aux_loss"] for p in per_part) / len(per_part)
        stats["moe_load_max"] = max(p["moe_load_max"] for p in per_part)
    return stats, layouts


@torch.no_grad()
def validation_sums(
    model: VisionLanguageModel,
    batch: Batch,
    mesh: Mesh,
    cp: CPOptions = CPOptions(),
    tp: TPOptions = TPOptions(),
    pipeline: Pipeline | None = None,
) -> torch.Tensor:
    """The forward of one validation batch (no gradients, the training's layout): [summed loss
    of the job's loss tokens in it, their number], float64, the same on every rank. The mean
    over several batches is the ratio of their sums (validation_loss). Under pipeline
    parallelism the stages' schedule runs it forward only, in its microbatches."""
    if pipeline is not None:
        rows, rest = divmod(batch.num_rows, pipeline.n_microbatches)
        if rest:  # validate.py keeps them whole (no accumulation with validation under pp)
            raise ValueError(
                f"a validation batch's {batch.num_rows} rows do not split into the pipeline's "
                f"{pipeline.n_microbatches} microbatches"
            )
        parts = [batch.rows(k * rows, (k + 1) * rows) for k in range(pipeline.n_microbatches)]
        loss = pipeline.evaluate(parts)  # summed over the pipeline: every stage rank has it
    else:
        logits, labels, _ = model.forward_local(batch, CPContext(mesh.cp, cp, mesh.tp, tp))
        loss = summed_loss(logits, labels)
    # the summed loss over this rank's text tokens (dp and cp; not tp: its ranks hold the same
    # tokens), the count over the whole rows each dp rank reads (loss_tokens)
    total = dist_sum(loss.double(), mesh.job.get_group())
    return torch.stack([total, loss_tokens([batch], mesh).double()])


def check_same_batch(batch: Batch, rows_mesh: DeviceMesh, step: int) -> None:
    """The CP and TP ranks of a dp group read the same rows and must build the same batch. If a
    data error struck some of them only (say a transient read error on one image), they would
    wait in different collectives and hang; one small all-gather per step turns that into the
    same error on every rank instead."""
    if rows_mesh.size() == 1:
        return
    pixels = sum(h * w for h, w in image_sizes(batch.images))
    mine = torch.tensor(
        [
            len(image_sizes(batch.images)),
            pixels,
            int((batch.doc >= 0).sum()),
            int(batch.tokens.sum()),
        ],
        dtype=torch.long,
        device=batch.tokens.device,
    )
    everyone = mine.new_empty(rows_mesh.size() * mine.numel())
    dist.all_gather_single(everyone, mine, group=rows_mesh.get_group())
    everyone = everyone.view(rows_mesh.size(), -1)
    if not bool((everyone == everyone[0]).all()):
        raise RuntimeError(
            f"step {step}: the CP/TP ranks that share rows built different batches (images, "
            f"their pixels, slots, token sum per rank: {everyone.tolist()}); a data error on "
            "some ranks only?"
        )
