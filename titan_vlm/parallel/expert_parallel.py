"""Expert parallelism (EP): each of the ep ranks of a group holds E / ep of a mixture-of-experts
layer's experts, and every token's rows travel to the ranks of the experts it picked and back.

Who holds what (ep = 2, E = 4, each rank with its own tokens: another dp row set or CP share):

    rank 0: experts 0, 1    its rows for experts 2, 3 --all-to-all--> rank 1
    rank 1: experts 2, 3    its rows for experts 0, 1 --all-to-all--> rank 0

The group is the `ep` dim of the mesh (parallel_dims.py: consecutive ranks of dp_shard x cp,
which it borrows, as torchtitan does); the experts' weights are DTensors sharded along dim 0
over it (parallel/parallelize.py apply_ep), and FSDP shards them further over the rest of
dp_shard x cp (mesh.expert_fsdp), which sums their gradients over the groups that hold the same
experts.

One layer's forward on a rank (`titan_vlm::ep_experts`, a custom op with its backward
`titan_vlm::ep_experts_backward`, so a compiled block stays one graph):

    x [N, dim] rows grouped by expert (counts [E]: what this rank's tokens picked)
    1. the counts [ep, E/ep] go to their experts' ranks: recv [ep, E/ep], rows each source
       sends for each local expert
    2. the rows follow (all_to_all_single, source-major), regrouped by local expert
    3. the local experts' SwiGLUs (models/common/grouped.py, the one-process math)
    4. the outputs go back the way they came: y [N, dim] in x's order

The backward moves dy the same way, runs the local experts' backward, and sends dx back; each
local expert's weight gradient is complete for the tokens of its group. Dropless: nothing is
capped, so every degree computes what one process computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from titan_vlm.models.common.grouped import KERNELS, resolve


def _group(name: str) -> dist.ProcessGroup:
    """The process group of `name` (ProcessGroup.group_name: what a custom op can carry)."""
    return _resolve_process_group(name)  # type: ignore[arg-type]


def _exchange(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of x's rows: send[r] of them (in order) to rank r, recv[r] from rank r."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _by_expert(recv: torch.Tensor) -> torch.Tensor:
    """The order that regroups received rows, source-major (for each source rank its rows of each
    local expert, recv [ep, E/ep] of them), by local expert, then source."""
    ep, local = recv.shape
    flat = recv.flatten()
    starts = flat.cumsum(0) - flat  # each (source, expert) segment's first row
    perm = torch.arange(ep * local, device=recv.device).view(ep, local).t().flatten()
    sizes, firsts = flat[perm], starts[perm]
    total = int(flat.sum())
    shift = torch.repeat_interleave(firsts - (sizes.cumsum(0) - sizes), sizes, output_size=total)
    return shift + torch.arange(total, device=recv.device)


def _sizes(counts: torch.Tensor, recv: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows this rank sends to and receives from each rank of the group."""
    return counts.view(recv.shape).sum(1).tolist(), recv.sum(1).tolist()


@torch.library.custom_op("titan_vlm::ep_experts", mutates_args=())
def _ep_op(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, the received rows grouped by local expert, their gate and up projections, recv)."""
    pg = _group(group)
    recv = torch.empty(pg.size(), w1.shape[0], dtype=counts.dtype, device=counts.device)
    dist.all_to_all_single(recv, counts.view(recv.shape).contiguous(), group=pg)
    send_rows, recv_rows = _sizes(counts, recv)
    order = _by_expert(recv)
    grouped = _exchange(x, send_rows, recv_rows, pg)[order]
    out, gate, up = KERNELS[kernel][0](grouped, recv.sum(0).tolist(), w1, w3, w2)
    back = torch.empty_like(out)
    back[order] = out
    return _exchange(back, recv_rows, send_rows, pg), grouped, gate, up, recv


@_ep_op.register_fake
def _(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.library.get_ctx().new_dynamic_size()  # what the router sends here: data
    local, ffn = w1.shape[0], w1.shape[1]
    recv = counts.new_empty(counts.shape[0] // local, local)
    grouped = x.new_empty(rows, x.shape[1])
    gate, up = x.new_empty(rows, ffn), x.new_empty(rows, ffn)
    return x.new_empty(x.shape), grouped, gate, up, recv


@torch.library.custom_op("titan_vlm::ep_experts_backward", mutates_args=())
def _ep_backward_op(
    dy: torch.Tensor,
    grouped: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    recv: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dw1, dw3, dw2 (this rank's experts) of `_ep_op`."""
    pg = _group(group)
    send_rows, recv_rows = _sizes(counts, recv)
    order = _by_expert(recv)
    d_grouped = _exchange(dy, send_rows, recv_rows, pg)[order]
    dx, dw1, dw3, dw2 = KERNELS[kernel][1](
        d_grouped, grouped, recv.sum(0).tolist(), gate, up, w1, w3, w2
    )
    back = torch.empty_like(dx)
    back[order] = dx
    return _exchange(back, recv_rows, send_rows, pg), dw1, dw3, dw2


@_ep_backward_op.register_fake
def _(
    dy: torch.Tensor,
    grouped: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    recv: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        dy.new_empty(dy.shape),
        w1.new_empty(w1.shape),
        w3.new_empty(w3.shape),
        w2.new_empty(w2.shape),
    )


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _, counts, w1, w3, w2, group, kernel = inputs
    _, grouped, gate, up, recv = output
    ctx.save_for_backward(grouped, gate, up, recv, counts, w1, w3, w2)
    ctx.group, ctx.kernel = group, kernel


def _backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    grouped, gate, up, recv, counts, w1, w3, w2 = ctx.saved_tensors
    dx, dw1, dw3, dw2 = _ep_backward_op(
        dy, grouped, gate, up, recv, counts, w1, w3, w2, ctx.group, ctx.kernel
    )
    return dx, None, dw1, dw3, dw2, None, None


_ep_op.register_autograd(_backward, setup_context=_setup)


def ep_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group: str,
    kernel: str = "auto",
) -> torch.Tensor:
    """y [N, dim] of this rank's rows x [N, dim] grouped by expert (counts [E]), the experts
    spread over the ranks of process group `group` (its name), this rank's w1, w3, w2 [E / ep,
    ...] (module docstring), their matmuls by `kernel` (models/common/grouped.py
    KERNEL_NAMES)."""
    return _ep_op(x, counts, w1, w3, w2, group, resolve(kernel, x.device))[0]
