"""A checkpoint's copies of the Hugging Face sources its model was built from.

    <checkpoint.folder>/.sources/<key>/        the run's copies, made once as it starts
    <checkpoint.folder>/step-N/source/<key>/   the same files, hard-linked into each checkpoint
                                               (its manifest covers them)

<key> is a config key (model.hf_path, model.hf_vision_path, model.hf_text_path,
model.tokenizer_path); its folder holds what decides the model's numbers besides the weights:
config.json, the tokenizer files, chat template and processor settings (a model folder's
non-weight files, a tower's config.json, the tokenizer file), and for model.hf_path the name,
dtype and shape of every source tensor and the tensors the model does not use (what --export-hf
needs). Generate, the exports and a resume read these copies, never the source folder again
(`copied_sources`, `config_with_copies`): editing, moving or deleting the source changes nothing
a checkpoint computes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

from titan_vlm.config import JobConfig
from titan_vlm.models.common.hf_folder import (
    HF_SOURCE_KEYS,
    RECORDED,
    UNUSED,
    WEIGHT_SUFFIXES,
    SafetensorsFiles,
    source_file_paths,
    weight_files,
)

SOURCE = "source"  # step-N/source/<config key>/: copies of the model's Hugging Face sources
SOURCES_STAGED = ".sources"  # <checkpoint.folder>/.sources/: the run's copies, made at its start
SOURCE_KEYS = (*HF_SOURCE_KEYS, "model.tokenizer_path")  # what a checkpoint copies


def copy_sources(cfg: JobConfig, dest: Path) -> None:
    """Copy what decides the model's numbers besides the weights, from the Hugging Face sources
    of `cfg` into `dest` (replaced), once as a run starts: for each source
    (common/hf_folder.py source_files' files: a folder's non-weight files, or a tower file's
    config.json), and for model.hf_path also the name, dtype and shape of every tensor of its
    weights and the tensors the model does not use (RECORDED, UNUSED: what --export-hf needs);
    model.tokenizer_path's file. Nothing when the model comes from no Hugging Face source."""
    from safetensors.torch import save_file

    from titan_vlm.models.registry import model_spec

    if dest.exists():
        shutil.rmtree(dest)
    files = source_file_paths(cfg)
    if not files:
        return
    for key, path in files:
        (dest / key).mkdir(parents=True, exist_ok=True)
        if path.suffix not in WEIGHT_SUFFIXES:  # the weights are the checkpoint's own
            shutil.copy2(path, dest / key / path.name)
    if cfg.model.hf_path:  # what --export-hf needs (separate towers do not export)
        key = "model.hf_path"
        spec = model_spec(cfg)
        args = spec.args(cfg)
        with SafetensorsFiles(weight_files(Path(cfg.model.hf_path), key), key) as st:
            names = sorted(st.keys())
            recorded = {n: {"dtype": st.dtype_code(n), "shape": list(st.shape(n))} for n in names}
            (dest / key / RECORDED).write_text(json.dumps(recorded, indent=1))
            unused = sorted(spec.hf_unused(args, set(names)))
            if unused:
                tensors = {n: st.read(n).contiguous() for n in unused}
                save_file(tensors, str(dest / key / UNUSED), metadata={"format": "pt"})


def link_sources(step_dir: Path, dest: Path) -> None:
    """A resumed run's copies (`dest`, replaced) are those of the checkpoint it resumed
    (`step_dir`), hard-linked: the sources it trained from, whatever the folders hold now."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(step_dir / SOURCE, dest, copy_function=link_or_copy)


def link_or_copy(src: str, dst: str) -> None:
    """A hard link (the staged copies are never written again), a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copied_sources(step_dir: Path, saved_model: dict[str, Any]) -> dict[str, Path]:
    """{config key: its copy} of a checkpoint's copies of its sources (`copy_sources`; none in a
    checkpoint of an older version, or of a model from no Hugging Face folder): the copied
    folder for model.hf_path, hf_vision_path, hf_text_path (a tower given as a .safetensors file:
    the folder of its config.json), the copied file for model.tokenizer_path. Only the keys the
    saved config (`saved_model`: its [model] section) sets."""
    found: dict[str, Path] = {}
    for key in SOURCE_KEYS:
        value = saved_model.get(key.removeprefix("model."))
        folder = step_dir / SOURCE / key
        if not value or not folder.is_dir():
            continue
        found[key] = folder / Path(value).name if key == "model.tokenizer_path" else folder
    return found


def source_values(cfg: JobConfig) -> dict[str, str]:
    """{config key: its value} of the source keys a checkpoint copies (SOURCE_KEYS; "" unset)."""
    return {key: getattr(cfg.model, key.removeprefix("model.")) for key in SOURCE_KEYS}


def _same_path(a: str, b: str) -> bool:
    """Whether two config values name the same path (relative ones against the current folder;
    a trailing slash or ./ changes nothing); both empty: the same."""
    if not a or not b:
        return a == b
    return os.path.abspath(a) == os.path.abspath(b)


def with_sources(cfg: JobConfig, sources: dict[str, Path]) -> JobConfig:
    """A copy of `cfg` whose source keys ({config key: path}) name `sources`."""
    out = copy.deepcopy(cfg)
    for key, path in sources.items():
        setattr(out.model, key.removeprefix("model."), str(path))
    return out


def config_with_copies(
    cfg: JobConfig, step_dir: Path, saved_model: dict[str, Any]
) -> JobConfig | None:
    """The config a run resuming `step_dir` builds its model, tokenizer and processor from: `cfg`
    with every Hugging Face source key at the checkpoint's copy, when `cfg` names the sources
    the checkpoint was trained from (each source key as in `saved_model`, the saved [model]
    section, and each set one copied). None otherwise: a checkpoint without copies (an older
    version's), or a run pointed at other sources, which reads them (resume_config.py refuses
    them unless their files are the same, or checkpoint.allow_config_change)."""
    copies = copied_sources(step_dir, saved_model)
    named = source_values(cfg)
    if not copies or any(
        not _same_path(named[k], saved_model.get(k.removeprefix("model."), "")) for k in named
    ):
        return None
    if any(value and key not in copies for key, value in named.items()):
        return None
    return with_sources(cfg, copies)
