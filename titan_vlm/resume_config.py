"""What a resumed run may change, and what it must keep, of the config its checkpoint was written
with (checkpoint/step-N/config.json).

Must match (else one line naming the keys, unless --checkpoint.allow_config_change):
the model's family, shape and tokenizer, the files of its Hugging Face sources when the run
reads them (SOURCE_FILES: a folder edited, emptied or refilled since the checkpoint was written
would build another model or tokenizer; a resume that names the sources it trained from reads
the checkpoint's copies instead, checkpoint_sources.py, and records their fingerprint as
trained), training.seq_len, training.seed, training.freeze (the optimizer's state covers the
groups that train), the global batch (dp x training.local_batch_size rows: the step is the data
position only for the same rows per step) and the data (data.* keys that pick the samples and
size the images, and a dataset file's size and SHA-256).
May change (logged): everything else: the parallel layout (the shards are resharded),
training.steps and the lr schedule, checkpoint.*, metrics.*, model.hf_path itself (a folder
moved: its files are what must match), and what computes the same step with other rounding
(training.mixed_precision, model.attention_kernel, compile.*, activation_checkpoint.*), ...
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from titan_vlm.config import ConfigError, JobConfig
from titan_vlm.data.index_cache import cached_digest, index_folder
from titan_vlm.data.jsonl import dataset_files
from titan_vlm.data.mixture import data_sources
from titan_vlm.models.common.hf_folder import source_changes, source_files

MUST_MATCH = (
    "model.name",
    "model.flavor",
    "model.image_attention",
    "model.tokenizer_path",
    "model.hf_vision_path",
    "model.hf_text_path",
    "training.seq_len",
    "training.seed",
    "training.freeze",  # the optimizer holds state for the groups that train only
    "data.dataset",
    "data.mixture",
    "data.packing",
    "data.shuffle",
    "data.index_window",  # the windows: which samples a row holds
    "data.image_root",
    "data.max_frames",
    "data.sentences_per_image",
    "data.images_per_sample",
    "data.blank_images",
    "data.native_resolution_pixels",
    "data.max_image_pixels",  # which images are bad samples: which samples a step holds
)
GLOBAL_ROWS = "global batch rows (dp x training.local_batch_size)"
DATA_FILE = "data.dataset's contents (size, SHA-256)"
SOURCE_FILES = "the model's Hugging Face source files"


def run_facts(
    cfg: JobConfig, global_rows: int, sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """What the config alone does not say and a resume must match: the rows per step, the
    dataset file's size and digest (None for the built-in data) and the fingerprint of the
    model's source files (`sources`: the one the resumed checkpoint recorded, for a run built
    from its copies; None: the files' now). Hashes the files: once a run."""
    facts: dict[str, Any] = {GLOBAL_ROWS: global_rows, DATA_FILE: None}
    facts[SOURCE_FILES] = source_files(cfg) if sources is None else sources
    if cfg.data.dataset != "synthetic":
        mixed = data_sources(cfg.data.dataset, cfg.data.mixture)
        files = [f for _, source in mixed for f in dataset_files("data.dataset", source)]
        if cfg.data.cache_index:  # hashed once while the files keep their sizes and times
            folder = index_folder(cfg.job.dump_folder)
            facts[DATA_FILE] = cached_digest(folder, files, lambda: data_digest(files))
        else:
            facts[DATA_FILE] = data_digest(files)
    return facts


def data_digest(files: list[Path]) -> str:
    """The data files' fact: their sizes and one SHA-256 of their bytes (with several, each
    one's name and size before its bytes: no two lists hash alike)."""
    h, size = hashlib.sha256(), 0
    for path in files:
        bytes_ = path.stat().st_size
        size += bytes_
        if len(files) > 1:
            h.update(f"{path.name}\0{bytes_}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    shards = f"{len(files)} files, " if len(files) > 1 else ""
    return f"{shards}{size} bytes, {h.hexdigest()[:16]}"


def flat(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{"section.key": value} of a JobConfig as dataclasses.asdict writes it."""
    return {f"{s}.{k}": v for s, keys in config.items() for k, v in keys.items()}


def check_resume_config(
    saved: dict[str, dict[str, Any]],
    saved_facts: dict[str, Any],
    cfg: JobConfig,
    facts: dict[str, Any],
    where: Path,
) -> tuple[str | None, str | None]:
    """Compare the checkpoint's config (`saved`, asdict form) and facts with this run's. Raises
    ConfigError naming every must-match key that changed (unless checkpoint.allow_config_change);
    returns the lines to log: (a warning about changed must-match keys that were allowed, a note
    of the keys that may change and did), None where there is nothing to say. Facts a checkpoint
    of an older version lacks are not compared."""
    old, new = flat(saved), flat(dataclasses.asdict(cfg))
    old.update({k: v for k, v in saved_facts.items() if k != SOURCE_FILES})
    new.update({k: v for k, v in facts.items() if k in saved_facts and k != SOURCE_FILES})
    changed = {k: (old.get(k), v) for k, v in new.items() if k in old and old[k] != v}
    must = [k for k in (*MUST_MATCH, GLOBAL_ROWS, DATA_FILE) if k in changed]
    listed = ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in must)
    if SOURCE_FILES in saved_facts:
        sources = source_changes(saved_facts[SOURCE_FILES], facts[SOURCE_FILES])
        if sources:
            must.append(SOURCE_FILES)
            listed = ", ".join([listed, sources] if listed else [sources])
    if must and not cfg.checkpoint.allow_config_change:
        raise ConfigError(
            f"resume from {where}: {listed} changed, and must match the checkpoint (the model, "
            "the data and the data position follow them); restore them (a run naming the "
            "source paths it trained from reads the checkpoint's copies of them), use another "
            "checkpoint.folder, or pass --checkpoint.allow_config_change"
        )
    warning = note = None
    if must:
        warning = f"resume from {where}: {listed} changed (checkpoint.allow_config_change)"
    may = [k for k in changed if k not in must]
    if may:
        note = f"resume from {where}: " + ", ".join(
            f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in may
        )
    return warning, note
