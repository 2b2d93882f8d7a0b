"""The one device mesh: named dims dp_replicate x dp_shard x cp x tp (any of them 1).

Which mesh each piece of the model and the data uses:
  - parameters: tensor-parallel DTensors on tp (parallel/tensor_parallel.py), then FSDP over the
    flattened (dp_shard, cp) dims or over dp_shard alone, as HSDP (replicated over dp_replicate,
    sharded over the rest) when dp_replicate > 1; which one, and why, is in parallel/parallelize.py;
  - the batch: one row set per (dp_replicate, dp_shard) coordinate, shared by the cp and tp ranks;
  - the loss normaliser (global text-token count): summed over (dp_replicate, dp_shard, cp), not
    tp: the tp ranks of a coordinate hold the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_vlm.config import JobConfig, check_choices
from titan_vlm.errors import ConfigError
from titan_vlm.kernels import KERNELS

if TYPE_CHECKING:
    from titan_vlm.models.llava.args import VLMArgs

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        p = cfg.parallelism
        for key in (
            "data_parallel_replicate_degree",
            "context_parallel_degree",
            "tensor_parallel_degree",
        ):
            if getattr(p, key) < 1:
                raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
        dp_shard = p.data_parallel_shard_degree
        others = (
            p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
        )
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism.data_parallel_shard_degree=-1: world size {world_size} "
                    "is not divisible "
                    f"by dp_replicate*cp*tp = {others}"
                )
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree must be >= 1 or -1, got {dp_shard}"
            )
        dims = cls(
            p.data_parallel_replicate_degree,
            dp_shard,
            p.context_parallel_degree,
            p.tensor_parallel_degree,
            world_size,
        )
        dims.validate()
        return dims

    def validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree({self.dp_replicate}) * "
                f"data_parallel_shard_degree({self.dp_shard}) * "
                f"context_parallel_degree({self.cp}) * tensor_parallel_degree({self.tp}) "
                f"= {product}, but the world size is {self.world_size} (set NPROC or the degrees)"
            )

    def validate_model(self, cfg: JobConfig) -> None:
        """Checks that need both the degrees and the model/data shapes (and, for a config built
        or changed in code, the names of the choice-valued keys: config.check_choices)."""
        from titan_vlm.data import model_inputs
        from titan_vlm.models.build import hf_files
        from titan_vlm.models.registry import model_spec

        check_choices(cfg)
        vlm = model_spec(cfg).args(cfg)  # reads and checks any HF config.json
        hf_files(cfg)  # each HF source's safetensors are there
        t = cfg.training
        k = cfg.data.images_per_sample
        if not 0 <= k <= 64:
            raise ConfigError(f"data.images_per_sample must be in 0..64, got {k}")
        if t.seq_len <= k * vlm.tokens_per_image + 2:
            raise ConfigError(
                f"training.seq_len={t.seq_len} leaves no room for text after {k} images of "
                f"{vlm.tokens_per_image} tokens (flavor '{cfg.model.flavor}', "
                f"data.images_per_sample={k})"
            )
        if (
            t.seq_len > vlm.decoder.max_seq_len
        ):  # RoPE positions restart at every sample, so this bounds them
            raise ConfigError(
                f"training.seq_len={t.seq_len} exceeds the RoPE table of flavor "
                f"'{cfg.model.flavor}' (max_seq_len {vlm.decoder.max_seq_len})"
            )
        for key, value, ok, want in (
            ("training.lr", t.lr, math.isfinite(t.lr) and t.lr > 0, "a positive number"),
            (
                "training.max_norm",
                t.max_norm,
                math.isfinite(t.max_norm),
                "a number (<= 0 disables clipping)",
            ),
            ("training.warmup_steps", t.warmup_steps, t.warmup_steps >= 0, ">= 0"),
            ("training.min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
            (
                "training.weight_decay",
                t.weight_decay,
                math.isfinite(t.weight_decay) and t.weight_decay >= 0,
                ">= 0",
            ),
            ("metrics.log_freq", cfg.metrics.log_freq, cfg.metrics.log_freq >= 1, ">= 1"),
        ):
            if not ok:
                raise ConfigError(f"{key} must be {want}, got {value}")
        if t.local_batch_size < 1:
            raise ConfigError(f"training.local_batch_size must be >= 1, got {t.local_batch_size}")
        if t.steps < 1:
            raise ConfigError(f"training.steps must be >= 1, got {t.steps}")
        from titan_vlm.data.jsonl import validate_data_config

        validate_data_config(cfg.data)  # data.dataset and the keys of a dataset file
        if cfg.data.sentences_per_image < 1:
            raise ConfigError(
                f"data.sentences_per_image must be >= 1, got {cfg.data.sentences_per_image}"
            )
        if cfg.checkpoint.interval < 1:
            raise ConfigError(f"checkpoint.interval must be >= 1, got {cfg.checkpoint.interval}")
        dec = vlm.decoder
        if dec.n_heads % dec.n_kv_heads:
            raise ConfigError(
                f"model.flavor={cfg.model.flavor}: n_heads {dec.n_heads} not divisible by "
                f"n_kv_heads {dec.n_kv_heads}"
            )
        vocab = model_inputs(cfg)[0].vocab_size
        if vocab > vlm.decoder.vocab_size:
            raise ConfigError(
                f"model.tokenizer_path: the tokenizer has {vocab} ids, flavor '{cfg.model.flavor}' "
                f"embeds {vlm.decoder.vocab_size}"
            )
        kernel = cfg.model.attention_kernel
        if kernel != "auto":
            if KERNELS[kernel].device_type != device_type():
                raise ConfigError(
                    f"model.attention_kernel={kernel} runs on {KERNELS[kernel].device_type}, "
                    f"this machine trains on {device_type()}"
                )
            if kernel in ("cuda_flash", "cuda_cudnn") and t.mixed_precision != "bf16":
                raise ConfigError(
                    f"model.attention_kernel={kernel} needs training.mixed_precision = 'bf16'"
                )
        comm = cfg.parallelism.cp_comm_type
        native = cfg.data.native_resolution_pixels
        if native:
            patch = vlm.vision.patch_size
            if cfg.model.hf_path:
                # a LLaVA folder's image processor fixes every image's size (and so its <image>
                # expansion): the folder's preprocessing would no longer be transformers'
                raise ConfigError(
                    "data.native_resolution_pixels > 0 does not combine with model.hf_path: the "
                    "folder's image processor fixes every image's size (set it to 0)"
                )
            if native < patch * patch:
                raise ConfigError(
                    f"data.native_resolution_pixels={native} is less than one {patch}x{patch} "
                    "patch of the ViT"
                )
            for key, on in (
                ("compile.enable", cfg.compile.enable),
                ("parallelism.enable_sequence_parallel", cfg.parallelism.enable_sequence_parallel),
            ):
                if on:
                    raise ConfigError(
                        f"data.native_resolution_pixels > 0 does not combine with {key} yet (the "
                        "ViT packs images of different sizes into one sequence)"
                    )
        self._validate_tp(cfg, vlm)
        local_heads = dec.n_heads // self.tp  # after TP: the heads the a2a splits over cp
        if comm == "a2a" and local_heads % self.cp:
            per_rank = (
                f" per tp rank ({dec.n_heads} / tensor_parallel_degree={self.tp})"
                if self.tp > 1
                else ""
            )
            raise ConfigError(
                f"parallelism.cp_comm_type='a2a' needs the {local_heads} attention "
                f"heads{per_rank} of "
                f"flavor '{cfg.model.flavor}' to divide by context_parallel_degree={self.cp}"
            )

    def _validate_tp(self, cfg: JobConfig, vlm: VLMArgs) -> None:
        """What tensor / sequence parallelism needs of the shapes: whole heads, K/V heads and MLP
        columns per tp rank, and (SP) ViT sequences that split evenly over tp."""
        p, tp = cfg.parallelism, self.tp
        for key in ("enable_sequence_parallel", "image_embed_tp_shard"):
            if getattr(p, key) and tp == 1:
                raise ConfigError(f"parallelism.{key} needs parallelism.tensor_parallel_degree > 1")
        if tp == 1:
            return
        dec, vit = vlm.decoder, vlm.vision
        for what, value in (
            ("decoder n_heads", dec.n_heads),
            ("decoder n_kv_heads", dec.n_kv_heads),
            ("decoder ffn_dim", dec.ffn_dim),
            ("decoder dim", dec.dim),
            ("decoder vocab_size", dec.vocab_size),
            ("ViT n_heads", vit.n_heads),
            ("ViT mlp_dim", vit.mlp_dim),
        ):
            if value % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree={tp} does not divide the {what} ({value}) "
                    f"of flavor '{cfg.model.flavor}'"
                )
        if (
            p.enable_sequence_parallel
        ):  # the decoder's local slots are padded to a multiple of tp (layout.py)
            if vit.num_positions % tp:
                raise ConfigError(
                    f"parallelism.enable_sequence_parallel: the ViT's {vit.num_positions} "
                    "positions per image "
                    f"must divide by tensor_parallel_degree={tp}"
                )

    def build_mesh(self, device_type: str) -> Mesh:
        root = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIMS,
        )
        return Mesh.from_root(root)


@dataclass(frozen=True)
class Mesh:
    """The one device mesh and the sub-meshes the trainer uses, each made once."""

    root: DeviceMesh
    cp: DeviceMesh  # the context-parallel group: text sharded, image embeddings replicated
    tp: DeviceMesh  # the tensor-parallel group: weights split, the same tokens on every rank
    world: (
        DeviceMesh  # every dim flattened: all ranks of this job (checkpoints, worst-rank metrics)
    )
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard): which rows a rank reads
    job: DeviceMesh  # flattened (dp_replicate, dp_shard, cp): loss normaliser, checkpoints, metrics
    # (dp_shard x cp) flattened, HSDP's (dp_replicate, dp_shard x cp) when dp_replicate > 1
    fsdp: DeviceMesh
    fsdp_no_cp: DeviceMesh  # the same without cp: dp_shard, or (dp_replicate, dp_shard)
    rows: DeviceMesh  # flattened (cp, tp): the ranks that read the same rows

    @classmethod
    def from_root(cls, root: DeviceMesh) -> Mesh:
        """`root` has named dims dp_replicate, dp_shard, cp and tp; tests add an outer dim of
        copies."""
        dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
        hsdp = root["dp_replicate"].size() > 1
        return cls(
            root=root,
            cp=root["cp"],
            tp=root["tp"],
            world=root[MESH_DIMS]._flatten("world"),
            dp=root["dp_replicate", "dp_shard"]._flatten("dp"),
            job=root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            fsdp=root["dp_replicate", "dp_shard_cp"] if hsdp else dp_shard_cp,
            fsdp_no_cp=root["dp_replicate", "dp_shard"] if hsdp else root["dp_shard"],
            rows=root["cp", "tp"]._flatten("cp_tp"),
        )

    def shards(self, fsdp_mesh: DeviceMesh) -> int:
        """How many ways an FSDP mesh shards a parameter (its last dim; HSDP replicates over the
        first)."""
        return fsdp_mesh.size(fsdp_mesh.ndim - 1)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
