"""The one device mesh: named dims pp x dp_replicate x dp_shard x cp x tp (any of them 1).

Which mesh each piece of the model and the data uses:
  - pipeline stages: each pp rank holds its stages' parameters (parallel/pipeline.py); the pp
    ranks of a (dp, cp, tp) coordinate read the same rows and pass hidden states along pp;
  - parameters: tensor-parallel DTensors on tp (parallel/tensor_parallel.py), then FSDP over the
    flattened (dp_shard, cp) dims or over dp_shard alone, as HSDP (replicated over dp_replicate,
    sharded over the rest) when dp_replicate > 1; which one, and why, is in parallel/parallelize.py;
  - the batch: one row set per (dp_replicate, dp_shard) coordinate, shared by the cp and tp ranks;
  - the loss normaliser (global text-token count): counted on each dp coordinate's whole rows
    (every microbatch of the step) and summed over (dp_replicate, dp_shard), not cp or tp: the
    cp and tp ranks of a coordinate read the same rows (step.py loss_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallelism: borrows ranks of dp_shard x cp
    pp: int = 1  # pipeline stages' ranks (the outermost dim)

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        p = cfg.parallelism
        for key in (
            "pipeline_parallel_degree",
            "data_parallel_replicate_degree",
            "context_parallel_degree",
            "tensor_parallel_degree",
            "expert_parallel_degree",
        ):
            if getattr(p, key) < 1:
                raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
        dp_shard = p.data_parallel_shard_degree
        others = (
            p.pipeline_parallel_degree
            * p.data_parallel_replicate_degree
            * p.context_parallel_degree
            * p.tensor_parallel_degree
        )
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism.data_parallel_shard_degree=-1: world size {world_size} "
                    "is not divisible "
                    f"by pp*dp_replicate*cp*tp = {others}"
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
            p.expert_parallel_degree,
            p.pipeline_parallel_degree,
        )
        dims.validate()
        return dims

    def validate(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallelism: pipeline_parallel_degree({self.pp}) * "
                f"data_parallel_replicate_degree({self.dp_replicate}) * "
                f"data_parallel_shard_degree({self.dp_shard}) * "
                f"context_parallel_degree({self.cp}) * tensor_parallel_degree({self.tp}) "
                f"= {product}, but the world size is {self.world_size} (set NPROC or the degrees)"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree={self.ep} must divide "
                f"data_parallel_shard_degree x context_parallel_degree = {self.dp_shard * self.cp} "
                "(the ranks expert parallelism borrows)"
            )

    def build_mesh(self, device_type: str) -> Mesh:
        root = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIMS,
        )
        return Mesh.from_root(root, self.ep)


@dataclass(frozen=True)
class Mesh:
    """The one device mesh and the sub-meshes the trainer uses, each made once."""

    root: DeviceMesh
    pp: DeviceMesh  # the pipeline group: stage ranks, in stage order
    cp: DeviceMesh  # the context-parallel group: text sharded, image embeddings replicated
    tp: DeviceMesh  # the tensor-parallel group: weights split, the same tokens on every rank
    world: (
        DeviceMesh  # every dim flattened: all ranks of this job (checkpoints, worst-rank metrics)
    )
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard): which rows a rank reads
    job: DeviceMesh  # flattened (dp_replicate, dp_shard, cp): the loss's sum, checkpoints, metrics
    # (dp_shard x cp) flattened, HSDP's (dp_replicate, dp_shard x cp) when dp_replicate > 1
    fsdp: DeviceMesh
    fsdp_no_cp: DeviceMesh  # the same without cp: dp_shard, or (dp_replicate, dp_shard)
    rows: DeviceMesh  # flattened (pp, cp, tp): the ranks that read the same rows
    # expert parallelism (None: ep = 1): `ep`, consecutive ranks of (dp_shard x cp) that split a
    # layer's experts; `expert_fsdp`, what FSDP shards the experts over: the rest of
    # (dp_shard x cp), with dp_replicate (HSDP) when it is > 1. Both dims of one mesh
    # (dp_replicate, efsdp, ep, tp), which FSDP needs of a DTensor's mesh and its own.
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None

    @classmethod
    def from_root(cls, root: DeviceMesh, ep: int = 1) -> Mesh:
        """`root` has named dims pp, dp_replicate, dp_shard, cp and tp; tests add an outer dim
        of copies. `ep` > 1: the expert-parallel meshes too (class docstring)."""
        dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
        hsdp = root["dp_replicate"].size() > 1
        ep_mesh = expert_fsdp = None
        if ep > 1:
            # the same ranks, (dp_shard x cp) split as (efsdp, ep): a reshape of the root's
            outer = [n for n in root.mesh_dim_names or () if n not in MESH_DIMS]
            sizes = [root[n].size() for n in outer]
            inner = root["dp_shard"].size() * root["cp"].size() // ep
            expert_root = init_device_mesh(
                root.device_type,
                (
                    *sizes,
                    root["pp"].size(),
                    root["dp_replicate"].size(),
                    inner,
                    ep,
                    root["tp"].size(),
                ),
                mesh_dim_names=(*outer, "pp", "dp_replicate", "efsdp", "ep", "tp"),
            )
            ep_mesh = expert_root["ep"]
            expert_fsdp = expert_root["dp_replicate", "efsdp"] if hsdp else expert_root["efsdp"]
        return cls(
            root=root,
            pp=root["pp"],
            cp=root["cp"],
            tp=root["tp"],
            world=root[MESH_DIMS]._flatten("world"),
            dp=root["dp_replicate", "dp_shard"]._flatten("dp"),
            job=root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            fsdp=root["dp_replicate", "dp_shard_cp"] if hsdp else dp_shard_cp,
            fsdp_no_cp=root["dp_replicate", "dp_shard"] if hsdp else root["dp_shard"],
            rows=root["pp", "cp", "tp"]._flatten("pp_cp_tp"),
            ep=ep_mesh,
            expert_fsdp=expert_fsdp,
        )

    def shards(self, fsdp_mesh: DeviceMesh) -> int:
        """How many ways an FSDP mesh shards a parameter (its last dim; HSDP replicates over the
        first)."""
        return fsdp_mesh.size(fsdp_mesh.ndim - 1)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
