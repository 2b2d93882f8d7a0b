"""Pipeline parallelism: the model cut into stages, a pipeline rank's each, trained over
microbatches by a schedule of torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B,
InterleavedZeroBubble).

    stages (pp = 2; Interleaved1F1B: v stages a rank, stage s on rank s mod pp):
      stage 0:    ViT + projector + tok_embeddings, decoder layers [0, a) -> h [slots, dim]
      stage k:    decoder layers [a, b)                                   -> h [slots, dim]
      last stage: decoder layers [b, n) + norm + output                    -> its summed loss / N

Every pipeline rank reads the same rows (the pp and cp ranks of a dp rank share its batch) and
builds each microbatch's CP layout itself (`CPContext.place`: arithmetic on the rows, no
collective), so only the hidden states cross stages, from a (stage, cp rank) to the next stage's
rank of the same cp rank:

    pp x cp = 2 x 2:   (stage 0, cp 0) --h of cp 0's slots--> (stage 1, cp 0)
                       (stage 0, cp 1) --h of cp 1's slots--> (stage 1, cp 1)
    each stage's attention exact over its cp ranks (the layout's CP attention, as without pp)

They travel flattened, [rows x local length, dim], padded to one number of slots (`wire_slots`:
torch.distributed.pipelining sends tensors of one shape, fixed when the stage is built), each
stage cutting its microbatch's own [rows, length] back out (its layout says which). The image
embeddings are made on stage 0's cp ranks, whole on each (CPContext.encode_images: their gradient
summed over cp before the projector and ViT) and used there (they enter the first layer's input),
the loss on the last.

Invariants: the loss of the step is the one process's (each microbatch's summed loss over N,
the whole step's loss tokens: `loss_tokens`; the schedule scales nothing, scale_grads=False), so
every pipeline degree, schedule and microbatch count computes the same gradients (but for a
mixture-of-experts decoder's load-balancing loss, which is a microbatch's: `Balance`); a parameter
lives on one stage (a tied embedding on two: below), under its one-process name (the model is
built whole, then `prune`d), so the gradient norm is each stage's squares summed over the
pipeline (optim.clip_grad_norm_'s `stages`) and a checkpoint holds the one model's names.

With data parallelism, each stage's units are FSDP-sharded over its dp ranks by the family's
parallelize (parallel/parallelize.py decoder_units: what a stage calls as a module), and each
dp rank reads its own rows (not with a zero-bubble schedule: its split backward computes the
weights' gradients on the module's own parameters, which FSDP swaps for unsharded ones). With
context parallelism, the stage's units are FSDP-sharded over dp x cp (mesh.fsdp), which sums the
cp ranks' gradients as without pp (the ViT and projector as without pp too: over dp alone
with cp_vision = "broadcast").

Every family runs through its VisionLanguageModel.decode_stage (the first stage builds the
first block's input as `decode` does; M-RoPE positions come from each microbatch's layout on
every stage); a family that adds image features after some decoder layers (Qwen3-VL's
DeepStack) has them on the first stage, which holds those layers (first_stage_layers: the split
and the config's validation keep them there). With tied embeddings the first stage holds the
weight for the lookups and the last for the head, under the one name
(decoder.tok_embeddings.weight, `StagePlan.prune`); after each step's backward the two copies
exchange gradients and each holds the sum (`sum_tied_grads`), counted once in the norm
(`Pipeline.copies`), so both take the same step. Compile and activation checkpointing wrap each
block a stage holds, as without stages; with bf16 mixed precision the stages compute and send
bf16 (FSDP's policy, applied under pp even without dp or cp ranks), the loss in fp32. With
tensor parallelism each stage's blocks, embeddings and head are split over its tp ranks as
without stages, each (stage, tp rank) sending its (whole, replicated) hidden states to the next
stage's rank of the same tp rank; with sequence parallelism each stage's run of blocks cuts
the sequence at its first block and gathers it after its last (tensor_parallel.py
apply_decoder_tp), so what crosses stages is whole. A mixture-of-experts decoder's
load-balancing loss couples every sparse layer, so each stage adds its routers' statistics to a
carrier that crosses stages with the hidden states and the last stage computes the loss
(`Balance`); with expert parallelism each stage's experts are split over its dp x cp ranks as
without stages. Validation runs the same schedule forward only (`evaluate`: torch's
schedule.eval) over a validation batch's microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_vlm.config import JobConfig, PPSchedule
from titan_vlm.data.batch import IGNORE_INDEX
from titan_vlm.distributed import dist_sum, local_tensor
from titan_vlm.layout import LayoutCost
from titan_vlm.models.common.moe import RouterStats, balance_loss
from titan_vlm.models.common.text_args import DecoderArgs, MoEArgs
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.parallel.context_parallel import CPContext, sync_broadcast_vision_grads

if TYPE_CHECKING:
    from titan_vlm.data.batch import Batch, Images
    from titan_vlm.layout.seq_layout import SeqLayout

# parallelism.pipeline_parallel_schedule -> torch.distributed.pipelining.schedules' class (that
# module is imported where a pipeline is built: it imports torch._dynamo, half a second of every
# worker's start-up, which runs without stages need not pay)
SCHEDULES: dict[PPSchedule, str] = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
}
MULTI_STAGE = ("Interleaved1F1B",)  # schedules of several stages a rank
ZERO_BUBBLE = ("InterleavedZeroBubble",)  # each backward split: inputs' gradients, then weights'
ROUNDS = (*MULTI_STAGE, *ZERO_BUBBLE)  # microbatches in rounds of one a stage rank


def split_layers(n_layers: int, stages: int) -> list[range]:
    """The decoder layers of each of `stages` stages, in order: as even as they divide, the
    first stages one fewer where they do not (stage 0 also runs the ViT)."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"{n_layers} decoder layers cannot make {stages} pipeline stages")
    base, extra = divmod(n_layers, stages)
    return ranges_of([base + (k >= stages - extra) for k in range(stages)])


