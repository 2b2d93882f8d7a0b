"""Hugging Face folders in and out of one process: inference from a folder, export to a folder.

    python -m titan_vlm.checkpoint --export-hf <checkpoint folder or step dir> <out folder>

writes the trained model in its source folder's format (model.hf_path): the same tensor names
(the adapter's, in the key style the source used), each in the source tensor's dtype, sharded as
`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` above `max_shard_bytes`;
tensors the model does not use (vision layers past vision_feature_layer, SigLIP's head, ...)
are copied from the source unchanged, and every other file of the source folder (config.json,
generation_config.json, tokenizer, chat template, processor settings) is copied as it is, since
training changes no shape. `from_pretrained` on the result finds no missing or unexpected
tensor; tied embeddings stay tied (one tensor, under the embedding's name).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titan_vlm.config import ImageAttention, JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.build import load_hf, unfilled_model
from titan_vlm.models.common.hf_adapter import hf_tensor_parts
from titan_vlm.models.common.hf_experts import ExpertView
from titan_vlm.models.common.hf_folder import INDEX, RECORDED, SINGLE, UNUSED, source_tensors
from titan_vlm.models.registry import model_spec
from titan_vlm.models.spec import VisionLanguageModel

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def hf_config(hf_path: str, image_attention: ImageAttention = "causal") -> JobConfig:
    """The JobConfig of a model taken whole from a Hugging Face folder."""
    cfg = JobConfig()
    cfg.model.flavor = "hf"
    cfg.model.hf_path = hf_path
    cfg.model.image_attention = image_attention
    return cfg


def load_hf_model(cfg: JobConfig) -> tuple[VisionLanguageModel, Any]:
    """The whole model of `cfg`'s Hugging Face sources in this process (no process group):
    built on meta, allocated on the CPU, filled from the files."""
    spec = model_spec(cfg)
    args = spec.args(cfg)
    model = unfilled_model(spec, args)
    load_hf(model, spec, args, cfg)
    return model.eval(), args


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, a new shard whenever the next would pass `max_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def export_hf(
    model: nn.Module,
    cfg: JobConfig,
    out: Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write `model` (whole, trained from cfg.model.hf_path) as a Hugging Face folder `out`.
    Returns the weight files written."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if not cfg.model.hf_path:
        raise ConfigError(
            "--export-hf writes the format of the folder a model started from (model.hf_path); "
            "this model has none: use --export for titan_vlm's own names"
        )
    if cfg.model.image_attention != "causal":
        raise ConfigError(
            "--export-hf: this model was trained with model.image_attention="
            f"{cfg.model.image_attention!r}; transformers' LLaVA attends causally, so the export "
            "would compute something else"
        )
    source = Path(cfg.model.hf_path)
    folder = source.parent if source.is_file() else source
    if out.resolve() == folder.resolve() or folder.resolve() in out.resolve().parents:
        raise ConfigError(
            f"--export-hf: {out} is (inside) the source folder {folder}; choose another"
        )
    spec = model_spec(cfg)
    params = {n: p.detach() for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    with source_tensors(source, "model.hf_path") as raw:
        st = ExpertView(raw, str(source))  # MoE experts stacked (common/hf_experts.py)
        keys = st.keys()
        names = spec.hf_names(model.args, keys, str(source))
        for theirs, parts in hf_tensor_parts(names).items():  # a fused tensor: its parts, in order
            if all(ours in params for ours in parts):
                whole = torch.cat([params[o] for o in parts]) if parts[1:] else params[parts[0]]
                tensors[theirs] = whole.to(st.dtype(theirs)).contiguous()
        for theirs in spec.hf_unused(model.args, keys):
            if theirs not in tensors:
                tensors[theirs] = st.read(theirs)
        for copy, original in spec.hf_same(model.args, keys):
            tensors[copy] = tensors[original].clone()  # the trained tensor, not the source's
        tensors = st.file_tensors(tensors)  # the experts back in the files' layout
    # Everything is written into a hidden folder inside `out` first (the same file system, so the
    # moves are renames); only a complete export moves in, then a previous export's shards that
    # are not this one's go: a full disk or an unreadable source file leaves `out` as it was
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        for item in folder.iterdir():
            copied = item.suffix != ".safetensors" and item.name not in (INDEX, RECORDED, UNUSED)
            if item.is_file() and copied:
                shutil.copy2(item, staging / item.name)
        shards = _shards(tensors, max_shard_bytes)
        n = len(shards)
        files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if n == 1:
            files = [SINGLE]
        for file, shard in zip(files, shards):
            save_file(shard, str(staging / file), metadata={"format": "pt"})
        if n > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {name: file for file, s in zip(files, shards) for name in s},
            }
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written = {item.name for item in staging.iterdir()}
        for item in sorted(staging.iterdir()):
            os.replace(item, out / item.name)
        for old in (*out.glob("*.safetensors"), out / INDEX):
            if old.name not in written:  # a previous export's shards would mix with this one's
                old.unlink(missing_ok=True)
    except (OSError, SafetensorError) as e:  # a full disk, a quota, a file-size limit
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
        raise ConfigError(
            f"--export-hf: cannot write {out}: {why}; {out} is left as it was"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / file for file in files]
