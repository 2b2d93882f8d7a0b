"""Checkpoints with torch.distributed.checkpoint (DCP): save, verify, resume, reshard, export.

<checkpoint.folder>/step-<N>/   one DCP checkpoint: the model's and the optimizer's sharded state
                               and the trainer's (trainer.py: step, lr scheduler, RNG, counters;
                               DCP `Stateful`), each rank writing its own shards and .metadata
                               indexing them; plus config.json (the JobConfig that wrote it),
                               facts.json (what a resume must match beyond the config:
                               resume_config.py) and manifest.json (size and SHA-256 of every
                               other file of the folder)
<checkpoint.folder>/latest     the step of the newest complete checkpoint

A checkpoint is complete when its manifest.json exists: it is written (write, then atomic
rename) after every rank has finished writing, and `latest` moves after it. Resume verifies the
newest checkpoint's files against its manifest; a checkpoint that fails (a missing, truncated or
overwritten file, no manifest, a garbage `latest`) is passed over with a one-line warning for the
newest one that verifies, and when none does the run stops with one line (`CheckpointError`).
After each save only the newest `checkpoint.keep` complete checkpoints are kept.

checkpoint.async_mode = "async" (or "async_with_pinned_mem") writes the same folder with DCP's
async save: the state is copied to host memory at the step, a background thread writes the files
(its collectives on a gloo group of its own) while training goes on, and the checkpoint is
committed exactly as a synchronous one (config.json, facts.json, manifest.json, then `latest`),
by every rank together at the first step boundary after every rank's files are written
(`poll`), before the next save starts, or when the run ends (`wait`). A crash before the commit
leaves a step folder without a manifest, which a resume passes over, and `latest` where it was.
checkpoint.initial_load_path starts a run with no checkpoint of its own from another run's model
weights (`load_initial_weights`).

A checkpoint is independent of the Hugging Face folders the model came from: step-N/source/<key>/
holds copies of what decides its numbers besides the weights (checkpoint_sources.py: made once
as the run starts, in <checkpoint.folder>/.sources/, and linked into each step folder, where the
manifest covers them); generate, the exports (`load_model_for_inference`) and a resume
(`run_start`) read them, never the source folders again.
The data is a pure function of the step (data/synthetic.py), so the step is the data position.
DCP stores DTensor shards with their global shapes, so a checkpoint written at one CP / DP layout
loads into another.

    python -m titan_vlm.checkpoint --export <checkpoint dir or step dir> <out.safetensors>
writes the full model weights into one safetensors file for inference. It, --export-hf and
generate --checkpoint (`load_model_for_inference`) verify the checkpoint they are given as a
resume does, and refuse a damaged one in one line (`CheckpointError`; no fallback to an older
step: the caller named this one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_vlm.checkpoint_sources import (
    SOURCE,
    SOURCES_STAGED,
    config_with_copies,
    copied_sources,
    copy_sources,
    link_or_copy,
    link_sources,
    source_values,
    with_sources,
)
from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError, UserError
from titan_vlm.models.common.hf_folder import HF_SOURCE_KEYS, source_changes, source_files
from titan_vlm.resume_config import SOURCE_FILES, check_resume_config, run_facts

if TYPE_CHECKING:
    from titan_vlm.models.spec import VisionLanguageModel

logger = logging.getLogger("titan_vlm")

MANIFEST = "manifest.json"
CONFIG = "config.json"
FACTS = "facts.json"


class CheckpointError(UserError):
    """No usable checkpoint to resume from; the message is one line naming the folder."""


def checkpoint_folder(cfg: JobConfig) -> Path:
    """checkpoint.folder, relative to job.dump_folder unless absolute."""
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def latest_step_dir(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder` (or `folder` itself if it is a step dir)."""
    if (folder / MANIFEST).is_file():
        return folder
    latest = folder / "latest"
    if not latest.is_file():
        return None
    text = latest.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{latest} holds {text[:40]!r}, not a step")
    step_dir = folder / f"step-{int(text)}"
    if not (step_dir / MANIFEST).is_file():
        raise FileNotFoundError(f"{latest} names {step_dir.name}, which is incomplete or missing")
    return step_dir


