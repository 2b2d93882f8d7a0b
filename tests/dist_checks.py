"""Checks that run on every rank of the shared test process group (see dist_pool.py).

Each returns plain Python data; the tests in test_*.py assert on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titan_vlm.attention import planned_attention
from titan_vlm.config import JobConfig, Training
from titan_vlm.data.batch import IGNORE_INDEX, Batch, Sample, collate
from titan_vlm.data.images import NativeResolution
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.distributed import dist_sum, local_tensor
from titan_vlm.layout import LayoutCost, SeqLayout
from titan_vlm.metrics import SavedForBackward
from titan_vlm.models.build import unfilled_model
from titan_vlm.models.common.decoder import apply_rope
from titan_vlm.models.common.text_args import Rope
from titan_vlm.models.llava.args import VLMArgs, get_flavor
from titan_vlm.models.llava.flops import layout_cost
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.llava.parallelize import apply_ac, parallelize_vlm
from titan_vlm.models.loading import canonical_name, local_box
from titan_vlm.models.qwen2_5_vl import vision as qwen_vision
from titan_vlm.models.spec import ModelSpec
from titan_vlm.optim import build_optimizer, build_scheduler
from titan_vlm.parallel import context_parallel, tensor_parallel
from titan_vlm.parallel.context_parallel import CPContext, CPOptions
from titan_vlm.parallel.tensor_parallel import TPOptions
from titan_vlm.parallel_dims import MESH_DIMS, Mesh
from titan_vlm.step import forward_backward, train_step
from titan_vlm.trainer import Trainer

GROUPS = ("vision", "projector", "decoder")
# Parameters whose exact gradient is zero: a key bias adds q.b_k to every score of a query, which
# the softmax cancels. Their computed gradients are rounding noise (~1e-11) on both sides, where
# a relative error means nothing; they are checked to be ~0 instead (`zero_grad_abs`).
ZERO_GRAD_SUFFIXES = ("attn.k.bias",)


@cache
def make_mesh(
    dp_shard: int, cp: int, dp_replicate: int = 1, tp: int = 1, ep: int = 1, pp: int = 1
) -> Mesh:
    """A (pp, dp_replicate, dp_shard, cp, tp) mesh (with `ep`, expert parallelism over
    consecutive ranks of dp_shard x cp); the world is split into identical copies of it."""
    world = dist.get_world_size()
    copies = world // (pp * dp_replicate * dp_shard * cp * tp)
    root = init_device_mesh(
        "cpu",
        (copies, pp, dp_replicate, dp_shard, cp, tp),
        mesh_dim_names=("copies", *MESH_DIMS),
    )
    return Mesh.from_root(root, ep)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This rank's share of [|a - b|^2, |b|^2, |a|^2] (float64), where `a` is a parallel tensor
    (a DTensor, or a plain tensor that every rank holds) and `b` the whole reference tensor:
    summed over the world, the shares are the sums over the whole tensors. Each rank pairs its
    piece of `a` with the same box of `b` (loading.local_box, what loads checkpoints and Hugging
    Face weights) and divides by the number of ranks holding that piece; a replica that differs
    from its copies counts as a difference. This replaces a full_tensor() all-gather per
    parameter by one all-reduce for all of them (_relative_errors)."""
    copies = dist.get_world_size()
    if isinstance(a, DTensor):
        assert not any(p.is_partial() for p in a.placements), a.placements
        mesh = a.device_mesh
        copies //= mesh.size()
        copies *= math.prod(mesh.size(d) for d, p in enumerate(a.placements) if p.is_replicate())
    a, box = local_box(a.detach())
    a, b = a.double(), b.detach()[box].double()
    return torch.stack([(a - b).square().sum(), b.square().sum(), a.square().sum()]) / copies


def _relative_errors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, float]]:
    """(norm(a - b) / norm(b), max(norm(a), norm(b))) of each (parallel, reference) pair, with one
    all-reduce over the world for all pairs (_squares). Every rank passes the same pairs."""
    sums = torch.stack([_squares(a, b) for a, b in pairs])
    dist.all_reduce(sums)
    return [(diff / max(ref, 1e-30), max(ref, own)) for diff, ref, own in sums.sqrt().tolist()]


def special_rows(name: str, seq_len: int, seed: int = 0) -> Batch:
    """Hand-built packed rows for the packing tests (debug flavor: 16 slots per image).
    "mixed": samples with 0, 1 and 3 images, an image in the middle and one at the end of its
    text; "no_image": text-only samples; "half_images": a text-only row and a row with images;
    "one_rank_images": a long sample whose two images sit inside its first text chunk, i.e.
    among one CP rank's text at cp=2 and cp=4; "native": the "mixed" kinds with six images of
    different sizes (an ImageList: native resolution, 6 to 16 slots each)."""
    args = get_flavor("debug")
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, seed, sentences_per_image=2
    )
    enc = data.tokenizer.encode
    rng = random.Random(seed)

    def image() -> torch.Tensor:
        return data.random_image(rng, 1)[0]

    def sized(h: int, w: int) -> torch.Tensor:
        return torch.rand(3, h, w, generator=torch.Generator().manual_seed(h * 97 + w)) * 2 - 1

    def text(n: int, bos: bool = False, eos: bool = False) -> list[int]:
        return enc("".join(rng.choice("abcdefgh ") for _ in range(n)), bos=bos, eos=eos)

    if name == "mixed":
        rows = [
            [
                Sample([image(), text(20, True, True)]),
                Sample([text(9, True, True)]),
                Sample(
                    [text(4, True), image(), text(7), image(), text(5), image(), text(6, eos=True)]
                ),
            ],
            [
                Sample([text(11, True), image(), text(23, eos=True)]),
                Sample([text(6, True), image()]),
                Sample([text(30, True, True)]),
            ],
        ]
    elif name == "no_image":
        rows = [
            [Sample([text(25, True, True)]), Sample([text(40, True, True)])],
            [Sample([text(70, True, True)])],
        ]
    elif name == "half_images":  # one row without, one with images (at dp=2: a dp rank has none)
        rows = [
            [Sample([text(25, True, True)]), Sample([text(40, True, True)])],
            [
                Sample([image(), text(30, True, True)]),
                Sample([text(3, True), image(), text(20, eos=True)]),
            ],
        ]
    elif name == "long_and_short":  # cp_sample_placement="auto": the long one split, the rest whole
        rows = [
            [
                Sample([text(3, True), image(), text(2), image(), text(86, eos=True)]),
                Sample([image(), text(10, True, True)]),
                Sample([text(12, True, True)]),
            ],
            [
                Sample([text(4, True), image(), text(6, eos=True)]),
                Sample([text(70, True, True)]),
                Sample([text(30, True), image()]),
                Sample([text(9, True, True)]),
            ],
        ]
    elif name == "native":  # images of mixed sizes (native resolution), packed, interleaved
        rows = [
            [
                Sample([sized(16, 40), text(20, True, True)]),
                Sample([text(9, True, True)]),
                Sample(
                    [
                        *(text(4, True), sized(24, 24), text(7), sized(32, 32)),
                        *(text(5), sized(8, 48), text(6, eos=True)),
                    ]
                ),
            ],
            [
                Sample([text(11, True), sized(40, 16), text(23, eos=True)]),
                Sample([text(6, True), sized(24, 16)]),
                Sample([text(30, True, True)]),
            ],
        ]
        rule = NativeResolution(2 * 32 * 32, 8, args.vision.image_size, args.image_tokens)
        return collate(rows, seq_len, rule, args.vision.image_size, data.tokenizer.PAD)
    elif name == "one_rank_images":
        rows = [
            [Sample([text(2, True), image(), text(1), image(), text(70, eos=True)])],
            [Sample([text(3, True), image(), text(60, eos=True)]), Sample([text(12, True, True)])],
        ]
    else:
        raise ValueError(name)
    return collate(rows, seq_len, args.tokens_per_image, args.vision.image_size, data.tokenizer.PAD)


