"""Build the model the config asks for, sharded, without a full copy on any rank.

    meta-device modules (no memory)  ->  spec.parallelize (TP, AC, compile, FSDP)
      ->  to_empty (each rank allocates its own shards)  ->  spec.init_buffers (RoPE tables)
      ->  load_hf_shards (each rank reads its boxes of the safetensors)  or  init_from_seed
          (or nothing: a resume's checkpoint fills them)

Start-up memory per rank is the rank's shards plus one row block or file slice at a time, so
it falls with the FSDP shard count (benchmarks/startup_memory.py, docs/performance.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.hf_experts import ExpertView
from titan_vlm.models.common.hf_folder import SafetensorsFiles, hf_sources, weight_files
from titan_vlm.models.loading import canonical_parameters, init_from_seed, load_hf_shards
from titan_vlm.models.spec import ModelSpec, VisionLanguageModel
from titan_vlm.parallel.pipeline import stage_plan

if TYPE_CHECKING:
    from titan_vlm.parallel_dims import Mesh

logger = logging.getLogger("titan_vlm")
SAME_ROWS = 64  # rows compared of a tensor the model holds once (ModelSpec.hf_same)


def hf_files(cfg: JobConfig) -> list[tuple[str, list[Path]]]:
    """(config key, safetensors files) of every Hugging Face source the config names."""
    return [(key, weight_files(path, key)) for key, path in hf_sources(cfg)]


def load_hf(model: nn.Module, spec: ModelSpec, args: Any, cfg: JobConfig) -> None:
    """Fill `model` (sharded or not) from the config's Hugging Face sources. Each file tensor is
    either loaded into a parameter or known to be unused (the adapter says why, and one log
    line lists them); any other tensor is an error naming it."""
    params = canonical_parameters(model)  # the adapter names the unwrapped model's parameters
    wanted = set(params)
    for key, files in hf_files(cfg):
        with SafetensorsFiles(files, key) as raw:
            st = ExpertView(raw, key)  # MoE experts stacked, whatever their layout in the files
            keys = st.keys()
            # the adapter names every parameter of the parts present and refuses any tensor
            # it neither maps nor knows to be unused
            names = spec.hf_names(args, keys, key)
            unused = spec.hf_unused(args, keys)
            for copy, original in spec.hf_same(args, keys):
                # the same leading rows on every rank, so all ranks decide alike
                rows = (slice(0, min(SAME_ROWS, st.shape(original)[0])),)
                if not torch.equal(st.read(copy, rows), st.read(original, rows)):
                    raise ConfigError(
                        f"{key}: config.json ties the embeddings, but '{copy}' in "
                        f"{raw.file_of(copy)} is not '{original}' (set tie_word_embeddings "
                        "to false, or drop the tensor)"
                    )
            wanted -= set(names)
            # a pipeline rank holds its stages' parameters (parallel/pipeline.py StagePlan.prune):
            # the other stages' are theirs to read (the adapter named the whole model's)
            names = {ours: theirs for ours, theirs in names.items() if ours in params}
            read = load_hf_shards(params, st, names, key)
        logger.info(
            "%s: loaded %d tensors (%.1f MiB read on this rank)%s",
            key,
            len(names),
            read / 2**20,
            f"; not used: {_summary(unused)}" if unused else "",
        )
    projector = {n for n in wanted if n.startswith("projector.")}
    if wanted - projector:
        missing = sorted(wanted - projector)
        raise ConfigError(
            f"no Hugging Face tensor for {len(missing)} parameter(s), e.g. {missing[0]} "
            "(give model.hf_path, or both model.hf_vision_path and model.hf_text_path)"
        )
    if projector:  # separate towers: the projector between them starts from the seed
        init_from_seed(model, cfg.training.seed, lambda n, p: spec.init_rule(args, n, p), projector)
        logger.info("projector: no Hugging Face tensors, initialised from training.seed")


def _summary(unused: dict[str, str]) -> str:
    """'N tensors (reason), ...' grouped by reason."""
    by_reason: dict[str, int] = {}
    for reason in unused.values():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    return "; ".join(f"{n} ({reason})" for reason, n in by_reason.items())


def build_model(
    spec: ModelSpec, cfg: JobConfig, mesh: Mesh, device: torch.device, fill: bool = True
) -> tuple[VisionLanguageModel, Any]:
    """The parallelized model on `device` (under pipeline parallelism, this rank's stages of it:
    parallel/pipeline.py StagePlan.prune), filled from Hugging Face weights or from the seed;
    fill=False leaves the parameters unfilled, for a checkpoint to fill (a resume: the Hugging
    Face weights are not read)."""
    args = spec.args(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    plan = stage_plan(cfg, mesh.pp, model, spec.layout_cost(args))
    if plan is not None:  # this rank's pipeline stages only, then sharded over the dp ranks
        plan.prune(model)
    spec.parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    spec.after_to_empty(model)
    if not fill:
        return model, args
    if hf_sources(cfg):
        load_hf(model, spec, args, cfg)
    else:
        init_from_seed(model, cfg.training.seed, lambda n, p: spec.init_rule(args, n, p))
    return model, args


def unfilled_model(spec: ModelSpec, args: Any) -> VisionLanguageModel:
    """The whole model, unsharded, allocated on the CPU but not filled (one process: inference,
    export); its buffers and ties are set, its parameters hold whatever memory held."""
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    spec.after_to_empty(model)
    return model
