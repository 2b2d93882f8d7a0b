"""Typed job configuration: TOML file + torchtitan-style command-line overrides.

    ./run_train.sh --config train_configs/vlm_cp.toml --training.steps=50 \\
        --parallelism.context_parallel_degree=4

Every key is a field of one section dataclass below, with its type and a docstring (the string
on the line after the field), from which `python -m titan_vlm.config --help` and the reference
docs/configuration.md are generated (config_reference.py). A key that takes one of a few names
has a `Literal` type: its names are checked where the value is read (`_coerce`), from the
`Literal` itself, so there is one list of them. Where a runtime registry holds the same names
(kernels, CP algorithms, ...), tests/unit/test_config.py checks that the two agree; this module
imports none of those registries (it sits below them).

An unknown section or key, a value of the wrong type or name, or an impossible combination raises
`ConfigError` with a one-line message naming the key, before any process group or collective
exists.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from titan_vlm.config_schema import choices, help_text, key_types, markdown, type_name
from titan_vlm.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The names a choice-valued key takes; the first is not necessarily the default.
ModelName = Literal["llava", "qwen2_5_vl", "qwen3_vl"]  # models/registry.py MODEL_SPECS
# the families' FLAVORS (models/*/args.py, spec.py), plus "hf"
Flavor = Literal["debug", "debug_moe", "small", "llava7b", "hf"]
AttentionKernel = Literal["auto", "cpu_flash", "cuda_flash", "cuda_efficient", "cuda_cudnn"]
ExpertsKernel = Literal["auto", "loop", "grouped_mm"]
ImageAttention = Literal["causal", "bidirectional"]
MixedPrecision = Literal["fp32", "bf16"]
OnNonfinite = Literal["stop", "skip"]
OnBadSample = Literal["skip", "error"]
CPCommType = Literal["p2p", "allgather", "a2a"]  # parallel/cp_attention.py CP_ATTENTION
CPVision = Literal["replicate", "broadcast", "shard"]  # parallel/context_parallel.py
PPSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"]  # pipeline.py
CPSamplePlacement = Literal["split", "auto"]  # layout/placement.py SAMPLE_PLACEMENTS
CPImageTokens = Literal["replicate", "shard", "auto"]  # layout/placement.py IMAGE_TOKEN_MODES
ACMode = Literal["none", "selective", "full"]  # parallel/parallelize.py, plan/memory.py
CompileBackend = Literal["inductor", "aot_eager", "eager"]
AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]  # checkpoint.py


@dataclass
class Job:
    """The run as a whole: where it writes, and how often torchrun restarts it."""

    dump_folder: str = "outputs"
    """Folder of the run's outputs: metrics.jsonl, TensorBoard logs (tb/), the job lock and (a
    relative checkpoint.folder) the checkpoints. Created if missing."""
    description: str = ""
    """Free text describing the run; saved with every checkpoint's config.json, used nowhere."""
    max_restarts: int = 0
    """Times torchrun restarts the job after a failure (0: never); a restarted job resumes from
    its latest checkpoint, so a value > 0 needs checkpoint.enable."""