def parity(
    dp_shard: int = 1,
    cp: int = 2,
    dp_replicate: int = 1,
    seq_len: int = 61,
    batch_size: int = 2,
    comm: str = "p2p",
    vision: str = "shard",
    images: int = 1,
    sum_image_grad: bool = True,
    seed: int = 3,
    mixed_precision: str = "fp32",
    ac: str = "none",
    compile_backend: str = "none",
    packing: bool = False,
    rows: str | None = None,
    image_attention: str = "causal",
    merge_samples: bool = False,
    tp: int = 1,
    sp: bool = False,
    image_embed_tp_shard: bool = False,
    tp_unreduced_norms: bool = False,
    hf_features: bool = False,
    placement: str = "split",
    placement_cost: str = "pairs",
    kept_images_placed: bool = True,
    image_tokens: str = "replicate",
) -> dict:
    """One optimizer step of the parallel trainer against one process with the same weights and
    global batch. Returns both losses and grad norms and, per group (vision, projector, decoder),
    the worst per-parameter relative error (norm of difference / norm) of the gradient and of the
    parameter after the step. Rows: the synthetic data (`packing` on or off) or `special_rows`.
    `merge_samples` (negative control only) lets the parallel run's samples attend to each other.
    `tp`, `sp`, `image_embed_tp_shard`: tensor parallelism (TPOptions); `tp_unreduced_norms` is
    the TP negative control (_sp_norms_with_local_weights). `hf_features`: the debug shapes with
        every module feature of the Hugging Face families (hf_features_args). `compile_backend`:
    "none" (eager blocks) or the torch.compile backend of every ViT and decoder block
    ("aot_eager", "inductor"), fullgraph, so a graph break fails the check; dynamo's caches are
    reset first and a recompile-limit hit is an error, so no block silently runs eager.
    `placement`: parallelism.cp_sample_placement, priced by `placement_cost` ("pairs": attention
    pairs only, LayoutCost(); "model": the debug model's weights, accounting.layout_cost);
    `kept_images_placed=False` is its negative control (_kept_images_not_placed);
    `image_tokens`: parallelism.cp_image_tokens."""
    args = dataclasses.replace(get_flavor("debug"), image_attention=image_attention)
    if hf_features:
        args = hf_features_args(args)
    t = Training(
        lr=1e-3,
        warmup_steps=0,
        steps=10,
        max_norm=1.0,
        seq_len=seq_len,
        local_batch_size=batch_size,
    )
    mesh = make_mesh(dp_shard, cp, dp_replicate, tp)
    dp = dp_replicate * dp_shard
    cost = layout_cost(args) if placement_cost == "model" else LayoutCost()
    options = CPOptions(
        comm_type=comm,
        vision=vision,
        sample_placement=placement,
        image_tokens=image_tokens,
        cost=cost,
    )
    tp_options = TPOptions(sequence_parallel=sp, image_embed_shard=image_embed_tp_shard)
    if rows is None:
        data = SyntheticCaptions(
            args.vision.image_size,
            args.tokens_per_image,
            seq_len,
            seed,
            sentences_per_image=3,
            images_per_sample=images,
            packing=packing,
        )
        full = data.batch(0, 0, 1, dp * batch_size)
    else:
        full = special_rows(rows, seq_len, seed)
        assert full.num_rows == dp * batch_size, "special rows: one per (dp rank, local row)"

    # The reference: one process, the whole global batch, no sharding, torch's own clip.
    torch.manual_seed(seed)
    ref = VLM(args)
    logits, labels, _ = ref.forward_local(full, CPContext())  # the family's forward, one process
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_norm)
    ref_grads = {
        n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None
    }  # clipped
    build_optimizer(ref, t).step()

    # The parallel run: same seed, so the same weights before sharding.
    if compile_backend != "none":
        torch._dynamo.reset()  # earlier checks' graphs would count towards the recompile limit
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.manual_seed(seed)
    with _sp_norms_with_local_weights() if tp_unreduced_norms else contextlib.nullcontext():
        model = parallelize_vlm(
            VLM(args),
            mesh,
            mixed_precision,
            cp_vision=vision,
            ac_mode=ac,
            compile_blocks=compile_backend != "none",
            tp=tp_options,
            compile_backend=compile_backend,
        )
    widths = []  # the local width of the image embeddings the projector hands to the CP exchange
    model.projector.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    opt = build_optimizer(model, t)
    sched = build_scheduler(opt, t)
    dp_rank = mesh.dp.get_local_rank()
    batch = full.rows(dp_rank * batch_size, (dp_rank + 1) * batch_size)
    if merge_samples:
        batch.doc = torch.where(batch.doc >= 0, 0, batch.doc)
    with (
        contextlib.nullcontext() if sum_image_grad else _image_grads_not_summed_over_cp(),
        contextlib.nullcontext() if kept_images_placed else _kept_images_not_placed(),
    ):
        stats, (layout,) = train_step(
            model, opt, sched, batch, mesh, t.max_norm, options, tp_options
        )

    grad_err = dict.fromkeys(GROUPS, 0.0)
    param_err = dict.fromkeys(GROUPS, 0.0)
    ref_params = dict(ref.named_parameters())
    missing = []  # parameters with a gradient on one side only
    zero_grad_abs = 0.0
    # Two pairs per parameter on every rank, whatever a rank's gradients (one all-reduce).
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    pairs = []
    for name, p in named:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        pairs += [
            (grad, ref_grads.get(name, torch.zeros_like(ref_params[name]))),
            (p, ref_params[name]),
        ]
    errors = _relative_errors(pairs)
    for i, (name, p) in enumerate(named):
        group = name.split(".")[0]
        (grad_rel, grad_norm), (param_rel, _) = errors[2 * i], errors[2 * i + 1]
        param_err[group] = max(param_err[group], param_rel)
        if (p.grad is None) != (ref_params[name].grad is None):
            missing.append(name)
        elif p.grad is not None and name.endswith(ZERO_GRAD_SUFFIXES):
            zero_grad_abs = max(zero_grad_abs, grad_norm)
        elif p.grad is not None:
            grad_err[group] = max(grad_err[group], grad_rel)
    return {
        "loss": stats["loss"],
        "ref_loss": ref_loss.item(),
        "grad_norm": stats["grad_norm"],
        "ref_grad_norm": ref_norm.item(),
        "grad_err": grad_err,
        "param_err": param_err,
        "missing_grads": missing,
        "zero_grad_abs": zero_grad_abs,
        "image_embed_width": widths[0] if widths else None,
        "ntokens": stats["ntokens"],
        "ref_ntokens": int((full.labels != IGNORE_INDEX).sum()),
        "cp_balance": stats["cp_balance"],
        "cp_padding": stats["cp_padding"],
        "split_samples": layout.split_samples(),
        "kept_samples": layout.kept_samples(),
        "kept_image_slots": [int((k.image >= 0).sum()) for k in layout.kept],
        "sharded_images": layout.sharded_images(),
        "replicated_images": layout.replicated_images(),
        "tied": model.decoder.output.weight is model.decoder.tok_embeddings.weight,
        "divide_factors": divide_factors(model),
    }


def divide_factors(model: VLM) -> dict[str, list[float]]:
    """Per group, the distinct FSDP gradient divide factors of its sharded modules (the reduce
    sums over the group's mesh, then divides by this): 1 everywhere except the vision tower and
    projector under cp_vision="replicate", which divide by cp."""
    modules = {
        "vision": [*model.vision.layers, model.vision],
        "projector": [model.projector],
        "decoder": [*model.decoder.layers, model.decoder],
    }
    out = {}
    for group, mods in modules.items():
        factors = set()
        for m in mods:
            assert isinstance(m, FSDPModule), f"{group}: {type(m).__name__} is not FSDP-sharded"
            param_group = m._get_fsdp_state()._fsdp_param_group
            assert param_group is not None
            factors.add(param_group.gradient_divide_factor)
        out[group] = sorted(factors)
    return out


def hf_features_args(args: VLMArgs) -> VLMArgs:
    """`args` with every module feature the Hugging Face families add: a CLIP-style tower cut
    before its last layer (class token dropped, pre-norm, no patch bias, quick_gelu, no post
    norm), a bias-free tanh-GELU projector, a decoder with q/k/v/o and MLP biases, q/k norms, a
    head_dim that is not dim / heads, llama3 RoPE and tied embeddings."""
    v, d = args.vision, args.decoder
    return dataclasses.replace(
        args,
        vision=dataclasses.replace(
            v,
            n_layers=v.n_layers - 1,
            source_layers=v.n_layers,
            act="quick_gelu",
            patch_bias=False,
            class_token=True,
            pre_norm=True,
            post_norm=False,
            drop_first=True,
        ),
        decoder=dataclasses.replace(
            d,
            head_dim=d.head_dim // 2,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            qk_norm=True,
            rope=Rope("llama3", 8.0, 1.0, 4.0, 16),
            tie_embeddings=True,
        ),
        projector_act="gelu_pytorch_tanh",
        projector_bias=False,
    )


@contextlib.contextmanager
def _sp_norms_with_local_weights():
    """TP negative control: sequence-parallel norms that keep plain per-rank weights. The layouts
    are SequenceParallel's (the norm runs on this rank's slice of the sequence), but the weights
    are not tp DTensors, so each rank's norm-weight gradient covers only its own slice and nothing
    sums it over tp: the classic forgotten SP all-reduce."""

    def local_weight_norm(**_):
        return PrepareModuleInputOutput(
            input_layouts=Shard(1),
            desired_input_layouts=Shard(1),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=Shard(1),
            use_local_output=False,
        )

    with mock.patch.object(tensor_parallel, "SequenceParallel", local_weight_norm):
        yield


@contextlib.contextmanager
def _kept_images_not_placed():
    """Negative control of cp_sample_placement="auto": the images of the samples a rank keeps
    whole never reach the decoder (their slots keep their token embeddings)."""
    with mock.patch.object(SeqLayout, "inline_embeds", lambda self, embeds: None):
        yield


@contextlib.contextmanager
def _image_grads_not_summed_over_cp():
    """The negative control of the image-embedding gradient sum: each CP rank's gradient is
    declared complete (Replicate) instead of Partial, so nothing sums it over cp."""
    with mock.patch.object(context_parallel, "image_grad_placement", Replicate):
        yield


def _job_config(steps: int, **overrides) -> JobConfig:
    """A JobConfig of `steps` steps with section__key=value overrides."""
    cfg = JobConfig()
    cfg.training = dataclasses.replace(cfg.training, steps=steps)
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


class _Crash(Exception):
    """A run dying right after a step (and its checkpoint, if one was due)."""


