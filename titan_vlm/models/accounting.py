"""Parameter and model-state accounting (works on meta-device models, so a 7B flavor costs
nothing). A family's FLOPs are its own (ModelSpec.flops, e.g. llava/flops.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_vlm.models.common.grouped import resolve
from titan_vlm.models.common.moe import MoE


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def active_params(model: nn.Module) -> int:
    """Parameters one token's forward uses: all of them but, in each mixture-of-experts layer,
    the experts it is not routed to (E - top_k of E)."""
    inactive = 0
    for m in model.modules():
        if isinstance(m, MoE):
            e, k = m.args.num_experts, m.args.top_k
            inactive += count_params(m.experts) * (e - k) // e
    return count_params(model) - inactive


def moe_summary(model: nn.Module, device: torch.device) -> str:
    """One line on the model's mixture-of-experts layers, their experts' matmuls on `device`
    ("": none)."""
    layers = [m.args for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return ""
    m = layers[0]
    return (
        f"{len(layers)} mixture-of-experts layers: {m.num_experts} experts of width {m.ffn_dim}, "
        f"top {m.top_k}{' renormalised' if m.norm_topk_prob else ''}, dropless, their matmuls by "
        f"{resolve(m.kernel, device)} (model.experts_kernel={m.kernel}); router load-balancing "
        f"loss weight {m.aux_loss_coef:g} (training.moe_aux_loss_coef)"
    )


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
