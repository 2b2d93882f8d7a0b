"""Parameter and model-state accounting (works on meta-device models, so a 7B flavor costs
nothing). A family's FLOPs are its own (ModelSpec.flops, e.g. llava/flops.py)."""

from __future__ import annotations

import torch.nn as nn


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters of each of the model's top-level modules (a family's parts: LLaVA's vision,
    projector and decoder; Qwen2.5-VL's vision and decoder), in their order."""
    return {name: count_params(child) for name, child in model.named_children()}


# fp32 parameter + fp32 gradient + AdamW's two fp32 moments
STATE_BYTES_PER_PARAM = 16


def state_bytes_per_rank(counts: dict[str, int], decoder_shards: int, vision_shards: int) -> float:
    """Bytes of parameters, gradients and optimizer state one rank holds under FSDP, where the
    decoder is sharded `decoder_shards` ways and the vision tower + projector `vision_shards` ways
    (activations and communication buffers not included)."""
    vision = counts["vision"] + counts["projector"]
    return STATE_BYTES_PER_PARAM * (counts["decoder"] / decoder_shards + vision / vision_shards)