def train_run(
    dp_shard: int,
    cp: int,
    steps: int,
    stop_after: int | None = None,
    dp_replicate: int = 1,
    tp: int = 1,
    slow_write_s: float = 0.0,
    uncopied_async_state: bool = False,
    pp: int = 1,
    ep: int = 1,
    **overrides,
) -> list[dict]:
    """The real training loop (Trainer) on a test mesh; overrides are section__key=value.
    Each copy of the mesh in the world writes under <job.dump_folder>/copy<i>. `stop_after`:
    the run dies after that step, as a crash would (no checkpoint beyond the cadence's; an
    async save's writer thread, which a crash would end, is let finish writing its files but
    nothing commits them). `slow_write_s`: each checkpoint write starts that much later (the
    steps after an async save go on meanwhile). `uncopied_async_state` (negative control): an
    async save writes the live tensors instead of their copy at the step. `pp`: pipeline stages'
    ranks (the outermost dim); `ep`: expert parallelism over dp_shard x cp."""
    cfg = _job_config(steps, **overrides)
    cfg.job.dump_folder = (
        f"{cfg.job.dump_folder}/copy{dist.get_rank() // (pp * dp_replicate * dp_shard * cp * tp)}"
    )
    cfg.parallelism.expert_parallel_degree = ep
    mesh = make_mesh(dp_shard, cp, dp_replicate, tp, ep, pp)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    write = _FileSystemWriter.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(slow_write_s)
        return write(self, *args, **kwargs)

    writes = contextlib.ExitStack()
    if slow_write_s:
        writes.enter_context(mock.patch.object(_FileSystemWriter, "write_data", slow_write))
    if uncopied_async_state:
        writes.enter_context(mock.patch.object(DefaultStager, "stage", lambda self, sd, **kw: sd))
    if stop_after is None:
        with writes:
            return trainer.train()
    checkpoint_if_due = trainer.checkpoint_if_due

    def then_crash(step: int, stop: bool) -> None:
        checkpoint_if_due(step, stop)
        if step == stop_after:
            raise _Crash

    try:
        with mock.patch.object(trainer, "checkpoint_if_due", then_crash), writes:
            trainer.train()
    except _Crash:
        pending = trainer.checkpointer.pending if trainer.checkpointer else None
        if pending is not None:
            pending[2].result()
        trainer.metrics.close()
    return trainer.history