@dataclass
class Model:
    """What model is trained, where its weights and tokenizer come from, how it attends."""

    name: ModelName = "llava"
    """The model family (models/registry.py): "llava" (a ViT + MLP projector + decoder),
    "qwen2_5_vl" (a windowed native-resolution ViT + merger + a Qwen2 decoder with M-RoPE) or
    "qwen3_vl" (Qwen3-VL, dense or mixture-of-experts: learned-position ViT, DeepStack, a Qwen3
    decoder with interleaved M-RoPE). With model.flavor = "hf" the family is the one whose
    folders have model.hf_path's config.json model_type, whatever this says."""
    flavor: Flavor = "debug"
    """A built-in size (the family's FLAVORS, models/*/): "debug" (CPU, under a second a step),
    "debug_moe" (the same with a mixture-of-experts decoder: llava, qwen3_vl), "small" and
    "llava7b" (LLaVA-1.5-7B shapes; llava); or "hf": the architecture of model.hf_path's
    config.json."""
    hf_path: str = ""
    """A Hugging Face LLaVA folder (config.json, safetensors, tokenizer, processor settings) to
    start from: its weights, tokenizer, chat template and image preprocessing. "": none."""
    hf_vision_path: str = ""
    """Separate towers instead of model.hf_path: a CLIP / SigLIP vision model (a folder, or a
    .safetensors file beside its config.json); the projector starts from training.seed. "":
    none. Set together with model.hf_text_path."""
    hf_text_path: str = ""
    """The decoder of separate towers: a Llama / Mistral / Qwen2 / Qwen3 folder, or a
    .safetensors file beside its config.json. "": none."""
    tokenizer_path: str = ""
    """A Hugging Face tokenizer.json (BOS / EOS / PAD found by their usual names). "": the
    built-in byte tokenizer (or model.hf_path's tokenizer)."""
    attention_kernel: AttentionKernel = "auto"
    """The attention kernel: "auto" picks per device and dtype (CPU: cpu_flash; CUDA:
    cuda_flash for 16-bit, cuda_efficient for fp32); a name forces that kernel (it must run on
    this machine's device; cuda_flash and cuda_cudnn need training.mixed_precision = "bf16")."""
    image_attention: ImageAttention = "causal"
    """How the tokens of one image see each other in the decoder: "causal" (in slot order, like
    text) or "bidirectional" (all of them). Text is causal either way."""
    experts_kernel: ExpertsKernel = "auto"
    """How a mixture-of-experts layer's expert matmuls run: "auto" picks by device (CUDA:
    grouped_mm; CPU: loop), "loop" (one matmul per expert on its rows, any device) or
    "grouped_mm" (torch._grouped_mm, one call over all the experts per projection, forward and
    backward: the grouped GEMM of CUDA GPUs, bf16 on H100-class ones; it also runs on the CPU).
    The two compute the same (tests/unit/test_moe.py; an H200's bf16 table in
    docs/performance.md)."""