def ranges_of(sizes: Sequence[int]) -> list[range]:
    """Consecutive layer ranges of these sizes, from layer 0."""
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(len(sizes))]


def balanced_split(
    n_layers: int, stages: int, first: float, last: float, min_first: int = 1
) -> list[range]:
    """The decoder layers of each of `stages` stages, in order and at least one each (the first
    at least `min_first`: VisionLanguageModel.first_stage_layers), that make the costliest stage
    cheapest, a decoder layer costing 1 and the first stage `first` more (the ViT, projector and
    token embeddings) and the last `last` more (the norm, head and loss); among those the most
    even (the least sum of squared stage costs), then the lightest first stages. With first =
    last = 0 and min_first = 1 it is `split_layers`."""
    min_first = max(min_first, 1)
    if stages < 1 or n_layers < stages - 1 + min_first:
        need = f" (the first holding {min_first})" if min_first > 1 else ""
        raise ValueError(f"{n_layers} decoder layers cannot make {stages} pipeline stages{need}")
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last
    best: dict[tuple[int, int], tuple[float, float, tuple[int, ...]]] = {}

    def solve(k: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        """The best split of layers [start, n) over stages k.."""
        if k == stages - 1:
            cost = n_layers - start + extra[k]
            return cost, cost * cost, (n_layers - start,)
        if (k, start) not in best:
            options = []
            for j in range(min_first if k == 0 else 1, n_layers - start - (stages - 1 - k) + 1):
                worst, squares, rest = solve(k + 1, start + j)
                cost = j + extra[k]
                options.append((max(cost, worst), cost * cost + squares, (j, *rest)))
            best[k, start] = min(options)
        return best[k, start]

    return ranges_of(solve(0, 0)[2])


def stage_costs(
    cost: LayoutCost, head_per_token: float, n_layers: int, rows: int, seq_len: int, images: int
) -> tuple[float, float]:
    """(first, last) of `balanced_split`: what a microbatch of `rows` rows of `seq_len` slots,
    one sample each with `images` images in all, costs the first stage beyond its layers (the
    ViT and projector: `cost.image` an image) and the last (the head: `head_per_token` a slot,
    counted on every slot although it runs on the text: a bound, which the image slots'
    share of a row makes loose),
    in units of one decoder layer's cost (its share of `cost.slot` a slot and `cost.pair` a
    query-key pair, causal over each row). `cost`: the family's (ModelSpec.layout_cost)."""
    pairs = seq_len * (seq_len + 1) / 2
    layer = rows * (cost.slot * seq_len + cost.pair * pairs) / n_layers
    return cost.image * images / layer, head_per_token * rows * seq_len / layer


def parse_stage_layers(
    text: str, stages: int, n_layers: int, min_first: int = 1
) -> list[range] | None:
    """parallelism.pipeline_parallel_stage_layers ("1,2": each stage's decoder layers, in
    order) as the stages' layers; None where it is empty. ValueError (one line) where it does
    not give `stages` counts of at least one summing to `n_layers`, the first at least
    `min_first` (VisionLanguageModel.first_stage_layers)."""
    if not text.strip():
        return None
    key = f"parallelism.pipeline_parallel_stage_layers={text!r}"
    parts = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() for x in parts):
        raise ValueError(f'{key}: expected comma-separated layer counts, e.g. "1,2"')
    sizes = [int(x) for x in parts]
    if len(sizes) != stages or min(sizes) < 1 or sum(sizes) != n_layers:
        raise ValueError(
            f"{key}: needs {stages} counts (one a stage: degree x stages_per_rank) of at least "
            f"1 layer, summing to the decoder's {n_layers} layers"
        )
    if sizes[0] < min_first:
        raise ValueError(
            f"{key}: the first stage must hold the decoder's first {min_first} layers (the "
            "model adds image features after them: DeepStack)"
        )
    return ranges_of(sizes)