def validation_run(dp_shard: int, cp: int, steps: int, **overrides) -> dict:
    """train_run's Trainer with validation at its last step (validation.freq = steps), and a
    single-process evaluation of the same held-out rows with the trained weights (gathered
    whole into an unsharded model, the family's forward with a one-rank CPContext, one mean over
    every loss token). Negative controls: the same evaluation of the training data's first rows,
    and the mean of each dp rank's own mean (a wrong normaliser)."""
    cfg = _job_config(steps, **overrides)
    cfg.validation.enable, cfg.validation.freq = True, steps
    if cfg.compile.enable:
        torch._dynamo.reset()  # earlier checks' graphs would count towards the recompile limit
    trainer = Trainer(cfg, make_mesh(dp_shard, cp), torch.device("cpu"))
    history = trainer.train()
    whole = {canonical_name(n): _full(p).detach() for n, p in trainer.model.named_parameters()}
    ref = unfilled_model(trainer.spec, trainer.args)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(whole[name])
    rows, dp = cfg.training.local_batch_size, dp_shard

    def evaluate(data, per_rank: bool = False) -> float:
        sums = []
        for k in range(cfg.validation.steps):
            full = data.batch(k, 0, 1, rows * dp)  # the global batch: every dp rank's rows
            for part in (
                [full.rows(r * rows, (r + 1) * rows) for r in range(dp)] if per_rank else [full]
            ):
                logits, labels, _ = ref.forward_local(part, CPContext())
                loss = F.cross_entropy(
                    logits.flatten(0, 1).double(),
                    labels.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                sums.append((float(loss), int((labels != IGNORE_INDEX).sum())))
        if per_rank:  # each dp rank's mean, then their mean
            means = [loss / n for loss, n in sums]
            return sum(means) / len(means)
        return sum(loss for loss, _ in sums) / sum(n for _, n in sums)

    with torch.no_grad():
        return {
            "history": history,
            "validation_loss": history[-1]["validation_loss"],
            "reference": evaluate(trainer.validation),
            "mean_of_means": evaluate(trainer.validation, per_rank=True),
            "training_rows": evaluate(trainer.data),
        }


def config_run(
    argv: list[str], dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1
) -> dict:
    """The job `argv` (--config FILE --section.key=value ...) describes, as train.py runs it
    (load_config, validate_job, the mesh of its degrees, which the keywords size this pool to),
    without torchrun. Returns {"history", "before", "after", "groups"}: every parameter, whole,
    after the Trainer's set-up (its weights loaded) and after training, and its group
    (vision, projector, decoder: the family's ModelSpec.group_of)."""
    from titan_vlm.config import load_config
    from titan_vlm.validate import validate_job

    cfg = load_config(argv)
    dims = validate_job(cfg, dist.get_world_size())
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (dp_replicate, dp_shard, cp, tp)
    trainer = Trainer(cfg, dims.build_mesh("cpu"), torch.device("cpu"))

    def whole() -> dict[str, torch.Tensor]:
        return {
            canonical_name(n): _full(p).detach().clone()
            for n, p in trainer.model.named_parameters()
        }

    before = whole()
    history = trainer.train()
    groups = {name: trainer.spec.group_of(name) for name in before}
    return {"history": history, "before": before, "after": whole(), "groups": groups}


def wandb_run(steps: int, **overrides) -> list[dict]:
    """train_run (one process) with W&B logging offline, its files under the dump folder."""
    import os

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    cfg = _job_config(steps, metrics__enable_wandb=True, **overrides)
    return Trainer(cfg, make_mesh(1, 1), torch.device("cpu")).train()


def accumulation_run(
    dp_shard: int, cp: int, steps: int, microbatch_normaliser: bool = False, **overrides
) -> dict:
    """train_run's Trainer, returning {"history", "params": {name: the parameter after
    training, whole}}. `microbatch_normaliser` (negative control): each microbatch's loss over
    its own loss tokens instead of the step's (a mean of means)."""
    import titan_vlm.step as step_module

    cfg = _job_config(steps, **overrides)
    trainer = Trainer(cfg, make_mesh(dp_shard, cp), torch.device("cpu"))
    real = step_module.forward_backward

    def own_tokens(model, batch, mesh, cp, tp, ntokens=None, accumulating=False, **kw):
        return real(model, batch, mesh, cp, tp, None, accumulating, **kw)

    with (
        mock.patch.object(step_module, "forward_backward", own_tokens)
        if microbatch_normaliser
        else contextlib.nullcontext()
    ):
        history = trainer.train()
    params = {
        canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    return {"history": history, "params": params}


def freeze_run(dp_shard: int, cp: int, steps: int, tp: int = 1, **overrides) -> dict:
    """train_run's Trainer (training.freeze etc. in overrides), and what freezing promises: each
    group's parameters before and after training (bit-equal or not, by PARAM_GROUPS group), the
    parameters the optimizer holds, its param groups' rates, and how often a vision block's
    backward ran. Returns {"history", "unchanged": {group: bool}, "optimizer_params",
    "optimizer_lrs": {lr_name: initial lr}, "vision_backward_calls", "frozen_grads": whether
    any frozen parameter got a gradient, "frozen_digests": {name: SHA-256 of the frozen
    parameter's bytes before training}}."""
    cfg = _job_config(steps, **overrides)
    trainer = Trainer(cfg, make_mesh(dp_shard, cp, 1, tp), torch.device("cpu"))
    model, spec = trainer.model, trainer.spec

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()

    before = {n: full(p) for n, p in model.named_parameters()}
    calls = [0]
    for block in model.vision_modules()[0].layers:
        block.register_full_backward_pre_hook(lambda m, g: calls.__setitem__(0, calls[0] + 1))
    frozen_grads = [False]
    real_step = trainer.optimizer.step

    def step_and_look(*args, **kwargs):
        frozen_grads[0] |= any(
            p.grad is not None for p in model.parameters() if not p.requires_grad
        )
        return real_step(*args, **kwargs)

    with mock.patch.object(trainer.optimizer, "step", step_and_look):
        history = trainer.train()
    unchanged: dict[str, bool] = {}
    for n, p in model.named_parameters():
        group = spec.group_of(n)
        same = torch.equal(full(p), before[n])
        unchanged[group] = unchanged.get(group, True) and same
    return {
        "history": history,
        "unchanged": unchanged,
        # the frozen parameters as they entered training (an export must hold these bytes)
        "frozen_digests": {
            n: hashlib.sha256(t.numpy().tobytes()).hexdigest()
            for n, t in before.items()
            if not dict(model.named_parameters())[n].requires_grad
        },
        "optimizer_params": sum(len(g["params"]) for g in trainer.optimizer.param_groups),
        "optimizer_lrs": {g["lr_name"]: g["initial_lr"] for g in trainer.optimizer.param_groups},
        "vision_backward_calls": calls[0],
        "frozen_grads": frozen_grads[0],
    }


def saved_for_backward(
    cp: int,
    comm: str = "p2p",
    seq_len: int = 528,
    batch_size: int = 1,
    ac: str = "none",
    flavor: str = "debug",
) -> dict:
    """What autograd saves for backward on this rank during one forward (CP only, no FSDP):
    bytes, counting each storage once and leaving out the parameters, and the longest dim of
    any saved tensor (a whole-sequence K/V would show up there)."""
    args = get_flavor(flavor)
    mesh = make_mesh(1, cp)
    torch.manual_seed(0)
    model = VLM(args)
    apply_ac(model, ac)
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, 0, sentences_per_image=40
    )
    with SavedForBackward(model.parameters()) as saved:
        # every sample split, images replicated: the layout the memory formulas price
        options = CPOptions(comm_type=comm, sample_placement="split", image_tokens="replicate")
        forward_backward(model, data.batch(0, 0, 1, batch_size), mesh, options)
    return {"bytes": saved.bytes, "longest_dim": saved.longest_dim}


def family_config(family: str, flavor: str) -> tuple[ModelSpec, JobConfig]:
    """A family's ModelSpec and a default JobConfig naming it and its `flavor`."""
    from titan_vlm.models.registry import get_model_spec

    cfg = JobConfig()
    cfg.model.name = family  # type: ignore[assignment]
    cfg.model.flavor = flavor  # type: ignore[assignment]
    return get_model_spec(family), cfg


def family_saved_for_backward(
    family: str, cp: int, flavor: str = "debug", seq_len: int = 256, images: int = 6
) -> dict:
    """`saved_for_backward` for a family through its ModelSpec: rows of one sample each,
    `images` images of the family's built-in size first, then text to the end of the row (the
    planner's workload), on a plain model (CP only, no FSDP); every sample split, images
    replicated. Returns the bytes, the rows' slot metadata (doc, image) for the planner, and
    the family's model FLOPs of the batch as the trainer counts them (ModelSpec.flops)."""
    spec, cfg = family_config(family, flavor)
    args = spec.args(cfg)
    rule, slot_data = spec.data_rule(args, cfg)
    g = torch.Generator().manual_seed(0)
    size = args.image_size
    pixels = [torch.randn(3, size, size, generator=g) for _ in range(images)]
    text = seq_len - images * args.tokens_per_image
    ids = torch.randint(0, args.image_token_id, (text,), generator=g).tolist()
    rows = [[Sample([*pixels, ids])] for _ in range(2)]
    batch = collate(rows, seq_len, rule, rule.image_size, 0, slot_data=slot_data)
    mesh = make_mesh(1, cp)
    torch.manual_seed(0)
    model = spec.build(args)
    with SavedForBackward(model.parameters()) as saved:
        options = CPOptions(sample_placement="split", image_tokens="replicate")
        layout = forward_backward(model, batch, mesh, options).layout
    flops = spec.flops(args, batch, layout)
    return {"bytes": saved.bytes, "doc": batch.doc, "image": batch.image, "flops": flops}


def model_state_bytes(
    dp_shard: int,
    cp: int,
    dp_replicate: int = 1,
    tp: int = 1,
    vision: str = "shard",
    flavor: str = "debug",
    ep: int = 1,
    sp: bool = False,
    family: str = "llava",
    pp: int = 1,
    tie: bool = False,
) -> int:
    """The trainer's "model state per rank" on this rank, in bytes: STATE_BYTES_PER_PARAM times
    the local elements of every parameter of a family's model parallelized through its
    ModelSpec (as build_model does: with `pp` pipeline ranks, this rank's stage of it) with
    parallelism.cp_vision `vision` and sequence parallelism `sp` (run_training's expression);
    `tie`: its head tied to its embeddings."""
    from titan_vlm.models.accounting import STATE_BYTES_PER_PARAM
    from titan_vlm.parallel.pipeline import stage_plan

    spec, cfg = family_config(family, flavor)
    cfg.parallelism.cp_vision = vision  # type: ignore[assignment]
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.enable_sequence_parallel = sp
    cfg.parallelism.expert_parallel_degree = ep
    cfg.parallelism.pipeline_parallel_degree = pp
    torch.manual_seed(0)
    args = spec.args(cfg)
    if tie:
        args = dataclasses.replace(
            args, decoder=dataclasses.replace(args.decoder, tie_embeddings=True)
        )
    model = spec.build(args)
    mesh = make_mesh(dp_shard, cp, dp_replicate, tp, ep, pp)
    plan = stage_plan(cfg, mesh.pp, model, spec.layout_cost(args))
    if plan is not None:
        plan.prune(model)
    spec.parallelize(model, mesh, cfg)
    local = sum(local_tensor(p).numel() for p in model.parameters())
    return STATE_BYTES_PER_PARAM * local


def _benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (its worker, its byte counter)."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module(name)


def cp_scaling_measured(cp: int, configs: list[tuple[str, int]]) -> list[dict]:
    """benchmarks/cp_scaling.py's own worker on this group (cp processes): the reports of its rank
    0, one per (comm, seq_len) of `configs`."""
    cp_scaling = _benchmark("cp_scaling")
    reports: list[dict] = []
    cp_scaling.worker(dist.get_rank(), cp, SimpleNamespace(put=reports.append), configs, "debug")
    return reports


def placed_step_measured(
    cp: int, comm: str, placement: str, image_tokens: str, seq_len: int, rows: int
) -> dict:
    """One forward + backward of packed rows (SyntheticCaptions, packing, up to 2 images per
    sample) under cp_sample_placement `placement` and cp_image_tokens `image_tokens`, with the
    family's cost model as the trainer passes it: what autograd saves and the bytes the CP
    attention sends (benchmarks/cp_scaling.py's counter), the most over the CP ranks; and the
    batch's slot metadata, so that the planner prices the same rows."""
    count_sent_bytes = _benchmark("cp_scaling").count_sent_bytes
    args = get_flavor("debug")
    mesh = make_mesh(1, cp)
    torch.manual_seed(0)
    model = VLM(args)
    data = SyntheticCaptions(
        args.vision.image_size,
        args.tokens_per_image,
        seq_len,
        0,
        sentences_per_image=8,
        images_per_sample=2,
        packing=True,
    )
    batch = data.batch(0, 0, 1, rows)
    options = CPOptions(comm, "shard", placement, image_tokens, layout_cost(args))
    with count_sent_bytes() as sent, SavedForBackward(model.parameters()) as saved:
        layout = forward_backward(model, batch, mesh, options).layout
    stats = torch.tensor([saved.bytes, sent["bytes"]], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return dict(
        saved=int(stats[0]),
        sent=int(stats[1]),
        doc=batch.doc,
        image=batch.image,
        kept=layout.kept_samples(),
        split=layout.split_samples(),
        sharded=any(bool((t.image >= 0).any()) for t in layout.texts),
    )


def mismatched_batches(cp: int = 2) -> str:
    """CP rank 1 builds a batch that differs from rank 0's (as a data error on one rank would):
    the per-step check must raise on every rank of the group, not hang. Returns the message."""
    from titan_vlm.step import check_same_batch

    mesh = make_mesh(1, cp)
    batch = SyntheticCaptions(32, 16, 64, seed=0).batch(0, 0, 1, 2)
    check_same_batch(batch, mesh.rows, step=1)  # the same batch everywhere: fine
    if mesh.cp.get_local_rank() == 1:
        batch.tokens[0, 20] += 1
    try:
        check_same_batch(batch, mesh.rows, step=2)
    except RuntimeError as e:
        return str(e)
    return "no error"


def built_weights(
    dp_shard: int, cp: int, tp: int = 1, ep: int = 1, **overrides
) -> dict[str, torch.Tensor]:
    """The trainer's model (models/build.py: meta, parallelize, each rank fills its own shards)
    on a test mesh (`ep`: expert parallelism), gathered whole; overrides are
    section__key=value."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_vlm.models.build import build_model
    from titan_vlm.models.loading import canonical_parameters
    from titan_vlm.models.registry import model_spec

    cfg = JobConfig()
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    model, _ = build_model(
        model_spec(cfg), cfg, make_mesh(dp_shard, cp, 1, tp, ep), torch.device("cpu")
    )
    weights = {n: _full(p.detach()).clone() for n, p in canonical_parameters(model).items()}
    # the names the weights were seeded by are keys a checkpoint stores them under (which also
    # holds a tied head under its own name)
    assert weights.keys() <= get_model_state_dict(model).keys()
    return weights


@contextlib.contextmanager
def _captured_warnings():
    """The titan_vlm logger's warnings while the block runs (this rank's)."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("titan_vlm")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def train_run_keeping_a_new_key(dp_shard: int, cp: int, steps: int, **kwargs) -> list[dict]:
    """train_run whose trainer keeps one more key in its state than the checkpoints written so
    far hold (what a checkpoint of an older titan_vlm looks like to this one)."""
    from titan_vlm.trainer import Trainer

    real = Trainer.state_dict
    with mock.patch.object(Trainer, "state_dict", lambda self: {**real(self), "a_new_key": 1}):
        return train_run(dp_shard, cp, steps, **kwargs)


def train_run_warnings(dp_shard: int, cp: int, steps: int, pp: int = 1, **kwargs) -> dict:
    """train_run, also returning the warnings it logged: {"history": ..., "warnings": [...]}."""
    with _captured_warnings() as records:
        history = train_run(dp_shard, cp, steps, pp=pp, **kwargs)
    return {"history": history, "warnings": records}


def _train_run_wrapping_batches(
    wrap: Callable[[Callable[[int], tuple[Batch, Batch]]], Callable[[int], tuple[Batch, Batch]]],
    dp_shard: int,
    cp: int,
    steps: int,
    **kwargs,
) -> dict:
    """train_run_warnings whose loader hands the trainer `wrap(batch)(step)` in place of
    `batch(step)` (BatchLoader.batch: each step's batch, on the host and on the device, as the
    data pipeline built it): {"history", "warnings"}."""
    from titan_vlm.data.loader import BatchLoader

    real = BatchLoader.batch

    def batch(self: BatchLoader, step: int) -> tuple[Batch, Batch]:
        return wrap(lambda k: real(self, k))(step)

    with mock.patch.object(BatchLoader, "batch", batch):
        return train_run_warnings(dp_shard, cp, steps, **kwargs)


def train_run_with_nan_images(dp_shard: int, cp: int, steps: int, nan_step: int, **kwargs) -> dict:
    """train_run whose batch of step `nan_step` has NaN pixels (as a corrupt image would give):
    its loss and gradients are NaN. Returns {"history", "warnings"}."""

    def poisoning(batch: Callable[[int], tuple[Batch, Batch]]) -> Callable[..., tuple]:
        def poisoned(index: int) -> tuple[Batch, Batch]:
            host, device = batch(index)
            if index == nan_step - 1:
                device.images[:] = float("nan")
            return host, device

        return poisoned

    return _train_run_wrapping_batches(poisoning, dp_shard, cp, steps, **kwargs)


def train_run_with_slow_data(dp_shard: int, cp: int, steps: int, delay_s: float, **kwargs) -> dict:
    """train_run whose dataset takes `delay_s` longer to build each batch on CP rank 1 only (as
    a slow disk or a large JPEG would; Dataset.collated, where a loader worker or, with
    data.num_workers=0, the training process builds it). Returns {"history", "warnings"}."""
    import titan_vlm.trainer as train_module

    real = train_module.build_dataset
    slow_rank = dist.get_rank() == 1

    def build_dataset(*args, **kw):
        data = real(*args, **kw)
        collated = data.collated

        def slow(plan):
            if slow_rank:
                time.sleep(delay_s)
            return collated(plan)

        data.collated = slow
        return data

    with mock.patch.object(train_module, "build_dataset", build_dataset):
        return train_run_warnings(dp_shard, cp, steps, **kwargs)


def train_run_with_file_size_limit(
    dp_shard: int, cp: int, steps: int, limit_bytes: int, **kwargs
) -> list[dict]:
    """train_run where no file may grow past `limit_bytes` (RLIMIT_FSIZE, SIGXFSZ ignored: a
    write past it fails with EFBIG, as a full disk fails with ENOSPC)."""
    import resource
    import signal

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, old_limit[1]))
    try:
        return train_run(dp_shard, cp, steps, **kwargs)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def compiled_train_run(dp_shard: int, cp: int, steps: int, tp: int = 1, **overrides) -> dict:
    """train_run with every ViT and decoder block compiled (compile__backend etc. in overrides;
    fullgraph by default, so a graph break fails the run), dynamo's caches reset first and a
    recompile-limit hit an error, so no block silently runs eager. Returns {"history",
    "graph_breaks", "graphs": {"vit", "decoder"}: how many graphs dynamo compiled for the
    block's forward, "shapes": {"vit": the distinct image batch shapes, "decoder": the distinct
    local sequence lengths}}."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from titan_vlm.models.common.decoder import DecoderBlock
    from titan_vlm.models.llava import parallelize
    from titan_vlm.models.llava.vit import ViTBlock

    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    breaks = sum(counters["graph_break"].values())
    shapes: dict[str, set] = {"vit": set(), "decoder": set()}
    real_compile = parallelize.apply_compile

    def apply_compile(model: VLM, *args, **kwargs) -> None:
        # the blocks' input shapes, seen from the uncompiled stacks around them
        model.vision.register_forward_pre_hook(  # a tensor batch's shape, an ImageList's sizes
            lambda m, a: shapes["vit"].add(
                tuple(a[0].shape) if isinstance(a[0], torch.Tensor) else tuple(a[0].sizes())
            )
        )
        model.decoder.register_forward_pre_hook(
            lambda m, a: shapes["decoder"].add(
                a[0].shape[1] + (0 if a[1] is None else a[1].shape[1])  # text + image slots
            )
        )
        real_compile(model, *args, **kwargs)

    with mock.patch.object(parallelize, "apply_compile", apply_compile):
        history = train_run(dp_shard, cp, steps, tp=tp, compile__enable=True, **overrides)
    return {
        "history": history,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
        "graphs": {
            "vit": len(_debug_get_cache_entry_list(ViTBlock.forward)),
            "decoder": len(_debug_get_cache_entry_list(DecoderBlock.forward)),
        },
        "shapes": {name: sorted(s) for name, s in shapes.items()},
    }


def staged_compiled_run(dp_shard: int, cp: int, steps: int, pp: int, **overrides) -> dict:
    """train_run at `pp` pipeline ranks with compile.enable and the overrides' activation
    checkpointing, dynamo's caches reset first and a graph break or recompile-limit hit an
    error. Returns {"history", "graph_breaks", "compiled": the decoder and ViT blocks this rank
    compiled, "checkpointed": the blocks it wrapped in activation checkpointing} (its stages'
    blocks only: the others' placeholders are neither)."""
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from titan_vlm.parallel import parallelize

    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    seen = {"compiled": 0, "checkpointed": 0}
    real_compile, real_ac = parallelize.apply_compile, parallelize.apply_ac

    def apply_compile(stacks, *args, **kwargs) -> None:
        real_compile(stacks, *args, **kwargs)
        blocks = [b for layers in stacks for b in layers]
        seen["compiled"] += sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)

    def apply_ac(stacks, mode) -> None:
        real_ac(stacks, mode)
        blocks = [b for layers in stacks for b in layers]
        seen["checkpointed"] += sum(isinstance(b, CheckpointWrapper) for b in blocks)

    with (
        mock.patch.object(parallelize, "apply_compile", apply_compile),
        mock.patch.object(parallelize, "apply_ac", apply_ac),
    ):
        history = train_run(dp_shard, cp, steps, pp=pp, compile__enable=True, **overrides)
    return {
        "history": history,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
        **seen,
    }


