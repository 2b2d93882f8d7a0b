"""The one attention entry point of titan_vlm.

Model code calls `attention(q, k, v, layout)` and knows nothing about parallelism. The
`SeqLayout` it passes along was built outside the model (by the data pipeline or by
`parallel/context_parallel.py`) and says where each local token sits in its row; when the row's
text is sharded over a context-parallel group, `layout.cp` carries the algorithm that makes the
attention exact across ranks (parallel/cp_attention.py).

Mask rule (decoder, layout.py): a query sees the keys of its own sample at earlier row
positions (and itself); the tokens of one image see each other causally or, with
model.image_attention = "bidirectional", all at once.

Every attention, local or context-parallel, runs *plans*: the dense and causal blocks of one
query set against one key set (layout.plan), packed into variable-length sequences
(varlen.pack) and run whole by a varlen kernel (kernels.py): one FlashAttention varlen launch per
plan and causality on CUDA, a loop over the sequences on CPU. Plans merge by log-sum-exp
(varlen.merge) where one query set meets several key sets (ring steps). The ViT's attention
(layout None) is one dense block.
"""

from __future__ import annotations

from typing import Protocol

import torch

from titan_vlm.kernels import (  # noqa: F401 - re-exported: the kernel registry lives here too
    KERNELS,
    expand_kv_heads,
    reduce_kv_heads,
    select_kernel,
    select_varlen,
    use_kernel,
)
from titan_vlm.layout import Block, SeqLayout
from titan_vlm.varlen import PackedPlan, pack, run_plan, run_plan_backward


class CPAttention(Protocol):
    """A context-parallel attention algorithm (see parallel/cp_attention.py)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor: ...


def float_grads(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 gradient accumulators shaped as the tensors."""
    return tuple(torch.zeros_like(t, dtype=torch.float32) for t in tensors)


class _PlannedAttention(torch.autograd.Function):
    """Attention of q over k/v as one packed plan (no merge: each query is in one sequence)."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        kernel = select_varlen(q.device, q.dtype)
        out, lse, auxes = run_plan(kernel, q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (kernel, plan, auxes)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        kernel, plan, auxes = ctx.meta
        dq, dk, dv = float_grads(q, k, v)
        run_plan_backward(kernel, dout, q, k, v, out, lse, plan, auxes, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def planned_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PackedPlan | list[Block]
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] under a plan: packed (SeqLayout.packed), or a block
    list, packed here in local slot order."""
    if not isinstance(plan, PackedPlan):
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        plan = pack(plan, torch.arange(lq).expand(b, lq), torch.arange(lk).expand(b, lk))
    return _PlannedAttention.apply(q, k, v, plan)


class _BlockAttention(torch.autograd.Function):
    """One dense block straight through the block kernel (the ViT's attention)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = select_kernel(q.device, q.dtype)
        h, scale = q.shape[1], q.shape[-1] ** -0.5
        out, lse, aux = kernel.forward(
            q, expand_kv_heads(k, h), expand_kv_heads(v, h), False, scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (kernel, aux)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        kernel, aux = ctx.meta
        h, scale = q.shape[1], q.shape[-1] ** -0.5
        dq, dk, dv = kernel.backward(
            dout.contiguous(),
            q,
            expand_kv_heads(k, h),
            expand_kv_heads(v, h),
            out,
            lse,
            False,
            scale,
            aux,
        )
        return dq, reduce_kv_heads(dk, k.shape[1]), reduce_kv_heads(dv, v.shape[1])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention where every query sees every key (one dense block)."""
    return _BlockAttention.apply(q, k, v)


@torch.compiler.disable  # the plan is Python data that changes with every batch
def _decoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    if layout.cp is not None:
        return layout.cp(q, k, v, layout)
    return planned_attention(q, k, v, layout.packed("local", "local"))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None
) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local slots. layout=None: bidirectional (ViT).
    Otherwise the decoder's mask rule (layout.py) over the layout's local slots, exact across the
    CP group when the text is sharded (layout.cp)."""
    if layout is None:
        return block_attention(q, k, v)
    return _decoder_attention(q, k, v, layout)
