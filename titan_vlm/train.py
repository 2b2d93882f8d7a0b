"""The trainer:

    torchrun ... -m titan_vlm.train --config train_configs/vlm_cp.toml [--key=value ...]

Read `forward_backward` for where context parallelism happens: the image embeddings are
replicated over cp (gradient summed there), only the text is sharded, and the loss is the mean
over the global batch's text tokens.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_vlm.checkpoint import Checkpointer
from titan_vlm.config import JobConfig, load_config, validate_failure_keys
from titan_vlm.data import build_dataset, model_inputs
from titan_vlm.data.batch import IGNORE_INDEX, Batch
from titan_vlm.errors import UserError
from titan_vlm.kernels import select_kernel
from titan_vlm.launch import STOP, die_with_parent, report_user_error
from titan_vlm.layout import SeqLayout
from titan_vlm.metrics import MetricsLogger, peak_memory_gib
from titan_vlm.models.accounting import STATE_BYTES_PER_PARAM, param_counts
from titan_vlm.models.build import build_model
from titan_vlm.models.registry import get_model_spec
from titan_vlm.models.vlm import VLM
from titan_vlm.optim import build_optimizer, build_scheduler, clip_grad_norm_
from titan_vlm.parallel.context_parallel import (
    CPOptions,
    encode_images_over_cp,
    shard_batch,
    sync_broadcast_vision_grads,
)
from titan_vlm.parallel.tensor_parallel import TPOptions, gather_image_embeds_over_tp
from titan_vlm.parallel_dims import Mesh, ParallelDims

logger = logging.getLogger("titan_vlm")


class NonFiniteError(UserError):
    """A non-finite loss or gradient norm with training.on_nonfinite = "stop"."""


class EmptyBatchesError(UserError):
    """data.max_empty_steps steps in a row without a loss token."""


# FSDP2 warns when a wrapped module returns a view (nn.Linear on 3-D input does); it matters only
# for in-place ops on that output, which titan_vlm never does.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
# The HSDP mesh is sliced from the root by a flattened dim, torchtitan-style; torch says that
# spelling will change, which is for a later torch pin to follow.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def forward_backward(
    model: VLM,
    batch: Batch,
    mesh: Mesh,
    cp: CPOptions = CPOptions(),
    sum_image_grad: bool = True,
    tp: TPOptions = TPOptions(),
) -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
    """Forward and backward of one batch on this rank. Returns the global loss (mean over every
    text token of the global batch, identical on all ranks), the global text-token count, and
    this rank's layout.

    `sum_image_grad=False` is the negative-control switch of the parity tests; never in training.
    """
    # 1-2. The image embeddings of every image of the batch, whole on every CP rank (Replicate on
    # cp); in backward their gradient is summed over cp before the projector and ViT. This runs
    # even for a batch without images, so every rank enters the same collectives. With
    # image_embed_tp_shard they are [.., dim/tp] slices until they join the text.
    width = model.args.decoder.dim // mesh.tp.size() if tp.image_embed_shard else None
    embeds = encode_images_over_cp(
        model, batch.images, mesh.cp, cp.vision, sum_image_grad, embed_width=width
    )
    if tp.image_embed_shard:
        embeds = gather_image_embeds_over_tp(embeds, mesh.tp)
    # 3. Only the text is CP-sharded (head-tail per sample), with its positions and shifted labels.
    tokens, labels, layout = shard_batch(
        batch,
        mesh.cp,
        cp.comm_type,
        model.args.image_attention == "bidirectional",
        pad_to_multiple=mesh.tp.size() if tp.sequence_parallel else 1,
    )
    logits = model.decoder(tokens, layout.place_images(embeds), layout)
    # 4. Mean over the global batch's text tokens: count across dp and cp (not tp: its ranks hold
    # the same tokens), sum per rank.
    loss_group = mesh.job.get_group()
    ntokens = (labels != IGNORE_INDEX).sum()
    dist.all_reduce(ntokens, group=loss_group)
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    ) / ntokens.clamp(min=1)
    loss.backward()
    if cp.vision == "broadcast":
        sync_broadcast_vision_grads(model, mesh.cp)
    loss = loss.detach()
    dist.all_reduce(loss, group=loss_group)
    return loss, ntokens, layout


def train_step(
    model: VLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: Batch,
    mesh: Mesh,
    max_norm: float,
    cp: CPOptions = CPOptions(),
    sum_image_grad: bool = True,
    tp: TPOptions = TPOptions(),
) -> dict[str, float]:
    """One optimizer step. A non-finite loss or gradient norm (the same on every rank: both are
    reduced over the job) updates nothing: the optimizer does not step and "nonfinite" is 1; the
    caller stops or goes on (training.on_nonfinite). The lr schedule advances either way."""
    optimizer.zero_grad(set_to_none=True)
    loss, ntokens, layout = forward_backward(model, batch, mesh, cp, sum_image_grad, tp)
    grad_norm = clip_grad_norm_(list(model.parameters()), max_norm)
    lr = scheduler.get_last_lr()[0]
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return {
        "loss": loss.item(),
        "grad_norm": grad_norm.item(),
        "ntokens": int(ntokens),
        "lr": lr,
        "cp_balance": layout.balance(),
        "nonfinite": int(not finite),
    }


def check_same_batch(batch: Batch, rows_mesh: DeviceMesh, step: int) -> None:
    """The CP and TP ranks of a dp group read the same rows and must build the same batch. If a
    data error struck some of them only (say a transient read error on one image), they would
    wait in different collectives and hang; one small all-gather per step turns that into the
    same error on every rank instead."""
    if rows_mesh.size() == 1:
        return
    mine = torch.tensor(
        [batch.images.shape[0], int((batch.doc >= 0).sum()), int(batch.tokens.sum())],
        dtype=torch.long,
        device=batch.tokens.device,
    )
    everyone = mine.new_empty(rows_mesh.size() * mine.numel())
    dist.all_gather_into_tensor(everyone, mine, group=rows_mesh.get_group())
    everyone = everyone.view(rows_mesh.size(), -1)
    if not bool((everyone == everyone[0]).all()):
        raise RuntimeError(
            f"step {step}: the CP/TP ranks that share rows built different batches (images, "
            f"slots, token sum per rank: {everyone.tolist()}); a data error on some ranks only?"
        )


def describe_layout(layout: SeqLayout, row: int = 0) -> list[str]:
    """Human-readable: which CP rank holds which slots of one row."""
    images = layout.images.order[row]
    n_img = int((images >= 0).sum())
    docs = layout.slots("all").doc[row]
    text = sum(int((t.doc[row] >= 0).sum()) for t in layout.texts)
    lines = [
        f"row {row}: {len(torch.unique(docs[docs >= 0]))} sample(s), "
        f"{layout.image_counts[row]} image(s) "
        f"= {n_img} image slots, {text} text slots"
    ]
    for r, t in enumerate(layout.texts):
        where = t.order[row][t.order[row] >= 0].tolist()
        runs, start = [], None
        for i, pos in enumerate(where):
            if start is None:
                start = pos
            if i + 1 == len(where) or where[i + 1] != pos + 1:
                runs.append(f"[{start}, {pos + 1})")
                start = None
        lines.append(
            f"  cp rank {r}: all {n_img} image slots (replicated) + {len(where)} text slots "
            f"{' '.join(runs) or '-'}"
        )
    return lines


def _init_distributed() -> tuple[torch.device, int]:
    if "RANK" not in os.environ:  # plain `python -m titan_vlm.train`: a one-process group
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_rank()


def train(cfg: JobConfig) -> None:
    """Entry point under torchrun: validate, start the process group, build the mesh, train."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg, world_size)  # config errors surface before any collective
    dims.validate_model(cfg)
    validate_failure_keys(cfg)
    device, rank = _init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[titan_vlm] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    mesh = dims.build_mesh(device.type)
    logger.info(
        "mesh: dp_replicate=%d dp_shard=%d cp=%d tp=%d on %d %s ranks",
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        dims.tp,
        world_size,
        device.type,
    )
    run_training(cfg, mesh, device)
    dist.barrier()  # no rank tears down its groups while another still uses them
    dist.destroy_process_group()