# ---- the parity harness through the family interface (models/spec.py ModelSpec) --------------
# A family joins by adding its tiny args and its rows here: `family_parity` builds, parallelizes
# and feeds it only through its ModelSpec (build, parallelize, data_rule, layout_cost) and its
# forward_local, so every CP layout the trainer has is checked against one process for it.


def _qwen_rows(args, rule, slot_data, seq_len: int, seed: int) -> Batch:
    """Two packed rows of Qwen2.5-VL samples: images of three sizes (6, 8 and 4 slots), a
    3-frame video (grid (2, 4, 4): 8 slots), an 8-frame one (grid (4, 4, 4): 16 slots, whose
    frame groups cp_vision = "shard" deals to different ranks), text-only samples, one long
    interleaved sample (so "auto" splits it) and short ones (kept whole)."""
    g = torch.Generator().manual_seed(seed)

    def pixels(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def text(n: int) -> list[int]:
        return torch.randint(0, args.image_token_id, (n,), generator=g).tolist()

    start, end = args.vision_start_token_id, args.vision_end_token_id
    rows = [
        [
            Sample(
                [
                    text(4) + [start],
                    pixels(3, 56, 84),
                    [end] + text(9) + [start],
                    pixels(3, 3, 56, 56),  # a video of 3 frames
                    [end] + text(40),
                ]
            ),
            Sample([text(6) + [start], pixels(3, 56, 56), [end] + text(8)]),
        ],
        [
            Sample([text(12)]),
            # a video of 8 frames (4 frame groups): cp_vision = "shard" spreads its groups
            Sample([text(2) + [start], pixels(8, 3, 56, 56), [end] + text(5)]),
            Sample([text(3) + [start], pixels(3, 112, 56), [end] + text(20)]),
            Sample([text(9)]),
        ],
    ]
    return collate(rows, seq_len, rule, rule.image_size, 0, slot_data=slot_data)


def _qwen3_rows(args, rule, slot_data, seq_len: int, seed: int) -> Batch:
    """Two packed rows of Qwen3-VL samples: images of four sizes (6, 4, 8 and 9 slots: 32-pixel
    merge units), text-only samples, one long interleaved sample (so "auto" splits it) and short
    ones (kept whole)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, args.image_token_id, (n,), generator=g).tolist()

    start, end = args.vision_start_token_id, args.vision_end_token_id

    def image(height: int, width: int) -> torch.Tensor:
        return torch.randn(3, height, width, generator=g)

    rows = [
        [
            Sample(
                [
                    text(4) + [start],
                    image(64, 96),
                    [end] + text(9) + [start],
                    image(64, 64),
                    [end] + text(40),
                ]
            ),
            Sample([text(6) + [start], image(128, 64), [end] + text(8)]),
        ],
        [
            Sample([text(12)]),
            Sample([text(3) + [start], image(96, 96), [end] + text(20)]),
            Sample([text(9)]),
        ],
    ]
    return collate(rows, seq_len, rule, rule.image_size, 0, slot_data=slot_data)


FAMILIES = {"qwen2_5_vl": _qwen_rows, "qwen3_vl": _qwen3_rows}


@contextlib.contextmanager
def _deepstack_fault(fault: str) -> Iterator[None]:
    """Negative controls of Qwen3-VL's DeepStack under CP: "dropped_off_rank0" (ranks other than
    0 add no features), "one_layer_late" (feature j added after layer j + 1)."""
    from titan_vlm.models.qwen3_vl.model import Qwen3Decoder

    if fault == "none":
        yield
        return
    forward = Qwen3Decoder.forward

    def faulty(self, tokens, image_embeds, layout, inline_embeds=None, deepstack=None):
        deepstack = list(deepstack or [])
        if fault == "dropped_off_rank0" and dist.get_rank() != 0:
            deepstack = []
        elif fault == "one_layer_late" and deepstack:
            prefix, inline = deepstack[0]
            zeros = (prefix * 0, inline * 0 if inline is not None else None)
            deepstack = [zeros, *deepstack]
        return forward(self, tokens, image_embeds, layout, inline_embeds, deepstack)

    with mock.patch.object(Qwen3Decoder, "forward", faulty):
        yield


@contextlib.contextmanager
def _router_loss_from_local_counts(on: bool) -> Iterator[None]:
    """Negative control of the MoE router loss under dp x cp: each rank's loss from its own
    tokens' counts and number (no all-reduce), summed over the ranks as the step sums losses."""
    if not on:
        yield
        return
    import titan_vlm.step

    real = titan_vlm.step.aux_loss
    with mock.patch.object(titan_vlm.step, "aux_loss", lambda router, group: real(router, None)):
        yield


