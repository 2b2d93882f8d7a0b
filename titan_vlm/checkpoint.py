"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, reshard, export.

<checkpoint.folder>/step-<N>/   one DCP checkpoint: the model's and the optimizer's sharded state
                               (each rank writes its own shards), plus trainer.pt (step, lr
                               scheduler, RNG, counters) and config.json (the JobConfig that
                               wrote it)
<checkpoint.folder>/latest     the step of the newest complete checkpoint

`latest` is replaced (write, then atomic rename) only after every rank has finished writing
its step folder, so a crash during a save leaves the previous checkpoint as the latest one.
The data is a pure function of the step (data/synthetic.py), so the step is the data position.
DCP stores DTensor shards with their global shapes, so a checkpoint written at one CP / DP layout
loads into another.

    python -m titan_vlm.checkpoint --export <checkpoint dir or step dir> <out.safetensors>
writes the full model weights into one safetensors file for inference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_vlm.config import ConfigError, JobConfig


def checkpoint_folder(cfg: JobConfig) -> Path:
    """checkpoint.folder, relative to job.dump_folder unless absolute."""
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def latest_step_dir(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder` (or `folder` itself if it is a step dir)."""
    if (folder / "trainer.pt").is_file():
        return folder
    latest = folder / "latest"
    if not latest.is_file():
        return None
    step_dir = folder / f"step-{int(latest.read_text().strip())}"
    if not (step_dir / "trainer.pt").is_file():
        raise FileNotFoundError(f"{latest} names {step_dir.name}, which is incomplete or missing")
    return step_dir


class Checkpointer:
    """Saves and restores model, optimizer, lr scheduler, step and RNG state on a process group
    (the ranks of one training job)."""

    def __init__(
        self,
        cfg: JobConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        group: dist.ProcessGroup,
    ):
        self.cfg = cfg
        self.folder = checkpoint_folder(cfg)
        self.model, self.optimizer, self.scheduler, self.group = model, optimizer, scheduler, group
        self.rank0 = dist.get_rank(group) == 0
        # Running totals the metrics report (the samples the data dropped so far), saved with the
        # step so a resumed run's metrics go on from them; not needed to reproduce the training.
        self.counters: dict[str, int] = {}

    # Optimizer state keyed by parameter name, not by param group: the groups follow the meshes,
    # which change with the layout (cp_vision) a run resumes into.
    _OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)

    def _state(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIM),
        }

    def save(self, step: int) -> Path:
        step_dir = self.folder / f"step-{step}"
        dcp.save(self._state(), checkpoint_id=str(step_dir), process_group=self.group)
        if self.rank0:
            trainer = {
                "step": step,
                "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "counters": dict(self.counters),
            }
            torch.save(trainer, step_dir / "trainer.pt.tmp")
            (step_dir / "config.json").write_text(
                json.dumps(dataclasses.asdict(self.cfg), indent=1)
            )
            os.replace(step_dir / "trainer.pt.tmp", step_dir / "trainer.pt")
        dist.barrier(group=self.group)  # every rank's shards are on disk before `latest` moves
        if self.rank0:
            tmp = self.folder / "latest.tmp"
            tmp.write_text(f"{step}\n")
            os.replace(tmp, self.folder / "latest")
        dist.barrier(group=self.group)
        return step_dir

    def resume(self) -> int:
        """Load the latest checkpoint if there is one; returns the step it was taken after
        (0: none)."""
        step_dir = latest_step_dir(self.folder)
        if step_dir is None:
            return 0
        saved = json.loads((step_dir / "config.json").read_text())["model"]["flavor"]
        if saved != self.cfg.model.flavor:
            raise ConfigError(
                f"model.flavor={self.cfg.model.flavor!r}, but the checkpoint {step_dir} holds a "
                f"{saved!r} model (use another checkpoint.folder)"
            )
        state = self._state()
        dcp.load(state, checkpoint_id=str(step_dir), process_group=self.group)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self._OPTIM)
        trainer = torch.load(step_dir / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["rng"])
        self.counters = dict(trainer.get("counters", {}))  # absent in checkpoints of older versions
        return int(trainer["step"])


def load_model_for_inference(path: str | Path) -> tuple[torch.nn.Module, JobConfig]:
    """A whole (unsharded) model from a checkpoint folder or step dir, in one process, no
    process group: DCP assembles every shard into plain tensors."""
    from titan_vlm.config import load_config
    from titan_vlm.models.registry import get_model_spec

    step_dir = latest_step_dir(Path(path))
    if step_dir is None:
        raise FileNotFoundError(
            f"{path}: no checkpoint (expected a 'latest' file or a step-N folder)"
        )
    saved = json.loads((step_dir / "config.json").read_text())
    # data.dataset too: generate asks in the format the model was trained on (chat or caption)
    cfg = load_config(
        [f"--model.{k}={v}" for k, v in saved["model"].items()]
        + [f"--data.dataset={saved['data']['dataset']}"]
    )
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(spec.args(cfg))
    model.to_empty(device="cpu")
    spec.after_to_empty(model)
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
    except (ConfigError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args[2]}")


if __name__ == "__main__":
    main()