def latest_text(folder: Path) -> str:
    """What `latest` says, for messages."""
    latest = folder / "latest"
    return f"step-{latest.read_text().strip()}" if latest.is_file() else "none"


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """The step-<N> folders under `folder`, newest first."""
    found = []
    for d in folder.glob("step-*"):
        suffix = d.name[len("step-") :]
        if d.is_dir() and suffix.isdigit():
            found.append((int(suffix), d))
    return sorted(found, reverse=True)


def file_digest(path: Path) -> dict[str, int | str]:
    """{"size": bytes, "sha256": hex digest} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def file_problem(step_dir: Path, name: str, want: dict[str, Any]) -> str | None:
    """Why `step_dir/name` does not match its manifest entry `want` (None: it does)."""
    path = step_dir / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want["size"]:
        return f"{name} has {size} bytes, the manifest says {want['size']}"
    if file_digest(path)["sha256"] != want["sha256"]:
        return f"{name} does not match its SHA-256 in the manifest (bytes overwritten)"
    return None


def read_manifest(step_dir: Path) -> dict[str, dict[str, Any]]:
    """The manifest's {file name: {"size", "sha256"}}; raises ValueError saying why it cannot."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise ValueError(f"no {MANIFEST} (a save that did not finish)")
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable ({type(e).__name__})") from None
    if not isinstance(files, dict) or not {".metadata", CONFIG, FACTS} <= files.keys():
        raise ValueError(f"{MANIFEST} does not list .metadata, {CONFIG} and {FACTS}")
    return files


def verify_step_dir(step_dir: Path) -> str | None:
    """Why the checkpoint in `step_dir` cannot be used (None: every file matches its manifest).
    One process; `Checkpointer` splits the same work over its ranks."""
    try:
        files = read_manifest(step_dir)
    except ValueError as e:
        return str(e)
    for name in sorted(files):
        problem = file_problem(step_dir, name, files[name])
        if problem:
            return problem
    return None


