"""The experts' SwiGLUs on rows grouped by expert, and the custom op pair (forward, backward)
that hides them from torch.compile, the way the decoder's attention is one op (attention.py):
how many rows each expert gets is data (the router's choice), which torch.compile cannot trace a
split by; behind the op a compiled block stays one graph (the fake implementations' shapes come
from the arguments alone).

`swiglu_forward` / `swiglu_backward` are the math, shared with expert parallelism
(parallel/expert_parallel.py, which runs them on the rows its all-to-all brings): one matmul per
expert on its rows, on any device and dtype. The forward keeps the gate and up projections,
which the backward reads instead of recomputing them.

    x [N, dim] (rows of expert 0, then 1, ...; sizes[e] each)
    gate = x_e @ w1[e].T, up = x_e @ w3[e].T   [N, ffn]
    y = (silu(gate) * up) @ w2[e].T            [N, dim]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def swiglu_forward(
    x: torch.Tensor, sizes: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, gate, up) of x's rows, sizes[e] of them through expert e (module docstring)."""
    ys, gates, ups = [], [], []
    for e, rows in enumerate(x.split(sizes)):
        gate, up = rows @ w1[e].t(), rows @ w3[e].t()
        ys.append((F.silu(gate) * up) @ w2[e].t())
        gates.append(gate)
        ups.append(up)
    return torch.cat(ys), torch.cat(gates), torch.cat(ups)


def swiglu_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    sizes: list[int],
    gate: torch.Tensor,
    up: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dw1, dw3, dw2 of `swiglu_forward` given dy [N, dim]."""
    dx, dw1, dw3, dw2 = [], torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
    parts = zip(x.split(sizes), dy.split(sizes), gate.split(sizes), up.split(sizes))
    for e, (xe, dye, ge, ue) in enumerate(parts):
        act = F.silu(ge)  # as the forward computed it, so a 16-bit run rounds the same
        dw2[e] = dye.t() @ (act * ue)
        dh = dye @ w2[e]  # [n, ffn]
        dup = dh * act
        dgate = torch.ops.aten.silu_backward(dh * ue, ge)  # autograd's own silu' (fp32 inside)
        dw1[e] = dgate.t() @ xe
        dw3[e] = dup.t() @ xe
        dx.append(dgate @ w1[e] + dup @ w3[e])
    return torch.cat(dx), dw1, dw3, dw2


@torch.library.custom_op("titan_vlm::experts", mutates_args=())
def _experts_op(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_forward` with the sizes as a tensor, counts [E]."""
    return swiglu_forward(x, counts.tolist(), w1, w3, w2)


@_experts_op.register_fake
def _(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, ffn = x.shape[0], w1.shape[1]
    return x.new_empty(x.shape), x.new_empty(n, ffn), x.new_empty(n, ffn)


@torch.library.custom_op("titan_vlm::experts_backward", mutates_args=())
def _experts_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_backward` with the sizes as a tensor."""
    return swiglu_backward(dy, x, counts.tolist(), gate, up, w1, w3, w2)


@_experts_backward_op.register_fake
def _(
    dy: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        x.new_empty(x.shape),
        w1.new_empty(w1.shape),
        w3.new_empty(w3.shape),
        w2.new_empty(w2.shape),
    )


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, counts, w1, w3, w2 = inputs
    _, gate, up = output
    ctx.save_for_backward(x, counts, gate, up, w1, w3, w2)


def _backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    x, counts, gate, up, w1, w3, w2 = ctx.saved_tensors
    dx, dw1, dw3, dw2 = _experts_backward_op(dy, x, counts, gate, up, w1, w3, w2)
    return dx, None, dw1, dw3, dw2


_experts_op.register_autograd(_backward, setup_context=_setup)


def experts(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """y [N, dim] of x [N, dim], its rows grouped by expert (counts [E] each): the op's output."""
    return _experts_op(x, counts, w1, w3, w2)[0]