def stage_holds(stage: int, layers: range, num_stages: int) -> str:
    """What stage `stage` of `num_stages` runs, in words: the tower, projector and embeddings
    on the first, its decoder `layers`, the norm and head on the last."""
    what = ["vision, projector, embeddings"] if stage == 0 else []
    what += [f"layers {layers.start}-{layers.stop - 1}"] if len(layers) else []
    what += ["norm, head"] if stage == num_stages - 1 else []
    return ", ".join(what)


@dataclass(frozen=True)
class StagePlan:
    """Which stages pipeline rank `rank` of `degree` holds and the decoder layers of every stage:
    one stage a rank (`per_rank` = 1: stage = rank), or `per_rank` of them, stage s on rank
    s mod degree (Interleaved1F1B's loop order); `split`: each stage's layers (`stage_split`),
    or none: `split_layers` over degree x per_rank."""

    rank: int
    degree: int
    per_rank: int
    n_layers: int
    split: tuple[range, ...] = ()

    @property
    def num_stages(self) -> int:
        return self.degree * self.per_rank

    @property
    def stages(self) -> list[int]:
        return [self.rank + k * self.degree for k in range(self.per_rank)]

    @property
    def layers(self) -> list[range]:
        return list(self.split) or split_layers(self.n_layers, self.num_stages)

    def holds(self, stage: int) -> bool:
        return stage in self.stages

    def describe(self) -> str:
        """Who holds what, for the log: one clause a stage."""
        return "; ".join(
            f"stage {s} (rank {s % self.degree}): {stage_holds(s, layers, self.num_stages)}"
            for s, layers in enumerate(self.layers)
        )

    def prune(self, model: VisionLanguageModel) -> None:
        """Remove from `model` (whole, as one process builds it: on the meta device, before
        its parameters are allocated) what this rank's stages do not run: every module but the
        decoder (the ViT, projector) and the token embeddings off stage 0, the final norm and
        head off the last stage, the decoder layers of other stages (left as parameter-free
        placeholders, so the kept ones keep their one-process names). With tied embeddings the
        last stage's head owns the weight, and the token embeddings there become an empty
        module that Decoder.tie_weights gives it to, so it keeps the one-process name
        (decoder.tok_embeddings.weight: the same checkpoint keys, optimizer state and Hugging
        Face tensor as without stages); the first and last stages each hold a copy, whose
        gradients `Pipeline.step` sums."""
        decoder = model.decoder
        kept = {i for s in self.stages for i in self.layers[s]}
        last = self.holds(self.num_stages - 1)
        if not self.holds(0):
            for name, _ in list(model.named_children()):
                if name != "decoder":
                    setattr(model, name, None)
            tied = decoder.args.tie_embeddings and last
            decoder.tok_embeddings = nn.Module() if tied else None  # type: ignore[assignment]
        if not last:
            decoder.norm = None  # type: ignore[assignment]
            decoder.output = None  # type: ignore[assignment]
        for i in range(len(decoder.layers)):
            if i not in kept:
                decoder.layers[i] = nn.Identity()
        decoder.tie_weights()