def verify_on_group(step_dir: Path, group: dist.ProcessGroup) -> str | None:
    """verify_step_dir, the files' digests split over the ranks of `group`; the same answer on
    all."""
    try:
        files = read_manifest(step_dir)
    except ValueError as e:
        return str(e)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = sorted(files)[rank::world]
    mine = next((p for n in names if (p := file_problem(step_dir, n, files[n]))), None)
    everyone: list[str | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return next((p for p in everyone if p), None)


def load_initial_weights(model: torch.nn.Module, path: str, group: dist.ProcessGroup) -> Path:
    """checkpoint.initial_load_path: the model weights of another run's checkpoint (a checkpoint
    folder or a step dir), verified as a resume verifies, into `model` on every rank of `group`
    (DCP reshards them to this run's layout); the optimizer and the step are not read. The
    saved model must have this model's parameters (those of every rank of `group`: under
    pipeline parallelism a rank holds its stages') and global shapes: one line naming the first
    that differs. Returns the step dir read."""
    key = f"checkpoint.initial_load_path={path!r}"
    try:
        step_dir = latest_step_dir(Path(path))
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(f"{key}: {e}") from None
    if step_dir is None:
        raise CheckpointError(f"{key}: no checkpoint there (no 'latest' file or step-N folder)")
    problem = verify_on_group(step_dir, group)
    if problem:
        raise CheckpointError(f"{key}: checkpoint {step_dir} is unusable: {problem}")
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    saved = {
        name.removeprefix("model."): tuple(meta.size)
        for name, meta in metadata.items()
        if name.startswith("model.") and hasattr(meta, "size")
    }
    state = {"model": get_model_state_dict(model)}
    mine = {name: tuple(cast(torch.Tensor, t).shape) for name, t in state["model"].items()}
    # the run's model is every rank's parameters together (a pipeline rank holds its stages')
    everyone: list[dict[str, tuple[int, ...]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    mine = {name: shape for shapes in everyone if shapes for name, shape in shapes.items()}
    for name in sorted(mine.keys() | saved.keys()):
        if saved.get(name) != mine.get(name):
            there = "absent" if name not in saved else f"{list(saved[name])}"
            here = "absent" if name not in mine else f"{list(mine[name])}"
            raise CheckpointError(
                f"{key}: {step_dir} holds another model: {name} is {there} there, {here} in "
                "this run's"
            )
    dcp.load(state, checkpoint_id=str(step_dir), process_group=group)
    set_model_state_dict(model, state["model"])
    return step_dir


class Checkpointer:
    """Saves and restores the model, the optimizer and the trainer's own state (a DCP
    `Stateful`: step, lr scheduler, RNG, counters) on a process group (the ranks of one training
    job). Every rank calls save / resume; DCP writes every rank's shards, rank 0 writes the small
    JSON files, every rank digests (and on resume verifies) its share of the folder's files."""

    def __init__(
        self,
        cfg: JobConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: Stateful,
        group: dist.ProcessGroup,
        start: RunStart,
    ):
        """start: where the run starts (`run_start`, decided before the model was built); a
        resume loads its checkpoint (`resume`)."""
        self.cfg, self.start = cfg, start
        self.folder = checkpoint_folder(cfg)
        self.model, self.optimizer, self.trainer, self.group = model, optimizer, trainer, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.rank0 = self.rank == 0
        self.facts = start.facts  # what each checkpoint records for a resume to match
        # the sources' copies, made once now, as the run starts from them (`copy_sources`; a
        # resume from copies keeps them: `link_sources`); each checkpoint links them into its
        # step folder
        self.sources = self.folder / SOURCES_STAGED
        if start.copied:  # resuming start.step_dir from its copies
            step_dir = cast(Path, start.step_dir)
            self._on_rank0(lambda: link_sources(step_dir, self.sources))
        else:
            self._on_rank0(lambda: copy_sources(cfg, self.sources))
        # checkpoint.async_mode: the save being written in the background (step, its folder,
        # DCP's future), and the gloo group its collectives use: DCP's async save needs a CPU
        # backend, and a group of its own keeps them from interleaving with the training's
        self.pending: tuple[int, Path, Future[Any]] | None = None
        self.async_group: dist.ProcessGroup | None = None
        self.stager: DefaultStager | None = None
        if cfg.checkpoint.async_mode != "disabled":
            self.async_group = dist.new_group(
                ranks=dist.get_process_group_ranks(group),
                backend="gloo",
                use_local_synchronization=True,
            )
        if cfg.checkpoint.async_mode == "async_with_pinned_mem":
            # host copies in pinned memory, kept from one save to the next
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )

    # Optimizer state keyed by parameter name, not by param group: the groups follow the meshes,
    # which change with the layout (cp_vision) a run resumes into.
    _OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)

    def _state(self) -> dict[str, Any]:
        """What DCP saves and loads: the model's and the optimizer's state dicts and the
        trainer (DCP calls its state_dict / load_state_dict)."""
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIM),
            "trainer": self.trainer,
        }

    def _check_trainer_keys(self, step_dir: Path) -> None:
        """ConfigError (one line) where the checkpoint lacks a key of the trainer's state this
        version keeps (one written by an older titan_vlm: e.g. before the data's position was
        kept, `trainer.data_positions`), rather than DCP's error deep in the load."""
        saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        missing = [
            f"trainer.{k}"
            for k in self.trainer.state_dict()
            if not any(n == f"trainer.{k}" or n.startswith(f"trainer.{k}.") for n in saved)
        ]
        if missing:
            raise ConfigError(
                f"resume from {step_dir}: the checkpoint lacks {', '.join(missing)} (written by "
                "an older titan_vlm, which read the data otherwise): start a new "
                "checkpoint.folder, with checkpoint.initial_load_path at it for its weights"
            )

    def _gather(self, mine: object) -> list[Any]:
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone

    def save(self, step: int, blocking: bool = False) -> Path | None:
        """Write step-<step>/ and move `latest` onto it; returns the folder. With
        checkpoint.async_mode, an earlier save still being written is finished first, and this
        one is started and left to the background: None (`poll` or `wait` commit it), unless
        `blocking` (the run is about to end). A write that fails (a full disk, a quota) is a
        UserError on every rank, naming the file; `latest` stays where it was."""
        self.wait()
        step_dir = self.folder / f"step-{step}"
        if self.rank0 and step_dir.exists():  # a save that died, or a damaged step resumed past
            shutil.rmtree(step_dir)
        dist.barrier(group=self.group)
        if self.async_group is not None and not blocking:
            # the state is copied to host memory (self.stager's, or DCP's default) before this
            # returns, so the next steps may change the parameters while the thread writes
            future = dcp.async_save(
                self._state(),
                checkpoint_id=str(step_dir),
                process_group=self.async_group,
                async_stager=self.stager,
            )
            self.pending = (step, step_dir, cast(Future[Any], future))
            return None
        try:
            dcp.save(self._state(), checkpoint_id=str(step_dir), process_group=self.group)
        except CheckpointException as e:  # raised on every rank, with every rank's failure
            self._write_failed(e, step_dir)
        self._commit(step, step_dir)
        return step_dir

    def poll(self) -> Path | None:
        """At a step boundary: commit the save being written in the background if every rank
        has written its files (the same answer on every rank); returns its folder, else None."""
        if self.pending is None:
            return None
        if not all(self._gather(self.pending[2].done())):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Finish the save being written in the background, if any (blocks until every rank's
        files are written) and commit it; returns its folder (None: there was none)."""
        if self.pending is None:
            return None
        step, step_dir, future = self.pending
        self.pending = None
        try:
            future.result()
        except CheckpointException as e:
            self._write_failed(e, step_dir)
        self._commit(step, step_dir)
        return step_dir

    def close(self) -> None:
        """Finish any background save and free what async saves hold (the pinned buffers)."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _write_failed(self, e: CheckpointException, step_dir: Path) -> NoReturn:
        """DCP's failure (raised on every rank, with every rank's) as one UserError line."""
        # A failed write in DCP is an OSError, or torch.save's RuntimeError ("unexpected
        # pos 704 vs 598" on a full disk)
        rank, (exc, _) = min(e.failures.items())
        # rank 0's line on every rank: the free space each rank would measure differs while
        # anything else writes to the disk
        box = [str(self._write_error(exc, f"{step_dir} (rank {rank})"))]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        raise UserError(box[0]) from None

    def _commit(self, step: int, step_dir: Path) -> None:
        """After every rank's shards are on disk: the JSON files, every file's digest (split over
        the ranks), manifest.json, then `latest`, then pruning."""

        def write_json() -> list[str]:
            (step_dir / CONFIG).write_text(json.dumps(dataclasses.asdict(self.cfg), indent=1))
            (step_dir / FACTS).write_text(json.dumps(self.facts, indent=1))
            if self.sources.is_dir():
                shutil.copytree(self.sources, step_dir / SOURCE, copy_function=link_or_copy)
            return sorted(
                p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()
            )

        # after every rank's shards are on disk: the folder's files, to digest
        names = self._on_rank0(write_json)
        mine = {n: file_digest(step_dir / n) for n in names[self.rank :: self.world]}
        digests = {n: d for part in self._gather(mine) for n, d in part.items()}

        def commit() -> None:
            tmp = step_dir / f"{MANIFEST}.tmp"
            tmp.write_text(json.dumps({"step": step, "files": digests}, indent=1, sort_keys=True))
            os.replace(tmp, step_dir / MANIFEST)
            tmp = self.folder / "latest.tmp"
            tmp.write_text(f"{step}\n")
            os.replace(tmp, self.folder / "latest")
            self._prune(step)

        self._on_rank0(commit)

    def _write_error(self, e: BaseException, where: str) -> UserError:
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        why = " ".join(why.split())  # one line
        free = shutil.disk_usage(self.folder).free
        return UserError(
            f"checkpoint: cannot write {where}: {why} ({free:,} bytes free there: a full disk, a "
            f"quota?); the latest checkpoint is still {latest_text(self.folder)}"
        )

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0, its result on every rank; its OSError (or any other error: a
        UserError, safetensors' own) a one-line UserError on every rank, not rank 0's alone."""
        result = error = None
        if self.rank0:
            try:
                result = fn()
            except OSError as e:
                error = str(self._write_error(e, e.filename or str(self.folder)))
            except UserError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - reported on every rank, in one line
                error = f"checkpoint: {type(e).__name__}: {' '.join(str(e).split())}"
        box = [(result, error)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        result, error = box[0]
        if error:
            raise UserError(error)
        return result

    def _prune(self, step: int) -> None:
        """Keep the newest checkpoint.keep complete checkpoints at or below `step` (0: all);
        delete the rest, and every step folder above `step` (a damaged one a resume passed
        over, from before this run went back)."""
        keep = self.cfg.checkpoint.keep
        complete = 0
        for n, d in step_dirs(self.folder):
            if n > step:
                shutil.rmtree(d)
            elif (d / MANIFEST).is_file() and (keep == 0 or complete < keep):
                complete += 1
            elif keep:
                shutil.rmtree(d)

    def resume(self) -> Path | None:
        """Load the checkpoint the run starts from (`run_start`), if any, into the model, the
        optimizer and the trainer; returns its folder (None: a fresh start)."""
        step_dir = self.start.step_dir
        if step_dir is None:
            return None
        state = self._state()
        self._check_trainer_keys(step_dir)
        dcp.load(state, checkpoint_id=str(step_dir), process_group=self.group)
        set_model_state_dict(self.model, state["model"])
        self._load_optimizer(state["optim"])
        return step_dir  # dcp.load has called the trainer's load_state_dict

    def _load_optimizer(self, optim: dict[str, Any]) -> None:
        """The optimizer's state from its flattened state dict. Torch's load cannot place an
        empty param group (under pipeline parallelism every rank keeps every group, and its
        stages may hold no parameter of one: optim.build_optimizer's `keys`): those are set
        aside while it loads and put back in their places."""
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [g for g in groups if g["params"]]
        try:
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=self._OPTIM)
        finally:
            loaded = iter(self.optimizer.param_groups)
            self.optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


@dataclass
class RunStart:
    """Where a run with checkpoint.enable starts, decided before its model is built
    (`run_start`)."""

    step_dir: Path | None  # the verified checkpoint it resumes; None: a fresh start
    facts: dict[str, Any]  # what its checkpoints record for a resume to match (rank 0's)
    sources: JobConfig  # the config its model, tokenizer and processor are built from
    copied: bool  # `sources` names the resumed checkpoint's copies (config_with_copies)
    # a key that must match changed (checkpoint.allow_config_change): the data's position in
    # the checkpoint may name other rows, so the data is read from row 0's window
    changed: bool = False


def run_start(cfg: JobConfig, group: dist.ProcessGroup, global_rows: int) -> RunStart:
    """Where the run of `cfg` starts, the same on every rank of `group`: the newest checkpoint of
    checkpoint.folder that verifies (`usable_checkpoint`), its config checked against `cfg`
    (resume_config.py: one line naming what must match and does not), and the sources the model
    is built from: a resume from a checkpoint with copies of its sources reads the copies
    (`config_with_copies`: editing, moving or deleting the source folders changes nothing; a
    warning says when they differ now), any other start the config's folders.
    global_rows: rows per step over all dp ranks (a resume must keep it)."""
    step_dir = usable_checkpoint(checkpoint_folder(cfg), group)
    rank0 = dist.get_rank(group) == 0
    sources: JobConfig | None = None
    saved_cfg: dict[str, Any] = {}
    saved_facts: dict[str, Any] = {}
    if step_dir is not None:
        saved_cfg = json.loads((step_dir / CONFIG).read_text())
        saved = saved_cfg["model"]["flavor"]
        if saved != cfg.model.flavor:
            raise ConfigError(
                f"model.flavor={cfg.model.flavor!r}, but the checkpoint {step_dir} holds a "
                f"{saved!r} model (use another checkpoint.folder)"
            )
        saved_facts = json.loads((step_dir / FACTS).read_text())
        sources = config_with_copies(cfg, step_dir, saved_cfg["model"])
    # rank 0 hashes the dataset file (and the source files) once; every rank gets its answer.
    # Built from the copies, the run records the fingerprint of the sources it trained from.
    trained_from = saved_facts.get(SOURCE_FILES, {}) if sources is not None else None
    box: list[dict[str, Any] | None] = [
        run_facts(cfg, global_rows, trained_from) if rank0 else None
    ]
    dist.broadcast_object_list(box, group=group, group_src=0)
    facts = cast(dict[str, Any], box[0])
    warning = None
    if step_dir is not None:
        warning, note = check_resume_config(saved_cfg, saved_facts, cfg, facts, step_dir)
        if warning and rank0:
            logger.warning("%s", warning)
        if note:
            logger.info("%s", note)  # rank 0's log shows INFO
        if sources is not None and rank0:
            warn_if_sources_changed(cfg, facts[SOURCE_FILES], step_dir)
    return RunStart(step_dir, facts, sources or cfg, sources is not None, warning is not None)


def warn_if_sources_changed(cfg: JobConfig, trained: dict[str, str], step_dir: Path) -> None:
    """A warning when the source folders no longer hold what the run trained from (`trained`:
    their fingerprint then): the run reads the checkpoint's copies."""
    named = source_values(cfg)
    gone = [k for k, value in named.items() if value and not Path(value).exists()]
    try:
        changes = source_changes(
            {n: f for n, f in trained.items() if n.split(":")[0] not in gone},
            {n: f for n, f in source_files(cfg).items() if n.split(":")[0] not in gone},
        )
    except (UserError, OSError) as e:  # an unreadable file or folder the run does not need
        changes = f"the source files cannot be compared ({' '.join(str(e).split())})"
    what = [f"{k} {named[k]} is gone" for k in gone] + ([changes] if changes else [])
    if what:
        logger.warning(
            "resume from %s: %s; this run reads the checkpoint's copies (%s), as it trained",
            step_dir,
            ", ".join(what),
            step_dir / SOURCE,
        )


def usable_checkpoint(folder: Path, group: dist.ProcessGroup) -> Path | None:
    """The newest checkpoint in `folder` that verifies, after a warning for each newer one that
    does not; None when the folder holds none at all; CheckpointError when none is usable."""
    rank0 = dist.get_rank(group) == 0
    latest = folder / "latest"
    candidates = step_dirs(folder)
    if not candidates and not latest.exists():
        return None
    rejected = []
    if latest.exists():
        text = latest.read_text(errors="replace").strip()
        if not text.isdigit():
            rejected.append(f"{latest} holds {text[:40]!r}, not a step")
        elif not (folder / f"step-{int(text)}").is_dir():
            rejected.append(f"{latest} names step-{int(text)}, which is missing")
    for _, step_dir in candidates:
        problem = verify_on_group(step_dir, group)
        if problem is None:
            for why in rejected if rank0 else ():
                logger.warning("checkpoint: %s; resuming from %s instead", why, step_dir)
            return step_dir
        rejected.append(f"{step_dir.name} is unusable: {problem}")
    raise CheckpointError(
        f"no usable checkpoint in {folder} ({'; '.join(rejected)}); move the folder away to "
        "start over"
    )


def resume_sources(cfg: JobConfig) -> tuple[JobConfig, bool]:
    """Before any process group (validate.py): (the config the model would be built from, whether
    checkpoint.folder holds a checkpoint to resume). As `run_start` decides it, for the newest
    complete checkpoint (not yet verified: the trainer resumes the newest that verifies, whose
    copies are the same files unless the run restarted from other sources)."""
    if not cfg.checkpoint.enable:
        return cfg, False
    found = [d for _, d in step_dirs(checkpoint_folder(cfg)) if (d / MANIFEST).is_file()]
    for step_dir in found:  # newest first; a damaged one the trainer passes over, so here
        try:
            saved = json.loads((step_dir / CONFIG).read_text())["model"]
            sources = config_with_copies(cfg, step_dir, saved)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if sources is None:
            return cfg, True  # the run reads its folders
        copies = [Path(v) for k, v in source_values(sources).items() if v and k in HF_SOURCE_KEYS]
        if all((copy / "config.json").is_file() for copy in copies):
            return sources, True
    return cfg, bool(found)


def load_model_for_inference(path: str | Path) -> tuple[VisionLanguageModel, JobConfig]:
    """A whole (unsharded) model from a checkpoint folder or step dir, in one process, no
    process group: DCP assembles every shard into plain tensors."""
    from titan_vlm.config import load_config
    from titan_vlm.models.build import unfilled_model
    from titan_vlm.models.registry import model_spec

    step_dir = latest_step_dir(Path(path))
    if step_dir is None:
        raise FileNotFoundError(
            f"{path}: no checkpoint (expected a 'latest' file or a step-N folder)"
        )
    # what a resume verifies, before DCP reads a shard (a truncated one: an EOFError deep in
    # torch.load); no fallback to an older step: the caller asked for this one
    problem = verify_step_dir(step_dir)
    if problem:
        raise CheckpointError(f"checkpoint {step_dir} is unusable: {problem}")
    saved = json.loads((step_dir / "config.json").read_text())
    # data.dataset too: generate asks in the format the model was trained on (chat or caption)
    cfg = load_config(
        [f"--model.{k}={v}" for k, v in saved["model"].items()]
        + [f"--data.dataset={saved['data']['dataset']}"]
    )
    # the architecture, tokenizer and processor come from the checkpoint's copies of the source
    # files (verified with the rest): editing, moving or deleting the sources changes nothing
    cfg = with_sources(cfg, copied_sources(step_dir, saved["model"]))
    spec = model_spec(cfg)
    model = unfilled_model(spec, spec.args(cfg))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process without a process group is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval(), cfg


def export_safetensors(path: str | Path, out: str | Path) -> None:
    from safetensors.torch import save_file

    model, _ = load_model_for_inference(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out))


USAGE = """usage: python -m titan_vlm.checkpoint --export <checkpoint> <out.safetensors>
       python -m titan_vlm.checkpoint --export-hf <checkpoint> <out folder> [--max-shard-gb G]
<checkpoint>: a checkpoint folder (with 'latest') or a step-N folder.
--export     the whole model under titan_vlm's own names, one safetensors file
--export-hf  a Hugging Face folder in the format of the one training started from
             (model.hf_path), which transformers' from_pretrained loads"""


def main(argv: list[str] | None = None) -> None:
    from titan_vlm.models.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf

    args = sys.argv[1:] if argv is None else argv
    max_bytes = DEFAULT_MAX_SHARD_BYTES
    if len(args) == 5 and args[3] == "--max-shard-gb":
        try:
            max_bytes = int(float(args[4]) * 2**30)
        except ValueError:
            sys.exit(f"error: --max-shard-gb takes a number of GiB, got {args[4]!r}")
        args = args[:3]
    if len(args) != 3 or args[0] not in ("--export", "--export-hf"):
        sys.exit(USAGE)
    try:
        if args[0] == "--export":
            export_safetensors(args[1], args[2])
        else:
            model, cfg = load_model_for_inference(args[1])
            files = export_hf(model, cfg, Path(args[2]), max_bytes)
            print(f"wrote {len(files)} safetensors file(s) and the source folder's other files")
    except (UserError, FileNotFoundError) as e:  # CheckpointError, ConfigError: one line
        sys.exit(f"error: {e}")
    print(f"wrote {args[2]}")


if __name__ == "__main__":
    main()
