"""The training job on an existing mesh, torchtitan's shape:

    trainer = Trainer(cfg, mesh, device)   model (built on meta, sharded, each rank fills its
                                           own shards), optimizer, lr schedule, checkpointer
                                           (resumes from the newest usable checkpoint), data,
                                           metrics; logs the setup
    trainer.train()                        the loop: step, non-finite policy, validation,
                                           metrics, empty batches, checkpoint cadence (and
                                           async saves' commits), profiler, signals

The trainer is DCP `Stateful`: `state_dict()` holds what it needs to go on beyond the model and
the optimizer (the step, which is the data position; the lr schedule; the RNG; the counters the
metrics report), and the checkpointer saves it through DCP with them (checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from titan_vlm.checkpoint import Checkpointer, RunStart, load_initial_weights, run_start
from titan_vlm.config import JobConfig
from titan_vlm.data import build_dataset
from titan_vlm.data.batch import SlotData
from titan_vlm.data.dataset import Dataset, Position
from titan_vlm.data.hf_processor import HFProcessor
from titan_vlm.data.image_batch import ImageRule, num_images
from titan_vlm.data.index_cache import IndexCache, code_digest, index_folder
from titan_vlm.data.loader import BatchLoader
from titan_vlm.data.shared_pass import GroupShare
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.distributed import dist_max, dist_sum, local_tensor
from titan_vlm.errors import UserError
from titan_vlm.kernels import select_kernel
from titan_vlm.launch import STOP
from titan_vlm.layout import SeqLayout, Slots
from titan_vlm.metrics import MetricsLogger, peak_memory_gib
from titan_vlm.models.accounting import (
    STATE_BYTES_PER_PARAM,
    active_params,
    moe_summary,
    param_counts,
)
from titan_vlm.models.build import build_model
from titan_vlm.models.registry import model_spec
from titan_vlm.optim import (
    accumulation_steps,
    build_optimizer,
    build_scheduler,
    freeze,
    frozen_groups,
    param_group_keys,
)
from titan_vlm.parallel.context_parallel import CPContext, CPOptions, shard_batch
from titan_vlm.parallel.pipeline import Pipeline, bubble, stage_plan
from titan_vlm.parallel.tensor_parallel import TPOptions
from titan_vlm.parallel_dims import Mesh
from titan_vlm.profiling import StepProfiler
from titan_vlm.step import check_same_batch, train_step, validation_sums

if TYPE_CHECKING:
    from titan_vlm.data.hf_processor import HFProcessor
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

    ModelInputs = tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]  # ModelSpec.inputs

logger = logging.getLogger("titan_vlm")

RECOMPILE_LIMIT = 8  # torch._dynamo.config.recompile_limit's default
# a step that waited longer than this share of its time for its batch is logged as data-bound
DATA_BOUND = 0.2


class NonFiniteError(UserError):
    """A non-finite loss or gradient norm with training.on_nonfinite = "stop"."""


class EmptyBatchesError(UserError):
    """data.max_empty_steps steps in a row without a loss token."""


@dataclass
class StepResult:
    """One step as the loop sees it: train_step's stats and the job-wide reductions after it."""

    stats: dict[str, float]  # train_step's (loss, grad_norm, ntokens, lr, cp_balance, nonfinite)
    elapsed_s: float
    data_wait_s: float  # how long the step waited for its batch (the slowest rank's)
    flops: float  # the global batch's model FLOPs
    peak_memory_gib: float  # the worst rank's
    stop: bool  # some rank was asked to stop (SIGINT / SIGTERM)