def stage_split(
    cfg: JobConfig, degree: int, cost: LayoutCost, decoder: DecoderArgs, min_first: int = 1
) -> list[range]:
    """Each stage's decoder layers for the trainer (`split_stages`) for a microbatch of the
    config's rows: pipeline_parallel_microbatch_size rows of training.seq_len slots,
    data.images_per_sample images each (the planner prices the same rows). `cost`: the family's
    cost model (ModelSpec.layout_cost); `min_first`: the layers the first stage must hold
    (VisionLanguageModel.first_stage_layers)."""
    p = cfg.parallelism
    rows = p.pipeline_parallel_microbatch_size
    return split_stages(
        p.pipeline_parallel_stage_layers,
        degree * p.pipeline_parallel_stages_per_rank,
        cost,
        head_flops_per_token(decoder.dim, decoder.vocab_size),
        decoder.n_layers,
        rows,
        cfg.training.seq_len,
        rows * cfg.data.images_per_sample,
        min_first,
    )


def split_stages(
    stage_layers: str,
    stages: int,
    cost: LayoutCost,
    head_per_token: float,
    n_layers: int,
    rows: int,
    seq_len: int,
    images: int,
    min_first: int = 1,
) -> list[range]:
    """Each of `stages` stages' decoder layers: `stage_layers`
    (parallelism.pipeline_parallel_stage_layers) where it is set, else `balanced_split` by
    `stage_costs` of a microbatch of `rows` rows of `seq_len` slots holding `images` images,
    the first stage holding at least `min_first` layers. The one rule the trainer
    (`stage_split`) and the planner (plan/pipeline.py) split by. ValueError (one line) for a
    split that does not fit."""
    given = parse_stage_layers(stage_layers, stages, n_layers, min_first)
    if given is not None:
        return given
    first, last = stage_costs(cost, head_per_token, n_layers, rows, seq_len, images)
    return balanced_split(n_layers, stages, first, last, min_first)


def head_flops_per_token(dim: int, vocab_size: int) -> float:
    """Model FLOPs of forward + backward of the output head on one slot (2 a weight, 3x)."""
    return 6.0 * dim * vocab_size


def stage_plan(
    cfg: JobConfig, pp: DeviceMesh, model: VisionLanguageModel, cost: LayoutCost
) -> StagePlan | None:
    """This rank's StagePlan of `model` under the config's pipeline keys on the mesh's pp dim
    (`stage_split`; `cost`: the family's cost model); None without pipeline parallelism."""
    if pp.size() == 1:
        return None
    decoder = model.decoder.args
    split = stage_split(cfg, pp.size(), cost, decoder, model.first_stage_layers)
    return StagePlan(
        pp.get_local_rank(),
        pp.size(),
        cfg.parallelism.pipeline_parallel_stages_per_rank,
        decoder.n_layers,
        tuple(split),
    )


def bubble(schedule: PPSchedule, stages: int, per_rank: int, microbatches: int) -> float:
    """The modelled share of a step each rank idles (equal stages, forward and backward of a
    microbatch on a stage the unit): (p - 1) / (v m + p - 1) for p ranks of v stages each and
    m microbatches; GPipe and 1F1B idle alike (1F1B only keeps fewer activations alive). A
    zero-bubble schedule fills the bubble with the weights' gradients: the ZB-1P paper's
    (p - 1)(F + B - W) of idle time, a third of 1F1B's (p - 1)(F + B + W) with the forward F,
    the inputs' backward B and the weights' W alike: (p - 1) / (3 v m + p - 1)."""
    p = stages // per_rank
    if schedule in ZERO_BUBBLE:
        return (p - 1) / (3 * per_rank * microbatches + p - 1)
    return (p - 1) / (per_rank * microbatches + p - 1)


