"""Fill a model whose parameters are already sharded, each rank writing only its own shards.

The trainer builds the model on the meta device (no memory), applies TP and FSDP (the
parameters become DTensors whose local pieces are still unallocated), allocates the local
pieces (`Module.to_empty`), and only then fills them, by one of:

  * `load_hf_shards`: each parameter's local piece is a box (an offset and a shape per dim) of
    the full tensor; exactly that box is read from the Hugging Face safetensors files. A rank
    of an FSDP group of N reads about 1/N of the weights, and at no time holds more.
  * `init_from_seed`: the same box of a tensor drawn from a generator seeded by the job's seed,
    the parameter's canonical name (`canonical_name`: no wrapper's prefix) and the row block
    (`ROW_BLOCK` rows of dim 0), so every layout, one process or many, with or without
    activation checkpointing or torch.compile, starts from the same weights, and a rank draws
    only the row blocks its piece touches.

Both work on plain tensors too (no FSDP: the box is the whole tensor).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.hf_adapter import hf_tensor_parts
from titan_vlm.models.common.hf_experts import ExpertView
from titan_vlm.models.common.hf_folder import SafetensorsFiles, weight_files

# rows of dim 0 drawn from one seeded generator (init_from_seed); 1 for a 3-D stacked tensor
ROW_BLOCK = 64
# What activation checkpointing's wrapper (torch's _CHECKPOINT_PREFIX) and a torch.compile'd
# module (OptimizedModule) insert into the names of the parameters below them
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes: the name of the unwrapped model, and
    the key a checkpoint stores it under (DCP's get_model_state_dict strips the same two), so
    the init seed, the Hugging Face mapping and the checkpoint agree whatever wraps the blocks."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def canonical_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """`model.named_parameters()` under their canonical names (`canonical_name`)."""
    return {canonical_name(n): p for n, p in model.named_parameters()}


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece of `param` and the box of the full tensor it holds."""
    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):  # never seen; would mean a placement we cannot box
        raise RuntimeError(
            f"local piece {tuple(local.shape)} != computed box {tuple(shape)} ({param.placements})"
        )
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_hf_shards(
    params: Mapping[str, torch.Tensor], files: ExpertView, names: dict[str, str], where: str
) -> int:
    """Copy each parameter's local box from the file tensor `names[param name]`, whose full
    shape must be the parameter's (the error names both); a file tensor several parameters name
    is their dim-0 concatenation (common/hf_adapter.py hf_tensor_parts), each read from its own
    rows. Returns the bytes this rank read."""
    read = 0
    for theirs, parts in hf_tensor_parts(names).items():
        if theirs not in files.keys():
            raise ConfigError(f"{where}: tensor '{theirs}' not found (needed for {parts[0]})")
        shapes = [tuple(params[ours].shape) for ours in parts]
        whole = shapes[0] if len(parts) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
        if files.shape(theirs) != whole or any(s[1:] != whole[1:] for s in shapes):
            needs = f"{parts[0]} needs" if len(parts) == 1 else f"{' + '.join(parts)} need"
            raise ConfigError(
                f"{where}: tensor '{theirs}' has shape {files.shape(theirs)}, {needs} {whole} "
                "(check the config.json beside it)"
            )
        files.dtype(theirs)  # a float type: an integer tensor is a one-line error, not a cast
        first = 0  # the parameter's first row in the file tensor
        for ours, shape in zip(parts, shapes):
            local, box = local_box(params[ours])
            if local.numel() > 0:
                if first:
                    box = (slice(box[0].start + first, box[0].stop + first), *box[1:])
                piece = files.read(theirs, box)
                local.copy_(piece.to(local.dtype))
                read += piece.numel() * piece.element_size()
            first += shape[0] if shape else 0
    return read


def load_whole_model(
    model: nn.Module,
    folder: Path,
    names: Callable[[Any, set[str], str], dict[str, str]],
    same: Callable[[Any, set[str]], list[tuple[str, str]]],
) -> None:
    """Copy every parameter of `model` (whole, one process, no parallelism) from a
    transformers-saved folder, through a family's adapter (ModelSpec.hf_names, hf_same, of
    `model.args`): a missing or stray tensor, one of another shape, or a tied copy that differs
    is a ConfigError."""
    where = str(folder)
    args = model.args
    with SafetensorsFiles(weight_files(folder, where), where) as raw:
        files = ExpertView(raw, where)
        mapping = names(args, files.keys(), where)
        for copy, original in same(args, files.keys()):
            if not torch.equal(files.read(copy), files.read(original)):
                raise ConfigError(
                    f"{where}: '{copy}' differs from '{original}' but the embeddings are tied"
                )
        load_hf_shards(dict(model.named_parameters()), files, mapping, where)


@dataclass(frozen=True)
class Init:
    """How one parameter starts: "normal" (mean 0, std `scale`), "uniform" (in [-scale, scale]),
    "ones" or "zeros"."""

    kind: str
    scale: float = 0.0


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(init: Init, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if init.kind == "normal":
        return torch.randn(shape, generator=generator) * init.scale
    if init.kind == "uniform":
        return (torch.rand(shape, generator=generator) * 2 - 1) * init.scale
    if init.kind == "ones":
        return torch.ones(shape)
    if init.kind == "zeros":
        return torch.zeros(shape)
    raise ValueError(f"unknown init kind {init.kind!r}")


@torch.no_grad()
def init_from_seed(
    model: nn.Module,
    seed: int,
    rule: Callable[[str, torch.Tensor], Init],
    only: set[str] | None = None,
) -> None:
    """Every parameter (or those named in `only`) from `rule(name, param)`, drawn in row blocks
    seeded by (seed, name, block): the values of a row do not depend on which rank holds it
    (module docstring). `name` is the canonical one (`canonical_name`): activation
    checkpointing or torch.compile around a block leaves its weights as they are."""
    for name, param in canonical_parameters(model).items():
        if only is not None and name not in only:
            continue
        init = rule(name, param)
        local, box = local_box(param)
        if local.numel() == 0:
            continue
        if init.kind in ("ones", "zeros"):
            local.fill_(1.0 if init.kind == "ones" else 0.0)
            continue
        full = tuple(param.shape)
        if not full:  # a scalar: one block
            local.copy_(_draw(init, (), torch.Generator().manual_seed(_seed(seed, name, 0))))
            continue
        rows = box[0]
        # a stacked tensor (a MoE layer's experts [E, ...]): one generator per expert, so a rank
        # holding a few experts draws only theirs, not 64 whole experts each
        per = ROW_BLOCK if len(full) < 3 else 1
        first, last = rows.start // per, math.ceil(rows.stop / per)
        blocks = []
        for b in range(first, last):
            n = min(per, full[0] - b * per)
            gen = torch.Generator().manual_seed(_seed(seed, name, b))
            blocks.append(_draw(init, (n, *full[1:]), gen))
        drawn = torch.cat(blocks)[rows.start - first * per : rows.stop - first * per]
        cols = (slice(None), *box[1:])  # this rank's box in the other dims
        local.copy_(drawn[cols].to(local.dtype))