@dataclass
class Training:
    """The optimisation: steps, rows, learning-rate schedule, precision."""

    steps: int = 200
    """Optimizer steps of the whole run (a resumed run counts the steps already done)."""
    seed: int = 0
    """Seed of the initial weights, the synthetic data and a dataset file's shuffle."""
    seq_len: int = 256
    """Slots per row (tokens): image tokens + text tokens; at most the flavor's RoPE table."""
    local_batch_size: int = 4
    """Rows per data-parallel rank and forward pass; the CP and TP ranks of one group share
    them."""
    global_batch_size: int = 0
    """Rows per optimizer step over the whole job; 0: local_batch_size x the data-parallel
    degree. A multiple of that accumulates gradients over global_batch_size / (local_batch_size
    x dp) microbatches of local_batch_size rows each: the loss is normalised over the whole
    step's loss tokens and FSDP reduces the gradients once per step, so the step is the one
    those rows would take at once, in the memory of local_batch_size."""
    lr: float = 1e-3
    """Peak learning rate of AdamW, reached after training.warmup_steps."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at training.lr * min_lr_ratio (in [0, 1])."""
    warmup_steps: int = 20
    """Steps of linear warmup before the cosine decay (0: none)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    max_norm: float = 1.0
    """Clip the gradient to this global L2 norm (over every rank's shards); <= 0 disables."""
    mixed_precision: MixedPrecision = "fp32"
    """"fp32" everywhere, or "bf16": bf16 parameters and compute, fp32 gradient reduction."""
    on_nonfinite: OnNonfinite = "stop"
    """A non-finite loss or gradient norm: "stop" the run (one line, exit 2, before the step
    updates anything) or "skip" the step (no update, counted). Either way it never reaches a
    checkpoint."""
    freeze: str = ""
    """Parameter groups that do not train, comma-separated: "vision" (the vision tower),
    "projector" (what maps its features into the decoder: LLaVA's projector, Qwen2.5-VL's patch
    merger), "decoder" (the language model). A frozen parameter gets no gradient, no optimizer
    state and no gradient communication, and is saved and exported bit for bit as loaded (e.g.
    LLaVA's first stage: "vision,decoder"). "": everything trains."""
    vision_lr: float = 0.0
    """Peak learning rate of the vision tower's parameters (the same warmup and decay as
    training.lr); 0: training.lr."""
    projector_lr: float = 0.0
    """Peak learning rate of the projector's (merger's) parameters; 0: training.lr."""
    moe_aux_loss_coef: float = -1.0
    """Weight of the MoE router's load-balancing loss (transformers' load_balancing_loss_func, over
    each microbatch's tokens on every rank and every sparse layer; with gradient accumulation
    the step's is the mean of its microbatches') in the training loss. -1: what transformers
    trains the folder's model with (a Qwen3-VL-MoE config's router_aux_loss_coef when its
    output_router_logits is true, else 0; LLaVA: 0, its class adds none); the built-in MoE
    flavors: 0.001. A dense model ignores it."""


@dataclass
class Data:
    """Where the samples come from and how they fill the rows."""

    dataset: str = "synthetic"
    """"synthetic" (built-in shapes and their captions), "mixture" (data.mixture's sources), or
    a file of LLaVA conversations or captions (data/jsonl.py): .jsonl, .json, .parquet, .arrow
    or a WebDataset .tar (data/record_files.py); or several of one format: a folder of them (not
    its subfolders, nor hidden files) or a glob pattern ("data/train-*.parquet"), read in name
    order (train-00009 before train-00010: pad the numbers) as one file; or a folder Hugging
    Face datasets' save_to_disk wrote (one split's)."""
    mixture: str = ""
    """With data.dataset = "mixture": its sources and their weights, "WEIGHT SOURCE, WEIGHT
    SOURCE, ..." (e.g. "3 llava.jsonl, 1 captions/"; each source as data.dataset names one: a
    file, a folder or glob pattern, a Hugging Face datasets folder), at least two. Each keeps its
    own rows and epochs; the run's rows are dealt to them in a fixed pattern, each its weight's
    share of every run of rows as long as the weights' sum (as the smallest whole numbers in
    their ratio) (data/mixture.py)."""
    sentences_per_image: int = 1
    """Synthetic data: sentences about the image per caption (with packing: up to this many); the
    long-text knob."""
    blank_images: bool = False
    """Ablation: every image black, so the captions are unpredictable."""
    images_per_sample: int = 1
    """Images per sample, 0..64 (0: text only); with data.packing, up to this many."""
    packing: bool = False
    """Several samples per row, each attending only to itself (cu_seqlens)."""
    image_root: str = ""
    """Folder a dataset file's image paths are relative to. "": each file's own folder."""
    on_bad_sample: OnBadSample = "skip"
    """A bad sample of a dataset file: "skip" it (warn, count, go on) or "error" (stop at the
    first, naming file:line)."""
    max_image_pixels: int = 4096 * 4096
    """Images larger than this (pixels, read from their header) are bad samples."""
    native_resolution_pixels: int = 0
    """0: every image is resized to the model's square input (vision image_size), so each takes
    the same number of slots. N > 0 (a dataset file's images and video frames): each keeps its
    aspect ratio, resized (bicubic) by min(1, sqrt(N / pixels)) with each side rounded down to a
    multiple of the ViT's patch size (at least one patch), so H x W <= N and no image is
    upscaled except to one patch a side; its slots are the ViT's tokens of that grid, and the
    ViT's position embeddings are interpolated to it (bicubic, as transformers'
    interpolate_pos_encoding). At least one patch (patch_size^2); not with a LLaVA folder
    (model.hf_path: its image processor fixes the size; a Qwen2.5-VL folder sizes its images
    itself, so this stays 0 there)."""
    max_frames: int = 8
    """A dataset record's "video" (a list of frame files): at most this many frames, sampled
    evenly from first to last; each frame is an image of the sample, in order."""
    shuffle: bool = True
    """A dataset file's samples in a new order every epoch (seeded by training.seed): its blocks
    of 1024 consecutive records reordered, and each window's rows shuffled (data.index_window);
    false: file order."""
    max_empty_steps: int = 3
    """Stop the run when this many steps in a row carry no loss token (every sample bad)."""
    index_window: int = 16384
    """Records of a dataset file read, checked, tokenized and packed as one window (whole blocks
    of 1024), a window at a time as training reaches it (data/windows.py): start-up reads the
    first window only, whatever the corpus's size; the step whose batch, or the batches its
    loader workers build ahead, reach a window waits for its pass (shared by every rank and its
    loader workers' cores, in data_wait); rows never cross a window, and a row's samples come
    from one window's records."""
    cache_index: bool = True
    """Keep where a dataset file's records lie (each record's line and byte span, or row: a
    JSONL file's lines found, a tar's member headers read) in <job.dump_folder>/data_index, so
    that a restart, a resume or another run of the same files with this dump folder maps them
    instead of scanning the files again (data/index_cache.py; keyed by titan_vlm's code and each
    file's path, size and modification time); and the files' SHA-256 a checkpoint records,
    hashed once while they keep their paths, sizes and times."""
    num_workers: int = 2
    """Loader worker processes per rank that build the batches (read, decode, preprocess, collate)
    ahead of the step, a step each in turn (data/loader.py); 0: each batch is built in the
    training process when its step starts. Workers change when a batch is built, never what: the
    losses are bit-identical at any count, and a run may resume at another. Each rank's
    share of a dataset file's window pass (data.index_window) is split over the rank and up to
    as many forked processes (data/forked.py; at least 4096 records each, and no more than the
    node's cores over its ranks allow): the same index, sooner."""
    prefetch: int = 2
    """Batches each loader worker keeps ready ahead of the step (num_workers x prefetch in all,
    each in host memory, pinned on CUDA)."""


@dataclass
class Parallelism:
    """The device mesh pp x dp_replicate x dp_shard x cp x tp (parallel_dims.py) and how PP, CP
    and TP split the work."""

    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks: the model cut along its decoder layers into stages (the ViT,
    projector and token embeddings in the first, the norm and head in the last), each rank
    holding its stages' parameters only, trained over microbatches by
    pipeline_parallel_schedule; the loss and every gradient are one process's
    (parallel/pipeline.py). With data or context parallelism each stage is FSDP-sharded over
    its dp x cp ranks, with CP each stage's attention is exact over its cp ranks, with tensor
    (and sequence) parallelism each stage's blocks, embeddings and head are split over its tp
    ranks; every family (Qwen3-VL's DeepStack layers on the first stage), tied embeddings (a
    copy on the first and last stages, their gradients summed), Hugging Face weights and
    checkpoint.initial_load_path (each rank reads its stages'), compile and activation
    checkpointing of each stage's blocks, bf16, validation (the schedule forward only), a
    mixture-of-experts decoder (its load-balancing loss over every stage's routers) with expert
    parallelism within each stage; a checkpoint resumes at any pipeline layout. Not yet with
    validation and gradient accumulation together (a one-line error)."""
    pipeline_parallel_schedule: PPSchedule = "1F1B"
    """torch.distributed.pipelining's schedule: "GPipe" (every forward, then every backward),
    "1F1B" (one forward, one backward: at most `degree` microbatches' activations alive; needs
    at least `degree` microbatches), "Interleaved1F1B" (pipeline_parallel_stages_per_rank >= 2
    stages a rank, a smaller bubble), "InterleavedZeroBubble" (ZB-1P: each backward split into
    the inputs' gradients and the weights', which fill the bubble; one or more stages a rank;
    not yet with data, context or tensor parallelism or bf16)."""
    pipeline_parallel_microbatch_size: int = 1
    """Rows a pipeline microbatch: a step's rows on a dp rank (training.local_batch_size x the
    accumulation steps) are split into microbatches of this many, each crossing the stages in
    turn. A mixture-of-experts decoder's load-balancing loss is a microbatch's: set it to
    training.local_batch_size for the objective of the run without stages (a warning else)."""
    pipeline_parallel_stages_per_rank: int = 1
    """Stages each pipeline rank holds (Interleaved1F1B: >= 2; stage s on rank s mod degree)."""
    pipeline_parallel_stage_layers: str = ""
    """The decoder layers of each stage, comma-separated in stage order (degree x
    stages_per_rank counts of at least 1, summing to the decoder's layers; e.g. "1,2").
    "": split by the model's cost model so the costliest stage is cheapest, the first stage's
    ViT, projector and embeddings and the last's head counted, for microbatches of the
    config's rows (training.seq_len slots, data.images_per_sample images a row: what
    `python -m titan_vlm.plan` prices); set it where a dataset's rows differ."""

    data_parallel_replicate_degree: int = 1
    """HSDP replicas: parameters replicated across them, gradients all-reduced."""
    data_parallel_shard_degree: int = 1
    """FSDP degree: parameters, gradients and optimizer state sharded; -1: whatever the world
    size leaves over."""
    context_parallel_degree: int = 1
    """CP group size: each rank holds 1/cp of the text (and all image tokens)."""
    tensor_parallel_degree: int = 1
    """TP group size: must divide the decoder's heads, K/V heads, ffn dim, dim and vocabulary and
    the ViT's heads and MLP dim; a tp group runs inside one node."""
    expert_parallel_degree: int = 1
    """EP group size for a mixture-of-experts decoder: each rank of a group holds 1/ep of every
    sparse layer's experts, and tokens travel to their experts' ranks and back (all-to-all). The
    group borrows consecutive ranks of dp_shard x cp (it must divide their product and the
    number of experts); FSDP shards the experts over the rest. 1: every rank holds every
    expert (FSDP-sharded)."""
    cp_comm_type: CPCommType = "p2p"
    """Exact attention across the CP group: "p2p" (ring), "allgather" (K/V gathered), "a2a"
    (Ulysses: the heads per tp rank must divide by cp)."""
    cp_vision: CPVision = "shard"
    """Where the ViT runs in a CP group: "shard" (each rank encodes its share of the images,
    all-gathered), "replicate" (every rank encodes all), "broadcast" (cp rank 0 encodes and
    broadcasts)."""
    cp_sample_placement: CPSamplePlacement = "auto"
    """How a row's samples are placed on the CP group: "split" (every sample's text cut head-tail
    over all ranks, its images on every rank) or "auto" (per row, the cost model keeps short
    samples whole on one rank, with their images, and splits the long ones head-tail, so that
    the ranks' modelled costs balance; layout/placement.py). "auto" is the default: on every
    workload of benchmarks/cp_layouts.py its busiest rank costs less and it sends less
    (docs/performance.md)."""
    cp_image_tokens: CPImageTokens = "auto"
    """The image slots of a sample split over the CP group: "replicate" (every rank holds them,
    the seed's design: nothing extra travels, each rank works on all of them), "shard" (cut
    head-tail with the sample's text, an image possibly split between ranks: each rank works on
    its share, whose K/V then travel like text), or "auto" (per batch, shard where the cost
    model prices the busiest rank at least 1% lower; else replicate). Samples kept whole keep
    their images either way. "auto" is the default: its busiest rank costs at most replicate's
    on every workload of benchmarks/cp_layouts.py, 1.8x less on image-heavy rows at cp = 8
    (docs/performance.md)."""
    enable_sequence_parallel: bool = False
    """Sequence parallelism inside the TP group: norms and residual adds on a 1/tp slice of the
    (CP-local) sequence; needs tensor_parallel_degree > 1."""
    image_embed_tp_shard: bool = False
    """Hold the image embeddings sharded along the hidden dim over tp, all-gathered where they
    join the text (the CP exchange moves dim/tp columns); needs tensor_parallel_degree > 1."""


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in the backward instead of keeping them."""

    mode: ACMode = "none"
    """"none", "full" (recompute every ViT and decoder block in the backward) or "selective"
    (every other block)."""


@dataclass
class Compile:
    """torch.compile of the transformer blocks."""

    enable: bool = False
    """torch.compile each ViT and decoder block."""
    fullgraph: bool = True
    """One graph per block: a graph break is an error, not a silent split."""
    backend: CompileBackend = "inductor"
    """torch.compile backend: "inductor" (generated kernels, the fast one), "aot_eager" (traces
    forward and backward like inductor but runs them eagerly: finds graph breaks and tracing
    bugs in seconds) or "eager" (dynamo only)."""


@dataclass
class Metrics:
    """What the run reports."""

    log_freq: int = 1
    """Print a step's line every this many steps (and the last); metrics.jsonl and TensorBoard
    get every step."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files under job.dump_folder/tb."""
    enable_wandb: bool = False
    """Log the same metrics to Weights & Biases (the optional extra titan_vlm[wandb]); the run's
    files go under job.dump_folder/wandb. wandb's own environment variables apply: WANDB_PROJECT
    (default "titan_vlm"), WANDB_MODE=offline (no network; `wandb sync` uploads later),
    WANDB_API_KEY."""


@dataclass
class Validation:
    """A held-out loss during training: forward only, no gradients, the training's parallel
    layout and rows per step."""

    enable: bool = False
    """Evaluate every validation.freq steps; the result is validation_loss in the log,
    metrics.jsonl, TensorBoard and W&B."""
    dataset: str = "synthetic"
    """"synthetic": the built-in data drawn with seed training.seed + 1 (held out: a run with
    that seed trains on it, this one does not); or a dataset file (or a folder or glob pattern
    of them, or a Hugging Face datasets folder) of the formats data.dataset reads, read in file
    order (not shuffled), its image paths relative to data.image_root as the training file's."""
    freq: int = 100
    """Steps between evaluations (at the steps that are multiples of it)."""
    steps: int = 10
    """Batches per evaluation, each of local_batch_size rows per data-parallel rank: the same
    validation.steps x local_batch_size x dp rows every time (a file shorter than that wraps
    around). The loss is the mean over all their loss tokens."""


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots of a window of steps."""

    enable_profiling: bool = False
    """Trace a step every profiling.profile_freq steps with torch.profiler (CPU, and CUDA
    kernels on a GPU): job.dump_folder/<save_traces_folder>/iteration_<step>/rank<r>_trace.json,
    for chrome://tracing or Perfetto."""
    save_traces_folder: str = "profile_traces"
    """Folder of the traces, under job.dump_folder."""
    profile_freq: int = 10
    """Steps between traces: each trace is the step at a multiple of it, after up to 3 warm-up
    steps the profiler sees but does not keep."""
    enable_memory_snapshot: bool = False
    """Record the CUDA allocator's history and dump it every profiling.profile_freq steps:
    job.dump_folder/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle
    (for pytorch.org/memory_viz). CUDA only: on a CPU it records nothing (one line says so)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder of the memory snapshots, under job.dump_folder."""


@dataclass
class Checkpoint:
    """DCP checkpoints: when they are written, where, how many are kept."""

    enable: bool = False
    """Write checkpoints, and resume from the latest complete one at start."""
    folder: str = "checkpoint"
    """Folder of the step-N checkpoints, relative to job.dump_folder unless absolute."""
    interval: int = 500
    """Steps between checkpoints (the last step and a stop request also write one)."""
    keep: int = 3
    """Complete checkpoints kept, the newest; 0 keeps all."""
    allow_config_change: bool = False
    """Resume even if a key that must match the checkpoint's config (resume_config.MUST_MATCH)
    changed: a warning instead of an error."""
    async_mode: AsyncMode = "disabled"
    """How a checkpoint is written: "disabled" (the step waits for the files), "async" (the state
    is copied to CPU memory, then written by a background thread while training goes on; the
    checkpoint is complete, and `latest` moves to it, at the first step after every rank's
    files are on disk) or "async_with_pinned_mem" (the same, the copy into reused pinned host
    memory: faster off a GPU; CUDA only). A checkpoint still being written when the run ends is
    finished before it exits."""
    initial_load_path: str = ""
    """A checkpoint (a checkpoint folder or a step-N folder of another run) whose model weights
    start this run when checkpoint.folder holds no checkpoint yet: the optimizer, the lr
    schedule and the step start fresh (e.g. LLaVA's second stage from its first stage's
    projector). Its model architecture must be this run's. "": none (a Hugging Face folder or
    training.seed)."""


@dataclass
class JobConfig:
    """The whole configuration: one field per [section]."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


def sections() -> dict[str, type]:
    """{section name: its dataclass}, in the order of JobConfig's fields."""
    return key_types(JobConfig)


def _check_choice(key: str, value: object, names: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in names:
        raise ConfigError(f"{key} must be one of {', '.join(names)}, got {value!r}")
    return value


def _coerce(key: str, value: object, typ: object) -> object:
    """Convert a TOML or command-line value to the key's type, or fail naming the key. A Literal
    type admits its names only (a string either way)."""
    names = choices(typ)
    if names is not None:
        return _check_choice(key, value, names)
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes"):
                    return True
                if text.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {type_name(typ)}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected bool, got {value!r}")
    if (typ is int or typ is float) and (isinstance(value, bool) or not isinstance(value, typ)):
        raise ConfigError(f"{key}: expected {type_name(typ)}, got {value!r}")
    if typ is str and not isinstance(value, str):
        raise ConfigError(f"{key}: expected str, got {value!r}")
    return value


def _set(cfg: JobConfig, dotted: str, value: object, where: str, typed: bool = False) -> None:
    """Set key `dotted` ("section.key") from `where` (a file or "command line"). `typed`: the
    value comes from TOML, which has its own types (`steps = "3"` is a string, an error for an
    int key), and errors name the file; command-line values are all strings, converted by
    _coerce."""
    section, _, name = dotted.partition(".")
    known = sections()
    if section not in known or not name:
        raise ConfigError(f"{where}: unknown key '{dotted}' (sections: {', '.join(known)})")
    types = key_types(known[section])
    if name not in types:
        raise ConfigError(
            f"{where}: unknown key '{dotted}' (known in [{section}]: {', '.join(types)})"
        )
    typ = types[name]
    if value is None:
        if typ is not bool:
            raise ConfigError(f"{where}: '--{dotted}' needs a value")
        value = True
    if typed and isinstance(value, str) and typ in (int, float, bool):
        raise ConfigError(
            f"{where}: {dotted}: expected {type_name(typ)}, got the string {value!r} "
            "(TOML: write it without quotes)"
        )
    setattr(
        getattr(cfg, section), name, _coerce(f"{where}: {dotted}" if typed else dotted, value, typ)
    )


def check_choices(cfg: JobConfig) -> None:
    """The choice-valued keys of a config built or changed in code (load_config checks each
    value as it reads it): ConfigError naming the first key whose value is not one of the names
    of its Literal type."""
    for section, section_type in sections().items():
        for name, typ in key_types(section_type).items():
            names = choices(typ)
            if names is not None:
                _check_choice(f"{section}.{name}", getattr(getattr(cfg, section), name), names)


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from `--config FILE` (optional) and `--section.key=value` overrides."""
    cfg = JobConfig()
    overrides: list[tuple[str, str | None]] = []
    config_file: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: expected --section.key=value, got '{arg}'")
        key, eq, text = arg[2:].partition("=")
        value: str | None = text
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
        p.pipeline_parallel_degree
        * p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.context_parallel_degree
        * p.tensor_parallel_degree
    )


def _count(env: dict[str, str], name: str) -> int | None:
    """A positive integer from the environment, None when unset."""
    value = env.get(name)
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
    nnodes = _count(env, "NNODES") or 1
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
    if cfg.checkpoint.keep < 0:
        raise ConfigError(f"checkpoint.keep must be >= 0 (0: keep all), got {cfg.checkpoint.keep}")
    if cfg.data.max_empty_steps < 1:
        raise ConfigError(f"data.max_empty_steps must be >= 1, got {cfg.data.max_empty_steps}")


USAGE = """\
./run_train.sh --config FILE [--section.key=value ...]   (or --section.key value; a bare
--section.key sets a bool key to true). The TOML file holds [section] tables of the same keys;
the command line overrides it. Every key, its type (a | b: one of these names), its default:
"""
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REFERENCE_INTRO = """\
Generated from the dataclasses of `titan_vlm/config.py` (their field docstrings) by
`python -m titan_vlm.config --markdown`; do not edit by hand (tests/test_config_reference.py
checks that it is up to date). `python -m titan_vlm.config --help` and `./run_train.sh --help`
print the same.

```bash
./run_train.sh --config train_configs/vlm_cp.toml --training.steps=50 \\
    --parallelism.context_parallel_degree=4
```

A TOML file holds `[section]` tables of the keys below (a value of TOML's own type: `steps = 3`,
not `steps = "3"`); `--section.key=value` (or `--section.key value`) on the command line
overrides it, and a bare `--section.key` sets a bool key to true. A key that takes one of a few
names lists them as `a` \\| `b`. An unknown key, a value of the wrong type or name, or an
impossible combination stops the run before any process starts, with one line naming the key.
"""


def main(argv: list[str]) -> int:
    """`python -m titan_vlm.config [--help]` prints every key; `--markdown [FILE]` writes the
    configuration reference (default: docs/configuration.md)."""
    if argv[:1] == ["--markdown"] and len(argv) <= 2:
        out = Path(argv[1]) if len(argv) == 2 else REFERENCE
        out.write_text(reference_markdown())
        print(f"wrote {out}")
        return 0
    if argv and argv[0] not in ("--help", "-h"):
        print("usage: python -m titan_vlm.config [--help | --markdown [FILE]]", file=sys.stderr)
        return 2
    print(config_help(), end="")
    return 0


def config_help() -> str:
    """What `--help` prints: every section and key, with type, default and docstring."""
    return help_text(JobConfig, USAGE)


def reference_markdown() -> str:
    """docs/configuration.md: the same as config_help, as Markdown tables."""
    return markdown(JobConfig, "Configuration reference", REFERENCE_INTRO)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
