"""What the planner prices: a parallel layout (`Layout`) and the rows one data-parallel rank
trains on per step (`Workload`), and the per-CP-rank geometry the project's own split gives them
(`Geometry`, from layout.build_layout: image slots replicated, text head-tail per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from titan_vlm.config import ACMode, CPCommType, CPVision, JobConfig, MixedPrecision, world_size_of
from titan_vlm.layout import build_layout


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

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def act_bytes(self) -> int:
        """Bytes of one element of the compute dtype (activations, FSDP's all-gathered params)."""
        return 2 if self.mixed_precision == "bf16" else 4

    def describe(self) -> str:
        extra = " sp" if self.sequence_parallel else ""
        return (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp}"
            f"{extra} cp_comm_type={self.cp_comm_type} cp_vision={self.cp_vision} "
            f"ac={self.ac_mode} {self.mixed_precision}"
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
        )


@dataclass(frozen=True, eq=False)
class Workload:
    """One data-parallel rank's rows of one step, as slot metadata [B, S] (layout.py: `doc` the
    sample of each slot, -1 padding; `image` the image it belongs to, -1 text)."""

    doc: torch.Tensor
    image: torch.Tensor
    bidirectional_images: bool = False
    _geometries: dict = field(default_factory=dict, repr=False)  # (cp, pad multiple) -> Geometry

    @classmethod
    def uniform(
        cls, seq_len: int, rows: int, images_per_row: int, tokens_per_image: int
    ) -> Workload:
        """`rows` full rows of one sample each: `images_per_row` images first, then text (the
        LLaVA layout; packed rows of several samples cost the same linear work and less
        attention)."""
        n = images_per_row * tokens_per_image
        image = torch.full((rows, seq_len), -1, dtype=torch.long)
        per_row = torch.arange(n) // tokens_per_image
        image[:, :n] = per_row + images_per_row * torch.arange(rows)[:, None]
        return cls(torch.zeros(rows, seq_len, dtype=torch.long), image)

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

    def geometry(self, cp: int, pad_to_multiple: int = 1) -> Geometry:
        """One CP rank's share of these rows (made once per cp and padding multiple)."""
        key = (cp, pad_to_multiple)
        cache = self._geometries
        if key not in cache:
            _, lay = build_layout(
                self.doc, self.image, cp, 0, self.bidirectional_images, pad_to_multiple
            )
            _, whole = build_layout(self.doc, self.image, 1, 0, self.bidirectional_images)
            cache[key] = Geometry(
                image_slots=lay.num_image_tokens,
                text_slots=len(lay.texts[0]),
                pairs=lay.rank_work(),
                whole_pairs=whole.rank_work()[0],
            )
        return cache[key]


@dataclass(frozen=True)
class Geometry:
    """One CP rank's share of a workload's rows: every rank holds all `image_slots` and
    `text_slots` text slots (padding included) per row; `pairs[r]` are the query-key pairs CP
    rank r's queries compute (SeqLayout.rank_work), `whole_pairs` those of the unsharded rows."""

    image_slots: int
    text_slots: int
    pairs: list[int]
    whole_pairs: int

    @property
    def local_slots(self) -> int:
        return self.image_slots + self.text_slots