def check_schedule(schedule: PPSchedule, degree: int, per_rank: int, microbatches: int) -> None:
    """ValueError (one line, the config's keys) where `schedule` cannot run `degree` ranks of
    `per_rank` stages each over `microbatches` microbatches."""
    key = "parallelism.pipeline_parallel"
    if schedule not in SCHEDULES:
        raise ValueError(f"{key}_schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
    if schedule in MULTI_STAGE and per_rank < 2:
        raise ValueError(
            f"{key}_schedule={schedule!r} runs several stages a rank: set "
            f"{key}_stages_per_rank >= 2"
        )
    if schedule not in ROUNDS and per_rank != 1:
        raise ValueError(
            f"{key}_schedule={schedule!r} runs one stage a rank, not "
            f"{key}_stages_per_rank={per_rank} (Interleaved1F1B runs several)"
        )
    if schedule != "GPipe" and microbatches < degree:
        raise ValueError(
            f"{key}_schedule={schedule!r} needs at least {degree} microbatches a step (one a "
            f"stage rank), got {microbatches}: more rows a step, or a smaller "
            f"{key}_microbatch_size"
        )
    if schedule in ROUNDS and microbatches % degree:
        raise ValueError(
            f"{key}_schedule={schedule!r}: {microbatches} microbatches a step do not divide "
            f"into rounds of {degree} (one a stage rank)"
        )


@dataclass
class Microbatch:
    """One microbatch as every stage of a cp rank sees it: this cp rank's tokens and labels
    [B, T] and layout (B: its rows, or 1 where cp_sample_placement = "auto" places them as one),
    its images (stage 0 encodes them) and the step's loss tokens N."""

    tokens: torch.Tensor
    labels: torch.Tensor
    layout: SeqLayout
    images: Images
    ntokens: torch.Tensor

    @property
    def length(self) -> int:
        """Its local sequence length: image prefix and text section."""
        return self.layout.num_image_tokens + self.tokens.shape[1]

    @property
    def slots(self) -> int:
        """The hidden states' slots [rows x length] that cross stages."""
        return self.tokens.shape[0] * self.length


def microbatches(
    parts: list[Batch], ntokens: torch.Tensor, bidirectional: bool, ctx: CPContext
) -> list[Microbatch]:
    """Each part's Microbatch on this cp rank, every one normalised by the step's `ntokens`."""
    out = []
    for part in parts:
        tokens, labels, layout = ctx.place(part, bidirectional)
        out.append(Microbatch(tokens, labels, layout, part.images, ntokens))
    return out


def wire_slots(rows: int, seq_len: int, cp: int, multiple: int = 1) -> int:
    """The most hidden-state slots a cp rank's microbatch of `rows` rows of `seq_len` slots can
    have, rows x local length (what crosses stages is padded to it). The image prefix is the
    longest row's replicated images (at most seq_len) and the text section the longest row's
    share of its text: at most seq_len without cp, and with cp at most twice a row's text slots
    (a one-token sample is padded to 2 cp slots, 2 on each rank). So one row holds at most
    seq_len without cp and 2 seq_len with it; several rows at most 2 seq_len a row without cp,
    3 seq_len with it (the prefix of one row, the text of another; cp_sample_placement = "auto"
    joins the rows into one, within that). `multiple`: the local length is padded to a
    multiple of it (sequence parallelism's tp), up to multiple - 1 slots more a row."""
    pad = rows * (multiple - 1)
    if cp == 1:
        return rows * seq_len * min(rows, 2) + pad
    return rows * seq_len * (2 if rows == 1 else 3) + pad


@dataclass(frozen=True)
class Balance:
    """A mixture-of-experts decoder's load-balancing loss (models/common/moe.py aux_loss) across
    stages. It couples every sparse layer (each expert's picks and router probabilities summed
    over all of them), so each stage adds its layers' statistics to a carrier that crosses
    stages with the hidden states, [1 + sparse layers, E] fp32: row 0 the probabilities' sums
    (with their graph: the last stage's loss sends their gradient back through the stages to
    each router), row 1 + j the picks of sparse layer j (detached). The last stage computes
    each microbatch's loss from it (moe.py balance_loss over `group`, dp x cp: the global
    microbatch's tokens), over `microbatches` as the trainer's accumulation does per microstep:
    the loss is a pipeline microbatch's, as without stages a microstep's of the same rows. It is
    not linear in the picks, so it is the run's without stages only where a microbatch holds a
    microstep's rows (pipeline_parallel_microbatch_size = training.local_batch_size; the
    trainer warns otherwise): 1F1B's backward starts before a step's later microbatches have
    picked, so no stage could use the step's totals."""

    args: MoEArgs
    sparse: tuple[int, ...]  # the decoder's sparse layers in order: rows 1.. of the carrier
    microbatches: int
    group: dist.ProcessGroup | None

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(1 + len(self.sparse), self.args.num_experts, device=device)

    def add(self, carrier: torch.Tensor, router: RouterStats | None, layers: range) -> torch.Tensor:
        """`carrier` with the statistics of a stage's forward over `layers` added."""
        if router is None:  # no sparse layer among them
            return carrier.clone()
        rows = [1 + self.sparse.index(i) for i in layers if i in self.sparse]
        picks = torch.zeros_like(carrier[1:]).index_copy(
            0, torch.tensor(rows, device=carrier.device) - 1, router.stats[:, 0].detach()
        )
        return carrier + torch.cat([router.stats[:, 1].sum(dim=0, keepdim=True), picks])

    def loss(self, carrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The microbatch's share of the loss over the step (over `microbatches`), the
        microbatch's aux (detached, global) and its global picks [sparse layers, E]."""
        share, aux, counts = balance_loss(carrier[0], carrier[1:].detach(), self.args, self.group)
        return share / self.microbatches, aux, counts


class StageModule(nn.Module):
    """Stage `stage` of `num_stages` of `model` (pruned: `prune`), as a PipelineStage runs it:
    `forward(x, *carrier, mb)` with `mb` the microbatch's number [1] (every stage's keyword
    input) and `x` stage 0's copy of it, or the hidden states [slots, dim] the stage before sent
    (flattened [rows, length, dim], padded); returns the hidden states so, or on the last stage
    the microbatch's summed loss over N. With a mixture-of-experts decoder (`balance`) the
    router statistics' carrier comes after the hidden states, in and out (`Balance`), and the
    last stage adds the load-balancing loss and keeps each microbatch's (`loads`). `table`:
    this step's microbatches (set before each schedule step); `ctx`: the cp rank's groups and
    choices (stage 0 encodes the images through it)."""

    def __init__(
        self,
        model: VisionLanguageModel,
        stage: int,
        num_stages: int,
        layers: range,
        slots: int,
        ctx: CPContext,
        balance: Balance | None = None,
    ):
        super().__init__()
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.layers, self.slots, self.ctx, self.balance = layers, slots, ctx, balance
        # the last stage's (aux, global picks) of each microbatch of the step, by number
        self.loads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.model = [model]  # not a submodule: the stage's own modules are registered below
        decoder = model.decoder
        own: dict[str, nn.Module] = {f"layer_{i}": decoder.layers[i] for i in layers}
        if self.first:
            own |= {name: m for name, m in model.named_children() if name != "decoder"}
            own["tok_embeddings"] = decoder.tok_embeddings
        if self.last:
            own |= {"norm": decoder.norm, "output": decoder.output}
        self.own = nn.ModuleDict(own)  # what this stage's backward and optimizer see
        self.table: list[Microbatch] = []

    def forward(
        self, x: torch.Tensor, *carried: torch.Tensor, mb: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        k = int(mb[0])
        m, model = self.table[k], self.model[0]
        if self.first:
            embeds = self.ctx.encode_images(model, m.images)
            h = model.decode_stage(m.tokens, embeds, m.layout, None, self.layers, self.last)
        else:
            h = x[: m.slots].view(m.tokens.shape[0], m.length, -1)
            h = model.decode_stage(m.tokens, None, m.layout, h, self.layers, self.last)
        carrier = None
        if self.balance is not None:
            before = carried[0] if carried else self.balance.empty(h.device)
            carrier = self.balance.add(before, model.router_stats(), self.layers)
        if not self.last:
            h = F.pad(h.reshape(m.slots, -1), (0, 0, 0, self.slots - m.slots))
            return h if carrier is None else (h, carrier)
        loss = F.cross_entropy(
            h.float().flatten(0, 1),
            m.labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ) / m.ntokens.clamp(min=1)
        if self.balance is not None and carrier is not None and torch.is_grad_enabled():
            # training (validation's forward adds no load-balancing loss: Pipeline.evaluate)
            share, aux, counts = self.balance.loss(carrier)
            loss = loss + share
            self.loads[k] = (aux, counts)
        return loss


def sum_tied_grads(weight: torch.Tensor, group: dist.ProcessGroup, peer: int) -> None:
    """Tied embeddings under pipeline parallelism: the first stage's copy of the weight got the
    embedding lookups' gradient, the last stage's the head's; each gets their sum, exchanged
    between the two (pipeline rank `peer` of `group` is the other; the same shards of it under
    FSDP, whose meshes are alike on every pipeline rank). a + b on one, b + a on the other: the
    same bits, so the two copies take the same optimizer step and stay one weight. A frozen
    decoder has no gradient on either."""
    if weight.grad is None:
        return
    mine = local_tensor(weight.grad)
    theirs = torch.empty_like(mine)
    other = dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, mine, other, group), dist.P2POp(dist.irecv, theirs, other, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    mine.add_(theirs)


def _loss(output: torch.Tensor, target: object) -> torch.Tensor:
    """The schedule's loss of a microbatch: the last stage's output already is."""
    del target
    return output


class Pipeline:
    """This pipeline rank's stages (`plan`) of `model` (pruned by plan.prune, its parameters
    allocated and filled) and the schedule that trains them: `step(parts, ntokens)` runs one
    optimizer step's forward and backward over the microbatches `parts` (each of `rows` rows of
    `seq_len` slots) and returns the step's loss (the sum of the microbatches', on every pipeline
    rank). `group`: the pipeline ranks, in stage order; `device`: this rank's; `ctx`: this rank's
    cp group and choices (CPContext(): no context parallelism); `dtype`: the hidden states'
    between stages (the compute's: bfloat16 with training.mixed_precision = "bf16")."""

    def __init__(
        self,
        model: VisionLanguageModel,
        plan: StagePlan,
        group: dist.ProcessGroup,
        schedule: PPSchedule,
        n_microbatches: int,
        rows: int,
        seq_len: int,
        device: torch.device,
        ctx: CPContext = CPContext(),
        dtype: torch.dtype = torch.float32,
        batch_group: dist.ProcessGroup | None = None,
    ):
        from torch.distributed.pipelining import PipelineStage, schedules

        check_schedule(schedule, plan.degree, plan.per_rank, n_microbatches)
        self.group, self.model, self.plan, self.ctx = group, model, plan, ctx
        self.bidirectional = model.bidirectional_images
        cp = ctx.cp_mesh.size() if ctx.cp_mesh is not None else 1
        multiple = ctx.tp_mesh.size() if ctx.tp_mesh is not None and ctx.tp.sequence_parallel else 1
        self.slots = wire_slots(rows, seq_len, cp, multiple)
        decoder, last = model.decoder.args, plan.num_stages - 1
        moe = decoder.moe
        self.balance = (
            Balance(moe, tuple(sorted(decoder.sparse)), n_microbatches, batch_group)
            if moe is not None
            else None
        )
        self.modules: list[StageModule] = []
        stages = []
        for s in plan.stages:
            module = StageModule(
                model, s, plan.num_stages, plan.layers[s], self.slots, ctx, self.balance
            )
            hidden = torch.empty(
                self.slots, decoder.dim, dtype=dtype, device="meta", requires_grad=True
            )
            wire: tuple[torch.Tensor, ...] = (hidden,)
            if self.balance is not None:  # the router statistics' carrier
                wire += (self.balance.empty("meta").requires_grad_(),)
            index = torch.empty(1, dtype=torch.long, device="meta")
            stages.append(
                PipelineStage(
                    module,
                    s,
                    plan.num_stages,
                    device,
                    input_args=(index,) if s == 0 else wire,
                    output_args=torch.empty((), device="meta") if s == last else wire,
                    group=group,
                )
            )
            self.modules.append(module)
        self.first, self.last = plan.holds(0), plan.holds(last)
        kind = getattr(schedules, SCHEDULES[schedule])
        many = issubclass(kind, schedules.PipelineScheduleMulti)
        self.schedule = kind(
            stages if many else stages[0],
            n_microbatches,
            loss_fn=_loss,
            scale_grads=False,
        )
        self.n_microbatches = n_microbatches
        self.layouts: list[SeqLayout] = []  # the last step's microbatches' layouts
        # the last step's (aux, global picks [sparse layers, E]) of each microbatch, on every
        # pipeline rank (a mixture-of-experts decoder's: `Balance`)
        self.loads: list[tuple[torch.Tensor, torch.Tensor]] = []
        # tied embeddings: the copy of the weight this rank holds (first or last stage, never
        # both: pp > 1), whose gradient is half the one-process one (`sum_tied_grads`)
        tied = model.decoder.args.tie_embeddings and self.first != self.last
        self.tied = model.decoder.tok_embeddings.weight if tied else None

    def copies(self) -> list[torch.Tensor]:
        """This rank's parameters that another pipeline rank holds too, whose gradient the
        step's norm counts there (optim.clip_grad_norm_'s `copies`): the last stage's copy of
        a tied embedding (the first stage's counts it once)."""
        return [self.tied] if self.tied is not None and self.last else []

    def evaluate(self, parts: list[Batch]) -> torch.Tensor:
        """The forward alone (torch's schedule.eval, no gradients) of the microbatches `parts`:
        their summed loss over this cp rank's loss tokens, summed over the pipeline (every
        rank has it; step.py validation_sums sums it over dp x cp as without stages)."""
        with torch.no_grad():
            return self._run(parts, torch.ones((), dtype=torch.long), train=False)

    def step(self, parts: list[Batch], ntokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the microbatches `parts`, each normalised by `ntokens` (the
        step's loss tokens); the step's loss, summed over the pipeline (every rank has it)."""
        return self._run(parts, ntokens, train=True)

    def _run(self, parts: list[Batch], ntokens: torch.Tensor, train: bool) -> torch.Tensor:
        """`step` (train) or `evaluate`: the schedule over the microbatches `parts`."""
        if len(parts) != self.n_microbatches:
            raise ValueError(f"{len(parts)} microbatches, the schedule runs {self.n_microbatches}")
        table = microbatches(parts, ntokens, self.bidirectional, self.ctx)
        for m in table:  # every stage rank built every layout: all raise, before any send
            if m.slots > self.slots:
                raise ValueError(
                    f"a pipeline microbatch's {m.tokens.shape[0]} x {m.length} local slots "
                    f"exceed the {self.slots} its stages send (parallel/pipeline.py wire_slots)"
                )
        self.layouts = [m.layout for m in table]
        for module in self.modules:
            module.table = table
        device = parts[0].tokens.device
        index = torch.arange(self.n_microbatches, device=device)
        losses: list[torch.Tensor] = []
        args = (index,) if self.first else ()
        target = index if self.last else None  # the last stage's loss_fn takes one (unused)
        run = self.schedule.step if train else self.schedule.eval
        try:
            run(*args, target=target, losses=losses, return_outputs=False, mb=index)
        finally:
            for module in self.modules:  # the microbatches' tensors are not kept past the step
                module.table = []
        total = torch.stack([x.detach() for x in losses]).sum() if losses else index.new_zeros(())
        if not train:
            return dist_sum(total.float(), self.group)
        cp = self.ctx.cp_mesh
        if self.first and cp is not None and self.ctx.options.vision == "broadcast":
            sync_broadcast_vision_grads(self.model, cp)  # cp rank 0 ran the ViT: its gradients
        if self.tied is not None:
            sum_tied_grads(self.tied, self.group, self.plan.degree - 1 if self.first else 0)
        if self.balance is not None:
            self.loads = self._gather_loads(index.device)
        return dist_sum(total.float(), self.group)

    def _gather_loads(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each microbatch's (aux, global picks) the last stage kept, on every pipeline rank
        (summed over the pipeline, the others adding zeros)."""
        assert self.balance is not None
        shape = (len(self.balance.sparse), self.balance.args.num_experts)
        packed = torch.zeros(self.n_microbatches, 1 + shape[0] * shape[1], device=device)
        for module in self.modules:
            for k, (aux, counts) in module.loads.items():
                packed[k] = torch.cat([aux.reshape(1), counts.flatten()])
            module.loads = {}
        packed = dist_sum(packed, self.group)
        return [(row[0], row[1:].view(shape)) for row in packed]
