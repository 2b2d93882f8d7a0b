"""The activation functions of the supported Hugging Face families, by their config names
(transformers' ACT2FN): the same formulas, so that the numbers match."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's approximation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def gelu_pytorch_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_pytorch_tanh,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}

# The activations by their Hugging Face names (`hidden_act`, `projector_hidden_act`).
ACTIVATIONS = tuple(ACT_FNS)