def run_training(
    cfg: JobConfig, mesh: Mesh, device: torch.device, stop_after: int | None = None
) -> list[dict[str, float]]:
    """The training loop on an existing mesh. Returns the metrics of the steps it ran.
    `stop_after` ends the run after that step as a crash would (tests of resuming)."""
    t = cfg.training
    spec = get_model_spec(cfg.model.name)
    p = cfg.parallelism
    cp = CPOptions(comm_type=p.cp_comm_type, vision=p.cp_vision)
    dtype = torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32
    logger.info(
        "attention kernel: %s (model.attention_kernel=%s)",
        select_kernel(cfg.model.attention_kernel, device, dtype).name,
        cfg.model.attention_kernel,
    )
    tp = TPOptions(
        sequence_parallel=p.enable_sequence_parallel, image_embed_shard=p.image_embed_tp_shard
    )
    if mesh.tp.size() > 1:
        logger.info(
            "tensor parallel: %d ways; sequence parallel %s; image embeddings %s over tp",
            mesh.tp.size(),
            "on" if tp.sequence_parallel else "off",
            "sharded along the hidden dim" if tp.image_embed_shard else "replicated",
        )
    # built on the meta device, sharded, then each rank fills only its own shards
    model, args = build_model(spec, cfg, mesh, device)
    counts = param_counts(model)
    logger.info(
        "model %s: %s parameters (vision %s, projector %s, decoder %s)",
        cfg.model.hf_path or cfg.model.flavor,
        f"{sum(counts.values()):,}",
        f"{counts['vision']:,}",
        f"{counts['projector']:,}",
        f"{counts['decoder']:,}",
    )
    vision_shards = mesh.shards(mesh.fsdp_no_cp if cp.vision == "broadcast" else mesh.fsdp)
    decoder_shards = mesh.shards(mesh.fsdp)
    tp_note = f"; TP splits the matrices {mesh.tp.size()} ways more" if mesh.tp.size() > 1 else ""
    # measured on this rank's shards
    # (with TP, the replicated norms and ViT embeddings are not split)
    local_params = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
    )
    logger.info(
        "model state per rank: %.3f GiB (fp32 params, grads and AdamW moments; "
        "decoder sharded %d ways, "
        "vision %d ways%s)",
        STATE_BYTES_PER_PARAM * local_params / 2**30,
        decoder_shards,
        vision_shards,
        tp_note,
    )
    optimizer = build_optimizer(model, t)
    scheduler = build_scheduler(optimizer, t)
    checkpointer = None
    start = 0
    if cfg.checkpoint.enable:
        checkpointer = Checkpointer(
            cfg,
            model,
            optimizer,
            scheduler,
            mesh.world.get_group(),
            global_rows=mesh.dp.size() * t.local_batch_size,
        )
        start = checkpointer.resume()
        if start:
            logger.info("resumed from %s at step %d", checkpointer.folder / f"step-{start}", start)
        if start >= t.steps:
            logger.warning(
                "the latest checkpoint is at step %d >= training.steps=%d: nothing to train "
                "(raise training.steps to train on)",
                start,
                t.steps,
            )

    k = cfg.data.images_per_sample
    # Start-up warnings once (rank 0); batch-time ones once per dp rank (its rows are its own).
    data = build_dataset(
        cfg,
        args,
        *model_inputs(cfg),
        log_startup=dist.get_rank() == 0,
        log_batches=mesh.cp.get_local_rank() == 0 and mesh.tp.get_local_rank() == 0,
    )
    dp_rank, dp = mesh.dp.get_local_rank(), mesh.dp.size()
    first = data.batch(start, dp_rank, dp, t.local_batch_size)
    sp_multiple = mesh.tp.size() if tp.sequence_parallel else 1
    _, _, layout = shard_batch(
        first, mesh.cp, cp.comm_type, args.image_attention == "bidirectional", sp_multiple
    )
    logger.info("data: %s", data.describe())
    for line in describe_layout(layout):
        logger.info(line)
    if tp.sequence_parallel:
        local = layout.positions.shape[1]
        logger.info(
            "  sequence parallel: this CP rank's %d slots (padded to a multiple of tp) "
            "are split %d per "
            "tp rank between the TP regions",
            local,
            local // mesh.tp.size(),
        )
    if k and mesh.cp.size() > 1:
        where = {
            "replicate": "every CP rank encodes all of them",
            "broadcast": "CP rank 0 encodes them and broadcasts the embeddings",
            "shard": "each CP rank encodes about 1/cp of them and the embeddings are all-gathered",
        }[cp.vision]
        logger.info(
            "vision (cp_vision=%s): %d images in the first step's batch; %s",
            cp.vision,
            first.images.shape[0],
            where,
        )
    rows = dp * t.local_batch_size
    rank0 = dist.get_rank() == 0
    metrics = MetricsLogger(
        cfg.job.dump_folder, cfg.metrics.enable_tensorboard, enabled=rank0, resume_after=start
    )
    logger.info(
        "training %d steps, %d rows x %d slots per step; metrics -> %s",
        t.steps,
        rows,
        t.seq_len,
        cfg.job.dump_folder,
    )

    history = []
    counters = checkpointer.counters if checkpointer else {}
    # The distinct samples any dp rank dropped while building batches since step 1 (every rank
    # holds the same set), and the steps skipped for a non-finite loss or grad norm; both kept
    # in checkpoints.
    dropped = set(counters.get("data_dropped_samples", []))
    skipped = counters.get("nonfinite_skipped", 0)
    empty_since = None  # first step of the current run of steps without a loss token
    for step in range(start + 1, t.steps + 1):
        begin = time.perf_counter()
        batch = data.batch(step - 1, dp_rank, dp, t.local_batch_size)
        new_drops = sorted(data.dropped - dropped)  # samples this rank dropped, new to the job
        # The global batch's model FLOPs and new drops: one all-reduce (exact as float64).
        sums = torch.tensor(
            [spec.flops(args, batch), len(new_drops)],
            dtype=torch.float64,
            device=device,
        )
        batch = batch.to(device)
        check_same_batch(batch, mesh.rows, step)
        stats = train_step(model, optimizer, scheduler, batch, mesh, t.max_norm, cp, tp=tp)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - begin
        # The worst rank's peak memory, and whether any rank was asked to stop (SIGINT/SIGTERM)
        peak_stop = torch.tensor([peak_memory_gib(device), STOP.requested], device=device)
        dist.all_reduce(peak_stop, op=dist.ReduceOp.MAX, group=mesh.world.get_group())
        peak, stop = peak_stop[0], bool(peak_stop[1])
        dist.all_reduce(sums, group=mesh.dp.get_group())
        if sums[1]:  # some dp rank dropped a sample new to the job: everyone learns which
            everyone: list = [None] * dp
            dist.all_gather_object(everyone, new_drops, group=mesh.dp.get_group())
            dropped.update(i for ids in everyone for i in ids)
        nonfinite = stats.pop("nonfinite")
        if nonfinite and t.on_nonfinite == "stop":  # the same on every rank: loss and norm are
            raise NonFiniteError(  # reduced over the job
                f"step {step}: loss {stats['loss']}, grad_norm {stats['grad_norm']}: not finite; "
                "stopped before the update (training.on_nonfinite='stop'; 'skip' skips such "
                "steps); the checkpoints hold only finite steps"
            )
        if nonfinite:
            skipped += 1
            logger.warning(
                "step %d: loss %s, grad_norm %s: not finite; step skipped, nothing updated "
                "(training.on_nonfinite='skip'; %d skipped so far)",
                step,
                stats["loss"],
                stats["grad_norm"],
                skipped,
            )
        record = {
            **stats,
            "tokens_per_sec": rows * t.seq_len / elapsed,
            "tflops_per_sec": float(sums[0]) / elapsed / 1e12,
            "step_time_s": elapsed,
            "peak_memory_gib": float(peak),
            "data_bad_samples": data.bad_at_startup + len(dropped),
            "data_truncated": data.truncated,
            "nonfinite_skipped": skipped,
        }
        # metrics.jsonl and TensorBoard get every step; stdout every log_freq steps and the last
        metrics.log(step, record, echo=step % cfg.metrics.log_freq == 0 or step == t.steps)
        history.append({"step": step, **record})
        if stats["ntokens"] == 0:
            empty_since = step if empty_since is None else empty_since
            if step - empty_since + 1 >= cfg.data.max_empty_steps:
                raise EmptyBatchesError(
                    f"steps {empty_since}-{step} carried no loss token (every sample of their "
                    f"batches was bad or empty: see the data: lines above; data.max_empty_steps="
                    f"{cfg.data.max_empty_steps})"
                )
        else:
            empty_since = None
        if checkpointer and (step % cfg.checkpoint.interval == 0 or step == t.steps or stop):
            counters.update(data_dropped_samples=sorted(dropped), nonfinite_skipped=skipped)
            logger.info("checkpoint saved: %s", checkpointer.save(step))
        if stop:
            logger.info("stopped after step %d on a signal (SIGINT / SIGTERM)", step)
            break
        if step == stop_after:
            break
    metrics.close()
    logger.info("done")
    return history


def main(argv: list[str] | None = None) -> None:
    """A worker under torchrun (README: When things go wrong): it exits when torchrun is gone,
    stops at a step boundary on SIGINT / SIGTERM, and reports a UserError in one line."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
        STOP.install()
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        train(cfg)
    except UserError as e:
        sys.exit(report_user_error(e))


if __name__ == "__main__":
    main()
