"""Typed job configuration: TOML file + torchtitan-style command-line overrides.

    ./run_train.sh --config train_configs/vlm_cp.toml --training.steps=50 \\
        --parallelism.context_parallel_degree=4

Every key lives in one dataclass below; an unknown section or key, a value of the wrong type
or an impossible combination raises `ConfigError` with a one-line message naming the key,
before any process group or collective exists.
"""

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class UserError(Exception):
    """A problem the user can fix (config, data, dump folder, checkpoints): the message is one
    line naming the key, file or folder. The trainer prints it once (rank 0), without a
    traceback, and exits with code 2."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message is one line and names the key or file."""


@dataclass
class Job:
    dump_folder: str = "outputs"  # TensorBoard logs (tb/) and metrics.jsonl go here
    description: str = ""
    max_restarts: int = (
        0  # torchrun restarts a failed job this often; it resumes from the latest checkpoint
    )


@dataclass
class Model:
    flavor: str = "debug"  # see titan_vlm/models/flavors.py
    attention_kernel: str = "auto"  # auto | cpu_flash | cuda_flash | cuda_efficient | cuda_cudnn
    hf_vision_path: str = (
        ""  # SigLIP-style vision tower (+ LLaVA projector) safetensors to start from
    )
    hf_text_path: str = ""  # Llama/Qwen-style decoder safetensors to start from
    tokenizer_path: str = ""  # a Hugging Face tokenizer.json; "" is the built-in byte tokenizer
    image_attention: str = (
        "causal"  # tokens of one image see each other: "causal" | "bidirectional"
    )


@dataclass
class Training:
    steps: int = 200
    seed: int = 0
    seq_len: int = 256  # tokens per row: image tokens + text tokens
    local_batch_size: int = 4  # rows per data-parallel rank (CP ranks of one group share rows)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_norm: float = 1.0  # gradient clipping on the global norm; <= 0 disables
    mixed_precision: str = "fp32"  # "fp32" | "bf16" (bf16 params/compute, fp32 grads reduce)
    # a non-finite loss or grad norm: "stop" the run (before the step updates anything) or
    # "skip" the step (no update, counted); either way it never reaches a checkpoint
    on_nonfinite: str = "stop"


@dataclass
class Data:
    dataset: str = (
        "synthetic"  # or a .json / .jsonl file of LLaVA conversations or captions (data/jsonl.py)
    )
    sentences_per_image: int = 1  # long-text knob: more sentences about the image per sample
    blank_images: bool = False  # ablation: every image black; captions are then unpredictable
    images_per_sample: int = 1  # images per sample (0: text only); with packing, at most this many
    packing: bool = (
        False  # several samples per row, each attending only to itself (README: packed rows)
    )
    image_root: str = (
        ""  # image paths of a dataset file are relative to this ("": the file's folder)
    )
    on_bad_sample: str = (
        "skip"  # a bad sample of a dataset file: "skip" (warn, count) | "error" (stop)
    )
    max_image_pixels: int = 4096 * 4096  # larger images (by their header) are bad samples
    shuffle: bool = (
        True  # a dataset file's rows in a new order each epoch (seeded by training.seed)
    )
    # stop the run when this many steps in a row carry no loss token (every sample bad)
    max_empty_steps: int = 3


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = 1  # -1: whatever the world size leaves over
    context_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    cp_comm_type: str = "p2p"  # exact CP attention: "p2p" (ring) | "allgather" | "a2a" (Ulysses)
    cp_vision: str = (
        "shard"  # where the ViT runs in a CP group: "shard" | "replicate" | "broadcast"
    )
    # sequence parallelism inside the TP group: norms and residual adds on a 1/tp slice of the
    # (CP-local) sequence; needs tensor_parallel_degree > 1
    enable_sequence_parallel: bool = False
    # hold the image embeddings sharded along the hidden dim over tp (seed 5.1), all-gathered
    # where they join the text; needs tensor_parallel_degree > 1
    image_embed_tp_shard: bool = False


@dataclass
class ActivationCheckpoint:
    mode: str = (
        "none"  # "none" | "full" (every transformer block) | "selective" (every other block)
    )


@dataclass
class Compile:
    enable: bool = False  # torch.compile each ViT and decoder block