@contextlib.contextmanager
def _received_rows_not_regrouped(on: bool) -> Iterator[None]:
    """Negative control of expert parallelism: the rows an expert's rank receives are taken in
    the order they arrive (by source rank) instead of regrouped by local expert."""
    if not on:
        yield
        return
    import titan_vlm.parallel.expert_parallel as ep

    def arrival_order(recv: torch.Tensor) -> torch.Tensor:
        return torch.arange(int(recv.sum()))

    with mock.patch.object(ep, "_by_expert", arrival_order):
        yield


def family_parity(
    family: str = "qwen2_5_vl",
    flavor: str = "debug",
    aux_coef: float = -1.0,
    local_router_counts: bool = False,
    ep: int = 1,
    ep_unordered: bool = False,
    dp_replicate: int = 1,
    dp_shard: int = 1,
    cp: int = 2,
    comm: str = "p2p",
    vision: str = "shard",
    placement: str = "split",
    image_tokens: str = "replicate",
    seq_len: int = 96,
    seed: int = 3,
    ac: str = "none",
    compile_backend: str = "none",
    one_d_positions: bool = False,
    sum_image_grad: bool = True,
    tp: int = 1,
    sp: bool = False,
    tp_unreduced_norms: bool = False,
    embed_shard: bool = False,
    deepstack_fault: str = "none",
) -> dict:
    """One optimizer step of a family's parallel model against one process with the same weights
    and global batch (FAMILIES' rows: dp * 1 rows), all through its ModelSpec. Returns both
    losses and pre-clip grad norms, per group (its top-level modules) the worst per-parameter
    relative gradient error, and the placement. `one_d_positions` (negative control): the
    parallel run's rows carry plain 1-D positions in place of the family's slot data;
    `sum_image_grad=False` (negative control): the image embeddings' gradient is not summed over
    cp. `tp`, `sp`, `embed_shard`: tensor (and sequence) parallelism as parallelism.* sets them
    (embed_shard: image_embed_tp_shard); `tp_unreduced_norms` (negative control): the SP norms'
    weight gradients not summed over tp; `deepstack_fault` (negative control, qwen3_vl:
    `_deepstack_fault`). `flavor` and `aux_coef` (training.moe_aux_loss_coef): a
    mixture-of-experts decoder, whose router loss joins both sides' loss (one process: over its
    whole batch); `local_router_counts` (negative control): `_router_loss_from_local_counts`;
    `ep`: expert parallelism over consecutive ranks of dp_shard x cp; `ep_unordered` (negative
    control): `_received_rows_not_regrouped`; `dp_replicate`: HSDP replicas.
    Gradient errors are per parameter group (ModelSpec.group_of)."""
    from titan_vlm.models.common.moe import aux_loss

    spec, cfg = family_config(family, flavor)
    cfg.training.moe_aux_loss_coef = aux_coef
    cfg.parallelism.cp_vision = vision  # type: ignore[assignment]
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.enable_sequence_parallel = sp
    cfg.parallelism.image_embed_tp_shard = embed_shard
    cfg.activation_checkpoint.mode = ac  # type: ignore[assignment]
    cfg.compile.enable = compile_backend != "none"
    cfg.compile.backend = compile_backend  # type: ignore[assignment]
    args = spec.args(cfg)
    t = Training(lr=1e-3, warmup_steps=0, steps=10, max_norm=1.0, seq_len=seq_len)
    mesh = make_mesh(dp_shard, cp, dp_replicate, tp=tp, ep=ep)
    dp = dp_replicate * dp_shard
    rule, slot_data = spec.data_rule(args, cfg)
    full = FAMILIES[family](args, rule, slot_data, seq_len, seed)
    assert full.num_rows == 2 and dp in (1, 2)
    rows_per_rank = full.num_rows // dp

    torch.manual_seed(seed)
    ref = spec.build(args)
    logits, labels, _ = ref.forward_local(full, CPContext())
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    router = ref.router_stats()
    ref_aux = None
    if router is not None:
        share, ref_aux, _ = aux_loss(router, None)  # the whole batch in one process
        ref_loss = ref_loss + share
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_norm)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    if compile_backend != "none":
        torch._dynamo.reset()
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.manual_seed(seed)
    model = spec.build(args)
    with _sp_norms_with_local_weights() if tp_unreduced_norms else contextlib.nullcontext():
        spec.parallelize(model, mesh, cfg)
    opt = build_optimizer(model, t)
    sched = build_scheduler(opt, t)
    dp_rank = mesh.dp.get_local_rank()
    batch = full.rows(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)
    if one_d_positions:
        batch.slot_data = {
            k: torch.arange(v.shape[-1]).expand_as(v).clone() for k, v in batch.slot_data.items()
        }
    options = CPOptions(comm, vision, placement, image_tokens, spec.layout_cost(args))
    tp_options = TPOptions.from_config(cfg.parallelism)
    with (
        contextlib.nullcontext() if sum_image_grad else _image_grads_not_summed_over_cp(),
        _deepstack_fault(deepstack_fault),
        _router_loss_from_local_counts(local_router_counts),
        _received_rows_not_regrouped(ep_unordered),
    ):
        stats, (layout,) = train_step(
            model, opt, sched, batch, mesh, t.max_norm, options, tp_options
        )
    ref_params = dict(ref.named_parameters())
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    pairs = [
        (
            p.grad if p.grad is not None else torch.zeros_like(p),
            ref_grads.get(name, torch.zeros_like(ref_params[name])),
        )
        for name, p in named
    ]
    grad_err: dict[str, float] = {}
    for (name, _), (rel, _) in zip(named, _relative_errors(pairs)):
        group = spec.group_of(name)
        grad_err[group] = max(grad_err.get(group, 0.0), rel)
    return {
        "loss": stats["loss"],
        "ref_loss": ref_loss.item(),
        "grad_norm": stats["grad_norm"],
        "ref_grad_norm": ref_norm.item(),
        "grad_err": grad_err,
        "split_samples": layout.split_samples(),
        "kept_samples": layout.kept_samples(),
        "sharded_images": layout.sharded_images(),
        "replicated_images": layout.replicated_images(),
        "moe_aux_loss": stats.get("moe_aux_loss"),
        # how the first expert weight is held: its mesh dims and placements
        "experts": next(
            (
                (p.device_mesh.mesh_dim_names, [str(x) for x in p.placements])
                for n, p in model.named_parameters()
                if n.endswith("experts.w1") and isinstance(p, DTensor)
            ),
            None,
        ),
        "ref_moe_aux_loss": None if ref_aux is None else float(ref_aux),
    }


class _FusedQKVAttention(qwen_vision.VisionAttention):
    """Qwen2.5-VL's vision attention as transformers holds it: one fused qkv Linear [3 * dim, dim]
    whose output's thirds are q, k, v (the negative control below)."""

    def __init__(self, a, attention_kernel: str):
        super().__init__(a, attention_kernel)
        del self.q, self.k, self.v
        self.qkv = torch.nn.Linear(a.hidden_size, 3 * a.hidden_size)

    def forward(self, x, cos, sin, plan):
        qkv = self.qkv(x).unflatten(-1, (3, -1, self.head_dim))  # [1, N, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = planned_attention(q, k, v, plan, self.attention_kernel)
        return self.proj(out.transpose(1, 2).flatten(2))


