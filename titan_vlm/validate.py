"""Everything a job's config is checked for before any process group exists (the launcher, every
worker, the planner's search): `validate_job(cfg, world_size)`. Each finding is a one-line
ConfigError naming the key.

    the mesh degrees                  ParallelDims.from_config
    the names of the choice keys      config.check_choices (a config built or changed in code)
    the model family and its args     models/registry.py model_spec(cfg).args (reads and checks
                                      any Hugging Face config.json, a resume's copy of it:
                                      checkpoint.py resume_sources), its safetensors files there
    the training, data, validation, profiling, metrics and checkpoint keys (training.freeze's
    groups among them), the attention kernel
                                      here
    what the family needs of the shapes and the mesh (heads, tp, a2a, sequence length, vocabulary)
                                      the family's ModelSpec.validate
"""

from __future__ import annotations

import math

from titan_vlm.config import JobConfig, Training, check_choices
from titan_vlm.errors import ConfigError
from titan_vlm.kernels import KERNELS
from titan_vlm.metrics import WANDB_MISSING, wandb_installed
from titan_vlm.models.spec import PARAM_GROUPS
from titan_vlm.optim import frozen_groups
from titan_vlm.parallel_dims import ParallelDims, device_type


def validate_job(cfg: JobConfig, world_size: int, weights: bool = True) -> ParallelDims:
    """The mesh degrees `cfg` asks for on `world_size` ranks, after every check (module
    docstring). `weights=False` (the planner, which needs the shapes alone): a Hugging Face
    source's config.json is read and checked, its safetensors need not be there."""
    from titan_vlm.checkpoint import resume_sources
    from titan_vlm.data.jsonl import validate_data_config
    from titan_vlm.models.build import hf_files
    from titan_vlm.models.registry import model_spec

    dims = ParallelDims.from_config(cfg, world_size)
    check_choices(cfg)
    # a resume builds the model from its checkpoint's copies of the sources, and its weights
    # come from the checkpoint (checkpoint.py run_start)
    sources, resuming = resume_sources(cfg)
    spec = model_spec(sources)
    args = spec.args(sources)  # reads and checks any HF config.json
    if weights and not resuming:
        hf_files(sources)  # each HF source's safetensors are there
    t = cfg.training
    k = cfg.data.images_per_sample
    if not 0 <= k <= 64:
        raise ConfigError(f"data.images_per_sample must be in 0..64, got {k}")
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
        (
            "training.moe_aux_loss_coef",
            t.moe_aux_loss_coef,
            t.moe_aux_loss_coef == -1
            or (math.isfinite(t.moe_aux_loss_coef) and t.moe_aux_loss_coef >= 0),
            ">= 0, or -1 (the model's own)",
        ),
        ("metrics.log_freq", cfg.metrics.log_freq, cfg.metrics.log_freq >= 1, ">= 1"),
    ):
        if not ok:
            raise ConfigError(f"{key} must be {want}, got {value}")
    _validate_groups(t)
    if t.local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1, got {t.local_batch_size}")
    per_pass = t.local_batch_size * dims.dp_replicate * dims.dp_shard
    if t.global_batch_size < 0 or t.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} must be 0 or a multiple of "
            f"training.local_batch_size x the data-parallel degree ({per_pass})"
        )
    if t.steps < 1:
        raise ConfigError(f"training.steps must be >= 1, got {t.steps}")
    validate_data_config(cfg.data)  # data.dataset and the keys of a dataset file
    if cfg.data.sentences_per_image < 1:
        raise ConfigError(
            f"data.sentences_per_image must be >= 1, got {cfg.data.sentences_per_image}"
        )
    if cfg.checkpoint.interval < 1:
        raise ConfigError(f"checkpoint.interval must be >= 1, got {cfg.checkpoint.interval}")
    _validate_recipe_keys(cfg)
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
    for key in ("enable_sequence_parallel", "image_embed_tp_shard"):
        if getattr(cfg.parallelism, key) and dims.tp == 1:
            raise ConfigError(f"parallelism.{key} needs parallelism.tensor_parallel_degree > 1")
    _validate_pipeline(cfg, dims, args)
    spec.validate(args, dims, sources)
    return dims