@dataclass
class Metrics:
    log_freq: int = 1
    enable_tensorboard: bool = True


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    keep: int = 3  # complete checkpoints kept (the newest); 0 keeps all
    # resume even if a key that must match the checkpoint's config (resume.MUST_MATCH) changed
    allow_config_change: bool = False


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Convert a TOML or command-line value to the field's type, or fail naming the key."""
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes"):
                    return True
                if text.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            return typ(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected bool, got {value!r}")
    if typ in (int, float) and (isinstance(value, bool) or not isinstance(value, typ)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")
    if typ is str and not isinstance(value, str):
        raise ConfigError(f"{key}: expected str, got {value!r}")
    return value


def _set(cfg: JobConfig, dotted: str, value: Any, where: str, typed: bool = False) -> None:
    """`typed`: the value comes from TOML, which has its own types (`steps = "3"` is a string,
    an error for an int key); command-line values are all strings, converted by _coerce."""
    section, _, name = dotted.partition(".")
    sections = _sections()
    if section not in sections or not name:
        raise ConfigError(f"{where}: unknown key '{dotted}' (sections: {', '.join(sections)})")
    obj = getattr(cfg, section)
    types = {f.name: f.type for f in dataclasses.fields(obj)}
    if name not in types:
        raise ConfigError(
            f"{where}: unknown key '{dotted}' (known in [{section}]: {', '.join(types)})"
        )
    if value is None:
        if types[name] is not bool:
            raise ConfigError(f"{where}: '--{dotted}' needs a value")
        value = True
    if typed and isinstance(value, str) and types[name] is not str:
        raise ConfigError(
            f"{where}: {dotted}: expected {types[name].__name__}, got the string {value!r} "
            "(TOML: write it without quotes)"
        )
    setattr(obj, name, _coerce(dotted, value, types[name]))


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from `--config FILE` (optional) and `--section.key=value` overrides."""
    cfg = JobConfig()
    overrides: list[tuple[str, str]] = []
    config_file: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: expected --section.key=value, got '{arg}'")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                value = None  # a bare flag: true for a bool key, an error for any other
            else:
                value = argv[i + 1]
                i += 1
        i += 1
        if key in ("config", "job.config_file"):
            if value is None:
                raise ConfigError("command line: '--config' needs a file")
            config_file = value
        else:
            overrides.append((key, value))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"--config: file not found: {config_file}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file}: invalid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_file}: top-level key '{section}' must be a [section]")
            for name, value in values.items():
                _set(cfg, f"{section}.{name}", value, config_file, typed=True)
    for key, value in overrides:
        _set(cfg, key, value, "command line")
    return cfg


def world_size_of(cfg: JobConfig) -> int:
    """Processes the config's parallel degrees need (dp_shard = -1 counts as 1)."""
    p = cfg.parallelism
    return (
        p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.context_parallel_degree
        * p.tensor_parallel_degree
    )


def validate_failure_keys(cfg: JobConfig) -> None:
    """The keys of what the job does when things go wrong (README: When things go wrong)."""
    if cfg.job.max_restarts < 0:
        raise ConfigError(f"job.max_restarts must be >= 0, got {cfg.job.max_restarts}")
    if cfg.job.max_restarts and not cfg.checkpoint.enable:
        raise ConfigError(
            "job.max_restarts needs checkpoint.enable = true: a restarted job resumes from "
            "its latest checkpoint, else it would start over"
        )
    if cfg.training.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(
            f"training.on_nonfinite must be 'stop' or 'skip', got {cfg.training.on_nonfinite!r}"
        )
    if cfg.checkpoint.keep < 0:
        raise ConfigError(f"checkpoint.keep must be >= 0 (0: keep all), got {cfg.checkpoint.keep}")
    if cfg.data.max_empty_steps < 1:
        raise ConfigError(f"data.max_empty_steps must be >= 1, got {cfg.data.max_empty_steps}")


def validate_launch(argv: list[str], nproc: str | None) -> tuple["JobConfig", int]:
    """The config of `argv`, fully validated, and the process count (`nproc`, the environment's
    NPROC, when set, is checked against the degrees instead); ConfigError otherwise. Used by
    `python -m titan_vlm.config` and the launcher (titan_vlm/launch.py), before any worker."""
    # Under `python -m titan_vlm.config` this file is __main__: use the package's own module, so
    # that the ConfigError raised by parallel_dims is the one the callers catch.
    from titan_vlm.config import ConfigError, load_config, validate_failure_keys
    from titan_vlm.parallel_dims import ParallelDims

    cfg = load_config(argv)
    if nproc is not None and not nproc.isdigit():
        raise ConfigError(f"NPROC must be a process count, got {nproc!r}")
    world = int(nproc) if nproc else world_size_of(cfg)
    ParallelDims.from_config(cfg, world).validate_model(cfg)
    validate_failure_keys(cfg)
    import torch

    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise ConfigError(
            f"{world} processes but {torch.cuda.device_count()} GPUs on this machine "
            "(one process per GPU; set NPROC or the degrees)"
        )
    return cfg, world


def main() -> None:
    """`python -m titan_vlm.config --config F [overrides]`: validate, then print the process count
    (the environment's NPROC, when set, is checked against the degrees instead) and
    job.max_restarts."""
    import os

    from titan_vlm.config import ConfigError, validate_launch

    try:
        cfg, world = validate_launch(sys.argv[1:], os.environ.get("NPROC"))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    print(world, cfg.job.max_restarts)


if __name__ == "__main__":
    main()
