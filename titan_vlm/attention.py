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
from titan_vlm.layout import Block, LayoutHandle, SeqLayout
from titan_vlm.parallel.cp_attention import ALGORITHMS, LocalAttention
from titan_vlm.varlen import PackedPlan, float_grads, pack, run_plan, run_plan_backward


class CPAttention(Protocol):
    """A context-parallel attention algorithm (see parallel/cp_attention.py)."""

    comm: str


# ----------------------------------------------------------------------------------------------
# The decoder's attention as one custom op: torch.compile sees an opaque op with a fake
# implementation (shapes from its tensor arguments alone) and a registered autograd formula,
# so a compiled decoder block is one graph. The layout travels as an opaque reference object
# (LayoutHandle); `images` [B, N] and `texts` (every CP rank's [B, T]) are the layout's slot
# metadata, passed so that the fake implementation knows N, P and T symbolically.


@torch.library.custom_op("titan_vlm::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    images: torch.Tensor,
    texts: list[torch.Tensor],
    comm: str,
    handle: LayoutHandle,
) -> list[torch.Tensor]:
    """[out, aux token, *saved] of ALGORITHMS[comm] (cp_attention.Algorithm)."""
    layout = handle.layout
    algorithm = layout.cp if layout.cp is not None else LocalAttention()
    out, saved, aux = algorithm.forward(q, k, v, layout)
    # the memory layouts the fake promises: out [B, L, H, D] in memory, the rest contiguous
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return [out, handle.keep(aux), *(s.contiguous() for s in saved)]


@_attention_op.register_fake
def _(q, k, v, images, texts, comm, handle):
    b, h, length, d = q.shape
    out = q.new_empty(b, length, h, d).transpose(1, 2)
    saved = ALGORITHMS[comm].saved_like(q, k, images.shape[1], texts)
    return [out, torch.empty((), dtype=torch.long), *saved]


@torch.library.custom_op("titan_vlm::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    outputs: list[torch.Tensor],
    comm: str,
    handle: LayoutHandle,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = handle.layout
    algorithm = layout.cp if layout.cp is not None else LocalAttention()
    out, token, *saved = outputs
    aux = handle.take(token)
    grads = algorithm.backward(dout.contiguous(), q, k, v, out, saved, layout, aux)
    # each gradient in its input's memory layout, as the fake promises
    return tuple(
        g if g.stride() == x.stride() else torch.empty_like(x).copy_(g)
        for g, x in zip(grads, (q, k, v))
    )


@_attention_backward_op.register_fake
def _(dout, q, k, v, outputs, comm, handle):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, _, texts, comm, handle = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.comm, ctx.handle, ctx.texts = comm, handle, len(texts)


def _backward(ctx, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    q, k, v, *outputs = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grads[0], q, k, v, outputs, ctx.comm, ctx.handle)
    return dq, dk, dv, None, [None] * ctx.texts, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _PlannedAttention(torch.autograd.Function):
    """Attention of q over k/v under one explicit packed plan (checks and benchmarks; the model
    goes through the op above)."""

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
        run_plan_backward(kernel, dout.contiguous(), q, k, v, out, lse, plan, auxes, dq, dk, dv)
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


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None
) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local slots. layout=None: bidirectional (ViT).
    Otherwise the decoder's mask rule (layout.py) over the layout's local slots, exact across the
    CP group when the text is sharded (layout.cp)."""
    if layout is None:
        return block_attention(q, k, v)
    texts = [t.order for t in layout.texts]
    return _attention_op(q, k, v, layout.images.order, texts, layout.comm, layout.handle)[0]
