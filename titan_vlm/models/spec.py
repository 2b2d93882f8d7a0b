"""The model-family boundary, in the spirit of torchtitan's TrainSpec.

A family (today: "llava", a vision tower + projector feeding a decoder) supplies everything the
trainer, the parallelisms and the checkpoint code need to know about its modules; they call
this interface and never reach into module names:

    args        the architecture, from a built-in flavor or a Hugging Face config.json (its
                validation: what the modules cannot express is a one-line ConfigError)
    build       the nn.Module (on whatever device is current: the trainer uses meta)
    init_rule   how each parameter starts when training from scratch (models/loading.py)
    after_to_empty  redo what `Module.to_empty` undoes: buffers (RoPE tables), tied weights
    hf_names / hf_unused / hf_same / hf_export_names
                the Hugging Face state-dict adapter, both directions (hf_same: file tensors the
                model holds once, e.g. a tied head, which must equal the one it loads)
    parallelize TP, activation checkpointing, compile and FSDP, applied from outside
    flops       model FLOPs of a batch

The next family (say Qwen2-VL) is a new module with its own `ModelSpec`, added to the one
registry, `models/registry.py`, which `model.name` chooses from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.data.batch import Batch
    from titan_vlm.models.loading import Init
    from titan_vlm.parallel_dims import Mesh


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args: Callable[[JobConfig], Any]
    build: Callable[[Any], nn.Module]
    init_rule: Callable[[Any, str, torch.Tensor], Init]
    after_to_empty: Callable[[nn.Module], None]
    hf_names: Callable[[Any, set[str], str], dict[str, str]]
    hf_unused: Callable[[Any, set[str]], dict[str, str]]
    hf_same: Callable[[Any, set[str]], list[tuple[str, str]]]
    hf_export_names: Callable[[Any], dict[str, str]]
    parallelize: Callable[[nn.Module, Mesh, JobConfig], None]
    flops: Callable[[Any, Batch], float]