def _validate_pipeline(cfg: JobConfig, dims: ParallelDims, args: object) -> None:
    """parallelism.pipeline_parallel_*: what the pipeline runs so far (parallel/pipeline.py), its
    schedule against the stages and the step's microbatches, and the stages against the
    decoder's layers."""
    from titan_vlm.optim import accumulation_steps
    from titan_vlm.parallel.pipeline import (
        ZERO_BUBBLE,
        check_schedule,
        parse_stage_layers,
        split_layers,
    )

    p, key = cfg.parallelism, "parallelism.pipeline_parallel"
    for name in ("microbatch_size", "stages_per_rank"):
        value = getattr(p, f"pipeline_parallel_{name}")
        if value < 1:
            raise ConfigError(f"{key}_{name} must be >= 1, got {value}")
    if dims.pp == 1:
        if p.pipeline_parallel_stage_layers.strip():
            raise ConfigError(
                f"{key}_stage_layers={p.pipeline_parallel_stage_layers!r} without pipeline "
                f"parallelism ({key}_degree=1): set the degree, or leave it empty"
            )
        return
    what = f"{key}_degree={dims.pp}"
    t = cfg.training
    steps = accumulation_steps(t, dims.dp_replicate * dims.dp_shard)
    if cfg.validation.enable and steps > 1:
        raise ConfigError(
            f"{what} with validation.enable and {steps} accumulation steps: not yet (a "
            "validation batch of training.local_batch_size rows runs the training's schedule, "
            "whose microbatches are a step's rows)"
        )
    decoder = getattr(args, "decoder")  # noqa: B009 - every family's args hold its DecoderArgs
    sharded = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp > 1
    if p.pipeline_parallel_schedule in ZERO_BUBBLE and (
        sharded or cfg.training.mixed_precision != "fp32"
    ):
        what = (
            "data, context or tensor parallelism" if sharded else "training.mixed_precision='bf16'"
        )
        raise ConfigError(
            f"{key}_schedule={p.pipeline_parallel_schedule!r} with {what}: not yet (its split "
            "backward computes the weights' gradients on the parameters FSDP replaces)"
        )
    rows = t.local_batch_size * steps
    size = p.pipeline_parallel_microbatch_size
    if rows % size:
        raise ConfigError(
            f"{key}_microbatch_size={size} does not divide the {rows} rows a step of a dp rank "
            "(training.local_batch_size x the accumulation steps)"
        )
    try:
        check_schedule(
            p.pipeline_parallel_schedule, dims.pp, p.pipeline_parallel_stages_per_rank, rows // size
        )
        stages = dims.pp * p.pipeline_parallel_stages_per_rank
        split_layers(decoder.n_layers, stages)  # enough layers for the stages
        parse_stage_layers(p.pipeline_parallel_stage_layers, stages, decoder.n_layers)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None


def _validate_recipe_keys(cfg: JobConfig) -> None:
    """The validation, profiling, W&B and checkpoint-loading keys."""
    from titan_vlm.data.jsonl import dataset_files

    v, prof, ckpt = cfg.validation, cfg.profiling, cfg.checkpoint
    for key, value in (
        ("validation.freq", v.freq),
        ("validation.steps", v.steps),
        ("profiling.profile_freq", prof.profile_freq),
    ):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if v.enable and v.dataset == "mixture":
        raise ConfigError(
            "validation.dataset: one source (a file, folder or pattern), not a mixture"
        )
    if v.enable and v.dataset != "synthetic":
        dataset_files("validation.dataset", v.dataset)
    if v.enable and v.dataset == "synthetic" and cfg.data.native_resolution_pixels:
        raise ConfigError(
            "validation.dataset='synthetic' draws every image at the model's size, but "
            "data.native_resolution_pixels > 0: validate on a dataset file"
        )
    for key, folder in (
        ("profiling.save_traces_folder", prof.save_traces_folder),
        ("profiling.save_memory_snapshot_folder", prof.save_memory_snapshot_folder),
    ):
        if not folder:
            raise ConfigError(f"{key} must name a folder (under job.dump_folder)")
    if cfg.metrics.enable_wandb and not wandb_installed():
        raise ConfigError(WANDB_MISSING)
    if ckpt.async_mode == "async_with_pinned_mem" and device_type() != "cuda":
        raise ConfigError(
            "checkpoint.async_mode='async_with_pinned_mem' copies into pinned memory, which "
            f"needs CUDA; this machine trains on {device_type()} (use 'async')"
        )
    # checkpoint.initial_load_path is read (and a missing one reported) only by a run that has
    # no checkpoint of its own: a resume must not need the first stage's folder any more


def _validate_groups(t: Training) -> None:
    """training.freeze names parameter groups (models/spec.py PARAM_GROUPS) and leaves one to
    train; a group's own learning rate is a rate (>= 0, 0: training.lr) of a group that trains."""
    frozen = frozen_groups(t)
    unknown = sorted(frozen - set(PARAM_GROUPS))
    if unknown:
        raise ConfigError(
            f"training.freeze={t.freeze!r}: {', '.join(unknown)} is not a parameter group "
            f"(groups: {', '.join(PARAM_GROUPS)})"
        )
    if frozen == set(PARAM_GROUPS):
        raise ConfigError(f"training.freeze={t.freeze!r} freezes every parameter: nothing trains")
    for group in ("vision", "projector"):
        key = f"training.{group}_lr"
        lr = getattr(t, f"{group}_lr")
        if not (math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"{key} must be >= 0 (0: training.lr), got {lr}")
        if lr and group in frozen:
            raise ConfigError(f"{key}={lr} is for a group training.freeze freezes ({group})")
