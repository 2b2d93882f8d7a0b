"""The experts' SwiGLUs on rows grouped by expert, and the custom op pair (forward, backward)
that hides them from torch.compile, the way the decoder's attention is one op (attention.py):
how many rows each expert gets is data (the router's choice), which torch.compile cannot trace a
split by; behind the op a compiled block stays one graph (the fake implementations' shapes come
from the arguments alone).

The math, shared with expert parallelism (parallel/expert_parallel.py, which runs it on the rows
its all-to-all brings), comes in two kernels of one interface, the registry `KERNELS`
(model.experts_kernel picks one; "auto", the default, picks by the rows' device: `resolve`):

    "loop"        `swiglu_forward` / `swiglu_backward`: one matmul per expert on its rows, on any
                  device and dtype
    "grouped_mm"  `grouped_forward` / `grouped_backward`: torch._grouped_mm, one call for all
                  the experts per projection (forward: x @ W^T and the down projection;
                  backward: dy @ W, and dy^T @ x with the groups along the reduced dim for the
                  weights' gradients); checked equal to "loop" on the CPU
                  (tests/unit/test_moe.py); on CUDA its bf16 kernel is the grouped GEMM of
                  H100-class GPUs (fp32 there: torch's loop over the groups in C++)

The forward keeps the gate and up projections, which the backward reads instead of recomputing
them.

    x [N, dim] (rows of expert 0, then 1, ...; sizes[e] each)
    gate = x_e @ w1[e].T, up = x_e @ w3[e].T   [N, ffn]
    y = (silu(gate) * up) @ w2[e].T            [N, dim]
"""

from __future__ import annotations

from collections.abc import Callable
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


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """torch._grouped_mm's offs: where each group ends, int32."""
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def grouped_forward(
    x: torch.Tensor, sizes: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_forward` by torch._grouped_mm: each projection one call over all the experts."""
    offs = _offsets(sizes, x.device)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs), gate, up


def grouped_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    sizes: list[int],
    gate: torch.Tensor,
    up: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_backward` by torch._grouped_mm: the inputs' gradient dy @ W per group, the
    weights' dy_e^T @ x_e (the groups along the reduced dim; an expert without rows gets 0).
    CUDA's bf16 kernel needs no alignment of the groups for the weights' products when their
    left operand is a transposed row-major tensor (dy.t()) and the right one row-major, so dy is
    made row-major (a no-op for autograd's usual contiguous gradient)."""
    dy = dy.contiguous()
    offs = _offsets(sizes, x.device)
    act = F.silu(gate)  # as the forward computed it
    dw2 = torch._grouped_mm(dy.t(), act * up, offs=offs)
    dh = torch._grouped_mm(dy, w2, offs=offs)  # [N, ffn]
    dup = dh * act
    dgate = torch.ops.aten.silu_backward(dh * up, gate)
    dw1 = torch._grouped_mm(dgate.t(), x, offs=offs)
    dw3 = torch._grouped_mm(dup.t(), x, offs=offs)
    dx = torch._grouped_mm(dgate, w1, offs=offs) + torch._grouped_mm(dup, w3, offs=offs)
    return dx, dw1, dw3, dw2


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
# the experts' kernels (module docstring): name -> (forward, backward)
KERNELS: dict[str, tuple[Forward, Backward]] = {
    "loop": (swiglu_forward, swiglu_backward),
    "grouped_mm": (grouped_forward, grouped_backward),
}


# model.experts_kernel: "auto" (chosen by device) or a kernel by name
KERNEL_NAMES: tuple[str, ...] = ("auto", *KERNELS)


def resolve(name: str, device: torch.device) -> str:
    """The kernel `name` (model.experts_kernel) means for rows on `device`. "auto": grouped_mm on
    CUDA (forward + backward 4.7x to 11x the loop's speed on an H200 in bf16, and faster in fp32
    too: docs/performance.md), the loop elsewhere (the CPU's grouped_mm is no faster)."""
    if name != "auto":
        return name
    return "grouped_mm" if device.type == "cuda" else "loop"


@torch.library.custom_op("titan_vlm::experts", mutates_args=())
def _experts_op(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `kernel`'s forward with the sizes as a tensor, counts [E]."""
    return KERNELS[kernel][0](x, counts.tolist(), w1, w3, w2)


@_experts_op.register_fake
def _(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    kernel: str,
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
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `kernel`'s backward with the sizes as a tensor."""
    return KERNELS[kernel][1](dy, x, counts.tolist(), gate, up, w1, w3, w2)


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
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        x.new_empty(x.shape),
        w1.new_empty(w1.shape),
        w3.new_empty(w3.shape),
        w2.new_empty(w2.shape),
    )


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, counts, w1, w3, w2, kernel = inputs
    _, gate, up = output
    ctx.save_for_backward(x, counts, gate, up, w1, w3, w2)
    ctx.kernel = kernel


def _backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    x, counts, gate, up, w1, w3, w2 = ctx.saved_tensors
    dx, dw1, dw3, dw2 = _experts_backward_op(dy, x, counts, gate, up, w1, w3, w2, ctx.kernel)
    return dx, None, dw1, dw3, dw2, None


_experts_op.register_autograd(_backward, setup_context=_setup)


def experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    kernel: str = "auto",
) -> torch.Tensor:
    """y [N, dim] of x [N, dim], its rows grouped by expert (counts [E] each), by `kernel`
    (KERNEL_NAMES): the op's output."""
    return _experts_op(x, counts, w1, w3, w2, resolve(kernel, x.device))[0]
