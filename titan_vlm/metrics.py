"""Per-step metrics to stdout, <dump_folder>/metrics.jsonl, TensorBoard (<dump_folder>/tb/) and
Weights & Biases (metrics.enable_wandb: <dump_folder>/wandb/)."""

from __future__ import annotations

import json
import logging
import os
import resource
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from titan_vlm.errors import UserError

logger = logging.getLogger("titan_vlm")


def peak_memory_gib(device: torch.device) -> float:
    """CUDA allocator peak on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def read_metrics_lines(path: Path) -> list[tuple[int, str]]:
    """(step, line) of each record of a metrics.jsonl. A torn last line (a crash in the middle of
    a write) is dropped with a warning; any other line that is not a record stops with one line
    naming the file and the line."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:
                logger.warning("%s:%d: dropped a torn last line %r", path, i + 1, line[:60])
                continue
            raise UserError(
                f"{path}:{i + 1}: not a metrics record ({line[:60]!r}); move the file away"
            ) from None
        out.append((step, line))
    return out


WANDB_MISSING = (
    "metrics.enable_wandb needs the wandb package: pip install 'titan_vlm[wandb]' (or set "
    "metrics.enable_wandb = false)"
)


def wandb_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class MetricsLogger:
    """Writes only on the rank given `enabled=True` (rank 0); the others call it as a no-op."""

    def __init__(
        self,
        dump_folder: str,
        enable_tensorboard: bool,
        enabled: bool,
        resume_after: int = 0,
        wandb_config: dict[str, Any] | None = None,
    ):
        """resume_after: a run resumed after that step keeps the earlier run's metrics.jsonl lines
        up to it (the steps redone after the checkpoint are written again, once).
        wandb_config: log to a new W&B run too, with this as its config (None: no W&B); a resumed
        run is a new W&B run whose first step is resume_after + 1."""
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        self.wandb: Any = None
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "metrics.jsonl"
        records = read_metrics_lines(path)
        kept = [line for step, line in records if resume_after and step <= resume_after]
        replaced = len(records) - len(kept)
        if replaced:
            logger.warning("%s: replacing %d lines from an earlier run", path, replaced)
        # The kept lines go to a new file that replaces the old one whole (a crash here leaves
        # the old file), then the run appends to it.
        tmp = folder / "metrics.jsonl.tmp"
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.jsonl = open(path, "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(folder / "tb"))
        if wandb_config is not None:
            if not wandb_installed():
                raise UserError(WANDB_MISSING)
            import wandb

            try:
                self.wandb = wandb.init(
                    project=os.environ.get("WANDB_PROJECT", "titan_vlm"),
                    dir=str(folder),
                    config=wandb_config,
                )
            except Exception as e:  # wandb's own: no API key, no network, a bad setting
                why = " ".join(str(e).split())[:300]
                raise UserError(
                    f"metrics.enable_wandb: W&B did not start ({type(e).__name__}: {why}); "
                    "set WANDB_API_KEY, or WANDB_MODE=offline to log without a network"
                ) from None
            logger.info("W&B run %s (%s) in %s", self.wandb.name, self.wandb.id, folder / "wandb")

    def log(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
        if self.jsonl is None:  # not the rank that writes
            return
        if echo:
            # a group with its own rate (training.vision_lr / projector_lr): "lr 1e-3 vision 2e-4"
            own = "".join(
                f" {key.removeprefix('lr_')} {value:.2e}"
                for key, value in metrics.items()
                if key.startswith("lr_")
            )
            # a mixture-of-experts decoder: its router loss and its busiest expert's load
            moe = (
                f" | moe aux {metrics['moe_aux_loss']:.4f} load max {metrics['moe_load_max']:.2f}x"
                if "moe_aux_loss" in metrics
                else ""
            )
            logger.info(
                "step %5d | loss %.4f | grad_norm %.3f | lr %.2e%s | tokens/s %9.1f | "
                "peak mem %.2f GiB | "
                "cp_balance %.3f | cp_padding %.3f%s | data_wait %.3f s",
                step,
                metrics["loss"],
                metrics["grad_norm"],
                metrics["lr"],
                own,
                metrics["tokens_per_sec"],
                metrics["peak_memory_gib"],
                metrics.get("cp_balance", 1.0),
                metrics.get("cp_padding", 0.0),
                moe,
                metrics.get("data_wait_s", 0.0),
            )
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class _Saved:
    """What autograd holds for one saved tensor inside SavedForBackward: dropped when autograd
    frees the saved tensor (its backward ran, or its graph went away)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedForBackward:
    """Context manager counting what autograd saves for backward inside it: `bytes` (each storage
    once, the given parameters left out), `peak` (the most of those bytes autograd held at once:
    a storage counts from its first save to the release of its last saved tensor) and
    `longest_dim` (of any saved tensor)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}
        self.longest_dim = 0
        self.alive = self.peak = 0
        self._holders: dict[int, int] = {}  # storage -> saved tensors autograd holds of it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return t
        self.storages[ptr] = storage.nbytes()
        self.longest_dim = max([self.longest_dim, *t.shape])
        if not self._holders.get(ptr):
            self.alive += storage.nbytes()
            self.peak = max(self.peak, self.alive)
        self._holders[ptr] = self._holders.get(ptr, 0) + 1
        # detached: holding a saved output (its grad_fn holds what we return) would make a cycle
        # through autograd's graph that Python cannot collect
        saved = _Saved(t.detach())
        weakref.finalize(saved, self._release, ptr, storage.nbytes())
        return saved

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved  # type: ignore[return-value]

    def _release(self, ptr: int, nbytes: int) -> None:
        self._holders[ptr] -= 1
        if not self._holders[ptr]:
            del self._holders[ptr]
            self.alive -= nbytes

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