def qwen_fused_qkv_parity(cp: int = 1, tp: int = 2, **kwargs) -> dict:
    """TP negative control of Qwen2.5-VL's vision attention: `family_parity` of a tower that keeps
    the fused qkv, split column-wise as one tensor by the plan, so a tp rank's q, k, v are a mix
    of q, k and v rows (why vision.py holds three projections). The one-process reference has
    the same fused tower, so only the split can break parity."""
    from titan_vlm.models.qwen2_5_vl import parallelize as qwen_parallelize

    def fused_plan(attn, qkv, *rest, **kw):
        return tensor_parallel.block_plan(attn, ("attn.qkv",), *rest, **kw)

    with (
        mock.patch.object(qwen_vision, "VisionAttention", _FusedQKVAttention),
        mock.patch.object(qwen_parallelize, "block_plan", fused_plan),
    ):
        return family_parity("qwen2_5_vl", cp=cp, tp=tp, **kwargs)


def experts_all_to_all(
    dp_shard: int = 2, tokens: int = 64, balanced: bool = True, kernel: str = "loop"
) -> dict:
    """One forward + backward of a MoE layer (4 experts, top 2, dim 32) under expert
    parallelism over the dp_shard ranks (each its own tokens), the experts' matmuls by `kernel`:
    the bytes this rank sends by all_to_all_single (benchmarks/moe_layer.py's counter), its
    output and its input's and experts' gradients. `balanced`: the router picks experts (t, t +
    1) mod 4 for token t, so half of every rank's picks leave it and as many arrive (what the
    planner assumes); else every token picks its own rank's experts (none leaves)."""
    from titan_vlm.models.common.moe import MoE
    from titan_vlm.models.common.text_args import MoEArgs
    from titan_vlm.parallel.parallelize import apply_ep

    moe_layer = _benchmark("moe_layer")
    mesh = make_mesh(dp_shard, 1, ep=dp_shard)
    assert mesh.ep is not None
    dim, e = 32, 4
    torch.manual_seed(0)
    layer = MoE(dim, MoEArgs(num_experts=e, top_k=2, ffn_dim=16, kernel=kernel))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    apply_ep([layer.experts], mesh.ep)
    with torch.no_grad():  # the router reads the first e features
        layer.router.weight.zero_()
        layer.router.weight[:, :e] = torch.eye(e)
    x = torch.zeros(tokens, dim)
    t = torch.arange(tokens)
    if balanced:
        x[t, t % e], x[t, (t + 1) % e] = 2.0, 1.0
    else:
        mine = 2 * mesh.ep.get_local_rank()  # this rank's experts: mine, mine + 1
        x[:, mine], x[:, mine + 1] = 2.0, 1.0
    x = x[None].requires_grad_()
    with moe_layer.count_all_to_all() as sent:
        out, _ = layer(x, torch.ones(1, tokens))
        (out * out).sum().backward()
    grads = [x.grad, *(local_tensor(p.grad) for p in layer.experts.parameters())]
    return {"bytes": sent["bytes"], "out": out.detach(), "grads": grads}


def shared_index(
    path: str,
    dp_shard: int,
    on_bad_sample: str = "skip",
    fail_on_rank: int | None = None,
    cache_folders: list[str] | None = None,
    rank_paths: list[str] | None = None,
    window: int = 16384,
    rows: int = 0,
) -> dict:
    """The JsonlDataset of `path` (test_jsonl_data.py's shapes) built with its first window's
    pass shared over the world of `dp_shard` ranks (data/shared_pass.py GroupShare), rank 0
    logging the pass's warnings: its windows (test_jsonl_data.index_of), counters, description
    and warnings, how many records this rank parsed ({"parsed"}) and how many files it scanned
    for their spans ({"scans"}: not read from the cache), or the one line it raised
    ({"error"}: a UserError's line, else type and message). `fail_on_rank`: that rank's parsing
    raises ValueError("a bug"), as a bug would. `cache_folders`: each rank's index cache folder
    (data/index_cache.py); `rank_paths`: each rank's own `path` (ranks that see other data);
    `window`: data.index_window; `rows`: the global rows then made readable (`ensure`, every
    rank)."""
    import titan_vlm.data.jsonl as jsonl
    import titan_vlm.data.record_files as record_files
    from titan_vlm.data.index_cache import IndexCache
    from titan_vlm.data.shared_pass import GroupShare
    from titan_vlm.data.tokenizer import ByteTokenizer
    from titan_vlm.errors import UserError

    assert dist.get_world_size() == dp_shard
    parsed = []
    real = record_files.decode_record

    def counting(raw, *args, **kwargs):
        parsed.append(raw)
        if dist.get_rank() == fail_on_rank:
            raise ValueError("a bug")
        return real(raw, *args, **kwargs)

    scans: list[str] = []
    real_spans = record_files.JsonRecords.spans

    def scanning(self):
        scans.append(str(self.path))
        return real_spans(self)

    counted = mock.patch.object(record_files, "decode_record", counting)
    scanned = mock.patch.object(record_files.JsonRecords, "spans", scanning)
    with counted, scanned, _captured_warnings() as warnings:
        try:
            data = jsonl.JsonlDataset(
                rank_paths[dist.get_rank()] if rank_paths else path,
                ByteTokenizer(),
                32,
                16,
                96,
                0,
                max_image_pixels=48 * 48,
                on_bad_sample=on_bad_sample,
                log_startup=dist.get_rank() == 0,
                share=GroupShare(dist.group.WORLD),
                cache=(
                    IndexCache(Path(cache_folders[dist.get_rank()]), {"code": "this"})
                    if cache_folders
                    else None
                ),
                window=window,
            )
            data.ensure(range(0, rows))
        except UserError as e:
            return {"error": str(e), "parsed": len(parsed)}
        except Exception as e:  # noqa: BLE001 - the test reads which one
            return {"error": f"{type(e).__name__}: {e}", "parsed": len(parsed)}
    return {
        "index": [
            [w.epoch, w.number, w.first, [[list(ref) for ref in row] for row in w.rows]]
            for w in data.windows
        ],
        "counts": [data.records, sum(data.skipped.values()), dict(data.skipped), data.truncated],
        "describe": data.describe(),
        "warnings": warnings,
        "parsed": len(parsed),
        "scans": len(scans),
    }


@contextlib.contextmanager
def _loss_over_each_microbatch() -> Iterator[None]:
    """Within: each pipeline microbatch's loss is over its own loss tokens, not the step's (the
    pipeline's negative control: a mean of means, which one process does not compute)."""
    from titan_vlm.parallel import pipeline

    real = pipeline.microbatches

    def own(parts, ntokens, bidirectional, ctx):
        out = real(parts, ntokens, bidirectional, ctx)
        for m, part in zip(out, parts):
            m.ntokens = (part.labels != IGNORE_INDEX).sum()
        return out

    with mock.patch.object(pipeline, "microbatches", own):
        yield


