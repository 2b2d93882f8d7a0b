"""What the planner prices: a parallel layout (`Layout`) and the rows one data-parallel rank
trains on per step (`Workload`), and the per-CP-rank geometry the trainer's own placement gives
them (`Geometry`, from layout.build_layout with the layout's cp_sample_placement and
cp_image_tokens and the family's cost model, the rows joined as shard_batch joins them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from titan_vlm.config import (
    ACMode,
    CPCommType,
    CPImageTokens,
    CPSamplePlacement,
    CPVision,
    JobConfig,
    MixedPrecision,
    PPSchedule,
    world_size_of,
)
from titan_vlm.data.batch import join_rows
from titan_vlm.layout import LayoutCost, build_layout
from titan_vlm.optim import accumulation_steps
from titan_vlm.parallel.context_parallel import vit_shares


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    cp_comm_type: CPCommType = "p2p"
    cp_vision: CPVision = "shard"
    ac_mode: ACMode = "none"
    mixed_precision: MixedPrecision = "bf16"
    sequence_parallel: bool = False
    image_embed_tp_shard: bool = False
    # what the trainer's CPOptions default to; from_config takes the config's (auto / auto)
    cp_sample_placement: CPSamplePlacement = "split"
    cp_image_tokens: CPImageTokens = "replicate"
    # expert parallelism: consecutive ranks of dp_shard x cp that split a MoE layer's experts
    ep: int = 1
    # pipeline parallelism (the mesh's outermost dim): pp ranks of pp_stages_per_rank stages,
    # pp_microbatch_size rows a microbatch, run by pp_schedule (parallel/pipeline.py)
    pp: int = 1
    pp_schedule: PPSchedule = "1F1B"
    pp_microbatch_size: int = 1
    pp_stages_per_rank: int = 1
    pp_stage_layers: str = ""  # parallelism.pipeline_parallel_stage_layers ("": by cost)
    # microsteps a step (training.global_batch_size): a pipeline runs all their rows as its
    # microbatches in one schedule step; without one each is priced alone
    accumulation: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_fsdp(self) -> int:
        """The ranks FSDP shards each expert parallel rank's experts over: dp_shard x cp / ep."""
        return self.dp_shard * self.cp // self.ep

    @property
    def act_bytes(self) -> int:
        """Bytes of one element of the compute dtype (activations, FSDP's all-gathered params)."""
        return 2 if self.mixed_precision == "bf16" else 4

    def describe(self) -> str:
        extra = " sp" if self.sequence_parallel else ""
        extra += f" ep={self.ep}" if self.ep > 1 else ""
        pp = (
            f"pp={self.pp} ({self.pp_schedule}, {self.pp_stages_per_rank} stage(s) a rank, "
            f"microbatches of {self.pp_microbatch_size} row(s)) "
            if self.pp > 1
            else ""
        )
        return (
            f"{pp}dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
            f"tp={self.tp}"
            f"{extra} cp_comm_type={self.cp_comm_type} cp_vision={self.cp_vision} "
            f"cp_sample_placement={self.cp_sample_placement} "
            f"cp_image_tokens={self.cp_image_tokens} ac={self.ac_mode} {self.mixed_precision}"
        )

    @classmethod
    def from_config(cls, cfg: JobConfig, world: int | None = None) -> Layout:
        """The config's degrees; data_parallel_shard_degree = -1 takes what `world` leaves."""
        p = cfg.parallelism
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == -1:
            others = world_size_of(cfg)
            dp_shard = (world or others) // others
        return cls(
            p.data_parallel_replicate_degree,
            dp_shard,
            p.context_parallel_degree,
            p.tensor_parallel_degree,
            p.cp_comm_type,
            p.cp_vision,
            cfg.activation_checkpoint.mode,
            cfg.training.mixed_precision,
            p.enable_sequence_parallel,
            p.image_embed_tp_shard,
            p.cp_sample_placement,
            p.cp_image_tokens,
            p.expert_parallel_degree,
            p.pipeline_parallel_degree,
            p.pipeline_parallel_schedule,
            p.pipeline_parallel_microbatch_size,
            p.pipeline_parallel_stages_per_rank,
            p.pipeline_parallel_stage_layers,
            accumulation_steps(cfg.training, p.data_parallel_replicate_degree * dp_shard),
        )


