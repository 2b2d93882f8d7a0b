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

from titan_vlm.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class Job:
    dump_folder: str = "outputs"  # TensorBoard logs (tb/) and metrics.jsonl go here
    description: str = ""
    # torchrun restarts a failed job this often; it resumes from the latest checkpoint
    max_restarts: int = 0


@dataclass
class Model:
    # the model family (titan_vlm/models/registry.py): "llava" (a ViT + projector + decoder)
    name: str = "llava"
    # a built-in flavor (titan_vlm/models/flavors.py), or "hf": the architecture of model.hf_path
    flavor: str = "debug"
    # a Hugging Face model folder (config.json, safetensors, tokenizer, processor settings) to
    # start from: its weights, tokenizer, chat template and image preprocessing
    hf_path: str = ""
    attention_kernel: str = "auto"  # auto | cpu_flash | cuda_flash | cuda_efficient | cuda_cudnn
    # separate towers instead of model.hf_path: a CLIP/SigLIP vision model (+ LLaVA projector)
    # and a Llama/Mistral/Qwen decoder, each a folder or a .safetensors file beside its config.json
    hf_vision_path: str = ""
    hf_text_path: str = ""
    tokenizer_path: str = ""  # a Hugging Face tokenizer.json; "" is the built-in byte tokenizer
    # tokens of one image see each other: "causal" | "bidirectional"
    image_attention: str = "causal"


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
    fullgraph: bool = True  # one graph per block: a graph break is an error, not a silent split
    # torch.compile backend: "inductor" (generated kernels, the fast one) | "aot_eager" (traces
    # forward and backward like inductor but runs them eagerly: finds graph breaks and tracing
    # bugs in seconds, for debugging) | "eager" (dynamo only)
    backend: str = "inductor"


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


def _count(env: dict[str, str], name: str, default: str | None = None) -> int | None:
    """A positive integer from the environment (None when unset and no default)."""
    value = env.get(name, default)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def launch_shape(cfg: JobConfig, env: dict[str, str]) -> tuple[int, int]:
    """(processes per node, nodes) of a launch, from the environment run_train.sh passes on:
    NNODES (default 1), NPROC per node (default: the degrees' product over NNODES), and on more
    than one node either RDZV_ENDPOINT (host:port of torchrun's c10d rendezvous) or NODE_RANK
    with MASTER_ADDR (a static rendezvous). Checks what can be checked before any worker
    starts; the degrees against the total world are ParallelDims' check."""
    nnodes = _count(env, "NNODES", "1")
    nproc = _count(env, "NPROC")
    if nproc is None:
        world = world_size_of(cfg)
        if world % nnodes:
            raise ConfigError(
                f"NNODES={nnodes} does not divide the {world} processes the parallel degrees "
                "need (set NPROC, processes per node, or the degrees)"
            )
        nproc = world // nnodes
    endpoint, node_rank = env.get("RDZV_ENDPOINT"), env.get("NODE_RANK")
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"RDZV_ENDPOINT must be host:port, got {endpoint!r}")
        if node_rank is not None:
            raise ConfigError("set RDZV_ENDPOINT (c10d rendezvous) or NODE_RANK, not both")
    elif nnodes > 1:
        if node_rank is None:
            raise ConfigError(
                f"NNODES={nnodes} needs RDZV_ENDPOINT=host:port (c10d rendezvous) or NODE_RANK "
                "and MASTER_ADDR (static)"
            )
        if not node_rank.isdigit() or int(node_rank) >= nnodes:
            raise ConfigError(f"NODE_RANK must be in 0..{nnodes - 1}, got {node_rank!r}")
        if not env.get("MASTER_ADDR"):
            raise ConfigError("NODE_RANK needs MASTER_ADDR, the address of node 0")
    tp = cfg.parallelism.tensor_parallel_degree
    if nnodes > 1 and nproc % tp:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={tp} must divide NPROC={nproc} (processes per "
            "node): a tp group runs inside one node"
        )
    return nproc, nnodes


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