def pp_parity(
    pp: int = 2,
    schedule: str = "1F1B",
    virtual: int = 1,
    microbatches: int = 4,
    rows_per_microbatch: int = 1,
    n_layers: int = 3,
    seq_len: int = 61,
    steps: int = 2,
    seed: int = 5,
    loss_over_each_microbatch: bool = False,
    dp_shard: int = 1,
    cp: int = 1,
    cp_options: dict | None = None,
    image_grads_not_summed: bool = False,
    tie: bool = False,
    tied_grads_not_summed: bool = False,
    mixed_precision: str = "fp32",
    tp: int = 1,
    sp: bool = False,
    moe: bool = False,
    carrier_detached: bool = False,
) -> dict:
    """`steps` optimizer steps of the debug model (`n_layers` decoder layers; `tie`: its head
    tied to its embeddings; `moe`: debug_moe's decoder, layers 1 and 2 sparse, against one
    process adding each microbatch's load-balancing loss over the step's microbatches, as the
    trainer's accumulation does; one dp rank) cut into `pp` x
    `virtual` pipeline stages (parallel/pipeline.py), each stage's units sharded over `dp_shard`
    x `cp` ranks (FSDP: the llava family's parallelize, as the trainer builds it); the dp ranks
    read their own rows of the global batch, the cp ranks of one their CP shares of it
    (`cp_options`: CPOptions' fields), against one process with the same weights and global
    batches (packed synthetic rows with images, their loss tokens unequal across the
    microbatches).
    Returns each step's losses and gradient norms, both sides, and, over this rank's own
    parameters, the worst relative error of the last step's gradient and of the parameter after
    the steps, per group (vision, projector, decoder), with the names this rank holds.
    `loss_over_each_microbatch`: the negative control (_loss_over_each_microbatch);
    `image_grads_not_summed`: CP's (_image_grads_not_summed_over_cp); `tied_grads_not_summed`:
    the tied embedding's (each stage's copy steps with its own half of the gradient);
    `carrier_detached`: the negative control of `moe` (the router statistics reach the last
    stage without their graph: no balance gradient for the earlier stages' routers);
    `mixed_precision` "bf16": the stages' (against the fp32 process); `tp`, `sp`: each stage's
    blocks, embeddings and head split over tp ranks (sequence parallelism within a stage)."""
    from titan_vlm.models.common.moe import aux_loss
    from titan_vlm.models.llava.parallelize import parallelize_vlm
    from titan_vlm.optim import clip_grad_norm_
    from titan_vlm.parallel.pipeline import Pipeline, StagePlan

    base = get_flavor("debug_moe" if moe else "debug")
    decoder = dataclasses.replace(base.decoder, n_layers=n_layers, tie_embeddings=tie)
    if decoder.moe is not None:  # a balance loss that weighs in the routers' gradients
        decoder = dataclasses.replace(
            decoder, moe=dataclasses.replace(decoder.moe, aux_loss_coef=1.0)
        )
    args = dataclasses.replace(base, decoder=decoder)
    t = Training(lr=1e-3, warmup_steps=0, steps=10, max_norm=1.0, seq_len=seq_len)
    rows = microbatches * rows_per_microbatch  # a dp rank's, a step
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, seed, 2, packing=True
    )
    batches = [data.batch(step, 0, 1, rows * dp_shard) for step in range(steps)]  # global
    mesh = make_mesh(dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
    group, dp_rank = mesh.pp.get_group(), mesh.dp.get_local_rank()
    options = CPOptions(**(cp_options or {}))
    tp_options = TPOptions(sequence_parallel=sp)

    torch.manual_seed(seed)
    ref = VLM(args)
    ref_opt = build_optimizer(ref, t)
    ref_losses, ref_norms = [], []
    for batch in batches:
        ref_opt.zero_grad(set_to_none=True)
        if moe:  # each microbatch's cross-entropy over the step's tokens, its balance over m
            assert dp_shard == 1 and cp == 1
            ntokens = (batch.labels != IGNORE_INDEX).sum()
            loss = torch.zeros(())
            for k in range(microbatches):
                part = batch.rows(k * rows_per_microbatch, (k + 1) * rows_per_microbatch)
                logits, labels, _ = ref.forward_local(part, CPContext())
                ce = F.cross_entropy(
                    logits.flatten(0, 1),
                    labels.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                router = ref.router_stats()
                assert router is not None
                loss = loss + ce / ntokens + aux_loss(router, None)[0] / microbatches
        else:
            logits, labels, _ = ref.forward_local(batch, CPContext())
            loss = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
            )
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_norm).item())
        ref_losses.append(loss.item())
        ref_opt.step()

    torch.manual_seed(seed)
    model = VLM(args)  # the whole model, as one process builds it, then cut to this rank's stages
    plan = StagePlan(dist.get_rank(group), pp, virtual, n_layers)
    plan.prune(model)
    # FSDP over the dp x cp ranks, as build_model applies it
    parallelize_vlm(model, mesh, mixed_precision, cp_vision=options.vision, tp=tp_options)
    pipe = Pipeline(
        model,
        plan,
        group,
        schedule,
        microbatches,
        rows_per_microbatch,
        seq_len,
        torch.device("cpu"),
        CPContext(mesh.cp, options, mesh.tp, tp_options),
        torch.bfloat16 if mixed_precision == "bf16" else torch.float32,
        mesh.job.get_group(),
    )
    opt = build_optimizer(model, t)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        mine = batch.rows(dp_rank * rows, (dp_rank + 1) * rows)
        parts = [
            mine.rows(k * rows_per_microbatch, (k + 1) * rows_per_microbatch)
            for k in range(microbatches)
        ]
        ntokens = (batch.labels != IGNORE_INDEX).sum()  # the global batch's
        with (
            _loss_over_each_microbatch() if loss_over_each_microbatch else contextlib.nullcontext(),
            _image_grads_not_summed_over_cp()
            if image_grads_not_summed
            else contextlib.nullcontext(),
            mock.patch("titan_vlm.parallel.pipeline.sum_tied_grads")
            if tied_grads_not_summed
            else contextlib.nullcontext(),
            _carrier_detached() if carrier_detached else contextlib.nullcontext(),
        ):
            losses.append(dist_sum(pipe.step(parts, ntokens), mesh.job.get_group()).item())
        params = list(model.parameters())
        norms.append(clip_grad_norm_(params, t.max_norm, group, pipe.copies()).item())
        opt.step()

    ref_params = dict(ref.named_parameters())
    grad_err = dict.fromkeys(GROUPS, 0.0)
    param_err = dict.fromkeys(GROUPS, 0.0)
    missing, zero_grad_abs = [], 0.0
    for name, p in model.named_parameters():
        r = ref_params[name]
        if p.grad is None or r.grad is None:
            missing.append(name)
            continue
        group_name, g, rg = name.split(".")[0], _full(p.grad), r.grad
        if name.endswith(ZERO_GRAD_SUFFIXES):  # rounding noise on both sides (parity's note)
            zero_grad_abs = max(zero_grad_abs, float(g.norm()), float(rg.norm()))
        else:
            grad_err[group_name] = max(grad_err[group_name], float((g - rg).norm() / rg.norm()))
        p, r = _full(p.detach()), r.detach()
        param_err[group_name] = max(param_err[group_name], float((p - r).norm() / r.norm()))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_norms": norms,
        "ref_grad_norms": ref_norms,
        "grad_err": grad_err,
        "param_err": param_err,
        "missing_grads": missing,
        "zero_grad_abs": zero_grad_abs,
        "names": sorted(n for n, _ in model.named_parameters()),
        "microbatch_tokens": [
            int(
                (
                    batches[-1].labels[k * rows_per_microbatch : (k + 1) * rows_per_microbatch]
                    != IGNORE_INDEX
                ).sum()
            )
            for k in range(microbatches)
        ],
    }


@contextlib.contextmanager
def _carrier_detached() -> Iterator[None]:
    """Balance.add taking the carrier it received without its graph."""
    from titan_vlm.parallel.pipeline import Balance

    real = Balance.add
    with mock.patch.object(
        Balance, "add", lambda self, carrier, *a: real(self, carrier.detach(), *a)
    ):
        yield


def pp_eval(
    schedule: str, virtual: int, n_layers: int, pp: int = 2, seq_len: int = 61, seed: int = 5
) -> dict:
    """Pipeline.evaluate (the schedule forward only) of the debug model (`n_layers` layers) cut
    into `pp` x `virtual` stages, before and after a training step, and the training step between
    them, against one process on the same 4 one-row microbatches: {"evals", "ref_evals"} (the
    summed loss over the loss tokens, before and after), {"loss", "ref_loss"} (the step's)."""
    from titan_vlm.optim import clip_grad_norm_
    from titan_vlm.parallel.pipeline import Pipeline, StagePlan

    base = get_flavor("debug")
    args = dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, n_layers=n_layers))
    t = Training(lr=1e-3, warmup_steps=0, steps=10, max_norm=1.0, seq_len=seq_len)
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, seed, 2, packing=True
    )
    batch = data.batch(0, 0, 1, 4)
    parts = [batch.rows(k, k + 1) for k in range(4)]
    ntokens = (batch.labels != IGNORE_INDEX).sum()
    mesh = make_mesh(dp_shard=1, cp=1, pp=pp)
    group = mesh.pp.get_group()

    torch.manual_seed(seed)
    ref = VLM(args)
    ref_opt = build_optimizer(ref, t)

    def ref_sum() -> float:
        with torch.no_grad():
            logits, labels, _ = ref.forward_local(batch, CPContext())
        return F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ).item()

    ref_evals = [ref_sum()]
    logits, labels, _ = ref.forward_local(batch, CPContext())
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_norm)
    ref_opt.step()
    ref_evals.append(ref_sum())

    torch.manual_seed(seed)
    model = VLM(args)
    plan = StagePlan(dist.get_rank(group), pp, virtual, n_layers)
    plan.prune(model)
    pipe = Pipeline(model, plan, group, schedule, 4, 1, seq_len, torch.device("cpu"))
    opt = build_optimizer(model, t)
    evals = [pipe.evaluate(parts).item()]
    loss = pipe.step(parts, ntokens).item()
    clip_grad_norm_(list(model.parameters()), t.max_norm, group)
    opt.step()
    evals.append(pipe.evaluate(parts).item())
    return {"evals": evals, "ref_evals": ref_evals, "loss": loss, "ref_loss": ref_loss.item()}


def pipeline_saved_peak(
    schedule: str,
    virtual: int = 1,
    microbatches: int = 4,
    n_layers: int = 4,
    seq_len: int = 528,
    pp: int = 2,
) -> dict:
    """One step of the debug model (fp32, `n_layers` decoder layers) cut into `pp` x `virtual`
    stages under `schedule`, on rows of one image and text to the end (the planner's uniform
    rows: SyntheticCaptions, 40 sentences); the most bytes autograd held saved for backward at
    once on this rank (metrics.SavedForBackward.peak), and the rows' slot metadata."""
    from titan_vlm.parallel.pipeline import Pipeline, StagePlan

    base = get_flavor("debug")
    args = dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, n_layers=n_layers))
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, 0, sentences_per_image=40
    )
    batch = data.batch(0, 0, 1, microbatches)
    mesh = make_mesh(dp_shard=1, cp=1, pp=pp)
    group = mesh.pp.get_group()
    torch.manual_seed(0)
    model = VLM(args)
    plan = StagePlan(dist.get_rank(group), pp, virtual, n_layers)
    plan.prune(model)
    pipe = Pipeline(model, plan, group, schedule, microbatches, 1, seq_len, torch.device("cpu"))
    parts = [batch.rows(k, k + 1) for k in range(microbatches)]
    ntokens = (batch.labels != IGNORE_INDEX).sum()
    with SavedForBackward(model.parameters()) as saved:
        pipe.step(parts, ntokens)
    return {"peak": saved.peak, "alive_after": saved.alive, "doc": batch.doc, "image": batch.image}