class Trainer(Stateful):
    """A training job on `mesh` (every rank builds one and calls `train()`)."""

    def __init__(self, cfg: JobConfig, mesh: Mesh, device: torch.device):
        t, p = cfg.training, cfg.parallelism
        self.cfg, self.mesh, self.device = cfg, mesh, device
        # microbatches of local_batch_size rows per step (training.global_batch_size)
        self.accumulation = accumulation_steps(t, mesh.dp.size())
        self.global_rows = mesh.dp.size() * t.local_batch_size * self.accumulation  # a step's
        self.files = cfg.data.dataset != "synthetic" or bool(cfg.data.mixture)  # dataset files
        # where the run starts (checkpoint.py run_start), before the model is built: a resume
        # builds the model, tokenizer and processor from the checkpoint's copies of its sources
        # (`sources`) and fills the weights from the checkpoint, not from a Hugging Face folder
        self.start: RunStart | None = None
        if cfg.checkpoint.enable:
            self.start = run_start(cfg, mesh.world.get_group(), self.global_rows)
        resuming = self.start is not None and self.start.step_dir is not None
        self.sources = self.start.sources if self.start is not None else cfg
        self.spec = model_spec(self.sources)
        self.tp = TPOptions.from_config(p)
        self.log_parallelism()
        self.model, self.args = build_model(
            self.spec, self.sources, mesh, device, fill=not resuming
        )
        # the cost model's weights come from the architecture (ModelSpec.layout_cost)
        self.cp = CPOptions.from_config(p, self.spec.layout_cost(self.args))
        # pipeline parallelism: this rank's stages of the model and their schedule
        self.pipeline = self.build_pipeline()
        # training.freeze: before the optimizer, which then holds no state for them
        freeze(self.model, self.spec.group_of, frozen_groups(t))
        self.log_model()
        self.optimizer = build_optimizer(self.model, t, self.spec.group_of, self.group_keys())
        self.scheduler = build_scheduler(self.optimizer, t)
        # The trainer's own state (state_dict): the step (the data position), and the counters
        # the metrics report: the distinct samples any dp rank dropped while building batches
        # since step 1 (every rank holds the same set) and the steps skipped for a non-finite
        # loss or grad norm.
        self.step = 0
        self.dropped: set[int] = set()
        # where the data stands in each dataset file (a resumed run's; what a save keeps)
        self.data_positions: list[Position] = []
        self.nonfinite_skipped = 0
        self.empty_since: int | None = None  # first step of the current run without a loss token
        self.checkpointer: Checkpointer | None = None
        if self.start is not None:
            self.checkpointer = Checkpointer(
                cfg, self.model, self.optimizer, self, mesh.world.get_group(), self.start
            )
            self.resume(self.checkpointer)
        if self.step == 0 and cfg.checkpoint.initial_load_path:
            step_dir = load_initial_weights(
                self.model, cfg.checkpoint.initial_load_path, mesh.world.get_group()
            )
            logger.info(
                "model weights from %s (checkpoint.initial_load_path); the optimizer, the lr "
                "schedule and the step start fresh",
                step_dir,
            )
        self.dp_rank, self.dp = mesh.dp.get_local_rank(), mesh.dp.size()
        rule, slot_data = self.spec.data_rule(self.args, self.sources)
        inputs = self.spec.inputs(self.sources)  # the tokenizer and processor, read once
        if self.data_positions and self.start is not None and self.start.changed:
            logger.warning(
                "the data's position in the checkpoint is not used (a key that must match "
                "changed: checkpoint.allow_config_change): dataset files are indexed from the "
                "window of row 0"
            )
            self.data_positions = []
        self.data = self.dataset(cfg, inputs, rule, slot_data, self.data_positions)
        self.log_data()
        # each step's rows on this dp rank: `accumulation` microbatches of local_batch_size rows
        self.loader = BatchLoader(
            self.data,
            self.dp_rank,
            self.dp,
            t.local_batch_size * self.accumulation,
            cfg.data.num_workers,
            cfg.data.prefetch,
            t.steps,
            device,
        )
        self.validation: Dataset | None = None
        if cfg.validation.enable:
            self.validation = self.build_validation_data(inputs, rule, slot_data)
            if cfg.compile.enable:
                # the compiled blocks build their graphs again under no_grad (grad mode is in
                # dynamo's guards): twice dynamo's default budget of graphs per block
                torch._dynamo.config.recompile_limit = max(
                    torch._dynamo.config.recompile_limit, 2 * RECOMPILE_LIMIT
                )
        self.metrics = MetricsLogger(
            cfg.job.dump_folder,
            cfg.metrics.enable_tensorboard,
            enabled=dist.get_rank() == 0,
            resume_after=self.step,
            wandb_config=dataclasses.asdict(cfg) if cfg.metrics.enable_wandb else None,
        )
        self.history: list[dict[str, float]] = []  # every step this run trained, with its metrics

    def train(self) -> list[dict[str, float]]:
        """Train from the resumed step to training.steps, or until a signal; returns the metrics
        of the steps it ran."""
        t = self.cfg.training
        accumulate = (
            f" ({self.accumulation} microbatches of {t.local_batch_size} rows per dp rank, "
            "gradients accumulated)"
            if self.accumulation > 1
            else ""
        )
        logger.info(
            "training %d steps, %d rows x %d slots per step%s; metrics -> %s",
            t.steps,
            self.dp * t.local_batch_size * self.accumulation,
            t.seq_len,
            accumulate,
            self.cfg.job.dump_folder,
        )
        profiler = StepProfiler(
            self.cfg.profiling, self.cfg.job.dump_folder, dist.get_rank(), self.device, self.step
        )
        try:
            # the loader workers start building from the first step's batch on: their start-up
            # is not the first step's wait
            self.loader.start(self.step)
            with profiler:
                for step in range(self.step + 1, t.steps + 1):
                    result = self.train_one_step(step)
                    self.apply_nonfinite_policy(step, result.stats)
                    if self.validation is not None and step % self.cfg.validation.freq == 0:
                        result.stats["validation_loss"] = self.validate(step, self.validation)
                    self.log_metrics(step, result)
                    self.check_empty_batches(step, int(result.stats["ntokens"]))
                    self.checkpoint_if_due(step, result.stop)
                    profiler.step(step)
                    if result.stop:
                        logger.info("stopped after step %d on a signal (SIGINT / SIGTERM)", step)
                        break
        except (NonFiniteError, EmptyBatchesError):
            # raised on every rank alike, so the collective commit of a save still being written
            # (a good checkpoint from before the failure) can run first
            self.finish_checkpoints()
            raise
        finally:
            self.loader.close()
            self.metrics.close()
        self.finish_checkpoints()
        logger.info("done")
        return self.history

    def finish_checkpoints(self) -> None:
        """Commit a save still being written in the background, free what async saves hold."""
        if self.checkpointer is not None:
            self.log_saved(self.checkpointer.wait())
            self.checkpointer.close()

    # ---- the loop's jobs ----

    def train_one_step(self, step: int) -> StepResult:
        """Read step's batch, train on it, and reduce over the job what every rank must know:
        the global batch's FLOPs and new drops (dp), the worst peak memory and any stop request
        (world)."""
        t = self.cfg.training
        begin = time.perf_counter()
        host, batch = self.loader.batch(step - 1)
        new_drops = sorted(self.data.dropped - self.dropped)  # this rank's, new to the job
        waited = time.perf_counter() - begin  # the batch built (or waited for) and copied
        check_same_batch(batch, self.mesh.rows, step)
        stats, layouts = train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            self.mesh,
            t.max_norm,
            self.cp,
            self.tp,
            self.pipeline.n_microbatches if self.pipeline is not None else self.accumulation,
            self.pipeline,
        )
        micro = host.num_rows // len(layouts)  # the rows of each layout's microbatch
        flops = sum(
            self.spec.flops(self.args, host.rows(k * micro, (k + 1) * micro), layout)
            for k, layout in enumerate(layouts)
        )
        # The global batch's model FLOPs and new drops: one all-reduce (exact as float64).
        sums = torch.tensor([flops, len(new_drops)], dtype=torch.float64, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - begin
        peak_stop = torch.tensor(
            [peak_memory_gib(self.device), STOP.requested, waited], device=self.device
        )
        dist_max(peak_stop, self.mesh.world.get_group())
        dist_sum(sums, self.mesh.dp.get_group())
        if sums[1]:  # some dp rank dropped a sample new to the job: everyone learns which
            everyone: list[list[int] | None] = [None] * self.dp
            dist.all_gather_object(everyone, new_drops, group=self.mesh.dp.get_group())
            self.dropped.update(i for ids in everyone for i in ids or ())
        self.step = step
        return StepResult(
            stats,
            elapsed,
            float(peak_stop[2]),
            float(sums[0]),
            float(peak_stop[0]),
            bool(peak_stop[1]),
        )

    def validate(self, step: int, data: Dataset) -> float:
        """validation_loss: the mean loss over the loss tokens of validation.steps batches of the
        validation data (the same ones every time), forward only, under the training's layout;
        the same on every rank."""
        v, rows = self.cfg.validation, self.cfg.training.local_batch_size
        begin = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k in range(v.steps):
            batch = data.batch(k, self.dp_rank, self.dp, rows).to(self.device)
            check_same_batch(batch, self.mesh.rows, step)
            sums += validation_sums(self.model, batch, self.mesh, self.cp, self.tp, self.pipeline)
        # no loss token in the held-out rows: no loss to report (NaN), not a perfect 0
        loss = float(sums[0] / sums[1]) if sums[1] else float("nan")
        logger.info(
            "validation at step %d: loss %.4f over %d loss tokens (%d batches of %d rows), %.1f s",
            step,
            loss,
            int(sums[1]),
            v.steps,
            rows * self.dp,
            time.perf_counter() - begin,
        )
        return loss

    def apply_nonfinite_policy(self, step: int, stats: dict[str, float]) -> None:
        """training.on_nonfinite for a step whose loss or grad norm was not finite (the same on
        every rank: both are reduced over the job): "stop" raises, "skip" counts and warns (the
        step updated nothing). Takes "nonfinite" out of `stats`."""
        if not stats.pop("nonfinite"):
            return
        if self.cfg.training.on_nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: loss {stats['loss']}, grad_norm {stats['grad_norm']}: not finite; "
                "stopped before the update (training.on_nonfinite='stop'; 'skip' skips such "
                "steps); the checkpoints hold only finite steps"
            )
        self.nonfinite_skipped += 1
        logger.warning(
            "step %d: loss %s, grad_norm %s: not finite; step skipped, nothing updated "
            "(training.on_nonfinite='skip'; %d skipped so far)",
            step,
            stats["loss"],
            stats["grad_norm"],
            self.nonfinite_skipped,
        )

    def log_metrics(self, step: int, result: StepResult) -> None:
        """metrics.jsonl and TensorBoard get every step; stdout every log_freq steps and the
        last."""
        t = self.cfg.training
        record = {
            **result.stats,
            "tokens_per_sec": self.dp
            * t.local_batch_size
            * self.accumulation
            * t.seq_len
            / result.elapsed_s,
            "tflops_per_sec": result.flops / result.elapsed_s / 1e12,
            "step_time_s": result.elapsed_s,
            "data_wait_s": result.data_wait_s,
            "peak_memory_gib": result.peak_memory_gib,
            "data_bad_samples": self.data.bad_samples(self.trained_rows(step)) + len(self.dropped),
            "data_truncated": self.data.truncated_samples(self.trained_rows(step)),
            "nonfinite_skipped": self.nonfinite_skipped,
        }
        echo = step % self.cfg.metrics.log_freq == 0 or step == t.steps
        self.metrics.log(step, record, echo=echo)
        # rank 0's line, as the metrics' (data_wait_s is the slowest rank's on every rank)
        bound = result.data_wait_s > DATA_BOUND * result.elapsed_s
        if echo and bound and dist.get_rank() == 0:
            workers = self.cfg.data.num_workers
            why = (
                f"its {workers} loader workers per rank do not keep up: more data.num_workers"
                if workers
                else "data.num_workers=0 builds each batch in the training process"
            )
            logger.warning(
                "step %d waited %.3f s of its %.3f s (%.0f%%) for its batch: data-bound (%s)",
                step,
                result.data_wait_s,
                result.elapsed_s,
                100 * result.data_wait_s / result.elapsed_s,
                why,
            )
        self.history.append({"step": step, **record})

    def check_empty_batches(self, step: int, ntokens: int) -> None:
        """data.max_empty_steps steps in a row without a loss token stop the run."""
        if ntokens:
            self.empty_since = None
            return
        self.empty_since = step if self.empty_since is None else self.empty_since
        if step - self.empty_since + 1 >= self.cfg.data.max_empty_steps:
            raise EmptyBatchesError(
                f"steps {self.empty_since}-{step} carried no loss token (every sample of their "
                f"batches was bad or empty: see the data: lines above; data.max_empty_steps="
                f"{self.cfg.data.max_empty_steps})"
            )

    def checkpoint_if_due(self, step: int, stop: bool) -> None:
        """Save every checkpoint.interval steps, after the last step, and before a signal
        stops the run."""
        if self.checkpointer is None:
            return
        self.log_saved(self.checkpointer.poll())  # an async save whose files are all written
        if step % self.cfg.checkpoint.interval == 0 or step == self.cfg.training.steps or stop:
            # where the next step's rows lie in the data (state_dict: what a resume builds from)
            self.data_positions = self.data.positions(self.trained_rows(step))
            # a stop writes synchronously: the process is about to end, nothing to overlap
            step_dir = self.checkpointer.save(step, blocking=stop)
            if step_dir is None:
                logger.info(
                    "checkpoint of step %d: being written in the background "
                    "(checkpoint.async_mode=%s)",
                    step,
                    self.cfg.checkpoint.async_mode,
                )
            self.log_saved(step_dir)

    @staticmethod
    def log_saved(step_dir: Path | None) -> None:
        if step_dir is not None:
            logger.info("checkpoint saved: %s", step_dir)

    # ---- DCP Stateful: what the trainer saves beside the model and the optimizer ----

    def trained_rows(self, step: int) -> int:
        """The global rows steps 1 .. step train on (the next step's first row)."""
        return step * self.global_rows

    def state_dict(self) -> dict[str, Any]:
        """The step (the data position: the data is a function of it), where that position lies
        in each dataset file (the window a resumed run indexes from: data/jsonl.py), the lr
        schedule, the RNG and the counters. The RNG state is the same on every rank (each
        process starts from torch's fixed default seed, a resume gives every rank the saved one,
        and training draws nothing from it), so DCP writing one rank's copy loses nothing."""
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "data_dropped_samples": sorted(self.dropped),
            "nonfinite_skipped": self.nonfinite_skipped,
        } | (
            # only with dataset files (the built-in data's rows need no position, and a
            # checkpoint of a titan_vlm before positions resumes such a run unchanged)
            {"data_positions": [list(p) for p in self.data_positions]} if self.files else {}
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.scheduler.load_state_dict(state_dict["scheduler"])
        torch.set_rng_state(state_dict["rng"])
        self.dropped = set(state_dict["data_dropped_samples"])
        self.data_positions = [Position(*p) for p in state_dict.get("data_positions", [])]
        self.nonfinite_skipped = int(state_dict["nonfinite_skipped"])

    # ---- set-up ----

    def resume(self, checkpointer: Checkpointer) -> None:
        """Load the newest usable checkpoint, if any, into the model, optimizer and trainer."""
        step_dir = checkpointer.resume()
        if step_dir is not None:
            copies = " (the model, tokenizer and processor from its copies of the sources)"
            copied = self.start is not None and self.start.copied
            logger.info(
                "resumed from %s at step %d%s", step_dir, self.step, copies if copied else ""
            )
        if self.step >= self.cfg.training.steps and dist.get_rank() == 0:  # once, not per rank
            logger.warning(
                "the latest checkpoint is at step %d >= training.steps=%d: nothing to train "
                "(raise training.steps to train on)",
                self.step,
                self.cfg.training.steps,
            )

    def dataset(
        self,
        cfg: JobConfig,
        inputs: ModelInputs,
        rule: ImageRule | None,
        slot_data: SlotData | None,
        positions: list[Position] | None = None,
    ) -> Dataset:
        """The dataset `cfg`'s data keys name, read with the model's inputs (tokenizer, processor)
        and its image rule, from `positions` (a resumed run's: Trainer.state_dict). A file's
        window passes are split over every rank of the job (data/shared_pass.py). The passes'
        warnings once (rank 0); batch-time ones once per dp rank (its rows are its own)."""
        world = self.mesh.world.get_group()
        return build_dataset(
            cfg,
            self.args,
            *inputs,
            log_startup=dist.get_rank() == 0,
            log_batches=all(
                m.get_local_rank() == 0 for m in (self.mesh.pp, self.mesh.cp, self.mesh.tp)
            ),
            rule=rule,
            slot_data=slot_data,
            share=GroupShare(world) if dist.get_world_size(world) > 1 else None,
            cache=index_cache(cfg) if cfg.data.cache_index else None,
            positions=positions or None,
        )

    def build_validation_data(
        self, inputs: ModelInputs, rule: ImageRule | None, slot_data: SlotData | None
    ) -> Dataset:
        """validation.dataset with the training's model inputs: a file in its order, or the
        synthetic data with the held-out seed training.seed + 1."""
        cfg, v = self.cfg, self.cfg.validation
        synthetic = v.dataset == "synthetic"
        held_out = dataclasses.replace(
            cfg,
            data=dataclasses.replace(cfg.data, dataset=v.dataset, mixture="", shuffle=False),
            training=dataclasses.replace(
                cfg.training, seed=cfg.training.seed + 1 if synthetic else cfg.training.seed
            ),
        )
        data = self.dataset(held_out, inputs, rule, slot_data)
        logger.info(
            "validation every %d steps: %d batches of %d rows x %d slots; data: %s",
            v.freq,
            v.steps,
            self.dp * cfg.training.local_batch_size,
            cfg.training.seq_len,
            data.describe(),
        )
        return data

    def group_keys(self) -> list[tuple[str, bool]] | None:
        """Under pipeline parallelism, the whole model's optimizer param groups (each rank holds
        some: every rank makes them all, in the whole model's order, the stages in rank order);
        else None (the model's own)."""
        if self.pipeline is None:
            return None
        mine = param_group_keys(self.model, self.spec.group_of)
        every: list[list[tuple[str, bool]] | None] = [None] * self.mesh.pp.size()
        dist.all_gather_object(every, mine, group=self.mesh.pp.get_group())
        return list(dict.fromkeys((g, d) for keys in every for g, d in keys or []))

    def build_pipeline(self) -> Pipeline | None:
        """Under pipeline parallelism (parallelism.pipeline_parallel_degree > 1), this rank's
        stages of the model (pruned by build_model) and the schedule over a step's microbatches,
        logged; else None."""
        p, t = self.cfg.parallelism, self.cfg.training
        plan = stage_plan(self.cfg, self.mesh.pp, self.model, self.spec.layout_cost(self.args))
        if plan is None:
            return None
        rows = t.local_batch_size * self.accumulation
        size = p.pipeline_parallel_microbatch_size
        pipeline = Pipeline(
            self.model,
            plan,
            self.mesh.pp.get_group(),
            p.pipeline_parallel_schedule,
            rows // size,
            size,
            t.seq_len,
            self.device,
            CPContext(self.mesh.cp, self.cp, self.mesh.tp, self.tp),
            torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32,
            self.mesh.job.get_group(),
        )
        logger.info(
            "pipeline parallel: %d ranks x %d stage(s), %s over %d microbatches of %d row(s) a "
            "step, modelled bubble %.0f%%; layers %s; %s",
            plan.degree,
            plan.per_rank,
            p.pipeline_parallel_schedule,
            rows // size,
            size,
            100
            * bubble(p.pipeline_parallel_schedule, plan.num_stages, plan.per_rank, rows // size),
            "as set (parallelism.pipeline_parallel_stage_layers)"
            if p.pipeline_parallel_stage_layers.strip()
            else "split by the cost model",
            plan.describe(),
        )
        if self.model.decoder.args.moe is not None and size != t.local_batch_size:
            logger.warning(
                "pipeline parallel: the load-balancing loss is each microbatch's (%d row(s)), "
                "without stages each microstep's (training.local_batch_size=%d rows): set "
                "parallelism.pipeline_parallel_microbatch_size=%d for the objective of the run "
                "without stages (parallel/pipeline.py Balance)",
                size,
                t.local_batch_size,
                t.local_batch_size,
            )
        return pipeline

    def log_parallelism(self) -> None:
        """The attention kernel, and tensor and expert parallelism when there is some."""
        cfg, mesh = self.cfg, self.mesh
        dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
        logger.info(
            "attention kernel: %s (model.attention_kernel=%s)",
            select_kernel(self.cfg.model.attention_kernel, self.device, dtype).name,
            cfg.model.attention_kernel,
        )
        if mesh.tp.size() > 1:
            logger.info(
                "tensor parallel: %d ways; sequence parallel %s; image embeddings %s over tp",
                mesh.tp.size(),
                "on" if self.tp.sequence_parallel else "off",
                "sharded along the hidden dim" if self.tp.image_embed_shard else "replicated",
            )
        if mesh.ep is not None and mesh.expert_fsdp is not None:
            more = mesh.shards(mesh.expert_fsdp)
            logger.info(
                "expert parallel: %d ways (consecutive ranks of dp_shard x cp): each rank holds "
                "1/%d of every sparse layer's experts, tokens travel to them by all-to-all; %s",
                mesh.ep.size(),
                mesh.ep.size(),
                f"FSDP shards them {more} ways more" if more > 1 else "no further FSDP sharding",
            )

    def log_model(self) -> None:
        """Parameter counts, and the model state this rank holds."""
        mesh = self.mesh
        counts, active = param_counts(self.model), active_params(self.model)
        if self.pipeline is not None:  # a tied embedding's last-stage copy: the first counts it
            held_twice = sum(p.numel() for p in self.pipeline.copies())
            counts["decoder"] -= held_twice
            active -= held_twice
        if mesh.pp.size() > 1:  # each rank holds its stages' parameters: the model's are summed
            every: list[dict[str, int] | None] = [None] * mesh.pp.size()
            dist.all_gather_object(every, counts, group=mesh.pp.get_group())
            counts = {}
            for theirs in every:
                for part, n in (theirs or {}).items():
                    counts[part] = counts.get(part, 0) + n
        total = sum(counts.values())
        if mesh.pp.size() > 1:
            active = int(dist_sum(torch.tensor(active, device=self.device), mesh.pp.get_group()))
        logger.info(
            "model %s %s: %s parameters (%s)%s",
            self.spec.name,
            self.cfg.model.hf_path or self.cfg.model.flavor,
            f"{total:,}",
            ", ".join(f"{part} {n:,}" for part, n in counts.items()),
            f"; {active:,} active per token (top-k of the experts)" if active < total else "",
        )
        if moe_summary(self.model, self.device):
            logger.info("%s", moe_summary(self.model, self.device))
        vision_fsdp = mesh.fsdp_no_cp if self.cp.vision == "broadcast" else mesh.fsdp
        tp_note = (
            f"; TP splits the matrices {mesh.tp.size()} ways more" if mesh.tp.size() > 1 else ""
        )
        # measured on this rank's shards (with TP, the replicated norms and ViT embeddings are
        # not split); a frozen parameter (training.freeze) holds its fp32 value only
        params = list(self.model.parameters())
        trained = sum(local_tensor(p).numel() for p in params if p.requires_grad)
        frozen = sum(local_tensor(p).numel() for p in params if not p.requires_grad)
        logger.info(
            "model state per rank: %.3f GiB (fp32 params, grads and AdamW moments; "
            "decoder sharded %d ways, "
            "vision %d ways%s)",
            (STATE_BYTES_PER_PARAM * trained + 4 * frozen) / 2**30,
            mesh.shards(mesh.fsdp),
            mesh.shards(vision_fsdp),
            tp_note,
        )
        groups = sorted(frozen_groups(self.cfg.training))
        if groups:
            total = sum(p.numel() for p in params if not p.requires_grad)
            logger.info(
                "frozen (training.freeze): %s, %s parameters: no gradient, no optimizer state",
                ", ".join(groups),
                f"{total:,}",
            )

    def log_data(self) -> None:
        """The data, and who holds which slots of the first batch this run trains on."""
        t, mesh = self.cfg.training, self.mesh
        rows = t.local_batch_size * self.accumulation  # the step's rows on this dp rank
        first = self.data.batch(self.step, self.dp_rank, self.dp, rows).rows(0, t.local_batch_size)
        sp_multiple = mesh.tp.size() if self.tp.sequence_parallel else 1
        _, _, layout = shard_batch(
            first, mesh.cp, self.cp, self.model.bidirectional_images, sp_multiple
        )
        logger.info("data: %s", self.data.describe())
        joined = self.cp.sample_placement == "auto" and mesh.cp.size() > 1
        name = f"rows 0-{first.num_rows - 1} placed as one" if joined else "row 0"
        for line in describe_layout(layout, name=name):
            logger.info(line)
        if mesh.cp.size() > 1:
            logger.info(
                "cp placement (parallelism.cp_sample_placement=%s, cp_image_tokens=%s): %d "
                "sample(s) split, %d kept whole on one rank; split samples' images: %d "
                "replicated, %d sharded; local slots per rank %s; cp_balance %.3f (max/mean "
                "modelled cost), cp_padding %.3f",
                self.cp.sample_placement,
                self.cp.image_tokens,
                layout.split_samples(),
                sum(layout.kept_samples()),
                layout.replicated_images(),
                layout.sharded_images(),
                layout.rank_slots(),
                layout.balance(),
                layout.padding(),
            )
        if self.tp.sequence_parallel:
            local = layout.positions.shape[1]
            logger.info(
                "  sequence parallel: this CP rank's %d slots (padded to a multiple of tp) "
                "are split %d per "
                "tp rank between the TP regions",
                local,
                local // mesh.tp.size(),
            )
        if self.cfg.data.images_per_sample and mesh.cp.size() > 1:
            where = {
                "replicate": "every CP rank encodes all of them",
                "broadcast": "CP rank 0 encodes them and broadcasts the embeddings",
                "shard": "each CP rank encodes about 1/cp of them and the embeddings are "
                "all-gathered",
            }[self.cp.vision]
            logger.info(
                "vision (cp_vision=%s): %d images in the first step's batch; %s",
                self.cp.vision,
                num_images(first.images),
                where,
            )


def index_cache(cfg: JobConfig) -> IndexCache:
    """Where the data's record spans are kept between runs (data.cache_index), and what of this
    run decides them besides the files: titan_vlm's code."""
    return IndexCache(index_folder(cfg.job.dump_folder), {"code": code_digest()})


def _runs(positions: list[int]) -> str:
    """Row positions as half-open runs: "[3, 7) [9, 10)"."""
    runs, start = [], None
    for i, pos in enumerate(positions):
        if start is None:
            start = pos
        if i + 1 == len(positions) or positions[i + 1] != pos + 1:
            runs.append(f"[{start}, {pos + 1})")
            start = None
    return " ".join(runs) or "-"


def describe_layout(layout: SeqLayout, row: int = 0, name: str | None = None) -> list[str]:
    """Human-readable: which CP rank holds which slots of one row (`name`: what to call it)."""
    ranks = range(len(layout.texts))
    every = Slots.cat([layout.images, *layout.texts, *layout.kept])
    docs, real = every.doc[row], every.doc[row] >= 0
    n_img = int((layout.images.order[row] >= 0).sum())
    images = int((every.image[row] >= 0).sum())
    lines = [
        f"{name or f'row {row}'}: {len(torch.unique(docs[real]))} sample(s), "
        f"{layout.image_counts[row]} image(s) "
        f"= {images} image slots, {int(real.sum()) - images} text slots"
    ]
    for r in ranks:
        split = layout.texts[r].order[row]
        where = split[split >= 0].tolist()
        parts = []
        if n_img or where:
            parts.append(
                f"{n_img} image slots (replicated) + {len(where)} text slots of split samples "
                f"{_runs(where)}"
            )
        kept = layout.kept[r]
        held = kept.doc[row] >= 0
        if bool(held.any()):
            mine = kept.order[row][held].tolist()
            kept_img = int((kept.image[row] >= 0).sum())
            parts.append(
                f"{len(torch.unique(kept.doc[row][held]))} whole sample(s): {kept_img} image + "
                f"{len(mine) - kept_img} text slots {_runs(mine)}"
            )
        lines.append(f"  cp rank {r}: " + ("; ".join(parts) or "nothing"))
    return lines