@dataclass(frozen=True, eq=False)
class Workload:
    """One data-parallel rank's rows of one step, as slot metadata [B, S] (layout/: `doc` the
    sample of each slot, -1 padding; `image` the image it belongs to, -1 text), and the cost
    model cp_sample_placement = "auto" balances them by (the family's ModelSpec.layout_cost,
    as the trainer passes it). `image_work`: each image's tower work in the cost model's
    `image` unit, as the trainer's images report it (ModelShapes.image_work: a LLaVA image 1,
    a Qwen-VL image its tower cost in patches' matmuls)."""

    doc: torch.Tensor
    image: torch.Tensor
    bidirectional_images: bool = False
    cost: LayoutCost = field(default_factory=LayoutCost)
    image_work: float = 1.0
    _geometries: dict = field(default_factory=dict, repr=False)  # placement -> Geometry

    @classmethod
    def uniform(
        cls,
        seq_len: int,
        rows: int,
        images_per_row: int,
        tokens_per_image: int,
        *,
        cost: LayoutCost,
        bidirectional_images: bool,
        image_work: float = 1.0,
    ) -> Workload:
        """`rows` full rows of one sample each: `images_per_row` images first, then text (the
        LLaVA layout; packed rows of several samples cost the same linear work and less
        attention). `cost` and `bidirectional_images`: the model's, as the trainer places
        rows with them; `image_work` (the class docstring)."""
        n = images_per_row * tokens_per_image
        image = torch.full((rows, seq_len), -1, dtype=torch.long)
        per_row = torch.arange(n) // tokens_per_image
        image[:, :n] = per_row + images_per_row * torch.arange(rows)[:, None]
        doc = torch.zeros(rows, seq_len, dtype=torch.long)
        return cls(doc, image, bidirectional_images, cost, image_work)

    @property
    def rows(self) -> int:
        return self.doc.shape[0]

    @property
    def seq_len(self) -> int:
        return self.doc.shape[1]

    @cached_property
    def num_images(self) -> int:
        return len(torch.unique(self.image[self.image >= 0]))

    @cached_property
    def text_tokens(self) -> int:
        return int(((self.doc >= 0) & (self.image < 0)).sum())

    def placed(self, layout: Layout) -> Geometry:
        """The CP ranks' shares of these rows under `layout`: its cp, sequence parallelism's
        padding multiple (tp), its sample placement and image tokens, and each rank's ViT share
        under its cp_vision, which the cost model weighs where either is "auto" (made once per
        distinct placement)."""
        pad = layout.tp if layout.sequence_parallel else 1
        placement, tokens = layout.cp_sample_placement, layout.cp_image_tokens
        # each rank's ViT share weighs only in the choices "auto" makes
        n = self.num_images  # images of one size, in batch order
        w = self.image_work
        shares = vit_shares([w] * n, [max(1, round(w))] * n, layout.cp, layout.cp_vision)
        weighed = tuple(shares) if "auto" in (placement, tokens) else ()
        key = (layout.cp, pad, placement, tokens, weighed)
        cache = self._geometries
        if key not in cache:
            cache[key] = self._place(layout.cp, pad, placement, tokens, shares)
        return cache[key]

    def whole(self) -> Geometry:
        """The rows on one device (no CP)."""
        return self.placed(Layout())

    def _place(
        self, cp: int, pad: int, placement: str, tokens: str, shares: list[float]
    ) -> Geometry:
        doc, image = self.doc, self.image
        if placement == "auto" and cp > 1:  # placed as one row, as shard_batch places them
            doc, image = join_rows(doc), image.reshape(1, -1)
        _, lay = build_layout(
            doc, image, cp, 0, self.bidirectional_images, pad, placement, self.cost, shares, tokens
        )
        return Geometry(
            rows=doc.shape[0],
            image_slots=lay.num_image_tokens,
            text_slots=lay.travel,
            kept_slots=[len(k) for k in lay.kept],
            pairs=lay.rank_work(),
            kept_pairs=lay.kept_work(),
            whole_pairs=lay.whole_work(),
        )


@dataclass(frozen=True)
class Geometry:
    """The CP ranks' shares of a workload's rows (layout.SeqLayout), per layout row: every rank
    holds the `image_slots` replicated image slots (N) and `text_slots` slots that travel (T:
    its share of the split samples, their image slots among them where cp_image_tokens shards
    them), and rank r the `kept_slots[r]` slots of the samples it keeps whole (W_r, never sent).
    `pairs[r]` are the query-key pairs CP rank r's queries compute (SeqLayout.rank_work), of
    which `kept_pairs[r]` its kept samples'; `whole_pairs` those of the rows on one device.
    `rows`: the layout's rows (the workload's, or 1 where "auto" joins them)."""

    rows: int
    image_slots: int
    text_slots: int
    kept_slots: list[int]
    pairs: list[int]
    kept_pairs: list[int]
    whole_pairs: int

    @property
    def kept(self) -> int:
        """W: the most slots a rank keeps whole (the busiest rank's)."""
        return max(self.kept_slots)

    @property
    def section_slots(self) -> int:
        """T + W: the busiest rank's text section (token ids, the head and the loss run on it)."""
        return self.text_slots + self.kept

    @property
    def local_slots(self) -> int:
        """N + T + W: the busiest rank's local slots (every decoder block runs on them)."""
        return self.image_slots + self.section_slots
